// Exports: map and unmap, grant and revoke, and an export as map and
// the configuration file's [[export]] give it, parsed.

package serverd

import (
	"errors"
	"fmt"
	"net/netip"
	"syscall"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// unservedExport is an export and where it comes from, "config" (the
// configuration file), "map" or "volume"; and why it is not served (its
// file or device could not be opened; tried again every export_retry),
// "" if it is.
type unservedExport struct {
	rnbd.Export
	Source    string
	NotServed string
}

// Map adds an export and saves the state; if saving fails the export is
// withdrawn again, so the daemon never serves what a restart would lose.
func (d *Daemon) Map(e rnbd.Export) error {
	if d.configured[e.Name] { // set at start, never changed
		return fmt.Errorf("export %s is one of the configuration file's: change it there: %w", e.Name, syscall.EEXIST)
	}
	if d.isVolume(e.Name) {
		return fmt.Errorf("export %s is a volume's: %w", e.Name, syscall.EEXIST)
	}
	// Looked at first, without the state lock: a path that does not
	// answer fails this map, not every other map and unmap with it.
	looked := d.probe.look([]string{e.Path}, probeWait)
	// A read-write export no session could open read-write (the unit's
	// sandbox) is refused here, not at every client's OPEN.
	if err := selfView.readOnly(e, looked[e.Path]); err != nil {
		return err
	}
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if d.volumes[e.Name] != nil {
		// Made a volume since the look above (a volume's name is
		// taken under the state lock).
		return fmt.Errorf("export %s is a volume's: %w", e.Name, syscall.EEXIST)
	}
	if err := d.mapLooked(e, looked); err != nil {
		return err
	}
	if err := d.saveState(); err != nil {
		d.rnbd.Unmap(e.Name, true)
		return fmt.Errorf("saving the state file: %w", err)
	}
	d.dropUnrestored(e.Name) // served now, as given
	d.log.WithFields(exportFields(e)).WithField("write_cache", d.exportCache(e)).Info("export mapped")
	return nil
}

// exportFields are the log fields of an export.
func exportFields(e rnbd.Export) log.Fields {
	return log.Fields{"export": e.Name, "path": e.Path, "read_only": e.ReadOnly, "allow": e.Allow,
		"allow_from": e.AllowFrom, "allow_identities": e.AllowIdentities, "migration": e.Migration, "max_sessions": e.MaxSessions,
		"write_through": e.WriteThrough}
}

// mapLooked maps e with what the look at its path found, unless the
// path did not answer.
func (d *Daemon) mapLooked(e rnbd.Export, looked map[string]probed) error {
	l := looked[e.Path]
	if err := l.err; errors.Is(err, syscall.ETIMEDOUT) {
		return fmt.Errorf("export %s: %w", e.Name, err)
	}
	if err := d.rnbd.MapStat(e, l.fi, l.err); err != nil {
		return selfView.missing(e.Path, err)
	}
	return nil
}

// Unmap withdraws an export and saves the state.
func (d *Daemon) Unmap(name string, force bool) error {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	if d.configured[name] {
		return fmt.Errorf("export %s is one of the configuration file's: remove it there and restart: %w", name, syscall.EPERM)
	}
	if d.isVolume(name) {
		return fmt.Errorf("export %s is a volume's: volume delete withdraws and deletes it: %w", name, syscall.EPERM)
	}
	if err := d.rnbd.Unmap(name, force); err != nil {
		if !errors.Is(err, syscall.ENOENT) || !d.dropUnrestored(name) {
			return err
		}
		// An export of the state file that is not served: unmapping
		// removes it from the file.
	}
	if err := d.saveState(); err != nil {
		return fmt.Errorf("export withdrawn, but saving the state file failed: %w", err)
	}
	d.log.WithFields(log.Fields{"export": name, "force": force}).Info("export unmapped")
	return nil
}

// Grant gives an identity access to an export, and Revoke takes it
// back; both save the state. The configuration file's exports are
// changed there.
//
// grants says which exports may be changed: any, or volumes' only (a
// provisioner's), checked with the change under the state lock.
func (d *Daemon) Grant(export string, g rnbd.Grant, grants grantScope) error {
	return d.changeGrants(export, grants, func() (bool, error) { return d.rnbd.Grant(export, g) },
		log.Fields{"export": export, "identity": g.Identity, "access": g.Access}, "grant given")
}

// Revoke: see Grant.
func (d *Daemon) Revoke(export, identity string, grants grantScope) error {
	return d.changeGrants(export, grants, func() (bool, error) { return d.rnbd.Revoke(export, identity) },
		log.Fields{"export": export, "identity": identity}, "grant revoked")
}

// grantScope is which exports a grant or revoke may change.
type grantScope int

const (
	anyExport grantScope = iota
	// volumesOnly: a volume's export; another is not_found (no such
	// volume).
	volumesOnly
	// volumesOnlyRefused: a volume's export; another is refused
	// permission_denied (a provisioner on an export's route).
	volumesOnlyRefused
)

func (d *Daemon) changeGrants(export string, grants grantScope, change func() (bool, error), fields log.Fields, what string) error {
	d.stateMu.Lock()
	defer d.stateMu.Unlock()
	switch {
	case grants == volumesOnly && d.volumes[export] == nil:
		return ctl.Errorf(ctl.CodeNotFound, "no volume %s", export)
	case grants == volumesOnlyRefused && d.volumes[export] == nil:
		return ctl.Errorf(ctl.CodePermission, "export %s is not a volume's: a provisioner grants and revokes the volumes' exports only", export)
	}
	if d.configured[export] {
		return fmt.Errorf("export %s is one of the configuration file's: change its allow_identities there: %w", export, syscall.EPERM)
	}
	changed, err := change()
	if err != nil {
		return err
	}
	if !changed {
		return nil
	}
	if err := d.saveState(); err != nil {
		return fmt.Errorf("%s, but saving the state file failed: %w", what, err)
	}
	d.log.WithFields(fields).Info(what)
	return nil
}

// exportOf is the export r describes, its networks and grants parsed;
// grants_only unset is false.
func exportOf(r api.MapRequest) (rnbd.Export, error) {
	if r.Name == "." || r.Name == ".." {
		// A URL path cannot carry them: the control API could not
		// name the export again (show, unmap, grants).
		return rnbd.Export{}, fmt.Errorf("export name %q: the control API cannot address it (a URL path cleans it away): choose another", r.Name)
	}
	from, err := parseNetworks(r.AllowFrom)
	if err != nil {
		return rnbd.Export{}, err
	}
	grants, err := parseGrants(r.AllowIdentities)
	if err != nil {
		return rnbd.Export{}, err
	}
	return rnbd.Export{Name: r.Name, Path: r.Path, ReadOnly: r.ReadOnly, Allow: r.Allow, AllowFrom: from,
		AllowIdentities: grants, Migration: r.Migration, MaxSessions: r.MaxSessions, WriteThrough: r.WriteThrough,
		GrantsOnly: r.GrantsOnly != nil && *r.GrantsOnly}, nil
}

// parseNetworks reads allow_from: CIDR prefixes or addresses.
func parseNetworks(ss []string) ([]netip.Prefix, error) {
	var from []netip.Prefix
	for _, s := range ss {
		p, err := parseNetwork(s)
		if err != nil {
			return nil, fmt.Errorf("allow_from %q: %v", s, err)
		}
		from = append(from, p)
	}
	return from, nil
}

// parseGrants reads allow_identities: NAME or NAME=ro|rw|migration.
func parseGrants(ss []string) ([]rnbd.Grant, error) {
	var grants []rnbd.Grant
	for _, s := range ss {
		g, err := rnbd.ParseGrant(s)
		if err != nil {
			return nil, fmt.Errorf("allow_identities: %v", err)
		}
		grants = append(grants, g)
	}
	return grants, nil
}

// parseNetwork reads a CIDR prefix, or a bare address as a prefix of
// its whole length.
func parseNetwork(s string) (netip.Prefix, error) {
	if p, err := netip.ParsePrefix(s); err == nil {
		return p.Masked(), nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, errors.New("want an address or a network like 10.0.0.0/24")
	}
	return netip.PrefixFrom(a.Unmap(), a.Unmap().BitLen()), nil
}
