package certs

import (
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"
)

// Entry is a certificate file of a directory, as List finds it.
type Entry struct {
	// File is the certificate's file name in the directory.
	File string
	Kind Kind
	// Names are the identity names, as the daemons read them (Names).
	Names []string
	// IPs are its IP alternative names.
	IPs      []string
	Usages   []string
	NotAfter time.Time
	Serial   string
	// Key says the key beside it (BASE.key): "ok", "missing" or
	// "does not match"; an authority's key is kept elsewhere: "-".
	Key string
	// Status is "ok", or why a peer would refuse it: expired, not yet
	// valid, not signed by the directory's ca.crt, or no ca.crt.
	Status string
}

// List reads every *.crt of dir, the authority (ca.crt) first.
func List(dir string, now time.Time) ([]Entry, error) {
	files, err := filepath.Glob(filepath.Join(dir, "*.crt"))
	if err != nil {
		return nil, err
	}
	if _, err := os.Stat(dir); err != nil {
		return nil, err
	}
	sort.Slice(files, func(i, j int) bool {
		ci, cj := filepath.Base(files[i]) == CAFile, filepath.Base(files[j]) == CAFile
		if ci != cj {
			return ci
		}
		return files[i] < files[j]
	})
	var roots *x509.CertPool
	caErr := "no " + CAFile + " in the directory"
	if b, err := os.ReadFile(filepath.Join(dir, CAFile)); err == nil {
		roots = x509.NewCertPool()
		if !roots.AppendCertsFromPEM(b) {
			roots, caErr = nil, CAFile+" holds no certificate"
		}
	}
	var out []Entry
	for _, f := range files {
		e := Entry{File: filepath.Base(f), Key: "-"}
		b, err := os.ReadFile(f)
		if err != nil {
			e.Status = err.Error()
			out = append(out, e)
			continue
		}
		cert, err := ParseCert(b)
		if err != nil {
			e.Status = err.Error()
			out = append(out, e)
			continue
		}
		e.Kind, e.Names, e.Usages, e.NotAfter = KindOf(cert), Names(cert), Usages(cert), cert.NotAfter
		e.Serial = fmt.Sprintf("%x", cert.SerialNumber)
		for _, ip := range cert.IPAddresses {
			e.IPs = append(e.IPs, ip.String())
		}
		if e.Kind != KindCA {
			e.Key = keyStatus(cert, strings.TrimSuffix(f, ".crt")+".key")
		}
		e.Status = status(cert, roots, caErr, now)
		out = append(out, e)
	}
	return out, nil
}

// keyStatus says whether the key at path is cert's.
func keyStatus(cert *x509.Certificate, path string) string {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return "missing"
	}
	if err != nil {
		return err.Error()
	}
	k, err := ParseKey(b)
	if err != nil {
		return "unreadable: " + err.Error()
	}
	if !Matches(cert, k) {
		return "does not match"
	}
	return "ok"
}

// status says whether cert verifies against roots at now.
func status(cert *x509.Certificate, roots *x509.CertPool, caErr string, now time.Time) string {
	switch {
	case now.After(cert.NotAfter):
		return "expired " + cert.NotAfter.UTC().Format(time.DateOnly)
	case now.Before(cert.NotBefore):
		return "not valid before " + cert.NotBefore.UTC().Format(time.RFC3339)
	case roots == nil:
		return caErr
	}
	_, err := cert.Verify(x509.VerifyOptions{Roots: roots, CurrentTime: now, KeyUsages: []x509.ExtKeyUsage{x509.ExtKeyUsageAny}})
	if err != nil {
		return "not of " + CAFile + ": " + err.Error()
	}
	return "ok"
}

// Names are cert's names as the daemons read them: the common name, then
// the DNS, URI and e-mail alternative names, each once (what
// pkg/rtrs/fabric/tcp.CertNames gives, which this package does not
// import: the tests of the fabric use test/testca, which uses it).
func Names(cert *x509.Certificate) []string {
	var names []string
	add := func(n string) {
		if n != "" && !slices.Contains(names, n) {
			names = append(names, n)
		}
	}
	add(cert.Subject.CommonName)
	for _, n := range cert.DNSNames {
		add(n)
	}
	for _, u := range cert.URIs {
		add(u.String())
	}
	for _, n := range cert.EmailAddresses {
		add(n)
	}
	return names
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
