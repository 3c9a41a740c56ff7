package rtrs

import (
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/netip"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

// A reject whose private data is not an RTRS conn_rsp — over RDMA the
// CM's own when nothing listens on the port, 148 bytes of zeros — says
// what happened (nothing listens there, or not an RTRS server:
// ECONNREFUSED); "malformed" is kept for an RTRS answer that is.
func TestRejectErr(t *testing.T) {
	dst := netip.MustParseAddrPort("10.78.0.1:1235")
	for _, c := range []struct {
		name string
		priv []byte
		want syscall.Errno
		says string
	}{
		{"the CM's reject: nothing listens", make([]byte, 148), syscall.ECONNREFUSED, "10.78.0.1:1235 refused the connection: nothing listens there, or it is not an RTRS server"},
		{"no private data", nil, syscall.ECONNREFUSED, "nothing listens there, or it is not an RTRS server"},
		{"another protocol's bytes", []byte(strings.Repeat("HTTP/1.1 400 Bad Request\r\n", 4)), syscall.ECONNREFUSED, "not an RTRS server"},
		{"an RTRS answer without an errno", (&ConnRsp{Magic: Magic, Version: ProtoVer}).Encode(make([]byte, ConnRspSize)), syscall.ECONNRESET, "malformed RTRS answer"},
		{"an RTRS refusal", (&ConnRsp{Magic: Magic, Version: ProtoVer, Errno: syscall.EACCES}).Encode(make([]byte, ConnRspSize)), syscall.EACCES, "rejected by server"},
		{"a kernel server's refusal padded by the CM", append((&ConnRsp{Magic: Magic, Version: ProtoVer, Errno: syscall.ENOMEM}).Encode(make([]byte, ConnRspSize)), make([]byte, 92)...), syscall.ENOMEM, "rejected by server"},
	} {
		err := rejectErr(dst, c.priv)
		if !errors.Is(err, c.want) || !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s: %v, want %v saying %q", c.name, err, c.want, c.says)
		}
		if c.want == syscall.ECONNREFUSED && strings.Contains(err.Error(), "malformed") {
			t.Errorf("%s: %v: nothing malformed came", c.name, err)
		}
	}
}

// The same through a whole DialSession over the TCP fabric, against a peer that
// rejects every connection with zeros, as the CM does.
func TestOpenRejectedByNonRTRSPeer(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	served := make(chan struct{})
	go func() {
		defer close(served)
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			var h [12]byte
			if _, err := io.ReadFull(c, h[:]); err == nil {
				io.CopyN(io.Discard, c, int64(binary.LittleEndian.Uint16(h[10:])))
				rej := append([]byte("RTRSTCP\x01\x03\x00"), 148, 0)
				c.Write(append(rej, make([]byte, 148)...))
			}
			c.Close()
		}
	}()
	dst := netip.MustParseAddrPort(ln.Addr().String())
	cfg := testClientConfig(tcp.New(tcp.Options{}), PathAddr{Dst: dst})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s, err := DialSession(ctx, cfg)
	if err == nil {
		s.Close()
		t.Fatal("a session with a peer that rejects everything")
	}
	if !errors.Is(err, syscall.ECONNREFUSED) || !strings.Contains(err.Error(), "nothing listens there, or it is not an RTRS server") ||
		strings.Contains(err.Error(), "malformed") {
		t.Fatalf("open: %v", err)
	}
	ln.Close()
	<-served
}
