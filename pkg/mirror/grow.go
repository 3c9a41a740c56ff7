package mirror

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// zeroChunk is the most one write-zeroes (or one write of zeroes, where
// a leg's device has no write-zeroes) of a growth covers.
const zeroChunk = 64 << 20

// Grow makes the mirror size bytes of data, more than it has, while it
// serves: every leg must be in sync and its device have grown first (its
// storage node's resize; each device's size is asked for again here).
// The bytes added are zeroed on every leg and flushed, the bitmap blocks
// they add written clean, and only then is a generation of the new size
// committed: a crash before the commit leaves the mirror as it was, one
// after leaves it grown, and either way the legs hold the same bytes
// everywhere. Writes and reads go on meanwhile; the bytes added take IO
// once Grow returns. The size it has already is success (a retry).
func (m *Mirror) Grow(ctx context.Context, size int64) error {
	m.growMu.Lock()
	defer m.growMu.Unlock()
	old := m.size.Load()
	switch {
	case size == old:
		return nil
	case size < old:
		return fmt.Errorf("mirror: it has %d bytes, asked %d: a mirror grows only: %w", old, size, syscall.EINVAL)
	case size%4096 != 0:
		return fmt.Errorf("mirror: a size of %d bytes: a multiple of 4096: %w", size, syscall.EINVAL)
	case m.failed.Load():
		return errFailed
	}
	m.metaMu.Lock()
	shift := m.sb.RegionShift
	m.metaMu.Unlock()
	if regionShiftFrom(uint64(size), shift) != shift || size > 1<<60 {
		return fmt.Errorf("mirror: %d bytes in regions of %d: more than its bitmap holds (%d regions; a mirror made with larger regions could): %w",
			size, int64(1)<<shift, BitmapMax*8, syscall.EINVAL)
	}
	legs, err := m.growable(ctx, size)
	if err != nil {
		return err
	}
	for _, v := range legs {
		if err := m.zeroLeg(ctx, v, DataOff+old, size-old); err != nil {
			return fmt.Errorf("mirror: %s: zeroing the bytes it grows by: %w", v.name, err)
		}
	}
	if m.grew != nil {
		m.grew()
	}
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	// What was checked before the zeroing still holds: no leg went out
	// or came back meanwhile (a leg that rejoined was not zeroed).
	for i, v := range legs {
		if m.state[i].Load() != legIn || m.leg(i) != v {
			return fmt.Errorf("mirror: %s left or came back while the mirror grew; nothing changed, grow it again once every leg is in sync: %w", m.name(i), syscall.EBUSY)
		}
	}
	for blk := m.bm.Blocks(); blk < bitmapBlocks(uint64(size), shift); blk++ {
		for _, v := range legs {
			clear(v.buf.Bytes()[:BitmapBlock])
			if err := v.do(ctx, rnbd.OpWrite, rnbd.FFUA, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf); err != nil {
				return fmt.Errorf("mirror: %s: writing the bitmap block %d it grows by: %w", v.name, blk, err)
			}
		}
	}
	next := m.stateSuperblock(&m.sb)
	next.DataSize = uint64(size)
	if err := m.commitLocked(ctx, next); err != nil {
		return err
	}
	// Committed: the bitmap first, then the size writes are checked
	// against.
	if err := m.bm.Grow(uint64(size)); err != nil {
		m.failed.Store(true) // cannot be: checked above
		return err
	}
	m.size.Store(size)
	m.log.WithFields(log.Fields{"was": old, "now": size, "generation": next.Gen.String()}).Info("mirror: grown")
	return nil
}

// growable is the legs of a mirror that may grow to size bytes: every
// one in sync, with no resync running, each device of DataOff+size
// bytes at least.
func (m *Mirror) growable(ctx context.Context, size int64) ([]*voter, error) {
	if l := m.rs.leg.Load(); l >= 0 {
		return nil, fmt.Errorf("mirror: %s resyncs: a mirror grows once every leg is in sync: %w", m.name(int(l)), syscall.EBUSY)
	}
	legs := make([]*voter, m.cfg.Layout.NLegs)
	for i := range legs {
		v := m.leg(i)
		if v == nil || m.state[i].Load() != legIn {
			return nil, fmt.Errorf("mirror: %s is %s: a mirror grows once every leg is in sync: %w", m.name(i), m.LegStates()[i], syscall.EBUSY)
		}
		if v.dev.Size() < DataOff+size {
			v.dev.PollSize(ctx) // it may have grown since the session's last poll
		}
		if got := v.dev.Size(); got < DataOff+size {
			return nil, fmt.Errorf("mirror: %s has %d bytes; %d bytes of data need %d (%d of metadata): grow its volume on its storage node first: %w",
				v.name, got, size, DataOff+size, DataOff, syscall.ENOSPC)
		}
		legs[i] = v
	}
	return legs, nil
}

// zeroLeg zeroes [off, off+n) of v's device and flushes it: with
// write-zeroes where the device has it, else with writes of zeroes paced
// as a resync's copy.
func (m *Mirror) zeroLeg(ctx context.Context, v *voter, off, n int64) error {
	var buf *rtrs.Buffer
	var start time.Time
	var wrote int64
	defer func() {
		if buf != nil {
			buf.Free()
		}
	}()
	for end := off + n; off < end; {
		c := min(end-off, zeroChunk)
		if buf == nil {
			var err error = syscall.EOPNOTSUPP
			if !m.zeroByWrites {
				err = v.do(ctx, rnbd.OpWriteZeroes, 0, off, int(c), nil)
			}
			if !errors.Is(err, syscall.EOPNOTSUPP) {
				if err != nil {
					return err
				}
				off += c
				continue
			}
			if buf, err = v.dev.Session().Session().AllocBuffer(resyncChunk); err != nil {
				return err
			}
			clear(buf.Bytes())
			start = time.Now()
		}
		c = min(c, resyncChunk)
		if err := v.do(ctx, rnbd.OpWrite, 0, off, int(c), buf); err != nil {
			return err
		}
		off += c
		wrote += c
		if err := m.pace(ctx, start, wrote); err != nil {
			return err
		}
	}
	return v.do(ctx, rnbd.OpFlush, 0, 0, 0, nil)
}
