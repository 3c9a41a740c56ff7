package rtrs

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math/bits"
	"syscall"
	"time"
)

// Protocol constants, mirroring drivers/infiniband/ulp/rtrs/rtrs-pri.h,
// rtrs-clt.c and rtrs-srv.c.
const (
	ProtoVerMajor = 2
	ProtoVerMinor = 0
	// ProtoVer is RTRS_PROTO_VER: major in the high byte, minor in the low.
	ProtoVer = ProtoVerMajor<<8 | ProtoVerMinor
	// Magic is RTRS_MAGIC, carried in conn_req and conn_rsp.
	Magic = 0x1BBD

	// MaxSessQueueDepth is MAX_SESS_QUEUE_DEPTH: queue_depth is a le16 on the wire.
	MaxSessQueueDepth = 65535
	// ServiceConQueueDepth is SERVICE_CON_QUEUE_DEPTH, the queue size of cid 0.
	ServiceConQueueDepth = 512
	// MaxPathsNum is MAX_PATHS_NUM, the most paths one session may have.
	MaxPathsNum = 128
	// MinChunkSize is MIN_CHUNK_SIZE, the smallest server chunk.
	MinChunkSize = 8192
	// MaxHdrSize is the server's MAX_HDR_SIZE (PAGE_SIZE): room for the user
	// header and the RTRS message at the end of each chunk.
	MaxHdrSize = 4096
	// DefaultMaxChunkSize and DefaultQueueDepth are the server module defaults.
	DefaultMaxChunkSize = 128 << 10
	DefaultQueueDepth   = 512
	// MaxConnsPerPath is the server's sanity limit on cid_num.
	MaxConnsPerPath = 4096

	// DefaultPort is RTRS_PORT, the port RNBD listens on.
	DefaultPort = 1234

	// DefaultHBInterval and DefaultHBMissedMax are RTRS_HB_INTERVAL_MS and
	// RTRS_HB_MISSED_MAX.
	DefaultHBInterval  = 5000 * time.Millisecond
	DefaultHBMissedMax = 5
	// DefaultConnectTimeout is RTRS_CONNECT_TIMEOUT_MS.
	DefaultConnectTimeout = 30 * time.Second

	nameMax = 255 // NAME_MAX
)

// Sizes of the wire structures, asserted against the kernel's.
const (
	ConnReqSize    = 56 // struct rtrs_msg_conn_req
	ConnRspSize    = 56 // struct rtrs_msg_conn_rsp
	InfoReqSize    = 272
	InfoRspHdrSize = 8  // struct rtrs_msg_info_rsp without desc[]
	SGDescSize     = 16 // struct rtrs_sg_desc
	RkeyRspSize    = 8  // struct rtrs_msg_rkey_rsp
	RDMAReadSize   = 8  // struct rtrs_msg_rdma_read without desc[]
	RDMAWriteSize  = 4  // struct rtrs_msg_rdma_write
)

// Message types, enum rtrs_msg_types.
const (
	MsgInfoReq uint16 = iota
	MsgInfoRsp
	MsgWrite
	MsgRead
	MsgRkeyRsp
)

// Message flags, enum rtrs_msg_flags.
const (
	MsgNeedInvalF = 1 << 0 // send invalidation in response
	MsgNewRkeyF   = 1 << 1 // send refreshed rkey in response
)

// Immediate data types, enum rtrs_imm_type.
const (
	ImmIOReq     = 0 // client to server
	ImmIORsp     = 1 // server to client
	ImmIORspWInv = 2 // server to client, a SEND_WITH_INV preceded it
	ImmHBMsg     = 8
	ImmHBAck     = 9

	immTypeBits    = 4
	immPayloadBits = 28
	immPayloadMask = 1<<immPayloadBits - 1
	immTypeMask    = 1<<immTypeBits - 1
)

// ToImm encodes an immediate: 4 bits of type over 28 bits of payload
// (rtrs_to_imm).
func ToImm(typ, payload uint32) uint32 {
	return (typ&immTypeMask)<<immPayloadBits | payload&immPayloadMask
}

// FromImm splits an immediate into its type and payload (rtrs_from_imm).
func FromImm(imm uint32) (typ, payload uint32) {
	return imm >> immPayloadBits, imm & immPayloadMask
}

// IORspImm encodes an IO response: 9 bits of |errno| and 19 bits of msg id
// (rtrs_to_io_rsp_imm). wInv selects RTRS_IO_RSP_W_INV_IMM.
func IORspImm(msgID uint32, errno syscall.Errno, wInv bool) uint32 {
	payload := (uint32(errno)&0x1ff)<<19 | msgID&0x7ffff
	typ := uint32(ImmIORsp)
	if wInv {
		typ = ImmIORspWInv
	}
	return ToImm(typ, payload)
}

// FromIORspImm decodes the payload of an IO response (rtrs_from_io_rsp_imm).
// The kernel restores the errno as negative; we return it as a positive Errno.
func FromIORspImm(payload uint32) (msgID uint32, errno syscall.Errno) {
	return payload & 0x7ffff, syscall.Errno(payload >> 19 & 0x1ff)
}

// BitsFor returns the number of bits needed to number n distinct values:
// ilog2(n-1)+1 in the kernel, with n <= 1 needing none.
func BitsFor(n uint32) int {
	if n <= 1 {
		return 0
	}
	return bits.Len32(n - 1)
}

// CheckImmBudget reports whether queueDepth chunks of chunkSize bytes can be
// addressed by the 28-bit immediate payload: bits(qd) + bits(chunk) <= 28.
func CheckImmBudget(queueDepth, chunkSize uint32) error {
	if b := BitsFor(queueDepth) + BitsFor(chunkSize); b > immPayloadBits {
		return fmt.Errorf("rtrs: %d chunks of %d bytes need %d bits of immediate payload, only %d exist",
			queueDepth, chunkSize, b, immPayloadBits)
	}
	return nil
}

// MemBits is the number of low payload bits that carry the offset inside a
// chunk, for a session of queueDepth chunks.
func MemBits(queueDepth uint32) int { return immPayloadBits - BitsFor(queueDepth) }

// ErrShortMessage is returned by the decoders for a buffer too small to hold
// the structure.
var ErrShortMessage = errors.New("rtrs: message too short")

var le = binary.LittleEndian

// ConnReq mirrors struct rtrs_msg_conn_req in rtrs-pri.h: the private data of
// rdma_connect, 56 bytes, the most an IP port-space CM REQ can carry.
//
//	off 0  u8   __cma_version (0; the CM may overwrite it for AF_IB)
//	off 1  u8   __ip_version  (0)
//	off 2  le16 magic
//	off 4  le16 version
//	off 6  le16 cid
//	off 8  le16 cid_num
//	off 10 le16 recon_cnt
//	off 12 u8[16] sess_uuid  (the path's UUID)
//	off 28 u8[16] paths_uuid (the session's UUID)
//	off 44 u8   bit0 first_conn
//	off 45 u8[11] reserved
type ConnReq struct {
	Magic     uint16
	Version   uint16
	CID       uint16
	CIDNum    uint16
	ReconCnt  uint16
	SessUUID  [16]byte
	PathsUUID [16]byte
	FirstConn bool
}

// Encode writes m into b, which must be at least ConnReqSize bytes; the
// reserved bytes are zeroed. It returns b[:ConnReqSize].
func (m *ConnReq) Encode(b []byte) []byte {
	b = b[:ConnReqSize]
	clear(b)
	le.PutUint16(b[2:], m.Magic)
	le.PutUint16(b[4:], m.Version)
	le.PutUint16(b[6:], m.CID)
	le.PutUint16(b[8:], m.CIDNum)
	le.PutUint16(b[10:], m.ReconCnt)
	copy(b[12:28], m.SessUUID[:])
	copy(b[28:44], m.PathsUUID[:])
	if m.FirstConn {
		b[44] = 1
	}
	return b
}

// Decode parses b. Like the kernel, it needs at least ConnReqSize bytes and
// ignores anything after them (the CM delivers more than was sent).
func (m *ConnReq) Decode(b []byte) error {
	if len(b) < ConnReqSize {
		*m = ConnReq{}
		return ErrShortMessage
	}
	m.Magic = le.Uint16(b[2:])
	m.Version = le.Uint16(b[4:])
	m.CID = le.Uint16(b[6:])
	m.CIDNum = le.Uint16(b[8:])
	m.ReconCnt = le.Uint16(b[10:])
	copy(m.SessUUID[:], b[12:28])
	copy(m.PathsUUID[:], b[28:44])
	m.FirstConn = b[44]&1 != 0
	return nil
}

// ConnRsp mirrors struct rtrs_msg_conn_rsp: the private data of rdma_accept,
// or the consumer-defined data of a reject. 56 bytes.
//
//	off 0  le16 magic
//	off 2  le16 version
//	off 4  le16 errno (negative errno; the client reads it as s16)
//	off 6  le16 queue_depth
//	off 8  le32 max_io_size
//	off 12 le32 max_hdr_size
//	off 16 le32 flags
//	off 20 u8[36] reserved
type ConnRsp struct {
	Magic      uint16
	Version    uint16
	Errno      syscall.Errno // positive here, negative on the wire
	QueueDepth uint16
	MaxIOSize  uint32
	MaxHdrSize uint32
	Flags      uint32
}

// Encode writes m into b (at least ConnRspSize bytes) and returns b[:ConnRspSize].
func (m *ConnRsp) Encode(b []byte) []byte {
	b = b[:ConnRspSize]
	clear(b)
	le.PutUint16(b[0:], m.Magic)
	le.PutUint16(b[2:], m.Version)
	le.PutUint16(b[4:], uint16(-int16(m.Errno)))
	le.PutUint16(b[6:], m.QueueDepth)
	le.PutUint32(b[8:], m.MaxIOSize)
	le.PutUint32(b[12:], m.MaxHdrSize)
	le.PutUint32(b[16:], m.Flags)
	return b
}

// Decode parses b; at least ConnRspSize bytes, the rest ignored (a kernel
// peer's accept arrives with 196 bytes, a reject with 148).
func (m *ConnRsp) Decode(b []byte) error {
	if len(b) < ConnRspSize {
		*m = ConnRsp{}
		return ErrShortMessage
	}
	m.Magic = le.Uint16(b[0:])
	m.Version = le.Uint16(b[2:])
	e := int16(le.Uint16(b[4:]))
	if e < 0 {
		e = -e
	}
	m.Errno = syscall.Errno(uint16(e))
	m.QueueDepth = le.Uint16(b[6:])
	m.MaxIOSize = le.Uint32(b[8:])
	m.MaxHdrSize = le.Uint32(b[12:])
	m.Flags = le.Uint32(b[16:])
	return nil
}

// InfoReq mirrors struct rtrs_msg_info_req: le16 type, u8 pathname[255],
// u8 reserved[15]; 272 bytes. The client sends its session name.
type InfoReq struct {
	Pathname string
}

// ErrBadName is returned for a session name that does not fit, is empty, or
// contains '/' or '.', which the kernel refuses.
var ErrBadName = errors.New("rtrs: session name must be 1..254 bytes without '/', '.' or NUL")

// ValidSessName reports whether name is acceptable as an RTRS session name.
func ValidSessName(name string) error {
	if len(name) == 0 || len(name) >= nameMax {
		return ErrBadName
	}
	for i := 0; i < len(name); i++ {
		if c := name[i]; c == '/' || c == '.' || c == 0 {
			return ErrBadName
		}
	}
	return nil
}

// Encode writes m into b (at least InfoReqSize bytes). Names longer than 254
// bytes are truncated; callers validate with ValidSessName first.
func (m *InfoReq) Encode(b []byte) []byte {
	b = b[:InfoReqSize]
	clear(b)
	le.PutUint16(b[0:], MsgInfoReq)
	copy(b[2:2+nameMax-1], m.Pathname) // keep a terminating NUL
	return b
}

// Decode parses an INFO_REQ. The name ends at the first NUL or after 255
// bytes; the type must be MsgInfoReq.
func (m *InfoReq) Decode(b []byte) error {
	*m = InfoReq{}
	if len(b) < InfoReqSize {
		return ErrShortMessage
	}
	if t := le.Uint16(b); t != MsgInfoReq {
		return fmt.Errorf("rtrs: info request has type %d", t)
	}
	name := b[2 : 2+nameMax]
	for i, c := range name {
		if c == 0 {
			name = name[:i]
			break
		}
	}
	m.Pathname = string(name)
	return nil
}

// SGDesc mirrors struct rtrs_sg_desc: le64 addr, le32 key, le32 len.
type SGDesc struct {
	Addr uint64
	Key  uint32
	Len  uint32
}

// Encode writes d into b[:16].
func (d *SGDesc) Encode(b []byte) {
	le.PutUint64(b[0:], d.Addr)
	le.PutUint32(b[8:], d.Key)
	le.PutUint32(b[12:], d.Len)
}

// Decode reads d from b[:16].
func (d *SGDesc) Decode(b []byte) {
	d.Addr = le.Uint64(b[0:])
	d.Key = le.Uint32(b[8:])
	d.Len = le.Uint32(b[12:])
}

// InfoRsp mirrors struct rtrs_msg_info_rsp: le16 type, le16 sg_cnt,
// u8 reserved[4], then sg_cnt descriptors of the server's memory regions.
type InfoRsp struct {
	Desc []SGDesc
}

// InfoRspSize is the size of an INFO_RSP with n descriptors.
func InfoRspSize(n int) int { return InfoRspHdrSize + n*SGDescSize }

// Encode writes m into b, which must hold InfoRspSize(len(m.Desc)) bytes.
func (m *InfoRsp) Encode(b []byte) []byte {
	b = b[:InfoRspSize(len(m.Desc))]
	clear(b[:InfoRspHdrSize])
	le.PutUint16(b[0:], MsgInfoRsp)
	le.PutUint16(b[2:], uint16(len(m.Desc)))
	for i := range m.Desc {
		m.Desc[i].Encode(b[InfoRspHdrSize+i*SGDescSize:])
	}
	return b
}

// Decode parses an INFO_RSP: the type, and sg_cnt descriptors that must all
// be inside b. Semantic checks (counts, lengths) are the client's.
func (m *InfoRsp) Decode(b []byte) error {
	m.Desc = m.Desc[:0]
	if len(b) < InfoRspHdrSize {
		return ErrShortMessage
	}
	if t := le.Uint16(b); t != MsgInfoRsp {
		return fmt.Errorf("rtrs: info response has type %d", t)
	}
	n := int(le.Uint16(b[2:]))
	if len(b) < InfoRspSize(n) {
		return ErrShortMessage
	}
	for i := 0; i < n; i++ {
		var d SGDesc
		d.Decode(b[InfoRspHdrSize+i*SGDescSize:])
		m.Desc = append(m.Desc, d)
	}
	return nil
}

// RkeyRsp mirrors struct rtrs_msg_rkey_rsp: le16 type, le16 buf_id, le32 rkey.
type RkeyRsp struct {
	BufID uint16
	RKey  uint32
}

// Encode writes m into b[:8].
func (m *RkeyRsp) Encode(b []byte) []byte {
	b = b[:RkeyRspSize]
	le.PutUint16(b[0:], MsgRkeyRsp)
	le.PutUint16(b[2:], m.BufID)
	le.PutUint32(b[4:], m.RKey)
	return b
}

// Decode parses an RKEY_RSP.
func (m *RkeyRsp) Decode(b []byte) error {
	*m = RkeyRsp{}
	if len(b) < RkeyRspSize {
		return ErrShortMessage
	}
	if t := le.Uint16(b); t != MsgRkeyRsp {
		return fmt.Errorf("rtrs: rkey response has type %d", t)
	}
	m.BufID = le.Uint16(b[2:])
	m.RKey = le.Uint32(b[4:])
	return nil
}

// RDMARead mirrors struct rtrs_msg_rdma_read: le16 type, le16 usr_len,
// le16 flags, le16 sg_cnt, then sg_cnt descriptors of the client's buffers.
// The server accepts only sg_cnt 0 or 1, so one descriptor is kept inline.
type RDMARead struct {
	UsrLen uint16
	Flags  uint16
	SGCnt  uint16
	Desc   SGDesc // valid when SGCnt == 1
}

// Size is the encoded size of m.
func (m *RDMARead) Size() int { return RDMAReadSize + int(m.SGCnt)*SGDescSize }

// Encode writes m into b; SGCnt must be 0 or 1.
func (m *RDMARead) Encode(b []byte) []byte {
	b = b[:m.Size()]
	le.PutUint16(b[0:], MsgRead)
	le.PutUint16(b[2:], m.UsrLen)
	le.PutUint16(b[4:], m.Flags)
	le.PutUint16(b[6:], m.SGCnt)
	if m.SGCnt == 1 {
		m.Desc.Encode(b[RDMAReadSize:])
	}
	return b
}

// Decode parses a READ message. A count other than 0 or 1 is refused, as
// the kernel's server does; the descriptor must be inside b.
func (m *RDMARead) Decode(b []byte) error {
	*m = RDMARead{}
	if len(b) < RDMAReadSize {
		return ErrShortMessage
	}
	if t := le.Uint16(b); t != MsgRead {
		return fmt.Errorf("rtrs: read message has type %d", t)
	}
	m.UsrLen = le.Uint16(b[2:])
	m.Flags = le.Uint16(b[4:])
	m.SGCnt = le.Uint16(b[6:])
	switch m.SGCnt {
	case 0:
	case 1:
		if len(b) < RDMAReadSize+SGDescSize {
			*m = RDMARead{}
			return ErrShortMessage
		}
		m.Desc.Decode(b[RDMAReadSize:])
	default:
		n := m.SGCnt
		*m = RDMARead{}
		return fmt.Errorf("rtrs: read message with %d descriptors", n)
	}
	return nil
}

// RDMAWrite mirrors struct rtrs_msg_rdma_write: le16 type, le16 usr_len.
type RDMAWrite struct {
	UsrLen uint16
}

// Encode writes m into b[:4].
func (m *RDMAWrite) Encode(b []byte) []byte {
	b = b[:RDMAWriteSize]
	le.PutUint16(b[0:], MsgWrite)
	le.PutUint16(b[2:], m.UsrLen)
	return b
}

// Decode parses a WRITE message.
func (m *RDMAWrite) Decode(b []byte) error {
	*m = RDMAWrite{}
	if len(b) < RDMAWriteSize {
		return ErrShortMessage
	}
	if t := le.Uint16(b); t != MsgWrite {
		return fmt.Errorf("rtrs: write message has type %d", t)
	}
	m.UsrLen = le.Uint16(b[2:])
	return nil
}
