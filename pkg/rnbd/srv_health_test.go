package rnbd

import (
	"bytes"
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/testfs"
)

// A backing file deleted, replaced or shrunk behind the server's back is
// logged once, and its recovery too.
func TestBackingStoreHealth(t *testing.T) {
	lg, entries := kit.LogRecorder()
	r := newSrig(t, SrvConfig{Log: lg, HealthInterval: 5 * time.Millisecond})
	p := r.file("a", 1<<20)
	c := r.client("h")
	if _, err := c.open(context.Background(), "a", AccessRW); err != nil {
		t.Fatal(err)
	}
	said := func(msg, part string) bool {
		for _, e := range entries() {
			if e.Message == msg {
				if err, _ := e.Data["error"].(error); part == "" || err != nil && strings.Contains(err.Error(), part) {
					return true
				}
			}
		}
		return false
	}
	if err := os.Truncate(p, 1<<19); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the shrink to be logged", func() bool { return said("backing store changed behind the server", "shrank from 1048576 to 524288") })
	if err := os.Truncate(p, 1<<20); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the recovery to be logged", func() bool { return said("backing store healthy again", "") })
	if err := os.Remove(p); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the deletion to be logged", func() bool { return said("backing store changed behind the server", "was deleted") })
	n := 0
	for _, e := range entries() {
		if e.Message == "backing store changed behind the server" {
			n++
		}
	}
	if n != 2 {
		t.Fatalf("%d problem entries for two problems: each is logged once", n)
	}
}

// TestHealthOnHungMount: the health check of a file whose mount stopped
// answering holds neither the checks of the other devices nor the close
// of its own device, and says that it hangs. The check used to stat the
// path on the health loop itself, holding an IO reference: the loop
// stopped for every device, and the device's close waited for ever.
func TestHealthOnHungMount(t *testing.T) {
	lg, entries := kit.LogRecorder()
	r := newSrig(t, SrvConfig{Log: lg, HealthInterval: 10 * time.Millisecond})
	under := filepath.Join(r.dir, "mnt")
	r.file("mnt/vol", 1<<20)
	other := r.file("other", 1<<20)
	c := r.client("h")
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	vol, err := c.Map(ctx, "mnt/vol", AccessRW)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Map(ctx, "other", AccessRW); err != nil {
		t.Fatal(err)
	}
	testfs.HungMountAt(t, under) // the open file stays; its path now hangs
	said := func(part string) bool {
		for _, e := range entries() {
			if err, _ := e.Data["error"].(error); e.Message == "backing store changed behind the server" &&
				err != nil && strings.Contains(err.Error(), part) {
				return true
			}
		}
		return false
	}
	kit.WaitFor(t, 10*time.Second, "the hung check to be reported", func() bool { return said("no answer to its health check") })
	if err := os.Remove(other); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the other device's deletion to be logged", func() bool { return said("other was deleted") })
	done := make(chan error, 1)
	go func() { done <- vol.Unmap(ctx) }()
	select {
	case err := <-done:
		if err != nil {
			t.Fatalf("unmap of the device on the hung mount: %v", err)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the close of the device on the hung mount waits for its health check")
	}
}

// TestShrinkBehindServer: a backing file cut behind the server's back
// while a session has it open is an error, not a resize — found by the
// client's size poll or by the health loop, whichever comes first: the
// size served stays (the client's device keeps its size), the shrink is
// logged at error level once and counted, IO past the file's end fails
// with EIO and does not grow the file back, what lies below it reads
// back intact; a grow back heals it, a resize refused leaves it, and a
// forced resize to the new size makes it the size served. On tmpfs the
// IO runs inline, through the file's mapping.
func TestShrinkBehindServer(t *testing.T) {
	for _, c := range []struct {
		name   string
		dir    string
		poll   time.Duration // the client's size poll
		health time.Duration // the server's health loop
	}{
		{"size poll", os.TempDir(), 20 * time.Millisecond, -1},
		{"health loop", os.TempDir(), time.Hour, 5 * time.Millisecond},
		{"size poll on tmpfs", "/dev/shm", 20 * time.Millisecond, -1},
	} {
		t.Run(strings.ReplaceAll(c.name, " ", "_"), func(t *testing.T) {
			dir, err := os.MkdirTemp(c.dir, "rnbd-shrink-")
			if err != nil {
				t.Skip(err)
			}
			t.Cleanup(func() { os.RemoveAll(dir) })
			testShrinkBehindServer(t, dir, c.poll, c.health)
		})
	}
}

func testShrinkBehindServer(t *testing.T, dir string, poll, health time.Duration) {
	lg, entries := kit.LogRecorder()
	r := newSrig(t, SrvConfig{Log: lg, HealthInterval: health, DevSearchPath: dir})
	p := r.vol(8 << 20)
	c := r.client("s")
	resized := make(chan int64, 8)
	c.OnResize(func(d *CltDev) { resized <- d.Size() })
	x := r.dev(c, "vol", AccessRW)
	c.SetSizePoll(poll)
	low, high := bytes.Repeat([]byte("low!"), 16<<10), bytes.Repeat([]byte("high"), 1024)
	if err := x.write(0, low, 0); err != nil {
		t.Fatal(err)
	}
	if err := x.write(6<<20, high, 0); err != nil {
		t.Fatal(err)
	}
	logged := func(msg string) (n int) {
		for _, e := range entries() {
			if e.Message == msg {
				n++
			}
		}
		return n
	}
	shrinkLogged := func(part string) bool {
		for _, e := range entries() {
			if err, _ := e.Data["error"].(error); e.Message == "backing store changed behind the server" && e.Level == log.ErrorLevel &&
				err != nil && strings.Contains(err.Error(), part) {
				return true
			}
		}
		return false
	}
	if err := os.Truncate(p, 2<<20); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the shrink to be logged", func() bool { return shrinkLogged("shrank from 8388608 to 2097152") })
	if n := r.srv.BackingShrinks()["vol"]; n != 1 {
		t.Fatalf("%d shrinks counted for vol, want 1", n)
	}
	if o := r.srv.OpenDevices(); len(o) != 1 || !strings.Contains(o[0].BackingProblem, "shrank") {
		t.Fatalf("open devices: %+v", o)
	}
	for _, w := range []struct {
		what string
		err  error
	}{
		{"write", x.write(6<<20, high, 0)},
		{"FUA write", x.write(6<<20, high, FFUA)},
		{"write across the end", x.write(2<<20-4096, low[:8192], 0)},
		{"write-zeroes", x.op(OpWriteZeroes, FNoUnmap, 4<<20, 1<<20)},
		{"read", x.do(OpRead, 0, 6<<20, 4096)},
	} {
		if !errors.Is(w.err, syscall.EIO) {
			t.Errorf("%s past the file's end: %v, want EIO", w.what, w.err)
		}
	}
	if n := fileSize(t, p); n != 2<<20 {
		t.Fatalf("the file is %d bytes after IO past its end, want it left at %d", n, 2<<20)
	}
	if got, err := x.read(0, len(low)); err != nil || !bytes.Equal(got, low) {
		t.Fatalf("read below the end: %v", err)
	}
	refusedLogged := false
	for _, e := range entries() {
		err, _ := e.Data["error"].(error)
		refusedLogged = refusedLogged || e.Message == "IO failed on the backend" && e.Level == log.ErrorLevel &&
			errors.Is(err, blockdev.ErrPastFileEnd) && strings.Contains(err.Error(), p)
	}
	if !refusedLogged {
		t.Fatal("IO refused past the file's end was not logged at error level, naming the file")
	}
	if rsp, err := c.open(context.Background(), "vol", AccessRW); err != nil || rsp.NSectors != (8<<20)/512 {
		t.Fatalf("a size poll after the shrink: %v, %d sectors, want the %d served", err, rsp.NSectors, (8<<20)/512)
	}
	if x.d.Size() != 8<<20 {
		t.Fatalf("the client's device went to %d bytes", x.d.Size())
	}
	// Grown back: healthy, IO there works again.
	if err := os.Truncate(p, 8<<20); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the recovery to be logged", func() bool { return logged("backing store healthy again") == 1 })
	kit.WaitFor(t, 10*time.Second, "a write past the old cut", func() bool { return x.write(6<<20, high, 0) == nil })
	if got, err := x.read(6<<20, len(high)); err != nil || !bytes.Equal(got, high) {
		t.Fatalf("read back past the old cut: %v", err)
	}
	if n := logged("backing store changed behind the server"); n != 1 {
		t.Fatalf("the shrink was logged %d times: once per change", n)
	}
	// Cut again: a shrink refused (no --force) leaves it an error; a
	// forced one to the file's size makes that the size served.
	if err := os.Truncate(p, 2<<20); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the second shrink to be counted", func() bool { return r.srv.BackingShrinks()["vol"] == 2 })
	if _, err := r.srv.Resize("vol", 2<<20, false); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("resize to the size cut, without force: %v, want EBUSY", err)
	}
	if err := x.write(6<<20, high, 0); !errors.Is(err, syscall.EIO) {
		t.Fatalf("write past the end after a resize refused: %v, want EIO", err)
	}
	if rsp, err := c.open(context.Background(), "vol", AccessRW); err != nil || rsp.NSectors != (8<<20)/512 {
		t.Fatalf("a size poll after a resize refused: %v, %d sectors", err, rsp.NSectors)
	}
	select {
	case n := <-resized:
		t.Fatalf("the client followed a shrink nobody made to %d bytes", n)
	default:
	}
	if _, err := r.srv.Resize("vol", 2<<20, true); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "healthy again after the forced resize", func() bool { return logged("backing store healthy again") == 2 })
	if rsp, err := c.open(context.Background(), "vol", AccessRW); err != nil || rsp.NSectors != (2<<20)/512 {
		t.Fatalf("a size poll after the forced resize: %v, %d sectors, want %d", err, rsp.NSectors, (2<<20)/512)
	}
	if err := x.write(1<<20, high, 0); err != nil {
		t.Fatalf("write below the new end: %v", err)
	}
	if n := r.srv.BackingShrinks()["vol"]; n != 2 {
		t.Fatalf("%d shrinks counted, want 2", n)
	}
}
