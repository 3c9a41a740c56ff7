package nbd

import (
	"bufio"
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
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

	mu        sync.Mutex
	data      []byte
	ops       []op
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

	mu   sync.Mutex
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

// ---- handshake ----

func TestHandshakeList(t *testing.T) {
	_, addr := startServer(t, Options{},
		&Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)},
		&Export{Name: "bb", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	reps := c.option(optList, nil)
	if final(reps) != repAck {
		t.Fatalf("OPT_LIST ended with %#x", final(reps))
	}
	var names []string
	for _, r := range reps[:len(reps)-1] {
		if r.typ != repServer || len(r.data) < 4 || int(binary.BigEndian.Uint32(r.data)) != len(r.data)-4 {
			t.Fatalf("bad REP_SERVER %#x %x", r.typ, r.data)
		}
		names = append(names, string(r.data[4:]))
	}
	slices.Sort(names)
	if !slices.Equal(names, []string{"a", "bb"}) {
		t.Fatalf("listed %q", names)
	}
	if reps := c.option(optList, []byte{0}); len(reps) != 1 || reps[0].typ != repErrInvalid {
		t.Fatalf("OPT_LIST with data: %+v", reps)
	}
	c.optGo("bb")
	if !bytes.Equal(c.mustRead(4096, 100), pattern(4096, 100)) {
		t.Fatal("read after OPT_LIST: wrong data")
	}
}

func TestHandshakeInfo(t *testing.T) {
	all := tflagHasFlags | tflagSendFlush | tflagSendFUA | tflagCanMulti
	for _, tc := range []struct {
		name  string
		exp   Export
		flags uint16
		block [3]uint32
	}{
		{"rw", Export{Flush: true, FUA: true, Trim: true, WriteZeroes: true, MultiConn: true},
			uint16(all | tflagSendTrim | tflagSendZeroes), [3]uint32{1, 4096, 32 << 20}},
		{"ro", Export{ReadOnly: true, Flush: true, FUA: true, Trim: true, WriteZeroes: true, MultiConn: true},
			uint16(all | tflagReadOnly), [3]uint32{1, 4096, 32 << 20}},
		{"fua-without-flush", Export{FUA: true}, tflagHasFlags, [3]uint32{1, 4096, 32 << 20}},
		{"plain", Export{MinBlock: 512, PrefBlock: 65536, MaxPayload: 1 << 20}, tflagHasFlags,
			[3]uint32{512, 65536, 1 << 20}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := tc.exp
			e.Name, e.Description, e.Size, e.Backend = tc.name, "the "+tc.name+" export", 3<<20, newStore(3<<20)
			_, addr := startServer(t, Options{}, &e)
			c := dial(t, addr)
			c.greet(cflagFixedNew | cflagNoZeroes)
			check := func(what string, reps []optRep) map[uint16][]byte {
				t.Helper()
				if final(reps) != repAck {
					t.Fatalf("%s: reply %#x", what, final(reps))
				}
				m := c.infos(reps)
				if c.size != 3<<20 || c.flags != tc.flags {
					t.Errorf("%s: size %d flags %#x, want %d %#x", what, c.size, c.flags, 3<<20, tc.flags)
				}
				if got := [3]uint32{c.minBlock, c.prefBlock, c.maxPayload}; got != tc.block {
					t.Errorf("%s: block sizes %v, want %v", what, got, tc.block)
				}
				return m
			}
			m := check("OPT_INFO", c.option(optInfo, goData(tc.name, infoName, infoDescription, infoBlockSize, 0x7777)))
			if string(m[infoName]) != tc.name || string(m[infoDescription]) != e.Description || len(m) != 4 {
				t.Errorf("OPT_INFO infos: %v", m)
			}
			// OPT_INFO stays in negotiation; OPT_GO then enters transmission.
			check("OPT_GO", c.option(optGo, goData(tc.name, infoBlockSize)))
			if !bytes.Equal(c.mustRead(1<<20, 4096), pattern(1<<20, 4096)) {
				t.Fatal("wrong data")
			}
		})
	}
}

func TestHandshakeDefaultExport(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "only", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := connect(t, addr, "")
	if c.size != 1<<20 {
		t.Fatalf("size %d", c.size)
	}
	c.mustRead(0, 512)
}

func TestHandshakeUnknownExport(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)},
		&Export{Name: "b", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	for _, opt := range []uint32{optInfo, optGo} {
		if reps := c.option(opt, goData("nope", infoBlockSize)); len(reps) != 1 || reps[0].typ != repErrUnknown {
			t.Fatalf("option %d of an unknown export: %+v", opt, reps)
		}
	}
	// Two exports: no default.
	if reps := c.option(optGo, goData("")); len(reps) != 1 || reps[0].typ != repErrUnknown {
		t.Fatalf("OPT_GO \"\" with two exports: %+v", reps)
	}
	c.optGo("a")
	c.mustRead(0, 512)

	c = dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	c.sendOpt(optExportName, []byte("nope"))
	c.expectClosed()
}

func TestHandshakeBadOptions(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	for _, tc := range []struct {
		name string
		opt  uint32
		data []byte
		want uint32
	}{
		{"short", optGo, []byte{0, 0, 0, 1, 0}, repErrInvalid},
		{"name-overflow", optInfo, goData("a")[:5], repErrInvalid},
		{"name-too-long", optGo, append(binary.BigEndian.AppendUint32(nil, 0xffffffff), 0, 0), repErrInvalid},
		{"infos-mismatch", optGo, append(goData("a", infoBlockSize), 0), repErrInvalid},
		{"structured-reply", 8, nil, repErrUnsup},
		{"unknown", 0x12345, []byte("xyz"), repErrUnsup},
	} {
		if reps := c.option(tc.opt, tc.data); len(reps) != 1 || reps[0].typ != tc.want {
			t.Fatalf("%s: %+v, want one reply %#x", tc.name, reps, tc.want)
		}
	}
	c.optGo("a")
	c.mustRead(0, 512)
}

func TestHandshakeAbort(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	if reps := c.option(optAbort, nil); len(reps) != 1 || reps[0].typ != repAck || len(reps[0].data) != 0 {
		t.Fatalf("OPT_ABORT: %+v", reps)
	}
	c.expectClosed()
}

func TestHandshakeExportName(t *testing.T) {
	for _, noZeroes := range []bool{true, false} {
		t.Run(fmt.Sprint("noZeroes=", noZeroes), func(t *testing.T) {
			_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, ReadOnly: true, Backend: newStore(1 << 20)})
			c := dial(t, addr)
			cflags := cflagFixedNew
			if noZeroes {
				cflags |= cflagNoZeroes
			}
			c.greet(cflags)
			c.sendOpt(optExportName, []byte("a"))
			b := c.readFull(10)
			if size, flags := binary.BigEndian.Uint64(b), binary.BigEndian.Uint16(b[8:]); size != 1<<20 ||
				flags != tflagHasFlags|tflagReadOnly {
				t.Fatalf("size %d flags %#x", size, flags)
			}
			if !noZeroes {
				if z := c.readFull(124); !bytes.Equal(z, make([]byte, 124)) {
					t.Fatalf("padding %x", z)
				}
			}
			if !bytes.Equal(c.mustRead(100, 1000), pattern(100, 1000)) {
				t.Fatal("wrong data")
			}
		})
	}
}

func TestHandshakeHostile(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	optHdr := func(magic uint64, opt, n uint32) []byte {
		b := binary.BigEndian.AppendUint64(nil, magic)
		b = binary.BigEndian.AppendUint32(b, opt)
		return binary.BigEndian.AppendUint32(b, n)
	}
	for _, tc := range []struct {
		name   string
		cflags uint32
		send   []byte
	}{
		{"client-flags", 1 << 7, nil},
		{"option-magic", cflagFixedNew, optHdr(0x1122334455667788, optGo, 0)},
		{"option-length", cflagFixedNew, optHdr(magicOpt, optGo, maxOptionLen+1)},
		{"option-length-huge", cflagFixedNew, optHdr(magicOpt, optList, 0xffffffff)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := dial(t, addr)
			c.greet(tc.cflags)
			if tc.send != nil {
				c.write(tc.send)
			}
			c.expectClosed()
		})
	}
	// The server still serves.
	connect(t, addr, "a").mustRead(0, 512)
}

func TestHandshakeTooManyOptions(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	for i := 0; i < maxOptions; i++ {
		if reps := c.option(0x999, nil); final(reps) != repErrUnsup {
			t.Fatalf("option %d: %+v", i, reps)
		}
	}
	c.expectClosed()
}

// ---- transmission ----

func TestReadWrite(t *testing.T) {
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprint("async=", async), func(t *testing.T) {
			const size = 4 << 20
			st := newStore(size)
			st.async = async
			_, addr := startServer(t, Options{}, &Export{Name: "a", Size: size, Flush: true, FUA: true,
				Trim: true, WriteZeroes: true, Backend: st})
			c := connect(t, addr, "a")
			want := pattern(0, size)
			w := func(flags uint16, off, n int) {
				t.Helper()
				p := bytes.Repeat([]byte{byte(off), byte(n), 0x5a}, n/3+1)[:n]
				c.mustDo(uint16(CmdWrite), flags, uint64(off), uint32(n), p)
				copy(want[off:], p)
			}
			w(0, 0, 4096)
			w(0, 1, 1)
			w(cmdFlagFUA, 4095, 2)
			w(0, 12345, 3<<20/2)
			w(0, size-1000, 1000)
			w(0, 1<<20, 0)
			c.mustDo(uint16(CmdTrim), 0, 8192, 4096, nil)
			clear(want[8192 : 8192+4096])
			c.mustDo(uint16(CmdWriteZeroes), cmdFlagNoHole|cmdFlagFUA, 3<<20, 100000, nil)
			clear(want[3<<20 : 3<<20+100000])
			c.mustDo(uint16(CmdFlush), 0, 0, 0, nil)
			for _, r := range [][2]int{{0, 8192}, {4094, 3}, {12000, 2 << 20}, {size - 4096, 4096}, {size, 0}, {0, size}} {
				if got := c.mustRead(uint64(r[0]), uint32(r[1])); !bytes.Equal(got, want[r[0]:r[0]+r[1]]) {
					t.Fatalf("read %d@%d: wrong data", r[1], r[0])
				}
			}
			data, ops, _ := st.snapshot()
			if !bytes.Equal(data, want) {
				t.Fatal("the backend holds the wrong data")
			}
			// Zero-length reads and writes are answered without the backend.
			wantOps := []op{
				{Cmd: CmdWrite, Offset: 0, Length: 4096},
				{Cmd: CmdWrite, Offset: 1, Length: 1},
				{Cmd: CmdWrite, FUA: true, Offset: 4095, Length: 2},
				{Cmd: CmdWrite, Offset: 12345, Length: 3 << 20 / 2},
				{Cmd: CmdWrite, Offset: size - 1000, Length: 1000},
				{Cmd: CmdTrim, Offset: 8192, Length: 4096},
				{Cmd: CmdWriteZeroes, FUA: true, NoHole: true, Offset: 3 << 20, Length: 100000},
				{Cmd: CmdFlush},
				{Cmd: CmdRead, Offset: 0, Length: 8192},
				{Cmd: CmdRead, Offset: 4094, Length: 3},
				{Cmd: CmdRead, Offset: 12000, Length: 2 << 20},
				{Cmd: CmdRead, Offset: size - 4096, Length: 4096},
				{Cmd: CmdRead, Offset: 0, Length: size},
			}
			if !slices.Equal(ops, wantOps) {
				t.Fatalf("backend ops\n%+v\nwant\n%+v", ops, wantOps)
			}
			c.disc()
			c.expectClosed()
		})
	}
}

// TestCheckErrnos sends every request that the server must refuse, each
// followed by a read that must still work: refused writes must have their
// payload consumed. Each payload is itself a valid request, which the
// server would answer if it took it for one.
func TestCheckErrnos(t *testing.T) {
	const size = 1 << 20
	exps := map[string]*Export{
		"rw":    {Name: "rw", Size: size, Flush: true, Trim: true, WriteZeroes: true, MaxPayload: 64 << 10},
		"ro":    {Name: "ro", Size: size, ReadOnly: true, Trim: true, WriteZeroes: true},
		"plain": {Name: "plain", Size: size},
		"al":    {Name: "al", Size: size, MinBlock: 512, Trim: true},
	}
	var list []*Export
	for _, e := range exps {
		e.Backend = newStore(size)
		list = append(list, e)
	}
	_, addr := startServer(t, Options{}, list...)
	conns := map[string]*client{}
	for name := range exps {
		conns[name] = connect(t, addr, name)
	}
	const (
		read   = uint16(CmdRead)
		write  = uint16(CmdWrite)
		flush  = uint16(CmdFlush)
		trim   = uint16(CmdTrim)
		zeroes = uint16(CmdWriteZeroes)
	)
	for _, tc := range []struct {
		name  string
		exp   string
		typ   uint16
		flags uint16
		off   uint64
		n     uint32
		want  uint32
	}{
		{"write-read-only", "ro", write, 0, 0, 4096, nbdEPERM},
		{"write-fua-read-only", "ro", write, cmdFlagFUA, 512, 100, nbdEPERM},
		{"trim-read-only", "ro", trim, 0, 0, 4096, nbdEPERM},
		{"zeroes-read-only", "ro", zeroes, 0, 0, 4096, nbdEPERM},
		{"write-read-only-past-end", "ro", write, 0, size, 512, nbdEPERM},
		{"read-past-end", "rw", read, 0, size - 100, 200, nbdEINVAL},
		{"read-beyond-end", "rw", read, 0, size + 4096, 0, nbdEINVAL},
		{"read-offset-overflow", "rw", read, 0, 1<<64 - 256, 512, nbdEINVAL},
		{"write-past-end", "rw", write, 0, size - 100, 200, nbdENOSPC},
		{"write-beyond-end", "rw", write, 0, size + 1, 1, nbdENOSPC},
		{"write-offset-overflow", "rw", write, 0, 1<<64 - 256, 512, nbdENOSPC},
		{"trim-past-end", "rw", trim, 0, size - 4096, 8192, nbdENOSPC},
		{"zeroes-past-end", "rw", zeroes, 0, size, 1, nbdENOSPC},
		{"unknown-cmd-5", "rw", 5, 0, 0, 512, nbdEINVAL},
		{"block-status", "rw", 7, 0, 0, 512, nbdEINVAL},
		{"unknown-cmd-ffff", "rw", 0xffff, 0, 0, 512, nbdEINVAL},
		{"read-flag-df", "rw", read, 1 << 2, 0, 512, nbdEINVAL},
		{"write-flag-15", "rw", write, 1 << 15, 0, 512, nbdEINVAL},
		{"read-fua", "rw", read, cmdFlagFUA, 0, 512, nbdEINVAL},
		{"write-nohole", "rw", write, cmdFlagNoHole, 0, 512, nbdEINVAL},
		{"trim-nohole", "rw", trim, cmdFlagNoHole, 0, 512, nbdEINVAL},
		{"flush-unsupported", "ro", flush, 0, 0, 0, nbdEINVAL},
		{"trim-unsupported", "plain", trim, 0, 0, 4096, nbdEINVAL},
		{"zeroes-unsupported", "plain", zeroes, 0, 0, 4096, nbdEINVAL},
		{"read-over-max-payload", "rw", read, 0, 0, 64<<10 + 512, nbdEINVAL},
		{"read-huge", "plain", read, 0, 0, 0xffffffff, nbdEINVAL},
		{"read-misaligned-offset", "al", read, 0, 100, 512, nbdEINVAL},
		{"read-misaligned-length", "al", read, 0, 512, 100, nbdEINVAL},
		{"write-misaligned", "al", write, 0, 512, 1000, nbdEINVAL},
		{"trim-misaligned", "al", trim, 0, 1, 512, nbdEINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := conns[tc.exp]
			st := exps[tc.exp].Backend.(*storeBackend)
			_, before, _ := st.snapshot()
			var payload []byte
			if Cmd(tc.typ) == CmdWrite {
				// Requests that would read 7 bytes from offset 0.
				for len(payload) < int(tc.n) {
					payload = appendRequest(payload, read, 0, 0xbad, 0, 7, nil)
				}
				payload = payload[:tc.n]
			}
			if errno, data := c.do(tc.typ, tc.flags, tc.off, tc.n, payload); errno != tc.want || data != nil {
				t.Fatalf("errno %d (data %d bytes), want %d", errno, len(data), tc.want)
			}
			if !bytes.Equal(c.mustRead(4096, 4096), pattern(4096, 4096)) {
				t.Fatal("read after the error: wrong data")
			}
			// The refused request never reached the backend.
			if _, after, _ := st.snapshot(); len(after) != len(before)+1 {
				t.Fatalf("backend ops %+v after %+v", after, before)
			}
		})
	}
	for name, c := range conns {
		if data, _, _ := exps[name].Backend.(*storeBackend).snapshot(); !bytes.Equal(data, pattern(0, size)) {
			t.Errorf("export %s was modified", name)
		}
		c.disc()
		c.expectClosed()
	}
}

func TestBackendErrnos(t *testing.T) {
	st := newStore(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Flush: true, Backend: st})
	c := connect(t, addr, "a")
	for _, tc := range []struct {
		err  error
		want uint32
	}{
		{syscall.EPERM, nbdEPERM},
		{syscall.EROFS, nbdEPERM},
		{syscall.EACCES, nbdEPERM},
		{syscall.EIO, nbdEIO},
		{syscall.ENOMEM, nbdENOMEM},
		{syscall.EINVAL, nbdEINVAL},
		{syscall.ENOSPC, nbdENOSPC},
		{syscall.EFBIG, nbdENOSPC},
		{syscall.EOVERFLOW, nbdEOVERFLOW},
		{syscall.EOPNOTSUPP, nbdENOTSUP},
		{syscall.ENOTSUP, nbdENOTSUP},
		{syscall.ESHUTDOWN, nbdESHUTDOWN},
		{syscall.ENOENT, nbdEIO},
		{syscall.EAGAIN, nbdEIO},
		{fmt.Errorf("wrapped: %w", syscall.ENOSPC), nbdENOSPC},
		{errors.New("opaque"), nbdEIO},
		{context.Canceled, nbdEIO},
	} {
		for _, cmd := range []Cmd{CmdRead, CmdWrite, CmdFlush} {
			st.set(func(s *storeBackend) { s.submitErr = tc.err })
			var payload []byte
			if cmd == CmdWrite {
				payload = appendRequest(nil, uint16(CmdRead), 0, 0xbad, 0, 7, nil)[:16]
			}
			n := uint32(len(payload))
			if cmd == CmdRead {
				n = 4096
			}
			if cmd == CmdFlush {
				n = 0
			}
			if errno, _ := c.do(uint16(cmd), 0, 0, n, payload); errno != tc.want {
				t.Errorf("%v on command %d: errno %d, want %d", tc.err, cmd, errno, tc.want)
			}
		}
	}
	st.set(func(s *storeBackend) { s.submitErr = nil })
	if !bytes.Equal(c.mustRead(0, 4096), pattern(0, 4096)) {
		t.Fatal("wrong data")
	}
}

// TestBufferFailure: when the backend has no memory the request fails
// with ENOMEM, and a write's payload is skipped.
func TestBufferFailure(t *testing.T) {
	st := newStore(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: st})
	c := connect(t, addr, "a")
	st.set(func(s *storeBackend) { s.bufErr = errors.New("no memory") })
	payload := appendRequest(nil, uint16(CmdRead), 0, 0xbad, 0, 7, nil)
	if errno, _ := c.do(uint16(CmdWrite), 0, 0, uint32(len(payload)), payload); errno != nbdENOMEM {
		t.Fatalf("write: errno %d", errno)
	}
	if errno, _ := c.do(uint16(CmdRead), 0, 0, 512, nil); errno != nbdENOMEM {
		t.Fatalf("read: errno %d", errno)
	}
	st.set(func(s *storeBackend) { s.bufErr = nil })
	if !bytes.Equal(c.mustRead(0, 4096), pattern(0, 4096)) {
		t.Fatal("wrong data")
	}
	if _, ops, _ := st.snapshot(); len(ops) != 1 {
		t.Fatalf("backend ops %+v", ops)
	}
}

// TestOutOfOrder: a backend completes a pipeline of reads and writes in
// reverse; the replies come in that order, each cookie exactly once.
func TestOutOfOrder(t *testing.T) {
	const n = 32
	hb := newHold(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: hb})
	c := connect(t, addr, "a")
	var reqs []byte
	for i := range n {
		off := uint64(i) * 8192
		if i%2 == 0 {
			reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(1000+i), off, 4096, nil)
		} else {
			reqs = appendRequest(reqs, uint16(CmdWrite), 0, uint64(1000+i), off, 4096, bytes.Repeat([]byte{byte(i)}, 4096))
		}
	}
	c.write(reqs)
	hs := hb.take(t, n)
	for i, h := range hs {
		if h.r.Offset != int64(i)*8192 {
			t.Fatalf("request %d submitted at %d", i, h.r.Offset)
		}
	}
	for i := n - 1; i >= 0; i-- {
		hb.finish(hs[i])
	}
	seen := map[uint64]bool{}
	for k := range n {
		errno, cookie := c.reply()
		i := int(cookie) - 1000
		if errno != 0 || i < 0 || i >= n || seen[cookie] {
			t.Fatalf("reply %d: errno %d cookie %d (seen %v)", k, errno, cookie, seen[cookie])
		}
		seen[cookie] = true
		if i != n-1-k {
			t.Errorf("reply %d for request %d, want the reverse of completion", k, i)
		}
		if i%2 == 0 {
			if got := c.readFull(4096); !bytes.Equal(got, pattern(i*8192, 4096)) {
				t.Fatalf("request %d: wrong data", i)
			}
		}
	}
	// Nothing more was sent, and the writes landed.
	hb.passThrough()
	for i := 1; i < n; i += 2 {
		if got := c.mustRead(uint64(i)*8192, 4096); !bytes.Equal(got, bytes.Repeat([]byte{byte(i)}, 4096)) {
			t.Fatalf("write %d: wrong data", i)
		}
	}
}

// TestDiscDrains: writes in flight when DISC arrives are all answered
// before the server closes.
func TestDiscDrains(t *testing.T) {
	for _, inflight := range []int{128, 4} {
		t.Run(fmt.Sprint("inflight=", inflight), func(t *testing.T) {
			const n = 16
			hb := newHold(1 << 20)
			_, addr := startServer(t, Options{MaxInflight: inflight}, &Export{Name: "a", Size: 1 << 20, Backend: hb})
			c := connect(t, addr, "a")
			var reqs []byte
			for i := range n {
				reqs = appendRequest(reqs, uint16(CmdWrite), 0, uint64(i), uint64(i)*4096, 4096, bytes.Repeat([]byte{byte(i + 1)}, 4096))
			}
			reqs = appendRequest(reqs, cmdDisc, 0, 99, 0, 0, nil)
			// Requests after DISC are ignored.
			reqs = appendRequest(reqs, uint16(CmdRead), 0, 100, 0, 4096, nil)
			c.write(reqs)
			if inflight >= n {
				// Hold all until the stream, DISC included, is sent.
				hs := hb.take(t, n)
				for i := n - 1; i >= 0; i-- {
					hb.finish(hs[i])
				}
			} else {
				for range n {
					hb.finish(hb.take(t, 1)[0])
				}
			}
			seen := map[uint64]bool{}
			for range n {
				errno, cookie := c.reply()
				if errno != 0 || cookie >= n || seen[cookie] {
					t.Fatalf("errno %d cookie %d", errno, cookie)
				}
				seen[cookie] = true
			}
			c.expectClosed()
			data, ops, _ := hb.snapshot()
			if len(ops) != n {
				t.Fatalf("backend saw %d requests", len(ops))
			}
			for i := range n {
				if !bytes.Equal(data[i*4096:(i+1)*4096], bytes.Repeat([]byte{byte(i + 1)}, 4096)) {
					t.Fatalf("write %d did not land", i)
				}
			}
		})
	}
}

// TestInflightLimit: the backend never has more than MaxInflight requests.
func TestInflightLimit(t *testing.T) {
	const limit, n = 3, 30
	hb := newHold(1 << 20)
	_, addr := startServer(t, Options{MaxInflight: limit}, &Export{Name: "a", Size: 1 << 20, Backend: hb})
	c := connect(t, addr, "a")
	var reqs []byte
	for i := range n {
		reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(i), uint64(i)*512, 512, nil)
	}
	c.write(reqs)
	for done := 0; done < n; done += limit {
		hs := hb.take(t, limit)
		if extra := len(hb.ch); extra != 0 {
			t.Fatalf("%d requests beyond the limit of %d", extra, limit)
		}
		for _, h := range hs {
			hb.finish(h)
		}
	}
	for range n {
		errno, cookie := c.reply()
		if errno != 0 {
			t.Fatalf("errno %d", errno)
		}
		if got := c.readFull(512); !bytes.Equal(got, pattern(int(cookie)*512, 512)) {
			t.Fatalf("request %d: wrong data", cookie)
		}
	}
}

// ---- hostile input ----

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

// ---- closing ----

// TestCloseInFlight: Server.Close waits for requests in flight, returns
// once the backend finishes them and leaves no goroutine behind.
func TestCloseInFlight(t *testing.T) {
	for _, tc := range []struct {
		name     string
		inflight int
		partial  bool // a write's payload is cut short
	}{
		{"held", 128, false},
		{"reader-waits-for-a-slot", 4, false},
		{"reader-in-payload", 128, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			hb := newHold(1 << 20)
			s, addr := startServer(t, Options{MaxInflight: tc.inflight}, &Export{Name: "a", Size: 1 << 20, Backend: hb},
				&Export{Name: "b", Size: 1 << 20, Backend: newStore(1 << 20)})
			c := connect(t, addr, "a")
			other := connect(t, addr, "b")
			other.mustRead(0, 512)
			const n = 8
			var reqs []byte
			for i := range n {
				reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(i), uint64(i)*4096, 4096, nil)
			}
			if tc.partial {
				reqs = appendRequest(reqs, uint16(CmdWrite), 0, 99, 0, 8192, make([]byte, 100))
			}
			c.write(reqs)
			hs := hb.take(t, min(n, tc.inflight))
			if na, nb := s.Conns("a"), s.Conns("b"); na != 1 || nb != 1 {
				t.Fatalf("Conns: %d %d", na, nb)
			}

			closed := make(chan struct{})
			go func() {
				s.Close()
				close(closed)
			}()
			// The connections end at once (their requests are still held,
			// so no reply is on its way).
			c.expectClosed()
			other.expectClosed()
			select {
			case <-closed:
				t.Fatal("Close returned with requests in flight")
			default:
			}
			for _, h := range hs {
				hb.finish(h)
			}
			select {
			case <-closed:
			case <-time.After(testTimeout):
				t.Fatal("Close did not return")
			}
			if na, nb := s.Conns("a"), s.Conns("b"); na != 0 || nb != 0 {
				t.Fatalf("Conns after Close: %d %d", na, nb)
			}
			if len(hb.ch) != 0 {
				t.Fatalf("%d requests submitted after Close", len(hb.ch))
			}
			goleak.VerifyNone(t)
		})
	}
}

func TestRemoveExport(t *testing.T) {
	hb := newHold(1 << 20)
	s, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: hb},
		&Export{Name: "b", Size: 1 << 20, Backend: newStore(1 << 20)})
	a, b := connect(t, addr, "a"), connect(t, addr, "b")
	a.send(uint16(CmdRead), 0, 1, 0, 512, nil)
	hs := hb.take(t, 1)
	removed := make(chan error, 1)
	go func() { removed <- s.RemoveExport("a") }()
	a.expectClosed()
	hb.finish(hs[0])
	select {
	case err := <-removed:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(testTimeout):
		t.Fatal("RemoveExport did not return")
	}
	if n := s.Conns("a"); n != 0 {
		t.Fatalf("Conns(a) = %d", n)
	}
	b.mustRead(0, 512) // and so b is in transmission
	if n := s.Conns("b"); n != 1 {
		t.Fatalf("Conns(b) = %d", n)
	}
	if err := s.RemoveExport("a"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("RemoveExport again: %v", err)
	}
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	if reps := c.option(optGo, goData("a")); final(reps) != repErrUnknown {
		t.Fatalf("OPT_GO of a removed export: %#x", final(reps))
	}
}

// TestCloseDuringHandshake: Close must not wait for a client that is in
// the middle of the handshake (it used to, for the 30 s handshake timeout).
func TestCloseDuringHandshake(t *testing.T) {
	s, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)})
	c := dial(t, addr)
	c.readFull(18) // the greeting; then silence
	closed := make(chan struct{})
	go func() {
		s.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Error("Close did not return within 5s while a client was in the handshake")
		<-closed
	}
	c.expectClosed()
}

// TestCloseWaitsForServeKernel: Close says it waits, and the kernel's
// connections (ServeKernel) have requests in flight like any other; the
// client daemon closes its backends right after Close.
func TestCloseWaitsForServeKernel(t *testing.T) {
	hb := newHold(1 << 20)
	s := NewServer(Options{Log: log.Discard()})
	if err := s.AddExport(&Export{Name: "a", Size: 1 << 20, Backend: hb}); err != nil {
		t.Fatal(err)
	}
	cli, srv := net.Pipe()
	defer cli.Close()
	served := make(chan struct{})
	go func() {
		defer close(served)
		s.ServeKernel(srv, "a")
	}()
	c := &client{tb: t, nc: cli, br: bufio.NewReader(cli)}
	cli.SetDeadline(time.Now().Add(testTimeout))
	c.send(uint16(CmdRead), 0, 1, 0, 512, nil)
	h := hb.take(t, 1)[0]
	closed := make(chan struct{})
	go func() {
		s.Close()
		close(closed)
	}()
	c.expectClosed()
	select {
	case <-closed:
		t.Error("Close returned while a ServeKernel connection had a request in flight")
	case <-time.After(time.Second): // a bound, not a synchronisation
	}
	hb.finish(h)
	for _, ch := range []chan struct{}{closed, served} {
		select {
		case <-ch:
		case <-time.After(testTimeout):
			t.Fatal("Close or ServeKernel did not return")
		}
	}
}

// ---- plugging ----

// plugBackend completes nothing until the connection unplugs: a request
// held by a plug the reader forgot would never be answered. Its Buffer
// has few slots, so the reader also waits for buffers.
type plugBackend struct {
	*storeBackend
	slots chan struct{}

	mu     sync.Mutex
	plugs  map[Plug]bool
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

// TestServeExport: a listener limited to one export lists only it, opens
// it by its name or the default name, and opens no other, by any option.
func TestServeExport(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	for _, name := range []string{"mine", "other"} {
		if err := s.AddExport(&Export{Name: name, Size: 1 << 20, Backend: newStore(1 << 20)}); err != nil {
			t.Fatal(err)
		}
	}
	addr := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(l, "mine") })
	c := dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	reps := c.option(optList, nil)
	if len(reps) != 2 || reps[0].typ != repServer || string(reps[0].data[4:]) != "mine" || final(reps) != repAck {
		t.Fatalf("OPT_LIST on a socket of one export: %+v", reps)
	}
	for _, opt := range []uint32{optInfo, optGo} {
		if reps := c.option(opt, goData("other", infoBlockSize)); len(reps) != 1 || reps[0].typ != repErrUnknown {
			t.Fatalf("option %d of another export: %+v", opt, reps)
		}
	}
	// The default name is this socket's export, though the server has two.
	c.optGo("")
	if !bytes.Equal(c.mustRead(0, 512), pattern(0, 512)) {
		t.Fatal("wrong data")
	}
	c = connect(t, addr, "mine")
	c.mustRead(0, 512)
	c = dial(t, addr)
	c.greet(cflagFixedNew | cflagNoZeroes)
	c.sendOpt(optExportName, []byte("other"))
	c.expectClosed()
}

// failingListener fails its first n accepts with EMFILE.
type failingListener struct {
	net.Listener
	mu sync.Mutex
	n  int
}

func (l *failingListener) Accept() (net.Conn, error) {
	l.mu.Lock()
	fail := l.n > 0
	l.n--
	l.mu.Unlock()
	if fail {
		return nil, &net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept4", syscall.EMFILE)}
	}
	return l.Listener.Accept()
}

// TestAcceptRetry: an accept that fails (out of descriptors) does not end
// the socket's service: it accepts again, and serves.
func TestAcceptRetry(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	if err := s.AddExport(&Export{Name: "a", Size: 1 << 20, Backend: newStore(1 << 20)}); err != nil {
		t.Fatal(err)
	}
	addr := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(&failingListener{Listener: l, n: 3}, "a") })
	c := connect(t, addr, "a")
	if !bytes.Equal(c.mustRead(0, 512), pattern(0, 512)) {
		t.Fatal("wrong data")
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

// TestExportIDs: exports may share a name under different IDs; each
// listener limited to one serves that one under the shared name, and a
// listener of every export refuses the name as ambiguous.
func TestExportIDs(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	stores := map[string]*storeBackend{"a": newStore(1 << 20), "b": newStore(1 << 20)}
	copy(stores["b"].data, bytes.Repeat([]byte{0xbb}, 4096))
	for id, st := range stores {
		if err := s.AddExport(&Export{ID: id, Name: "vol", Size: 1 << 20, Backend: st}); err != nil {
			t.Fatal(err)
		}
	}
	if err := s.AddExport(&Export{ID: "a", Name: "other", Size: 1 << 20, Backend: newStore(1 << 20)}); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("a second export of ID a: %v, want EEXIST", err)
	}
	la := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(l, "a") })
	lb := serveOn(t, s, func(l net.Listener) error { return s.ServeExport(l, "b") })
	all := serveOn(t, s, s.Serve)
	if got := connect(t, la, "vol").mustRead(0, 4096); !bytes.Equal(got, pattern(0, 4096)) {
		t.Fatal("a's socket: not a's data")
	}
	cb := connect(t, lb, "vol")
	if got := cb.mustRead(0, 4096); !bytes.Equal(got, bytes.Repeat([]byte{0xbb}, 4096)) {
		t.Fatal("b's socket: not b's data")
	}
	if n := s.Conns("b"); n != 1 {
		t.Fatalf("Conns(b) = %d", n)
	}
	c := dial(t, all)
	c.greet(cflagFixedNew | cflagNoZeroes)
	if reps := c.option(optGo, goData("vol")); len(reps) != 1 || reps[0].typ != repErrUnknown {
		t.Fatalf("OPT_GO of a name two exports share, on the socket of every export: %+v", reps)
	}
	if err := s.RemoveExport("b"); err != nil {
		t.Fatal(err)
	}
	cb.expectClosed()
	if got := connect(t, all, "vol").mustRead(0, 4096); !bytes.Equal(got, pattern(0, 4096)) {
		t.Fatal("the name left to one export does not open it")
	}
}

// brokenListener fails every accept with EINVAL, as a socket shut down.
type brokenListener struct{ net.Listener }

func (brokenListener) Accept() (net.Conn, error) {
	return nil, &net.OpError{Op: "accept", Net: "unix", Err: os.NewSyscallError("accept4", syscall.EINVAL)}
}

// TestAcceptBroken: an accept error that no retry cures ends Serve with
// it, rather than a retry every second for ever.
func TestAcceptBroken(t *testing.T) {
	s := NewServer(Options{Log: log.Discard()})
	defer s.Close()
	l, err := net.Listen("unix", filepath.Join(t.TempDir(), "s"))
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	done := make(chan error, 1)
	go func() { done <- s.Serve(brokenListener{l}) }()
	select {
	case err := <-done:
		if !errors.Is(err, syscall.EINVAL) {
			t.Fatalf("Serve: %v, want EINVAL", err)
		}
	case <-time.After(testTimeout):
		t.Fatal("Serve retries an accept error that does not go away")
	}
}
