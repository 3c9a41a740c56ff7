package nbd

// The wire layouts the server writes by hand, held to go-nbd's structs
// as encoding/binary lays them out, and go-nbd's client negotiating with
// the server.

import (
	"bytes"
	"encoding/binary"
	"net"
	"slices"
	"testing"
	"time"

	gonbd "github.com/pojntfx/go-nbd/pkg/client"
	"github.com/pojntfx/go-nbd/pkg/protocol"
)

func TestHeaderSizesAreGoNBDs(t *testing.T) {
	if n := binary.Size(protocol.TransmissionRequestHeader{}); n != requestSize {
		t.Errorf("go-nbd's request header is %d bytes, requestSize %d", n, requestSize)
	}
	if n := binary.Size(protocol.TransmissionReplyHeader{}); n != replySize {
		t.Errorf("go-nbd's reply header is %d bytes, replySize %d", n, replySize)
	}
}

// TestTransmissionLayoutIsGoNBDs: requests encoded from go-nbd's struct
// are read as meant, and the replies decode into go-nbd's struct.
func TestTransmissionLayoutIsGoNBDs(t *testing.T) {
	st := newStore(1 << 20)
	_, addr := startServer(t, Options{}, &Export{Name: "a", Size: 1 << 20, Backend: st})
	c := connect(t, addr, "a")
	reply := func(cookie uint64) {
		t.Helper()
		var h protocol.TransmissionReplyHeader
		if err := binary.Read(bytes.NewReader(c.readFull(replySize)), binary.BigEndian, &h); err != nil {
			t.Fatal(err)
		}
		if h.ReplyMagic != protocol.TRANSMISSION_MAGIC_REPLY || h.Error != 0 || h.Handle != cookie {
			t.Fatalf("reply %+v, want cookie %#x and no error", h, cookie)
		}
	}
	req := func(typ uint16, cookie, off uint64, n uint32, payload []byte) {
		t.Helper()
		b, err := binary.Append(nil, binary.BigEndian, protocol.TransmissionRequestHeader{
			RequestMagic: protocol.TRANSMISSION_MAGIC_REQUEST, Type: typ, Handle: cookie, Offset: off, Length: n})
		if err != nil {
			t.Fatal(err)
		}
		c.write(append(b, payload...))
	}
	data := slices.Repeat([]byte{0x5a}, 1000)
	req(protocol.TRANSMISSION_TYPE_REQUEST_WRITE, 0x0102030405060708, 4097, 1000, data)
	reply(0x0102030405060708)
	req(protocol.TRANSMISSION_TYPE_REQUEST_READ, 0x1122334455667788, 4096, 1002, nil)
	reply(0x1122334455667788)
	want := append(append(pattern(4096, 1), data...), pattern(5097, 1)...)
	if got := c.readFull(1002); !bytes.Equal(got, want) {
		t.Fatal("read back other data than written")
	}
	req(protocol.TRANSMISSION_TYPE_REQUEST_DISC, 0, 0, 0, nil)
	c.expectClosed()
}

// TestGoNBDClientList: go-nbd's client lists the export (its whole
// negotiation short of attaching a device, which the VM tier does).
func TestGoNBDClientList(t *testing.T) {
	_, addr := startServer(t, Options{}, &Export{Name: "disk", Size: 1 << 20, Backend: newStore(1 << 20)})
	nc, err := net.Dial("unix", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	nc.SetDeadline(time.Now().Add(testTimeout))
	names, err := gonbd.List(nc)
	if err != nil || !slices.Equal(names, []string{"disk"}) {
		t.Fatalf("go-nbd's List: %q, %v", names, err)
	}
}
