// The control device (/dev/ublk-control): its own io_uring, the scratch
// memory its commands point the kernel at, the commands themselves, and
// those callable without a Device (Probe, GetInfo, UpdateSize, Remove).

package ublk

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/pkg/frontend/ublk/internal/uring"
)

// Scratch layout.
const (
	scratchDevInfo  = 0
	scratchParams   = 128
	scratchFeatures = 512
)

// ctrlTimeout bounds one control command.
const ctrlTimeout = 30 * time.Second

// Probe reports the UBLK_F_* features of the running kernel, or an error
// wrapping ErrNoUblk.
func Probe() (uint64, error) {
	d := &Device{ctrlFd: -1}
	if err := d.openControl(); err != nil {
		return 0, err
	}
	defer d.closeControl()
	return d.features, nil
}

// GetInfo reports device id as the kernel sees it; an error wraps
// ErrNoDevice if there is none (or ErrNoUblk).
func GetInfo(id int) (Info, error) {
	d := &Device{ctrlFd: -1, id: uint32(id)}
	if err := d.openControl(); err != nil {
		return Info{}, err
	}
	defer d.closeControl()
	di, err := d.getInfo()
	return infoOf(di), err
}

// UpdateSize changes the size of device id (UPDATE_SIZE): the block
// layer sees it at once and tells user space with a change uevent.
// Kernels before 6.16 cannot: the error then wraps EOPNOTSUPP.
func UpdateSize(id int, bytes int64) error {
	d := &Device{ctrlFd: -1, id: uint32(id)}
	if err := d.openControl(); err != nil {
		return err
	}
	defer d.closeControl()
	if d.features&FlagUpdateSize == 0 {
		return fmt.Errorf("ublk: this kernel cannot change a device's size (UPDATE_SIZE needs Linux 6.16): %w", syscall.EOPNOTSUPP)
	}
	if bytes <= 0 || bytes%512 != 0 {
		return fmt.Errorf("ublk: size %d is not a positive multiple of 512: %w", bytes, syscall.EINVAL)
	}
	return d.devCmd("UPDATE_SIZE", cmdUpdateSize, ctrlCmd{Data: uint64(bytes) / 512})
}

// Remove stops and deletes device id, which nobody serves any more (a
// server that died and will not be recovered): IO it holds fails.
func Remove(id int) error {
	d := &Device{ctrlFd: -1, id: uint32(id)}
	if err := d.openControl(); err != nil {
		return err
	}
	defer d.closeControl()
	if _, err := d.getInfo(); err != nil {
		return err
	}
	if err := d.devCmd("STOP_DEV", cmdStopDev, ctrlCmd{}); err != nil {
		return err
	}
	return d.delDev()
}

func (d *Device) getInfo() (devInfo, error) {
	clear(d.scratch[scratchDevInfo : scratchDevInfo+sizeDevInfo])
	res, err := d.ctrl(cmdGetDevInfo, d.ioctlEnc, ctrlCmd{DevID: d.id, QueueID: 0xffff, Len: sizeDevInfo,
		Addr: d.scratchAddr(scratchDevInfo)})
	if err == nil && res == -int32(syscall.ENODEV) {
		return devInfo{}, fmt.Errorf("%w: /dev/ublkb%d", ErrNoDevice, d.id)
	}
	if err := ctrlErr("GET_DEV_INFO", res, err); err != nil {
		return devInfo{}, err
	}
	return decodeDevInfo(d.scratch[scratchDevInfo:]), nil
}

func (d *Device) getParams() (paramBasic, error) {
	b := d.scratch[scratchParams : scratchParams+sizeParams]
	clear(b)
	ne.PutUint32(b, sizeParams)
	err := d.devCmd("GET_PARAMS", cmdGetParams, ctrlCmd{Len: sizeParams, Addr: d.scratchAddr(scratchParams)})
	if err != nil {
		return paramBasic{}, err
	}
	if ne.Uint32(b[4:])&paramTypeBasic == 0 {
		return paramBasic{}, errors.New("ublk: GET_PARAMS: the device has no basic parameters")
	}
	return decodeParamsBasic(b), nil
}
func (d *Device) openControl() error {
	fd, err := unix.Open(ControlPath, unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENODEV) || errors.Is(err, unix.ENXIO) {
			return fmt.Errorf("%w: %s: %w (is ublk_drv loaded?)", ErrNoUblk, ControlPath, err)
		}
		return fmt.Errorf("ublk: open %s: %w", ControlPath, err)
	}
	d.ctrlFd = fd
	d.ctrlRing, err = uring.New(4, uring.Options{SQE128: true})
	if err != nil {
		d.closeControl()
		if errors.Is(err, uring.ErrUnavailable) {
			return fmt.Errorf("%w: %w", ErrNoUblk, err)
		}
		return fmt.Errorf("ublk: control ring: %w", err)
	}
	d.scratch, err = unix.Mmap(-1, 0, os.Getpagesize(), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		d.closeControl()
		return fmt.Errorf("ublk: mmap: %w", err)
	}
	// GET_FEATURES exists only ioctl-encoded (6.5+); a kernel without it
	// gets the legacy opcodes and no optional features.
	res, err := d.ctrl(cmdGetFeatures, true, ctrlCmd{DevID: ^uint32(0), QueueID: 0xffff, Len: 8,
		Addr: d.scratchAddr(scratchFeatures)})
	if err != nil {
		d.closeControl()
		return err
	}
	if res >= 0 {
		d.features = ne.Uint64(d.scratch[scratchFeatures:])
	}
	d.ioctlEnc = d.features&FlagCmdIoctlEncode != 0
	return nil
}

func (d *Device) closeControl() {
	if d.ctrlRing != nil && d.ctrlBad == nil {
		d.ctrlRing.Close()
		if d.scratch != nil {
			unix.Munmap(d.scratch)
		}
	}
	d.ctrlRing, d.scratch = nil, nil
	if d.ctrlFd >= 0 {
		unix.Close(d.ctrlFd)
		d.ctrlFd = -1
	}
}

func (d *Device) scratchAddr(off int) uint64 { return uint64(uintptr(unsafe.Pointer(&d.scratch[off]))) }

// ctrl runs one control command and returns the kernel's result
// (negative errno) or an error if the ring failed or timed out.
func (d *Device) ctrl(nr uint32, ioctlEnc bool, c ctrlCmd) (int32, error) {
	d.ctrlMu.Lock()
	defer d.ctrlMu.Unlock()
	if d.ctrlBad != nil {
		return 0, d.ctrlBad
	}
	// The command may finish in an io-wq worker, which posts it through
	// task work to the submitting thread: submit and wait on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	r := d.ctrlRing
	s := r.GetSQE()
	if s == nil {
		return 0, errors.New("ublk: control ring full")
	}
	s.PrepURingCmd(d.ctrlFd, ctrlOp(nr, ioctlEnc), uint64(nr))
	c.encode(r.Cmd(s))
	if err := r.WaitTimeout(ctrlTimeout); err != nil {
		if err == syscall.ETIME {
			d.ctrlBad = fmt.Errorf("ublk: control command %#x timed out after %v", nr, ctrlTimeout)
			return 0, d.ctrlBad
		}
		return 0, fmt.Errorf("ublk: control command %#x: %w", nr, err)
	}
	cqe, _ := r.PeekCQE()
	r.SeenCQE()
	return cqe.Res, nil
}

// ctrlErr turns a control command's result into an error.
func ctrlErr(name string, res int32, err error) error {
	if err != nil {
		return err
	}
	if res < 0 {
		return fmt.Errorf("ublk: %s: %w", name, syscall.Errno(-res))
	}
	return nil
}

func (d *Device) devCmd(name string, nr uint32, c ctrlCmd) error {
	c.DevID = d.id
	c.QueueID = 0xffff
	res, err := d.ctrl(nr, d.ioctlEnc, c)
	return ctrlErr(name, res, err)
}
