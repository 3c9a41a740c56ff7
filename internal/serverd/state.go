// The state file (the exports mapped, the session names bound), and the
// exports that could not be served, tried again until they are.

package serverd

import (
	"sort"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// StateVersion is the newest version of the state file format: 2 has
// volumes. A file without volumes is written as version 1, which the
// daemons before volumes read; one with them as 2, which those refuse
// rather than drop the volumes at their next save.
const StateVersion = 2

// State is what survives a restart: the explicit exports, and the
// session names bound to client identities (rnbd.SessionOwner).
type State struct {
	Version       int                 `json:"version"`
	Exports       []rnbd.Export       `json:"exports"`
	SessionOwners []rnbd.SessionOwner `json:"session_owners,omitempty"`
	// Volumes are the volumes of the pools, each with its export's
	// rules (not in Exports) and the change under way (volume.go).
	Volumes []VolumeState `json:"volumes,omitempty"`
}

// StateVersion implements conf.Versioned.
func (st *State) StateVersion() int { return st.Version }

// saveState writes the exports atomically: a temporary file, synced, then
// renamed over the old one, and the directory synced.
// +checklocks:d.stateMu
func (d *Daemon) saveState() error {
	st := State{Version: StateVersion, SessionOwners: d.rnbd.SessionOwners()}
	served := map[string]bool{}
	volumes := map[string]rnbd.Export{}
	for _, e := range d.rnbd.Exports() {
		switch {
		case d.volumes[e.Name] != nil:
			volumes[e.Name] = e
		case !d.configured[e.Name]:
			st.Exports = append(st.Exports, e)
			served[e.Name] = true
		}
	}
	st.Volumes = d.volumeStates(volumes)
	if len(st.Volumes) == 0 {
		st.Version = 1
	}
	for _, e := range d.unrestored {
		if !served[e.Name] {
			st.Exports = append(st.Exports, e)
		}
	}
	sort.Slice(st.Exports, func(i, j int) bool { return st.Exports[i].Name < st.Exports[j].Name })
	return conf.SaveState(d.cfg.StateFile, st)
}

// dropUnrestored forgets an export that could not be restored (it was
// mapped again, or unmapped). stateMu is held.
// +checklocks:d.stateMu
func (d *Daemon) dropUnrestored(name string) bool {
	for i, e := range d.unrestored {
		if e.Name == name {
			delete(d.notServed, name)
			d.unrestored = append(d.unrestored[:i], d.unrestored[i+1:]...)
			return true
		}
	}
	return false
}

// saveOwners saves the state file when a session name was bound, until
// Stop, and once more then if one is still due.
func (d *Daemon) saveOwners() {
	defer close(d.ownersDone)
	save := func() {
		d.stateMu.Lock()
		defer d.stateMu.Unlock()
		if err := d.saveState(); err != nil {
			d.log.WithError(err).Error("saving the session names' identities failed")
		}
	}
	for {
		select {
		case <-d.ownersDirty:
			save()
		case <-d.stopOwners:
			select {
			case <-d.ownersDirty:
				save()
			default:
			}
			return
		}
	}
}

// unserved lists the exports that could not be served, with why: the
// configuration file's, and the state file's not shadowed by one of the
// configuration file.
func (d *Daemon) unserved() []unservedExport {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	var out []unservedExport
	for _, e := range d.configPending {
		out = append(out, unservedExport{Export: e, Source: "config", NotServed: d.notServed[e.Name]})
	}
	for _, e := range d.unrestored {
		if !d.configured[e.Name] {
			out = append(out, unservedExport{Export: e, Source: "map", NotServed: d.notServed[e.Name]})
		}
	}
	return out
}

// noteNotServed records why e is not served, and logs it when that is
// news. stateMu is held (or the daemon is starting).
// +checklocks:d.stateMu
func (d *Daemon) noteNotServed(e rnbd.Export, what string, err error) {
	if d.notServed[e.Name] == err.Error() {
		return
	}
	d.notServed[e.Name] = err.Error()
	d.log.WithError(err).WithFields(exportFields(e)).Error(what)
}

// retryStopWait bounds how long Stop waits for a retry under way.
const retryStopWait = 5 * time.Second

// retryLoop tries the exports and the pools not served again every
// retryEvery, until Stop. It is a goroutine of its own: a path on a
// mount that hangs, or a pool's command, holds only it, not the saves
// of the state file.
func (d *Daemon) retryLoop() {
	defer close(d.retryDone)
	t := time.NewTicker(d.retryEvery)
	defer t.Stop()
	for {
		select {
		case <-t.C:
			d.retryNotServed()
			d.retryPools(d.retryCtx)
		case <-d.retryCtx.Done():
			return
		}
	}
}

// retryNotServed tries the exports that could not be served again: a
// device that appeared since (an LVM volume activated late, a file
// system mounted) is served without a restart. Their paths are looked
// at without the state lock: a stat on a mount that does not answer
// hangs, and must not hold map, unmap and the saves with it; an export
// is mapped only once its path answered.
func (d *Daemon) retryNotServed() {
	d.stateMu.Lock()
	var paths []string
	for _, list := range [][]rnbd.Export{d.configPending, d.unrestored} {
		for _, e := range list {
			paths = append(paths, e.Path)
		}
	}
	d.stateMu.Unlock()
	if len(paths) == 0 {
		return
	}
	looked := d.probe.look(paths, probeWait)
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	// A state-file export the configuration file shadows waits for the
	// file to lose it (state true); the configuration's own never are.
	try := func(list []rnbd.Export, state bool, what string) []rnbd.Export {
		keep := list[:0]
		for _, e := range list {
			if state && d.configured[e.Name] {
				keep = append(keep, e)
				continue
			}
			if err := d.mapLooked(e, looked); err != nil {
				d.noteNotServed(e, what+" still not served", err)
				keep = append(keep, e)
				continue
			}
			delete(d.notServed, e.Name)
			d.log.WithFields(exportFields(e)).Info(what + " served now")
			d.warnReadOnly(e, looked[e.Path])
		}
		return keep // +checklocksignore: stateMu is the caller's, held across the closure
	}
	d.configPending = try(d.configPending, false, "export of the configuration file")
	d.unrestored = try(d.unrestored, true, "export of the state file")
}
