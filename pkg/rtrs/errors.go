package rtrs

import (
	"errors"
	"fmt"
	"syscall"
)

// The package's errors: first those both sides use (the kernel keeps
// what both use in rtrs-pri.h), then the client's. Errors from the peer
// arrive as syscall.Errno.

// Errors of both sides.
var (
	// ErrClosed is returned after CltSession.Close, and for an answer
	// posted on a server connection that is closing.
	ErrClosed = errors.New("rtrs: session closed")
	// errPathDown: the path has no connection to post on.
	errPathDown = errors.New("rtrs: path not connected")
)

// Errors of the client side.
var (
	// ErrNoPath fails a request when no path is connected. It matches
	// ECONNABORTED, the kernel's error in that case.
	ErrNoPath = fmt.Errorf("rtrs: no connected path: %w", syscall.ECONNABORTED)
	// ErrMsgSize is returned for a request that does not fit the
	// server's chunk or header limits.
	ErrMsgSize = fmt.Errorf("rtrs: request too large: %w", syscall.EMSGSIZE)
	// ErrQueueDepthChanged is the reason a reconnect is refused when the
	// server's queue depth changed; the path then waits for a manual
	// reconnect, as the kernel does.
	ErrQueueDepthChanged = fmt.Errorf("rtrs: server queue depth changed: %w", syscall.ECONNRESET)
	// errInfoUnanswered: the path's connections went down while it
	// waited for INFO_RSP. INFO_REQ has no error answer: a server that
	// refuses the session's name closes the path.
	errInfoUnanswered = ErrInfoUnanswered
	// ErrInfoUnanswered is errInfoUnanswered, for a caller that knows why
	// (it closed a session of that name a moment ago, which the server
	// may not have seen go yet).
	ErrInfoUnanswered = fmt.Errorf("rtrs: the path went down before the server answered its INFO_REQ "+
		"(a server closes it so when it refuses a session name in use, or bound to another client's identity; its log says why): %w", syscall.ECONNRESET)
)

// ErrAbandoned is returned by Do when its context ended before the
// answer came: the request is still in flight.
var ErrAbandoned = errors.New("rtrs: request abandoned before its answer")
