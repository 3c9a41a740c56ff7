// Package blockdev is the operating system's block storage: on the server
// side the backends an export is served from (a regular file or a block
// device, with flush, FUA, discard and write-zeroes mapped exactly), and on
// the client side the frontends a mapped device is offered through (NBD,
// kernel NBD attach, ublk).
package blockdev
