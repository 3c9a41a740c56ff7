package mirror

import (
	"context"
	"fmt"
	"sync"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rnbd"
)

// BenchmarkMirrorIO is a mirror of two legs (and a witness) on the
// in-memory fabric: Submit of 4 KiB reads and writes at queue depth 1
// and 32, over blocks whose bitmap bits are set (the steady state), and
// the same through one leg's rnbd.CltDev alone for comparison. One op is
// one request completed. allocs/op is the point: the mirror's part of
// it must be 0 — a mirror's op costs its legs' ops (two writes, one
// read) and nothing more.
func BenchmarkMirrorIO(b *testing.B) {
	for _, op := range []rnbd.Op{rnbd.OpRead, rnbd.OpWrite} {
		for _, qd := range []int{1, 32} {
			b.Run(fmt.Sprintf("mirror/%v/qd%d", op, qd), func(b *testing.B) { benchMirror(b, op, qd, false) })
			b.Run(fmt.Sprintf("leg/%v/qd%d", op, qd), func(b *testing.B) { benchMirror(b, op, qd, true) })
		}
	}
}

func benchMirror(b *testing.B, op rnbd.Op, qd int, legOnly bool) {
	const size = 4096
	f := newFleet(b, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		b.Fatal(err)
	}
	buf, err := f.m.AllocBuffer(qd * size)
	if err != nil {
		b.Fatal(err)
	}
	defer buf.Free()
	leg := f.m.leg(0).dev
	legBuf := buf.legs[0]
	if legOnly {
		dirtyAll(b, f.m, buf)
		runIO(b, qd, func(i, _ int, off int64, lr *rnbd.IOReq, _ *Req, lfin func(*rnbd.IOReq, error), _ func(*Req, error)) error {
			*lr = rnbd.IOReq{Op: op, Off: DataOff + off, Len: size, Buf: legBuf, BufOff: i * size, Done: lfin}
			return leg.Submit(context.Background(), lr)
		})
		return
	}
	benchRun(b, f.m, buf, op, qd)
}

// dirtyAll writes every block of the benchmarks once: each bitmap bit
// set and stored, so that the loop does no metadata IO.
func dirtyAll(b *testing.B, m *Mirror, buf *Buffer) {
	for blk := range benchBlocks {
		done := make(chan error, 1)
		if err := m.Submit(context.Background(), &Req{Op: rnbd.OpWrite, Off: int64(blk) * 4096, Len: 4096, Buf: buf,
			Done: func(_ *Req, err error) { done <- err }}); err != nil {
			b.Fatal(err)
		}
		if err := <-done; err != nil {
			b.Fatal(err)
		}
	}
}

// benchBlocks are the 4 KiB blocks the benchmarks go over, their bitmap
// bits set first.
const benchBlocks = 1024

// benchRun runs b.N requests of op on m, qd at a time, over benchBlocks
// blocks.
func benchRun(b *testing.B, m *Mirror, buf *Buffer, op rnbd.Op, qd int) {
	dirtyAll(b, m, buf)
	runIO(b, qd, func(i, _ int, off int64, _ *rnbd.IOReq, r *Req, _ func(*rnbd.IOReq, error), fin func(*Req, error)) error {
		*r = Req{Op: op, Off: off, Len: 4096, Buf: buf, BufOff: i * 4096, Done: fin}
		return m.Submit(context.Background(), r)
	})
}

// runIO runs b.N requests from qd goroutines, each submitting its next
// once its last completed: submit gives goroutine i's j-th, at block
// offset off, with the goroutine's own requests and callbacks (made
// once: the loop allocates nothing of its own).
func runIO(b *testing.B, qd int, submit func(i, j int, off int64, lr *rnbd.IOReq, r *Req, lfin func(*rnbd.IOReq, error), fin func(*Req, error)) error) {
	var wg sync.WaitGroup
	per := b.N / qd
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for i := range qd {
		wg.Add(1)
		go func() {
			defer wg.Done()
			done := make(chan error, 1)
			r, lr := &Req{}, &rnbd.IOReq{}
			fin := func(_ *Req, err error) { done <- err }
			lfin := func(_ *rnbd.IOReq, err error) { done <- err }
			for j := range per {
				if err := submit(i, j, int64((i*per+j)%benchBlocks)*4096, lr, r, lfin, fin); err != nil {
					b.Error(err)
					return
				}
				if err := <-done; err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	b.ReportMetric(float64(per*qd)/time.Since(start).Seconds(), "ops/s")
}
