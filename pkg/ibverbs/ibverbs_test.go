package ibverbs

import (
	"bytes"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/test/kit"
)

// TestMain fails the package if a test leaves a verbs object open.
func TestMain(m *testing.M) {
	code := m.Run()
	if err := LeakError(); err != nil {
		fmt.Fprintln(os.Stderr, err)
		code = 1
	}
	if code == 0 {
		if err := goleak.Find(); err != nil {
			fmt.Fprintln(os.Stderr, err)
			code = 1
		}
	}
	os.Exit(code)
}

// The tests that need a device read its address from RNBD_RDMA_ADDR
// (kit.RDMAAddr: the VM tier sets it on rdma_rxe); without it they skip.

func TestErrors(t *testing.T) {
	err := errnoErr("ibv_post_send", -int(syscall.ENOMEM))
	var e *Error
	if !errors.As(err, &e) || e.Op != "ibv_post_send" || !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("%v", err)
	}
	if err := errnoErr("rdma_create_event_channel", -int(syscall.ENODEV)); !errors.Is(err, ErrNotSupported) || !errors.Is(err, syscall.ENODEV) {
		t.Fatalf("ENODEV: %v", err)
	}
	if errnoErr("x", 0) != nil || errnoErr("x", 5) != nil {
		t.Fatal("success is an error")
	}
	if WCRemAccessErr.String() != "remote access error" || WCStatus(99).String() != "status 99" {
		t.Fatal("status names")
	}
	if EventDisconnected.String() != "RDMA_CM_EVENT_DISCONNECTED" || EventType(99).String() != "RDMA_CM_EVENT(99)" {
		t.Fatal("event names")
	}
}

// Without a device (this build host) the package says so, and leaks
// nothing.
func TestNoDevice(t *testing.T) {
	if os.Getenv("RNBD_RDMA_ADDR") != "" {
		t.Skip("this machine has an RDMA device")
	}
	devs, err := Devices()
	if err != nil && !errors.Is(err, ErrNotSupported) {
		t.Fatalf("Devices: %v", err)
	}
	if len(devs) != 0 {
		t.Skipf("devices %v without RNBD_RDMA_ADDR", devs)
	}
	ch, err := NewEventChannel()
	if err == nil {
		// rdma_cm without devices: an ID cannot resolve anything.
		ch.Close()
		return
	}
	if !errors.Is(err, ErrNotSupported) {
		t.Fatalf("NewEventChannel without rdma_cm: %v, want ErrNotSupported", err)
	}
	if _, err := OpenDevice("nope0"); !errors.Is(err, ErrNotSupported) {
		t.Fatalf("OpenDevice: %v", err)
	}
}

func TestAllocMemory(t *testing.T) {
	b, err := AllocMemory(3 * 4096)
	if err != nil {
		t.Fatal(err)
	}
	if len(b) != 3*4096 || uintptrOf(b)%4096 != 0 {
		t.Fatalf("%d bytes at %#x", len(b), uintptrOf(b))
	}
	b[0], b[len(b)-1] = 1, 2
	if err := FreeMemory(b); err != nil {
		t.Fatal(err)
	}
}

// deviceOf resolves the test address to its device and opens it.
func deviceOf(t testing.TB) (*Context, netip.Addr) {
	t.Helper()
	addr := kit.RDMAAddr(t)
	if !Supported {
		t.Skip("built without cgo")
	}
	ch, err := NewEventChannel()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	id, err := ch.CreateID(PortSpaceTCP)
	if err != nil {
		t.Fatal(err)
	}
	if err := id.ResolveAddr(netip.AddrPort{}, netip.AddrPortFrom(addr, 1), 5000); err != nil {
		t.Fatal(err)
	}
	ev, err := ch.Next()
	if err != nil || ev.Type != EventAddrResolved || ev.ID != id {
		t.Fatalf("resolve: %+v %v", ev, err)
	}
	name := id.Context().Name()
	x, err := OpenDevice(name)
	if err != nil {
		t.Fatal(err)
	}
	return x, addr
}

// Parents close their children first; Close is idempotent; nothing is
// left behind.
func TestLifetimes(t *testing.T) {
	x, _ := deviceOf(t)
	pd, err := x.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	mem, err := AllocMemory(1 << 20)
	if err != nil {
		t.Fatal(err)
	}
	defer FreeMemory(mem)
	var mrs []*MR
	for i := 0; i < 4; i++ {
		mr, err := pd.RegMR(mem[i<<18:(i+1)<<18], AccessLocalWrite|AccessRemoteWrite)
		if err != nil {
			t.Fatal(err)
		}
		if mr.Addr() != uint64(uintptrOf(mem[i<<18:])) || mr.RKey() == 0 {
			t.Fatalf("mr addr %#x rkey %#x", mr.Addr(), mr.RKey())
		}
		mrs = append(mrs, mr)
	}
	ch, err := x.NewCompChannel()
	if err != nil {
		t.Fatal(err)
	}
	cq, err := x.NewCQ(64, ch)
	if err != nil {
		t.Fatal(err)
	}
	if err := mrs[0].Close(); err != nil {
		t.Fatal(err)
	}
	if err := mrs[0].Close(); err != nil {
		t.Fatal("second Close:", err)
	}
	if n := len(Live()); n != 1+1+3+1+1 { // context, PD, 3 MRs, channel, CQ
		t.Fatalf("%d live objects: %v", n, Live())
	}
	// Closing the device closes everything made on it.
	if err := x.Close(); err != nil {
		t.Fatal(err)
	}
	if live := Live(); len(live) != 0 {
		t.Fatalf("left after closing the device: %v", live)
	}
	if _, err := cq.Poll(make([]WC, 4)); !errors.Is(err, ErrClosed) {
		t.Fatalf("poll of a closed CQ: %v", err)
	}
	if err := pd.Close(); err != nil {
		t.Fatal("Close after the parent closed it:", err)
	}
}

// end is one side of a loopback connection.
type end struct {
	id *CMID
	cc *CompChannel
	cq *CQ
	qp *QP
}

// poll waits (in the poller) for the side's next completion.
func (e end) poll(tb testing.TB) WC {
	tb.Helper()
	wcs := make([]WC, 1)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		if err := e.cq.ReqNotify(); err != nil {
			tb.Fatal(err)
		}
		n, err := e.cq.Poll(wcs)
		if err != nil {
			tb.Fatal(err)
		}
		if n > 0 {
			return wcs[0]
		}
		done := make(chan struct{})
		go func() {
			e.cc.Wait()
			close(done)
		}()
		select {
		case <-done:
		case <-time.After(time.Until(deadline)):
			e.cc.Interrupt()
			<-done
		}
	}
	tb.Fatal("no completion")
	return WC{}
}

// loopback is a connection through rdma_cm with both ends in this
// process, on one PD.
type loopback struct {
	lch, cch *EventChannel
	lid      *CMID
	pd       *PD
	cli, srv end
}

func newLoopback(tb testing.TB) *loopback {
	tb.Helper()
	x0, addr := deviceOf(tb)
	x0.Close()
	lb := &loopback{}
	var err error
	must := func(err error) {
		tb.Helper()
		if err != nil {
			lb.close()
			tb.Fatal(err)
		}
	}
	next := func(ch *EventChannel, want EventType) CMEvent {
		tb.Helper()
		ev, err := ch.Next()
		if err != nil || ev.Type != want {
			lb.close()
			tb.Fatalf("waiting for %v: %v (status %d) %v", want, ev.Type, ev.Status, err)
		}
		return ev
	}
	lb.lch, err = NewEventChannel()
	must(err)
	lb.cch, err = NewEventChannel()
	must(err)
	lb.lid, err = lb.lch.CreateID(PortSpaceTCP)
	must(err)
	must(lb.lid.Bind(netip.AddrPortFrom(addr, 0)))
	must(lb.lid.Listen(4))
	port := lb.lid.LocalAddr().Port()
	lb.cli.id, err = lb.cch.CreateID(PortSpaceTCP)
	must(err)
	must(lb.cli.id.ResolveAddr(netip.AddrPortFrom(addr, 0), netip.AddrPortFrom(addr, port), 5000))
	next(lb.cch, EventAddrResolved)
	must(lb.cli.id.ResolveRoute(5000))
	next(lb.cch, EventRouteResolved)
	x := lb.cli.id.Context()
	lb.pd, err = x.AllocPD()
	must(err)
	mkEnd := func(e *end) {
		var err error
		e.cc, err = x.NewCompChannel()
		must(err)
		e.cq, err = x.NewCQ(64, e.cc)
		must(err)
		e.qp, err = e.id.CreateQP(lb.pd, e.cq, QPCaps{MaxSendWR: 32, MaxRecvWR: 32})
		must(err)
	}
	mkEnd(&lb.cli)
	must(lb.cli.id.Connect(ConnParam{PrivateData: []byte("req"), RetryCount: 7, RNRRetryCount: 7}))
	req := next(lb.lch, EventConnectRequest)
	if req.Listener != lb.lid || !bytes.HasPrefix(req.PrivateData, []byte("req")) {
		lb.close()
		tb.Fatalf("request %+v", req)
	}
	lb.srv.id = req.ID
	mkEnd(&lb.srv)
	must(lb.srv.qp.PostRecv([]RecvWR{{ID: 11}, {ID: 12}}))
	must(req.ID.Accept(ConnParam{PrivateData: []byte("rsp"), RNRRetryCount: 7}))
	est := next(lb.cch, EventEstablished)
	if !bytes.HasPrefix(est.PrivateData, []byte("rsp")) {
		lb.close()
		tb.Fatalf("accept private data %q", est.PrivateData)
	}
	next(lb.lch, EventEstablished)
	return lb
}

// close tears down in the order the objects demand: each ID (its QP)
// before its channel (its CQ), the PD last, then the event channels.
func (lb *loopback) close() {
	for _, e := range []end{lb.cli, lb.srv} {
		if e.id != nil {
			e.id.Close()
		}
		if e.cc != nil {
			e.cc.Close()
		}
	}
	if lb.pd != nil {
		lb.pd.Close()
	}
	for _, ch := range []*EventChannel{lb.lch, lb.cch} {
		if ch != nil {
			ch.Close()
		}
	}
}

// memory allocates size bytes outside the Go heap, freed when the test
// ends: after lb.close, which deregisters what is still registered.
func memory(tb testing.TB, size int) []byte {
	tb.Helper()
	mem, err := AllocMemory(size)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { FreeMemory(mem) })
	return mem
}

// register registers mem on the loopback's PD until the test ends.
func (lb *loopback) register(tb testing.TB, mem []byte, access Access) *MR {
	tb.Helper()
	mr, err := lb.pd.RegMR(mem, access)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { mr.Close() })
	return mr
}

// A loopback connection through rdma_cm: an RDMA write with immediate
// lands and completes; a write with a stale rkey is refused by the
// device; a disconnect reaches the peer as an event.
func TestLoopback(t *testing.T) {
	lb := newLoopback(t)
	defer lb.close()
	mem := memory(t, 8192)
	mr := lb.register(t, mem, AccessLocalWrite|AccessRemoteWrite)
	copy(mem[:5], "hello")
	w := SendWR{ID: 1, Opcode: WRRDMAWriteWithImm, Flags: SendSignaled, RemoteAddr: mr.Addr() + 4096, RKey: mr.RKey(),
		Imm: 0xabcdef01, NumSGE: 1, SG: [MaxSGE]SGE{{Addr: mr.Addr(), Length: 5, LKey: mr.LKey()}}}
	if err := lb.cli.qp.PostSend([]SendWR{w}); err != nil {
		t.Fatal(err)
	}
	if wc := lb.cli.poll(t); wc.Status != WCSuccess || wc.ID != 1 || wc.Opcode != WCRDMAWrite {
		t.Fatalf("sender: %+v", wc)
	}
	if wc := lb.srv.poll(t); wc.Status != WCSuccess || wc.ID != 11 || wc.Opcode != WCRecvRDMAWithImm ||
		wc.Imm != 0xabcdef01 || wc.ByteLen != 5 || wc.Flags&WCFlagWithImm == 0 {
		t.Fatalf("receiver: %+v", wc)
	}
	if string(mem[4096:4101]) != "hello" {
		t.Fatalf("landed %q", mem[4096:4101])
	}
	// A stale rkey: the device refuses, nothing lands.
	copy(mem[:5], "wrong")
	w.ID, w.RKey = 2, mr.RKey()^0x80
	if err := lb.cli.qp.PostSend([]SendWR{w}); err != nil {
		t.Fatal(err)
	}
	if wc := lb.cli.poll(t); wc.Status != WCRemAccessErr {
		t.Fatalf("stale rkey: %+v", wc)
	}
	if string(mem[4096:4101]) != "hello" {
		t.Fatal("a write with a stale rkey landed")
	}
	// The client goes; the server hears it from the CM.
	if err := lb.cli.id.Disconnect(); err != nil {
		t.Fatal(err)
	}
	if ev, err := lb.lch.Next(); err != nil || ev.Type != EventDisconnected || ev.ID != lb.srv.id {
		t.Fatalf("after the disconnect: %+v %v", ev, err)
	}
}

// always_invalidate has two ways on userspace verbs; these measure them
// (the VM tier runs them on rdma_rxe, docs/protocol.md has the figures).
//
// BenchmarkReregister: deregister and register a 128 KiB chunk, what the
// RDMA fabric does per IO (fabric/rdma mr.Invalidate, mr.Reregister).
func BenchmarkReregister(b *testing.B) {
	lb := newLoopback(b)
	defer lb.close()
	mem := memory(b, 128<<10)
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		mr, err := lb.pd.RegMR(mem, AccessLocalWrite|AccessRemoteWrite)
		if err != nil {
			b.Fatal(err)
		}
		if err := mr.Close(); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkMemoryWindow: unbind and bind a type 1 window over the chunk,
// each a work request on a connected QP whose completion is awaited.
func BenchmarkMemoryWindow(b *testing.B) {
	lb := newLoopback(b)
	defer lb.close()
	mem := memory(b, 128<<10)
	mr := lb.register(b, mem, AccessLocalWrite|AccessMWBind)
	mw, err := lb.pd.AllocMW()
	if err != nil {
		b.Skipf("no memory windows: %v", err)
	}
	defer mw.Close()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, buf := range [][]byte{mem, nil} {
			if err := lb.cli.qp.BindMW(mw, mr, buf, AccessRemoteWrite, uint64(i), true); err != nil {
				b.Fatal(err)
			}
			if wc := lb.cli.poll(b); wc.Status != WCSuccess {
				b.Fatalf("bind: %+v", wc)
			}
		}
	}
}

// Memory windows, where the device has them: a bound window grants the
// range, an unbound one nothing, and every bind is a new rkey.
func TestMemoryWindow(t *testing.T) {
	x, _ := deviceOf(t)
	defer x.Close()
	attr, err := x.Query()
	if err != nil {
		t.Fatal(err)
	}
	if attr.CapFlags&DeviceMemWindow == 0 || attr.MaxMW == 0 {
		t.Skipf("%s has no memory windows (cap flags %#x)", x.Name(), attr.CapFlags)
	}
	pd, err := x.AllocPD()
	if err != nil {
		t.Fatal(err)
	}
	mw, err := pd.AllocMW()
	if err != nil {
		t.Fatal(err)
	}
	if mw.RKey() == 0 {
		t.Fatal("window without an rkey")
	}
	if err := mw.Close(); err != nil {
		t.Fatal(err)
	}
}

func uintptrOf(b []byte) uintptr { return uintptr(unsafe.Pointer(&b[0])) }
