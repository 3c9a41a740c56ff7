package mirror

import (
	"cmp"
	"context"
	"errors"
	"fmt"

	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// A witness that failed while the mirror serves (fenced, its session
// without a path, or it did not take a generation) no longer votes:
// commits go on without it, not waiting for it, as long as they reach a
// write quorum, but the mirror can then lose no leg (with two legs, the
// lone leg and no witness are no quorum). So it is dialled again, as a
// leg out is, and takes the current generation (RejoinWitness).

// WitnessVoting says whether the mirror has a witness that takes its
// generations: false for a mirror without one, and for one whose
// witness was not reached, was fenced, has no connected path, missed a
// commit or had its device reopened.
func (m *Mirror) WitnessVoting() bool {
	w := m.witness.Load()
	return w != nil && w.votes()
}

// votes says whether the witness's voter w takes generations: not
// fenced, no generation missed, and a path of its session connected.
func (w *voter) votes() bool {
	if w.fenced.Load() || w.lost.Load() {
		return false
	}
	for _, p := range w.dev.Session().Session().Paths() {
		if p.State() == rtrs.CltPathConnected {
			return true
		}
	}
	return false
}

// RejoinWitness takes the witness back through dev (its storage node
// reached again, through a new session; the caller owns it, and the
// old witness's session, which it may close once this returns): the
// current generation is written to it, and it votes from then on. A
// device without a superblock is a new witness. One that records a
// generation this mirror never had is refused: it went on without it.
// name, if not empty, is what logs call the witness from here.
func (m *Mirror) RejoinWitness(ctx context.Context, dev *rnbd.CltDev, name string) error {
	if !m.cfg.Layout.Witness {
		return errors.New("mirror: it has no witness")
	}
	if m.failed.Load() {
		return errFailed
	}
	if m.WitnessVoting() {
		return errors.New("mirror: the witness votes: nothing to rejoin")
	}
	if dev.Size() < WitnessEnd {
		return fmt.Errorf("mirror: %s: a device of %d bytes; a witness needs %d", cmp.Or(name, m.name(WitnessIndex)), dev.Size(), WitnessEnd)
	}
	v, err := newVoter(WitnessIndex, cmp.Or(name, m.name(WitnessIndex)), dev)
	if err != nil {
		return err
	}
	m.metaMu.Lock()
	defer m.metaMu.Unlock()
	if err := m.witnessTakesLocked(ctx, v); err != nil {
		v.buf.Free()
		return err
	}
	if old := m.witness.Swap(v); old != nil && old.buf != nil {
		old.buf.Free()
	}
	m.watchReopen(v)
	m.log.WithField("voter", v.name).Info("mirror: the witness is back and votes")
	return nil
}

// witnessTakesLocked checks that v is this mirror's witness and writes
// the current generation to it.
//
// +checklocks:m.metaMu
func (m *Mirror) witnessTakesLocked(ctx context.Context, v *voter) error {
	sb, err := v.read(ctx)
	switch {
	case errors.Is(err, ErrNoSuperblock):
		// A new witness (its storage node replaced): it takes the
		// generation and the slots from here.
	case err != nil:
		return fmt.Errorf("mirror: %s: %w", v.name, err)
	default:
		if err := m.cfg.Layout.belongs(&Voter{Index: WitnessIndex, Name: v.name, SB: sb}); err != nil {
			return err
		}
		if sb.Gen != m.sb.Gen && !m.sb.InHistory(sb.Gen) {
			return &RefusedError{Reason: fmt.Sprintf("%s records generation %s, which this mirror never had", v.name, sb.Gen),
				Need: "an operator to choose: unmap, then map again (the assembly decides over every voter)"}
		}
	}
	return v.write(ctx, &m.sb)
}
