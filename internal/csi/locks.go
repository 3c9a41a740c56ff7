// Operations in flight: the CSI spec asks a plugin to answer Aborted to
// a second operation on a volume or snapshot while one is under way (the
// CO retries it). One set of locks, by kind of key, for the controller
// and the node service.

package csi

import (
	"sync"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// opLocks are the keys with an operation under way. It is safe for
// concurrent use; mu guards keys, and is held over no call.
type opLocks struct {
	mu sync.Mutex
	// +checklocks:mu
	keys map[lockKey]bool
}

// lockKey is a kind of key and the key: a CSI volume name and a volume
// id never clash, nor a volume's and a snapshot's.
type lockKey struct {
	kind lockKind
	key  string
}

type lockKind string

const (
	byVolumeName   lockKind = "volume name"
	byVolumeID     lockKind = "volume"
	bySnapshotName lockKind = "snapshot name"
	bySnapshotID   lockKind = "snapshot"
)

// lockByName takes CSI volume name name (CreateVolume).
func (l *opLocks) lockByName(name string) (func(), error) { return l.lock(byVolumeName, name) }

// lockByVolumeID takes volume id (every other call of one volume).
func (l *opLocks) lockByVolumeID(id string) (func(), error) { return l.lock(byVolumeID, id) }

// lockBySnapshotName takes CSI snapshot name name (CreateSnapshot).
func (l *opLocks) lockBySnapshotName(name string) (func(), error) {
	return l.lock(bySnapshotName, name)
}

// lockBySnapshotID takes snapshot id (DeleteSnapshot).
func (l *opLocks) lockBySnapshotID(id string) (func(), error) { return l.lock(bySnapshotID, id) }

// lock marks the key busy until the func it gives is called; one busy
// already is Aborted.
func (l *opLocks) lock(kind lockKind, key string) (func(), error) {
	k := lockKey{kind, key}
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.keys[k] {
		return nil, status.Errorf(codes.Aborted, "an operation on %s %s is already in progress", kind, key)
	}
	if l.keys == nil {
		l.keys = map[lockKey]bool{}
	}
	l.keys[k] = true
	return func() {
		l.mu.Lock()
		defer l.mu.Unlock()
		delete(l.keys, k)
	}, nil
}
