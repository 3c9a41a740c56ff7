package nbdnl

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// The ioctl path needs a real /dev/nbdN to succeed; these tests cover the
// setup plan and the failures, which must not leak the NBD_DO_IT thread
// (goleak checks at the end).

func TestIoctlSteps(t *testing.T) {
	type step struct {
		req, arg uintptr
	}
	plan := func(size, bs, flags uint64, timeout time.Duration) []step {
		t.Helper()
		steps, err := ioctlSteps(size, bs, flags, timeout)
		if err != nil {
			t.Fatal(err)
		}
		var out []step
		for _, s := range steps {
			out = append(out, step{s.req, s.arg})
		}
		return out
	}
	eq := func(got, want []step) bool {
		if len(got) != len(want) {
			return false
		}
		for i := range got {
			if got[i] != want[i] {
				return false
			}
		}
		return true
	}
	if got, want := plan(1<<30, 4096, FlagHasFlags|FlagSendFlush, 30*time.Second), []step{
		{0xab01, 4096}, {0xab07, 1 << 18}, {0xab0a, 5}, {0xab09, 30},
	}; !eq(got, want) {
		t.Errorf("whole blocks: %x, want %x", got, want)
	}
	// Not a whole number of blocks, or no block size: in bytes. No
	// timeout: none set.
	if got, want := plan(1<<20+512, 4096, 0, 0), []step{{0xab01, 4096}, {0xab02, 1<<20 + 512}, {0xab0a, 0}}; !eq(got, want) {
		t.Errorf("bytes: %x, want %x", got, want)
	}
	if got, want := plan(1<<20, 0, 1, 1500*time.Millisecond), []step{{0xab02, 1 << 20}, {0xab0a, 1}, {0xab09, 2}}; !eq(got, want) {
		t.Errorf("default block size: %x, want %x", got, want)
	}
	for _, bs := range []uint64{256, 1000, 3 << 10} {
		if _, err := ioctlSteps(1<<20, bs, 0, 0); !errors.Is(err, unix.EINVAL) {
			t.Errorf("block size %d: %v, want EINVAL", bs, err)
		}
	}
}

func TestAttachIoctlFailures(t *testing.T) {
	sock := sockets(t, 1)[0]
	if _, err := AttachIoctl("/dev/nbd0", nil, 1<<20, 512, 0, 0); !errors.Is(err, unix.EBADF) {
		t.Errorf("no socket: %v, want EBADF", err)
	}
	missing := filepath.Join(t.TempDir(), "nbd0")
	if _, err := AttachIoctl(missing, sock, 1<<20, 512, 0, 0); !errors.Is(err, unix.ENOENT) {
		t.Errorf("missing device: %v, want ENOENT", err)
	}
	if _, err := AttachIoctl("/dev/null", sock, 1<<20, 1000, 0, 0); !errors.Is(err, unix.EINVAL) {
		t.Errorf("bad block size: %v, want EINVAL", err)
	}
	// Not an nbd device: the first ioctl fails on the serving thread, and
	// the errno comes back.
	if _, err := os.Stat("/dev/null"); err == nil {
		if _, err := AttachIoctl("/dev/null", sock, 1<<20, 512, FlagHasFlags, time.Second); !errors.Is(err, unix.ENOTTY) {
			t.Errorf("/dev/null: %v, want ENOTTY", err)
		}
	}
}

func TestAsyncSignals(t *testing.T) {
	set := asyncSignals()
	for _, s := range []unix.Signal{unix.SIGTERM, unix.SIGINT, unix.SIGHUP, unix.SIGURG, unix.SIGPROF, unix.SIGCHLD, unix.SIGUSR1} {
		if !sigsetHas(&set, s) {
			t.Errorf("%v not blocked", s)
		}
	}
	for _, s := range []unix.Signal{unix.SIGSEGV, unix.SIGBUS, unix.SIGFPE, unix.SIGILL, unix.SIGTRAP, unix.SIGSYS} {
		if sigsetHas(&set, s) {
			t.Errorf("synchronous %v blocked", s)
		}
	}
}

// TestIoctlDevLifecycle exercises Disconnect/Wait/Done on a device whose
// serving goroutine already ended, without a kernel.
func TestIoctlDevLifecycle(t *testing.T) {
	d := &IoctlDev{path: "/dev/nbd9", fd: -1, done: make(chan struct{}), err: unix.ETIMEDOUT}
	close(d.done)
	if err := d.Disconnect(); err != nil {
		t.Errorf("Disconnect after the end: %v", err)
	}
	if err := d.Wait(); !errors.Is(err, unix.ETIMEDOUT) {
		t.Errorf("Wait: %v", err)
	}
	select {
	case <-d.Done():
	default:
		t.Error("Done open")
	}
	if d.Path() != "/dev/nbd9" {
		t.Error(d.Path())
	}
}
