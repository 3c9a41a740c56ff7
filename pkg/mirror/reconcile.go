package mirror

// Making the legs identical: the reconcile of an assembly (a crash's
// dirty regions, legs back, new legs rebuilt) and the cleaning of the
// bitmap while every leg is in sync.

import (
	"context"
	"fmt"
	"slices"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// reconcileLocked copies what may differ from the source to the other
// legs (after a crash; a leg back), rebuilds the new ones, then commits
// them in sync and, with every leg in sync, clears the bitmap.
// +checklocks:m.metaMu
func (m *Mirror) reconcileLocked(ctx context.Context, d Decision) error {
	var targets []int
	for i := 0; i < m.cfg.Layout.NLegs; i++ {
		if i != d.Source && m.state[i].Load() != legOut {
			targets = append(targets, i)
		}
	}
	if len(targets) == 0 {
		return m.cleanLocked(ctx, true)
	}
	src := m.leg(d.Source)
	const chunk = 1 << 20
	buf, err := src.dev.Session().Session().AllocBuffer(chunk)
	if err != nil {
		return err
	}
	defer buf.Free()
	shared := map[int]*rtrs.Buffer{}
	defer freeShared(shared)
	for _, i := range targets {
		if shared[i], err = m.leg(i).dev.Session().Session().ShareBuffer(buf); err != nil {
			return err
		}
	}
	var full, part []int
	for _, i := range targets {
		if slices.Contains(d.Full, i) {
			full = append(full, i)
		} else {
			part = append(part, i)
		}
	}
	// A block the source cannot read (its storage node answers EIO) is
	// read from a leg that was in sync (a crash's dirty regions may
	// hold either leg's version; outside them they are equal), and
	// written to every other, the source's bad block mended too.
	c := copier{m: m, src: src, buf: buf, shared: shared, alts: part}
	if len(full) > 0 {
		if err := c.copy(ctx, 0, m.size.Load(), full); err != nil {
			return err
		}
	}
	if len(part) > 0 {
		for _, r := range m.bm.Runs(0) {
			if err := c.copy(ctx, r[0], r[1], part); err != nil {
				return err
			}
		}
	}
	for _, i := range targets {
		if err := m.leg(i).do(ctx, rnbd.OpFlush, 0, 0, 0, nil); err != nil {
			return fmt.Errorf("mirror: flushing %s: %w", m.leg(i).name, err)
		}
		m.state[i].Store(legIn)
	}
	if err := m.commitLocked(ctx, m.stateSuperblock(&m.sb)); err != nil {
		return err
	}
	return m.cleanLocked(ctx, true)
}

// cleanLocked clears the bitmap's quiet regions, on the legs too, when
// every leg is in sync (no leg is away to have missed a marked region):
// those no write has touched for a period of the worker's cleaning
// (cleanEvery), or, now, those no write is in flight on. Either way
// every write to them has ended before every leg is flushed, and the
// flush comes before their bits are cleared.
// +checklocks:m.metaMu
func (m *Mirror) cleanLocked(ctx context.Context, now bool) error {
	for i := range m.cfg.Layout.NLegs {
		if m.state[i].Load() != legIn {
			return nil
		}
	}
	if now {
		// An empty period: what it leaves out is only what is
		// written from here to the next Settle.
		m.bm.Settle()
	}
	q := m.bm.Settle()
	if len(q.blocks) > 0 {
		// A region is cleaned only once what was written to it is
		// durable on every leg: a leg whose storage node restarts
		// and loses what it had cached is taken out at the reopen
		// (watchReopen), and its resync copies the regions still
		// marked, which must include every write it may have lost.
		for i := range m.cfg.Layout.NLegs {
			if err := m.leg(i).do(ctx, rnbd.OpFlush, 0, 0, 0, nil); err != nil {
				m.log.WithError(err).WithField("leg", m.name(i)).Warn("mirror: a leg's flush before the bitmap's cleaning failed: it is out")
				m.markOut(i)
				return nil
			}
		}
	}
	blocks, regions := m.bm.Clean(q)
	m.stats.Cleaned.Add(uint64(regions))
	for _, blk := range blocks {
		if err := m.storeBitmapLocked(ctx, blk); err != nil {
			return err
		}
	}
	return nil
}

// readElsewhere reads [off, off+l) of the data into the buffer from
// another leg, after the source failed with err: only for a media error
// (the source's storage node answered EIO: a bad block), from the first
// of alts that can. It returns the leg read, or -1.
func (c copier) readElsewhere(ctx context.Context, off int64, l int, err error) int {
	if !mediaError(err) {
		return -1
	}
	for _, i := range c.alts {
		if e := c.m.leg(i).do(ctx, rnbd.OpRead, 0, DataOff+off, l, c.shared[i]); e == nil {
			c.m.log.WithFields(log.Fields{"source": c.src.name, "leg": c.m.leg(i).name, "offset": off, "length": l}).WithError(err).
				Warn("mirror: the reconcile's source cannot read a block; copied from another leg in sync, and mended")
			return i
		}
	}
	return -1
}

func freeShared(bs map[int]*rtrs.Buffer) {
	for _, b := range bs {
		b.Free()
	}
}

// copier copies data from a source leg to others, through one buffer
// shared by their sessions.
type copier struct {
	m      *Mirror
	src    *voter
	buf    *rtrs.Buffer
	shared map[int]*rtrs.Buffer
	// alts are the legs (targets, with a share of buf) a chunk the
	// source cannot read is read from instead.
	alts []int
}

// copy copies [off, off+n) of the data from the source to the legs to.
func (c copier) copy(ctx context.Context, off, n int64, to []int) error {
	chunk := int64(len(c.buf.Bytes()))
	for n > 0 {
		l := min(n, chunk)
		from := -1 // the source
		if err := c.src.do(ctx, rnbd.OpRead, 0, DataOff+off, int(l), c.buf); err != nil {
			if from = c.readElsewhere(ctx, off, int(l), err); from < 0 {
				return fmt.Errorf("mirror: reading %s to copy it: %w", c.src.name, err)
			}
			if err := c.src.do(ctx, rnbd.OpWrite, 0, DataOff+off, int(l), c.buf); err != nil {
				return fmt.Errorf("mirror: mending %s from %s: %w", c.src.name, c.m.leg(from).name, err)
			}
		}
		for _, i := range to {
			if i == from {
				continue
			}
			if err := c.m.leg(i).do(ctx, rnbd.OpWrite, 0, DataOff+off, int(l), c.shared[i]); err != nil {
				return fmt.Errorf("mirror: copying to %s: %w", c.m.leg(i).name, err)
			}
		}
		c.m.stats.Reconciled.Add(uint64(l) * uint64(len(to)))
		off, n = off+l, n-l
	}
	return nil
}

// cleanEvery is how often the worker cleans the bitmap while every leg
// is in sync: the regions with no write for one period are cleaned at
// the end of the next, from one to two periods after their last write.
const cleanEvery = 5 * time.Second

// cleanQuiet cleans the bitmap's regions quiet for a period of
// cleanEvery, when every leg is in sync and no resync runs: a leg that
// goes later needs only what was written after.
func (m *Mirror) cleanQuiet() {
	if m.failed.Load() || m.closing.Load() || m.rs.leg.Load() >= 0 {
		return
	}
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	if err := m.cleanLocked(context.Background(), false); err != nil {
		m.log.WithError(err).Warn("mirror: cleaning the bitmap")
	}
}
