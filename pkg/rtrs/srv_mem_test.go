package rtrs

import (
	"context"
	"github.com/rnbd/rnbd/test/kit"
	"net/netip"
	"runtime/debug"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// serverPath finds the one path of the server's session pathsUUID.
func serverPath(t *testing.T, srv *Server, pathsUUID [16]byte) *SrvPath {
	t.Helper()
	var p *SrvPath
	kit.WaitFor(t, 10*time.Second, "the server's path", func() bool {
		for _, x := range srv.Sessions() {
			if x.UUID() == pathsUUID {
				if ps := x.Paths(); len(ps) == 1 {
					p = ps[0]
					return true
				}
			}
		}
		return false
	})
	return p
}

// chunksOf reads a server path's chunks as INFO_REQ's goroutine left
// them (seeing the path CONNECTED publishes them), under its session's
// lock, which the path's close work takes before it frees them.
func chunksOf(p *SrvPath) []byte {
	if p.State() != SrvPathConnected {
		return nil
	}
	p.sess.mu.Lock()
	defer p.sess.mu.Unlock()
	return p.chunkBuf
}

// A path costs its connections until it proves itself: with every
// connection open and no INFO_REQ it has no chunks (the path churn of
// issue 30 allocated and registered them at the first connection), but
// is counted for them in the budget; INFO_REQ brings them.
func TestChunksWaitForInfoReq(t *testing.T) {
	h := newHostileRig(t, true)
	used0, _ := h.srv.ChunkMemory()
	rp := newRawPathConns(t, h.fab, h.src, h.dst, 2, 2)
	p := serverPath(t, h.srv, rp.req.PathsUUID)
	if p.State() != SrvPathConnecting {
		t.Fatalf("path %v before INFO_REQ", p.State())
	}
	if used, _ := h.srv.ChunkMemory(); used <= used0 {
		t.Fatalf("a half-open path is counted for %d bytes, want its footprint", used-used0)
	}
	// Nothing writes them before INFO_REQ: what the path was made
	// with (under its session's lock).
	p.sess.mu.Lock()
	chunks, mrs := p.chunks, len(p.mrs)
	p.sess.mu.Unlock()
	if chunks != nil || mrs != 0 {
		t.Fatalf("a path without INFO_REQ holds chunks (%v) and %d registrations", chunks != nil, mrs)
	}
	if err := rp.sendInfoReq("half"); err != nil {
		t.Fatal(err)
	}
	rp.wait(0, fabric.WCRecv) // INFO_RSP
	kit.WaitFor(t, 10*time.Second, "the path CONNECTED", func() bool { return p.State() == SrvPathConnected })
	if got, want := len(chunksOf(p)), h.srv.cfg.QueueDepth*h.srv.cfg.MaxChunkSize; got != want {
		t.Fatalf("after INFO_REQ the path has %d bytes of chunks, want %d", got, want)
	}
	rp.close()
	h.stillServes()
	if used, _ := h.srv.ChunkMemory(); used != used0 {
		t.Fatalf("%d bytes counted after the path went, want %d", used, used0)
	}
}

// A closed path's chunks go back to the server's pool, and the next
// path takes them — zeroed: one client's data never reaches another's
// chunks.
func TestChunkPoolReuse(t *testing.T) {
	h := newHostileRig(t, true)
	rp := newRawPath(t, h.fab, h.src, h.dst, "first")
	p := serverPath(t, h.srv, rp.req.PathsUUID)
	old := chunksOf(p)
	if old == nil {
		t.Fatal("a connected path without chunks")
	}
	// A client's data in every chunk.
	for i := 0; i < len(old); i += 4096 {
		copy(old[i:], "secret of the first client")
	}
	addr := &old[0]
	rp.close()
	kit.WaitFor(t, 10*time.Second, "the pool to take the chunks back", func() bool { return h.srv.pool.idle() == 1 })
	rp2 := newRawPath(t, h.fab, h.src, h.dst, "second")
	p2 := serverPath(t, h.srv, rp2.req.PathsUUID)
	got := chunksOf(p2)
	if &got[0] != addr {
		t.Fatal("the second path did not take the first one's chunks from the pool")
	}
	if n := h.srv.pool.idle(); n != 0 {
		t.Fatalf("%d areas idle in the pool after the second path took one", n)
	}
	for i, b := range got {
		if b != 0 {
			t.Fatalf("byte %d of the reused chunks is %#x: the first client's data reached the second", i, b)
		}
	}
	rp2.close()
	h.stillServes()
}

// New paths of one address come no faster than NewPathRate after a
// burst of NewPathBurst: past it they are refused with EAGAIN (and
// counted), while another address is not affected; the bucket refills
// with time.
func TestNewPathRate(t *testing.T) {
	h := newHostileRigCfg(t, func(c *SrvConfig) { c.NewPathRate, c.NewPathBurst = 1, 2 })
	var mu sync.Mutex
	now := time.Now()
	h.srv.pathRate.mu.Lock()
	h.srv.pathRate.heldMu.Lock()
	h.srv.pathRate.now = func() time.Time { mu.Lock(); defer mu.Unlock(); return now }
	h.srv.pathRate.heldMu.Unlock()
	h.srv.pathRate.mu.Unlock()
	for i := 0; i < 2; i++ {
		if err := h.dialPath(); err != nil {
			t.Fatalf("new path %d of a burst of 2: %v", i, err)
		}
	}
	if err := h.dialPath(); rejectErrno(err) != syscall.EAGAIN {
		t.Fatalf("a third new path at once: %v, want a reject with EAGAIN", err)
	}
	other := *h
	other.src = netip.MustParseAddrPort("127.0.0.4:0")
	if err := other.dialPath(); err != nil {
		t.Fatalf("a new path from another address: %v", err)
	}
	mu.Lock()
	now = now.Add(time.Second)
	mu.Unlock()
	if err := h.dialPath(); err != nil {
		t.Fatalf("a new path a second later: %v", err)
	}
	if err := h.dialPath(); rejectErrno(err) != syscall.EAGAIN {
		t.Fatalf("a second one in that second: %v, want EAGAIN", err)
	}
	if n := h.srv.Rejected()[syscall.EAGAIN]; n != 2 {
		t.Fatalf("%d refusals counted as EAGAIN, want 2", n)
	}
	h.stillServes()
}

// Our client asks again when the server refuses a new path with EAGAIN
// (its new_path_rate), until its context ends.
func TestClientRetriesNewPathRate(t *testing.T) {
	fab := newHostileRigCfg(t, func(c *SrvConfig) { c.NewPathRate, c.NewPathBurst = 5, 1 })
	// The rig's own session took the one token of 127.0.0.1.
	ccfg := testClientConfig(fab.fab, pa("127.0.0.1", fab.dst.String()))
	ccfg.SessName = "second"
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := DialSession(ctx, ccfg)
	if err != nil {
		t.Fatalf("a session refused EAGAIN at first: %v, want it to retry and connect", err)
	}
	s.Close()
	if n := fab.srv.Rejected()[syscall.EAGAIN]; n == 0 {
		t.Fatal("the second session was never refused: the test proves nothing")
	}
}

// With GoMemoryLimit the runtime's memory limit is GoHeapMargin plus the
// heap part of what the paths hold, follows paths as they come and go,
// and is put back by Close.
func TestGoMemoryLimit(t *testing.T) {
	before := debug.SetMemoryLimit(-1)
	h := newHostileRigCfg(t, func(c *SrvConfig) {
		c.GoMemoryLimit = true
		c.MaxChunkMemory = 1 << 30
	})
	limit := func() int64 { return debug.SetMemoryLimit(-1) }
	h.srv.memMu.Lock()
	heap := h.srv.heapMem
	h.srv.memMu.Unlock()
	if heap <= 0 || limit() != GoHeapMargin+heap {
		t.Fatalf("limit %d with one path holding %d bytes of heap, want %d", limit(), heap, GoHeapMargin+heap)
	}
	rp := newRawPathConns(t, h.fab, h.src, h.dst, 3, 1)
	_, onHeap := pathFootprint(&h.srv.cfg, h.fab, h.srv.cfg.QueueDepth, h.srv.cfg.MaxChunkSize, 3)
	if got := limit(); got != GoHeapMargin+heap+onHeap {
		t.Fatalf("limit %d with a second path, want %d", got, GoHeapMargin+heap+onHeap)
	}
	rp.close()
	kit.WaitFor(t, 10*time.Second, "the second path's memory released", func() bool { return limit() == GoHeapMargin+heap })
	h.sess.Close()
	h.srv.Close()
	if got := limit(); got != before {
		t.Fatalf("limit %d after Close, want the %d before", got, before)
	}
}

// The buckets of rateLimiter: a new path takes a token from its
// address's bucket and its identity's, or from neither; a path refused
// for its identity still costs its address a token; an address refused
// with none is held until its bucket is half full again, and recovers
// then;
// buckets refill at the rate up to the burst, and full ones and ended
// holds are forgotten.
func TestRateLimiter(t *testing.T) {
	now := time.Unix(1000, 0)
	r := rateLimiter{now: func() time.Time { return now }}
	r.init(2, 2)
	a, c := fabric.PeerGroup(netip.MustParseAddr("10.0.0.1")), fabric.PeerGroup(netip.MustParseAddr("::ffff:10.0.0.3"))
	if !r.allow(a, "x") || !r.allow(a, "x") {
		t.Fatal("a burst of 2 refused")
	}
	if r.holding(a) > 0 {
		t.Fatal("an address held before it was refused")
	}
	if r.allow(a, "") {
		t.Fatal("an empty bucket let a path through")
	}
	if d := r.holding(a); d != 500*time.Millisecond {
		t.Fatalf("an address refused with its bucket empty is held for %v, want 500ms: a token at 2/s", d)
	}
	if r.allow(c, "x") {
		t.Fatal("an empty identity bucket let a path through")
	}
	if r.holding(c) > 0 {
		t.Fatal("an address refused for its identity is held with tokens of its own")
	}
	if !r.allow(c, "") || r.allow(c, "") {
		t.Fatal("the refusal for the identity did not cost the address one token of its two")
	}
	if r.holding(c) == 0 {
		t.Fatal("an address that ran its bucket dry is not held")
	}
	now = now.Add(250 * time.Millisecond)
	if r.holding(a) == 0 {
		t.Fatal("held for half a token's time at 2/s: want held still")
	}
	now = now.Add(250 * time.Millisecond)
	if r.holding(a) > 0 {
		t.Fatal("held when its bucket has a token again")
	}
	if !r.allow(a, "x") || r.allow(a, "x") {
		t.Fatal("half a second at 2/s: want one token back")
	}
	now = now.Add(time.Hour)
	for i := 0; i < sweepAt; i++ {
		p := fabric.PeerGroup(netip.AddrFrom4([4]byte{10, 1, byte(i >> 8), byte(i)}))
		for r.allow(p, "") {
		}
	}
	r.heldMu.Lock()
	held := len(r.held)
	r.heldMu.Unlock()
	if held < sweepAt {
		t.Fatalf("%d addresses held, want %d", held, sweepAt)
	}
	now = now.Add(time.Hour)
	z := fabric.PeerGroup(netip.MustParseAddr("10.2.0.1"))
	r.allow(z, "")
	r.allow(z, "")
	r.allow(z, "") // held: a sweep of the ended holds
	r.mu.Lock()
	buckets := len(r.addrs) + len(r.ids)
	r.mu.Unlock()
	r.heldMu.Lock()
	held = len(r.held)
	r.heldMu.Unlock()
	if buckets > 2 || held != 1 {
		t.Fatalf("%d buckets and %d holds left after the sweeps, want the full and the ended ones gone", buckets, held)
	}
	// Refused with its bucket empty, an address is held until the
	// bucket is half full: a burst of 4 at 1/s, 2 s.
	r4 := rateLimiter{now: func() time.Time { return now }}
	r4.init(1, 4)
	for r4.allow(a, "") {
	}
	now = now.Add(1500 * time.Millisecond)
	if r4.holding(a) == 0 {
		t.Fatal("held for a token and a half of a burst of 4: want held still")
	}
	now = now.Add(500 * time.Millisecond)
	if r4.holding(a) > 0 {
		t.Fatal("held with its bucket half full again")
	}
	if !r4.allow(a, "") || !r4.allow(a, "") || r4.allow(a, "") {
		t.Fatal("released with half a burst of 4: want 2 paths")
	}
	// A rate too low to count in time.Duration holds for an hour.
	slow := rateLimiter{now: func() time.Time { return now }}
	slow.init(1e-12, 1)
	for slow.allow(a, "") {
	}
	if d := slow.holding(a); d != time.Hour {
		t.Fatalf("held for %v at 1e-12 a second, want an hour", d)
	}
	var off rateLimiter
	off.init(0, 0)
	for i := 0; i < 100; i++ {
		if !off.allow(a, "x") || off.holding(a) > 0 {
			t.Fatal("rate 0 refused or held")
		}
	}
}
