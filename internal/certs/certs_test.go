package certs

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// TestIssue: a node's certificate has serverAuth and clientAuth, its
// name as common name, its addresses as IP and its host names as DNS
// alternative names; a client's has clientAuth and its name only; both
// are ECDSA P-256 with random serial numbers, valid for the default
// lifetime, and signed by the authority.
func TestIssue(t *testing.T) {
	ca, err := NewCA("test CA", 0)
	if err != nil {
		t.Fatal(err)
	}
	if !ca.Cert.IsCA || ca.Cert.KeyUsage&x509.KeyUsageCertSign == 0 {
		t.Fatalf("the authority: IsCA %v, key usage %v", ca.Cert.IsCA, ca.Cert.KeyUsage)
	}
	if d := time.Until(ca.Cert.NotAfter); d < DefaultCALifetime-time.Hour || d > DefaultCALifetime {
		t.Errorf("the authority is valid for %v, want %v", d, DefaultCALifetime)
	}
	node, _, err := ca.Issue(Request{Kind: KindNode, Name: "storage-a", Hosts: []string{"10.0.9.5", "[fd00::5]", "storage-a.example"}})
	if err != nil {
		t.Fatal(err)
	}
	if got := Usages(node); !slices.Equal(got, []string{"serverAuth", "clientAuth"}) {
		t.Errorf("a node's usages %v", got)
	}
	if node.Subject.CommonName != "storage-a" || !slices.Equal(node.DNSNames, []string{"storage-a.example"}) ||
		len(node.IPAddresses) != 2 || !node.IPAddresses[0].Equal(net.ParseIP("10.0.9.5")) || !node.IPAddresses[1].Equal(net.ParseIP("fd00::5")) {
		t.Errorf("a node's names: CN %q, DNS %v, IP %v", node.Subject.CommonName, node.DNSNames, node.IPAddresses)
	}
	client, key, err := ca.Issue(Request{Kind: KindClient, Name: "worker-1"})
	if err != nil {
		t.Fatal(err)
	}
	if got := Usages(client); !slices.Equal(got, []string{"clientAuth"}) {
		t.Errorf("a client's usages %v", got)
	}
	if got := tcp.CertNames(client); !slices.Equal(got, []string{"worker-1"}) {
		t.Errorf("a client's identity names %v, want worker-1", got)
	}
	for _, c := range []*x509.Certificate{node, client, ca.Cert} {
		if got, want := Names(c), tcp.CertNames(c); !slices.Equal(got, want) {
			t.Errorf("Names %v, the fabric's %v", got, want)
		}
	}
	if key.Curve != elliptic.P256() {
		t.Errorf("key curve %v", key.Curve.Params().Name)
	}
	if _, ok := client.PublicKey.(*ecdsa.PublicKey); !ok || !Matches(client, key) {
		t.Errorf("the key is not the certificate's")
	}
	if d := time.Until(client.NotAfter); d < DefaultLifetime-time.Hour || d > DefaultLifetime {
		t.Errorf("a client's certificate is valid for %v, want %v", d, DefaultLifetime)
	}
	if node.SerialNumber.Cmp(client.SerialNumber) == 0 || client.SerialNumber.BitLen() < 64 {
		t.Errorf("serial numbers %x and %x: want random ones", node.SerialNumber, client.SerialNumber)
	}
	for _, c := range []*x509.Certificate{node, client} {
		if err := c.CheckSignatureFrom(ca.Cert); err != nil {
			t.Errorf("%s: %v", c.Subject.CommonName, err)
		}
	}
}

// TestIssueRefuses: what is not a certificate the daemons can use is
// refused, saying why.
func TestIssueRefuses(t *testing.T) {
	ca, err := NewCA("test CA", 365*24*time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		r    Request
		want string
	}{
		{Request{Kind: KindNode, Name: "n"}, "at least one"},
		{Request{Kind: KindClient, Name: "c", Hosts: []string{"10.0.0.1"}}, "identity only"},
		{Request{Kind: KindClient, Name: ""}, "empty"},
		{Request{Kind: KindClient, Name: strings.Repeat("x", 65)}, "64 bytes"},
		{Request{Kind: KindClient, Name: "a\nb"}, "not printable"},
		{Request{Kind: KindNode, Name: "n", Hosts: []string{"bad host"}}, "not an IP address nor a host name"},
		{Request{Kind: KindNode, Name: "n", Hosts: []string{"a..b"}}, "not an IP address nor a host name"},
		{Request{Kind: KindClient, Name: "c", Lifetime: 2 * 365 * 24 * time.Hour}, "the authority expires"},
		{Request{Kind: "server", Name: "c"}, "want node or client"},
	} {
		if _, _, err := ca.Issue(c.r); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%+v: %v, want an error saying %q", c.r, err, c.want)
		}
	}
}

// TestWriteFiles: keys are written 0600, certificates 0644; nothing is
// replaced without overwrite, and with it both are; the authority loads
// back only with its own key.
func TestWriteFiles(t *testing.T) {
	dir := t.TempDir()
	pki, caKey := filepath.Join(dir, "pki"), filepath.Join(dir, "private", "ca.key")
	ca, err := NewCA("test CA", 0)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := WriteCA(ca, pki, caKey, false)
	if err != nil {
		t.Fatal(err)
	}
	mode := func(p string) os.FileMode {
		st, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		return st.Mode().Perm()
	}
	if mode(caKey) != 0o600 || mode(caCert) != 0o644 || mode(pki) != 0o700 {
		t.Errorf("modes: key %v, certificate %v, directory %v", mode(caKey), mode(caCert), mode(pki))
	}
	other, _ := NewCA("other CA", 0)
	if _, err := WriteCA(other, pki, caKey, false); !errors.Is(err, ErrExists) || !strings.Contains(err.Error(), "--overwrite") {
		t.Errorf("a second authority over the first: %v", err)
	}
	loaded, err := LoadCA(pki, caKey)
	if err != nil || !loaded.Cert.Equal(ca.Cert) {
		t.Fatalf("LoadCA: %v", err)
	}

	cert, key, err := loaded.Issue(Request{Kind: KindClient, Name: "ops"})
	if err != nil {
		t.Fatal(err)
	}
	cp, kp, err := WriteCert(pki, "ops", cert, key, false)
	if err != nil {
		t.Fatal(err)
	}
	if mode(kp) != 0o600 || mode(cp) != 0o644 {
		t.Errorf("modes: key %v, certificate %v", mode(kp), mode(cp))
	}
	before, _ := os.ReadFile(kp)
	cert2, key2, _ := loaded.Issue(Request{Kind: KindClient, Name: "ops"})
	if _, _, err := WriteCert(pki, "ops", cert2, key2, false); !errors.Is(err, os.ErrExist) {
		t.Errorf("a second ops without overwrite: %v", err)
	}
	if after, _ := os.ReadFile(kp); string(after) != string(before) {
		t.Errorf("the refused write changed the key")
	}
	if _, _, err := WriteCert(pki, "ops", cert2, key2, true); err != nil {
		t.Fatal(err)
	}
	if _, err := tls.LoadX509KeyPair(cp, kp); err != nil {
		t.Errorf("the renewed pair: %v", err)
	}
	if mode(kp) != 0o600 {
		t.Errorf("the renewed key's mode %v", mode(kp))
	}
	for _, base := range []string{"", "..", "a/b", "ca"} {
		if _, _, err := WriteCert(pki, base, cert, key, true); err == nil {
			t.Errorf("file name %q taken", base)
		}
	}
	// The authority with another key is refused.
	if _, err := LoadCA(pki, kp); err == nil || !strings.Contains(err.Error(), "is not the key of") {
		t.Errorf("LoadCA with ops's key: %v", err)
	}
	if _, err := LoadCA(filepath.Join(dir, "none"), caKey); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("LoadCA of no directory: %v", err)
	}
	if ents, _ := os.ReadDir(pki); len(ents) != 3 {
		t.Errorf("files left in the directory: %v (no temporary files)", ents)
	}
}

// TestHandshake: a node's and a client's certificate, loaded as the
// daemons load them (conf.TLS), complete a TLS 1.3 handshake with both
// ends verified; the server sees the client's identity; a client's
// certificate cannot serve.
func TestHandshake(t *testing.T) {
	dir := t.TempDir()
	ca, _ := NewCA("test CA", 0)
	if _, err := WriteCA(ca, dir, filepath.Join(dir, "ca.key"), false); err != nil {
		t.Fatal(err)
	}
	issue := func(kind Kind, name string, hosts ...string) conf.TLS {
		c, k, err := ca.Issue(Request{Kind: kind, Name: name, Hosts: hosts})
		if err != nil {
			t.Fatal(err)
		}
		cp, kp, err := WriteCert(dir, name, c, k, false)
		if err != nil {
			t.Fatal(err)
		}
		return conf.TLS{Cert: cp, Key: kp, CA: filepath.Join(dir, CAFile)}
	}
	srv, cli := issue(KindNode, "srv", "127.0.0.1"), issue(KindClient, "host7")
	handshake := func(server, client conf.TLS) (names []string, err error) {
		sc, err := server.Config()
		if err != nil {
			t.Fatal(err)
		}
		cc, err := client.Config()
		if err != nil {
			t.Fatal(err)
		}
		sc.ClientAuth, sc.MinVersion = tls.RequireAndVerifyClientCert, tls.VersionTLS13
		cc.ServerName = "127.0.0.1"
		a, b := net.Pipe()
		defer a.Close()
		defer b.Close()
		done := make(chan error, 1)
		s := tls.Server(a, sc)
		go func() { done <- s.Handshake() }()
		cerr := tls.Client(b, cc).Handshake()
		if cerr != nil {
			a.Close()
		}
		serr := <-done
		if err := errors.Join(cerr, serr); err != nil {
			return nil, err
		}
		return tcp.CertNames(s.ConnectionState().PeerCertificates[0]), nil
	}
	names, err := handshake(srv, cli)
	if err != nil || !slices.Equal(names, []string{"host7"}) {
		t.Fatalf("node and client: names %v, %v", names, err)
	}
	// The node's certificate is a client's too (clientAuth).
	if _, err := handshake(srv, srv); err != nil {
		t.Errorf("the node's certificate as a client: %v", err)
	}
	other := issue(KindClient, "other")
	if _, err := handshake(other, cli); err == nil {
		t.Errorf("a client's certificate served")
	}
}

// TestList: the directory's certificates with their kind, names,
// usages, whether the key beside each is its own, and whether the
// authority signed it and it is in date.
func TestList(t *testing.T) {
	dir := t.TempDir()
	ca, _ := NewCA("test CA", 0)
	if _, err := WriteCA(ca, dir, filepath.Join(t.TempDir(), "ca.key"), false); err != nil {
		t.Fatal(err)
	}
	write := func(ca *CA, base string, r Request) (*x509.Certificate, string) {
		c, k, err := ca.Issue(r)
		if err != nil {
			t.Fatal(err)
		}
		_, kp, err := WriteCert(dir, base, c, k, false)
		if err != nil {
			t.Fatal(err)
		}
		return c, kp
	}
	write(ca, "srv", Request{Kind: KindNode, Name: "srv", Hosts: []string{"127.0.0.1", "srv.example"}})
	_, kp := write(ca, "nokey", Request{Kind: KindClient, Name: "nokey"})
	os.Remove(kp)
	_, kp = write(ca, "wrongkey", Request{Kind: KindClient, Name: "wrongkey"})
	_, okp := write(ca, "ops", Request{Kind: KindClient, Name: "ops"})
	b, _ := os.ReadFile(okp)
	os.WriteFile(kp, b, 0o600)
	other, _ := NewCA("other CA", 0)
	write(other, "stranger", Request{Kind: KindClient, Name: "stranger"})

	ents, err := List(dir, time.Now())
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]Entry{}
	var order []string
	for _, e := range ents {
		got[e.File] = e
		order = append(order, e.File)
	}
	if !slices.Equal(order, []string{"ca.crt", "nokey.crt", "ops.crt", "srv.crt", "stranger.crt", "wrongkey.crt"}) {
		t.Fatalf("files %v", order)
	}
	check := func(file string, kind Kind, names, usages, key, status string) {
		t.Helper()
		e := got[file]
		if e.Kind != kind || strings.Join(e.Names, ",") != names || strings.Join(e.Usages, ",") != usages || e.Key != key ||
			!strings.HasPrefix(e.Status, status) {
			t.Errorf("%s: %+v; want kind %s, names %s, usages %s, key %s, status %s", file, e, kind, names, usages, key, status)
		}
	}
	check("ca.crt", KindCA, "test CA", "certSign", "-", "ok")
	check("srv.crt", KindNode, "srv,srv.example", "serverAuth,clientAuth", "ok", "ok")
	check("ops.crt", KindClient, "ops", "clientAuth", "ok", "ok")
	check("nokey.crt", KindClient, "nokey", "clientAuth", "missing", "ok")
	check("wrongkey.crt", KindClient, "wrongkey", "clientAuth", "does not match", "ok")
	check("stranger.crt", KindClient, "stranger", "clientAuth", "ok", "not of ca.crt")
	if ips := got["srv.crt"].IPs; !slices.Equal(ips, []string{"127.0.0.1"}) {
		t.Errorf("srv.crt's IPs %v", ips)
	}
	// Three years on, the node's certificate has expired; the
	// authority has not.
	ents, _ = List(dir, time.Now().Add(3*365*24*time.Hour))
	for _, e := range ents {
		if want := e.File != "ca.crt"; strings.HasPrefix(e.Status, "expired ") != want {
			t.Errorf("in three years, %s: %s", e.File, e.Status)
		}
	}
	if _, err := List(filepath.Join(dir, "none"), time.Now()); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("List of no directory: %v", err)
	}
}
