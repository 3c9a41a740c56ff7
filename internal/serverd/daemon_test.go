package serverd

import (
	"path/filepath"
	"testing"
	"time"
)

// A daemon stops once: a second Stop returns the first's result, and
// the export retry's goroutine is gone with the first.
func TestStopTwice(t *testing.T) {
	dir := t.TempDir()
	cfg := DefaultConfig()
	cfg.Listen = []string{"tcp://127.0.0.1:0"}
	cfg.ControlSocket = filepath.Join(dir, "s.sock")
	cfg.StateFile = filepath.Join(dir, "s.json")
	cfg.ExportRetry = Duration{Duration: 100 * time.Millisecond}
	d, err := Start(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	if err := d.Stop(); err != nil {
		t.Fatal(err)
	}
	select {
	case <-d.retryDone:
	default:
		t.Fatal("the export retry still runs after Stop")
	}
}
