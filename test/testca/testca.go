// Package testca is a certificate authority for tests: it issues
// certificates for TLS on the TCP fabric (usable as server and as client,
// with the names and addresses asked for) in memory or as PEM files.
package testca

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/certs"
)

// CA is a self-signed authority.
type CA struct {
	Cert   *x509.Certificate
	key    crypto.Signer
	serial atomic.Int64
}

// lifetime is how long the certificates are valid: long enough that no
// check warns they expire soon (conf.TLS.CertWarnings).
const lifetime = 365 * 24 * time.Hour

// New makes an authority named name, as `rnbd-server cert create-ca`
// does (internal/certs).
func New(t testing.TB, name string) *CA {
	t.Helper()
	c, err := certs.NewCA(name, lifetime)
	if err != nil {
		t.Fatal(err)
	}
	ca := &CA{Cert: c.Cert, key: c.Key}
	ca.serial.Store(1)
	return ca
}

// Pool is a pool holding only the authority.
func (ca *CA) Pool() *x509.CertPool {
	p := x509.NewCertPool()
	p.AddCert(ca.Cert)
	return p
}

// Issue makes a certificate with common name cn and, as subject
// alternative names, every entry of sans that parses as an IP address as
// one and the rest as DNS names. It is valid for servers and clients (a
// node's certificate of internal/certs, but that it may name no
// address).
func (ca *CA) Issue(t testing.TB, cn string, sans ...string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(ca.serial.Add(1)),
		Subject:      pkix.Name{CommonName: cn},
		NotBefore:    time.Now().Add(-time.Hour),
		NotAfter:     time.Now().Add(lifetime - time.Hour),
		KeyUsage:     x509.KeyUsageDigitalSignature,
		ExtKeyUsage:  []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	for _, s := range sans {
		if ip := net.ParseIP(s); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, s)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	leaf, err := x509.ParseCertificate(der)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key, Leaf: leaf}
}

// Config is a TLS configuration for the TCP fabric presenting cert and
// trusting the authority in both roles.
func (ca *CA) Config(cert tls.Certificate) *tls.Config {
	return &tls.Config{Certificates: []tls.Certificate{cert}, RootCAs: ca.Pool(), ClientCAs: ca.Pool()}
}

// WriteCA writes the authority's certificate to dir/NAME.crt and returns
// its path.
func (ca *CA) WriteCA(t testing.TB, dir, name string) string {
	t.Helper()
	p := filepath.Join(dir, name+".crt")
	writePEM(t, p, "CERTIFICATE", ca.Cert.Raw)
	return p
}

// WriteCert writes cert and its key to dir/NAME.crt and dir/NAME.key and
// returns the two paths.
func WriteCert(t testing.TB, cert tls.Certificate, dir, name string) (certFile, keyFile string) {
	t.Helper()
	certFile, keyFile = filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key")
	writePEM(t, certFile, "CERTIFICATE", cert.Certificate[0])
	der, err := x509.MarshalPKCS8PrivateKey(cert.PrivateKey)
	if err != nil {
		t.Fatal(err)
	}
	writePEM(t, keyFile, "PRIVATE KEY", der)
	return certFile, keyFile
}

func writePEM(t testing.TB, path, typ string, der []byte) {
	t.Helper()
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: typ, Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
}
