package rtrs

import "fmt"

// CltPathState is the state of a client path, enum rtrs_clt_state.
type CltPathState int32

const (
	CltPathConnecting CltPathState = iota
	CltPathConnectingErr
	CltPathReconnecting
	CltPathConnected
	CltPathClosing
	CltPathClosed
	CltPathDead
)

var pathStateNames = [...]string{
	CltPathConnecting:    "CONNECTING",
	CltPathConnectingErr: "CONNECTING_ERR",
	CltPathReconnecting:  "RECONNECTING",
	CltPathConnected:     "CONNECTED",
	CltPathClosing:       "CLOSING",
	CltPathClosed:        "CLOSED",
	CltPathDead:          "DEAD",
}

func (s CltPathState) String() string {
	if s >= 0 && int(s) < len(pathStateNames) {
		return pathStateNames[s]
	}
	return fmt.Sprintf("CltPathState(%d)", int32(s))
}

// SysfsString is what the kernel's paths/<path>/state shows: "connected"
// for CONNECTED and "disconnected" for every other state.
func (s CltPathState) SysfsString() string {
	if s == CltPathConnected {
		return "connected"
	}
	return "disconnected"
}

// pathTransitionAllowed is the whole transition table of
// rtrs_clt_change_state: the states a path may enter each state from.
func pathTransitionAllowed(from, to CltPathState) bool {
	switch to {
	case CltPathConnecting:
		return from == CltPathReconnecting
	case CltPathReconnecting:
		return from == CltPathConnected || from == CltPathConnectingErr || from == CltPathClosed
	case CltPathConnected:
		return from == CltPathConnecting
	case CltPathConnectingErr:
		return from == CltPathConnecting
	case CltPathClosing:
		return from == CltPathConnecting || from == CltPathConnectingErr ||
			from == CltPathReconnecting || from == CltPathConnected
	case CltPathClosed:
		return from == CltPathClosing
	case CltPathDead:
		return from == CltPathClosed
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
