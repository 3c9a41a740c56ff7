package rtrs

import (
	"fmt"
	"math"
	"strings"
)

// MPPolicy is the multipath policy, enum rtrs_mp_policy: how each IO picks
// its path.
type MPPolicy int32

const (
	// MPRoundRobin takes the paths in turn.
	MPRoundRobin MPPolicy = 0
	// MPMinInflight takes the path with the fewest requests in flight;
	// the kernel's default.
	MPMinInflight MPPolicy = 1
	// MPMinLatency takes the path with the lowest heartbeat round trip.
	MPMinLatency MPPolicy = 2
)

// Name is the policy's long name.
func (p MPPolicy) Name() string {
	switch p {
	case MPRoundRobin:
		return "round-robin"
	case MPMinInflight:
		return "min-inflight"
	case MPMinLatency:
		return "min-latency"
	}
	return fmt.Sprintf("MPPolicy(%d)", int32(p))
}

// Short is the two-letter name the rnbd tool shows (RR, MI, ML).
func (p MPPolicy) Short() string {
	switch p {
	case MPRoundRobin:
		return "RR"
	case MPMinInflight:
		return "MI"
	case MPMinLatency:
		return "ML"
	}
	return "??"
}

// String is what the kernel's mpath_policy shows, e.g.
// "min-inflight (MI: 1)"; the rnbd tool parses it, so it is frozen.
func (p MPPolicy) String() string {
	return fmt.Sprintf("%s (%s: %d)", p.Name(), p.Short(), int32(p))
}

// ParseMPPolicy accepts what the kernel's mpath_policy store accepts:
// "0", "1", "2", or the long or short names in any case.
func ParseMPPolicy(s string) (MPPolicy, error) {
	switch strings.ToLower(strings.TrimSpace(s)) {
	case "0", "round-robin", "rr":
		return MPRoundRobin, nil
	case "1", "min-inflight", "mi":
		return MPMinInflight, nil
	case "2", "min-latency", "ml":
		return MPMinLatency, nil
	}
	return 0, fmt.Errorf("rtrs: unknown multipath policy %q (want round-robin, min-inflight or min-latency)", s)
}

// MarshalText is the policy's name, as configuration files and flags
// write it.
func (p MPPolicy) MarshalText() ([]byte, error) { return []byte(p.Name()), nil }

// UnmarshalText reads what ParseMPPolicy accepts.
func (p *MPPolicy) UnmarshalText(b []byte) error {
	v, err := ParseMPPolicy(string(b))
	if err != nil {
		return err
	}
	*p = v
	return nil
}

// pathIter yields the paths to try for one request, at most one pass over
// the session's paths, in the order the policy prefers; the caller skips
// paths that are not connected and moves on when a post fails. It lives on
// the stack: no allocation per IO.
type pathIter struct {
	paths  []*CltPath
	policy MPPolicy
	n      int
	start  int
	tried  [MaxPathsNum / 64]uint64
}

func (it *pathIter) init(s *CltSession, paths []*CltPath) {
	it.paths = paths
	it.policy = MPPolicy(s.policy.Load())
	it.n = 0
	if it.policy == MPRoundRobin && len(paths) > 0 {
		it.start = int(s.rrCursor.Add(1) % uint32(len(paths)))
	}
}

func (it *pathIter) next() *CltPath {
	if it.n >= len(it.paths) {
		return nil
	}
	it.n++
	switch it.policy {
	case MPRoundRobin:
		return it.paths[(it.start+it.n-1)%len(it.paths)]
	case MPMinLatency:
		return it.pick(func(p *CltPath) int64 { return int64(p.hb.latency()) })
	default:
		return it.pick(func(p *CltPath) int64 { return p.stats.inflight.Load() })
	}
}

// pick returns the connected, untried path with the lowest cost; the first
// one wins a tie, as in the kernel.
func (it *pathIter) pick(cost func(*CltPath) int64) *CltPath {
	best, bestCost := -1, int64(math.MaxInt64)
	for i, p := range it.paths {
		if it.tried[i/64]&(1<<(i%64)) != 0 || p.State() != CltPathConnected {
			continue
		}
		if c := cost(p); c < bestCost {
			best, bestCost = i, c
		}
	}
	if best < 0 {
		it.n = len(it.paths)
		return nil
	}
	it.tried[best/64] |= 1 << (best % 64)
	return it.paths[best]
}
