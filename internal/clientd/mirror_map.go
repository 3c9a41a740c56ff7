package clientd

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"sync"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/mirror"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// A mirror mapping (docs/replication.md): one device over 2 or 3 legs,
// each an RNBD device on a storage node of its own reached through a
// session of its own (the mirror closes a leg's session to fence it, so
// no other mapping may share it), and maybe a witness holding only
// metadata.

// legDialTimeout bounds the dialling of one leg at map: a leg's storage
// node that does not answer in it is missing, and the mirror decides
// whether it can serve without it.
var legDialTimeout = 10 * time.Second

// legConn is a mirror's leg or witness as the daemon holds it: its
// session and device, or why it was not reached.
type legConn struct {
	cs  *rnbd.CltSession
	dev *rnbd.CltDev
	err error
}

// mirrorDev is a mirror mapping's device (an ioDev).
type mirrorDev struct {
	name string
	m    *mirror.Mirror
	info rnbd.OpenRsp
	// mu guards the legs' conns, which a rejoin replaces, and spec.
	mu      sync.Mutex
	legs    []legConn // by leg
	witness *legConn
	// spec is the mapping as normalized: its legs, witness and their
	// paths, which a replace-leg changes (the mapping's record too,
	// under the daemon's mu).
	// +checklocks:mu
	spec mapSpec
	// rejoinMu is held through each rejoin of a leg and through a
	// replace-leg: one at a time.
	rejoinMu sync.Mutex
	// stop ends the rejoiner; done is closed when it has.
	stop context.CancelFunc
	done chan struct{}
}

func (d *mirrorDev) Name() string       { return d.name }
func (d *mirrorDev) Size() int64        { return d.m.Size() }
func (d *mirrorDev) Info() rnbd.OpenRsp { return d.info }
func (d *mirrorDev) ReadOnly() bool     { return false }
func (d *mirrorDev) Describe() string {
	return fmt.Sprintf("rnbd mirror %s (%d legs)", d.name, len(d.legs))
}

func (d *mirrorDev) AllocBuffer(n int) (ioBuf, error) {
	b, err := d.m.AllocBuffer(n)
	if err != nil {
		return nil, err
	}
	return b, nil
}

func (d *mirrorDev) Submit(r *devReq) {
	mr := &r.mr
	mr.Op = r.op
	mr.Flags, mr.Off, mr.Len = r.wire()
	mr.Buf, mr.BufOff, mr.Plug = nil, 0, r.plug
	if r.op == rnbd.OpRead || r.op == rnbd.OpWrite {
		mr.Buf, _ = r.buf.(*mirror.Buffer)
		mr.BufOff = r.bufOff
	}
	if err := d.m.Submit(context.Background(), mr); err != nil {
		r.done(r, err)
	}
}

// stopRejoiner stops the rejoiner and waits for it (any number of
// times).
func (d *mirrorDev) stopRejoiner() {
	if d.stop != nil {
		d.stop()
		<-d.done
	}
}

// conns are the legs, then the witness.
func (d *mirrorDev) conns() []*legConn {
	var out []*legConn
	for i := range d.legs {
		out = append(out, &d.legs[i])
	}
	if d.witness != nil {
		out = append(out, d.witness)
	}
	return out
}

// closeLegs stops the rejoiner, unmaps the legs' devices and closes
// their sessions.
func (d *mirrorDev) closeLegs(ctx context.Context) {
	d.stopRejoiner()
	d.mu.Lock()
	defer d.mu.Unlock()
	for _, c := range d.conns() {
		if c.dev != nil {
			c.dev.Unmap(ctx) // a fenced leg's session is closed already
		}
		if c.cs != nil {
			c.cs.Close()
		}
	}
}

// mapMirror dials the mirror's legs and witness (each bounded by
// legDialTimeout; one not reached is missing), creates the mirror's
// metadata if asked, assembles it (which may refuse: a
// *mirror.RefusedError), attaches its frontend and registers it.
func (d *Daemon) mapMirror(ctx context.Context, s mapSpec, restore bool) (*mapped, error) {
	md := &mirrorDev{name: s.Mirror, legs: make([]legConn, len(s.Legs))}
	if s.Witness != nil {
		md.witness = &legConn{}
	}
	conns := md.conns()
	var wg sync.WaitGroup
	for i := range s.legs() {
		wg.Add(1)
		go func() {
			defer wg.Done()
			*conns[i] = d.dialLeg(ctx, &s, i, restore)
		}()
	}
	wg.Wait()
	fail := func(err error) (*mapped, error) {
		md.closeLegs(context.Background())
		return nil, err
	}
	cfg := mirror.Config{
		Layout: mirror.Layout{Mirror: mirrorID(s.Mirror), NLegs: len(s.Legs), Witness: s.Witness != nil},
		Log:    d.log.WithField("mirror", s.Mirror), LegTimeout: d.cfg.MirrorLegTimeout.Duration,
		ResyncRate: int64(d.cfg.MirrorResyncRate), RegionSize: s.regionSize,
		// Reads choose a leg as the legs' sessions choose a path.
		ReadPolicy: d.cfg.MPPolicy,
	}
	if s.Adopt != "" {
		cfg.Layout.Adopt = mirrorID(s.Adopt)
	}
	if p := s.Settings.MPPolicy; p != nil {
		cfg.ReadPolicy, _ = rtrs.ParseMPPolicy(*p) // checked by normalize
	}
	for i, l := range s.legs() {
		c := conns[i]
		cfg.Names = append(cfg.Names, s.legTitle(i))
		if c.cs != nil {
			l.SessUUID = sessUUID(c.cs)
		} else {
			d.log.WithError(c.err).WithFields(log.Fields{"mirror": s.Mirror, "leg": cfg.Names[i]}).Warn("mirror: leg not reached")
		}
		if i < len(s.Legs) {
			cfg.Legs = append(cfg.Legs, c.dev)
		} else {
			cfg.Witness = c.dev
		}
	}
	if s.Create {
		for i, c := range conns {
			if c.dev == nil {
				return fail(ctl.Errorf(ctl.CodeUnavailable, "mirror %s: create needs every leg: %s: %v", s.Mirror, cfg.Names[i], c.err))
			}
		}
		if err := mirror.Create(ctx, cfg); err != nil {
			return fail(ctl.Errorf(ctl.CodeInvalid, "mirror %s: %v", s.Mirror, err))
		}
		d.log.WithFields(log.Fields{"mirror": s.Mirror, "legs": len(s.Legs), "witness": s.Witness != nil}).Info("mirror created")
	}
	if s.CreateIfNew {
		created, err := mirror.CreateIfNew(ctx, cfg)
		if err != nil {
			code := ctl.CodeInvalid
			if errors.Is(err, mirror.ErrCreateNeedsEvery) {
				code = ctl.CodeUnavailable
			}
			return fail(ctl.Errorf(code, "mirror %s: %v", s.Mirror, err))
		}
		if created {
			d.log.WithFields(log.Fields{"mirror": s.Mirror, "legs": len(s.Legs), "witness": s.Witness != nil}).Info("mirror created")
		}
	}
	if f := s.Force; f != nil {
		cfg.Force = &mirror.Force{By: f.By, From: f.From, At: time.Now().Unix()}
		d.log.WithFields(log.Fields{"audit": true, "mirror": s.Mirror, "by": f.By, "from": f.From}).
			Warn("mirror: assembly forced by the operator: writes only the legs left out had may be lost")
	}
	mir, err := mirror.Open(ctx, cfg)
	if err != nil {
		if _, ok := errors.AsType[*mirror.RefusedError](err); ok {
			return fail(ctl.Errorf(ctl.CodeUnavailable, "mirror %s: %v", s.Mirror, err))
		}
		return fail(fmt.Errorf("mirror %s: %w", s.Mirror, err))
	}
	if s.growTo > mir.Size() {
		if err := mir.Grow(ctx, s.growTo); err != nil {
			if !errors.Is(err, syscall.EBUSY) {
				mir.Close()
				return fail(fmt.Errorf("mirror %s: growing it to the size asked: %w", s.Mirror, err))
			}
			// A leg resyncs or is out: the mirror serves at its size
			// and grows by resize once its legs are in sync (Map's
			// answer says so).
			d.log.WithError(err).WithFields(log.Fields{"mirror": s.Mirror, "size": mir.Size(), "asked": s.growTo}).
				Info("mirror: not grown to the size asked as it is mapped")
		}
	}
	md.m = mir
	md.info = mirrorInfo(md)
	fe, err := d.attach(s, md)
	if err != nil {
		mir.Close()
		return fail(err)
	}
	// What the state file keeps: never create or force again.
	s.Create, s.CreateIfNew, s.Force, s.RegionSize, s.Size = false, false, nil, "", ""
	md.mu.Lock()
	md.spec = s
	md.mu.Unlock()
	mp := d.register(s, nil, md, fe)
	rctx, cancel := context.WithCancel(context.Background())
	md.stop, md.done = cancel, make(chan struct{})
	go d.rejoiner(rctx, mp, md)
	return mp, nil
}

// rejoinEvery is how often a mirror's legs out are tried again.
var rejoinEvery = 5 * time.Second

// rejoiner brings the mirror's legs that are out back while it is
// mapped: every rejoinEvery, one leg out (its storage node lost, frozen
// or cut off, or never reached) is dialled again through a new session
// and, reached, rejoins: written at once, resynced in the background
// (mirror.Mirror.Rejoin); so is a witness that does not vote
// (mirror.Mirror.RejoinWitness). Until ctx ends.
//
// A leg out since longer than mirror_spare_after and not back is
// replaced by the first of the mapping's spares the mirror takes
// (takeSpare).
func (d *Daemon) rejoiner(ctx context.Context, mp *mapped, md *mirrorDev) {
	defer close(md.done)
	t := time.NewTicker(rejoinEvery)
	defer t.Stop()
	failing := map[int]string{}     // the last error said of each leg
	outSince := map[int]time.Time{} // when each leg out was first seen out
	said := map[int]time.Time{}     // when failing[i] was last logged
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if md.m.Resync().Leg >= 0 || md.m.Failed() {
			continue
		}
		md.mu.Lock()
		s := md.spec
		md.mu.Unlock()
		// The legs out, then the witness if it does not vote.
		var out []int
		for i, st := range md.m.LegStates() {
			if st == "out" {
				out = append(out, i)
			} else {
				delete(failing, i)
				delete(outSince, i)
			}
		}
		if w := len(s.Legs); s.Witness != nil {
			if md.m.WitnessVoting() {
				delete(failing, w)
				delete(outSince, w)
			} else {
				out = append(out, w)
			}
		}
		now := time.Now()
		for _, i := range out {
			if _, ok := outSince[i]; !ok {
				outSince[i] = now
			}
		}
		for _, i := range out {
			md.rejoinMu.Lock()
			// A replace-leg may have changed the leg while this waited:
			// the next round dials it as it is now.
			md.mu.Lock()
			cur := md.spec
			md.mu.Unlock()
			err := errors.New("replaced a moment ago")
			if a, b := cur.legs()[i], s.legs()[i]; a.SessName == b.SessName && a.DevicePath == b.DevicePath && slices.Equal(a.Paths, b.Paths) {
				err = d.rejoin(ctx, md, i, &cur, true)
			}
			md.rejoinMu.Unlock()
			// A spare is a leg's (the witness is replaced by hand).
			if err != nil && i < len(cur.Legs) && len(cur.Spares) > 0 && time.Since(outSince[i]) >= d.cfg.MirrorSpareAfter.Duration && ctx.Err() == nil {
				serr := d.takeSpare(ctx, mp, i)
				if serr == nil {
					delete(outSince, i)
					delete(failing, i)
					break // takeLeg said so; one resync at a time
				}
				err = fmt.Errorf("%w; and no spare taken: %w", err, serr)
			}
			lg := d.log.WithFields(log.Fields{"mirror": md.name, "leg": i, "session": s.legs()[i].SessName})
			if err == nil {
				delete(failing, i)
				lg.Info("mirror: " + s.legName(i) + " back")
				break // one resync at a time
			}
			if ctx.Err() != nil {
				return
			}
			// Said again once a minute while it does not change: the
			// log shows a leg that keeps failing the same way.
			if failing[i] != err.Error() || time.Since(said[i]) >= time.Minute {
				lg.WithError(err).WithField("out_for", time.Since(outSince[i]).Round(time.Second).String()).
					Warn("mirror: " + s.legName(i) + " not back yet; tried again")
				failing[i], said[i] = err.Error(), time.Now()
			}
		}
	}
}

// dialLeg dials leg i of s.legs() (bounded by legDialTimeout) and maps
// its device read-write. A leg not reached has only err.
func (d *Daemon) dialLeg(ctx context.Context, s *mapSpec, i int, restore bool) legConn {
	l := s.withSpares()[i]
	var c legConn
	dctx, cancel := context.WithTimeout(ctx, legDialTimeout)
	defer cancel()
	if c.cs, c.err = d.dial(dctx, l.SessName, l.SessUUID, s.Transport, s.legPaths[i], restore); c.err != nil {
		return c
	}
	if err := (&session{cs: c.cs}).set(s.Settings); err != nil { // checked by normalize
		d.log.WithError(err).WithField("session", l.SessName).Warn("session settings")
	}
	if c.dev, c.err = c.cs.Map(dctx, l.DevicePath, rnbd.AccessRW); c.err != nil {
		c.cs.Close()
		c.cs = nil
	}
	return c
}

// rejoin dials leg i of the mirror (i = the number of legs: the
// witness) as s says, through a new session, and has the mirror take it
// back (a device new to it is rebuilt in full). The old conn is closed
// first where the new session has its name, else once the new leg is
// taken: a replacement that fails leaves the leg as it was. md.rejoinMu
// is held.
func (d *Daemon) rejoin(ctx context.Context, md *mirrorDev, i int, s *mapSpec, restore bool) error {
	closeConn := func(c legConn) {
		if c.dev != nil {
			c.dev.Unmap(ctx) // a fenced leg's session is closed already
		}
		if c.cs != nil {
			c.cs.Close()
		}
	}
	md.mu.Lock()
	conn := md.conns()[i]
	old := *conn
	same := md.spec.legs()[i].SessName == s.legs()[i].SessName
	if same {
		*conn = legConn{err: errors.New("rejoining")}
	}
	md.mu.Unlock()
	if same {
		closeConn(old)
	}
	c := d.dialLeg(ctx, s, i, restore)
	if c.err == nil {
		// Bounded as the dial: a leg that answers the dial and then
		// hangs is not waited for (its resync runs on its own).
		rctx, cancel := context.WithTimeout(ctx, legDialTimeout)
		if i == len(s.Legs) {
			c.err = md.m.RejoinWitness(rctx, c.dev, s.legTitle(i))
		} else {
			c.err = md.m.Rejoin(rctx, i, c.dev, s.legTitle(i))
		}
		cancel()
		if c.err != nil {
			closeConn(c)
			c.dev, c.cs = nil, nil
		}
	}
	if !same && c.err != nil {
		return c.err
	}
	md.mu.Lock()
	*conn = c
	md.mu.Unlock()
	if !same {
		closeConn(old)
	}
	return c.err
}

// legTitle names leg i of s.legs() with its session and device, for
// logs and the mirror's messages.
func (s *mapSpec) legTitle(i int) string {
	l := s.legs()[i]
	return fmt.Sprintf("%s (%s/%s)", s.legName(i), l.SessName, l.DevicePath)
}

// sessUUID is a session's UUID as the mapping keeps it.
func sessUUID(cs *rnbd.CltSession) string {
	u := cs.Session().UUID()
	return fmt.Sprintf("%x", u[:])
}

// mirrorInfo is what the mirror offers: what every leg reached can do
// (the smallest limits, the largest blocks), the cache of any.
func mirrorInfo(md *mirrorDev) rnbd.OpenRsp {
	var out rnbd.OpenRsp
	first := true
	for _, c := range md.legs {
		if c.dev == nil {
			continue
		}
		in := c.dev.Info()
		if first {
			out, first = in, false
			continue
		}
		out.MaxHWSectors = min(out.MaxHWSectors, in.MaxHWSectors)
		out.MaxWriteZeroesSectors = min(out.MaxWriteZeroesSectors, in.MaxWriteZeroesSectors)
		out.MaxDiscardSectors = min(out.MaxDiscardSectors, in.MaxDiscardSectors)
		out.DiscardGranularity = max(out.DiscardGranularity, in.DiscardGranularity)
		out.PhysicalBlockSize = max(out.PhysicalBlockSize, in.PhysicalBlockSize)
		out.LogicalBlockSize = max(out.LogicalBlockSize, in.LogicalBlockSize)
		out.MaxSegments = min(out.MaxSegments, in.MaxSegments)
		out.CachePolicy |= in.CachePolicy
	}
	out.SecureDiscard, out.DiscardAlignment = 0, 0
	out.NSectors = uint64(md.m.Size()) / 512
	return out
}

// legRecords are a mirror's legs and witness for its device record.
func (d *mirrorDev) legRecords() []api.CltLegRecord {
	states := d.m.LegStates()
	p := d.m.Resync()
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.spec
	var out []api.CltLegRecord
	for i, c := range d.conns() {
		r := api.CltLegRecord{Leg: strconv.Itoa(i)}
		l := s.Witness
		if i < len(s.Legs) {
			l = &s.Legs[i]
		} else {
			r.Leg = "witness"
		}
		r.SessName, r.DevicePath = l.SessName, l.DevicePath
		switch {
		case c.dev == nil:
			r.State = "missing"
		case i == len(s.Legs) && !d.m.WitnessVoting():
			r.State = "missing" // dialled again
		case i == len(s.Legs):
			r.State = "voting"
		case states[i] == "out":
			r.State = "stale"
		default:
			r.State = states[i]
		}
		if i == p.Leg {
			r.Resync, r.ResyncTotal = p.Copied, p.Total
		}
		out = append(out, r)
	}
	for j, l := range s.Spares {
		out = append(out, api.CltLegRecord{Leg: "spare" + strconv.Itoa(j), SessName: l.SessName, DevicePath: l.DevicePath, State: "spare"})
	}
	return out
}

// state is the mirror's device state: open with every leg in sync,
// degraded with one out, failed when it lost its quorum.
func (d *mirrorDev) state() string {
	if d.m.Failed() {
		return "failed"
	}
	for _, st := range d.m.LegStates() {
		if st != "in sync" {
			return "degraded"
		}
	}
	return "open"
}
