// A storage node as the controller talks to it: its admin API through
// the typed client of package api, each call in its turn (a bounded
// queue per node: the node's own bound on one identity's requests is
// never reached) and within a deadline of its own, so that a node that
// does not answer costs a call its deadline, not the caller's.

package csi

import (
	"context"
	"errors"
	"fmt"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
)

// storageNode is one storage node of the configuration. It is safe for
// concurrent use: calls wait their turn in queue, up is atomic.
type storageNode struct {
	cfg *StorageNode
	api *api.Server
	// c is the transport under api (its idle connections closed at Stop).
	c *ctl.Client
	// timeout bounds one call ([controller] storage_timeout).
	timeout time.Duration
	queue   *callQueue
	m       *rpcMetrics
	// up: the last call was answered (or none was made yet); changed
	// is called when it turns (the reconciler's wake-up). While it is
	// not, one call at a time goes to the node (probing), the others
	// are refused at once: a node that does not answer holds no queue.
	up      atomic.Bool
	probing atomic.Bool
	// downSince is when up turned false (unix nanoseconds; 0 while up).
	downSince atomic.Int64
	changed   func(n *storageNode, up bool)
}

func newStorageNode(cfg *StorageNode, cl *ctl.Client, cc ControllerConfig, m *rpcMetrics, changed func(*storageNode, bool)) *storageNode {
	n := &storageNode{cfg: cfg, api: api.NewServer(cl), c: cl, timeout: cc.StorageTimeout.Duration,
		queue: newCallQueue(cc.MaxCallsPerNode, cc.MaxQueuedPerNode), m: m, changed: changed}
	n.up.Store(true)
	m.nodeUp.WithLabelValues(cfg.Name).Set(1)
	return n
}

// callOn runs one call f on n: in its turn, the wait for it and the call
// together within n's deadline. A call the node did not answer in time
// is unavailable, naming the node. While n does not answer, one call at
// a time probes it and the others are refused unavailable at once.
func callOn[T any](ctx context.Context, n *storageNode, what string, f func(ctx context.Context) (T, error)) (T, error) {
	var zero T
	if !n.up.Load() {
		if !n.probing.CompareAndSwap(false, true) {
			return zero, ctl.Errorf(ctl.CodeUnavailable, "%s does not answer (another call is finding out whether it does again)", n)
		}
		defer n.probing.Store(false)
	}
	cctx, cancel := context.WithTimeout(ctx, n.timeout)
	defer cancel()
	began := time.Now()
	release, err := n.queue.acquire(cctx)
	n.m.queueWait.WithLabelValues(n.cfg.Name).Observe(time.Since(began).Seconds())
	if err != nil {
		return zero, fmt.Errorf("%s: %w", n, err)
	}
	defer release()
	waited, called := time.Since(began), time.Now()
	v, err := f(cctx)
	timedOut := err != nil && ctx.Err() == nil && errors.Is(cctx.Err(), context.DeadlineExceeded)
	if timedOut {
		err = ctl.Errorf(ctl.CodeUnavailable, "%s did not answer %s within %v ([controller] storage_timeout; %v of it waiting for a turn)",
			n, what, n.timeout, waited.Round(time.Millisecond))
	}
	// The caller giving up says nothing of the node; nor does a call
	// that its wait for a turn left less than half the deadline: a burst
	// of calls to a busy node must not mark it down.
	if ctx.Err() == nil && !(timedOut && time.Since(called) < n.timeout/2) {
		n.answered(err)
	}
	return v, err
}

// answered records whether the node answered a call: a call it did not
// answer (nothing listens, no answer in time, the connection broken)
// marks it down, any answer (an error of its own included: a refusal,
// one of its bounds) up.
func (n *storageNode) answered(err error) {
	up := err == nil || ctl.Answered(err)
	result := "ok"
	switch {
	case !up:
		result = "unanswered"
	case err != nil:
		result = "error"
	}
	n.m.nodeCalls.WithLabelValues(n.cfg.Name, result).Inc()
	if n.up.Swap(up) != up {
		v := 0.0
		if up {
			v = 1
			n.downSince.Store(0)
		} else {
			n.downSince.Store(time.Now().UnixNano())
		}
		n.m.nodeUp.WithLabelValues(n.cfg.Name).Set(v)
		if n.changed != nil {
			n.changed(n, up)
		}
	}
}

func (n *storageNode) pools(ctx context.Context) ([]api.PoolRecord, error) {
	return callOn(ctx, n, "a pool list", n.api.Pools)
}

// allocatable is what a new volume may still be given in pool.
func (n *storageNode) allocatable(ctx context.Context, pool string) (int64, error) {
	ps, err := n.pools(ctx)
	if err != nil {
		return 0, err
	}
	for _, p := range ps {
		if p.Name == pool {
			if p.Allocatable == nil {
				return 0, ctl.Errorf(ctl.CodeUnavailable, "pool %s: %s", pool, p.State)
			}
			return *p.Allocatable, nil
		}
	}
	return 0, ctl.Errorf(ctl.CodeNotFound, "no pool %s", pool)
}

// volume is the record of volume name (a not_found error if none).
func (n *storageNode) volume(ctx context.Context, name string) (*api.VolumeRecord, error) {
	return callOn(ctx, n, "volume "+name, func(ctx context.Context) (*api.VolumeRecord, error) { return n.api.Volume(ctx, name) })
}

func (n *storageNode) volumes(ctx context.Context) ([]api.VolumeRecord, error) {
	return callOn(ctx, n, "a volume list", n.api.Volumes)
}

func (n *storageNode) createVolume(ctx context.Context, req api.VolumeRequest) (api.VolumeRecord, error) {
	out, err := callOn(ctx, n, "a create of volume "+req.Name, func(ctx context.Context) (api.CreatedVolume, error) {
		return n.api.CreateVolume(ctx, req)
	})
	return out.Record, err
}

func (n *storageNode) deleteVolume(ctx context.Context, name string) error {
	_, err := callOn(ctx, n, "a delete of volume "+name, func(ctx context.Context) (bool, error) { return n.api.DeleteVolume(ctx, name, false) })
	return err
}

func (n *storageNode) resizeVolume(ctx context.Context, name string, size int64) error {
	_, err := callOn(ctx, n, "a resize of volume "+name, func(ctx context.Context) (api.ResizeResponse, error) {
		return n.api.ResizeVolume(ctx, name, strconv.FormatInt(size, 10))
	})
	return err
}

func (n *storageNode) setLabels(ctx context.Context, name string, labels map[string]string) error {
	_, err := callOn(ctx, n, "the labels of volume "+name, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, n.api.SetVolumeLabels(ctx, name, labels)
	})
	return err
}

func (n *storageNode) grants(ctx context.Context, volume string) ([]api.GrantRecord, error) {
	return callOn(ctx, n, "the grants of volume "+volume, func(ctx context.Context) ([]api.GrantRecord, error) {
		return n.api.VolumeGrants(ctx, volume)
	})
}

func (n *storageNode) grant(ctx context.Context, volume, identity, access string) error {
	_, err := callOn(ctx, n, "a grant of volume "+volume, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, n.api.GrantVolume(ctx, volume, api.GrantRequest{Identity: identity, Access: access})
	})
	return err
}

func (n *storageNode) revoke(ctx context.Context, volume, identity string) error {
	_, err := callOn(ctx, n, "a revoke of volume "+volume, func(ctx context.Context) (struct{}, error) {
		return struct{}{}, n.api.RevokeVolume(ctx, volume, identity)
	})
	return err
}

func (n *storageNode) snapshot(ctx context.Context, name string) (*api.SnapshotRecord, error) {
	return callOn(ctx, n, "snapshot "+name, func(ctx context.Context) (*api.SnapshotRecord, error) { return n.api.Snapshot(ctx, name) })
}

func (n *storageNode) snapshots(ctx context.Context, volume string) ([]api.SnapshotRecord, error) {
	return callOn(ctx, n, "a snapshot list", func(ctx context.Context) ([]api.SnapshotRecord, error) { return n.api.Snapshots(ctx, volume) })
}

func (n *storageNode) createSnapshot(ctx context.Context, name, volume string) (api.SnapshotRecord, error) {
	out, err := callOn(ctx, n, "a snapshot "+name, func(ctx context.Context) (api.CreatedSnapshot, error) {
		return n.api.CreateSnapshot(ctx, api.SnapshotRequest{Name: name, Volume: volume})
	})
	return out.Record, err
}

func (n *storageNode) deleteSnapshot(ctx context.Context, name string) error {
	_, err := callOn(ctx, n, "a delete of snapshot "+name, func(ctx context.Context) (bool, error) { return n.api.DeleteSnapshot(ctx, name) })
	return err
}

func (n *storageNode) String() string { return fmt.Sprintf("storage node %s", n.cfg.Name) }

// callQueue bounds the calls under way to one storage node: at most
// cap(slots) at once, at most maxWaiting more waiting their turn; one
// past that is refused unavailable at once (the CO retries it with
// backoff). It is safe for concurrent use.
type callQueue struct {
	slots      chan struct{}
	waiting    atomic.Int64
	maxWaiting int64
}

func newCallQueue(calls, waiting int) *callQueue {
	return &callQueue{slots: make(chan struct{}, calls), maxWaiting: int64(waiting)}
}

// acquire takes a turn, waiting for one while ctx allows; release gives
// it back.
func (q *callQueue) acquire(ctx context.Context) (release func(), err error) {
	release = func() { <-q.slots }
	select {
	case q.slots <- struct{}{}:
		return release, nil
	default:
	}
	if q.waiting.Add(1) > q.maxWaiting {
		q.waiting.Add(-1)
		return nil, ctl.Errorf(ctl.CodeUnavailable, "%d calls under way and %d waiting: the most the controller queues for one storage node "+
			"([controller] max_calls_per_node, max_queued_per_node); try again", cap(q.slots), q.maxWaiting)
	}
	defer q.waiting.Add(-1)
	select {
	case q.slots <- struct{}{}:
		return release, nil
	case <-ctx.Done():
		return nil, ctl.Errorf(ctl.CodeUnavailable, "no turn among the %d calls under way before the call's deadline: %v", cap(q.slots), ctx.Err())
	}
}
