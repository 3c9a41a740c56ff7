// TLS: the names a certificate vouches for, and how a failed TLS
// handshake is told apart (refused by the server, an authentication
// failure, or the network's).

package tcp

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"syscall"
)

// CertNames are the names a certificate vouches for, as the fabric
// reports them (fabric.Authenticated): the subject's common name, then the
// DNS, URI and e-mail subject alternative names, without repeats.
func CertNames(c *x509.Certificate) []string {
	var names []string
	add := func(n string) {
		if n == "" {
			return
		}
		for _, m := range names {
			if m == n {
				return
			}
		}
		names = append(names, n)
	}
	add(c.Subject.CommonName)
	for _, n := range c.DNSNames {
		add(n)
	}
	for _, u := range c.URIs {
		add(u.String())
	}
	for _, n := range c.EmailAddresses {
		add(n)
	}
	return names
}

// noIdentityError refuses a client certificate that names no identity.
type noIdentityError struct{ cert *x509.Certificate }

func (e noIdentityError) Error() string {
	return "client certificate names no identity (no CN, no SAN)"
}

// errNoClientCert refuses a TLS client that presents no certificate.
var errNoClientCert = errors.New("client presented no certificate")

// refusedHandshake says whether a TLS handshake failed by the server's
// own verdict on the client's certificate, rather than the client's or
// the network's.
func refusedHandshake(err error) bool {
	var cv *tls.CertificateVerificationError
	_, ni := errors.AsType[noIdentityError](err)
	return ni || errors.Is(err, errNoClientCert) || errors.As(err, &cv)
}

// isAuthFailure reports whether a TLS error is about credentials: a
// certificate that does not verify here, or an alert from the peer (which
// refuses ours). A timeout, a reset or an EOF is not.
func isAuthFailure(err error) bool {
	var cv *tls.CertificateVerificationError
	var oe *net.OpError
	return errors.As(err, &cv) || (errors.As(err, &oe) && oe.Op == "remote error")
}

// authError is a failed TLS authentication: a permission error (EACCES)
// to those who classify errors by errno.
type authError struct{ err error }

func (e authError) Error() string   { return e.err.Error() }
func (e authError) Unwrap() []error { return []error{e.err, syscall.EACCES} }
