package csi

import (
	"context"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"testing"

	"github.com/container-storage-interface/spec/lib/go/csi"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/rnbd/rnbd/pkg/log"
)

// The driver's /metrics counts each call by service, method and gRPC
// code, and times it: a NodeGetInfo answered and a NodeStageVolume
// refused are both there, as a scrape sees them.
func TestRPCMetrics(t *testing.T) {
	cfg := DefaultConfig()
	cfg.Node.NodeID, cfg.Node.ClientSocket = "worker-1", filepath.Join(t.TempDir(), "none.sock")
	d, err := NewDriver(cfg, ModeNode, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "csi.sock")
	if _, err := d.Listen("unix://" + sock); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	if err := d.ServeMetrics(addr); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() { served <- d.Serve() }()
	t.Cleanup(func() {
		d.Stop()
		if err := <-served; err != nil {
			t.Error(err)
		}
	})
	conn, err := grpc.NewClient("unix://"+sock, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	node := csi.NewNodeClient(conn)
	if _, err := node.NodeGetInfo(context.Background(), &csi.NodeGetInfoRequest{}); err != nil {
		t.Fatal(err)
	}
	if _, err := node.NodeStageVolume(context.Background(), &csi.NodeStageVolumeRequest{}); err == nil {
		t.Fatal("a stage without a volume id succeeded")
	}
	rsp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(rsp.Body)
	rsp.Body.Close()
	for _, want := range []string{
		`rnbd_csi_calls_total{code="OK",method="NodeGetInfo",service="Node"} 1`,
		`rnbd_csi_calls_total{code="InvalidArgument",method="NodeStageVolume",service="Node"} 1`,
		`rnbd_csi_call_seconds_count{method="NodeGetInfo",service="Node"} 1`,
	} {
		if !strings.Contains(string(b), want) {
			t.Errorf("/metrics lacks %s:\n%s", want, grepLines(string(b), "rnbd_csi_"))
		}
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
