// Tests of peers that ask for too much: connections, half-open paths,
// sessions and chunk memory past their limits, per path and per client.

package rtrs

import (
	"net/netip"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/kit"
)

// The buffers of the connections a path asks for count against
// MaxChunkMemory with its chunks: a peer that asks for 4096 connections
// per path is refused (ENOMEM) instead of making the server size 4096
// connections, the budget is whole again afterwards, and the good
// session goes on.
func TestHostileConnectionMemory(t *testing.T) {
	fab := tcp.New(tcp.Options{HandshakeTimeout: time.Second})
	dst := loopbackListener(t)
	scfg := testServerConfig(fab, newMemDisk(4<<20), dst)
	ccfg := testClientConfig(fab, pa("127.0.0.1", dst.String()))
	good, _ := pathFootprint(&scfg, nil, scfg.QueueDepth, scfg.MaxChunkSize, ccfg.ConnsPerPath+1)
	if chunks := int64(scfg.QueueDepth * scfg.MaxChunkSize); good <= chunks {
		t.Fatalf("a path of %d connections counts %d bytes, no more than its chunks alone", ccfg.ConnsPerPath+1, good)
	}
	scfg.MaxChunkMemory = 4 * good
	h := &hostileRig{rig: newRig(t, fab, scfg, ccfg), fab: fab, dst: dst, src: netip.MustParseAddrPort("127.0.0.3:0")}
	if got := h.srv.chunkMem.Load(); got != good {
		t.Fatalf("the good path counts %d bytes, want %d", got, good)
	}
	dev, _ := h.fab.Resolve(nil, h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, MaxConnsPerPath)
	_, _, err := dialRaw(h.fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize)))
	if e := rejectErrno(err); e != syscall.ENOMEM {
		t.Fatalf("a path of %d connections: %v (errno %v), want a reject with ENOMEM", MaxConnsPerPath, err, e)
	}
	// A path of a few connections still fits.
	rp := newRawPathConns(t, h.fab, h.src, h.dst, 3, 3)
	if err := rp.sendInfoReq("second"); err != nil {
		t.Fatal(err)
	}
	rp.wait(0, fabric.WCRecv)
	rp.close()
	h.stillServes()
	kit.WaitFor(t, 10*time.Second, "the budget to be whole again", func() bool { return h.srv.chunkMem.Load() == good })
}

// A client address may have DefaultMaxConnectingPerAddr paths connecting
// (accepted, no INFO_REQ yet: each holds its chunks) at once; the next
// one is refused with EBUSY, another address is not affected, and a slot
// comes back when one of them goes.
func TestHostileHalfOpenPaths(t *testing.T) {
	h := newHostileRig(t, true)
	var half []*rawPath
	for i := 0; i < DefaultMaxConnectingPerAddr; i++ {
		half = append(half, newRawPathConns(t, h.fab, h.src, h.dst, 2, 1))
	}
	dev, _ := h.fab.Resolve(nil, h.src, h.dst)
	pd, _ := dev.AllocPD()
	req := rawConnReq(0, 2)
	if _, _, err := dialRaw(h.fab, pd, dev, h.src, h.dst, req.Encode(make([]byte, ConnReqSize))); rejectErrno(err) != syscall.EBUSY {
		t.Fatalf("path %d connecting from one address: %v, want a reject with EBUSY", DefaultMaxConnectingPerAddr+1, err)
	}
	// Another address, a whole path.
	rp := newRawPathConns(t, h.fab, netip.MustParseAddrPort("127.0.0.4:0"), h.dst, 2, 2)
	if err := rp.sendInfoReq("other"); err != nil {
		t.Fatal(err)
	}
	rp.wait(0, fabric.WCRecv)
	half[0].close()
	kit.WaitFor(t, 10*time.Second, "a slot to come back", func() bool {
		h.srv.connectingMu.Lock()
		defer h.srv.connectingMu.Unlock()
		return h.srv.connecting[fabric.PeerGroup(h.src.Addr())] < DefaultMaxConnectingPerAddr
	})
	half[0] = newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	for _, p := range half {
		p.close()
	}
	rp.close()
	h.stillServes()
}

// One client address (or identity) may have MaxSessionsPerClient
// sessions; one more is refused with EUSERS while other addresses are
// not affected, and a slot comes back when a session goes.
func TestHostileSessionsPerClient(t *testing.T) {
	h := newHostileRigCfg(t, func(c *SrvConfig) { c.MaxSessionsPerClient = 2 })
	first := newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	if err := h.dialPath(); rejectErrno(err) != syscall.EUSERS {
		t.Fatalf("a third session from one address: %v, want a reject with EUSERS", err)
	}
	other := netip.MustParseAddrPort("127.0.0.4:0")
	newRawPathConns(t, h.fab, other, h.dst, 2, 1) // another address has its own
	first.close()
	kit.WaitFor(t, 10*time.Second, "the closed session to go", func() bool { return len(h.srv.Sessions()) == 3 })
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	h.stillServesWith(4)
}

// One client's paths may hold MaxChunkMemoryPerClient of the budget
// together: past it a path of that client is refused with ENOMEM while
// another address gets a path from what is left, and the share comes
// back when a path goes.
func TestHostileClientMemoryShare(t *testing.T) {
	var small, budget int64
	h := newHostileRigCfg(t, func(c *SrvConfig) {
		small, _ = pathFootprint(c, nil, c.QueueDepth, c.MaxChunkSize, 2) // a raw path of two connections
		budget = 16 * small
		c.MaxChunkMemory, c.MaxChunkMemoryPerClient = budget, 2*small
	})
	first := newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	if err := h.dialPath(); rejectErrno(err) != syscall.ENOMEM {
		t.Fatalf("a third path of one client past its share: %v, want a reject with ENOMEM", err)
	}
	if used, _ := h.srv.ChunkMemory(); used >= budget-small {
		t.Fatalf("%d bytes of %d used: the refusal was the budget's, not the share's", used, budget)
	}
	newRawPathConns(t, h.fab, netip.MustParseAddrPort("127.0.0.4:0"), h.dst, 2, 1) // another client has its own share
	first.close()
	kit.WaitFor(t, 10*time.Second, "the closed path's share to come back", func() bool {
		h.srv.memMu.Lock()
		defer h.srv.memMu.Unlock()
		return h.srv.clientMem["address:127.0.0.3"] == small
	})
	newRawPathConns(t, h.fab, h.src, h.dst, 2, 1)
	h.stillServesWith(4)
}
