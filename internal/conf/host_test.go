package conf

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestCheckLocal: an address of this host, a port in use on it, every
// interface's address and a name of this host are fine; an address of
// another host is ErrNotLocal, naming this host's.
func TestCheckLocal(t *testing.T) {
	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	for _, h := range []string{"", "127.0.0.1", "0.0.0.0", "::", "localhost"} {
		if err := CheckLocal(h); err != nil {
			t.Errorf("%q: %v", h, err)
		}
	}
	for _, h := range []string{"203.0.113.77", "198.51.100.77"} {
		if l, err := net.Listen("tcp", h+":0"); err == nil {
			l.Close()
			continue // this host has it
		}
		err := CheckLocal(h)
		if !errors.Is(err, ErrNotLocal) || !strings.Contains(err.Error(), "(its addresses: ") || !strings.Contains(err.Error(), "127.0.0.1") {
			t.Errorf("%s: %v", h, err)
		}
	}
}

// TestCertWarnings: a certificate without the usage its peers check, one
// not yet valid, expired or expiring within 30 days is a warning; one
// with the usage, or with no extended key usage at all, in date, is not.
func TestCertWarnings(t *testing.T) {
	dir := t.TempDir()
	now := time.Now()
	write := func(name string, usages []x509.ExtKeyUsage, from, to time.Time) TLS {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: name},
			NotBefore: from, NotAfter: to, ExtKeyUsage: usages}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
		if err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(dir, name+".crt")
		os.WriteFile(p, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o644)
		return TLS{Cert: p}
	}
	year := 365 * 24 * time.Hour
	server := []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth}
	for _, c := range []struct {
		t    TLS
		want string
	}{
		{write("ok", server, now.Add(-time.Hour), now.Add(year)), ""},
		{write("any", nil, now.Add(-time.Hour), now.Add(year)), ""},
		{write("client", []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}, now.Add(-time.Hour), now.Add(year)),
			"has no serverAuth extended key usage (it has clientAuth): peers refuse it as a server's"},
		{write("early", server, now.Add(time.Hour), now.Add(year)), "is not valid before"},
		{write("expired", server, now.Add(-year), now.Add(-time.Hour)), "expired on"},
		{write("soon", server, now.Add(-year), now.Add(10*24*time.Hour)), "in 9 days"},
	} {
		got := strings.Join(c.t.CertWarnings(x509.ExtKeyUsageServerAuth, "server", now), "\n")
		if c.want == "" && got != "" || !strings.Contains(got, c.want) {
			t.Errorf("%s: %q, want %q", c.t.Cert, got, c.want)
		}
	}
}
