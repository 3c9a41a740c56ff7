package clientd

import (
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/api"
)

func TestParseDevIndex(t *testing.T) {
	for _, tc := range []struct {
		path string
		nbd  int
		ublk int
	}{
		{"/dev/nbd0", 0, -1},
		{"/dev/nbd17", 17, -1},
		{"/dev/ublkb3", -1, 3},
		{"/dev/ublkc3", -1, -1},
		{"/dev/nbd", -1, -1},
		{"/dev/nbd1p2", -1, -1},
		{"/dev/nbd-1", -1, -1},
		{"", -1, -1},
		{"nbd0", -1, -1},
	} {
		if got := parseKernelIndex(tc.path); got != tc.nbd {
			t.Errorf("parseKernelIndex(%q) = %d, want %d", tc.path, got, tc.nbd)
		}
		if got := parseUblkIndex(tc.path); got != tc.ublk {
			t.Errorf("parseUblkIndex(%q) = %d, want %d", tc.path, got, tc.ublk)
		}
	}
}

// The cookie names the session and device: stable across restarts,
// different for another mapping.
func TestUblkCookie(t *testing.T) {
	a := ublkCookie(backendID(api.Mapping{SessName: "s", DevicePath: "d"}))
	if a != ublkCookie("rnbd:s/d") || a == 0 {
		t.Fatalf("cookie %#x", a)
	}
	if a == ublkCookie(backendID(api.Mapping{SessName: "s", DevicePath: "e"})) ||
		a == ublkCookie(backendID(api.Mapping{SessName: "t", DevicePath: "d"})) {
		t.Fatal("different mappings share a cookie")
	}
}

func TestNBDIOTimeout(t *testing.T) {
	c := DefaultConfig()
	// 120s no_path_timeout + 5s × (5+1) heartbeats + 10s.
	if got := c.nbdIOTimeout(); got != 160*time.Second {
		t.Errorf("default: %v", got)
	}
	c.NoPathTimeout.Duration = 0
	c.HBInterval.Duration, c.HBMissedMax = time.Second, 3
	if got := c.nbdIOTimeout(); got != 30*time.Second {
		t.Errorf("never below the kernel's 30s: %v", got)
	}
	c.NBDIOTimeout.Duration = 7 * time.Second
	if got := c.nbdIOTimeout(); got != 7*time.Second {
		t.Errorf("explicit: %v", got)
	}
}
