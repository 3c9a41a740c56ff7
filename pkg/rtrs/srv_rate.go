package rtrs

import (
	"net/netip"
	"sync"
	"time"
)

// rateLimiter bounds how fast clients make new paths (NewPathRate): a
// token bucket per client address (a fabric.PeerGroup) and one per
// identity, rate tokens a second up to burst. A new path takes a token
// from its address's bucket and its identity's, or from neither if one
// is empty. A path refused for its identity's bucket still costs its
// address a token, so that an address that keeps asking runs its own
// bucket dry.
//
// An address refused with its bucket empty is held until the bucket is
// half full again (burst/2 tokens, at least one): its connections are
// refused as they are accepted (Server.refuseAtAccept), before they cost
// a goroutine, a handshake or the request's decoding, and without taking
// a token, so the bucket refills meanwhile, and an address that stopped
// asking faster than the rate has it back then. Half the burst, not one
// token: every release lets through, besides its paths, the connections
// that come before the server has refused the next path too many, each
// at the full cost (a peer that asks as fast as it can gets tens in that
// time), and this way there are burst/2 times fewer releases. An
// identity is known only after the handshake: its bucket is applied
// then, as before.
//
// A bucket that has filled up again is forgotten, and so is a hold that
// ended, so a peer that uses many addresses leaves as many buckets as it
// used in the last burst/rate seconds.
type rateLimiter struct {
	rate  float64 // tokens per second; 0: no bound
	burst float64
	// now is the clock; a test that sets it holds mu and heldMu.
	now func() time.Time

	mu sync.Mutex // guards the buckets; taken before heldMu
	// +checklocks:mu
	addrs map[netip.Prefix]*bucket
	// +checklocks:mu
	ids map[string]*bucket
	// +checklocks:mu
	swept time.Time

	// heldMu guards the holds. It is not mu: the accept loops read the
	// holds for every connection, and must not wait for a sweep of the
	// buckets.
	heldMu sync.Mutex
	// +checklocks:heldMu
	held map[netip.Prefix]time.Time // until when each address is held
	// +checklocks:heldMu
	heldSwept time.Time
}

type bucket struct {
	tokens float64
	at     time.Time
}

// sweepAt is how many buckets, or holds, there may be before the full
// ones, or the ended ones, are dropped.
const sweepAt = 1024

func (r *rateLimiter) init(rate float64, burst int) {
	r.rate, r.burst = rate, float64(burst)
	if r.now == nil {
		r.now = time.Now
	}
}

// allow takes a token from the bucket of addr (a fabric.PeerGroup) and
// from that of identity (none if ""), or from neither if one of them is
// empty, and says which. Refused, the address pays a token all the same
// if it has one, and is held if it has none left.
func (r *rateLimiter) allow(addr netip.Prefix, identity string) bool {
	if r.rate <= 0 {
		return true
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if r.addrs == nil {
		r.addrs, r.ids = make(map[netip.Prefix]*bucket), make(map[string]*bucket)
	}
	if len(r.addrs)+len(r.ids) >= sweepAt && now.Sub(r.swept) > time.Second {
		r.sweepLocked(now)
	}
	ab := r.addrs[addr]
	if ab == nil {
		ab = &bucket{tokens: r.burst, at: now}
		r.addrs[addr] = ab
	}
	var ib *bucket
	if identity != "" {
		if ib = r.ids[identity]; ib == nil {
			ib = &bucket{tokens: r.burst, at: now}
			r.ids[identity] = ib
		}
	}
	at := r.fill(ab, now)
	if at >= 1 && (ib == nil || r.fill(ib, now) >= 1) {
		ab.tokens, ab.at = at-1, now
		if ib != nil {
			ib.tokens, ib.at = r.fill(ib, now)-1, now
		}
		return true
	}
	if at >= 1 {
		at-- // refused for its identity: the address pays for asking
	}
	ab.tokens, ab.at = at, now
	if at < 1 {
		// An hour at most: a rate so low that it takes longer refuses
		// the address again when it comes back.
		refill := (max(1, r.burst/2) - at) / r.rate
		r.hold(addr, now.Add(time.Duration(min(refill, time.Hour.Seconds())*float64(time.Second))))
	}
	return false
}

// fill is what b holds at now.
func (r *rateLimiter) fill(b *bucket, now time.Time) float64 {
	return min(r.burst, b.tokens+now.Sub(b.at).Seconds()*r.rate)
}

// sweepLocked forgets the buckets that are full again.
// +checklocks:r.mu
func (r *rateLimiter) sweepLocked(now time.Time) {
	r.swept = now
	for k, b := range r.addrs {
		if r.fill(b, now) >= r.burst {
			delete(r.addrs, k)
		}
	}
	for k, b := range r.ids {
		if r.fill(b, now) >= r.burst {
			delete(r.ids, k)
		}
	}
}

// hold refuses addr's connections at accept until until.
func (r *rateLimiter) hold(addr netip.Prefix, until time.Time) {
	r.heldMu.Lock()
	defer r.heldMu.Unlock()
	if r.held == nil {
		r.held = make(map[netip.Prefix]time.Time)
	}
	if now := r.now(); len(r.held) >= sweepAt && now.Sub(r.heldSwept) > time.Second {
		r.heldSwept = now
		for k, u := range r.held {
			if !now.Before(u) {
				delete(r.held, k)
			}
		}
	}
	r.held[addr] = until
}

// holding says for how much longer addr (a fabric.PeerGroup) is held:
// refused a new path, and its bucket not refilled yet (0: not held). It
// neither waits for anything but heldMu nor allocates: the accept loops
// call it for every connection.
func (r *rateLimiter) holding(addr netip.Prefix) time.Duration {
	if r.rate <= 0 {
		return 0
	}
	r.heldMu.Lock()
	defer r.heldMu.Unlock()
	until, ok := r.held[addr]
	if !ok {
		return 0
	}
	if d := until.Sub(r.now()); d > 0 {
		return d
	}
	delete(r.held, addr)
	return 0
}
