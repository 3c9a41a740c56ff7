// One change of a volume or snapshot name at a time: the locks by name
// that the changes hold across their pool commands, in place of the
// state lock.

package serverd

import (
	"context"
	"fmt"
	"slices"
	"sync"
	"time"

	"github.com/rnbd/rnbd/internal/ctl"
)

// nameWait bounds how long a change of a volume or snapshot waits for
// another change of the same name to end, before it is refused busy: a
// pool command ends within minutes (lvm2's are bounded at 2), most within
// seconds, and a caller that retries (the CSI controller) converges
// sooner by waiting than by being refused at once.
const nameWait = 30 * time.Second

// Keys of the name locks: volumes and snapshots are two name spaces (a
// snapshot may have a volume's name).
func volumeKey(name string) string   { return "volume " + name }
func snapshotKey(name string) string { return "snapshot " + name }

// nameLocks are the volume and snapshot names with a change under way.
// The pool is never asked two changes of one name at once (pool.Pool
// runs those of different names in parallel), and what the daemon
// decides from its state about a name (it exists, it is being made)
// holds until the change ends. A change that finds its name held waits
// for it, bounded by nameWait and by its caller's context.
type nameLocks struct {
	mu sync.Mutex
	// +checklocks:mu
	held map[string]*nameHold
}

// nameHold is a name held: by what, since when; done is closed when it
// is let go.
type nameHold struct {
	what  string
	since time.Time
	done  chan struct{}
}

// lock holds keys for what ("create", "delete", …), waiting for each
// held by another change, at most wait in all or until ctx ends. The
// keys are taken in order (so two changes that need the same two never
// wait for each other); on an error none is held. unlock lets them go.
func (n *nameLocks) lock(ctx context.Context, wait time.Duration, what string, keys ...string) (unlock func(), err error) {
	keys = slices.Clone(keys)
	slices.Sort(keys)
	keys = slices.Compact(keys)
	var timeout <-chan time.Time
	if wait > 0 {
		t := time.NewTimer(wait)
		defer t.Stop()
		timeout = t.C
	}
	start := time.Now()
	var got []string
	unlock = func() {
		n.mu.Lock()
		defer n.mu.Unlock()
		for _, k := range got {
			close(n.held[k].done)
			delete(n.held, k)
		}
	}
	for _, k := range keys {
		for {
			n.mu.Lock()
			if n.held == nil {
				n.held = map[string]*nameHold{}
			}
			h := n.held[k]
			if h == nil {
				n.held[k] = &nameHold{what: what, since: time.Now(), done: make(chan struct{})}
				n.mu.Unlock()
				got = append(got, k)
				break
			}
			n.mu.Unlock()
			select {
			case <-h.done:
			case <-timeout:
				unlock()
				return nil, ctl.Errorf(ctl.CodeBusy, "%s: a %s under way for %v has not ended after %v of waiting; try again later",
					k, h.what, time.Since(h.since).Round(time.Second), time.Since(start).Round(time.Millisecond))
			case <-ctx.Done():
				unlock()
				return nil, fmt.Errorf("%s: waiting for a %s under way: %w", k, h.what, ctx.Err())
			}
		}
	}
	return unlock, nil
}
