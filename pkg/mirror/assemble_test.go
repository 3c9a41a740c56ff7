package mirror

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

// voters makes an assembly's input: sbs[i] is what voter i holds (nil:
// not reached), in index order, the witness last when the layout has one.
func voters(l Layout, sbs ...*Superblock) []Voter {
	var vs []Voter
	for j, sb := range sbs {
		i := j
		if j == l.NLegs {
			i = WitnessIndex
		}
		v := Voter{Index: i, Name: voterName(i, "")}
		if sb == nil {
			v.Err = errors.New("no path")
		} else {
			sb := *sb
			sb.Index = uint8(i)
			if l.Witness {
				sb.Flags |= FlagWitness
			}
			v.SB = &sb
		}
		vs = append(vs, v)
	}
	return vs
}

func TestAssemble(t *testing.T) {
	two := Layout{Mirror: testMirror, NLegs: 2}
	twoW := Layout{Mirror: testMirror, NLegs: 2, Witness: true}
	three := Layout{Mirror: testMirror, NLegs: 3}
	in, out, rs := LegInSync, LegOutdated, LegResyncing
	// Two histories from epoch 7: A went on at 8 and 9, B was forced
	// alone at 8 after A's fork, so it holds writes A does not.
	hA, hB := sbOf(0, 9, in, out), sbOf(0, 8, out, in)
	hB.Gen.ID, hB.ForcedAt, hB.Flags = 8888, 1796200000, FlagForced
	// B at an 8 that never committed (no force): nothing acknowledged
	// is on it, so A's 9 stands and B is copied whole.
	uB := sbOf(0, 8, out, in)
	uB.Gen.ID = 8888
	// An assembly's 8 that crashed before its commit (A's), and the next
	// assembly's 8, which could not see it (B's): tied.
	tA, tB := sbOf(0, 8, in, in), sbOf(0, 8, out, in)
	tB.Gen.ID = 8888
	// The running mirror took leg 1 out: epoch 7, seq 1.
	s71 := sbOf(0, 7, in, in).Derive(7100)
	s71.Legs[1].State = out
	for _, c := range []struct {
		name   string
		l      Layout
		sbs    []*Superblock
		force  *Force
		refuse string // the refusal's text, or "" to serve
		inSync []int
		resync []int
		full   []int
	}{
		{name: "both legs, in sync", l: two, sbs: []*Superblock{sbOf(0, 7, in, in), sbOf(1, 7, in, in)}, inSync: []int{0, 1}},
		{name: "one leg of two: a lone leg cannot tell", l: two, sbs: []*Superblock{sbOf(0, 7, in, in), nil},
			refuse: "1 of its 2 voters reached"},
		{name: "one leg of two, forced", l: two, sbs: []*Superblock{sbOf(0, 7, in, in), nil}, force: &Force{By: "ops", From: -1}, inSync: []int{0}},
		{name: "one outdated leg of two, forced without naming it", l: two, sbs: []*Superblock{nil, sbOf(1, 8, in, out)}, force: &Force{By: "ops", From: -1},
			refuse: "no leg reached is in sync"},
		{name: "one outdated leg of two, forced by name", l: two, sbs: []*Superblock{nil, sbOf(1, 8, in, out)}, force: &Force{By: "ops", From: 1}, inSync: []int{1}},
		{name: "the leg that went on, and the one it left", l: two, sbs: []*Superblock{&s71, sbOf(1, 7, in, in)}, inSync: []int{0}, resync: []int{1}},
		{name: "a commit that reached one leg only", l: two, sbs: []*Superblock{sbOf(0, 7, in, in), sbOf(1, 8, in, in)}, inSync: []int{0, 1}},
		{name: "leg and witness: current", l: twoW, sbs: []*Superblock{sbOf(0, 8, in, out), nil, sbOf(0, 8, in, out)}, inSync: []int{0}},
		{name: "leg and witness: the witness knows the leg is stale", l: twoW, sbs: []*Superblock{sbOf(0, 7, in, in), nil, sbOf(0, 8, out, in)},
			refuse: "no leg reached is in sync at generation 8"},
		{name: "witness alone", l: twoW, sbs: []*Superblock{nil, nil, sbOf(0, 8, out, in)}, refuse: "1 of its 3 voters"},
		{name: "three legs, two reached, one outdated", l: three, sbs: []*Superblock{nil, sbOf(1, 9, out, in, out), sbOf(2, 9, out, in, out)},
			inSync: []int{1}, resync: []int{2}},
		{name: "three legs, one reached", l: three, sbs: []*Superblock{sbOf(0, 5, in, in, in), nil, nil}, refuse: "1 of its 3 voters"},
		{name: "a resyncing leg keeps its cursor", l: two, sbs: []*Superblock{sbOf(0, 5, in, rs), sbOf(1, 5, in, rs)}, inSync: []int{0}, resync: []int{1}},
		{name: "two histories", l: two, sbs: []*Superblock{hA, hB}, refuse: "went on separately"},
		{name: "two histories, forced but not chosen", l: two, sbs: []*Superblock{hA, hB}, force: &Force{By: "ops", From: -1}, refuse: "went on separately"},
		{name: "two histories, B kept", l: two, sbs: []*Superblock{hA, hB}, force: &Force{By: "ops", From: 1}, inSync: []int{1}, resync: []int{0}, full: []int{0}},
		{name: "a generation that never committed", l: two, sbs: []*Superblock{hA, uB}, inSync: []int{0}, resync: []int{1}, full: []int{1}},
		{name: "two assemblies of one epoch", l: two, sbs: []*Superblock{tA, tB}, inSync: []int{1}, resync: []int{0}},
		{name: "two assemblies of one epoch, the other leg missing", l: twoW, sbs: []*Superblock{tA, nil, tA}, inSync: []int{0}, resync: nil},
		{name: "forced from an unreached leg", l: two, sbs: []*Superblock{sbOf(0, 7, in, in), nil}, force: &Force{By: "ops", From: 1}, refuse: "was not reached"},
	} {
		t.Run(c.name, func(t *testing.T) {
			d, err := Assemble(c.l, voters(c.l, c.sbs...), c.force, 0xabc)
			if c.refuse != "" {
				var re *RefusedError
				if !errors.As(err, &re) || !strings.Contains(err.Error(), c.refuse) {
					t.Fatalf("got %v (%+v), want a refusal with %q", err, d, c.refuse)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(d.InSync, c.inSync) || !slices.Equal(d.Resync, c.resync) || !slices.Equal(d.Full, c.full) {
				t.Fatalf("in sync %v resync %v full %v, want %v %v %v", d.InSync, d.Resync, d.Full, c.inSync, c.resync, c.full)
			}
			if d.Next.Gen.Epoch != d.Last.Epoch+1 || d.Next.Gen.Seq != 0 || d.Next.Gen.ID != 0xabc || d.Next.History[0] == (Gen{}) {
				t.Fatalf("next generation %v history %v after %v", d.Next.Gen, d.Next.History[:2], d.Last)
			}
			if (c.force != nil) != d.Forced || d.Forced != (d.Next.Flags&FlagForced != 0) || d.Forced && d.Next.ForcedBy != "ops" {
				t.Fatalf("forced %v, flags %#x by %q", d.Forced, d.Next.Flags, d.Next.ForcedBy)
			}
			if err := d.Next.Check(); err != nil {
				t.Fatal(err)
			}
		})
	}
}

func TestAssembleRefusalNames(t *testing.T) {
	l := Layout{Mirror: testMirror, NLegs: 2, Witness: true}
	vs := voters(l, sbOf(0, 7, LegInSync, LegInSync), nil, nil)
	vs[0].Name, vs[1].Name, vs[2].Name = "leg 0 (storage-a/vol)", "leg 1 (storage-b/vol)", "the witness (storage-c/w)"
	_, err := Assemble(l, vs, nil, 1)
	want := "mirror refused: 1 of its 3 voters reached, and a lone leg cannot tell whether another went on without it; it needs 2 of them (or an operator's --force); reached: leg 0 (storage-a/vol); missing: leg 1 (storage-b/vol) (no path), the witness (storage-c/w) (no path)"
	if err == nil || err.Error() != want {
		t.Fatalf("got\n%v\nwant\n%s", err, want)
	}
}

func TestAssembleRefusesOthers(t *testing.T) {
	l := Layout{Mirror: testMirror, NLegs: 2}
	other := sbOf(1, 7, LegInSync, LegInSync)
	other.Mirror[0] ^= 1
	for _, c := range []struct {
		name string
		vs   []Voter
		want string
	}{
		{"another mirror's leg", voters(l, sbOf(0, 7, LegInSync, LegInSync), other), "another mirror"},
		{"a leg in the wrong slot", func() []Voter {
			vs := voters(l, sbOf(0, 7, LegInSync, LegInSync), sbOf(1, 7, LegInSync, LegInSync))
			vs[1].SB.Index = 0
			return vs
		}(), "records itself as voter 0"},
		{"a witness the mapping has not", voters(l, sbOf(0, 7, LegInSync, LegInSync), sbOf(1, 7, LegInSync, LegInSync), sbOf(0, 7, LegInSync, LegInSync)), "not one of this mirror's"},
		{"three legs for two", voters(l, sbOf(0, 7, LegInSync, LegInSync, LegInSync), sbOf(1, 7, LegInSync, LegInSync, LegInSync)), "records 3 legs"},
	} {
		if _, err := Assemble(l, c.vs, nil, 1); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: %v, want %q", c.name, err, c.want)
		}
	}
}

// TestAssembleAdopt: voters of another mirror (copies of its members,
// one point in time) assemble under Layout.Adopt as that mirror's would,
// and the next generation carries the new identity; without Adopt, or
// of a third mirror, they are refused.
func TestAssembleAdopt(t *testing.T) {
	src := testMirror
	src[0] ^= 0x55
	w := func(sb *Superblock) *Superblock { sb.Flags |= FlagWitness; return sb }
	old := func(sb *Superblock) *Superblock { sb.Mirror = src; return w(sb) }
	l := Layout{Mirror: testMirror, NLegs: 2, Witness: true, Adopt: src}
	vs := voters(l, old(sbOf(0, 7, LegInSync, LegInSync)), old(sbOf(1, 7, LegInSync, LegInSync)), old(sbOf(WitnessIndex, 7, LegInSync, LegInSync)))
	d, err := Assemble(l, vs, nil, 99)
	if err != nil {
		t.Fatal(err)
	}
	if d.Next.Mirror != testMirror || d.Next.Gen.Epoch != 8 || d.Source < 0 {
		t.Fatalf("adopted: next %x at %v, source %d; want the new identity at epoch 8", d.Next.Mirror, d.Next.Gen, d.Source)
	}
	// A leg that took the new identity beside one that did not (it
	// was away at the adoption): one mirror.
	vs = voters(l, w(sbOf(0, 8, LegInSync, LegOutdated)), old(sbOf(1, 7, LegInSync, LegInSync)), w(sbOf(WitnessIndex, 8, LegInSync, LegOutdated)))
	if _, err := Assemble(l, vs, nil, 100); err != nil {
		t.Fatalf("adopted, one leg away at the adoption: %v", err)
	}
	l.Adopt = [16]byte{}
	vs = voters(l, old(sbOf(0, 7, LegInSync, LegInSync)), old(sbOf(1, 7, LegInSync, LegInSync)), old(sbOf(WitnessIndex, 7, LegInSync, LegInSync)))
	if _, err := Assemble(l, vs, nil, 99); err == nil || !strings.Contains(err.Error(), "another mirror") {
		t.Fatalf("another mirror's voters without Adopt: %v", err)
	}
	l.Adopt = src
	l.Adopt[1] ^= 1
	if _, err := Assemble(l, vs, nil, 99); err == nil || !strings.Contains(err.Error(), "another mirror") {
		t.Fatalf("a third mirror's voters: %v", err)
	}
}

func TestAssembleNewLeg(t *testing.T) {
	l := Layout{Mirror: testMirror, NLegs: 2, Witness: true}
	vs := voters(l, sbOf(0, 8, LegInSync, LegOutdated), nil, sbOf(0, 8, LegInSync, LegOutdated))
	newUUID := [16]byte{0x99}
	vs[1] = Voter{Index: 1, Name: "leg 1 (storage-d/vol)", Err: ErrNoSuperblock, UUID: newUUID}
	d, err := Assemble(l, vs, nil, 1)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(d.Full, []int{1}) || d.Next.Legs[1].UUID != newUUID || d.Next.Legs[1].State != LegResyncing {
		t.Fatalf("new leg: %+v", d)
	}
	// Without the caller saying it is a new leg, a device with no
	// superblock is not written over.
	vs[1].UUID = [16]byte{}
	if d, err = Assemble(l, vs, nil, 1); err != nil || len(d.Resync) != 0 || !slices.Equal(d.Outdated, []int{1}) {
		t.Fatalf("unmarked device: %v %+v", err, d)
	}
}

// TestAssembleNoStaleSource runs a model of a mirror through random
// failures — voters unreachable, legs taken out, commits cut short by a
// crash, resyncs, assemblies from whatever is reachable — and checks
// the promise at the metadata level: an assembly that serves reads only
// from legs that hold every acknowledged write. Seeded; the seed of a
// failing schedule is printed.
func TestAssembleNoStaleSource(t *testing.T) {
	schedules := 3000
	if testing.Short() {
		schedules = 300
	}
	served, refused := 0, 0
	for seed := uint64(1); seed <= uint64(schedules); seed++ {
		s, r := runModel(t, seed)
		served += s
		refused += r
	}
	t.Logf("%d schedules: %d assemblies served, %d refused", schedules, served, refused)
	if served == 0 || refused == 0 {
		t.Fatal("the schedules never served or never refused: the model tests nothing")
	}
}

func runModel(t *testing.T, seed uint64) (served, refused int) {
	rng := rand.New(rand.NewPCG(seed, 0x6d6972726f72))
	layouts := []Layout{{NLegs: 2}, {NLegs: 2, Witness: true}, {NLegs: 3}, {NLegs: 3, Witness: true}}
	l := layouts[rng.IntN(len(layouts))]
	l.Mirror = testMirror
	ix := l.indexes()
	stored := map[int]*Superblock{} // what each voter has durably
	has := map[int]int{}            // the writes each leg holds (a count of the acknowledged ones)
	acked := 0
	var cur *Superblock // the running client's committed generation; nil: not assembled
	up := map[int]bool{}
	var log []string
	fail := func(f string, a ...any) {
		t.Helper()
		t.Fatalf("seed %d (%+v): "+f+"\nhistory:\n%s", append([]any{seed, l}, append(a, strings.Join(log, "\n"))...)...)
	}
	sb0 := sbOf(0, 1, LegInSync, LegInSync, LegInSync)
	sb0.NLegs = uint8(l.NLegs)
	if l.NLegs == 2 {
		sb0.Legs[2] = Leg{}
	}
	if l.Witness {
		sb0.Flags |= FlagWitness
	}
	nextID := uint64(1000)
	// commit writes sb to the reachable voters, or to a random part of
	// them when the client crashes in the middle; it says whether sb is
	// committed (a write quorum with every in-sync leg).
	commit := func(sb Superblock, crash bool) bool {
		n := 0
		inSyncOK := true
		for _, i := range ix {
			if !up[i] || crash && rng.IntN(2) == 0 {
				if i != WitnessIndex && sb.Legs[i].State == LegInSync {
					inSyncOK = false
				}
				continue
			}
			c := sb
			c.Index = uint8(i)
			stored[i] = &c
			n++
		}
		return !crash && inSyncOK && n >= l.WriteQuorum()
	}
	for _, i := range ix {
		up[i] = true
	}
	commit(*sb0, false)
	cur = sb0
	for step := 0; step < 60; step++ {
		switch k := rng.IntN(10); {
		case k < 3: // a voter goes away or comes back
			i := ix[rng.IntN(len(ix))]
			up[i] = !up[i]
			log = append(log, "voter "+voterName(i, "")+map[bool]string{true: " up", false: " down"}[up[i]])
		case k < 6 && cur != nil: // a write
			next := cur.Derive(nextID)
			nextID++
			changed := false
			for i := 0; i < l.NLegs; i++ {
				if !up[i] && next.Legs[i].State != LegOutdated {
					next.Legs[i].State, next.Legs[i].Cursor = LegOutdated, 0
					changed = true
				}
			}
			if changed {
				if next.Check() != nil { // no leg left
					log = append(log, "write: no leg left, the client stops")
					cur = nil
					continue
				}
				crash := rng.IntN(4) == 0
				if !commit(next, crash) {
					log = append(log, "write: the commit of "+next.Gen.String()+" did not reach a quorum; the client stops")
					cur = nil
					continue
				}
				cur = &next
			}
			acked++
			for i := 0; i < l.NLegs; i++ {
				if cur.Legs[i].State == LegInSync {
					has[i] = acked
				}
			}
			log = append(log, fmt.Sprintf("write %d acknowledged at %v", acked, cur.Gen))
		case k < 7 && cur != nil: // a resync ends
			for i := 0; i < l.NLegs; i++ {
				if cur.Legs[i].State == LegResyncing && up[i] {
					next := cur.Derive(nextID)
					nextID++
					next.Legs[i].State, next.Legs[i].Cursor = LegInSync, 0
					// The copy is done before its generation is
					// written: the leg holds every write by then
					// (those made during the copy went to it too).
					has[i] = acked
					if commit(next, rng.IntN(4) == 0) {
						cur = &next
						log = append(log, "leg "+voterName(i, "")+" in sync at "+next.Gen.String())
					} else {
						cur = nil
						log = append(log, "resync of "+voterName(i, "")+": the commit failed; the client stops")
					}
					break
				}
			}
		case k < 8: // the client crashes
			cur = nil
			log = append(log, "client crash")
		default: // an assembly from what is reachable
			if cur != nil {
				continue
			}
			var vs []Voter
			for _, i := range ix {
				v := Voter{Index: i, Name: voterName(i, "")}
				if up[i] && stored[i] != nil {
					c := *stored[i]
					v.SB = &c
				} else {
					v.Err = errors.New("down")
				}
				vs = append(vs, v)
			}
			d, err := Assemble(l, vs, nil, nextID)
			nextID++
			if err != nil {
				var re *RefusedError
				if !errors.As(err, &re) {
					fail("assembly: %v", err)
				}
				refused++
				log = append(log, "assembly refused: "+err.Error())
				continue
			}
			for _, i := range d.InSync {
				if has[i] != acked {
					fail("assembly serves leg %d, which holds %d of the %d acknowledged writes", i, has[i], acked)
				}
			}
			served++
			if rng.IntN(4) == 0 {
				commit(d.Next, true)
				log = append(log, fmt.Sprintf("assembly of %v: the client crashed in its commit", d.Next.Gen))
				continue
			}
			if !commit(d.Next, false) {
				fail("an assembly's commit of %v did not reach a quorum with every in-sync leg reachable", d.Next.Gen)
			}
			cur = &d.Next
			log = append(log, fmt.Sprintf("assembled at %v: in sync %v, resync %v", d.Next.Gen, d.InSync, d.Resync))
		}
	}
	return served, refused
}
