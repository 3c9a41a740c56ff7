package rtrs

import (
	"context"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"runtime"
	"syscall"
	"testing"
	"time"
)

// pathsUpCount reads the session's count of connected paths.
func (s *CltSession) pathsUpCount() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.pathsUp
}

// A manual reconnect that runs between a path's failure (state
// RECONNECTING) and its goroutine's recovery must not build a new attempt
// on top of the old one: the request in flight on the old attempt is
// completed (ErrNoPath: there is no other path to fail over to), and the
// session counts the path once.
func TestReconnectInRecoveryWindow(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.77.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.77.0.2", srvAddr.String()))
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	p := r.sess.Paths()[0]
	release := r.disk.holdIO()
	wait, _ := r.inflight(1, 4096)
	kit.WaitFor(t, 5*time.Second, "request in flight", func() bool { return counters(p).Inflight == 1 })
	// What errorRecovery does before the path's goroutine sees recoverCh.
	if !p.changeStateFromTo(CltPathConnected, CltPathReconnecting) {
		t.Fatal("path was not connected")
	}
	// The server still holds the old path (its IO is held), so this
	// attempt may be refused with EBUSY; the path then keeps reconnecting.
	err := p.Reconnect(context.Background())
	release()
	if err != nil && !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("Reconnect: %v", err)
	}
	kit.WaitFor(t, 10*time.Second, "path reconnected", func() bool { return p.State() == CltPathConnected })
	done := make(chan []error, 1)
	go func() { done <- wait() }()
	select {
	case errs := <-done:
		if !errors.Is(errs[0], ErrNoPath) {
			t.Fatalf("request: %v, want ErrNoPath", errs[0])
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the request in flight on the replaced attempt was never completed")
	}
	if err := r.write(0, []byte("after")); err != nil {
		t.Fatalf("write after the reconnect: %v", err)
	}
	// The path counts itself up just after it turns CONNECTED (as the
	// kernel's rtrs_clt_path_up does): under load the write above can
	// come between the two. What must not happen is a count of two.
	kit.WaitFor(t, 5*time.Second, "the path counted up", func() bool { return r.sess.pathsUpCount() >= 1 })
	if n := r.sess.pathsUpCount(); n != 1 {
		t.Fatalf("one path connected, session counts %d", n)
	}
}

// A heartbeat-style failure racing an operator's reconnect leaves exactly
// one live attempt: the path ends CONNECTED and counted once.
func TestReconnectRacingErrorRecovery(t *testing.T) {
	_, fab := memNet()
	srvAddr := ap("10.78.0.1:1234")
	ccfg := testClientConfig(fab, pa("10.78.0.2", srvAddr.String()))
	ccfg.ReconnectDelay = 5 * time.Millisecond
	ccfg.ReconnectJitter = time.Millisecond
	r := newRig(t, fab, testServerConfig(fab, newMemDisk(1<<20), srvAddr), ccfg)
	p := r.sess.Paths()[0]
	for i := 0; i < 30; i++ {
		go p.errorRecovery(nil)
		for j := 0; j < i%4; j++ {
			runtime.Gosched()
		}
		p.Reconnect(context.Background()) // EBUSY or ENOTCONN are fine here
		kit.WaitFor(t, 10*time.Second, "path connected and counted once", func() bool {
			return p.State() == CltPathConnected && r.sess.pathsUpCount() == 1
		})
	}
	if _, err := r.read(0, 4096); err != nil {
		t.Fatalf("read after the races: %v", err)
	}
}

// Closing a session while a path is being added neither hangs nor leaves
// the new path running; an AddPath after Close fails with ErrClosed.
func TestCloseRacingAddPath(t *testing.T) {
	for i := 0; i < 20; i++ {
		_, fab := memNet()
		a1 := ap(fmt.Sprintf("10.79.%d.1:1234", i))
		a2 := ap(fmt.Sprintf("10.80.%d.1:1234", i))
		srv, err := NewServer(testServerConfig(fab, newMemDisk(1<<20), a1, a2))
		if err != nil {
			t.Fatal(err)
		}
		sess, err := DialSession(context.Background(), testClientConfig(fab, pa(fmt.Sprintf("10.79.%d.2", i), a1.String())))
		if err != nil {
			t.Fatal(err)
		}
		added := make(chan error, 1)
		go func() {
			_, err := sess.AddPath(context.Background(), pa(fmt.Sprintf("10.80.%d.2", i), a2.String()))
			added <- err
		}()
		for j := 0; j < i; j++ {
			runtime.Gosched()
		}
		closed := make(chan struct{})
		go func() { sess.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatalf("iteration %d: Session.Close hangs", i)
		}
		<-added
		if n := len(sess.Paths()); n != 0 {
			t.Fatalf("iteration %d: %d paths left after Close", i, n)
		}
		if _, err := sess.AddPath(context.Background(), pa("", a2.String())); !errors.Is(err, ErrClosed) {
			t.Fatalf("AddPath after Close: %v, want ErrClosed", err)
		}
		srv.Close()
	}
}

// Closing the server while a client connects never hangs.
func TestServerCloseRacingConnect(t *testing.T) {
	for i := 0; i < 40; i++ {
		_, fab := memNet()
		a1 := ap(fmt.Sprintf("10.81.%d.1:1234", i))
		srv, err := NewServer(testServerConfig(fab, newMemDisk(1<<20), a1))
		if err != nil {
			t.Fatal(err)
		}
		ccfg := testClientConfig(fab, pa(fmt.Sprintf("10.81.%d.2", i), a1.String()))
		ccfg.ConnsPerPath = 1
		opened := make(chan *CltSession, 1)
		go func() {
			s, _ := DialSession(context.Background(), ccfg)
			opened <- s
		}()
		for j := 0; j < i; j++ {
			runtime.Gosched()
		}
		closed := make(chan struct{})
		go func() { srv.Close(); close(closed) }()
		select {
		case <-closed:
		case <-time.After(10 * time.Second):
			t.Fatalf("iteration %d: Server.Close hangs", i)
		}
		if s := <-opened; s != nil {
			s.Close()
		}
		if n := len(srv.Sessions()); n != 0 {
			t.Fatalf("iteration %d: %d sessions left after Close", i, n)
		}
	}
}

// The server refuses a path whose chunks and connections would pass MaxChunkMemory, with
// ENOMEM, and takes one again once the memory is released.
func TestServerChunkMemoryBudget(t *testing.T) {
	_, fab := memNet()
	a1, a2 := ap("10.82.0.1:1234"), ap("10.82.1.1:1234")
	scfg := testServerConfig(fab, newMemDisk(1<<20), a1, a2)
	ccfg := testClientConfig(fab, pa("10.82.0.2", a1.String()))
	scfg.MaxChunkMemory, _ = pathFootprint(&scfg, nil, scfg.QueueDepth, scfg.MaxChunkSize, ccfg.ConnsPerPath+1) // one path
	r := newRig(t, fab, scfg, ccfg)
	_, err := r.sess.AddPath(context.Background(), pa("10.82.1.2", a2.String()))
	if !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("second path over the budget: %v, want ENOMEM", err)
	}
	if n := len(r.sess.Paths()); n != 1 {
		t.Fatalf("%d paths after the refused one, want 1", n)
	}
	// Another session's path is refused the same way.
	other := testClientConfig(fab, pa("10.82.1.2", a2.String()))
	other.SessName = "other"
	if _, err := DialSession(context.Background(), other); !errors.Is(err, syscall.ENOMEM) {
		t.Fatalf("second session over the budget: %v, want ENOMEM", err)
	}
	// Releasing the first path's memory lets a new one in.
	p := r.sess.Paths()[0]
	if err := p.Disconnect(); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "server path gone", func() bool { return len(r.srv.Sessions()) == 0 })
	if err := p.Reconnect(context.Background()); err != nil {
		t.Fatalf("reconnect after the memory was released: %v", err)
	}
	if _, err := r.read(0, 4096); err != nil {
		t.Fatal(err)
	}
}
