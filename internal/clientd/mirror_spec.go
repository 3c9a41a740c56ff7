package clientd

// A mirror mapping's request, checked (normalizeMirror), and what the
// daemon derives from it: its legs in order, their names in messages,
// its identity on the legs, and the mappings it may not share a session
// with.

import (
	"crypto/sha256"
	"strconv"
	"strings"
	"unicode"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/mirror"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// maxMirrorName bounds a mirror's name (it goes in logs and metrics).
const maxMirrorName = 128

// normalizeMirror checks a mirror mapping: its name, its legs and
// witness (each a session to a different storage node), create and
// force.
func (s *mapSpec) normalizeMirror() error {
	m := &s.Mapping
	if m.Mirror == "" {
		return ctl.Errorf(ctl.CodeInvalid, "a mirror needs its name (--mirror NAME)")
	}
	if len(m.Mirror) > maxMirrorName {
		return ctl.Errorf(ctl.CodeInvalid, "mirror name of %d bytes: at most %d", len(m.Mirror), maxMirrorName)
	}
	for _, r := range m.Mirror {
		if !unicode.IsPrint(r) || unicode.IsSpace(r) {
			return ctl.Errorf(ctl.CodeInvalid, "mirror name %q: printable characters without spaces only", m.Mirror)
		}
	}
	if m.SessName != "" || len(m.Paths) > 0 || m.DevicePath != "" {
		return ctl.Errorf(ctl.CodeInvalid, "a mirror's sessions are its legs' (--leg for each), not sessname, path or device_path")
	}
	if len(m.Legs) < 2 || len(m.Legs) > mirror.MaxLegs {
		return ctl.Errorf(ctl.CodeInvalid, "a mirror has 2 or 3 legs, not %d", len(m.Legs))
	}
	if (m.Create || m.CreateIfNew) && m.Force != nil {
		return ctl.Errorf(ctl.CodeInvalid, "create and force together: a new mirror needs no force")
	}
	if m.Adopt != "" && (m.Create || m.Adopt == m.Mirror || len(m.Adopt) > maxMirrorName) {
		return ctl.Errorf(ctl.CodeInvalid, "adopt %q: the name of another mirror (at most %d bytes) whose voters the legs are copies of, not with create", m.Adopt, maxMirrorName)
	}
	if m.Create && m.CreateIfNew {
		return ctl.Errorf(ctl.CodeInvalid, "create and create_if_new together: create refuses a mirror that exists, create_if_new assembles it")
	}
	if m.RegionSize != "" {
		if !m.Create && !m.CreateIfNew {
			return ctl.Errorf(ctl.CodeInvalid, "region_size is a new mirror's (with create): a mirror keeps the one it was created with")
		}
		n, err := units.ParseSize(m.RegionSize)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "region_size %q: %v", m.RegionSize, err)
		}
		s.regionSize = n
	}
	if m.Size != "" {
		n, err := units.ParseSize(m.Size)
		if err != nil || n <= 0 || n%4096 != 0 {
			return ctl.Errorf(ctl.CodeInvalid, "size %q: a mirror's data size, a multiple of 4096 bytes", m.Size)
		}
		s.growTo = n
	}
	if f := m.Force; f != nil {
		if f.By == "" {
			return ctl.Errorf(ctl.CodeInvalid, "force needs who orders it (--force BY): it is logged and kept on the legs")
		}
		if f.From < -1 || f.From >= len(m.Legs) {
			return ctl.Errorf(ctl.CodeInvalid, "force from leg %d: the mirror has legs 0 to %d", f.From, len(m.Legs)-1)
		}
	}
	if len(m.Spares) > mirror.MaxLegs {
		return ctl.Errorf(ctl.CodeInvalid, "%d spares: at most %d", len(m.Spares), mirror.MaxLegs)
	}
	sessions := map[string]string{}
	nodes := map[string]string{}
	legs := s.withSpares()
	s.legPaths = nil
	for i, l := range legs {
		what := s.legName(i)
		if l.SessName == "" || len(l.Paths) == 0 || l.DevicePath == "" {
			return ctl.Errorf(ctl.CodeInvalid, "%s needs sessname, at least one path and device_path", what)
		}
		if err := rtrs.ValidSessName(l.SessName); err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "%s: sessname %q: %v", what, l.SessName, err)
		}
		if other, ok := sessions[l.SessName]; ok {
			return ctl.Errorf(ctl.CodeInvalid, "%s and %s have one session %s: each leg has a session of its own", other, what, l.SessName)
		}
		sessions[l.SessName] = what
		if l.DestPort == 0 {
			l.DestPort = rtrs.DefaultPort
		}
		ps, err := parsePaths(l.Paths, l.DestPort)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "%s: %v", what, err)
		}
		// A copy on the same storage node is no copy when the node
		// goes: the legs' servers must differ.
		for _, p := range ps {
			node := p.Dst.String()
			if other, ok := nodes[node]; ok && other != what {
				return ctl.Errorf(ctl.CodeInvalid, "%s and %s are on one storage node (%s): a mirror's legs are on different ones", other, what, node)
			}
			nodes[node] = what
		}
		s.legPaths = append(s.legPaths, ps)
	}
	return nil
}

// legs are pointers to the spec's legs, then its witness.
func (s *mapSpec) legs() []*api.Leg {
	var out []*api.Leg
	for i := range s.Legs {
		out = append(out, &s.Legs[i])
	}
	if s.Witness != nil {
		out = append(out, s.Witness)
	}
	return out
}

// withSpares are s.legs(), then the spares.
func (s *mapSpec) withSpares() []*api.Leg {
	out := s.legs()
	for i := range s.Spares {
		out = append(out, &s.Spares[i])
	}
	return out
}

// legs are a mapping's legs, then its witness.
func (m *mapped) legs() []*api.Leg { return (&mapSpec{Mapping: m.Mapping}).legs() }

// mirrorConflictLocked refuses a mapping that would share a session with
// a mirror's leg (a leg's session is the mirror's own: fencing a leg
// closes it), or a second mapping of one mirror; self (a mirror whose
// leg is replaced), if not nil, is left out.
//
// +checklocks:d.mu
func (d *Daemon) mirrorConflictLocked(spec mapSpec, self *mapped) error {
	taken := map[string]string{} // session name → what has it
	for name := range d.sessions {
		taken[name] = "a mapping's session"
	}
	all := make([]api.Mapping, 0, len(d.maps)+len(d.failed))
	for _, m := range d.maps {
		if m != self {
			all = append(all, m.Mapping)
		}
	}
	for _, f := range d.failed {
		all = append(all, f.Mapping)
		if f.Mirror == "" {
			taken[f.SessName] = "the session of " + f.Device
		}
	}
	for _, m := range all {
		if m.Mirror == "" {
			continue
		}
		if m.Mirror == spec.Mirror {
			return ctl.Errorf(ctl.CodeExists, "mirror %s is mapped already as %s", spec.Mirror, m.Device)
		}
		for _, l := range (&mapSpec{Mapping: m}).withSpares() {
			taken[l.SessName] = "a leg's session of mirror " + m.Mirror + " (" + m.Device + ")"
		}
	}
	if spec.Mirror == "" {
		if what, ok := taken[spec.SessName]; ok && strings.HasPrefix(what, "a leg") {
			return ctl.Errorf(ctl.CodeExists, "session %s is %s: choose another sessname", spec.SessName, what)
		}
		return nil
	}
	for _, l := range spec.withSpares() {
		if what, ok := taken[l.SessName]; ok {
			return ctl.Errorf(ctl.CodeExists, "session %s is %s: a mirror's leg needs a session of its own", l.SessName, what)
		}
	}
	return nil
}

// legName names leg i of s.legs() in messages (past them: the spares).
func (s *mapSpec) legName(i int) string {
	switch n := len(s.Legs); {
	case i == n && s.Witness != nil:
		return "the witness"
	case i >= len(s.legs()):
		return "spare " + strconv.Itoa(i-len(s.legs()))
	}
	return "leg " + strconv.Itoa(i)
}

// mirrorID is a mirror's identity on its legs: derived from its name, so
// that the same name maps the same mirror, and a device of another
// mirror is refused as a leg.
func mirrorID(name string) [16]byte {
	h := sha256.Sum256([]byte("rnbd mirror\x00" + name))
	var id [16]byte
	copy(id[:], h[:])
	return id
}
