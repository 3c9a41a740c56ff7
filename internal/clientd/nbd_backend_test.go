package clientd

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestLargeBuffersBounded: the memory of its own that requests larger
// than a pool slot take is bounded per device (as much as the pool, at
// least one request of maxPayload): past it, a request waits for memory
// to come back, or for its connection to go.
func TestLargeBuffersBounded(t *testing.T) {
	r := newRig(t)
	r.file("a", 64<<20)
	d := r.start()
	defer d.Stop()
	if _, err := d.Map(context.Background(), r.mapping("s1", "a")); err != nil {
		t.Fatal(err)
	}
	m, err := d.find("rnbd0", "test")
	if err != nil {
		t.Fatal(err)
	}
	be, err := newNBDBackend(rnbdDev{m.dev}, r.cfg.NBDBuffers) // 4 slots: the bound is maxPayload
	if err != nil {
		t.Fatal(err)
	}
	defer be.close()
	first, err := be.Buffer(context.Background(), maxPayload-2<<20)
	if err != nil {
		t.Fatal(err)
	}
	second, err := be.Buffer(context.Background(), 2<<20)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 50*time.Millisecond)
	defer cancel()
	if _, err := be.Buffer(ctx, 2<<20); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a large request past the bound: %v, want it to wait", err)
	}
	// A request that fits a slot does not wait for large ones.
	small, err := be.Buffer(context.Background(), 4096)
	if err != nil {
		t.Fatal(err)
	}
	small.Release()
	got := make(chan error, 1)
	go func() {
		b, err := be.Buffer(context.Background(), 2<<20)
		if err == nil {
			b.Release()
		}
		got <- err
	}()
	second.Release()
	select {
	case err := <-got:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("a large request still waits after memory came back")
	}
	first.Release()
	if _, err := be.Buffer(context.Background(), maxPayload+4096); err == nil {
		t.Fatal("a request over maxPayload got memory")
	}
}
