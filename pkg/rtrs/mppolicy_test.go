package rtrs

import (
	"bytes"
	"testing"
	"time"
)

// fakePaths builds paths without goroutines: only state, inflight and
// latency matter to the iterator.
func fakePaths(states []CltPathState, inflight []int64, latency []time.Duration) []*CltPath {
	var ps []*CltPath
	for i, st := range states {
		p := &CltPath{stats: newPathStats()}
		p.state.Store(int32(st))
		p.stats.inflight.Store(inflight[i])
		p.hb.curLatency.Store(int64(latency[i]))
		ps = append(ps, p)
	}
	return ps
}

func order(s *CltSession, paths []*CltPath) []int {
	var it pathIter
	it.init(s, paths)
	var got []int
	for p := it.next(); p != nil; p = it.next() {
		for i, q := range paths {
			if q == p {
				got = append(got, i)
			}
		}
	}
	return got
}

func equalInts(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func TestPolicyMinInflight(t *testing.T) {
	s := &CltSession{}
	s.policy.Store(int32(MPMinInflight))
	paths := fakePaths(
		[]CltPathState{CltPathConnected, CltPathConnected, CltPathReconnecting, CltPathConnected},
		[]int64{5, 2, 0, 9},
		[]time.Duration{1, 1, 1, 1})
	// Least inflight first, the disconnected path never, then stop.
	if got := order(s, paths); !equalInts(got, []int{1, 0, 3}) {
		t.Fatalf("order %v, want [1 0 3]", got)
	}
	// A tie goes to the first path, as in the kernel.
	paths[0].stats.inflight.Store(2)
	if got := order(s, paths); got[0] != 0 {
		t.Fatalf("tie went to path %d", got[0])
	}
}

func TestPolicyMinLatency(t *testing.T) {
	s := &CltSession{}
	s.policy.Store(int32(MPMinLatency))
	paths := fakePaths(
		[]CltPathState{CltPathConnected, CltPathConnected, CltPathConnected, CltPathClosed},
		[]int64{0, 0, 100, 0},
		[]time.Duration{300 * time.Microsecond, 900 * time.Microsecond, 50 * time.Microsecond, time.Microsecond})
	if got := order(s, paths); !equalInts(got, []int{2, 0, 1}) {
		t.Fatalf("order %v, want [2 0 1]", got)
	}
}

func TestPolicyRoundRobin(t *testing.T) {
	s := &CltSession{}
	s.policy.Store(int32(MPRoundRobin))
	paths := fakePaths(
		[]CltPathState{CltPathConnected, CltPathConnected, CltPathConnected},
		[]int64{0, 0, 0}, []time.Duration{0, 0, 0})
	// Each request starts one further, and tries every path once.
	firsts := map[int]int{}
	for i := 0; i < 30; i++ {
		got := order(s, paths)
		if len(got) != 3 {
			t.Fatalf("round robin tried %v", got)
		}
		firsts[got[0]]++
		if got[1] != (got[0]+1)%3 || got[2] != (got[0]+2)%3 {
			t.Fatalf("round robin order %v", got)
		}
	}
	for i := 0; i < 3; i++ {
		if firsts[i] != 10 {
			t.Fatalf("first choices %v, want 10 each", firsts)
		}
	}
}

func TestParseMPPolicy(t *testing.T) {
	for s, want := range map[string]MPPolicy{
		"0": MPRoundRobin, "RR": MPRoundRobin, "round-robin": MPRoundRobin,
		"1": MPMinInflight, "mi": MPMinInflight, "Min-Inflight": MPMinInflight,
		"2": MPMinLatency, "ML": MPMinLatency, "min-latency\n": MPMinLatency,
	} {
		if got, err := ParseMPPolicy(s); err != nil || got != want {
			t.Errorf("ParseMPPolicy(%q) = %v, %v", s, got, err)
		}
	}
	if _, err := ParseMPPolicy("3"); err == nil {
		t.Fatal("policy 3 accepted")
	}
	// The rnbd tool parses "%s (%2s: %*d)".
	if s := MPMinInflight.String(); s != "min-inflight (MI: 1)" {
		t.Fatalf("mpath_policy shows %q", s)
	}
}

// TestPolicySwitchAtRuntime switches policies under a running load over two
// paths and checks where the IO went.
func TestPolicySwitchAtRuntime(t *testing.T) {
	_, fab := memNet()
	disk := newMemDisk(1 << 20)
	scfg := testServerConfig(fab, disk, ap("10.1.0.1:1234"))
	ccfg := testClientConfig(fab, pa("10.1.0.2", "10.1.0.1:1234"), pa("10.1.0.3", "10.1.0.1:1234"))
	r := newRig(t, fab, scfg, ccfg)
	data := bytes.Repeat([]byte{7}, 512)
	run := func(n int) {
		for i := 0; i < n; i++ {
			if err := r.write(uint64(i*512), data); err != nil {
				t.Fatal(err)
			}
		}
	}
	paths := r.sess.Paths()
	count := func() (a, b uint64) {
		return paths[0].Stats().Counters().WriteCount, paths[1].Stats().Counters().WriteCount
	}
	// min-inflight with one request at a time: always the first path.
	run(20)
	if a, b := count(); a != 20 || b != 0 {
		t.Fatalf("min-inflight at queue depth 1 spread %d/%d, want 20/0", a, b)
	}
	if err := r.sess.SetMPPolicy(MPRoundRobin); err != nil {
		t.Fatal(err)
	}
	run(20)
	if a, b := count(); a != 30 || b != 10 {
		t.Fatalf("round-robin spread %d/%d, want 30/10", a, b)
	}
	// min-latency follows the lower heartbeat round trip.
	paths[0].hb.curLatency.Store(int64(time.Millisecond))
	paths[1].hb.curLatency.Store(int64(time.Microsecond))
	if err := r.sess.SetMPPolicy(MPMinLatency); err != nil {
		t.Fatal(err)
	}
	run(20)
	if a, b := count(); a != 30 || b != 30 {
		t.Fatalf("min-latency spread %d/%d, want 30/30", a, b)
	}
	if err := r.sess.SetMPPolicy(7); err == nil {
		t.Fatal("policy 7 accepted")
	}
	got, err := r.read(0, 512*20)
	if err != nil || !bytes.Equal(got, bytes.Repeat([]byte{7}, 512*20)) {
		t.Fatalf("read back: %v", err)
	}
	r.assertHealthy()
}
