package rnbd

import (
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/rnbd/rnbd/pkg/blockdev"
)

// The health checks of the open backends: what can happen to a backing
// store behind the server's back (a file deleted, replaced or shrunk, a
// mount that does not answer) is looked for every HealthInterval, logged
// when it changes, and shown with the device.

// healthLoop checks the open backends every interval until Close.
func (s *Server) healthLoop(interval time.Duration) {
	defer s.wg.Done()
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-s.done:
			return
		case <-t.C:
			s.checkHealth()
		}
	}
}

// checkHealth starts, for each open device, a check that logs a problem
// that appeared or went away since the last one. Each check runs in a
// goroutine of its own, on a descriptor of its own (blockdev.HealthCheck):
// a stat on a mount that stopped answering holds neither the checks of
// the other devices nor the close of its own. A device whose check from
// an earlier round has not returned is not checked again; that it hangs
// is the problem reported. Close does not wait for the checks: one may
// wait on a dead mount for ever (it holds a descriptor and a thread, and
// logs when it returns).
func (s *Server) checkHealth() {
	s.mu.Lock()
	devs := make([]*device, 0, len(s.devices))
	for _, d := range s.devices {
		devs = append(devs, d)
	}
	s.mu.Unlock()
	for _, dev := range devs {
		dev.mu.Lock()
		if since := dev.checking; !since.IsZero() {
			dev.mu.Unlock()
			s.noteHealth(dev, fmt.Errorf("blockdev: %s: no answer to its health check since %s (a mount that does not answer?)",
				dev.path, since.Format(time.RFC3339)))
			continue
		}
		var held *SrvSessDev
		for _, d := range dev.sessDevs {
			d.mu.Lock()
			if !d.closing {
				d.refs.Add(1) // as an IO does: the backend stays open
				held = d
			}
			d.mu.Unlock()
			if held != nil {
				break
			}
		}
		if held == nil {
			dev.mu.Unlock()
			continue
		}
		hc, err := held.backend.NewHealthCheck()
		held.refs.Done()
		if err == nil {
			dev.checking = time.Now()
		}
		dev.mu.Unlock()
		if err != nil {
			s.noteHealth(dev, err)
			continue
		}
		go func() {
			err := hc.Run()
			dev.mu.Lock()
			dev.checking = time.Time{}
			shrunk := dev.shrunk
			dev.mu.Unlock()
			var se *blockdev.ShrinkError
			if errors.As(err, &se) || shrunk {
				// The file's backends refuse IO past its end
				// from now on, or serve it again. What they
				// find is the later look: a shrink healed
				// since (a resize --force) is not one.
				if perr, ok := s.pollSizes(dev); ok && se != nil {
					err = perr
				}
			}
			s.noteHealth(dev, err)
		}()
	}
}

// pollSizes polls the size of every backend open on dev (PollSize) and
// returns the first shrink one found, nil if none; ok if one answered.
func (s *Server) pollSizes(dev *device) (shrink error, ok bool) {
	var held []*SrvSessDev
	dev.mu.Lock()
	for _, d := range dev.sessDevs {
		if d.ref() {
			held = append(held, d)
		}
	}
	dev.mu.Unlock()
	for _, d := range held {
		_, _, err := d.backend.PollSize()
		d.refs.Done()
		var se *blockdev.ShrinkError
		switch {
		case err == nil:
			ok = true
		case errors.As(err, &se):
			ok = true
			if shrink == nil {
				shrink = err
			}
		}
	}
	return shrink, ok
}

// noteHealth records a device's health check and logs a change.
func (s *Server) noteHealth(dev *device, err error) { s.note(dev, err, false) }

// noteSize records what a look at a device's size found: a shrink
// behind the server's back (a *blockdev.ShrinkError, as the health check
// finds it), or nil, which ends a shrink recorded and nothing else (it
// looked at the size only).
func (s *Server) noteSize(dev *device, err error) { s.note(dev, err, true) }

// note records a finding about a device's backing store and logs a
// change, once: a shrink is counted. With sizeOnly the finding is about
// its size only, and replaces no other problem.
func (s *Server) note(dev *device, err error, sizeOnly bool) {
	msg := ""
	if err != nil {
		msg = err.Error()
	}
	var se *blockdev.ShrinkError
	shrink := errors.As(err, &se)
	dev.mu.Lock()
	if sizeOnly && dev.problem != "" && !dev.shrunk {
		dev.mu.Unlock() // deleted, replaced, no answer: the health check's to say
		return
	}
	changed := msg != dev.problem
	dev.problem, dev.shrunk = msg, shrink
	var names []string
	if changed && shrink {
		for _, d := range dev.sessDevs {
			if n := d.devName(); !slices.Contains(names, n) {
				names = append(names, n)
			}
		}
	}
	dev.mu.Unlock()
	if len(names) > 0 {
		s.shrinkMu.Lock()
		for _, n := range names {
			s.shrinks[n]++
		}
		s.shrinkMu.Unlock()
	}
	switch {
	case changed && err != nil:
		s.log.WithField("path", dev.path).WithError(err).Error("backing store changed behind the server")
	case changed:
		s.log.WithField("path", dev.path).Info("backing store healthy again")
	}
}

// BackingShrinks counts the shrinks of backing files seen behind the
// server's back since it started, by device name: the export's, or the
// name under the search path.
func (s *Server) BackingShrinks() map[string]uint64 {
	s.shrinkMu.Lock()
	defer s.shrinkMu.Unlock()
	out := make(map[string]uint64, len(s.shrinks))
	for n, c := range s.shrinks {
		out[n] = c
	}
	return out
}

// backingProblem is what was last found wrong with the device's backing
// store, "" if nothing.
func (d *SrvSessDev) backingProblem() string {
	if d.dev == nil {
		return ""
	}
	d.dev.mu.Lock()
	defer d.dev.mu.Unlock()
	return d.dev.problem
}
