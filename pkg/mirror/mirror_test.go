package mirror

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net/netip"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
	"github.com/rnbd/rnbd/test/history"
	"github.com/rnbd/rnbd/test/kit"
	"go.uber.org/goleak"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// node is a storage node on the in-memory fabric: an RNBD server of the
// files of its directory, stopped and started again as a daemon is.
type node struct {
	t    testing.TB
	net  *fabrictest.Network
	addr netip.AddrPort
	dir  string
	srv  *rnbd.Server
	rs   *rtrs.Server
}

func newNode(t testing.TB, net *fabrictest.Network, i int, files map[string]int64) *node {
	n := &node{t: t, net: net, addr: netip.AddrPortFrom(netip.AddrFrom4([4]byte{10, 30, 0, byte(i + 1)}), 1234), dir: t.TempDir()}
	for name, size := range files {
		f, err := os.Create(filepath.Join(n.dir, name))
		if err != nil {
			t.Fatal(err)
		}
		f.Truncate(size)
		f.Close()
	}
	n.start()
	t.Cleanup(n.stop)
	return n
}

func (n *node) start() {
	n.srv = rnbd.NewServer(rnbd.SrvConfig{DevSearchPath: n.dir, Log: log.Discard()})
	cfg := rtrs.DefaultSrvConfig()
	cfg.Fabric, cfg.Handler, cfg.Listen, cfg.Log = n.net.Fabric(), n.srv, []netip.AddrPort{n.addr}, log.Discard()
	cfg.QueueDepth, cfg.MaxChunkSize = 64, 128<<10
	var err error
	if n.rs, err = rtrs.NewServer(cfg); err != nil {
		n.t.Fatal(err)
	}
}

// stop is a kill: the sessions go, nothing is flushed that the files
// had not.
func (n *node) stop() {
	if n.rs != nil {
		n.rs.Close()
		n.srv.Close()
		n.rs, n.srv = nil, nil
	}
}

// file is the bytes of one of the node's files.
func (n *node) file(name string) []byte {
	b, err := os.ReadFile(filepath.Join(n.dir, name))
	if err != nil {
		n.t.Fatal(err)
	}
	return b
}

// clientAddr is the client's address on the fabric.
var clientAddr = netip.AddrFrom4([4]byte{10, 30, 9, 1})

// legNoPath is the legs' no_path_timeout in the tests: IO to a leg
// whose node is gone fails after it, and the leg is taken out.
const legNoPath = 100 * time.Millisecond

// Dials wait for a node that runs: on a loaded machine (the schedules
// run eight at once, beside other packages' tests) a dial may take
// more than a moment. A frozen node is not waited for long: it is not
// reached.
const (
	dialWait       = 10 * time.Second
	frozenDialWait = 300 * time.Millisecond
)

// client maps name on n through a session of its own; IO without a
// path fails after legNoPath.
func (n *node) client(ctx context.Context, sess, name string) (*rnbd.CltSession, *rnbd.CltDev, error) {
	return n.clientWithin(ctx, sess, name, dialWait)
}

// clientWithin is client with the dial bounded by wait.
func (n *node) clientWithin(ctx context.Context, sess, name string, wait time.Duration) (*rnbd.CltSession, *rnbd.CltDev, error) {
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = sess, n.net.Fabric(), log.Discard()
	cfg.ConnsPerPath = 2
	cfg.ReconnectDelay, cfg.ReconnectJitter = 20*time.Millisecond, time.Millisecond
	cfg.Paths = []rtrs.PathAddr{{Src: netip.AddrPortFrom(clientAddr, 0), Dst: n.addr}}
	dctx, cancel := context.WithTimeout(ctx, wait)
	defer cancel()
	s, err := rnbd.DialSession(dctx, cfg, legNoPath)
	cancel()
	dctx, cancel = context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	if err != nil {
		return nil, nil, err
	}
	// The server lets go of a crashed client's session a moment after
	// it closed: until then the device has a writer (EBUSY).
	for {
		d, err := s.Map(dctx, name, rnbd.AccessRW)
		if err == nil {
			return s, d, nil
		}
		if !errors.Is(err, syscall.EBUSY) || dctx.Err() != nil {
			s.Close()
			return nil, nil, err
		}
		time.Sleep(5 * time.Millisecond)
	}
}

const (
	testData  = 4 << 20
	legSize   = DataOff + testData
	blockSize = 4096
)

// fleet is the storage nodes of a mirror and a client of it that can
// crash and come back.
type fleet struct {
	t          testing.TB
	layout     Layout
	nodes      []*node // legs, then the witness
	sess       []*rnbd.CltSession
	m          *Mirror
	buf        *Buffer
	opened     int
	seedRnd    uint64
	legTimeout time.Duration
	resyncRate int64
	cleanEvery time.Duration
	net        *fabrictest.Network
	// frozen are the nodes whose link is silent (by index): dialled
	// with frozenDialWait.
	frozen map[int]bool
}

func newFleet(t testing.TB, nlegs int, witness bool) *fleet {
	net := fabrictest.NewNetwork()
	f := &fleet{t: t, layout: Layout{Mirror: testMirror, NLegs: nlegs, Witness: witness}, net: net, frozen: map[int]bool{}}
	for i := range nlegs {
		f.nodes = append(f.nodes, newNode(t, net, i, map[string]int64{"vol": legSize}))
	}
	if witness {
		f.nodes = append(f.nodes, newNode(t, net, nlegs, map[string]int64{"w": 1 << 20}))
	}
	t.Cleanup(func() { f.crash() })
	return f
}

func (f *fleet) devName(j int) string {
	if j == f.layout.NLegs {
		return "w"
	}
	return "vol"
}

// connect maps every voter whose node runs; the others are nil.
func (f *fleet) connect() Config {
	ctx := context.Background()
	// 64 KiB regions, the least: 64 of them in testData.
	cfg := Config{Layout: f.layout, Legs: make([]*rnbd.CltDev, f.layout.NLegs), Log: log.Discard(), LegTimeout: f.legTimeout,
		ResyncRate: f.resyncRate, RegionSize: 1 << minRegionShift, cleanEvery: f.cleanEvery}
	f.opened++
	f.seedRnd += 1000
	next := f.seedRnd
	cfg.Rand = func() uint64 { next++; return next }
	for j, n := range f.nodes {
		if n.rs == nil {
			continue
		}
		wait := dialWait
		if f.frozen[j] {
			wait = frozenDialWait
		}
		s, d, err := n.clientWithin(ctx, fmt.Sprintf("mirror-%d-%d", f.opened, j), f.devName(j), wait)
		if err != nil {
			continue
		}
		f.sess = append(f.sess, s)
		if j == f.layout.NLegs {
			cfg.Witness = d
		} else {
			cfg.Legs[j] = d
		}
	}
	return cfg
}

func (f *fleet) create() {
	if err := Create(context.Background(), f.connect()); err != nil {
		f.t.Fatal(err)
	}
	f.crash()
}

// open assembles the mirror from the voters whose nodes run.
func (f *fleet) open(force *Force) error {
	cfg := f.connect()
	cfg.Force = force
	m, err := Open(context.Background(), cfg)
	if err != nil {
		f.crash()
		return err
	}
	f.m = m
	if f.buf, err = m.AllocBuffer(blockSize); err != nil {
		f.t.Fatal(err)
	}
	return nil
}

// crash drops the client: its sessions closed under whatever is in
// flight (drain waits for those requests to end, with errors mostly),
// nothing of the mirror's metadata written on the way out.
func (f *fleet) crash(drain ...func()) {
	for _, s := range f.sess {
		s.Close()
	}
	f.sess = nil
	for _, d := range drain {
		if d != nil {
			d()
		}
	}
	if f.m != nil {
		f.buf.Free()
		f.m.Close()
		f.m = nil
	}
}

func (f *fleet) do(op rnbd.Op, off int64) error {
	done := make(chan error, 1)
	r := &Req{Op: op, Off: off, Len: blockSize, Buf: f.buf, Done: func(_ *Req, err error) { done <- err }}
	if op == rnbd.OpFlush {
		r.Off, r.Len = 0, 0
	}
	if err := f.m.Submit(context.Background(), r); err != nil {
		return err
	}
	select {
	case err := <-done:
		return err
	case <-time.After(30 * time.Second):
		f.t.Fatalf("a %v at %d did not complete in 30 s", op, off)
		return nil
	}
}

// write writes the history's value for block blk.
func (f *fleet) write(h *history.History, blk int64) error {
	w := h.BeginWrite(blk)
	history.Fill(f.buf.Bytes(), blk, w.Value)
	err := f.do(rnbd.OpWrite, blk*blockSize)
	w.Done(err)
	return err
}

// read reads block blk and checks what it holds against the history.
func (f *fleet) read(h *history.History, blk int64) error {
	r := h.BeginRead(blk)
	clear(f.buf.Bytes())
	if err := f.do(rnbd.OpRead, blk*blockSize); err != nil {
		return err
	}
	v, err := history.ValueOf(f.buf.Bytes(), blk)
	if err != nil {
		return err
	}
	return r.Done(v)
}

func checkHistory(t testing.TB, h *history.History) history.Stats {
	t.Helper()
	bad, st := h.Check()
	for _, v := range bad {
		t.Error(v)
	}
	return st
}

func TestMirrorWritesEveryLeg(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	for blk := range int64(64) {
		if err := f.write(h, blk*7%1024); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.do(rnbd.OpFlush, 0); err != nil {
		t.Fatal(err)
	}
	for blk := range int64(1024) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
	f.crash()
	// Both legs hold the data after the metadata area, the same bytes.
	a, b := f.nodes[0].file("vol"), f.nodes[1].file("vol")
	if !bytes.Equal(a[DataOff:], b[DataOff:]) || allZero(a[DataOff:]) {
		t.Fatal("the legs' data differ, or hold nothing")
	}
	if _, err := Decode(f.nodes[2].file("w")[Slot0Off:]); err != nil && !errors.Is(err, ErrNoSuperblock) {
		t.Fatal(err)
	}
}

// TestMirrorLegLost: a leg's storage node killed under writes: the leg
// is taken out, writes go on; the mirror assembled again with the node
// back resyncs it from the bitmap, and then it alone (with the witness)
// serves every write.
func TestMirrorLegLost(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	for blk := range int64(32) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	f.nodes[1].stop()
	began := time.Now()
	if err := f.write(h, 100); err != nil {
		t.Fatalf("a write after a leg's node was killed: %v", err)
	}
	t.Logf("the first write after the kill took %v", time.Since(began))
	if st := f.m.LegStates(); st[1] != "out" || st[0] != "in sync" {
		t.Fatalf("legs %v", st)
	}
	for blk := range int64(16) {
		if err := f.write(h, 200+blk); err != nil {
			t.Fatal(err)
		}
	}
	gen := f.m.Generation()
	f.crash()
	// Leg 1 back, leg 0 away: leg 1 is stale and the witness knows.
	f.nodes[1].start()
	f.nodes[0].stop()
	var re *RefusedError
	if err := f.open(nil); !errors.As(err, &re) {
		t.Fatalf("the stale leg and the witness: %v, want a refusal", err)
	} else {
		t.Logf("refused as it must: %v", err)
	}
	// Both back: leg 1 resynced by the bitmap.
	f.nodes[0].start()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	if st := f.m.LegStates(); st[0] != "in sync" || st[1] != "in sync" {
		t.Fatalf("legs %v after the resync", st)
	}
	if g := f.m.Generation(); !gen.Before(g) {
		t.Fatalf("generation %v after %v", g, gen)
	}
	copied := f.m.Stats().Reconciled.Load()
	t.Logf("resync copied %d bytes of %d", copied, testData)
	if copied == 0 || copied >= testData {
		t.Fatalf("the resync copied %d bytes: want what the bitmap marked, not nothing nor all", copied)
	}
	f.crash()
	// Now leg 1 alone with the witness: every write is there.
	f.nodes[0].stop()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	for blk := range int64(256) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
}

// TestMirrorOutLegNotRead: a leg taken out is read no more when its node
// comes back and its session maps the device again: it missed writes.
func TestMirrorOutLegNotRead(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	f.nodes[1].stop()
	for blk := range int64(8) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	f.nodes[1].start()
	kit.WaitFor(t, 10*time.Second, "leg 1's device open again", func() bool { return f.sess[1].Devices()[0].State() == rnbd.DevOpen })
	for range 4 {
		for blk := range int64(8) {
			if err := f.read(h, blk); err != nil {
				t.Fatal(err)
			}
		}
	}
	checkHistory(t, h)
}

// TestMirrorNoAckWithoutQuorum: with the witness down, a leg lost
// cannot be taken out (no write quorum): the write fails rather than be
// acknowledged on the other leg alone, which a later assembly from the
// lost leg and the witness could not know of; that assembly then serves
// the lost leg, and no acknowledged write is missing.
func TestMirrorNoAckWithoutQuorum(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	if err := f.write(h, 3); err != nil {
		t.Fatal(err)
	}
	f.nodes[2].stop()
	f.nodes[1].stop()
	if err := f.write(h, 3); err == nil {
		t.Fatal("a write was acknowledged on one leg with no quorum to take the other out")
	}
	if err := f.write(h, 4); err == nil {
		t.Fatal("the mirror without a quorum took a write")
	}
	f.crash()
	f.nodes[0].stop()
	f.nodes[1].start()
	f.nodes[2].start()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	for _, blk := range []int64{3, 4} {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
}

// TestMirrorLegFrozen: a leg's node stops answering with its
// connections up (the link blackholed, as a SIGSTOPped daemon or a
// silent path loss): the leg timeout fences it, the write goes on with
// the other leg in a bounded time, printed.
func TestMirrorLegFrozen(t *testing.T) {
	f := newFleet(t, 2, true)
	f.legTimeout = 500 * time.Millisecond
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	for blk := range int64(8) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	f.net.SetLink(clientAddr, f.nodes[1].addr.Addr(), fabrictest.LinkBlackhole)
	defer f.net.SetLink(clientAddr, f.nodes[1].addr.Addr(), fabrictest.LinkUp)
	began := time.Now()
	if err := f.write(h, 8); err != nil {
		t.Fatalf("a write with a leg frozen: %v", err)
	}
	took := time.Since(began)
	t.Logf("with a leg frozen the write took %v (leg timeout %v)", took, f.legTimeout)
	if took > 5*time.Second {
		t.Fatalf("a frozen leg held a write %v", took)
	}
	if f.m.Stats().Fenced.Load() != 1 || f.m.LegStates()[1] != "out" {
		t.Fatalf("fenced %d, legs %v", f.m.Stats().Fenced.Load(), f.m.LegStates())
	}
	for blk := range int64(16) {
		if err := f.read(h, blk%9); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
}

// TestMirrorLoneLegRefused: two legs and no witness: a restart that
// reaches one leg refuses, whichever it is, until forced.
func TestMirrorLoneLegRefused(t *testing.T) {
	f := newFleet(t, 2, false)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	if err := f.write(h, 1); err != nil {
		t.Fatal(err)
	}
	f.nodes[0].stop()
	if err := f.write(h, 2); err != nil {
		t.Fatalf("writes go on with one leg: %v", err)
	}
	f.crash()
	f.nodes[0].start()
	f.nodes[1].stop()
	var re *RefusedError
	if err := f.open(nil); !errors.As(err, &re) {
		t.Fatalf("the lone leg: %v, want a refusal", err)
	}
	f.nodes[1].start()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	for blk := range int64(4) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
}

// TestMirrorHistoryUnderFaults: random schedules of writes, reads,
// flushes and bursts of concurrent writes, under storage nodes killed
// and started again in any order, frozen (their links silent) and
// thawed, and the client crashed (writes in flight) and assembled again
// from whatever runs, the bitmap cleaned often in half of them; every
// read judged by
// the history checker; at the end every node runs and every block is
// read once more. Zero stale reads, zero lost or torn blocks; the
// refusals are counted (an assembly that cannot prove it has the last
// writes refuses). Seeded: the failing seed is printed;
// RNBD_MIRROR_SCHEDULES sets how many (default 40, 12 with -short).
func TestMirrorHistoryUnderFaults(t *testing.T) {
	n := 200
	if testing.Short() {
		n = 24
	}
	if v := os.Getenv("RNBD_MIRROR_SCHEDULES"); v != "" {
		fmt.Sscan(v, &n)
	}
	// The schedules wait more than they work (timeouts, dials, a
	// paced resync), each on a fabric of its own: several at once.
	const atOnce = 8
	var (
		mu    sync.Mutex
		total scheduleStats
		wg    sync.WaitGroup
		slots = make(chan struct{}, atOnce)
	)
	for seed := uint64(1); seed <= uint64(n); seed++ {
		slots <- struct{}{}
		wg.Go(func() {
			defer func() { <-slots }()
			t.Run(fmt.Sprintf("seed-%d", seed), func(t *testing.T) {
				defer func() {
					if t.Failed() {
						t.Logf("seed %d failed: RNBD_MIRROR_SCHEDULES=%d go test -run 'TestMirrorHistoryUnderFaults/seed-%d$' ./pkg/mirror", seed, seed, seed)
					}
				}()
				st := runSchedule(t, seed)
				mu.Lock()
				total.add(st)
				mu.Unlock()
			})
		})
	}
	wg.Wait()
	t.Logf("%d schedules: %+v", n, total)
	if total.opens == 0 || total.refused == 0 || total.takenOut == 0 || total.reads == 0 || total.freezes == 0 || total.rejoins == 0 ||
		total.witnessRejoins == 0 || total.cleaned == 0 {
		t.Fatalf("the schedules did not reach every case: %+v", total)
	}
}

type scheduleStats struct {
	writes, failedWrites, reads, opens, refused, kills, freezes, crashes, takenOut, rejoins, witnessRejoins, cleaned int
}

func (s *scheduleStats) add(o scheduleStats) {
	s.writes += o.writes
	s.failedWrites += o.failedWrites
	s.reads += o.reads
	s.opens += o.opens
	s.refused += o.refused
	s.kills += o.kills
	s.freezes += o.freezes
	s.crashes += o.crashes
	s.takenOut += o.takenOut
	s.rejoins += o.rejoins
	s.witnessRejoins += o.witnessRejoins
	s.cleaned += o.cleaned
}

func runSchedule(t *testing.T, seed uint64) (st scheduleStats) {
	rng := rand.New(rand.NewPCG(seed, 0x6d6972))
	shapes := []struct {
		legs    int
		witness bool
	}{{2, false}, {2, true}, {3, false}}
	shape := shapes[rng.IntN(len(shapes))]
	// Half the schedules clean the bitmap every few milliseconds: the
	// crashes and faults land on regions cleaned and marked again.
	f := newFleet(t, shape.legs, shape.witness)
	if rng.IntN(2) == 0 {
		f.cleanEvery = 5 * time.Millisecond
	}
	f.legTimeout = 300 * time.Millisecond
	f.resyncRate = 32 << 20 // a full copy takes an eighth of a second: faults land in it
	f.create()
	h := history.New(0)
	frozen := f.frozen
	thaw := func(i int) {
		f.net.SetLink(clientAddr, f.nodes[i].addr.Addr(), fabrictest.LinkUp)
		delete(frozen, i)
	}
	const blocks = 64
	var trail []string
	note := func(s string, a ...any) { trail = append(trail, fmt.Sprintf(s, a...)) }
	revive := func(i int) { // node i started, or thawed
		if f.nodes[i].rs == nil {
			f.nodes[i].start()
			note("node %d started", i)
		}
		if frozen[i] {
			thaw(i)
			note("node %d thawed", i)
		}
	}
	defer func() {
		if t.Failed() {
			t.Logf("seed %d, %d legs, witness %v:\n%s", seed, shape.legs, shape.witness, strings.Join(trail, "\n"))
		}
	}()
	open := func() {
		err := f.open(nil)
		var re *RefusedError
		switch {
		case err == nil:
			st.opens++
			note("open: legs %v", f.m.LegStates())
		case errors.As(err, &re):
			st.refused++
			note("open refused: %v", err)
		default:
			note("open failed: %v", err)
		}
	}
	crash := func(drain ...func()) {
		if f.m != nil {
			st.takenOut += int(f.m.Stats().TakenOut.Load())
			st.cleaned += int(f.m.Stats().Cleaned.Load())
		}
		h.Crash() // what is in flight now ends with the client
		f.crash(drain...)
		st.crashes++
	}
	open()
	for range 40 {
		switch k := rng.IntN(100); {
		case k < 8: // a node killed
			i := rng.IntN(len(f.nodes))
			if f.nodes[i].rs != nil {
				f.nodes[i].stop()
				st.kills++
				note("node %d killed", i)
			}
		case k < 12: // a node frozen: its link silent
			i := rng.IntN(len(f.nodes))
			if !frozen[i] {
				f.net.SetLink(clientAddr, f.nodes[i].addr.Addr(), fabrictest.LinkBlackhole)
				frozen[i] = true
				st.freezes++
				note("node %d frozen", i)
			}
		case k < 22: // a node started, or thawed
			revive(rng.IntN(len(f.nodes)))
		case k < 25: // the client crashes, with writes in flight (a resync too)
			var drain func()
			if f.m != nil {
				_, drain = burst(f, h, rng, blocks, 4)
				note("client crash with writes in flight")
			}
			crash(drain)
			open()
		case f.m == nil:
			open()
		case k < 30: // a leg out comes back (its node started or thawed) and rejoins while mapped
			var out []int
			for i, st := range f.m.LegStates() {
				if st == "out" {
					out = append(out, i)
				}
			}
			if shape.witness && !f.m.WitnessVoting() {
				out = append(out, shape.legs)
			}
			if len(out) == 0 {
				continue
			}
			i := out[rng.IntN(len(out))]
			if i == shape.legs {
				// The witness, dialled again: its old session closed
				// first (it holds the device), as rnbd-client does.
				revive(i)
				if old := f.m.witness.Load(); old != nil {
					old.dev.Session().Close()
				}
				s, d, err := f.nodes[i].client(context.Background(), fmt.Sprintf("rejoin-%d-%d-%d", f.opened, i, len(f.sess)), "w")
				if err != nil {
					note("witness not reached to rejoin: %v", err)
					continue
				}
				f.sess = append(f.sess, s)
				if err := f.m.RejoinWitness(context.Background(), d, ""); err != nil {
					note("witness rejoin: %v", err)
					continue
				}
				st.witnessRejoins++
				note("witness rejoined")
				continue
			}
			revive(i)
			s, d, err := f.nodes[i].client(context.Background(), fmt.Sprintf("rejoin-%d-%d-%d", f.opened, i, len(f.sess)), "vol")
			if err != nil {
				note("leg %d not reached to rejoin: %v", i, err)
				continue
			}
			f.sess = append(f.sess, s)
			if err := f.m.Rejoin(context.Background(), i, d, ""); err != nil {
				note("leg %d rejoin: %v", i, err)
				continue
			}
			st.rejoins++
			note("leg %d rejoined: legs %v", i, f.m.LegStates())
		case k < 55:
			blk := rng.Int64N(blocks)
			if err := f.write(h, blk); err != nil {
				st.failedWrites++
				note("write %d: %v", blk, err)
			} else {
				st.writes++
			}
		case k < 62:
			acked, wait := burst(f, h, rng, blocks, 8)
			wait()
			st.writes += *acked
		case k < 65:
			if err := f.do(rnbd.OpFlush, 0); err != nil {
				note("flush: %v", err)
			}
		default:
			blk := rng.Int64N(blocks)
			if err := f.read(h, blk); err != nil {
				if strings.Contains(err.Error(), "torn") || strings.Contains(err.Error(), "no write") {
					t.Fatal(err)
				}
				note("read %d: %v", blk, err)
			} else {
				st.reads++
			}
		}
	}
	// Everything back: the mirror serves, and every block reads as the
	// history allows.
	crash()
	for i, n := range f.nodes {
		if n.rs == nil {
			n.start()
		}
		thaw(i)
	}
	if err := f.open(nil); err != nil {
		t.Fatalf("every node running, the mirror does not open: %v", err)
	}
	st.opens++
	for blk := range int64(blocks) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
		st.reads++
	}
	checkHistory(t, h)
	return st
}

// burst submits n writes of random blocks at once and returns at once,
// with the count of those acknowledged (after wait) and wait, which
// waits for every one to end and frees their buffers. A write that ends
// after a crash (h.Crash) stays unknown in the history.
func burst(f *fleet, h *history.History, rng *rand.Rand, blocks int64, n int) (*int, func()) {
	var bufs []*Buffer
	done := make(chan error, n)
	var crashed atomic.Bool
	for k := range n {
		buf, err := f.m.AllocBuffer(blockSize)
		if err != nil {
			// Every leg out: the mirror failed, no IO to start.
			n = k
			break
		}
		bufs = append(bufs, buf)
		blk := rng.Int64N(blocks)
		w := h.BeginWrite(blk)
		history.Fill(buf.Bytes(), blk, w.Value)
		r := &Req{Op: rnbd.OpWrite, Off: blk * blockSize, Len: blockSize, Buf: buf, Done: func(_ *Req, err error) {
			if w.Outcome() == history.Pending {
				w.Done(err)
			} else {
				crashed.Store(true)
			}
			done <- err
		}}
		if err := f.m.Submit(context.Background(), r); err != nil {
			f.t.Fatal(err)
		}
	}
	acked := new(int)
	return acked, func() {
		for range n {
			select {
			case err := <-done:
				if err == nil {
					*acked++
				}
			case <-time.After(30 * time.Second):
				f.t.Fatal("a write of a burst did not end in 30 s")
			}
		}
		for _, b := range bufs {
			b.Free()
		}
	}
}

// TestMirrorRegionSize: Create gives a new mirror 4 MiB regions unless
// told otherwise, and refuses a region size that is not one.
func TestMirrorRegionSize(t *testing.T) {
	f := newFleet(t, 2, false)
	for _, bad := range []int64{-1, 3 << 16, 1 << 15, 1 << 31} {
		cfg := f.connect()
		cfg.RegionSize = bad
		err := Create(context.Background(), cfg)
		f.crash()
		if err == nil || !strings.Contains(err.Error(), "power of two") {
			t.Fatalf("region size %d: %v, want a refusal", bad, err)
		}
	}
	cfg := f.connect()
	cfg.RegionSize = 0
	if err := Create(context.Background(), cfg); err != nil {
		t.Fatal(err)
	}
	f.crash()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	defer f.crash()
	if got := f.m.bm.RegionSize(); got != 4<<20 {
		t.Fatalf("region size %d, want 4 MiB", got)
	}
}

// TestMirrorCreateIfNew: a volume's first map makes its mirror, and so
// does any retry of it until an assembly served it — a create that
// stopped part way is made again, never assembled from what it left —
// and from then on it makes nothing, whatever a voter holds.
func TestMirrorCreateIfNew(t *testing.T) {
	f := newFleet(t, 2, true)
	ctx := context.Background()
	createIfNew := func() (bool, error) {
		t.Helper()
		defer f.crash()
		return CreateIfNew(ctx, f.connect())
	}
	wipe := func(j int) {
		t.Helper()
		n := f.nodes[j]
		if err := os.WriteFile(filepath.Join(n.dir, f.devName(j)), make([]byte, len(n.file(f.devName(j)))), 0o644); err != nil {
			t.Fatal(err)
		}
	}

	// A create that wrote leg 0 only: no assembly can serve it.
	f.create()
	wipe(1)
	wipe(2)
	if err := f.open(nil); err == nil {
		t.Fatal("a create that wrote one voter of three was assembled")
	}
	if created, err := createIfNew(); err != nil || !created {
		t.Fatalf("over a create that stopped part way: created %t, %v; want made anew", created, err)
	}
	if err := f.open(nil); err != nil {
		t.Fatalf("the mirror made anew: %v", err)
	}
	h := history.New(0)
	for blk := range int64(8) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	f.crash()

	// Served once: nothing is made, with every voter or without one.
	if created, err := createIfNew(); err != nil || created {
		t.Fatalf("a mirror that was served: created %t, %v; want it left as it is", created, err)
	}
	f.nodes[1].stop()
	if created, err := createIfNew(); err != nil || created {
		t.Fatalf("a served mirror with a leg's node down: created %t, %v; want it left as it is", created, err)
	}
	f.nodes[1].start()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	for blk := range int64(8) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
	f.crash()

	// A voter of another mirror is never written over.
	other := f.layout
	other.Mirror[0] ^= 1
	cfg := f.connect()
	cfg.Layout = other
	_, err := CreateIfNew(ctx, cfg)
	f.crash()
	if err == nil || !strings.Contains(err.Error(), "another mirror") {
		t.Fatalf("over another mirror's voters: %v, want a refusal", err)
	}

	// A new mirror needs every voter.
	g := newFleet(t, 2, true)
	g.nodes[2].stop()
	_, err = CreateIfNew(ctx, g.connect())
	g.crash()
	if err == nil || !strings.Contains(err.Error(), "was not reached") {
		t.Fatalf("a new mirror without its witness: %v, want a refusal", err)
	}
}

// TestMirrorAdopt: a mirror's voters as a crash left them, copied (as a
// replicated volume's snapshots are), assemble under another identity
// with Layout.Adopt: every acknowledged write reads back, and from the
// first commit on they are the new mirror's — it assembles without
// Adopt, the old identity is refused.
func TestMirrorAdopt(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	for blk := range int64(256) {
		if err := f.write(h, blk*13%1024); err != nil {
			t.Fatal(err)
		}
	}
	f.crash() // no clean close: regions dirty
	adopted := testMirror
	adopted[15] ^= 0xa5
	f.layout = Layout{Mirror: adopted, NLegs: 2, Witness: true, Adopt: testMirror}
	if err := f.open(nil); err != nil {
		t.Fatalf("adopting: %v", err)
	}
	for blk := range int64(1024) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	for blk := range int64(32) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
	f.crash()
	f.layout.Adopt = [16]byte{}
	if err := f.open(nil); err != nil {
		t.Fatalf("the adopted mirror without Adopt: %v", err)
	}
	for blk := range int64(1024) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
	f.crash()
	f.layout = Layout{Mirror: testMirror, NLegs: 2, Witness: true}
	if err := f.open(nil); err == nil || !strings.Contains(err.Error(), "another mirror") {
		t.Fatalf("the old identity over the adopted voters: %v", err)
	}
}
