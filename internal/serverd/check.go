// What `rnbd-server config check` finds beyond CheckConfig: every
// problem of the file and of this host at once.

package serverd

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
)

// CheckAll is `rnbd-server config check`: the file read and validated
// as the daemon reads it (CheckConfig), and what can be checked on this
// host without starting anything, every problem reported rather than the
// first:
//
//   - errors, which keep the daemon from starting: a value that is
//     wrong, a TLS file that does not load ([tls]'s and [admin]'s), a
//     listen, metrics_listen or [admin] listen address this host does not
//     have (port 0 of it is bound and closed: the daemon itself, running,
//     is no problem), an rdma:// address on an interface without an RDMA
//     device or in a build without RDMA;
//   - warnings, which it starts with: a pool whose directory is not
//     there, is not one, or is not a mount point with mountpoint = true,
//     an lvm-thin pool whose volume group or thin pool lvs does not find
//     (not checked without lvm2's tools), an export of the file whose
//     path is not there (retried every export_retry), a certificate
//     without the serverAuth usage, expired or about to.
//
// A file that cannot be read or parsed is the one error.
func CheckAll(path string, mustExist bool) (Config, conf.Findings) {
	var f conf.Findings
	cfg, err := LoadConfig(path, mustExist)
	if err != nil {
		f.Add(err)
		return cfg, f
	}
	at := func(err error) error { return fmt.Errorf("config %s: %w", path, err) }
	f.Add(cfgError(path, cfg.Validate()))
	if cfg.TLS.Validate() == nil && cfg.TLS.Enabled() {
		if _, err := cfg.TLS.Config(); err != nil {
			f.Add(at(err))
		} else {
			for _, w := range cfg.TLS.CertWarnings(x509.ExtKeyUsageServerAuth, "server", time.Now()) {
				f.Warn("%s", w)
			}
		}
	}
	if len(cfg.Admin.Listen) > 0 && (cfg.Admin.Cert != "" || cfg.Admin.Key != "" || cfg.Admin.CA != "") {
		// [admin]'s own files; [tls]'s were loaded above.
		if _, err := cfg.adminTLS().Config(); err != nil {
			f.Add(at(fmt.Errorf("[admin]: %w", err)))
		} else if cfg.Admin.Cert != "" {
			for _, w := range cfg.adminTLS().CertWarnings(x509.ExtKeyUsageServerAuth, "server", time.Now()) {
				f.Warn("[admin]: %s", w)
			}
		}
	}
	for _, s := range cfg.Listen {
		f.Add(checkListen(path, s))
	}
	if cfg.MetricsListen != "" {
		if host, _, err := net.SplitHostPort(cfg.MetricsListen); err == nil {
			f.Add(localError(path, "metrics_listen "+cfg.MetricsListen, conf.CheckLocal(host)))
		}
	}
	for _, s := range cfg.Admin.Listen {
		if addr, err := AdminAddr(s); err == nil {
			host, _, _ := net.SplitHostPort(addr)
			f.Add(localError(path, "[admin] listen "+s, conf.CheckLocal(host)))
		}
	}
	for _, p := range cfg.Pools {
		if w := checkPool(p); w != "" {
			f.Warn("%s", w)
		}
	}
	for _, e := range cfg.Exports {
		if e.Path == "" {
			continue
		}
		if _, err := os.Stat(e.Path); err != nil {
			f.Warn("[[export]] %s: %v: the daemon starts without it and tries it again every export_retry (%v)", e.Name, err, cfg.ExportRetry.Duration)
		}
	}
	return cfg, f
}

// cfgError is a validation's error of the file at path (nil: nil).
func cfgError(path string, err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("config %s: %w", path, err)
}

// localError is what CheckLocal's error says of what (nil: nil).
func localError(path, what string, err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, syscall.EACCES), errors.Is(err, syscall.EPERM):
		return ctl.Errorf(ctl.CodePermission, "config %s: %s: %v", path, what, err)
	}
	return ctl.Errorf(ctl.CodeInvalid, "config %s: %s: %v", path, what, err)
}

// checkListen checks a listen address on this host: one address (not
// every interface's) must be this host's, and an rdma:// one must have
// an RDMA device behind it. rdma:// on every interface is listened on
// where the machine has RDMA, and nowhere else: no error.
func checkListen(path, s string) error {
	l, err := rtrs.ParseListen(s)
	if err != nil || l.Addr.Addr().IsUnspecified() {
		return nil // Validate said so; or every interface
	}
	a := l.Addr.Addr()
	if err := localError(path, "listen "+s, conf.CheckLocal(a.String())); err != nil {
		return err
	}
	if l.Transport == "rdma" {
		if err := rdmaAt(a); err != nil {
			return ctl.Errorf(ctl.CodeNotSupported, "config %s: listen %s: %v", path, s, err)
		}
	}
	return nil
}

// rdmaAt checks that the interface holding a has an RDMA device.
func rdmaAt(a netip.Addr) error {
	if !ibverbs.Supported {
		return errors.New("this build of rnbd-server has no RDMA (built without cgo): listen on tcp:// instead")
	}
	devs, err := ibverbs.Devices()
	if err != nil {
		return fmt.Errorf("listing the RDMA devices: %w", err)
	}
	if len(devs) == 0 {
		return errors.New("this host has no RDMA device (none in /sys/class/infiniband; soft RoCE: modprobe rdma_rxe and rdma link add rxe0 type rxe netdev IFACE): listen on tcp:// instead")
	}
	dev, err := rdma.DeviceFor(netip.Addr{}, a)
	if err != nil {
		return err
	}
	if dev == "" {
		return fmt.Errorf("the interface of %v has no RDMA device (this host's: %s)", a, strings.Join(devs, ", "))
	}
	return nil
}

// checkPool is a warning about a pool this host does not have as
// configured ("" if none): the daemon starts without it.
func checkPool(p PoolConfig) string {
	switch p.Type {
	case "dir":
		st, err := os.Stat(p.Path)
		if err != nil {
			return fmt.Sprintf("[[pool]] %s: %v: the daemon starts without this pool", p.Name, err)
		}
		if !st.IsDir() {
			return fmt.Sprintf("[[pool]] %s: %s is not a directory: the daemon starts without this pool", p.Name, p.Path)
		}
		if p.Mountpoint {
			up, err := os.Stat(filepath.Join(p.Path, ".."))
			if err != nil {
				return fmt.Sprintf("[[pool]] %s: %v", p.Name, err)
			}
			a, b := st.Sys().(*syscall.Stat_t), up.Sys().(*syscall.Stat_t)
			if a.Dev == b.Dev && a.Ino != b.Ino {
				return fmt.Sprintf("[[pool]] %s: %s is not a mount point (mountpoint = true): is its file system mounted? The daemon starts without this pool", p.Name, p.Path)
			}
		}
	case "lvm-thin":
		lvs, err := exec.LookPath("lvs")
		if err != nil {
			return fmt.Sprintf("[[pool]] %s: volume group %s and thin pool %s not checked: lvm2's tools (lvs) are not installed, and the pool needs them", p.Name, p.VolumeGroup, p.ThinPool)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		out, err := exec.CommandContext(ctx, lvs, "--noheadings", "-o", "segtype", p.VolumeGroup+"/"+p.ThinPool).CombinedOutput()
		msg := strings.Join(strings.Fields(string(out)), " ")
		switch {
		case err != nil:
			return fmt.Sprintf("[[pool]] %s: lvs %s/%s: %v: %s: the daemon starts without this pool", p.Name, p.VolumeGroup, p.ThinPool, err, msg)
		case msg != "thin-pool":
			return fmt.Sprintf("[[pool]] %s: %s/%s is not a thin pool (lvs says %q): the daemon starts without this pool", p.Name, p.VolumeGroup, p.ThinPool, msg)
		}
	}
	return ""
}
