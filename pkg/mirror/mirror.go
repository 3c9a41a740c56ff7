package mirror

import (
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Config is what a mirror is opened with: its layout and the RNBD
// devices of its voters, each mapped read-write through a session of its
// own to its storage node.
type Config struct {
	Layout Layout
	// Legs are the leg devices by index (len Layout.NLegs); nil: the
	// leg's storage node was not reached.
	Legs []*rnbd.CltDev
	// Witness is the witness device (Layout.Witness); nil: not reached.
	Witness *rnbd.CltDev
	// Names name the voters in messages, legs by index, then the
	// witness ("leg 1 (storage-b/pvc-…)"); empty: "leg N".
	Names []string
	// NewLegs marks legs that are new devices, to be rebuilt in full
	// (a replaced storage node): their superblock may be missing.
	NewLegs []int
	// Force serves without the proof Assemble asks for.
	Force *Force
	Log   *log.Entry
	// Rand gives the generations' random ids; nil: crypto/rand.
	Rand func() uint64
	// Now is the clock the bitmap's cleaning goes by; nil: time.Now.
	Now func() time.Time
	// LegTimeout is how long a voter may hold requests without
	// completing any before it is fenced: its session closed (its
	// requests end with errors, none can touch a buffer after) and the
	// leg taken out. Default 5 s.
	LegTimeout time.Duration
}

// DefaultLegTimeout is Config.LegTimeout's default.
const DefaultLegTimeout = 5 * time.Second

// Leg states in memory, for IO (the superblock's say what is committed).
const (
	legOut  int32 = iota // not written, not read
	legIn                // in sync: written and read
	legSync              // being resynced: written, not read
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
	// the leg timeout.
	fenced atomic.Bool
}

// legIO is what the leg timeout watches: the requests outstanding on a
// voter, and when it last made progress (Unix ns: a request done, or
// the first sent after none was outstanding).
type legIO struct {
	inflight atomic.Int32
	progress atomic.Int64
}

func (l *legIO) start() {
	if l.inflight.Add(1) == 1 {
		l.progress.Store(time.Now().UnixNano())
	}
}

func (l *legIO) done() {
	l.progress.Store(time.Now().UnixNano())
	l.inflight.Add(-1)
}

// do runs one request on the voter, watched by the leg timeout.
func (v *voter) do(ctx context.Context, op rnbd.Op, flags uint32, off int64, n int, buf *rtrs.Buffer) error {
	v.io.start()
	defer v.io.done()
	return v.dev.Do(ctx, op, flags, off, n, buf, 0)
}

// Mirror is an assembled mirror: one device over its legs. Submit is
// safe for concurrent use.
type Mirror struct {
	cfg  Config
	log  *log.Entry
	size int64
	bm   *Bitmap
	rand func() uint64

	legs    [MaxLegs]*voter // nil: not reached
	witness *voter
	state   [MaxLegs]atomic.Int32

	// memberSeq counts the changes of the legs' states in memory;
	// committedSeq is the one the last commit recorded. A write
	// completing while they differ waits (held) for the commit.
	memberSeq    atomic.Uint64
	committedSeq atomic.Uint64
	// failed: the mirror lost its quorum or every leg: IO fails.
	failed atomic.Bool

	// metaMu serializes metadata IO and changes of the superblock.
	metaMu sync.Mutex
	// +checklocks:metaMu
	sb Superblock
	// +checklocks:metaMu
	bmBuf []byte // a bitmap block's bytes for the legs

	heldMu sync.Mutex
	// +checklocks:heldMu
	held []*mreq
	wake chan struct{}
	done chan struct{}
	wg   sync.WaitGroup

	rr    atomic.Uint32
	reqs  sync.Pool
	stats Stats
}

// Stats counts what the mirror did, for its records and metrics.
type Stats struct {
	TakenOut   atomic.Uint64 // legs taken out
	Commits    atomic.Uint64 // generations committed
	ReadRetry  atomic.Uint64 // reads served by another leg after an error
	Reconciled atomic.Uint64 // bytes copied at assembly (a crash's dirty regions, resyncs)
	Fenced     atomic.Uint64 // voters fenced by the leg timeout
}

// Open reads the superblocks of the voters reached, decides with
// Assemble, commits the next generation, makes the legs identical where
// the bitmaps say they may differ and resyncs the legs that came back,
// then serves. A refusal is a *RefusedError.
func Open(ctx context.Context, cfg Config) (*Mirror, error) {
	l := cfg.Layout
	if len(cfg.Legs) != l.NLegs {
		return nil, fmt.Errorf("mirror: %d leg devices for %d legs", len(cfg.Legs), l.NLegs)
	}
	m := &Mirror{cfg: cfg, log: cfg.Log, rand: cfg.Rand, wake: make(chan struct{}, 1), done: make(chan struct{})}
	if m.log == nil {
		m.log = log.Discard()
	}
	if m.rand == nil {
		m.rand = cryptoRand
	}
	if m.cfg.Now == nil {
		m.cfg.Now = time.Now
	}
	if m.cfg.LegTimeout <= 0 {
		m.cfg.LegTimeout = DefaultLegTimeout
	}
	var err error
	for i, dev := range cfg.Legs {
		if dev != nil {
			if m.legs[i], err = newVoter(i, m.name(i), dev); err != nil {
				m.freeBuffers()
				return nil, err
			}
		}
	}
	if l.Witness && cfg.Witness != nil {
		if m.witness, err = newVoter(WitnessIndex, m.name(WitnessIndex), cfg.Witness); err != nil {
			m.freeBuffers()
			return nil, err
		}
	}
	// From here a voter that holds a request past the leg timeout is
	// fenced, during the assembly too.
	m.wg.Add(1)
	go m.watch()
	var voters []Voter
	for _, i := range l.indexes() {
		v := Voter{Index: i, Name: m.name(i), Err: errors.New("not reached")}
		if x := m.voter(i); x != nil {
			v.SB, v.Err = x.read(ctx)
			if v.SB == nil && v.Err == ErrNoSuperblock && contains(cfg.NewLegs, i) {
				v.UUID = legDeviceUUID(m.rand)
			}
		}
		voters = append(voters, v)
	}
	d, err := Assemble(l, voters, cfg.Force, m.rand())
	if err != nil {
		m.stop()
		return nil, err
	}
	if d.Forced {
		m.log.WithFields(log.Fields{"by": cfg.Force.By, "generation": d.Next.Gen.String()}).Warn("mirror assembled by force: writes only the legs left out had may be lost")
	}
	if err := m.serve(ctx, d); err != nil {
		m.stop()
		return nil, err
	}
	return m, nil
}

// Create makes a new mirror over legs that hold the same bytes (new,
// zeroed volumes): every leg in sync at epoch 1, the witness's record
// too, the bitmaps clean. It refuses a device that holds a superblock.
func Create(ctx context.Context, cfg Config) error {
	l := cfg.Layout
	if len(cfg.Legs) != l.NLegs || l.Witness != (cfg.Witness != nil) {
		return fmt.Errorf("mirror: create needs every voter's device")
	}
	rnd := cfg.Rand
	if rnd == nil {
		rnd = cryptoRand
	}
	size := int64(-1)
	for _, d := range cfg.Legs {
		if d == nil {
			return fmt.Errorf("mirror: create needs every leg")
		}
		if s := d.Size() - DataOff; size < 0 || s < size {
			size = s
		}
	}
	size &^= 4095
	if size <= 0 {
		return fmt.Errorf("mirror: a leg of %d bytes holds no data after the %d of metadata", size+DataOff, DataOff)
	}
	sb := Superblock{Mirror: l.Mirror, NLegs: uint8(l.NLegs), RegionShift: RegionShiftFor(uint64(size)), DataSize: uint64(size),
		Gen: Gen{Epoch: 1, ID: rnd()}}
	if l.Witness {
		sb.Flags |= FlagWitness
	}
	for i := range cfg.Legs {
		sb.Legs[i] = Leg{UUID: legDeviceUUID(rnd), State: LegInSync}
	}
	devs := append([]*rnbd.CltDev(nil), cfg.Legs...)
	if l.Witness {
		devs = append(devs, cfg.Witness)
	}
	for j, dev := range devs {
		idx := j
		if j == l.NLegs {
			idx = WitnessIndex
		}
		v, err := newVoter(idx, fmt.Sprint(idx), dev)
		if err != nil {
			return err
		}
		_, rerr := v.read(ctx)
		if !errors.Is(rerr, ErrNoSuperblock) {
			v.buf.Free()
			return fmt.Errorf("mirror: voter %d holds a superblock already (or cannot be read): %v", idx, rerr)
		}
		if idx != WitnessIndex {
			// The bitmap, clean.
			zero := make([]byte, BitmapBlock)
			b, _ := NewBitmap(sb.DataSize, sb.RegionShift)
			for blk := range b.Blocks() {
				copy(v.buf.Bytes(), zero)
				if err := v.dev.Do(ctx, rnbd.OpWrite, rnbd.FFUA, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf, 0); err != nil {
					v.buf.Free()
					return fmt.Errorf("mirror: leg %d: bitmap: %w", idx, err)
				}
			}
		}
		c := sb
		c.Index = uint8(idx)
		err = v.write(ctx, &c)
		v.buf.Free()
		if err != nil {
			return err
		}
	}
	return nil
}

func newVoter(i int, name string, dev *rnbd.CltDev) (*voter, error) {
	if dev.Mode() != rnbd.AccessRW {
		return nil, fmt.Errorf("mirror: %s is mapped %v: a mirror's voters are mapped rw, its one writer", name, dev.Mode())
	}
	buf, err := dev.Session().Session().AllocBuffer(2 * SlotSize)
	if err != nil {
		return nil, err
	}
	return &voter{index: i, name: name, dev: dev, buf: buf}, nil
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

func (m *Mirror) name(i int) string {
	j := i
	if i == WitnessIndex {
		j = m.cfg.Layout.NLegs
	}
	if j < len(m.cfg.Names) && m.cfg.Names[j] != "" {
		return m.cfg.Names[j]
	}
	return voterName(i, "")
}

func (m *Mirror) freeBuffers() {
	for _, v := range append(m.legs[:], m.witness) {
		if v != nil && v.buf != nil {
			v.buf.Free()
			v.buf = nil
		}
	}
}

// serve commits the assembly's generation, reconciles and resyncs, and
// starts the mirror's worker.
func (m *Mirror) serve(ctx context.Context, d Decision) error {
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	m.size = int64(d.Next.DataSize)
	bm, err := NewBitmap(d.Next.DataSize, d.Next.RegionShift)
	if err != nil {
		return err
	}
	m.bm, m.bmBuf = bm, make([]byte, BitmapBlock)
	// The union of the bitmaps of the legs in sync and of those that
	// resync from them: what may differ.
	for _, i := range append(append([]int(nil), d.InSync...), d.Resync...) {
		if contains(d.Full, i) {
			continue
		}
		v := m.legs[i]
		for blk := range bm.Blocks() {
			if err := v.do(ctx, rnbd.OpRead, 0, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf); err != nil {
				return fmt.Errorf("mirror: %s: reading its bitmap: %w", v.name, err)
			}
			if err := bm.Load(blk, v.buf.Bytes()); err != nil {
				return fmt.Errorf("mirror: %s: %w", v.name, err)
			}
		}
	}
	for _, i := range d.InSync {
		m.state[i].Store(legIn)
	}
	for _, i := range d.Resync {
		m.state[i].Store(legSync)
	}
	if err := m.commitLocked(ctx, d.Next); err != nil {
		return err
	}
	// Before a read may see a difference: every marked region copied
	// from the source to the other legs; the legs to rebuild in full,
	// whole.
	if err := m.reconcileLocked(ctx, d); err != nil {
		return err
	}
	m.committedSeq.Store(m.memberSeq.Load())
	m.wg.Add(1)
	go m.worker() // the watchdog runs since Open
	return nil
}

// commitLocked writes next to the voters reached and not out: a write
// quorum with every leg in sync in it, or an error (and the mirror
// fails).
// +checklocks:m.metaMu
func (m *Mirror) commitLocked(ctx context.Context, next Superblock) error {
	for {
		wrote := 0
		lost := false
		for _, v := range append(m.legs[:], m.witness) {
			if v == nil || v.index != WitnessIndex && m.state[v.index].Load() == legOut {
				continue
			}
			if err := v.write(ctx, &next); err != nil {
				m.log.WithError(err).Warn("mirror: a voter did not take the new generation")
				if v.index != WitnessIndex {
					m.markOut(v.index)
					lost = true
				}
				continue
			}
			wrote++
		}
		if lost {
			// A leg that took it no more is out in a newer generation.
			next = m.stateSuperblock(&next)
			continue
		}
		if wrote < m.cfg.Layout.WriteQuorum() {
			m.failed.Store(true)
			return &RefusedError{Reason: fmt.Sprintf("generation %v reached %d voters", next.Gen, wrote),
				Need: fmt.Sprintf("%d of its %d voters", m.cfg.Layout.WriteQuorum(), m.cfg.Layout.Voters())}
		}
		m.sb = next
		m.stats.Commits.Add(1)
		return nil
	}
}

// stateSuperblock is the generation after base with the legs as they
// are in memory.
func (m *Mirror) stateSuperblock(base *Superblock) Superblock {
	next := base.Derive(m.rand())
	for i := 0; i < m.cfg.Layout.NLegs; i++ {
		switch m.state[i].Load() {
		case legIn:
			next.Legs[i].State, next.Legs[i].Cursor = LegInSync, 0
		case legSync:
			next.Legs[i].State = LegResyncing
		default:
			next.Legs[i].State, next.Legs[i].Cursor = LegOutdated, 0
		}
	}
	next.Flags &^= FlagForced
	return next
}

// markOut takes leg i out in memory: no IO goes to it from now on, and
// writes complete only after a commit that records it.
func (m *Mirror) markOut(i int) {
	if m.state[i].Swap(legOut) != legOut {
		m.memberSeq.Add(1)
		m.stats.TakenOut.Add(1)
		m.log.WithField("leg", m.name(i)).Warn("mirror: leg taken out")
		select {
		case m.wake <- struct{}{}:
		default:
		}
	}
}

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
		return m.cleanLocked(ctx)
	}
	src := m.legs[d.Source]
	const chunk = 1 << 20
	buf, err := src.dev.Session().Session().AllocBuffer(chunk)
	if err != nil {
		return err
	}
	defer buf.Free()
	shared := map[int]*rtrs.Buffer{}
	defer freeShared(shared)
	for _, i := range targets {
		if shared[i], err = m.legs[i].dev.Session().Session().ShareBuffer(buf); err != nil {
			return err
		}
	}
	var full, part []int
	for _, i := range targets {
		if contains(d.Full, i) {
			full = append(full, i)
		} else {
			part = append(part, i)
		}
	}
	c := copier{m: m, src: src, buf: buf, shared: shared}
	if len(full) > 0 {
		if err := c.copy(ctx, 0, m.size, full); err != nil {
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
		if err := m.legs[i].do(ctx, rnbd.OpFlush, 0, 0, 0, nil); err != nil {
			return fmt.Errorf("mirror: flushing %s: %w", m.legs[i].name, err)
		}
		m.state[i].Store(legIn)
	}
	if err := m.commitLocked(ctx, m.stateSuperblock(&m.sb)); err != nil {
		return err
	}
	return m.cleanLocked(ctx)
}

// cleanLocked clears the bitmap, on the legs too, when every leg is in
// sync: nothing is in flight at assembly, and no leg is away to have
// missed a marked region.
// +checklocks:m.metaMu
func (m *Mirror) cleanLocked(ctx context.Context) error {
	for i := range m.cfg.Layout.NLegs {
		if m.state[i].Load() != legIn {
			return nil
		}
	}
	for _, blk := range m.bm.Clean(m.cfg.Now()) {
		if err := m.storeBitmapLocked(ctx, blk); err != nil {
			return err
		}
	}
	return nil
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
}

// copy copies [off, off+n) of the data from the source to the legs to.
func (c copier) copy(ctx context.Context, off, n int64, to []int) error {
	chunk := int64(len(c.buf.Bytes()))
	for n > 0 {
		l := min(n, chunk)
		if err := c.src.do(ctx, rnbd.OpRead, 0, DataOff+off, int(l), c.buf); err != nil {
			return fmt.Errorf("mirror: reading %s to copy it: %w", c.src.name, err)
		}
		for _, i := range to {
			if err := c.m.legs[i].do(ctx, rnbd.OpWrite, 0, DataOff+off, int(l), c.shared[i]); err != nil {
				return fmt.Errorf("mirror: copying to %s: %w", c.m.legs[i].name, err)
			}
		}
		c.m.stats.Reconciled.Add(uint64(l) * uint64(len(to)))
		off, n = off+l, n-l
	}
	return nil
}

// Size is the mirror's size in bytes.
func (m *Mirror) Size() int64 { return m.size }

// Stats is the mirror's counters.
func (m *Mirror) Stats() *Stats { return &m.stats }

// LegStates is each leg's state as IO sees it: "in sync", "resyncing" or
// "out".
func (m *Mirror) LegStates() []string {
	out := make([]string, m.cfg.Layout.NLegs)
	for i := range out {
		out[i] = [...]string{"out", "in sync", "resyncing"}[m.state[i].Load()]
	}
	return out
}

// Generation is the last generation committed.
func (m *Mirror) Generation() Gen {
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	return m.sb.Gen
}

// Buffer is memory a mirror's requests carry data in: registered with
// each leg's session.
type Buffer struct {
	legs [MaxLegs]*rtrs.Buffer
	b    []byte
}

// Bytes is the buffer's memory.
func (b *Buffer) Bytes() []byte { return b.b }

// AllocBuffer allocates n bytes usable by every leg IO goes to.
func (m *Mirror) AllocBuffer(n int) (*Buffer, error) {
	b := &Buffer{}
	var owner *rtrs.Buffer
	for i, v := range m.legs {
		if v == nil || v.fenced.Load() || m.state[i].Load() == legOut {
			continue // no IO goes to it
		}
		s := v.dev.Session().Session()
		var err error
		if owner == nil {
			owner, err = s.AllocBuffer(n)
			b.legs[i] = owner
		} else {
			b.legs[i], err = s.ShareBuffer(owner)
		}
		if err != nil {
			b.Free()
			return nil, err
		}
	}
	if owner == nil {
		return nil, errors.New("mirror: no leg to allocate a buffer on")
	}
	b.b = owner.Bytes()
	return b, nil
}

// Free releases the buffer; no request may be using it.
func (b *Buffer) Free() {
	// The shared registrations first, the owner's memory last.
	owner := -1
	for i, x := range b.legs {
		if x == nil {
			continue
		}
		if owner < 0 {
			owner = i
			continue
		}
		x.Free()
	}
	if owner >= 0 {
		b.legs[owner].Free()
	}
	b.legs = [MaxLegs]*rtrs.Buffer{}
}

// Req is a request of a mirror's user (a frontend).
type Req struct {
	Op     rnbd.Op
	Flags  uint32 // rnbd.FFUA
	Off    int64
	Len    int
	Buf    *Buffer
	BufOff int
	// Done is called once, from any goroutine; it must not block.
	Done func(r *Req, err error)
}

// mreq is a request in flight: one rnbd.IOReq per leg, reused.
type mreq struct {
	m       *Mirror
	r       *Req
	legs    [MaxLegs]rnbd.IOReq
	errs    [MaxLegs]error
	sent    [MaxLegs]bool
	pending atomic.Int32
	// readLeg is the leg a read went to; tried the legs it tried.
	readLeg int
	tried   [MaxLegs]bool
	marked  bool // the bitmap counts it (EndWrite due)
}

func (m *Mirror) getReq() *mreq {
	if x, ok := m.reqs.Get().(*mreq); ok {
		return x
	}
	x := &mreq{m: m}
	for i := range x.legs {
		x.legs[i].Done = func(_ *rnbd.IOReq, err error) { x.legDone(i, err) }
	}
	return x
}

func (m *Mirror) putReq(x *mreq) {
	x.r = nil
	x.errs, x.sent, x.tried = [MaxLegs]error{}, [MaxLegs]bool{}, [MaxLegs]bool{}
	x.marked = false
	m.reqs.Put(x)
}

// errFailed is the error of IO on a mirror that lost its quorum or every
// leg.
var errFailed = fmt.Errorf("mirror: no quorum or no leg left: %w", syscall.EIO)

// Submit starts r: a read goes to one leg in sync, anything else to
// every leg written (in sync or resyncing). It returns an error without
// calling Done only for a request that cannot be valid.
func (m *Mirror) Submit(ctx context.Context, r *Req) error {
	if r.Off < 0 || r.Off%512 != 0 || r.Len < 0 || (r.Op != rnbd.OpFlush && r.Off+int64(r.Len) > m.size) {
		return syscall.EINVAL
	}
	if (r.Op == rnbd.OpRead || r.Op == rnbd.OpWrite) && (r.Buf == nil || r.BufOff < 0 || r.BufOff+r.Len > len(r.Buf.b)) {
		return syscall.EINVAL
	}
	if m.failed.Load() {
		r.Done(r, errFailed)
		return nil
	}
	x := m.getReq()
	x.r = r
	if r.Op == rnbd.OpRead {
		return m.sendRead(ctx, x)
	}
	if r.Op != rnbd.OpFlush && r.Len > 0 {
		need := m.bm.StartWrite(r.Off, int64(r.Len))
		x.marked = true
		for blk := m.bm.Pending(need); blk >= 0; blk = m.bm.Pending(need) {
			if err := m.storeBitmap(ctx, blk); err != nil {
				m.finish(x, err)
				return nil
			}
		}
	}
	// Count every leg before sending to any: a completion must not see
	// 0 while others are still to go.
	n := int32(0)
	for i := range m.cfg.Layout.NLegs {
		if m.state[i].Load() != legOut {
			x.sent[i] = true
			n++
		}
	}
	if n == 0 {
		m.finish(x, errFailed)
		return nil
	}
	x.pending.Store(n)
	// x may be done, and reused, once its last piece is sent: the loop
	// goes by a copy.
	sent := x.sent
	for i := range m.cfg.Layout.NLegs {
		if sent[i] {
			m.sendLeg(ctx, x, i, r.Op, r.Flags)
		}
	}
	return nil
}

// sendLeg submits the request's piece for leg i.
func (m *Mirror) sendLeg(ctx context.Context, x *mreq, i int, op rnbd.Op, flags uint32) {
	r := x.r
	lr := &x.legs[i]
	*lr = rnbd.IOReq{Op: op, Flags: flags, Off: DataOff + r.Off, Len: r.Len, Done: lr.Done}
	if op == rnbd.OpFlush {
		lr.Off = 0
	}
	if op == rnbd.OpRead || op == rnbd.OpWrite {
		lr.Buf, lr.BufOff = r.Buf.legs[i], r.BufOff
	}
	m.legs[i].io.start()
	if err := m.legs[i].dev.Submit(ctx, lr); err != nil {
		x.legDone(i, err)
	}
}

// sendRead sends a read to an in-sync leg it has not tried, by round
// robin, or completes it with the last error.
func (m *Mirror) sendRead(ctx context.Context, x *mreq) error {
	n := m.cfg.Layout.NLegs
	start := int(m.rr.Add(1))
	for k := range n {
		i := (start + k) % n
		if x.tried[i] || m.state[i].Load() != legIn {
			continue
		}
		x.tried[i], x.readLeg = true, i
		x.pending.Store(1)
		m.sendLeg(ctx, x, i, rnbd.OpRead, 0)
		return nil
	}
	err := errFailed
	for _, e := range x.errs {
		if e != nil {
			err = fmt.Errorf("mirror: read failed on every leg in sync: %w", e)
		}
	}
	m.finish(x, err)
	return nil
}

// legDone is a leg's completion of x's piece.
func (x *mreq) legDone(i int, err error) {
	x.m.legs[i].io.done()
	x.errs[i] = err
	if x.pending.Add(-1) != 0 {
		return
	}
	m := x.m
	if x.r.Op == rnbd.OpRead {
		if err == nil {
			m.finish(x, nil)
			return
		}
		if !legFault(err) {
			m.finish(x, err)
			return
		}
		m.markOut(i)
		m.stats.ReadRetry.Add(1)
		// Another leg; not from this callback, which must not block.
		go m.sendRead(context.Background(), x)
		return
	}
	ok := 0
	for j, e := range x.errs {
		if x.sent[j] && e == nil {
			ok++
		}
	}
	for j, e := range x.errs {
		// A leg that failed where another did not now differs from
		// it, whatever the error: out. Where none took it, only the
		// legs' own faults are (a request every leg refuses changed
		// nothing).
		if x.sent[j] && e != nil && (ok > 0 || legFault(e)) {
			m.markOut(j)
		}
	}
	if ok == 0 {
		m.finish(x, fmt.Errorf("mirror: no leg took it: %w", firstErr(x.errs[:])))
		return
	}
	m.complete(x)
}

// legFault says whether err is a leg's failure (it is taken out) rather
// than the request's own (every leg would say the same).
func legFault(err error) bool {
	for _, e := range []error{syscall.EINVAL, syscall.ENOSPC, syscall.EOPNOTSUPP, syscall.EROFS} {
		if errors.Is(err, e) {
			return false
		}
	}
	return true
}

func firstErr(errs []error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return syscall.EIO
}

// complete acknowledges a write once the legs' states it ran under are
// committed, else holds it for the worker.
func (m *Mirror) complete(x *mreq) {
	if m.committedSeq.Load() >= m.memberSeq.Load() {
		m.finish(x, nil)
		return
	}
	m.heldMu.Lock()
	m.held = append(m.held, x)
	m.heldMu.Unlock()
	select {
	case m.wake <- struct{}{}:
	default:
	}
}

// finish ends x with err.
func (m *Mirror) finish(x *mreq, err error) {
	r := x.r
	if x.marked {
		m.bm.EndWrite(r.Off, int64(r.Len), m.cfg.Now())
	}
	m.putReq(x)
	r.Done(r, err)
}

// storeBitmap writes bitmap block blk to every leg written.
func (m *Mirror) storeBitmap(ctx context.Context, blk int) error {
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	return m.storeBitmapLocked(ctx, blk)
}

// +checklocks:m.metaMu
func (m *Mirror) storeBitmapLocked(ctx context.Context, blk int) error {
	change := m.bm.Snapshot(blk, m.bmBuf)
	wrote := 0
	for i, v := range m.legs {
		if v == nil || m.state[i].Load() == legOut {
			continue
		}
		copy(v.buf.Bytes(), m.bmBuf)
		if err := v.do(ctx, rnbd.OpWrite, rnbd.FFUA, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf); err != nil {
			m.markOut(i)
			continue
		}
		wrote++
	}
	if wrote == 0 {
		m.failed.Store(true)
		return errFailed
	}
	m.bm.Written(blk, change)
	return nil
}

// worker commits the legs' states when they change, then releases the
// writes held for that.
func (m *Mirror) worker() {
	defer m.wg.Done()
	for {
		select {
		case <-m.done:
			return
		case <-m.wake:
		}
		m.commitChanges()
	}
}

func (m *Mirror) commitChanges() {
	want := m.memberSeq.Load()
	var err error
	if m.committedSeq.Load() < want {
		m.metaMu.Lock()
		err = m.commitLocked(context.Background(), m.stateSuperblock(&m.sb))
		m.metaMu.Unlock()
		if err == nil {
			m.committedSeq.Store(want)
		} else {
			m.log.WithError(err).Error("mirror: the legs' new states could not be committed: IO fails")
		}
	}
	m.heldMu.Lock()
	held := m.held
	m.held = nil
	m.heldMu.Unlock()
	var again []*mreq
	for _, x := range held {
		switch {
		case err != nil || m.failed.Load():
			m.finish(x, errFailed)
		case m.committedSeq.Load() >= m.memberSeq.Load():
			m.finish(x, nil)
		default:
			again = append(again, x)
		}
	}
	if len(again) > 0 {
		m.heldMu.Lock()
		m.held = append(m.held, again...)
		m.heldMu.Unlock()
		select {
		case m.wake <- struct{}{}:
		default:
		}
	}
}

// Close stops the mirror: no request may be in flight. The legs'
// devices stay the caller's (a fenced leg's session is closed).
func (m *Mirror) Close() { m.stop() }

func (m *Mirror) stop() {
	close(m.done)
	m.wg.Wait()
	m.freeBuffers()
}

// voter is voter i (a leg's index, or WitnessIndex), nil if not reached.
func (m *Mirror) voter(i int) *voter {
	if i == WitnessIndex {
		return m.witness
	}
	return m.legs[i]
}

// watch fences a voter that holds requests past the leg timeout
// without completing any.
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
		now := time.Now().UnixNano()
		for _, i := range m.cfg.Layout.indexes() {
			v := m.voter(i)
			if v == nil || v.fenced.Load() || v.io.inflight.Load() == 0 {
				continue
			}
			if now-v.io.progress.Load() > int64(m.cfg.LegTimeout) {
				m.fence(v)
			}
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

func cryptoRand() uint64 {
	var b [8]byte
	crand.Read(b[:])
	return binary.LittleEndian.Uint64(b[:])
}

func legDeviceUUID(rnd func() uint64) [16]byte {
	var u [16]byte
	for u == ([16]byte{}) {
		binary.LittleEndian.PutUint64(u[:], rnd())
		binary.LittleEndian.PutUint64(u[8:], rnd())
	}
	return u
}

func contains(xs []int, x int) bool {
	for _, y := range xs {
		if y == x {
			return true
		}
	}
	return false
}
