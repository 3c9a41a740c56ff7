package rnbd

import (
	"errors"
	"syscall"
	"testing"
)

// TestSessionNameBinding: a name binds to the first identity that takes
// it and is refused (EACCES) to any other, and to a client without an
// identity; a client without one binds nothing; bindings restore and
// can be forgotten.
func TestSessionNameBinding(t *testing.T) {
	changed := 0
	s := NewServer(ServerConfig{OwnersChanged: func() { changed++ }, HealthInterval: -1})
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
	s2 := NewServer(ServerConfig{HealthInterval: -1})
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
}
