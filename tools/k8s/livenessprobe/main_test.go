package main

import (
	"context"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/protobuf/types/known/wrapperspb"
)

type identity struct {
	csi.UnimplementedIdentityServer
	ready chan bool
}

func (i *identity) Probe(context.Context, *csi.ProbeRequest) (*csi.ProbeResponse, error) {
	return &csi.ProbeResponse{Ready: wrapperspb.Bool(<-i.ready)}, nil
}

// TestHealthz: 200 while the driver's Probe says ready, 500 when it says
// not ready, 500 within the probe timeout when it does not answer.
func TestHealthz(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "csi.sock")
	id := &identity{ready: make(chan bool, 1)}
	drv := grpc.NewServer()
	csi.RegisterIdentityServer(drv, id)
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go drv.Serve(l)
	defer drv.Stop()
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	hs := httptest.NewServer(handler(csi.NewIdentityClient(conn), 500*time.Millisecond))
	defer hs.Close()

	for _, c := range []struct {
		ready  *bool
		code   int
		answer string
	}{
		{ptr(true), 200, "ok"},
		{ptr(false), 500, "driver not ready"},
		{nil, 500, "DeadlineExceeded"},
	} {
		if c.ready != nil {
			id.ready <- *c.ready
		}
		r, err := http.Get(hs.URL + "/healthz")
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(r.Body)
		r.Body.Close()
		if r.StatusCode != c.code || !strings.Contains(string(b), c.answer) {
			t.Errorf("ready %v: %d %q, want %d %q", c.ready, r.StatusCode, b, c.code, c.answer)
		}
	}
	id.ready <- true // the Probe left waiting
}

func ptr(b bool) *bool { return &b }
