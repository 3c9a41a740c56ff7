package tcp

import (
	"context"
	"net/netip"
	"runtime"
	"testing"
	"unsafe"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/test/testca"
)

// ConnMemory is what a connection really holds, not less (a server
// counted less than it allocated and passed its budget: issue 30 B) and
// not far more (the budget would hold fewer paths than it could): the
// Go heap and stacks that n connections of an RTRS server's IO size
// (queue depth 512) take, after both ends have sent, so that every
// batch is made.
func TestConnMemory(t *testing.T) {
	t.Run("plain", func(t *testing.T) { testConnMemory(t, New(Options{})) })
	t.Run("tls", func(t *testing.T) {
		ca := testca.New(t, "test ca")
		testConnMemory(t, New(Options{TLS: ca.Config(ca.Issue(t, "peer", "127.0.0.1"))}))
	})
}

func testConnMemory(t *testing.T, f *Fabric) {
	const n = 16
	const maxSend, maxRecv = 512*5 + 1, 512 + 1
	l, err := f.Listen(netip.MustParseAddrPort("127.0.0.1:0"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	dev, err := f.Resolve(context.Background(), netip.AddrPort{}, l.Addr())
	if err != nil {
		t.Fatal(err)
	}
	pd, _ := dev.AllocPD()
	var ms0, ms1 runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms0)
	attr := func(h fabric.Handler) fabric.ConnAttr {
		return fabric.ConnAttr{Handler: h, MaxSendWR: maxSend, MaxRecvWR: maxRecv}
	}
	var conns []fabric.Conn
	var recs []*smallRecorder
	for i := 0; i < n; i++ {
		srv := newSmallRecorder()
		done := make(chan error, 1)
		go func() {
			r, err := l.Accept(context.Background())
			if err == nil {
				var c fabric.Conn
				c, err = r.Accept(pd, attr(srv), nil)
				conns = append(conns, c)
			}
			done <- err
		}()
		cli := newSmallRecorder()
		c, _, err := dev.Dial(context.Background(), fabric.DialParams{Dst: l.Addr(), PD: pd, Attr: attr(cli)})
		if err != nil {
			t.Fatal(err)
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
		recs = append(recs, srv, cli)
	}
	// A signaled write with immediate each way on every connection: the
	// writer's batch and the reader's are made.
	for _, c := range conns {
		c.PostRecv(&fabric.RecvWR{ID: 1})
		if err := c.PostSend(&fabric.SendWR{ID: 7, Op: fabric.OpWriteImm, Signaled: true}); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range recs {
		<-r.wcs
		<-r.wcs
	}
	runtime.GC()
	runtime.ReadMemStats(&ms1)
	held := (int64(ms1.HeapAlloc+ms1.StackInuse) - int64(ms0.HeapAlloc+ms0.StackInuse)) / (2 * n)
	counted := f.ConnMemory(maxSend, maxRecv)
	t.Logf("a connection of %d send and %d receive work requests holds %d KiB, is counted for %d KiB (SendWR %d bytes)",
		maxSend, maxRecv, held>>10, counted>>10, unsafe.Sizeof(fabric.SendWR{}))
	if held > counted {
		t.Errorf("a connection holds %d bytes, more than the %d it is counted for", held, counted)
	}
	if held < counted/2 {
		t.Errorf("a connection holds %d bytes, less than half the %d it is counted for", held, counted)
	}
	for _, c := range conns {
		c.Close()
	}
	runtime.KeepAlive(recs)
}

// smallRecorder is a handler that holds little: conntest.Recorder's
// room for 4096 completions would count as the connection's.
type smallRecorder struct{ wcs chan fabric.WC }

func newSmallRecorder() *smallRecorder { return &smallRecorder{wcs: make(chan fabric.WC, 2)} }

func (r *smallRecorder) Attached(fabric.Conn)     {}
func (r *smallRecorder) Completion(wc *fabric.WC) { r.wcs <- *wc }
func (r *smallRecorder) Disconnected(error)       {}

// AllocMapped's memory is a mapping of its own: page aligned, zero, and
// Free unmaps it once (a second Free does nothing).
func TestAllocMapped(t *testing.T) {
	f := New(Options{})
	m, err := f.AllocMapped(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	b := m.Bytes()
	if len(b) != 1<<20 || uintptr(unsafe.Pointer(&b[0]))%4096 != 0 {
		t.Fatalf("%d bytes at %p", len(b), &b[0])
	}
	for i, v := range b {
		if v != 0 {
			t.Fatalf("byte %d is %#x", i, v)
		}
	}
	b[0] = 1
	if err := m.Free(); err != nil {
		t.Fatal(err)
	}
	if err := m.Free(); err != nil || m.Bytes() != nil {
		t.Fatalf("second Free: %v, bytes %v", err, m.Bytes() != nil)
	}
	if _, err := f.AllocMapped(0); err == nil {
		t.Fatal("a mapping of 0 bytes")
	}
	var _ fabric.Mapper = f
	var _ fabric.ConnCoster = f
}

// A PD tells whether its regions get windows: with Options.Windows.
func TestWindowPD(t *testing.T) {
	for _, w := range []bool{false, true} {
		f := New(Options{Windows: w})
		dev, _ := f.Resolve(context.Background(), netip.AddrPort{}, netip.MustParseAddrPort("127.0.0.1:1"))
		pd, _ := dev.AllocPD()
		if got := pd.(fabric.WindowPD).Windows(); got != w {
			t.Fatalf("Windows %v with Options.Windows %v", got, w)
		}
		mr, err := pd.RegisterMR(make([]byte, 4096), fabric.AccessRemoteWrite|fabric.AccessWindow)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok := mr.(fabric.WindowMR); ok != w {
			t.Fatalf("a region with AccessWindow is a window: %v, the PD said %v", ok, w)
		}
		mr.Close()
		pd.Close()
	}
}
