package rnbd

import (
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// TestForcedShrinkUnderWrites: a forced shrink while a session writes
// past the new end leaves the file at the new size — a write checked
// against the old size and landing after the cut would grow it again —
// and IO past the end fails from then on. On a disk file system the
// writes go through the workers, on tmpfs they run inline (TryWriteAt).
func TestForcedShrinkUnderWrites(t *testing.T) {
	for _, dir := range []string{os.TempDir(), "/dev/shm"} {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			sp, err := os.MkdirTemp(dir, "rnbd-shrink-")
			if err != nil {
				t.Skip(err)
			}
			t.Cleanup(func() { os.RemoveAll(sp) })
			testForcedShrinkUnderWrites(t, sp)
		})
	}
}

func testForcedShrinkUnderWrites(t *testing.T, dir string) {
	r := newSrig(t, SrvConfig{DevSearchPath: dir})
	p := r.vol(8 << 20)
	c := r.client("s")
	c.SetSizePoll(time.Hour) // the client keeps the old size: its writes reach the server
	x := r.dev(c, "vol", AccessRW)
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var landed atomic.Int64
	for w := 0; w < 4; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				// Past 4 MiB, where the shrink cuts; the client still
				// has the old size.
				off := int64(4<<20 + (w*1024+i%1024)*4096%(4<<20))
				if x.d.Do(context.Background(), OpWrite, 0, off, 4096, x.buf, w*4096) == nil {
					landed.Add(1)
				}
			}
		}()
	}
	stopped := false
	halt := func() {
		if !stopped {
			stopped = true
			close(stop)
			wg.Wait()
		}
	}
	defer halt()
	for round := 0; round < 30; round++ {
		deadline := time.Now().Add(10 * time.Second)
		for start := landed.Load(); landed.Load() < start+20; runtime.Gosched() {
			// Writes land past 4 MiB before the cut.
			if time.Now().After(deadline) {
				t.Fatalf("round %d: the writes stopped landing", round)
			}
		}
		if _, err := r.srv.Resize("vol", 4<<20, true); err != nil {
			t.Fatalf("round %d: forced shrink: %v", round, err)
		}
		if n := fileSize(t, p); n != 4<<20 {
			t.Fatalf("round %d: the file has %d bytes after the shrink to %d", round, n, 4<<20)
		}
		if err := x.d.Do(context.Background(), OpWrite, 0, 6<<20, 4096, x.buf, 0); err == nil {
			t.Fatalf("round %d: a write past the new end succeeded", round)
		}
		if round == 29 {
			break
		}
		if _, err := r.srv.Resize("vol", 8<<20, false); err != nil {
			t.Fatalf("round %d: growing: %v", round, err)
		}
	}
	halt() // nothing in flight lands past the end later either
	if n := fileSize(t, p); n != 4<<20 {
		t.Fatalf("the file has %d bytes once the writes stopped, want %d", n, 4<<20)
	}
}

// fileSize is the size of the file at p.
func fileSize(t *testing.T, p string) int64 {
	t.Helper()
	st, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}

// TestResizeSeesEveryOpen: a shrink counts the sessions that have the
// file open through another name (the search path) as well; a device
// opened while a shrink is under way is served the new size, and a
// second resize of the file then is refused (EBUSY).
func TestResizeSeesEveryOpen(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	p := r.vol(4 << 20)
	c := r.client("s")
	x := r.dev(c, "exp/x", AccessRO) // by the search path, not the export
	if _, err := r.srv.Resize("vol", 1<<20, false); !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "by session s:") {
		t.Fatalf("shrinking a file open through the search path: %v, want EBUSY naming the session", err)
	}
	if n := fileSize(t, p); n != 4<<20 {
		t.Fatalf("the refused shrink cut the file to %d", n)
	}
	fi, _ := os.Stat(p)
	id, ok := blockdev.FileID(fi)
	r.srv.mu.Lock()
	dev := r.srv.devices[id]
	shrinking := resizing{shrink: true, size: 1 << 20, owner: 99} // a shrink waiting for writes
	r.srv.resizes[id] = shrinking
	r.srv.mu.Unlock()
	if !ok || dev == nil || x.d.Size() != 4<<20 {
		t.Fatalf("FileID %q (%v) names no open device", id, ok)
	}
	ct := r.client("t")
	y := r.dev(ct, "vol", AccessRO)
	if y.d.Size() != 1<<20 {
		t.Fatalf("a device opened during a shrink to 1 MiB has %d bytes", y.d.Size())
	}
	if _, err := r.srv.Resize("vol", 2<<20, true); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("a resize during another: %v, want EBUSY", err)
	}
	r.srv.endResize(id, shrinking, false) // the shrink gave up: nothing was cut
	ct.SetSizePoll(20 * time.Millisecond)
	for deadline := time.Now().Add(10 * time.Second); y.d.Size() != 4<<20; time.Sleep(5 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the device did not learn the size back: %d", y.d.Size())
		}
	}
	if err := y.d.Do(context.Background(), OpRead, 0, 3<<20, 4096, y.buf, 0); err != nil {
		t.Fatalf("a read past 1 MiB once the shrink ended: %v", err)
	}
	// Open by two sessions (one of them twice): the refusal names both.
	r.dev(ct, "exp/x", AccessRO)
	if _, err := r.srv.Resize("vol", 1<<20, false); !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "is open 3 time(s), by sessions s, t:") {
		t.Fatalf("shrinking a file two sessions have open: %v, want EBUSY naming both", err)
	}
}

// TestShrinkWhileClosing: a device closing still waits for a write it
// admitted; a shrink it does not count as open (no --force needed) still
// caps it, so that write cannot land past the cut.
func TestShrinkWhileClosing(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	p := r.vol(8 << 20)
	hold := make(chan struct{})
	release := sync.OnceFunc(func() { close(hold) })
	t.Cleanup(release) // before the server closes, should the test fail
	var held atomic.Int32
	r.srv.beforeIO = func() {
		held.Add(1)
		<-hold
	}
	x := r.dev(r.client("s"), "vol", AccessRW)
	wrote := make(chan error, 1)
	go func() { wrote <- x.d.Do(context.Background(), OpWrite, 0, 6<<20, 4096, x.buf, 0) }()
	kit.WaitFor(t, 10*time.Second, "the write at the server", func() bool { return held.Load() == 1 })
	closed := make(chan error, 1)
	go func() { _, err := r.srv.ForceClose("vol", ""); closed <- err }() // rnbd-server device close
	fi, _ := os.Stat(p)
	id, _ := blockdev.FileID(fi)
	kit.WaitFor(t, 10*time.Second, "the device closing", func() bool {
		r.srv.mu.Lock()
		defer r.srv.mu.Unlock()
		_, closing := r.srv.openOn(id)
		return len(closing) == 1
	})
	if _, err := r.srv.Resize("vol", 4<<20, false); err != nil {
		t.Fatalf("shrinking a file whose only device is closing: %v", err)
	}
	release()
	if err := <-wrote; err == nil {
		t.Fatal("the write past the cut succeeded")
	}
	if err := <-closed; err != nil {
		t.Fatal(err)
	}
	if n := fileSize(t, p); n != 4<<20 {
		t.Fatalf("the file has %d bytes after a shrink to %d", n, 4<<20)
	}
}

// TestOpenAfterCut: a file cut behind the server's back between a
// device's backend open and its join is served at its new size: the
// open reads the size again once joined, where a shrink's end would no
// longer reach it.
func TestOpenAfterCut(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	p := r.vol(4 << 20)
	r.srv.beforeJoin = func() { os.Truncate(p, 1<<20) }
	x := r.dev(r.client("s"), "vol", AccessRW)
	if x.d.Size() != 1<<20 {
		t.Fatalf("the device is served %d bytes of a file cut to %d", x.d.Size(), 1<<20)
	}
}

// rnbd-server resize reaches a client that has the device open through
// its size poll, without a remap; so does a file grown behind the
// server's back. Shrinking what a session has open needs force; IO
// follows the size both ways.
func TestServerResize(t *testing.T) {
	h := &countMsgs{}
	r := newSrigWith(t, SrvConfig{}, func(s *Server) rtrs.SrvHandler { h.Server = s; return h })
	p := r.vol(1 << 20)
	c := r.client("s")
	resized := make(chan int64, 4)
	c.OnResize(func(d *CltDev) { resized <- d.Size() })
	x := r.dev(c, "vol", AccessRW)
	c.SetSizePoll(20 * time.Millisecond)
	next := func(want int64) {
		t.Helper()
		select {
		case got := <-resized:
			if got != want || x.d.Size() != want {
				t.Fatalf("resized to %d (device %d), want %d", got, x.d.Size(), want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("the client did not learn the size %d", want)
		}
	}
	if _, err := r.srv.Resize("vol", 4<<20, false); err != nil {
		t.Fatal(err)
	}
	next(4 << 20)
	if err := x.d.Do(context.Background(), OpWrite, 0, 4<<20-4096, 4096, x.buf, 0); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
	os.Truncate(p, 6<<20) // behind the server's back: the poll's OPEN refreshes it
	next(6 << 20)
	if _, err := r.srv.Resize("vol", 1<<20, false); !errors.Is(err, syscall.EBUSY) || !strings.Contains(err.Error(), "export vol is open 1 time(s), by session s:") {
		t.Fatalf("shrinking an open export: %v, want EBUSY naming the session", err)
	}
	if was, err := r.srv.Resize("vol", 2<<20, true); err != nil || was != 6<<20 {
		t.Fatalf("forced shrink: %d %v", was, err)
	}
	next(2 << 20)
	if err := x.d.Do(context.Background(), OpRead, 0, 4<<20-4096, 4096, x.buf, 0); err == nil {
		t.Fatal("read past the new end succeeded")
	}
	for _, c := range []struct {
		name string
		size int64
		want syscall.Errno
	}{{"vol", 1000, syscall.EINVAL}, {"vol", 0, syscall.EINVAL}, {"none", 1 << 20, syscall.ENOENT}} {
		if _, err := r.srv.Resize(c.name, c.size, false); !errors.Is(err, c.want) {
			t.Errorf("resize %s to %d: %v, want %v", c.name, c.size, err, c.want)
		}
	}
	select {
	case n := <-resized:
		t.Fatalf("a size change %d nobody made", n)
	default:
	}
	// Closed by the server's administrator: the size poll must not
	// open it again (its read before the OPEN finds it closed). Closed
	// between polls: a poll under way could have read the device before
	// the close and OPEN it after, the moment docs/client.md owns to.
	r.mapClock(c)
	pausePolls(t, c)
	if n, err := r.srv.ForceClose("vol", "s"); err != nil || n != 1 {
		t.Fatalf("force close: %d %v", n, err)
	}
	opens := h.opened("vol")
	c.SetSizePoll(20 * time.Millisecond)
	kit.WaitFor(t, 10*time.Second, "a poll to find it closed", func() bool { return x.d.State() == DevSrvClosed })
	h.waitPolls(t, 5)
	if n := h.opened("vol") - opens; n != 0 || r.openOnServer("vol") {
		t.Fatalf("after five more polls: %d OPENs of vol, open on the server: %v", n, r.srv.OpenDevices())
	}
}
