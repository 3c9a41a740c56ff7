package rtrs

// Link events of a client session (enum rtrs_clt_link_ev): the count of
// connected paths, and DISCONNECTED / RECONNECTED when it reaches 0 / 1.

// CltLinkEvent is what a session tells its user about its paths as a
// whole (enum rtrs_clt_link_ev).
type CltLinkEvent int

const (
	// CltLinkReconnected: a path came up after all were down.
	CltLinkReconnected CltLinkEvent = iota
	// CltLinkDisconnected: the last connected path went down.
	CltLinkDisconnected
)

func (e CltLinkEvent) String() string {
	if e == CltLinkReconnected {
		return "RECONNECTED"
	}
	return "DISCONNECTED"
}

// pathUp counts a path that became connected and reports RECONNECTED when
// it is the first after all were down (rtrs_clt_path_up).
func (s *CltSession) pathUp() {
	s.pathEvent(+1, 1, CltLinkReconnected)
}

// pathDown reports DISCONNECTED when the last connected path went down.
func (s *CltSession) pathDown() { s.pathEvent(-1, 0, CltLinkDisconnected) }

// pathEvent counts a path going up or down and reports ev when the count
// reaches at. evMu is held across the count and the report, so the user
// sees DISCONNECTED and RECONNECTED in the order the paths changed.
func (s *CltSession) pathEvent(delta, at int, ev CltLinkEvent) {
	s.evMu.Lock()
	defer s.evMu.Unlock()
	s.mu.Lock()
	s.pathsUp += delta
	fire := s.opened && s.pathsUp == at
	s.mu.Unlock()
	if !fire {
		return
	}
	s.log.WithField("event", ev).Info("link event")
	if s.cfg.LinkEvent != nil && !s.closed.Load() {
		s.cfg.LinkEvent(ev)
	}
}
