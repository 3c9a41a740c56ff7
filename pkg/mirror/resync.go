package mirror

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// A leg taken out comes back while the mirror serves (Rejoin): it is
// written from then on, and a resync copies to it, in the background and
// at a bounded rate, what it missed — the regions the bitmap marks, or
// everything when the bitmap cannot say — then it is read again.
//
// The copy of a window of the data and the writes to it must not cross:
// a copy reading the source before a write and landing on the leg after
// it would leave the leg with the old bytes. So while a resync runs,
// writes are admitted one by one: one overlapping the window being
// copied waits until the window moves on, and the copy of a window
// starts only once the writes admitted into it have ended.

// DefaultResyncRate is Config.ResyncRate's default, bytes per second.
const DefaultResyncRate = 200 << 20

// resyncChunk is the bytes the resync copies at a time: its window.
const resyncChunk = 1 << 20

// resyncGate holds writes off the window a resync is copying.
type resyncGate struct {
	// active: a resync runs and writes are admitted through mu. plain
	// counts the writes in flight that were not (started before it
	// ran): the resync waits for them before its first copy.
	active atomic.Bool
	plain  atomic.Int64

	mu   sync.Mutex
	cond sync.Cond
	// +checklocks:mu
	lo int64
	// +checklocks:mu
	hi int64 // the window; lo == hi: none
	// +checklocks:mu
	admitted map[*mreq]struct{}
	// +checklocks:mu
	deferred []*Req

	leg    atomic.Int32 // the leg being resynced, -1 none
	copied atomic.Int64
	total  atomic.Int64
}

func (g *resyncGate) init() {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.cond.L = &g.mu
	g.admitted = map[*mreq]struct{}{}
	g.leg.Store(-1)
}

// admit lets write r in (true) or defers it until the window moves
// (false: it is resubmitted then).
func (g *resyncGate) admit(r *Req, x *mreq) bool {
	g.mu.Lock()
	defer g.mu.Unlock()
	if r.Off < g.hi && g.lo < r.Off+int64(r.Len) {
		g.deferred = append(g.deferred, r)
		return false
	}
	g.admitted[x] = struct{}{}
	return true
}

// ended counts an admitted write done.
func (g *resyncGate) ended(x *mreq) {
	g.mu.Lock()
	delete(g.admitted, x)
	g.mu.Unlock()
	g.cond.Broadcast()
}

// hold sets the window to [lo, hi) and waits for the writes admitted
// into it to end.
func (g *resyncGate) hold(lo, hi int64) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.lo, g.hi = lo, hi
	for g.overlapsLocked(lo, hi) {
		g.cond.Wait()
	}
}

// +checklocks:g.mu
func (g *resyncGate) overlapsLocked(lo, hi int64) bool {
	for x := range g.admitted {
		if r := x.r; r.Off < hi && lo < r.Off+int64(r.Len) {
			return true
		}
	}
	return false
}

// gateWrites has the writes from now on admitted through the gate
// (m.rs.leg taken by the caller) and waits for those that were not to
// end: from its return no write overlaps a window the caller holds.
func (m *Mirror) gateWrites(ctx context.Context) error {
	m.rs.active.Store(true)
	for m.rs.plain.Load() > 0 {
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(time.Millisecond):
		}
	}
	return nil
}

// release clears the window and returns the writes it deferred.
func (g *resyncGate) release() []*Req {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.lo, g.hi = 0, 0
	d := g.deferred
	g.deferred = nil
	return d
}

// Progress is a resync's: the leg (-1: none runs) and the bytes copied
// of those to copy.
type Progress struct {
	Leg           int
	Copied, Total int64
}

// Resync is the resync running now, if any.
func (m *Mirror) Resync() Progress {
	return Progress{Leg: int(m.rs.leg.Load()), Copied: m.rs.copied.Load(), Total: m.rs.total.Load()}
}

// Rejoin takes leg i, out, back through dev (its storage node reached
// again, through a new session; the caller owns it): once it returns the
// leg is written by every write, and a resync copies to it what it
// missed, then it is read again. A device without a superblock is a
// new one, rebuilt in full (a leg replaced: its storage node gone for
// good); name, if not empty, is what logs and errors call the leg from
// here. One leg resyncs at a time.
func (m *Mirror) Rejoin(ctx context.Context, i int, dev *rnbd.CltDev, name string) error {
	switch {
	case i < 0 || i >= m.cfg.Layout.NLegs:
		return fmt.Errorf("mirror: no leg %d", i)
	case m.failed.Load():
		return errFailed
	case m.state[i].Load() != legOut:
		return fmt.Errorf("mirror: %s is not out", m.name(i))
	case dev.Size() < DataOff+m.size.Load():
		// A new leg too small would fail part way through its rebuild.
		return fmt.Errorf("mirror: %s: a device of %d bytes; a leg of this mirror needs %d (its data and %d of metadata)",
			cmp.Or(name, m.name(i)), dev.Size(), DataOff+m.size.Load(), DataOff)
	case !m.rs.leg.CompareAndSwap(-1, int32(i)):
		return fmt.Errorf("mirror: %s resyncs now; one leg at a time", m.name(int(m.rs.leg.Load())))
	}
	started := false
	defer func() {
		if !started {
			m.endResync()
		}
	}()
	v, err := newVoter(i, cmp.Or(name, m.name(i)), dev)
	if err != nil {
		return err
	}
	sb, err := v.read(ctx)
	if err != nil && !errors.Is(err, ErrNoSuperblock) {
		v.buf.Free()
		return fmt.Errorf("mirror: %s: %w", v.name, err)
	}
	// From here writes are admitted through the gate; the ones that
	// were not end before the first copy (not under metaMu: a write
	// may wait for it to store the bitmap).
	if err := m.gateWrites(ctx); err != nil {
		v.buf.Free()
		return err
	}
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	if dev.Size() < DataOff+m.size.Load() {
		// Grown since the check above.
		v.buf.Free()
		return fmt.Errorf("mirror: %s: a device of %d bytes; the mirror grew meanwhile, a leg of it needs %d", v.name, dev.Size(), DataOff+m.size.Load())
	}
	uuid, full, err := m.rejoinsAsLocked(i, v, sb)
	if err != nil {
		v.buf.Free()
		return err
	}
	m.bufMu.Lock()
	if err := m.shareLocked(i, v); err != nil {
		m.bufMu.Unlock()
		v.buf.Free()
		return err
	}
	if old := m.legs[i].Swap(v); old != nil && old.buf != nil {
		old.buf.Free()
	}
	m.watchReopen(v)
	want := m.memberSeq.Add(1)
	m.state[i].Store(legSync) // written from here
	m.bufMu.Unlock()
	next := m.stateSuperblock(&m.sb)
	next.Legs[i].UUID = uuid
	if err := m.commitLocked(ctx, next); err != nil {
		return err
	}
	if m.committedSeq.Load() < want {
		m.committedSeq.Store(want)
	}
	// The leg's bitmap as it is in memory: if the others go, what they
	// miss from here is on it.
	for blk := range m.bm.Blocks() {
		m.bm.Snapshot(blk, v.buf.Bytes()[:BitmapBlock])
		if err := v.do(ctx, rnbd.OpWrite, rnbd.FFUA, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf); err != nil {
			m.markOut(i)
			return fmt.Errorf("mirror: %s: writing its bitmap: %w", v.name, err)
		}
	}
	var runs [][2]int64
	if full {
		runs = [][2]int64{{0, m.size.Load()}}
	} else {
		runs = m.bm.Runs(0)
	}
	var total int64
	for _, r := range runs {
		total += r[1]
	}
	m.rs.copied.Store(0)
	m.rs.total.Store(total)
	m.log.WithFields(log.Fields{"leg": v.name, "bytes": total, "full": full}).Info("mirror: leg rejoined; resyncing")
	started = true
	m.wg.Add(1)
	go m.resync(i, runs)
	return nil
}

// rejoinsAsLocked checks that sb (nil: none) is leg i's of this mirror,
// and says what the leg becomes: its device's UUID, and whether it is
// copied whole (a new device, or one the bitmap does not speak for).
//
// +checklocks:m.metaMu
func (m *Mirror) rejoinsAsLocked(i int, v *voter, sb *Superblock) ([16]byte, bool, error) {
	if sb == nil {
		return legDeviceUUID(m.rand), true, nil
	}
	if err := m.cfg.Layout.belongs(&Voter{Index: i, Name: v.name, SB: sb}); err != nil {
		return [16]byte{}, false, err
	}
	own := sb.Legs[i].UUID
	inHistory := m.sb.InHistory(sb.Gen)
	if !inHistory && sb.ForcedAt > m.sb.ForcedAt {
		return [16]byte{}, false, &RefusedError{Reason: fmt.Sprintf("%s went on without this mirror (forced at generation %s)", v.name, sb.Gen),
			Need: "an operator to choose the leg to keep: unmap, then map with --force-from LEG"}
	}
	return own, own != m.sb.Legs[i].UUID || !inHistory, nil
}

// resync copies runs from a leg in sync to leg i through the gate, at
// the configured rate, then puts the leg in sync.
func (m *Mirror) resync(i int, runs [][2]int64) {
	defer m.wg.Done()
	defer m.endResync()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		select {
		case <-m.done:
			cancel()
		case <-ctx.Done():
		}
	}()
	err := m.copyRuns(ctx, i, runs)
	if err == nil {
		err = m.leg(i).do(ctx, rnbd.OpFlush, 0, 0, 0, nil)
	}
	if err != nil || m.state[i].Load() != legSync {
		m.log.WithError(err).WithField("leg", m.name(i)).Warn("mirror: resync stopped; the leg is out")
		m.markOut(i)
		return
	}
	m.state[i].Store(legIn)
	m.memberSeq.Add(1)
	select {
	case m.wake <- struct{}{}:
	default:
	}
	m.log.WithFields(log.Fields{"leg": m.name(i), "bytes": m.rs.copied.Load()}).Info("mirror: leg in sync")
}

// copyRuns copies each run, a window at a time, from a leg in sync to
// leg i, paced to Config.ResyncRate.
func (m *Mirror) copyRuns(ctx context.Context, i int, runs [][2]int64) error {
	dst := m.leg(i)
	buf, err := dst.dev.Session().Session().AllocBuffer(resyncChunk)
	if err != nil {
		return err
	}
	defer buf.Free()
	// The buffer registered with each source's session, on first use.
	shares := map[int]*rtrs.Buffer{}
	defer freeShared(shares)
	start := time.Now()
	for _, r := range runs {
		for off, end := r[0], r[0]+r[1]; off < end; {
			n := min(end-off, resyncChunk)
			if m.state[i].Load() != legSync {
				return errors.New("taken out while resyncing")
			}
			if err := m.copyWindow(ctx, i, off, n, buf, shares); err != nil {
				return err
			}
			off += n
			m.stats.Reconciled.Add(uint64(n))
			if err := m.pace(ctx, start, m.rs.copied.Add(n)); err != nil {
				return err
			}
		}
	}
	return nil
}

// pace waits until the bytes done since start have taken their time at
// Config.ResyncRate.
func (m *Mirror) pace(ctx context.Context, start time.Time, done int64) error {
	rate := m.cfg.ResyncRate
	if rate <= 0 {
		rate = DefaultResyncRate
	}
	wait := time.Duration(float64(done)/float64(rate)*float64(time.Second)) - time.Since(start)
	if wait <= 0 {
		return nil
	}
	t := time.NewTimer(wait)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// copyWindow copies [off, off+n) from a leg in sync to leg i with the
// writes to it held off, then lets them go.
func (m *Mirror) copyWindow(ctx context.Context, i int, off, n int64, buf *rtrs.Buffer, shares map[int]*rtrs.Buffer) error {
	m.rs.hold(off, off+n)
	defer m.releaseDeferred()
	dst := m.leg(i)
	for k := range m.cfg.Layout.NLegs {
		if m.state[k].Load() != legIn {
			continue
		}
		src := m.leg(k)
		if shares[k] == nil {
			s, err := src.dev.Session().Session().ShareBuffer(buf)
			if err != nil {
				return err
			}
			shares[k] = s
		}
		if err := src.do(ctx, rnbd.OpRead, 0, DataOff+off, int(n), shares[k]); err != nil {
			if legFault(err) && ctx.Err() == nil {
				if !mediaError(err) {
					m.markOut(k)
				} // a bad block: the source answers and stays in
				continue // another source
			}
			return err
		}
		if m.copyRead != nil {
			m.copyRead(off, n)
		}
		return dst.do(ctx, rnbd.OpWrite, 0, DataOff+off, int(n), buf)
	}
	return errors.New("no leg in sync to copy from")
}

// releaseDeferred clears the window: the writes it held go out.
func (m *Mirror) releaseDeferred() {
	for _, r := range m.rs.release() {
		if err := m.Submit(context.Background(), r); err != nil {
			r.Done(r, err)
		}
	}
}

// endResync ends the resync's gate: the writes it deferred go out.
func (m *Mirror) endResync() {
	m.rs.active.Store(false)
	m.releaseDeferred()
	m.rs.leg.Store(-1)
}
