// Package cli is what the rnbd-server and rnbd-client command lines share:
// the global flags, talking to the daemon, printing records, running a
// daemon with signals and sd_notify, and turning errors into one line and
// an exit code.
package cli

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net/url"
	"os"
	"os/signal"
	"regexp"
	"runtime"
	"runtime/pprof"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/sdnotify"
	"github.com/rnbd/rnbd/pkg/log"
)

// Globals are the flags every control command takes.
type Globals struct {
	Socket string
	Format string
	Fields string
	// Server, with Cert, Key and CA, is a daemon's admin listener to
	// talk to instead of the socket: https://HOST:PORT (AddRemote).
	Server, Cert, Key, CA string
	// remoteOn: AddRemote was called (rnbd-server), and the
	// environment's RNBD_SERVER counts.
	remoteOn bool
}

// The environment's equivalents of AddRemote's flags.
const (
	EnvServer = "RNBD_SERVER"
	EnvCert   = "RNBD_CERT"
	EnvKey    = "RNBD_KEY"
	EnvCA     = "RNBD_CA"
)

// AddRemote registers --server, --cert, --key and --ca on root: the
// commands then talk to a daemon's admin listener over TLS instead of
// its socket, from any machine (docs/operations.md, "Managing a storage
// node remotely"). Unset, the environment's RNBD_SERVER, RNBD_CERT,
// RNBD_KEY and RNBD_CA.
func (g *Globals) AddRemote(root *cobra.Command) {
	g.remoteOn = true
	f := root.PersistentFlags()
	f.StringVar(&g.Server, "server", "", "talk to the daemon's admin listener, https://HOST[:PORT] (TLS 1.3 with --cert, --key, --ca), instead of --socket (env "+EnvServer+")")
	f.StringVar(&g.Cert, "cert", "", "PEM certificate presented to --server: its names are the caller's identity, which the server gives a role (env "+EnvCert+")")
	f.StringVar(&g.Key, "key", "", "PEM private key of --cert (env "+EnvKey+")")
	f.StringVar(&g.CA, "ca", "", "PEM authority the --server's certificate must chain to; the certificate must name the host of --server (env "+EnvCA+")")
}

// remote fills what the flags left empty from the environment.
func (g *Globals) remote() {
	for _, v := range []struct {
		p   *string
		env string
	}{{&g.Server, EnvServer}, {&g.Cert, EnvCert}, {&g.Key, EnvKey}, {&g.CA, EnvCA}} {
		if *v.p == "" {
			*v.p = os.Getenv(v.env)
		}
	}
}

// Add registers the global flags on root.
func (g *Globals) Add(root *cobra.Command, defaultSocket string) {
	f := root.PersistentFlags()
	f.StringVar(&g.Socket, "socket", defaultSocket, "the daemon's control socket")
	f.StringVarP(&g.Format, "format", "f", "table", "output format: table, json, csv or xml")
	f.StringVar(&g.Fields, "fields", "", `fields to show: "f1,f2", "+f" to add, "-f" to remove, or "all"; a member of an object field as field.member`)
	// An unknown format is a usage error (exit 2), found before the
	// command does anything.
	root.PersistentPreRunE = func(*cobra.Command, []string) error { return g.CheckFormat() }
	CompleteFlag(root, "format", CompleteFrom(output.Formats...))
	CompleteFlag(root, "fields", completeFields)
}

// CheckFormat refuses an unknown --format as a usage error.
func (g *Globals) CheckFormat() error {
	if err := output.CheckFormat(g.Format); err != nil {
		return ctl.Errorf(ctl.CodeInvalid, "--format: %v", err)
	}
	return nil
}

// Client returns a client of the daemon's socket, or of its admin
// listener with --server (or RNBD_SERVER; rnbd-server only). A client
// that cannot be set up (a TLS file missing) fails each request, saying
// why.
func (g *Globals) Client() *ctl.Client {
	if g.remoteOn {
		g.remote()
	}
	if g.Server == "" {
		return ctl.Dial(g.Socket)
	}
	c, err := RemoteClient(g.Server, conf.TLS{Cert: g.Cert, Key: g.Key, CA: g.CA}, "--cert, --key and --ca")
	if err != nil {
		return ctl.Broken(err)
	}
	return c
}

// RemoteClient is a client of the admin listener at server
// (https://HOST[:PORT]) with the certificate, key and CA of t, which
// flags names (for the error when one is missing).
func RemoteClient(server string, t conf.TLS, flags string) (*ctl.Client, error) {
	if t.Cert == "" || t.Key == "" || t.CA == "" {
		return nil, ctl.Errorf(ctl.CodeInvalid, "%s: the admin listener takes TLS only: give %s", server, flags)
	}
	tc, err := t.Config()
	if err != nil {
		return nil, ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	// What the server would refuse in the handshake with no more than
	// "bad certificate": said here, with the reason.
	if unusable, _ := t.CertProblems(x509.ExtKeyUsageClientAuth, "client", time.Now()); len(unusable) > 0 {
		return nil, ctl.Errorf(ctl.CodePermission, "%s: %s", server, strings.Join(unusable, "; "))
	}
	return ctl.DialTLS(server, tc)
}

// Call sends one request of route rt (its names filled by args, query
// added) to the daemon with a 2-minute bound: control commands must not
// hang on a dead path.
func (g *Globals) Call(rt api.Route, args []string, query url.Values, body, out any) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	return api.Call(ctx, g.Client(), rt, args, query, body, out)
}

// List fetches the records of rt (a GET) and prints them with the
// selected fields. The command lines print records as the daemon sent
// them, untyped: a field a newer daemon adds is printed too.
func (g *Globals) List(w io.Writer, rt api.Route, args []string, query url.Values, kind string, defaults, all []string) error {
	var recs []output.Record
	if err := g.Call(rt, args, query, nil, &recs); err != nil {
		return err
	}
	return g.Print(w, kind, recs, defaults, all)
}

// Print prints records of kind with the selected fields (defaults
// unless --fields), in the selected format.
func (g *Globals) Print(w io.Writer, kind string, recs []output.Record, defaults, all []string) error {
	fields, err := output.Fields(g.Fields, defaults, all)
	if err == nil {
		err = output.CheckMembers(fields, recs)
	}
	if err != nil {
		return ctl.Errorf(ctl.CodeInvalid, "%v", err)
	}
	if err := g.CheckFormat(); err != nil {
		return err
	}
	return output.Print(w, g.Format, output.List{Kind: kind, Fields: fields, Records: recs})
}

// Table reports whether records are to be printed as the table (the
// default), where commands that act print a sentence instead.
func (g *Globals) Table() bool { return g.Format == "" || g.Format == "table" }

// Main runs root with the command line's arguments and exits with Run's
// code.
func Main(name string, root *cobra.Command) {
	os.Exit(Run(name, root, os.Args[1:], os.Stdout, os.Stderr))
}

// Run runs root (made Strict) with args and returns its exit code: 0,
// or the error's class's code (ctl), with one line per line of the
// error on stderr, each saying whose it is (name). A usage error of
// cobra's (an unknown flag, a wrong number of arguments) is 2.
func Run(name string, root *cobra.Command, args []string, stdout, stderr io.Writer) int {
	Strict(root)
	root.SilenceUsage = true
	root.SilenceErrors = true
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return flagError(err) })
	root.SetArgs(args)
	root.SetOut(stdout)
	root.SetErr(stderr)
	err := root.Execute()
	if err == nil {
		return 0
	}
	// One line per problem (a configuration's unknown keys), each
	// saying whose it is.
	for _, l := range strings.Split(err.Error(), "\n") {
		fmt.Fprintf(stderr, "%s: %s\n", name, l)
	}
	code := ctl.ExitCode(err)
	var ce *ctl.Error
	if !errors.As(err, &ce) && code == 1 && isUsage(err) {
		code = 2
	}
	return code
}

// strconvError is strconv's part of a flag's error: `invalid argument
// "x" for "--queue-depth" flag: strconv.ParseInt: parsing "x": invalid
// syntax`.
var strconvError = regexp.MustCompile(`strconv\.Parse\w+: parsing "(?:[^"\\]|\\.)*": (invalid syntax|value out of range)`)

// flagError says a flag's bad number in plain words.
func flagError(err error) error {
	msg := strconvError.ReplaceAllStringFunc(err.Error(), func(m string) string {
		if strings.HasSuffix(m, "out of range") {
			return "out of range"
		}
		return "not a number"
	})
	if msg == err.Error() {
		return err
	}
	return errors.New(msg)
}

// isUsage reports a cobra argument or flag error.
func isUsage(err error) bool {
	s := err.Error()
	for _, p := range []string{"unknown command", "unknown flag", "unknown shorthand", "accepts ", "requires ", "invalid argument", "flag needs"} {
		if len(s) >= len(p) && contains(s, p) {
			return true
		}
	}
	return false
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// Daemon is what RunDaemon runs.
type Daemon interface {
	Stop() error
}

// RunDaemon starts a daemon and serves until SIGTERM or SIGINT: signals
// are caught before the start so none is missed; READY=1 goes to systemd
// once it serves and STOPPING=1 when it stops. SIGUSR1 logs every
// goroutine's stack.
func RunDaemon(start func() (Daemon, error)) error {
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT, syscall.SIGUSR1, syscall.SIGHUP, syscall.SIGPIPE)
	defer signal.Stop(sigs)
	if f := os.Getenv("RNBD_CPUPROFILE"); f != "" {
		stop, err := startCPUProfile(f)
		if err != nil {
			return err
		}
		defer stop()
	}
	d, err := start()
	if err != nil {
		return err
	}
	if ok, err := sdnotify.Notify(sdnotify.Ready); err != nil {
		log.L.WithError(err).Warn("sd_notify READY failed")
	} else if !ok {
		log.L.Debug("not started by systemd: no readiness notification")
	}
	for s := range sigs {
		switch s {
		case syscall.SIGUSR1:
			buf := make([]byte, 1<<20)
			n := runtime.Stack(buf, true)
			log.L.WithField("stacks", string(buf[:n])).Info("goroutine dump")
		case syscall.SIGHUP, syscall.SIGPIPE:
			// Not a reason to stop: CLIs and terminals go away.
		default:
			log.L.WithField("signal", s).Info("stopping")
			sdnotify.Notify(sdnotify.Stopping)
			return d.Stop()
		}
	}
	return nil
}

// startCPUProfile writes a CPU profile of the daemon to path until it
// stops: the profiling hook for benchmarks (RNBD_CPUPROFILE=path).
func startCPUProfile(path string) (func(), error) {
	f, err := os.Create(path)
	if err != nil {
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Close()
		return nil, fmt.Errorf("cpu profile: %w", err)
	}
	return func() {
		pprof.StopCPUProfile()
		f.Close()
	}, nil
}

// SetupLog applies a log level and format ("text" or "json").
func SetupLog(level, format string) error {
	l, err := log.ParseLevel(level)
	if err != nil {
		return ctl.Errorf(ctl.CodeInvalid, "log level %q: %v", level, err)
	}
	log.SetLevel(l)
	switch format {
	case "", "text":
	case "json":
		log.SetJSON()
	default:
		return ctl.Errorf(ctl.CodeInvalid, "log format %q: want text or json", format)
	}
	return nil
}
