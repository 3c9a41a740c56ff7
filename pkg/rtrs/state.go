package rtrs

import "fmt"

// PathState is the state of a client path, enum rtrs_clt_state.
type PathState int32

const (
	PathConnecting PathState = iota
	PathConnectingErr
	PathReconnecting
	PathConnected
	PathClosing
	PathClosed
	PathDead
)

var pathStateNames = [...]string{
	PathConnecting:    "CONNECTING",
	PathConnectingErr: "CONNECTING_ERR",
	PathReconnecting:  "RECONNECTING",
	PathConnected:     "CONNECTED",
	PathClosing:       "CLOSING",
	PathClosed:        "CLOSED",
	PathDead:          "DEAD",
}

func (s PathState) String() string {
	if s >= 0 && int(s) < len(pathStateNames) {
		return pathStateNames[s]
	}
	return fmt.Sprintf("PathState(%d)", int32(s))
}

// SysfsString is what the kernel's paths/<path>/state shows: "connected"
// for CONNECTED and "disconnected" for every other state.
func (s PathState) SysfsString() string {
	if s == PathConnected {
		return "connected"
	}
	return "disconnected"
}

// pathTransitionAllowed is the whole transition table of
// rtrs_clt_change_state: the states a path may enter each state from.
func pathTransitionAllowed(from, to PathState) bool {
	switch to {
	case PathConnecting:
		return from == PathReconnecting
	case PathReconnecting:
		return from == PathConnected || from == PathConnectingErr || from == PathClosed
	case PathConnected:
		return from == PathConnecting
	case PathConnectingErr:
		return from == PathConnecting
	case PathClosing:
		return from == PathConnecting || from == PathConnectingErr ||
			from == PathReconnecting || from == PathConnected
	case PathClosed:
		return from == PathClosing
	case PathDead:
		return from == PathClosed
	}
	return false
}

// SrvPathState is the state of a server path, enum rtrs_srv_state.
type SrvPathState int32

const (
	SrvPathConnecting SrvPathState = iota
	SrvPathConnected
	SrvPathClosing
	SrvPathClosed
)

var srvPathStateNames = [...]string{
	SrvPathConnecting: "CONNECTING",
	SrvPathConnected:  "CONNECTED",
	SrvPathClosing:    "CLOSING",
	SrvPathClosed:     "CLOSED",
}

func (s SrvPathState) String() string {
	if s >= 0 && int(s) < len(srvPathStateNames) {
		return srvPathStateNames[s]
	}
	return fmt.Sprintf("SrvPathState(%d)", int32(s))
}

// SysfsString is "connected" or "disconnected", as for client paths.
func (s SrvPathState) SysfsString() string {
	if s == SrvPathConnected {
		return "connected"
	}
	return "disconnected"
}

// srvTransitionAllowed is the table of rtrs_srv_change_state.
func srvTransitionAllowed(from, to SrvPathState) bool {
	switch to {
	case SrvPathConnected:
		return from == SrvPathConnecting
	case SrvPathClosing:
		return from == SrvPathConnecting || from == SrvPathConnected
	case SrvPathClosed:
		return from == SrvPathClosing
	}
	return false
}
