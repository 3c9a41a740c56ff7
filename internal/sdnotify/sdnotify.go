// Package sdnotify tells systemd about a Type=notify service's state
// (sd_notify(3)): READY=1 once it serves, STOPPING=1 when it shuts down.
package sdnotify

import (
	"net"
	"os"
)

// Ready and Stopping are the states the daemons send.
const (
	Ready    = "READY=1"
	Stopping = "STOPPING=1"
)

// Notify sends state to $NOTIFY_SOCKET. Without one (not run by systemd)
// it does nothing and reports false.
func Notify(state string) (bool, error) {
	path := os.Getenv("NOTIFY_SOCKET")
	if path == "" {
		return false, nil
	}
	if path[0] == '@' {
		path = "\x00" + path[1:] // abstract namespace
	}
	c, err := net.DialUnix("unixgram", nil, &net.UnixAddr{Name: path, Net: "unixgram"})
	if err != nil {
		return false, err
	}
	defer c.Close()
	if _, err := c.Write([]byte(state)); err != nil {
		return false, err
	}
	return true, nil
}
