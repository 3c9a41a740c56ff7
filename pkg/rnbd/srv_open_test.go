package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/test/testfs"
)

func TestSessInfoVersion(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	c := r.client("v")
	for _, c2 := range []struct{ ask, want uint8 }{{1, 1}, {2, 2}, {9, 2}} {
		var usr [SessInfoSize]byte
		(&SessInfo{Ver: c2.ask}).Encode(usr[:], MsgSessInfo)
		if err := c.sess.Do(context.Background(), rtrs.AdminCon, rtrs.Read, usr[:], c.admin, 0, SessInfoRspSize); err != nil { // +checklocksignore: the test is the session's only admin sender
			t.Fatal(err)
		}
		var rsp SessInfo
		if err := rsp.Decode(c.admin.Bytes()[:SessInfoRspSize], MsgSessInfoRsp); err != nil || rsp.Ver != c2.want { // +checklocksignore: as above
			t.Fatalf("asked %d: got %d %v, want %d", c2.ask, rsp.Ver, err, c2.want)
		}
	}
}

func TestAccessModes(t *testing.T) {
	r := newSrig(t, SrvConfig{AllowMigration: true})
	r.file("shared", 1<<20)
	a, b, c := r.client("a"), r.client("b"), r.client("c")
	open := func(cl *CltSession, mode AccessMode) error {
		_, err := cl.open(context.Background(), "shared", mode)
		return err
	}
	if err := open(a, AccessRW); err != nil {
		t.Fatal(err)
	}
	// A writer too many is EBUSY, which the client explains as such.
	err := open(b, AccessRW)
	if !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "another session has the device open for writing: a second writer needs access_mode=migration") {
		t.Fatalf("second writer: %v, want EBUSY saying so", err)
	}
	if err := open(b, AccessRO); err != nil {
		t.Fatalf("reader beside a writer: %v", err)
	}
	if err := open(c, AccessMigration); err != nil {
		t.Fatalf("migration beside one writer: %v", err)
	}
	d := r.client("d")
	if err := open(d, AccessMigration); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("third writer: %v, want EBUSY", err)
	}
	if err := open(d, AccessRO); err != nil {
		t.Fatal(err)
	}
	// A read-only open refuses writes.
	ro := r.dev(d, "shared", AccessRO)
	if err := ro.write(0, make([]byte, 512), 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write on a read-only open: %v", err)
	}
	// Access mode 3 does not exist.
	if _, err := d.open(context.Background(), "other", 3); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("access mode 3: %v", err)
	}
	// When the writer's session goes away its devices close and the
	// device takes a writer again.
	a.Session().Close()
	kit.WaitFor(t, 10*time.Second, "a's device to close", func() bool { return len(r.srv.OpenDevices()) == 3 })
	if err := open(d, AccessRW); !errors.Is(err, syscall.EPERM) {
		// d has "shared" open read-only already: same name, same device.
		if err != nil {
			t.Fatalf("d reopening: %v", err)
		}
	}
	e := r.client("e")
	if err := open(e, AccessMigration); err != nil {
		t.Fatalf("second migration writer after a's exit: %v", err)
	}
}

func TestPathTraversal(t *testing.T) {
	root := t.TempDir()
	dir := filepath.Join(root, "exports")
	os.MkdirAll(dir, 0o755)
	os.WriteFile(filepath.Join(root, "secret"), make([]byte, 4096), 0o600)
	r := newSrig(t, SrvConfig{DevSearchPath: dir})
	os.Symlink(filepath.Join(root, "secret"), filepath.Join(dir, "link-out"))
	os.Symlink("../secret", filepath.Join(dir, "rel-out"))
	r.file("ok", 1<<20)
	c := r.client("t")
	for name, want := range map[string]syscall.Errno{
		"../secret":               syscall.EINVAL,
		"a/../../secret":          syscall.EINVAL,
		"..":                      syscall.EINVAL,
		"/etc/passwd":             syscall.ENOENT, // resolved beneath the search path, as the kernel does
		"link-out":                syscall.EINVAL,
		"rel-out":                 syscall.EINVAL,
		"missing":                 syscall.ENOENT,
		string(make([]byte, 254)): syscall.EINVAL,
	} {
		_, err := c.open(context.Background(), name, AccessRO)
		if !errors.Is(err, want) {
			t.Errorf("open %q: %v, want %v", name, err, want)
		}
	}
	if _, err := c.open(context.Background(), "ok", AccessRO); err != nil {
		t.Fatal(err)
	}
	if _, err := c.open(context.Background(), "/ok", AccessRO); err != nil {
		t.Fatalf("/ok: %v", err)
	}
}

func TestSessnameSearchPath(t *testing.T) {
	root := t.TempDir()
	r := newSrig(t, SrvConfig{DevSearchPath: filepath.Join(root, "%SESSNAME%", "ignored")})
	os.MkdirAll(filepath.Join(root, "alice"), 0o755)
	os.MkdirAll(filepath.Join(root, "bob"), 0o755)
	os.WriteFile(filepath.Join(root, "alice", "disk"), make([]byte, 1<<20), 0o600)
	os.WriteFile(filepath.Join(root, "bob", "disk"), make([]byte, 2<<20), 0o600)
	a := r.dev(r.client("alice"), "disk", AccessRW)
	b := r.dev(r.client("bob"), "disk", AccessRW)
	if a.d.Size() != 1<<20 || b.d.Size() != 2<<20 {
		t.Fatalf("each session sees its own directory: %d %d", a.d.Size(), b.d.Size())
	}
	// Nobody reaches another session's directory.
	if _, err := r.client("carol").open(context.Background(), "../alice/disk", AccessRO); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("carol into alice's directory: %v", err)
	}
	// Session names that would move the directory never get here: RTRS
	// refuses '/' and '.', and the resolver checks again.
	for _, bad := range []string{"..", "a/b", ".", ""} {
		if _, err := r.srv.searchDir(bad, "disk"); !errors.Is(err, syscall.EINVAL) {
			t.Errorf("session %q: %v", bad, err)
		}
	}
}

// TestCloseWaitsForIO: CLOSE returns only after the device's IO in flight
// has answered, and that IO succeeds.
func TestCloseWaitsForIO(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("slow", 1<<20)
	hold := make(chan struct{})
	var held atomic.Int32
	r.srv.beforeIO = func() {
		held.Add(1)
		<-hold
	}
	c := r.client("w")
	x := r.dev(c, "slow", AccessRW)
	var wg sync.WaitGroup
	errs := make([]error, 4)
	for i := range errs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = x.op(OpFlush, 0, 0, 0)
		}()
	}
	kit.WaitFor(t, 10*time.Second, "IO at the server", func() bool { return held.Load() == 4 })
	closed := make(chan error, 1)
	go func() { closed <- x.d.Unmap(context.Background()) }()
	select {
	case err := <-closed:
		t.Fatalf("close returned with IO in flight: %v", err)
	case <-time.After(100 * time.Millisecond):
	}
	close(hold)
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	wg.Wait()
	for i, err := range errs {
		if err != nil {
			t.Fatalf("IO %d in flight across close: %v", i, err)
		}
	}
}

// TestOpenOnHungMount: an OPEN whose backing file is on a mount that
// does not answer holds only itself: the session's IO on its other
// devices goes on — on the one worker too (a flush runs there) — and a
// second OPEN of the same name is refused (EBUSY) rather than stacked
// behind it.
func TestOpenOnHungMount(t *testing.T) {
	var mnt string
	r := newSrig(t, SrvConfig{Workers: 1, Stat: func(p string) (os.FileInfo, error) {
		if mnt != "" && strings.HasPrefix(p, mnt) {
			return nil, nil // exported while the mount answered
		}
		return os.Stat(p)
	}})
	r.file("vol1", 1<<20)
	c := r.client("c1")
	x := r.dev(c, "vol1", AccessRW)
	mnt = testfs.HungMount(t) // its cleanup, first, lets the open fail
	if err := r.srv.Map(Export{Name: "hung", Path: filepath.Join(mnt, "disk.img")}); err != nil {
		t.Fatal(err)
	}
	go c.open(context.Background(), "hung", AccessRW) // hangs until the cleanup
	opening := func() bool {
		for _, s := range r.srv.Sessions() {
			if !s.mu.TryLock() {
				continue // (held through the open, it would never be free)
			}
			o := s.opening["hung"] // +checklocksignore: held by the TryLock above
			s.mu.Unlock()          // +checklocksignore: as above
			if o {
				return true
			}
		}
		return false
	}
	for deadline := time.Now().Add(10 * time.Second); !opening(); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the open of the hung export never started")
		}
	}
	done := make(chan error, 1)
	go func() {
		want := bytes.Repeat([]byte("still served"), 4096/12+1)[:4096]
		err := x.write(0, want, 0)
		if err == nil {
			var got []byte
			if got, err = x.read(0, len(want)); err == nil && !bytes.Equal(got, want) {
				err = fmt.Errorf("read back %q", got[:12])
			}
		}
		if err == nil {
			err = x.op(OpFlush, 0, 0, 0)
		}
		done <- err
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("IO on another device of the session waits for the hung open")
	}
	// Our client sends one admin message at a time; another client
	// need not.
	var usr [OpenSize]byte
	(&Open{AccessMode: AccessRW, DevName: "hung"}).Encode(usr[:])
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := c.Session().Do(ctx, rtrs.IOCon, rtrs.Read, usr[:], x.buf, 0, OpenRspSize); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("a second open of the name being opened: %v, want EBUSY", err)
	}
}

// TestUnmapDuringOpen: an export withdrawn while a session's OPEN of it
// is under way (its backend opened, the device not yet the session's) is
// not left open behind the unmap: the OPEN fails with ENOENT, nothing
// stays open, and the export's max_sessions count is released.
func TestUnmapDuringOpen(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	p := r.file("exp/x", 1<<20)
	if err := r.srv.Map(Export{Name: "vol", Path: p, MaxSessions: 1}); err != nil {
		t.Fatal(err)
	}
	opened, release := make(chan struct{}), make(chan struct{})
	var once sync.Once
	r.srv.afterOpen = func() {
		once.Do(func() {
			close(opened)
			<-release
		})
	}
	c := r.client("s")
	res := make(chan error, 1)
	go func() {
		_, err := c.open(context.Background(), "vol", AccessRW)
		res <- err
	}()
	<-opened
	if err := r.srv.Unmap("vol", false); err != nil {
		t.Fatalf("unmap while an open is under way: %v", err)
	}
	close(release)
	if err := <-res; !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("the open of a withdrawn export: %v, want ENOENT", err)
	}
	if open := r.srv.OpenDevices(); len(open) != 0 {
		t.Fatalf("open after the unmap: %+v", open)
	}
	if err := r.srv.Map(Export{Name: "vol", Path: p, MaxSessions: 1}); err != nil {
		t.Fatal(err)
	}
	r.dev(c, "vol", AccessRW) // its one session's room was given back
}

// TestReopenLooksAtPath: an OPEN of a device the session has open (a
// remap, our client's size poll) asks the backend for its size only if
// the export's path answers (SrvConfig.Answers): where it does not
// (the daemon's bounded look gives ETIMEDOUT), the OPEN fails with that
// at once instead of waiting on the mount. A path that is gone is no reason
// to fail: the file renamed or removed is still the device's.
func TestReopenLooksAtPath(t *testing.T) {
	var hung atomic.Bool
	r := newSrig(t, SrvConfig{Answers: func(p string) error {
		if hung.Load() {
			return &os.PathError{Op: "stat", Path: p, Err: syscall.ETIMEDOUT}
		}
		_, err := os.Stat(p)
		return err
	}})
	p := r.file("exp/vol", 1<<20)
	for name, path := range map[string]string{"vol": p, "vol2": r.file("exp/vol2", 1<<20)} {
		if err := r.srv.Map(Export{Name: name, Path: path}); err != nil {
			t.Fatal(err)
		}
	}
	c := r.client("c1")
	r.dev(c, "vol", AccessRW)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := os.Truncate(p, 2<<20); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(p, p+".moved"); err != nil {
		t.Fatal(err)
	}
	rsp, err := c.open(ctx, "vol", AccessRW)
	if err != nil || rsp.NSectors != (2<<20)/512 {
		t.Fatalf("reopen with the file moved away: %v, %d sectors, want the grown size %d", err, rsp.NSectors, (2<<20)/512)
	}
	hung.Store(true)
	if _, err := c.open(ctx, "vol", AccessRW); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("reopen with the path not answering: %v, want ETIMEDOUT", err)
	}
	// A first OPEN is refused the same way, and leaves nothing behind.
	if _, err := c.open(ctx, "vol2", AccessRW); !errors.Is(err, syscall.ETIMEDOUT) {
		t.Fatalf("open with the path not answering: %v, want ETIMEDOUT", err)
	}
	hung.Store(false)
	if _, err := c.open(ctx, "vol", AccessRW); err != nil {
		t.Fatalf("reopen once the path answers: %v", err)
	}
	if _, err := c.open(ctx, "vol2", AccessRW); err != nil {
		t.Fatalf("open once the path answers: %v", err)
	}
}

// TestWriterWhileReaderCloses: a writer's OPEN racing the close of the
// device's only other session (a reader) never leaves the device without
// its writer: a second writer is refused every time. The writer used to
// join the device only after the server's lock was released, and the
// reader's close could drop the device in between, so that the next
// writer found none and was let in.
func TestWriterWhileReaderCloses(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("vol", 1<<20)
	ra, w, w2 := r.client("reader"), r.client("writer"), r.client("second")
	ctx := context.Background()
	for i := 0; i < 200; i++ {
		rd, err := ra.Map(ctx, "vol", AccessRO)
		if err != nil {
			t.Fatal(err)
		}
		closed := make(chan error, 1)
		go func() { closed <- rd.Unmap(ctx) }()
		wd, err := w.Map(ctx, "vol", AccessRW)
		if err != nil {
			t.Fatal(err)
		}
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
		if d, err := w2.Map(ctx, "vol", AccessRW); !errors.Is(err, syscall.EBUSY) {
			if d != nil {
				d.Unmap(ctx)
			}
			t.Fatalf("round %d: a second writer beside the first: %v, want EBUSY", i, err)
		}
		if err := wd.Unmap(ctx); err != nil {
			t.Fatal(err)
		}
	}
	r.srv.mu.Lock()
	left := len(r.srv.devices)
	r.srv.mu.Unlock()
	if left != 0 {
		t.Fatalf("%d devices left open", left)
	}
}
