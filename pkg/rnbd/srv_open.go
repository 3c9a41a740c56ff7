package rnbd

import (
	"errors"
	"fmt"
	"net/netip"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/rnbd/rnbd/pkg/blockdev"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

// The admin messages of a session: SESS_INFO, OPEN and CLOSE
// (process_msg_sess_info, process_msg_open, process_msg_close), and the
// device's open and close behind them — the name resolved to an export
// or beneath dev_search_path, the backend opened, the access mode taken
// on the device it shares with the other sessions (rnbd-srv-dev.c).

// pathMax is PATH_MAX: the kernel refuses longer device paths.
const pathMax = 4096

// processSessInfo answers SESS_INFO with min(client, our) version; the
// answer goes into the read buffer of the request.
func (x *SrvSession) processSessInfo(op *rtrs.SrvOp) error {
	var m SessInfo
	if err := m.Decode(op.Usr(), MsgSessInfo); err != nil {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed SESS_INFO: %v", err))
	}
	if op.Dir() != rtrs.Read || len(op.Data()) < SessInfoRspSize {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "SESS_INFO without a buffer for its answer"))
	}
	v := min(m.Ver, ProtoVerMajor)
	x.ver.Store(uint32(v))
	(&SessInfo{Ver: v}).Encode(op.Data(), MsgSessInfoRsp)
	return nil
}

// processClose closes a device the session opened, after its IO drained.
func (x *SrvSession) processClose(op *rtrs.SrvOp) error {
	var m Close
	if err := m.Decode(op.Usr()); err != nil {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed CLOSE: %v", err))
	}
	x.mu.Lock()
	d := x.devs[m.DeviceID]
	if d != nil {
		delete(x.devs, m.DeviceID)
	}
	x.mu.Unlock()
	if d == nil {
		return nil // already closed, or force-closed: nothing to do
	}
	d.close()
	return nil
}

// processOpen opens (or finds) a device for the session (process_msg_open).
func (x *SrvSession) processOpen(op *rtrs.SrvOp) error {
	var m Open
	if err := m.Decode(op.Usr()); err != nil {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "malformed OPEN: %v", err))
	}
	if op.Dir() != rtrs.Read || len(op.Data()) < OpenRspSize {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "OPEN without a buffer for its answer"))
	}
	if m.AccessMode > AccessMigration {
		return x.refuse(msgFields(op), refuse(syscall.EINVAL, "OPEN of %s with access mode %d", m.DevName, m.AccessMode))
	}
	// The backend's open and its size refresh are file system calls,
	// which on a mount that stops answering never return: they run
	// without x.mu, which every IO of the session takes (get).
	x.mu.Lock()
	if x.devs == nil {
		x.mu.Unlock()
		return syscall.ENOTCONN // the session is going
	}
	for _, d := range x.devs {
		if d != nil && d.name == m.DevName {
			// The kernel answers with the open device whatever the
			// mode; a writer must not get a device it cannot write.
			if d.readonly && m.AccessMode != AccessRO {
				x.mu.Unlock()
				err := errorf(syscall.EPERM, "%s is open read-only by this session; close it to reopen it %v", m.DevName, m.AccessMode)
				x.srv.rl.Log(x.log().WithError(err), log.WarnLevel, "open refused")
				return err
			}
			if !d.ref() { // (close takes it out of devs first)
				x.mu.Unlock()
				return errorf(syscall.ENOTCONN, "%s is being closed", m.DevName)
			}
			x.mu.Unlock()
			defer d.refs.Done()
			// A remap, or our client asking after the size (it does
			// every few seconds): answer with the size the backend has
			// now, grown since — if its mount answers (the file
			// renamed or removed is still the device's). A file cut
			// behind the server's back is not a resize: the size
			// stays, the shrink is an error (logged, counted), and IO
			// past the file's end fails.
			if err := x.srv.answers(d.export, d.path); err != nil {
				return err
			}
			was, now, err := d.backend.PollSize()
			if se := (*blockdev.ShrinkError)(nil); err == nil || errors.As(err, &se) {
				x.srv.noteSize(d.dev, err)
			}
			if was != now {
				x.log().WithFields(log.Fields{"device": d.name, "was": was, "now": now}).Info("device size changed")
			}
			x.fillOpenRsp(d, op.Data())
			return nil
		}
	}
	if x.opening[m.DevName] {
		x.mu.Unlock()
		return errorf(syscall.EBUSY, "%s is being opened by this session", m.DevName)
	}
	if x.opening == nil {
		x.opening = map[string]bool{}
	}
	x.opening[m.DevName] = true
	x.mu.Unlock()
	d, err := x.srv.open(x, m.DevName, m.AccessMode, op.Path().ClientAddr().Addr())
	if h := x.srv.afterOpen; h != nil && err == nil {
		h()
	}
	x.mu.Lock()
	delete(x.opening, m.DevName)
	if err != nil {
		x.mu.Unlock()
		x.srv.rl.Log(x.log().WithFields(log.Fields{"device": m.DevName, "access_mode": m.AccessMode}).WithError(err),
			log.WarnLevel, "open refused")
		return err
	}
	if x.devs == nil {
		x.mu.Unlock()
		d.close()
		return errorf(syscall.ENOTCONN, "the session closed while %s was being opened", m.DevName)
	}
	if !x.srv.stillExported(d) {
		// Unmapped (or mapped anew) while it was being opened: Unmap
		// looks for the devices to close among devs, where this one
		// is not yet. Once it is, under x.mu, Unmap finds it.
		x.mu.Unlock()
		d.close()
		return errorf(syscall.ENOENT, "export %s was withdrawn while %s was being opened", d.export, m.DevName)
	}
	// The session is admitted: its name binds to its identity now, not
	// when it connected (srv_names.go).
	if err := x.srv.admitName(x.name, x.rtrs.Identity()); err != nil {
		x.mu.Unlock()
		d.close()
		return err
	}
	for {
		x.nextID++
		if _, used := x.devs[x.nextID]; !used && x.nextID != 0 {
			break
		}
	}
	d.id = x.nextID
	x.devs[d.id] = d
	x.fillOpenRsp(d, op.Data())
	x.mu.Unlock()
	x.log().WithFields(log.Fields{"device": d.name, "path": d.backend.Path(), "device_id": d.id, "access_mode": d.access}).Info("device opened")
	return nil
}

func (x *SrvSession) fillOpenRsp(d *SrvSessDev, b []byte) {
	be := d.backend
	c := be.Caps()
	maxIO := uint32(min(int(c.MaxIOBytes), x.srv.cfg.MaxIOSize))
	rsp := OpenRsp{
		DeviceID:          d.id,
		NSectors:          uint64(be.Size()) / 512,
		MaxHWSectors:      maxIO / 512,
		PhysicalBlockSize: uint16(be.PhysicalBlockSize()),
		LogicalBlockSize:  uint16(be.LogicalBlockSize()),
		MaxSegments:       c.MaxSegments,
	}
	if !d.readonly {
		rsp.MaxWriteZeroesSectors = uint32(min(c.MaxWriteZeroesBytes/512, 1<<31))
		if c.Discard {
			rsp.MaxDiscardSectors = uint32(min(c.MaxDiscardBytes/512, 1<<31))
			rsp.DiscardGranularity = c.DiscardGranularity
			rsp.DiscardAlignment = c.DiscardAlignment
		}
		if c.SecureErase {
			rsp.SecureDiscard = 1
		}
	}
	if c.WriteCache {
		rsp.CachePolicy |= CacheWriteback
	}
	if c.FUA {
		rsp.CachePolicy |= CacheFUA
	}
	rsp.Encode(b)
}

// open resolves name for session x, opens the backend and takes the
// access mode on its device. x.mu is not held: the open may take long.
func (s *Server) open(x *SrvSession, name string, mode AccessMode, from netip.Addr) (*SrvSessDev, error) {
	readonly := mode == AccessRO
	opts := blockdev.Options{ReadOnly: readonly, Direct: s.cfg.Direct}
	s.mu.Lock()
	var exp, orig *Export
	if e := s.exports[name]; e != nil && !e.withdrawing {
		c := *e
		exp, orig = &c, e
		opts.WriteThrough = exp.WriteThrough
		if exp.MaxSessions > 0 && s.exportOpens[name] >= exp.MaxSessions {
			s.mu.Unlock()
			return nil, errorf(syscall.EUSERS, "export %s is open by %d sessions, its max_sessions", name, exp.MaxSessions)
		}
		s.exportOpens[name]++ // until the open fails or the device closes
	}
	s.mu.Unlock()
	opened := false
	defer func() {
		if exp != nil && !opened {
			s.exportClosed(exp.Name)
		}
	}()
	var be *blockdev.Backend
	var err error
	var secondWriter bool
	switch {
	case exp != nil:
		if secondWriter, err = exp.admit(x, mode, from); err != nil {
			return nil, err
		}
		if err = s.answers(exp.Name, exp.Path); err == nil {
			be, err = blockdev.Open(exp.Path, opts)
		}
	case s.cfg.DevSearchPath != "":
		// Every device there has the same rules.
		rules := Export{Name: name, AllowFrom: s.cfg.SearchAllowFrom, AllowIdentities: s.cfg.SearchAllowIdentities,
			Migration: s.cfg.AllowMigration}
		if secondWriter, err = rules.admit(x, mode, from); err != nil {
			return nil, err
		}
		var dir string
		if dir, err = s.searchDir(x.name, name); err == nil {
			be, err = blockdev.OpenBeneath(dir, name, opts)
		}
	default:
		return nil, errorf(syscall.ENOENT, "no export %s", name)
	}
	if err != nil {
		if errors.Is(err, blockdev.ErrEscapes) {
			s.log.WithFields(log.Fields{"session": x.name, "device": name}).Warn("device name leads out of the search path: refused")
		}
		return nil, err
	}
	d := &SrvSessDev{sess: x, name: name, access: mode, readonly: readonly, backend: be}
	if exp != nil {
		d.export, d.from, d.path = exp.Name, orig, exp.Path
	}
	d.refs.Add(1) // open
	if h := s.beforeJoin; h != nil {
		h()
	}
	if err := s.takeDevice(d, secondWriter); err != nil {
		be.Close()
		return nil, err
	}
	// The size again, now that the device is joined: a resize that cut
	// the file after the backend read its size, and ended before the
	// join (which would have capped it), is seen here, before any IO.
	opened = true // from here d.close uncounts the export
	if _, _, err := be.Refresh(); err != nil {
		// Its size from the open may be from before a cut.
		d.close()
		return nil, fmt.Errorf("reading the size of %s: %w", name, err)
	}
	return d, nil
}

// searchDir is rnbd_srv_get_full_path: the directory a name is resolved
// beneath. Names with ".." are refused outright, as the kernel does, and
// OpenBeneath refuses every other way out (symlinks, absolute jumps).
func (s *Server) searchDir(sess, name string) (string, error) {
	if strings.Contains(name, "..") {
		return "", errorf(syscall.EINVAL, "device name %q contains ..", name)
	}
	sp := s.cfg.DevSearchPath
	dir := sp
	if i := strings.Index(sp, "%SESSNAME%"); i >= 0 {
		if strings.ContainsAny(sess, "/.") || sess == "" {
			return "", errorf(syscall.EINVAL, "session name %q cannot select a directory", sess)
		}
		dir = filepath.Join(sp[:i], sess)
	}
	if len(dir)+1+len(name) >= pathMax {
		return "", errorf(syscall.EINVAL, "device path of %q is longer than PATH_MAX", name)
	}
	return dir, nil
}

// takeDevice finds the device behind d's backend, applies the access mode
// rules (rnbd_srv_check_update_open_perm: ro always, rw only with no
// writer, migration with at most one) and adds d to its sessions. A
// writer too many is EBUSY (the kernel's server says EPERM, which the
// client cannot tell from an export's refusal): the device is in use.
func (s *Server) takeDevice(d *SrvSessDev, secondWriter bool) error {
	be, mode := d.backend, d.access
	s.mu.Lock()
	defer s.mu.Unlock()
	dev := s.devices[be.ID()]
	if dev == nil {
		dev = &device{id: be.ID(), path: be.Path()}
		if h := s.holds[dev.id]; h != nil && h.on() {
			dev.held.Store(h)
		}
		s.devices[dev.id] = dev
	}
	dev.mu.Lock()
	defer dev.mu.Unlock()
	switch mode {
	case AccessRO:
	case AccessRW:
		if dev.openWriteCnt != 0 {
			return errorf(syscall.EBUSY, "%s is open for writing by another session", be.Path())
		}
		dev.openWriteCnt++
	case AccessMigration:
		if dev.openWriteCnt >= 2 {
			return errorf(syscall.EBUSY, "%s is open for writing by %d sessions already", be.Path(), dev.openWriteCnt)
		}
		if dev.openWriteCnt == 1 && !secondWriter {
			// The kernel's server lets it: then anyone who reaches
			// the port could write beside the device's writer.
			return errorf(syscall.EBUSY, "%s is open for writing by another session, and a second writer "+
				"(access_mode=migration) is not allowed here", be.Path())
		}
		dev.openWriteCnt++
	}
	if r, ok := s.resizes[dev.id]; ok && r.shrink {
		// A shrink of the file is under way: this backend, opened
		// before or after the cut, serves no more than the new size
		// until endResize. It has no writes to wait for (and nobody
		// else has it: its locks are free).
		be.Cap(r.size, 0, r.owner)
	}
	// Joined under s.mu: a close of the device's last other session
	// must not take it out of s.devices while this one is on its way.
	d.dev = dev
	dev.sessDevs = append(dev.sessDevs, d)
	return nil
}

// close waits for the device's IO, then releases it (rnbd_destroy_sess_dev).
// The caller has already taken it out of its session's table.
func (d *SrvSessDev) close() {
	d.mu.Lock()
	if d.closing {
		d.mu.Unlock()
		return
	}
	d.closing = true
	d.mu.Unlock()
	d.refs.Done() // the open reference
	d.refs.Wait() // every IO has answered
	d.backend.Close()
	s := d.sess.srv
	s.mu.Lock()
	dev := d.dev
	dev.mu.Lock()
	if !d.readonly {
		dev.openWriteCnt--
	}
	for i, x := range dev.sessDevs {
		if x == d {
			dev.sessDevs = append(dev.sessDevs[:i:i], dev.sessDevs[i+1:]...)
			break
		}
	}
	if len(dev.sessDevs) == 0 {
		delete(s.devices, dev.id)
	}
	dev.mu.Unlock()
	s.mu.Unlock()
	if d.export != "" {
		s.exportClosed(d.export)
	}
	d.sess.log().WithFields(log.Fields{"device": d.name, "device_id": d.id}).Info("device closed")
}

// exportClosed uncounts a session of export name.
func (s *Server) exportClosed(name string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if n := s.exportOpens[name]; n > 1 {
		s.exportOpens[name] = n - 1
	} else {
		delete(s.exportOpens, name)
	}
}

// stillExported says whether the export d was opened from is still
// served as it was (not withdrawn, nor replaced); true for a device of
// the search path. The caller holds d.sess.mu (lock order).
func (s *Server) stillExported(d *SrvSessDev) bool {
	if d.from == nil {
		return true
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	e := s.exports[d.export]
	return e == d.from && !e.withdrawing
}

// answers is cfg.Answers of an explicit export's path (path not empty):
// an error only for a path that does not answer (ETIMEDOUT). Any other
// finding — the file renamed or removed — is left to the open, or to the
// backend an open device already has.
func (s *Server) answers(name, path string) error {
	if s.cfg.Answers == nil || path == "" {
		return nil
	}
	if err := s.cfg.Answers(path); errors.Is(err, syscall.ETIMEDOUT) {
		return fmt.Errorf("export %s: %w", name, err)
	}
	return nil
}
