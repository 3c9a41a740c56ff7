package mirror

import (
	"cmp"
	"context"
	crand "crypto/rand"
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"slices"
	"sync"
	"sync/atomic"
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
	// ResyncRate bounds a resync's copy, bytes per second; 0:
	// DefaultResyncRate.
	ResyncRate int64
	// RegionSize is the bitmap's region size Create gives a new mirror:
	// a power of two from 64 KiB to 1 GiB; 0: 4 MiB, or more for a
	// mirror too large for a bitmap of 4 MiB at that size
	// (RegionShiftFor).
	RegionSize int64
	// cleanEvery, in tests, is the cleaning's period; 0: cleanEvery.
	cleanEvery time.Duration
	// ReadPolicy chooses the leg of each read among those in sync, as
	// a session's mpath_policy chooses a path: round-robin (the zero
	// value), min-inflight (the leg with the fewest requests in flight)
	// or min-latency (the leg whose session's paths answer heartbeats
	// fastest, measured every quarter of LegTimeout).
	ReadPolicy rtrs.MPPolicy
}

// DefaultLegTimeout is Config.LegTimeout's default.
const DefaultLegTimeout = 5 * time.Second

// Leg states in memory, for IO (the superblock's say what is committed).
const (
	legOut  int32 = iota // not written, not read
	legIn                // in sync: written and read
	legSync              // being resynced: written, not read
)

// Mirror is an assembled mirror: one device over its legs. Submit is
// safe for concurrent use.
type Mirror struct {
	cfg Config
	log *log.Entry
	// size is the bytes of data; it grows (Grow), never shrinks.
	size atomic.Int64
	bm   *Bitmap
	rand func() uint64

	// legs are the legs' voters (nil: not reached), replaced when a
	// leg rejoins.
	legs [MaxLegs]atomic.Pointer[voter]
	// witness is the witness's voter (nil: not reached), replaced when
	// it is dialled again (RejoinWitness).
	witness atomic.Pointer[voter]
	state   [MaxLegs]atomic.Int32

	// memberSeq counts the changes of the legs' states in memory;
	// committedSeq is the one the last commit recorded. A write
	// completing while they differ waits (held) for the commit.
	memberSeq    atomic.Uint64
	committedSeq atomic.Uint64
	// failed: the mirror lost its quorum or every leg: IO fails.
	failed atomic.Bool
	// closing: Quiesce was called.
	closing atomic.Bool

	// growMu serializes Grows.
	growMu sync.Mutex
	// metaMu serializes metadata IO and changes of the superblock.
	metaMu sync.Mutex
	// +checklocks:metaMu
	sb Superblock
	// +checklocks:metaMu
	bmBuf []byte // a bitmap block's bytes for the legs

	// bufMu guards the buffers' registrations with the legs' sessions.
	bufMu sync.Mutex
	// +checklocks:bufMu
	bufs map[*Buffer]struct{}

	heldMu sync.Mutex
	// +checklocks:heldMu
	held []*mreq
	wake chan struct{}
	done chan struct{}
	wg   sync.WaitGroup

	rs resyncGate
	// copyRead, in tests, runs between a resync's read of a window and
	// its write to the leg.
	copyRead func(off, n int64)
	// grew, in tests, runs when Grow has zeroed the bytes added;
	// zeroByWrites has it zero them as on a device without write-zeroes.
	grew         func()
	zeroByWrites bool
	rr           atomic.Uint32
	reqs         sync.Pool
	stats        Stats
}

// Stats counts what the mirror did, for its records and metrics.
type Stats struct {
	TakenOut   atomic.Uint64 // legs taken out
	Commits    atomic.Uint64 // generations committed
	ReadRetry  atomic.Uint64 // reads served by another leg after an error
	Reconciled atomic.Uint64 // bytes copied at assembly (a crash's dirty regions, resyncs)
	Fenced     atomic.Uint64 // voters fenced by the leg timeout
	Repaired   atomic.Uint64 // blocks a leg could not read, rewritten from another (repair.go)
	Cleaned    atomic.Uint64 // regions cleared in the bitmap by its cleaning (reconcile.go)
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
	m := &Mirror{cfg: cfg, log: cfg.Log, rand: cfg.Rand, wake: make(chan struct{}, 1), done: make(chan struct{}),
		bufs: map[*Buffer]struct{}{}}
	m.rs.init()
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
			v, err := newVoter(i, m.name(i), dev)
			if err != nil {
				m.freeBuffers()
				return nil, err
			}
			m.legs[i].Store(v)
			m.watchReopen(v)
		}
	}
	if l.Witness && cfg.Witness != nil {
		w, err := newVoter(WitnessIndex, m.name(WitnessIndex), cfg.Witness)
		if err != nil {
			m.freeBuffers()
			return nil, err
		}
		m.witness.Store(w)
		m.watchReopen(w)
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
			if v.SB == nil && v.Err == ErrNoSuperblock && slices.Contains(cfg.NewLegs, i) {
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
	_, err := create(ctx, cfg, false)
	return err
}

// CreateIfNew makes a new mirror as Create does where none was ever
// served on these voters: each holds no superblock, or one of this
// mirror at epoch 1 — a Create that stopped part way, which no assembly
// ever committed, so no write to it was ever acknowledged (an assembly
// commits epoch 2 or later before it serves). That is what a volume's
// first map does, and every retry of it (rnbd-csi's NodeStageVolume).
// Where a voter holds a later generation of this mirror it writes
// nothing and reports false: the mirror exists, Open assembles it. A
// voter not reached, or a superblock of anything else, is an error.
func CreateIfNew(ctx context.Context, cfg Config) (created bool, err error) {
	return create(ctx, cfg, true)
}

// ErrCreateNeedsEvery: a new mirror is made on every voter at once.
var ErrCreateNeedsEvery = errors.New("mirror: create needs every voter")

// cfgName is cfg's name of voter j (legs, then the witness), if it has one.
func cfgName(cfg Config, j int) string {
	if j < len(cfg.Names) {
		return cfg.Names[j]
	}
	return ""
}

func create(ctx context.Context, cfg Config, ifNew bool) (bool, error) {
	l := cfg.Layout
	if len(cfg.Legs) != l.NLegs || !l.Witness && cfg.Witness != nil {
		return false, fmt.Errorf("mirror: %d legs and a witness given for a layout of %d legs, witness %t", len(cfg.Legs), l.NLegs, l.Witness)
	}
	rnd := cfg.Rand
	if rnd == nil {
		rnd = cryptoRand
	}
	devs := append([]*rnbd.CltDev(nil), cfg.Legs...)
	if l.Witness {
		devs = append(devs, cfg.Witness)
	}
	// Every voter read before any is written: a create that stops part
	// way leaves epoch-1 superblocks, which CreateIfNew writes over.
	voters := make([]*voter, len(devs))
	defer func() {
		for _, v := range voters {
			if v != nil {
				v.buf.Free()
			}
		}
	}()
	var missing error
	for j, dev := range devs {
		idx := j
		if j == l.NLegs {
			idx = WitnessIndex
		}
		if dev == nil {
			missing = fmt.Errorf("%w: %s was not reached", ErrCreateNeedsEvery, voterName(idx, cfgName(cfg, j)))
			continue
		}
		v, err := newVoter(idx, voterName(idx, cfgName(cfg, j)), dev)
		if err != nil {
			return false, err
		}
		voters[j] = v
		sb, rerr := v.read(ctx)
		switch {
		case errors.Is(rerr, ErrNoSuperblock):
		case !ifNew || sb == nil:
			return false, fmt.Errorf("mirror: %s holds a superblock already (or cannot be read): %v", v.name, rerr)
		default:
			if err := l.belongs(&Voter{Index: idx, Name: v.name, SB: sb}); err != nil {
				return false, fmt.Errorf("%w: not creating over it", err)
			}
			if sb.Gen.Epoch > 1 {
				return false, nil // served once: it exists
			}
		}
	}
	if missing != nil {
		return false, missing
	}
	size := int64(-1)
	for _, d := range cfg.Legs {
		if s := d.Size() - DataOff; size < 0 || s < size {
			size = s
		}
	}
	size &^= 4095
	if size <= 0 {
		return false, fmt.Errorf("mirror: a leg of %d bytes holds no data after the %d of metadata", size+DataOff, DataOff)
	}
	shift := RegionShiftFor(uint64(size))
	if r := cfg.RegionSize; r != 0 {
		shift = uint8(bits.TrailingZeros64(uint64(r)))
		if r < 0 || r&(r-1) != 0 || shift < minRegionShift || shift > maxRegionShift {
			return false, fmt.Errorf("mirror: a region of %d bytes: a power of two from %d to %d", r, 1<<minRegionShift, 1<<maxRegionShift)
		}
		if fit := regionShiftFrom(uint64(size), shift); fit != shift {
			return false, fmt.Errorf("mirror: a region of %d bytes is too small for %d bytes of data: the bitmap holds %d regions at most", r, size, BitmapMax*8)
		}
	}
	sb := Superblock{Mirror: l.Mirror, NLegs: uint8(l.NLegs), RegionShift: shift, DataSize: uint64(size),
		Gen: Gen{Epoch: 1, ID: rnd()}}
	if l.Witness {
		sb.Flags |= FlagWitness
	}
	for i := range cfg.Legs {
		sb.Legs[i] = Leg{UUID: legDeviceUUID(rnd), State: LegInSync}
	}
	for _, v := range voters {
		if v.index != WitnessIndex {
			// The bitmap, clean.
			zero := make([]byte, BitmapBlock)
			b, _ := NewBitmap(sb.DataSize, sb.RegionShift)
			for blk := range b.Blocks() {
				copy(v.buf.Bytes(), zero)
				if err := v.dev.Do(ctx, rnbd.OpWrite, rnbd.FFUA, BitmapOff+int64(blk)*BitmapBlock, BitmapBlock, v.buf, 0); err != nil {
					return false, fmt.Errorf("mirror: leg %d: bitmap: %w", v.index, err)
				}
			}
		}
		c := sb
		c.Index = uint8(v.index)
		if err := v.write(ctx, &c); err != nil {
			return false, err
		}
	}
	return true, nil
}

func (m *Mirror) name(i int) string {
	if v := m.voter(i); v != nil {
		return v.name // a leg replaced has its new name
	}
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
	for _, v := range m.voters() {
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
	m.size.Store(int64(d.Next.DataSize))
	bm, err := NewBitmap(d.Next.DataSize, d.Next.RegionShift)
	if err != nil {
		return err
	}
	m.bm, m.bmBuf = bm, make([]byte, BitmapBlock)
	// The union of the bitmaps of the legs in sync and of those that
	// resync from them: what may differ.
	for _, i := range append(append([]int(nil), d.InSync...), d.Resync...) {
		if slices.Contains(d.Full, i) {
			continue
		}
		v := m.leg(i)
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
	go m.worker(time.NewTicker(cmp.Or(m.cfg.cleanEvery, cleanEvery))) // the watchdog runs since Open
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
		for _, v := range m.voters() {
			if v == nil || v.index != WitnessIndex && m.state[v.index].Load() == legOut {
				continue
			}
			if v.index == WitnessIndex && !v.votes() {
				// Not waited for (its session would wait for a
				// path): it misses this generation, and is
				// dialled again to take the current one.
				v.lost.Store(true)
				continue
			}
			if err := v.write(ctx, &next); err != nil {
				m.log.WithError(err).Warn("mirror: a voter did not take the new generation")
				if v.index != WitnessIndex {
					m.markOut(v.index)
					lost = true
				} else {
					v.lost.Store(true) // until dialled again
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

// watchReopen has v taken out of use when its session opens its device
// again after a reconnect (its storage node restarted, or every path
// went down): what answers at the name may be another device, or one
// that lost writes it had acknowledged from its cache. A leg goes out
// and a witness stops voting; both are dialled again, and their
// superblock checked, as any voter that comes back.
func (m *Mirror) watchReopen(v *voter) {
	v.dev.OnReopen(func() {
		if m.voter(v.index) != v || m.closing.Load() {
			return // replaced since, or the mirror is closing
		}
		m.log.WithField("voter", v.name).Warn("mirror: its device was opened again after its session reconnected: " +
			"out of use until it is dialled again and its superblock checked")
		if v.index == WitnessIndex {
			v.lost.Store(true)
			return
		}
		m.markOut(v.index)
	})
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

// Size is the mirror's size in bytes.
func (m *Mirror) Size() int64 { return m.size.Load() }

// RegionSize is the bitmap's region, bytes: what a resync copies for
// each region written while a leg was away.
func (m *Mirror) RegionSize() int64 { return m.bm.RegionSize() }

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

// Failed says whether the mirror lost its quorum or every leg: its IO
// fails until it is assembled again.
func (m *Mirror) Failed() bool { return m.failed.Load() }

// Quiesce makes the mirror end what is in flight with errors without
// judging its legs: the caller is closing their sessions (the daemon
// stops), so a leg's error from now on is not the leg's fault. Close
// follows.
func (m *Mirror) Quiesce() { m.closing.Store(true) }

// Generation is the last generation committed.
func (m *Mirror) Generation() Gen {
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	return m.sb.Gen
}

// worker commits the legs' states when they change, then releases the
// writes held for that; it cleans the bitmap at each tick of t.
func (m *Mirror) worker(t *time.Ticker) {
	defer m.wg.Done()
	defer t.Stop()
	for {
		select {
		case <-m.done:
			return
		case <-m.wake:
			m.commitChanges()
		case <-t.C:
			m.cleanQuiet()
		}
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
			m.finish(x, errFailed, nil)
		case m.committedSeq.Load() >= m.memberSeq.Load():
			m.finish(x, nil, nil)
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
		return m.witness.Load()
	}
	return m.leg(i)
}

// leg is leg i's voter, nil if not reached.
func (m *Mirror) leg(i int) *voter { return m.legs[i].Load() }

// voters are the legs' voters, then the witness's (nil: not reached).
func (m *Mirror) voters() []*voter {
	var out [MaxLegs + 1]*voter
	for i := range m.legs {
		out[i] = m.leg(i)
	}
	out[MaxLegs] = m.witness.Load()
	return out[:]
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
