package e2e

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

// TestQuickStartDemo runs the README's first command (make demo's script)
// as a newcomer would, and has it unmap and stop at the end.
func TestQuickStartDemo(t *testing.T) {
	if _, err := exec.LookPath("qemu-io"); err != nil {
		t.Skip("qemu-io (qemu-utils) not installed")
	}
	dir := t.TempDir()
	cmd := exec.Command("bash", "../../scripts/demo.sh")
	cmd.Env = append(os.Environ(), "RNBD_BIN="+binDir, "DEMO_DIR="+dir, "DEMO_STOP=1")
	done := make(chan struct{})
	timer := time.AfterFunc(2*time.Minute, func() {
		select {
		case <-done:
		default:
			cmd.Process.Kill()
		}
	})
	out, err := cmd.CombinedOutput()
	close(done)
	timer.Stop()
	if err != nil {
		t.Fatalf("demo: %v\n%s", err, out)
	}
	for _, want := range []string{"exported", "mapped demo0 as rnbd0", "read it back: identical", "unmapped and stopped"} {
		if !strings.Contains(string(out), want) {
			t.Fatalf("demo output lacks %q:\n%s", want, out)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "pids")); !os.IsNotExist(err) {
		t.Fatalf("the demo left its daemons' pid file: %v", err)
	}
}
