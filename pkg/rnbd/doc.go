// Package rnbd implements the RNBD protocol of the Linux kernel's
// drivers/block/rnbd on top of an RTRS session: the messages (proto.go),
// the server side — exports, dev_search_path, access modes, force close,
// and IO run on a blockdev backend straight from the RTRS chunk — and the
// client side that maps remote devices.
//
// It knows nothing of NBD or ublk: the client side hands requests to and
// from whatever frontend uses it.
//
// Lock order, from outermost to innermost: a lock may be taken while one
// above it in its list is held, never the other way round.
//
// The server (srv*.go):
//
//	SrvSession.mu      a session's devices, their ids, its opens under way
//	  Server.ownMu     session names bound to identities (an OPEN binds)
//	  Server.mu        exports, sessions, devices, resizes under way
//	    device.mu      a backing store: its writers, sessions, health
//	      SrvSessDev.mu  a session's device: whether it is closing
//	    hold.mu        a hold of a store's writes: the writes it keeps
//	Server.shrinkMu    shrinks seen behind the server's back
//
// SrvSession.mu is never taken while Server.mu is held: what needs both
// snapshots the sessions (Server.Sessions) first. SrvSessDev.mu is
// taken under SrvSession.mu too (an IO's reference), without the locks
// between. Server.ownMu, SrvSessDev.mu, hold.mu and Server.shrinkMu are leaves:
// nothing is taken while one of them is held.
//
// The client (clt*.go):
//
//	CltDev.resizeMu        held across the OnResize callback
//	  CltSession.adminMu   one admin message at a time, across its round trip
//	    CltDev.ioMu        the device's id, state and open number; held
//	                       shared while an IO posts to RTRS
//	CltSession.mu          the session's devices, whether it is closed
//	waitQueue.mu           a device's IO that waits for it (CltDev.wait)
//
// What the OnResize callback locks comes inside CltDev.resizeMu.
// CltSession.mu and waitQueue.mu are leaves: nothing is taken while one
// of them is held, and they may be taken under any of the others.
//
// Beside other packages: RTRS holds its session's evMu across a link
// event (Server.LinkEvent, the client session's), so it comes before
// every lock the event takes. The locks that calls into rtrs, blockdev
// and log take come after every lock held at the call.
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations on the fields and functions, checked by
// gVisor's checklocks analyzer in make vet; the order above is not.
package rnbd
