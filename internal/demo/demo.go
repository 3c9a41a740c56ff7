// Package demo is the RTRS demonstration used by the quick start and the
// multipath tests: a server whose backend is memory, and a load generator
// that writes and reads it through a multipath session and verifies every
// byte it reads.
//
// The user header of a request is the demo's own, not RNBD: 8 bytes, the
// little-endian byte offset of the IO in the server's memory.
package demo

import (
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs"
)

// Backend is a server user serving a byte array.
type Backend struct {
	mu sync.RWMutex
	b  []byte

	Reads, Writes atomic.Int64
}

// NewBackend returns a backend of size bytes.
func NewBackend(size int) *Backend { return &Backend{b: make([]byte, size)} }

func (m *Backend) LinkEvent(*rtrs.SrvSession, rtrs.SrvLinkEvent) error { return nil }

// HandleIO serves one request on a goroutine of its own.
func (m *Backend) HandleIO(op *rtrs.SrvOp) error {
	if len(op.Usr()) < 8 {
		return syscall.EINVAL
	}
	off := binary.LittleEndian.Uint64(op.Usr())
	n := uint64(len(op.Data()))
	if off > uint64(len(m.b)) || n > uint64(len(m.b))-off {
		return syscall.EINVAL
	}
	go func() {
		if op.Dir() == rtrs.Write {
			m.mu.Lock()
			copy(m.b[off:], op.Data())
			m.mu.Unlock()
			m.Writes.Add(1)
		} else {
			m.mu.RLock()
			copy(op.Data(), m.b[off:off+n])
			m.mu.RUnlock()
			m.Reads.Add(1)
		}
		op.Respond(nil)
	}()
	return nil
}

// LoadConfig describes a load run.
type LoadConfig struct {
	Session    *rtrs.CltSession
	Size       int64         // bytes of the server's backend to use
	BlockSize  int           // IO size
	QueueDepth int           // concurrent requests
	WritePct   int           // share of writes, 0..100
	Duration   time.Duration // run this long, or
	IOs        int64         // this many IOs (whichever ends first; 0: no bound)
	Seed       uint64
}

// Result is what a load run did.
type Result struct {
	Reads, Writes    int64
	Errors           int64
	VerifyFailures   int64
	FirstError       string
	Elapsed          time.Duration
	BytesRead        int64
	BytesWritten     int64
	LatencyMaxMicros int64
}

// Run drives the load: QueueDepth workers, each owning the blocks whose
// number modulo QueueDepth is its own, so no two requests touch one block
// at once and every read has one right answer: the last data written
// there (zeros before). Data is a function of block, generation and seed.
func Run(ctx context.Context, cfg LoadConfig) (Result, error) {
	s := cfg.Session
	if cfg.BlockSize <= 0 || cfg.BlockSize > s.MaxIOSize() || cfg.BlockSize%8 != 0 {
		return Result{}, fmt.Errorf("block size %d: want a multiple of 8 up to %d", cfg.BlockSize, s.MaxIOSize())
	}
	blocks := cfg.Size / int64(cfg.BlockSize)
	if cfg.QueueDepth < 1 || int64(cfg.QueueDepth) > blocks {
		return Result{}, fmt.Errorf("queue depth %d for %d blocks", cfg.QueueDepth, blocks)
	}
	if cfg.Duration > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, cfg.Duration)
		defer cancel()
	}
	buf, err := s.AllocBuffer(cfg.QueueDepth * cfg.BlockSize)
	if err != nil {
		return Result{}, err
	}
	defer buf.Free()
	var res Result
	var ios, maxLat atomic.Int64
	var reads, writes, errs, verifyFailures atomic.Int64 // res's, when the workers are done
	var mu sync.Mutex
	note := func(err error) {
		mu.Lock()
		if res.FirstError == "" {
			res.FirstError = err.Error()
		}
		mu.Unlock()
	}
	start := time.Now()
	var wg sync.WaitGroup
	for w := 0; w < cfg.QueueDepth; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			rnd := rand.New(rand.NewPCG(cfg.Seed, uint64(w)))
			gen := make(map[int64]uint32)
			mine := (blocks - int64(w) + int64(cfg.QueueDepth) - 1) / int64(cfg.QueueDepth)
			data := buf.Bytes()[w*cfg.BlockSize : (w+1)*cfg.BlockSize]
			hdr := make([]byte, 8)
			done := make(chan error, 1)
			conf := confirmer(done)
			for ctx.Err() == nil {
				if cfg.IOs > 0 && ios.Add(1) > cfg.IOs {
					return
				}
				blk := int64(w) + rnd.Int64N(mine)*int64(cfg.QueueDepth)
				binary.LittleEndian.PutUint64(hdr, uint64(blk)*uint64(cfg.BlockSize))
				write := rnd.IntN(100) < cfg.WritePct
				dir := rtrs.Read
				if write {
					dir = rtrs.Write
					fill(data, blk, gen[blk]+1, cfg.Seed)
				}
				p, err := s.GetPermit(ctx, rtrs.IOCon)
				if err != nil {
					return
				}
				t0 := time.Now()
				err = s.Request(dir, p, conf, hdr, buf, w*cfg.BlockSize, cfg.BlockSize)
				if err == nil {
					err = <-done
				}
				s.PutPermit(p)
				lat := time.Since(t0).Microseconds()
				for m := maxLat.Load(); lat > m && !maxLat.CompareAndSwap(m, lat); m = maxLat.Load() {
				}
				if err != nil {
					errs.Add(1)
					note(fmt.Errorf("%v of block %d: %w", dir, blk, err))
					continue
				}
				if write {
					gen[blk]++
					writes.Add(1)
					continue
				}
				reads.Add(1)
				if !check(data, blk, gen[blk], cfg.Seed) {
					verifyFailures.Add(1)
					note(fmt.Errorf("block %d: read data differs from what was written (generation %d)", blk, gen[blk]))
				}
			}
		}(w)
	}
	wg.Wait()
	res.Reads, res.Writes, res.Errors, res.VerifyFailures = reads.Load(), writes.Load(), errs.Load(), verifyFailures.Load()
	res.Elapsed = time.Since(start)
	res.BytesRead = res.Reads * int64(cfg.BlockSize)
	res.BytesWritten = res.Writes * int64(cfg.BlockSize)
	res.LatencyMaxMicros = maxLat.Load()
	if res.Errors > 0 || res.VerifyFailures > 0 {
		return res, errors.New(res.FirstError)
	}
	return res, nil
}

type confirmer chan error

func (c confirmer) Confirm(err error) { c <- err }

// fill writes the pattern of (block, generation, seed) into b.
func fill(b []byte, blk int64, gen uint32, seed uint64) {
	x := uint64(blk)*0x9E3779B97F4A7C15 ^ uint64(gen)<<32 ^ seed
	for i := 0; i+8 <= len(b); i += 8 {
		x ^= x << 13
		x ^= x >> 7
		x ^= x << 17
		binary.LittleEndian.PutUint64(b[i:], x)
	}
}

// check reports whether b holds the pattern of generation gen; generation
// 0 is a block never written, all zeros.
func check(b []byte, blk int64, gen uint32, seed uint64) bool {
	if gen == 0 {
		for _, c := range b {
			if c != 0 {
				return false
			}
		}
		return true
	}
	want := make([]byte, len(b))
	fill(want, blk, gen, seed)
	return string(want) == string(b)
}
