package testfs

// A file with bad blocks, for tests of what a storage stack does when a
// disk cannot read a block: a FUSE file system of one file over a real
// one, whose reads of a block marked bad fail with EIO, as a disk's
// medium error reaches a program. A write to a bad block mends it (the
// disk remaps the sector), unless it is marked to fail writes too (a
// disk that has run out of spare sectors). This is the model of
// device-mapper's dust target, on a host whose kernel has FUSE and no
// device mapper.

import (
	"context"
	"fmt"
	"os"
	"sync"
	"syscall"
	"testing"

	"github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// BadBlockSize is the size of a block that can be marked bad.
const BadBlockSize = 4096

// BadFile is the file BadBlocks serves.
type BadFile struct {
	fs.Inode
	f *os.File

	mu sync.Mutex
	// bad maps a bad block to whether writes to it fail too.
	// +checklocks:mu
	bad map[int64]bool
	// readErrs and mended count the reads failed and the bad blocks a
	// write mended.
	// +checklocks:mu
	readErrs int
	// +checklocks:mu
	mended int
}

var (
	_ fs.NodeOpener    = (*BadFile)(nil)
	_ fs.NodeGetattrer = (*BadFile)(nil)
	_ fs.NodeReader    = (*BadFile)(nil)
	_ fs.NodeWriter    = (*BadFile)(nil)
	_ fs.NodeFsyncer   = (*BadFile)(nil)
	_ fs.NodeFlusher   = (*BadFile)(nil)
)

// BadBlocks serves backing, an existing file, as dir/name on a FUSE
// mount at dir, with no bad block yet, until the test ends (it skips the
// test where FUSE cannot be mounted).
func BadBlocks(t testing.TB, dir, name, backing string) *BadFile {
	t.Helper()
	f, err := os.OpenFile(backing, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	file := &BadFile{f: f, bad: map[int64]bool{}}
	root := &fs.Inode{}
	srv, err := fs.Mount(dir, root, &fs.Options{
		MountOptions: fuse.MountOptions{DirectMount: true, DirectMountStrict: true, FsName: "badblock", Name: "badblock",
			AllowOther: true},
		OnAdd: func(ctx context.Context) {
			root.AddChild(name, root.NewPersistentInode(ctx, file, fs.StableAttr{Mode: syscall.S_IFREG, Ino: 2}), true)
		},
	})
	if err != nil {
		f.Close()
		t.Skipf("no FUSE mount here (%v)", err)
	}
	// The test's own cleanups, registered after this, run before it:
	// whatever has the file open must be closed by then.
	t.Cleanup(func() {
		defer f.Close()
		if err := srv.Unmount(); err != nil {
			// Detached, not waited for: the file is still open.
			t.Errorf("unmounting %s: %v (the file is still open)", dir, err)
			syscall.Unmount(dir, syscall.MNT_DETACH)
			return
		}
		srv.Wait()
	})
	return file
}

// SetBad marks the block at off (a multiple of BadBlockSize) bad: reads of
// it fail with EIO until a write mends it; with failWrites, writes to it
// fail too, and it stays bad.
func (b *BadFile) SetBad(off int64, failWrites bool) {
	if off%BadBlockSize != 0 {
		panic(fmt.Sprintf("testfs: offset %d is not a block's", off))
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	b.bad[off/BadBlockSize] = failWrites
}

// Counts are the reads failed, the bad blocks mended by a write, and the
// blocks bad now.
func (b *BadFile) Counts() (readErrs, mended, bad int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.readErrs, b.mended, len(b.bad)
}

// Open opens it uncached: every read and write comes here.
func (b *BadFile) Open(ctx context.Context, flags uint32) (fs.FileHandle, uint32, syscall.Errno) {
	return nil, fuse.FOPEN_DIRECT_IO, 0
}

func (b *BadFile) Getattr(ctx context.Context, _ fs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	var st syscall.Stat_t
	if err := syscall.Fstat(int(b.f.Fd()), &st); err != nil {
		return fs.ToErrno(err)
	}
	out.FromStat(&st)
	out.Ino = 2
	return 0
}

// hitsLocked is the bad blocks [off, off+n) covers.
//
// +checklocks:b.mu
func (b *BadFile) hitsLocked(off int64, n int) []int64 {
	var out []int64
	for blk := off / BadBlockSize; blk*BadBlockSize < off+int64(n); blk++ {
		if _, ok := b.bad[blk]; ok {
			out = append(out, blk)
		}
	}
	return out
}

func (b *BadFile) Read(ctx context.Context, _ fs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	b.mu.Lock()
	if len(b.hitsLocked(off, len(dest))) > 0 {
		b.readErrs++
		b.mu.Unlock()
		return nil, syscall.EIO
	}
	b.mu.Unlock()
	n, err := b.f.ReadAt(dest, off)
	if err != nil && n == 0 {
		return fuse.ReadResultData(nil), 0 // past the end
	}
	return fuse.ReadResultData(dest[:n]), 0
}

func (b *BadFile) Write(ctx context.Context, _ fs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	b.mu.Lock()
	defer b.mu.Unlock()
	hits := b.hitsLocked(off, len(data))
	for _, blk := range hits {
		if b.bad[blk] {
			return 0, syscall.EIO
		}
	}
	n, err := b.f.WriteAt(data, off)
	if err != nil {
		return uint32(n), fs.ToErrno(err)
	}
	// A partial write of a bad block does not mend it: a disk remaps
	// the whole sector only when all of it is written.
	for _, blk := range hits {
		if off <= blk*BadBlockSize && (blk+1)*BadBlockSize <= off+int64(len(data)) {
			delete(b.bad, blk)
			b.mended++
		}
	}
	return uint32(n), 0
}

func (b *BadFile) Fsync(ctx context.Context, _ fs.FileHandle, flags uint32) syscall.Errno {
	return fs.ToErrno(b.f.Sync())
}

func (b *BadFile) Flush(ctx context.Context, _ fs.FileHandle) syscall.Errno { return 0 }
