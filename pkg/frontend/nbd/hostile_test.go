// Tests of hostile clients in transmission: a bad magic, a write too
// large, a reader that stalls.

package nbd

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"syscall"
	"testing"
	"time"
)

func TestBadMagicClosesOnlyThatConnection(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	good := connect(t, addr, "a")
	good.mustRead(0, 512)
	bad := connect(t, addr, "a")
	req := appendRequest(nil, uint16(CmdRead), 0, 1, 0, 512, nil)
	binary.BigEndian.PutUint32(req, magicReply)
	bad.write(req)
	bad.expectClosed()
	if !bytes.Equal(good.mustRead(512, 512), pattern(512, 512)) {
		t.Fatal("wrong data")
	}
	connect(t, addr, "a").mustRead(0, 512)
}

// TestHugeWrite: a write longer than the maximum payload ends the
// connection without asking for its memory.
func TestHugeWrite(t *testing.T) {
	for _, n := range []uint32{1<<20 + 1, 32 << 20, 0xffffffff} {
		t.Run(fmt.Sprint(n), func(t *testing.T) {
			st := newStore(64 << 20)
			_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 64 << 20, MaxPayload: 1 << 20, Backend: st})
			c := connect(t, addr, "a")
			if c.maxPayload != 1<<20 {
				t.Fatalf("max payload %d", c.maxPayload)
			}
			c.mustDo(uint16(CmdWrite), 0, 0, 1<<20, make([]byte, 1<<20))
			c.send(uint16(CmdWrite), 0, 7, 0, n, make([]byte, 4096))
			c.expectClosed()
			if _, _, maxBuf := st.snapshot(); maxBuf > 1<<20 {
				t.Fatalf("the server asked for %d bytes", maxBuf)
			}
			connect(t, addr, "a").mustRead(0, 512)
		})
	}
}

// TestHugeWriteReadOnly: the same on a read-only export, where the write
// is refused anyway.
func TestHugeWriteReadOnly(t *testing.T) {
	st := newStore(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, ReadOnly: true, Backend: st})
	c := connect(t, addr, "a")
	c.send(uint16(CmdWrite), 0, 7, 0, 0xfffffff0, make([]byte, 4096))
	// Either the connection ends, or the write is refused (and its payload
	// skipped, which this client never sends).
	b, err := c.br.Peek(replySize)
	if err == nil {
		if e := binary.BigEndian.Uint32(b[4:]); e == 0 {
			t.Fatal("a huge write to a read-only export succeeded")
		}
	} else if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatal(err)
	}
	if _, _, maxBuf := st.snapshot(); maxBuf != 0 {
		t.Fatalf("the server asked for %d bytes", maxBuf)
	}
}

// TestStalledReader: a client that stops reading its replies loses its
// connection after the stall timeout, and the requests whose replies it
// did not read are retired (their memory, which other connections to the
// export share, comes back).
func TestStalledReader(t *testing.T) {
	st := newStore(64 << 20)
	s, addr := startServer(t, Options{StallTimeout: 200 * time.Millisecond},
		&Export{Name: "a", Size: 64 << 20, Backend: st, MaxPayload: 1 << 20})
	c := connect(t, addr, "a")
	for i := 0; i < 48; i++ { // 48 MiB of replies: more than the socket holds
		c.send(uint16(CmdRead), 0, uint64(i), uint64(i)<<20, 1<<20, nil)
	}
	deadline := time.Now().Add(testTimeout)
	for s.Conns("a") > 0 {
		if time.Now().After(deadline) {
			t.Fatal("the connection of a client that reads no reply is still open")
		}
		time.Sleep(10 * time.Millisecond)
	}
	// Another client is served.
	d := connect(t, addr, "a")
	if !bytes.Equal(d.mustRead(1<<20, 4096), pattern(1<<20, 4096)) {
		t.Fatal("wrong data")
	}
}
