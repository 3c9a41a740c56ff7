package ublk

import (
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"syscall"
	"testing"
)

// The golden bytes come from gcc on include/uapi/linux/ublk_cmd.h (the
// fields the Debian 12 header lacks were put at their uapi offsets).

func golden(t *testing.T, name string, got []byte, want string) {
	t.Helper()
	if h := hex.EncodeToString(got); h != want {
		t.Errorf("%s:\n got %s\nwant %s", name, h, want)
	}
}

func TestCtrlCmdEncoding(t *testing.T) {
	b := make([]byte, 80)
	for i := range b {
		b[i] = 0xee
	}
	c := ctrlCmd{DevID: ^uint32(0), QueueID: 0xffff, Len: 64, Addr: 0x1122334455667788, Data: 0x99, DevPathLen: 7}
	c.encode(b)
	golden(t, "ublksrv_ctrl_cmd", b[:sizeCtrlCmd], "ffffffffffff4000887766554433221199000000000000000700000000000000")
	if b[sizeCtrlCmd] != 0xee {
		t.Error("encode wrote past the struct")
	}
}

func TestDevInfoEncoding(t *testing.T) {
	d := devInfo{NrHWQueues: 2, QueueDepth: 128, MaxIOBufBytes: 512 << 10, DevID: ^uint32(0), SrvPID: 1234,
		Flags: FlagCmdIoctlEncode | FlagUserRecovery, OwnerUID: 5, OwnerGID: 6}
	b := make([]byte, sizeDevInfo)
	d.encode(b)
	golden(t, "ublksrv_ctrl_dev_info", b, "020080000000000000000800ffffffffd20400000000000048000000000000000000000000000000050000000600000000000000000000000000000000000000")
	if got := decodeDevInfo(b); got != d {
		t.Errorf("round trip: %+v != %+v", got, d)
	}
}

func TestParamsEncoding(t *testing.T) {
	o := Options{Size: 64 << 20, Discard: true, WriteZeroes: true, VolatileCache: true, FUA: true}
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	p := buildParams(&o)
	b := make([]byte, sizeParams)
	p.encode(b)
	golden(t, "ublk_params", b, "70000000030000000c000000090c0c0c000400000000000000000200000000000000000000000000000000000010000000004000000040000100000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000000")
}

// GET_PARAMS hands back what SET_PARAMS sent: the basic part decodes to
// what buildParams made.
func TestParamsBasicRoundTrip(t *testing.T) {
	o := Options{Size: 3 << 30, LogicalBlockSize: 4096, ReadOnly: true, VolatileCache: true, FUA: true}
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	p := buildParams(&o)
	b := make([]byte, sizeParams)
	p.encode(b)
	if got := decodeParamsBasic(b); got != p.Basic {
		t.Errorf("decoded %+v, want %+v", got, p.Basic)
	}
}

func TestDevInfoCookie(t *testing.T) {
	// The cookie travels in ublksrv_flags, at offset 32.
	d := devInfo{SrvFlags: 0x0102030405060708}
	b := make([]byte, sizeDevInfo)
	d.encode(b)
	if ne.Uint64(b[32:]) != 0x0102030405060708 || infoOf(decodeDevInfo(b)).Cookie != 0x0102030405060708 {
		t.Errorf("cookie not at ublksrv_flags: %x", b)
	}
	if s := (StateQuiesced).String(); s != "quiesced" {
		t.Errorf("StateQuiesced = %q", s)
	}
}

func TestBuildParams(t *testing.T) {
	o := Options{Size: 1 << 30, LogicalBlockSize: 4096, ReadOnly: true, Discard: true}
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	p := buildParams(&o)
	if p.Types != paramTypeBasic {
		t.Errorf("read-only device with discard params: types %#x", p.Types)
	}
	if p.Basic.Attrs != attrReadOnly || p.Basic.LogicalBSShift != 12 || p.Basic.PhysicalBSShift != 12 ||
		p.Basic.DevSectors != 1<<21 || p.Basic.MaxSectors != 1024 {
		t.Errorf("basic %+v", p.Basic)
	}
	o = Options{Size: 1 << 20, WriteZeroes: true}
	o.setDefaults()
	p = buildParams(&o)
	if p.Types != paramTypeBasic|paramTypeDisc || p.Discard.MaxDiscardSectors != 0 ||
		p.Discard.MaxWriteZeroesSectors == 0 || p.Discard.Granularity == 0 || p.Discard.MaxDiscardSegments != 1 {
		t.Errorf("write-zeroes only: %+v", p)
	}
}

func TestIODescDecoding(t *testing.T) {
	b, _ := hex.DecodeString("01200000080000005634120000000000efbeadde00000000")
	d := decodeIODesc(b)
	want := ioDesc{OpFlags: 1 | ioFlagFUA, NrSectors: 8, StartSector: 0x123456, Addr: 0xdeadbeef}
	if d != want || Op(d.op()) != OpWrite {
		t.Errorf("got %+v op %v", d, Op(d.op()))
	}
}

func TestIOCmdEncoding(t *testing.T) {
	b := make([]byte, sizeIOCmd)
	c := ioCmd{QID: 1, Tag: 77, Result: -5, Addr: 0x7f0000001000}
	c.encode(b)
	golden(t, "ublksrv_io_cmd", b, "01004d00fbffffff00100000007f0000")
}

func TestOpcodes(t *testing.T) {
	for _, tc := range []struct {
		name      string
		got, want uint32
	}{
		{"UBLK_U_CMD_ADD_DEV", ctrlOp(cmdAddDev, true), 0xC0207504},
		{"UBLK_U_CMD_DEL_DEV", ctrlOp(cmdDelDev, true), 0xC0207505},
		{"UBLK_U_CMD_START_DEV", ctrlOp(cmdStartDev, true), 0xC0207506},
		{"UBLK_U_CMD_STOP_DEV", ctrlOp(cmdStopDev, true), 0xC0207507},
		{"UBLK_U_CMD_SET_PARAMS", ctrlOp(cmdSetParams, true), 0xC0207508},
		{"UBLK_U_CMD_GET_PARAMS", ctrlOp(cmdGetParams, true), 0x80207509},
		{"UBLK_U_CMD_START_USER_RECOVERY", ctrlOp(cmdStartUserRecov, true), 0xC0207510},
		{"UBLK_U_CMD_END_USER_RECOVERY", ctrlOp(cmdEndUserRecov, true), 0xC0207511},
		{"UBLK_U_CMD_GET_FEATURES", ctrlOp(cmdGetFeatures, true), 0x80207513},
		{"UBLK_U_CMD_DEL_DEV_ASYNC", ctrlOp(cmdDelDevAsync, true), 0x80207514},
		{"UBLK_CMD_ADD_DEV (legacy)", ctrlOp(cmdAddDev, false), 0x04},
		{"UBLK_U_IO_FETCH_REQ", ioOp(ioFetchReq, true), 0xC0107520},
		{"UBLK_U_IO_COMMIT_AND_FETCH_REQ", ioOp(ioCommitAndFetchReq, true), 0xC0107521},
		{"UBLK_U_IO_NEED_GET_DATA", ioOp(ioNeedGetData, true), 0xC0107522},
		{"UBLK_IO_FETCH_REQ (legacy)", ioOp(ioFetchReq, false), 0x20},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %#x, want %#x", tc.name, tc.got, tc.want)
		}
	}
}

func TestDescArea(t *testing.T) {
	if got := descAreaOffset(0, 4096); got != 0 {
		t.Errorf("queue 0 at %d", got)
	}
	// round_up(4096*24, 4096) = 98304 per queue.
	if got := descAreaOffset(3, 4096); got != 3*98304 {
		t.Errorf("queue 3 at %d", got)
	}
	if got := descAreaSize(128, 4096); got != 4096 {
		t.Errorf("128 descriptors: %d bytes", got)
	}
	if got := descAreaSize(200, 4096); got != 8192 {
		t.Errorf("200 descriptors: %d bytes", got)
	}
}

func TestErrnoResult(t *testing.T) {
	for _, tc := range []struct {
		err  error
		want int32
	}{
		{nil, 0},
		{syscall.ENOSPC, -28},
		{fmt.Errorf("backend: %w", syscall.EROFS), -30},
		{&os.PathError{Op: "write", Path: "x", Err: syscall.EAGAIN}, -11},
		{errors.New("something"), -5},
		{io.ErrUnexpectedEOF, -5},
		{syscall.Errno(0), -5},
	} {
		if got := errnoResult(tc.err); got != tc.want {
			t.Errorf("errnoResult(%v) = %d, want %d", tc.err, got, tc.want)
		}
	}
}

func TestOptionsValidation(t *testing.T) {
	bad := []Options{
		{},
		{Size: 1000},
		{Size: 1 << 20, LogicalBlockSize: 1000},
		{Size: 1 << 20, LogicalBlockSize: 4096, PhysicalBlockSize: 512},
		{Size: 1 << 20, QueueDepth: 5000},
		{Size: 1 << 20, MaxIOBytes: 1000},
		{Size: 1 << 20, MaxIOBytes: 64 << 20},
		{Size: 1 << 20, Queues: -1},
	}
	for _, o := range bad {
		if err := o.setDefaults(); err == nil {
			t.Errorf("%+v accepted", o)
		}
	}
	o := Options{Size: 1 << 20}
	if err := o.setDefaults(); err != nil {
		t.Fatal(err)
	}
	if o.LogicalBlockSize != 512 || o.PhysicalBlockSize != 4096 || o.QueueDepth != 128 || o.MaxIOBytes != 512<<10 || o.Queues < 1 {
		t.Errorf("defaults %+v", o)
	}
}

// Without /dev/ublk-control (this build host), New says so.
func TestNoUblk(t *testing.T) {
	if _, err := os.Stat(ControlPath); err == nil {
		t.Skip(ControlPath + " exists here")
	}
	_, err := New(Options{Size: 1 << 20}, nil)
	if !errors.Is(err, ErrNoUblk) || !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("New: %v, want ErrNoUblk wrapping ENOENT", err)
	}
	if _, err := Probe(); !errors.Is(err, ErrNoUblk) {
		t.Fatalf("Probe: %v", err)
	}
	if _, err := Recover(0, Options{}, nil); !errors.Is(err, ErrNoUblk) {
		t.Fatalf("Recover: %v", err)
	}
	if _, err := GetInfo(0); !errors.Is(err, ErrNoUblk) {
		t.Fatalf("GetInfo: %v", err)
	}
	if err := Remove(0); !errors.Is(err, ErrNoUblk) {
		t.Fatalf("Remove: %v", err)
	}
}
