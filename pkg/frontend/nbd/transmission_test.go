// Tests of transmission: reads and writes, the errnos of refused and
// failed requests, replies out of order, DISC and the in-flight limit.

package nbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"syscall"
	"testing"
)

func TestReadWrite(t *testing.T) {
	for _, async := range []bool{false, true} {
		t.Run(fmt.Sprint("async=", async), func(t *testing.T) {
			const size = 4 << 20
			st := newStore(size)
			st.async = async
			_, addr := startServer(t, Options{}, &Export{Name: "a", Size: size, Flush: true, FUA: true,
				Trim: true, WriteZeroes: true, Backend: st})
			c := connect(t, addr, "a")
			want := pattern(0, size)
			w := func(flags uint16, off, n int) {
				t.Helper()
				p := bytes.Repeat([]byte{byte(off), byte(n), 0x5a}, n/3+1)[:n]
				c.mustDo(uint16(CmdWrite), flags, uint64(off), uint32(n), p)
				copy(want[off:], p)
			}
			w(0, 0, 4096)
			w(0, 1, 1)
			w(cmdFlagFUA, 4095, 2)
			w(0, 12345, 3<<20/2)
			w(0, size-1000, 1000)
			w(0, 1<<20, 0)
			c.mustDo(uint16(CmdTrim), 0, 8192, 4096, nil)
			clear(want[8192 : 8192+4096])
			c.mustDo(uint16(CmdWriteZeroes), cmdFlagNoHole|cmdFlagFUA, 3<<20, 100000, nil)
			clear(want[3<<20 : 3<<20+100000])
			c.mustDo(uint16(CmdFlush), 0, 0, 0, nil)
			for _, r := range [][2]int{{0, 8192}, {4094, 3}, {12000, 2 << 20}, {size - 4096, 4096}, {size, 0}, {0, size}} {
				if got := c.mustRead(uint64(r[0]), uint32(r[1])); !bytes.Equal(got, want[r[0]:r[0]+r[1]]) {
					t.Fatalf("read %d@%d: wrong data", r[1], r[0])
				}
			}
			data, ops, _ := st.snapshot()
			if !bytes.Equal(data, want) {
				t.Fatal("the backend holds the wrong data")
			}
			// Zero-length reads and writes are answered without the backend.
			wantOps := []op{
				{Cmd: CmdWrite, Offset: 0, Length: 4096},
				{Cmd: CmdWrite, Offset: 1, Length: 1},
				{Cmd: CmdWrite, FUA: true, Offset: 4095, Length: 2},
				{Cmd: CmdWrite, Offset: 12345, Length: 3 << 20 / 2},
				{Cmd: CmdWrite, Offset: size - 1000, Length: 1000},
				{Cmd: CmdTrim, Offset: 8192, Length: 4096},
				{Cmd: CmdWriteZeroes, FUA: true, NoHole: true, Offset: 3 << 20, Length: 100000},
				{Cmd: CmdFlush},
				{Cmd: CmdRead, Offset: 0, Length: 8192},
				{Cmd: CmdRead, Offset: 4094, Length: 3},
				{Cmd: CmdRead, Offset: 12000, Length: 2 << 20},
				{Cmd: CmdRead, Offset: size - 4096, Length: 4096},
				{Cmd: CmdRead, Offset: 0, Length: size},
			}
			if !slices.Equal(ops, wantOps) {
				t.Fatalf("backend ops\n%+v\nwant\n%+v", ops, wantOps)
			}
			c.disc()
			c.expectClosed()
		})
	}
}

// TestCheckErrnos sends every request that the server must refuse, each
// followed by a read that must still work: refused writes must have their
// payload consumed. Each payload is itself a valid request, which the
// server would answer if it took it for one.
func TestCheckErrnos(t *testing.T) {
	const size = 1 << 20
	exps := map[string]*Export{
		"rw":    {Name: "rw", Size: size, Flush: true, Trim: true, WriteZeroes: true, MaxPayload: 64 << 10},
		"ro":    {Name: "ro", Size: size, ReadOnly: true, Trim: true, WriteZeroes: true},
		"plain": {Name: "plain", Size: size},
		"al":    {Name: "al", Size: size, MinBlock: 512, Trim: true},
	}
	var list []*Export
	for _, e := range exps {
		e.Backend = newStore(size)
		list = append(list, e)
	}
	_, addr := startServer(t, Options{}, list...)
	conns := map[string]*client{}
	for name := range exps {
		conns[name] = connect(t, addr, name)
	}
	const (
		read   = uint16(CmdRead)
		write  = uint16(CmdWrite)
		flush  = uint16(CmdFlush)
		trim   = uint16(CmdTrim)
		zeroes = uint16(CmdWriteZeroes)
	)
	for _, tc := range []struct {
		name  string
		exp   string
		typ   uint16
		flags uint16
		off   uint64
		n     uint32
		want  uint32
	}{
		{"write-read-only", "ro", write, 0, 0, 4096, nbdEPERM},
		{"write-fua-read-only", "ro", write, cmdFlagFUA, 512, 100, nbdEPERM},
		{"trim-read-only", "ro", trim, 0, 0, 4096, nbdEPERM},
		{"zeroes-read-only", "ro", zeroes, 0, 0, 4096, nbdEPERM},
		{"write-read-only-past-end", "ro", write, 0, size, 512, nbdEPERM},
		{"read-past-end", "rw", read, 0, size - 100, 200, nbdEINVAL},
		{"read-beyond-end", "rw", read, 0, size + 4096, 0, nbdEINVAL},
		{"read-offset-overflow", "rw", read, 0, 1<<64 - 256, 512, nbdEINVAL},
		{"write-past-end", "rw", write, 0, size - 100, 200, nbdENOSPC},
		{"write-beyond-end", "rw", write, 0, size + 1, 1, nbdENOSPC},
		{"write-offset-overflow", "rw", write, 0, 1<<64 - 256, 512, nbdENOSPC},
		{"trim-past-end", "rw", trim, 0, size - 4096, 8192, nbdENOSPC},
		{"zeroes-past-end", "rw", zeroes, 0, size, 1, nbdENOSPC},
		{"unknown-cmd-5", "rw", 5, 0, 0, 512, nbdEINVAL},
		{"block-status", "rw", 7, 0, 0, 512, nbdEINVAL},
		{"unknown-cmd-ffff", "rw", 0xffff, 0, 0, 512, nbdEINVAL},
		{"read-flag-df", "rw", read, 1 << 2, 0, 512, nbdEINVAL},
		{"write-flag-15", "rw", write, 1 << 15, 0, 512, nbdEINVAL},
		{"read-fua", "rw", read, cmdFlagFUA, 0, 512, nbdEINVAL},
		{"write-nohole", "rw", write, cmdFlagNoHole, 0, 512, nbdEINVAL},
		{"trim-nohole", "rw", trim, cmdFlagNoHole, 0, 512, nbdEINVAL},
		{"flush-unsupported", "ro", flush, 0, 0, 0, nbdEINVAL},
		{"trim-unsupported", "plain", trim, 0, 0, 4096, nbdEINVAL},
		{"zeroes-unsupported", "plain", zeroes, 0, 0, 4096, nbdEINVAL},
		{"read-over-max-payload", "rw", read, 0, 0, 64<<10 + 512, nbdEINVAL},
		{"read-huge", "plain", read, 0, 0, 0xffffffff, nbdEINVAL},
		{"read-misaligned-offset", "al", read, 0, 100, 512, nbdEINVAL},
		{"read-misaligned-length", "al", read, 0, 512, 100, nbdEINVAL},
		{"write-misaligned", "al", write, 0, 512, 1000, nbdEINVAL},
		{"trim-misaligned", "al", trim, 0, 1, 512, nbdEINVAL},
	} {
		t.Run(tc.name, func(t *testing.T) {
			c := conns[tc.exp]
			st := exps[tc.exp].Backend.(*storeBackend)
			_, before, _ := st.snapshot()
			var payload []byte
			if Cmd(tc.typ) == CmdWrite {
				// Requests that would read 7 bytes from offset 0.
				for len(payload) < int(tc.n) {
					payload = appendRequest(payload, read, 0, 0xbad, 0, 7, nil)
				}
				payload = payload[:tc.n]
			}
			if errno, data := c.do(tc.typ, tc.flags, tc.off, tc.n, payload); errno != tc.want || data != nil {
				t.Fatalf("errno %d (data %d bytes), want %d", errno, len(data), tc.want)
			}
			if !bytes.Equal(c.mustRead(4096, 4096), pattern(4096, 4096)) {
				t.Fatal("read after the error: wrong data")
			}
			// The refused request never reached the backend.
			if _, after, _ := st.snapshot(); len(after) != len(before)+1 {
				t.Fatalf("backend ops %+v after %+v", after, before)
			}
		})
	}
	for name, c := range conns {
		if data, _, _ := exps[name].Backend.(*storeBackend).snapshot(); !bytes.Equal(data, pattern(0, size)) {
			t.Errorf("export %s was modified", name)
		}
		c.disc()
		c.expectClosed()
	}
}

func TestBackendErrnos(t *testing.T) {
	st := newStore(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Flush: true, Backend: st})
	c := connect(t, addr, "a")
	for _, tc := range []struct {
		err  error
		want uint32
	}{
		{syscall.EPERM, nbdEPERM},
		{syscall.EROFS, nbdEPERM},
		{syscall.EACCES, nbdEPERM},
		{syscall.EIO, nbdEIO},
		{syscall.ENOMEM, nbdENOMEM},
		{syscall.EINVAL, nbdEINVAL},
		{syscall.ENOSPC, nbdENOSPC},
		{syscall.EFBIG, nbdENOSPC},
		{syscall.EOVERFLOW, nbdEOVERFLOW},
		{syscall.EOPNOTSUPP, nbdENOTSUP},
		{syscall.ENOTSUP, nbdENOTSUP},
		{syscall.ESHUTDOWN, nbdESHUTDOWN},
		{syscall.ENOENT, nbdEIO},
		{syscall.EAGAIN, nbdEIO},
		{fmt.Errorf("wrapped: %w", syscall.ENOSPC), nbdENOSPC},
		{errors.New("opaque"), nbdEIO},
		{context.Canceled, nbdEIO},
	} {
		for _, cmd := range []Cmd{CmdRead, CmdWrite, CmdFlush} {
			st.set(func(s *storeBackend) { s.submitErr = tc.err })
			var payload []byte
			if cmd == CmdWrite {
				payload = appendRequest(nil, uint16(CmdRead), 0, 0xbad, 0, 7, nil)[:16]
			}
			n := uint32(len(payload))
			if cmd == CmdRead {
				n = 4096
			}
			if cmd == CmdFlush {
				n = 0
			}
			if errno, _ := c.do(uint16(cmd), 0, 0, n, payload); errno != tc.want {
				t.Errorf("%v on command %d: errno %d, want %d", tc.err, cmd, errno, tc.want)
			}
		}
	}
	st.set(func(s *storeBackend) { s.submitErr = nil })
	if !bytes.Equal(c.mustRead(0, 4096), pattern(0, 4096)) {
		t.Fatal("wrong data")
	}
}

// TestBufferFailure: when the backend has no memory the request fails
// with ENOMEM, and a write's payload is skipped.
func TestBufferFailure(t *testing.T) {
	st := newStore(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: st})
	c := connect(t, addr, "a")
	st.set(func(s *storeBackend) { s.bufErr = errors.New("no memory") })
	payload := appendRequest(nil, uint16(CmdRead), 0, 0xbad, 0, 7, nil)
	if errno, _ := c.do(uint16(CmdWrite), 0, 0, uint32(len(payload)), payload); errno != nbdENOMEM {
		t.Fatalf("write: errno %d", errno)
	}
	if errno, _ := c.do(uint16(CmdRead), 0, 0, 512, nil); errno != nbdENOMEM {
		t.Fatalf("read: errno %d", errno)
	}
	st.set(func(s *storeBackend) { s.bufErr = nil })
	if !bytes.Equal(c.mustRead(0, 4096), pattern(0, 4096)) {
		t.Fatal("wrong data")
	}
	if _, ops, _ := st.snapshot(); len(ops) != 1 {
		t.Fatalf("backend ops %+v", ops)
	}
}

// TestOutOfOrder: a backend completes a pipeline of reads and writes in
// reverse; the replies come in that order, each cookie exactly once.
func TestOutOfOrder(t *testing.T) {
	const n = 32
	hb := newHold(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: hb})
	c := connect(t, addr, "a")
	var reqs []byte
	for i := range n {
		off := uint64(i) * 8192
		if i%2 == 0 {
			reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(1000+i), off, 4096, nil)
		} else {
			reqs = appendRequest(reqs, uint16(CmdWrite), 0, uint64(1000+i), off, 4096, bytes.Repeat([]byte{byte(i)}, 4096))
		}
	}
	c.write(reqs)
	hs := hb.take(t, n)
	for i, h := range hs {
		if h.r.Offset != int64(i)*8192 {
			t.Fatalf("request %d submitted at %d", i, h.r.Offset)
		}
	}
	for i := n - 1; i >= 0; i-- {
		hb.finish(hs[i])
	}
	seen := map[uint64]bool{}
	for k := range n {
		errno, cookie := c.reply()
		i := int(cookie) - 1000
		if errno != 0 || i < 0 || i >= n || seen[cookie] {
			t.Fatalf("reply %d: errno %d cookie %d (seen %v)", k, errno, cookie, seen[cookie])
		}
		seen[cookie] = true
		if i != n-1-k {
			t.Errorf("reply %d for request %d, want the reverse of completion", k, i)
		}
		if i%2 == 0 {
			if got := c.readFull(4096); !bytes.Equal(got, pattern(i*8192, 4096)) {
				t.Fatalf("request %d: wrong data", i)
			}
		}
	}
	// Nothing more was sent, and the writes landed.
	hb.passThrough()
	for i := 1; i < n; i += 2 {
		if got := c.mustRead(uint64(i)*8192, 4096); !bytes.Equal(got, bytes.Repeat([]byte{byte(i)}, 4096)) {
			t.Fatalf("write %d: wrong data", i)
		}
	}
}

// TestDiscDrains: writes in flight when DISC arrives are all answered
// before the server closes.
func TestDiscDrains(t *testing.T) {
	for _, inflight := range []int{128, 4} {
		t.Run(fmt.Sprint("inflight=", inflight), func(t *testing.T) {
			const n = 16
			hb := newHold(1 << 20)
			_, addr := startServer(t, Options{MaxInflight: inflight}, &Export{Name: "a", Size: 1 << 20, Backend: hb})
			c := connect(t, addr, "a")
			var reqs []byte
			for i := range n {
				reqs = appendRequest(reqs, uint16(CmdWrite), 0, uint64(i), uint64(i)*4096, 4096, bytes.Repeat([]byte{byte(i + 1)}, 4096))
			}
			reqs = appendRequest(reqs, cmdDisc, 0, 99, 0, 0, nil)
			// Requests after DISC are ignored.
			reqs = appendRequest(reqs, uint16(CmdRead), 0, 100, 0, 4096, nil)
			c.write(reqs)
			if inflight >= n {
				// Hold all until the stream, DISC included, is sent.
				hs := hb.take(t, n)
				for i := n - 1; i >= 0; i-- {
					hb.finish(hs[i])
				}
			} else {
				for range n {
					hb.finish(hb.take(t, 1)[0])
				}
			}
			seen := map[uint64]bool{}
			for range n {
				errno, cookie := c.reply()
				if errno != 0 || cookie >= n || seen[cookie] {
					t.Fatalf("errno %d cookie %d", errno, cookie)
				}
				seen[cookie] = true
			}
			c.expectClosed()
			data, ops, _ := hb.snapshot()
			if len(ops) != n {
				t.Fatalf("backend saw %d requests", len(ops))
			}
			for i := range n {
				if !bytes.Equal(data[i*4096:(i+1)*4096], bytes.Repeat([]byte{byte(i + 1)}, 4096)) {
					t.Fatalf("write %d did not land", i)
				}
			}
		})
	}
}

// TestInflightLimit: the backend never has more than MaxInflight requests.
func TestInflightLimit(t *testing.T) {
	const limit, n = 3, 30
	hb := newHold(1 << 20)
	_, addr := startServer(t, Options{MaxInflight: limit}, &Export{Name: "a", Size: 1 << 20, Backend: hb})
	c := connect(t, addr, "a")
	var reqs []byte
	for i := range n {
		reqs = appendRequest(reqs, uint16(CmdRead), 0, uint64(i), uint64(i)*512, 512, nil)
	}
	c.write(reqs)
	for done := 0; done < n; done += limit {
		hs := hb.take(t, limit)
		if extra := len(hb.ch); extra != 0 {
			t.Fatalf("%d requests beyond the limit of %d", extra, limit)
		}
		for _, h := range hs {
			hb.finish(h)
		}
	}
	for range n {
		errno, cookie := c.reply()
		if errno != 0 {
			t.Fatalf("errno %d", errno)
		}
		if got := c.readFull(512); !bytes.Equal(got, pattern(int(cookie)*512, 512)) {
			t.Fatalf("request %d: wrong data", cookie)
		}
	}
}
