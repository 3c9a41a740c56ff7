package lint

import (
	"crypto/tls"
	"math/big"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/test/testca"
)

// secretKeys are the keys of the controller's Secret, as the chart mounts
// it at /etc/rnbd/tls and the configuration names them.
var secretKeys = []string{"tls.crt", "tls.key", "ca.crt"}

// writeSecretVersion writes one version of the controller's Secret as the
// kubelet's atomic writer does: the files in a directory of their own,
// named after the time, beside the ..data link. A version written later
// has later times (a rotation comes well after the first write).
func writeSecretVersion(t *testing.T, dir, version string, ca *testca.CA, cert tls.Certificate, at time.Time) {
	t.Helper()
	v := filepath.Join(dir, version)
	if err := os.Mkdir(v, 0o755); err != nil {
		t.Fatal(err)
	}
	testca.WriteCert(t, cert, v, "tls")
	ca.WriteCA(t, v, "ca")
	for _, k := range secretKeys {
		if err := os.Chtimes(filepath.Join(v, k), at, at); err != nil {
			t.Fatal(err)
		}
	}
	// ..data names the version at once: a new link renamed over it.
	tmp := filepath.Join(dir, "..data_tmp")
	if err := os.Symlink(version, tmp); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
}

// TestControllerCertificateRotation: docs/kubernetes.md's rotation of the
// controller's certificate ("The controller's certificate") holds for a
// Secret volume as the kubelet lays one out and updates it — each key a
// link through ..data into a directory of the version, an update a new
// directory and ..data swapped by a rename. With the TLS configuration
// rnbd-csi's controller dials the storage nodes with (internal/conf,
// [tls] of csi.toml naming the mounted files), a storage node's admin
// listener sees the old certificate on a connection made before the
// update and the new one, of the same name, on the next connection,
// without a restart.
func TestControllerCertificateRotation(t *testing.T) {
	ca := testca.New(t, "fleet ca")
	dir := t.TempDir() // the volume, /etc/rnbd/tls
	start := time.Now().Add(-time.Hour)
	old := ca.Issue(t, "csi-controller")
	writeSecretVersion(t, dir, "..2026_11_01_10_00_00.1", ca, old, start)
	for _, k := range secretKeys {
		if err := os.Symlink(filepath.Join("..data", k), filepath.Join(dir, k)); err != nil {
			t.Fatal(err)
		}
	}
	cfg, err := conf.TLS{Cert: filepath.Join(dir, "tls.crt"), Key: filepath.Join(dir, "tls.key"),
		CA: filepath.Join(dir, "ca.crt"), ServerName: "storage-a"}.Config()
	if err != nil {
		t.Fatal(err)
	}
	cfg.MinVersion = tls.VersionTLS13 // as ctl.DialTLS sets it

	// A storage node's admin listener: mutual TLS, the client's
	// certificate of the CA required; it tells each connection's serial.
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{
		Certificates: []tls.Certificate{ca.Issue(t, "storage-a", "storage-a")},
		ClientCAs:    ca.Pool(), ClientAuth: tls.RequireAndVerifyClientCert, MinVersion: tls.VersionTLS13,
	})
	if err != nil {
		t.Fatal(err)
	}
	serials := make(chan *big.Int, 2)
	var conns sync.WaitGroup
	conns.Add(1)
	go func() {
		defer conns.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			conns.Add(1)
			go func() {
				defer conns.Done()
				defer c.Close()
				tc := c.(*tls.Conn)
				var serial *big.Int
				if tc.Handshake() == nil && len(tc.ConnectionState().PeerCertificates) > 0 {
					serial = tc.ConnectionState().PeerCertificates[0].SerialNumber
				}
				serials <- serial
				// Up until the client closes it.
				_, _ = c.Read(make([]byte, 1))
			}()
		}
	}()
	defer func() {
		ln.Close()
		conns.Wait()
	}()
	dial := func() (*tls.Conn, *big.Int) {
		t.Helper()
		c, err := tls.Dial("tcp", ln.Addr().String(), cfg)
		if err != nil {
			t.Fatalf("dialing the storage node: %v", err)
		}
		// TLS 1.3: the server has the client's certificate after the
		// client's Dial returned; wait for its handshake.
		s := <-serials
		if s == nil {
			t.Fatal("the storage node refused the controller's certificate")
		}
		return c, s
	}

	before, s1 := dial()
	defer before.Close()
	if s1.Cmp(old.Leaf.SerialNumber) != 0 {
		t.Fatalf("first connection presented serial %v, want the Secret's %v", s1, old.Leaf.SerialNumber)
	}

	// kubectl apply of the renewed Secret: the kubelet writes the new
	// version and swaps ..data.
	renewed := ca.Issue(t, "csi-controller")
	writeSecretVersion(t, dir, "..2026_12_01_10_00_00.2", ca, renewed, start.Add(30*time.Minute))

	after, s2 := dial()
	defer after.Close()
	if s2.Cmp(renewed.Leaf.SerialNumber) != 0 {
		t.Errorf("the connection after the update presented serial %v, want the renewed certificate's %v (the old one is %v)", s2, renewed.Leaf.SerialNumber, old.Leaf.SerialNumber)
	}
	if got := before.ConnectionState().HandshakeComplete; !got {
		t.Error("the connection made before the update did not stay up")
	}
}
