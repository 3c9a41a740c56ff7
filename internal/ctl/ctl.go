// Package ctl is the control API's transport between a daemon and its
// callers: HTTP with strictly decoded JSON bodies over a unix socket
// (mode 0600), and on TLS 1.3 with client certificates (remote.go,
// bounded by admission.go); the roles and rights every request passes
// and its audit line (access.go); and a small fixed set of error classes
// that the CLI turns into one clear line and an exit code. What the
// endpoints are is package api's; docs/control-api.md documents them,
// a stable ABI.
//
// A Server is safe for concurrent use once Serve runs (SetAccess,
// Handle and ListenTLS come before). Its locks are each held over no
// call and never nest: admission.mu (the handshakes under way and the
// connections taken), slots.mu (each identity's requests under way),
// Server.conflictMu (the certificates warned of). A Client is safe for
// concurrent use.
package ctl

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net"
	"net/http"
	"net/url"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	kjson "sigs.k8s.io/json"

	"github.com/rnbd/rnbd/pkg/log"
)

// Code is an error class.
type Code string

const (
	CodeNotFound     Code = "not_found"
	CodeExists       Code = "already_exists"
	CodeBusy         Code = "busy"
	CodeInvalid      Code = "invalid_argument"
	CodePermission   Code = "permission_denied"
	CodeUnavailable  Code = "unavailable"
	CodeInternal     Code = "internal"
	CodeNotSupported Code = "not_supported"
	CodeNoSpace      Code = "no_space"
)

var codeStatus = map[Code]int{
	CodeNotFound:     http.StatusNotFound,
	CodeExists:       http.StatusConflict,
	CodeBusy:         http.StatusLocked,
	CodeInvalid:      http.StatusBadRequest,
	CodePermission:   http.StatusForbidden,
	CodeUnavailable:  http.StatusServiceUnavailable,
	CodeInternal:     http.StatusInternalServerError,
	CodeNotSupported: http.StatusNotImplemented,
	CodeNoSpace:      http.StatusInsufficientStorage,
}

// exitCodes are the CLI's exit codes per class (docs/control-api.md).
var exitCodes = map[Code]int{
	CodeInternal:     1,
	CodeInvalid:      2,
	CodeNotFound:     3,
	CodeExists:       4,
	CodeBusy:         5,
	CodeUnavailable:  6,
	CodePermission:   7,
	CodeNotSupported: 8,
	CodeNoSpace:      9,
}

// exitMeanings say what each exit code means, for the man pages' EXIT
// STATUS (docs/control-api.md has the same classes, with more).
var exitMeanings = map[Code]string{
	CodeInternal:     "a bug or an unexpected I/O error",
	CodeInvalid:      "a bad name, path, flag or request; command-line usage; a configuration file that is wrong",
	CodeNotFound:     "no such export, device, session or path; a file that does not exist",
	CodeExists:       "an export or mapping of that name exists",
	CodeBusy:         "in use: an export or device a session or client has open, a name bound to a session",
	CodeUnavailable:  "the daemon is not running, or a peer did not answer in time",
	CodePermission:   "the control socket is not yours, a file cannot be read, or the server refused (an identity, session name, network or access mode an export does not allow)",
	CodeNotSupported: "the operation is not implemented for this object",
	CodeNoSpace:      "a pool has not the space asked for, or its thin pool is full",
}

// ExitStatus is one exit code of the command lines: the code, its class
// and what it means.
type ExitStatus struct {
	Exit    int
	Class   Code
	Meaning string
}

// ExitStatuses are every exit code but 0, in order.
func ExitStatuses() []ExitStatus {
	var out []ExitStatus
	for c, n := range exitCodes {
		out = append(out, ExitStatus{Exit: n, Class: c, Meaning: exitMeanings[c]})
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Exit < out[j].Exit })
	return out
}

// Error is an error with a class, as it crosses the socket.
type Error struct {
	Code    Code   `json:"code"`
	Message string `json:"error"`
	// err is what it wraps, on the client's side (ErrNotRunning).
	err error
	// retryAfter, if not 0, is the seconds the answer's Retry-After
	// gives: a refusal by a bound, which frees soon.
	retryAfter int
	// answered: the daemon answered with it (decoded from its reply),
	// rather than no answer came (Answered).
	answered bool
}

// Answered reports whether err is a daemon's own answer to a request
// (a refusal, a not_found, one of its bounds), not the request failing
// to get one (nothing listens, no answer in time, a broken
// connection): what tells a peer that answers from one that does not.
func Answered(err error) bool {
	var ce *Error
	return errors.As(err, &ce) && ce.answered
}

func (e *Error) Error() string { return e.Message }

func (e *Error) Unwrap() error { return e.err }

// ErrNotRunning: no daemon listens on the control socket (Client.Do's
// error wraps it).
var ErrNotRunning = errors.New("daemon not running")

// Errorf makes an Error of class code.
func Errorf(code Code, format string, args ...any) *Error {
	return &Error{Code: code, Message: fmt.Sprintf(format, args...)}
}

// Classify finds the class of err: an *Error's own, else by errno.
func Classify(err error) Code {
	var ce *Error
	if errors.As(err, &ce) {
		return ce.Code
	}
	if errors.Is(err, context.DeadlineExceeded) {
		return CodeUnavailable // a peer that did not answer in time
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		switch e {
		case syscall.ENOENT, syscall.ENODEV, syscall.ENXIO:
			return CodeNotFound
		case syscall.EEXIST, syscall.EALREADY:
			return CodeExists
		case syscall.EBUSY, syscall.EUSERS:
			return CodeBusy
		case syscall.EINVAL, syscall.ERANGE, syscall.ENAMETOOLONG, syscall.EISDIR, syscall.ENOTDIR:
			return CodeInvalid
		case syscall.EPERM, syscall.EACCES, syscall.EROFS:
			return CodePermission
		case syscall.ENOTCONN, syscall.ECONNREFUSED, syscall.ECONNRESET, syscall.ETIMEDOUT, syscall.EHOSTUNREACH,
			syscall.ENETUNREACH, syscall.ECONNABORTED, syscall.ESHUTDOWN:
			return CodeUnavailable
		case syscall.EOPNOTSUPP:
			return CodeNotSupported
		case syscall.ENOSPC:
			return CodeNoSpace
		}
	}
	return CodeInternal
}

// ExitCode is the CLI exit code for err (0 for nil).
func ExitCode(err error) int {
	if err == nil {
		return 0
	}
	return exitCodes[Classify(err)]
}

// Server serves the control API on a unix socket.
type Server struct {
	path string
	l    net.Listener
	mux  *http.ServeMux
	hs   *http.Server
	// access admits requests (access.go); remote are the TLS
	// listeners (remote.go). Set before Serve.
	access Access
	remote []*tlsListener
	slots  slots
	// adm counts the TLS listeners' handshakes and connections
	// (admission.go).
	adm admission
	// connLog bounds the lines of refused connections.
	connLog log.Limiter
	// conflicts are the certificates whose names give different
	// roles that were warned of (remote.go).
	conflictMu sync.Mutex
	// +checklocks:conflictMu
	conflicts map[string]bool
	// patterns are the routes, as Handle was given them.
	patterns []string
}

// Listen creates the socket at path (its directory 0755, the socket
// 0600). A stale socket left by a dead daemon is replaced; a live one
// means another daemon runs: that is an error.
func Listen(path string) (*Server, error) {
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return nil, err
	}
	if err := ClearStaleSocket(path); errors.Is(err, syscall.EADDRINUSE) {
		return nil, fmt.Errorf("control socket %s: another daemon is running: %w", path, syscall.EADDRINUSE)
	} else if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	old := syscall.Umask(0o177)
	l, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, err
	}
	if err := os.Chmod(path, 0o600); err != nil {
		l.Close()
		return nil, err
	}
	s := &Server{path: path, l: l, mux: http.NewServeMux()}
	s.hs = &http.Server{Handler: s.mux, ReadHeaderTimeout: 10 * time.Second,
		// Only root reaches the socket (0600): the local admin.
		ConnContext: func(ctx context.Context, _ net.Conn) context.Context {
			c := localCaller
			return withCaller(ctx, &c)
		}}
	return s, nil
}

// ClearStaleSocket makes way for a unix socket at path: nothing is
// there, or a socket that nothing listens on (left by a process that
// died), which it removes. A socket that something listens on is
// EADDRINUSE; anything else (a regular file, a directory, a link) is
// EEXIST and stays: a mistyped path never deletes a file.
func ClearStaleSocket(path string) error {
	st, err := os.Lstat(path)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return err
	}
	if st.Mode().Type() != fs.ModeSocket {
		return fmt.Errorf("%s exists and is not a socket (%v); not replaced: %w", path, st.Mode().Type(), syscall.EEXIST)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return fmt.Errorf("%s: something listens on it: %w", path, syscall.EADDRINUSE)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, fs.ErrNotExist) {
		return err
	}
	return nil
}

// AnswerTimeout bounds how long writing one answer to a peer of the
// admin listener may take.
const AnswerTimeout = 30 * time.Second

// Handler answers a request: a value encoded as JSON, or an error.
type Handler func(r *http.Request) (any, error)

// Handle registers h for a pattern like "GET /v1/devices/{name}". Every
// request passes admit first: the right the pattern needs, the caller's
// slot, the body's bound, the audit line (access.go).
func (s *Server) Handle(pattern string, h Handler) {
	s.patterns = append(s.patterns, pattern)
	s.mux.HandleFunc(pattern, func(w http.ResponseWriter, r *http.Request) {
		defer s.busy(r)()
		v, err := s.admit(pattern, h, r)
		if !CallerOf(r).Local {
			// A peer that does not read its answer holds its
			// connection, busy, no longer than this: then the write
			// fails and the connection goes.
			http.NewResponseController(w).SetWriteDeadline(time.Now().Add(AnswerTimeout))
		}
		w.Header().Set("Content-Type", "application/json")
		if err != nil {
			code := Classify(err)
			if ce, ok := errors.AsType[*Error](err); ok && ce.retryAfter > 0 {
				w.Header().Set("Retry-After", strconv.Itoa(ce.retryAfter))
			}
			w.WriteHeader(codeStatus[code])
			json.NewEncoder(w).Encode(&Error{Code: code, Message: err.Error()})
			return
		}
		if v == nil {
			v = struct{}{}
		}
		json.NewEncoder(w).Encode(v)
	})
}

// Patterns are the routes Handle registered, in order: what a rights
// table is checked against.
func (s *Server) Patterns() []string { return slices.Clone(s.patterns) }

// Serve serves until Close: the socket, and the TLS listeners
// (ListenTLS).
func (s *Server) Serve() error {
	errs := make(chan error, len(s.remote))
	for _, l := range s.remote {
		go func() { errs <- l.serve() }()
	}
	err := s.hs.Serve(s.l)
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	for range s.remote {
		err = errors.Join(err, <-errs)
	}
	return err
}

// Close stops serving and removes the socket.
func (s *Server) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := s.hs.Shutdown(ctx)
	for _, l := range s.remote {
		err = errors.Join(err, l.shutdown(ctx))
	}
	os.Remove(s.path)
	return err
}

// Decode reads a JSON request body into v, strictly: one JSON object
// and nothing after it, each key exactly a field's name (as the
// records and docs/control-api.md spell it, case included) and given
// once. A bad body is CodeInvalid, saying what was wrong; one past the
// bound on bodies (max_body_size) says so, whatever it holds.
func Decode(r *http.Request, v any) error {
	limit := bodyLimit(r)
	b, err := io.ReadAll(io.LimitReader(r.Body, limit+1))
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok || int64(len(b)) > limit {
		return bodyTooLarge(limit)
	}
	if err != nil {
		return Errorf(CodeInvalid, "reading the request body: %v", err)
	}
	return decodeStrict(b, v)
}

// decodeStrict decodes b, a whole request body, into v, refusing what
// encoding/json lets by: a key given twice (the last would win), a key
// that matches a field's name only without regard to case, and
// anything but white space after the object; and, as it does with
// DisallowUnknownFields, a key no field has.
func decodeStrict(b []byte, v any) error {
	// JSON's white space, not Unicode's.
	if t := bytes.TrimLeft(b, " \t\r\n"); len(t) == 0 || t[0] != '{' {
		return Errorf(CodeInvalid, "bad request body: want a JSON object")
	}
	strict, err := kjson.UnmarshalStrict(b, v)
	if err != nil {
		return Errorf(CodeInvalid, "bad request body: %v", err)
	}
	if len(strict) > 0 {
		msgs := make([]string, len(strict))
		for i, e := range strict {
			msgs[i] = e.Error()
		}
		return Errorf(CodeInvalid, "bad request body: %s (keys are given once each, spelt as docs/control-api.md gives them, lower case)",
			strings.Join(msgs, "; "))
	}
	return nil
}

// Client talks to a daemon's control API: its unix socket (Dial), or
// its admin listener over TLS (DialTLS).
type Client struct {
	path string // the socket, or the https:// base URL
	base string // what requests' URLs start with
	hc   *http.Client
	// remote: over TLS (DialTLS); err: a client that could not be
	// set up, which every request answers (Broken).
	remote bool
	err    error
}

// Dial returns a client of the socket at path; nothing connects until a
// request is made.
func Dial(path string) *Client {
	tr := &http.Transport{
		DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
			var d net.Dialer
			return d.DialContext(ctx, "unix", path)
		},
	}
	return &Client{path: path, base: "http://daemon", hc: &http.Client{Transport: tr}}
}

// DialTLS returns a client of an admin listener, base "https://HOST:PORT":
// TLS 1.3, the server's certificate verified against tc.RootCAs and the
// host (or tc.ServerName), tc's certificate presented as the caller's.
func DialTLS(base string, tc *tls.Config) (*Client, error) {
	u, err := url.Parse(base)
	if err != nil || u.Scheme != "https" || u.Host == "" || (u.Path != "" && u.Path != "/") || u.RawQuery != "" {
		return nil, Errorf(CodeInvalid, "server %q: want https://HOST:PORT (the admin listener of rnbd-server; TLS only)", base)
	}
	if u.Port() == "" {
		u.Host = net.JoinHostPort(u.Hostname(), strconv.Itoa(DefaultAdminPort))
	}
	c := tc.Clone()
	c.MinVersion, c.MaxVersion = tls.VersionTLS13, tls.VersionTLS13
	tr := &http.Transport{TLSClientConfig: c, TLSHandshakeTimeout: clientHandshakeTimeout, ForceAttemptHTTP2: false,
		// As many kept for reuse as rnbd-csi's controller has calls
		// under way to one storage node: each extra is a TLS handshake.
		MaxIdleConnsPerHost: 16, IdleConnTimeout: 30 * time.Second}
	base = "https://" + u.Host
	return &Client{path: base, base: base, hc: &http.Client{Transport: tr}, remote: true}, nil
}

// Broken is a client whose every request fails with err: one whose
// set-up (TLS files) did not work, so that commands fail where they talk.
func Broken(err error) *Client { return &Client{err: err} }

// Close closes the client's idle connections; requests after it open
// new ones.
func (c *Client) Close() {
	if c.hc != nil {
		c.hc.CloseIdleConnections()
	}
}

// Do sends a request with body (encoded as JSON if not nil) and decodes
// the answer into out (if not nil). A daemon that is not running is
// CodeUnavailable; the daemon's errors keep their class.
func (c *Client) Do(ctx context.Context, method, path string, body, out any) error {
	if c.err != nil {
		return c.err
	}
	var rd io.Reader
	if body != nil {
		b, err := json.Marshal(body)
		if err != nil {
			return err
		}
		rd = bytes.NewReader(b)
	}
	req, err := http.NewRequestWithContext(ctx, method, c.base+path, rd)
	if err != nil {
		return err
	}
	resp, err := c.hc.Do(req)
	if err != nil {
		if c.remote {
			return remoteError(c.path, err)
		}
		if errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ECONNREFUSED) {
			e := Errorf(CodeUnavailable, "daemon not running (no daemon listens on %s)", c.path)
			e.err = ErrNotRunning
			return e
		}
		if errors.Is(err, syscall.EACCES) {
			return Errorf(CodePermission, "no permission to use %s (run as root)", c.path)
		}
		return Errorf(CodeUnavailable, "control socket %s: %v", c.path, err)
	}
	defer func() {
		// Read to its end, so that the connection is kept for the
		// next request rather than closed.
		io.Copy(io.Discard, io.LimitReader(resp.Body, 64<<10))
		resp.Body.Close()
	}()
	if resp.StatusCode != http.StatusOK {
		var e Error
		if json.NewDecoder(resp.Body).Decode(&e) != nil || e.Code == "" {
			e := Errorf(CodeInternal, "daemon answered %s", resp.Status)
			e.answered = true
			return e
		}
		e.answered = true
		return &e
	}
	if out == nil {
		return nil
	}
	return json.NewDecoder(resp.Body).Decode(out)
}

// remoteError says why a request to an admin listener got no answer:
// nothing listens there, the server's certificate is not one the CA
// signed for that name, the server refused ours, or the network.
func remoteError(server string, err error) error {
	// Not `Get "https://...": ...`: the server is named once.
	if ue, ok := errors.AsType[*url.Error](err); ok {
		err = ue.Err
	}
	var cv *tls.CertificateVerificationError
	var hn x509.HostnameError
	var ua x509.UnknownAuthorityError
	var ci x509.CertificateInvalidError
	var oe *net.OpError
	switch {
	case errors.As(err, &hn):
		return Errorf(CodePermission, "%s: the server's certificate is not for this name: %v (connect by a name or address it has, or check --server)", server, hn)
	case errors.As(err, &cv), errors.As(err, &ua), errors.As(err, &ci):
		return Errorf(CodePermission, "%s: the server's certificate is not trusted (not signed by --ca, or expired): %v", server, err)
	case errors.As(err, &oe) && oe.Op == "remote error":
		return Errorf(CodePermission, "%s: the server refused our certificate (%v): it must be signed by the CA of the server's admin listener, "+
			"name an identity, have the clientAuth extended key usage and be in date", server, oe.Err)
	case errors.Is(err, syscall.ECONNREFUSED):
		e := Errorf(CodeUnavailable, "%s: nothing listens there (is [admin] listen set in the server's configuration, and the daemon running?)", server)
		e.err = ErrNotRunning
		return e
	case errors.Is(err, context.DeadlineExceeded):
		return Errorf(CodeUnavailable, "%s: no answer in time: %v", server, err)
	}
	return Errorf(CodeUnavailable, "%s: %v", server, err)
}

// Lookup finds the objects of kind ("path") a name as typed names: those
// whose name is it, or if none is, those near(x) accepts (the same
// written another way). None is a not_found error that lists the names
// there are, so that the one meant can be seen.
func Lookup[T any](kind, name string, all []T, nameOf func(T) string, near func(T) bool) ([]T, error) {
	var exact, others []T
	for _, x := range all {
		switch {
		case nameOf(x) == name:
			exact = append(exact, x)
		case near(x):
			others = append(others, x)
		}
	}
	if len(exact) > 0 {
		return exact, nil
	}
	if len(others) > 0 {
		return others, nil
	}
	if len(all) == 0 {
		return nil, Errorf(CodeNotFound, "no %s %s (there are none)", kind, name)
	}
	return nil, Errorf(CodeNotFound, "no %s %s (%ss: %s)", kind, name, kind, Names(all, nameOf))
}

// Names lists the names of objects for a message: at most 8, sorted,
// without repeats.
func Names[T any](xs []T, nameOf func(T) string) string {
	seen := map[string]bool{}
	var names []string
	for _, x := range xs {
		if n := nameOf(x); !seen[n] {
			seen[n] = true
			names = append(names, n)
		}
	}
	sort.Strings(names)
	if len(names) > 8 {
		return strings.Join(names[:8], ", ") + fmt.Sprintf(" and %d more", len(names)-8)
	}
	return strings.Join(names, ", ")
}

// One is the one object of found (what Lookup found by name), or an
// invalid_argument error that says why there is not one: a name the
// objects of several sessions have (sessOf), or one that several
// objects' names match.
func One[T any](kind, name string, found []T, nameOf, sessOf func(T) string) (T, error) {
	var zero T
	switch {
	case len(found) == 1:
		return found[0], nil
	case len(found) == 0:
		return zero, Errorf(CodeNotFound, "no %s %s", kind, name)
	case nameOf(found[0]) == name:
		return zero, Errorf(CodeInvalid, "%s %s exists in %d sessions (%s), name the session", kind, name, len(found), Names(found, sessOf))
	}
	return zero, Errorf(CodeInvalid, "%s names %d %ss (%s): give the whole name, or the session", name, len(found), kind, Names(found, nameOf))
}
