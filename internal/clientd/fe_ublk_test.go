package clientd

import (
	"errors"
	"syscall"
	"testing"

	"github.com/rnbd/rnbd/pkg/frontend/ublk"
)

// TestUblkUnsupportedOp: an op the device does not do fails with
// EOPNOTSUPP, the errno the ublk frontend gives the kernel (not EIO).
func TestUblkUnsupportedOp(t *testing.T) {
	b := newUblkBackend(nil)
	var got error
	called := false
	b.Submit(&ublk.Request{Op: ublk.OpWriteSame}, func(_ *ublk.Request, err error) { called, got = true, err })
	if !called || !errors.Is(got, syscall.EOPNOTSUPP) {
		t.Fatalf("WRITE_SAME: done called %v with %v, want EOPNOTSUPP", called, got)
	}
	var errno syscall.Errno
	if !errors.As(got, &errno) || errno != syscall.EOPNOTSUPP {
		t.Fatalf("WRITE_SAME: the errno found is %v, want EOPNOTSUPP", errno)
	}
}
