package nbd

import (
	"context"
	"encoding/binary"
	"net"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

type memBuf struct{ b []byte }

func (m *memBuf) Bytes() []byte { return m.b }
func (m *memBuf) Release()      {}

// memBackend completes every request at once, out of the caller's stack.
type memBackend struct{ data []byte }

func (m *memBackend) Buffer(ctx context.Context, n int) (Buf, error) {
	return &memBuf{b: make([]byte, n)}, nil
}

func (m *memBackend) Submit(r *Request, done func(*Request, error)) {
	switch r.Cmd {
	case CmdRead:
		copy(r.Data, m.data[r.Offset:])
	case CmdWrite:
		copy(m.data[r.Offset:], r.Data)
	}
	go done(r, nil)
}

// FuzzConn feeds arbitrary bytes as the client of a connection, after a
// valid handshake or instead of one: the server must neither panic nor
// hang, and must end the connection when the input ends.
func FuzzConn(f *testing.F) {
	req := func(typ uint16, off uint64, n uint32, payload int) []byte {
		b := make([]byte, requestSize+payload)
		binary.BigEndian.PutUint32(b[0:], magicRequest)
		binary.BigEndian.PutUint16(b[6:], typ)
		binary.BigEndian.PutUint64(b[16:], off)
		binary.BigEndian.PutUint32(b[24:], n)
		return b
	}
	f.Add(true, req(uint16(CmdRead), 0, 4096, 0))
	f.Add(true, req(uint16(CmdWrite), 512, 1024, 1024))
	f.Add(true, append(req(uint16(CmdFlush), 0, 0, 0), req(cmdDisc, 0, 0, 0)...))
	f.Add(true, req(uint16(CmdRead), 1<<40, 4096, 0))
	f.Add(true, req(uint16(CmdWrite), 0, 64<<20, 16))
	f.Add(true, []byte{0xff, 0xff, 0xff, 0xff})
	f.Add(false, []byte{0, 0, 0, 3, 0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, 0, 0, 0, 7, 0, 0, 0, 6, 0, 0, 0, 0, 0, 0})
	f.Add(false, []byte{0, 0, 0, 3, 0x49, 0x48, 0x41, 0x56, 0x45, 0x4f, 0x50, 0x54, 0, 0, 0, 1, 0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, transmission bool, in []byte) {
		s := NewServer(Options{MaxInflight: 4, Log: log.Discard()})
		if err := s.AddExport(&Export{Name: "x", Size: 1 << 20, Flush: true, Trim: true, WriteZeroes: true,
			MaxPayload: 1 << 20, Backend: &memBackend{data: make([]byte, 1<<20)}}); err != nil {
			t.Fatal(err)
		}
		cli, srv := net.Pipe()
		done := make(chan struct{})
		go func() {
			defer close(done)
			if transmission {
				s.ServeKernel(srv, "x")
			} else {
				s.ServeConn(srv)
			}
		}()
		go func() { // drain what the server says
			b := make([]byte, 64<<10)
			for {
				if _, err := cli.Read(b); err != nil {
					return
				}
			}
		}()
		cli.SetWriteDeadline(time.Now().Add(5 * time.Second))
		cli.Write(in)
		cli.Close()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("the server did not end the connection")
		}
		s.Close()
	})
}
