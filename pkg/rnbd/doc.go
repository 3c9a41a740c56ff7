// Package rnbd implements the RNBD protocol of the Linux kernel's
// drivers/block/rnbd on top of an RTRS session: the messages (proto.go),
// the server side — exports, dev_search_path, access modes, force close,
// and IO run on a blockdev backend straight from the RTRS chunk — and the
// client side that maps remote devices.
//
// It knows nothing of NBD or ublk: the client side hands requests to and
// from whatever frontend uses it.
package rnbd
