package conf

import (
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"strings"
	"syscall"
	"time"
)

// Findings are what a daemon's `config check` found beyond the file
// itself, on this host: errors, which keep the daemon from starting (or
// from doing what it is configured for), and warnings, which it starts
// with (a pool not there is served once it is; a certificate that
// expires soon). Every one is found, not only the first.
type Findings struct {
	Errors   []error
	Warnings []string
}

// Add adds err (nil: nothing) as an error.
func (f *Findings) Add(err error) {
	if err != nil {
		f.Errors = append(f.Errors, err)
	}
}

// Warn adds a warning.
func (f *Findings) Warn(format string, args ...any) {
	f.Warnings = append(f.Warnings, fmt.Sprintf(format, args...))
}

// ErrNotLocal is the error of an address this host does not have.
var ErrNotLocal = errors.New("not an address of this host")

// CheckLocal checks that the daemon could listen on host (an IP address
// or a name; empty, or an unspecified address: every interface, fine):
// it binds port 0 of it and closes it at once, so a port in use (by the
// daemon itself, running) is no error. An address this host does not
// have is ErrNotLocal, naming the addresses it has.
func CheckLocal(host string) error {
	if host == "" {
		return nil
	}
	if a, err := netip.ParseAddr(host); err == nil && a.IsUnspecified() {
		return nil
	}
	l, err := net.Listen("tcp", net.JoinHostPort(host, "0"))
	if err == nil {
		l.Close()
		return nil
	}
	if errors.Is(err, syscall.EADDRNOTAVAIL) {
		return fmt.Errorf("%s is %w (its addresses: %s)", host, ErrNotLocal, LocalAddrs())
	}
	var dns *net.DNSError
	if errors.As(err, &dns) {
		return fmt.Errorf("%s: %w: no such host here", host, ErrNotLocal)
	}
	return fmt.Errorf("%s: %w", host, err)
}

// LocalAddrs are this host's interface addresses, for a message.
func LocalAddrs() string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		return "unknown: " + err.Error()
	}
	var out []string
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && !n.IP.IsLinkLocalUnicast() {
			out = append(out, n.IP.String())
		}
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}

// expiresSoon is how long before a certificate's end CertWarnings warns.
const expiresSoon = 30 * 24 * time.Hour

// CertWarnings are the warnings about the certificate of t (its first in
// t.Cert) as what (a "server" of the fabric, a "client"): CertProblems',
// both kinds. The daemons start with it (and take a renewed one without
// a restart), but their peers refuse it.
func (t TLS) CertWarnings(usage x509.ExtKeyUsage, what string, now time.Time) []string {
	unusable, soon := t.CertProblems(usage, what, now)
	if soon != "" {
		unusable = append(unusable, soon)
	}
	return unusable
}

// CertProblems says what is wrong with the certificate of t (its first in
// t.Cert) as what: unusable, why its peers refuse it (it lacks the
// extended key usage they check, serverAuth or clientAuth; it is not yet
// valid, or has expired), and soon, that it expires within 30 days ("":
// not). A certificate that does not load is Config's to say: nothing.
func (t TLS) CertProblems(usage x509.ExtKeyUsage, what string, now time.Time) (unusable []string, soon string) {
	if t.Cert == "" {
		return nil, ""
	}
	b, err := os.ReadFile(t.Cert)
	if err != nil {
		return nil, ""
	}
	var cert *x509.Certificate
	for cert == nil {
		var blk *pem.Block
		if blk, b = pem.Decode(b); blk == nil {
			return nil, ""
		}
		if blk.Type == "CERTIFICATE" {
			if cert, err = x509.ParseCertificate(blk.Bytes); err != nil {
				return nil, ""
			}
		}
	}
	if name, ok := missingUsage(cert, usage); !ok {
		unusable = append(unusable, fmt.Sprintf("tls: cert %s has no %s extended key usage (it has %s): peers refuse it as a %s's; make it with that usage (rnbd-server cert)",
			t.Cert, name, usageNames(cert), what))
	}
	switch {
	case now.Before(cert.NotBefore):
		unusable = append(unusable, fmt.Sprintf("tls: cert %s is not valid before %s: peers refuse it until then (is this host's clock right?)",
			t.Cert, cert.NotBefore.UTC().Format(time.RFC3339)))
	case now.After(cert.NotAfter):
		unusable = append(unusable, fmt.Sprintf("tls: cert %s expired on %s: peers refuse it; renew it (the daemon takes the new one without a restart)",
			t.Cert, cert.NotAfter.UTC().Format(time.DateOnly)))
	case cert.NotAfter.Sub(now) < expiresSoon:
		left := fmt.Sprintf("%d days", int(cert.NotAfter.Sub(now).Hours()/24))
		if h := cert.NotAfter.Sub(now).Hours(); h < 48 {
			left = fmt.Sprintf("%d hours", int(h))
		}
		soon = fmt.Sprintf("tls: cert %s expires on %s, in %s: renew it (the daemon takes the new one without a restart)",
			t.Cert, cert.NotAfter.UTC().Format(time.RFC3339), left)
	}
	return unusable, soon
}

// missingUsage reports whether cert may be used for usage: one with no
// extended key usage may be used for any (as Go's verification has it).
func missingUsage(cert *x509.Certificate, usage x509.ExtKeyUsage) (string, bool) {
	name := map[x509.ExtKeyUsage]string{x509.ExtKeyUsageServerAuth: "serverAuth", x509.ExtKeyUsageClientAuth: "clientAuth"}[usage]
	if len(cert.ExtKeyUsage) == 0 && len(cert.UnknownExtKeyUsage) == 0 {
		return name, true
	}
	for _, u := range cert.ExtKeyUsage {
		if u == usage || u == x509.ExtKeyUsageAny {
			return name, true
		}
	}
	return name, false
}

// usageNames are cert's extended key usages, for a message.
func usageNames(cert *x509.Certificate) string {
	var out []string
	for _, u := range cert.ExtKeyUsage {
		switch u {
		case x509.ExtKeyUsageServerAuth:
			out = append(out, "serverAuth")
		case x509.ExtKeyUsageClientAuth:
			out = append(out, "clientAuth")
		default:
			out = append(out, fmt.Sprintf("usage %d", u))
		}
	}
	for _, o := range cert.UnknownExtKeyUsage {
		out = append(out, o.String())
	}
	if len(out) == 0 {
		return "none"
	}
	return strings.Join(out, ", ")
}
