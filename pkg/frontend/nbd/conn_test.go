// The package's test harness: backends that store, hold or fail what
// they are given, a server on a unix socket, and a client that speaks the
// protocol by hand (so that it can also speak it wrong).

package nbd

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/rnbd/rnbd/pkg/log"
)

// TestMain fails the package if any test leaves a goroutine behind.
func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// testTimeout bounds every blocking step of a test: client sockets get it
// as a deadline, and waits on channels give up after it.
const testTimeout = 10 * time.Second

// NBD error values as they appear on the wire.
const (
	nbdEPERM     = 1
	nbdEIO       = 5
	nbdENOMEM    = 12
	nbdEINVAL    = 22
	nbdENOSPC    = 28
	nbdEOVERFLOW = 75
	nbdENOTSUP   = 95
	nbdESHUTDOWN = 108
)

// ---- backends ----

// pattern is the initial content of a test export at off.
func pattern(off, n int) []byte {
	b := make([]byte, n)
	for i := range b {
		x := off + i
		b[i] = byte(x*7 + x>>9 + x>>17)
	}
	return b
}

// op is what a backend was asked to do.
type op struct {
	Cmd         Cmd
	FUA, NoHole bool
	Offset      int64
	Length      uint32
}

// storeBackend is an in-memory export. It completes synchronously, or
// from a goroutine of its own if async, and records every request.
type storeBackend struct {
	async bool

	mu sync.Mutex
	// +checklocks:mu
	data []byte
	// +checklocks:mu
	ops []op
	// +checklocks:mu
	maxBuf    int   // the largest Buffer asked for
	bufErr    error // Buffer fails with it
	submitErr error // Submit completes with it
}

func newStore(size int) *storeBackend { return &storeBackend{data: pattern(0, size)} }

func (s *storeBackend) Buffer(ctx context.Context, n int) (Buf, error) {
	s.mu.Lock()
	s.maxBuf = max(s.maxBuf, n)
	err := s.bufErr
	s.mu.Unlock()
	if err != nil {
		return nil, err
	}
	return &memBuf{b: make([]byte, n)}, nil
}

// apply records r and serves it, returning the configured error.
func (s *storeBackend) apply(r *Request) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.ops = append(s.ops, op{Cmd: r.Cmd, FUA: r.FUA, NoHole: r.NoHole, Offset: r.Offset, Length: r.Length})
	if s.submitErr != nil {
		return s.submitErr
	}
	switch r.Cmd {
	case CmdRead:
		copy(r.Data, s.data[r.Offset:])
	case CmdWrite:
		copy(s.data[r.Offset:], r.Data)
	case CmdTrim, CmdWriteZeroes:
		clear(s.data[r.Offset : r.Offset+int64(r.Length)])
	}
	return nil
}

func (s *storeBackend) Submit(r *Request, done func(*Request, error)) {
	err := s.apply(r)
	if s.async {
		go done(r, err)
		return
	}
	done(r, err)
}

func (s *storeBackend) set(f func(s *storeBackend)) {
	s.mu.Lock()
	defer s.mu.Unlock()
	f(s)
}

func (s *storeBackend) snapshot() (data []byte, ops []op, maxBuf int) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return slices.Clone(s.data), slices.Clone(s.ops), s.maxBuf
}

// held is a request a holdBackend keeps until the test finishes it.
type held struct {
	r    *Request
	done func(*Request, error)
}

// holdBackend hands every submitted request to the test on ch, until
// told to pass them through.
type holdBackend struct {
	*storeBackend
	ch chan held

	mu sync.Mutex
	// +checklocks:mu
	pass bool
}

func newHold(size int) *holdBackend {
	return &holdBackend{storeBackend: newStore(size), ch: make(chan held, 1024)}
}

func (h *holdBackend) Submit(r *Request, done func(*Request, error)) {
	h.mu.Lock()
	pass := h.pass
	h.mu.Unlock()
	if pass {
		h.storeBackend.Submit(r, done)
		return
	}
	h.ch <- held{r, done}
}

// passThrough makes the backend complete requests at once from now on.
func (h *holdBackend) passThrough() {
	h.mu.Lock()
	h.pass = true
	h.mu.Unlock()
}

// take waits for n submitted requests.
func (h *holdBackend) take(tb testing.TB, n int) []held {
	tb.Helper()
	var hs []held
	timeout := time.After(testTimeout)
	for len(hs) < n {
		select {
		case x := <-h.ch:
			hs = append(hs, x)
		case <-timeout:
			tb.Fatalf("the backend got %d requests of %d", len(hs), n)
		}
	}
	return hs
}

// finish serves a held request and completes it.
func (h *holdBackend) finish(x held) { x.done(x.r, h.apply(x.r)) }

// ---- server ----

// startServer serves exps on a unix socket in a temporary directory and
// closes the server when the test ends.
func startServer(tb testing.TB, opts Options, exps ...*Export) (*Server, string) {
	tb.Helper()
	if opts.Log == nil {
		opts.Log = log.Discard()
	}
	s := NewServer(opts)
	for _, e := range exps {
		if err := s.AddExport(e); err != nil {
			tb.Fatal(err)
		}
	}
	return s, serveOn(tb, s, s.Serve)
}

// serveOn runs serve (one of s's) on a new unix socket, and returns its
// address; when the test ends s is closed and serve must have returned.
func serveOn(tb testing.TB, s *Server, serve func(net.Listener) error) string {
	tb.Helper()
	addr := filepath.Join(tb.TempDir(), "s")
	l, err := net.Listen("unix", addr)
	if err != nil {
		tb.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- serve(l) }()
	tb.Cleanup(func() {
		s.Close()
		l.Close() // if Close came before Serve took it
		select {
		case err := <-served:
			if err != nil {
				tb.Errorf("Serve: %v", err)
			}
		case <-time.After(testTimeout):
			tb.Errorf("Serve did not return after Close")
		}
	})
	return addr
}

// ---- client ----

// client is a minimal NBD client; every step is bounded by testTimeout.
type client struct {
	tb     testing.TB
	nc     net.Conn
	br     *bufio.Reader
	cookie uint64

	size                            uint64
	flags                           uint16
	minBlock, prefBlock, maxPayload uint32
}

func dial(tb testing.TB, addr string) *client {
	tb.Helper()
	nc, err := net.Dial("unix", addr)
	if err != nil {
		tb.Fatal(err)
	}
	nc.SetDeadline(time.Now().Add(testTimeout))
	tb.Cleanup(func() { nc.Close() })
	return &client{tb: tb, nc: nc, br: bufio.NewReaderSize(nc, 256<<10)}
}

func (c *client) write(b []byte) {
	c.tb.Helper()
	if _, err := c.nc.Write(b); err != nil {
		c.tb.Fatalf("write: %v", err)
	}
}

func (c *client) readFull(n int) []byte {
	c.tb.Helper()
	b := make([]byte, n)
	if _, err := io.ReadFull(c.br, b); err != nil {
		c.tb.Fatalf("read %d bytes: %v", n, err)
	}
	return b
}

// expectClosed asserts that the server ends the connection without
// sending anything more.
func (c *client) expectClosed() {
	c.tb.Helper()
	b, err := c.br.ReadByte()
	if err == nil {
		c.tb.Fatalf("the server sent %#x; want the connection closed", b)
	}
	if !errors.Is(err, io.EOF) && !errors.Is(err, syscall.ECONNRESET) {
		c.tb.Fatalf("want the connection closed, got %v", err)
	}
}

// greet reads the server's greeting and sends the client flags.
func (c *client) greet(cflags uint32) {
	c.tb.Helper()
	b := c.readFull(18)
	if m := binary.BigEndian.Uint64(b[0:]); m != magicNBD {
		c.tb.Fatalf("greeting magic %#x", m)
	}
	if m := binary.BigEndian.Uint64(b[8:]); m != magicOpt {
		c.tb.Fatalf("greeting option magic %#x", m)
	}
	if f := binary.BigEndian.Uint16(b[16:]); f != flagFixedNew|flagNoZeroes {
		c.tb.Fatalf("handshake flags %#x", f)
	}
	var f [4]byte
	binary.BigEndian.PutUint32(f[:], cflags)
	c.write(f[:])
}

func (c *client) sendOpt(opt uint32, data []byte) {
	c.tb.Helper()
	b := make([]byte, 16+len(data))
	binary.BigEndian.PutUint64(b[0:], magicOpt)
	binary.BigEndian.PutUint32(b[8:], opt)
	binary.BigEndian.PutUint32(b[12:], uint32(len(data)))
	copy(b[16:], data)
	c.write(b)
}

type optRep struct {
	typ  uint32
	data []byte
}

// option sends an option and reads its replies up to the final one (an
// ACK or an error).
func (c *client) option(opt uint32, data []byte) []optRep {
	c.tb.Helper()
	c.sendOpt(opt, data)
	var reps []optRep
	for {
		h := c.readFull(20)
		if m := binary.BigEndian.Uint64(h[0:]); m != magicOptReply {
			c.tb.Fatalf("option reply magic %#x", m)
		}
		if o := binary.BigEndian.Uint32(h[8:]); o != opt {
			c.tb.Fatalf("reply to option %d for option %d", o, opt)
		}
		r := optRep{typ: binary.BigEndian.Uint32(h[12:])}
		r.data = c.readFull(int(binary.BigEndian.Uint32(h[16:])))
		reps = append(reps, r)
		if r.typ != repInfo && r.typ != repServer {
			return reps
		}
	}
}

// final is the type of the last reply, which ends an option.
func final(reps []optRep) uint32 { return reps[len(reps)-1].typ }

// goData is the payload of OPT_INFO and OPT_GO.
func goData(name string, infos ...uint16) []byte {
	b := binary.BigEndian.AppendUint32(nil, uint32(len(name)))
	b = append(b, name...)
	b = binary.BigEndian.AppendUint16(b, uint16(len(infos)))
	for _, i := range infos {
		b = binary.BigEndian.AppendUint16(b, i)
	}
	return b
}

// infos parses the REP_INFO replies by type, failing on duplicates.
func (c *client) infos(reps []optRep) map[uint16][]byte {
	c.tb.Helper()
	m := map[uint16][]byte{}
	for _, r := range reps {
		if r.typ != repInfo {
			continue
		}
		if len(r.data) < 2 {
			c.tb.Fatalf("short REP_INFO %x", r.data)
		}
		t := binary.BigEndian.Uint16(r.data)
		if _, dup := m[t]; dup {
			c.tb.Fatalf("info %d sent twice", t)
		}
		m[t] = r.data[2:]
	}
	ex, ok := m[infoExport]
	if !ok || len(ex) != 10 {
		c.tb.Fatalf("INFO_EXPORT missing or malformed: %x", ex)
	}
	c.size, c.flags = binary.BigEndian.Uint64(ex), binary.BigEndian.Uint16(ex[8:])
	if bs, ok := m[infoBlockSize]; ok {
		if len(bs) != 12 {
			c.tb.Fatalf("INFO_BLOCK_SIZE malformed: %x", bs)
		}
		c.minBlock = binary.BigEndian.Uint32(bs[0:])
		c.prefBlock = binary.BigEndian.Uint32(bs[4:])
		c.maxPayload = binary.BigEndian.Uint32(bs[8:])
	}
	return m
}

// optGo enters transmission on export name.
func (c *client) optGo(name string) {
	c.tb.Helper()
	reps := c.option(optGo, goData(name, infoBlockSize))
	if t := final(reps); t != repAck {
		c.tb.Fatalf("OPT_GO %q: reply %#x", name, t)
	}
	c.infos(reps)
}

// connect dials, negotiates and enters transmission on export name.
func connect(tb testing.TB, addr, name string) *client {
	tb.Helper()
	c := dial(tb, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	c.optGo(name)
	return c
}

func (c *client) send(typ, flags uint16, cookie, off uint64, n uint32, payload []byte) {
	c.tb.Helper()
	c.write(appendRequest(nil, typ, flags, cookie, off, n, payload))
}

func appendRequest(b []byte, typ, flags uint16, cookie, off uint64, n uint32, payload []byte) []byte {
	b = binary.BigEndian.AppendUint32(b, magicRequest)
	b = binary.BigEndian.AppendUint16(b, flags)
	b = binary.BigEndian.AppendUint16(b, typ)
	b = binary.BigEndian.AppendUint64(b, cookie)
	b = binary.BigEndian.AppendUint64(b, off)
	b = binary.BigEndian.AppendUint32(b, n)
	return append(b, payload...)
}

// reply reads a simple reply's header.
func (c *client) reply() (errno uint32, cookie uint64) {
	c.tb.Helper()
	h := c.readFull(replySize)
	if m := binary.BigEndian.Uint32(h); m != magicReply {
		c.tb.Fatalf("reply magic %#x", m)
	}
	return binary.BigEndian.Uint32(h[4:]), binary.BigEndian.Uint64(h[8:])
}

// do sends one request and waits for its reply; data is a read's.
func (c *client) do(typ, flags uint16, off uint64, n uint32, payload []byte) (errno uint32, data []byte) {
	c.tb.Helper()
	c.cookie++
	want := c.cookie<<8 | 0xa5
	c.send(typ, flags, want, off, n, payload)
	errno, cookie := c.reply()
	if cookie != want {
		c.tb.Fatalf("reply to cookie %#x, want %#x", cookie, want)
	}
	if Cmd(typ) == CmdRead && errno == 0 {
		data = c.readFull(int(n))
	}
	return errno, data
}

func (c *client) mustRead(off uint64, n uint32) []byte {
	c.tb.Helper()
	errno, data := c.do(uint16(CmdRead), 0, off, n, nil)
	if errno != 0 {
		c.tb.Fatalf("read %d@%d: errno %d", n, off, errno)
	}
	return data
}

func (c *client) mustDo(typ, flags uint16, off uint64, n uint32, payload []byte) {
	c.tb.Helper()
	if errno, _ := c.do(typ, flags, off, n, payload); errno != 0 {
		c.tb.Fatalf("command %d %d@%d: errno %d", typ, n, off, errno)
	}
}

func (c *client) disc() { c.tb.Helper(); c.send(cmdDisc, 0, 0, 0, 0, nil) }
