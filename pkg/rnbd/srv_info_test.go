package rnbd

import (
	"context"
	"errors"
	"syscall"
	"testing"
)

func TestForceClose(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("a", 1<<20)
	r.file("b", 1<<20)
	c := r.client("fc")
	x := r.dev(c, "a", AccessRW)
	if err := x.write(0, []byte("x"), 0); err == nil {
		// 1 byte is not a multiple of the block: refused.
		t.Fatal("unaligned write accepted")
	}
	if n, err := r.srv.ForceClose("a", "fc"); n != 1 || err != nil {
		t.Fatalf("force close: %d %v", n, err)
	}
	if err := x.write(0, make([]byte, 512), 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after force close: %v, want ENOTCONN", err)
	}
	// The id stays reserved: another device does not get it.
	y := r.dev(c, "b", AccessRW)
	if y.d.Info().DeviceID == x.d.Info().DeviceID {
		t.Fatal("a force-closed device's id was reused")
	}
	if _, err := r.srv.ForceClose("a", "fc"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("second force close: %v", err)
	}
	// The writer count was released: "a" opens for writing again.
	if _, err := r.client("other").open(context.Background(), "a", AccessRW); err != nil {
		t.Fatalf("rw open after force close: %v", err)
	}
}
