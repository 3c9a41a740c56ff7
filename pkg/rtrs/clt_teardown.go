package rtrs

import (
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Tearing a client path's connections down (rtrs_clt_close_conns,
// rtrs_clt_stop_and_destroy_conns): fence IO, close, fail over what was
// in flight, release the attempt's resources.

// closeConns is rtrs_clt_close_conns with wait: CLOSING, tear down, CLOSED.
func (p *CltPath) closeConns() {
	if ok, _ := p.changeStateGetOld(CltPathClosing); ok {
		p.stopAndDestroyConns()
		p.changeStateFromTo(CltPathClosing, CltPathClosed)
	}
}

// stopAndDestroyConns is rtrs_clt_stop_and_destroy_conns: fence IO, stop
// the heartbeat, close every connection (no completion can arrive after),
// fail over the requests that were in flight, and release the attempt.
func (p *CltPath) stopAndDestroyConns() {
	p.submitMu.Lock()
	res := p.res
	p.submitMu.Unlock()
	p.hb.stop()
	if res == nil {
		return
	}
	for i, c := range res.conns {
		c.qp.Close()
		if testHookConnClosed != nil {
			testHookConnClosed(i)
		}
	}
	var failed []*Permit
	for i := range res.reqs {
		if res.reqs[i].inUse.CompareAndSwap(true, false) {
			p.stats.inflight.Add(-1)
			failed = append(failed, &p.sess.permits[i])
		}
	}
	p.mu.Lock()
	wasUp := p.established
	p.established = false
	p.mu.Unlock()
	if wasUp {
		p.sess.pathDown()
	}
	if len(failed) > 0 {
		p.lg().WithField("requests", len(failed)).Info("failing over requests in flight")
	}
	for _, pm := range failed {
		p.sess.failover(p, pm)
	}
	p.destroyRes(res)
}

// testHookConnClosed, when set by a test, runs after stopAndDestroyConns
// closed connection i of a path.
var testHookConnClosed func(i int)

// destroyRes releases what an attempt set up; its connections must be
// closed or never started.
func (p *CltPath) destroyRes(res *pathRes) {
	for _, c := range res.conns {
		c.qp.Close()
	}
	p.sess.regMu.Lock()
	// Unpublish the attempt before its registrations go, so a region
	// registered or deregistered concurrently no longer finds it.
	p.submitMu.Lock()
	if p.res == res {
		p.res = nil
	}
	p.submitMu.Unlock()
	for _, mr := range *res.mrs.Load() {
		if mr != nil {
			mr.Close()
		}
	}
	empty := []fabric.MR{}
	res.mrs.Store(&empty)
	p.sess.regMu.Unlock()
	for _, c := range res.conns {
		c.freeIUs()
	}
	if res.infoMR != nil {
		res.infoMR.Close()
	}
	if res.infoMem != nil {
		res.infoMem.Free()
	}
	res.pd.Close()
}
