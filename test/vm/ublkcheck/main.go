// Command ublkcheck proves pkg/frontend/ublk on a real kernel: it serves
// a ublk device from an in-memory backend that completes every request
// asynchronously from another goroutine, drives it through /dev/ublkbN
// (O_DIRECT pattern write and read back, discard, write-zeroes, flush,
// FUA) and stops it. It prints "RESULT ublk-<name> PASS|FAIL detail"
// lines and exits 1 if any check failed.
//
// Build it static (CGO_ENABLED=0) for the VM's initramfs.
package main

import (
	"bytes"
	"crypto/rand"
	"errors"
	"flag"
	"fmt"
	"math/big"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/frontend/ublk"
)

const mib = 1 << 20

// memBackend is a RAM disk that completes asynchronously.
type memBackend struct {
	mu   sync.RWMutex
	data []byte

	inflight, maxInflight atomic.Int64
	ops                   [8]atomic.Int64
	fua                   atomic.Int64
	maxDelay              time.Duration

	// corrupt: flip a byte of the first READ that overlaps
	// [corruptFrom, corruptTo) once armed.
	corruptArmed           atomic.Bool
	corruptFrom, corruptTo int64
	corrupted              atomic.Int64
}

func (m *memBackend) Submit(r *ublk.Request, done func(*ublk.Request, error)) {
	n := m.inflight.Add(1)
	for {
		old := m.maxInflight.Load()
		if n <= old || m.maxInflight.CompareAndSwap(old, n) {
			break
		}
	}
	go func() {
		if m.maxDelay > 0 {
			d, _ := rand.Int(rand.Reader, big.NewInt(int64(m.maxDelay)))
			time.Sleep(time.Duration(d.Int64()))
		}
		err := m.do(r)
		m.inflight.Add(-1)
		done(r, err)
	}()
}

func (m *memBackend) do(r *ublk.Request) error {
	if int(r.Op) < len(m.ops) {
		m.ops[r.Op].Add(1)
	}
	if r.Op != ublk.OpFlush && (r.Offset < 0 || r.Offset+int64(r.Len) > int64(len(m.data))) {
		return syscall.EIO
	}
	end := r.Offset + int64(r.Len)
	switch r.Op {
	case ublk.OpRead:
		m.mu.RLock()
		copy(r.Data, m.data[r.Offset:end])
		m.mu.RUnlock()
		if r.Offset < m.corruptTo && end > m.corruptFrom && m.corruptArmed.CompareAndSwap(true, false) {
			i := max(r.Offset, m.corruptFrom) - r.Offset
			r.Data[i] ^= 0xff
			m.corrupted.Store(r.Offset + i)
		}
	case ublk.OpWrite:
		if r.FUA {
			m.fua.Add(1)
		}
		m.mu.Lock()
		copy(m.data[r.Offset:end], r.Data)
		m.mu.Unlock()
	case ublk.OpFlush:
	case ublk.OpDiscard, ublk.OpWriteZeroes:
		m.mu.Lock()
		clear(m.data[r.Offset:end])
		m.mu.Unlock()
	default:
		return syscall.EOPNOTSUPP
	}
	return nil
}

var failed int

func result(name string, ok bool, detail string, args ...any) {
	st := "PASS"
	if !ok {
		st = "FAIL"
		failed++
	}
	fmt.Printf("RESULT ublk-%s %s %s\n", name, st, fmt.Sprintf(detail, args...))
}

func alignedBuf(n int) []byte {
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		panic(err)
	}
	return b
}

// parallel runs fn on chunk-sized pieces of [0, n) with w workers.
func parallel(n, chunk, w int, fn func(off int) error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	errs := make(chan error, w)
	for i := 0; i < w; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				off := int(next.Add(int64(chunk))) - chunk
				if off >= n {
					return
				}
				if err := fn(off); err != nil {
					errs <- err
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	return <-errs
}

func firstDiff(a, b []byte) int {
	for i := range a {
		if a[i] != b[i] {
			return i
		}
	}
	return -1
}

func ioctl(fd int, req uintptr, arg unsafe.Pointer) error {
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(fd), req, uintptr(arg))
	if e != 0 {
		return e
	}
	return nil
}

const (
	blkDiscard = 0x1277 // _IO(0x12,119)
	blkZeroout = 0x127f // _IO(0x12,127)
)

func sysfs(dev, name string) string {
	b, _ := os.ReadFile(filepath.Join("/sys/block", filepath.Base(dev), name))
	return strings.TrimSpace(string(b))
}

func main() {
	sizeMB := flag.Int("size-mb", 64, "device size in MiB")
	patMB := flag.Int("pattern-mb", 16, "pattern size in MiB")
	depth := flag.Int("depth", 128, "queue depth")
	queues := flag.Int("queues", 0, "queues (default NumCPU)")
	corrupt := flag.Bool("corrupt-read-once", false, "backend corrupts the first read of the pattern (to prove a FAIL is seen)")
	delay := flag.Duration("max-delay", 200*time.Microsecond, "random backend completion delay, up to")
	flag.Parse()

	if err := run(*sizeMB, *patMB, *queues, *depth, *corrupt, *delay); err != nil {
		result("run", false, "%v", err)
	}
	if failed > 0 {
		os.Exit(1)
	}
}

func run(sizeMB, patMB, queues, depth int, corrupt bool, delay time.Duration) error {
	size := int64(sizeMB) * mib
	be := &memBackend{data: make([]byte, size), maxDelay: delay}
	feat, err := ublk.Probe()
	if errors.Is(err, ublk.ErrNoUblk) {
		result("probe", false, "%v", err)
		return nil
	}
	if err != nil {
		return err
	}
	result("probe", true, "features=%#x", feat)

	t0 := time.Now()
	dev, err := ublk.New(ublk.Options{Size: size, Queues: queues, QueueDepth: depth,
		Discard: true, WriteZeroes: true, VolatileCache: true, FUA: true}, be)
	if err != nil {
		result("create", false, "%v", err)
		return nil
	}
	path := dev.Path()
	result("create", true, "%s queues=%d depth=%d flags=%#x in %v", path, dev.Queues(), dev.QueueDepth(),
		dev.Flags(), time.Since(t0).Round(time.Millisecond))
	stopped := false
	defer func() {
		if !stopped {
			dev.Stop()
		}
	}()

	if _, err := os.Stat(path); err != nil {
		result("node", false, "%v", err)
		return nil
	}
	secs, _ := strconv.ParseInt(sysfs(path, "size"), 10, 64)
	result("size", secs == size/512, "%d sectors", secs)
	mq, _ := os.ReadDir(filepath.Join("/sys/block", filepath.Base(path), "mq"))
	result("queues", len(mq) == dev.Queues(), "%d hw queues in sysfs, %d granted", len(mq), dev.Queues())
	wc := sysfs(path, "queue/write_cache")
	fua := sysfs(path, "queue/fua")
	dmax := sysfs(path, "queue/discard_max_bytes")
	result("attrs", wc == "write back" && fua == "1" && dmax != "0" && dmax != "",
		"write_cache=%q fua=%s discard_max_bytes=%s", wc, fua, dmax)

	fd, err := unix.Open(path, unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open %s: %w", path, err)
	}
	defer func() {
		if fd >= 0 {
			unix.Close(fd)
		}
	}()

	// 1. The pattern, written and read back with O_DIRECT by 8 workers.
	plen := patMB * mib
	pbase := int64(4 * mib)
	pat := alignedBuf(plen)
	back := alignedBuf(plen)
	rand.Read(pat)
	be.maxInflight.Store(0)
	t0 = time.Now()
	err = parallel(plen, mib, 8, func(off int) error {
		_, err := unix.Pwrite(fd, pat[off:off+mib], pbase+int64(off))
		return err
	})
	wt := time.Since(t0)
	if err != nil {
		result("direct-write", false, "%v", err)
		return nil
	}
	if corrupt {
		be.corruptFrom, be.corruptTo = pbase, pbase+int64(plen)
		be.corruptArmed.Store(true)
	}
	t0 = time.Now()
	err = parallel(plen, mib, 8, func(off int) error {
		_, err := unix.Pread(fd, back[off:off+mib], pbase+int64(off))
		return err
	})
	rt := time.Since(t0)
	if err != nil {
		result("direct-read", false, "%v", err)
		return nil
	}
	if i := firstDiff(pat, back); i >= 0 {
		result("direct-io", false, "%d MiB differ first at device offset %d (backend corrupted %d)", patMB, pbase+int64(i), be.corrupted.Load())
	} else {
		result("direct-io", true, "%d MiB O_DIRECT written and read back", patMB)
	}
	fmt.Printf("TPUT ublk go-async O_DIRECT 8x1M write %.0f MB/s read %.0f MB/s (emulated)\n",
		float64(plen)/mib/wt.Seconds(), float64(plen)/mib/rt.Seconds())
	be.mu.RLock()
	onBE := bytes.Equal(be.data[pbase:pbase+int64(plen)], pat)
	be.mu.RUnlock()
	result("on-backend", onBE, "")
	mi := be.maxInflight.Load()
	result("async", mi > 1, "max %d requests in flight in the backend", mi)

	// 2. Discard: the backend zeroes, reads see zeros.
	zero := make([]byte, 8*mib)
	n0 := be.ops[ublk.OpDiscard].Load()
	rng := [2]uint64{uint64(pbase), 8 * mib}
	if err := ioctl(fd, blkDiscard, unsafe.Pointer(&rng)); err != nil {
		result("discard", false, "BLKDISCARD: %v", err)
	} else {
		_, err := unix.Pread(fd, back[:8*mib], pbase)
		nd := be.ops[ublk.OpDiscard].Load() - n0
		result("discard", err == nil && nd > 0 && bytes.Equal(back[:8*mib], zero),
			"%d discard requests, read back err=%v", nd, err)
	}

	// 3. Write zeroes (BLKZEROOUT) over the rest of the pattern.
	n0 = be.ops[ublk.OpWriteZeroes].Load()
	rng = [2]uint64{uint64(pbase) + 8*mib, 8 * mib}
	if err := ioctl(fd, blkZeroout, unsafe.Pointer(&rng)); err != nil {
		result("write-zeroes", false, "BLKZEROOUT: %v", err)
	} else {
		_, err := unix.Pread(fd, back[:8*mib], pbase+8*mib)
		nz := be.ops[ublk.OpWriteZeroes].Load() - n0
		result("write-zeroes", err == nil && nz > 0 && bytes.Equal(back[:8*mib], zero),
			"%d write-zeroes requests, read back err=%v", nz, err)
	}

	// 4. Flush: fsync of the block device reaches the backend.
	n0 = be.ops[ublk.OpFlush].Load()
	if _, err := unix.Pwrite(fd, pat[:4096], 0); err != nil {
		result("flush", false, "write: %v", err)
	} else if err := unix.Fsync(fd); err != nil {
		result("flush", false, "fsync: %v", err)
	} else {
		nf := be.ops[ublk.OpFlush].Load() - n0
		result("flush", nf > 0, "%d flush requests", nf)
	}

	// 5. FUA: an O_DSYNC direct write arrives as a FUA write.
	n0 = be.fua.Load()
	if sfd, err := unix.Open(path, unix.O_RDWR|unix.O_DIRECT|unix.O_DSYNC|unix.O_CLOEXEC, 0); err != nil {
		result("fua", false, "open: %v", err)
	} else {
		_, err := unix.Pwrite(sfd, pat[:4096], 4096)
		unix.Close(sfd)
		nf := be.fua.Load() - n0
		result("fua", err == nil && nf > 0, "%d FUA writes, err=%v", nf, err)
	}

	// 6. fio with verification, many requests in flight (if fio is here).
	if fio, err := exec.LookPath("fio"); err == nil {
		be.maxInflight.Store(0)
		out, err := exec.Command(fio, "--name=v", "--filename="+path, "--direct=1", "--ioengine=libaio",
			"--rw=randrw", "--bsrange=4k-256k", "--size=32M", "--offset=32M", "--iodepth=64", "--numjobs=1",
			"--verify=crc32c", "--verify_fatal=1", "--verify_state_save=0", "--randrepeat=0", "--output-format=terse").CombinedOutput()
		detail := fmt.Sprintf("max %d in flight", be.maxInflight.Load())
		if err != nil {
			lines := strings.Split(strings.TrimSpace(string(out)), "\n")
			detail = fmt.Sprintf("%v: %s", err, lines[len(lines)-1])
		}
		result("fio-verify", err == nil, "%s", detail)
	}

	// 7. Stop: STOP_DEV, the queues wind down, DEL_DEV; the node goes.
	unix.Close(fd)
	fd = -1
	t0 = time.Now()
	err = dev.Stop()
	stopped = true
	_, serr := os.Stat(filepath.Join("/sys/block", filepath.Base(path)))
	result("stop", err == nil && os.IsNotExist(serr), "in %v, err=%v, sysfs gone=%v",
		time.Since(t0).Round(time.Millisecond), err, os.IsNotExist(serr))
	_, cerr := os.Stat(fmt.Sprintf("/dev/ublkc%d", dev.ID()))
	result("deleted", os.IsNotExist(cerr), "/dev/ublkc%d: %v", dev.ID(), cerr)

	stopUnderIO(size, queues, depth)
	recovery(size, queues, depth)
	return nil
}

// recovery detaches a recoverable device while writers keep IO going, so
// that the kernel holds their IO, then takes it over again with Recover
// and a new backend over the same data: the writers never see an error
// and every block holds what they wrote. A wrong cookie is refused and
// leaves the device as it was.
func recovery(size int64, queues, depth int) {
	const cookie = 0x726e6264
	be := &memBackend{data: make([]byte, size), maxDelay: time.Millisecond}
	dev, err := ublk.New(ublk.Options{Size: size, Queues: queues, QueueDepth: depth, VolatileCache: true,
		Recovery: true, Cookie: cookie}, be)
	if err != nil {
		result("recovery", false, "create: %v", err)
		return
	}
	if !dev.Recoverable() {
		result("recovery", false, "the kernel made the device without user recovery (flags %#x)", dev.Flags())
		dev.Stop()
		return
	}
	path, id := dev.Path(), dev.ID()
	// Four writers, each filling its own quarter with a pattern of its
	// own, pass after pass.
	var wg sync.WaitGroup
	var ios, ioErrs atomic.Int64
	var lastErr atomic.Value
	stop := make(chan struct{})
	quarter := size / 4
	for w := 0; w < 4; w++ {
		fd, err := unix.Open(path, unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
		if err != nil {
			result("recovery", false, "open: %v", err)
			close(stop)
			wg.Wait()
			dev.Stop()
			return
		}
		wg.Add(1)
		go func(w int, fd int) {
			defer wg.Done()
			defer unix.Close(fd)
			buf := alignedBuf(128 << 10)
			defer unix.Munmap(buf)
			for i := range buf {
				buf[i] = byte(w + 1)
			}
			for pass := 0; ; pass++ {
				for off := int64(0); off < quarter; off += int64(len(buf)) {
					select {
					case <-stop:
						return
					default:
					}
					if _, err := unix.Pwrite(fd, buf, int64(w)*quarter+off); err != nil {
						ioErrs.Add(1)
						lastErr.Store(err.Error())
						return
					}
					ios.Add(1)
				}
			}
		}(w, fd)
	}
	time.Sleep(300 * time.Millisecond)
	t0 := time.Now()
	derr := dev.Detach()
	detached := time.Since(t0).Round(time.Millisecond)
	// The kernel quiesces the device once the closed rings' commands are
	// cancelled: shortly after Detach, asynchronously.
	var info ublk.Info
	var ierr error
	for end := time.Now().Add(10 * time.Second); time.Now().Before(end); time.Sleep(20 * time.Millisecond) {
		if info, ierr = ublk.GetInfo(id); ierr != nil || info.State == ublk.StateQuiesced {
			break
		}
	}
	quiesced := time.Since(t0).Round(time.Millisecond)
	time.Sleep(100 * time.Millisecond) // the last commits reach the writers
	held := ios.Load()
	time.Sleep(500 * time.Millisecond)
	heldOK := ios.Load() == held // nothing completes while nobody serves
	result("recovery-detach", derr == nil && ierr == nil && info.State == ublk.StateQuiesced && heldOK && ioErrs.Load() == 0,
		"Detach in %v err=%v, state %v after %v (%v), %d IOs before, none after: %v", detached, derr, info.State, quiesced, ierr, held, heldOK)

	_, err = ublk.Recover(id, ublk.Options{Cookie: cookie + 1}, be)
	info2, _ := ublk.GetInfo(id)
	result("recovery-cookie", errors.Is(err, ublk.ErrNotRecoverable) && info2.State == ublk.StateQuiesced,
		"other cookie: %v; state still %v", err, info2.State)

	be2 := &memBackend{data: be.data, maxDelay: time.Millisecond}
	t0 = time.Now()
	dev2, err := ublk.Recover(id, ublk.Options{Cookie: cookie}, be2)
	took := time.Since(t0).Round(time.Millisecond)
	if err != nil {
		result("recovery-recover", false, "Recover: %v", err)
		close(stop)
		ublk.Remove(id)
		wg.Wait()
		return
	}
	time.Sleep(500 * time.Millisecond)
	close(stop)
	wg.Wait()
	after := ios.Load()
	le, _ := lastErr.Load().(string)
	result("recovery-recover", ioErrs.Load() == 0 && after > held && dev2.Path() == path && dev2.Size() == size,
		"Recover in %v: %s, %d IOs held then %d more, errors %d %s", took, dev2.Path(), held, after-held, ioErrs.Load(), le)
	// Every written block holds its writer's byte (or zero where no pass
	// reached): nothing torn, nothing lost.
	bad := int64(-1)
	be2.mu.RLock()
	for off := int64(0); off < size && bad < 0; off++ {
		if v := be2.data[off]; v != 0 && v != byte(off/quarter+1) {
			bad = off
		}
	}
	be2.mu.RUnlock()
	result("recovery-data", bad < 0, "first bad byte %d", bad)
	err = dev2.Stop()
	_, serr := os.Stat(path)
	result("recovery-stop", err == nil && os.IsNotExist(serr), "err=%v, node gone=%v", err, os.IsNotExist(serr))
}

// stopUnderIO stops a second device while readers keep IO going and hold
// /dev/ublkbN open: Stop must return, the readers must see errors.
func stopUnderIO(size int64, queues, depth int) {
	be := &memBackend{data: make([]byte, size), maxDelay: 2 * time.Millisecond}
	dev, err := ublk.New(ublk.Options{Size: size, Queues: queues, QueueDepth: depth, VolatileCache: true}, be)
	if err != nil {
		result("stop-under-io", false, "create: %v", err)
		return
	}
	var wg sync.WaitGroup
	var ios, errs atomic.Int64
	var lastErr atomic.Value
	fds := make(chan int, 4)
	for i := 0; i < 4; i++ {
		fd, err := unix.Open(dev.Path(), unix.O_RDWR|unix.O_DIRECT|unix.O_CLOEXEC, 0)
		if err != nil {
			result("stop-under-io", false, "open: %v", err)
			dev.Stop()
			return
		}
		fds <- fd
		wg.Add(1)
		go func(fd int, seed int64) {
			defer wg.Done()
			buf := alignedBuf(256 << 10)
			defer unix.Munmap(buf)
			off := seed * mib
			for errs.Load() < 100 {
				var err error
				if seed%2 == 0 {
					_, err = unix.Pread(fd, buf, off)
				} else {
					_, err = unix.Pwrite(fd, buf, off)
				}
				if err != nil {
					errs.Add(1)
					lastErr.Store(err.Error())
					time.Sleep(time.Millisecond)
					continue
				}
				ios.Add(1)
				off = (off + 256<<10) % size
			}
		}(fd, int64(i))
	}
	time.Sleep(500 * time.Millisecond)
	before := ios.Load()
	t0 := time.Now()
	done := make(chan error, 1)
	go func() { done <- dev.Stop() }()
	select {
	case err = <-done:
	case <-time.After(60 * time.Second):
		err = errors.New("Stop hangs")
	}
	took := time.Since(t0).Round(time.Millisecond)
	waited := make(chan struct{})
	go func() { wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-time.After(30 * time.Second):
	}
	close(fds)
	for fd := range fds {
		unix.Close(fd)
	}
	_, serr := os.Stat(dev.Path())
	le, _ := lastErr.Load().(string)
	result("stop-under-io", err == nil && before > 0 && errs.Load() > 0 && os.IsNotExist(serr),
		"%d IOs before Stop, Stop in %v err=%v, readers then failed with %q, node gone=%v",
		before, took, err, le, os.IsNotExist(serr))
}
