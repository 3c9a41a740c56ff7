// The admin listener: the control API on TCP for remote management
// (TLS 1.3 and client certificates only, never on the data port), the
// roles of identities, the right each route needs, and discovery
// (docs/control-api.md, "The admin listener").

package serverd

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// AdminConfig is the [admin] table: where the control API is served on
// TCP, with which certificate, and which identities have which role.
type AdminConfig struct {
	// Listen are HOST[:PORT] addresses (port ctl.DefaultAdminPort if
	// none); none: the unix socket only.
	Listen []string `toml:"listen"`
	// Cert, Key and CA default to [tls]'s.
	Cert string `toml:"cert"`
	Key  string `toml:"key"`
	CA   string `toml:"ca"`
	// Admins, Provisioners and Readers are identities (names of client
	// certificates) with each role (ctl.Role).
	Admins       []string `toml:"admins"`
	Provisioners []string `toml:"provisioners"`
	Readers      []string `toml:"readers"`
	// ExportRoots are the directories under which an admin may map a
	// path over the network (POST /v1/exports on the admin listener);
	// none: no remote map at all. The unix socket's root is not bound
	// by them.
	ExportRoots []string `toml:"export_roots"`
	// The bounds of the listener (ctl.Access).
	HandshakeTimeout        Duration `toml:"handshake_timeout"`
	ReadHeaderTimeout       Duration `toml:"read_header_timeout"`
	IdleTimeout             Duration `toml:"idle_timeout"`
	MaxConnections          int      `toml:"max_connections"`
	MaxHandshakesPerAddress int      `toml:"max_handshakes_per_address"`
	MaxRequestsPerIdentity  int      `toml:"max_requests_per_identity"`
	MaxBodySize             Size     `toml:"max_body_size"`
}

// DefaultAdminConfig is [admin] unset: no listener, the bounds of ctl.
func DefaultAdminConfig() AdminConfig {
	return AdminConfig{
		HandshakeTimeout:        Duration{Duration: ctl.DefaultHandshakeTimeout},
		ReadHeaderTimeout:       Duration{Duration: ctl.DefaultReadHeaderTimeout},
		IdleTimeout:             Duration{Duration: ctl.DefaultIdleTimeout},
		MaxConnections:          ctl.DefaultMaxConnections,
		MaxHandshakesPerAddress: ctl.DefaultMaxHandshakesPerAddress,
		MaxRequestsPerIdentity:  ctl.DefaultMaxRequestsPerIdentity,
		MaxBodySize:             Size(ctl.DefaultMaxBodySize),
	}
}

// adminTLS is the admin listener's TLS: [admin]'s files, each defaulting
// to [tls]'s.
func (c *Config) adminTLS() conf.TLS {
	t := conf.TLS{Cert: c.Admin.Cert, Key: c.Admin.Key, CA: c.Admin.CA}
	if t.Cert == "" {
		t.Cert = c.TLS.Cert
	}
	if t.Key == "" {
		t.Key = c.TLS.Key
	}
	if t.CA == "" {
		t.CA = c.TLS.CA
	}
	return t
}

// AdminAddr is an [admin] listen address as HOST:PORT: the port
// ctl.DefaultAdminPort where it has none.
func AdminAddr(s string) (string, error) {
	if strings.Contains(s, "://") {
		return "", fmt.Errorf("[admin] listen %q: want HOST[:PORT] (the admin listener is TLS only, no scheme)", s)
	}
	host, port, err := net.SplitHostPort(s)
	if err != nil {
		// No port: the host alone, an IPv6 address bracketed or not.
		host, port = strings.TrimSuffix(strings.TrimPrefix(s, "["), "]"), strconv.Itoa(ctl.DefaultAdminPort)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 0 || p > 65535 {
		return "", fmt.Errorf("[admin] listen %q: port %q: want 1 to 65535 (0: any free one)", s, port)
	}
	if host == "" || strings.ContainsAny(host, "[]/ ") {
		return "", fmt.Errorf("[admin] listen %q: want HOST[:PORT], the host an address of this machine (0.0.0.0 or [::] for every one)", s)
	}
	return net.JoinHostPort(host, port), nil
}

// validate checks [admin] against the rest of the configuration c: its
// addresses are none of the fabric's nor the metrics', it has TLS, and
// no identity has two roles.
func (a AdminConfig) validate(c *Config) error {
	if a.HandshakeTimeout.Duration < 100*time.Millisecond || a.ReadHeaderTimeout.Duration < 100*time.Millisecond || a.IdleTimeout.Duration < time.Second {
		return fmt.Errorf("[admin] handshake_timeout %v, read_header_timeout %v, idle_timeout %v: at least 100ms, 100ms and 1s",
			a.HandshakeTimeout.Duration, a.ReadHeaderTimeout.Duration, a.IdleTimeout.Duration)
	}
	if a.MaxConnections < 1 || a.MaxHandshakesPerAddress < 1 || a.MaxRequestsPerIdentity < 1 || a.MaxBodySize < 4096 {
		return fmt.Errorf("[admin] max_connections %d, max_handshakes_per_address %d, max_requests_per_identity %d, max_body_size %d: "+
			"at least 1, 1, 1 and 4096 bytes", a.MaxConnections, a.MaxHandshakesPerAddress, a.MaxRequestsPerIdentity, int64(a.MaxBodySize))
	}
	roles := map[string]ctl.Role{}
	for _, l := range []struct {
		key  string
		ids  []string
		role ctl.Role
	}{{"admins", a.Admins, ctl.RoleAdmin}, {"provisioners", a.Provisioners, ctl.RoleProvisioner}, {"readers", a.Readers, ctl.RoleReader}} {
		for _, id := range l.ids {
			if id == "" || id == ctl.LocalIdentity {
				return fmt.Errorf("[admin] %s: identity %q: want a name of a client certificate (%q is the unix socket's root)", l.key, id, ctl.LocalIdentity)
			}
			if r, dup := roles[id]; dup {
				return fmt.Errorf("[admin] %s: identity %s has the role %s already: give each identity one role", l.key, id, r)
			}
			roles[id] = l.role
		}
	}
	for _, r := range a.ExportRoots {
		if !filepath.IsAbs(r) || filepath.Clean(r) != r || r == "/" {
			return fmt.Errorf("[admin] export_roots: %q: want an absolute, clean directory other than / (e.g. /srv/rnbd)", r)
		}
	}
	if len(a.Listen) == 0 {
		return nil
	}
	if t := c.adminTLS(); t.Cert == "" || t.Key == "" || t.CA == "" {
		return errors.New("[admin] listen is set, but not cert, key and ca, in [admin] or [tls]: the control API is served on " +
			"the network only with TLS 1.3 and client certificates of a CA (scripts/test-ca.sh makes a test one)")
	}
	for _, s := range a.Listen {
		addr, err := AdminAddr(s)
		if err != nil {
			return err
		}
		for _, l := range c.Listen {
			if fl, err := rtrs.ParseListen(l); err == nil && fl.Transport == "tcp" && sameListener(addr, fl.Addr.String()) {
				return fmt.Errorf("[admin] listen %s: the fabric listens there (%s): the control API is never served on the data port; give it a port of its own (default %d)",
					s, l, ctl.DefaultAdminPort)
			}
		}
		if c.MetricsListen != "" && sameListener(addr, c.MetricsListen) {
			return fmt.Errorf("[admin] listen %s: metrics_listen is there (%s)", s, c.MetricsListen)
		}
	}
	return nil
}

// sameListener reports whether two HOST:PORT addresses would take the
// same port: the same port, and the same host or either every
// interface's (or a name, which is not resolved here).
func sameListener(a, b string) bool {
	ha, pa, err1 := net.SplitHostPort(a)
	hb, pb, err2 := net.SplitHostPort(b)
	if err1 != nil || err2 != nil || pa != pb || pa == "0" {
		return false // port 0: each its own free port
	}
	ia, errA := netip.ParseAddr(ha)
	ib, errB := netip.ParseAddr(hb)
	if errA != nil || errB != nil {
		return true
	}
	return ia.Unmap() == ib.Unmap() || ia.IsUnspecified() || ib.IsUnspecified()
}

// roleOf is the role of a certificate's names and the name that gives
// it: the one role its names that have one give, and the first of them
// (none: no role, and ""). Names that give different roles are an
// error that names them: such a certificate is refused, rather than
// given the most power any of its names has (docs/control-api.md,
// "Roles").
func (a AdminConfig) roleOf(names []string) (ctl.Role, string, error) {
	role, by, mixed := ctl.RoleNone, "", false
	var given []string
	for _, n := range names {
		var r ctl.Role
		switch {
		case slices.Contains(a.Admins, n):
			r = ctl.RoleAdmin
		case slices.Contains(a.Provisioners, n):
			r = ctl.RoleProvisioner
		case slices.Contains(a.Readers, n):
			r = ctl.RoleReader
		default:
			continue
		}
		given = append(given, n+" "+string(r))
		if by == "" {
			role, by = r, n
		}
		mixed = mixed || r != role
	}
	if mixed {
		return ctl.RoleNone, "", fmt.Errorf("its names give different roles in [admin] (%s): a certificate may have one role; "+
			"give it names of one role, or name one of them in no role list", strings.Join(given, ", "))
	}
	return role, by, nil
}

// listenAdmin sets who may call the control API, with the audit log,
// adds discovery, and opens the admin listeners if [admin] has any.
func (d *Daemon) listenAdmin() error {
	a := d.cfg.Admin
	d.ctl.SetAccess(ctl.Access{Rights: api.ServerRoutes.Right, Roles: a.roleOf, Identify: tcp.CertNames, Log: d.log,
		HandshakeTimeout: a.HandshakeTimeout.Duration, ReadHeaderTimeout: a.ReadHeaderTimeout.Duration, IdleTimeout: a.IdleTimeout.Duration,
		MaxConnections: a.MaxConnections, MaxHandshakesPerAddress: a.MaxHandshakesPerAddress, MaxRequestsPerIdentity: a.MaxRequestsPerIdentity,
		MaxBodySize: int64(a.MaxBodySize)})
	if len(a.Listen) == 0 {
		return nil
	}
	tc, err := d.cfg.adminTLS().Config()
	if err != nil {
		return fmt.Errorf("[admin]: %w", err)
	}
	var bound []string
	for _, s := range a.Listen {
		addr, _ := AdminAddr(s) // validated
		b, err := d.ctl.ListenTLS(addr, tc)
		if err != nil {
			return err
		}
		bound = append(bound, b.String())
	}
	d.log.WithFields(log.Fields{"admin_listen": strings.Join(bound, ","), "admins": len(a.Admins), "provisioners": len(a.Provisioners),
		"readers": len(a.Readers)}).Info("admin listener: the control API on TLS 1.3 with client certificates")
	return nil
}

// underExportRoots is path, its links resolved, if it is beneath one of
// [admin] export_roots: what an export mapped over the network may
// serve. The resolved path is what is served, so that a link changed
// later does not lead outside.
func (a AdminConfig) underExportRoots(path string) (string, error) {
	if len(a.ExportRoots) == 0 {
		return "", ctl.Errorf(ctl.CodePermission, "map of %s over the admin listener: this storage node names no [admin] export_roots, "+
			"so no path may be mapped remotely (volumes may: volume create; or map it on the node itself)", path)
	}
	if !filepath.IsAbs(path) {
		return "", ctl.Errorf(ctl.CodeInvalid, "path %q: want an absolute path", path)
	}
	real, err := filepath.EvalSymlinks(path)
	if err != nil {
		return "", fmt.Errorf("path %s: %w", path, err)
	}
	for _, root := range a.ExportRoots {
		r, err := filepath.EvalSymlinks(root)
		if err != nil {
			continue
		}
		if rel, err := filepath.Rel(r, real); err == nil && rel != "." && rel != ".." && !strings.HasPrefix(rel, "../") {
			return real, nil
		}
	}
	return "", ctl.Errorf(ctl.CodePermission, "path %s (%s) is beneath none of [admin] export_roots (%s): not mapped over the network",
		path, real, strings.Join(a.ExportRoots, ", "))
}

// AdminAddrs are the addresses the admin listeners are bound to.
func (d *Daemon) AdminAddrs() []net.Addr { return d.ctl.RemoteAddrs() }

// discover answers the exports the caller may open, by the rules an
// OPEN of it would pass that do not depend on the session: its
// certificate's names against allow_identities (and grants_only), its
// address against allow_from. Each with its size and the most it may
// open it for.
func (d *Daemon) discover(r *http.Request) (any, error) {
	c := ctl.CallerOf(r)
	var from netip.Addr
	if ap, err := netip.ParseAddrPort(c.Remote); err == nil {
		from = ap.Addr().Unmap()
	}
	var open []rnbd.Export
	var access []string
	var paths []string
	for _, e := range d.rnbd.Exports() {
		if m, ok := mayOpen(e, c.Names, from); ok {
			open, access, paths = append(open, e), append(access, m), append(paths, e.Path)
		}
	}
	looked := d.probe.look(paths, probeWait)
	rows := []api.DiscoverRecord{}
	for i, e := range open {
		rows = append(rows, api.DiscoverRecord{Name: e.Name, Size: pathSize(e.Path, looked[e.Path]), Access: access[i], ReadOnly: e.ReadOnly})
	}
	return rows, nil
}

// mayOpen reports whether a client of the names at from may open e, by
// rnbd.Export's own rules (Granted, AllowsFrom), and the most it may
// open it for; ro if e is read-only. Session names (allow) are not
// known before a session: they are not looked at.
func mayOpen(e rnbd.Export, names []string, from netip.Addr) (string, bool) {
	if !from.IsValid() && len(e.AllowFrom) > 0 || !e.AllowsFrom(from) {
		return "", false
	}
	most, ok := e.Granted(names)
	switch {
	case !ok:
		return "", false
	case e.ReadOnly:
		return rnbd.AccessRO.String(), true
	case most == rnbd.AccessMigration && len(e.AllowIdentities) == 0 && !e.GrantsOnly:
		return rnbd.AccessRW.String(), true // an export open to any client: rw (migration needs its flag)
	}
	return most.String(), true
}

// pathSize is the size of an export's file or block device in bytes, or
// nil if it cannot be had now (a path that did not answer, a device that
// does not open).
func pathSize(path string, p probed) *int64 {
	switch {
	case p.err != nil || p.fi == nil:
		return nil
	case p.fi.Mode().IsRegular():
		return ptr(p.fi.Size())
	case p.fi.Mode()&os.ModeDevice == 0:
		return nil
	}
	b, err := blockdev.Open(path, blockdev.Options{ReadOnly: true})
	if err != nil {
		return nil
	}
	defer b.Close()
	return ptr(b.Size())
}
