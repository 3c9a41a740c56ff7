package rnbd

import (
	"context"
	"errors"
	"fmt"
	"syscall"
	"testing"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/testca"
)

// take is a session of identity connecting with name (the claim) and
// being admitted (an OPEN that succeeded), as the server sees it.
func take(s *Server, name, identity string) error {
	if err := s.ClaimSessionName(name, identity); err != nil {
		return err
	}
	return s.admitName(name, identity)
}

// TestSessionNameBinding: a name binds to the first identity admitted
// with it and is refused (EACCES) to any other, and to a client without
// an identity; a client without one binds nothing; bindings restore and
// can be forgotten.
func TestSessionNameBinding(t *testing.T) {
	changed := 0
	s := NewServer(SrvConfig{BindSessionNames: true, OwnersChanged: func() { changed++ }, HealthInterval: -1})
	defer s.Close()
	for _, c := range []struct {
		name, id string
		want     error
	}{
		{"a", "client-a", nil},
		{"a", "client-a", nil},
		{"a", "client-b", syscall.EACCES},
		{"a", "", syscall.EACCES},
		{"plain", "", nil},
		{"plain", "client-b", nil}, // free until an identity takes it
		{"plain", "", syscall.EACCES},
	} {
		if err := take(s, c.name, c.id); !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
			t.Errorf("take %q by %q: %v, want %v", c.name, c.id, err, c.want)
		}
	}
	if changed != 2 {
		t.Errorf("OwnersChanged told %d times, want 2 (a, plain)", changed)
	}
	got := s.SessionOwners()
	if len(got) != 2 || got[0] != (SessionOwner{"a", "client-a"}) || got[1] != (SessionOwner{"plain", "client-b"}) {
		t.Fatalf("owners %v", got)
	}
	s2 := NewServer(SrvConfig{BindSessionNames: true, HealthInterval: -1})
	defer s2.Close()
	s2.SetSessionOwners(append(got, SessionOwner{"", "x"}, SessionOwner{"y", ""}))
	if err := s2.ClaimSessionName("a", "client-b"); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("restored binding not kept: %v", err)
	}
	if id, err := s2.ForgetSessionName("a"); err != nil || id != "client-a" {
		t.Fatalf("forget: %q %v", id, err)
	}
	if _, err := s2.ForgetSessionName("a"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("forget twice: %v, want ENOENT", err)
	}
	if err := take(s2, "a", "client-b"); err != nil {
		t.Fatalf("a freed name: %v", err)
	}
	if got := s2.SessionOwners(); len(got) != 2 || got[0] != (SessionOwner{"a", "client-b"}) {
		t.Fatalf("owners after forget and take %v", got)
	}
	// The operator gives a name to an identity, in advance or instead
	// of another.
	if n, err := s2.BindSessionName("a", "client-c"); err != nil || n != 0 {
		t.Fatalf("bind: %d %v", n, err)
	}
	if err := s2.ClaimSessionName("a", "client-b"); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("a name bound to client-c, claimed by client-b: %v", err)
	}
	if _, err := s2.BindSessionName("b", ""); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("bind to no identity: %v", err)
	}
}

// TestSessionNameBoundOnAdmission: a claim — a session connecting with
// the name — binds nothing; the name binds when its session is admitted
// (admitName, at its first OPEN that succeeds). A name the operator gave
// to another identity between the claim and the admission is refused
// then (EACCES).
func TestSessionNameBoundOnAdmission(t *testing.T) {
	changed := 0
	s := NewServer(SrvConfig{BindSessionNames: true, OwnersChanged: func() { changed++ }, HealthInterval: -1})
	defer s.Close()
	if err := s.ClaimSessionName("intr", "intruder"); err != nil {
		t.Fatal(err)
	}
	if got := s.SessionOwners(); len(got) != 0 || changed != 0 {
		t.Fatalf("a claim bound %v (OwnersChanged %d), want nothing until admitted", got, changed)
	}
	if err := s.ClaimSessionName("intr", "client-a"); err != nil {
		t.Fatalf("a name claimed, never admitted, is free: %v", err)
	}
	if err := s.admitName("intr", "client-a"); err != nil {
		t.Fatal(err)
	}
	if got := s.SessionOwners(); len(got) != 1 || got[0] != (SessionOwner{"intr", "client-a"}) || changed != 1 {
		t.Fatalf("owners after admission %v (OwnersChanged %d)", got, changed)
	}
	if err := s.ClaimSessionName("late", "client-b"); err != nil {
		t.Fatal(err)
	}
	if _, err := s.BindSessionName("late", "client-c"); err != nil {
		t.Fatal(err)
	}
	if err := s.admitName("late", "client-b"); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("admission of a name given to another meanwhile: %v, want EACCES", err)
	}
}

// TestSessionNameBindingOff: without BindSessionNames (no TLS, or
// bind_session_names off) restored bindings are kept but not enforced,
// and nothing new binds.
func TestSessionNameBindingOff(t *testing.T) {
	s := NewServer(SrvConfig{HealthInterval: -1})
	defer s.Close()
	s.SetSessionOwners([]SessionOwner{{"a", "client-a"}})
	for _, id := range []string{"", "client-b"} {
		if err := s.ClaimSessionName("a", id); err != nil {
			t.Fatalf("claim by %q with bindings off: %v", id, err)
		}
	}
	if err := take(s, "new", "client-b"); err != nil {
		t.Fatal(err)
	}
	if got := s.SessionOwners(); len(got) != 1 || got[0] != (SessionOwner{"a", "client-a"}) {
		t.Fatalf("owners %v, want the restored one only", got)
	}
}

// TestSessionNamesPerIdentity: one identity binds at most
// MaxNamesPerIdentity names; past it its sessions take names unbound.
func TestSessionNamesPerIdentity(t *testing.T) {
	s := NewServer(SrvConfig{BindSessionNames: true, HealthInterval: -1})
	defer s.Close()
	for i := 0; i < MaxNamesPerIdentity+10; i++ {
		if err := take(s, fmt.Sprintf("n%d", i), "greedy"); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(s.SessionOwners()); got != MaxNamesPerIdentity {
		t.Fatalf("%d names bound to one identity, want %d", got, MaxNamesPerIdentity)
	}
	if err := take(s, fmt.Sprintf("n%d", MaxNamesPerIdentity+5), "other"); err != nil {
		t.Fatalf("an unbound name past the cap: %v", err)
	}
}

// TestForgetWhileConnecting: a forget that races a path taking the name
// (the transport has the session, Sessions not yet) fails with EBUSY and
// leaves the binding; if a claim bound the name anew meanwhile, that
// binding stays.
func TestForgetWhileConnecting(t *testing.T) {
	var s *Server
	var held func(string) bool
	s = NewServer(SrvConfig{BindSessionNames: true, HealthInterval: -1,
		NameHeld: func(name string) bool { return held(name) }})
	defer s.Close()
	s.SetSessionOwners([]SessionOwner{{"a", "client-a"}, {"b", "client-a"}, {"c", "client-a"}})

	held = func(string) bool { return true } // client-a's path took "a" just before
	if _, err := s.ForgetSessionName("a"); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("forget of a name being taken: %v, want EBUSY", err)
	}
	held = func(name string) bool {
		// client-b took "b" right after the binding was removed.
		if err := take(s, name, "client-b"); err != nil {
			t.Errorf("claim of a freed name: %v", err)
		}
		return true
	}
	if _, err := s.ForgetSessionName("b"); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("forget of a name taken anew: %v, want EBUSY", err)
	}
	held = func(string) bool { return false }
	if id, err := s.ForgetSessionName("c"); err != nil || id != "client-a" {
		t.Fatalf("forget of a name no session has: %q %v", id, err)
	}
	want := []SessionOwner{{"a", "client-a"}, {"b", "client-b"}}
	if got := s.SessionOwners(); fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("owners %v, want %v", got, want)
	}
}

// TestSessionNameBoundByOpen: over TLS, a session whose every OPEN is
// refused (an identity the export grants nothing, a device the server
// does not have) binds no name, though it connected with one and holds
// it while connected; the first OPEN that succeeds binds the session's
// name to its identity.
func TestSessionNameBoundByOpen(t *testing.T) {
	ca := testca.New(t, "test ca")
	changed := make(chan struct{}, 8)
	r := newSrigOn(t, SrvConfig{BindSessionNames: true, OwnersChanged: func() { changed <- struct{}{} }}, nil,
		tcp.Options{TLS: ca.Config(ca.Issue(t, "server", srvAddr.Addr().String()))})
	if err := r.srv.Map(Export{Name: "vol", Path: r.file("exp/x", 1<<20), AllowIdentities: []Grant{{"alice", "rw"}}}); err != nil {
		t.Fatal(err)
	}
	as := func(cn, sess string) *CltSession {
		return r.clientOn(r.net.FabricWith(tcp.Options{TLS: ca.Config(ca.Issue(t, cn))}), sess)
	}
	intruder := as("intruder", "intr")
	if _, err := intruder.open(context.Background(), "vol", AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("an identity the export grants nothing: %v, want EACCES", err)
	}
	alice := as("alice", "s1")
	if _, err := alice.open(context.Background(), "nosuch", AccessRW); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("a device the server does not have: %v, want ENOENT", err)
	}
	if got := r.srv.SessionOwners(); len(got) != 0 || len(changed) != 0 {
		t.Fatalf("owners after refused OPENs: %v (OwnersChanged %d times), want none", got, len(changed))
	}
	r.dev(alice, "vol", AccessRW)
	if got := r.srv.SessionOwners(); len(got) != 1 || got[0] != (SessionOwner{"s1", "alice"}) || len(changed) != 1 {
		t.Fatalf("owners after an OPEN that succeeded: %v (OwnersChanged %d times)", got, len(changed))
	}
}
