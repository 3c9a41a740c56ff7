package rnbd

import (
	"bytes"
	"errors"
	"os"
	"syscall"
	"testing"
	"time"
)

// parkedOn is how many requests the hold of export name keeps now.
func (s *Server) parkedOn(name string) int {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, h := range s.holds {
		if h.name == name {
			h.mu.Lock()
			defer h.mu.Unlock()
			return len(h.parked)
		}
	}
	return -1
}

// waitParked waits until export name's hold keeps n requests.
func (r *srig) waitParked(name string, n int) {
	r.t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for r.srv.parkedOn(name) != n {
		if time.Now().After(deadline) {
			r.t.Fatalf("hold of %s keeps %d request(s), want %d", name, r.srv.parkedOn(name), n)
		}
		time.Sleep(time.Millisecond)
	}
}

// another is x with a buffer of its own, for IO beside x's.
func (x *dio) another() *dio {
	x.t.Helper()
	buf, err := x.d.Session().Session().AllocBuffer(1 << 20)
	if err != nil {
		x.t.Fatal(err)
	}
	return &dio{t: x.t, d: x.d, buf: buf}
}

func fill(b byte, n int) []byte { return bytes.Repeat([]byte{b}, n) }

// TestHold: a hold keeps every write of the export's backing store from
// it — a write, a write-zeroes — until its release, and lets reads and
// flushes by; the held writes run then, in order. Its time up, it lets
// them run by itself, and its release says so.
func TestHold(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.vol(1 << 20)
	x := r.dev(r.client("s"), "vol", AccessRW)
	if err := x.write(0, fill('a', 4096), 0); err != nil {
		t.Fatal(err)
	}
	token, err := r.srv.Hold("vol", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.srv.Hold("vol", time.Second); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("a second hold: %v, want EBUSY", err)
	}
	w := x.another()
	wrote := make(chan error, 2)
	go func() {
		wrote <- w.write(0, fill('b', 4096), 0)
		wrote <- w.op(OpWriteZeroes, 0, 0, 4096)
	}()
	r.waitParked("vol", 1)
	// Held: not on the file, and reads and flushes go on.
	if b, _ := os.ReadFile(path); !bytes.Equal(b[:4096], fill('a', 4096)) {
		t.Fatal("a held write reached the file")
	}
	if b, err := x.read(0, 4096); err != nil || !bytes.Equal(b, fill('a', 4096)) {
		t.Fatalf("read during the hold: %v (%q…)", err, b[:1])
	}
	if err := x.op(OpFlush, 0, 0, 0); err != nil {
		t.Fatalf("flush during the hold: %v", err)
	}
	select {
	case err := <-wrote:
		t.Fatalf("a held write was answered: %v", err)
	default:
	}
	if _, err := r.srv.Release("vol", token+1); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("release of another token: %v, want ENOENT", err)
	}
	if held, err := r.srv.Release("vol", token); err != nil || !held {
		t.Fatalf("release: held %v, %v; want true", held, err)
	}
	for range 2 {
		if err := <-wrote; err != nil {
			t.Fatalf("a held write, after the release: %v", err)
		}
	}
	if b, _ := os.ReadFile(path); !bytes.Equal(b[:4096], make([]byte, 4096)) {
		t.Fatal("the held write and write-zeroes did not run, in order, after the release")
	}

	// Its time up, the hold lets the write go by itself.
	token, err = r.srv.Hold("vol", 50*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	if err := w.write(0, fill('c', 4096), 0); err != nil {
		t.Fatalf("a write past the hold's time: %v", err)
	}
	if held, err := r.srv.Release("vol", token); err != nil || held {
		t.Fatalf("release after its time: held %v, %v; want false", held, err)
	}
	if _, err := r.srv.Release("vol", token); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("a second release: %v, want ENOENT", err)
	}
}

// TestHoldRefusals: what a hold is refused.
func TestHoldRefusals(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.vol(1 << 20)
	for _, c := range []struct {
		name string
		max  time.Duration
		want syscall.Errno
	}{
		{"vol", 0, syscall.EINVAL},
		{"vol", MaxHold + time.Second, syscall.EINVAL},
		{"nosuch", time.Second, syscall.ENOENT},
	} {
		if _, err := r.srv.Hold(c.name, c.max); !errors.Is(err, c.want) {
			t.Errorf("hold %s for %v: %v, want %v", c.name, c.max, err, c.want)
		}
	}
}

// TestHoldOpenedLater: a device opened while its backing store is held
// is held too, and a second export of the same file is the same hold.
func TestHoldOpenedLater(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.vol(1 << 20)
	if err := r.srv.Map(Export{Name: "alias", Path: path}); err != nil {
		t.Fatal(err)
	}
	token, err := r.srv.Hold("vol", 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.srv.Hold("alias", time.Second); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("a hold of the same file by another export: %v, want EBUSY", err)
	}
	x := r.dev(r.client("s"), "alias", AccessRW)
	wrote := make(chan error, 1)
	go func() { wrote <- x.write(4096, fill('d', 4096), FFUA) }()
	r.waitParked("vol", 1)
	if held, err := r.srv.Release("vol", token); err != nil || !held {
		t.Fatalf("release: held %v, %v", held, err)
	}
	if err := <-wrote; err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(path); !bytes.Equal(b[4096:8192], fill('d', 4096)) {
		t.Fatal("the write held did not land after the release")
	}
}

// TestEndHolds: a stopping server (EndHolds, before its RTRS server
// closes, which waits for every answer) lets the writes held run at
// once and takes no new hold.
func TestEndHolds(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.vol(1 << 20)
	x := r.dev(r.client("s"), "vol", AccessRW)
	if _, err := r.srv.Hold("vol", MaxHold); err != nil {
		t.Fatal(err)
	}
	wrote := make(chan error, 1)
	go func() { wrote <- x.write(0, fill('e', 4096), 0) }()
	r.waitParked("vol", 1)
	r.srv.EndHolds()
	if err := <-wrote; err != nil {
		t.Fatalf("a write held when the server stopped: %v", err)
	}
	if b, _ := os.ReadFile(path); !bytes.Equal(b[:4096], fill('e', 4096)) {
		t.Fatal("the write held did not land when the holds ended")
	}
	if _, err := r.srv.Hold("vol", time.Second); !errors.Is(err, syscall.ESHUTDOWN) {
		t.Fatalf("a hold after EndHolds: %v, want ESHUTDOWN", err)
	}
}
