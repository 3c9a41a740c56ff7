package clientd

import (
	"context"
	"errors"
	"os"
	"sync"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/blockdev/ublk"
	"github.com/rnbd/rnbd/pkg/rnbd"
)

// ublkBackend serves a mapped device to a ublk device. ublk hands each
// request its own buffer (the tag's); the data is copied between it and a
// slot of the device's registered memory, from where RTRS sends it.
type ublkBackend struct {
	nb   *nbdBackend
	reqs sync.Pool // *ublkIO
}

// ublkIO carries one ublk request through the device.
type ublkIO struct {
	rnbd.IOReq
	ur     *ublk.Request
	done   func(*ublk.Request, error)
	slot   *slotBuf
	b      *ublkBackend
	doneFn func(*rnbd.IOReq, error)
}

func newUblkBackend(nb *nbdBackend) *ublkBackend {
	b := &ublkBackend{nb: nb}
	b.reqs.New = func() any {
		r := &ublkIO{b: b}
		r.doneFn = r.complete
		return r
	}
	return b
}

func (r *ublkIO) complete(_ *rnbd.IOReq, err error) {
	ur, done, slot := r.ur, r.done, r.slot
	if slot != nil {
		if err == nil && ur.Op == ublk.OpRead {
			copy(ur.Data, slot.data)
		}
		slot.Release()
	}
	r.ur, r.done, r.slot = nil, nil, nil
	r.b.reqs.Put(r)
	done(ur, err)
}

// Submit implements ublk.Backend.
func (b *ublkBackend) Submit(ur *ublk.Request, done func(*ublk.Request, error)) {
	r := b.reqs.Get().(*ublkIO)
	r.ur, r.done = ur, done
	r.IOReq = rnbd.IOReq{Off: ur.Offset, Len: ur.Len, Done: r.doneFn}
	switch ur.Op {
	case ublk.OpRead:
		r.Op = rnbd.OpRead
	case ublk.OpWrite:
		r.Op = rnbd.OpWrite
	case ublk.OpFlush:
		r.Op, r.Off, r.Len = rnbd.OpFlush, 0, 0
	case ublk.OpDiscard:
		r.Op = rnbd.OpDiscard
	case ublk.OpWriteZeroes:
		r.Op = rnbd.OpWriteZeroes
		if ur.NoUnmap {
			r.Flags |= rnbd.FNoUnmap
		}
	default:
		r.complete(&r.IOReq, ctl.Errorf(ctl.CodeNotSupported, "ublk %v", ur.Op))
		return
	}
	if ur.FUA {
		r.Flags |= rnbd.FFUA
	}
	if ur.Op == ublk.OpRead || ur.Op == ublk.OpWrite {
		// Waits for a free slot: they come back as IO completes,
		// which never waits for the ublk queue.
		buf, err := b.nb.Buffer(context.Background(), ur.Len)
		if err != nil {
			r.complete(&r.IOReq, err)
			return
		}
		r.slot = buf.(*slotBuf)
		if ur.Op == ublk.OpWrite {
			copy(r.slot.data, ur.Data)
		}
		r.Buf, r.BufOff = r.slot.buf, r.slot.off
	}
	if err := b.nb.dev.Submit(context.Background(), &r.IOReq); err != nil {
		r.complete(&r.IOReq, err)
	}
}

// attachUblk creates a ublk device (/dev/ublkbN) for a mapped device.
func attachUblk(nb *nbdBackend) (*ublk.Device, error) {
	dev := nb.dev
	info := dev.Info()
	ro := dev.Mode() == rnbd.AccessRO
	lbs := max(int(info.LogicalBlockSize), 512)
	opts := ublk.Options{
		Size:              dev.Size(),
		LogicalBlockSize:  lbs,
		PhysicalBlockSize: max(int(info.PhysicalBlockSize), lbs),
		// Every tag has a buffer of MaxIOBytes: 64 tags of 512 KiB per
		// queue (one queue per CPU) is 32 MiB of memory per queue.
		QueueDepth:    64,
		MaxIOBytes:    min(512<<10, slotSize),
		Discard:       !ro && info.MaxDiscardSectors > 0,
		WriteZeroes:   !ro && info.MaxWriteZeroesSectors > 0,
		VolatileCache: true,
		FUA:           info.CachePolicy&rnbd.CacheFUA != 0,
		ReadOnly:      ro,
	}
	d, err := ublk.New(opts, newUblkBackend(nb))
	if errors.Is(err, ublk.ErrNoUblk) {
		return nil, ctl.Errorf(ctl.CodeNotSupported, "this kernel has no ublk driver (modprobe ublk_drv); map with --as nbd or --as socket:PATH instead")
	}
	return d, err
}

// kernelHasUblk reports whether /dev/ublk-control exists.
func kernelHasUblk() bool {
	_, err := os.Stat("/dev/ublk-control")
	return err == nil
}
