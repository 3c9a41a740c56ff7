package csi

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
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

// TestCallOnJudgesByTheCall: a call whose wait for a turn left it less
// than half the deadline fails unavailable, saying so, but does not mark
// the node down (a burst on a busy node is not a node that does not
// answer); one that had the whole deadline and got no answer does.
func TestCallOnJudgesByTheCall(t *testing.T) {
	const timeout = time.Second
	n := newStorageNode(&StorageNode{Name: "node-a"}, nil, ControllerConfig{StorageTimeout: conf.Duration{Duration: timeout}, MaxCallsPerNode: 1, MaxQueuedPerNode: 1},
		newRPCMetrics(), nil)
	slow := func(d time.Duration) func(ctx context.Context) (bool, error) {
		return func(ctx context.Context) (bool, error) {
			select {
			case <-time.After(d):
				return true, nil
			case <-ctx.Done():
				return false, ctx.Err()
			}
		}
	}
	ctx := context.Background()
	first := make(chan error, 1)
	go func() { _, err := callOn(ctx, n, "a first call", slow(700*time.Millisecond)); first <- err }()
	deadline := time.Now().Add(5 * time.Second)
	for len(n.queue.slots) == 0 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	// Waits about 700 ms for its turn, then has about 300 ms of its own.
	_, err := callOn(ctx, n, "a second call", slow(700*time.Millisecond))
	if ctl.Classify(err) != ctl.CodeUnavailable || !strings.Contains(err.Error(), "of it waiting for a turn") {
		t.Fatalf("the call its wait left short: %v, want unavailable, saying it waited", err)
	}
	if err := <-first; err != nil {
		t.Fatalf("the first call: %v", err)
	}
	if !n.up.Load() {
		t.Fatal("a call its own wait left short marked the node down")
	}
	if _, err := callOn(ctx, n, "a call with the whole deadline", slow(3*time.Second)); ctl.Classify(err) != ctl.CodeUnavailable {
		t.Fatalf("a call not answered: %v", err)
	}
	if n.up.Load() {
		t.Fatal("a call not answered in the whole deadline left the node up")
	}
}
