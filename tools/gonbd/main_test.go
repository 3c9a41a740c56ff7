package main

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"path/filepath"
	"testing"
	"time"

	"github.com/pojntfx/go-nbd/pkg/protocol"

	"github.com/rnbd/rnbd/pkg/frontend/nbd"
	"github.com/rnbd/rnbd/pkg/log"
)

// memBackend serves reads of zeroes and takes writes (the test sends
// neither: only the negotiation matters).
type memBackend struct{}

type memBuf []byte

func (b memBuf) Bytes() []byte { return b }
func (memBuf) Release()        {}

func (memBackend) Buffer(_ context.Context, n int) (nbd.Buf, error) { return make(memBuf, n), nil }
func (memBackend) Submit(r *nbd.Request, done func(*nbd.Request, error)) {
	done(r, nil)
}

// goNBDNegotiation is what go-nbd v0.3.2's client.Connect writes: client
// flags 0, then NBD_OPT_GO with its length field 0 and the name's length,
// the name and no information requests after it.
func goNBDNegotiation(name string) []byte {
	b := make([]byte, 4)
	b, _ = binary.Append(b, binary.BigEndian, protocol.NegotiationOptionHeader{
		OptionMagic: protocol.NEGOTIATION_MAGIC_OPTION, ID: protocol.NEGOTIATION_ID_OPTION_GO})
	b = binary.BigEndian.AppendUint32(b, uint32(len(name)))
	b = append(b, name...)
	return binary.BigEndian.AppendUint16(b, 0)
}

// TestFixGo: go-nbd's NBD_OPT_GO, relayed by fixGo, is accepted by our
// server, which answers with the export's size and an ACK.
func TestFixGo(t *testing.T) {
	s := nbd.NewServer(nbd.Options{Log: log.Discard()})
	defer s.Close()
	if err := s.AddExport(&nbd.Export{Name: "disk", Size: 3 << 20, Backend: memBackend{}}); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(t.TempDir(), "s")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	go s.Serve(l)
	srv, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	srv.SetDeadline(time.Now().Add(10 * time.Second))
	var greeting protocol.NegotiationNewstyleHeader
	if err := binary.Read(srv, binary.BigEndian, &greeting); err != nil || greeting.OptionMagic != protocol.NEGOTIATION_MAGIC_OPTION {
		t.Fatalf("greeting %+v, %v", greeting, err)
	}
	// Followed by what the transmission would send: fixGo leaves it.
	if err := fixGo(bytes.NewReader(append(goNBDNegotiation("disk"), "more"...)), srv); err != nil {
		t.Fatal(err)
	}
	var size uint64
	for {
		var h protocol.NegotiationReplyHeader
		if err := binary.Read(srv, binary.BigEndian, &h); err != nil {
			t.Fatal(err)
		}
		if h.ReplyMagic != protocol.NEGOTIATION_MAGIC_REPLY || h.ID != protocol.NEGOTIATION_ID_OPTION_GO {
			t.Fatalf("reply %+v", h)
		}
		data := make([]byte, h.Length)
		if _, err := io.ReadFull(srv, data); err != nil {
			t.Fatal(err)
		}
		if h.Type == protocol.NEGOTIATION_TYPE_REPLY_ACK {
			break
		}
		if h.Type != protocol.NEGOTIATION_TYPE_REPLY_INFO {
			t.Fatalf("reply type %#x", h.Type)
		}
		if binary.BigEndian.Uint16(data) == protocol.NEGOTIATION_TYPE_INFO_EXPORT {
			var info protocol.NegotiationReplyInfo
			binary.Read(bytes.NewReader(data), binary.BigEndian, &info)
			size = info.Size
		}
	}
	if size != 3<<20 {
		t.Fatalf("export size %d", size)
	}

	// Without fixGo the server goes by the length, 0: ERR_INVALID.
	raw, err := net.Dial("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(10 * time.Second))
	binary.Read(raw, binary.BigEndian, &greeting)
	raw.Write(goNBDNegotiation("disk"))
	var h protocol.NegotiationReplyHeader
	if err := binary.Read(raw, binary.BigEndian, &h); err != nil || h.Type != 1<<31+3 {
		t.Fatalf("go-nbd's NBD_OPT_GO as sent: reply %+v, %v; want NBD_REP_ERR_INVALID", h, err)
	}
}
