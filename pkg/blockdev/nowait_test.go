package blockdev

import (
	"bytes"
	"errors"
	"os"
	"syscall"
	"testing"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// TestTryIOInMemory: on tmpfs every read and write runs at once, with the
// data and the errors of ReadAt and WriteAt.
func TestTryIOInMemory(t *testing.T) {
	b := open(t, sparseFile(t, "/dev/shm", 1<<20), Options{})
	if !b.InMemory() {
		t.Fatal("a tmpfs file is not reported in memory")
	}
	data := bytes.Repeat([]byte("nowait!!"), 512)
	if done, err := b.TryWriteAt(data, 8192); !done || err != nil {
		t.Fatalf("write: done %v err %v", done, err)
	}
	got := make([]byte, len(data))
	if done, err := b.TryReadAt(got, 8192); !done || err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read: done %v err %v equal %v", done, err, bytes.Equal(got, data))
	}
	// Out of range: done, with the error ReadAt and WriteAt give.
	if done, err := b.TryReadAt(got, 1<<20); !done || !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("read past the end: done %v err %v", done, err)
	}
	if done, err := b.TryWriteAt(data, 1<<20); !done || !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the end: done %v err %v", done, err)
	}
}

// TestTryIOOnDisk: on ext4 reads the page cache holds run at once, writes
// never do (they may wait for writeback), and O_DIRECT never runs inline.
func TestTryIOOnDisk(t *testing.T) {
	path := sparseFile(t, os.TempDir(), 1<<20)
	b := open(t, path, Options{})
	if b.InMemory() {
		t.Fatalf("a file in %s is reported in memory", os.TempDir())
	}
	data := bytes.Repeat([]byte("cached.."), 512)
	if done, _ := b.TryWriteAt(data, 4096); done {
		t.Fatal("a buffered write on disk ran inline")
	}
	if err := b.WriteAt(data, 4096, false); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(data))
	done, err := b.TryReadAt(got, 4096)
	if err != nil {
		t.Fatal(err)
	}
	if !b.nw.reads.Load() {
		t.Skipf("%s has no RWF_NOWAIT reads", os.TempDir())
	}
	if !done || !bytes.Equal(got, data) {
		t.Fatalf("cached read: done %v equal %v", done, bytes.Equal(got, data))
	}

	d, err := Open(path, Options{Direct: true})
	if err != nil {
		t.Skipf("O_DIRECT: %v", err)
	}
	defer d.Close()
	buf := tcp.AlignedBytes(4096)
	if done, _ := d.TryReadAt(buf, 4096); done {
		t.Fatal("an O_DIRECT read ran inline")
	}
}
