// The connection handshake, the TCP fabric's stand-in for the CM's REQ,
// REP and REJ: its frames, written and read by Dial and the listener.

package tcp

import (
	"encoding/binary"
	"fmt"
	"io"
	"net"
)

// The handshake stands in for the CM's REQ, REP and REJ. Each frame is a
// 12-byte header, then private data:
//
//	off 0  [7]u8 "RTRSTCP"
//	off 7  u8    version (1)
//	off 8  u8    type: 1 REQ, 2 REP (accept), 3 REJ (reject), 4 TLS
//	             required (a server with TLS to a peer without), 5 no TLS
//	             (a server without TLS to a peer that starts it)
//	off 9  u8    reserved (0)
//	off 10 le16  private data length (at most 256)
const (
	hsHdrSize   = 12
	hsVersion   = 1
	hsREQ       = 1
	hsREP       = 2
	hsREJ       = 3
	hsNeedTLS   = 4
	hsNoTLS     = 5
	maxPrivData = 256
)

var hsMagic = [7]byte{'R', 'T', 'R', 'S', 'T', 'C', 'P'}

func writeHandshake(w io.Writer, typ byte, priv []byte) error {
	if len(priv) > maxPrivData {
		return fmt.Errorf("tcp fabric: %d bytes of private data, at most %d", len(priv), maxPrivData)
	}
	b := make([]byte, hsHdrSize+len(priv))
	putHandshake(b, typ, priv)
	_, err := w.Write(b)
	return err
}

// putHandshake lays a frame of typ and priv out in b, which has room.
func putHandshake(b []byte, typ byte, priv []byte) {
	copy(b, hsMagic[:])
	b[7] = hsVersion
	b[8] = typ
	b[9] = 0
	binary.LittleEndian.PutUint16(b[10:], uint16(len(priv)))
	copy(b[hsHdrSize:], priv)
}

func readHandshake(r io.Reader) (typ byte, priv []byte, err error) {
	var h [hsHdrSize]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, nil, err
	}
	if [7]byte(h[:7]) != hsMagic || h[7] != hsVersion {
		return 0, nil, fmt.Errorf("tcp fabric: not an RTRS/TCP peer: %w", errProtocol)
	}
	n := binary.LittleEndian.Uint16(h[10:])
	if n > maxPrivData {
		return 0, nil, fmt.Errorf("tcp fabric: %d bytes of private data: %w", n, errProtocol)
	}
	priv = make([]byte, n)
	if _, err := io.ReadFull(r, priv); err != nil {
		return 0, nil, err
	}
	return h[8], priv, nil
}

// prefixConn is a connection whose first bytes were read already.
type prefixConn struct {
	net.Conn
	prefix []byte
}

func (c *prefixConn) Read(p []byte) (int, error) {
	if len(c.prefix) > 0 {
		n := copy(p, c.prefix)
		c.prefix = c.prefix[n:]
		return n, nil
	}
	return c.Conn.Read(p)
}
