package rtrs

import (
	"bytes"
	"math/rand/v2"
	"net"
	"net/netip"
	"sync"
	"testing"
	"time"

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

// TestWriteReadWindows: always_invalidate by memory windows (the TCP
// fabric's emulation of them: unbind on arrival, the request processed on
// its completion, bind in front of the answer).
func TestWriteReadWindows(t *testing.T) {
	for _, async := range []bool{false, true} {
		n, _ := memNet()
		fab := tcp.New(tcp.Options{Network: n, Name: "mem", Windows: true})
		testWriteRead(t, fab, ap("10.0.0.1:1234"), true, async)
	}
}

func TestWriteReadTCP(t *testing.T) {
	for _, inv := range []bool{true, false} {
		testWriteRead(t, tcp.New(tcp.Options{}), loopbackListener(t), inv, true)
	}
}

// burstConfirmer counts its requests' completions and defers a flush of
// itself to their burst.
type burstConfirmer struct {
	mu        sync.Mutex
	confirmed int
	inBurst   int
	flushed   int // completions a Flush found
	errs      []error
	done      chan struct{}
	want      int
}

func (c *burstConfirmer) Confirm(err error) { c.ConfirmBurst(err, nil) }

func (c *burstConfirmer) ConfirmBurst(err error, b *Burst) {
	c.mu.Lock()
	c.confirmed++
	if err != nil {
		c.errs = append(c.errs, err)
	}
	c.mu.Unlock()
	if b == nil {
		c.Flush()
		return
	}
	c.mu.Lock()
	c.inBurst++
	c.mu.Unlock()
	b.Defer(c)
}

func (c *burstConfirmer) Flush() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.flushed = c.confirmed
	if c.flushed == c.want {
		close(c.done)
	}
}

// TestPlugAndBurst sends a queue depth of reads and writes held in one
// plug, then checks that on the TCP fabric every completion came in a
// burst whose end flushed what it deferred, and that the data is right.
func TestPlugAndBurst(t *testing.T) {
	_, fab := memNet()
	disk := newMemDisk(4 << 20)
	r := newRig(t, fab, testServerConfig(fab, disk, ap("10.0.0.1:1234")), testClientConfig(fab, pa("", "10.0.0.1:1234")))
	n := r.sess.QueueDepth()
	const size = 4096
	for i := range n {
		copy(r.buf.Bytes()[i*size:], bytes.Repeat([]byte{byte(i + 1)}, size))
	}
	conf := &burstConfirmer{done: make(chan struct{}), want: n}
	var pl Plug
	for i := range n {
		p := r.sess.TryGetPermit(IOCon)
		if p == nil {
			t.Fatalf("permit %d of %d", i, n)
		}
		t.Cleanup(func() { r.sess.PutPermit(p) })
		if err := r.sess.RequestPlugged(&pl, Write, p, conf, offsetHdr(uint64(i*size)), r.buf, i*size, size); err != nil {
			t.Fatal(err)
		}
	}
	pl.Unplug()
	select {
	case <-conf.done:
	case <-time.After(20 * time.Second):
		t.Fatalf("%d of %d plugged writes flushed", conf.flushed, n)
	}
	if conf.inBurst != n || len(conf.errs) != 0 {
		t.Fatalf("%d of %d completions in a burst, errors %v", conf.inBurst, n, conf.errs)
	}
	if got := disk.bytes(0, n*size); !bytes.Equal(got, r.buf.Bytes()[:n*size]) {
		t.Fatal("the server has other data than written")
	}
	r.assertHealthy()
}
