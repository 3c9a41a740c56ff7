package clientd

import (
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

// TestQueueLimitsWrittenOnce: a device's max_sectors_kb is set to one
// NBD buffer's worth (within the driver's max_hw_sectors_kb), and a
// device that has it already — one taken back after a restart — is not
// written again: every write of a queue attribute freezes the queue,
// which after a crash waits for requests stranded on the dead sockets.
func TestQueueLimitsWrittenOnce(t *testing.T) {
	sys := t.TempDir()
	q := filepath.Join(sys, "nbd3", "queue")
	if err := os.MkdirAll(q, 0o755); err != nil {
		t.Fatal(err)
	}
	want := strconv.Itoa(slotSize >> 10 / 2) // the driver allows less than a buffer
	os.WriteFile(filepath.Join(q, "max_hw_sectors_kb"), []byte(want+"\n"), 0o644)
	kb := filepath.Join(q, "max_sectors_kb")
	os.WriteFile(kb, []byte("128\n"), 0o644)
	d := &Daemon{log: log.Discard(), sysBlock: sys}
	d.setQueueLimits(&nbdFE{index: 3})
	if b, _ := os.ReadFile(kb); string(b) != want {
		t.Fatalf("max_sectors_kb %q, want the driver's %s", b, want)
	}
	// As sysfs shows it, with its newline; the write's time kept in the
	// past, so that another write would show.
	os.WriteFile(kb, []byte(want+"\n"), 0o644)
	old := time.Now().Add(-time.Hour).Truncate(time.Second)
	os.Chtimes(kb, old, old)
	d.setQueueLimits(&nbdFE{index: 3})
	if st, err := os.Stat(kb); err != nil || !st.ModTime().Equal(old) {
		t.Fatalf("max_sectors_kb written again though it had the value (%v)", err)
	}
}
