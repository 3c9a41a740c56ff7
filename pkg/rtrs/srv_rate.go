package rtrs

import (
	"sync"
	"time"
)

// rateLimiter is a token bucket per key (a client's address, its
// identity): NewPathRate tokens a second up to NewPathBurst. A bucket
// that has filled up again is forgotten, so a peer that uses many
// addresses leaves as many buckets as it used in the last
// burst/rate seconds.
type rateLimiter struct {
	rate  float64 // tokens per second; 0: no bound
	burst float64
	now   func() time.Time

	mu sync.Mutex // guards the fields below
	// +checklocks:mu
	buckets map[string]*bucket
	// +checklocks:mu
	swept time.Time
}

type bucket struct {
	tokens float64
	at     time.Time
}

// sweepAt is how many buckets there may be before full ones are
// dropped.
const sweepAt = 1024

func (r *rateLimiter) init(rate float64, burst int) {
	r.rate, r.burst = rate, float64(burst)
	if r.now == nil {
		r.now = time.Now
	}
}

// allow takes a token from the bucket of every key, or from none if one
// of them is empty, and says which.
func (r *rateLimiter) allow(keys ...string) bool {
	if r.rate <= 0 {
		return true
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	now := r.now()
	if r.buckets == nil {
		r.buckets = make(map[string]*bucket)
	}
	if len(r.buckets) >= sweepAt && now.Sub(r.swept) > time.Second {
		r.sweepLocked(now)
	}
	for _, k := range keys {
		if b := r.buckets[k]; b != nil && r.fill(b, now) < 1 {
			return false
		}
	}
	for _, k := range keys {
		b := r.buckets[k]
		if b == nil {
			b = &bucket{tokens: r.burst, at: now}
			r.buckets[k] = b
		}
		b.tokens = r.fill(b, now) - 1
		b.at = now
	}
	return true
}

// fill is what b holds at now.
func (r *rateLimiter) fill(b *bucket, now time.Time) float64 {
	return min(r.burst, b.tokens+now.Sub(b.at).Seconds()*r.rate)
}

// sweepLocked forgets the buckets that are full again.
// +checklocks:r.mu
func (r *rateLimiter) sweepLocked(now time.Time) {
	r.swept = now
	for k, b := range r.buckets {
		if r.fill(b, now) >= r.burst {
			delete(r.buckets, k)
		}
	}
}
