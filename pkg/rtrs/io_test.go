package rtrs

import (
	"bytes"
	"math/rand/v2"
	"net"
	"net/netip"
	"testing"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

func loopbackListener(t testing.TB) netip.AddrPort {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	a := l.Addr().(*net.TCPAddr).AddrPort()
	l.Close()
	return a
}

func testWriteRead(t *testing.T, fab fabric.Fabric, dst netip.AddrPort, alwaysInvalidate, async bool) {
	disk := newMemDisk(4 << 20)
	disk.async = async
	scfg := testServerConfig(fab, disk, dst)
	scfg.AlwaysInvalidate = alwaysInvalidate
	r := newRig(t, fab, scfg, testClientConfig(fab, PathAddr{Dst: dst}))
	rnd := rand.New(rand.NewPCG(1, 2))
	for i := 0; i < 200; i++ {
		n := 1 + rnd.IntN(r.sess.MaxIOSize())
		off := uint64(rnd.IntN(len(disk.b) - n))
		data := make([]byte, n)
		for j := range data {
			data[j] = byte(rnd.Uint32())
		}
		if err := r.write(off, data); err != nil {
			t.Fatalf("write %d at %d: %v", n, off, err)
		}
		if got := disk.bytes(int(off), n); !bytes.Equal(got, data) {
			t.Fatalf("server has other data than written at %d+%d", off, n)
		}
		got, err := r.read(off, n)
		if err != nil {
			t.Fatalf("read %d at %d: %v", n, off, err)
		}
		if !bytes.Equal(got, data) {
			t.Fatalf("read back other data than written at %d+%d", off, n)
		}
	}
	r.assertHealthy()
	if ev := disk.linkEvents(); len(ev) != 1 || ev[0] != SrvLinkConnected {
		t.Fatalf("server link events %v, want [CONNECTED]", ev)
	}
}

func TestWriteReadMem(t *testing.T) {
	for _, inv := range []bool{true, false} {
		for _, async := range []bool{false, true} {
			_, fab := memNet()
			testWriteRead(t, fab, ap("10.0.0.1:1234"), inv, async)
		}
	}
}

func TestWriteReadTCP(t *testing.T) {
	for _, inv := range []bool{true, false} {
		testWriteRead(t, tcp.New(tcp.Options{}), loopbackListener(t), inv, true)
	}
}
