package ublk

import (
	"encoding/binary"
)

// The kernel ABI of include/uapi/linux/ublk_cmd.h, encoded by hand: every
// struct is little endian on the architectures we run on, and native
// endian in general.

var ne = binary.NativeEndian

// Control command numbers (_IOC_NR). Without UBLK_F_CMD_IOCTL_ENCODE the
// kernel takes them as the whole cmd_op ("legacy opcodes").
const (
	cmdGetQueueAffinity = 0x01
	cmdGetDevInfo       = 0x02
	cmdAddDev           = 0x04
	cmdDelDev           = 0x05
	cmdStartDev         = 0x06
	cmdStopDev          = 0x07
	cmdSetParams        = 0x08
	cmdGetParams        = 0x09
	cmdStartUserRecov   = 0x10
	cmdEndUserRecov     = 0x11
	cmdGetDevInfo2      = 0x12
	cmdGetFeatures      = 0x13
	cmdDelDevAsync      = 0x14
	cmdUpdateSize       = 0x15 // Linux 6.16, UBLK_F_UPDATE_SIZE
)

// IO command numbers, issued on /dev/ublkcN.
const (
	ioFetchReq          = 0x20
	ioCommitAndFetchReq = 0x21
	ioNeedGetData       = 0x22
)

// Sizes of the uapi structs.
const (
	sizeCtrlCmd = 32 // struct ublksrv_ctrl_cmd
	sizeDevInfo = 64 // struct ublksrv_ctrl_dev_info
	sizeIODesc  = 24 // struct ublksrv_io_desc
	sizeIOCmd   = 16 // struct ublksrv_io_cmd
	// sizeParams covers struct ublk_params up to and including the zoned
	// part (len, types, basic, discard, devt, zoned), as 6.12 defines it,
	// rounded to 8. A kernel that knows fewer parts clamps len; one that
	// knows more zeroes the rest.
	sizeParams = 112
)

// ioctl encoding: dir<<30 | size<<16 | type<<8 | nr.
const (
	iocWrite = 1
	iocRead  = 2
)

func ioc(dir, nr, size uint32) uint32 { return dir<<30 | size<<16 | 'u'<<8 | nr }

// ctrlOp is the cmd_op for a control command: ioctl encoded
// (UBLK_U_CMD_*) or the legacy number.
func ctrlOp(nr uint32, ioctlEncode bool) uint32 {
	if !ioctlEncode {
		return nr
	}
	switch nr {
	case cmdGetQueueAffinity, cmdGetDevInfo, cmdGetParams, cmdGetDevInfo2, cmdGetFeatures, cmdDelDevAsync:
		return ioc(iocRead, nr, sizeCtrlCmd)
	}
	return ioc(iocRead|iocWrite, nr, sizeCtrlCmd)
}

// ioOp is the cmd_op for an IO command (UBLK_U_IO_* or legacy).
func ioOp(nr uint32, ioctlEncode bool) uint32 {
	if !ioctlEncode {
		return nr
	}
	return ioc(iocRead|iocWrite, nr, sizeIOCmd)
}

// Feature flags (UBLK_F_*), as GET_FEATURES reports them and ADD_DEV takes them.
const (
	FlagSupportZeroCopy   = 1 << 0
	FlagURingCmdCompTask  = 1 << 1
	FlagNeedGetData       = 1 << 2
	FlagUserRecovery      = 1 << 3
	FlagUserRecoveryReiss = 1 << 4
	FlagUnprivilegedDev   = 1 << 5
	FlagCmdIoctlEncode    = 1 << 6
	FlagUserCopy          = 1 << 7
	FlagZoned             = 1 << 8
	FlagUserRecoveryFail  = 1 << 9
	FlagUpdateSize        = 1 << 10
	FlagAutoBufReg        = 1 << 11
	FlagQuiesce           = 1 << 12
	FlagPerIODaemon       = 1 << 13
)

// Device states (UBLK_S_DEV_*), as GET_DEV_INFO reports them.
const (
	devStateDead     = 0
	devStateLive     = 1
	devStateQuiesced = 2
	devStateFailIO   = 3
)

// IO results the kernel reports on FETCH/COMMIT_AND_FETCH completions.
const (
	ioResOK          = 0
	ioResNeedGetData = 1
	ioResAbort       = -19 // -ENODEV
)

// Offsets of the char device's mmap areas.
const (
	cmdBufOffset    = 0
	maxQueueDepth   = 4096
	maxNrQueues     = 4096
	maxIOBufBytes   = 1 << 25 // UBLK_IO_BUF_BITS
	ioFlagFUA       = 1 << 13
	ioFlagNoUnmap   = 1 << 15
	paramTypeBasic  = 1 << 0
	paramTypeDisc   = 1 << 1
	attrReadOnly    = 1 << 0
	attrRotational  = 1 << 1
	attrVolatileCch = 1 << 2
	attrFUA         = 1 << 3
)

// ctrlCmd is struct ublksrv_ctrl_cmd, carried in the SQE command area.
type ctrlCmd struct {
	DevID      uint32
	QueueID    uint16
	Len        uint16
	Addr       uint64
	Data       uint64
	DevPathLen uint16
}

func (c *ctrlCmd) encode(b []byte) {
	clear(b[:sizeCtrlCmd])
	ne.PutUint32(b[0:], c.DevID)
	ne.PutUint16(b[4:], c.QueueID)
	ne.PutUint16(b[6:], c.Len)
	ne.PutUint64(b[8:], c.Addr)
	ne.PutUint64(b[16:], c.Data)
	ne.PutUint16(b[24:], c.DevPathLen)
}

// devInfo is struct ublksrv_ctrl_dev_info.
type devInfo struct {
	NrHWQueues    uint16
	QueueDepth    uint16
	State         uint16
	MaxIOBufBytes uint32
	DevID         uint32
	SrvPID        int32
	Flags         uint64
	SrvFlags      uint64
	OwnerUID      uint32
	OwnerGID      uint32
}

func (d *devInfo) encode(b []byte) {
	clear(b[:sizeDevInfo])
	ne.PutUint16(b[0:], d.NrHWQueues)
	ne.PutUint16(b[2:], d.QueueDepth)
	ne.PutUint16(b[4:], d.State)
	ne.PutUint32(b[8:], d.MaxIOBufBytes)
	ne.PutUint32(b[12:], d.DevID)
	ne.PutUint32(b[16:], uint32(d.SrvPID))
	ne.PutUint64(b[24:], d.Flags)
	ne.PutUint64(b[32:], d.SrvFlags)
	ne.PutUint32(b[40:], d.OwnerUID)
	ne.PutUint32(b[44:], d.OwnerGID)
}

func decodeDevInfo(b []byte) devInfo {
	return devInfo{
		NrHWQueues:    ne.Uint16(b[0:]),
		QueueDepth:    ne.Uint16(b[2:]),
		State:         ne.Uint16(b[4:]),
		MaxIOBufBytes: ne.Uint32(b[8:]),
		DevID:         ne.Uint32(b[12:]),
		SrvPID:        int32(ne.Uint32(b[16:])),
		Flags:         ne.Uint64(b[24:]),
		SrvFlags:      ne.Uint64(b[32:]),
		OwnerUID:      ne.Uint32(b[40:]),
		OwnerGID:      ne.Uint32(b[44:]),
	}
}

// paramBasic is struct ublk_param_basic.
type paramBasic struct {
	Attrs            uint32
	LogicalBSShift   uint8
	PhysicalBSShift  uint8
	IOOptShift       uint8
	IOMinShift       uint8
	MaxSectors       uint32
	ChunkSectors     uint32
	DevSectors       uint64
	VirtBoundaryMask uint64
}

// paramDiscard is struct ublk_param_discard.
type paramDiscard struct {
	Alignment             uint32
	Granularity           uint32
	MaxDiscardSectors     uint32
	MaxWriteZeroesSectors uint32
	MaxDiscardSegments    uint16
}

// params is struct ublk_params (the parts we set).
type params struct {
	Types   uint32
	Basic   paramBasic
	Discard paramDiscard
}

func (p *params) encode(b []byte) {
	clear(b[:sizeParams])
	ne.PutUint32(b[0:], sizeParams)
	ne.PutUint32(b[4:], p.Types)
	// basic at 8
	ne.PutUint32(b[8:], p.Basic.Attrs)
	b[12] = p.Basic.LogicalBSShift
	b[13] = p.Basic.PhysicalBSShift
	b[14] = p.Basic.IOOptShift
	b[15] = p.Basic.IOMinShift
	ne.PutUint32(b[16:], p.Basic.MaxSectors)
	ne.PutUint32(b[20:], p.Basic.ChunkSectors)
	ne.PutUint64(b[24:], p.Basic.DevSectors)
	ne.PutUint64(b[32:], p.Basic.VirtBoundaryMask)
	// discard at 40
	ne.PutUint32(b[40:], p.Discard.Alignment)
	ne.PutUint32(b[44:], p.Discard.Granularity)
	ne.PutUint32(b[48:], p.Discard.MaxDiscardSectors)
	ne.PutUint32(b[52:], p.Discard.MaxWriteZeroesSectors)
	ne.PutUint16(b[56:], p.Discard.MaxDiscardSegments)
	// devt (60..76) is read-only, zoned (76..108) unused.
}

// decodeParamsBasic reads the basic part of struct ublk_params as
// GET_PARAMS returned it.
func decodeParamsBasic(b []byte) paramBasic {
	return paramBasic{
		Attrs:            ne.Uint32(b[8:]),
		LogicalBSShift:   b[12],
		PhysicalBSShift:  b[13],
		IOOptShift:       b[14],
		IOMinShift:       b[15],
		MaxSectors:       ne.Uint32(b[16:]),
		ChunkSectors:     ne.Uint32(b[20:]),
		DevSectors:       ne.Uint64(b[24:]),
		VirtBoundaryMask: ne.Uint64(b[32:]),
	}
}

// ioDesc is struct ublksrv_io_desc, one per tag in the mmapped area.
type ioDesc struct {
	OpFlags     uint32
	NrSectors   uint32
	StartSector uint64
	Addr        uint64
}

func decodeIODesc(b []byte) ioDesc {
	return ioDesc{
		OpFlags:     ne.Uint32(b[0:]),
		NrSectors:   ne.Uint32(b[4:]),
		StartSector: ne.Uint64(b[8:]),
		Addr:        ne.Uint64(b[16:]),
	}
}

func (d ioDesc) op() uint8 { return uint8(d.OpFlags) }

// ioCmd is struct ublksrv_io_cmd, carried in the SQE command area.
type ioCmd struct {
	QID    uint16
	Tag    uint16
	Result int32
	Addr   uint64
}

func (c *ioCmd) encode(b []byte) {
	ne.PutUint16(b[0:], c.QID)
	ne.PutUint16(b[2:], c.Tag)
	ne.PutUint32(b[4:], uint32(c.Result))
	ne.PutUint64(b[8:], c.Addr)
}

// descAreaOffset is where queue q's descriptor array is mmapped from
// /dev/ublkcN: each queue has room for UBLK_MAX_QUEUE_DEPTH descriptors.
func descAreaOffset(q int, pageSize int) int64 {
	return cmdBufOffset + int64(q)*int64(roundUp(maxQueueDepth*sizeIODesc, pageSize))
}

// descAreaSize is the length of queue's mmap: what the kernel insists on.
func descAreaSize(depth, pageSize int) int { return roundUp(depth*sizeIODesc, pageSize) }

func roundUp(n, to int) int { return (n + to - 1) / to * to }
