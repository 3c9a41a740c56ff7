package tagpool

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

// TestLowestFirst: tags go out lowest first, whatever order they came
// back in, across words of the bitmap.
func TestLowestFirst(t *testing.T) {
	p := New(130)
	for i := 0; i < 130; i++ {
		if got := p.TryGet(); got != i {
			t.Fatalf("get %d: %d", i, got)
		}
	}
	if got := p.TryGet(); got != -1 {
		t.Fatalf("a tag beyond the pool: %d", got)
	}
	for _, i := range []int{129, 64, 3, 70} {
		p.Put(i)
	}
	for _, want := range []int{3, 64, 70, 129} {
		if got := p.TryGet(); got != want {
			t.Fatalf("got %d, want %d", got, want)
		}
	}
	var zero Pool
	if got := zero.TryGet(); got != -1 {
		t.Fatalf("the zero pool gave %d", got)
	}
}

// TestWaiters: every waiter gets a tag as they come back, none is lost
// between two waiters; a waiter leaves at its context's end or at stop.
func TestWaiters(t *testing.T) {
	p := New(4)
	for range 4 {
		p.TryGet()
	}
	const n = 16
	got := make(chan int, n)
	var wg sync.WaitGroup
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			tag, err := p.Get(context.Background(), nil)
			if err != nil {
				t.Error(err)
				return
			}
			got <- tag
		}()
	}
	// One tag back at a time: each must reach a waiter (who keeps it).
	for i := 0; i < n; i++ {
		p.Put(i % 4)
		if tag := <-got; tag != i%4 {
			t.Fatalf("waiter %d got tag %d, want %d", i, tag, i%4)
		}
	}
	wg.Wait()
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Millisecond)
	defer cancel()
	if _, err := p.Get(ctx, nil); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("a waiter past its deadline: %v", err)
	}
	stop := make(chan struct{})
	close(stop)
	if _, err := p.Get(context.Background(), stop); !errors.Is(err, ErrStopped) {
		t.Fatalf("a waiter stopped: %v", err)
	}
	p.mu.Lock()
	waiters := p.waiters
	p.mu.Unlock()
	if waiters != 0 {
		t.Fatalf("%d waiters left", waiters)
	}
}

// TestManyWaitersManyPuts: tags put back together reach as many waiters.
func TestManyWaitersManyPuts(t *testing.T) {
	p := New(8)
	for range 8 {
		p.TryGet()
	}
	got := make(chan int, 8)
	for range 8 {
		go func() {
			tag, err := p.Get(context.Background(), nil)
			if err == nil {
				got <- tag
			}
		}()
	}
	for i := range 8 {
		p.Put(i)
	}
	seen := map[int]bool{}
	for range 8 {
		select {
		case tag := <-got:
			seen[tag] = true
		case <-time.After(10 * time.Second):
			t.Fatalf("a waiter was not woken: %d of 8 served", len(seen))
		}
	}
	if len(seen) != 8 {
		t.Fatalf("tags served %v", seen)
	}
}

// TestNoBarging: while a waiter waits, a tag that comes back is its
// own, not the next TryGet's or Get's.
func TestNoBarging(t *testing.T) {
	p := New(1)
	p.TryGet()
	got := make(chan int, 1)
	go func() {
		tag, _ := p.Get(context.Background(), nil)
		got <- tag
	}()
	for {
		p.mu.Lock()
		w := p.waiters
		p.mu.Unlock()
		if w == 1 {
			break
		}
		time.Sleep(time.Millisecond)
	}
	p.Put(0)
	if tag := p.TryGet(); tag != -1 {
		t.Fatalf("TryGet took tag %d from a waiter", tag)
	}
	if tag := <-got; tag != 0 {
		t.Fatalf("the waiter got %d", tag)
	}
}
