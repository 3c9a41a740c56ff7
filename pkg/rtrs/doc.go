// Package rtrs implements the RTRS transport (formerly IBTRS) of the Linux
// kernel's drivers/infiniband/ulp/rtrs in Go: client sessions made of paths,
// each path made of one service connection and several IO connections; a
// session-wide pool of permits (one permit is one server chunk); per-IO
// multipath (round-robin, min-inflight, min-latency); heartbeats; reconnect
// with bounded attempts; silent failover of in-flight requests; and the
// server side that owns the chunks and hands IO to its user.
//
// The protocol engine is written once against the reliable-connection
// contract of package fabric, so the same state machines, permits, failover
// and heartbeat run over the TCP fabric (fabric/tcp), the in-memory test
// fabric (fabric/fabrictest) and RDMA verbs.
//
// Wire structures and the immediate-data encoding live in proto.go and
// mirror drivers/infiniband/ulp/rtrs/rtrs-pri.h byte for byte.
package rtrs
