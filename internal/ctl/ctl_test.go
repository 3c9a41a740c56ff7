package ctl

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
)

func TestClassifyAndExitCodes(t *testing.T) {
	cases := []struct {
		err  error
		code Code
		exit int
	}{
		{nil, "", 0},
		{Errorf(CodeBusy, "x"), CodeBusy, 5},
		{fmt.Errorf("wrapped: %w", syscall.ENOENT), CodeNotFound, 3},
		{syscall.EEXIST, CodeExists, 4},
		{syscall.EINVAL, CodeInvalid, 2},
		{syscall.EPERM, CodePermission, 7},
		{syscall.ENOTCONN, CodeUnavailable, 6},
		{fmt.Errorf("open: %w", context.DeadlineExceeded), CodeUnavailable, 6},
		{syscall.EOPNOTSUPP, CodeNotSupported, 8},
		{errors.New("surprise"), CodeInternal, 1},
	}
	for _, c := range cases {
		if c.err != nil && Classify(c.err) != c.code {
			t.Errorf("Classify(%v) = %s, want %s", c.err, Classify(c.err), c.code)
		}
		if got := ExitCode(c.err); got != c.exit {
			t.Errorf("ExitCode(%v) = %d, want %d", c.err, got, c.exit)
		}
	}
}

// A request crosses the socket with its body; an error comes back with
// its class; the socket is the owner's only.
func TestServerAndClient(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "run", "d.sock")
	s, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	type echo struct {
		Name string `json:"name"`
	}
	s.Handle("POST /v1/echo", func(r *http.Request) (any, error) {
		var e echo
		if err := Decode(r, &e); err != nil {
			return nil, err
		}
		return e, nil
	})
	s.Handle("GET /v1/busy", func(r *http.Request) (any, error) { return nil, fmt.Errorf("in use: %w", syscall.EBUSY) })
	served := make(chan error, 1)
	go func() { served <- s.Serve() }()
	defer func() {
		s.Close()
		<-served
	}()
	st, err := os.Stat(sock)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode %v (%v), want 0600", st.Mode(), err)
	}
	c := Dial(sock)
	ctx := context.Background()
	var out echo
	if err := c.Do(ctx, "POST", "/v1/echo", echo{Name: "d0"}, &out); err != nil || out.Name != "d0" {
		t.Fatalf("echo: %+v %v", out, err)
	}
	err = c.Do(ctx, "GET", "/v1/busy", nil, nil)
	if Classify(err) != CodeBusy || err.Error() != "in use: device or resource busy" {
		t.Fatalf("busy: %v (%s)", err, Classify(err))
	}
	if err := c.Do(ctx, "POST", "/v1/echo", map[string]int{"bogus": 1}, nil); Classify(err) != CodeInvalid {
		t.Fatalf("unknown field: %v", err)
	}
	if err := c.Do(ctx, "GET", "/v1/nothing", nil, nil); err == nil {
		t.Fatal("an unknown endpoint answered")
	}
	// A second daemon on the same socket is refused while the first lives.
	if _, err := Listen(sock); !errors.Is(err, syscall.EADDRINUSE) {
		t.Fatalf("second Listen: %v, want EADDRINUSE", err)
	}
}

func TestDaemonNotRunning(t *testing.T) {
	dir := t.TempDir()
	err := Dial(filepath.Join(dir, "none.sock")).Do(context.Background(), "GET", "/v1/x", nil, nil)
	if Classify(err) != CodeUnavailable || ExitCode(err) != 6 {
		t.Fatalf("no daemon: %v", err)
	}
	// A stale socket of a dead daemon is replaced by the next one.
	sock := filepath.Join(dir, "stale.sock")
	s, err := Listen(sock)
	if err != nil {
		t.Fatal(err)
	}
	s.l.Close() // dies without removing the file
	if _, err := os.Stat(sock); err != nil {
		t.Skip("the listener removed its socket; nothing stale to test")
	}
	s2, err := Listen(sock)
	if err != nil {
		t.Fatalf("Listen over a stale socket: %v", err)
	}
	s2.Close()
}

// Whatever is at the socket's path and is not a socket stays, and Listen
// says why it cannot start.
func TestListenKeepsWhatIsNoSocket(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "file")
	if err := os.WriteFile(file, []byte("precious"), 0o644); err != nil {
		t.Fatal(err)
	}
	sub := filepath.Join(dir, "dir")
	os.Mkdir(sub, 0o755)
	link := filepath.Join(dir, "link")
	os.Symlink(file, link)
	for _, p := range []string{file, sub, link} {
		if _, err := Listen(p); !errors.Is(err, syscall.EEXIST) || !strings.Contains(err.Error(), "not a socket") {
			t.Errorf("Listen on %s: %v, want EEXIST", p, err)
		}
	}
	if b, err := os.ReadFile(file); err != nil || string(b) != "precious" {
		t.Fatalf("the file at the path: %q %v", b, err)
	}
	if _, err := os.Stat(sub); err != nil {
		t.Fatalf("the directory at the path: %v", err)
	}
}

// TestLookup: the exact name first, else the names written another way;
// none lists the names there are; One says why several are not one.
func TestLookup(t *testing.T) {
	type obj struct{ sess, name string }
	all := []obj{{"s1", "ip:a@ip:b"}, {"s2", "ip:a@ip:b"}, {"s1", "ip:c@ip:d"}}
	nameOf := func(o obj) string { return o.name }
	sessOf := func(o obj) string { return o.sess }
	near := func(typed string) func(obj) bool {
		return func(o obj) bool { return strings.Contains(o.name, typed) }
	}
	if got, err := Lookup("path", "ip:a@ip:b", all, nameOf, near("ip:a@ip:b")); err != nil || len(got) != 2 {
		t.Fatalf("exact: %v %v", got, err)
	}
	if _, err := One("path", "ip:a@ip:b", all[:2], nameOf, sessOf); err == nil || !strings.Contains(err.Error(), "exists in 2 sessions (s1, s2), name the session") {
		t.Errorf("a name in two sessions: %v", err)
	}
	got, err := Lookup("path", "c", all, nameOf, near("c"))
	if one, err2 := One("path", "c", got, nameOf, sessOf); err != nil || err2 != nil || one != all[2] {
		t.Errorf("near: %v %v %v", one, err, err2)
	}
	got, _ = Lookup("path", "ip:", all, nameOf, near("ip:"))
	if _, err := One("path", "ip:", got, nameOf, sessOf); ExitCode(err) != 2 || !strings.Contains(err.Error(), "ip: names 3 paths (ip:a@ip:b, ip:c@ip:d)") {
		t.Errorf("several near: %v", err)
	}
	if _, err := Lookup("path", "x", all, nameOf, near("x")); ExitCode(err) != 3 || err.Error() != "no path x (paths: ip:a@ip:b, ip:c@ip:d)" {
		t.Errorf("none: %v", err)
	}
	if _, err := Lookup("path", "x", nil, nameOf, near("x")); ExitCode(err) != 3 || err.Error() != "no path x (there are none)" {
		t.Errorf("none of none: %v", err)
	}
}

// TestExitCodesDocumented: docs/control-api.md's table of classes says
// the exit codes the command lines use, and each has a meaning for the
// man pages' EXIT STATUS.
func TestExitCodesDocumented(t *testing.T) {
	b, err := os.ReadFile("../../docs/control-api.md")
	if err != nil {
		t.Fatal(err)
	}
	row := regexp.MustCompile("(?m)^\\| `([a-z_]+)` \\| (\\d+) \\| (\\d+) \\|")
	docs := map[Code]string{}
	for _, m := range row.FindAllStringSubmatch(string(b), -1) {
		docs[Code(m[1])] = m[3]
	}
	st := ExitStatuses()
	if len(st) != len(exitCodes) || len(docs) != len(exitCodes) {
		t.Fatalf("%d classes, %d exit statuses, %d in the docs", len(exitCodes), len(st), len(docs))
	}
	for i, s := range st {
		if docs[s.Class] != strconv.Itoa(s.Exit) || s.Meaning == "" || (i > 0 && st[i-1].Exit >= s.Exit) {
			t.Errorf("%s: exit %d (docs: %s), meaning %q", s.Class, s.Exit, docs[s.Class], s.Meaning)
		}
	}
}
