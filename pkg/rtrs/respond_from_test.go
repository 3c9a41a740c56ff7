package rtrs

import (
	"bytes"
	"context"
	"crypto/rand"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	mrand "math/rand/v2"
	"net/netip"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// lender lends memDisk's reads to RespondFrom: each answer is sent from a
// buffer of its own, which its hold wipes when released, so that a send
// that read it after the release would deliver zeros.
type lender struct {
	lent, released atomic.Int64
}

type lentBuf struct {
	l    *lender
	buf  []byte
	done atomic.Bool
}

func (h *lentBuf) Release() {
	if h.done.Swap(true) {
		panic("a hold released twice")
	}
	clear(h.buf)
	h.l.released.Add(1)
}

func (l *lender) respond(op *SrvOp, src []byte) {
	l.lent.Add(1)
	op.RespondFrom(src, &lentBuf{l: l, buf: src})
}

// TestRespondFrom: over TCP a read answered from memory of the server's
// user (not the chunk) arrives whole, and every hold is released once
// its answer is out — not before (the buffer is wiped at release): on
// the in-memory network, one read at a time, and over loopback TCP
// (writev) with reads of every size in flight together.
func TestRespondFrom(t *testing.T) {
	t.Run("mem", func(t *testing.T) {
		_, fab := memNet()
		testRespondFrom(t, fab, ap("10.14.0.1:1234"), 1)
	})
	t.Run("tcp", func(t *testing.T) {
		testRespondFrom(t, tcp.New(tcp.Options{}), loopbackListener(t), 8)
	})
}

func testRespondFrom(t *testing.T, fab fabric.Fabric, addr netip.AddrPort, readers int) {
	disk := newMemDisk(4 << 20)
	disk.lend = &lender{}
	r := newRig(t, fab, testServerConfig(fab, disk, addr), testClientConfig(fab, PathAddr{Dst: addr}))
	data := make([]byte, len(disk.b))
	rand.Read(data)
	for off := 0; off < len(data); off += 32 << 10 {
		if err := r.write(uint64(off), data[off:][:32<<10]); err != nil {
			t.Fatal(err)
		}
	}
	if disk.lend.lent.Load() != 0 {
		t.Fatal("a write was answered with RespondFrom")
	}
	const perReader = 100
	errs := make(chan error, readers)
	for g := range readers {
		go func() {
			buf, err := r.sess.AllocBuffer(r.sess.MaxIOSize())
			if err != nil {
				errs <- err
				return
			}
			rnd := mrand.New(mrand.NewPCG(uint64(g), 7))
			for range perReader {
				n := 1 + rnd.IntN(r.sess.MaxIOSize())
				off := rnd.IntN(len(data) - n)
				clear(buf.Bytes()[:n])
				if err := r.sess.Do(context.Background(), IOCon, Read, offsetHdr(uint64(off)), buf, 0, n); err != nil {
					errs <- err
					return
				}
				if !bytes.Equal(buf.Bytes()[:n], data[off:][:n]) {
					errs <- fmt.Errorf("read of %d bytes at %d: the data differs", n, off)
					return
				}
			}
			errs <- nil
		}()
	}
	for range readers {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if got := disk.lend.lent.Load(); got != int64(readers*perReader) {
		t.Fatalf("%d reads, %d answered with RespondFrom", readers*perReader, got)
	}
	kit.WaitFor(t, 5*time.Second, "every hold released", func() bool {
		return disk.lend.released.Load() == disk.lend.lent.Load()
	})
	r.assertHealthy()
}

// TestRespondFromHeldPastClose: answers sent from the user's memory that
// are stuck behind a silent link keep their holds until the path is
// closed — the memory may still be read until then — and are released
// then, none left behind.
func TestRespondFromHeldPastClose(t *testing.T) {
	synctest.Test(t, func(t *testing.T) {
		disk := newMemDisk(1 << 20)
		disk.lend = &lender{}
		net, cli, srvAddr, srv, sess := openFakeLink(t, disk)
		defer srv.Close()
		defer sess.Close()
		buf, err := sess.AllocBuffer(64 << 10)
		if err != nil {
			t.Fatal(err)
		}
		release := disk.holdIO()
		const reads = 8
		errs := make(chan error, reads)
		for i := range reads {
			go func() {
				ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				errs <- sess.Do(ctx, IOCon, Read, offsetHdr(uint64(i)*8192), buf, i*8192, 8192)
			}()
		}
		synctest.Wait() // the reads wait in the server's user
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkBlackhole)
		release() // the answers are posted, and stay in the send queue
		synctest.Wait()
		if l, r := disk.lend.lent.Load(), disk.lend.released.Load(); l != reads || r != 0 {
			t.Fatalf("answers stuck behind a silent link: %d lent, %d released; want %d, 0", l, r, reads)
		}
		for len(srv.Sessions()) != 0 {
			time.Sleep(100 * time.Millisecond)
		}
		if l, r := disk.lend.lent.Load(), disk.lend.released.Load(); r != l {
			t.Fatalf("after the path closed: %d lent, %d released", l, r)
		}
		net.SetLink(cli, srvAddr.Addr(), fabrictest.LinkUp)
		for range reads {
			<-errs // failed or answered again after a reconnect: not what this test is about
		}
	})
}
