package serverd

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/rnbd"
)

// The daemon's view of the file system, where map meets it.
//
// Under its systemd unit (deploy/rnbd-server.service) the daemon sees
// the file system through a sandbox: ProtectSystem=strict mounts all of
// it read-only but the unit's ReadWritePaths= (/srv/rnbd), and
// PrivateTmp=yes gives it a /tmp and a /var/tmp of its own. A
// read-write export of a file elsewhere would be taken, and then every
// read-write OPEN of it fail with EROFS at the client; a file in the
// host's /var/tmp is not there for the daemon at all. map refuses either
// saying so, from what the daemon itself sees (statfs, its mountinfo and
// its cgroup), and how to allow it (docs/operations.md, "Running under
// systemd"). Exports of the configuration and state files are served as
// before, with a warning.

// view is where the daemon reads its own view from: its mount table and
// its control group (tests give others).
type view struct {
	mountinfo string
	cgroup    string
}

var selfView = view{mountinfo: "/proc/self/mountinfo", cgroup: "/proc/self/cgroup"}

// readOnlyFS reports whether path is on a file system this process sees
// read-only: statfs's ST_RDONLY, set for a read-only file system and for
// a read-only mount of a writable one (a sandbox's, a bind mount's).
func readOnlyFS(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Flags&unix.ST_RDONLY != 0
}

// mountEntry is one line of a mountinfo file (proc_pid_mountinfo(5)).
type mountEntry struct {
	root, point, fstype, source string
	// ro: the mount is read-only; superRO: the file system is.
	ro, superRO bool
}

// mounts reads the mount table, or nil.
func (v view) mounts() []mountEntry {
	b, err := os.ReadFile(v.mountinfo)
	if err != nil {
		return nil
	}
	var out []mountEntry
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if sep < 0 || len(f) < sep+3 {
			continue
		}
		e := mountEntry{root: unescapeMount(f[3]), point: unescapeMount(f[4]), ro: hasOpt(f[5], "ro"),
			fstype: f[sep+1], source: unescapeMount(f[sep+2])}
		if len(f) > sep+3 {
			e.superRO = hasOpt(f[sep+3], "ro")
		}
		out = append(out, e)
	}
	return out
}

// mountOf is the mount that path (absolute, without symbolic links) is
// on: the one of the longest mount point that holds it, the last listed
// of those (the one on top).
func (v view) mountOf(path string) (mountEntry, bool) {
	var best mountEntry
	found := false
	for _, m := range v.mounts() {
		if m.point != "/" && path != m.point && !strings.HasPrefix(path, m.point+"/") {
			continue
		}
		if !found || len(m.point) >= len(best.point) {
			best, found = m, true
		}
	}
	return best, found
}

// unit is the systemd service the daemon runs in (its control group's
// last part that names a .service), or "".
func (v view) unit() string {
	b, err := os.ReadFile(v.cgroup)
	if err != nil {
		return ""
	}
	for _, line := range strings.Split(string(b), "\n") {
		// hierarchy-ID:controllers:path
		parts := strings.SplitN(line, ":", 3)
		if len(parts) != 3 {
			continue
		}
		elems := strings.Split(parts[2], "/")
		for i := len(elems) - 1; i >= 0; i-- {
			if strings.HasSuffix(elems[i], ".service") {
				return elems[i]
			}
		}
	}
	return ""
}

// readOnly is map's refusal (EROFS) of a read-write export of a regular
// file on a file system the daemon sees read-only, which no session could
// open read-write; nil for anything else. It says why, from the mount the
// file is on, and how to allow it.
func (v view) readOnly(e rnbd.Export, p probed) error {
	if e.ReadOnly || p.err != nil || !p.readOnly || !filepath.IsAbs(e.Path) {
		return nil
	}
	path := e.Path
	if r, err := filepath.EvalSymlinks(path); err == nil {
		path = r
	}
	name := e.Path
	if path != e.Path {
		name = fmt.Sprintf("%s (%s)", e.Path, path)
	}
	why, how := "is on a file system this daemon sees read-only", "make it writable for the daemon"
	m, ok := v.mountOf(path)
	unit := v.unit()
	switch {
	case ok && m.superRO:
		why = fmt.Sprintf("is on a file system mounted read-only (%s on %s)", m.source, m.point)
		how = "remount it read-write"
	case ok && unit != "":
		why = fmt.Sprintf("is on a file system that %s sees read-only (the unit's sandbox, ProtectSystem= or ReadOnlyPaths=, "+
			"leaves only its ReadWritePaths= writable: /srv/rnbd in the packaged unit)", unit)
		how = fmt.Sprintf("allow its directory with a drop-in (systemctl edit %s: [Service] ReadWritePaths=%s) and restart the unit",
			unit, filepath.Dir(path))
	case ok:
		why = fmt.Sprintf("is on a read-only mount (on %s) of a file system that is writable", m.point)
		how = "make the mount writable where this daemon runs"
	}
	return fmt.Errorf("export %s: %s %s, so no session could open it read-write; %s, or export it read-only (--ro): %w",
		e.Name, name, why, how, syscall.EROFS)
}

// missing adds to a map's "no such file or directory" for a path under
// /tmp or /var/tmp that the daemon's own /tmp or /var/tmp is a systemd
// PrivateTmp= directory, not the host's; it returns other errors as they
// are.
func (v view) missing(path string, err error) error {
	if !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	for _, tmp := range []string{"/tmp", "/var/tmp"} {
		if !strings.HasPrefix(path, tmp+"/") {
			continue
		}
		m, ok := v.mountOf(path)
		if !ok || m.point != tmp || !strings.Contains(m.root, "/systemd-private-") {
			return err
		}
		who := "this daemon"
		if u := v.unit(); u != "" {
			who = u
		}
		return &hinted{err: err, hint: fmt.Sprintf("%s has a %s of its own (PrivateTmp=yes), not the host's: put the file "+
			"where the daemon may write, /srv/rnbd in the packaged unit or a directory a drop-in's ReadWritePaths= allows", who, tmp)}
	}
	return err
}

// hinted is an error with what to do about it.
type hinted struct {
	err  error
	hint string
}

func (h *hinted) Error() string { return h.err.Error() + "; " + h.hint }
func (h *hinted) Unwrap() error { return h.err }

// warnReadOnly logs, for an export of the configuration or the state file
// now served, what map would have refused it for.
func (d *Daemon) warnReadOnly(e rnbd.Export, p probed) {
	if err := selfView.readOnly(e, p); err != nil {
		d.log.WithError(err).WithFields(exportFields(e)).Warn("export served, but no session can open it read-write")
	}
}

// hasOpt reports whether the comma-separated options hold opt.
func hasOpt(opts, opt string) bool {
	for _, o := range strings.Split(opts, ",") {
		if o == opt {
			return true
		}
	}
	return false
}

// unescapeMount undoes mountinfo's octal escapes (\040 for a space, …).
func unescapeMount(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) && isOctal(s[i+1:i+4]) {
			b.WriteByte((s[i+1]-'0')<<6 | (s[i+2]-'0')<<3 | (s[i+3] - '0'))
			i += 3
			continue
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

func isOctal(s string) bool {
	for i := 0; i < len(s); i++ {
		if s[i] < '0' || s[i] > '7' {
			return false
		}
	}
	return true
}
