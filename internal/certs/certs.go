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
package certs

import (
	"crypto"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
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

// EncodeCert is cert as PEM.
func EncodeCert(cert *x509.Certificate) []byte {
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: cert.Raw})
}

// EncodeKey is key as PEM (PKCS #8).
func EncodeKey(key crypto.Signer) ([]byte, error) {
	der, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		return nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), nil
}

// ParseCert is the first certificate of PEM data.
func ParseCert(data []byte) (*x509.Certificate, error) {
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			return nil, errors.New("no PEM certificate in it")
		}
		if b.Type == "CERTIFICATE" {
			return x509.ParseCertificate(b.Bytes)
		}
	}
}

// ParseKey is the private key of PEM data (PKCS #8, SEC 1 or PKCS #1).
func ParseKey(data []byte) (crypto.Signer, error) {
	for {
		var b *pem.Block
		b, data = pem.Decode(data)
		if b == nil {
			return nil, errors.New("no PEM private key in it")
		}
		var k any
		var err error
		switch b.Type {
		case "PRIVATE KEY":
			k, err = x509.ParsePKCS8PrivateKey(b.Bytes)
		case "EC PRIVATE KEY":
			k, err = x509.ParseECPrivateKey(b.Bytes)
		case "RSA PRIVATE KEY":
			k, err = x509.ParsePKCS1PrivateKey(b.Bytes)
		default:
			continue
		}
		if err != nil {
			return nil, err
		}
		s, ok := k.(crypto.Signer)
		if !ok {
			return nil, fmt.Errorf("a %T cannot sign", k)
		}
		return s, nil
	}
}

// Matches reports whether key is the private key of cert.
func Matches(cert *x509.Certificate, key crypto.Signer) bool {
	pub, ok := key.Public().(interface{ Equal(crypto.PublicKey) bool })
	return ok && pub.Equal(cert.PublicKey)
}

// ErrExists is the error of a file that is there and is not to be
// replaced (errors.Is(err, os.ErrExist) holds too).
var ErrExists = errors.New("exists")

// writeFile writes data to path with mode, whole or not at all: a
// temporary file in its directory, synced, then linked to path (which
// fails if path exists) or, with overwrite, renamed over it.
func writeFile(path string, data []byte, mode os.FileMode, overwrite bool) error {
	dir := filepath.Dir(path)
	f, err := os.CreateTemp(dir, ".rnbd-cert-*")
	if err != nil {
		return err
	}
	tmp := f.Name()
	defer os.Remove(tmp)
	if err := f.Chmod(mode); err != nil {
		f.Close()
		return err
	}
	if _, err := f.Write(data); err != nil {
		f.Close()
		return err
	}
	if err := f.Sync(); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	if overwrite {
		err = os.Rename(tmp, path)
	} else {
		err = os.Link(tmp, path)
	}
	if err != nil {
		return err
	}
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// absent checks that none of paths exists, unless overwrite: a file
// there is an error naming it and --overwrite.
func absent(overwrite bool, paths ...string) error {
	if overwrite {
		return nil
	}
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			return &existsError{path: p}
		} else if !errors.Is(err, os.ErrNotExist) {
			return err
		}
	}
	return nil
}

type existsError struct{ path string }

func (e *existsError) Error() string {
	return e.path + " exists: not replaced (give --overwrite to replace it)"
}

func (e *existsError) Is(target error) bool { return target == ErrExists || target == os.ErrExist }

// WriteCA writes the authority's certificate to dir/ca.crt (0644) and its
// key to keyPath (0600), making dir (0700) if it is not there. Unless
// overwrite, neither may exist.
func WriteCA(ca *CA, dir, keyPath string, overwrite bool) (certPath string, err error) {
	certPath = filepath.Join(dir, CAFile)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	if err := os.MkdirAll(filepath.Dir(keyPath), 0o700); err != nil {
		return "", err
	}
	if err := absent(overwrite, certPath, keyPath); err != nil {
		return "", err
	}
	kb, err := EncodeKey(ca.Key)
	if err != nil {
		return "", err
	}
	if err := writeFile(keyPath, kb, 0o600, overwrite); err != nil {
		return "", existsMessage(keyPath, err)
	}
	if err := writeFile(certPath, EncodeCert(ca.Cert), 0o644, overwrite); err != nil {
		return "", existsMessage(certPath, err)
	}
	return certPath, nil
}

// existsMessage says which file was there (a race with absent).
func existsMessage(path string, err error) error {
	if errors.Is(err, os.ErrExist) {
		return &existsError{path: path}
	}
	return err
}

// LoadCA reads the authority of dir (ca.crt) and its key at keyPath,
// and checks they are a pair and an authority.
func LoadCA(dir, keyPath string) (*CA, error) {
	certPath := filepath.Join(dir, CAFile)
	cb, err := os.ReadFile(certPath)
	if err != nil {
		return nil, fmt.Errorf("the authority's certificate: %w (make one with cert create-ca)", err)
	}
	cert, err := ParseCert(cb)
	if err != nil {
		return nil, fmt.Errorf("the authority's certificate %s: %w", certPath, err)
	}
	if !cert.IsCA {
		return nil, fmt.Errorf("%s is not an authority's certificate (no CA:TRUE)", certPath)
	}
	kb, err := os.ReadFile(keyPath)
	if err != nil {
		return nil, fmt.Errorf("the authority's key: %w", err)
	}
	key, err := ParseKey(kb)
	if err != nil {
		return nil, fmt.Errorf("the authority's key %s: %w", keyPath, err)
	}
	if !Matches(cert, key) {
		return nil, fmt.Errorf("the key %s is not the key of %s", keyPath, certPath)
	}
	return &CA{Cert: cert, Key: key}, nil
}

// WriteCert writes cert to dir/BASE.crt (0644) and key to dir/BASE.key
// (0600). Unless overwrite, neither may exist.
func WriteCert(dir, base string, cert *x509.Certificate, key crypto.Signer, overwrite bool) (certPath, keyPath string, err error) {
	if base == "" || base == "." || base == ".." || strings.ContainsAny(base, "/\x00") {
		return "", "", fmt.Errorf("file name %q: want a name without '/'", base)
	}
	if base+".crt" == CAFile {
		return "", "", fmt.Errorf("file name %q: ca.crt is the authority's", base)
	}
	certPath, keyPath = filepath.Join(dir, base+".crt"), filepath.Join(dir, base+".key")
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", "", err
	}
	if err := absent(overwrite, certPath, keyPath); err != nil {
		return "", "", err
	}
	kb, err := EncodeKey(key)
	if err != nil {
		return "", "", err
	}
	// The key first: a certificate is never there without its key.
	if err := writeFile(keyPath, kb, 0o600, overwrite); err != nil {
		return "", "", existsMessage(keyPath, err)
	}
	if err := writeFile(certPath, EncodeCert(cert), 0o644, overwrite); err != nil {
		os.Remove(keyPath)
		return "", "", existsMessage(certPath, err)
	}
	return certPath, keyPath, nil
}

// Usages are the extended key usages of cert by their names in
// openssl's and the RFC's words (serverAuth, clientAuth, ...).
func Usages(cert *x509.Certificate) []string {
	var out []string
	for _, u := range cert.ExtKeyUsage {
		switch u {
		case x509.ExtKeyUsageServerAuth:
			out = append(out, "serverAuth")
		case x509.ExtKeyUsageClientAuth:
			out = append(out, "clientAuth")
		case x509.ExtKeyUsageAny:
			out = append(out, "anyExtendedKeyUsage")
		case x509.ExtKeyUsageEmailProtection:
			out = append(out, "emailProtection")
		case x509.ExtKeyUsageCodeSigning:
			out = append(out, "codeSigning")
		default:
			out = append(out, fmt.Sprintf("usage%d", u))
		}
	}
	if cert.IsCA && cert.KeyUsage&x509.KeyUsageCertSign != 0 {
		out = append([]string{"certSign"}, out...)
	}
	return out
}

// KindOf says what cert is for, as Issue makes them: an authority, a
// node's (serverAuth), a client's (clientAuth only), or "other".
func KindOf(cert *x509.Certificate) Kind {
	if cert.IsCA {
		return KindCA
	}
	u := strings.Join(Usages(cert), ",")
	switch {
	case strings.Contains(u, "serverAuth"):
		return KindNode
	case strings.Contains(u, "clientAuth"):
		return KindClient
	}
	return "other"
}
