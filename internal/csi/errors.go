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
	var c codes.Code
	switch ctl.Classify(err) {
	case ctl.CodeNotFound:
		c = codes.NotFound
	case ctl.CodeExists:
		c = codes.AlreadyExists
	case ctl.CodeBusy:
		// In use (a session has the volume open), or a change of it
		// under way on the storage node: not until that ends.
		c = codes.FailedPrecondition
	case ctl.CodeInvalid:
		c = codes.InvalidArgument
	case ctl.CodePermission:
		// The storage node refused the controller's certificate or
		// role: a configuration to fix, not a retry.
		c = codes.PermissionDenied
	case ctl.CodeUnavailable:
		c = codes.Unavailable
	case ctl.CodeNotSupported:
		c = codes.FailedPrecondition
	case ctl.CodeNoSpace:
		c = codes.ResourceExhausted
	default:
		c = codes.Internal
	}
	return status.Error(c, fmt.Sprintf("%s: %v", what, err))
}

func isCtl(err error) bool {
	var ce *ctl.Error
	return errors.As(err, &ce)
}

// isNotFound: the storage node answered not_found.
func isNotFound(err error) bool { return err != nil && ctl.Classify(err) == ctl.CodeNotFound }
