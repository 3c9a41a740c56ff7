// Dialling: a connection to a listener, through TLS if the fabric has it,
// and the handshake's REQ and its answer.

package tcp

import (
	"bytes"
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric"
)

// Dial connects and performs the handshake.
func (d *device) Dial(ctx context.Context, p fabric.DialParams) (fabric.Conn, []byte, error) {
	pdp, ok := p.PD.(*pd)
	if !ok || pdp.dev != d {
		return nil, nil, errors.New("tcp fabric: dial with a protection domain of another device")
	}
	nc, err := d.fab.opts.Network.Dial(ctx, p.Src, p.Dst)
	if err != nil {
		return nil, nil, err
	}
	deadline := time.Now().Add(d.fab.opts.HandshakeTimeout)
	if dl, ok := ctx.Deadline(); ok && dl.Before(deadline) {
		deadline = dl
	}
	nc.SetDeadline(deadline)
	stop := context.AfterFunc(ctx, func() { nc.SetDeadline(time.Unix(1, 0)) })
	defer stop()
	raw := nc
	if cfg := d.fab.opts.TLS; cfg != nil {
		if cfg.ServerName == "" {
			cfg = cfg.Clone()
			cfg.ServerName = p.Dst.Addr().Unmap().WithZone("").String()
		}
		fr := &firstRead{Conn: raw}
		tc := tls.Client(fr, cfg)
		if err := tc.Handshake(); err != nil {
			var rh tls.RecordHeaderError
			var typ byte
			var priv []byte
			if errors.As(err, &rh) && ctx.Err() == nil {
				// Not TLS: the plain handshake, if it is one, says
				// why.
				typ, priv, _ = readHandshake(io.MultiReader(bytes.NewReader(fr.buf[:fr.n]), raw))
			}
			raw.Close()
			if ctx.Err() != nil {
				return nil, nil, ctx.Err()
			}
			if typ == hsREJ {
				// Refused as it was accepted (the server's
				// new_path_rate, ...): the reason is in priv.
				return nil, nil, &fabric.RejectError{PrivateData: priv}
			}
			if errors.As(err, &rh) {
				return nil, nil, fmt.Errorf("tcp fabric: %v does not speak TLS (its server has no tls configured): %w", p.Dst, syscall.EACCES)
			}
			err = fmt.Errorf("tcp fabric: TLS handshake with %v: %w", p.Dst, err)
			if isAuthFailure(err) {
				err = authError{err}
			}
			return nil, nil, err
		}
		nc = tc
	}
	if err := writeHandshake(nc, hsREQ, p.PrivateData); err != nil {
		raw.Close()
		return nil, nil, err
	}
	typ, priv, err := readHandshake(nc)
	if err != nil {
		raw.Close()
		if ctx.Err() != nil {
			return nil, nil, ctx.Err()
		}
		// TLS 1.3: the server checks the client's certificate after
		// the client's side of the handshake is done; its verdict is
		// an alert on the first read.
		if nc != raw && isAuthFailure(err) {
			return nil, nil, authError{fmt.Errorf("tcp fabric: %v refused the client's certificate "+
				"(not of its ca, expired, or naming no identity: the server's log says which): %w", p.Dst, err)}
		}
		return nil, nil, fmt.Errorf("tcp fabric: handshake with %v: %w", p.Dst, err)
	}
	if !stop() {
		raw.Close()
		return nil, nil, ctx.Err()
	}
	nc.SetDeadline(time.Time{})
	switch typ {
	case hsREP:
	case hsREJ:
		raw.Close()
		return nil, nil, &fabric.RejectError{PrivateData: priv}
	case hsNeedTLS:
		raw.Close()
		return nil, nil, fmt.Errorf("tcp fabric: %v requires TLS: give the client a certificate (tls): %w", p.Dst, syscall.EACCES)
	default:
		raw.Close()
		return nil, nil, fmt.Errorf("tcp fabric: handshake reply of type %d: %w", typ, errProtocol)
	}
	c, err := newConn(nc, raw, d, pdp, p.Attr)
	if err != nil {
		raw.Close()
		return nil, nil, err
	}
	c.start()
	if _, host := d.fab.opts.Network.(tcpNetwork); host {
		d.fab.links.add(c)
	}
	return c, priv, nil
}

// firstRead is a connection that keeps the first bytes read from it:
// when a TLS handshake fails on an answer that is not TLS, the answer can
// still be read. A server refuses some clients as it accepts them, before
// any TLS, with a plain REJ (fabric.Screener); a server without TLS
// answers a client with it that it has none.
type firstRead struct {
	net.Conn
	buf [hsHdrSize + maxPrivData]byte
	n   int
}

func (c *firstRead) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	if c.n < len(c.buf) {
		c.n += copy(c.buf[c.n:], p[:n])
	}
	return n, err
}
