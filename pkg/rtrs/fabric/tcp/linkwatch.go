package tcp

import (
	"encoding/binary"
	"fmt"
	"net"
	"net/netip"
	"sync"
	"syscall"

	"github.com/mdlayher/netlink"
	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/log"
)

// linkWatch fails a dialled connection at once when the interface its
// local address is on goes down — taken down, its carrier lost, or
// removed — so that its requests fail over to another path within
// milliseconds. TCP itself keeps such a connection until
// TCP_USER_TIMEOUT (1 s) runs out, as it does for a silent loss
// anywhere else on the path, which still waits for that timer. It
// listens to the kernel's link notifications (rtnetlink, RTMGRP_LINK)
// while it has connections to watch, in the process's network namespace.
type linkWatch struct {
	log *log.Entry

	mu sync.Mutex // guards the fields below
	// +checklocks:mu
	byIndex map[int]map[*conn]struct{}
	// +checklocks:mu
	nl *netlink.Conn // nil while no connection is watched
	wg sync.WaitGroup
}

// interfaceOf is the index and name of the interface that has a, or 0
// for the loopback interface (which never goes down by itself) and an
// address no interface has (an in-memory network's).
func interfaceOf(a netip.Addr) (int, string) {
	a = a.Unmap()
	if !a.IsValid() || a.IsLoopback() {
		return 0, ""
	}
	ifs, err := net.Interfaces()
	if err != nil {
		return 0, ""
	}
	for _, ifc := range ifs {
		if ifc.Flags&net.FlagLoopback != 0 {
			continue
		}
		addrs, err := ifc.Addrs()
		if err != nil {
			continue
		}
		for _, ad := range addrs {
			if n, ok := ad.(*net.IPNet); ok {
				if ip, ok := netip.AddrFromSlice(n.IP); ok && ip.Unmap() == a {
					return ifc.Index, ifc.Name
				}
			}
		}
	}
	return 0, ""
}

// add watches c's interface. If it is down already, c fails at once.
func (w *linkWatch) add(c *conn) {
	idx, name := interfaceOf(c.local.Addr())
	if idx == 0 {
		return
	}
	w.mu.Lock()
	if w.nl == nil {
		nl, err := netlink.Dial(unix.NETLINK_ROUTE, &netlink.Config{Groups: unix.RTMGRP_LINK})
		if err != nil {
			w.mu.Unlock()
			w.log.WithError(err).Warn("tcp fabric: cannot follow the links (rtnetlink): a link that goes down fails its paths by TCP_USER_TIMEOUT only")
			return
		}
		w.nl = nl
		w.byIndex = make(map[int]map[*conn]struct{})
		w.wg.Add(1)
		go w.run(nl)
	}
	if w.byIndex[idx] == nil {
		w.byIndex[idx] = make(map[*conn]struct{})
	}
	w.byIndex[idx][c] = struct{}{}
	c.watchIdx, c.watchName = idx, name
	w.mu.Unlock()
	if c.closed.Load() {
		w.remove(c) // it failed before it was watched: fail could not
		return
	}
	// Down before the subscription saw it: no event will come.
	if ifc, err := net.InterfaceByIndex(idx); err != nil || ifc.Flags&net.FlagUp == 0 || ifc.Flags&net.FlagRunning == 0 {
		c.fail(linkDownErr(name, c.local))
	}
}

// remove stops watching c; the last one stops the subscription.
func (w *linkWatch) remove(c *conn) {
	w.mu.Lock()
	set := w.byIndex[c.watchIdx]
	if _, ok := set[c]; !ok {
		w.mu.Unlock()
		return
	}
	delete(set, c)
	if len(set) == 0 {
		delete(w.byIndex, c.watchIdx)
	}
	var nl *netlink.Conn
	if len(w.byIndex) == 0 {
		nl, w.nl = w.nl, nil
	}
	w.mu.Unlock()
	if nl != nil {
		nl.Close() // ends run's Receive
	}
}

// run fails the connections of every interface the kernel says went
// down, until nl is closed.
func (w *linkWatch) run(nl *netlink.Conn) {
	defer w.wg.Done()
	for {
		msgs, err := nl.Receive()
		if err != nil {
			return // closed (or the socket failed: TCP's timers remain)
		}
		for _, m := range msgs {
			idx, down := linkDown(uint16(m.Header.Type), m.Data)
			if !down {
				continue
			}
			w.mu.Lock()
			var conns []*conn
			for c := range w.byIndex[idx] {
				conns = append(conns, c)
			}
			w.mu.Unlock()
			for _, c := range conns {
				c.fail(linkDownErr(c.watchName, c.local))
			}
		}
	}
}

// linkDown reads a link notification (its type and its ifinfomsg): the
// interface's index, and whether it is down — removed, not up, or not
// running (no carrier: the kernel's operational state).
func linkDown(typ uint16, data []byte) (idx int, down bool) {
	if (typ != unix.RTM_NEWLINK && typ != unix.RTM_DELLINK) || len(data) < unix.SizeofIfInfomsg {
		return 0, false
	}
	idx = int(int32(binary.NativeEndian.Uint32(data[4:8])))
	flags := binary.NativeEndian.Uint32(data[8:12])
	return idx, typ == unix.RTM_DELLINK || flags&unix.IFF_UP == 0 || flags&unix.IFF_RUNNING == 0
}

func linkDownErr(name string, local netip.AddrPort) error {
	return fmt.Errorf("tcp fabric: link %s of %v is down: %w", name, local.Addr(), syscall.ENETDOWN)
}
