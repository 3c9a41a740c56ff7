// Package api is the control API of both daemons as types: every route
// with the right it needs (routes_srv.go, routes_clt.go), the requests
// and the records each answers (srv.go, clt.go), and typed clients of
// the two daemons (client_srv.go, client_clt.go) over package ctl's
// transport. The daemons register their handlers from the route tables,
// the command lines and rnbd-csi call through the types, so a renamed
// field or path is a compile error, not a zero read at run time
// (docs/control-api.md is the reference; a test holds its tables to
// these).
//
// Floors: api uses ctl (the transport: HTTP over a unix socket or TLS,
// the error classes, roles and rights); the daemons (internal/serverd,
// internal/clientd), the command lines (cmd/…) and rnbd-csi use api.
//
// Files:
//
//	route.go        Route: a method, a path pattern, the right it needs
//	routes_srv.go   rnbd-server's routes, in the order docs/control-api.md lists them
//	routes_clt.go   rnbd-client's routes
//	srv.go          rnbd-server's requests, answers and records
//	clt.go          rnbd-client's requests, answers and records
//	fields.go       a record type's field names, from its JSON tags; Grants
//	client_srv.go   Server: a typed client of a storage node's API
//	client_clt.go   Client: a typed client of an rnbd-client daemon's API
package api
