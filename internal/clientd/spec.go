package clientd

import (
	"cmp"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/ibverbs"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/rdma"
)

// feKind is the kind of frontend a mapping is offered through.
type feKind int

const (
	feSocket feKind = iota // an NBD unix socket
	feNBD                  // /dev/nbdN, the kernel's nbd driver
	feUblk                 // /dev/ublkbN
)

// mapSpec is a mapping request checked and typed: everything map needs,
// with nothing left to parse.
type mapSpec struct {
	// Mapping is the request with its defaults filled in: what the state
	// file keeps.
	api.Mapping
	mode  rnbd.AccessMode
	paths []rtrs.PathAddr
	fe    feKind
	// sock is a socket mapping's path; empty until the device is named
	// when it goes in socket_dir.
	sock string
	// legPaths are a mirror's legs' paths by leg, then the witness's.
	legPaths [][]rtrs.PathAddr
	// growTo is the data size a mirror grows to before its device is
	// made (Size, parsed).
	growTo int64
	// regionSize is a new mirror's bitmap region (RegionSize, parsed).
	regionSize int64
	// note is what map says beside its answer: how the device is
	// served when that is not what the request implied (a socket where
	// /dev/nbdN is the default).
	note string
}

// haveNBD and haveUblk say whether this kernel has the drivers of the
// kernel frontends (tests replace them).
var (
	haveNBD  = kernelHasNBD
	haveUblk = kernelHasUblk
)

// ParseMapString parses the kernel's map_device line: "sessname=s1
// path=ip:10.0.0.1 path=ip:10.0.1.1 device_path=vol1 access_mode=rw
// dest_port=1234".
func ParseMapString(s string) (api.Mapping, error) {
	var m api.Mapping
	for _, tok := range strings.Fields(s) {
		k, v, ok := strings.Cut(tok, "=")
		if !ok || v == "" {
			return m, ctl.Errorf(ctl.CodeInvalid, "map: token %q: want key=value", tok)
		}
		switch k {
		case "sessname":
			m.SessName = v
		case "path":
			m.Paths = append(m.Paths, v)
		case "device_path":
			m.DevicePath = v
		case "access_mode":
			m.AccessMode = v
		case "dest_port":
			p, err := strconv.ParseUint(v, 10, 16)
			if err != nil || p == 0 {
				return m, ctl.Errorf(ctl.CodeInvalid, "map: dest_port %s: want a port number from 1 to 65535", v)
			}
			m.DestPort = uint16(p)
		case "nr_poll_queues":
			return m, ctl.Errorf(ctl.CodeNotSupported, "map: nr_poll_queues is a kernel block-layer option with no meaning here")
		default:
			if err := m.Settings.Parse(k, v); err != nil {
				return m, ctl.Errorf(ctl.CodeInvalid, "map: unknown parameter %q", k)
			}
		}
	}
	return m, nil
}

// ParseLegString parses a mirror's leg (or witness) as a map string:
// "sessname=S path=P... device_path=D [dest_port=N]".
func ParseLegString(s string) (api.Leg, error) {
	m, err := ParseMapString(s)
	if err != nil {
		return api.Leg{}, err
	}
	if m.AccessMode != "" || m.Settings != (api.SetRequest{}) {
		return api.Leg{}, ctl.Errorf(ctl.CodeInvalid, "leg %q: a leg takes sessname, path, device_path and dest_port; "+
			"the mirror's access mode and session settings are the mapping's", s)
	}
	return api.Leg{SessName: m.SessName, Paths: m.Paths, DevicePath: m.DevicePath, DestPort: m.DestPort}, nil
}

// normalize checks a mapping request, fills the defaults and types it.
func normalize(m api.Mapping) (mapSpec, error) {
	s := mapSpec{Mapping: m}
	if m.Mirror != "" || len(m.Legs) > 0 || m.Witness != nil {
		if err := s.normalizeMirror(); err != nil {
			return s, err
		}
	} else {
		if m.Create || m.CreateIfNew || m.Force != nil || m.Size != "" {
			return s, ctl.Errorf(ctl.CodeInvalid, "create, force and size are for a mirror (--mirror NAME --leg ...); a device of one storage node has its volume's size")
		}
		if m.SessName == "" || len(m.Paths) == 0 || m.DevicePath == "" {
			return s, ctl.Errorf(ctl.CodeInvalid, "map needs sessname, at least one path and device_path")
		}
		if err := rtrs.ValidSessName(m.SessName); err != nil {
			return s, ctl.Errorf(ctl.CodeInvalid, "sessname %q: %v", m.SessName, err)
		}
	}
	if err := checkSettings(m.Settings); err != nil {
		return s, err
	}
	if s.AccessMode == "" {
		s.AccessMode = "rw"
	}
	var err error
	if s.mode, err = rnbd.ParseAccessMode(s.AccessMode); err != nil {
		return s, ctl.Errorf(ctl.CodeInvalid, "access_mode %q: want ro, rw or migration", s.AccessMode)
	}
	if s.Mirror != "" && s.mode != rnbd.AccessRW {
		// Migration's second writer could order its writes to the
		// legs differently; ro cannot assemble (it commits a
		// generation).
		return s, ctl.Errorf(ctl.CodeInvalid, "access_mode %s: a mirror is mapped rw by one client only", s.AccessMode)
	}
	if s.Mirror == "" {
		if s.DestPort == 0 {
			s.DestPort = rtrs.DefaultPort
		}
		if s.paths, err = parsePaths(m.Paths, s.DestPort); err != nil {
			return s, err
		}
	}
	switch s.Transport {
	case "", "auto":
		s.Transport = autoTransport(s.allPaths())
	case "tcp":
	case "rdma":
		if !ibverbs.Supported {
			return s, ctl.Errorf(ctl.CodeNotSupported, "this rnbd-client was built without RDMA (cgo); use --transport tcp")
		}
	default:
		return s, ctl.Errorf(ctl.CodeInvalid, "transport %q: want auto, tcp or rdma", s.Transport)
	}
	switch {
	case s.As == "" && haveNBD():
		s.As, s.fe = "nbd", feNBD
	case s.As == "":
		// Said, not done quietly: the operator asked for nothing
		// and gets no /dev/nbdN.
		s.fe = feSocket
		s.note = "this kernel has no nbd driver (modprobe nbd), so the device is served on an NBD socket, not as /dev/nbdN " +
			"(once the module is loaded, unmap and map again for /dev/nbdN; --as socket:PATH chooses the socket)"
	case s.As == "socket":
		// A socket in socket_dir, named when the device is.
		s.As, s.fe = "", feSocket
	case s.As == "nbd":
		if !haveNBD() {
			return s, ctl.Errorf(ctl.CodeNotSupported, "this kernel has no nbd driver (modprobe nbd); map with --as socket:PATH instead")
		}
		s.fe = feNBD
	case s.As == "ublk":
		if !haveUblk() {
			if haveNBD() {
				return s, ctl.Errorf(ctl.CodeNotSupported, "this kernel has no ublk driver (modprobe ublk_drv); map with --as nbd or --as socket:PATH instead")
			}
			return s, ctl.Errorf(ctl.CodeNotSupported, "this kernel has no ublk driver (modprobe ublk_drv), nor the nbd driver "+
				"for --as nbd (modprobe nbd); map with --as socket:PATH instead")
		}
		s.fe = feUblk
	case strings.HasPrefix(s.As, "socket:") && len(s.As) > len("socket:"):
		s.sock = s.As[len("socket:"):]
		if !filepath.IsAbs(s.sock) {
			return s, ctl.Errorf(ctl.CodeInvalid, "--as socket:PATH needs an absolute path")
		}
		s.fe = feSocket
	default:
		return s, ctl.Errorf(ctl.CodeInvalid, "--as %q: want nbd, ublk or socket:PATH", s.As)
	}
	return s, nil
}

// parsePaths parses a session's path arguments.
func parsePaths(ps []string, port uint16) ([]rtrs.PathAddr, error) {
	var out []rtrs.PathAddr
	for _, p := range ps {
		pa, err := rtrs.ParsePathAddr(p, port)
		if err != nil {
			return nil, ctl.Errorf(ctl.CodeInvalid, "path %q: %v", p, err)
		}
		out = append(out, pa)
	}
	return out, nil
}

// allPaths is every path the mapping dials: its session's, or its legs'.
func (s *mapSpec) allPaths() []rtrs.PathAddr {
	out := append([]rtrs.PathAddr(nil), s.paths...)
	for _, l := range s.legPaths {
		out = append(out, l...)
	}
	return out
}

// named gives the spec its device name, and a socket in dir to a socket
// mapping that has none.
func (s *mapSpec) named(device, dir string) {
	s.Device = device
	if s.fe == feSocket && s.sock == "" {
		s.sock = filepath.Join(dir, device+".sock")
		s.As = "socket:" + s.sock
	}
}

// autoTransport is RDMA when every path's addresses lead to an RDMA
// device (a session runs on one transport), else TCP.
func autoTransport(paths []rtrs.PathAddr) string {
	for _, pa := range paths {
		if pa.GID {
			return "tcp"
		}
		if dev, err := rdma.DeviceFor(pa.Src.Addr(), pa.Dst.Addr()); err != nil || dev == "" {
			return "tcp"
		}
	}
	return "rdma"
}

// exportName is the name NBD clients open the mapping's device by: its
// device_path, or the mirror's name.
func (s *mapSpec) exportName() string { return cmp.Or(s.Mirror, s.DevicePath) }

// backendID names what a kernel device of m serves: nbd's
// BACKEND_IDENTIFIER, the source of a ublk device's cookie.
func backendID(m api.Mapping) string {
	if m.Mirror != "" {
		return "rnbd-mirror:" + m.Mirror
	}
	return "rnbd:" + m.SessName + "/" + m.DevicePath
}
