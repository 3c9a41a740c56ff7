package rnbd

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// BenchmarkCltDevIO is the client's IO path end to end over TCP loopback:
// CltDev.Submit of 4 KiB requests to an RNBD server exporting a file, at
// queue depth 1 and 32. One op is one request completed; allocs/op is the
// point (the hot path must not allocate), ops/s the throughput.
func BenchmarkCltDevIO(b *testing.B) {
	for _, op := range []Op{OpRead, OpWrite} {
		for _, qd := range []int{1, 32} {
			b.Run(fmt.Sprintf("%v/qd%d", op, qd), func(b *testing.B) { benchCltDev(b, op, qd) })
		}
	}
}

func benchCltDev(b *testing.B, op Op, qd int) {
	const size = 4096
	dir := b.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "f"), make([]byte, 64<<20), 0o600); err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	dst := l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	fab := tcp.New(tcp.Options{})
	srv := NewServer(SrvConfig{DevSearchPath: dir, Log: log.Discard()})
	defer srv.Close()
	scfg := rtrs.DefaultSrvConfig()
	scfg.Fabric, scfg.Handler, scfg.Listen, scfg.Log = fab, srv, []netip.AddrPort{dst}, log.Discard()
	rs, err := rtrs.NewServer(scfg)
	if err != nil {
		b.Fatal(err)
	}
	defer rs.Close()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = "bench", fab, log.Discard()
	cfg.ConnsPerPath = 2
	cfg.Paths = []rtrs.PathAddr{{Dst: dst}}
	s, err := DialSession(context.Background(), cfg, 0)
	if err != nil {
		b.Fatal(err)
	}
	defer s.Close()
	d, err := s.Map(context.Background(), "f", AccessRW)
	if err != nil {
		b.Fatal(err)
	}
	buf, err := s.Session().AllocBuffer(qd * size)
	if err != nil {
		b.Fatal(err)
	}
	var wg sync.WaitGroup
	per := b.N / qd
	b.ReportAllocs()
	b.ResetTimer()
	start := time.Now()
	for i := 0; i < qd; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			done := make(chan error, 1)
			r := &IOReq{}
			fin := func(_ *IOReq, err error) { done <- err }
			for j := 0; j < per; j++ {
				*r = IOReq{Op: op, Off: int64((i*per+j)%16384) * size, Len: size, Buf: buf, BufOff: i * size, Done: fin}
				if err := d.Submit(context.Background(), r); err != nil {
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
