package rnbd

import (
	"fmt"
	"sort"
	"syscall"

	"github.com/rnbd/rnbd/pkg/log"
)

// Session names bound to identities.
//
// A client chooses its session name, and the name selects things: the
// %SESSNAME% directory of dev_search_path, an export's Allow list, and
// the one session the server lets have it. With authenticated clients
// (TLS) and SrvConfig.BindSessionNames, a name taken by an identity is
// bound to it once its session was admitted — it opened a device: from
// then on only that identity may take it, across restarts of either end
// (the binding is kept with the exports). So a peer that connects first
// after a server restart cannot lock a client out of its name, nor reach
// its %SESSNAME% directory. A session refused (at connect, or every OPEN
// it sent) binds nothing: a client that was never let in leaves no
// claim behind; while it is connected the name is its session's anyway,
// as any session's is. A client without an identity (RDMA beside TLS)
// binds nothing and may not take a bound name. An operator frees a name
// (ForgetSessionName) or gives it to an identity in advance
// (BindSessionName). Without BindSessionNames the bindings are kept but
// not enforced, and nothing new is bound.

// MaxNamesPerIdentity bounds the names one identity binds: past it, its
// new sessions take their names unbound, as without TLS, so that one
// client cannot fill the state file.
const MaxNamesPerIdentity = 256

// SessionOwner is one binding: a session name and the identity that
// holds it.
type SessionOwner struct {
	Name     string `json:"sessname"`
	Identity string `json:"identity"`
}

// ClaimSessionName implements rtrs.NameClaimer: a name bound to another
// identity than identity is refused with EACCES (a client without an
// identity may take no bound name). It binds nothing: admitName does,
// when the session opens a device.
func (s *Server) ClaimSessionName(name, identity string) error {
	if !s.cfg.BindSessionNames {
		return nil
	}
	s.ownMu.Lock()
	owner, bound := s.owners[name]
	s.ownMu.Unlock()
	if bound && owner != identity {
		return s.refuseName(name, identity, owner)
	}
	return nil
}

// refuseName is the refusal of name, bound to owner, to identity.
func (s *Server) refuseName(name, identity, owner string) error {
	who := identity
	if who == "" {
		who = "a client without a certificate"
	}
	s.rl.Log(s.log.WithFields(log.Fields{"session": name, "peer": who, "owner": owner}), log.WarnLevel,
		"session name refused: it belongs to another identity")
	return fmt.Errorf("session name %q belongs to identity %q, not %s: %w", name, owner, who, syscall.EACCES)
}

// admitName binds name to identity when its session was admitted: an
// OPEN of it succeeded. A name that is free binds (unless identity is
// empty, or has bound MaxNamesPerIdentity names); one bound to another
// identity meanwhile (the operator's BindSessionName, which disconnects
// the session too) is refused with EACCES, and the OPEN with it.
func (s *Server) admitName(name, identity string) error {
	if !s.cfg.BindSessionNames {
		return nil
	}
	s.ownMu.Lock()
	owner, bound := s.owners[name]
	bind := !bound && identity != "" && s.ownedBy(identity) < MaxNamesPerIdentity
	if bind {
		s.owners[name] = identity
	}
	s.ownMu.Unlock()
	switch {
	case bound && owner != identity:
		return s.refuseName(name, identity, owner)
	case bind:
		s.log.WithFields(log.Fields{"session": name, "identity": identity}).Info("session name bound to its identity")
		s.ownersChanged()
	case !bound && identity != "":
		s.rl.Log(s.log.WithFields(log.Fields{"session": name, "identity": identity, "max": MaxNamesPerIdentity}), log.WarnLevel,
			"session name left unbound: its identity has bound as many as it may")
	}
	return nil
}

// ownedBy counts the names identity holds. ownMu is held.
// +checklocks:s.ownMu
func (s *Server) ownedBy(identity string) int {
	n := 0
	for _, id := range s.owners {
		if id == identity {
			n++
		}
	}
	return n
}

func (s *Server) ownersChanged() {
	if s.cfg.OwnersChanged != nil {
		s.cfg.OwnersChanged()
	}
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
	if len(m) > 0 && !s.cfg.BindSessionNames {
		s.log.WithField("names", len(m)).Warn("session names are bound to identities, but bindings are not enforced " +
			"(no TLS, or bind_session_names off): any client may take them")
	}
}

// holder is the connected session that has name, if any.
func (s *Server) holder(name string) *SrvSession {
	for _, x := range s.Sessions() {
		if x.name == name {
			return x
		}
	}
	return nil
}

// ForgetSessionName frees a bound name: the next identity to take it
// binds it. ENOENT if the name is not bound; EBUSY while a session has
// it (it would bind it again when it reconnects: disconnect it first, or
// give the name to an identity with BindSessionName).
func (s *Server) ForgetSessionName(name string) (identity string, err error) {
	if x := s.holder(name); x != nil {
		return "", fmt.Errorf("session %s is connected (peer %q): disconnect it first, or bind the name to another identity: %w",
			name, x.rtrs.Identity(), syscall.EBUSY)
	}
	s.ownMu.Lock()
	identity, ok := s.owners[name]
	delete(s.owners, name)
	s.ownMu.Unlock()
	if !ok {
		return "", fmt.Errorf("session name %q is not bound to an identity: %w", name, syscall.ENOENT)
	}
	// A path may have taken the name under the binding just removed
	// while its session was not among Sessions yet: once the namings
	// under way are done, such a session is seen by the transport, and
	// the binding is put back (unless a claim after the removal bound
	// the name anew).
	if s.cfg.NameHeld != nil && s.cfg.NameHeld(name) {
		s.ownMu.Lock()
		if _, bound := s.owners[name]; !bound {
			s.owners[name] = identity
		}
		s.ownMu.Unlock()
		return "", fmt.Errorf("session %s is connecting: disconnect it first, or bind the name to another identity: %w", name, syscall.EBUSY)
	}
	s.log.WithFields(log.Fields{"session": name, "identity": identity}).Info("session name freed")
	return identity, nil
}

// BindSessionName gives name to identity, replacing any binding, and
// disconnects a session that has the name under another identity (its
// client then cannot take it back). It returns how many were
// disconnected.
func (s *Server) BindSessionName(name, identity string) (int, error) {
	if identity == "" {
		return 0, fmt.Errorf("binding session name %q: no identity: %w", name, syscall.EINVAL)
	}
	s.ownMu.Lock()
	was := s.owners[name]
	s.owners[name] = identity
	s.ownMu.Unlock()
	s.log.WithFields(log.Fields{"session": name, "identity": identity, "was": was}).Info("session name bound by the operator")
	x := s.holder(name)
	if x == nil || x.rtrs.Identity() == identity {
		return 0, nil
	}
	for _, p := range x.rtrs.Paths() {
		p.Disconnect()
	}
	return 1, nil
}
