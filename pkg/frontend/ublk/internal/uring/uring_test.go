package uring

import (
	"errors"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Offsets of include/uapi/linux/io_uring.h (checked with gcc on the
// Debian 12 headers).
func TestLayout(t *testing.T) {
	var p params
	var s SQE
	var c CQE
	for _, tc := range []struct {
		name      string
		got, want uintptr
	}{
		{"sizeof io_uring_params", unsafe.Sizeof(p), 120},
		{"params.sq_off", unsafe.Offsetof(p.SQOff), 40},
		{"params.cq_off", unsafe.Offsetof(p.CQOff), 80},
		{"sizeof io_uring_sqe", unsafe.Sizeof(s), 64},
		{"sqe.off/cmd_op", unsafe.Offsetof(s.Off), 8},
		{"sqe.addr", unsafe.Offsetof(s.Addr), 16},
		{"sqe.len", unsafe.Offsetof(s.Len), 24},
		{"sqe.op_flags", unsafe.Offsetof(s.OpFlags), 28},
		{"sqe.user_data", unsafe.Offsetof(s.UserData), 32},
		{"sqe.buf_index", unsafe.Offsetof(s.BufIndex), 40},
		{"sqe.splice_fd_in", unsafe.Offsetof(s.SpliceFdIn), 44},
		{"sqe.addr3/cmd", unsafe.Offsetof(s.Addr3), 48},
		{"sizeof io_uring_cqe", unsafe.Sizeof(c), 16},
		{"cqe.res", unsafe.Offsetof(c.Res), 8},
		{"sizeof getevents_arg", unsafe.Sizeof(getEventsArg{}), 24},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %d, want %d", tc.name, tc.got, tc.want)
		}
	}
}

func newRing(t *testing.T, entries uint32, o Options) *Ring {
	t.Helper()
	if b, err := os.ReadFile("/proc/sys/kernel/io_uring_disabled"); err == nil && strings.TrimSpace(string(b)) == "2" {
		t.Skip("io_uring is disabled on this host (kernel.io_uring_disabled=2)")
	}
	r, err := New(entries, o)
	if errors.Is(err, ErrUnavailable) {
		t.Skipf("io_uring unavailable here: %v", err)
	}
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { r.Close() })
	return r
}

func TestNop(t *testing.T) {
	for _, big := range []bool{false, true} {
		r := newRing(t, 8, Options{SQE128: big, CQEntries: 32})
		if r.CQEntries() != 32 {
			t.Errorf("CQ entries %d, want 32", r.CQEntries())
		}
		// More NOPs than SQ slots: GetSQE returns nil when full.
		n := 0
		for i := 0; i < 20; i++ {
			s := r.GetSQE()
			if s == nil {
				if _, err := r.Submit(); err != nil {
					t.Fatal(err)
				}
				s = r.GetSQE()
			}
			s.PrepNop(uint64(1000 + i))
			n++
		}
		if _, err := r.SubmitAndWait(20); err != nil {
			t.Fatal(err)
		}
		seen := map[uint64]bool{}
		r.Reap(func(c CQE) {
			if c.Res != 0 {
				t.Errorf("nop res %d", c.Res)
			}
			seen[c.UserData] = true
		})
		if len(seen) != n {
			t.Fatalf("SQE128=%v: %d completions, want %d", big, len(seen), n)
		}
	}
}

func TestCmdArea(t *testing.T) {
	r := newRing(t, 4, Options{SQE128: true})
	s := r.GetSQE()
	if got := len(r.Cmd(s)); got != 80 {
		t.Fatalf("cmd area %d bytes, want 80", got)
	}
	s.PrepURingCmd(3, 0xC0207504, 7)
	b := unsafe.Slice((*byte)(unsafe.Pointer(s)), 128)
	if b[0] != OpURingCmd || b[8] != 0x04 || b[9] != 0x75 || b[10] != 0x20 || b[11] != 0xC0 || b[12] != 0 {
		t.Fatalf("cmd_op bytes % x", b[:16])
	}
	r.Cmd(s)[79] = 0xAA
	if b[127] != 0xAA {
		t.Fatal("cmd area does not end at SQE byte 127")
	}
	r2 := newRing(t, 4, Options{})
	if got := len(r2.Cmd(r2.GetSQE())); got != 16 {
		t.Fatalf("cmd area of a 64-byte SQE: %d bytes, want 16", got)
	}
}

// URING_CMD on a file that has no uring_cmd handler completes with an
// error rather than failing the submission.
func TestURingCmdUnsupported(t *testing.T) {
	r := newRing(t, 4, Options{SQE128: true})
	f, err := os.CreateTemp(t.TempDir(), "x")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	r.GetSQE().PrepURingCmd(int(f.Fd()), 1, 9)
	if _, err := r.SubmitAndWait(1); err != nil {
		t.Fatal(err)
	}
	c, ok := r.PeekCQE()
	if !ok || c.UserData != 9 || c.Res >= 0 {
		t.Fatalf("cqe %+v ok=%v, want an error result", c, ok)
	}
	r.SeenCQE()
}

func TestEventfdRead(t *testing.T) {
	r := newRing(t, 4, Options{})
	efd, err := unix.Eventfd(0, unix.EFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(efd)
	buf := new(uint64)
	r.GetSQE().PrepRead(efd, unsafe.Pointer(buf), 8, 0, 42)
	if _, err := r.Submit(); err != nil {
		t.Fatal(err)
	}
	if err := r.WaitTimeout(50 * time.Millisecond); err != syscall.ETIME {
		t.Fatalf("WaitTimeout before the write: %v, want ETIME", err)
	}
	go func() {
		time.Sleep(20 * time.Millisecond)
		var v [8]byte
		v[0] = 5
		unix.Write(efd, v[:])
	}()
	if _, err := r.SubmitAndWait(1); err != nil {
		t.Fatal(err)
	}
	c, _ := r.PeekCQE()
	r.SeenCQE()
	if c.UserData != 42 || c.Res != 8 || *buf != 5 {
		t.Fatalf("cqe %+v value %d", c, *buf)
	}
}

func TestPipeReadAndPoll(t *testing.T) {
	r := newRing(t, 4, Options{})
	var p [2]int
	if err := unix.Pipe2(p[:], unix.O_CLOEXEC); err != nil {
		t.Fatal(err)
	}
	defer unix.Close(p[0])
	defer unix.Close(p[1])
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	r.GetSQE().PrepPollAdd(p[0], unix.POLLIN, 1)
	r.GetSQE().PrepRead(p[0], unsafe.Pointer(&buf[0]), 4096, ^uint64(0), 2)
	if _, err := r.Submit(); err != nil {
		t.Fatal(err)
	}
	if _, err := unix.Write(p[1], []byte("hello ring")); err != nil {
		t.Fatal(err)
	}
	got := map[uint64]int32{}
	for len(got) < 2 {
		if err := r.WaitTimeout(5 * time.Second); err != nil {
			t.Fatal(err)
		}
		r.Reap(func(c CQE) { got[c.UserData] = c.Res })
	}
	if got[1]&unix.POLLIN == 0 {
		t.Errorf("poll res %#x", got[1])
	}
	if got[2] != 10 || string(buf[:10]) != "hello ring" {
		t.Errorf("read res %d %q", got[2], buf[:10])
	}
}

func TestTimeoutOp(t *testing.T) {
	r := newRing(t, 4, Options{})
	ts := &unix.Timespec{Nsec: 10e6}
	r.GetSQE().PrepTimeout(ts, 77)
	start := time.Now()
	if _, err := r.SubmitAndWait(1); err != nil {
		t.Fatal(err)
	}
	c, _ := r.PeekCQE()
	r.SeenCQE()
	if c.UserData != 77 || c.Res != -int32(unix.ETIME) {
		t.Fatalf("timeout cqe %+v", c)
	}
	if time.Since(start) < 5*time.Millisecond {
		t.Fatal("timeout completed too early")
	}
}
