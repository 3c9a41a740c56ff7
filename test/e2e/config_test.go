package e2e

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/testca"
)

// runCode runs a command to its end within timeout: its stdout, stderr
// and exit code.
func runCode(t *testing.T, timeout time.Duration, name string, args ...string) (string, string, int) {
	t.Helper()
	cmd := exec.Command(name, args...)
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		if errors.As(err, &ee) {
			return stdout.String(), stderr.String(), ee.ExitCode()
		} else if err != nil {
			t.Fatalf("%s %v: %v", name, args, err)
		}
		return stdout.String(), stderr.String(), 0
	case <-time.After(timeout):
		cmd.Process.Kill()
		<-done
		t.Fatalf("%s %s still runs after %v (it should have refused to start)\n%s%s", filepath.Base(name), strings.Join(args, " "),
			timeout, stdout.String(), stderr.String())
	}
	return "", "", -1
}

// tlsFiles writes a CA (ca.crt) and a certificate of each name
// (NAME.crt, NAME.key) into dir: the cert, key and ca lines of a [tls]
// table of the first.
func tlsFiles(t *testing.T, dir string, names ...string) string {
	t.Helper()
	ca := testca.New(t, "e2e-ca")
	caFile := ca.WriteCA(t, dir, "ca")
	var lines string
	for i, name := range names {
		cert, key := testca.WriteCert(t, ca.Issue(t, name, "127.0.0.1"), dir, name)
		if i == 0 {
			lines = fmt.Sprintf("cert = %q\nkey = %q\nca = %q\n", cert, key, caFile)
		}
	}
	return lines
}

// TestConfigTypoRefusesToStart: a daemon whose configuration has a key
// or table it does not know, or a [tls] that comes to nothing, does not
// start: it exits with 2 (invalid_argument) naming the file, the line
// and the nearest known key, and nothing listens — not on the port, not
// on the control socket. (Before, `[tsl]` started the server in
// plaintext and `lisen` on every interface, each with a warning.) The
// listen address is a loopback one, by flag, so that a server that did
// start would not listen elsewhere.
func TestConfigTypoRefusesToStart(t *testing.T) {
	dir := t.TempDir()
	tls := tlsFiles(t, dir, "srv")
	for _, c := range []struct {
		name, conf string
		flags      []string
		want       []string
	}{
		{"lisen", "lisen = [\"tcp://[::]:1234\"]\n", nil,
			[]string{`rnbd-server: config CONF:4: unknown key "lisen" (did you mean listen?)`}},
		{"[tsl]", "[tsl]\n" + tls, nil, []string{`rnbd-server: config CONF:4: unknown table [tsl] (did you mean [tls]?)`}},
		{"both", "lisen = []\n[tsl]\n" + tls, nil, []string{
			`rnbd-server: config CONF:4: unknown key "lisen" (did you mean listen?)`,
			`rnbd-server: config CONF:5: unknown table [tsl] (did you mean [tls]?)`}},
		{"[tls] without files", "[tls]\n", nil, []string{"rnbd-server: tls: the configuration has [tls] but sets none of cert, key and ca"}},
		{"[tls] emptied by flags", "[tls]\n" + tls, []string{"--tls-cert=", "--tls-key=", "--tls-ca="},
			[]string{"rnbd-server: tls: the configuration has [tls] but sets none of cert, key and ca"}},
		{"[tls] without its key by flag", "[tls]\n" + tls, []string{"--tls-key="},
			[]string{"rnbd-server: tls: cert, key and ca must be set together (key not set)"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			d := t.TempDir()
			conf := filepath.Join(d, "server.toml")
			sock := filepath.Join(d, "server.sock")
			// Three lines, then the case's from line 4.
			text := fmt.Sprintf("version = 1\ncontrol_socket = %q\nstate_file = %q\n", sock, filepath.Join(d, "state.json")) + c.conf
			if err := os.WriteFile(conf, []byte(text), 0o644); err != nil {
				t.Fatal(err)
			}
			port := freePort(t)
			args := append([]string{"daemon", "--config", conf, "--listen", fmt.Sprintf("tcp://127.0.0.1:%d", port)}, c.flags...)
			_, stderr, code := runCode(t, 10*time.Second, bin("rnbd-server"), args...)
			for _, w := range c.want {
				if w = strings.ReplaceAll(w, "CONF", conf); !strings.Contains("\n"+stderr, "\n"+w) {
					t.Errorf("stderr lacks %q:\n%s", w, stderr)
				}
			}
			if code != 2 {
				t.Errorf("exit %d, want 2 (invalid_argument)", code)
			}
			if _, err := os.Stat(sock); err == nil {
				t.Error("the control socket was made")
			}
			if c, err := net.Dial("tcp", fmt.Sprintf("127.0.0.1:%d", port)); err == nil {
				c.Close()
				t.Error("something listens on the port")
			}
		})
	}
	// The client the same.
	conf := filepath.Join(dir, "client.toml")
	os.WriteFile(conf, []byte("version = 1\nno_path_timout = \"1m\"\n"), 0o644)
	_, stderr, code := runCode(t, 10*time.Second, bin("rnbd-client"), "daemon", "--config", conf,
		"--control-socket", filepath.Join(dir, "client.sock"), "--state-file", filepath.Join(dir, "client.json"), "--socket-dir", dir)
	if want := fmt.Sprintf("rnbd-client: config %s:2: unknown key \"no_path_timout\" (did you mean no_path_timeout?)\n", conf); code != 2 || !strings.Contains(stderr, want) {
		t.Errorf("client: exit %d, stderr %q, want 2 and %q", code, stderr, want)
	}
}

// TestConfigCheck: `config check [FILE]` says whether the daemon would
// start with a file, starting nothing, with the exit codes of the
// control commands: 0 ok, 2 invalid (unknown keys by line, bad values,
// a [tls] without its files), 3 a file it names that does not exist.
// The packaged example configurations pass once their TLS files are
// there.
func TestConfigCheck(t *testing.T) {
	dir := t.TempDir()
	write := func(name, text string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	tlsDir := filepath.Join(dir, "tls")
	os.MkdirAll(tlsDir, 0o700)
	tlsFiles(t, tlsDir, "server", "client") // the names the examples give them
	example := func(name string) string {
		b, err := os.ReadFile("../../deploy/" + name)
		if err != nil {
			t.Fatal(err)
		}
		return write(name, strings.ReplaceAll(string(b), "/etc/rnbd/tls", tlsDir))
	}
	// The server's example as this host can run it: its storage
	// network's addresses made loopback, TCP only.
	local := func() string {
		b, err := os.ReadFile(example("server.toml"))
		if err != nil {
			t.Fatal(err)
		}
		text := regexp.MustCompile(`(?m)^listen = .*$`).ReplaceAllString(string(b), `listen = ["tcp://127.0.0.1:1234"]`)
		return write("local.toml", text)
	}
	// Every problem at once: addresses this host does not have (the
	// example's 10.10.0.5 and 10.11.0.5 once more, where a test may
	// add them: TEST-NET-3 then), and warnings beside.
	bad := "203.0.113.77"
	many := write("many.toml", fmt.Sprintf(`listen = ["tcp://%[1]s:1234", "tcp://127.0.0.1:1234"]
metrics_listen = "%[1]s:9724"
export_retry = "1ms"
[[pool]]
name = "p1"
type = "dir"
path = %[2]q
`, bad, filepath.Join(dir, "no-pool")))
	for _, c := range []struct {
		bin  string
		args []string
		code int
		out  string // on stdout with 0, stderr otherwise
	}{
		{"rnbd-server", []string{example("server.toml")}, 2, "listen tcp://10.10.0.5:1234: 10.10.0.5 is not an address of this host (its addresses: "},
		{"rnbd-server", []string{example("server.toml")}, 2, "listen tcp://10.11.0.5:1234: 10.11.0.5 is not an address of this host"},
		{"rnbd-server", []string{example("server.toml")}, 2, "listen rdma://10.10.0.5:1234: 10.10.0.5 is not an address of this host"},
		{"rnbd-server", []string{local()}, 0, "local.toml: ok\n"},
		{"rnbd-server", []string{many}, 2, "many.toml: export_retry 1ms: at least 100ms"},
		{"rnbd-server", []string{many}, 2, "many.toml: listen tcp://" + bad + ":1234: " + bad + " is not an address of this host"},
		{"rnbd-server", []string{many}, 2, "many.toml: metrics_listen " + bad + ":9724: " + bad + " is not an address of this host"},
		{"rnbd-server", []string{many}, 2, "many.toml: warning: [[pool]] p1: stat " + filepath.Join(dir, "no-pool") + ": no such file or directory: the daemon starts without this pool"},
		{"rnbd-client", []string{example("client.toml")}, 0, "client.toml: ok\n"},
		{"rnbd-server", []string{write("typo.toml", "version = 1\nmax_chunk_memroy = \"1GiB\"\n")}, 2,
			"typo.toml:2: unknown key \"max_chunk_memroy\" (did you mean max_chunk_memory?)\n"},
		{"rnbd-client", []string{write("ctypo.toml", "[tls]\ncert = \"/c\"\nkye = \"/k\"\n")}, 2,
			"ctypo.toml:3: unknown key \"kye\" in [tls] (did you mean key?)\n"},
		{"rnbd-server", []string{write("value.toml", "listen = [\"udp://1.2.3.4\"]\n")}, 2, "udp://1.2.3.4"},
		{"rnbd-server", []string{write("empty-tls.toml", "[tls]\n")}, 2, "sets none of cert, key and ca"},
		{"rnbd-server", []string{write("no-files.toml", "[tls]\ncert = \"/nonexistent/c\"\nkey = \"/nonexistent/k\"\nca = \"/nonexistent/ca\"\n")}, 3,
			"tls: ca: open /nonexistent/ca: no such file or directory\n"},
		{"rnbd-server", []string{filepath.Join(dir, "missing.toml")}, 3, "missing.toml: no such file or directory\n"},
		{"rnbd-server", []string{write("newer.toml", "version = 99\nnew_key = 1\n")}, 2, "version 99 is newer than this daemon understands (1)\n"},
	} {
		stdout, stderr, code := runCode(t, 10*time.Second, bin(c.bin), append([]string{"config", "check"}, c.args...)...)
		got := stderr
		if c.code == 0 {
			got = stdout
		}
		if code != c.code || !strings.Contains(got, c.out) {
			t.Errorf("%s config check %s: exit %d\n%s%s\nwant exit %d and %q", c.bin, strings.Join(c.args, " "), code, stdout, stderr, c.code, c.out)
		}
	}
}
