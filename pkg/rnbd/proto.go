package rnbd

import (
	"encoding/binary"
	"errors"
	"fmt"
	"syscall"
)

// Protocol constants, mirroring drivers/block/rnbd/rnbd-proto.h. Only the
// major version is exchanged on the wire; we implement 2.2: the flags
// PREFLUSH (2.1) and NOUNMAP (2.2) proposed in December 2025, which older
// peers never set.
const (
	ProtoVerMajor = 2
	ProtoVerMinor = 2
)

// Message types, enum rnbd_msg_type.
const (
	MsgSessInfo uint16 = iota
	MsgSessInfoRsp
	MsgOpen
	MsgOpenRsp
	MsgIO
	MsgClose
)

// Sizes of the messages, as the kernel's BUILD_BUG_ONs assert.
const (
	HdrSize         = 4
	SessInfoSize    = 36
	SessInfoRspSize = 36
	OpenSize        = 264
	OpenRspSize     = 56
	CloseSize       = 8
	// IOSize is sizeof(struct rnbd_msg_io) on 64-bit: 26 bytes used and
	// padding to 32. We send 32; a peer may send 24 (before prio) to 32.
	IOSize    = 32
	ioMinSize = 24
	ioPrioEnd = 26

	nameMax = 255 // NAME_MAX: the device name field
)

// AccessMode is enum rnbd_access_mode: RO may be mapped by any number of
// sessions, RW by one writer, MIGRATION by a second writer.
type AccessMode uint8

const (
	AccessRO AccessMode = iota
	AccessRW
	AccessMigration
)

func (m AccessMode) String() string {
	switch m {
	case AccessRO:
		return "ro"
	case AccessRW:
		return "rw"
	case AccessMigration:
		return "migration"
	}
	return "unknown"
}

// ParseAccessMode parses "ro", "rw" or "migration".
func ParseAccessMode(s string) (AccessMode, error) {
	switch s {
	case "ro":
		return AccessRO, nil
	case "rw":
		return AccessRW, nil
	case "migration":
		return AccessMigration, nil
	}
	return 0, fmt.Errorf("rnbd: access mode %q: want ro, rw or migration", s)
}

// Cache policy bits of OPEN_RSP, enum rnbd_cache_policy.
const (
	CacheFUA       = 1 << 0 // the device honours FUA
	CacheWriteback = 1 << 1 // the device has a volatile write cache: flush it
)

// Op is the operation in the low 8 bits of rnbd_msg_io.rw.
type Op uint8

const (
	OpRead Op = iota
	OpWrite
	OpFlush
	OpDiscard
	OpSecureErase
	OpWriteZeroes // WRITE_SAME in kernels before 5.19
	opLast
)

func (o Op) String() string {
	switch o {
	case OpRead:
		return "READ"
	case OpWrite:
		return "WRITE"
	case OpFlush:
		return "FLUSH"
	case OpDiscard:
		return "DISCARD"
	case OpSecureErase:
		return "SECURE_ERASE"
	case OpWriteZeroes:
		return "WRITE_ZEROES"
	}
	return fmt.Sprintf("Op(%d)", uint8(o))
}

// Flags above the operation in rnbd_msg_io.rw.
const (
	OpBits     = 8
	OpMask     = 1<<OpBits - 1
	FSync      = 1 << (OpBits + 0)
	FFUA       = 1 << (OpBits + 1)
	FPreflush  = 1 << (OpBits + 2) // 2.1: flush the cache before this write
	FNoUnmap   = 1 << (OpBits + 3) // 2.2: write zeroes without deallocating
	flagsKnown = FSync | FFUA | FPreflush | FNoUnmap
)

// FlagString names the flags of rw ("SYNC|FUA"), "0" for none; bits that
// are no known flag print in hex.
func FlagString(rw uint32) string {
	f := rw &^ OpMask
	if f == 0 {
		return "0"
	}
	var b []byte
	for _, n := range [...]struct {
		bit  uint32
		name string
	}{{FSync, "SYNC"}, {FFUA, "FUA"}, {FPreflush, "PREFLUSH"}, {FNoUnmap, "NOUNMAP"}} {
		if f&n.bit != 0 {
			b = append(append(b, '|'), n.name...)
			f &^= n.bit
		}
	}
	if f != 0 {
		b = fmt.Appendf(append(b, '|'), "%#x", f)
	}
	return string(b[1:])
}

// ErrShortMessage is returned for a buffer too small for the message.
var ErrShortMessage = errors.New("rnbd: message too short")

var le = binary.LittleEndian

func putHdr(b []byte, typ uint16) {
	le.PutUint16(b[0:], typ)
	le.PutUint16(b[2:], 0)
}

// MsgType returns the type of the message in b.
func MsgType(b []byte) (uint16, error) {
	if len(b) < HdrSize {
		return 0, ErrShortMessage
	}
	return le.Uint16(b), nil
}

func checkType(b []byte, size int, want uint16) error {
	if len(b) < size {
		return ErrShortMessage
	}
	if t := le.Uint16(b); t != want {
		return fmt.Errorf("rnbd: message type %d, want %d", t, want)
	}
	return nil
}

// SessInfo mirrors struct rnbd_msg_sess_info (and _rsp): hdr, u8 ver,
// u8 reserved[31]; 36 bytes.
type SessInfo struct {
	Ver uint8
}

// Encode writes the message of type typ (MsgSessInfo or MsgSessInfoRsp).
func (m *SessInfo) Encode(b []byte, typ uint16) []byte {
	b = b[:SessInfoSize]
	clear(b)
	putHdr(b, typ)
	b[4] = m.Ver
	return b
}

// Decode parses a message of type typ.
func (m *SessInfo) Decode(b []byte, typ uint16) error {
	*m = SessInfo{}
	if err := checkType(b, SessInfoSize, typ); err != nil {
		return err
	}
	m.Ver = b[4]
	return nil
}

// Open mirrors struct rnbd_msg_open: hdr, u8 access_mode, u8 resv1,
// s8 dev_name[255], u8 reserved[3]; 264 bytes.
type Open struct {
	AccessMode AccessMode
	DevName    string
}

// ErrBadDevName is returned for an empty device name or one that does not
// fit NAME_MAX with its terminating NUL.
var ErrBadDevName = fmt.Errorf("rnbd: device name must be 1..254 bytes without NUL: %w", syscall.EINVAL)

// Encode writes m; the name must have been checked (at most 254 bytes).
func (m *Open) Encode(b []byte) []byte {
	b = b[:OpenSize]
	clear(b)
	putHdr(b, MsgOpen)
	b[4] = uint8(m.AccessMode)
	copy(b[6:6+nameMax-1], m.DevName)
	return b
}

// Decode parses an OPEN. The name must be NUL-terminated inside its field.
func (m *Open) Decode(b []byte) error {
	*m = Open{}
	if err := checkType(b, OpenSize, MsgOpen); err != nil {
		return err
	}
	name := b[6 : 6+nameMax]
	n := 0
	for n < len(name) && name[n] != 0 {
		n++
	}
	if n == len(name) || n == 0 {
		return ErrBadDevName
	}
	m.AccessMode = AccessMode(b[4])
	m.DevName = string(name[:n])
	return nil
}

// OpenRsp mirrors struct rnbd_msg_open_rsp, 56 bytes.
type OpenRsp struct {
	DeviceID              uint32
	NSectors              uint64 // in 512-byte units
	MaxHWSectors          uint32
	MaxWriteZeroesSectors uint32
	MaxDiscardSectors     uint32
	DiscardGranularity    uint32
	DiscardAlignment      uint32
	PhysicalBlockSize     uint16
	LogicalBlockSize      uint16
	MaxSegments           uint16
	SecureDiscard         uint16
	CachePolicy           uint8
}

// Encode writes m.
func (m *OpenRsp) Encode(b []byte) []byte {
	b = b[:OpenRspSize]
	clear(b)
	putHdr(b, MsgOpenRsp)
	le.PutUint32(b[4:], m.DeviceID)
	le.PutUint64(b[8:], m.NSectors)
	le.PutUint32(b[16:], m.MaxHWSectors)
	le.PutUint32(b[20:], m.MaxWriteZeroesSectors)
	le.PutUint32(b[24:], m.MaxDiscardSectors)
	le.PutUint32(b[28:], m.DiscardGranularity)
	le.PutUint32(b[32:], m.DiscardAlignment)
	le.PutUint16(b[36:], m.PhysicalBlockSize)
	le.PutUint16(b[38:], m.LogicalBlockSize)
	le.PutUint16(b[40:], m.MaxSegments)
	le.PutUint16(b[42:], m.SecureDiscard)
	// b[44] obsolete_rotational stays 0
	b[45] = m.CachePolicy
	return b
}

// Decode parses an OPEN_RSP.
func (m *OpenRsp) Decode(b []byte) error {
	*m = OpenRsp{}
	if err := checkType(b, OpenRspSize, MsgOpenRsp); err != nil {
		return err
	}
	m.DeviceID = le.Uint32(b[4:])
	m.NSectors = le.Uint64(b[8:])
	m.MaxHWSectors = le.Uint32(b[16:])
	m.MaxWriteZeroesSectors = le.Uint32(b[20:])
	m.MaxDiscardSectors = le.Uint32(b[24:])
	m.DiscardGranularity = le.Uint32(b[28:])
	m.DiscardAlignment = le.Uint32(b[32:])
	m.PhysicalBlockSize = le.Uint16(b[36:])
	m.LogicalBlockSize = le.Uint16(b[38:])
	m.MaxSegments = le.Uint16(b[40:])
	m.SecureDiscard = le.Uint16(b[42:])
	m.CachePolicy = b[45]
	return nil
}

// Close mirrors struct rnbd_msg_close: hdr, le32 device_id; 8 bytes.
type Close struct {
	DeviceID uint32
}

// Encode writes m.
func (m *Close) Encode(b []byte) []byte {
	b = b[:CloseSize]
	putHdr(b, MsgClose)
	le.PutUint32(b[4:], m.DeviceID)
	return b
}

// Decode parses a CLOSE.
func (m *Close) Decode(b []byte) error {
	*m = Close{}
	if err := checkType(b, CloseSize, MsgClose); err != nil {
		return err
	}
	m.DeviceID = le.Uint32(b[4:])
	return nil
}

// IO mirrors struct rnbd_msg_io: hdr, le32 device_id @4, le64 sector @8,
// le32 rw @16, le32 bi_size @20, le16 prio @24; 32 bytes with padding.
type IO struct {
	DeviceID uint32
	Sector   uint64 // in 512-byte units
	RW       uint32 // Op | flags
	Size     uint32 // bi_size, bytes
	Prio     uint16
}

// Op is the operation of the request.
func (m *IO) Op() Op { return Op(m.RW & OpMask) }

// Flags are the flags of the request.
func (m *IO) Flags() uint32 { return m.RW &^ OpMask }

// Encode writes m in 32 bytes.
func (m *IO) Encode(b []byte) []byte {
	b = b[:IOSize]
	clear(b)
	putHdr(b, MsgIO)
	le.PutUint32(b[4:], m.DeviceID)
	le.PutUint64(b[8:], m.Sector)
	le.PutUint32(b[16:], m.RW)
	le.PutUint32(b[20:], m.Size)
	le.PutUint16(b[24:], m.Prio)
	return b
}

// Decode parses an IO message of 24 (no prio) to 32 bytes. It does not
// judge the operation and flags: see CheckRW.
func (m *IO) Decode(b []byte) error {
	*m = IO{}
	if err := checkType(b, ioMinSize, MsgIO); err != nil {
		return err
	}
	m.DeviceID = le.Uint32(b[4:])
	m.Sector = le.Uint64(b[8:])
	m.RW = le.Uint32(b[16:])
	m.Size = le.Uint32(b[20:])
	if len(b) >= ioPrioEnd {
		m.Prio = le.Uint16(b[24:])
	}
	return nil
}

// CheckRW reports whether rw names a known operation with known flags
// (rnbd_flags_supported, extended by the 2.1 and 2.2 flags).
func CheckRW(rw uint32) error {
	if Op(rw&OpMask) >= opLast {
		return fmt.Errorf("rnbd: unknown operation %d", rw&OpMask)
	}
	if f := rw &^ OpMask; f&^flagsKnown != 0 {
		return fmt.Errorf("rnbd: unknown flags %#x", f&^flagsKnown)
	}
	return nil
}
