package rtrs

import (
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Batching on the client: a Plug holds the requests a goroutine posts in
// a burst until Unplug, and a Burst tells a BurstConfirmer which
// completions came from one read, so what they leave to do goes out once
// at its end. Why, how the layers above carry them, and what it gains:
// docs/rtrs.md, "Batching" (the one place that says it).

// Plug holds the requests one goroutine sends in a burst until it calls
// Unplug (blk_start_plug / blk_finish_plug; docs/rtrs.md, "Batching").
// Its owner must Unplug before it waits for anything, the completion of
// its own requests included (a permit, request memory, more requests to
// read). A Plug is not safe for concurrent use; the zero value is ready.
type Plug struct {
	held []fabric.Flusher // connections holding this plug's requests
}

// Unplug sends the requests held.
func (pl *Plug) Unplug() {
	for i, f := range pl.held {
		f.Flush()
		pl.held[i] = nil
	}
	pl.held = pl.held[:0]
}

// hold marks wr as held in pl if con can hold it.
func (pl *Plug) hold(con fabric.Conn, wr *fabric.SendWR) {
	f, ok := con.(fabric.Flusher)
	if !ok {
		return
	}
	wr.More = true
	for _, h := range pl.held {
		if h == f {
			return
		}
	}
	pl.held = append(pl.held, f)
}

// BurstConfirmer is a Confirmer that is also told the burst its
// completion belongs to, so that it may defer work to the burst's end
// (docs/rtrs.md, "Batching"). b is nil outside a burst.
type BurstConfirmer interface {
	Confirmer
	ConfirmBurst(err error, b *Burst)
}

// Burst is the run of completions a connection delivers from what it read
// at once (fabric.BurstHandler). What they defer is flushed once at its
// end, before the connection waits for more (docs/rtrs.md, "Batching").
// It is used only by the connection's completion goroutine.
type Burst struct {
	deferred []interface{ Flush() }
}

// Defer has f flushed at the end of the burst, once however often it is
// deferred.
func (b *Burst) Defer(f interface{ Flush() }) {
	for _, d := range b.deferred {
		if d == f {
			return
		}
	}
	b.deferred = append(b.deferred, f)
}

// end flushes what was deferred.
func (b *Burst) end() {
	for i, f := range b.deferred {
		f.Flush()
		b.deferred[i] = nil
	}
	b.deferred = b.deferred[:0]
}
