package rtrs

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strconv"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
)

// Reconnecting a client path (rtrs_clt_reconnect_work and the sysfs
// reconnect): the backoff between attempts, max_reconnect_attempts,
// ctrl_loss_tmo counted from when the path went down, and the manual
// reconnect.

func (p *CltPath) reconnectDelay() time.Duration {
	cfg := &p.sess.cfg
	p.mu.Lock()
	n := p.reconnectAttempts
	p.mu.Unlock()
	d := p.sess.ReconnectDelay()
	limit := max(cfg.ReconnectMaxDelay, d)
	for i := 0; i < n && d < limit; i++ {
		d *= 2
	}
	d = min(d, limit)
	if cfg.ReconnectJitter > 0 {
		d += rand.N(cfg.ReconnectJitter)
	}
	return d
}

// wentDown notes when the path went down, unless it was already.
func (p *CltPath) wentDown() {
	p.mu.Lock()
	if p.downSince.IsZero() {
		p.downSince = time.Now()
	}
	p.mu.Unlock()
}

// lossLeft is the time ctrl_loss_tmo leaves the path to reconnect in
// (never below 0), and whether the session has a ctrl_loss_tmo.
func (p *CltPath) lossLeft() (time.Duration, bool) {
	tmo := p.sess.CtrlLossTmo()
	if tmo < 0 {
		return 0, false
	}
	p.mu.Lock()
	since := p.downSince
	p.mu.Unlock()
	if since.IsZero() {
		return tmo, true
	}
	return max(tmo-time.Since(since), 0), true
}

// CtrlLossIn is how long the path, down, has left to reconnect before it
// gives up (ctrl_loss_tmo after it went down; never below 0); ok is false
// while it is up, once it has given up, or when the session has no
// ctrl_loss_tmo.
func (p *CltPath) CtrlLossIn() (left time.Duration, ok bool) {
	switch p.State() {
	case CltPathConnected, CltPathClosed, CltPathDead:
		return 0, false
	}
	p.mu.Lock()
	down := !p.downSince.IsZero()
	p.mu.Unlock()
	if !down {
		return 0, false
	}
	return p.lossLeft()
}

// unscheduled notes that no reconnect attempt is scheduled.
func (p *CltPath) unscheduled() {
	p.mu.Lock()
	p.nextAttempt = time.Time{}
	p.mu.Unlock()
}

// ReconnectAttempts is how many reconnect attempts the path made since it
// was last connected (or since a manual reconnect), and how long until
// the next one; next is 0 when none is scheduled (connected, connecting
// now, or given up).
func (p *CltPath) ReconnectAttempts() (attempts int, next time.Duration) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.nextAttempt.IsZero() {
		next = max(time.Until(p.nextAttempt), time.Millisecond)
	}
	return max(p.reconnectAttempts, 0), next
}

// nextAttemptIn notes that the next reconnect attempt comes in d, and
// says so: which of how many it is ("of unlimited" for
// max_reconnect_attempts -1).
func (p *CltPath) nextAttemptIn(in time.Duration) {
	max := p.sess.MaxReconnectAttempts()
	left, bounded := p.lossLeft()
	p.mu.Lock()
	n := p.reconnectAttempts + 1
	// The timer's work gives up, and says so.
	last := (max >= 0 && n > max) || (bounded && left <= in)
	if !last {
		p.nextAttempt = time.Now().Add(in)
	}
	p.mu.Unlock()
	if last {
		return
	}
	of := "unlimited"
	if max >= 0 {
		of = strconv.Itoa(max)
	}
	p.lg().WithFields(log.Fields{"attempt": n, "max_reconnect_attempts": max, "in": in.Round(time.Millisecond).String()}).
		Infof("path %s: reconnect attempt %d of %s in %v", p.Name(), n, of, in.Round(time.Millisecond))
}

// reconnectWork is rtrs_clt_reconnect_work: give up once the attempts are
// spent, else try to establish the path again. It reports whether another
// attempt should be scheduled, and why the attempt failed.
func (p *CltPath) reconnectWork(ctx context.Context, manual bool) (bool, error) {
	if p.State() != CltPathReconnecting {
		return false, nil
	}
	max := p.sess.MaxReconnectAttempts()
	p.mu.Lock()
	giveUp := !manual && (p.reconnectAttempts < 0 || (max >= 0 && p.reconnectAttempts >= max))
	tmo := p.sess.CtrlLossTmo()
	lost := !manual && !giveUp && tmo >= 0 && !p.downSince.IsZero() && time.Since(p.downSince) >= tmo
	if !giveUp && !lost {
		p.reconnectAttempts++
	}
	p.mu.Unlock()
	if giveUp || lost {
		l := p.lg().WithField("max_reconnect_attempts", max)
		if lost {
			l = l.WithField("ctrl_loss_tmo", tmo.String())
		}
		l.Warn("giving up reconnecting; trigger a manual reconnect")
		p.closeConns()
		return false, nil
	}
	// The path may have failed again between the recovery that scheduled
	// this attempt and now (an error on a connection of the previous
	// attempt): whatever is left of it goes before a new one starts.
	p.stopAndDestroyConns()
	if !p.changeStateFromTo(CltPathReconnecting, CltPathConnecting) {
		return false, nil
	}
	err := p.initPath(ctx)
	if err == nil {
		return false, nil
	}
	if p.changeStateFromTo(CltPathConnectingErr, CltPathReconnecting) {
		p.stats.reconnFail.Add(1)
		p.lg().WithError(err).Warn("reconnect failed")
		return true, err
	}
	return false, err
}

// manualBusyRetries bounds how often a manual reconnect retries while the
// server still holds the path's previous connection: the server drops
// that one when it sees the new attempt, so the next try normally works.
const manualBusyRetries = 5

// reconnectCmd is rtrs_clt_reconnect_from_sysfs. ctx bounds the
// attempt (the connect timeout still applies within it); a path whose
// attempt it ended goes on reconnecting by itself.
func (p *CltPath) reconnectCmd(ctx context.Context) error {
	if err := ctx.Err(); err != nil { // it ended while the command waited
		return fmt.Errorf("rtrs: path reconnect not made: %w", err)
	}
	changed, old := p.changeStateGetOld(CltPathReconnecting)
	if !changed && old != CltPathReconnecting {
		return fmt.Errorf("rtrs: path is %v: %w", old, syscall.EBUSY)
	}
	if changed {
		p.mu.Lock()
		p.reconnectAttempts = 0
		p.downSince = time.Now() // a manual reconnect starts the clock again
		p.mu.Unlock()
		p.stopAndDestroyConns()
	}
	var last error
	for i := 0; ; i++ {
		retry, err := p.reconnectWork(ctx, true)
		last = err
		// EBUSY: the server still held the path's previous connection;
		// EAGAIN: it takes new paths from us no faster than its rate.
		if !retry || !(errors.Is(err, syscall.EBUSY) || errors.Is(err, syscall.EAGAIN)) || i == manualBusyRetries {
			break
		}
		t := time.NewTimer(min(p.sess.cfg.ReconnectDelay, 100*time.Millisecond) << i)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
		}
		if ctx.Err() != nil {
			break
		}
	}
	if p.State() != CltPathConnected {
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("rtrs: path did not reconnect (%v): %w", err, syscall.ENOTCONN)
		}
		if errors.Is(last, syscall.EAGAIN) {
			// Still refused for the server's rate: the caller may
			// ask again later (connectRetryBusy does).
			return fmt.Errorf("rtrs: path did not reconnect: %w: %w", last, syscall.ENOTCONN)
		}
		return fmt.Errorf("rtrs: path did not reconnect: %w", syscall.ENOTCONN)
	}
	return nil
}
