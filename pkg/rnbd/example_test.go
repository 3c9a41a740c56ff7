package rnbd_test

import (
	"context"
	"fmt"
	"net/netip"
	"os"
	"path/filepath"
	"time"

	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// The examples without an Output line need a server they cannot have:
// they are compiled, not run. Example runs both ends on the loopback.

// A client session to the server at 10.0.0.1 over TCP, from 10.0.0.2: one
// path, and IO that finds no path waits for one up to the default
// no_path_timeout.
func ExampleDialSession() {
	ctx := context.Background()
	cfg := rtrs.DefaultCltConfig()
	cfg.SessName = "client1@server1"
	cfg.Fabric = tcp.New(tcp.Options{})
	p, err := rtrs.ParsePathAddr("ip:10.0.0.2@ip:10.0.0.1", rtrs.DefaultPort)
	if err != nil {
		fmt.Println(err)
		return
	}
	cfg.Paths = []rtrs.PathAddr{p}
	s, err := rnbd.DialSession(ctx, cfg, rnbd.DefaultNoPathTimeout)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	fmt.Println("protocol version", s.Version())
}

// sess is a session DialSession opened.
var sess *rnbd.CltSession

// Map opens a device the server exports (or finds under its
// dev_search_path) for reading and writing.
func ExampleCltSession_Map() {
	d, err := sess.Map(context.Background(), "vol", rnbd.AccessRW)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Println(d.Name(), d.Size(), "bytes, blocks of", d.Info().LogicalBlockSize)
}

// dev is a device Map opened.
var dev *rnbd.CltDev

// Submit starts a request and returns; Done tells when it is over. The
// data travels in memory the session registered (AllocBuffer), here
// written at the device's first 4 KiB.
func ExampleCltDev_Submit() {
	buf, err := dev.Session().Session().AllocBuffer(4096)
	if err != nil {
		fmt.Println(err)
		return
	}
	copy(buf.Bytes(), "hello")
	done := make(chan error, 1)
	r := &rnbd.IOReq{Op: rnbd.OpWrite, Off: 0, Len: 4096, Buf: buf, BufOff: 0,
		Done: func(_ *rnbd.IOReq, err error) { done <- err }}
	if err := dev.Submit(context.Background(), r); err != nil {
		fmt.Println(err) // an invalid request: Done is not called
		return
	}
	fmt.Println("written:", <-done)
}

// The server: an RNBD server is the handler of an RTRS server, which
// must be closed first. It serves an explicit export, and every file
// beneath /srv/rnbd by its name there.
func ExampleNewServer() {
	srv := rnbd.NewServer(rnbd.SrvConfig{DevSearchPath: "/srv/rnbd"})
	defer srv.Close()
	if err := srv.Map(rnbd.Export{Name: "vol", Path: "/var/lib/images/vol.img"}); err != nil {
		fmt.Println(err)
		return
	}
	cfg := rtrs.DefaultSrvConfig()
	cfg.Fabric, cfg.Handler = tcp.New(tcp.Options{}), srv
	cfg.Listen = []netip.AddrPort{netip.AddrPortFrom(netip.IPv4Unspecified(), rtrs.DefaultPort)}
	rs, err := rtrs.NewServer(cfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rs.Close()
	select {} // serve
}

// Both ends on the loopback: a server exporting a file, a client that
// maps it, writes a block and reads it back.
func Example() {
	dir, err := os.MkdirTemp("", "rnbd-example-")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	img := filepath.Join(dir, "vol.img")
	if err := os.WriteFile(img, make([]byte, 1<<20), 0o600); err != nil {
		fmt.Println(err)
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	fab := tcp.New(tcp.Options{})

	srv := rnbd.NewServer(rnbd.SrvConfig{Log: log.Discard()})
	defer srv.Close()
	if err := srv.Map(rnbd.Export{Name: "vol", Path: img}); err != nil {
		fmt.Println(err)
		return
	}
	scfg := rtrs.DefaultSrvConfig()
	scfg.Fabric, scfg.Handler, scfg.Log = fab, srv, log.Discard()
	scfg.Listen = []netip.AddrPort{netip.MustParseAddrPort("127.0.0.1:0")}
	rs, err := rtrs.NewServer(scfg)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer rs.Close()

	cfg := rtrs.DefaultCltConfig()
	cfg.SessName, cfg.Fabric, cfg.Log = "example", fab, log.Discard()
	cfg.ConnsPerPath = 1
	cfg.Paths = []rtrs.PathAddr{{Dst: rs.Addrs()[0]}}
	s, err := rnbd.DialSession(ctx, cfg, 0)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer s.Close()
	d, err := s.Map(ctx, "vol", rnbd.AccessRW)
	if err != nil {
		fmt.Println(err)
		return
	}
	defer d.Unmap(ctx)
	buf, err := s.Session().AllocBuffer(2 * 4096)
	if err != nil {
		fmt.Println(err)
		return
	}
	copy(buf.Bytes(), "hello, block 8")
	done := make(chan error, 1)
	fin := func(_ *rnbd.IOReq, err error) { done <- err }
	for _, r := range []*rnbd.IOReq{
		{Op: rnbd.OpWrite, Off: 8 * 4096, Len: 4096, Buf: buf, BufOff: 0, Done: fin},
		{Op: rnbd.OpRead, Off: 8 * 4096, Len: 4096, Buf: buf, BufOff: 4096, Done: fin},
	} {
		if err := d.Submit(ctx, r); err != nil {
			fmt.Println(err)
			return
		}
		if err := <-done; err != nil {
			fmt.Println(r.Op, err)
			return
		}
	}
	fmt.Printf("%d bytes: %s\n", d.Size(), buf.Bytes()[4096:4096+14])
	// Output: 1048576 bytes: hello, block 8
}
