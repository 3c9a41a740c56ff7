// Package certs makes and lists the certificates rnbd's TLS runs on: an
// authority, a storage node's certificate (for the TCP fabric and the
// admin listener, server and client in one) and a client's (a worker's
// rnbd-client, or an operator's or orchestrator's on the admin listener).
// It is what "rnbd-server cert" and "rnbd-client cert" do, so that the
// packages alone make a working set, as cockroach's "cert" commands do
// for its operators.
//
// Keys are ECDSA P-256 in PKCS #8, written 0600; certificates have
// random 128-bit serial numbers and say their usages (serverAuth and
// clientAuth for a node, clientAuth for a client). A certificate's
// identity is its common name (pkg/rtrs/fabric/tcp.CertNames reads it
// first); a node's addresses and host names are its IP and DNS
// alternative names, which clients check the address they dial against.
//
// certs.go makes keys and certificates; files.go writes and reads them
// (PEM, never over a file that is there unless asked); list.go says what
// a directory of them holds.
package certs

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"errors"
	"fmt"
	"math/big"
	"net"
	"strings"
	"time"
	"unicode"
	"unicode/utf8"
)

// Kind is what a certificate is for.
type Kind string

const (
	// KindCA is the authority: it signs the others.
	KindCA Kind = "ca"
	// KindNode is a storage node's: serverAuth for its listeners
	// (fabric and admin) and clientAuth, naming its addresses.
	KindNode Kind = "node"
	// KindClient is a client's: clientAuth, its name the identity.
	KindClient Kind = "client"
)

// The lifetimes when none is given: an authority lives long, as it is
// in every peer's configuration; the others are renewed, which the
// daemons take without a restart (operations.md, "Renewal").
const (
	DefaultCALifetime = 10 * 365 * 24 * time.Hour
	DefaultLifetime   = 2 * 365 * 24 * time.Hour
)

// CAFile is the authority's certificate in a certificates directory.
const CAFile = "ca.crt"

// backdate is how far before now a certificate starts: a peer whose
// clock is a little behind accepts it.
const backdate = 5 * time.Minute

// CA is an authority: its certificate and key.
type CA struct {
	Cert *x509.Certificate
	Key  crypto.Signer
}

// Request is a certificate to issue.
type Request struct {
	Kind Kind
	// Name is the subject's common name: the identity.
	Name string
	// Hosts are a node's addresses and host names: each IP address
	// an IP alternative name, each other a DNS one.
	Hosts []string
	// Lifetime is how long it is valid (0: DefaultLifetime, or less
	// if the authority expires sooner).
	Lifetime time.Duration
}

// NewKey makes a private key: ECDSA on P-256.
func NewKey() (*ecdsa.PrivateKey, error) {
	return ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
}

// serial is a random serial number of 128 bits, positive.
func serial() (*big.Int, error) {
	n, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, err
	}
	return n.Add(n, big.NewInt(1)), nil
}

// NewCA makes an authority named name, valid for lifetime (0:
// DefaultCALifetime).
func NewCA(name string, lifetime time.Duration) (*CA, error) {
	if err := CheckName(name); err != nil {
		return nil, err
	}
	if lifetime == 0 {
		lifetime = DefaultCALifetime
	}
	if lifetime < 0 {
		return nil, fmt.Errorf("lifetime %v: want a positive duration", lifetime)
	}
	key, err := NewKey()
	if err != nil {
		return nil, err
	}
	sn, err := serial()
	if err != nil {
		return nil, err
	}
	now := time.Now()
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: name, Organization: []string{"rnbd"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(lifetime),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageCRLSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
		MaxPathLenZero:        true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, err
	}
	return &CA{Cert: cert, Key: key}, nil
}

// Issue makes a key and a certificate of the authority for r.
func (ca *CA) Issue(r Request) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	if err := CheckName(r.Name); err != nil {
		return nil, nil, err
	}
	var usages []x509.ExtKeyUsage
	switch r.Kind {
	case KindNode:
		if len(r.Hosts) == 0 {
			return nil, nil, errors.New("a node's certificate names the addresses (or host names) clients dial: give at least one")
		}
		usages = []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth}
	case KindClient:
		if len(r.Hosts) > 0 {
			return nil, nil, errors.New("a client's certificate names its identity only")
		}
		usages = []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth}
	default:
		return nil, nil, fmt.Errorf("kind %q: want %s or %s", r.Kind, KindNode, KindClient)
	}
	var ips []net.IP
	var dns []string
	for _, h := range r.Hosts {
		h = strings.TrimSuffix(strings.TrimPrefix(h, "["), "]")
		if ip := net.ParseIP(h); ip != nil {
			ips = append(ips, ip)
			continue
		}
		if err := checkHost(h); err != nil {
			return nil, nil, err
		}
		dns = append(dns, h)
	}
	if r.Lifetime < 0 {
		return nil, nil, fmt.Errorf("lifetime %v: want a positive duration", r.Lifetime)
	}
	now := time.Now()
	notAfter := now.Add(r.Lifetime)
	if r.Lifetime == 0 {
		// The default, as long as the authority lasts.
		notAfter = now.Add(DefaultLifetime)
		if notAfter.After(ca.Cert.NotAfter) {
			notAfter = ca.Cert.NotAfter
		}
	}
	if notAfter.After(ca.Cert.NotAfter) {
		return nil, nil, fmt.Errorf("the authority expires %s, before the certificate would (%s): give a shorter lifetime, or make a new authority",
			ca.Cert.NotAfter.UTC().Format(time.DateOnly), notAfter.UTC().Format(time.DateOnly))
	}
	sn, err := serial()
	if err != nil {
		return nil, nil, err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          sn,
		Subject:               pkix.Name{CommonName: r.Name},
		NotBefore:             now.Add(-backdate),
		NotAfter:              notAfter,
		KeyUsage:              x509.KeyUsageDigitalSignature,
		ExtKeyUsage:           usages,
		BasicConstraintsValid: true,
		IPAddresses:           ips,
		DNSNames:              dns,
	}
	key, err := NewKey()
	if err != nil {
		return nil, nil, err
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.Cert, &key.PublicKey, ca.Key)
	if err != nil {
		return nil, nil, err
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return nil, nil, err
	}
	return cert, key, nil
}

// CheckName checks a common name: not empty, printable, at most 64
// bytes (RFC 5280's bound).
func CheckName(name string) error {
	if name == "" {
		return errors.New("a certificate's name (its identity) is empty")
	}
	if len(name) > 64 {
		return fmt.Errorf("name %q: longer than 64 bytes", name)
	}
	if !utf8.ValidString(name) {
		return fmt.Errorf("name %q: not UTF-8", name)
	}
	for _, r := range name {
		if !unicode.IsPrint(r) {
			return fmt.Errorf("name %q: has a character that is not printable", name)
		}
	}
	return nil
}

// checkHost checks a DNS name: labels of letters, digits, '-' and '_',
// a '*' for a whole first label.
func checkHost(h string) error {
	if h == "" || len(h) > 253 {
		return fmt.Errorf("host %q: not an IP address nor a host name", h)
	}
	for i, l := range strings.Split(h, ".") {
		if l == "*" && i == 0 {
			continue
		}
		if l == "" || len(l) > 63 {
			return fmt.Errorf("host %q: not an IP address nor a host name", h)
		}
		for _, r := range l {
			if !(r >= 'a' && r <= 'z' || r >= 'A' && r <= 'Z' || r >= '0' && r <= '9' || r == '-' || r == '_') {
				return fmt.Errorf("host %q: not an IP address nor a host name (%q)", h, r)
			}
		}
	}
	return nil
}
