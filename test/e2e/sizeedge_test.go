package e2e

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// qemuIOOut runs qemu-io commands on an NBD URI and returns what it
// printed (qemu-io exits 0 when a command fails: the output says).
func qemuIOOut(t *testing.T, uri string, cmds ...string) string {
	t.Helper()
	args := []string{"-f", "raw"}
	for _, c := range cmds {
		args = append(args, "-c", c)
	}
	out, _ := exec.Command("qemu-io", append(args, uri)...).CombinedOutput()
	return string(out)
}

// TestWritePastEndENOSPC: after a forced shrink the client, which has
// not polled the size yet, still shows the old size; a write that starts
// past the new end goes to the server and gets ENOSPC through the NBD
// socket — not EINVAL, which tools take for a misaligned O_DIRECT buffer
// (busybox dd then wrote again through the page cache and lost the
// data). A read there gets EINVAL; the file does not grow.
func TestWritePastEndENOSPC(t *testing.T) {
	needTools(t, "qemu-io")
	m := mapVol(t, 8<<20, "pe", nil, []string{"--size-poll", "0"})
	srv, vol, uri := m.srv, m.vol, m.uri
	qemuIO(t, uri, "write -P 0x11 6M 64k", "read -P 0x11 6M 64k")
	srv.ok("resize", "vol", "4MiB", "--force")
	for _, c := range []struct{ cmd, want string }{
		{"write -P 0xab 6M 64k", "write failed: No space left on device"},   // starts past the end
		{"write -P 0xab 4M 4k", "write failed: No space left on device"},    // starts at the end
		{"write -P 0xab 4092k 8k", "write failed: No space left on device"}, // runs past it
		{"write -z 5M 64k", "write failed: No space left on device"},        // write-zeroes
		{"read 6M 64k", "read failed: Invalid argument"},                    // a read past the end
	} {
		if out := qemuIOOut(t, uri, c.cmd); !strings.Contains(out, c.want) {
			t.Errorf("%s: %q, want %q", c.cmd, strings.TrimSpace(out), c.want)
		}
	}
	if st, err := os.Stat(vol); err != nil || st.Size() != 4<<20 {
		t.Fatalf("the file after writes past its end: %v, size %d", err, st.Size())
	}
	qemuIO(t, uri, "write -P 0x22 4088k 4k", "read -P 0x22 4088k 4k")
}

// TestServerCloseSticks: rnbd-server device close of a mapped device
// (the kernel's force_close) sticks across the client's size polls: the
// device shows "closed by server", the server has nothing open for the
// session, its IO fails; rnbd-client remap opens it again with its data.
func TestServerCloseSticks(t *testing.T) {
	needTools(t, "qemu-io")
	m := mapVol(t, 8<<20, "sc", nil, []string{"--size-poll", "100ms"})
	srv, cl, uri := m.srv, m.cl, m.uri
	qemuIO(t, uri, "write -P 0x5c 1M 64k")
	state := func() string {
		recs := cl.records("device", "list")
		if len(recs) != 1 {
			t.Fatalf("device list: %v", recs)
		}
		return fmt.Sprint(recs[0]["state"])
	}
	srv.ok("device", "close", "vol", "--session", "sc")
	deadline := time.Now().Add(20 * time.Second)
	for state() != "closed by server" {
		if time.Now().After(deadline) {
			t.Fatalf("device state %q after the server closed it\n%s", state(), cl.out.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
	time.Sleep(time.Second) // ten size polls
	if st := state(); st != "closed by server" {
		t.Fatalf("state %q after ten size polls", st)
	}
	if recs := srv.records("device", "list"); len(recs) != 0 {
		for _, r := range recs {
			if r["sessname"] == "sc" {
				t.Fatalf("the server has the device open again for the session: %v", recs)
			}
		}
	}
	if out := qemuIOOut(t, uri, "read 1M 64k"); !strings.Contains(out, "read failed: Input/output error") {
		t.Fatalf("read of a device its server closed: %q", out)
	}
	if n := strings.Count(cl.out.String(), `msg="the server closed the device (its administrator`); n != 1 {
		t.Fatalf("the client said %d times that the server closed the device\n%s", n, cl.out.String())
	}
	cl.ok("remap", "rnbd0")
	if st := state(); st != "open" {
		t.Fatalf("state %q after remap", st)
	}
	qemuIO(t, uri, "read -P 0x5c 1M 64k", "write -P 0x5d 2M 64k", "read -P 0x5d 2M 64k")
}
