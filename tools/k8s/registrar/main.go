// Command registrar is the project's stand-in for the Kubernetes
// node-driver-registrar sidecar (not served by the Go module proxy here),
// for the Kubernetes tier (make test-k8s): the image the tier imports as
// registry.k8s.io/sig-storage/csi-node-driver-registrar holds it. It takes
// the flags deploy/kubernetes/node.yaml passes to the real one and does
// what the kubelet needs of it:
//
//   - it asks the CSI driver on -csi-address its name (GetPluginInfo),
//     trying again until the driver answers;
//   - it serves the kubelet's plugin-registration API
//     (k8s.io/kubelet/pkg/apis/pluginregistration/v1) on
//     -plugin-registration-path/<driver>-reg.sock: GetInfo says a CSI
//     plugin of that name whose socket, as the kubelet sees it, is
//     -kubelet-registration-path; NotifyRegistrationStatus reports what
//     the kubelet made of it (a refusal ends the process, to be restarted);
//   - with -http-endpoint, GET /healthz answers 200 while its
//     registration socket is there, 503 otherwise;
//   - -mode=kubelet-registration-probe exits 0 at once, as the real
//     one's has since v2.9.0.
//
// SIGINT or SIGTERM removes the socket and exits 0.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"net/http"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

func main() {
	fs := flag.NewFlagSet("registrar", flag.ContinueOnError)
	csiAddress := fs.String("csi-address", "/run/csi/socket", "the CSI driver's socket in this container")
	kubeletPath := fs.String("kubelet-registration-path", "", "the CSI driver's socket as the kubelet sees it (required)")
	regDir := fs.String("plugin-registration-path", "/registration", "the kubelet's plugin registration directory in this container")
	httpEndpoint := fs.String("http-endpoint", "", "address of /healthz (empty: none)")
	mode := fs.String("mode", "registration", "registration, or kubelet-registration-probe")
	timeout := fs.Duration("timeout", time.Second, "deadline of each call to the driver")
	fs.Int("v", 0, "log verbosity (accepted; this one logs what it does)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "registrar: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	switch *mode {
	case "kubelet-registration-probe":
		return
	case "registration":
	default:
		fmt.Fprintf(os.Stderr, "registrar: -mode %q: registration or kubelet-registration-probe\n", *mode)
		os.Exit(2)
	}
	if *kubeletPath == "" {
		fmt.Fprintln(os.Stderr, "registrar: -kubelet-registration-path is required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, config{
		csiAddress:   strings.TrimPrefix(*csiAddress, "unix://"),
		kubeletPath:  *kubeletPath,
		regDir:       *regDir,
		httpEndpoint: *httpEndpoint,
		timeout:      *timeout,
	}); err != nil {
		log.Printf("registrar: %v", err)
		os.Exit(1)
	}
}

type config struct {
	csiAddress, kubeletPath, regDir, httpEndpoint string
	timeout                                       time.Duration
}

func run(ctx context.Context, c config) error {
	name, err := driverName(ctx, c.csiAddress, c.timeout)
	if err != nil {
		return err
	}
	sock := filepath.Join(c.regDir, name+"-reg.sock")
	if err := os.Remove(sock); err != nil && !errors.Is(err, os.ErrNotExist) {
		return err
	}
	if c.httpEndpoint != "" {
		hl, err := net.Listen("tcp", c.httpEndpoint)
		if err != nil {
			return err
		}
		hs := &http.Server{Handler: healthz(sock), ReadHeaderTimeout: 5 * time.Second}
		go hs.Serve(hl)
		defer hs.Close()
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	defer os.Remove(sock)
	refused := make(chan error, 1)
	srv := grpc.NewServer()
	registerapi.RegisterRegistrationServer(srv, &registration{name: name, endpoint: c.kubeletPath, refused: refused})
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	defer srv.GracefulStop() // a refusal answered before the end
	log.Printf("registrar: driver %s registers %s at %s", name, c.kubeletPath, sock)

	select {
	case <-ctx.Done():
		return nil
	case err := <-refused:
		return err
	case err := <-served:
		return fmt.Errorf("registration socket: %w", err)
	}
}

// driverName asks the driver its name, again every second until it answers
// or ctx ends.
func driverName(ctx context.Context, addr string, timeout time.Duration) (string, error) {
	conn, err := grpc.NewClient("unix://"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return "", err
	}
	defer conn.Close()
	id := csi.NewIdentityClient(conn)
	for {
		cctx, cancel := context.WithTimeout(ctx, timeout)
		r, err := id.GetPluginInfo(cctx, &csi.GetPluginInfoRequest{})
		cancel()
		if err == nil && r.GetName() != "" {
			return r.GetName(), nil
		}
		if err == nil {
			err = errors.New("GetPluginInfo: no name")
		}
		log.Printf("registrar: the driver at %s: %v (trying again)", addr, err)
		select {
		case <-ctx.Done():
			return "", ctx.Err()
		case <-time.After(time.Second):
		}
	}
}

// healthz answers 200 while the registration socket is there.
func healthz(sock string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if fi, err := os.Stat(sock); err != nil || fi.Mode().Type() != os.ModeSocket {
			http.Error(w, fmt.Sprintf("registration socket %s is not there", sock), http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	return mux
}

// registration is the kubelet's plugin-registration service.
type registration struct {
	registerapi.UnimplementedRegistrationServer
	name, endpoint string
	refused        chan<- error
}

func (r *registration) GetInfo(context.Context, *registerapi.InfoRequest) (*registerapi.PluginInfo, error) {
	return &registerapi.PluginInfo{
		Type:              registerapi.CSIPlugin,
		Name:              r.name,
		Endpoint:          r.endpoint,
		SupportedVersions: []string{"1.0.0"},
	}, nil
}

func (r *registration) NotifyRegistrationStatus(_ context.Context, s *registerapi.RegistrationStatus) (*registerapi.RegistrationStatusResponse, error) {
	if s.GetPluginRegistered() {
		log.Printf("registrar: the kubelet registered %s", r.name)
	} else {
		select {
		case r.refused <- fmt.Errorf("the kubelet refused %s: %s", r.name, s.GetError()):
		default:
		}
	}
	return &registerapi.RegistrationStatusResponse{}, nil
}
