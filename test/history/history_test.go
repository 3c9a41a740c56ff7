package history

import (
	"errors"
	"strings"
	"sync"
	"testing"
)

var errIO = errors.New("EIO")

// read records a whole read of b returning v.
func readOf(t *testing.T, h *History, b int64, v uint64) {
	t.Helper()
	if err := h.BeginRead(b).Done(v); err != nil {
		t.Fatal(err)
	}
}

func wantViolations(t *testing.T, h *History, want ...string) {
	t.Helper()
	bad, _ := h.Check()
	if len(bad) != len(want) {
		t.Fatalf("%d violations %v, want %d %q", len(bad), bad, len(want), want)
	}
	for i, v := range bad {
		if !strings.Contains(v.String(), want[i]) {
			t.Errorf("violation %d: %v, want %q", i, v, want[i])
		}
	}
}

func TestHistoryCorrect(t *testing.T) {
	h := New(0)
	readOf(t, h, 7, 0) // never written: its first value
	w := h.BeginWrite(7)
	r := h.BeginRead(7) // concurrent with the write: old or new
	if err := r.Done(0); err != nil {
		t.Fatal(err)
	}
	r = h.BeginRead(7)
	w.Done(nil)
	if err := r.Done(w.Value); err != nil {
		t.Fatal(err)
	}
	readOf(t, h, 7, w.Value)
	// A failed write may or may not have landed, until an acknowledged
	// one replaces it.
	f := h.BeginWrite(7)
	f.Done(errIO)
	readOf(t, h, 7, w.Value)
	readOf(t, h, 7, w.Value)
	// In flight at a crash: either.
	u := h.BeginWrite(8)
	h.Crash()
	readOf(t, h, 8, u.Value)
	bad, st := h.Check()
	if len(bad) != 0 {
		t.Fatal(bad)
	}
	if st.Writes[Acked] != 1 || st.Writes[Failed] != 1 || st.Writes[Unknown] != 1 || st.Reads != 7 || st.Blocks != 2 {
		t.Fatalf("stats %+v", st)
	}
}

func TestHistoryStale(t *testing.T) {
	h := New(0)
	w := h.BeginWrite(1)
	w.Done(nil)
	readOf(t, h, 1, 0) // the first value, after an acknowledged write
	f := h.BeginWrite(1)
	f.Done(errIO)
	w2 := h.BeginWrite(1)
	w2.Done(nil)
	readOf(t, h, 1, f.Value) // the failed write, after a later acknowledged one
	u := h.BeginWrite(1)
	h.Crash()
	w3 := h.BeginWrite(1)
	w3.Done(nil)
	readOf(t, h, 1, u.Value) // in flight at the crash, then overwritten
	wantViolations(t, h, "stale: write 1", "stale: write 3", "stale: write 5")
}

func TestHistoryFlipFlop(t *testing.T) {
	h := New(0)
	f := h.BeginWrite(2)
	f.Done(errIO)
	readOf(t, h, 2, f.Value) // it landed
	readOf(t, h, 2, 0)       // and went away again
	wantViolations(t, h, "flip-flop")

	// Two reads overlapping a write: old then new, or new then old while
	// both overlap it, are both fine.
	h = New(0)
	w := h.BeginWrite(3)
	r1 := h.BeginRead(3)
	r2 := h.BeginRead(3)
	r1.Done(w.Value)
	r2.Done(0)
	w.Done(nil)
	wantViolations(t, h)
}

func TestHistoryImpossible(t *testing.T) {
	h := New(0)
	if err := h.BeginRead(4).Done(12345); err == nil {
		t.Fatal("a value never written passed")
	}
	r := h.BeginRead(4)
	w := h.BeginWrite(4)
	r.Done(0)
	w.Done(nil)
	r = h.BeginRead(5)
	r.Done(0)
	w = h.BeginWrite(5)
	if err := h.BeginRead(4).Done(w.Value); err == nil {
		t.Fatal("block 4 read block 5's value")
	}
	wantViolations(t, h)
	defer func() {
		if recover() == nil {
			t.Fatal("a write ended twice")
		}
	}()
	w.Done(nil)
	w.Done(nil)
}

func TestHistoryConcurrent(t *testing.T) {
	h := New(0)
	var wg sync.WaitGroup
	for g := range 8 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			b := int64(g)
			last := uint64(0)
			for range 200 {
				w := h.BeginWrite(b)
				w.Done(nil)
				last = w.Value
				if err := h.BeginRead(b).Done(last); err != nil {
					t.Error(err)
				}
			}
		}()
	}
	wg.Wait()
	bad, st := h.Check()
	if len(bad) != 0 || st.Reads != 1600 || st.Writes[Acked] != 1600 {
		t.Fatalf("%v %+v", bad, st)
	}
}
