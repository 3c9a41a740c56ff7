package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	registerapi "k8s.io/kubelet/pkg/apis/pluginregistration/v1"
)

// identity is the driver's side: a name, once asked twice (the first
// call refused, as a driver still starting does).
type identity struct {
	csi.UnimplementedIdentityServer
	calls int
}

func (i *identity) GetPluginInfo(context.Context, *csi.GetPluginInfoRequest) (*csi.GetPluginInfoResponse, error) {
	i.calls++
	if i.calls == 1 {
		return nil, errors.New("starting")
	}
	return &csi.GetPluginInfoResponse{Name: "rnbd.csi.rnbd.io", VendorVersion: "test"}, nil
}

// TestRegistration plays the kubelet against the registrar: the
// registration socket is named after the driver, GetInfo says what the
// kubelet needs, /healthz is 200 while it serves, and a refused
// registration ends it with the kubelet's reason.
func TestRegistration(t *testing.T) {
	dir := t.TempDir()
	drv := grpc.NewServer()
	csi.RegisterIdentityServer(drv, &identity{})
	l, err := net.Listen("unix", filepath.Join(dir, "csi.sock"))
	if err != nil {
		t.Fatal(err)
	}
	go drv.Serve(l)
	defer drv.Stop()

	hl, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	httpAddr := hl.Addr().String()
	hl.Close()

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	done := make(chan error, 1)
	go func() {
		done <- run(ctx, config{
			csiAddress:   filepath.Join(dir, "csi.sock"),
			kubeletPath:  "/var/lib/kubelet/plugins/rnbd.csi.rnbd.io/csi.sock",
			regDir:       dir,
			httpEndpoint: httpAddr,
			timeout:      time.Second,
		})
	}()

	sock := filepath.Join(dir, "rnbd.csi.rnbd.io-reg.sock")
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	reg := registerapi.NewRegistrationClient(conn)
	var info *registerapi.PluginInfo
	for info == nil {
		cctx, ccancel := context.WithTimeout(ctx, time.Second)
		info, err = reg.GetInfo(cctx, &registerapi.InfoRequest{}, grpc.WaitForReady(true))
		ccancel()
		if ctx.Err() != nil {
			t.Fatalf("GetInfo: %v", err)
		}
	}
	want := fmt.Sprint(registerapi.CSIPlugin, " rnbd.csi.rnbd.io /var/lib/kubelet/plugins/rnbd.csi.rnbd.io/csi.sock [1.0.0]")
	if got := fmt.Sprint(info.Type, " ", info.Name, " ", info.Endpoint, " ", info.SupportedVersions); got != want {
		t.Fatalf("GetInfo: %s, want %s", got, want)
	}
	if code, body := get(t, "http://"+httpAddr+"/healthz"); code != 200 {
		t.Fatalf("/healthz: %d %s", code, body)
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{PluginRegistered: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := reg.NotifyRegistrationStatus(ctx, &registerapi.RegistrationStatus{Error: "version 0.9 only"}); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "the kubelet refused rnbd.csi.rnbd.io: version 0.9 only") {
			t.Fatalf("run: %v, want the kubelet's refusal", err)
		}
	case <-ctx.Done():
		t.Fatal("a refused registration did not end the registrar")
	}
	if _, err := net.Dial("unix", sock); err == nil {
		t.Fatal("the registration socket outlives the registrar")
	}
}

func get(t *testing.T, url string) (int, string) {
	t.Helper()
	r, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer r.Body.Close()
	b, _ := io.ReadAll(r.Body)
	return r.StatusCode, string(b)
}
