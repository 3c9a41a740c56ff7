// Tests of the size: Refresh, a cut's cap, and a file cut behind the
// backend's back (PollSize).

package blockdev

import (
	"bytes"
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Refresh serves the file's new size, grown or shrunk, in whole logical
// blocks; IO follows it.
func TestRefresh(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20)
	b := open(t, path, Options{LogicalBlockSize: 4096})
	buf := make([]byte, 4096)
	if err := b.WriteAt(buf, 1<<20, false); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("write past the end before the refresh: %v", err)
	}
	os.Truncate(path, 2<<20+100) // the tail short of a block does not count
	if was, now, err := b.Refresh(); err != nil || was != 1<<20 || now != 2<<20 || b.Size() != 2<<20 {
		t.Fatalf("refresh after growing: %d → %d, %v; size %d", was, now, err, b.Size())
	}
	if err := b.WriteAt(buf, 2<<20-4096, false); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
	os.Truncate(path, 512<<10)
	if _, now, err := b.Refresh(); err != nil || now != 512<<10 {
		t.Fatalf("refresh after shrinking: %d %v", now, err)
	}
	if err := b.ReadAt(buf, 512<<10); !errors.Is(err, ErrOutOfRange) {
		t.Fatalf("read past the new end: %v", err)
	}
}

// TestCap: a cut's cap refuses writes past it at once, outlives a
// Refresh, and waits for the writes that began before it — not for
// those that begin after — or gives up with ETIMEDOUT.
func TestCap(t *testing.T) {
	path := sparseFile(t, t.TempDir(), 8<<20)
	b := open(t, path, Options{})
	g := b.beginWrite() // a write in flight, checked against 8 MiB
	done := make(chan error, 1)
	go func() { done <- b.Cap(4<<20, 10*time.Second, 1) }()
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		for deadline := time.Now().Add(10 * time.Second); !cond(); time.Sleep(time.Millisecond) {
			if time.Now().After(deadline) {
				t.Fatalf("timed out waiting for %s", what)
			}
		}
	}
	waitFor("the cap", func() bool { return b.wgen.Load() != 0 }) // flipped: what begins now is not waited for
	if err := b.WriteAt(make([]byte, 4096), 5<<20, false); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the cap: %v, want ENOSPC", err)
	}
	if _, now, err := b.Refresh(); err != nil || now != 4<<20 {
		t.Fatalf("Refresh under the cap: %d %v, want %d", now, err, 4<<20)
	}
	later := b.beginWrite() // begins after the cap: not waited for
	select {
	case err := <-done:
		t.Fatalf("Cap returned (%v) with a write from before it in flight", err)
	case <-time.After(50 * time.Millisecond):
	}
	b.endWrite(g)
	if err := <-done; err != nil {
		t.Fatalf("Cap: %v", err)
	}
	// A write that does not end: the cap gives up, and one tried again
	// still waits for it (it counts in a generation two flips back).
	for i := 0; i < 3; i++ {
		if err := b.Cap(2<<20, 20*time.Millisecond, 2); !errors.Is(err, syscall.ETIMEDOUT) {
			t.Fatalf("Cap %d with a write that does not end: %v, want ETIMEDOUT", i, err)
		}
		b.Uncap(2)
	}
	b.endWrite(later)
	if err := b.Cap(2<<20, 10*time.Second, 3); err != nil {
		t.Fatalf("Cap after the write ended: %v", err)
	}
	// A cap taken over by a later one: the first's Uncap lifts nothing.
	b.Uncap(1)
	if _, now, err := b.Refresh(); err != nil || now != 2<<20 {
		t.Fatalf("Refresh after the Uncap of a cap taken over: %d %v, want %d", now, err, 2<<20)
	}
	b.Uncap(3)
	if _, now, err := b.Refresh(); err != nil || now != 8<<20 {
		t.Fatalf("Refresh after Uncap: %d %v, want %d", now, err, 8<<20)
	}
}

// TestShrinkBehind: a file cut behind the server's back is not a resize
// to PollSize (a size poll) as it is to Refresh (the server's own
// resize): the size served stays, every IO that reaches past the file's
// end fails with EIO — writes too, which would grow the file back — and
// what lies below it is served as before; a grow back heals it, a grow
// past it is served, and a failed cut (Cap, Uncap) leaves it as it was.
// On ext4 through the workers' IO, on tmpfs through the inline IO too
// (TryWriteAt, the file's mapping).
func TestShrinkBehind(t *testing.T) {
	for _, dir := range dirs {
		t.Run(strings.ReplaceAll(dir, "/", "_"), func(t *testing.T) {
			testShrinkBehind(t, dir)
		})
	}
}

func testShrinkBehind(t *testing.T, dir string) {
	path := sparseFile(t, dir, 8<<20)
	b := open(t, path, Options{})
	low, high := bytes.Repeat([]byte("low!"), 256<<10), bytes.Repeat([]byte("high"), 1024) // 1 MiB at 0, 4 KiB at 6 MiB
	if err := b.WriteAt(low, 0, false); err != nil {
		t.Fatal(err)
	}
	if err := b.WriteAt(high, 6<<20, false); err != nil {
		t.Fatal(err)
	}
	if err := os.Truncate(path, 2<<20+100); err != nil { // the tail short of a block does not count
		t.Fatal(err)
	}
	was, now, err := b.PollSize()
	var se *ShrinkError
	if !errors.As(err, &se) || se.Served != 8<<20 || se.Size != 2<<20 || se.Path != path || was != 8<<20 || now != 8<<20 {
		t.Fatalf("poll of the file cut to 2 MiB: %d → %d, %v; want 8 MiB kept and a ShrinkError from 8 MiB to 2 MiB", was, now, err)
	}
	if b.Size() != 8<<20 {
		t.Fatalf("the size served went to %d on a shrink behind the server", b.Size())
	}
	if herr := b.Health(); herr == nil || herr.Error() != err.Error() {
		t.Fatalf("the health check says %v, the poll %v: one change, one message", herr, err)
	}
	if _, _, again := b.PollSize(); again == nil || again.Error() != err.Error() {
		t.Fatalf("poll again: %v", again)
	}
	past := make([]byte, 8192)
	eio := func(what string, err error) {
		t.Helper()
		if !errors.Is(err, syscall.EIO) || !errors.Is(err, ErrPastFileEnd) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s past the file's end: %v, want EIO naming the file", what, err)
		}
	}
	eio("write", b.WriteAt(past, 6<<20, false))
	eio("FUA write", b.WriteAt(past, 6<<20, true))
	eio("write straddling the end", b.WriteAt(past, 2<<20-4096, false))
	eio("read", b.ReadAt(past, 6<<20))
	eio("discard", b.Discard(4<<20, 1<<20))
	eio("write-zeroes", b.WriteZeroes(4<<20, 1<<20, true))
	eio("write-zeroes unmapping", b.WriteZeroes(4<<20, 1<<20, false))
	if done, err := b.TryWriteAt(past, 5<<20); done {
		eio("inline write", err)
	}
	if done, err := b.TryReadAt(past, 5<<20); done {
		eio("inline read", err)
	}
	if err := b.WriteAt(past, 9<<20, false); !errors.Is(err, syscall.ENOSPC) || !errors.Is(err, ErrOutOfRange) {
		t.Errorf("write past the size served: %v, want ENOSPC", err)
	}
	if n := fileSize(t, path); n != 2<<20+100 {
		t.Fatalf("the file is %d bytes after the refused IO, want it left at %d", n, 2<<20+100)
	}
	// Below the end: served as before.
	got := make([]byte, len(low))
	if err := b.ReadAt(got, 0); err != nil || !bytes.Equal(got, low) {
		t.Fatalf("read below the end: %v", err)
	}
	if done, err := b.TryReadAt(got[:4096], 4096); done && (err != nil || !bytes.Equal(got[:4096], low[4096:8192])) {
		t.Fatalf("inline read below the end: %v", err)
	}
	if err := b.WriteAt(low[:4096], 2<<20-4096, true); err != nil {
		t.Fatalf("write below the end: %v", err)
	}
	// A forced cut that failed (its cap lifted, nothing cut) leaves it
	// as it was: the size served, the shrink.
	if err := b.Cap(2<<20, time.Second, 7); err != nil {
		t.Fatal(err)
	}
	b.Uncap(7)
	if was, now, err := b.PollSize(); !errors.As(err, &se) || was != 2<<20 || now != 8<<20 {
		t.Fatalf("poll after a cut that failed: %d → %d, %v; want 8 MiB back and the shrink", was, now, err)
	}
	// Grown back: healed, IO past the old cut works again.
	if err := os.Truncate(path, 8<<20); err != nil {
		t.Fatal(err)
	}
	if was, now, err := b.PollSize(); err != nil || was != 8<<20 || now != 8<<20 {
		t.Fatalf("poll of the file grown back: %d → %d, %v", was, now, err)
	}
	if err := b.Health(); err != nil {
		t.Fatalf("health once grown back: %v", err)
	}
	if err := b.WriteAt(high, 6<<20, false); err != nil {
		t.Fatalf("write once grown back: %v", err)
	}
	if err := b.ReadAt(got[:len(high)], 6<<20); err != nil || !bytes.Equal(got[:len(high)], high) {
		t.Fatalf("read once grown back: %v", err)
	}
	// Cut again, then grown past the size served: the grow is served.
	os.Truncate(path, 1<<20)
	if _, _, err := b.PollSize(); !errors.As(err, &se) {
		t.Fatalf("poll of the file cut again: %v", err)
	}
	os.Truncate(path, 12<<20)
	if was, now, err := b.PollSize(); err != nil || was != 8<<20 || now != 12<<20 {
		t.Fatalf("poll of the file grown past the size served: %d → %d, %v", was, now, err)
	}
	if err := b.WriteAt(high, 11<<20, false); err != nil {
		t.Fatalf("write in the grown part: %v", err)
	}
	// Cut again and Refreshed (rnbd-server resize --force): the new size
	// is served, IO past it is out of range, not EIO.
	os.Truncate(path, 2<<20)
	if was, now, err := b.Refresh(); err != nil || was != 12<<20 || now != 2<<20 {
		t.Fatalf("refresh of the file cut: %d → %d, %v", was, now, err)
	}
	if err := b.WriteAt(past, 6<<20, false); !errors.Is(err, ErrOutOfRange) || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the size served once refreshed: %v, want ENOSPC", err)
	}
	if _, _, err := b.PollSize(); err != nil {
		t.Fatalf("poll once refreshed: %v", err)
	}
}

// fileSize is the size of the file at path.
func fileSize(t *testing.T, path string) int64 {
	t.Helper()
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	return st.Size()
}
