package serverd

import (
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"
)

// probeWait is how long an export's path may take to answer a stat
// before the export is left not served (and tried again later).
const probeWait = 2 * time.Second

// maxProbesPending bounds the stats that have not returned: each holds
// an OS thread until its mount answers, if ever.
const maxProbesPending = 64

// pathProbe looks at export paths without waiting for one that does not
// answer: a stat on a hard NFS mount of a server that is gone, or a FUSE
// mount whose daemon hangs, never returns, and cannot be interrupted. A
// daemon that waited for it would not start, or would hold every map and
// unmap behind it. Each stat runs in a goroutine of its own; a path whose
// stat is still hanging is not looked at again until it returns, so a
// path on a dead mount costs one goroutine (and the OS thread it blocks),
// however often it is retried, and at most maxProbesPending are pending.
type pathProbe struct {
	mu sync.Mutex
	// +checklocks:mu
	pending map[string]bool // paths whose stat has not returned
}

// probed is what a stat of a path gave.
type probed struct {
	fi  os.FileInfo
	err error
	// readOnly: a regular file on a file system this process sees
	// read-only (statfs ST_RDONLY: the file system's or the mount's),
	// which no one can open for writing (sandbox.go).
	readOnly bool
}

// look stats the paths, for at most wait. The result has one entry per
// path: its FileInfo, the stat's error, or an ETIMEDOUT error for a path
// that did not answer in time. Paths past maxProbesPending wait for a
// stat of this look to return (many exports at start: their stats are
// quick, only many); where the pending stats are earlier looks' that
// hang, a path is not looked at.
func (pp *pathProbe) look(paths []string, wait time.Duration) map[string]probed {
	type answer struct {
		path string
		probed
	}
	out := make(map[string]probed, len(paths))
	done := make(chan answer, len(paths))
	t := time.NewTimer(wait)
	defer t.Stop()
	asked, expired := 0, false
	// receive takes one answer of this look, or notes the deadline.
	receive := func() {
		select {
		case a := <-done:
			out[a.path] = a.probed
			asked--
		case <-t.C:
			expired = true
		}
	}
	pp.mu.Lock()
	if pp.pending == nil {
		pp.pending = map[string]bool{}
	}
	for _, p := range paths {
		if _, dup := out[p]; dup {
			continue
		}
		if pp.pending[p] {
			out[p] = probed{err: &os.PathError{Op: "stat", Path: p,
				Err: fmt.Errorf("no answer: an earlier look has not returned (a mount that does not answer?): %w", syscall.ETIMEDOUT)}}
			continue
		}
		for len(pp.pending) >= maxProbesPending && asked > 0 && !expired {
			pp.mu.Unlock()
			receive()
			pp.mu.Lock()
		}
		if len(pp.pending) >= maxProbesPending || expired {
			out[p] = probed{err: notLooked(p, len(pp.pending))}
			continue
		}
		out[p] = probed{err: hungPath(p, wait)}
		pp.pending[p] = true
		asked++
		go func() {
			fi, err := os.Stat(p)
			ro := err == nil && fi.Mode().IsRegular() && readOnlyFS(p)
			pp.mu.Lock()
			delete(pp.pending, p)
			pp.mu.Unlock()
			done <- answer{p, probed{fi, err, ro}} // buffered: never blocks
		}()
	}
	pp.mu.Unlock()
	for asked > 0 && !expired {
		receive()
	}
	return out
}

// stat is os.Stat of one path, bounded as look.
func (pp *pathProbe) stat(path string) (os.FileInfo, error) {
	r := pp.look([]string{path}, probeWait)[path]
	return r.fi, r.err
}

// openWait bounds how long an OPEN waits for its export's path to answer:
// longer than a map's look (a slow mount still opens), shorter than our
// client's admin timeout (30 s), so that the client hears why.
const openWait = 10 * time.Second

// answers is rnbd.SrvConfig.Answers: an error at once for a path whose
// earlier look still hangs, after openWait for one that does not answer
// now, and nil — the open goes on unbounded, as it would without a look —
// when maxProbesPending looks hang already: one path's dead mount must
// not fail the OPENs of every other export.
func (pp *pathProbe) answers(path string) error {
	pp.mu.Lock()
	full := !pp.pending[path] && len(pp.pending) >= maxProbesPending
	pp.mu.Unlock()
	if full {
		return nil
	}
	return pp.look([]string{path}, openWait)[path].err
}

// notLooked is the error of a path not looked at: n stats pending.
func notLooked(path string, n int) error {
	return &os.PathError{Op: "stat", Path: path,
		Err: fmt.Errorf("not looked at: %d export paths do not answer: %w", n, syscall.ETIMEDOUT)}
}

// hungPath is the error of a path that did not answer a stat.
func hungPath(path string, wait time.Duration) error {
	return &os.PathError{Op: "stat", Path: path,
		Err: fmt.Errorf("no answer in %v (a mount that does not answer?): %w", wait, syscall.ETIMEDOUT)}
}
