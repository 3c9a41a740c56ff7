package e2e

import (
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/history"
	"github.com/rnbd/rnbd/test/kit"
)

// pairMember is a member of the mirror over two kernels' rnbd_servers
// (RNBD_KERNEL_PAIR, set by the VM tier's interop part): its device on
// a kernel's rnbd_server and the commands that cut its path silently
// (the client's address of it taken away) and mend it.
type pairMember struct {
	Path       string `json:"path"` // ip:CLIENT@ip:SERVER
	DevicePath string `json:"device_path"`
	Port       int    `json:"port"`
	Cut        string `json:"cut"`
	Mend       string `json:"mend"`
	Witness    bool   `json:"witness"`
}

// kernelPair is TestMirrorOnKernelPair's mirror: kernelMirror's IO and
// history over the members' kernels; its faults are path cuts.
type kernelPair struct {
	*kernelMirror
	members []pairMember
	cut     []bool
	maps    int    // maps made: each gets sessions of new names
	as      string // the frontend maps make: ublk, or nbd for the crash
}

// TestMirrorOnKernelPair is a fault schedule of the mirror over two
// kernels' rnbd_servers: the VM tier's guest and its peer (test/vm/run.sh
// VM_PEER), leg 1 on the guest's kernel, leg 2 on the peer's, the
// witness on the guest's; the wire to them is the kernel's own RTRS over
// soft-RoCE. Seeded rounds of reads and writes (O_DIRECT on /dev/ublkbN,
// every read judged by the history checker) around silent path cuts of
// one member, or two (the mirror then loses its quorum: IO fails, and it
// is mapped again once they are back), mended in random order; then the
// client daemon killed (-9) with writes in flight and started again
// (crash: mapped as /dev/nbdN for it); then the stale-only-leg case: a
// leg cut while writes are acknowledged without it, the mirror unmapped,
// the other leg and the witness cut, that leg alone back — the map must
// refuse. At the end every member is back, the
// mirror in sync, every block reads as the history allows and the legs'
// data is equal. RNBD_KERNEL_PAIR_SEED picks the seed (default 1; printed
// on failure).
func TestMirrorOnKernelPair(t *testing.T) {
	cfg := os.Getenv("RNBD_KERNEL_PAIR")
	if cfg == "" {
		t.Skip("needs two kernels' rnbd_servers: the VM tier's interop part sets RNBD_KERNEL_PAIR")
	}
	var members []pairMember
	if err := json.Unmarshal([]byte(cfg), &members); err != nil || len(members) != 3 || !members[2].Witness {
		t.Fatalf("RNBD_KERNEL_PAIR: want two legs and a witness: %v", err)
	}
	seed := uint64(1)
	if v := os.Getenv("RNBD_KERNEL_PAIR_SEED"); v != "" {
		fmt.Sscan(v, &seed)
	}
	rng := rand.New(rand.NewPCG(seed, 0x6b7061))
	// The kernel's nbd driver sends a request stranded on a dead socket
	// (crash) again after its timeout, derived from no_path_timeout
	// (over 2 minutes by default, longer than kioBound): 30 s is safe
	// here, where no request waits in the daemon that long (a leg is
	// fenced in a second, and a mirror without its quorum fails IO).
	k := &kernelMirror{t: t, dir: t.TempDir(), h: history.New(0), start: time.Now(),
		clientArgs: []string{"--nbd-io-timeout", "30s"}}
	p := &kernelPair{kernelMirror: k, members: members, cut: make([]bool, len(members)), as: "ublk"}
	defer func() {
		for i := range p.members {
			if p.cut[i] {
				p.mend(i)
			}
		}
		if t.Failed() {
			t.Logf("seed %d (RNBD_KERNEL_PAIR_SEED):\n%s", seed, strings.Join(p.trail, "\n"))
		}
	}()
	var st kernelScheduleStats
	p.startClient()
	p.mapMirror(true)
	for round := range 4 {
		p.note("round %d", round)
		p.io(rng, 8, &st)
		i := rng.IntN(len(p.members))
		p.cutMember(i)
		p.io(rng, 6, &st)
		if rng.IntN(3) == 0 {
			p.cutMember((i + 1 + rng.IntN(len(p.members)-1)) % len(p.members))
			p.io(rng, 3, &st)
		}
		for _, j := range rng.Perm(len(p.members)) {
			if p.cut[j] {
				p.mend(j)
			}
		}
		p.back(&st)
		p.io(rng, 6, &st)
	}
	p.crash(rng, &st)
	p.staleOnly(rng.IntN(2), &st)
	p.back(&st)
	for blk := range int64(kblocks) {
		if err := p.read(blk, &st); err != nil {
			t.Fatalf("block %d with every leg in sync: %v", blk, err)
		}
	}
	bad, hs := p.h.Check()
	for _, v := range bad {
		t.Error(v)
	}
	p.cl.ok("unmap", "rnbd0")
	p.dev = ""
	if a, b := p.legData(0), p.legData(1); string(a) != string(b) {
		t.Errorf("the legs' data differs after the resync")
	}
	t.Logf("seed %d: %+v; history %+v", seed, st, hs)
	if st.writes == 0 || st.reads == 0 || st.refused == 0 || st.rejoined == 0 || st.crashes == 0 {
		t.Fatalf("the schedule did not reach every case: %+v", st)
	}
}

// mapArgsNow is the map command with sessions of new names: a kernel
// server may still hold the sessions of a map before (a path cut, its
// heartbeat not yet run out).
func (p *kernelPair) mapArgsNow(create bool) []string {
	p.maps++
	args := []string{"map", "--mirror", "kpair", "--transport", "rdma", "--as", p.as}
	for i, m := range p.members {
		flag, name := "--leg", fmt.Sprintf("kp%d-m%d", i+1, p.maps)
		if m.Witness {
			flag, name = "--witness", fmt.Sprintf("kpw-m%d", p.maps)
		}
		args = append(args, flag, fmt.Sprintf("sessname=%s path=%s dest_port=%d device_path=%s", name, m.Path, m.Port, m.DevicePath))
	}
	if create {
		args = append(args, "--create")
	}
	return args
}

// tryMap maps the mirror, trying again for up to 2 minutes while the
// map fails — a kernel server still holds a session of a member (or its
// device) from before a cut until its heartbeat runs out, and the
// assembly then misses that member — unless refusal says the refusal
// is the answer (it returns it then). It fails the test after the 2
// minutes.
func (p *kernelPair) tryMap(create bool, refusal func(string) bool) (refused string) {
	deadline := time.Now().Add(2 * time.Minute)
	for {
		out, errOut, code := p.cl.ctl(p.mapArgsNow(create)...)
		errOut = strings.TrimSpace(errOut)
		switch {
		case code == 0:
			p.dev = mappedDev(p.t, out)
			return ""
		case refusal != nil && strings.Contains(errOut, "mirror refused") && refusal(errOut):
			return errOut
		case time.Now().After(deadline):
			p.t.Fatalf("the mirror did not map as wanted in 2 minutes: %s", errOut)
		}
		p.note("map: %s", errOut)
		p.cl.ctl("unmap", "rnbd0", "--force")
		time.Sleep(3 * time.Second)
	}
}

// mapMirror maps the mirror, every member reachable (or about to be).
func (p *kernelPair) mapMirror(create bool) {
	p.tryMap(create, nil)
	p.note("mapped %s", p.dev)
}

func (p *kernelPair) sh(cmd string) {
	if out, err := exec.Command("sh", "-c", cmd).CombinedOutput(); err != nil {
		p.t.Fatalf("%s: %v: %s", cmd, err, out)
	}
}

func (p *kernelPair) cutMember(i int) {
	if p.cut[i] {
		return
	}
	p.sh(p.members[i].Cut)
	p.cut[i] = true
	p.note("member %d cut", i)
}

func (p *kernelPair) mend(i int) {
	p.sh(p.members[i].Mend)
	p.cut[i] = false
	p.note("member %d mended", i)
}

// io is n reads, writes, bursts and flushes of random blocks.
func (p *kernelPair) io(rng *rand.Rand, n int, st *kernelScheduleStats) {
	for range n {
		switch x := rng.IntN(100); {
		case x < 45:
			p.write(rng.Int64N(kblocks), st)
		case x < 55:
			p.burst(rng, 4, st)()
		case x < 60:
			err := p.do(func(f *os.File) error { return f.Sync() })
			p.note("flush: %v", err)
		default:
			p.read(rng.Int64N(kblocks), st)
		}
	}
}

// back, every member mended, waits for the mirror to be in sync: its
// legs dialled back and resynced while mapped, or, if it failed (it
// lost its quorum), mapped again.
func (p *kernelPair) back(st *kernelScheduleStats) {
	start := time.Now()
	if s := p.state(); s == "failed" || p.dev == "" {
		p.note("the mirror %s: mapped again", s)
		p.cl.ctl("unmap", "rnbd0", "--force")
		p.mapMirror(false)
		st.remapped++
	}
	// Whole for pairSettle on end: a cut mended at once may be seen
	// late (the kernel server drops a session whose address went away
	// a second or two after, mended or not), and the next cut of
	// another member would then find no quorum.
	var since time.Time
	kit.WaitFor(p.t, 3*time.Minute, "every leg in sync and the witness voting", func() bool {
		if !p.whole() {
			since = time.Time{}
			return false
		}
		if since.IsZero() {
			since = time.Now()
		}
		return time.Since(since) >= pairSettle
	})
	st.rejoined++
	p.note("every leg in sync, the witness voting, in %v", time.Since(start).Round(100*time.Millisecond))
}

// pairSettle is how long back wants the mirror whole before the next
// fault.
const pairSettle = 5 * time.Second

// whole: the mirror serves with every leg in sync and its witness
// voting (its state says the legs only: a witness whose session the
// kernel server still refuses after a cut is "missing", and the next cut
// of a leg would leave no quorum).
func (p *kernelPair) whole() bool {
	rec := p.record()
	if rec == nil || rec["state"] != "open" {
		return false
	}
	for _, s := range legStates(p.t, rec) {
		if s != "in sync" && s != "voting" {
			return false
		}
	}
	return true
}

// crash kills the client daemon (-9) with a burst of writes in flight
// and starts it again: the mirror restored from the state file, its
// assembly making the legs agree on every region the burst could have
// left different, the writes the kernel held during the outage sent
// then. The mirror is mapped as /dev/nbdN for it (nbd's RECONFIGURE
// hands the restarted daemon the device), not /dev/ublkbN: this kernel
// (6.12) once oopsed in io_uring's exit path when a daemon serving
// ublk devices was killed (docs/client.md), which the tier's newer
// kernel runs in TestMirrorSchedulesOnKernel's crashes. Every member
// is reachable: the refusal of a mirror that cannot prove its legs
// current is staleOnly's.
func (p *kernelPair) crash(rng *rand.Rand, st *kernelScheduleStats) {
	p.cl.ok("unmap", "rnbd0")
	p.as = "nbd"
	p.mapMirror(false)
	wait := p.burst(rng, 4, st)
	time.Sleep(time.Duration(rng.IntN(20)) * time.Millisecond)
	p.killClient(st)
	p.startClient()
	wait()
	kit.WaitFor(p.t, 2*time.Minute, "the mirror restored", func() bool {
		s := p.state()
		return s == "open" || s == "degraded"
	})
	if dev := fmt.Sprint(p.record()["devpath"]); dev != p.dev {
		p.t.Fatalf("the mirror came back as %s, not %s", dev, p.dev)
	}
	p.note("client back: %s", p.dev)
	p.io(rng, 6, st)
	p.back(st)
	p.cl.ok("unmap", "rnbd0")
	p.as = "ublk"
	p.mapMirror(false)
}

// staleOnly is the stale-only-leg case: leg a cut while writes are
// acknowledged without it, the mirror unmapped, the other leg and the
// witness cut, leg a alone back: the map refuses, naming what it needs.
// Then every member is back and the mirror maps (leg a resyncs).
func (p *kernelPair) staleOnly(a int, st *kernelScheduleStats) {
	p.cutMember(a)
	for blk := range int64(3) {
		p.write(blk, st)
	}
	kit.WaitFor(p.t, time.Minute, "the mirror degraded", func() bool { return p.state() == "degraded" })
	p.cl.ok("unmap", "rnbd0", "--force")
	p.dev = ""
	for i := range p.members {
		p.cutMember(i)
	}
	p.mend(a)
	// The refusal that counts is one that reached leg a (the kernel
	// server may hold its session from before the cut a while).
	r := p.tryMap(false, func(e string) bool {
		_, reached, _ := strings.Cut(e, "reached: ")
		reached, _, _ = strings.Cut(reached, "; missing")
		return strings.Contains(reached, fmt.Sprintf("leg %d ", a))
	})
	if r == "" {
		p.t.Fatalf("leg %d, stale, alone reachable: the mirror mapped %s", a, p.dev)
	}
	st.refused++
	p.note("leg %d alone: %s", a, r)
	for i := range p.members {
		if p.cut[i] {
			p.mend(i)
		}
	}
	p.mapMirror(false)
	st.remapped++
}

// legData is leg i's data region (kblocks blocks past the mirror's
// metadata), read through a read-only mapping of its device alone.
func (p *kernelPair) legData(i int) []byte {
	m := p.members[i]
	out := p.cl.ok("map", "--sessname", fmt.Sprintf("kpchk%d", i), "--path", m.Path, "--dest-port", fmt.Sprint(m.Port),
		"--device-path", m.DevicePath, "--access-mode", "ro", "--transport", "rdma", "--as", "ublk")
	dev := mappedDev(p.t, out)
	defer p.cl.ok("unmap", strings.Fields(out)[0])
	f, err := os.OpenFile(dev, os.O_RDONLY|syscall.O_DIRECT, 0)
	if err != nil {
		p.t.Fatal(err)
	}
	defer f.Close()
	data := make([]byte, 0, kblocks*kblockSize)
	for blk := range int64(kblocks) {
		b := alignedBlock()
		if _, err := f.ReadAt(b, 8<<20+blk*kblockSize); err != nil {
			p.t.Fatalf("leg %d's block %d: %v", i, blk, err)
		}
		data = append(data, b...)
	}
	return data
}
