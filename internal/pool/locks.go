// What lets the changes of a pool run at once: a lock per name, so that
// a change waits only for the changes of its own volume or snapshot, and
// the space that changes under way have been promised, so that two
// creates at once are not both given the last of it.

package pool

import "sync"

// nameLocks serialises the changes of one name; those of other names
// run at once. A name's entry lives while a change holds it: no lock is
// kept for a name nobody changes.
type nameLocks struct {
	mu sync.Mutex
	// held maps a name (lockKey) to a channel closed when its change
	// ends.
	// +checklocks:mu
	held map[string]chan struct{}
}

// lockKey is the key of a volume's or a snapshot's name (a volume and a
// snapshot may share a name).
func lockKey(kind, name string) string { return kind + "/" + name }

// with runs fn once no other change of key is under way, holding key
// until fn returns. Waiters are woken together and one of them takes
// the key: the same name changed at once is an orchestrator's retry,
// not a queue to be fair to.
func (l *nameLocks) with(key string, fn func() error) error {
	for {
		l.mu.Lock()
		done, busy := l.held[key]
		if !busy {
			if l.held == nil {
				l.held = map[string]chan struct{}{}
			}
			l.held[key] = make(chan struct{})
			l.mu.Unlock()
			break
		}
		l.mu.Unlock()
		<-done
	}
	defer l.release(key)
	return fn()
}

func (l *nameLocks) release(key string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	close(l.held[key])
	delete(l.held, key)
}

// reservations is the space promised to the changes under way whose
// volumes the pool does not show yet (a file still under .rnbd-tmp/, an
// lvcreate not yet committed): a capacity check counts it, so running
// at once never promises more than running one after the other would.
type reservations struct {
	mu sync.Mutex
	// +checklocks:mu
	bytes int64
}

// take runs check with the reservations held, and reserves what it says
// the change needs. check counts the pool's space itself (reserved is
// what the other changes under way hold), so that no change finishes
// unseen between its count and the reservation: a change's reservation
// is given back (release) only once its volume is there to be counted.
func (r *reservations) take(check func(reserved int64) (need int64, err error)) (release func(), err error) {
	r.mu.Lock()
	defer r.mu.Unlock()
	need, err := check(r.bytes)
	if err != nil {
		return nil, err
	}
	r.bytes += need
	return func() {
		r.mu.Lock()
		defer r.mu.Unlock()
		r.bytes -= need
	}, nil
}

// held is the space reserved now.
func (r *reservations) held() int64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.bytes
}
