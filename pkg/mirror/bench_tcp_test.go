package mirror

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"testing"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// BenchmarkMirrorTCP is BenchmarkMirrorIO over TCP loopback, whose
// fabric allocates nothing per request (rnbd's BenchmarkCltDevIO): two
// legs, each an RNBD server of its own exporting a file, their sessions
// dialled as rnbd-client dials them. allocs/op counts everything — the
// servers', the legs' sessions' and the mirror's — and must be 0.
func BenchmarkMirrorTCP(b *testing.B) {
	for _, op := range []rnbd.Op{rnbd.OpRead, rnbd.OpWrite} {
		for _, qd := range []int{1, 32} {
			b.Run(fmt.Sprintf("%v/qd%d", op, qd), func(b *testing.B) { benchMirrorTCP(b, op, qd) })
		}
	}
}

func benchMirrorTCP(b *testing.B, op rnbd.Op, qd int) {
	m, buf := tcpMirror(b, qd)
	benchRun(b, m, buf, op, qd)
}

// TestMirrorTCPAllocs: a read and a write of a mapped mirror over TCP
// loopback allocate nothing, end to end (the mirror's, its legs'
// sessions' and their servers'): the hot path's promise, held by
// make test (its run without the race detector) as well as shown by
// BenchmarkMirrorTCP.
func TestMirrorTCPAllocs(t *testing.T) {
	if raceDetector {
		t.Skip("the race detector allocates (make test runs this test without it too)")
	}
	m, buf := tcpMirror(t, 1)
	done := make(chan error, 1)
	r := &Req{}
	fin := func(_ *Req, err error) { done <- err }
	for _, op := range []rnbd.Op{rnbd.OpWrite, rnbd.OpRead} {
		io := func() {
			*r = Req{Op: op, Off: 64 << 10, Len: 4096, Buf: buf, Done: fin}
			if err := m.Submit(context.Background(), r); err != nil {
				t.Fatal(err)
			}
			if err := <-done; err != nil {
				t.Fatal(err)
			}
		}
		io() // the first write sets its region's bit: metadata IO, once
		// Heartbeats and timers may allocate now and then; a request
		// that allocated would show as 1 or more.
		if n := testing.AllocsPerRun(2000, io); n > 0.1 {
			t.Errorf("a %v of the mirror allocates %.2f times", op, n)
		}
	}
}

// tcpMirror is a new mirror of two tcpLegs, open, and a buffer of qd
// blocks of 4 KiB; closed at the end of tb.
func tcpMirror(tb testing.TB, qd int) (*Mirror, *Buffer) {
	ctx := context.Background()
	fab := tcp.New(tcp.Options{})
	cfg := Config{Layout: Layout{Mirror: testMirror, NLegs: 2}, Log: log.Discard()}
	for i := range 2 {
		cfg.Legs = append(cfg.Legs, tcpLeg(tb, fab, fmt.Sprintf("bench-leg%d", i)))
		cfg.Names = append(cfg.Names, fmt.Sprintf("leg%d", i))
	}
	if err := Create(ctx, cfg); err != nil {
		tb.Fatal(err)
	}
	m, err := Open(ctx, cfg)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { m.Close() })
	buf, err := m.AllocBuffer(qd * 4096)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { buf.Free() })
	return m, buf
}

// tcpLeg is a device of an RNBD server of its own on a loopback port,
// a file of the metadata and 64 MiB of data, opened through session
// sess; all closed at the benchmark's end.
func tcpLeg(b testing.TB, fab fabric.Fabric, sess string) *rnbd.CltDev {
	dir := b.TempDir()
	if err := os.WriteFile(filepath.Join(dir, "vol"), nil, 0o600); err != nil {
		b.Fatal(err)
	}
	if err := os.Truncate(filepath.Join(dir, "vol"), DataOff+64<<20); err != nil {
		b.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	dst := l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	srv := rnbd.NewServer(rnbd.SrvConfig{DevSearchPath: dir, Log: log.Discard()})
	b.Cleanup(func() { srv.Close() })
	scfg := rtrs.DefaultSrvConfig()
	scfg.Fabric, scfg.Handler, scfg.Listen, scfg.Log = fab, srv, []netip.AddrPort{dst}, log.Discard()
	rs, err := rtrs.NewServer(scfg)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { rs.Close() })
	ccfg := rtrs.DefaultCltConfig()
	ccfg.SessName, ccfg.Fabric, ccfg.Log = sess, fab, log.Discard()
	ccfg.ConnsPerPath = 2
	ccfg.Paths = []rtrs.PathAddr{{Dst: dst}}
	s, err := rnbd.DialSession(context.Background(), ccfg, 0)
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { s.Close() })
	d, err := s.Map(context.Background(), "vol", rnbd.AccessRW)
	if err != nil {
		b.Fatal(err)
	}
	return d
}
