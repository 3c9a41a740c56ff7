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
	// Every block's bit set and stored: no metadata IO in the loop.
	const blocks = 1024
	for blk := range blocks {
		done := make(chan error, 1)
		if err := f.m.Submit(context.Background(), &Req{Op: rnbd.OpWrite, Off: int64(blk) * size, Len: size, Buf: buf,
			Done: func(_ *Req, err error) { done <- err }}); err != nil {
			b.Fatal(err)
		}
		if err := <-done; err != nil {
			b.Fatal(err)
		}
	}
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
			r := &Req{}
			fin := func(_ *Req, err error) { done <- err }
			lr := &rnbd.IOReq{}
			lfin := func(_ *rnbd.IOReq, err error) { done <- err }
			for j := range per {
				off := int64((i*per+j)%blocks) * size
				var err error
				if legOnly {
					*lr = rnbd.IOReq{Op: op, Off: DataOff + off, Len: size, Buf: legBuf, BufOff: i * size, Done: lfin}
					err = leg.Submit(context.Background(), lr)
				} else {
					*r = Req{Op: op, Off: off, Len: size, Buf: buf, BufOff: i * size, Done: fin}
					err = f.m.Submit(context.Background(), r)
				}
				if err != nil {
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
