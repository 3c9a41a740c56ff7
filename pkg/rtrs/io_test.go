package rtrs

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"net"
	"net/netip"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
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
	mu sync.Mutex
	// +checklocks:mu
	confirmed int
	// +checklocks:mu
	inBurst int
	// +checklocks:mu
	flushed int // completions a Flush found
	// +checklocks:mu
	errs []error
	done chan struct{} // +checklocksignore: set once, before it is shared
	want int           // +checklocksignore: set once, before it is shared
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

// TestBufferIDsReused: a freed buffer's id is taken by the next buffer,
// so the session's table of regions (and each path's, copied on every
// registration) is as long as the buffers alive at once, not as those
// ever allocated; IO through a buffer on a reused id lands in it.
func TestBufferIDsReused(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.7.0.1:1234")
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), testClientConfig(fab, pa("10.7.0.2", srvAddr.String())))
	before := len(r.sess.regions) // +checklocksignore: no buffer is allocated or freed meanwhile
	for i := 0; i < 1000; i++ {
		b, err := r.sess.AllocBuffer(4096)
		if err != nil {
			t.Fatal(err)
		}
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
	}
	if n := len(r.sess.regions); n != before { // +checklocksignore: as above
		t.Fatalf("%d regions after 1000 buffers allocated and freed one at a time, %d before", n, before)
	}
	// A hole below the last buffer is filled first.
	a, _ := r.sess.AllocBuffer(4096)
	b, _ := r.sess.AllocBuffer(4096)
	if err := a.Free(); err != nil {
		t.Fatal(err)
	}
	c, err := r.sess.AllocBuffer(4096)
	if err != nil {
		t.Fatal(err)
	}
	if c.idx != a.idx {
		t.Fatalf("new buffer took id %d, the freed one was %d", c.idx, a.idx)
	}
	if err := a.Free(); err == nil {
		t.Fatal("a second Free of a buffer whose id was reused succeeded")
	}
	want := bytes.Repeat([]byte("reused"), 4096/6+1)[:4096]
	copy(c.Bytes(), want)
	if err := r.sess.Do(context.Background(), IOCon, Write, offsetHdr(8192), c, 0, 4096); err != nil {
		t.Fatal(err)
	}
	clear(c.Bytes())
	if err := r.sess.Do(context.Background(), IOCon, Read, offsetHdr(8192), c, 0, 4096); err != nil || !bytes.Equal(c.Bytes(), want) {
		t.Fatalf("IO through a buffer on a reused id: %v", err)
	}
	b.Free()
	c.Free()
}

// countingFabric counts the memory its AllocMemory hands out and that is
// not freed yet.
type countingFabric struct {
	fabric.Fabric
	live atomic.Int64
}

type countedMemory struct {
	fabric.Memory
	f    *countingFabric
	once sync.Once
}

func (m *countedMemory) Free() error {
	m.once.Do(func() { m.f.live.Add(-1) })
	return m.Memory.Free()
}

func (f *countingFabric) AllocMemory(n int) (fabric.Memory, error) {
	m, err := f.Fabric.AllocMemory(n)
	if err != nil {
		return nil, err
	}
	f.live.Add(1)
	return &countedMemory{Memory: m, f: f}, nil
}

// TestSessionFreesMemory: a closed session leaves no memory of its own
// behind (the permits' header memory, mmapped on RDMA, was never freed),
// and frees it only once no permit is out: a user may still hold one
// across Close and write its header.
func TestSessionFreesMemory(t *testing.T) {
	_, fab := memNet()
	cf := &countingFabric{Fabric: fab}
	srvAddr := ap("10.7.0.1:1234")
	srv, err := NewServer(testServerConfig(fab, newMemDisk(1<<20), srvAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	for _, holdPermit := range []bool{false, true} {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		// A name per round: the server may not have let go of the
		// last round's session when this one dials.
		ccfg := testClientConfig(cf, pa("10.7.0.2", srvAddr.String()))
		ccfg.SessName = fmt.Sprintf("testsess-%v", holdPermit)
		sess, err := DialSession(ctx, ccfg)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
		b, err := sess.AllocBuffer(4096)
		if err != nil {
			t.Fatal(err)
		}
		if err := sess.Do(context.Background(), IOCon, Write, offsetHdr(0), b, 0, 4096); err != nil {
			t.Fatal(err)
		}
		var pm *Permit
		if holdPermit {
			if pm, err = sess.GetPermit(context.Background(), IOCon); err != nil {
				t.Fatal(err)
			}
		}
		sess.Close()
		if err := b.Free(); err != nil {
			t.Fatal(err)
		}
		if holdPermit {
			if n := cf.live.Load(); n != 1 {
				t.Fatalf("a permit out across Close: %d memories live, want the header memory alone", n)
			}
			copy(pm.hdr, "still mine")
			sess.PutPermit(pm)
		}
		if n := cf.live.Load(); n != 0 {
			t.Fatalf("hold permit %v: %d memories left after Close", holdPermit, n)
		}
	}
}

// failOnceFabric fails its first AllocMemory with ENOMEM.
type failOnceFabric struct {
	fabric.Fabric
	failed atomic.Bool
}

func (f *failOnceFabric) AllocMemory(n int) (fabric.Memory, error) {
	if f.failed.CompareAndSwap(false, true) {
		return nil, syscall.ENOMEM
	}
	return f.Fabric.AllocMemory(n)
}

// TestInitRetriedByNextPath: a session whose first path could not size it
// (memory short for the permits' headers) is sized by the next path's
// connection, not failed on every path with the first one's error.
func TestInitRetriedByNextPath(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.7.0.1:1234")
	srv, err := NewServer(testServerConfig(fab, newMemDisk(1<<20), srvAddr))
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	ff := &failOnceFabric{Fabric: fab}
	cfg := testClientConfig(ff, pa("10.7.0.2", srvAddr.String()), pa("10.7.0.3", srvAddr.String()))
	cfg.OpenAnyPath = true
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	sess, err := DialSession(ctx, cfg)
	if err != nil {
		t.Fatalf("open with the first path's memory short: %v", err)
	}
	defer sess.Close()
	if !ff.failed.Load() || sess.QueueDepth() == 0 {
		t.Fatalf("failed %v, queue depth %d", ff.failed.Load(), sess.QueueDepth())
	}
	b, err := sess.AllocBuffer(4096)
	if err != nil {
		t.Fatal(err)
	}
	defer b.Free()
	if err := sess.Do(context.Background(), IOCon, Write, offsetHdr(0), b, 0, 4096); err != nil {
		t.Fatal(err)
	}
}

// TestShareBuffer: one memory, registered with two sessions to two
// servers, carries a write to each and the reads back from each (a
// mirror's legs); the shared buffer's Free leaves the memory to its
// owner, which keeps working; a header buffer and a buffer of another
// kind of fabric are refused.
func TestShareBuffer(t *testing.T) {
	_, fab := memNet()
	a := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), ap("10.7.0.1:1234")), testClientConfig(fab, pa("10.7.0.3", "10.7.0.1:1234")))
	b := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), ap("10.7.0.2:1234")), testClientConfig(fab, pa("10.7.0.4", "10.7.0.2:1234")))
	own, err := a.sess.AllocBuffer(8192)
	if err != nil {
		t.Fatal(err)
	}
	defer own.Free()
	shared, err := b.sess.ShareBuffer(own)
	if err != nil {
		t.Fatal(err)
	}
	if &shared.Bytes()[0] != &own.Bytes()[0] {
		t.Fatal("the shared buffer is other memory")
	}
	want := bytes.Repeat([]byte("mirrored"), 512)
	copy(own.Bytes(), want)
	ctx := context.Background()
	if err := a.sess.Do(ctx, IOCon, Write, offsetHdr(4096), own, 0, 4096); err != nil {
		t.Fatal(err)
	}
	if err := b.sess.Do(ctx, IOCon, Write, offsetHdr(4096), shared, 0, 4096); err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(a.disk.bytes(4096, 4096), want) || !bytes.Equal(b.disk.bytes(4096, 4096), want) {
		t.Fatal("a server did not get the buffer's bytes")
	}
	if err := b.sess.Do(ctx, IOCon, Read, offsetHdr(4096), shared, 4096, 4096); err != nil || !bytes.Equal(own.Bytes()[4096:], want) {
		t.Fatalf("read through the shared buffer: %v", err)
	}
	if err := shared.Free(); err != nil {
		t.Fatal(err)
	}
	clear(own.Bytes())
	if err := a.sess.Do(ctx, IOCon, Read, offsetHdr(4096), own, 0, 4096); err != nil || !bytes.Equal(own.Bytes()[:4096], want) {
		t.Fatalf("the owner after the shared buffer's Free: %v", err)
	}
	if _, err := b.sess.ShareBuffer(a.sess.regions[0]); err == nil { // +checklocksignore: the header buffer, fixed
		t.Fatal("a header buffer was shared")
	}
	ccfg := testClientConfig(renamedFabric{fab}, pa("10.7.0.5", "10.7.0.1:1234"))
	ccfg.SessName = "other-fabric"
	c, err := DialSession(ctx, ccfg)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.ShareBuffer(own); err == nil || !strings.Contains(err.Error(), "shared with a") {
		t.Fatalf("a buffer shared with a session of another kind of fabric: %v", err)
	}
}

// renamedFabric is a fabric of another name: memory of the one it wraps
// is not its memory.
type renamedFabric struct{ fabric.Fabric }

func (renamedFabric) Name() string { return "other" }
