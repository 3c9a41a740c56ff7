// Package kit holds the helpers that tests across the tree share: waiting
// for a state instead of sleeping, reading golden files, making sparse
// files, finding the RDMA device to test on, and recording what a
// component logs. Only tests import it (test/lint keeps it out of the
// binaries and libraries).
package kit

import (
	"encoding/hex"
	"net/netip"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/sirupsen/logrus"
	logtest "github.com/sirupsen/logrus/hooks/test"

	"github.com/rnbd/rnbd/pkg/log"
)

// WaitFor polls cond until it holds, failing t if d passes first. It
// polls often at first and then less (up to every 50 ms), so that a
// condition that holds soon is seen soon and an expensive one (a scrape
// of metrics) is not asked for in a loop.
func WaitFor(t testing.TB, d time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(d)
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(pause)
		pause = min(2*pause, 50*time.Millisecond)
	}
}

// Blocked reports whether a goroutine with fn on its stack is blocked in
// state, as a traceback names it ("select", "sync.Mutex.Lock",
// "IO wait", ...).
func Blocked(fn, state string) bool {
	buf := make([]byte, 1<<20)
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		head, _, _ := strings.Cut(g, "\n")
		if strings.Contains(head, " ["+state) && strings.Contains(g, fn) {
			return true
		}
	}
	return false
}

// WaitBlocked waits until a goroutine with fn on its stack is blocked in
// state (Blocked): a test that must act only once a goroutine waits —
// the wait being what it tests — waits for that, not for a while.
func WaitBlocked(t testing.TB, d time.Duration, fn, state string) {
	t.Helper()
	WaitFor(t, d, fn+" blocked in "+state, func() bool { return Blocked(fn, state) })
}

// GoldenHex reads testdata/golden/name.hex: bytes in hex, with blanks
// and '#' comments anywhere.
func GoldenHex(name string) ([]byte, error) {
	raw, err := os.ReadFile(filepath.Join("testdata", "golden", name+".hex"))
	if err != nil {
		return nil, err
	}
	var b strings.Builder
	for _, line := range strings.Split(string(raw), "\n") {
		if i := strings.IndexByte(line, '#'); i >= 0 {
			line = line[:i]
		}
		b.WriteString(strings.Join(strings.Fields(line), ""))
	}
	return hex.DecodeString(b.String())
}

// Golden is GoldenHex, failing t on an error.
func Golden(t testing.TB, name string) []byte {
	t.Helper()
	b, err := GoldenHex(name)
	if err != nil {
		t.Fatalf("golden %s: %v", name, err)
	}
	return b
}

// SparseFile makes a sparse file of size bytes at path.
func SparseFile(t testing.TB, path string, size int64) {
	t.Helper()
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
}

// RDMAAddr returns the address on an RDMA device that the tests of RDMA
// use, from RNBD_RDMA_ADDR (the VM tier sets it on rdma_rxe); without it
// the test skips.
func RDMAAddr(t testing.TB) netip.Addr {
	t.Helper()
	s := os.Getenv("RNBD_RDMA_ADDR")
	if s == "" {
		t.Skip("set RNBD_RDMA_ADDR to an address on an RDMA device (the VM tier runs these on rdma_rxe)")
	}
	return netip.MustParseAddr(s)
}

// LogRecorder returns an entry that records, at debug level and above,
// what is logged through it, and a function returning the records: for
// tests that assert what a component logs.
func LogRecorder() (*log.Entry, func() []*log.Entry) {
	l, hook := logtest.NewNullLogger()
	l.SetLevel(logrus.DebugLevel)
	return logrus.NewEntry(l), hook.AllEntries
}
