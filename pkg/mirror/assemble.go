package mirror

import (
	"fmt"
	"slices"
	"strings"
)

// Layout is what the mirror is made of, as its configuration says (the
// mapping's record), not as a device claims.
type Layout struct {
	Mirror  [16]byte
	NLegs   int  // 2 or 3
	Witness bool // a metadata-only voter on a third storage node
	// Adopt, if set, is another mirror's identity that the voters may
	// carry: copies of its voters, snapshotted at one point in time, that
	// make a new mirror (a volume restored from a replicated volume's
	// snapshot). They are assembled as that mirror's after a crash, and
	// the first generation committed carries Mirror.
	Adopt [16]byte
}

// Voters is the number of voters: the legs and the witness.
func (l Layout) Voters() int {
	if l.Witness {
		return l.NLegs + 1
	}
	return l.NLegs
}

// ReadQuorum is how many voters an assembly must reach to know the last
// committed generation: every read quorum meets every write quorum
// (docs/replication.md, "Generations and quorum").
func (l Layout) ReadQuorum() int {
	if l.Voters() == 2 {
		return 2 // two legs: the write quorum is the in-sync legs alone
	}
	return l.Voters()/2 + 1
}

// WriteQuorum is how many voters must record a generation, besides
// every leg in sync in it, before a write is acknowledged under it.
func (l Layout) WriteQuorum() int {
	if l.Voters() == 2 {
		return 1
	}
	return l.Voters()/2 + 1
}

// Voter is what an assembly found of one voter.
type Voter struct {
	Index int    // 0..NLegs-1 a leg; WitnessIndex the witness
	Name  string // for messages: "leg 1 (storage-b/pvc-…)"
	// SB is its superblock; nil when the voter was not reached or holds
	// none (Err says which).
	SB  *Superblock
	Err error
	// UUID is the leg device's own id where it has no superblock yet (a
	// new device, to be rebuilt in full): set by the caller.
	UUID [16]byte
}

// Force is an operator's order to serve without the proof the mirror
// asks for (docs/replication.md, "Forcing").
type Force struct {
	By   string // who: recorded in the superblock and the log
	From int    // the leg to keep as the only source; -1: the mirror's choice
	At   int64  // Unix seconds
}

// Decision is an assembly's outcome: the generation it commits before
// the first write, and what each leg does under it.
type Decision struct {
	// Last is the newest generation among the voters reached.
	Last Gen
	// Next is the superblock to commit (Seq and Index are set per voter
	// when it is written); Next.Gen.ID is the caller's random id.
	Next Superblock
	// Source is the leg reads of the regions the bitmap marks go to
	// until they are copied to the other in-sync legs (after a crash).
	Source int
	// InSync, Resync and Outdated are the legs in each state under Next.
	// Full lists the resyncing legs to copy whole (a new device, or a
	// leg after a forced assembly chose another history).
	InSync, Resync, Outdated, Full []int
	Forced                         bool
}

// RefusedError is an assembly that does not serve: Need says what would
// let it, Reached and Missing name the voters.
type RefusedError struct {
	Reason  string
	Need    string
	Reached []string
	Missing []string
}

func (e *RefusedError) Error() string {
	var b strings.Builder
	fmt.Fprintf(&b, "mirror refused: %s; it needs %s", e.Reason, e.Need)
	if len(e.Reached) > 0 {
		fmt.Fprintf(&b, "; reached: %s", strings.Join(e.Reached, ", "))
	}
	if len(e.Missing) > 0 {
		fmt.Fprintf(&b, "; missing: %s", strings.Join(e.Missing, ", "))
	}
	return b.String()
}

// Assemble decides, from what was read of each voter, whether the mirror
// can serve with no stale read, and how (docs/replication.md, the
// assembly's four rules). force, when not nil, serves without a quorum
// or a leg in sync; it never guesses between two histories (that takes
// force.From). newID is the random id of the next generation.
func Assemble(l Layout, voters []Voter, force *Force, newID uint64) (Decision, error) {
	if l.NLegs < 2 || l.NLegs > MaxLegs {
		return Decision{}, fmt.Errorf("mirror: %d legs (2 or 3)", l.NLegs)
	}
	byIndex := map[int]*Voter{}
	for i := range voters {
		v := &voters[i]
		if v.Index != WitnessIndex && (v.Index < 0 || v.Index >= l.NLegs) || v.Index == WitnessIndex && !l.Witness {
			return Decision{}, fmt.Errorf("mirror: voter %q has index %d, not one of this mirror's", v.Name, v.Index)
		}
		if byIndex[v.Index] != nil {
			return Decision{}, fmt.Errorf("mirror: voter %d given twice", v.Index)
		}
		byIndex[v.Index] = v
	}
	var reached, missing []string
	var sbs []*Voter // voters with a superblock of this mirror
	var fresh []*Voter
	for _, i := range l.indexes() {
		v := byIndex[i]
		switch {
		case v == nil:
			missing = append(missing, voterName(i, ""))
		case v.SB != nil:
			if err := l.belongs(v); err != nil {
				return Decision{}, err
			}
			reached = append(reached, v.Name)
			sbs = append(sbs, v)
		case v.Err == ErrNoSuperblock && i != WitnessIndex && v.UUID != [16]byte{}:
			// Reached, but never part of the mirror: a new leg to
			// rebuild. It is no voter.
			fresh = append(fresh, v)
			missing = append(missing, v.Name+" (new, no superblock)")
		default:
			missing = append(missing, fmt.Sprintf("%s (%v)", v.Name, v.Err))
		}
	}
	refuse := func(reason, need string) (Decision, error) {
		return Decision{}, &RefusedError{Reason: reason, Need: need, Reached: reached, Missing: missing}
	}
	if len(sbs) == 0 {
		return refuse("no voter with a superblock of this mirror was reached", fmt.Sprintf("%d of its %d voters", l.ReadQuorum(), l.Voters()))
	}
	// G: the newest generation reached. One of its number but another
	// id (an assembly that crashed before its commit, and the next one,
	// which could not see it) is tied with it: a leg is a source only if
	// every one of them has it in sync.
	G := sbs[0].SB
	for _, v := range sbs[1:] {
		if G.Gen.Before(v.SB.Gen) {
			G = v.SB
		}
	}
	var tied []*Superblock
	for _, v := range sbs {
		if v.SB.Gen.SameNumber(G.Gen) && v.SB.Gen != G.Gen {
			tied = append(tied, v.SB)
		}
	}
	// A forced assembly's history that another went past (it was forced
	// after the fork, so it holds writes G's legs do not): the operator
	// chooses. Any other generation off G's history is one that never
	// committed, and holds nothing acknowledged.
	var diverged []string
	for _, v := range sbs {
		g := v.SB.Gen
		if g.Before(G.Gen) && G.historyCovers(g) && !G.InHistory(g) && v.SB.ForcedAt > G.ForcedAt {
			diverged = append(diverged, fmt.Sprintf("%s at generation %s, forced later", v.Name, g))
		}
	}
	if len(diverged) > 0 && (force == nil || force.From < 0) {
		return refuse(fmt.Sprintf("its legs went on separately: %s at generation %s, and %s",
			nameOfSB(sbs, G), G.Gen, strings.Join(diverged, ", ")), "an operator to choose the leg to keep (--force-from LEG); the others are rebuilt in full")
	}

	d := Decision{Last: G.Gen, Next: *G, Source: -1}
	quorum := len(sbs) >= l.ReadQuorum()
	var sources []int
	for _, v := range sbs {
		if v.Index != WitnessIndex && inSyncIn(G, v) && !slices.ContainsFunc(tied, func(t *Superblock) bool { return !inSyncIn(t, v) }) {
			sources = append(sources, v.Index)
		}
	}
	switch {
	case force != nil && force.From >= 0:
		v := byIndex[force.From]
		if force.From >= l.NLegs || v == nil || v.SB == nil {
			return refuse(fmt.Sprintf("the leg to keep, %d, was not reached", force.From), "a leg that was reached to keep")
		}
		d.Forced = true
		d.Next = *v.SB
		sources = []int{force.From}
	case !quorum && force == nil:
		return refuse(fmt.Sprintf("%d of its %d voters reached, and a lone leg cannot tell whether another went on without it", len(sbs), l.Voters()),
			fmt.Sprintf("%d of them (or an operator's --force)", l.ReadQuorum()))
	case len(sources) == 0:
		var want []string
		for i := 0; i < l.NLegs; i++ {
			if G.Legs[i].State == LegInSync {
				want = append(want, voterName(i, nameOf(byIndex[i])))
			}
		}
		return refuse(fmt.Sprintf("no leg reached is in sync at generation %s", G.Gen),
			"a leg in sync then, with writes no other leg has: "+strings.Join(want, " or ")+" (or an operator's --force-from LEG)")
	case !quorum:
		d.Forced = true
	}
	d.Source = sources[0]

	// base is the superblock the next generation follows: G's, or the
	// kept leg's when an operator chose one.
	base := d.Next
	next := &d.Next
	next.pushHistory(&base)
	next.Mirror = l.Mirror // an adopted mirror's voters take its identity
	if d.Forced {
		next.Flags |= FlagForced
		next.ForcedAt, next.ForcedBy = force.At, truncUTF8(force.By, forcedByLen)
	} else {
		next.Flags &^= FlagForced
	}
	next.Gen = Gen{Epoch: G.Gen.Epoch + 1, ID: newID}
	reachedLeg := func(i int) *Voter {
		if v := byIndex[i]; v != nil && (v.SB != nil || slices.Contains(fresh, v)) {
			return v
		}
		return nil
	}
	for i := 0; i < l.NLegs; i++ {
		e := &next.Legs[i]
		v := reachedLeg(i)
		switch {
		case slices.Contains(sources, i):
			e.State, e.Cursor = LegInSync, 0
			d.InSync = append(d.InSync, i)
		case v == nil:
			if e.State != LegOutdated {
				e.State, e.Cursor = LegOutdated, 0
			}
			d.Outdated = append(d.Outdated, i)
		case v.SB == nil || v.SB.Legs[i].UUID != e.UUID || !base.InHistory(v.SB.Gen) || force != nil && force.From >= 0:
			// A new device, another device in the slot, a leg off the
			// history kept (or too far behind it for the history to
			// say), or any when an operator chose the leg to keep: the
			// bitmaps do not say what differs, so it is copied whole.
			if v.SB == nil {
				e.UUID = v.UUID
			} else {
				e.UUID = v.SB.Legs[i].UUID
			}
			e.State, e.Cursor = LegResyncing, 0
			d.Resync = append(d.Resync, i)
			d.Full = append(d.Full, i)
		default:
			if e.State != LegResyncing {
				e.State, e.Cursor = LegResyncing, 0
			}
			d.Resync = append(d.Resync, i)
		}
	}
	if err := next.Check(); err != nil {
		return Decision{}, fmt.Errorf("mirror: the next superblock would be invalid: %w", err)
	}
	return d, nil
}

// belongs checks that a voter's superblock is of this mirror and of the
// slot the configuration puts it in.
func (l Layout) belongs(v *Voter) error {
	sb := v.SB
	switch {
	case sb.Mirror != l.Mirror && (l.Adopt == [16]byte{} || sb.Mirror != l.Adopt):
		return fmt.Errorf("mirror: %s belongs to another mirror (%x)", v.Name, sb.Mirror)
	case int(sb.NLegs) != l.NLegs:
		return fmt.Errorf("mirror: %s records %d legs, the mapping %d", v.Name, sb.NLegs, l.NLegs)
	case int(sb.Index) != v.Index:
		return fmt.Errorf("mirror: %s records itself as voter %d, the mapping has it as %d", v.Name, sb.Index, v.Index)
	case (sb.Flags&FlagWitness != 0) != l.Witness:
		return fmt.Errorf("mirror: %s disagrees with the mapping on the witness", v.Name)
	}
	return nil
}

func (l Layout) indexes() []int {
	ix := make([]int, 0, l.NLegs+1)
	for i := 0; i < l.NLegs; i++ {
		ix = append(ix, i)
	}
	if l.Witness {
		ix = append(ix, WitnessIndex)
	}
	return ix
}

// inSyncIn says whether sb has v's leg in sync, as the device v reached
// (the one whose id sb records).
func inSyncIn(sb *Superblock, v *Voter) bool {
	l := sb.Legs[v.Index]
	return l.State == LegInSync && l.UUID == v.SB.Legs[v.Index].UUID
}

func nameOfSB(vs []*Voter, sb *Superblock) string {
	for _, v := range vs {
		if v.SB == sb {
			return v.Name
		}
	}
	return "?"
}

func nameOf(v *Voter) string {
	if v == nil {
		return ""
	}
	return v.Name
}

func voterName(i int, name string) string {
	if name != "" {
		return name
	}
	if i == WitnessIndex {
		return "the witness"
	}
	return fmt.Sprintf("leg %d", i)
}

func truncUTF8(s string, n int) string {
	s = strings.ToValidUTF8(strings.ReplaceAll(s, "\x00", ""), "?")
	for len(s) > n {
		_, size := lastRune(s)
		s = s[:len(s)-size]
	}
	return s
}

func lastRune(s string) (rune, int) {
	for i := len(s) - 1; i >= 0; i-- {
		if s[i]&0xC0 != 0x80 {
			return rune(s[i]), len(s) - i
		}
	}
	return 0, len(s)
}
