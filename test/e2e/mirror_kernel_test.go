package e2e

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"github.com/rnbd/rnbd/test/history"
	"github.com/rnbd/rnbd/test/kit"
)

// TestMirrorSchedulesOnKernel is the mirror's fault schedules on real
// devices: real rnbd-server processes as storage nodes, a real
// rnbd-client daemon mapping the mirror as /dev/ublkbN, and the test's
// O_DIRECT reads and writes of that device judged by the history
// checker. The faults are the data centre's: a node killed (-9) and
// started again, frozen (SIGSTOP) and thawed, the client daemon killed
// with writes in flight and started again (ublk's user recovery hands
// it the device), in random order; the client dials legs back and
// resyncs them by itself. An assembly that cannot prove its legs current
// refuses (counted), and is mapped again, as an operator does, once
// every node runs. At the end every node runs, the mirror is in sync,
// every block reads as the history allows, and the legs' data is
// equal. The pkg/mirror schedules run the same kinds of faults by the
// hundred on the in-memory fabric; these run on a kernel (the VM tier:
// RNBD_E2E_BIN=/bin), RNBD_MIRROR_SCHEDULES of them (default 24), the
// seed printed on failure.
func TestMirrorSchedulesOnKernel(t *testing.T) {
	if _, err := os.Stat("/dev/ublk-control"); err != nil {
		t.Skip("needs the kernel's ublk (/dev/ublk-control): the VM tier runs it")
	}
	n := 24
	if v := os.Getenv("RNBD_MIRROR_SCHEDULES"); v != "" {
		fmt.Sscan(v, &n)
	}
	var total kernelScheduleStats
	start := time.Now()
	for seed := uint64(1); seed <= uint64(n); seed++ {
		var st kernelScheduleStats
		if !t.Run(fmt.Sprintf("seed-%d", seed), func(t *testing.T) { st = runKernelSchedule(t, seed) }) {
			t.Fatalf("seed %d failed: RNBD_MIRROR_SCHEDULES=%d -test.run 'TestMirrorSchedulesOnKernel/seed-%d$'", seed, seed, seed)
		}
		total.add(st)
	}
	t.Logf("%d schedules in %v: %+v", n, time.Since(start).Round(time.Second), total)
	if total.kills == 0 || total.freezes == 0 || total.crashes == 0 || total.reads == 0 || total.writes == 0 || total.rejoined == 0 {
		t.Fatalf("the schedules did not reach every case: %+v", total)
	}
}

type kernelScheduleStats struct {
	writes, failedWrites, reads, failedReads, kills, freezes, crashes, refused, rejoined, remapped int
}

func (s *kernelScheduleStats) add(o kernelScheduleStats) {
	s.writes += o.writes
	s.failedWrites += o.failedWrites
	s.reads += o.reads
	s.failedReads += o.failedReads
	s.kills += o.kills
	s.freezes += o.freezes
	s.crashes += o.crashes
	s.refused += o.refused
	s.rejoined += o.rejoined
	s.remapped += o.remapped
}

const (
	kblocks    = 32
	kblockSize = 4096
	// kioBound: no IO of the test may take longer (a leg frozen is
	// fenced in --mirror-leg-timeout; a hang is a failure).
	kioBound = 90 * time.Second
)

// kernelMirror is one schedule's fleet: its nodes, the client and the
// mapping's device.
type kernelMirror struct {
	t       *testing.T
	nodes   []*storageNode
	down    []bool // killed
	frozen  []bool // SIGSTOPped
	dir     string
	cl      *clientDaemon
	mapArgs []string
	// clientArgs are the client daemon's flags beyond startClient's.
	clientArgs []string
	dev        string // /dev/ublkbN (or /dev/nbdN) while mapped, "" while refused
	h          *history.History
	start      time.Time
	trail      []string
}

func (k *kernelMirror) note(s string, a ...any) {
	k.trail = append(k.trail, fmt.Sprintf("%5.1fs ", time.Since(k.start).Seconds())+fmt.Sprintf(s, a...))
}

func runKernelSchedule(t *testing.T, seed uint64) (st kernelScheduleStats) {
	rng := rand.New(rand.NewPCG(seed, 0x6b6d69))
	shapes := []struct {
		legs    int
		witness bool
	}{{2, true}, {3, false}, {2, false}}
	shape := shapes[rng.IntN(len(shapes))]
	k := &kernelMirror{t: t, dir: t.TempDir(), h: history.New(0), start: time.Now()}
	for i := range shape.legs {
		k.nodes = append(k.nodes, newStorageNode(t, 8<<20+kblocks*kblockSize))
		k.mapArgs = append(k.mapArgs, "--leg", k.nodes[i].leg(fmt.Sprintf("ks%d-%d", seed, i)))
	}
	if shape.witness {
		k.nodes = append(k.nodes, newStorageNode(t, 1<<20))
		k.mapArgs = append(k.mapArgs, "--witness", k.nodes[shape.legs].leg(fmt.Sprintf("ks%d-w", seed)))
	}
	k.mapArgs = append([]string{"map", "--mirror", fmt.Sprintf("ks%d", seed)}, append(k.mapArgs, "--as", "ublk")...)
	k.down, k.frozen = make([]bool, len(k.nodes)), make([]bool, len(k.nodes))
	defer func() {
		for i, n := range k.nodes { // a frozen node would not die of SIGKILL's cleanup
			if k.frozen[i] && !k.down[i] {
				n.srv.cmd.Process.Signal(syscall.SIGCONT)
			}
		}
		if t.Failed() {
			t.Logf("seed %d, %d legs, witness %v:\n%s", seed, shape.legs, shape.witness, strings.Join(k.trail, "\n"))
		}
	}()
	k.startClient()
	k.dev = mappedDev(t, k.cl.ok(append(k.mapArgs, "--create")...))
	k.note("mapped %s", k.dev)

	for range 30 {
		switch x := rng.IntN(100); {
		case x < 8:
			if i := rng.IntN(len(k.nodes)); !k.down[i] {
				if k.frozen[i] {
					k.nodes[i].srv.cmd.Process.Signal(syscall.SIGCONT)
					k.frozen[i] = false
				}
				k.nodes[i].kill(t)
				k.down[i] = true
				st.kills++
				k.note("node %d killed", i)
			}
		case x < 12:
			if i := rng.IntN(len(k.nodes)); !k.down[i] && !k.frozen[i] {
				k.nodes[i].srv.cmd.Process.Signal(syscall.SIGSTOP)
				k.frozen[i] = true
				st.freezes++
				k.note("node %d frozen", i)
			}
		case x < 22:
			k.revive(rng.IntN(len(k.nodes)))
		case x < 26:
			k.crash(rng, &st)
		case x < 30:
			k.rejoin(rng, &st)
		case k.dev == "":
			// Refused: every node back, and mapped again.
			for i := range k.nodes {
				k.revive(i)
			}
			k.remap(&st)
		case x < 55:
			k.write(rng.Int64N(kblocks), &st)
		case x < 62:
			k.burst(rng, 8, &st)()
		case x < 65:
			err := k.do(func(f *os.File) error { return f.Sync() })
			k.note("flush: %v", err)
		default:
			k.read(rng.Int64N(kblocks), &st)
		}
	}
	// The client crashes once more (its restart restores what it can
	// reach), then every node comes back (a mirror refused is mapped
	// again) and the legs resync; every block is read.
	k.crash(nil, &st)
	for i := range k.nodes {
		k.revive(i)
	}
	if k.dev == "" {
		k.remap(&st)
	}
	kit.WaitFor(t, 3*time.Minute, "every leg in sync", func() bool { return k.state() == "open" })
	for blk := range int64(kblocks) {
		if err := k.read(blk, &st); err != nil {
			t.Fatalf("block %d with every leg in sync: %v", blk, err)
		}
	}
	bad, hs := k.h.Check()
	for _, v := range bad {
		t.Error(v)
	}
	k.note("history: %+v", hs)
	k.cl.ok("unmap", "rnbd0")
	for _, n := range k.nodes[1:shape.legs] {
		if a, b := k.nodes[0].data(t, 0, kblocks*kblockSize), n.data(t, 0, kblocks*kblockSize); string(a) != string(b) {
			t.Errorf("legs 0 and on port %d differ after the resync", n.port)
		}
	}
	return st
}

// startClient starts the client daemon; a test that fails leaves no
// ublk device behind it (one whose daemon is killed waits for another).
func (k *kernelMirror) startClient() {
	cl := startClient(k.t, k.dir, append([]string{"--mirror-leg-timeout", "1s"}, k.clientArgs...)...)
	k.t.Cleanup(func() { cl.ctl("unmap", "rnbd0", "--force") })
	k.cl = cl
}

// record is the mapping's record (nil when there is none).
func (k *kernelMirror) record() map[string]any {
	if _, _, code := k.cl.ctl("device", "show", "rnbd0"); code != 0 {
		return nil
	}
	return k.cl.records("device", "show", "rnbd0")[0]
}

func (k *kernelMirror) state() string { return fmt.Sprint(k.record()["state"]) }

// revive starts node i, or thaws it.
func (k *kernelMirror) revive(i int) {
	if k.down[i] {
		k.nodes[i].start(k.t)
		k.down[i] = false
		k.note("node %d started", i)
	}
	if k.frozen[i] {
		k.nodes[i].srv.cmd.Process.Signal(syscall.SIGCONT)
		k.frozen[i] = false
		k.note("node %d thawed", i)
	}
}

// crash kills the client daemon (-9) with a burst of writes in flight
// (with rng), and starts it again: it restores the mirror from its
// state file and recovers the ublk device, or refuses. A frozen node is
// thawed first: the restore waits for what it dials.
func (k *kernelMirror) crash(rng *rand.Rand, st *kernelScheduleStats) {
	var wait func()
	if rng != nil && k.dev != "" {
		wait = k.burst(rng, 4, st)
		time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
	}
	k.killClient(st)
	for i := range k.nodes {
		if k.frozen[i] {
			k.revive(i)
		}
	}
	k.startClient()
	if wait != nil {
		wait()
	}
	switch rec := k.record(); rec["state"] {
	case "open", "degraded":
		k.dev = fmt.Sprint(rec["devpath"])
		k.note("client back: %s, %s", rec["state"], k.dev)
	default:
		st.refused++
		k.dev = ""
		k.note("client back, the mirror %v (refused)", rec["state"])
	}
}

// killClient kills the client daemon (-9): the writes in flight become
// unknown in the history.
func (k *kernelMirror) killClient(st *kernelScheduleStats) {
	k.cl.cmd.Process.Kill()
	err := <-k.cl.done
	k.cl.done <- err
	k.h.Crash()
	st.crashes++
	k.note("client killed")
}

// remap unmaps a mirror whose restore was refused, or that failed, and
// maps it again (every node runs).
func (k *kernelMirror) remap(st *kernelScheduleStats) {
	k.cl.ctl("unmap", "rnbd0", "--force")
	out, errOut, code := k.cl.ctl(k.mapArgs...)
	if code != 0 {
		k.t.Fatalf("every node running, the mirror does not map: %s", errOut)
	}
	k.dev = mappedDev(k.t, out)
	st.remapped++
	k.note("mapped again: %s", k.dev)
}

// rejoin, while the mirror is degraded, brings every node back (in a
// random order) and waits for the client to dial the legs out again
// and resync them while mapped. A mirror that failed (it lost its
// quorum: IO fails until it is mapped again) is mapped again.
func (k *kernelMirror) rejoin(rng *rand.Rand, st *kernelScheduleStats) {
	s := k.state()
	if k.dev == "" || s != "degraded" && s != "failed" {
		return
	}
	for _, i := range rng.Perm(len(k.nodes)) {
		k.revive(i)
	}
	if s == "failed" {
		k.remap(st)
		return
	}
	start := time.Now()
	kit.WaitFor(k.t, 2*time.Minute, "the legs to rejoin", func() bool { return k.state() == "open" })
	st.rejoined++
	k.note("every leg back in sync in %v", time.Since(start).Round(100*time.Millisecond))
}

// do runs op on the mapping's device, opened O_DIRECT, bounded by
// kioBound.
func (k *kernelMirror) do(op func(*os.File) error) error {
	if k.dev == "" {
		return syscall.ENODEV
	}
	f, err := os.OpenFile(k.dev, os.O_RDWR|syscall.O_DIRECT, 0)
	if err != nil {
		return err
	}
	defer f.Close()
	done := make(chan error, 1)
	go func() { done <- op(f) }()
	select {
	case err := <-done:
		return err
	case <-time.After(kioBound):
		k.t.Fatalf("an IO on %s did not end in %v", k.dev, kioBound)
		return nil
	}
}

// alignedBlock is a block-sized buffer aligned for O_DIRECT.
func alignedBlock() []byte {
	b := make([]byte, 2*kblockSize)
	off := kblockSize - int(uintptr(unsafe.Pointer(&b[0]))%kblockSize)
	return b[off%kblockSize:][:kblockSize]
}

func (k *kernelMirror) write(blk int64, st *kernelScheduleStats) {
	w := k.h.BeginWrite(blk)
	b := alignedBlock()
	history.Fill(b, blk, w.Value)
	err := k.do(func(f *os.File) error { _, err := f.WriteAt(b, blk*kblockSize); return err })
	w.Done(err)
	if err != nil {
		st.failedWrites++
		k.note("write %d: %v", blk, err)
	} else {
		st.writes++
	}
}

func (k *kernelMirror) read(blk int64, st *kernelScheduleStats) error {
	r := k.h.BeginRead(blk)
	b := alignedBlock()
	err := k.do(func(f *os.File) error { _, err := f.ReadAt(b, blk*kblockSize); return err })
	if err == nil {
		var v uint64
		if v, err = history.ValueOf(b, blk); err != nil {
			k.t.Fatal(err) // torn or another block's: no correct device gives it
		}
		if err = r.Done(v); err != nil {
			k.t.Fatal(err)
		}
		st.reads++
		return nil
	}
	st.failedReads++
	k.note("read %d: %v", blk, err)
	return err
}

// burst starts n writes of random blocks at once, each its own open of
// the device, and returns a wait for them. A write that ends after a
// crash stays unknown in the history.
func (k *kernelMirror) burst(rng *rand.Rand, n int, st *kernelScheduleStats) (wait func()) {
	if k.dev == "" {
		return func() {}
	}
	dev := k.dev
	var wg sync.WaitGroup
	errs := make([]error, n)
	for i := range n {
		blk := rng.Int64N(kblocks)
		w := k.h.BeginWrite(blk)
		b := alignedBlock()
		history.Fill(b, blk, w.Value)
		wg.Go(func() {
			f, err := os.OpenFile(dev, os.O_RDWR|syscall.O_DIRECT, 0)
			if err == nil {
				_, err = f.WriteAt(b, blk*kblockSize)
				f.Close()
			}
			if w.Outcome() == history.Pending {
				w.Done(err)
			}
			errs[i] = err
		})
	}
	return func() {
		done := make(chan struct{})
		go func() { wg.Wait(); close(done) }()
		select {
		case <-done:
		case <-time.After(kioBound):
			k.t.Fatalf("a write of a burst on %s did not end in %v", dev, kioBound)
		}
		for _, err := range errs {
			if err == nil {
				st.writes++
			} else {
				st.failedWrites++
			}
		}
	}
}

// mappedDev is the device a map command's output names.
func mappedDev(t *testing.T, out string) string {
	t.Helper()
	_, dev, ok := strings.Cut(out, "mapped: ")
	dev, _, _ = strings.Cut(dev, "\n")
	dev = strings.TrimSpace(dev)
	if !ok || !strings.HasPrefix(dev, "/dev/ublkb") && !strings.HasPrefix(dev, "/dev/nbd") {
		t.Fatalf("map: %q", out)
	}
	return dev
}
