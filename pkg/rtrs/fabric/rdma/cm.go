// rdma_cm events and parameters: waiting for an event under a context,
// the errno an unwanted one stands for, and the connection parameters
// both sides use. It is what fabric/tcp's handshake.go stands in for.

package rdma

import (
	"context"
	"fmt"
	"syscall"

	"github.com/rnbd/rnbd/pkg/ibverbs"
)

// event waits for ch's next event, or ctx; ctx interrupts the channel.
func event(ctx context.Context, ch *ibverbs.EventChannel) (ibverbs.CMEvent, error) {
	stop := context.AfterFunc(ctx, ch.Interrupt)
	ev, err := ch.Next()
	stop()
	if err != nil && ctx.Err() != nil {
		return ev, ctx.Err()
	}
	return ev, err
}

// expect waits for the event want; any other is the error it means.
func expect(ctx context.Context, ch *ibverbs.EventChannel, want ibverbs.EventType) (ibverbs.CMEvent, error) {
	ev, err := event(ctx, ch)
	if err != nil {
		return ev, err
	}
	if ev.Type != want {
		return ev, fmt.Errorf("rdma fabric: waiting for %v: %v (status %d): %w", want, ev.Type, ev.Status, cmErrno(ev))
	}
	return ev, nil
}

// cmErrno is the errno an unwanted CM event stands for.
func cmErrno(ev ibverbs.CMEvent) error {
	if ev.Status < 0 {
		return syscall.Errno(-ev.Status)
	}
	switch ev.Type {
	case ibverbs.EventAddrError, ibverbs.EventRouteError:
		return syscall.EHOSTUNREACH
	case ibverbs.EventUnreachable:
		return syscall.ENETUNREACH
	case ibverbs.EventRejected:
		return syscall.ECONNREFUSED
	case ibverbs.EventDeviceRemoval:
		return syscall.ENODEV
	}
	return syscall.ECONNRESET
}

// connParam is what both sides of RTRS use (rtrs-clt/rtrs-srv): no RDMA
// reads, retries as the kernel's (7: RNR retries for ever).
func connParam(priv []byte) ibverbs.ConnParam {
	return ibverbs.ConnParam{PrivateData: priv, RetryCount: 7, RNRRetryCount: 7}
}
