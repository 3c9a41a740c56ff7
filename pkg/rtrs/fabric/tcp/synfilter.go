// The SYN filter: a classic BPF program on a listening socket that drops
// the packets of the peers its screen keeps refusing, so that their SYNs
// cost the kernel the program and no more — no SYN-ACK, no place in the
// listen backlog, no accept, no answer — until their refusal ends.

package tcp

import (
	"net/netip"
	"slices"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// synFilterAfter is how many connections of one address a listener
// refuses at accept within one refusal before it has the kernel drop the
// address's SYNs for the rest of it: a client that asks again now and
// then is answered (EAGAIN, and it retries); one that keeps coming is no
// longer heard, and its connects wait for the kernel's SYN
// retransmissions, a second and more each.
const synFilterAfter = 8

// synFilterMax bounds the addresses in the program: an IPv6 one takes 9
// of the kernel's 4096 instructions. Past it the others are refused at
// accept only.
const synFilterMax = 256

// synFilter keeps the program of a hostListener. The accept loop reports
// the refusals (refused); a goroutine of its own builds and attaches the
// program, and takes the addresses out as their refusals end. Lock
// order: mu is a leaf.
type synFilter struct {
	rc   syscall.RawConn // the listening socket's
	wake chan struct{}   // cap 1: the addresses to drop changed
	done chan struct{}
	once sync.Once // starts run
	wg   sync.WaitGroup
	// attached: a program was attached once. The connections accepted
	// since are clones of the listening socket and carry the program
	// as it was then: they detach it, so that their packets do not run
	// it.
	attached atomic.Bool

	mu sync.Mutex
	// +checklocks:mu
	after int // synFilterAfter; tests change it
	// +checklocks:mu
	refusals map[netip.Addr]*refusal
	// +checklocks:mu
	swept time.Time
	// +checklocks:mu
	closed bool
}

// refusal is what a listener knows of an address it refused at accept.
type refusal struct {
	until   time.Time // when the refusal ends, as the screen said
	count   int       // connections refused at accept since it began
	dropped bool      // in the program
}

func newSYNFilter(rc syscall.RawConn) *synFilter {
	return &synFilter{rc: rc, after: synFilterAfter, wake: make(chan struct{}, 1), done: make(chan struct{}),
		refusals: make(map[netip.Addr]*refusal)}
}

// refused notes a connection from a that the listener refused at accept,
// refused for d more. It allocates only for an address it did not know,
// and does not wait for the program to change.
func (f *synFilter) refused(a netip.Addr, d time.Duration) {
	a = a.Unmap().WithZone("")
	now := time.Now()
	f.mu.Lock()
	if f.closed {
		f.mu.Unlock()
		return
	}
	if len(f.refusals) >= 1024 && now.Sub(f.swept) > time.Second {
		f.swept = now
		for k, r := range f.refusals {
			if !r.dropped && !now.Before(r.until) {
				delete(f.refusals, k)
			}
		}
	}
	r := f.refusals[a]
	if r == nil {
		r = &refusal{}
		f.refusals[a] = r
	}
	if !now.Before(r.until) && !r.dropped {
		r.count = 0 // a refusal before this one
	}
	r.until = now.Add(d)
	r.count++
	drop := !r.dropped && r.count >= f.after
	if drop {
		r.dropped = true
	}
	f.mu.Unlock()
	if drop {
		f.once.Do(func() {
			f.wg.Add(1)
			go f.run()
		})
		select {
		case f.wake <- struct{}{}:
		default:
		}
	}
}

// close stops the goroutine; the program stays with the socket, which the
// caller closes.
func (f *synFilter) close() {
	f.mu.Lock()
	was := f.closed
	f.closed = true
	f.mu.Unlock()
	if was {
		return
	}
	f.once.Do(func() {}) // none starts after this
	close(f.done)
	f.wg.Wait()
}

// run keeps the program as refusals begin and end.
func (f *synFilter) run() {
	defer f.wg.Done()
	var installed []netip.Addr
	t := time.NewTimer(time.Hour)
	defer t.Stop()
	for {
		addrs, next := f.dropping()
		if !slices.Equal(addrs, installed) {
			if err := f.attach(addrs); err == nil {
				installed = addrs
			}
		}
		wait := time.Hour // until a refusal at accept wakes it
		if !next.IsZero() {
			wait = time.Until(next)
		}
		t.Reset(wait)
		select {
		case <-f.wake:
		case <-t.C:
		case <-f.done:
			return
		}
	}
}

// dropping are the addresses whose refusals go on, whose SYNs the program
// is to drop (at most synFilterMax, in order), and when the first of
// those refusals ends; it forgets the refusals that ended.
func (f *synFilter) dropping() ([]netip.Addr, time.Time) {
	now := time.Now()
	f.mu.Lock()
	defer f.mu.Unlock()
	var addrs []netip.Addr
	var next time.Time
	for a, r := range f.refusals {
		if !now.Before(r.until) {
			delete(f.refusals, a)
			continue
		}
		if r.dropped {
			addrs = append(addrs, a)
			if next.IsZero() || r.until.Before(next) {
				next = r.until
			}
		}
	}
	slices.SortFunc(addrs, netip.Addr.Compare)
	if len(addrs) > synFilterMax {
		addrs = addrs[:synFilterMax]
	}
	return addrs, next
}

// attach puts the program that drops addrs on the socket, or takes the
// program off if there are none.
func (f *synFilter) attach(addrs []netip.Addr) error {
	var serr error
	err := f.rc.Control(func(fd uintptr) {
		if len(addrs) == 0 {
			serr = unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DETACH_FILTER, 0)
			return
		}
		prog := synProgram(addrs)
		serr = unix.SetsockoptSockFprog(int(fd), unix.SOL_SOCKET, unix.SO_ATTACH_FILTER,
			&unix.SockFprog{Len: uint16(len(prog)), Filter: &prog[0]})
		if serr == nil {
			f.attached.Store(true)
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// detach takes the program a connection accepted from a listening socket
// with one inherited off it (the clone of the socket takes its program
// along); nothing if the listener never had one.
func (f *synFilter) detach(fd uintptr) {
	if f.attached.Load() {
		unix.SetsockoptInt(int(fd), unix.SOL_SOCKET, unix.SO_DETACH_FILTER, 0) // ENOENT: it took none
	}
}

// The program's instructions (linux/filter.h): packets are read from
// their network header (SKF_NET_OFF), IPv4 or IPv6 (an IPv6 socket takes
// both).
const (
	skfNetOff = -0x100000
	bpfLdB    = unix.BPF_LD | unix.BPF_B | unix.BPF_ABS
	bpfLdW    = unix.BPF_LD | unix.BPF_W | unix.BPF_ABS
	bpfRsh    = unix.BPF_ALU | unix.BPF_RSH | unix.BPF_K
	bpfJeq    = unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K
	bpfJa     = unix.BPF_JMP | unix.BPF_JA
	bpfRet    = unix.BPF_RET | unix.BPF_K
	bpfKeep   = 0xffffffff // the whole packet
	bpfDrop   = 0
)

// netOff is the offset of a packet's network header byte off.
func netOff(off int32) uint32 { return uint32(skfNetOff + off) }

// synProgram drops the packets whose source is one of addrs and keeps
// every other:
//
//	ldb [net+0]; rsh #4           the IP version
//	jeq #4, 0, 1; ja v4
//	jeq #6, 0, 1; ja v6
//	ret #keep
//	v4: ld [net+12]; then per address: jeq #a, 0, 1; ret #0; last: ret #keep
//	v6: per address, its four words at net+8..20 (a mismatch skips to the
//	    next address); ret #0; last: ret #keep
func synProgram(addrs []netip.Addr) []unix.SockFilter {
	var v4, v6 []unix.SockFilter
	v4 = append(v4, unix.SockFilter{Code: bpfLdW, K: netOff(12)})
	for _, a := range addrs {
		if a = a.Unmap(); a.Is4() {
			b := a.As4()
			v4 = append(v4, unix.SockFilter{Code: bpfJeq, Jf: 1, K: be32(b[:])}, unix.SockFilter{Code: bpfRet, K: bpfDrop})
			continue
		}
		b := a.As16()
		for w := 0; w < 4; w++ {
			v6 = append(v6, unix.SockFilter{Code: bpfLdW, K: netOff(8 + 4*int32(w))},
				unix.SockFilter{Code: bpfJeq, Jf: uint8(7 - 2*w), K: be32(b[4*w:])})
		}
		v6 = append(v6, unix.SockFilter{Code: bpfRet, K: bpfDrop})
	}
	v4 = append(v4, unix.SockFilter{Code: bpfRet, K: bpfKeep})
	v6 = append(v6, unix.SockFilter{Code: bpfRet, K: bpfKeep})
	p := []unix.SockFilter{
		{Code: bpfLdB, K: netOff(0)},
		{Code: bpfRsh, K: 4},
		{Code: bpfJeq, Jf: 1, K: 4},
		{Code: bpfJa, K: 3}, // to v4, past the 3 below
		{Code: bpfJeq, Jf: 1, K: 6},
		{Code: bpfJa, K: uint32(1 + len(v4))}, // to v6, past the ret and v4
		{Code: bpfRet, K: bpfKeep},
	}
	return append(append(p, v4...), v6...)
}

// be32 is the big-endian word at b, as the program's loads read one.
func be32(b []byte) uint32 {
	return uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
}
