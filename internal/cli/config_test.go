package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"syscall"
	"testing"

	"github.com/rnbd/rnbd/internal/ctl"
)

// TestCheckReport: config check's errors are one error, every message on
// a line of its own, with the exit code of the worst class: the file
// wrong (2) over a file missing (3) over one unreadable (7) over what
// this host cannot do (8).
func TestCheckReport(t *testing.T) {
	missing := fmt.Errorf("tls: ca: %w", &fs.PathError{Op: "open", Path: "/etc/rnbd/tls/ca.crt", Err: syscall.ENOENT})
	unreadable := fmt.Errorf("tls: key: %w", &fs.PathError{Op: "open", Path: "/etc/rnbd/tls/server.key", Err: syscall.EACCES})
	noRDMA := ctl.Errorf(ctl.CodeNotSupported, "listen rdma://10.0.0.5: no RDMA device")
	wrong := errors.New("queue_depth must be at least 1") // a validation's: no class of its own
	for _, c := range []struct {
		errs []error
		exit int
	}{
		{nil, 0},
		{[]error{noRDMA}, 8},
		{[]error{noRDMA, unreadable}, 7},
		{[]error{noRDMA, unreadable, missing}, 3},
		{[]error{noRDMA, missing, wrong, unreadable}, 2},
	} {
		err := CheckReport(c.errs)
		if got := ctl.ExitCode(err); got != c.exit {
			t.Errorf("%v: exit %d, want %d", c.errs, got, c.exit)
		}
		if err != nil && err.Error() != errors.Join(c.errs...).Error() {
			t.Errorf("%q, want every message on a line", err)
		}
	}
}
