package csi

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/kubernetes-csi/csi-test/v5/pkg/sanity"
	"github.com/onsi/ginkgo/v2"
	"github.com/onsi/ginkgo/v2/types"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testca"
	"github.com/rnbd/rnbd/test/testfs"
)

// sanityNodeID is the worker's identity in TestSanity: the name of its
// rnbd-client's certificate, which a publish grants.
const sanityNodeID = "worker-1"

// needsBlockDevice are the csi-sanity specs that stage or publish a
// volume for real: the node maps it through rnbd-client to /dev/nbdN
// (or ublk) and formats and mounts it, which needs the nbd or ublk
// kernel module. This host has neither; they run in the VM tier. Each
// is a regular expression matched against the spec's full text (see
// docs/testing.md, "csi-sanity on the host").
var needsBlockDevice = []string{
	`Node Service NodePublishVolume with single node multi writer capability should fail when volume with single node single writer access mode is already mounted at a different target path`,
	`Node Service NodeUnpublishVolume should remove target path`,
	`Node Service NodeGetVolumeStats should fail when volume does not exist on the specified path`,
	`Node Service NodeExpandVolume should work if node-expand is called after node-publish`,
	`Node Service NodeGetVolumeHealth should return health for a valid volume`,
	`Node Service should work`,
	`Node Service should be idempotent`,
}

// hasBlockDevice: the kernel can give rnbd-client a block device.
func hasBlockDevice() bool {
	for _, p := range []string{"/dev/nbd0", "/dev/ublk-control"} {
		if _, err := os.Stat(p); err == nil {
			return true
		}
	}
	return false
}

// TestSanity runs csi-sanity (kubernetes-csi/csi-test) against rnbd-csi
// serving both services on a unix socket, with two storage nodes
// (rnbd-server, dir pools on XFS so snapshots and clones work, admin
// listeners over TLS) and the worker's own rnbd-client daemon.
func TestSanity(t *testing.T) {
	if testing.Short() {
		t.Skip("csi-sanity starts three daemons and runs about a hundred specs")
	}
	if parallelFlag() && os.Getenv(sanityChild) == "" {
		sanityInChild(t)
		return
	}
	dir := t.TempDir()
	pki := writeSanityPKI(t, filepath.Join(dir, "pki"))
	// Topology labels, so the accessibility constraints are on and
	// tried: both storage nodes and the worker in one zone.
	zone := map[string]string{"topology.kubernetes.io/zone": "a"}
	var nodes []StorageNode
	for _, name := range []string{"node-a", "node-b"} {
		n := startStorageNode(t, filepath.Join(dir, name), pki, name, testfs.ReflinkDir(t))
		n.Labels = zone
		nodes = append(nodes, n)
	}

	csock := filepath.Join(dir, "client.sock")
	startDaemon(t, "rnbd-client", filepath.Join(dir, "client.log"), clientBin, "daemon", "--config", "/dev/null",
		"--control-socket", csock, "--state-file", filepath.Join(dir, "client.json"), "--socket-dir", dir,
		"--dev-links-dir", "", "--tls-cert", filepath.Join(pki, sanityNodeID+".crt"),
		"--tls-key", filepath.Join(pki, sanityNodeID+".key"), "--tls-ca", filepath.Join(pki, "ca.crt"))
	kit.WaitFor(t, 20*time.Second, "rnbd-client's control socket", func() bool { _, err := os.Stat(csock); return err == nil })

	cfg := DefaultConfig()
	cfg.StorageNodes = nodes
	cfg.TLS.Cert, cfg.TLS.Key, cfg.TLS.CA = filepath.Join(pki, "csi-controller.crt"), filepath.Join(pki, "csi-controller.key"), filepath.Join(pki, "ca.crt")
	cfg.Node.NodeID, cfg.Node.ClientSocket, cfg.Node.Labels = sanityNodeID, csock, zone
	cfg.Workers = WorkersConfig{Source: WorkersList, Names: []string{sanityNodeID}}
	d, err := NewDriver(cfg, ModeAll, log.Discard())
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range d.ctrl.nodes {
		kit.WaitFor(t, 30*time.Second, n.String()+"'s admin listener", func() bool {
			_, err := n.pools(context.Background())
			return err == nil
		})
	}
	sock := filepath.Join(dir, "csi.sock")
	if _, err := d.Listen("unix://" + sock); err != nil {
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

	kernel := os.Getenv("RNBD_CSI_KERNEL") == "1"
	if kernel && !hasBlockDevice() {
		t.Fatal("RNBD_CSI_KERNEL=1 but no /dev/nbd0 nor /dev/ublk-control")
	}
	if !hasBlockDevice() {
		// Ginkgo's own skip: the specs are reported as skipped, by name.
		skip := "(" + strings.Join(needsBlockDevice, ")|(") + ")"
		if old := flag.Lookup("ginkgo.skip").Value.String(); old != "" {
			skip = old + "|" + skip
		}
		if err := flag.Set("ginkgo.skip", skip); err != nil {
			t.Fatal(err)
		}
		t.Logf("no /dev/nbd0 nor /dev/ublk-control: skipping the %d specs that need a kernel block device", len(needsBlockDevice))
	}

	// The access type and the frontend of the suite's volumes: a
	// process runs the suite once (Ginkgo's RunSpecs), so the VM tier
	// runs it once per access type.
	access, frontend := os.Getenv("RNBD_CSI_SANITY_ACCESS"), os.Getenv("RNBD_CSI_SANITY_FRONTEND")
	if access == "" {
		access = "mount"
	}
	if access != "mount" && access != "block" {
		t.Fatalf("RNBD_CSI_SANITY_ACCESS=%s: mount or block", access)
	}
	sc := sanity.NewTestConfig()
	sc.Address = "unix://" + sock
	sc.TargetPath = filepath.Join(dir, "target")
	sc.StagingPath = filepath.Join(dir, "staging")
	sc.TestVolumeAccessType = access
	sc.TestVolumeSize = 64 << 20
	sc.TestVolumeExpandSize = 128 << 20
	sc.TestVolumeParameters = map[string]string{"transport": "tcp"}
	if frontend != "" {
		sc.TestVolumeParameters["frontend"] = frontend
	}
	sc.TestSnapshotParameters = map[string]string{}
	sc.TestNodeVolumeAttachLimit = true
	sc.IdempotentCount = 2
	label := access
	if frontend != "" {
		label += " on " + frontend
	}
	// The counts, on a line of their own (the VM tier's console shows
	// TPUT lines), and each spec the suite skipped with the reason it
	// gave (a capability the driver does not advertise; docs/testing.md
	// lists them) or the filter above.
	ginkgo.ReportAfterSuite("csi-sanity counts", func(r ginkgo.Report) {
		var passed, failed, skipped, pending int
		for _, s := range r.SpecReports {
			if s.LeafNodeType != types.NodeTypeIt {
				continue
			}
			switch {
			case s.State == types.SpecStatePassed:
				passed++
			case s.State == types.SpecStateSkipped:
				skipped++
				why := s.Failure.Message
				if why == "" {
					why = "filtered out (needs a kernel block device)"
				}
				t.Logf("skipped: %s: %s", s.FullText(), why)
			case s.State == types.SpecStatePending:
				// The suite's own XIt: disabled by its authors.
				pending++
				t.Logf("pending (disabled in csi-test): %s", s.FullText())
			case s.State.Is(types.SpecStateFailureStates):
				failed++
			}
		}
		fmt.Printf("TPUT csi-sanity %s: %d passed, %d skipped, %d pending, %d failed\n", label, passed, skipped, pending, failed)
	})
	sanity.Test(t, sc)
}

// sanityChild marks the process sanityInChild starts.
const sanityChild = "RNBD_CSI_SANITY_CHILD"

// parallelFlag: the test binary was given -test.parallel, which Ginkgo
// refuses ("Use of go test -parallel"): its specs do not run in
// parallel that way. make test gives it, for the other packages' sake.
func parallelFlag() bool {
	set := false
	flag.Visit(func(f *flag.Flag) { set = set || f.Name == "test.parallel" })
	return set
}

// sanityInChild runs TestSanity again in a process of this test binary
// started without -test.parallel, its output in the test's log and its
// TPUT line on stdout, and fails where it fails.
func sanityInChild(t *testing.T) {
	args := []string{"-test.run=^TestSanity$", "-test.count=1", "-test.v"}
	if d, ok := t.Deadline(); ok {
		args = append(args, "-test.timeout="+time.Until(d).Round(time.Second).String())
	}
	cmd := exec.Command(os.Args[0], args...)
	// The daemons this process built already (TestMain reads RNBD_BIN).
	cmd.Env = append(os.Environ(), sanityChild+"=1", "RNBD_BIN="+filepath.Dir(serverBin))
	out, err := cmd.CombinedOutput()
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, "TPUT ") {
			fmt.Println(l)
		}
	}
	if err != nil {
		t.Fatalf("csi-sanity, in a process without -test.parallel: %v\n%s", err, out)
	}
	t.Logf("csi-sanity, in a process without -test.parallel (Ginkgo refuses it):\n%s", out)
}

// writeSanityPKI writes the certificates TestSanity's daemons present,
// from an authority of the test's (no openssl: the VM tier's guest has
// none): the CA, the storage nodes' (for 127.0.0.1), the controller's
// (the storage nodes' provisioner) and the worker's (its identity).
func writeSanityPKI(t *testing.T, dir string) string {
	t.Helper()
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatal(err)
	}
	ca := testca.New(t, "rnbd-csi sanity CA")
	ca.WriteCA(t, dir, "ca")
	for _, name := range []string{"node-a", "node-b", "csi-controller", sanityNodeID} {
		testca.WriteCert(t, ca.Issue(t, name, "127.0.0.1"), dir, name)
	}
	return dir
}
