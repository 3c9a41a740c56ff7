// Package blockdev is the operating system's block storage an RNBD
// server serves an export from: a regular file or a block device, with
// flush, FUA, discard and write-zeroes mapped exactly. The client's
// frontends are in pkg/frontend.
package blockdev
