// The storage nodes' error classes as the gRPC codes the CSI spec asks.

package csi

import (
	"errors"
	"fmt"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/rnbd/rnbd/internal/ctl"
)

// toStatus is err, from a storage node's admin API, as a gRPC status:
// what says the CO how to go on (retry later, give up, fix the request).
// what names the operation ("create volume pvc-1 on node-a").
func toStatus(err error, what string) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok && !isCtl(err) {
		return err
	}
	return status.Error(grpcCode(err), fmt.Sprintf("%s: %v", what, err))
}

// grpcCode is the gRPC code of an error class of the control API (a
// storage node's admin listener, the worker's rnbd-client).
func grpcCode(err error) codes.Code {
	switch ctl.Classify(err) {
	case ctl.CodeNotFound:
		return codes.NotFound
	case ctl.CodeExists:
		return codes.AlreadyExists
	case ctl.CodeBusy:
		// In use (a session has the volume open), or a change of it
		// under way on the storage node: not until that ends.
		return codes.FailedPrecondition
	case ctl.CodeInvalid:
		return codes.InvalidArgument
	case ctl.CodePermission:
		// A certificate or role refused: a configuration to fix, not a
		// retry.
		return codes.PermissionDenied
	case ctl.CodeUnavailable:
		return codes.Unavailable
	case ctl.CodeNotSupported:
		return codes.FailedPrecondition
	case ctl.CodeNoSpace:
		return codes.ResourceExhausted
	}
	return codes.Internal
}

func isCtl(err error) bool {
	var ce *ctl.Error
	return errors.As(err, &ce)
}

// isNotFound: the storage node answered not_found.
func isNotFound(err error) bool { return err != nil && ctl.Classify(err) == ctl.CodeNotFound }
