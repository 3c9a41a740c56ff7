// Tests of a connection's bursts: a Plugger backend's plug and unplug,
// and replies deferred to the end of a completer's batch.

package nbd

import (
	"bytes"
	"context"
	"fmt"
	"slices"
	"sync"
	"syscall"
	"testing"
)

// ---- plugging ----

// plugBackend completes nothing until the connection unplugs: a request
// held by a plug the reader forgot would never be answered. Its Buffer
// has few slots, so the reader also waits for buffers.
type plugBackend struct {
	*storeBackend
	slots chan struct{}

	mu sync.Mutex
	// +checklocks:mu
	plugs map[Plug]bool
	// +checklocks:mu
	bursts []int // requests sent per Unplug that sent any
}

type testPlug struct {
	b    *plugBackend
	held []held
}

func (b *plugBackend) NewPlug() Plug {
	pl := &testPlug{b: b}
	b.mu.Lock()
	b.plugs[pl] = true
	b.mu.Unlock()
	return pl
}

func (pl *testPlug) Unplug() {
	if len(pl.held) == 0 {
		return
	}
	pl.b.mu.Lock()
	pl.b.bursts = append(pl.b.bursts, len(pl.held))
	pl.b.mu.Unlock()
	for _, h := range pl.held {
		h.done(h.r, pl.b.apply(h.r))
	}
	pl.held = pl.held[:0]
}

type slotBuf struct {
	memBuf
	slots chan struct{}
}

func (s *slotBuf) Release() { s.slots <- struct{}{} }

func (b *plugBackend) Buffer(ctx context.Context, n int) (Buf, error) {
	select {
	case <-b.slots:
	default:
		if pl := PlugFrom(ctx); pl != nil {
			pl.Unplug()
		}
		select {
		case <-b.slots:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	return &slotBuf{memBuf: memBuf{b: make([]byte, n)}, slots: b.slots}, nil
}

func (b *plugBackend) Submit(r *Request, done func(*Request, error)) {
	pl, _ := r.Plug.(*testPlug)
	b.mu.Lock()
	known := b.plugs[pl]
	b.mu.Unlock()
	if !known {
		done(r, fmt.Errorf("request without its connection's plug: %w", syscall.EIO))
		return
	}
	pl.held = append(pl.held, held{r, done})
}

// TestPlug checks that a Plugger backend gets the requests of a burst
// under the connection's plug and that the connection unplugs whenever it
// would wait: for more to read, for a free request (the in-flight limit),
// for a buffer, and when it stops.
func TestPlug(t *testing.T) {
	for _, tc := range []struct {
		name         string
		inflight     int
		slots        int
		wantBatching bool
	}{
		{"burst", 64, 64, true},
		{"inflight-limit", 3, 64, false},
		{"buffer-wait", 64, 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			const n = 30
			pb := &plugBackend{storeBackend: newStore(1 << 20), slots: make(chan struct{}, tc.slots), plugs: map[Plug]bool{}}
			for range tc.slots {
				pb.slots <- struct{}{}
			}
			_, addr := startServer(t, Options{MaxInflight: tc.inflight}, &Export{Name: "a", Size: 1 << 20, Backend: pb})
			c := connect(t, addr, "a")
			// One request alone: answered only if the reader unplugs
			// before it reads again.
			if got := c.mustRead(512, 512); !bytes.Equal(got, pattern(512, 512)) {
				t.Fatal("single read: wrong data")
			}
			var reqs []byte
			for i := range n {
				if i%2 == 0 {
					reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(i), uint64(i)*512, 512, nil)
				} else {
					reqs = appendRequest(reqs, uint16(CmdWrite), 0, uint64(i), uint64(i)*512, 512, pattern(1<<19+i*512, 512))
				}
			}
			c.write(reqs)
			for range n {
				errno, cookie := c.reply()
				if errno != 0 {
					t.Fatalf("request %d: errno %d", cookie, errno)
				}
				if cookie%2 == 0 {
					if got := c.readFull(512); !bytes.Equal(got, pattern(int(cookie)*512, 512)) {
						t.Fatalf("read %d: wrong data", cookie)
					}
				}
			}
			data, _, _ := pb.snapshot()
			for i := 1; i < n; i += 2 {
				if !bytes.Equal(data[i*512:(i+1)*512], pattern(1<<19+i*512, 512)) {
					t.Fatalf("write %d: wrong data", i)
				}
			}
			// A write left held when the client disconnects still
			// reaches the backend.
			c.send(uint16(CmdWrite), 0, 99, 0, 512, pattern(1<<18, 512))
			c.disc()
			if errno, cookie := c.reply(); errno != 0 || cookie != 99 {
				t.Fatalf("write before DISC: errno %d, cookie %d", errno, cookie)
			}
			c.expectClosed()
			data, _, _ = pb.snapshot()
			if !bytes.Equal(data[:512], pattern(1<<18, 512)) {
				t.Fatal("the write before DISC did not reach the backend")
			}
			pb.mu.Lock()
			maxBurst := slices.Max(pb.bursts)
			pb.mu.Unlock()
			if tc.wantBatching && maxBurst < 2 {
				t.Errorf("%d requests written at once went out in bursts of at most %d", n, maxBurst)
			}
			if maxBurst > tc.inflight || maxBurst > tc.slots+1 {
				t.Errorf("a burst of %d with %d requests and %d buffers", maxBurst, tc.inflight, tc.slots)
			}
		})
	}
}

// ---- completion batches ----

// testBatch is a completer's burst: Flush of what was deferred runs when
// the test ends the burst.
type testBatch struct {
	deferred []interface{ Flush() }
	defers   int
}

func (b *testBatch) Defer(f interface{ Flush() }) {
	b.defers++
	if !slices.Contains(b.deferred, f) {
		b.deferred = append(b.deferred, f)
	}
}

func (b *testBatch) end() {
	for _, f := range b.deferred {
		f.Flush()
	}
	b.deferred = nil
}

// TestBatchedReplies completes requests in bursts, as a transport's reader
// does: replies deferred to the burst's end are written then, once per
// connection, also when they do not fit in the socket at once (the writer
// goroutine takes the rest).
func TestBatchedReplies(t *testing.T) {
	for _, tc := range []struct {
		name string
		n    int
		size uint32
	}{
		{"small", 16, 4096},
		{"past-the-socket-buffer", 8, 1 << 20},
	} {
		t.Run(tc.name, func(t *testing.T) {
			size := int64(tc.n) * int64(tc.size)
			hb := newHold(int(size))
			_, addr := startServer(t, Options{}, &Export{Name: "a", Size: size, Backend: hb, MaxPayload: 1 << 20})
			c := connect(t, addr, "a")
			var reqs []byte
			for i := range tc.n {
				reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(i), uint64(i)*uint64(tc.size), tc.size, nil)
			}
			c.write(reqs)
			hs := hb.take(t, tc.n)
			var b testBatch
			for _, h := range hs {
				h.r.Batch = &b
				hb.finish(h)
			}
			if b.defers != tc.n || len(b.deferred) != 1 {
				t.Fatalf("%d replies deferred %d times to %d flushers; want %d to 1", tc.n, b.defers, len(b.deferred), tc.n)
			}
			// Flush must not wait for the client to read: it reads
			// only after.
			b.end()
			for range tc.n {
				errno, cookie := c.reply()
				if errno != 0 {
					t.Fatalf("request %d: errno %d", cookie, errno)
				}
				if got := c.readFull(int(tc.size)); !bytes.Equal(got, pattern(int(cookie)*int(tc.size), int(tc.size))) {
					t.Fatalf("read %d: wrong data", cookie)
				}
			}
			// Completions outside a burst still reach the writer.
			if got := c.mustReadAfter(hb, 0, 512); !bytes.Equal(got, pattern(0, 512)) {
				t.Fatal("read outside a burst: wrong data")
			}
		})
	}
}

// mustReadAfter reads through a holdBackend, finishing the request
// outside any batch.
func (c *client) mustReadAfter(hb *holdBackend, off uint64, n uint32) []byte {
	c.tb.Helper()
	c.send(uint16(CmdRead), 0, 1000, off, n, nil)
	hb.finish(hb.take(c.tb, 1)[0])
	errno, cookie := c.reply()
	if errno != 0 || cookie != 1000 {
		c.tb.Fatalf("read: errno %d, cookie %d", errno, cookie)
	}
	return c.readFull(int(n))
}
