// The size served and where IO ends: Refresh and PollSize read it again,
// Cap and Uncap cut a file under the writes in flight (drained by
// generation).

package blockdev

import (
	"fmt"
	"os"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Size is the addressable size in bytes, a multiple of the logical block.
func (b *Backend) Size() int64 { return b.size.Load() }

// Refresh reads the size again — a file grown or cut by the server
// itself (rnbd-server resize), a block device resized (lvextend) — and
// serves that size from then on, at most a Cap under way, grown or
// shrunk. It returns the size served before and after. A size poll uses
// PollSize, which does not take a file's shrink for a resize.
func (b *Backend) Refresh() (was, now int64, err error) {
	return b.reread(true)
}

// PollSize reads the size again for a size poll (a client's OPEN of a
// device it has open, the health loop): a grow is served from then on as
// Refresh serves it, and a block device's new size whatever it is; but a
// file found shorter than the size served — cut behind the server's
// back: a cut of the server's own is capped first (Cap) — is not. The
// size served stays, IO past the file's end fails with ErrPastFileEnd
// (EIO), so that no write grows the file back, and PollSize returns a
// *ShrinkError; until a poll finds the file back at the size served, or
// a Refresh serves the size it has. It returns the size served before
// and after.
func (b *Backend) PollSize() (was, now int64, err error) {
	return b.reread(b.kind != KindFile)
}

func (b *Backend) reread(follow bool) (was, now int64, err error) {
	for {
		// The size is read without the lock (fstat may wait on its
		// file system), and served only if no cap or uncap came
		// between: else it may be from before a cut.
		b.sizeMu.Lock()
		seq := b.sizeSeq
		b.sizeMu.Unlock()
		has, err := b.readSize()
		if err != nil {
			return 0, 0, err
		}
		b.sizeMu.Lock()
		if seq != b.sizeSeq {
			b.sizeMu.Unlock()
			continue
		}
		want := has
		if !follow && has < b.want {
			want = b.want // a shrink behind the server's back: an error, not a resize
		}
		was, now = b.serve(want, has)
		b.sizeMu.Unlock()
		b.remap(now)
		if has < now {
			return was, now, &ShrinkError{Path: b.path, Served: now, Size: has}
		}
		return was, now, nil
	}
}

// serve sets the size served but for a cap (want), and with it the size
// served and where IO ends, for a file that has bytes now (whole
// logical blocks); sizeMu is held. It returns the size served before
// and after.
func (b *Backend) serve(want, has int64) (was, now int64) {
	b.want = want
	now = want
	if b.capOwner != 0 && now > b.capped {
		now = b.capped
	}
	end := min(now, has)
	was, old := b.size.Load(), b.end.Load()
	b.resized(old, end) // before a grow is served
	// end <= size at every instant: whichever moves down goes first.
	if end < old {
		b.end.Store(end)
		b.size.Store(now)
	} else {
		b.size.Store(now)
		b.end.Store(end)
	}
	return was, now
}

// ShrinkError is a file found shorter than the size its clients are
// served: cut behind the server's back (PollSize, HealthCheck).
type ShrinkError struct {
	Path         string
	Served, Size int64 // bytes, Size in whole logical blocks
}

func (e *ShrinkError) Error() string {
	return fmt.Sprintf("blockdev: %s shrank from %d to %d bytes, not by rnbd-server resize: clients keep the size they were told, "+
		"and IO past the file's end fails with EIO until the file is grown back or resized with --force", e.Path, e.Served, e.Size)
}

// readSize is the size the file or device has now, in whole logical
// blocks.
func (b *Backend) readSize() (int64, error) {
	var now int64
	switch b.kind {
	case KindFile:
		var st unix.Stat_t
		if err := unix.Fstat(int(b.f.Fd()), &st); err != nil {
			return 0, fmt.Errorf("blockdev: %s: %w", b.path, err)
		}
		now = st.Size
	default:
		n, err := ioctlUint64(b.f, unix.BLKGETSIZE64)
		if err != nil {
			return 0, fmt.Errorf("blockdev: %s: BLKGETSIZE64: %w", b.path, err)
		}
		now = int64(n)
	}
	return now &^ int64(b.lbs-1), nil
}

// Cap prepares a cut of the file to size for owner (not 0; a later cap
// takes over): from its call on, the backend serves at most size bytes
// (writes past it fail with ENOSPC, Refresh and PollSize keep to it),
// and it returns when every write that began before has ended, so that
// none lands past size once the caller cuts the file — or fails with
// ETIMEDOUT after timeout (a write hung on its storage). Uncap(owner)
// ends the cap, done or not.
func (b *Backend) Cap(size int64, timeout time.Duration, owner uint64) error {
	b.capMu.Lock()
	defer b.capMu.Unlock()
	size &^= int64(b.lbs - 1)
	b.sizeMu.Lock()
	b.capOwner, b.capped = owner, size
	b.sizeSeq++
	if b.end.Load() > size {
		b.end.Store(size) // first: end <= size
	}
	if b.size.Load() > size {
		b.size.Store(size)
	}
	b.sizeMu.Unlock()
	deadline := time.Now().Add(timeout)
	cur := b.wgen.Load()
	// First the writes of older generations that an earlier cap gave
	// up on (they count in the counter the flip makes the new one)...
	if err := b.drain((cur+1)&1, deadline, timeout); err != nil {
		return err
	}
	// ...then those of this generation. One that began before the
	// flip is counted in cur's when we look, or checks its range after
	// the end stored above (beginWrite).
	b.wgen.Store(cur + 1)
	return b.drain(cur&1, deadline, timeout)
}

// drain waits until no write counts in generation g, or the deadline.
func (b *Backend) drain(g uint32, deadline time.Time, timeout time.Duration) error {
	for b.wcnt[g].Load() != 0 {
		if time.Now().After(deadline) {
			return fmt.Errorf("blockdev: %s: %d writes in flight did not end in %v: %w", b.path, b.wcnt[g].Load(), timeout, syscall.ETIMEDOUT)
		}
		time.Sleep(time.Millisecond)
	}
	return nil
}

// Uncap ends owner's Cap, if it is still the one in force; the caller
// then Refreshes to serve the file's size (or, if nothing was cut, polls
// it: PollSize).
func (b *Backend) Uncap(owner uint64) {
	b.sizeMu.Lock()
	if b.capOwner == owner {
		b.capOwner = 0
		b.sizeSeq++
	}
	b.sizeMu.Unlock()
}

// beginWrite counts a write (or discard, write-zeroes) in flight for
// Cap, before its range is checked; endWrite, with what it returned,
// when it is done. A write counts in the generation that is current
// after it counted itself: one that read the generation, then waited
// while a cap flipped it (once or more), counts again in the new one.
func (b *Backend) beginWrite() uint32 {
	for {
		g := b.wgen.Load()
		b.wcnt[g&1].Add(1)
		if b.wgen.Load() == g {
			return g & 1
		}
		b.wcnt[g&1].Add(-1)
	}
}

func (b *Backend) endWrite(g uint32) { b.wcnt[g].Add(-1) }

// DeviceSize is the size in bytes of the block device at path (its
// BLKGETSIZE64), for callers that only need to know it (rnbd-csi's node
// service, growing a file system after the device grew).
func DeviceSize(path string) (int64, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, err
	}
	defer f.Close()
	n, err := ioctlUint64(f, unix.BLKGETSIZE64)
	if err != nil {
		return 0, fmt.Errorf("blockdev: %s: BLKGETSIZE64: %w", path, err)
	}
	return int64(n), nil
}
