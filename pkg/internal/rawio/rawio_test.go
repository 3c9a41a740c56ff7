package rawio

import (
	"bytes"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"io"
	"math/rand/v2"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func tcpPair(t *testing.T) (a, b net.Conn) {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	ch := make(chan net.Conn, 1)
	go func() {
		c, _ := l.Accept()
		ch <- c
	}()
	a, err = net.Dial("tcp", l.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	b = <-ch
	if b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a, b
}

// queued is how many bytes c has received and not yet read (SIOCINQ).
func queued(t *testing.T, c net.Conn) int {
	t.Helper()
	rc, err := c.(*net.TCPConn).SyscallConn()
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	rc.Control(func(fd uintptr) { n, err = unix.IoctlGetInt(int(fd), unix.SIOCINQ) })
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// pollerRound returns once the network poller has run after it was
// called: a goroutine parked in the poller on the connection pair x, y
// is woken, which only the poller does, and the poller takes every
// readiness the kernel had queued by then, not only that one.
func pollerRound(t *testing.T, x, y net.Conn) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		pollerRoundRead(y)
	}()
	kit.WaitFor(t, 10*time.Second, "the poller round's reader to wait in the poller", func() bool { return kit.Blocked("rawio.pollerRoundRead(", "IO wait") })
	if _, err := x.Write([]byte{0}); err != nil {
		t.Fatal(err)
	}
	<-done
}

func pollerRoundRead(y net.Conn) {
	var b [1]byte
	y.Read(b[:])
}

// Writev of more than the socket buffers hold waits for room (the reader
// is slow to start), splits across more buffers than one writev takes,
// and every byte arrives in order.
func TestConnWritevLargeAndManyBuffers(t *testing.T) {
	a, b := tcpPair(t)
	w, r := New(a), New(b)
	if w == nil || r == nil {
		t.Fatal("a TCP connection has a descriptor")
	}
	rng := rand.New(rand.NewPCG(1, 2))
	var want []byte
	var bufs [][]byte
	for i := 0; i < 3000; i++ { // > maxIov buffers, some empty
		p := make([]byte, rng.IntN(8<<10))
		for j := range p {
			p[j] = byte(rng.Uint32())
		}
		want = append(want, p...)
		bufs = append(bufs, p)
	}
	done := make(chan error, 1)
	go func() { done <- w.Writev(bufs) }()
	// The writer fills the socket and waits for room (or, where the
	// socket's buffers take it all, is done) before the reader starts.
	kit.WaitFor(t, 10*time.Second, "the writer to wait for room", func() bool { return len(done) > 0 || kit.Blocked("rawio.(*Conn).Writev(", "IO wait") })
	g, _ := io.ReadAll(io.LimitReader(r, int64(len(want))))
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(g, want) {
		t.Fatalf("read %d bytes, want %d equal ones", len(g), len(want))
	}
	if err := w.Writev([][]byte{nil, {}}); err != nil {
		t.Fatalf("empty write: %v", err)
	}
}

func TestConnReadEOFAndClose(t *testing.T) {
	a, b := tcpPair(t)
	r := New(b)
	a.Write([]byte("hi"))
	a.Close()
	buf := make([]byte, 10)
	n, err := r.Read(buf)
	if n != 2 || err != nil || string(buf[:2]) != "hi" {
		t.Fatalf("read %d %v", n, err)
	}
	if n, err = r.Read(buf); n != 0 || err != io.EOF {
		t.Fatalf("at the end: %d %v, want io.EOF", n, err)
	}

	// A reader waiting in the poller returns net.ErrClosed at Close.
	c, d := tcpPair(t)
	_ = c
	rd := New(d)
	var wg sync.WaitGroup
	wg.Add(1)
	var rerr error
	go func() {
		defer wg.Done()
		_, rerr = rd.Read(buf)
	}()
	kit.WaitFor(t, 10*time.Second, "the reader to wait in the poller", func() bool { return kit.Blocked("rawio.(*Conn).Read(", "IO wait") })
	d.Close()
	wg.Wait()
	if !errors.Is(rerr, net.ErrClosed) {
		t.Fatalf("read after close: %v, want net.ErrClosed", rerr)
	}
	// Deadlines still work.
	e, f := tcpPair(t)
	_ = e
	f.SetReadDeadline(time.Now().Add(10 * time.Millisecond))
	if _, err := New(f).Read(buf); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read past the deadline: %v", err)
	}
}

func TestConnWriteToResetPeer(t *testing.T) {
	a, b := tcpPair(t)
	b.(*net.TCPConn).SetLinger(0)
	b.Close()
	w := New(a)
	p := make([]byte, 1<<20)
	var err error
	for i := 0; i < 50 && err == nil; i++ {
		err = w.Writev([][]byte{p})
	}
	if !errors.Is(err, syscall.EPIPE) && !errors.Is(err, syscall.ECONNRESET) {
		t.Fatalf("writing to a reset peer: %v", err)
	}
}

func TestNewWithoutDescriptor(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if New(a) != nil {
		t.Fatal("net.Pipe has no descriptor")
	}
}

func TestFileCalls(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	fd := int(f.Fd())
	if n, err := Pwrite(fd, []byte("hello world"), 100); n != 11 || err != nil {
		t.Fatalf("pwrite: %d %v", n, err)
	}
	p := make([]byte, 5)
	if n, err := Pread(fd, p, 106); n != 5 || err != nil || string(p) != "world" {
		t.Fatalf("pread: %d %v %q", n, err, p)
	}
	if n, err := Pread(fd, p, 109); n != 2 || err != nil {
		t.Fatalf("pread across the end: %d %v, want 2", n, err)
	}
	n, err := PreadNowait(fd, p, 100)
	switch {
	case errors.Is(err, syscall.EOPNOTSUPP) || errors.Is(err, syscall.EAGAIN):
		// The filesystem does not do RWF_NOWAIT, or not for this file.
	case err != nil || n != 5 || string(p) != "hello":
		t.Fatalf("preadv2 nowait: %d %v %q", n, err, p)
	}
	if _, err := Pread(-1, p, 0); !errors.Is(err, syscall.EBADF) {
		t.Fatalf("bad descriptor: %v", err)
	}
	if _, err := Pwrite(-1, p, 0); !errors.Is(err, syscall.EBADF) {
		t.Fatalf("bad descriptor: %v", err)
	}
}

// Bytes that arrive after a short read, before the next Read, are read:
// Read must try the socket before it waits. (Waiting at once after a
// short read, to save the read that returns EAGAIN, loses them: the
// runtime's poller forgets readiness it saw before each RawConn.Read, so
// the wake-up for them is gone and the reader sleeps with data queued —
// a hang found by measuring exactly that change.)
func TestReadAfterShortRead(t *testing.T) {
	a, b := tcpPair(t)
	x, y := tcpPair(t)
	r := New(b)
	buf := make([]byte, 64)
	for i := range 3 {
		if _, err := a.Write([]byte{byte(i)}); err != nil {
			t.Fatal(err)
		}
		// The byte is there, and the poller takes the socket's
		// wake-up for it before Read is called.
		kit.WaitFor(t, 10*time.Second, "the byte to arrive", func() bool { return queued(t, b) > 0 })
		pollerRound(t, x, y)
		b.SetReadDeadline(time.Now().Add(5 * time.Second))
		if n, err := r.Read(buf); err != nil || n != 1 || buf[0] != byte(i) {
			t.Fatalf("read %d: %d bytes %v, %v", i, n, buf[:n], err)
		}
	}
}

func TestStep(t *testing.T) {
	b := func(n int) []byte { return make([]byte, n) }
	for _, tc := range []struct {
		iov  [][]byte
		max  int
		want int
	}{
		{[][]byte{b(10), b(10), b(10)}, 25, 2},
		{[][]byte{b(10), b(10), b(10)}, 30, 3},
		{[][]byte{b(50), b(1)}, 25, 1}, // one buffer over the bound still goes
		{[][]byte{b(0), b(0)}, 0, 2},
		{nil, 10, 0},
	} {
		if got := Step(tc.iov, tc.max); got != tc.want {
			t.Errorf("Step(%d buffers, %d) = %d, want %d", len(tc.iov), tc.max, got, tc.want)
		}
	}
}
