package rtrs

import (
	"context"
	"fmt"
	"net/netip"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// nullDisk answers every request at once without touching the data: the
// benchmark measures the transport.
type nullDisk struct{}

func (nullDisk) LinkEvent(*SrvSession, SrvLinkEvent) error { return nil }
func (nullDisk) HandleIO(op *SrvOp) error {
	op.Respond(nil)
	return nil
}

// benchSlot is one request slot of the benchmark's queue.
type benchSlot struct {
	done chan error
}

func (b *benchSlot) Confirm(err error) { b.done <- err }

// BenchmarkIO measures 4 KiB request round trips over TCP loopback: one
// op is one request answered. ops/s is the throughput at that queue depth.
func BenchmarkIO(b *testing.B) {
	for _, inv := range []bool{false, true} {
		for _, dir := range []Dir{Read, Write} {
			for _, qd := range []int{1, 32} {
				name := fmt.Sprintf("%s/qd%d/always_invalidate=%v", dir, qd, inv)
				b.Run(name, func(b *testing.B) { benchIO(b, dir, qd, 4096, inv) })
			}
		}
	}
}

func benchIO(b *testing.B, dir Dir, qd, size int, inv bool) {
	fab := tcp.New(tcp.Options{})
	dst := loopbackListener(b)
	scfg := DefaultServerConfig()
	scfg.Fabric, scfg.Handler, scfg.Listen, scfg.Log = fab, nullDisk{}, []netip.AddrPort{dst}, testLog()
	scfg.AlwaysInvalidate = inv
	srv, err := NewServer(scfg)
	if err != nil {
		b.Fatal(err)
	}
	defer srv.Close()
	ccfg := testClientConfig(fab, PathAddr{Dst: dst})
	ccfg.ConnsPerPath = 2
	sess, err := Open(context.Background(), ccfg)
	if err != nil {
		b.Fatal(err)
	}
	defer sess.Close()
	buf, err := sess.AllocBuffer(qd * size)
	if err != nil {
		b.Fatal(err)
	}
	usr := make([]byte, 32)
	var next atomic.Int64
	var wg sync.WaitGroup
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < qd; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			slot := &benchSlot{done: make(chan error, 1)}
			p, err := sess.GetPermit(context.Background(), IOCon)
			if err != nil {
				b.Error(err)
				return
			}
			defer sess.PutPermit(p)
			for next.Add(1) <= int64(b.N) {
				if err := sess.Request(dir, p, slot, usr, buf, i*size, size); err != nil {
					b.Error(err)
					return
				}
				if err := <-slot.done; err != nil {
					b.Error(err)
					return
				}
			}
		}()
	}
	wg.Wait()
	el := time.Since(start)
	b.StopTimer()
	b.ReportMetric(float64(b.N)/el.Seconds(), "ops/s")
}
