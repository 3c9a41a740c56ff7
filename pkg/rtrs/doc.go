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
//
// # Files
//
// The client is in clt_*.go (the kernel's rtrs-clt.c): the session
// (clt_sess.go), a path's state and goroutine (clt_path.go), its
// connections and completions (clt_conn.go), connecting and the INFO
// exchange (clt_info.go), reconnecting (clt_reconnect.go), tearing down
// (clt_teardown.go), permits, buffers, requests, batching, link events and
// configuration (clt_permit.go, clt_buffer.go, clt_request.go,
// clt_batch.go, clt_link.go, clt_config.go). The server is in srv*.go
// (rtrs-srv.c): srv.go, srv_config.go, srv_sess.go, srv_path.go,
// srv_conn.go, srv_op.go, srv_mem.go, srv_rate.go. What both sides use
// (rtrs.c, rtrs-pri.h): proto.go, wr.go, errors.go, heartbeat.go,
// state.go, stats.go, addr.go.
//
// # Lock order
//
// Outermost first; a lock is taken only while holding locks above it in
// its list, never below. Indented: the locks that are taken while holding
// the one above (the nestings the code has); the order between two locks
// that never nest is fixed all the same, so that a new nesting has one
// place to go.
//
// Client:
//
//	CltSession.evMu (pathEvent; the user's CltConfig.LinkEvent runs under it)
//	  CltSession.mu
//	CltSession.initMu (initResources)
//	  CltSession.regMu
//	    CltPath.submitMu (destroyRes, AllocBuffer and Buffer.Free through curRes)
//	heartbeat.mu (a path's heartbeat: tick and probeTick call send and onErr under it)
//	  CltPath.submitMu (sendHB through curRes, shared)
//	  CltPath.mu (onErr is errorRecovery)
//	  heartbeat.sentMu
//
// so, as one order: CltSession.evMu, CltSession.mu, CltSession.initMu,
// CltSession.regMu, heartbeat.mu, CltPath.submitMu, CltPath.mu,
// heartbeat.sentMu.
//
// Server:
//
//	Server.nameMu (claimName, NameHeld; the user's NameClaimer runs under it)
//	  SrvSession.mu (the other sessions' Name, then the claimant's)
//	  Server.mu (Sessions)
//	SrvSession.evMu (pathUp, pathDown; the user's LinkEvent runs under it)
//	  SrvSession.mu
//	heartbeat.mu (a path's heartbeat)
//	  SrvSession.mu (sendHB reads conns[0])
//	  srvConn.sendMu (postHB)
//	  SrvPath.stateMu (onErr is close)
//	  heartbeat.sentMu
//	SrvSession.mu (handleConnReq, allocPathLocked)
//	  Server.mu (putSession)
//	  rateLimiter.mu, Server.connectingMu, Server.memMu, chunkPool.mu
//	    rateLimiter.heldMu (allow holds an address)
//	SrvPath.stateMu (changeState)
//	  Server.connectingMu (doneConnecting)
//
// so, as one order: Server.nameMu, SrvSession.evMu, heartbeat.mu,
// SrvSession.mu, Server.mu, SrvPath.stateMu, srvConn.sendMu,
// rateLimiter.mu, rateLimiter.heldMu, Server.connectingMu, Server.memMu,
// chunkPool.mu, heartbeat.sentMu. SrvSession.acceptCond waits on
// SrvSession.mu. The listeners' accept loops (refuseAtAccept) take
// rateLimiter.heldMu alone.
//
// Below all of them: the locks of package fabric's connections, of
// pkg/tagpool (permits) and of pkg/log's limiters, none of which
// calls back into this package while held. The fabric contract this
// relies on: PostSend and PostRecv never call a Handler (fabric/tcp
// queues and wakes its writer), so CltPath.post holds submitMu (shared)
// and srvConn.post holds sendMu across them; Flush may deliver send
// completions and Disconnected, so it is called with no lock of this
// package held (Plug.Unplug, Burst's end); Conn.Close waits for the
// handlers, so it too is called with none held.
//
// User callbacks: Confirmer.Confirm and SrvHandler.HandleIO run with
// no lock of this package held. CltConfig.LinkEvent, SrvHandler's
// LinkEvent and NameClaimer.ClaimSessionName run under the locks named
// above: they may read the session (Name, Paths) but must not call what
// takes their own lock again (the client's path controls, Server.NameHeld
// from ClaimSessionName).
//
// Which fields each lock guards, and which functions run with it held,
// are +checklocks annotations on the fields and functions, checked by
// gVisor's checklocks analyzer in make vet; the order above is not.
//
// # Concurrency
//
// CltSession, CltPath, Server, SrvSession and SrvPath are safe for
// concurrent use, and so are CltPathStats and SrvPathStats (each counter is
// atomic; a Counters snapshot is not taken at one instant). A Permit
// belongs to the goroutine that took it until PutPermit, a SrvOp to the
// handler from HandleIO until its Respond; a Buffer's methods may be
// called from any goroutine, but its bytes are the user's to share. A
// Plug is used by one goroutine at a time, a Burst only by the completion
// goroutine that delivers it, during the call.
package rtrs
