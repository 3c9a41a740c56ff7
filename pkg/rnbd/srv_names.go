package rnbd

import (
	"fmt"
	"sort"
	"syscall"

	"github.com/rnbd/rnbd/internal/log"
)

// Session names bound to identities.
//
// A client chooses its session name, and the name selects things: the
// %SESSNAME% directory of dev_search_path, an export's Allow list, and
// the one session the server lets have it. With authenticated clients
// (TLS), a name taken by an identity is bound to it: from then on only
// that identity may take it, across restarts of either end (the binding
// is kept with the exports). So a peer that connects first after a server
// restart cannot lock a client out of its name, nor reach its
// %SESSNAME% directory. A client without an identity (plain TCP, RDMA)
// binds nothing and may not take a bound name. An operator frees a name
// with ForgetSessionName (rnbd-server session forget).

// SessionOwner is one binding: a session name and the identity that
// holds it.
type SessionOwner struct {
	Name     string `json:"sessname"`
	Identity string `json:"identity"`
}

// ClaimSessionName implements rtrs.NameClaimer: name binds to identity
// when it is free and identity is not empty; a name bound to another
// identity is refused with EACCES.
func (s *Server) ClaimSessionName(name, identity string) error {
	s.ownMu.Lock()
	owner, bound := s.owners[name]
	if !bound && identity != "" {
		s.owners[name] = identity
	}
	s.ownMu.Unlock()
	switch {
	case bound && owner != identity:
		who := identity
		if who == "" {
			who = "a client without a certificate"
		}
		s.rl.Log(s.log.WithFields(log.Fields{"session": name, "peer": who, "owner": owner}), log.WarnLevel,
			"session name refused: it belongs to another identity")
		return fmt.Errorf("session name %q belongs to identity %q, not %s: %w", name, owner, who, syscall.EACCES)
	case !bound && identity != "":
		s.log.WithFields(log.Fields{"session": name, "identity": identity}).Info("session name bound to its identity")
		if s.cfg.OwnersChanged != nil {
			s.cfg.OwnersChanged()
		}
	}
	return nil
}

// SessionOwners returns the bindings, by name.
func (s *Server) SessionOwners() []SessionOwner {
	s.ownMu.Lock()
	defer s.ownMu.Unlock()
	out := make([]SessionOwner, 0, len(s.owners))
	for n, id := range s.owners {
		out = append(out, SessionOwner{Name: n, Identity: id})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// SetSessionOwners replaces the bindings (restoring them at start).
func (s *Server) SetSessionOwners(owners []SessionOwner) {
	m := make(map[string]string, len(owners))
	for _, o := range owners {
		if o.Name != "" && o.Identity != "" {
			m[o.Name] = o.Identity
		}
	}
	s.ownMu.Lock()
	s.owners = m
	s.ownMu.Unlock()
}

// ForgetSessionName frees a bound name: the next identity to take it
// binds it. A session that has it keeps it while it is connected. ENOENT
// if the name is not bound.
func (s *Server) ForgetSessionName(name string) (identity string, err error) {
	s.ownMu.Lock()
	identity, ok := s.owners[name]
	delete(s.owners, name)
	s.ownMu.Unlock()
	if !ok {
		return "", fmt.Errorf("session name %q is not bound to an identity: %w", name, syscall.ENOENT)
	}
	s.log.WithFields(log.Fields{"session": name, "identity": identity}).Info("session name freed")
	return identity, nil
}
