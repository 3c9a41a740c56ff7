package rtrs_test

import (
	"context"
	"log"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// The examples are what docs/rtrs.md shows, compiled with the package's
// tests so that they keep up with the API. They have no Output: they
// need a server to talk to, and are not run.

// confirmer is told the outcome of one request.
type confirmer chan error

func (c confirmer) Confirm(err error) { c <- err }

// Dial a session of one path over TCP, send one write, and wait for its
// answer.
func Example() {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName = "client1@server1"
	cfg.Fabric = tcp.New(tcp.Options{})
	p, err := rtrs.ParsePathAddr("ip:10.0.0.2@ip:10.0.0.1", rtrs.DefaultPort)
	if err != nil {
		log.Fatal(err)
	}
	cfg.Paths = []rtrs.PathAddr{p}
	sess, err := rtrs.DialSession(ctx, cfg) // every path connected (cfg.OpenAnyPath: one)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()

	buf, err := sess.AllocBuffer(1 << 20) // registered memory for data
	if err != nil {
		log.Fatal(err)
	}
	defer buf.Free()
	copy(buf.Bytes(), "hello")
	permit, err := sess.GetPermit(ctx, rtrs.IOCon)
	if err != nil {
		log.Fatal(err)
	}
	usrHeader := []byte("the user's message")
	done := make(confirmer, 1)
	if err := sess.Request(rtrs.Write, permit, done, usrHeader, buf, 0, 4096); err != nil {
		// Not sent (rtrs.ErrNoPath: no path is connected): done is
		// not told.
		sess.PutPermit(permit)
		log.Fatal(err)
	}
	// nil, a syscall.Errno from the server, or rtrs.ErrNoPath when the
	// last path went with the request.
	err = <-done
	sess.PutPermit(permit) // only after the answer
	if err != nil {
		log.Fatal(err)
	}
}

// Open waits for every path of cfg; with OpenAnyPath it returns once
// one is connected and the others keep trying.
func ExampleDialSession() {
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName = "client1@server1"
	cfg.Fabric = tcp.New(tcp.Options{})
	for _, s := range []string{"ip:10.0.0.2@ip:10.0.0.1", "ip:10.0.1.2@ip:10.0.1.1"} {
		p, err := rtrs.ParsePathAddr(s, rtrs.DefaultPort)
		if err != nil {
			log.Fatal(err)
		}
		cfg.Paths = append(cfg.Paths, p)
	}
	cfg.OpenAnyPath = true
	sess, err := rtrs.DialSession(context.Background(), cfg)
	if err != nil {
		log.Fatal(err)
	}
	defer sess.Close()
	for _, p := range sess.Paths() {
		log.Printf("%s: %v", p.Name(), p.State())
	}
}

// GetPermit waits for a free permit (a server chunk) until ctx ends or
// the session closes; TryGetPermit does not wait.
func ExampleCltSession_GetPermit() {
	var sess *rtrs.CltSession // from rtrs.DialSession
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	permit, err := sess.GetPermit(ctx, rtrs.IOCon)
	if err != nil {
		log.Fatal(err) // ctx's error, or rtrs.ErrClosed
	}
	defer sess.PutPermit(permit)
	log.Printf("chunk %d", permit.ID())
}

// Request sends a read: the server writes n bytes of answer into
// buf[off:] before it confirms.
func ExampleCltSession_Request() {
	var sess *rtrs.CltSession // from rtrs.DialSession
	buf, err := sess.AllocBuffer(4096)
	if err != nil {
		log.Fatal(err)
	}
	defer buf.Free()
	permit := sess.TryGetPermit(rtrs.IOCon)
	if permit == nil {
		log.Fatal("all permits in use")
	}
	done := make(confirmer, 1)
	if err := sess.Request(rtrs.Read, permit, done, []byte("read 4 KiB at 0"), buf, 0, 4096); err != nil {
		sess.PutPermit(permit)
		log.Fatal(err)
	}
	err = <-done
	sess.PutPermit(permit)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("%q", buf.Bytes()[:16])
}
