package mirror

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync/atomic"
	"time"

	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// voter is one voter device and the metadata IO on it.
type voter struct {
	index int
	name  string
	dev   *rnbd.CltDev
	buf   *rtrs.Buffer // SlotSize*2 on the device's session
	slot  int          // the slot holding its newest superblock
	seq   uint64
	io    legIO
	// fenced: its session was closed for a request outstanding past
	// the leg timeout. lost: the witness did not take a generation (a
	// leg is taken out instead).
	fenced atomic.Bool
	lost   atomic.Bool
	// latency is its session's fastest connected path's heartbeat round
	// trip in nanoseconds (the min-latency read policy's key), kept by
	// the watchdog; no path: the largest.
	latency atomic.Int64
}

// measure keeps v.latency.
func (v *voter) measure() {
	l := int64(math.MaxInt64)
	for _, p := range v.dev.Session().Session().Paths() {
		if p.State() == rtrs.CltPathConnected {
			l = min(l, int64(p.CurLatency()))
		}
	}
	v.latency.Store(l)
}

// legIO is what the leg timeout watches: the requests outstanding on a
// voter and those completed. IO only counts (no clock read per
// request); the watchdog alone keeps seen and since, the count it saw
// last and when it last changed.
type legIO struct {
	inflight  atomic.Int32
	completed atomic.Uint64
	seen      uint64
	since     time.Time
}

func (l *legIO) start() { l.inflight.Add(1) }

func (l *legIO) done() {
	l.completed.Add(1)
	l.inflight.Add(-1)
}

// stuck says, at now, whether the voter has held requests without
// completing any for longer than d. Called by the watchdog only.
func (l *legIO) stuck(now time.Time, d time.Duration) bool {
	if c := l.completed.Load(); l.inflight.Load() == 0 || c != l.seen || l.since.IsZero() {
		l.seen, l.since = c, now
		return false
	}
	return now.Sub(l.since) > d
}

// do runs one request on the voter, watched by the leg timeout.
func (v *voter) do(ctx context.Context, op rnbd.Op, flags uint32, off int64, n int, buf *rtrs.Buffer) error {
	return v.doAt(ctx, op, flags, off, n, buf, 0)
}

// doAt is do with the data at bufOff in buf. An answer from a device
// its session opened again meanwhile is errReopened: what answered may
// not be the device the request went to.
func (v *voter) doAt(ctx context.Context, op rnbd.Op, flags uint32, off int64, n int, buf *rtrs.Buffer, bufOff int) error {
	v.io.start()
	defer v.io.done()
	g := v.dev.Opens()
	err := v.dev.Do(ctx, op, flags, off, n, buf, bufOff)
	if err == nil && v.dev.Opens() != g {
		err = errReopened
	}
	return err
}

// errReopened fails a leg's request whose device was opened again after
// a reconnect while it was out (rnbd.CltDev.Opens): its storage node
// restarted, or every path went down, and what answers at the name may
// be another device; the leg is taken out, and checked when it rejoins.
var errReopened = errors.New("mirror: the leg's device was opened again after its session reconnected")

// errTakenOut fails a piece for a leg taken out before it was sent.
var errTakenOut = errors.New("mirror: the leg was taken out")

func newVoter(i int, name string, dev *rnbd.CltDev) (*voter, error) {
	if dev.Mode() != rnbd.AccessRW {
		return nil, fmt.Errorf("mirror: %s is mapped %v: a mirror's voters are mapped rw, its one writer", name, dev.Mode())
	}
	buf, err := dev.Session().Session().AllocBuffer(2 * SlotSize)
	if err != nil {
		return nil, err
	}
	v := &voter{index: i, name: name, dev: dev, buf: buf}
	v.measure()
	return v, nil
}

// read reads and chooses the voter's superblock.
func (v *voter) read(ctx context.Context) (*Superblock, error) {
	if err := v.do(ctx, rnbd.OpRead, 0, Slot0Off, 2*SlotSize, v.buf); err != nil {
		return nil, fmt.Errorf("reading its superblock: %w", err)
	}
	p := v.buf.Bytes()
	sb, slot, err := ReadSlots(p[:SlotSize], p[SlotSize:2*SlotSize])
	if err != nil {
		return nil, err
	}
	v.slot, v.seq = slot, sb.Seq
	return &sb, nil
}

// write writes sb (its Index and Seq set here) to the slot other than
// the newest, with FUA.
func (v *voter) write(ctx context.Context, sb *Superblock) error {
	c := *sb
	c.Index = uint8(v.index)
	c.Seq = v.seq + 1
	p := v.buf.Bytes()[:SlotSize]
	if err := c.Encode(p); err != nil {
		return err
	}
	next := 1 - v.slot
	if err := v.do(ctx, rnbd.OpWrite, rnbd.FFUA, Slot0Off+int64(next)*SlotSize, SlotSize, v.buf); err != nil {
		return fmt.Errorf("mirror: %s: writing its superblock: %w", v.name, err)
	}
	v.slot, v.seq = next, c.Seq
	return nil
}

// watch fences a voter that holds requests past the leg timeout
// without completing any: looked at every quarter of it, so
// fenced between 1 and 1.5 times the timeout after its last progress.
func (m *Mirror) watch() {
	defer m.wg.Done()
	t := time.NewTicker(m.cfg.LegTimeout / 4)
	defer t.Stop()
	for {
		select {
		case <-m.done:
			return
		case <-t.C:
		}
		if m.closing.Load() {
			continue // the sessions are closing: nothing to judge
		}
		now := time.Now()
		for _, i := range m.cfg.Layout.indexes() {
			v := m.voter(i)
			if v == nil || v.fenced.Load() {
				continue
			}
			if v.io.stuck(now, m.cfg.LegTimeout) {
				m.fence(v)
			}
			v.measure()
		}
	}
}

// fence closes v's session, so that every request outstanding on it
// ends (with an error) and none can touch a buffer after, and takes a
// leg out.
func (m *Mirror) fence(v *voter) {
	if !v.fenced.CompareAndSwap(false, true) {
		return
	}
	m.stats.Fenced.Add(1)
	m.log.WithField("voter", v.name).Warnf("mirror: no answer in %v: fenced, its session closed", m.cfg.LegTimeout)
	if v.index != WitnessIndex {
		m.markOut(v.index)
	}
	go v.dev.Session().Close()
}
