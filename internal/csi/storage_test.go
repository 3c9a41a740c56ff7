package csi

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/ctl"
)

// TestCallQueue: at most its calls at once, at most its waiting more;
// one past both is refused unavailable at once; a waiting one gives up
// with its context, unavailable; a released turn goes to the next.
func TestCallQueue(t *testing.T) {
	q := newCallQueue(1, 1)
	release, err := q.acquire(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	got := make(chan error, 1)
	go func() {
		r, err := q.acquire(context.Background())
		if err == nil {
			r()
		}
		got <- err
	}()
	deadline := time.Now().Add(5 * time.Second)
	for q.waiting.Load() != 1 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if _, err := q.acquire(context.Background()); ctl.Classify(err) != ctl.CodeUnavailable {
		t.Fatalf("a call past the turns and the waiting: %v, want unavailable at once", err)
	}
	release()
	if err := <-got; err != nil {
		t.Fatalf("the waiting call after a release: %v", err)
	}
	release, _ = q.acquire(context.Background())
	defer release()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := q.acquire(ctx); ctl.Classify(err) != ctl.CodeUnavailable || !errors.Is(ctx.Err(), context.DeadlineExceeded) {
		t.Fatalf("a call whose deadline passes while it waits: %v", err)
	}
	if q.waiting.Load() != 0 {
		t.Fatalf("%d still counted waiting", q.waiting.Load())
	}
}
