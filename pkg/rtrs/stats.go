package rtrs

import (
	"fmt"
	"math/bits"
	"strings"
	"sync/atomic"
	"time"
)

// Dir is the direction of an IO: READ moves data from server to client.
type Dir uint8

const (
	Read Dir = iota
	Write
)

func (d Dir) String() string {
	if d == Read {
		return "read"
	}
	return "write"
}

// latBuckets is the number of log2 latency buckets: bucket i counts IOs that
// took less than 2^i microseconds (i = 0 .. latBuckets-2), the last counts
// the rest. 2^26 µs is about 67 s.
const latBuckets = 28

// latHist is a log2 latency histogram per direction (stats/rdma_lat's),
// with the largest and the sum of what it counted.
type latHist struct {
	lat    [2][latBuckets]atomic.Uint64
	latMax [2]atomic.Int64  // ns
	latSum [2]atomic.Uint64 // ns
}

func (h *latHist) observeLatency(d Dir, lat time.Duration) {
	us := uint64(lat / time.Microsecond)
	b := bits.Len64(us)
	if b >= latBuckets {
		b = latBuckets - 1
	}
	h.lat[d][b].Add(1)
	h.latSum[d].Add(uint64(lat))
	for {
		m := h.latMax[d].Load()
		if int64(lat) <= m || h.latMax[d].CompareAndSwap(m, int64(lat)) {
			break
		}
	}
}

// Latency returns the buckets for direction d: counts[i], i < len-1, is
// the requests that took less than 2^i µs (and at least 2^(i-1)), the
// last those that took longer; and the sum of all their latencies.
func (h *latHist) Latency(d Dir) (counts []uint64, sum time.Duration) {
	counts = make([]uint64, latBuckets)
	for i := range counts {
		counts[i] = h.lat[d][i].Load()
	}
	return counts, time.Duration(h.latSum[d].Load())
}

// ResetLatency clears the histogram.
func (h *latHist) ResetLatency() {
	for d := range h.lat {
		for i := range h.lat[d] {
			h.lat[d][i].Store(0)
		}
		h.latMax[d].Store(0)
		h.latSum[d].Store(0)
	}
}

// CltPathStats are a client path's counters, in the kernel's stats/ formats.
// All methods are safe for concurrent use.
type CltPathStats struct {
	rdCnt, rdBytes atomic.Uint64
	wrCnt, wrBytes atomic.Uint64
	inflight       atomic.Int64
	// failoverCnt counts the requests failed over to this path from a
	// failed one, as the kernel's failover_cnt does (it counts on the
	// path that took them); failedOver counts this path's requests that
	// went to another when it failed.
	failoverCnt atomic.Uint64
	failedOver  atomic.Uint64
	// reconnSucc starts at -1: the first connection makes it 0, as
	// rtrs_clt_init_stats arranges.
	reconnSucc atomic.Int64
	reconnFail atomic.Int64
	latHist    // from posting a request to its answer
}

func newPathStats() *CltPathStats {
	s := &CltPathStats{}
	s.reconnSucc.Store(-1)
	return s
}

// update counts a request of usr+data bytes as it is posted, as
// rtrs_clt_update_all_stats does.
func (s *CltPathStats) update(d Dir, size int) {
	if d == Read {
		s.rdCnt.Add(1)
		s.rdBytes.Add(uint64(size))
	} else {
		s.wrCnt.Add(1)
		s.wrBytes.Add(uint64(size))
	}
	s.inflight.Add(1)
}

// RDMA is stats/rdma: "rd_cnt rd_bytes wr_cnt wr_bytes inflight failover_cnt".
func (s *CltPathStats) RDMA() string {
	return fmt.Sprintf("%d %d %d %d %d %d\n", s.rdCnt.Load(), s.rdBytes.Load(),
		s.wrCnt.Load(), s.wrBytes.Load(), s.inflight.Load(), s.failoverCnt.Load())
}

// Reconnects is stats/reconnects: "successful failed".
func (s *CltPathStats) Reconnects() string {
	return fmt.Sprintf("%d %d\n", s.reconnSucc.Load(), s.reconnFail.Load())
}

// Counters returns the numbers behind RDMA and Reconnects.
func (s *CltPathStats) Counters() StatsCounters {
	return StatsCounters{
		ReadCount: s.rdCnt.Load(), ReadBytes: s.rdBytes.Load(),
		WriteCount: s.wrCnt.Load(), WriteBytes: s.wrBytes.Load(),
		Inflight: s.inflight.Load(), FailoverCount: s.failoverCnt.Load(), FailedOverCount: s.failedOver.Load(),
		ReconnectsSuccessful: s.reconnSucc.Load(), ReconnectsFailed: s.reconnFail.Load(),
	}
}

// StatsCounters is a snapshot of a path's counters.
type StatsCounters struct {
	ReadCount, ReadBytes   uint64
	WriteCount, WriteBytes uint64
	Inflight               int64
	// FailoverCount is stats/rdma's failover_cnt: requests of a failed
	// path that this one took over (the kernel counts them here).
	FailoverCount uint64
	// FailedOverCount is this path's requests that failed over to
	// another path when it failed (rnbd_client_path_failovers_total).
	FailedOverCount      uint64
	ReconnectsSuccessful int64
	ReconnectsFailed     int64
}

// LatencyHist is stats/rdma_lat, the seed documentation's log2 histogram,
// in microseconds: one line per bucket "<2^i> us: <reads> <writes>", then
// ">= <2^26> us" and "maximum us".
func (s *CltPathStats) LatencyHist() string {
	var b strings.Builder
	for i := 0; i < latBuckets-1; i++ {
		fmt.Fprintf(&b, "%d us: %d %d\n", uint64(1)<<i, s.lat[Read][i].Load(), s.lat[Write][i].Load())
	}
	fmt.Fprintf(&b, ">= %d us: %d %d\n", uint64(1)<<(latBuckets-2),
		s.lat[Read][latBuckets-1].Load(), s.lat[Write][latBuckets-1].Load())
	fmt.Fprintf(&b, "maximum us: %d %d\n", s.latMax[Read].Load()/1000, s.latMax[Write].Load()/1000)
	return b.String()
}

// ResetRDMA clears stats/rdma except inflight, which tracks live requests.
func (s *CltPathStats) ResetRDMA() {
	s.rdCnt.Store(0)
	s.rdBytes.Store(0)
	s.wrCnt.Store(0)
	s.wrBytes.Store(0)
	s.failoverCnt.Store(0)
	s.failedOver.Store(0)
}

// ResetReconnects clears stats/reconnects.
func (s *CltPathStats) ResetReconnects() {
	s.reconnSucc.Store(0)
	s.reconnFail.Store(0)
}

// ResetAll is stats/reset_all. Unlike the kernel it keeps inflight, which
// counts requests still on the wire and would go negative if cleared.
func (s *CltPathStats) ResetAll() {
	s.ResetRDMA()
	s.ResetReconnects()
	s.ResetLatency()
}

// SrvPathStats are a server path's counters: stats/rdma in the newest
// kernels' four-value format, plus the in-flight count the older format had.
// All methods are safe for concurrent use.
type SrvPathStats struct {
	rdCnt, rdBytes atomic.Uint64
	wrCnt, wrBytes atomic.Uint64
	inflight       atomic.Int64
	latHist        // from a request's arrival to its answer being posted
}

func (s *SrvPathStats) update(d Dir, size int) {
	if d == Read {
		s.rdCnt.Add(1)
		s.rdBytes.Add(uint64(size))
	} else {
		s.wrCnt.Add(1)
		s.wrBytes.Add(uint64(size))
	}
}

// RDMA is stats/rdma of a server path: "rd_cnt rd_bytes wr_cnt wr_bytes".
func (s *SrvPathStats) RDMA() string {
	return fmt.Sprintf("%d %d %d %d\n", s.rdCnt.Load(), s.rdBytes.Load(), s.wrCnt.Load(), s.wrBytes.Load())
}

// Inflight is the number of IOs handed to the user and not yet answered.
func (s *SrvPathStats) Inflight() int64 { return s.inflight.Load() }

// Counters returns the numbers behind RDMA.
func (s *SrvPathStats) Counters() StatsCounters {
	return StatsCounters{
		ReadCount: s.rdCnt.Load(), ReadBytes: s.rdBytes.Load(),
		WriteCount: s.wrCnt.Load(), WriteBytes: s.wrBytes.Load(),
		Inflight: s.inflight.Load(),
	}
}

// Reset clears the counters except inflight.
func (s *SrvPathStats) Reset() {
	s.rdCnt.Store(0)
	s.rdBytes.Store(0)
	s.wrCnt.Store(0)
	s.wrBytes.Store(0)
	s.ResetLatency()
}
