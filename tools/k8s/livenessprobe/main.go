// Command livenessprobe is the project's stand-in for the Kubernetes CSI
// livenessprobe sidecar (not served by the Go module proxy here), for the
// Kubernetes tier (make test-k8s): the image the tier imports as
// registry.k8s.io/sig-storage/livenessprobe holds it. It takes the flags
// deploy/kubernetes passes to the real one: GET /healthz on
// -http-endpoint calls the driver's Probe on -csi-address within
// -probe-timeout and answers 200 when the driver is ready, 500 with the
// reason when it is not or does not answer. SIGINT or SIGTERM exits 0.
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
	"strings"
	"syscall"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
)

func main() {
	fs := flag.NewFlagSet("livenessprobe", flag.ContinueOnError)
	csiAddress := fs.String("csi-address", "/run/csi/socket", "the CSI driver's socket in this container")
	httpEndpoint := fs.String("http-endpoint", "", "address of /healthz")
	healthPort := fs.Int("health-port", 9808, "port of /healthz on every address when -http-endpoint is empty")
	probeTimeout := fs.Duration("probe-timeout", time.Second, "deadline of the driver's Probe")
	fs.Int("v", 0, "log verbosity (accepted; this one logs failed probes)")
	if err := fs.Parse(os.Args[1:]); err != nil {
		os.Exit(2)
	}
	if fs.NArg() > 0 {
		fmt.Fprintf(os.Stderr, "livenessprobe: unexpected arguments %q\n", fs.Args())
		os.Exit(2)
	}
	addr := *httpEndpoint
	if addr == "" {
		addr = fmt.Sprintf(":%d", *healthPort)
	}
	conn, err := grpc.NewClient("unix://"+strings.TrimPrefix(*csiAddress, "unix://"),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("livenessprobe: %v", err)
	}
	defer conn.Close()
	l, err := net.Listen("tcp", addr)
	if err != nil {
		log.Fatalf("livenessprobe: %v", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
	defer stop()
	hs := &http.Server{Handler: handler(csi.NewIdentityClient(conn), *probeTimeout), ReadHeaderTimeout: 5 * time.Second}
	go func() {
		<-ctx.Done()
		hs.Close()
	}()
	if err := hs.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Fatalf("livenessprobe: %v", err)
	}
}

func handler(id csi.IdentityClient, timeout time.Duration) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, r *http.Request) {
		ctx, cancel := context.WithTimeout(r.Context(), timeout)
		defer cancel()
		p, err := id.Probe(ctx, &csi.ProbeRequest{})
		switch {
		case err != nil:
			log.Printf("livenessprobe: Probe: %v", err)
			http.Error(w, err.Error(), http.StatusInternalServerError)
		case p.GetReady() != nil && !p.GetReady().GetValue():
			log.Printf("livenessprobe: Probe: not ready")
			http.Error(w, "driver not ready", http.StatusInternalServerError)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	return mux
}
