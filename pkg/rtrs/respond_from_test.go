package rtrs

import (
	"bytes"
	"context"
	"crypto/rand"
	"sync/atomic"
	"testing"
	"testing/synctest"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/fabrictest"
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
// its answer is out — not before (the buffer is wiped at release).
func TestRespondFrom(t *testing.T) {
	_, fab := memNet()
	addr := ap("10.14.0.1:1234")
	disk := newMemDisk(4 << 20)
	disk.lend = &lender{}
	r := newRig(t, fab, testServerConfig(fab, disk, addr), testClientConfig(fab, pa("", addr.String())))
	data := make([]byte, 4<<20)
	rand.Read(data)
	for off := 0; off < len(data); off += 32 << 10 {
		if err := r.write(uint64(off), data[off:][:32<<10]); err != nil {
			t.Fatal(err)
		}
	}
	if disk.lend.lent.Load() != 0 {
		t.Fatal("a write was answered with RespondFrom")
	}
	reads := 0
	for _, n := range []int{512, 4096, 32 << 10, 48 << 10} {
		for off := 0; off+n <= len(data); off += 509 * 1024 {
			got, err := r.read(uint64(off), n)
			if err != nil {
				t.Fatal(err)
			}
			if !bytes.Equal(got, data[off:][:n]) {
				t.Fatalf("read of %d bytes at %d: the data differs", n, off)
			}
			reads++
		}
	}
	if got := disk.lend.lent.Load(); got != int64(reads) {
		t.Fatalf("%d reads, %d answered with RespondFrom", reads, got)
	}
	waitFor(t, 5*time.Second, "every hold released", func() bool {
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
