package conf

import (
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// TLS is a daemon's TLS on the TCP fabric: its certificate and key and
// the authority its peers' certificates must chain to, as PEM files.
// Either all three are set or none; where the configuration file has a
// [tls] table (Configured), all three.
type TLS struct {
	Cert string `toml:"cert"`
	Key  string `toml:"key"`
	CA   string `toml:"ca"`
	// ServerName is what a client checks the server's certificate
	// against; empty: the address it dials (the certificate then names
	// the server's addresses as IP subject alternative names).
	ServerName string `toml:"server_name"`
	// Configured: the configuration file has a [tls] table. The daemon
	// then runs with TLS or not at all: a table left empty, or emptied
	// by flags, is an error, not plaintext.
	Configured bool `toml:"-"`
}

// Enabled reports whether TLS is configured.
func (t TLS) Enabled() bool { return t.Configured || t.Cert != "" || t.Key != "" || t.CA != "" }

// Validate checks that the settings are whole.
func (t TLS) Validate() error {
	if !t.Enabled() {
		return nil
	}
	var missing []string
	for _, f := range []struct{ name, v string }{{"cert", t.Cert}, {"key", t.Key}, {"ca", t.CA}} {
		if f.v == "" {
			missing = append(missing, f.name)
		}
	}
	switch {
	case len(missing) == 3:
		return errors.New("tls: the configuration has [tls] but sets none of cert, key and ca: " +
			"the daemon does not run without the TLS it is configured with (to run without TLS, delete the [tls] table)")
	case len(missing) > 0:
		return fmt.Errorf("tls: cert, key and ca must be set together (%s not set)", strings.Join(missing, " and "))
	}
	return nil
}

// Config loads the files and returns the fabric's configuration, or nil
// if TLS is not configured. The certificate and key are read again when
// either file changes (a renewed certificate is used from the next
// connection on, without a restart); a pair that does not load then
// keeps the previous one. The authority is read once.
func (t TLS) Config() (*tls.Config, error) {
	if !t.Enabled() {
		return nil, nil
	}
	if err := t.Validate(); err != nil {
		return nil, err
	}
	pem, err := os.ReadFile(t.CA)
	if err != nil {
		return nil, fmt.Errorf("tls: ca: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("tls: ca %s: no PEM certificate in it", t.CA)
	}
	kp := &keyPair{cert: t.Cert, key: t.Key}
	if _, err := kp.get(); err != nil {
		return nil, err
	}
	return &tls.Config{
		RootCAs:    pool,
		ClientCAs:  pool,
		ServerName: t.ServerName,
		GetCertificate: func(*tls.ClientHelloInfo) (*tls.Certificate, error) {
			return kp.get()
		},
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) {
			return kp.get()
		},
	}, nil
}

// Fabric is a daemon's TCP fabric: given, the caller's own (tests),
// which must not stand in for the TLS configured (it would drop it);
// else one made with this TLS and userTimeout (tcp_user_timeout,
// validated), o holding the rest of its options.
func (t TLS) Fabric(given fabric.Fabric, userTimeout string, o tcp.Options) (fabric.Fabric, error) {
	if given != nil && t.Enabled() {
		return nil, errors.New("tls: configured, but the caller gave its own TCP fabric")
	}
	if given != nil {
		return given, nil
	}
	tc, err := t.Config()
	if err != nil {
		return nil, err
	}
	o.TLS = tc
	o.UserTimeout, _ = ParseUserTimeout(userTimeout) // validated
	return tcp.New(o), nil
}

// keyPair is a certificate and key loaded from files, loaded again when
// their modification times change. It is safe for concurrent use.
type keyPair struct {
	// The files: set when made, never changed.
	cert string
	key  string

	mu sync.Mutex
	// +checklocks:mu
	loaded *tls.Certificate
	// +checklocks:mu
	certTime time.Time
	// +checklocks:mu
	keyTime time.Time
}

func (k *keyPair) get() (*tls.Certificate, error) {
	cert, key := k.cert, k.key
	k.mu.Lock()
	defer k.mu.Unlock()
	cs, err1 := os.Stat(cert)
	ks, err2 := os.Stat(key)
	if err := errors.Join(err1, err2); err != nil {
		if k.loaded != nil {
			return k.loaded, nil // being replaced, or gone: keep what works
		}
		return nil, fmt.Errorf("tls: %w", err)
	}
	if k.loaded != nil && cs.ModTime().Equal(k.certTime) && ks.ModTime().Equal(k.keyTime) {
		return k.loaded, nil
	}
	c, err := tls.LoadX509KeyPair(cert, key)
	if err != nil {
		if k.loaded != nil {
			return k.loaded, nil // half written: try again next time
		}
		return nil, fmt.Errorf("tls: certificate %s, key %s: %w", cert, key, err)
	}
	k.loaded, k.certTime, k.keyTime = &c, cs.ModTime(), ks.ModTime()
	return k.loaded, nil
}
