// The files: PEM certificates and keys, written whole or not at all and
// never over one that is there unless asked.

package certs

import (
	"crypto"
	"crypto/x509"
	"encoding/pem"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
)

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
		if !overwrite {
			os.Remove(keyPath) // ours: made just now
		}
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
		if !overwrite {
			os.Remove(keyPath) // ours: made just now
		}
		return "", "", existsMessage(certPath, err)
	}
	return certPath, keyPath, nil
}
