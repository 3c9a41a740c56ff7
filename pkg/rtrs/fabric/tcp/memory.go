// Memory for buffers: Go memory aligned for O_DIRECT (AllocMemory), or a
// private anonymous mapping (AllocMapped).

package tcp

import (
	"errors"
	"fmt"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// AllocMemory returns Go memory (the TCP fabric never hands it to
// hardware), aligned to 4 KiB so that chunks can be read and written with
// O_DIRECT.
func (f *Fabric) AllocMemory(n int) (fabric.Memory, error) {
	if n <= 0 {
		return nil, errors.New("tcp fabric: memory size must be positive")
	}
	return &heapMemory{b: AlignedBytes(n)}, nil
}

// AlignedBytes returns n zeroed bytes whose first byte is 4 KiB aligned.
func AlignedBytes(n int) []byte {
	const align = 4096
	b := make([]byte, n+align)
	off := (align - int(uintptr(unsafe.Pointer(&b[0]))%align)) % align
	return b[off : off+n : off+n]
}

type heapMemory struct{ b []byte }

func (m *heapMemory) Bytes() []byte { return m.b }
func (m *heapMemory) Free() error   { return nil }

// AllocMapped returns n bytes of a private anonymous mapping
// (fabric.Mapper): zero, taking no room until touched, and unmapped by
// Free. Page aligned, so O_DIRECT can use it.
func (f *Fabric) AllocMapped(n int) (fabric.Memory, error) {
	if n <= 0 {
		return nil, errors.New("tcp fabric: memory size must be positive")
	}
	b, err := unix.Mmap(-1, 0, n, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return nil, fmt.Errorf("tcp fabric: mmap %d bytes: %w", n, err)
	}
	return &mappedMemory{b: b}, nil
}

type mappedMemory struct{ b []byte }

func (m *mappedMemory) Bytes() []byte { return m.b }

func (m *mappedMemory) Free() error {
	if m.b == nil {
		return nil
	}
	err := unix.Munmap(m.b)
	m.b = nil
	return err
}
