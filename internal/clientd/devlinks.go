package clientd

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"unicode"
	"unicode/utf8"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/pkg/log"
)

// Stable names of kernel devices.
//
// /dev/nbdN and /dev/ublkbN numbers depend on the order of mappings and
// on what else the machine has. A mapping served as a kernel device
// also gets /dev/rnbd/SESSNAME/DEVICE_PATH, a link to it: made when the
// device is attached (a map, or a restore after a restart: the link then
// names the device the mapping has now), removed when it is unmapped,
// and removed at start for a mapping that did not come back. A '/' in
// the device path makes a directory, and a character udev does not allow
// in a link's name becomes '_', as udev would make it (linkName): the
// name is the same with udev and without.
//
// Where udev runs, the links are udev's, so that systemd knows them as
// devices (an fstab line on /dev/rnbd/... waits for its .device unit):
// the daemon writes the name to udevHints/KERNEL (/run/rnbd/devlinks/nbd0)
// and asks udev to look at the device again (a "change" uevent); the
// rule deploy/udev/60-rnbd.rules turns the file into the link, and the
// link goes when the file does. Without udev (a minimal system, the VM
// tier) the daemon makes the link in DevLinksDir itself. ublk's devices
// carry nothing a udev rule could name them by on its own, hence the
// file rather than a rule on a sysfs attribute.

// udevHints is where the daemon leaves the names for udev's rule.
const udevHints = "/run/rnbd/devlinks"

// udevRunning reports whether a udev daemon manages /dev.
var udevRunning = func() bool {
	_, err := os.Stat("/run/udev/control")
	return err == nil
}

var tmpSeq atomic.Uint64

// mirrorLinkDir holds the stable names of mirrors' kernel devices.
const mirrorLinkDir = "mirror.d"

// linkName is m's name below the links' directory, SESSNAME/DEVICE_PATH,
// or "" when there is none (no DevLinksDir, no session name, or a device
// path of no name). Each '/' of the device path separates directories
// (empty parts are dropped, and "." and ".." become "_" and "__": the
// name never leaves the session's directory); a character udev does not
// allow in a link (outside 0-9 A-Z a-z # + - . : = @ _ and UTF-8 beyond
// ASCII) becomes '_', as udev makes it.
//
// A mirror's is mirror.d/NAME: no session's name has a '.'.
func (d *Daemon) linkName(m api.Mapping) string {
	dir, name := m.SessName, m.DevicePath
	if m.Mirror != "" {
		dir, name = mirrorLinkDir, m.Mirror
	}
	if d.cfg.DevLinksDir == "" || dir == "" {
		return ""
	}
	var parts []string
	for _, p := range append([]string{dir}, strings.Split(name, "/")...) {
		switch p {
		case "":
			continue
		case ".", "..":
			p = strings.Repeat("_", len(p))
		}
		parts = append(parts, udevSafe(p))
	}
	if len(parts) < 2 {
		return ""
	}
	return strings.Join(parts, "/")
}

// udevSafe replaces what udev would replace in a link's name by '_'.
func udevSafe(s string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r >= '0' && r <= '9', r >= 'A' && r <= 'Z', r >= 'a' && r <= 'z', strings.ContainsRune("#+-.:=@_", r):
			return r
		case r > unicode.MaxASCII && r != utf8.RuneError:
			return r
		}
		return '_'
	}, s)
}

// devLink is the link the daemon makes itself for m, or "".
func (d *Daemon) devLink(m api.Mapping) string {
	n := d.linkName(m)
	if n == "" {
		return ""
	}
	return filepath.Join(d.cfg.DevLinksDir, n)
}

// linkHolder is the device of another mapping served as a kernel device
// whose stable name is m's, or "".
func (d *Daemon) linkHolder(m api.Mapping) string {
	name := d.linkName(m)
	if name == "" {
		return ""
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	for dev, o := range d.maps {
		if dev != m.Device && o.Kernel != "" && d.linkName(o.Mapping) == name {
			return dev
		}
	}
	return ""
}

// makeDevLink gives m's kernel device, target, its stable name.
// Best effort: the mapping works without it.
func (d *Daemon) makeDevLink(m api.Mapping, target string) {
	name := d.linkName(m)
	if name == "" {
		return
	}
	l := d.log.WithFields(log.Fields{"device": m.Device, "name": name, "kernel_device": target})
	var err error
	if d.hints != "" {
		err = d.hint(filepath.Base(target), name)
	} else {
		err = d.link(filepath.Join(d.cfg.DevLinksDir, name), target)
	}
	if err != nil {
		l.WithError(err).Warn("no stable name for the device")
	}
}

// link points path at target, replacing what it named in one rename. The
// temporary name is in the links' directory itself, where no session's
// directory can be called ".tmp-…" (session names have no '.').
func (d *Daemon) link(path, target string) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	tmp := filepath.Join(d.cfg.DevLinksDir, fmt.Sprintf(".tmp-%d-%d", os.Getpid(), tmpSeq.Add(1)))
	if err := os.Symlink(target, tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return err
	}
	return nil
}

// hint writes udev's name for kernel device kname and has udev look at
// the device again; name "" withdraws it.
func (d *Daemon) hint(kname, name string) error {
	file := filepath.Join(d.hints, kname)
	if name == "" {
		if err := os.Remove(file); err != nil {
			return err
		}
	} else {
		if err := os.MkdirAll(d.hints, 0o755); err != nil {
			return err
		}
		if err := os.WriteFile(file+".new", []byte(name+"\n"), 0o644); err != nil {
			return err
		}
		if err := os.Rename(file+".new", file); err != nil {
			return err
		}
	}
	return os.WriteFile(filepath.Join(d.sysBlock, kname, "uevent"), []byte("change"), 0)
}

// removeDevLink removes m's stable name if it still names m's own
// device (m.Kernel): another mapping may have the name now.
func (d *Daemon) removeDevLink(m api.Mapping) {
	name := d.linkName(m)
	if name == "" || m.Kernel == "" {
		return
	}
	if d.hints != "" {
		kname := filepath.Base(m.Kernel)
		if b, err := os.ReadFile(filepath.Join(d.hints, kname)); err != nil || !bytes.Equal(bytes.TrimSpace(b), []byte(name)) {
			return
		}
		if err := d.hint(kname, ""); err != nil {
			d.log.WithError(err).WithField("name", name).Warn("could not remove the device's stable name")
		}
		return
	}
	link := filepath.Join(d.cfg.DevLinksDir, name)
	if got, err := os.Readlink(link); err != nil || got != m.Kernel {
		return
	}
	if err := os.Remove(link); err != nil && !errors.Is(err, fs.ErrNotExist) {
		d.log.WithError(err).WithField("link", link).Warn("could not remove the device's stable name")
	}
	// Its directories, the session's included, as far as they are empty.
	for dir := filepath.Dir(link); dir != filepath.Clean(d.cfg.DevLinksDir) && os.Remove(dir) == nil; dir = filepath.Dir(dir) {
	}
}
