// What both daemons' session records say of a session's paths, summed
// path by path the same way.

package output

// PathSum sums a session's paths for its record: path_cnt,
// act_path_cnt, state, path_uu, rx_bytes, tx_bytes and inflights. Bytes
// received and sent are as the daemon sees them: a server receives the
// writes, a client the reads.
type PathSum struct {
	n, up    int
	uu       []byte
	rx, tx   uint64
	inflight int64
}

// Add counts a path: whether it is connected, the bytes it received and
// sent, its requests in flight.
func (s *PathSum) Add(connected bool, rx, tx uint64, inflight int64) {
	s.n++
	s.rx, s.tx, s.inflight = s.rx+rx, s.tx+tx, s.inflight+inflight
	if connected {
		s.up++
		s.uu = append(s.uu, 'U')
	} else {
		s.uu = append(s.uu, '_')
	}
}

// Fields sets the sum's fields in r, and returns it. A session is
// "connected" while one of its paths is.
func (s *PathSum) Fields(r Record) Record {
	state := "disconnected"
	if s.up > 0 {
		state = "connected"
	}
	r["path_cnt"], r["act_path_cnt"], r["state"], r["path_uu"] = s.n, s.up, state, string(s.uu)
	r["rx_bytes"], r["tx_bytes"], r["inflights"] = s.rx, s.tx, s.inflight
	return r
}
