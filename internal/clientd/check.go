// What `rnbd-client config check` finds beyond CheckConfig: every
// problem of the file and of this host at once.

package clientd

import (
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
)

// CheckAll is `rnbd-client config check`: the file read and validated
// as the daemon reads it (CheckConfig), and what can be checked on this
// host without starting anything, every problem reported rather than the
// first: errors (a value that is wrong, TLS files that do not load, a
// metrics_listen address this host does not have) and warnings, which the
// daemon starts with (a certificate without the clientAuth usage servers
// check, expired or about to). A file that cannot be read or parsed is
// the one error.
func CheckAll(path string, mustExist bool) (Config, conf.Findings) {
	var f conf.Findings
	cfg, err := LoadConfig(path, mustExist)
	if err != nil {
		f.Add(err)
		return cfg, f
	}
	if err := cfg.Validate(); err != nil {
		f.Add(fmt.Errorf("config %s: %w", path, err))
	}
	if cfg.TLS.Validate() == nil && cfg.TLS.Enabled() {
		if _, err := cfg.TLS.Config(); err != nil {
			f.Add(fmt.Errorf("config %s: %w", path, err))
		} else {
			for _, w := range cfg.TLS.CertWarnings(x509.ExtKeyUsageClientAuth, "client", time.Now()) {
				f.Warn("%s", w)
			}
		}
	}
	if cfg.MetricsListen != "" {
		if host, _, err := net.SplitHostPort(cfg.MetricsListen); err == nil {
			if err := conf.CheckLocal(host); err != nil {
				code := ctl.CodeInvalid
				if errors.Is(err, syscall.EACCES) || errors.Is(err, syscall.EPERM) {
					code = ctl.CodePermission
				}
				f.Add(ctl.Errorf(code, "config %s: metrics_listen %s: %v", path, cfg.MetricsListen, err))
			}
		}
	}
	return cfg, f
}
