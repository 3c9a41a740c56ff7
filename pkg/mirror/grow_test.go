package mirror

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/test/history"
)

// growFile makes a node's leg file size bytes, the bytes added holding
// garbage of the node's own (what a block device's growth leaves there)
// at off within the data.
func growFile(t *testing.T, n *node, size, off int64, garbage byte) {
	t.Helper()
	f, err := os.OpenFile(filepath.Join(n.dir, "vol"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt(bytes.Repeat([]byte{garbage}, 2*blockSize), DataOff+off); err != nil {
		t.Fatal(err)
	}
}

// TestMirrorGrow: a mirror grows while it serves once its legs have;
// what the legs held in the bytes added (garbage, each its own) reads as
// zeros from either leg, the bytes added take writes, and the size holds
// across an assembly. Grown past 32,768 regions, it stores a second
// bitmap block on the legs, clean, which the next assembly loads.
func TestMirrorGrow(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	h := history.New(0)
	for blk := range int64(testData / blockSize / 4) {
		if err := f.write(h, blk*4); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.m.Grow(ctx, testData-blockSize); err == nil || !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "grows only") {
		t.Fatalf("a smaller size: %v, want EINVAL, grows only", err)
	}
	if err := f.m.Grow(ctx, testData+100); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("a size not a multiple of 4096: %v, want EINVAL", err)
	}
	// The legs have not grown: refused, naming the leg.
	size := int64(8 << 20)
	if err := f.m.Grow(ctx, size); !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "grow its volume on its storage node first") {
		t.Fatalf("legs too small: %v, want ENOSPC", err)
	}
	// One leg grown: still refused; both: grown.
	growFile(t, f.nodes[0], DataOff+size, testData, 0xa5)
	if err := f.m.Grow(ctx, size); !errors.Is(err, syscall.ENOSPC) || !strings.Contains(err.Error(), "leg 1") {
		t.Fatalf("leg 1 too small: %v, want ENOSPC naming it", err)
	}
	growFile(t, f.nodes[1], DataOff+size, testData, 0x5a)
	// This first growth zeroes as on a device without write-zeroes.
	f.m.zeroByWrites = true
	if got := f.m.Size(); got != testData {
		t.Fatalf("refused grows changed the size: %d", got)
	}
	if err := f.do(rnbd.OpRead, testData); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("a read past the size before the growth: %v, want EINVAL", err)
	}
	if err := f.m.Grow(ctx, size); err != nil {
		t.Fatal(err)
	}
	if err := f.m.Grow(ctx, size); err != nil {
		t.Fatalf("the size it has (a retry): %v", err)
	}
	if got := f.m.Size(); got != size {
		t.Fatalf("size %d, want %d", got, size)
	}
	f.m.zeroByWrites = false
	// The bytes added read as zeros from each leg, whatever it held.
	for range 4 { // round-robin: both legs
		if err := f.read(h, testData/blockSize); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 2 {
		b := f.nodes[i].file("vol")
		if !allZero(b[DataOff+testData:]) {
			t.Fatalf("leg %d holds its garbage in the bytes added", i)
		}
	}
	for blk := int64(testData / blockSize); blk < size/blockSize; blk += 97 {
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	f.crash()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	if got := f.m.Size(); got != size {
		t.Fatalf("assembled again: size %d, want %d", got, size)
	}
	for blk := range size / blockSize {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)

	// Past one bitmap block of 64 KiB regions (2 GiB): a second block,
	// clean on the legs, marked by the writes to it.
	big := int64(regionsPerBlock)<<minRegionShift + 8<<20
	for i := range 2 {
		growFile(t, f.nodes[i], DataOff+big, big-2*blockSize, byte(i+1))
		// What a reused device holds where the second block goes.
		b, err := os.OpenFile(filepath.Join(f.nodes[i].dir, "vol"), os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		_, err = b.WriteAt(bytes.Repeat([]byte{0xff}, BitmapBlock), BitmapOff+BitmapBlock)
		b.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	if err := f.m.Grow(ctx, big); err != nil {
		t.Fatal(err)
	}
	if got := f.m.bm.Blocks(); got != 2 {
		t.Fatalf("%d bitmap blocks, want 2", got)
	}
	f.crash()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	if got := f.m.Size(); got != big {
		t.Fatalf("assembled again: size %d, want %d", got, big)
	}
	if rs := f.m.bm.Runs(regionsPerBlock); len(rs) != 0 {
		t.Fatalf("the second bitmap block marks %v", rs)
	}
	last := big/blockSize - 1
	if err := f.write(h, last); err != nil {
		t.Fatal(err)
	}
	for _, blk := range []int64{0, 4, testData / blockSize, last - 1, last} {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	checkHistory(t, h)
}

// TestMirrorGrowNeedsEveryLeg: a mirror with a leg out does not grow
// (the leg would come back without the bytes added), nor one whose leg
// went out while it grew.
func TestMirrorGrowNeedsEveryLeg(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	size := int64(8 << 20)
	for i := range 2 {
		growFile(t, f.nodes[i], DataOff+size, testData, 0)
	}
	h := history.New(0)
	f.nodes[1].stop()
	if err := f.write(h, 1); err != nil {
		t.Fatal(err)
	}
	if err := f.m.Grow(ctx, size); err == nil || !strings.Contains(err.Error(), "every leg is in sync") {
		t.Fatalf("a leg out: %v, want a refusal", err)
	}
	if got := f.m.Size(); got != testData {
		t.Fatalf("size %d after a refusal", got)
	}
	f.nodes[1].start()
	f.rejoin(1)
	f.waitResync()
	// A leg taken out while the bytes added are zeroed: nothing
	// changes.
	f.m.grew = func() { f.m.markOut(1) }
	if err := f.m.Grow(ctx, size); err == nil || !strings.Contains(err.Error(), "left or came back while the mirror grew") {
		t.Fatalf("a leg out while growing: %v, want a refusal", err)
	}
	f.m.grew = nil
	if got := f.m.Size(); got != testData {
		t.Fatalf("size %d after a refusal", got)
	}
	if err := f.write(h, 2); err != nil {
		t.Fatal(err)
	}
	// Back through its device, still mapped.
	if err := f.m.Rejoin(ctx, 1, f.m.leg(1).dev, ""); err != nil {
		t.Fatal(err)
	}
	f.waitResync()
	if err := f.m.Grow(ctx, size); err != nil {
		t.Fatal(err)
	}
	if err := f.write(h, size/blockSize-1); err != nil {
		t.Fatal(err)
	}
	if err := f.read(h, size/blockSize-1); err != nil {
		t.Fatal(err)
	}
	checkHistory(t, h)
}
