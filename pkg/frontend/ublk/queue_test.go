package ublk

import (
	"errors"
	"sync"
	"syscall"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/frontend/ublk/internal/uring"
)

// newWakeQueue is a queue with only its eventfd and ring, the eventfd READ
// armed: the completion path without a kernel device. It is cleaned up
// with the test.
func newWakeQueue(tb testing.TB, depth int) *queue {
	d := &Device{opts: Options{MaxIOBytes: 4096}}
	q := newQueue(d, 0, depth)
	var err error
	if q.efd, err = unix.Eventfd(0, unix.EFD_CLOEXEC); err != nil {
		tb.Fatal(err)
	}
	q.ring, err = uring.New(8, uring.Options{})
	if errors.Is(err, uring.ErrUnavailable) {
		unix.Close(q.efd)
		tb.Skip(err)
	}
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(q.cleanup)
	if err := q.armWake(); err != nil {
		tb.Fatal(err)
	}
	return q
}

// The completion path without a kernel device: backend goroutines call
// done, the queue goroutine is woken through its eventfd READ and finds
// every completion with the right result.
func TestCompletionWake(t *testing.T) {
	const depth = 64
	q := newWakeQueue(t, depth)
	const rounds = 20
	got := map[uint16]int32{}
	for round := 0; round < rounds; round++ {
		var wg sync.WaitGroup
		for tag := 0; tag < depth; tag++ {
			r := &q.reqs[tag]
			r.Op, r.Len = OpRead, 512*(tag+1)
			if tag%3 == 1 {
				r.Op = OpFlush
			}
			q.owned[tag].Store(true)
			wg.Add(1)
			go func(r *Request) {
				defer wg.Done()
				var err error
				if r.tag%3 == 2 {
					err = syscall.ENOSPC
				}
				q.doneFn(r, err)
			}(r)
		}
		n := 0
		for n < depth {
			if _, err := q.ring.SubmitAndWait(1); err != nil {
				t.Fatal(err)
			}
			q.ring.Reap(func(c uring.CQE) {
				if c.UserData != wakeTag || c.Res != 8 {
					t.Fatalf("unexpected cqe %+v", c)
				}
				q.wakeArmed.Store(false)
				if err := q.armWake(); err != nil {
					t.Fatal(err)
				}
			})
			q.mu.Lock()
			for _, c := range q.done {
				got[c.tag] = c.result
			}
			n += len(q.done)
			q.done = q.done[:0]
			q.mu.Unlock()
		}
		wg.Wait()
		if n != depth {
			t.Fatalf("round %d: %d completions, want %d", round, n, depth)
		}
	}
	for tag := uint16(0); tag < depth; tag++ {
		want := int32(512 * (int(tag) + 1))
		switch tag % 3 {
		case 1:
			want = 0
		case 2:
			want = -int32(syscall.ENOSPC)
		}
		if got[tag] != want {
			t.Errorf("tag %d: result %d, want %d", tag, got[tag], want)
		}
	}
	// A second done for the same request is a bug in the backend.
	func() {
		defer func() {
			if recover() == nil {
				t.Error("double completion not caught")
			}
		}()
		q.doneFn(&q.reqs[0], nil)
	}()
}

// BenchmarkCompletion is the queue's hot path without a kernel device: a
// backend goroutine completes a request, the queue goroutine is woken by
// the eventfd, collects the completion and re-arms. 0 allocs/op.
func BenchmarkCompletion(b *testing.B) {
	q := newWakeQueue(b, 1)
	r := &q.reqs[0]
	r.Op, r.Len = OpRead, 4096
	kick := make(chan struct{})
	go func() {
		for range kick {
			q.doneFn(r, nil)
		}
	}()
	defer close(kick)
	reap := func(c uring.CQE) {
		q.wakeArmed.Store(false)
		q.armWake()
	}
	b.ReportAllocs()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		q.owned[0].Store(true)
		kick <- struct{}{}
		for n := 0; n == 0; {
			if _, err := q.ring.SubmitAndWait(1); err != nil {
				b.Fatal(err)
			}
			q.ring.Reap(reap)
			q.mu.Lock()
			n = len(q.done)
			q.done = q.done[:0]
			q.mu.Unlock()
		}
	}
}
