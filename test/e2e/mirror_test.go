package e2e

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/kit"
)

// storageNode is an rnbd-server process exporting one sparse file as
// "vol", on a port of its own: a storage node of its own for the mirror.
type storageNode struct {
	dir, vol string
	port     int
	srv      *serverDaemon
}

func newStorageNode(t *testing.T, size int64) *storageNode {
	t.Helper()
	n := &storageNode{dir: t.TempDir(), port: freePort(t)}
	n.vol = filepath.Join(n.dir, "vol.img")
	kit.SparseFile(t, n.vol, size)
	n.start(t)
	n.srv.ok("map", "vol", n.vol)
	return n
}

// start starts the node's server; its exports come back from its state
// file.
func (n *storageNode) start(t *testing.T) { n.srv = startServer(t, n.dir, n.port) }

// kill ends the server with SIGKILL: a storage node lost.
func (n *storageNode) kill(t *testing.T) {
	t.Helper()
	n.srv.cmd.Process.Kill()
	select {
	case err := <-n.srv.done:
		n.srv.done <- err // for the cleanup
	case <-time.After(30 * time.Second):
		t.Fatal("rnbd-server did not die")
	}
}

// leg is the node's volume as a mirror's leg, through session sess.
func (n *storageNode) leg(sess string) string {
	return fmt.Sprintf("sessname=%s path=ip:127.0.0.1 device_path=vol dest_port=%d", sess, n.port)
}

// data is n bytes of the leg's data region at off (past the mirror's
// metadata, docs/replication.md).
func (n *storageNode) data(t *testing.T, off, size int64) []byte {
	t.Helper()
	const dataOff = 8 << 20
	f, err := os.Open(n.vol)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	b := make([]byte, size)
	if _, err := f.ReadAt(b, dataOff+off); err != nil {
		t.Fatal(err)
	}
	return b
}

// legStates are the states of a mirror's legs in its device record.
func legStates(t *testing.T, rec map[string]any) []string {
	t.Helper()
	var out []string
	legs, _ := rec["legs"].([]any)
	for _, l := range legs {
		out = append(out, fmt.Sprint(l.(map[string]any)["state"]))
	}
	return out
}

// TestMirrorMapping drives a mirror as an operator does, with real
// daemons and a real NBD client: created over two storage nodes, written
// through its NBD socket onto both; a node killed under it (IO goes on,
// the leg stale); the node back while mapped (the leg rejoins and is
// resynced from the bitmap, then read again); then the other node lost, where a lone
// leg that may be stale is refused until forced, and a restart keeps the
// mapping to restore.
func TestMirrorMapping(t *testing.T) {
	needTools(t, "qemu-io")
	const size = 64 << 20
	a, b := newStorageNode(t, size), newStorageNode(t, size)
	dir := t.TempDir()
	cl := startClient(t, dir, "--mirror-leg-timeout", "2s")
	sock := filepath.Join(dir, "m.sock")
	uri := "nbd+unix:///vol?socket=" + sock
	mapArgs := []string{"map", "--mirror", "vol", "--leg", a.leg("m-a"), "--leg", b.leg("m-b"), "--as", "socket:" + sock}

	if _, errOut, code := cl.ctl(mapArgs...); code == 0 || !strings.Contains(errOut, "no superblock") && !strings.Contains(errOut, "refused") {
		t.Fatalf("map of new legs without --create: exit %d: %s", code, errOut)
	}
	out := cl.ok(append(mapArgs, "--create", "--region-size", "1MiB")...)
	if !strings.Contains(out, "rnbd0 mapped: "+uri) {
		t.Fatalf("map: %q", out)
	}
	rec := cl.records("device", "show", "rnbd0")[0]
	if rec["mirror"] != "vol" || rec["state"] != "open" || rec["size"] != float64(size-8<<20) || rec["region_size"] != float64(1<<20) ||
		strings.Join(legStates(t, rec), ",") != "in sync,in sync" {
		t.Fatalf("record %v", rec)
	}
	qemuIO(t, uri, "write -P 0xa1 0 1M", "read -P 0xa1 0 1M")
	for _, n := range []*storageNode{a, b} {
		if !bytes.Equal(n.data(t, 0, 1<<20), bytes.Repeat([]byte{0xa1}, 1<<20)) {
			t.Fatalf("leg on port %d does not hold the write", n.port)
		}
	}
	// Two mappings of one mirror, or a session shared with a leg, are
	// refused.
	if _, errOut, code := cl.ctl(append(slices.Clone(mapArgs[:len(mapArgs)-2]), "--as", "socket:"+sock+"2")...); code == 0 || !strings.Contains(errOut, "mapped already") {
		t.Fatalf("second map of the mirror: exit %d: %s", code, errOut)
	}

	// Node b lost under IO: the write completes on a, b is stale.
	b.kill(t)
	start := time.Now()
	qemuIO(t, uri, "write -P 0xb2 1M 1M", "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M")
	t.Logf("IO with a leg's node killed done in %v", time.Since(start))
	rec = cl.records("device", "show", "rnbd0")[0]
	if rec["state"] != "degraded" || strings.Join(legStates(t, rec), ",") != "in sync,stale" {
		t.Fatalf("record after a leg's node died %v", rec)
	}

	// b back while mapped: it rejoins, is resynced from the bitmap with
	// what it missed, and is in sync again.
	b.start(t)
	kit.WaitFor(t, time.Minute, "b to rejoin and resync", func() bool {
		rec = cl.records("device", "show", "rnbd0")[0]
		return rec["state"] == "open"
	})
	if strings.Join(legStates(t, rec), ",") != "in sync,in sync" {
		t.Fatalf("record after b came back %v", rec)
	}
	if !bytes.Equal(b.data(t, 1<<20, 1<<20), bytes.Repeat([]byte{0xb2}, 1<<20)) {
		t.Fatal("b was not resynced with the write it missed")
	}
	qemuIO(t, uri, "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M", "write -P 0xc3 2M 1M")
	if !bytes.Equal(b.data(t, 2<<20, 1<<20), bytes.Repeat([]byte{0xc3}, 1<<20)) {
		t.Fatal("b, back in sync, missed a write")
	}
	// Mapped again, as a first map's retry maps it (--create-if-new):
	// assembled from both, nothing made anew.
	cl.ok("unmap", "rnbd0")
	cl.ok(append(mapArgs, "--create-if-new")...)
	if rec = cl.records("device", "show", "rnbd0")[0]; rec["state"] != "open" {
		t.Fatalf("record mapped again %v", rec)
	}
	qemuIO(t, uri, "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M", "read -P 0xc3 2M 1M")
	cl.ok("unmap", "rnbd0")

	// a lost for good: b alone cannot prove it is current.
	a.kill(t)
	_, errOut, code := cl.ctl(mapArgs...)
	if code == 0 || !strings.Contains(errOut, "mirror refused") {
		t.Fatalf("map with one leg of two: exit %d: %s", code, errOut)
	}
	cl.ok(append(mapArgs, "--force", "e2e operator")...)
	qemuIO(t, uri, "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M", "read -P 0xc3 2M 1M")
	if log := cl.out.String(); !strings.Contains(log, "audit") || !strings.Contains(log, "e2e operator") {
		t.Fatalf("no audit line for the forced assembly:\n%s", log)
	}
	// The state file keeps the mirror; a restart without a leaves it to
	// restore, never forced again.
	cl.stop()
	st, _ := os.ReadFile(filepath.Join(dir, "client.json"))
	cl = startClient(t, dir, "--mirror-leg-timeout", "2s")
	if _, errOut, code := cl.ctl("device", "show", "rnbd0"); code != 0 {
		t.Fatalf("after a restart: %s\nstate file: %s\n%s", errOut, st, cl.out.String())
	}
	rec = cl.records("device", "show", "rnbd0")[0]
	if rec["mirror"] != "vol" || rec["state"] != "restoring" {
		t.Fatalf("record after a restart with one leg %v", rec)
	}
}

// TestMirrorWitness: a mirror of two legs and a witness keeps serving
// when a leg is lost only while the witness votes. The witness's node
// goes down while leg b is away; b comes back and resyncs, generations
// the witness misses; the witness's node comes back, and the client
// dials it again while mapped, so that losing leg a then leaves b and
// the witness, a quorum: IO goes on.
func TestMirrorWitness(t *testing.T) {
	needTools(t, "qemu-io")
	const size = 32 << 20
	a, b, w := newStorageNode(t, size), newStorageNode(t, size), newStorageNode(t, 1<<20)
	dir := t.TempDir()
	cl := startClient(t, dir, "--mirror-leg-timeout", "2s")
	sock := filepath.Join(dir, "m.sock")
	uri := "nbd+unix:///vol?socket=" + sock
	// New legs: --create-if-new makes the mirror.
	cl.ok("map", "--mirror", "vol", "--leg", a.leg("w-a"), "--leg", b.leg("w-b"), "--witness", w.leg("w-w"),
		"--as", "socket:"+sock, "--create-if-new")
	states := func() string {
		return strings.Join(legStates(t, cl.records("device", "show", "rnbd0")[0]), ",")
	}
	waitStates := func(want string) {
		t.Helper()
		kit.WaitFor(t, time.Minute, "legs "+want, func() bool { return states() == want })
	}
	if got := states(); got != "in sync,in sync,voting" {
		t.Fatalf("legs %s after create", got)
	}
	qemuIO(t, uri, "write -P 0xa1 0 1M")
	b.kill(t)
	qemuIO(t, uri, "write -P 0xb2 1M 1M")
	waitStates("in sync,stale,voting")
	w.kill(t)
	waitStates("in sync,stale,missing")
	b.start(t)
	waitStates("in sync,in sync,missing") // b resynced; the witness missed it
	w.start(t)
	start := time.Now()
	waitStates("in sync,in sync,voting")
	t.Logf("the witness voted again %v after its node came back", time.Since(start))

	a.kill(t)
	qemuIO(t, uri, "write -P 0xc3 2M 1M", "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M", "read -P 0xc3 2M 1M")
	rec := cl.records("device", "show", "rnbd0")[0]
	if rec["state"] != "degraded" || strings.Join(legStates(t, rec), ",") != "stale,in sync,voting" {
		t.Fatalf("record with a lost after the witness came back %v", rec)
	}
}

// TestMirrorReplaceLeg: a leg's storage node gone for good is replaced
// by a device on another (rnbd-client replace-leg), rebuilt in full
// under IO, and is then a voter as the old one was: the other leg's
// node lost too, the new leg and the witness serve on. The state file
// keeps the new leg; the old node back is no leg any more. Refusals:
// a leg in sync, a leg on a node another leg is on, a device the new
// node does not export (nothing changed).
func TestMirrorReplaceLeg(t *testing.T) {
	needTools(t, "qemu-io")
	const size = 24 << 20
	a, b, w, c := newStorageNode(t, size), newStorageNode(t, size), newStorageNode(t, 1<<20), newStorageNode(t, size)
	dir := t.TempDir()
	cl := startClient(t, dir, "--mirror-leg-timeout", "2s")
	sock := filepath.Join(dir, "m.sock")
	uri := "nbd+unix:///vol?socket=" + sock
	cl.ok("map", "--mirror", "vol", "--leg", a.leg("r-a"), "--leg", b.leg("r-b"), "--witness", w.leg("r-w"),
		"--as", "socket:"+sock, "--create-if-new")
	legs := func() string {
		var out []string
		for _, l := range cl.records("device", "show", "rnbd0")[0]["legs"].([]any) {
			m := l.(map[string]any)
			out = append(out, fmt.Sprint(m["sessname"], "=", m["state"]))
		}
		return strings.Join(out, ",")
	}
	qemuIO(t, uri, "write -P 0xa1 0 1M")

	b.kill(t)
	qemuIO(t, uri, "write -P 0xb2 1M 1M")
	kit.WaitFor(t, time.Minute, "b stale", func() bool { return legs() == "r-a=in sync,r-b=stale,r-w=voting" })
	for what, args := range map[string][]string{
		"a leg in sync":     {"0", c.leg("r-c")},
		"on a's node":       {"1", a.leg("r-c")},
		"a's session":       {"1", c.leg("r-a")},
		"no such leg":       {"3", c.leg("r-c")},
		"no such export":    {"1", strings.Replace(c.leg("r-c"), "device_path=vol", "device_path=nope", 1)},
		"the witness votes": {"witness", c.leg("r-c")},
	} {
		if _, errOut, code := cl.ctl(append([]string{"replace-leg", "rnbd0"}, args...)...); code == 0 {
			t.Errorf("replace-leg, %s: exit 0", what)
		} else {
			t.Logf("replace-leg, %s: %s", what, strings.TrimSpace(errOut))
		}
	}
	if got := legs(); got != "r-a=in sync,r-b=stale,r-w=voting" {
		t.Fatalf("legs after the refusals: %s", got)
	}

	// c in b's place: rebuilt in full (it missed every write), under IO.
	start := time.Now()
	cl.ok("replace-leg", "rnbd0", "1", c.leg("r-c"))
	qemuIO(t, uri, "write -P 0xc3 2M 1M")
	cl.ok("wait", "--timeout", "2m")
	t.Logf("replaced and rebuilt (%d MiB) in %v", (size-8<<20)>>20, time.Since(start))
	if got := legs(); got != "r-a=in sync,r-c=in sync,r-w=voting" {
		t.Fatalf("legs after the rebuild: %s", got)
	}
	for i, p := range []byte{0xa1, 0xb2, 0xc3} {
		if !bytes.Equal(c.data(t, int64(i)<<20, 1<<20), bytes.Repeat([]byte{p}, 1<<20)) {
			t.Fatalf("the new leg does not hold MiB %d (%#x)", i, p)
		}
	}
	if !bytes.Equal(c.data(t, 3<<20, 1<<20), make([]byte, 1<<20)) {
		t.Fatal("the new leg's unwritten data is not zero")
	}

	// a lost too: c and the witness are a quorum, and c is current.
	a.kill(t)
	qemuIO(t, uri, "write -P 0xd4 3M 1M", "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M", "read -P 0xc3 2M 1M", "read -P 0xd4 3M 1M")

	// Restarted: the mapping comes back with c (a still down; c and the
	// witness assemble), and b, back, is no leg of it.
	b.start(t)
	cl.stop()
	cl = startClient(t, dir, "--mirror-leg-timeout", "2s")
	kit.WaitFor(t, time.Minute, "the mirror restored", func() bool {
		rec := cl.records("device", "show", "rnbd0")[0]
		return rec["state"] == "degraded"
	})
	if got := legs(); got != "r-a=stale,r-c=in sync,r-w=voting" && got != "r-a=missing,r-c=in sync,r-w=voting" {
		t.Fatalf("legs after a restart: %s", got)
	}
	qemuIO(t, uri, "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M", "read -P 0xc3 2M 1M", "read -P 0xd4 3M 1M")
	if strings.Contains(cl.out.String(), "r-b") {
		t.Fatalf("the restarted client dialled the replaced leg:\n%s", cl.out.String())
	}
}

// TestMirrorSpare: a mirror mapped with a spare (map --spare); a leg's
// storage node lost and not back within mirror_spare_after: the spare
// takes its place by itself, is rebuilt in full under IO, and the state
// file keeps it.
func TestMirrorSpare(t *testing.T) {
	needTools(t, "qemu-io")
	const size = 24 << 20
	a, b, w, c := newStorageNode(t, size), newStorageNode(t, size), newStorageNode(t, 1<<20), newStorageNode(t, size)
	dir := t.TempDir()
	cl := startClient(t, dir, "--mirror-leg-timeout", "2s", "--mirror-spare-after", "1s")
	sock := filepath.Join(dir, "m.sock")
	uri := "nbd+unix:///vol?socket=" + sock
	cl.ok("map", "--mirror", "vol", "--leg", a.leg("s-a"), "--leg", b.leg("s-b"), "--witness", w.leg("s-w"),
		"--spare", c.leg("s-c"), "--as", "socket:"+sock, "--create-if-new")
	legs := func() string {
		var out []string
		for _, l := range cl.records("device", "show", "rnbd0")[0]["legs"].([]any) {
			m := l.(map[string]any)
			out = append(out, fmt.Sprint(m["leg"], ":", m["sessname"], "=", m["state"]))
		}
		return strings.Join(out, ",")
	}
	if got := legs(); got != "0:s-a=in sync,1:s-b=in sync,witness:s-w=voting,spare0:s-c=spare" {
		t.Fatalf("legs after create: %s", got)
	}
	qemuIO(t, uri, "write -P 0xa1 0 1M")
	b.kill(t)
	start := time.Now()
	qemuIO(t, uri, "write -P 0xb2 1M 1M")
	kit.WaitFor(t, time.Minute, "the spare in b's place, in sync", func() bool {
		return legs() == "0:s-a=in sync,1:s-c=in sync,witness:s-w=voting"
	})
	t.Logf("b's node lost: the spare in sync %v later", time.Since(start))
	for i, p := range []byte{0xa1, 0xb2} {
		if !bytes.Equal(c.data(t, int64(i)<<20, 1<<20), bytes.Repeat([]byte{p}, 1<<20)) {
			t.Fatalf("the spare does not hold MiB %d (%#x)", i, p)
		}
	}
	if log := cl.out.String(); !strings.Contains(log, "a spare took its place") || !strings.Contains(log, "audit") {
		t.Fatalf("no audit line for the spare taken:\n%s", log)
	}
	cl.stop()
	cl = startClient(t, dir, "--mirror-leg-timeout", "2s")
	kit.WaitFor(t, time.Minute, "the mirror restored", func() bool {
		return cl.records("device", "show", "rnbd0")[0]["state"] == "open"
	})
	if got := legs(); got != "0:s-a=in sync,1:s-c=in sync,witness:s-w=voting" {
		t.Fatalf("legs after a restart: %s", got)
	}
	qemuIO(t, uri, "read -P 0xa1 0 1M", "read -P 0xb2 1M 1M")
}

// TestMirrorGrow: `rnbd-client resize` grows a mapped mirror once both
// storage nodes have grown its legs (`rnbd-server resize`): refused,
// naming the leg, while one has not, and a mirror never shrinks. The
// bytes added read as zeros — on the leg whose grown file held garbage
// there too — and take writes; NBD clients that connect see the new
// size, and so does the mirror mapped again. remap, a single device's,
// is refused.
func TestMirrorGrow(t *testing.T) {
	needTools(t, "qemu-io", "nbdinfo")
	const size, grown = 64 << 20, 96 << 20 // the legs'; the data is 8 MiB less
	a, b := newStorageNode(t, size), newStorageNode(t, size)
	dir := t.TempDir()
	cl := startClient(t, dir)
	sock := filepath.Join(dir, "m.sock")
	uri := "nbd+unix:///vol?socket=" + sock
	mapArgs := []string{"map", "--mirror", "vol", "--leg", a.leg("g-a"), "--leg", b.leg("g-b"), "--as", "socket:" + sock}
	cl.ok(append(mapArgs, "--create")...)
	qemuIO(t, uri, "write -P 0xa1 0 1M", "write -P 0xa2 55M 1M")
	nbdSize := func() string { return strings.TrimSpace(run(t, time.Minute, "nbdinfo", "--size", uri)) }

	// remap is a single device's: refused for a mirror, saying why.
	if _, errOut, code := cl.ctl("remap", "rnbd0"); code != 8 || !strings.Contains(errOut, "is a mirror") {
		t.Fatalf("remap of a mirror: exit %d: %s", code, errOut)
	}
	if _, errOut, code := cl.ctl("resize", "rnbd0", "48MiB"); code != 2 || !strings.Contains(errOut, "grows only") {
		t.Fatalf("shrink: exit %d: %s", code, errOut)
	}
	if _, errOut, code := cl.ctl("resize", "rnbd0", "88MiB"); code != 9 || !strings.Contains(errOut, "grow its volume on its storage node first") {
		t.Fatalf("grow before the legs: exit %d: %s", code, errOut)
	}
	a.srv.ok("resize", "vol", "96MiB")
	// What a reused device may hold in the bytes it grows by.
	f, err := os.OpenFile(a.vol, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	_, err = f.WriteAt(bytes.Repeat([]byte{0xee}, 1<<20), size)
	f.Close()
	if err != nil {
		t.Fatal(err)
	}
	if _, errOut, code := cl.ctl("resize", "rnbd0", "88MiB"); code != 9 || !strings.Contains(errOut, "leg 1") {
		t.Fatalf("grow before leg 1: exit %d: %s", code, errOut)
	}
	if s := nbdSize(); s != fmt.Sprint(size-8<<20) {
		t.Fatalf("refused grows changed the size: %s", s)
	}
	b.srv.ok("resize", "vol", "96MiB")
	cl.ok("resize", "rnbd0", "88MiB")
	if rec := cl.records("device", "show", "rnbd0")[0]; rec["size"] != float64(grown-8<<20) ||
		strings.Join(legStates(t, rec), ",") != "in sync,in sync" {
		t.Fatalf("record after the growth %v", rec)
	}
	if s := nbdSize(); s != fmt.Sprint(grown-8<<20) {
		t.Fatalf("an NBD client sees %s bytes", s)
	}
	// Both legs' bytes added are zeros; read through the mirror from
	// either (round-robin), written and read back.
	for _, n := range []*storageNode{a, b} {
		if !bytes.Equal(n.data(t, size-8<<20, 1<<20), make([]byte, 1<<20)) {
			t.Fatalf("leg on port %d: the bytes added are not zeros", n.port)
		}
	}
	qemuIO(t, uri, "read -P 0 56M 1M", "read -P 0 56M 1M", "write -P 0xb3 87M 1M", "read -P 0xb3 87M 1M",
		"read -P 0xa1 0 1M", "read -P 0xa2 55M 1M")
	cl.ok("unmap", "rnbd0")
	cl.ok(mapArgs...)
	if s := nbdSize(); s != fmt.Sprint(grown-8<<20) {
		t.Fatalf("mapped again: %s bytes", s)
	}
	qemuIO(t, uri, "read -P 0xb3 87M 1M", "read -P 0xa1 0 1M", "read -P 0 60M 1M")
	for _, n := range []*storageNode{a, b} {
		if !bytes.Equal(n.data(t, 87<<20, 1<<20), bytes.Repeat([]byte{0xb3}, 1<<20)) {
			t.Fatalf("leg on port %d does not hold the write past the old size", n.port)
		}
	}
}

// TestMirrorMapSize: a mirror mapped with --size while a leg's node is
// down cannot grow (a leg not in sync would come back without the bytes
// added): it is mapped at its size and map says so, resize is refused
// (busy) until the leg is back and resynced, then grows it. The map and
// the refused resize leave the size the NBD clients see as it was.
func TestMirrorMapSize(t *testing.T) {
	needTools(t, "qemu-io", "nbdinfo")
	const size = 32 << 20
	a, b, w := newStorageNode(t, size), newStorageNode(t, size), newStorageNode(t, 1<<20)
	dir := t.TempDir()
	cl := startClient(t, dir, "--mirror-leg-timeout", "2s")
	sock := filepath.Join(dir, "m.sock")
	uri := "nbd+unix:///vol?socket=" + sock
	mapArgs := []string{"map", "--mirror", "vol", "--leg", a.leg("z-a"), "--leg", b.leg("z-b"), "--witness", w.leg("z-w"), "--as", "socket:" + sock}
	cl.ok(append(mapArgs, "--create-if-new")...)
	qemuIO(t, uri, "write -P 0xa1 0 1M")
	cl.ok("unmap", "rnbd0")
	// Both legs' volumes grown, then b's node lost.
	b.kill(t)
	for _, n := range []*storageNode{a, b} {
		if err := os.Truncate(n.vol, size+16<<20); err != nil {
			t.Fatal(err)
		}
	}
	nbdSize := func() string { return strings.TrimSpace(run(t, time.Minute, "nbdinfo", "--size", uri)) }
	_, errOut, code := cl.ctl(append(mapArgs, "--size", "40MiB")...)
	if code != 0 || !strings.Contains(errOut, "not the 41943040 asked") {
		t.Fatalf("map --size with a leg's node down: exit %d: %s", code, errOut)
	}
	if s := nbdSize(); s != fmt.Sprint(size-8<<20) {
		t.Fatalf("mapped degraded with --size 40MiB: %s bytes, want its %d", s, size-8<<20)
	}
	if _, errOut, code := cl.ctl("resize", "rnbd0", "40MiB"); code != 5 || !strings.Contains(errOut, "leg 1") {
		t.Fatalf("resize with leg 1 out: exit %d: %s", code, errOut)
	}
	b.start(t)
	kit.WaitFor(t, time.Minute, "leg 1 back in sync", func() bool {
		return strings.Join(legStates(t, cl.records("device", "show", "rnbd0")[0]), ",") == "in sync,in sync,voting"
	})
	cl.ok("resize", "rnbd0", "40MiB")
	if s := nbdSize(); s != fmt.Sprint(40<<20) {
		t.Fatalf("grown once leg 1 was back: %s bytes", s)
	}
	qemuIO(t, uri, "read -P 0xa1 0 1M", "read -P 0 24M 16M", "write -P 0xb2 39M 1M", "read -P 0xb2 39M 1M")
}

// TestMirrorAdopt: copies of a mapped mirror's legs, taken while it is
// idle but not closed (its bitmap as a crash leaves it), mapped on other
// storage nodes as another mirror with --adopt: the data reads back, and
// from then on they are that mirror's — mapped again without --adopt,
// and refused under the old name. --adopt with --create is refused. The
// copies are made larger (a restore larger than its snapshot) and the
// map's --size grows the mirror to it, the bytes added zeros; a size
// its legs do not hold is refused.
func TestMirrorAdopt(t *testing.T) {
	needTools(t, "qemu-io", "nbdinfo")
	const size = 32 << 20
	a, b := newStorageNode(t, size), newStorageNode(t, size)
	c, d := newStorageNode(t, size), newStorageNode(t, size)
	dir := t.TempDir()
	cl := startClient(t, dir)
	sock, sock2 := filepath.Join(dir, "m.sock"), filepath.Join(dir, "m2.sock")
	cl.ok("map", "--mirror", "vol", "--leg", a.leg("ad-a"), "--leg", b.leg("ad-b"), "--as", "socket:"+sock, "--create")
	qemuIO(t, "nbd+unix:///vol?socket="+sock, "write -P 0xc1 0 1M", "write -P 0xc2 20M 2M")
	for _, cp := range [][2]*storageNode{{a, c}, {b, d}} {
		data, err := os.ReadFile(cp[0].vol)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(cp[1].vol, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	restored := []string{"map", "--mirror", "restored", "--leg", c.leg("ad-c"), "--leg", d.leg("ad-d"), "--as", "socket:" + sock2}
	if _, errOut, code := cl.ctl(append(restored, "--adopt", "vol", "--create")...); code != 2 || !strings.Contains(errOut, "adopt") {
		t.Fatalf("--adopt with --create: exit %d: %s", code, errOut)
	}
	if _, errOut, code := cl.ctl(restored...); code == 0 || !strings.Contains(errOut, "another mirror") {
		t.Fatalf("the copies without --adopt: exit %d: %s", code, errOut)
	}
	// The copies made larger, as a restore larger than its snapshot
	// makes them: the mirror grows to the size asked before its device
	// is made, the bytes added zeros.
	for _, n := range []*storageNode{c, d} {
		if err := os.Truncate(n.vol, size+16<<20); err != nil {
			t.Fatal(err)
		}
		f, err := os.OpenFile(n.vol, os.O_WRONLY, 0)
		if err != nil {
			t.Fatal(err)
		}
		_, err = f.WriteAt(bytes.Repeat([]byte{0xee}, 1<<20), size+8<<20) // what a reused device may hold
		f.Close()
		if err != nil {
			t.Fatal(err)
		}
	}
	if _, errOut, code := cl.ctl(append(restored, "--adopt", "vol", "--size", "40001KiB")...); code != 2 || !strings.Contains(errOut, "multiple of 4096") {
		t.Fatalf("--size 40001KiB: exit %d: %s", code, errOut)
	}
	if _, errOut, code := cl.ctl(append(restored, "--adopt", "vol", "--size", "48MiB")...); code != 9 || !strings.Contains(errOut, "grow its volume") {
		t.Fatalf("--size more than the legs hold: exit %d: %s", code, errOut)
	}
	cl.ok(append(restored, "--adopt", "vol", "--size", "40MiB")...)
	uri2 := "nbd+unix:///restored?socket=" + sock2
	if s := strings.TrimSpace(run(t, time.Minute, "nbdinfo", "--size", uri2)); s != fmt.Sprint(40<<20) {
		t.Fatalf("mapped with --size 40MiB: %s bytes", s)
	}
	qemuIO(t, uri2, "read -P 0xc1 0 1M", "read -P 0xc2 20M 2M", "write -P 0xd3 4M 1M", "read -P 0 24M 16M")
	// The source goes on by itself.
	qemuIO(t, "nbd+unix:///vol?socket="+sock, "read -P 0 4M 1M")
	rec := cl.records("device", "show", "rnbd1")[0]
	cl.ok("unmap", "rnbd1")
	cl.ok(restored...)
	qemuIO(t, uri2, "read -P 0xc1 0 1M", "read -P 0xd3 4M 1M")
	cl.ok("unmap", "rnbd1")
	cl.ok("unmap", "rnbd0")
	if _, errOut, code := cl.ctl("map", "--mirror", "vol", "--leg", c.leg("ad-c2"), "--leg", d.leg("ad-d2"), "--as", "socket:"+sock2); code == 0 || !strings.Contains(errOut, "another mirror") {
		t.Fatalf("the adopted legs under the old name: exit %d: %s", code, errOut)
	}
	if rec["mirror"] != "restored" {
		t.Errorf("record of the adopted mirror: %v", rec)
	}
}
