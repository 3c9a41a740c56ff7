package rtrs

// Link events of a client session (enum rtrs_clt_link_ev): the count of
// connected paths, and DISCONNECTED / RECONNECTED when it reaches 0 / 1.

// ClientLinkEvent is what a session tells its user about its paths as a
// whole (enum rtrs_clt_link_ev).
type ClientLinkEvent int

const (
	// LinkReconnected: a path came up after all were down.
	LinkReconnected ClientLinkEvent = iota
	// LinkDisconnected: the last connected path went down.
	LinkDisconnected
)

func (e ClientLinkEvent) String() string {
	if e == LinkReconnected {
		return "RECONNECTED"
	}
	return "DISCONNECTED"
}

// pathUp counts a path that became connected and reports RECONNECTED when
// it is the first after all were down (rtrs_clt_path_up).
func (s *CltSession) pathUp() {
	s.pathEvent(+1, 1, LinkReconnected)
}

// pathDown reports DISCONNECTED when the last connected path went down.
func (s *CltSession) pathDown() { s.pathEvent(-1, 0, LinkDisconnected) }

// pathEvent counts a path going up or down and reports ev when the count
// reaches at. evMu is held across the count and the report, so the user
// sees DISCONNECTED and RECONNECTED in the order the paths changed.
func (s *CltSession) pathEvent(delta, at int, ev ClientLinkEvent) {
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
