package conf

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/testca"
)

func TestTLS(t *testing.T) {
	if c, err := (TLS{}).Config(); c != nil || err != nil {
		t.Fatalf("no TLS configured: %v %v", c, err)
	}
	dir := t.TempDir()
	ca := testca.New(t, "test ca")
	caFile := ca.WriteCA(t, dir, "ca")
	cert, key := testca.WriteCert(t, ca.Issue(t, "node-1"), dir, "node")
	if err := (TLS{Cert: cert, CA: caFile}).Validate(); err == nil {
		t.Fatal("a certificate without its key was taken")
	}
	if _, err := (TLS{Cert: cert, Key: key, CA: cert + ".missing"}).Config(); err == nil {
		t.Fatal("a missing authority was taken")
	}
	if _, err := (TLS{Cert: cert, Key: caFile, CA: caFile}).Config(); err == nil {
		t.Fatal("a key that is no key was taken")
	}
	c, err := TLS{Cert: cert, Key: key, CA: caFile}.Config()
	if err != nil {
		t.Fatal(err)
	}
	got := func() string {
		t.Helper()
		kc, err := c.GetClientCertificate(nil)
		if err != nil {
			t.Fatal(err)
		}
		sc, err := c.GetCertificate(nil)
		if err != nil || sc != kc {
			t.Fatalf("server and client certificates differ: %v", err)
		}
		return kc.Leaf.Subject.CommonName
	}
	if n := got(); n != "node-1" {
		t.Fatalf("certificate of %q", n)
	}
	// A renewed certificate is taken from the next handshake on; a
	// half-written one is not, until it is whole.
	later := time.Now().Add(time.Minute)
	os.WriteFile(cert, []byte("-----BEGIN CERT"), 0o600)
	os.Chtimes(cert, later, later)
	if n := got(); n != "node-1" {
		t.Fatalf("a broken certificate file replaced the working one: %q", n)
	}
	testca.WriteCert(t, ca.Issue(t, "node-2"), dir, "node")
	later = later.Add(time.Minute)
	os.Chtimes(cert, later, later)
	os.Chtimes(key, later, later)
	if n := got(); n != "node-2" {
		t.Fatalf("renewed certificate not taken: %q", n)
	}
	os.Remove(filepath.Join(dir, "node.crt"))
	if n := got(); n != "node-2" {
		t.Fatalf("certificate gone: %q, want the last one kept", n)
	}
}

// TestFabricKeepsTLS: a caller's own fabric is used where no TLS is
// configured, and refused where it is (it would drop it).
func TestFabricKeepsTLS(t *testing.T) {
	own := tcp.New(tcp.Options{})
	if f, err := (TLS{}).Fabric(own, "off", tcp.Options{}); err != nil || f != own {
		t.Fatalf("without TLS: %v, %v; want the caller's", f, err)
	}
	if _, err := (TLS{Configured: true, Cert: "c", Key: "k", CA: "a"}).Fabric(own, "off", tcp.Options{}); err == nil {
		t.Fatal("with TLS configured, the caller's fabric was taken")
	}
	if f, err := (TLS{}).Fabric(nil, "5s", tcp.Options{}); err != nil || f == nil {
		t.Fatalf("made without TLS: %v, %v", f, err)
	}
}
