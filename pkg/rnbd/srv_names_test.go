package rnbd

import (
	"errors"
	"fmt"
	"syscall"
	"testing"
)

// TestSessionNameBinding: a name binds to the first identity that takes
// it and is refused (EACCES) to any other, and to a client without an
// identity; a client without one binds nothing; bindings restore and
// can be forgotten.
func TestSessionNameBinding(t *testing.T) {
	changed := 0
	s := NewServer(ServerConfig{BindSessionNames: true, OwnersChanged: func() { changed++ }, HealthInterval: -1})
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
		if err := s.ClaimSessionName(c.name, c.id); !errors.Is(err, c.want) || (c.want == nil) != (err == nil) {
			t.Errorf("claim %q by %q: %v, want %v", c.name, c.id, err, c.want)
		}
	}
	if changed != 2 {
		t.Errorf("OwnersChanged told %d times, want 2 (a, plain)", changed)
	}
	got := s.SessionOwners()
	if len(got) != 2 || got[0] != (SessionOwner{"a", "client-a"}) || got[1] != (SessionOwner{"plain", "client-b"}) {
		t.Fatalf("owners %v", got)
	}
	s2 := NewServer(ServerConfig{BindSessionNames: true, HealthInterval: -1})
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
	if err := s2.ClaimSessionName("a", "client-b"); err != nil {
		t.Fatalf("a freed name: %v", err)
	}
	if got := s2.SessionOwners(); len(got) != 2 || got[0] != (SessionOwner{"a", "client-b"}) {
		t.Fatalf("owners after forget and claim %v", got)
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

// TestSessionNameBindingOff: without BindSessionNames (no TLS, or
// bind_session_names off) restored bindings are kept but not enforced,
// and nothing new binds.
func TestSessionNameBindingOff(t *testing.T) {
	s := NewServer(ServerConfig{HealthInterval: -1})
	defer s.Close()
	s.SetSessionOwners([]SessionOwner{{"a", "client-a"}})
	for _, id := range []string{"", "client-b"} {
		if err := s.ClaimSessionName("a", id); err != nil {
			t.Fatalf("claim by %q with bindings off: %v", id, err)
		}
	}
	if err := s.ClaimSessionName("new", "client-b"); err != nil {
		t.Fatal(err)
	}
	if got := s.SessionOwners(); len(got) != 1 || got[0] != (SessionOwner{"a", "client-a"}) {
		t.Fatalf("owners %v, want the restored one only", got)
	}
}

// TestSessionNamesPerIdentity: one identity binds at most
// MaxNamesPerIdentity names; past it its sessions take names unbound.
func TestSessionNamesPerIdentity(t *testing.T) {
	s := NewServer(ServerConfig{BindSessionNames: true, HealthInterval: -1})
	defer s.Close()
	for i := 0; i < MaxNamesPerIdentity+10; i++ {
		if err := s.ClaimSessionName(fmt.Sprintf("n%d", i), "greedy"); err != nil {
			t.Fatal(err)
		}
	}
	if got := len(s.SessionOwners()); got != MaxNamesPerIdentity {
		t.Fatalf("%d names bound to one identity, want %d", got, MaxNamesPerIdentity)
	}
	if err := s.ClaimSessionName(fmt.Sprintf("n%d", MaxNamesPerIdentity+5), "other"); err != nil {
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
	s = NewServer(ServerConfig{BindSessionNames: true, HealthInterval: -1,
		NameHeld: func(name string) bool { return held(name) }})
	defer s.Close()
	s.SetSessionOwners([]SessionOwner{{"a", "client-a"}, {"b", "client-a"}, {"c", "client-a"}})

	held = func(string) bool { return true } // client-a's path took "a" just before
	if _, err := s.ForgetSessionName("a"); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("forget of a name being taken: %v, want EBUSY", err)
	}
	held = func(name string) bool {
		// client-b took "b" right after the binding was removed.
		if err := s.ClaimSessionName(name, "client-b"); err != nil {
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
