package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

var binDir string

// TestMain builds the binaries once for every test of the package (or
// takes them from RNBD_E2E_BIN), or runs the helper a test started the
// test binary as.
func TestMain(m *testing.M) {
	if kind := os.Getenv(helperEnv); kind != "" {
		os.Exit(runHelper(kind)) // a process a test started (churn_test.go)
	}
	if dir := os.Getenv("RNBD_E2E_BIN"); dir != "" {
		// Binaries built already, where no Go toolchain is (the VM
		// tier's guest: /bin).
		binDir = dir
		os.Exit(m.Run())
	}
	dir, err := os.MkdirTemp("", "rnbd-e2e-bin-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	binDir = dir
	root, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		fmt.Fprintln(os.Stderr, "go env GOMOD:", err)
		os.Exit(1)
	}
	// Stamped as the Makefile stamps them (TestVersion).
	repo := filepath.Dir(strings.TrimSpace(string(root)))
	stamp := exec.Command("scripts/version.sh")
	stamp.Dir = repo
	ldflags, err := stamp.Output()
	if err != nil {
		fmt.Fprintln(os.Stderr, "scripts/version.sh:", err)
		os.Exit(1)
	}
	build := exec.Command("go", "build", "-ldflags", strings.TrimSpace(string(ldflags)), "-o", dir+"/", "./cmd/...")
	build.Dir = repo
	if out, err := build.CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "building the binaries: %v\n%s", err, out)
		os.Exit(1)
	}
	if os.Getenv("RNBD_E2E_TLS") == "1" {
		if err := makeSuitePKI(filepath.Join(dir, "pki"), filepath.Dir(strings.TrimSpace(string(root)))); err != nil {
			fmt.Fprintln(os.Stderr, "test CA:", err)
			os.Exit(1)
		}
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// suitePKI, with RNBD_E2E_TLS=1, is where scripts/test-ca.sh put the
// certificates the daemons of every test run with: the whole suite over
// TLS. Empty: plain TCP.
var suitePKI string

// makeSuitePKI makes a CA, a server certificate naming every address
// the tests serve on, and a client certificate.
func makeSuitePKI(pki, repo string) error {
	script := filepath.Join(repo, "scripts", "test-ca.sh")
	server := []string{"server", "srv", "127.0.0.1"}
	for net := 201; net <= 210; net++ {
		for sub := 1; sub <= 2; sub++ {
			server = append(server, fmt.Sprintf("10.%d.%d.1", net, sub))
		}
	}
	steps := [][]string{{"ca"}, server, {"client", "e2e-client"}}
	for _, id := range append(hostileIdentities, churnIdentity) {
		steps = append(steps, []string{"client", id})
	}
	for _, args := range steps {
		if out, err := exec.Command("bash", append([]string{script, pki}, args...)...).CombinedOutput(); err != nil {
			return fmt.Errorf("%v: %v\n%s", args, err, out)
		}
	}
	suitePKI = pki
	return nil
}

// tlsFlags are the daemon flags for the suite's TLS (none without it, or
// when a test's own args set TLS — "--tls-cert=" alone turns it off):
// who is "srv" or "e2e-client".
func tlsFlags(who string, own ...string) []string {
	for _, a := range own {
		if strings.HasPrefix(a, "--tls-") {
			return nil
		}
	}
	if suitePKI == "" {
		return nil
	}
	return []string{"--tls-cert", filepath.Join(suitePKI, who+".crt"), "--tls-key", filepath.Join(suitePKI, who+".key"),
		"--tls-ca", filepath.Join(suitePKI, "ca.crt")}
}

func bin(name string) string { return filepath.Join(binDir, name) }

// requireRoot skips unless the test can create network namespaces.
func requireRoot(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces and veth pairs (CI runs as root)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		t.Skip("needs ip from iproute2 (make deps installs it)")
	}
}

func sh(t *testing.T, args ...string) string {
	t.Helper()
	out, err := exec.Command(args[0], args[1:]...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return string(out)
}

// netns creates a namespace with loopback up and removes it at the end.
func netns(t *testing.T, name string) string {
	t.Helper()
	exec.Command("ip", "netns", "del", name).Run() // a leftover of a killed run
	sh(t, "ip", "netns", "add", name)
	t.Cleanup(func() { exec.Command("ip", "netns", "del", name).Run() })
	sh(t, "ip", "-n", name, "link", "set", "lo", "up")
	return name
}

// veth joins two namespaces with a pair of interfaces and addresses.
func veth(t *testing.T, nsA, ifA, addrA, nsB, ifB, addrB string) {
	t.Helper()
	sh(t, "ip", "link", "add", ifA, "netns", nsA, "type", "veth", "peer", "name", ifB, "netns", nsB)
	sh(t, "ip", "-n", nsA, "addr", "add", addrA, "dev", ifA)
	sh(t, "ip", "-n", nsB, "addr", "add", addrB, "dev", ifB)
	sh(t, "ip", "-n", nsA, "link", "set", ifA, "up")
	sh(t, "ip", "-n", nsB, "link", "set", ifB, "up")
}

// proc is a background process the test started.
type proc struct {
	cmd  *exec.Cmd
	out  lockedBuffer
	done chan error
}

func start(t *testing.T, args ...string) *proc {
	t.Helper()
	p := &proc{cmd: exec.Command(args[0], args[1:]...), done: make(chan error, 1)}
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.done <- p.cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-p.done:
		default:
			p.cmd.Process.Kill()
			<-p.done
		}
	})
	return p
}

// wait waits for the process to exit within d.
func (p *proc) wait(t *testing.T, d time.Duration) error {
	t.Helper()
	select {
	case err := <-p.done:
		p.done <- err
		return err
	case <-time.After(d):
		t.Fatalf("%s did not finish within %v\n%s", p.cmd.Path, d, p.out.String())
	}
	return nil
}

func waitFile(t *testing.T, path string, d time.Duration) {
	t.Helper()
	deadline := time.Now().Add(d)
	for {
		if b, err := os.ReadFile(path); err == nil && len(b) > 0 {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s did not appear within %v", path, d)
		}
		time.Sleep(20 * time.Millisecond)
	}
}
