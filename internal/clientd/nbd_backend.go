package clientd

import (
	"context"
	"sync"
	"syscall"

	"golang.org/x/sync/semaphore"

	"github.com/rnbd/rnbd/pkg/frontend/nbd"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/tagpool"
)

// slotSize is the request memory one NBD request up to that size takes
// from a device's pool; larger requests get memory of their own.
const slotSize = 1 << 20

// maxPayload is the largest NBD request a device takes.
const maxPayload = 32 << 20

// nbdBackend serves a mapped device to the NBD server: request data lives
// in registered transport memory, so it goes from the NBD socket to the
// wire (and back) without another copy.
type nbdBackend struct {
	dev   ioDev
	pool  ioBuf // slots of slotSize
	slots []slotBuf
	free  *tagpool.Pool // free slots, lowest first: the memory in use stays warm
	reqs  sync.Pool     // *ioReq
	// big bounds the bytes of the buffers of their own that requests
	// larger than a slot hold at once: as much as the pool, at least one
	// request of maxPayload. Without it 128 requests in flight of 32 MiB
	// each on one connection were 4 GiB of registered memory.
	big *semaphore.Weighted
}

func newNBDBackend(dev ioDev, nslots int) (*nbdBackend, error) {
	pool, err := dev.AllocBuffer(nslots * slotSize)
	if err != nil {
		return nil, err
	}
	b := &nbdBackend{dev: dev, pool: pool, slots: make([]slotBuf, nslots), free: tagpool.New(nslots),
		big: semaphore.NewWeighted(int64(max(nslots*slotSize, maxPayload)))}
	for i := range b.slots {
		b.slots[i] = slotBuf{b: b, slot: i, buf: pool, off: i * slotSize}
	}
	b.reqs.New = func() any {
		r := new(ioReq)
		r.init(r.complete) // a method value allocates: once per ioReq
		return r
	}
	return b, nil
}

func (b *nbdBackend) close() { b.pool.Free() }

// slotBuf is a slot of the pool, or a buffer of its own for a request
// larger than a slot.
type slotBuf struct {
	b    *nbdBackend
	slot int // -1: own
	buf  ioBuf
	off  int
	data []byte
}

func (s *slotBuf) Bytes() []byte { return s.data }

func (s *slotBuf) Release() {
	if s.slot < 0 {
		s.buf.Free()
		s.b.big.Release(int64(len(s.data)))
		return
	}
	s.b.free.Put(s.slot)
}

func (b *nbdBackend) Buffer(ctx context.Context, n int) (nbd.Buf, error) {
	if n > slotSize {
		if n > maxPayload {
			return nil, syscall.EINVAL // the export's MaxPayload keeps it out
		}
		if !b.big.TryAcquire(int64(n)) {
			// The connection's plug may hold what frees memory.
			if pl := nbd.PlugFrom(ctx); pl != nil {
				pl.Unplug()
			}
			if err := b.big.Acquire(ctx, int64(n)); err != nil {
				return nil, err
			}
		}
		buf, err := b.dev.AllocBuffer(n)
		if err != nil {
			b.big.Release(int64(n))
			return nil, err
		}
		return &slotBuf{b: b, slot: -1, buf: buf, data: buf.Bytes()[:n]}, nil
	}
	i := b.free.TryGet()
	if i < 0 {
		// The connection's plug may hold what frees a slot.
		if pl := nbd.PlugFrom(ctx); pl != nil {
			pl.Unplug()
		}
		var err error
		if i, err = b.free.Get(ctx, nil); err != nil {
			return nil, err
		}
	}
	s := &b.slots[i]
	s.data = b.pool.Bytes()[s.off : s.off+n]
	return s, nil
}

// NewPlug gives an NBD connection a plug (nbd.Plugger): the requests it
// reads in one burst go to the transport in one write (docs/rtrs.md,
// "Batching": the plug down, the burst back up as the reply's Batch).
func (b *nbdBackend) NewPlug() nbd.Plug { return new(rtrs.Plug) }

// ioReq carries one NBD request through the device.
type ioReq struct {
	devReq
	nr     *nbd.Request
	nbdEnd func(*nbd.Request, error)
	b      *nbdBackend
}

func (r *ioReq) complete(_ *devReq, err error) {
	nr, done, b := r.nr, r.nbdEnd, r.b
	if bu := r.burst(); bu != nil {
		// The reply goes out with the others of the transport's burst.
		nr.Batch = bu
	}
	r.nr, r.nbdEnd = nil, nil
	b.reqs.Put(r)
	done(nr, err)
}

func (b *nbdBackend) Submit(nr *nbd.Request, done func(*nbd.Request, error)) {
	r := b.reqs.Get().(*ioReq)
	r.nr, r.nbdEnd, r.b = nr, done, b
	br := blockReq{off: nr.Offset, n: int(nr.Length), fua: nr.FUA, noUnmap: nr.NoHole}
	switch nr.Cmd {
	case nbd.CmdRead, nbd.CmdWrite:
		br.op = rnbd.OpRead
		if nr.Cmd == nbd.CmdWrite {
			br.op = rnbd.OpWrite
		}
		sb := nr.Buf().(*slotBuf)
		br.buf, br.bufOff = sb.buf, sb.off
	case nbd.CmdFlush:
		br.op = rnbd.OpFlush
	case nbd.CmdTrim:
		br.op = rnbd.OpDiscard
	case nbd.CmdWriteZeroes:
		br.op = rnbd.OpWriteZeroes
	}
	r.blockReq = br
	r.plug, _ = nr.Plug.(*rtrs.Plug)
	b.dev.Submit(&r.devReq)
}

// export describes the device to the NBD server.
func (b *nbdBackend) export(id, name string) *nbd.Export {
	info := b.dev.Info()
	ro := b.dev.ReadOnly()
	// Flush and FUA as the server's cache policy says (the kernel's
	// client sets BLK_FEAT_WRITE_CACHE and BLK_FEAT_FUA the same way): a
	// write-through device needs neither, and /dev/nbdN then shows
	// "write through".
	wc := info.CachePolicy&rnbd.CacheWriteback != 0
	return &nbd.Export{
		ID:          id,
		Name:        name,
		Description: b.dev.Describe(),
		Size:        b.dev.Size(),
		SizeNow:     b.dev.Size,
		ReadOnly:    ro,
		Flush:       wc,
		FUA:         wc && info.CachePolicy&rnbd.CacheFUA != 0,
		Trim:        !ro && info.MaxDiscardSectors > 0,
		WriteZeroes: !ro && info.MaxWriteZeroesSectors > 0,
		// Every connection funnels into the same session and device,
		// and FLUSH reaches the server's backend: coherent.
		MultiConn:  true,
		MinBlock:   uint32(info.LogicalBlockSize),
		PrefBlock:  uint32(max(info.PhysicalBlockSize, 4096)),
		MaxPayload: maxPayload,
		Backend:    b,
	}
}
