// Memory for buffers: page-aligned mappings outside the Go heap, which
// the device keeps addresses into.

package rdma

import (
	"errors"

	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// memory is mmapped: outside the Go heap, as the device keeps its address.
type memory struct{ b []byte }

func (m *memory) Bytes() []byte { return m.b }
func (m *memory) Free() error {
	if m.b == nil {
		return nil
	}
	err := ibverbs.FreeMemory(m.b)
	m.b = nil
	return err
}

// AllocMemory returns page-aligned memory outside the Go heap.
func (f *Fabric) AllocMemory(n int) (fabric.Memory, error) {
	if n <= 0 {
		return nil, errors.New("rdma fabric: memory size must be positive")
	}
	b, err := ibverbs.AllocMemory(n)
	if err != nil {
		return nil, err
	}
	return &memory{b: b}, nil
}

// AllocMapped is AllocMemory, which is a private mapping already
// (fabric.Mapper).
func (f *Fabric) AllocMapped(n int) (fabric.Memory, error) { return f.AllocMemory(n) }
