package mirror

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/test/history"
	"github.com/rnbd/rnbd/test/testfs"
)

// TestMirrorReadRepair: a leg whose disk cannot read a block (its
// storage node answers EIO) serves no wrong read: the read is served by
// the other leg and the block written back to the bad one, which stays
// in; a block that cannot be written either takes the leg out. The bad
// disk is real to the storage node: a FUSE file with bad blocks.
func TestMirrorReadRepair(t *testing.T) {
	f, disks, backing := badDiskFleet(t)
	disk := disks[1]
	h := f.openWritten(8)
	// Block 3 of leg 1 goes bad. Round robin sends one of two reads
	// there.
	disk.SetBad(DataOff+3*blockSize, false)
	for range 4 {
		if err := f.read(h, 3); err != nil {
			t.Fatal(err)
		}
	}
	if readErrs, mended, bad := disk.Counts(); readErrs != 1 || mended != 1 || bad != 0 {
		t.Fatalf("the disk failed %d reads and had %d bad blocks mended, %d left; want 1, 1, 0", readErrs, mended, bad)
	}
	st := f.m.Stats()
	if st.Repaired.Load() != 1 || st.TakenOut.Load() != 0 {
		t.Fatalf("%d repaired, %d taken out; want 1 and 0", st.Repaired.Load(), st.TakenOut.Load())
	}
	if got := f.m.LegStates(); got[0] != "in sync" || got[1] != "in sync" {
		t.Fatalf("legs %v after a repair, want both in sync", got)
	}
	if !legsEqual(t, backing) {
		t.Fatal("the legs differ after the repair")
	}
	// Repairs of blocks being written: a writer keeps writing blocks 0
	// and 1 while they go bad on leg 1 and are read (a write mends a
	// bad block too). Every read the disk failed is repaired; a rewrite
	// that crossed a write would leave the legs different.
	stop := make(chan struct{})
	wait := writers(t, f, h, 1, 2, stop)
	for i := range 100 {
		blk := int64(i % 2)
		disk.SetBad(DataOff+blk*blockSize, false)
		for range 2 {
			if err := f.read(h, blk); err != nil {
				t.Fatal(err)
			}
		}
	}
	close(stop)
	t.Logf("%d writes, %d repairs", wait(), st.Repaired.Load())
	readErrs, _, bad := disk.Counts()
	if bad != 0 || st.TakenOut.Load() != 0 || st.Repaired.Load() != uint64(readErrs) || readErrs < 2 {
		t.Fatalf("%d blocks still bad, %d repaired of %d reads failed, %d taken out; want 0, all (more than 1), 0",
			bad, st.Repaired.Load(), readErrs, st.TakenOut.Load())
	}
	if !legsEqual(t, backing) {
		t.Fatal("the legs differ after repairs under writes")
	}
	// A write to the block in the moment between the repair's read of
	// the good leg and its rewrite of the bad one: held off until the
	// rewrite is done, or (without the gate) the rewrite lands over it.
	var wrote <-chan error
	f.m.copyRead, wrote = crossingWrite(t, f, h, 6)
	disk.SetBad(DataOff+6*blockSize, false)
	for range 2 { // one of them goes to leg 1
		if err := f.read(h, 6); err != nil {
			t.Fatal(err)
		}
	}
	select {
	case err := <-wrote:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no repair of block 6")
	}
	if err := f.read(h, 6); err != nil {
		t.Fatal(err)
	}
	if !legsEqual(t, backing) {
		t.Fatal("a write in the middle of a repair: the legs differ")
	}

	// Block 5 cannot be read nor written: the read is still served, and
	// the leg goes.
	repaired := st.Repaired.Load()
	disk.SetBad(DataOff+5*blockSize, true)
	for range 4 {
		if err := f.read(h, 5); err != nil {
			t.Fatal(err)
		}
	}
	if got := f.m.LegStates(); got[1] != "out" {
		t.Fatalf("legs %v after a block that could not be rewritten, want leg 1 out", got)
	}
	if st.Repaired.Load() != repaired || st.TakenOut.Load() != 1 {
		t.Fatalf("%d repaired, %d taken out; want %d and 1", st.Repaired.Load(), st.TakenOut.Load(), repaired)
	}
	for blk := range int64(8) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	// A bad block on leg 0, the last in sync: the read fails with EIO,
	// and the leg stays (the mirror goes on); a write mends the block.
	disks[0].SetBad(DataOff+7*blockSize, false)
	if err := f.do(rnbd.OpRead, 7*blockSize); !errors.Is(err, syscall.EIO) {
		t.Fatalf("a read of a bad block on the last leg in sync: %v, want EIO", err)
	}
	if got := f.m.LegStates(); got[0] != "in sync" || f.m.Failed() {
		t.Fatalf("legs %v (failed %v) after a bad block on the last leg in sync", got, f.m.Failed())
	}
	if err := f.write(h, 7); err != nil {
		t.Fatal(err)
	}
	for blk := range int64(8) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	// Leg 1 rejoins, and its resync's source, leg 0, has a bad block in
	// what it copies: the resync stops and leg 1 stays out, but leg 0,
	// which answers, stays in and the mirror serves.
	disk.SetBad(DataOff+5*blockSize, false) // writable again
	disks[0].SetBad(DataOff+4*blockSize, false)
	f.m.leg(1).dev.Session().Close() // it holds the device, as rnbd-client's rejoin closes it
	f.rejoin(1)
	f.waitResync()
	if got := f.m.LegStates(); got[0] != "in sync" || got[1] != "out" || f.m.Failed() {
		t.Fatalf("legs %v (failed %v) after a resync from a bad block, want leg 0 in sync and 1 out", got, f.m.Failed())
	}
	for _, blk := range []int64{0, 1, 2, 3, 5, 6, 7} {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
}

// badDiskFleet is a fleet of two legs whose storage nodes' disks are
// FUSE files with bad blocks (test/testfs), and the files behind them.
func badDiskFleet(t *testing.T) (*fleet, []*testfs.BadFile, []string) {
	f := newFleet(t, 2, false)
	var disks []*testfs.BadFile
	var backing []string
	for _, n := range f.nodes {
		n.stop()
		backing = append(backing, filepath.Join(n.dir, "vol"))
		mnt := t.TempDir()
		disks = append(disks, testfs.BadBlocks(t, mnt, "vol", backing[len(backing)-1]))
		n.dir = mnt
		n.start()
	}
	t.Cleanup(func() { // before the unmounts
		f.crash()
		for _, n := range f.nodes {
			n.stop()
		}
	})
	return f, disks, backing
}

// TestMirrorReconcileBadBlock: the assembly after a client crash copies
// the crash's dirty regions from one leg to the other; a block its
// source cannot read is read from the other leg instead, and written
// back to the source, which mends it. Each leg's disk in turn has the
// bad block: one of the two is the source.
func TestMirrorReconcileBadBlock(t *testing.T) {
	sourceReads := 0
	for bad := range 2 {
		f, disks, backing := badDiskFleet(t)
		h := f.openWritten(8)
		f.crash() // the region of blocks 0 to 7 stays dirty
		disks[bad].SetBad(DataOff+3*blockSize, false)
		if err := f.open(nil); err != nil {
			t.Fatalf("bad block on leg %d: the assembly after a crash: %v", bad, err)
		}
		readErrs, _, left := disks[bad].Counts()
		if left != 0 {
			t.Fatalf("bad block on leg %d: not mended by the reconcile", bad)
		}
		sourceReads += readErrs
		if got := f.m.LegStates(); got[0] != "in sync" || got[1] != "in sync" {
			t.Fatalf("bad block on leg %d: legs %v after the assembly", bad, got)
		}
		if !legsEqual(t, backing) {
			t.Fatalf("bad block on leg %d: the legs differ after the reconcile", bad)
		}
		for blk := range int64(8) {
			if err := f.read(h, blk); err != nil {
				t.Fatal(err)
			}
		}
		checkHistory(t, h)
	}
	if sourceReads != 1 {
		t.Fatalf("the reconcile's source read a bad block %d times in two assemblies, want once (one of the legs is the source)", sourceReads)
	}
}

// openWritten creates the fleet's mirror, opens it and writes blocks 0
// to n-1, recorded in the history it returns.
func (f *fleet) openWritten(n int64) *history.History {
	f.t.Helper()
	f.create()
	if err := f.open(nil); err != nil {
		f.t.Fatal(err)
	}
	h := history.New(0)
	for blk := range n {
		if err := f.write(h, blk); err != nil {
			f.t.Fatal(err)
		}
	}
	return h
}

// legsEqual compares the data of two legs' files.
func legsEqual(t *testing.T, files []string) bool {
	a, err := os.ReadFile(files[0])
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(files[1])
	if err != nil {
		t.Fatal(err)
	}
	return bytes.Equal(a[DataOff:], b[DataOff:])
}
