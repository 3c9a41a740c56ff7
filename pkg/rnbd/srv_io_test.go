package rnbd

import (
	"bytes"
	"context"
	"errors"
	"github.com/rnbd/rnbd/test/kit"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/test/testfs"
)

// TestIOSemantics checks flush, FUA, preflush, discard and write-zeroes
// against the file: holes, allocation and data.
func TestIOSemantics(t *testing.T) {
	for _, dir := range []string{os.TempDir(), "/dev/shm"} {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			sp, _ := os.MkdirTemp(dir, "rnbd-sem-")
			defer os.RemoveAll(sp)
			r := newSrig(t, SrvConfig{DevSearchPath: sp})
			path := r.file("f", 8<<20)
			x := r.dev(r.client("sem"), "f", AccessRW)
			data := bytes.Repeat([]byte{0x5a}, 64<<10)
			for _, flags := range []uint32{0, FFUA, FPreflush, FPreflush | FFUA, FSync} {
				if err := x.write(1<<20, data[:64<<10], flags); err != nil {
					t.Fatalf("write with flags %#x: %v", flags, err)
				}
			}
			for off := int64(2 << 20); off < 2<<20+256<<10; off += 64 << 10 {
				if err := x.write(off, data, FFUA); err != nil {
					t.Fatal(err)
				}
			}
			if err := x.op(OpFlush, 0, 0, 0); err != nil {
				t.Fatal(err)
			}
			// Discard: a hole that reads as zeros.
			if err := x.op(OpDiscard, 0, 2<<20, 64<<10); err != nil {
				t.Fatal(err)
			}
			if !testfs.IsHole(t, path, 2<<20) {
				t.Fatal("discard did not punch a hole")
			}
			got := x.readAll(2<<20, 128<<10)
			if !bytes.Equal(got[:64<<10], make([]byte, 64<<10)) || !bytes.Equal(got[64<<10:], data) {
				t.Fatal("discard changed the wrong bytes")
			}
			// Write zeroes with NOUNMAP keeps the blocks.
			before := testfs.Allocated(t, path)
			if err := x.op(OpWriteZeroes, FNoUnmap, 2<<20+64<<10, 64<<10); err != nil {
				t.Fatal(err)
			}
			if after := testfs.Allocated(t, path); after < before-8<<10 {
				t.Fatalf("write zeroes with NOUNMAP freed blocks: %d -> %d", before, after)
			}
			// Without it, the blocks may go, and here do.
			before = testfs.Allocated(t, path)
			if err := x.op(OpWriteZeroes, 0, 2<<20+128<<10, 64<<10); err != nil {
				t.Fatal(err)
			}
			if after := testfs.Allocated(t, path); after > before-48<<10 { // ext4 counts extent metadata blocks too
				t.Fatalf("write zeroes that may unmap: %d -> %d bytes allocated", before, after)
			}
			got = x.readAll(2<<20, 256<<10)
			if !bytes.Equal(got[:192<<10], make([]byte, 192<<10)) || !bytes.Equal(got[192<<10:], data) {
				t.Fatal("zeroed ranges read wrong")
			}
			if err := x.op(OpSecureErase, 0, 0, 4096); !errors.Is(err, syscall.EOPNOTSUPP) {
				t.Fatalf("secure erase of a file: %v", err)
			}
			// What reached the backend is counted: two preflushes and
			// the flush, six FUA writes, a discard, two write-zeroes.
			o := r.srv.OpenDevices()
			if len(o) != 1 || o[0].Flushes != 3 || o[0].FUAWrites != 6 || o[0].Discards != 1 || o[0].WriteZeroes != 2 {
				t.Fatalf("counters %+v", o)
			}
		})
	}
}

// TestWriteThroughExport: an export made write-through announces no write
// cache (so a kernel client never flushes it) and its writes, FUA or not,
// go through the O_DSYNC descriptor; flushes are still served.
func TestWriteThroughExport(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	p := r.file("wt.img", 1<<20)
	for _, e := range []Export{{Name: "wt", Path: p, WriteThrough: true}, {Name: "wb", Path: p}} {
		if err := r.srv.Map(e); err != nil {
			t.Fatal(err)
		}
	}
	c := r.client("wt")
	wt, wb := r.dev(c, "wt", AccessRO), r.dev(r.client("wb"), "wb", AccessRW)
	if cp := wb.d.Info().CachePolicy; cp != CacheWriteback|CacheFUA {
		t.Fatalf("default export: cache_policy %#x", cp)
	}
	// Read-only opens keep the export's policy too: what matters to a
	// client is whether the device it reads may lose writes.
	if cp := wt.d.Info().CachePolicy; cp != 0 {
		t.Fatalf("write-through export: cache_policy %#x, want 0", cp)
	}
	wb.d.Unmap(context.Background())
	rw := r.dev(r.client("wt-rw"), "wt", AccessRW)
	if cp := rw.d.Info().CachePolicy; cp != 0 {
		t.Fatalf("write-through export opened rw: cache_policy %#x, want 0", cp)
	}
	data := bytes.Repeat([]byte("through!"), 512)
	if err := rw.write(0, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := rw.op(OpFlush, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if onDisk, _ := os.ReadFile(p); !bytes.Equal(onDisk[:len(data)], data) {
		t.Fatal("the write did not land")
	}
	for _, o := range r.srv.OpenDevices() {
		if o.Name == "wt" && o.WriteCache {
			t.Fatalf("%+v reports a write cache", o)
		}
	}
}

// TestKernelClientMessages replays what the kernel's rnbd-clt sends
// (testdata/golden/kclt*.hex, from its source) byte for byte, in the RTRS
// direction it sends them, and checks what reaches the file. The kernel
// sends its flushes at sector (u64)-1 as RTRS reads without data; a server
// that refused them left a kernel client without fsync.
func TestKernelClientMessages(t *testing.T) {
	rec, logged := kit.LogRecorder()
	r := newSrig(t, SrvConfig{Log: rec})
	path := r.file("kdisk", 1<<20)
	c := r.client("kclt")
	x := r.dev(c, "kdisk", AccessRW)
	if id := x.d.Info().DeviceID; id != 1 {
		t.Fatalf("device id %d: the golden messages name device 1", id)
	}
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	s, buf := c.Session(), x.buf
	send := func(usr []byte, dir rtrs.Dir, n int) error {
		return s.Do(context.Background(), rtrs.IOCon, dir, usr, buf, 0, n)
	}
	counters := func() SessDevInfo {
		t.Helper()
		o := r.srv.OpenDevices()
		if len(o) != 1 {
			t.Fatalf("%d devices open", len(o))
		}
		return o[0]
	}
	fill := func(off int64, n int, b byte) []byte {
		t.Helper()
		d := bytes.Repeat([]byte{b}, n)
		if _, err := f.WriteAt(d, off); err != nil {
			t.Fatal(err)
		}
		return d
	}
	fileAt := func(off int64, n int) []byte {
		t.Helper()
		b := make([]byte, n)
		if _, err := f.ReadAt(b, off); err != nil {
			t.Fatal(err)
		}
		return b
	}

	want := fill(16*512, 4096, 0x3c)
	if err := send(kit.Golden(t, "kclt_read"), rtrs.Read, 4096); err != nil || !bytes.Equal(buf.Bytes()[:4096], want) {
		t.Fatalf("read: %v", err)
	}
	want = bytes.Repeat([]byte("journal!"), 512)
	copy(buf.Bytes(), want)
	if err := send(kit.Golden(t, "kclt_write_fua"), rtrs.Write, 4096); err != nil || !bytes.Equal(fileAt(24*512, 4096), want) {
		t.Fatalf("FUA write: %v", err)
	}
	flushes := []struct {
		name string
		dir  rtrs.Dir
	}{
		{"kclt_flush", rtrs.Read},
		{"kclt21_flush", rtrs.Read},
		{"kclt21_write_preflush_empty", rtrs.Write},
		{"kclt_write_preflush_empty", rtrs.Write},
	}
	for _, fl := range flushes {
		if err := send(kit.Golden(t, fl.name), fl.dir, 0); err != nil {
			t.Fatalf("%s: %v", fl.name, err)
		}
	}
	if c := counters(); c.Flushes != uint64(len(flushes)) || c.FUAWrites != 1 {
		t.Fatalf("after the flushes: %d flushes, %d FUA writes; want %d and 1", c.Flushes, c.FUAWrites, len(flushes))
	}
	const end = 1<<20 - 64<<10
	zeros := make([]byte, 64<<10)
	fill(end-64<<10, 128<<10, 0xee)
	if err := send(kit.Golden(t, "kclt_discard_end"), rtrs.Write, 0); err != nil {
		t.Fatalf("discard: %v", err)
	}
	if !bytes.Equal(fileAt(end, 64<<10), zeros) || !testfs.IsHole(t, path, end) || fileAt(end-1, 1)[0] != 0xee {
		t.Fatal("the discard did not punch exactly the last 64 KiB")
	}
	fill(end, 64<<10, 0xee)
	if err := send(kit.Golden(t, "kclt_write_zeroes_end"), rtrs.Write, 0); err != nil || !bytes.Equal(fileAt(end, 64<<10), zeros) {
		t.Fatalf("write zeroes: %v", err)
	}
	fill(end, 64<<10, 0xee)
	if err := send(kit.Golden(t, "kclt22_write_zeroes_nounmap"), rtrs.Write, 0); err != nil || !bytes.Equal(fileAt(end, 64<<10), zeros) {
		t.Fatalf("write zeroes with NOUNMAP: %v", err)
	}
	if testfs.IsHole(t, path, end) {
		t.Fatal("write zeroes with NOUNMAP deallocated")
	}
	if c := counters(); c.Discards != 1 || c.WriteZeroes != 2 {
		t.Fatalf("counters %+v", c)
	}
	for _, e := range logged() {
		if e.Level <= log.WarnLevel {
			t.Errorf("logged at %v: %s %v", e.Level, e.Message, e.Data)
		}
	}

	// What no kernel sends is refused, with the errno and a log line
	// that says why.
	patch := func(name string, rw uint32, sector uint64) []byte {
		b := kit.Golden(t, name)
		le.PutUint32(b[16:], rw)
		if sector != 0 {
			le.PutUint64(b[8:], sector)
		}
		return b
	}
	for _, c := range []struct {
		name string
		usr  []byte
		dir  rtrs.Dir
		n    int
		want syscall.Errno
		why  string
	}{
		{"flush with data", kit.Golden(t, "kclt_flush"), rtrs.Write, 512, syscall.EINVAL, "carries none"},
		{"flush with an unknown flag", patch("kclt_flush", 0x302|1<<16, 0), rtrs.Read, 0, syscall.EINVAL, "unknown flags 0x10000"},
		{"FUA read", patch("kclt_read", 0x300, 0), rtrs.Read, 4096, syscall.EINVAL, "READ with flags FUA"},
		{"NOUNMAP on a write", patch("kclt_write_fua", 0x801, 0), rtrs.Write, 4096, syscall.EINVAL, "WRITE with flags NOUNMAP"},
		{"read as an RTRS write", kit.Golden(t, "kclt_read"), rtrs.Write, 4096, syscall.EINVAL, "READ as an RTRS write"},
		{"discard straddling the end", patch("kclt_discard_end", 3, 1984), rtrs.Write, 0, syscall.ENOSPC, "runs past the end"},
		{"read beyond the device", patch("kclt_read", 0x100, 1<<40), rtrs.Read, 4096, syscall.EINVAL, "beyond the device"},
	} {
		before := len(logged())
		if err := send(c.usr, c.dir, c.n); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
			continue
		}
		var line *log.Entry
		for _, e := range logged()[before:] {
			if e.Level == log.WarnLevel && strings.Contains(e.Message, c.why) {
				line = e
			}
		}
		if line == nil || line.Data["session"] != "kclt" || line.Data["device"] != "kdisk" || line.Data["op"] == nil {
			t.Errorf("%s: no warning saying %q with the session, device and op: %v", c.name, c.why, logged()[before:])
		}
	}

	// A flush on a read-only open is allowed (as the block layer allows
	// it on a read-only disk); a discard is not.
	ro := r.dev(r.client("kclt-ro"), "kdisk", AccessRO)
	if ro.d.Info().DeviceID != 1 {
		t.Fatalf("device id %d", ro.d.Info().DeviceID)
	}
	rs := ro.d.s.Session()
	if err := rs.Do(context.Background(), rtrs.IOCon, rtrs.Read, kit.Golden(t, "kclt_flush"), nil, 0, 0); err != nil {
		t.Fatalf("flush on a read-only open: %v", err)
	}
	if err := rs.Do(context.Background(), rtrs.IOCon, rtrs.Write, kit.Golden(t, "kclt_discard_end"), nil, 0, 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("discard on a read-only open: %v, want EROFS", err)
	}
}

// TestPastTheEnd: IO beyond the device fails whole and the file does not
// grow.
func TestPastTheEnd(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	path := r.file("small", 1<<20)
	x := r.dev(r.client("end"), "small", AccessRW)
	read := func(off int64, n int) error { _, err := x.read(off, n); return err }
	// Whatever writes gets ENOSPC past the end, whether it starts inside
	// the device, at its end or beyond it (a forced shrink, or a kernel
	// client's resize beyond the export, sends those); a read gets
	// EINVAL. docs/server.md and docs/protocol.md say so.
	for _, c := range []struct {
		name string
		err  error
		want syscall.Errno
	}{
		{"write straddling", x.write(1<<20-4096, make([]byte, 8192), 0), syscall.ENOSPC},
		{"write at the end", x.write(1<<20, make([]byte, 4096), 0), syscall.ENOSPC},
		{"write starting past the end", x.write(1<<20+4096, make([]byte, 4096), 0), syscall.ENOSPC},
		{"FUA write starting past the end", x.write(2<<20, make([]byte, 512), FFUA), syscall.ENOSPC},
		{"read straddling", read(1<<20-512, 1024), syscall.EINVAL},
		{"read starting past the end", read(1<<20+4096, 4096), syscall.EINVAL},
		{"discard at the end", x.op(OpDiscard, 0, 1<<20, 4096), syscall.ENOSPC},
		{"discard starting past the end", x.op(OpDiscard, 0, 1<<21, 4096), syscall.ENOSPC},
		{"zeroes straddling", x.op(OpWriteZeroes, 0, 1<<20-512, 4096), syscall.ENOSPC},
		{"zeroes at a sector beyond any size", x.op(OpWriteZeroes, 0, 1<<40, 512), syscall.ENOSPC},
	} {
		if !errors.Is(c.err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, c.err, c.want)
		}
	}
	if st, _ := os.Stat(path); st.Size() != 1<<20 {
		t.Fatalf("file grew to %d", st.Size())
	}
}

// TestHostileMessages: malformed RNBD messages get an errno and never
// crash the server or disturb a well-behaved device.
func TestHostileMessages(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("good", 1<<20)
	c := r.client("h")
	good := r.dev(c, "good", AccessRW)
	s := c.Session()
	buf, _ := s.AllocBuffer(1 << 16)
	ioMsg := func(m IO, n int) []byte { return m.Encode(make([]byte, IOSize))[:n] }
	open := (&Open{AccessMode: AccessRO, DevName: "good"}).Encode(make([]byte, OpenSize))
	unterminated := append([]byte(nil), open...)
	for i := 6; i < 6+255; i++ {
		unterminated[i] = 'a'
	}
	id := good.d.Info().DeviceID
	for _, c := range []struct {
		name string
		dir  rtrs.Dir
		usr  []byte
		n    int
		want syscall.Errno
	}{
		{"short header", rtrs.Write, []byte{4, 0}, 0, syscall.EINVAL},
		{"unknown type", rtrs.Write, []byte{9, 0, 0, 0}, 0, syscall.EINVAL},
		{"server-to-client type", rtrs.Write, (&SessInfo{Ver: 2}).Encode(make([]byte, 36), MsgSessInfoRsp), 0, syscall.EINVAL},
		{"short sess info", rtrs.Read, []byte{0, 0, 0, 0, 2}, 36, syscall.EINVAL},
		{"sess info without room for the answer", rtrs.Read, (&SessInfo{Ver: 2}).Encode(make([]byte, 36), MsgSessInfo), 8, syscall.EINVAL},
		{"open as a write", rtrs.Write, open, 0, syscall.EINVAL},
		{"open without room for the answer", rtrs.Read, open, 16, syscall.EINVAL},
		{"open with an unterminated name", rtrs.Read, unterminated, 56, syscall.EINVAL},
		{"short open", rtrs.Read, open[:100], 56, syscall.EINVAL},
		{"io with an unknown op", rtrs.Write, ioMsg(IO{DeviceID: id, RW: 9}, 32), 0, syscall.EINVAL},
		{"io with unknown flags", rtrs.Write, ioMsg(IO{DeviceID: id, RW: 2 | 1<<20}, 32), 0, syscall.EINVAL},
		{"io for an unknown device", rtrs.Write, ioMsg(IO{DeviceID: 999, RW: uint32(OpFlush)}, 32), 0, syscall.ENOTCONN},
		{"io too short", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpFlush)}, 20), 0, syscall.EINVAL},
		{"read longer than its data", rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 8192}, 32), 4096, syscall.EINVAL},
		{"write shorter than its data", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpWrite), Size: 512}, 32), 4096, syscall.EINVAL},
		{"read sent as a write", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 4096}, 32), 4096, syscall.EINVAL},
		{"discard with data", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpDiscard), Size: 4096}, 32), 4096, syscall.EINVAL},
		{"unaligned read", rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 100}, 32), 100, syscall.EINVAL},
		// Past the end, however far: ENOSPC for what writes, EINVAL for a read.
		{"sector that overflows", rtrs.Write, ioMsg(IO{DeviceID: id, RW: uint32(OpDiscard), Sector: 1 << 62, Size: 512}, 32), 0, syscall.ENOSPC},
		{"read at a sector that overflows", rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Sector: 1 << 62, Size: 512}, 32), 512, syscall.EINVAL},
	} {
		err := s.Do(context.Background(), rtrs.IOCon, c.dir, c.usr, buf, 0, c.n)
		if !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", c.name, err, c.want)
		}
	}
	// A close of an id that is not open is harmless.
	if err := s.Do(context.Background(), rtrs.AdminCon, rtrs.Write, (&Close{DeviceID: 12345}).Encode(make([]byte, 8)), nil, 0, 0); err != nil {
		t.Fatalf("close of an unknown id: %v", err)
	}
	// The well-behaved device still works, and a 24-byte IO (no prio) too.
	data := bytes.Repeat([]byte("ok"), 2048)
	if err := good.write(0, data, 0); err != nil {
		t.Fatal(err)
	}
	if err := s.Do(context.Background(), rtrs.IOCon, rtrs.Read, ioMsg(IO{DeviceID: id, RW: uint32(OpRead), Size: 4096}, 24), buf, 0, 4096); err != nil {
		t.Fatalf("24-byte io: %v", err)
	}
	if !bytes.Equal(buf.Bytes()[:4096], data) {
		t.Fatal("read back")
	}
}

// TestInlineIO: on tmpfs, plain reads and writes are answered on the
// receive path, with the same data and errors as on the workers; FUA
// writes, flushes and writes to a read-only device still go to them.
func TestInlineIO(t *testing.T) {
	dir, err := os.MkdirTemp("/dev/shm", "rnbd-inline-")
	if err != nil {
		t.Skip(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	r := newSrig(t, SrvConfig{DevSearchPath: dir})
	path := r.file("mem", 1<<20)
	c := r.client("inline")
	x := r.dev(c, "mem", AccessRW)
	data := bytes.Repeat([]byte("inline.."), 8192) // 64 KiB
	if err := x.write(8192, data, 0); err != nil {
		t.Fatal(err)
	}
	if got, err := x.read(8192, len(data)); err != nil || !bytes.Equal(got, data) {
		t.Fatalf("read back: %v", err)
	}
	if onDisk, _ := os.ReadFile(path); !bytes.Equal(onDisk[8192:8192+len(data)], data) {
		t.Fatal("the file does not hold what was written")
	}
	if n := r.srv.inline.Load(); n != 2 {
		t.Fatalf("%d IOs answered inline, want the write and the read", n)
	}
	if n := r.srv.lent.Load(); n != 1 {
		t.Fatalf("%d reads sent from the file's mapping, want the read of 64 KiB", n)
	}
	if err := x.write(0, data[:4096], FFUA); err != nil {
		t.Fatal(err)
	}
	if err := x.op(OpFlush, 0, 0, 0); err != nil {
		t.Fatal(err)
	}
	if err := x.write(1<<20-4096, make([]byte, 8192), 0); !errors.Is(err, syscall.ENOSPC) {
		t.Fatalf("write past the end: %v, want ENOSPC", err)
	}
	if n := r.srv.inline.Load(); n != 2 {
		t.Fatalf("%d IOs answered inline, want 2: FUA, flush and the refused write past the end go to the workers", n)
	}
	ro := r.dev(r.client("inline-ro"), "mem", AccessRO)
	if err := ro.write(0, data[:4096], 0); !errors.Is(err, syscall.EROFS) {
		t.Fatalf("write to a read-only device: %v, want EROFS", err)
	}
	if got, err := ro.read(8192, 4096); err != nil || !bytes.Equal(got, data[:4096]) {
		t.Fatalf("read-only read: %v", err)
	}
	if got, err := ro.read(8192, len(data)); err != nil || !bytes.Equal(got, data) || r.srv.lent.Load() != 2 {
		t.Fatalf("read-only read of 64 KiB: %v, %d sent from the mapping", err, r.srv.lent.Load())
	}
	// Closed by both sessions, the file is mapped no more: no answer
	// sent from its mapping kept it.
	for _, d := range []*dio{x, ro} {
		if err := d.d.Unmap(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	kit.WaitFor(t, 10*time.Second, "the file unmapped", func() bool {
		maps, err := os.ReadFile("/proc/self/maps")
		return err == nil && !bytes.Contains(maps, []byte(path))
	})
}

// FuzzAdmit: whatever IO message and RTRS request a peer sends, the
// server either refuses it with an errno and a reason, or admits a range
// that lies inside the device, aligned, with the chunk's data matching.
func FuzzAdmit(f *testing.F) {
	for _, n := range []string{"kclt_read", "kclt_write_fua", "kclt_flush", "kclt21_flush", "kclt_write_preflush_empty",
		"kclt_discard_end", "kclt_write_zeroes_end", "kclt22_write_zeroes_nounmap", "io"} {
		b, err := kit.GoldenHex(n)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(b, false, 0, false)
		f.Add(b, true, 4096, true)
	}
	p := filepath.Join(f.TempDir(), "d")
	if err := os.WriteFile(p, nil, 0o644); err != nil {
		f.Fatal(err)
	}
	if err := os.Truncate(p, 1<<20); err != nil {
		f.Fatal(err)
	}
	be, err := blockdev.Open(p, blockdev.Options{LogicalBlockSize: 4096})
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { be.Close() })
	f.Fuzz(func(t *testing.T, b []byte, read bool, dataLen int, ro bool) {
		var m IO
		if m.Decode(b) != nil {
			return
		}
		dir := rtrs.Write
		if read {
			dir = rtrs.Read
		}
		d := &SrvSessDev{backend: be, readonly: ro}
		off, n, r := d.admit(&m, dir, dataLen)
		if r != nil {
			if r.errno == 0 || r.why == "" {
				t.Fatalf("refusal without errno or reason: %+v", r)
			}
			return
		}
		rule := ioRules[m.Op()]
		if (rule.write && ro) || m.Flags()&^rule.flags != 0 || (rule.data && dataLen != int(m.Size)) || (!rule.data && dataLen != 0) {
			t.Fatalf("admitted %+v dir %v data %d ro %v", m, dir, dataLen, ro)
		}
		if off < 0 || n < 0 || off+n > be.Size() || off%4096 != 0 || n%4096 != 0 || (n > 0 && n != int64(m.Size)) {
			t.Fatalf("admitted range %d+%d of %+v", off, n, m)
		}
	})
}
