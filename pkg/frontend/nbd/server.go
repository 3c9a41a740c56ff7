// Package nbd is a pipelined NBD server: the frontend that serves mapped
// devices to NBD clients (qemu, libnbd tools, fio's nbd engine) over unix
// or TCP sockets, and to the kernel's nbd driver over socketpairs.
//
// Each connection has one reader, which parses requests and hands them to
// the backend without waiting, and one writer, which sends the replies in
// the order they complete, batching whatever is ready into one writev.
//
// Lock order: there are two locks, and neither is taken while the other
// is held.
//
//	Server.mu  the exports, connections, handshakes and listeners;
//	           Close snapshots the connections and closes them after it
//	conn.mu    a connection's replies ready, in flight, and its writer's
//	           state; held over no call out of the connection
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations, checked by gVisor's checklocks analyzer
// in make vet (which does not check the order).
package nbd

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"sync"
	"syscall"
	"time"

	"github.com/pojntfx/go-nbd/pkg/protocol"

	"github.com/rnbd/rnbd/pkg/log"
)

// Protocol constants (doc/proto.md of the NBD project). go-nbd's
// pkg/protocol has the magics, the options and replies of the newstyle
// negotiation, the transmission flags HAS_FLAGS and CAN_MULTI_CONN and the
// commands READ, WRITE and DISC: those are its values. What it lacks is
// here: NO_ZEROES, EXPORT_NAME, ERR_INVALID, the transmission flags and
// command flags of FLUSH, FUA, TRIM and WRITE_ZEROES, and the commands
// FLUSH, TRIM and WRITE_ZEROES (Cmd below).
const (
	magicNBD        = protocol.NEGOTIATION_MAGIC_OLDSTYLE // "NBDMAGIC"
	magicOpt        = protocol.NEGOTIATION_MAGIC_OPTION   // "IHAVEOPT"
	magicOptReply   = protocol.NEGOTIATION_MAGIC_REPLY
	magicRequest    = protocol.TRANSMISSION_MAGIC_REQUEST
	magicReply      = protocol.TRANSMISSION_MAGIC_REPLY
	flagFixedNew    = protocol.NEGOTIATION_HANDSHAKE_FLAG_FIXED_NEWSTYLE
	optAbort        = protocol.NEGOTIATION_ID_OPTION_ABORT
	optList         = protocol.NEGOTIATION_ID_OPTION_LIST
	optInfo         = protocol.NEGOTIATION_ID_OPTION_INFO
	optGo           = protocol.NEGOTIATION_ID_OPTION_GO
	repAck          = protocol.NEGOTIATION_TYPE_REPLY_ACK
	repServer       = protocol.NEGOTIATION_TYPE_REPLY_SERVER
	repInfo         = protocol.NEGOTIATION_TYPE_REPLY_INFO
	repErrUnsup     = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNSUPPORTED
	repErrUnknown   = protocol.NEGOTIATION_TYPE_REPLY_ERR_UNKNOWN
	infoExport      = protocol.NEGOTIATION_TYPE_INFO_EXPORT
	infoName        = protocol.NEGOTIATION_TYPE_INFO_NAME
	infoDescription = protocol.NEGOTIATION_TYPE_INFO_DESCRIPTION
	infoBlockSize   = protocol.NEGOTIATION_TYPE_INFO_BLOCKSIZE
	tflagHasFlags   = protocol.NEGOTIATION_REPLY_FLAGS_HAS_FLAGS
	tflagCanMulti   = protocol.NEGOTIATION_REPLY_FLAGS_CAN_MULTI_CONN
	cmdDisc         = protocol.TRANSMISSION_TYPE_REQUEST_DISC

	flagNoZeroes    = 1 << 1
	cflagFixedNew   = uint32(flagFixedNew) // the client's flags: the same bits, 32 wide
	cflagNoZeroes   = uint32(flagNoZeroes)
	optExportName   = 1
	repErrInvalid   = 1<<31 + 3
	tflagReadOnly   = 1 << 1
	tflagSendFlush  = 1 << 2
	tflagSendFUA    = 1 << 3
	tflagSendTrim   = 1 << 5
	tflagSendZeroes = 1 << 6
	cmdFlagFUA      = 1 << 0
	cmdFlagNoHole   = 1 << 1

	// requestSize and replySize are the wire sizes of go-nbd's
	// TransmissionRequestHeader and TransmissionReplyHeader, which the
	// reader and the writer lay out by hand at the same offsets (magic,
	// flags, type, cookie, offset, length; magic, error, cookie):
	// encoding/binary on a struct would cost its reflection on every
	// request. A test holds the two to the same bytes.
	requestSize = 28
	replySize   = 16

	maxOptionLen     = 64 << 10
	maxOptions       = 64
	handshakeTimeout = 30 * time.Second
)

// Cmd is an NBD command the backend serves.
type Cmd uint16

const (
	CmdRead        Cmd = Cmd(protocol.TRANSMISSION_TYPE_REQUEST_READ)
	CmdWrite       Cmd = Cmd(protocol.TRANSMISSION_TYPE_REQUEST_WRITE)
	CmdFlush       Cmd = 3
	CmdTrim        Cmd = 4
	CmdWriteZeroes Cmd = 6
)

// Buf is request memory the backend hands out.
type Buf interface {
	Bytes() []byte
	Release()
}

// Request is one command in flight. The server owns and reuses it.
type Request struct {
	Cmd    Cmd
	FUA    bool
	NoHole bool
	Offset int64
	Length uint32
	Data   []byte // reads and writes: Buf().Bytes()
	// Plug is the connection's, if the backend is a Plugger; it is the
	// submitting goroutine's, for use during Submit only.
	Plug Plug
	// Batch, set by the backend before it calls done (nil: none), is
	// the completer's batch; it is read during done only.
	Batch Batch

	cookie uint64
	buf    Buf
	errno  uint32
	c      *conn
}

// Buf is the memory of a read or write.
func (r *Request) Buf() Buf { return r.buf }

// Backend serves one export.
type Backend interface {
	// Buffer returns memory for n bytes; it may block (back pressure)
	// until ctx, cancelled when the connection goes, is done.
	Buffer(ctx context.Context, n int) (Buf, error)
	// Submit starts r and returns; done is called once, from any
	// goroutine, with nil or an error (a syscall.Errno keeps its value).
	Submit(r *Request, done func(r *Request, err error))
}

// Plugger is a Backend that can hold the requests of a connection's burst
// and send them together (the block layer's plug): the connection gets a
// Plug from NewPlug, gives it to Submit in Request.Plug, and unplugs it
// before it waits, for more requests to read or for a free slot. Buffer
// must unplug PlugFrom(ctx) itself before it waits. docs/rtrs.md,
// "Batching", has the whole path of a plug and of a batch.
type Plugger interface {
	NewPlug() Plug
}

// Plug is a connection's plug: Unplug sends what it holds.
type Plug interface {
	Unplug()
}

// Batch is where a completion may leave work to be done once at the end
// of the completer's burst (an RNBD transport's read of many responses):
// Submit's done, given a request with Batch set, may defer the reply's
// write to it, so that the replies of a burst go out in one write from
// the completing goroutine.
type Batch interface {
	Defer(f interface{ Flush() })
}

type plugKey struct{}

// PlugFrom returns the plug of the connection whose context ctx is, or nil.
func PlugFrom(ctx context.Context) Plug {
	pl, _ := ctx.Value(plugKey{}).(Plug)
	return pl
}

// Export is what the server offers under a name.
type Export struct {
	Name string
	// ID is what the server files the export under (AddExport,
	// RemoveExport, Conns, ServeExport, ServeKernel); Name if empty.
	// Exports may share a Name under different IDs: clients of a
	// listener limited to one of them (ServeExport) see only that one,
	// and a listener of every export opens a Name only if it is one
	// export's.
	ID          string
	Description string
	Size        int64
	ReadOnly    bool
	Flush       bool
	FUA         bool
	Trim        bool
	WriteZeroes bool
	MultiConn   bool
	MinBlock    uint32 // default 1
	PrefBlock   uint32 // default 4096
	MaxPayload  uint32 // default 32 MiB
	Backend     Backend
	// SizeNow, if set, is the export's size instead of Size: each
	// negotiation announces it and each request is checked against it
	// (a device whose size changes). NBD cannot tell a connection that
	// the size changed: one connected before keeps the size it was told,
	// within which IO goes on.
	SizeNow func() int64
}

// size is what the export has now.
func (e *Export) size() int64 {
	if e.SizeNow != nil {
		return e.SizeNow()
	}
	return e.Size
}

// TransmissionFlags are the NBD transmission flags the export advertises
// (what the kernel's nbd driver is told at attach).
func (e *Export) TransmissionFlags() uint16 { return e.flags() }

func (e *Export) flags() uint16 {
	f := uint16(tflagHasFlags)
	if e.ReadOnly {
		f |= tflagReadOnly
	}
	if e.Flush {
		f |= tflagSendFlush
		if e.FUA {
			f |= tflagSendFUA
		}
	}
	if e.Trim && !e.ReadOnly {
		f |= tflagSendTrim
	}
	if e.WriteZeroes && !e.ReadOnly {
		f |= tflagSendZeroes
	}
	if e.MultiConn {
		f |= tflagCanMulti
	}
	return f
}

// Options configure a Server.
type Options struct {
	MaxInflight int // per connection, default 128
	// StallTimeout is how long a client may take to read stallStep
	// bytes of replies (default 60 s): one that reads less is taken for
	// stopped and its connection closed, so that the request memory its
	// unread replies hold — shared by every connection to the export —
	// comes back.
	StallTimeout time.Duration
	Log          *log.Entry
}

// Server serves exports to NBD clients.
//
// Concurrency: a Server is safe for concurrent use: exports are added
// and removed while listeners and connections serve the others, and
// Close may come at any time. mu guards the exports, connections,
// handshakes and listeners, and is held only to read or change those,
// never over IO or a call into a backend; each connection has its own
// reader and writer goroutines and its own conn.mu, and neither lock is
// taken under the other (the package's Lock order). An Export is not
// changed once added (AddExport fills in its defaults before it is
// shared); its Backend serves the requests of all its connections at
// once. RemoveExport waits for the requests in flight of the export's
// connections, Close for every connection and listener goroutine.
type Server struct {
	opts Options
	log  *log.Entry

	mu sync.Mutex
	// +checklocks:mu
	exports map[string]*Export
	// +checklocks:mu
	conns map[*conn]struct{}
	// +checklocks:mu
	shaking map[net.Conn]struct{} // in the handshake
	// +checklocks:mu
	listeners map[net.Listener]struct{}
	// +checklocks:mu
	closed bool
	wg     sync.WaitGroup
}

// NewServer returns a server with no exports.
func NewServer(opts Options) *Server {
	if opts.MaxInflight <= 0 {
		opts.MaxInflight = 128
	}
	if opts.StallTimeout <= 0 {
		opts.StallTimeout = 60 * time.Second
	}
	if opts.Log == nil {
		opts.Log = log.L
	}
	return &Server{opts: opts, log: opts.Log, exports: map[string]*Export{},
		conns: map[*conn]struct{}{}, shaking: map[net.Conn]struct{}{}, listeners: map[net.Listener]struct{}{}}
}

// AddExport offers e.
func (s *Server) AddExport(e *Export) error {
	if e.MinBlock == 0 {
		e.MinBlock = 1
	}
	if e.PrefBlock == 0 {
		e.PrefBlock = 4096
	}
	if e.MaxPayload == 0 {
		e.MaxPayload = 32 << 20
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.exports[e.key()] != nil {
		return fmt.Errorf("nbd: export %q exists: %w", e.key(), syscall.EEXIST)
	}
	s.exports[e.key()] = e
	return nil
}

// key is the export's ID, or its Name.
func (e *Export) key() string {
	if e.ID != "" {
		return e.ID
	}
	return e.Name
}

// RemoveExport withdraws the export id and closes its connections,
// waiting for their requests in flight.
func (s *Server) RemoveExport(id string) error {
	s.mu.Lock()
	e := s.exports[id]
	delete(s.exports, id)
	var cs []*conn
	for c := range s.conns {
		if c.exp == e {
			cs = append(cs, c)
		}
	}
	s.mu.Unlock()
	if e == nil {
		return fmt.Errorf("nbd: no export %q: %w", id, syscall.ENOENT)
	}
	for _, c := range cs {
		c.close()
		<-c.done
	}
	return nil
}

// Conns counts the connections serving the export id.
func (s *Server) Conns(id string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	n := 0
	for c := range s.conns {
		if c.exp != nil && c.exp.key() == id {
			n++
		}
	}
	return n
}

// Serve accepts connections on l until l or the server closes; they may
// open any export.
func (s *Server) Serve(l net.Listener) error { return s.serve(l, "") }

// ServeExport is Serve for connections that see only the export id: it
// is all they can list, and what its name and the default name open. A
// socket that serves one device then opens no other, whoever can reach
// it.
func (s *Server) ServeExport(l net.Listener, id string) error { return s.serve(l, id) }

// acceptRetryMax bounds the wait before the accept after one that failed.
const acceptRetryMax = time.Second

// transientAccept reports whether an accept failed for want of a
// resource that comes back (descriptors, memory) or for one connection
// alone, rather than for the listener itself.
func transientAccept(err error) bool {
	for _, e := range []syscall.Errno{syscall.EMFILE, syscall.ENFILE, syscall.ENOBUFS, syscall.ENOMEM,
		syscall.ECONNABORTED, syscall.EINTR, syscall.EAGAIN, syscall.EPROTO, syscall.EPERM} {
		if errors.Is(err, e) {
			return true
		}
	}
	return false
}

func (s *Server) serve(l net.Listener, only string) error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.listeners[l] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()
	var wait time.Duration
	for {
		nc, err := l.Accept()
		if err != nil {
			s.mu.Lock()
			closed := s.closed
			if closed || errors.Is(err, net.ErrClosed) || !transientAccept(err) {
				delete(s.listeners, l)
				s.mu.Unlock()
				if closed || errors.Is(err, net.ErrClosed) {
					return nil
				}
				return err
			}
			s.mu.Unlock()
			// Out of descriptors (EMFILE, ENFILE) or memory: the
			// socket stays, and accepts again when there is room.
			wait = min(max(2*wait, 5*time.Millisecond), acceptRetryMax)
			s.log.WithError(err).Warnf("nbd: accept failed; trying again in %v", wait)
			time.Sleep(wait)
			continue
		}
		wait = 0
		s.wg.Add(1)
		go func() {
			defer s.wg.Done()
			s.serveConn(nc, only)
		}()
	}
}

// enter counts a connection being served, so that Close waits for it; it
// fails once the server is closed.
func (s *Server) enter(nc net.Conn, handshake bool) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	if handshake {
		s.shaking[nc] = struct{}{}
	}
	return true
}

// ServeConn runs the handshake, then serves the connection until it ends.
func (s *Server) ServeConn(nc net.Conn) { s.serveConn(nc, "") }

// serveConn is ServeConn for a connection limited to export only, if
// not empty.
func (s *Server) serveConn(nc net.Conn, only string) {
	defer nc.Close()
	if !s.enter(nc, true) {
		return
	}
	defer s.wg.Done()
	nc.SetDeadline(time.Now().Add(handshakeTimeout))
	e, err := s.handshake(nc, only)
	s.mu.Lock()
	delete(s.shaking, nc)
	s.mu.Unlock()
	if err != nil {
		if !errors.Is(err, io.EOF) && !errors.Is(err, errAbort) {
			s.log.WithError(err).Debug("nbd: handshake failed")
		}
		return
	}
	nc.SetDeadline(time.Time{})
	s.transmit(nc, e)
}

// ServeKernel serves the export id on a connection that skips the
// handshake (the kernel's socketpairs), until it ends.
func (s *Server) ServeKernel(nc net.Conn, id string) error {
	defer nc.Close()
	if !s.enter(nc, false) {
		return net.ErrClosed
	}
	defer s.wg.Done()
	s.mu.Lock()
	e := s.exports[id]
	s.mu.Unlock()
	if e == nil {
		return fmt.Errorf("nbd: no export %q: %w", id, syscall.ENOENT)
	}
	s.transmit(nc, e)
	return nil
}

// Close stops the listeners, closes every connection and waits.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	for l := range s.listeners {
		l.Close()
	}
	var cs []*conn
	for c := range s.conns {
		cs = append(cs, c)
	}
	for nc := range s.shaking {
		nc.Close() // the handshake fails at once
	}
	s.mu.Unlock()
	for _, c := range cs {
		c.close()
	}
	s.wg.Wait()
	return nil
}

var errAbort = errors.New("nbd: client aborted")

// export is the export a client names, as seen by a connection limited
// to the export of ID only (if not empty), or nil.
func (s *Server) export(name, only string) *Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	if only != "" {
		e := s.exports[only]
		if e == nil || name != "" && name != e.Name {
			return nil
		}
		return e
	}
	var found *Export
	for _, e := range s.exports {
		if name == "" && len(s.exports) == 1 || e.Name == name {
			if found != nil {
				return nil // two exports of that name: not this listener's to choose
			}
			found = e
		}
	}
	return found
}

// handshake is the fixed-newstyle negotiation, limited to export only if
// that is not empty. Its headers are go-nbd's structs, through
// encoding/binary: once per connection, not per request.
func (s *Server) handshake(nc net.Conn, only string) (*Export, error) {
	if err := binary.Write(nc, binary.BigEndian, protocol.NegotiationNewstyleHeader{
		OldstyleMagic: magicNBD, OptionMagic: magicOpt, HandshakeFlags: flagFixedNew | flagNoZeroes}); err != nil {
		return nil, err
	}
	var cflags uint32
	if err := binary.Read(nc, binary.BigEndian, &cflags); err != nil {
		return nil, err
	}
	if cflags&^(cflagFixedNew|cflagNoZeroes) != 0 {
		return nil, fmt.Errorf("unknown client flags %#x", cflags)
	}
	noZeroes := cflags&cflagNoZeroes != 0
	for i := 0; i < maxOptions; i++ {
		var h protocol.NegotiationOptionHeader
		if err := binary.Read(nc, binary.BigEndian, &h); err != nil {
			return nil, err
		}
		if h.OptionMagic != magicOpt {
			return nil, errors.New("bad option magic")
		}
		opt, n := h.ID, h.Length
		if n > maxOptionLen {
			return nil, fmt.Errorf("option %d of %d bytes", opt, n)
		}
		data := make([]byte, n)
		if _, err := io.ReadFull(nc, data); err != nil {
			return nil, err
		}
		switch opt {
		case optExportName:
			e := s.export(string(data), only)
			if e == nil {
				return nil, fmt.Errorf("unknown export %q", data)
			}
			out := make([]byte, 10, 134)
			binary.BigEndian.PutUint64(out[0:], uint64(e.size()))
			binary.BigEndian.PutUint16(out[8:], e.flags())
			if !noZeroes {
				out = out[:134]
			}
			_, err := nc.Write(out)
			return e, err
		case optAbort:
			optReply(nc, opt, repAck, nil)
			return nil, errAbort
		case optList:
			if n != 0 {
				if err := optReply(nc, opt, repErrInvalid, nil); err != nil {
					return nil, err
				}
				continue
			}
			s.mu.Lock()
			var names []string
			for id, e := range s.exports {
				if only == "" || id == only {
					names = append(names, e.Name)
				}
			}
			s.mu.Unlock()
			for _, name := range names {
				p := make([]byte, 4+len(name))
				binary.BigEndian.PutUint32(p, uint32(len(name)))
				copy(p[4:], name)
				if err := optReply(nc, opt, repServer, p); err != nil {
					return nil, err
				}
			}
			if err := optReply(nc, opt, repAck, nil); err != nil {
				return nil, err
			}
		case optInfo, optGo:
			e, err := s.info(nc, opt, data, only)
			if err != nil {
				return nil, err
			}
			if e != nil && opt == optGo {
				return e, nil
			}
		default:
			if err := optReply(nc, opt, repErrUnsup, nil); err != nil {
				return nil, err
			}
		}
	}
	return nil, errors.New("too many options")
}

// info answers OPT_INFO and OPT_GO; it returns the export if the answer
// was an ACK.
func (s *Server) info(nc net.Conn, opt uint32, data []byte, only string) (*Export, error) {
	if len(data) < 6 {
		return nil, optReply(nc, opt, repErrInvalid, nil)
	}
	nl := binary.BigEndian.Uint32(data)
	if uint64(nl)+6 > uint64(len(data)) {
		return nil, optReply(nc, opt, repErrInvalid, nil)
	}
	name := string(data[4 : 4+nl])
	nreq := binary.BigEndian.Uint16(data[4+nl:])
	reqs := data[6+nl:]
	if len(reqs) != int(nreq)*2 {
		return nil, optReply(nc, opt, repErrInvalid, nil)
	}
	e := s.export(name, only)
	if e == nil {
		return nil, optReply(nc, opt, repErrUnknown, nil)
	}
	p, _ := binary.Append(nil, binary.BigEndian, protocol.NegotiationReplyInfo{
		Type: infoExport, Size: uint64(e.size()), TransmissionFlags: e.flags()})
	if err := optReply(nc, opt, repInfo, p); err != nil {
		return nil, err
	}
	p, _ = binary.Append(p[:0], binary.BigEndian, protocol.NegotiationReplyBlockSize{
		Type: infoBlockSize, MinimumBlockSize: e.MinBlock, PreferredBlockSize: e.PrefBlock, MaximumBlockSize: e.MaxPayload})
	if err := optReply(nc, opt, repInfo, p); err != nil {
		return nil, err
	}
	for i := 0; i < int(nreq); i++ {
		var text string
		typ := binary.BigEndian.Uint16(reqs[2*i:])
		switch typ {
		case infoName:
			text = e.Name
		case infoDescription:
			text = e.Description
		default:
			continue
		}
		// NAME and DESCRIPTION: the same header, then the text.
		q, _ := binary.Append(make([]byte, 0, 2+len(text)), binary.BigEndian, protocol.NegotiationReplyNameHeader{Type: typ})
		q = append(q, text...)
		if err := optReply(nc, opt, repInfo, q); err != nil {
			return nil, err
		}
	}
	return e, optReply(nc, opt, repAck, nil)
}

// optReply writes an option's reply: go-nbd's header, then data, in one
// write.
func optReply(w io.Writer, opt, typ uint32, data []byte) error {
	b, _ := binary.Append(make([]byte, 0, 20+len(data)), binary.BigEndian, protocol.NegotiationReplyHeader{
		ReplyMagic: magicOptReply, ID: opt, Type: typ, Length: uint32(len(data))})
	b = append(b, data...)
	_, err := w.Write(b)
	return err
}
