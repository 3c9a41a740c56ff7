package mirror

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/test/history"
	"github.com/rnbd/rnbd/test/kit"
)

// TestMirrorWitnessRejoin: a witness that missed a generation while its
// storage node was down no longer votes, and the mirror would fail at
// the next leg lost (one leg and no witness are no quorum). Dialled
// again (RejoinWitness) it takes the current generation, and the mirror
// then survives losing a leg.
func TestMirrorWitnessRejoin(t *testing.T) {
	f := newFleet(t, 2, true)
	f.create()
	if err := f.open(nil); err != nil {
		t.Fatal(err)
	}
	h := history.New(0)
	write := func(blk int64) {
		t.Helper()
		if err := f.write(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	write(0)
	if !f.m.WitnessVoting() {
		t.Fatal("the witness does not vote after the assembly")
	}
	if err := f.m.RejoinWitness(context.Background(), nil, ""); err == nil {
		t.Fatal("a witness that votes rejoined")
	}
	// Leg 1 goes (committed with the witness), the witness goes, leg 1
	// comes back and resyncs: those generations miss the witness.
	wit := f.nodes[2]
	f.nodes[1].stop()
	write(1)
	wit.stop()
	kit.WaitFor(t, 5*time.Second, "the witness to stop voting", func() bool { return !f.m.WitnessVoting() })
	f.nodes[1].start()
	f.rejoin(1)
	f.waitResync()
	write(2)
	wit.start()
	// Its old session finds its node again, but it missed generations:
	// it does not vote until it has taken the current one.
	old := f.m.witness.Load()
	kit.WaitFor(t, 5*time.Second, "the witness's old session to reconnect", func() bool {
		for _, p := range old.dev.Session().Session().Paths() {
			if p.State() == rtrs.CltPathConnected {
				return true
			}
		}
		return false
	})
	if f.m.WitnessVoting() {
		t.Fatal("a witness that missed generations votes")
	}
	// The caller closes the old session, which holds the device open,
	// and dials it anew (as rnbd-client does).
	old.dev.Session().Close()
	s, d, err := wit.client(context.Background(), fmt.Sprintf("witness-%d", len(f.sess)), "w")
	if err != nil {
		t.Fatal(err)
	}
	f.sess = append(f.sess, s)
	if err := f.m.RejoinWitness(context.Background(), d, ""); err != nil {
		t.Fatal(err)
	}
	if !f.m.WitnessVoting() {
		t.Fatal("the witness does not vote after its rejoin")
	}
	// Now a leg can go: leg 1 and the witness are a write quorum.
	f.nodes[0].stop()
	write(3)
	if f.m.Failed() {
		t.Fatal("the mirror failed with a leg and the witness left")
	}
	for blk := range int64(4) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
	// The witness holds the generation: an assembly from leg 1 and it
	// alone serves.
	gen := f.m.Generation()
	f.crash()
	if err := f.open(nil); err != nil {
		t.Fatalf("an assembly from leg 1 and the witness: %v", err)
	}
	if got := f.m.Generation(); !gen.Before(got) {
		t.Fatalf("assembled at generation %s, not after %s", got, gen)
	}
	for blk := range int64(4) {
		if err := f.read(h, blk); err != nil {
			t.Fatal(err)
		}
	}
}
