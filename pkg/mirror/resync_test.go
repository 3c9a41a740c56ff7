package mirror

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/test/history"
	"github.com/rnbd/rnbd/test/kit"
)

// rejoin maps leg i's device through a new session and has the mirror
// take it back; it returns the device. The leg's old session is closed
// first, as rnbd-client's rejoin closes it: reconnected to the node
// started again, it would hold the device (EBUSY for the new one).
func (f *fleet) rejoin(i int) *rnbd.CltDev {
	f.t.Helper()
	if old := f.m.leg(i); old != nil {
		old.dev.Session().Close()
	}
	s, d, err := f.nodes[i].client(context.Background(), fmt.Sprintf("rejoin-%d", len(f.sess)), "vol")
	if err != nil {
		f.t.Fatal(err)
	}
	f.sess = append(f.sess, s)
	if err := f.m.Rejoin(context.Background(), i, d, ""); err != nil {
		f.t.Fatal(err)
	}
	return d
}

// waitResync waits for the resync running to end.
func (f *fleet) waitResync() {
	f.t.Helper()
	kit.WaitFor(f.t, 20*time.Second, "the resync", func() bool { return f.m.Resync().Leg < 0 })
}

// writers writes random blocks of [0, blocks) from n goroutines, each
// with a buffer of its own and blocks of its own (two writes of one
// block in flight at once may land in either order on each leg, as on
// any block device), until stop is closed; the function it returns
// waits for them and counts their writes. Every write goes in the
// history.
func writers(t *testing.T, f *fleet, h *history.History, n int, blocks int64, stop chan struct{}) func() int {
	var wg sync.WaitGroup
	var mu sync.Mutex
	total := 0
	for k := range n {
		buf, err := f.m.AllocBuffer(blockSize)
		if err != nil {
			t.Fatal(err)
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer buf.Free()
			rng := rand.New(rand.NewPCG(uint64(k), 42))
			for {
				select {
				case <-stop:
					return
				default:
				}
				blk := rng.Int64N(blocks/int64(n))*int64(n) + int64(k)
				w := h.BeginWrite(blk)
				history.Fill(buf.Bytes(), blk, w.Value)
				done := make(chan error, 1)
				r := &Req{Op: rnbd.OpWrite, Off: blk * blockSize, Len: blockSize, Buf: buf, Done: func(_ *Req, err error) { done <- err }}
				if err := f.m.Submit(context.Background(), r); err != nil {
					w.Done(err)
					t.Error(err)
					return
				}
				err := <-done
				w.Done(err)
				if err != nil {
					t.Errorf("a write during the resync: %v", err)
					return
				}
				mu.Lock()
				total++
				mu.Unlock()
			}
		}()
	}
	return func() int {
		wg.Wait()
		return total
	}
}

// TestMirrorRejoin: a leg whose node was killed comes back while the
// mirror serves and writes go on from four writers: it is written from
// the moment it rejoins and resynced underneath them, by the bitmap or
// (a new, empty device) in full, then read again; at the end both legs
// hold the same bytes and every read agrees with the history.
func TestMirrorRejoin(t *testing.T) {
	for _, c := range []struct {
		name string
		wipe bool // the leg comes back as a new device
	}{{"bitmap", false}, {"new device", true}} {
		t.Run(c.name, func(t *testing.T) {
			f := newFleet(t, 2, true)
			f.create()
			if err := f.open(nil); err != nil {
				t.Fatal(err)
			}
			f.m.cfg.ResyncRate = 16 << 20 // the full copy takes a quarter of a second
			h := history.New(0)
			const blocks = testData / blockSize
			for blk := range int64(64) {
				if err := f.write(h, blk); err != nil {
					t.Fatal(err)
				}
			}
			f.nodes[1].stop()
			for blk := range int64(32) {
				if err := f.write(h, 300+blk); err != nil {
					t.Fatal(err)
				}
			}
			if st := f.m.LegStates(); st[1] != "out" {
				t.Fatalf("legs %v", st)
			}
			if c.wipe {
				// A new device too small for the mirror is refused
				// before anything changes.
				vol := filepath.Join(f.nodes[1].dir, "vol")
				if err := os.Truncate(vol, 0); err != nil {
					t.Fatal(err)
				}
				if err := os.Truncate(vol, legSize/2); err != nil {
					t.Fatal(err)
				}
				f.nodes[1].start()
				s, d, err := f.nodes[1].client(context.Background(), "small", "vol")
				if err != nil {
					t.Fatal(err)
				}
				if err := f.m.Rejoin(context.Background(), 1, d, ""); err == nil || !strings.Contains(err.Error(), "needs") {
					t.Fatalf("a leg of half the size rejoined: %v", err)
				}
				if st := f.m.LegStates(); st[1] != "out" || f.m.Resync().Leg >= 0 {
					t.Fatalf("legs %v, resync %+v after a refused rejoin", st, f.m.Resync())
				}
				s.Close()
				f.nodes[1].stop()
				if err := os.Truncate(vol, legSize); err != nil {
					t.Fatal(err)
				}
			}
			f.nodes[1].start()
			stop := make(chan struct{})
			wait := writers(t, f, h, 4, blocks, stop)
			d := f.rejoin(1)
			if st := f.m.LegStates(); st[1] != "resyncing" {
				t.Fatalf("legs %v after the rejoin", st)
			}
			if err := f.m.Rejoin(context.Background(), 0, d, ""); err == nil {
				t.Fatal("a leg in sync rejoined")
			}
			f.waitResync()
			close(stop)
			n := wait()
			if st := f.m.LegStates(); st[0] != "in sync" || st[1] != "in sync" {
				t.Fatalf("legs %v after the resync", st)
			}
			p := f.m.Stats().Reconciled.Load()
			t.Logf("%d writes during the rejoin and resync; resync copied %d bytes", n, p)
			if n == 0 {
				t.Fatal("no write ran during the resync")
			}
			// Reads by round robin: both legs serve them.
			for blk := range int64(blocks) {
				if err := f.read(h, blk); err != nil {
					t.Fatal(err)
				}
			}
			checkHistory(t, h)
			f.crash()
			a, b := f.nodes[0].file("vol"), f.nodes[1].file("vol")
			if !bytes.Equal(a[DataOff:], b[DataOff:]) {
				var diff []int64
				for blk := int64(0); blk < blocks; blk++ {
					o := DataOff + blk*blockSize
					if !bytes.Equal(a[o:o+blockSize], b[o:o+blockSize]) {
						diff = append(diff, blk)
					}
				}
				t.Fatalf("the legs' data differ after the resync, in blocks %v", diff)
			}
		})
	}
}

// crossingWrite is a copyRead hook that, the first time it is called,
// writes block blk in the moment between a copy's read of the source
// and its write to the leg (a resync's, a repair's): the gate defers
// the write, or (without the gate) it lands before the copy's. The
// channel has the write's result.
func crossingWrite(t *testing.T, f *fleet, h *history.History, blk int64) (func(off, n int64), <-chan error) {
	buf, err := f.m.AllocBuffer(blockSize)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { buf.Free() }) // before the fleet's: it was registered later
	wrote := make(chan error, 1)
	var once sync.Once
	return func(off, n int64) {
		once.Do(func() {
			w := h.BeginWrite(blk)
			history.Fill(buf.Bytes(), blk, w.Value)
			r := &Req{Op: rnbd.OpWrite, Off: blk * blockSize, Len: blockSize, Buf: buf, Done: func(_ *Req, err error) { w.Done(err); wrote <- err }}
			if err := f.m.Submit(context.Background(), r); err != nil {
				t.Error(err)
			}
			kit.WaitFor(t, 10*time.Second, "the write to end or wait", func() bool {
				f.m.rs.mu.Lock()
				deferred := len(f.m.rs.deferred)
				f.m.rs.mu.Unlock()
				return deferred > 0 || len(wrote) > 0
			})
		})
	}, wrote
}

// TestMirrorResyncWindow: a write to the window a resync has read and
// not yet written to the leg waits for the copy, so the copy's old
// bytes cannot land over it (without the gate the legs differ: checked
// by making it admit everything).
func TestMirrorResyncWindow(t *testing.T) {
	f := newFleet(t, 2, false)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	for blk := range int64(16) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	f.nodes[1].stop()
	if err := f.write(h, 5); err != nil { // leg 1 misses it: region 0 to copy
		t.Fatal(err)
	}
	f.nodes[1].start()
	var wrote <-chan error
	f.m.copyRead, wrote = crossingWrite(t, f, h, 3)
	f.rejoin(1)
	f.waitResync()
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	for blk := range int64(16) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
	f.crash()
	a, b := f.nodes[0].file("vol"), f.nodes[1].file("vol")
	if !bytes.Equal(a[DataOff:DataOff+16*blockSize], b[DataOff:DataOff+16*blockSize]) {
		t.Fatal("the copy landed over the write made while it ran: the legs differ")
	}
}

// TestMirrorCleansWhileMapped: with every leg in sync the bitmap is
// cleaned region by region as they go quiet, while one region of the
// same bitmap block is written all along; a leg that goes after that is
// resynced with only the region written since and the one written all
// along.
func TestMirrorCleansWhileMapped(t *testing.T) {
	f := newFleet(t, 2, false)
	f.cleanEvery = 20 * time.Millisecond
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	for blk := range int64(testData / blockSize / 4) {
		if err := f.write(h, blk*4); err != nil {
			t.Fatal(err)
		}
	}
	if len(f.m.bm.Runs(0)) == 0 {
		t.Fatal("no region dirty after the writes")
	}
	// The hot block is written every few milliseconds, far more often
	// than a cleaning period: the rest of its bitmap block is cleaned
	// around its region. (Cleaned by blocks, the bitmap stays all
	// marked, or, after a stall of a period, all clean.)
	const hot = testData / blockSize / 2
	region := f.m.bm.RegionSize()
	hotRun := [][2]int64{{hot * blockSize / region * region, region}}
	for deadline := time.Now().Add(10 * time.Second); !slices.Equal(f.m.bm.Runs(0), hotRun); time.Sleep(2 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatalf("the bitmap marks %v, want only the hot region's %v", f.m.bm.Runs(0), hotRun)
		}
		if err := f.write(h, hot); err != nil {
			t.Fatal(err)
		}
	}
	f.nodes[1].stop()
	if err := f.write(h, 7); err != nil {
		t.Fatal(err)
	}
	// Leg 1 is out: nothing is cleaned now. The hot region, written
	// last a moment ago, is marked unless a stall of two periods let
	// it be cleaned.
	want := uint64(region)
	if f.m.bm.IsDirty(hot * blockSize) {
		want += uint64(region)
	}
	f.nodes[1].start()
	f.rejoin(1)
	f.waitResync()
	if got := f.m.Stats().Reconciled.Load(); got != want {
		t.Fatalf("the resync copied %d bytes, want %d: the region written while the leg was out and the hot one", got, want)
	}
	f.crash()
	a, b := f.nodes[0].file("vol"), f.nodes[1].file("vol")
	if !bytes.Equal(a[DataOff:], b[DataOff:]) {
		t.Fatal("the legs differ after the resync")
	}
}

// TestMirrorReadPolicy: reads go to the leg the policy chooses among
// those in sync: min-inflight away from a leg with requests in flight,
// min-latency to the leg whose paths answer fastest; round robin to
// both.
func TestMirrorReadPolicy(t *testing.T) {
	f := newFleet(t, 2, false)
	f.legTimeout = time.Minute // the watchdog measures no latency meanwhile
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	reads := func() [2]uint64 {
		var out [2]uint64
		for i := range out {
			out[i] = f.m.leg(i).dev.Counters().Requests[rnbd.OpRead]
		}
		return out
	}
	spread := func(p rtrs.MPPolicy) [2]uint64 {
		f.m.cfg.ReadPolicy = p
		before := reads()
		for blk := range int64(64) {
			if err := f.do(rnbd.OpRead, blk*blockSize); err != nil {
				t.Fatal(err)
			}
		}
		after := reads()
		return [2]uint64{after[0] - before[0], after[1] - before[1]}
	}
	if got := spread(rtrs.MPRoundRobin); got != [2]uint64{32, 32} {
		t.Errorf("round robin: reads per leg %v", got)
	}
	f.m.leg(0).io.inflight.Add(8) // leg 0 busy
	if got := spread(rtrs.MPMinInflight); got != [2]uint64{0, 64} {
		t.Errorf("min-inflight with leg 0 busy: reads per leg %v", got)
	}
	f.m.leg(0).io.inflight.Add(-8)
	f.m.leg(0).latency.Store(int64(time.Millisecond))
	f.m.leg(1).latency.Store(int64(10 * time.Millisecond))
	if got := spread(rtrs.MPMinLatency); got != [2]uint64{64, 0} {
		t.Errorf("min-latency with leg 0 faster: reads per leg %v", got)
	}
}

// TestMirrorLegReopened: leg 1's storage node restarts with its disk
// replaced (an empty device at the same name) while the mirror runs. The
// leg's session reconnects by itself and opens the device again; the
// mirror must not read the new, empty device as the leg: the leg goes
// out at the reopen, every read stays right, and dialled again it is
// rebuilt in full (no superblock) and in sync again.
func TestMirrorLegReopened(t *testing.T) {
	f := newFleet(t, 2, false)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	const blocks = 32
	for blk := range int64(blocks) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	n := f.nodes[1]
	dev := f.m.leg(1).dev
	opens := dev.Opens()
	n.stop()
	emptyFile(t, filepath.Join(n.dir, "vol"), legSize)
	n.start()
	// No IO meanwhile: the old session finds the node again (20 ms) and
	// reopens the device; the leg is out from that moment.
	kit.WaitFor(t, 5*time.Second, "leg 1's device to be reopened", func() bool { return dev.Opens() != opens })
	if got := f.m.LegStates(); got[1] != "out" {
		t.Fatalf("legs %v after leg 1's device was reopened, want it out", got)
	}
	for range 2 { // round robin would send every other read to leg 1
		for blk := range int64(blocks) {
			if err := f.read(h, blk); err != nil {
				t.Fatal(err)
			}
		}
	}
	if f.m.Failed() {
		t.Fatal("the mirror failed")
	}
	// Requests in flight when the device is reopened: their answers
	// come from what is there now, and are not taken (legDone).
	f.m.leg(1).dev.Session().Close() // it holds the device, as rnbd-client's rejoin closes it
	f.rejoin(1)
	f.waitResync()
	for blk := range int64(blocks) {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	dev, opens = f.m.leg(1).dev, f.m.leg(1).dev.Opens()
	n.stop()
	emptyFile(t, filepath.Join(n.dir, "vol"), legSize)
	stop := make(chan struct{})
	readers := make(chan error, 1)
	go func() { // reads all along, some of them out when it reopens
		for {
			select {
			case <-stop:
				readers <- nil
				return
			default:
			}
			for blk := range int64(blocks) {
				if err := f.read(h, blk); err != nil {
					readers <- err
					return
				}
			}
		}
	}()
	n.start()
	kit.WaitFor(t, 5*time.Second, "leg 1's device to be reopened", func() bool { return dev.Opens() != opens })
	close(stop)
	if err := <-readers; err != nil {
		t.Fatal(err)
	}
	f.m.leg(1).dev.Session().Close() // it holds the device, as rnbd-client's rejoin closes it
	f.rejoin(1)
	f.waitResync()
	if got := f.m.LegStates(); got[0] != "in sync" || got[1] != "in sync" {
		t.Fatalf("legs %v after the rebuild", got)
	}
	if got, want := f.m.Stats().Reconciled.Load(), uint64(2*testData); got != want {
		t.Fatalf("the two rebuilds copied %d bytes, want all twice, %d", got, want)
	}
	for blk := range int64(blocks) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	a, b := f.nodes[0].file("vol"), n.file("vol")
	if !bytes.Equal(a[DataOff:], b[DataOff:]) {
		t.Fatal("the legs differ after the rebuild")
	}
}

// emptyFile makes path an empty file of size bytes: a device replaced.
func emptyFile(t *testing.T, path string, size int64) {
	t.Helper()
	for _, n := range []int64{0, size} {
		if err := os.Truncate(path, n); err != nil {
			t.Fatal(err)
		}
	}
}
