package clientd

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strings"

	"github.com/rnbd/rnbd/internal/log"
)

// Stable names of kernel devices.
//
// /dev/nbdN and /dev/ublkbN numbers depend on the order of mappings and
// on what else the machine has. A mapping served as a kernel device
// also gets DevLinksDir/SESSNAME/DEVICE_PATH (/dev/rnbd/host7/vol1), a
// symbolic link to it that the daemon keeps: made when the device is
// attached (a map, a restore after a restart: the link then names the
// device the mapping has now), removed when it is unmapped, and removed
// at start for a mapping that did not come back. A '/' in the device
// path is written '!', as the kernel's rnbd names its sysfs entries.
// The daemon makes the links itself rather than a udev rule: ublk's
// devices carry nothing udev could name them by, and the daemon knows
// every mapping when the device appears.

// devLink is the stable name of mapping m, or "" when there is none (no
// DevLinksDir, or a device path that cannot be a file name).
func (d *Daemon) devLink(m Mapping) string {
	if d.cfg.DevLinksDir == "" {
		return ""
	}
	name := strings.ReplaceAll(m.DevicePath, "/", "!")
	if name == "" || name == "." || name == ".." || strings.ContainsRune(name, 0) || m.SessName == "" {
		return ""
	}
	return filepath.Join(d.cfg.DevLinksDir, m.SessName, name)
}

// makeDevLink points m's stable name at target (replacing what it named
// before, in one rename). Best effort: the mapping works without it.
func (d *Daemon) makeDevLink(m Mapping, target string) {
	link := d.devLink(m)
	if link == "" {
		return
	}
	l := d.log.WithFields(log.Fields{"device": m.Device, "link": link, "kernel_device": target})
	if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
		l.WithError(err).Warn("no stable name for the device")
		return
	}
	tmp := link + ".new"
	os.Remove(tmp)
	if err := os.Symlink(target, tmp); err != nil {
		l.WithError(err).Warn("no stable name for the device")
		return
	}
	if err := os.Rename(tmp, link); err != nil {
		os.Remove(tmp)
		l.WithError(err).Warn("no stable name for the device")
		return
	}
	l.Debug("stable name")
}

// removeDevLink removes m's stable name, if it is a link, and its
// session's directory once empty.
func (d *Daemon) removeDevLink(m Mapping) {
	link := d.devLink(m)
	if link == "" {
		return
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&fs.ModeSymlink == 0 {
		return
	}
	if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
		d.log.WithError(err).WithField("link", link).Warn("could not remove the device's stable name")
	}
	os.Remove(filepath.Dir(link)) // only if empty
}
