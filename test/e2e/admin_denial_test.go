package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/kit"
)

// The admin listener under denial (issue 40): sockets that never
// handshake, sockets that reconnect as soon as they are closed, kept-alive
// connections of an identity with no role, and requests whose header
// never ends, each from loopback addresses of its own, while a
// provisioner makes volumes on a connection of its own for each request.
// Each of its answers comes within denialBound; its latencies are
// printed.

// denialBound is how long the provisioner may wait for an answer under
// attack: loose, for a loaded 2-core machine.
const denialBound = 2 * time.Second

// newDenialRig is an admin rig with a directory pool "p" for the
// provisioner's volumes.
func newDenialRig(t *testing.T) *adminRig {
	t.Helper()
	dir := t.TempDir()
	return newAdminRig(t, poolConf("p", dir))
}

// httpsClient is a client of the rig's admin listener with dir's
// certificate of name, a new connection for each request.
func (r *adminRig) httpsClient(t *testing.T, dir, name string) *http.Client {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key"))
	if err != nil {
		t.Fatal(err)
	}
	tc := &tls.Config{RootCAs: pool(t, filepath.Join(r.pki, "ca.crt")), ServerName: "127.0.0.1", MinVersion: tls.VersionTLS13,
		GetClientCertificate: func(*tls.CertificateRequestInfo) (*tls.Certificate, error) { return &cert, nil }}
	return &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: tc, DisableKeepAlives: true}}
}

// adminURL is the URL of path on the rig's admin listener.
func (r *adminRig) adminURL(path string) string {
	return fmt.Sprintf("https://127.0.0.1:%d%s", r.admin, path)
}

// provisioner makes volumes (a list, a create, a delete, again) until
// stopped, each request on a new connection, and gives the latency of
// each answer, or fails the test with the first error.
type provisioner struct {
	t  *testing.T
	r  *adminRig
	hc *http.Client
	mu sync.Mutex
	// +checklocks:mu
	lat []time.Duration
	// +checklocks:mu
	errs     []string
	stopOnce sync.Once
	stopped  chan struct{}
	done     chan struct{}
}

// startProvisioner starts a provisioner, stopped at the end of the test
// at the latest.
func (r *adminRig) startProvisioner(t *testing.T) *provisioner {
	t.Helper()
	p := &provisioner{t: t, r: r, hc: r.httpsClient(t, r.pki, "orch"), stopped: make(chan struct{}), done: make(chan struct{})}
	t.Cleanup(func() {
		p.stop()
		<-p.done
	})
	stop := p.stopped
	go func() {
		defer close(p.done)
		for i := 0; ; i++ {
			select {
			case <-stop:
				return
			default:
			}
			name := fmt.Sprintf("d%d", i)
			p.do("GET", "/v1/volumes", "")
			p.do("POST", "/v1/volumes", fmt.Sprintf(`{"name":%q,"pool":"p","size":"1MiB"}`, name))
			p.do("DELETE", "/v1/volumes/"+name, "")
			select {
			case <-stop:
				return
			case <-time.After(50 * time.Millisecond):
			}
		}
	}()
	return p
}

// do makes one request and records how long its answer took.
func (p *provisioner) do(method, path, body string) {
	req, err := http.NewRequest(method, p.r.adminURL(path), strings.NewReader(body))
	if err != nil {
		panic(err)
	}
	t0 := time.Now()
	resp, err := p.hc.Do(req)
	d := time.Since(t0)
	var b []byte
	if err == nil {
		b, _ = io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			err = fmt.Errorf("%s: %s", resp.Status, bytes.TrimSpace(b))
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.lat = append(p.lat, d)
	if err != nil {
		p.errs = append(p.errs, fmt.Sprintf("%s %s after %v: %v", method, path, d.Round(time.Millisecond), err))
	}
}

// stop stops the provisioner.
func (p *provisioner) stop() { p.stopOnce.Do(func() { close(p.stopped) }) }

// answers is how many answers the provisioner has had.
func (p *provisioner) answers() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.lat)
}

// waitAnswers waits for n more answers of the provisioner: the window
// an attack stands in.
func (p *provisioner) waitAnswers(n int, beside string) {
	p.t.Helper()
	until := p.answers() + n
	kit.WaitFor(p.t, 60*time.Second, fmt.Sprintf("%d answers of the provisioner beside %s", n, beside), func() bool { return p.answers() >= until })
}

// check waits for the provisioner to stop, prints its latencies, and
// fails the test for an error or an answer slower than denialBound.
func (p *provisioner) check(what string) {
	p.t.Helper()
	p.stop()
	<-p.done
	p.mu.Lock()
	lat, errs := slices.Clone(p.lat), slices.Clone(p.errs)
	p.mu.Unlock()
	slices.Sort(lat)
	if len(lat) == 0 {
		p.t.Fatalf("%s: the provisioner made no request", what)
	}
	q := func(f float64) time.Duration { return lat[int(f*float64(len(lat)-1))].Round(100 * time.Microsecond) }
	p.t.Logf("%s: the provisioner's %d requests: latency min %v, median %v, p90 %v, max %v; %d failed",
		what, len(lat), q(0), q(0.5), q(0.9), q(1), len(errs))
	for i, e := range errs {
		if i == 5 {
			p.t.Errorf("%s: and %d more failures", what, len(errs)-5)
			break
		}
		p.t.Errorf("%s: the provisioner's request failed: %s", what, e)
	}
	if lat[len(lat)-1] > denialBound {
		p.t.Errorf("%s: the provisioner waited %v for an answer, more than %v", what, lat[len(lat)-1], denialBound)
	}
}

// fromAddr dials the rig's admin listener from the loopback address
// 127.0.0.n.
func (r *adminRig) fromAddr(n int) *net.Dialer {
	return &net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.IPv4(127, 0, 0, byte(n))}}
}

// serverFDs counts the server's open files.
func serverFDs(t *testing.T, srv *serverDaemon) int {
	t.Helper()
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", srv.cmd.Process.Pid))
	if err != nil {
		t.Fatal(err)
	}
	return len(ents)
}

// waitFDs waits for the server's open files to be back to base (a few
// more: a log or state file open for a moment).
func waitFDs(t *testing.T, srv *serverDaemon, base int) {
	t.Helper()
	kit.WaitFor(t, 15*time.Second, fmt.Sprintf("the server's open files back to %d", base), func() bool {
		return serverFDs(t, srv) <= base+2
	})
}

// closedByServer reports whether the server has closed c: a read that
// ends in EOF or a reset within d, not a timeout.
func closedByServer(c net.Conn, d time.Duration) bool {
	c.SetReadDeadline(time.Now().Add(d))
	_, err := io.Copy(io.Discard, c)
	var ne net.Error
	return !(errors.As(err, &ne) && ne.Timeout())
}

// TestAdminDenialIdleSockets: 500 TCP sockets that never begin a TLS
// handshake, from 20 addresses, take no connection of the API: a
// provisioner gets every answer in time, and the server closes each
// socket once handshake_timeout has passed (or sooner, to make room).
func TestAdminDenialIdleSockets(t *testing.T) {
	r := newDenialRig(t)
	p := r.startProvisioner(t)
	p.waitAnswers(3, "nothing")
	base := serverFDs(t, r.srv)

	var socks []net.Conn
	defer func() {
		for _, c := range socks {
			c.Close()
		}
	}()
	addr := fmt.Sprintf("127.0.0.1:%d", r.admin)
	var closed atomic.Int64
	var readers sync.WaitGroup
	for i := range 500 {
		c, err := r.fromAddr(2+i%20).Dial("tcp", addr)
		if err != nil {
			t.Fatalf("socket %d: %v", i, err)
		}
		socks = append(socks, c)
		// Each socket's reader sees the server close it.
		readers.Go(func() {
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			if _, err := io.Copy(io.Discard, c); !isTimeout(err) {
				closed.Add(1)
			}
		})
	}
	p.waitAnswers(30, "500 idle sockets")
	// Every socket closed by the server: made way for newer ones, or
	// past handshake_timeout (2 s).
	p.check("500 idle sockets")
	kit.WaitFor(t, 10*time.Second, "the server to close the 500 sockets", func() bool { return closed.Load() == 500 })
	for _, c := range socks {
		c.Close()
	}
	readers.Wait()
	socks = nil
	waitFDs(t, r.srv, base)
}

// isTimeout reports whether err is a deadline's.
func isTimeout(err error) bool {
	var ne net.Error
	return errors.As(err, &ne) && ne.Timeout()
}

// TestAdminDenialReconnecting: 80 sockets from one address that never
// handshake and connect again as soon as the server closes them, for as
// long as the provisioner takes to get 30 answers, each in time.
func TestAdminDenialReconnecting(t *testing.T) {
	r := newDenialRig(t)
	stop := make(chan struct{})
	var stopOnce sync.Once
	stopAttack := func() { stopOnce.Do(func() { close(stop) }) }
	defer stopAttack()
	p := r.startProvisioner(t)
	p.waitAnswers(3, "nothing")
	base := serverFDs(t, r.srv)

	addr := fmt.Sprintf("127.0.0.1:%d", r.admin)
	var wg sync.WaitGroup
	var dials atomic.Int64
	for range 80 {
		wg.Go(func() {
			d := r.fromAddr(2)
			for {
				select {
				case <-stop:
					return
				default:
				}
				c, err := d.Dial("tcp", addr)
				if err != nil {
					continue // the listen queue full: at once again
				}
				dials.Add(1)
				// Until the server closes it (or the test stops).
				for {
					c.SetReadDeadline(time.Now().Add(200 * time.Millisecond))
					_, err := c.Read(make([]byte, 1))
					if err == nil || !isTimeout(err) {
						break
					}
					select {
					case <-stop:
						c.Close()
						return
					default:
					}
				}
				c.Close()
			}
		})
	}
	p.waitAnswers(30, "80 reconnecting sockets")
	stopAttack()
	wg.Wait()
	p.check("80 reconnecting sockets")
	t.Logf("80 reconnecting sockets: %d connections", dials.Load())
	waitFDs(t, r.srv, base)
}

// rawRequest writes a request on c and reads its answer's status and
// body.
func rawRequest(c net.Conn, br *bufio.Reader, req string) (int, string, error) {
	c.SetDeadline(time.Now().Add(10 * time.Second))
	defer c.SetDeadline(time.Time{})
	if _, err := io.WriteString(c, req); err != nil {
		return 0, "", err
	}
	resp, err := http.ReadResponse(br, nil)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), err
}

// tlsConfig is a TLS client configuration of dir's certificate of name
// for the rig's admin listener.
func (r *adminRig) tlsConfig(t *testing.T, dir, name string) *tls.Config {
	t.Helper()
	cert, err := tls.LoadX509KeyPair(filepath.Join(dir, name+".crt"), filepath.Join(dir, name+".key"))
	if err != nil {
		t.Fatal(err)
	}
	return &tls.Config{RootCAs: pool(t, filepath.Join(r.pki, "ca.crt")), ServerName: "127.0.0.1", MinVersion: tls.VersionTLS13,
		NextProtos: []string{"http/1.1"}, Certificates: []tls.Certificate{cert}}
}

// tlsTo dials the admin listener from 127.0.0.n with tc, and
// handshakes.
func (r *adminRig) tlsTo(n int, tc *tls.Config) (*tls.Conn, error) {
	d := &tls.Dialer{NetDialer: r.fromAddr(n), Config: tc}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := d.DialContext(ctx, "tcp", fmt.Sprintf("127.0.0.1:%d", r.admin))
	if err != nil {
		return nil, err
	}
	return c.(*tls.Conn), nil
}

// TestAdminDenialKeptAlive: 64 kept-alive connections of a certificate
// with no role (each asked GET /v1/discover once, then idle) hold at
// most their share of max_connections: the provisioner gets every
// answer in time, a reader's new connection is served, and the server
// has closed the connections past the share.
func TestAdminDenialKeptAlive(t *testing.T) {
	r := newDenialRig(t)
	base := serverFDs(t, r.srv)
	var conns []*tls.Conn
	defer func() {
		for _, c := range conns {
			c.Close()
		}
	}()
	ok, refused := 0, 0
	hostA := r.tlsConfig(t, r.pki, "host-a")
	for i := range 64 {
		c, err := r.tlsTo(2, hostA)
		if err != nil {
			t.Fatalf("connection %d of host-a: %v", i, err)
		}
		conns = append(conns, c)
		code, body, err := rawRequest(c, bufio.NewReader(c), "GET /v1/discover HTTP/1.1\r\nHost: x\r\n\r\n")
		switch {
		case err == nil && code == http.StatusOK:
			ok++
		case err == nil && code == http.StatusServiceUnavailable && strings.Contains(body, `"unavailable"`):
			refused++
		default:
			t.Fatalf("host-a's discover %d: %d %q %v", i, code, body, err)
		}
	}
	t.Logf("64 connections of host-a (no role): %d answered, %d refused unavailable", ok, refused)

	p := r.startProvisioner(t)
	// A reader's new connection is served beside them.
	mon := r.httpsClient(t, r.pki, "mon")
	resp, err := mon.Get(r.adminURL("/v1/exports"))
	if err != nil {
		t.Errorf("a reader's GET beside 64 idle connections of host-a: %v", err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("a reader's GET beside 64 idle connections of host-a: %s", resp.Status)
		}
	}
	p.waitAnswers(30, "64 kept-alive connections of host-a")
	p.check("64 kept-alive connections with no role")
	open := 0
	for _, c := range conns {
		if !closedByServer(c, 100*time.Millisecond) {
			open++
		}
	}
	t.Logf("of host-a's 64 connections, %d still open", open)
	if open > 32 {
		t.Errorf("%d of host-a's connections still open, more than the share of roles other than admin and provisioner (32)", open)
	}
	for _, c := range conns {
		c.Close()
	}
	conns = nil
	waitFDs(t, r.srv, base)
}

// TestAdminDenialSlowHeaders: 500 requests with a reader's certificate
// whose header never ends (a line every 300 ms), from 10 addresses, 100
// at a time: the provisioner gets every answer in time, and the reader
// itself still gets an answer (a header being read holds no request
// slot of its identity).
func TestAdminDenialSlowHeaders(t *testing.T) {
	r := newDenialRig(t)
	stop := make(chan struct{})
	var stopOnce sync.Once
	stopAttack := func() { stopOnce.Do(func() { close(stop) }) }
	defer stopAttack()
	p := r.startProvisioner(t)
	p.waitAnswers(3, "nothing")
	base := serverFDs(t, r.srv)

	var wg sync.WaitGroup
	var made, dialErrs atomic.Int64
	var remaining atomic.Int64
	remaining.Store(500)
	monTLS := r.tlsConfig(t, r.pki, "mon")
	for g := range 100 {
		wg.Go(func() {
			for remaining.Add(-1) >= 0 {
				select {
				case <-stop:
					return
				default:
				}
				c, err := r.tlsTo(2+g%10, monTLS)
				if err != nil {
					dialErrs.Add(1)
					continue
				}
				made.Add(1)
				io.WriteString(c, "GET /v1/exports HTTP/1.1\r\nHost: x\r\n")
				// A header line every 300 ms, until the server closes
				// it or the test stops.
				for i := 0; ; i++ {
					c.SetWriteDeadline(time.Now().Add(time.Second))
					if _, err := fmt.Fprintf(c, "X-Slow-%d: x\r\n", i); err != nil {
						break
					}
					select {
					case <-stop:
						c.Close()
						return
					case <-time.After(300 * time.Millisecond):
					}
				}
				c.Close()
			}
		})
	}
	kit.WaitFor(t, 60*time.Second, "the 500 slow headers begun", func() bool { return made.Load()+dialErrs.Load() >= 250 })
	// The reader's own request, beside its slow ones.
	mon := r.httpsClient(t, r.pki, "mon")
	t0 := time.Now()
	resp, err := mon.Get(r.adminURL("/v1/exports"))
	if err != nil {
		t.Errorf("the reader's GET beside its slow headers: %v", err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Errorf("the reader's GET beside its slow headers: %s", resp.Status)
		}
		t.Logf("the reader's GET beside its slow headers: %v", time.Since(t0).Round(time.Millisecond))
	}
	p.waitAnswers(30, "slow headers")
	kit.WaitFor(t, 60*time.Second, "the 500 slow headers begun", func() bool { return made.Load()+dialErrs.Load() >= 500 })
	stopAttack()
	wg.Wait()
	p.check("500 slow headers of a reader")
	t.Logf("slow headers: %d connections made, %d not", made.Load(), dialErrs.Load())

	waitFDs(t, r.srv, base)
}

// TestAdminParallelCreates: the controller's parallelism (16 requests
// under way per storage node, as rnbd-csi bounds itself), twice over:
// 32 creates of one provisioner at once are all served, none refused
// by max_requests_per_identity.
func TestAdminParallelCreates(t *testing.T) {
	r := newDenialRig(t)
	hc := r.httpsClient(t, r.pki, "orch")
	var wg sync.WaitGroup
	errs := make(chan error, 32)
	start := make(chan struct{})
	for i := range 32 {
		wg.Go(func() {
			<-start
			body := fmt.Sprintf(`{"name":"par%d","pool":"p","size":"1MiB"}`, i)
			resp, err := hc.Post(r.adminURL("/v1/volumes"), "application/json", strings.NewReader(body))
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			b, _ := io.ReadAll(resp.Body)
			if resp.StatusCode != http.StatusOK {
				errs <- fmt.Errorf("create par%d: %s: %s", i, resp.Status, bytes.TrimSpace(b))
			}
		})
	}
	close(start)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	out := r.srv.ok("volume", "list", "--format", "json")
	var recs []map[string]any
	if err := json.Unmarshal([]byte(out), &recs); err != nil || len(recs) != 32 {
		t.Errorf("after 32 creates, %d volumes (%v)", len(recs), err)
	}
}

// TestAdminRefusalsAudited: plaintext HTTP and TLS 1.2 on the admin
// port get the audit line docs/control-api.md promises; a certificate
// whose names give different roles (a reader's and an admin's) is
// refused at every request, saying so, audited, and warned of once.
func TestAdminRefusalsAudited(t *testing.T) {
	r := newAdminRig(t)
	addr := fmt.Sprintf("127.0.0.1:%d", r.admin)
	pc, err := r.fromAddr(2).Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	pc.SetDeadline(time.Now().Add(10 * time.Second))
	fmt.Fprintf(pc, "GET /v1/exports HTTP/1.1\r\nHost: x\r\n\r\n")
	b, _ := io.ReadAll(pc)
	pc.Close()
	if !strings.HasPrefix(string(b), "HTTP/1.0 400 Bad Request") || !strings.Contains(string(b), "use https://") {
		t.Errorf("plaintext HTTP answered %q", b)
	}
	r.waitAudit(t, "method", "CONNECT", "object", "tls", "remote", "127.0.0.2:", "result", "permission_denied",
		"error", "the client does not speak TLS (plaintext HTTP?)")
	old := r.tlsConfig(t, r.pki, "ops")
	old.MinVersion, old.MaxVersion = tls.VersionTLS12, tls.VersionTLS12
	if c, err := r.tlsTo(3, old); err == nil {
		c.Close()
		t.Errorf("a TLS 1.2 handshake succeeded")
	}
	r.waitAudit(t, "method", "CONNECT", "object", "tls", "remote", "127.0.0.3:", "result", "permission_denied",
		"error", "the client offered TLS 1.2 only")

	run(t, time.Minute, "bash", "../../scripts/test-ca.sh", r.pki, "admin", "mon2", "mon", "ops")
	for _, args := range [][]string{{"export", "list"}, {"map", "x", r.vol}} {
		_, errOut, code := r.remote(t, r.pki, "mon2", args...)
		if code != 7 || !strings.Contains(errOut, "the client certificate (mon2, mon, ops) is refused: its names give different roles in [admin] (mon reader, ops admin)") {
			t.Errorf("%v with names of a reader and an admin: exit %d: %q", args, code, errOut)
		}
	}
	r.waitAudit(t, "identity", "mon2", "method", "POST", "object", "/v1/exports", "result", "permission_denied", "role", "none")
	if n := strings.Count(r.srv.out.String(), "a client certificate whose names give different roles"); n != 1 {
		t.Errorf("%d warnings of the certificate, want 1", n)
	}
}
