package rnbd

import (
	"fmt"
	"io/fs"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"syscall"
)

// Explicit exports (rnbd-server map NAME PATH) and the rules an OPEN of
// one must pass: the session name, the client's network, its identity's
// grant, read-only. Map refuses at once a path that can never be served.

// Export is a device served under a name chosen by the administrator
// (rnbd-server map NAME PATH).
type Export struct {
	Name     string   `json:"name"`
	Path     string   `json:"path"`
	ReadOnly bool     `json:"read_only,omitempty"`
	Allow    []string `json:"allow,omitempty"` // session names; empty: every session
	// AllowFrom are the networks (CIDR prefixes) an OPEN may come from:
	// the client address of the path it arrives on. Empty: any.
	AllowFrom []netip.Prefix `json:"allow_from,omitempty"`
	// Migration lets a second session open the export read-write with
	// access_mode=migration beside a writer (live migration). Off, such
	// an OPEN is refused while another session writes: any peer could
	// otherwise write to a device another holds. Alone, migration opens
	// as rw does.
	Migration bool `json:"migration,omitempty"`
	// AllowIdentities are the client identities that may open the
	// export, each with the most it may open it for. A client's
	// identities are the names of its TLS certificate on the TCP fabric
	// (rtrs.SrvSession.PeerNames), which the client cannot choose as it
	// chooses its session name. Set, a client without a certificate (TCP
	// without TLS, RDMA) cannot open the export, and access_mode
	// migration needs a grant of migration (which lets the client write
	// beside another writer whatever Migration says). Empty: any client,
	// by the other rules.
	AllowIdentities []Grant `json:"allow_identities,omitempty"`
	// GrantsOnly: only the identities of AllowIdentities may open the
	// export, and with none, no client may. It is what grants given one
	// at a time (Server.Grant, Server.Revoke) need: revoking the last
	// grant closes the export rather than opening it to every client.
	GrantsOnly bool `json:"grants_only,omitempty"`
	// MaxSessions bounds the sessions that have the export open at once;
	// 0: no bound. One more OPEN is refused with EUSERS.
	MaxSessions int `json:"max_sessions,omitempty"`
	// WriteThrough makes every write durable when it completes, and
	// OPEN_RSP then announces no write cache: clients do not flush.
	WriteThrough bool `json:"write_through,omitempty"`

	withdrawing bool // being unmapped: no new opens
}

// AllowsFrom reports whether an OPEN from a may open e (AllowFrom).
func (e *Export) AllowsFrom(a netip.Addr) bool {
	if len(e.AllowFrom) == 0 {
		return true
	}
	a = a.Unmap()
	for _, p := range e.AllowFrom {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// Grant is an entry of Export.AllowIdentities.
type Grant struct {
	Identity string `json:"identity"`
	// Access is the most the identity may open the export for: "ro",
	// "rw" or "migration" (each allows the ones before it).
	Access string `json:"access"`
}

// ParseGrant parses NAME or NAME=ACCESS (access rw by default).
func ParseGrant(s string) (Grant, error) {
	g := Grant{Identity: s, Access: "rw"}
	if i := strings.LastIndexByte(s, '='); i >= 0 {
		if _, err := ParseAccessMode(s[i+1:]); err == nil {
			g.Identity, g.Access = s[:i], s[i+1:]
		}
	}
	if g.Identity == "" {
		return g, fmt.Errorf("identity %q: want NAME or NAME=ro|rw|migration", s)
	}
	return g, nil
}

func (g Grant) String() string { return g.Identity + "=" + g.Access }

// Granted returns the most a client of the peer names (its identities)
// may open e for, and whether it may open it at all by them (the other
// rules apply too: AllowsFrom, Allow, ReadOnly). Of several matching
// grants the widest counts.
func (e *Export) Granted(peer []string) (AccessMode, bool) {
	if len(e.AllowIdentities) == 0 && !e.GrantsOnly {
		return AccessMigration, true
	}
	best, ok := AccessRO, false
	for _, g := range e.AllowIdentities {
		if !slices.Contains(peer, g.Identity) {
			continue
		}
		m, _ := ParseAccessMode(g.Access) // checked by Map
		if !ok || m > best {
			best, ok = m, true
		}
	}
	return best, ok
}

// admit checks an OPEN of e by session x in mode, from a client at
// from, against e's rules: the session name, the client's network, its
// identity's grant, read-only. It reports whether the session may write
// beside another writer (access_mode=migration: Migration, or a grant of
// migration where grants are given).
func (e *Export) admit(x *SrvSession, mode AccessMode, from netip.Addr) (secondWriter bool, err error) {
	if !e.allows(x.name) {
		return false, errorf(syscall.EPERM, "export %s does not allow session %s", e.Name, x.name)
	}
	if !e.AllowsFrom(from) {
		return false, errorf(syscall.EPERM, "export %s does not allow clients at %v", e.Name, from)
	}
	peer := x.rtrs.PeerNames()
	most, ok := e.Granted(peer)
	switch {
	case !ok && len(peer) == 0:
		return false, errorf(syscall.EACCES, "export %s allows only clients with a certificate it names, and this one has none", e.Name)
	case !ok && len(e.AllowIdentities) == 0:
		return false, errorf(syscall.EACCES, "export %s grants no client access (grants_only, and no grant)", e.Name)
	case !ok:
		return false, errorf(syscall.EACCES, "export %s does not allow client %s", e.Name, strings.Join(peer, ", "))
	case mode > most:
		return false, errorf(syscall.EACCES, "export %s allows client %s only %s", e.Name, x.rtrs.Identity(), most)
	}
	if e.ReadOnly && mode != AccessRO {
		// EROFS, not the kernel's EPERM: the client can say which.
		return false, errorf(syscall.EROFS, "export %s is read-only", e.Name)
	}
	if len(e.AllowIdentities) > 0 || e.GrantsOnly {
		return most == AccessMigration, nil
	}
	return e.Migration, nil
}

func (e *Export) allows(sess string) bool {
	if len(e.Allow) == 0 {
		return true
	}
	for _, a := range e.Allow {
		if a == sess {
			return true
		}
	}
	return false
}

// Map adds an explicit export. Its path is looked at (SrvConfig.Stat):
// one that is gone, or can never be served (unservable), is refused.
// Paths are checked again when a session opens them.
func (s *Server) Map(e Export) error {
	if err := e.check(); err != nil {
		return err
	}
	fi, err := s.stat(e.Path)
	return s.add(e, fi, err)
}

// MapStat is Map with the look at e.Path made by the caller: fi and
// statErr are what a stat of it gave. The daemon looks once, bounded (a
// stat on a mount that does not answer never returns), before it takes
// its own locks, and maps with what it found.
func (s *Server) MapStat(e Export, fi os.FileInfo, statErr error) error {
	if err := e.check(); err != nil {
		return err
	}
	return s.add(e, fi, statErr)
}

// check refuses an export Map cannot take, whatever its path is.
func (e *Export) check() error {
	if e.Name == "" || len(e.Name) >= nameMax || strings.IndexByte(e.Name, 0) >= 0 {
		return errorf(syscall.EINVAL, "export name %q: want 1..254 bytes without NUL", e.Name)
	}
	if !filepath.IsAbs(e.Path) {
		return errorf(syscall.EINVAL, "export path %q must be absolute", e.Path)
	}
	if e.MaxSessions < 0 {
		return errorf(syscall.EINVAL, "export %s: max_sessions %d", e.Name, e.MaxSessions)
	}
	for _, g := range e.AllowIdentities {
		if _, err := ParseAccessMode(g.Access); err != nil || g.Identity == "" {
			return errorf(syscall.EINVAL, "export %s: allow_identities entry %q: want an identity and ro, rw or migration", e.Name, g.String())
		}
	}
	return nil
}

// add adds e (checked) with what a stat of its path gave.
func (s *Server) add(e Export, fi os.FileInfo, statErr error) error {
	if err := lookAt(e.Name, e.Path, fi, statErr); err != nil {
		return err
	}
	e.AllowIdentities = slices.Clone(e.AllowIdentities)
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.exports[e.Name]; ok {
		return errorf(syscall.EEXIST, "export %s already exists", e.Name)
	}
	e.Allow = append([]string(nil), e.Allow...)
	e.AllowFrom = append([]netip.Prefix(nil), e.AllowFrom...)
	for i, p := range e.AllowFrom {
		if !p.IsValid() {
			return errorf(syscall.EINVAL, "export %s: invalid network in allow_from", e.Name)
		}
		e.AllowFrom[i] = p.Masked()
	}
	s.exports[e.Name] = &e
	return nil
}

// Grant gives identity g.Access to export name, replacing a grant it
// had, and makes the export GrantsOnly. It reports whether anything
// changed (the same grant again changes nothing). Sessions that have
// the export open keep it as they opened it.
func (s *Server) Grant(name string, g Grant) (changed bool, err error) {
	if _, err := ParseAccessMode(g.Access); err != nil || g.Identity == "" {
		return false, errorf(syscall.EINVAL, "export %s: grant %q: want an identity and ro, rw or migration", name, g.String())
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e, changed, err := s.grantsOnly(name)
	if err != nil {
		return false, err
	}
	i := slices.IndexFunc(e.AllowIdentities, func(h Grant) bool { return h.Identity == g.Identity })
	switch {
	case i < 0:
		e.AllowIdentities = append(slices.Clone(e.AllowIdentities), g)
		changed = true
	case e.AllowIdentities[i] != g:
		e.AllowIdentities = slices.Clone(e.AllowIdentities)
		e.AllowIdentities[i] = g
		changed = true
	}
	return changed, nil
}

// Revoke takes identity's grant off export name and makes it
// GrantsOnly: with no grant left, no client may open it. A grant that
// is not there is no change, and no error. Sessions that have the
// export open keep it (ForceClose closes it for them); their next OPEN
// is refused.
func (s *Server) Revoke(name, identity string) (changed bool, err error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	e, changed, err := s.grantsOnly(name)
	if err != nil {
		return false, err
	}
	if i := slices.IndexFunc(e.AllowIdentities, func(h Grant) bool { return h.Identity == identity }); i >= 0 {
		e.AllowIdentities = slices.Delete(slices.Clone(e.AllowIdentities), i, i+1)
		changed = true
	}
	return changed, nil
}

// grantsOnly makes export name GrantsOnly, reporting whether it was
// not.
// +checklocks:s.mu
func (s *Server) grantsOnly(name string) (e *Export, changed bool, err error) {
	e = s.exports[name]
	if e == nil || e.withdrawing {
		return nil, false, errorf(syscall.ENOENT, "no export %s", name)
	}
	changed = !e.GrantsOnly
	e.GrantsOnly = true
	return e, changed, nil
}

// Unmap withdraws an export. Without force it refuses while a session has
// it open; with force it closes it for every session, keeping their device
// ids reserved so their later IO fails with ENOTCONN.
func (s *Server) Unmap(name string, force bool) error {
	s.mu.Lock()
	e := s.exports[name]
	if e == nil || e.withdrawing {
		s.mu.Unlock()
		return errorf(syscall.ENOENT, "no export %s", name)
	}
	e.withdrawing = true // opens from now on fail; those under way finish
	s.mu.Unlock()
	open := s.collect(func(d *SrvSessDev) bool { return d.export == name })
	s.mu.Lock()
	if len(open) > 0 && !force {
		e.withdrawing = false
		s.mu.Unlock()
		return errorf(syscall.EBUSY, "export %s is open by %d session(s); --force closes it for them", name, len(open))
	}
	delete(s.exports, name)
	s.mu.Unlock()
	for _, d := range open {
		d.forceClose()
	}
	return nil
}

// lookAt judges what a stat of an export's path gave (fi, err): an
// error if the path is gone or, with the daemon's bounded look, did not
// answer in time, and for what can never be served (unservable).
func lookAt(name, path string, fi os.FileInfo, err error) error {
	if err != nil {
		return fmt.Errorf("export %s: %w", name, err)
	}
	if fi == nil { // (a test's Stat may say nothing)
		return nil
	}
	return unservable(name, path, fi.Mode())
}

// unservable refuses a path that is no regular file or block device: a
// directory (EISDIR), a FIFO, a socket or a character device (EINVAL).
// Such an export would be accepted and every OPEN of it fail; the
// operator learns it at map, with the reason.
func unservable(name, path string, mode fs.FileMode) error {
	var what string
	switch {
	case mode.IsRegular(), mode&fs.ModeDevice != 0 && mode&fs.ModeCharDevice == 0:
		return nil
	case mode.IsDir():
		return errorf(syscall.EISDIR, "export %s: %s is a directory: an export is a regular file or a block device", name, path)
	case mode&fs.ModeNamedPipe != 0:
		what = "a FIFO"
	case mode&fs.ModeSocket != 0:
		what = "a socket"
	case mode&fs.ModeCharDevice != 0:
		what = "a character device"
	default:
		what = "not a regular file (" + mode.Type().String() + ")"
	}
	return errorf(syscall.EINVAL, "export %s: %s is %s: an export is a regular file or a block device", name, path, what)
}

// stat is cfg.Stat, or os.Stat if none is set.
func (s *Server) stat(path string) (os.FileInfo, error) {
	if s.cfg.Stat == nil {
		return os.Stat(path)
	}
	return s.cfg.Stat(path)
}

// statExport is stat of export name's path, its error saying which.
func (s *Server) statExport(name, path string) (os.FileInfo, error) {
	fi, err := s.stat(path)
	if err != nil {
		return nil, fmt.Errorf("export %s: %w", name, err)
	}
	return fi, nil
}

// Exports lists the explicit exports, by name.
func (s *Server) Exports() []Export {
	s.mu.Lock()
	defer s.mu.Unlock()
	var es []Export
	for _, e := range s.exports {
		c := *e
		c.Allow = append([]string(nil), e.Allow...)
		c.AllowFrom = slices.Clone(e.AllowFrom)
		c.AllowIdentities = slices.Clone(e.AllowIdentities)
		es = append(es, c)
	}
	sort.Slice(es, func(i, j int) bool { return es[i].Name < es[j].Name })
	return es
}
