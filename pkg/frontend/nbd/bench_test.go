package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"testing"
	"time"
)

// poolBackend is an in-memory export that completes every request
// synchronously, inside Submit, with buffers it recycles: what the
// benchmarks measure is the server.
type poolBackend struct {
	data []byte
	pool sync.Pool
}

type poolBuf struct {
	b []byte
	p *sync.Pool
}

func (m *poolBuf) Bytes() []byte { return m.b }
func (m *poolBuf) Release()      { m.p.Put(m) }

func (p *poolBackend) Buffer(ctx context.Context, n int) (Buf, error) {
	if v, _ := p.pool.Get().(*poolBuf); v != nil && cap(v.b) >= n {
		v.b = v.b[:n]
		return v, nil
	}
	return &poolBuf{b: make([]byte, n), p: &p.pool}, nil
}

func (p *poolBackend) Submit(r *Request, done func(*Request, error)) {
	switch r.Cmd {
	case CmdRead:
		copy(r.Data, p.data[r.Offset:])
	case CmdWrite:
		copy(p.data[r.Offset:], r.Data)
	}
	done(r, nil)
}

// pipeline runs n requests of bs bytes over an open connection, keeping
// qd outstanding: this goroutine writes requests, batching those it may
// send into one write, and another reads the replies. Neither allocates.
func pipeline(c *client, cmd Cmd, bs, qd, n int, exportSize int64) error {
	tokens := make(chan struct{}, qd)
	for range qd {
		tokens <- struct{}{}
	}
	quit := make(chan struct{})
	rerr := make(chan error, 1)
	go func() {
		err := func() error {
			var h [replySize]byte
			data := make([]byte, bs)
			for range n {
				if _, err := io.ReadFull(c.br, h[:]); err != nil {
					return err
				}
				if m := binary.BigEndian.Uint32(h[0:]); m != magicReply {
					return fmt.Errorf("reply magic %#x", m)
				}
				if e := binary.BigEndian.Uint32(h[4:]); e != 0 {
					return fmt.Errorf("errno %d", e)
				}
				if cmd == CmdRead {
					if _, err := io.ReadFull(c.br, data); err != nil {
						return err
					}
				}
				tokens <- struct{}{}
			}
			return nil
		}()
		if err != nil {
			c.nc.Close() // unblocks the writer
		}
		rerr <- err
		close(quit)
	}()

	bw := bufio.NewWriterSize(c.nc, 256<<10)
	payload := make([]byte, bs)
	nblocks := exportSize / int64(bs)
	var h [requestSize]byte
	binary.BigEndian.PutUint32(h[0:], magicRequest)
	binary.BigEndian.PutUint16(h[6:], uint16(cmd))
	binary.BigEndian.PutUint32(h[24:], uint32(bs))
	werr := func() error {
		for i := range n {
			select {
			case <-tokens:
			default:
				// The window is full: send what is batched, then wait.
				if err := bw.Flush(); err != nil {
					return err
				}
				select {
				case <-tokens:
				case <-quit:
					return errors.New("the reader stopped")
				}
			}
			binary.BigEndian.PutUint64(h[8:], uint64(i))
			binary.BigEndian.PutUint64(h[16:], uint64(int64(i)%nblocks*int64(bs)))
			bw.Write(h[:])
			if cmd == CmdWrite {
				bw.Write(payload)
			}
		}
		return bw.Flush()
	}()
	if werr != nil {
		c.nc.Close() // stops the reader
		<-rerr
		return werr
	}
	return <-rerr
}

func benchIO(b *testing.B, cmd Cmd, bs, qd int) {
	const size = 256 << 20
	_, addr := startServer(b, Options{}, &Export{Name: "b", Size: size, Backend: &poolBackend{data: make([]byte, size)}})
	c := connect(b, addr, "b")
	c.nc.SetDeadline(time.Time{})
	// Warm up the buffers on both sides.
	if err := pipeline(c, cmd, bs, qd, 2*qd, size); err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(bs))
	b.ReportAllocs()
	b.ResetTimer()
	if err := pipeline(c, cmd, bs, qd, b.N, size); err != nil {
		b.Fatal(err)
	}
	b.StopTimer()
	c.disc()
	c.nc.SetDeadline(time.Now().Add(testTimeout))
	c.expectClosed()
}

func BenchmarkRead4KQD1(b *testing.B)   { benchIO(b, CmdRead, 4<<10, 1) }
func BenchmarkRead4KQD32(b *testing.B)  { benchIO(b, CmdRead, 4<<10, 32) }
func BenchmarkWrite4KQD32(b *testing.B) { benchIO(b, CmdWrite, 4<<10, 32) }
func BenchmarkRead1MQD8(b *testing.B)   { benchIO(b, CmdRead, 1<<20, 8) }

// TestPipeline runs the benchmarks' client briefly, under the race
// detector too.
func TestPipeline(t *testing.T) {
	for _, tc := range []struct {
		cmd       Cmd
		bs, qd, n int
	}{
		{CmdRead, 4 << 10, 1, 200},
		{CmdRead, 4 << 10, 32, 2000},
		{CmdWrite, 4 << 10, 32, 2000},
		{CmdRead, 1 << 20, 8, 50},
		{CmdWrite, 1 << 20, 8, 50},
	} {
		t.Run(fmt.Sprint(tc.cmd, "/", tc.bs, "/", tc.qd), func(t *testing.T) {
			const size = 16 << 20
			_, addr := startServer(t, Options{MaxInflight: 16}, &Export{Name: "b", Size: size,
				Backend: &poolBackend{data: make([]byte, size)}})
			c := connect(t, addr, "b")
			if err := pipeline(c, tc.cmd, tc.bs, tc.qd, tc.n, size); err != nil {
				t.Fatal(err)
			}
			c.disc()
			c.expectClosed()
		})
	}
}
