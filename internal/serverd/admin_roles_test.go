package serverd

import (
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/ctl"
)

// TestRoleOf: a certificate's names give one role, by the first name
// that has one; names that give different roles are refused, naming
// them and their roles, rather than given the most power any has
// (issue 40: CN mon2 with SANs mon and ops was an admin, audited as
// mon2).
func TestRoleOf(t *testing.T) {
	a := AdminConfig{Admins: []string{"ops", "ops2"}, Provisioners: []string{"orch"}, Readers: []string{"mon"}}
	for _, c := range []struct {
		names    []string
		role     ctl.Role
		by, says string
	}{
		{[]string{"ops"}, ctl.RoleAdmin, "ops", ""},
		{[]string{"host-a"}, ctl.RoleNone, "", ""},
		{[]string{"host-a", "host-b"}, ctl.RoleNone, "", ""},
		{[]string{"mon2", "mon"}, ctl.RoleReader, "mon", ""},
		{[]string{"x", "ops2", "y", "ops"}, ctl.RoleAdmin, "ops2", ""},
		{[]string{"mon2", "mon", "ops"}, ctl.RoleNone, "", "its names give different roles in [admin] (mon reader, ops admin)"},
		{[]string{"orch", "x", "ops"}, ctl.RoleNone, "", "(orch provisioner, ops admin)"},
	} {
		role, by, err := a.roleOf(c.names)
		if role != c.role || by != c.by || (c.says == "") != (err == nil) || err != nil && !strings.Contains(err.Error(), c.says) {
			t.Errorf("roleOf(%q) = %s, %q, %v; want %s, %q, %q", c.names, role, by, err, c.role, c.by, c.says)
		}
	}
}

// TestAdminBoundsConfig: the listener's bounds are checked, and each
// reaches ctl.Access.
func TestAdminBoundsConfig(t *testing.T) {
	for name, edit := range map[string]func(*AdminConfig){
		"handshake_timeout":          func(a *AdminConfig) { a.HandshakeTimeout.Duration = time.Millisecond },
		"read_header_timeout":        func(a *AdminConfig) { a.ReadHeaderTimeout.Duration = 0 },
		"max_handshakes_per_address": func(a *AdminConfig) { a.MaxHandshakesPerAddress = 0 },
		"max_requests_per_identity":  func(a *AdminConfig) { a.MaxRequestsPerIdentity = 0 },
	} {
		cfg := DefaultConfig()
		edit(&cfg.Admin)
		if err := cfg.Validate(); err == nil || !strings.Contains(err.Error(), name) {
			t.Errorf("[admin] %s out of bounds: %v", name, err)
		}
	}
	d := DefaultAdminConfig()
	if d.HandshakeTimeout.Duration != 2*time.Second || d.ReadHeaderTimeout.Duration != 10*time.Second || d.MaxHandshakesPerAddress != 32 ||
		d.MaxRequestsPerIdentity != 32 {
		t.Errorf("defaults %+v", d)
	}
}
