package rtrs

import (
	"fmt"
	"runtime/debug"
	"sync"
	"syscall"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// What a path costs the server in memory, and how the server keeps the
// sum within MaxChunkMemory:
//
//   - A path is counted, at its first connection, for everything it may
//     come to hold (pathFootprint): its chunks, the per-chunk structures,
//     and every connection it asked for at what its fabric says one costs
//     (fabric.ConnCoster). One that would pass the budget, or its client's
//     share of it, is refused with ENOMEM.
//   - Counting is not allocating: the chunks are allocated and registered
//     only when the path has proved itself — every connection open and
//     INFO_REQ received (allocChunks). A peer that opens paths and hangs
//     up makes the server allocate a connection's buffers at most.
//   - Chunks live in mapped memory (fabric.Mapper), not on the Go heap:
//     a closed path's chunks go back to the server's chunkPool with their
//     pages given back to the kernel, not to the garbage collector.
//   - What does live on the Go heap (connections' queues and buffers, the
//     per-chunk structures) becomes garbage when its path closes. With
//     SrvConfig.GoMemoryLimit the server keeps the runtime's soft
//     memory limit at GoHeapMargin plus the heap part of what the paths
//     hold, so that the collector frees that garbage before the process
//     passes its budget.

// GoHeapMargin is what the Go heap may hold beyond what the paths are
// counted for, with SrvConfig.GoMemoryLimit: the daemon's own
// structures, goroutine stacks, log and control buffers, connections in
// their handshake. The process's memory stays within MaxChunkMemory plus
// this margin (and the runtime's own few MiB).
const GoHeapMargin = 256 << 20

// chunkOverhead is what each chunk costs beside its bytes: its SrvOp and
// the registration's structures.
const chunkOverhead = int64(unsafe.Sizeof(SrvOp{})) + 256

// ConnFootprint is what one connection with these queue sizes is
// counted for on a fabric that does not say (fabric.ConnCoster): its
// work requests, held three times (the queue and two batches that take
// from it), a frame header and an iovec per SGE and header, and the
// read buffer of a stream fabric. A verbs queue pair's rings live in
// the driver; the figure stands for them too.
func ConnFootprint(maxSend, maxRecv int) int64 {
	const iovec = 24
	perSend := 3*int64(unsafe.Sizeof(fabric.SendWR{})) + 2*(fabric.MaxSGE+1)*iovec + 2*24
	return int64(maxSend)*perSend + int64(maxRecv)*int64(unsafe.Sizeof(fabric.RecvWR{})) + 256<<10
}

// connMemory is what a connection on fab is counted for.
func connMemory(fab fabric.Fabric, maxSend, maxRecv int) int64 {
	if cc, ok := fab.(fabric.ConnCoster); ok {
		return cc.ConnMemory(maxSend, maxRecv)
	}
	return ConnFootprint(maxSend, maxRecv)
}

// pathFootprint is what a path of cidNum connections on fab (nil: the
// configuration's fabric) is counted for against MaxChunkMemory: its
// chunks and their structures, and its connections.
func pathFootprint(cfg *SrvConfig, fab fabric.Fabric, qd, chunkSize, cidNum int) (total, heap int64) {
	if fab == nil {
		fab = cfg.Fabric
	}
	windows := cfg.AlwaysInvalidate && !cfg.InvalidateByRegistration
	s0, r0, _ := connQueues(cfg, qd, 0, windows) // the service connection
	s1, r1, _ := connQueues(cfg, qd, 1, windows) // each IO connection
	heap = int64(qd)*chunkOverhead + connMemory(fab, s0, r0) + int64(cidNum-1)*connMemory(fab, s1, r1)
	chunks := int64(qd) * int64(chunkSize)
	if _, ok := fab.(fabric.Mapper); !ok {
		heap += chunks
	}
	return chunks + heap, heap
}

// reserveMem counts size (heap of it on the Go heap) against
// MaxChunkMemory and the share of it client may hold, or refuses it
// (ENOMEM) and counts nothing.
func (s *Server) reserveMem(client string, size, heap int64) error {
	s.memMu.Lock()
	defer s.memMu.Unlock()
	total, mine := s.chunkMem.Load()+size, s.clientMem[client]+size
	if most := s.cfg.MaxChunkMemory; most > 0 && total > most {
		return fmt.Errorf("its %d bytes would pass max_chunk_memory %d: %w", size, most, syscall.ENOMEM)
	}
	if most := s.cfg.MaxChunkMemoryPerClient; most > 0 && mine > most {
		return fmt.Errorf("its %d bytes would pass max_chunk_memory_per_client %d of %s: %w", size, most, client, syscall.ENOMEM)
	}
	if s.clientMem == nil {
		s.clientMem = make(map[string]int64)
	}
	s.chunkMem.Store(total)
	s.clientMem[client] = mine
	s.heapMem += heap
	s.setMemoryLimitLocked()
	return nil
}

// releaseMem gives back what reserveMem counted for client.
func (s *Server) releaseMem(client string, size, heap int64) {
	if size == 0 {
		return
	}
	s.memMu.Lock()
	defer s.memMu.Unlock()
	s.chunkMem.Add(-size)
	if n := s.clientMem[client] - size; n > 0 {
		s.clientMem[client] = n
	} else {
		delete(s.clientMem, client)
	}
	s.heapMem -= heap
	s.setMemoryLimitLocked()
}

// setMemoryLimitLocked sets the runtime's soft memory limit to
// GoHeapMargin plus what the paths may hold on the heap
// (SrvConfig.GoMemoryLimit). memMu is held: the last change wins.
// +checklocks:s.memMu
func (s *Server) setMemoryLimitLocked() {
	if s.cfg.GoMemoryLimit && s.cfg.MaxChunkMemory > 0 {
		debug.SetMemoryLimit(GoHeapMargin + s.heapMem)
	}
}

// startMemoryLimit sets the runtime's memory limit for an empty server
// (GoMemoryLimit), remembering the one it replaces.
func (s *Server) startMemoryLimit() {
	if !s.cfg.GoMemoryLimit || s.cfg.MaxChunkMemory <= 0 {
		return
	}
	s.memMu.Lock()
	defer s.memMu.Unlock()
	s.goLimit = debug.SetMemoryLimit(-1)
	s.setMemoryLimitLocked()
}

// stopMemoryLimit puts back the limit startMemoryLimit replaced.
func (s *Server) stopMemoryLimit() {
	if !s.cfg.GoMemoryLimit || s.cfg.MaxChunkMemory <= 0 {
		return
	}
	s.memMu.Lock()
	defer s.memMu.Unlock()
	debug.SetMemoryLimit(s.goLimit)
}

// chunkPoolMax is how many areas of chunks the pool keeps at most: they
// hold no memory, only address space.
const chunkPoolMax = 16

// chunkPool keeps the chunk areas of closed paths for the next paths to
// take instead of mapping anew: one per server. An area comes back with
// its pages given back to the kernel (MADV_DONTNEED), so while it waits
// it holds no memory, and the path that takes it finds it zero: no
// client's data reaches another's path.
type chunkPool struct {
	mu sync.Mutex
	// +checklocks:mu
	free map[chunkArea][]fabric.Memory
	// +checklocks:mu
	n int
}

type chunkArea struct {
	fab  fabric.Fabric
	size int
}

// get returns an area of n bytes of fab's memory: the pool's, mapped
// anew, or, on a fabric that cannot map (fabric.Mapper), its
// AllocMemory. mapped says which of the last it is.
func (cp *chunkPool) get(fab fabric.Fabric, n int) (mem fabric.Memory, mapped bool, err error) {
	m, ok := fab.(fabric.Mapper)
	if !ok {
		mem, err = fab.AllocMemory(n)
		return mem, false, err
	}
	k := chunkArea{fab, n}
	cp.mu.Lock()
	if l := cp.free[k]; len(l) > 0 {
		mem = l[len(l)-1]
		l[len(l)-1] = nil
		cp.free[k] = l[:len(l)-1]
		cp.n--
	}
	cp.mu.Unlock()
	if mem != nil {
		return mem, true, nil
	}
	mem, err = m.AllocMapped(n)
	return mem, true, err
}

// put takes back an area from get; memory that is not mapped, or that
// the pool has no room for, is freed.
func (cp *chunkPool) put(fab fabric.Fabric, mem fabric.Memory, mapped bool) {
	b := mem.Bytes()
	if !mapped || len(b) == 0 || unix.Madvise(b, unix.MADV_DONTNEED) != nil {
		mem.Free()
		return
	}
	k := chunkArea{fab, len(b)}
	cp.mu.Lock()
	if cp.n < chunkPoolMax {
		if cp.free == nil {
			cp.free = make(map[chunkArea][]fabric.Memory)
		}
		cp.free[k] = append(cp.free[k], mem)
		cp.n++
		mem = nil
	}
	cp.mu.Unlock()
	if mem != nil {
		mem.Free()
	}
}

// close frees every area the pool holds.
func (cp *chunkPool) close() {
	cp.mu.Lock()
	free := cp.free
	cp.free, cp.n = nil, 0
	cp.mu.Unlock()
	for _, l := range free {
		for _, m := range l {
			m.Free()
		}
	}
}

// idle is how many areas the pool holds.
func (cp *chunkPool) idle() int {
	cp.mu.Lock()
	defer cp.mu.Unlock()
	return cp.n
}
