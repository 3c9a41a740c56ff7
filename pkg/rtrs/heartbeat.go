package rtrs

import (
	"sync"
	"sync/atomic"
	"time"
)

// heartbeat is the algorithm of rtrs.c hb_work, run by both sides on the
// service connection of a path: every interval, if more than missedMax
// ticks passed without traffic from the peer, the path is declared dead;
// otherwise a HB_MSG is sent when the previous one was answered (missed
// count zero) and the tick is counted. Any traffic from the peer resets
// the count (alive); a HB_ACK also measures the round trip (ack).
type heartbeat struct {
	interval  time.Duration
	missedMax int32
	epoch     time.Time

	// mu serializes ticks with start and stop, so stop returns only
	// when no tick is running.
	mu sync.Mutex
	// +checklocks:mu
	timer *time.Timer
	// +checklocks:mu
	running bool

	missed atomic.Int32
	// sent are the send times (ns since epoch) of the HB_MSGs not
	// answered yet, oldest first: HB_ACKs come back in order on the one
	// connection, so each ack is measured from its own message.
	sentMu sync.Mutex
	// +checklocks:sentMu
	sent [8]int64
	// +checklocks:sentMu
	nsent      int
	curLatency atomic.Int64 // ns, the last HB round trip

	send  func() error // post a HB_MSG
	onErr func()       // the peer is gone or the send failed

	// probeEvery and busy (the client's paths) make the heartbeat a
	// probe as well: every probeEvery, if requests wait on the path
	// (busy) and nothing came from the peer since the last look, a
	// HB_MSG goes out at once. A request can be lost with nothing of
	// ours unacknowledged on the wire — the peer's kernel took it, and
	// the answer died with the path —, and then TCP_USER_TIMEOUT (or
	// the RDMA QP's retries) has nothing to time out until the next
	// regular heartbeat, up to an interval later. The probe is
	// something to time out: a silent loss costs about the user
	// timeout plus one or two probe periods. A live peer answers it,
	// and traffic from the peer keeps it from being sent at all.
	probeEvery time.Duration
	busy       func() bool
	// +checklocks:mu
	probeTimer *time.Timer
	recvSeq    atomic.Uint64 // counts what came from the peer
	// +checklocks:mu
	probeSeen uint64 // recvSeq at the last probe tick; under mu
}

func (h *heartbeat) init(interval time.Duration, missedMax int, send func() error, onErr func()) {
	h.interval, h.missedMax = interval, int32(missedMax)
	h.epoch = time.Now()
	h.send, h.onErr = send, onErr
}

// start begins ticking; the first tick comes one interval after the path
// is up ("start hb after path_up").
func (h *heartbeat) start() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.missed.Store(0)
	h.sentMu.Lock()
	h.nsent = 0 // the old connection's messages get no answer
	h.sentMu.Unlock()
	h.running = true
	if h.timer == nil {
		h.timer = time.AfterFunc(h.interval, h.tick)
	} else {
		h.timer.Reset(h.interval)
	}
	if h.probeEvery > 0 {
		h.probeSeen = h.recvSeq.Load()
		if h.probeTimer == nil {
			h.probeTimer = time.AfterFunc(h.probeEvery, h.probeTick)
		} else {
			h.probeTimer.Reset(h.probeEvery)
		}
	}
}

// stop halts ticking and waits for a running tick.
func (h *heartbeat) stop() {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.running = false
	if h.timer != nil {
		h.timer.Stop()
	}
	if h.probeTimer != nil {
		h.probeTimer.Stop()
	}
	h.missed.Store(0)
}

// probeTick sends a HB_MSG now if requests wait and the peer has been
// silent for a probe period (see probeEvery).
func (h *heartbeat) probeTick() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.running {
		return
	}
	seq := h.recvSeq.Load()
	if seq == h.probeSeen && h.busy() {
		h.noteSent()
		if err := h.send(); err != nil {
			h.running = false
			h.onErr()
			return
		}
	}
	h.probeSeen = seq
	h.probeTimer.Reset(h.probeEvery)
}

func (h *heartbeat) tick() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if !h.running {
		return
	}
	if h.missed.Load() > h.missedMax {
		h.running = false
		h.onErr()
		return
	}
	if h.missed.Add(1) != 1 {
		h.timer.Reset(h.interval)
		return
	}
	h.noteSent()
	if err := h.send(); err != nil {
		h.running = false
		h.onErr()
		return
	}
	h.timer.Reset(h.interval)
}

// noteSent keeps the send time of a HB_MSG about to go out, for the
// HB_ACK that answers it. Past len(sent) unanswered the newest are not
// kept: their acks, if any come, are then measured from older sends
// (longer, never shorter, than they were: a slow path never looks fast).
func (h *heartbeat) noteSent() {
	h.sentMu.Lock()
	if h.nsent < len(h.sent) {
		h.sent[h.nsent] = int64(time.Since(h.epoch))
		h.nsent++
	}
	h.sentMu.Unlock()
}

// alive notes traffic from the peer.
func (h *heartbeat) alive() {
	h.missed.Store(0)
	h.recvSeq.Add(1)
}

// ack notes a HB_ACK: traffic, and a latency sample.
func (h *heartbeat) ack() {
	h.missed.Store(0)
	h.recvSeq.Add(1)
	h.sentMu.Lock()
	if h.nsent > 0 {
		h.curLatency.Store(int64(time.Since(h.epoch)) - h.sent[0])
		copy(h.sent[:], h.sent[1:h.nsent])
		h.nsent--
	}
	h.sentMu.Unlock()
}

// latency is the last measured heartbeat round trip.
func (h *heartbeat) latency() time.Duration { return time.Duration(h.curLatency.Load()) }
