package mirror

import (
	"context"
	"errors"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Read repair: a read a leg's storage node answered with EIO (a bad
// block: its disk could not read it) is read from another leg in sync,
// and the bytes written back to the leg that failed, as md's raid1 does
// (fix_read_error): the leg stays in, and a disk that remaps a sector on
// write is mended. Only if the rewrite fails too is the leg taken out.
//
// The rewrite must not cross a write to the same blocks: bytes read from
// the good leg before a write, and landing on the bad leg after it,
// would leave the legs different. So a repair holds writes off the
// blocks through the resync's gate, as a resync's window does, and reads
// the good leg only once the writes already in flight there have ended.
// One repair or resync runs at a time; a read error that finds one
// running is served by another leg, the block left bad until a later
// read repairs it.

// repairTimeout bounds a repair: the wait for writes in flight, the
// read from a good leg and the rewrite.
const repairTimeout = 30 * time.Second

// mediaError says whether err is a leg's answer that it could not do the
// IO (its storage node's EIO), not the loss of the leg itself: the leg
// is there, and a block of it is bad.
func mediaError(err error) bool {
	return errors.Is(err, syscall.EIO) && !errors.Is(err, rtrs.ErrNoPath) && !errors.Is(err, rtrs.ErrClosed) &&
		!errors.Is(err, context.DeadlineExceeded) && !errors.Is(err, context.Canceled)
}

// repair serves read x, which failed on leg bad with a media error, from
// another leg in sync and writes the bytes back to leg bad; if that
// write fails too, leg bad is taken out. It reports false, x not
// finished, if it served nothing: it could not start (another repair or
// a resync runs) or no other leg could serve the read.
func (m *Mirror) repair(x *mreq, bad int) bool {
	if m.closing.Load() || !m.rs.leg.CompareAndSwap(-1, int32(bad)) {
		return false
	}
	r := x.r
	m.rs.copied.Store(0)
	m.rs.total.Store(int64(r.Len))
	ctx, cancel := context.WithTimeout(context.Background(), repairTimeout)
	defer cancel()
	served, err := m.repairHeld(ctx, x, bad)
	m.endResync()
	if !served {
		return false
	}
	lg := m.log.WithFields(log.Fields{"leg": m.name(bad), "offset": r.Off, "length": r.Len})
	if err == nil {
		m.stats.Repaired.Add(1)
		lg.Warn("mirror: a read failed on the leg: served from another, and rewritten")
	} else {
		lg.WithError(err).Warn("mirror: a read failed on the leg and could not be rewritten: the leg is out")
		m.markOut(bad)
	}
	m.finish(x, nil, nil)
	return true
}

// repairHeld is repair's work with the gate active: the blocks held, the
// bytes read from a good leg into the read's buffer (served), then
// written back to leg bad (err: the rewrite failed).
func (m *Mirror) repairHeld(ctx context.Context, x *mreq, bad int) (served bool, err error) {
	r := x.r
	if err := m.gateWrites(ctx); err != nil {
		return false, err
	}
	m.rs.hold(r.Off, r.Off+int64(r.Len))
	defer m.releaseDeferred()
	for !served {
		i := m.readLeg(x)
		if i < 0 {
			return false, nil
		}
		x.tried[i] = true
		err := m.legDo(ctx, i, rnbd.OpRead, 0, r)
		x.errs[i] = err
		switch {
		case err == nil:
			served = true
		case legFault(err):
			m.markOut(i)
		default:
			return false, err
		}
	}
	m.stats.ReadRetry.Add(1)
	if m.copyRead != nil {
		m.copyRead(r.Off, int64(r.Len))
	}
	// The rewrite is a write: its regions marked before it, so that a
	// crash in the middle of it leaves them to be made identical.
	need := m.bm.StartWrite(r.Off, int64(r.Len))
	defer m.bm.EndWrite(r.Off, int64(r.Len), need.Pass)
	for blk := m.bm.Pending(need); blk >= 0; blk = m.bm.Pending(need) {
		if err := m.storeBitmap(ctx, blk); err != nil {
			return true, err
		}
	}
	if m.state[bad].Load() == legOut {
		return true, errors.New("taken out while it was repaired")
	}
	return true, m.legDo(ctx, bad, rnbd.OpWrite, rnbd.FFUA, r)
}

// legDo does r's op on leg i with r's buffer, and waits.
func (m *Mirror) legDo(ctx context.Context, i int, op rnbd.Op, flags uint32, r *Req) error {
	return m.leg(i).doAt(ctx, op, flags, DataOff+r.Off, r.Len, r.Buf.legs[i], r.BufOff)
}
