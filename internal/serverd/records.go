// The records of the control API: devices, exports, sessions, paths
// and stats, as the rnbd tool names their fields.

package serverd

import (
	"io/fs"
	"slices"
	"sort"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

func (d *Daemon) deviceRecords(name string) []api.SrvDeviceRecord {
	rows := []api.SrvDeviceRecord{}
	open := map[string]bool{}
	exports := map[string]rnbd.Export{}
	for _, e := range d.rnbd.Exports() {
		exports[e.Name] = e
	}
	for _, o := range d.rnbd.OpenDevices() {
		devname := o.Export
		rules := d.searchRules()
		if e, ok := exports[o.Export]; ok {
			rules = exportRules(e)
		}
		if o.Export == "" {
			devname = o.Name
		} else {
			open[o.Export] = true
		}
		if name != "" && devname != name && o.Name != name {
			continue
		}
		id := o.DeviceID
		rows = append(rows, api.SrvDeviceRecord{
			DevName: devname, DevPath: o.Path, SessName: o.Session, MappingPath: o.Name,
			AccessMode: o.AccessMode.String(), ReadOnly: o.ReadOnly, DeviceID: &id,
			State: "open", WriteCache: writeCache(o.WriteCache), RxSect: o.WrittenSectors, TxSect: o.ReadSectors, FlushCnt: o.Flushes,
			FUACnt: o.FUAWrites, DiscardCnt: o.Discards, WZeroCnt: o.WriteZeroes, Source: d.source(o.Export),
			Rules: rules, Direction: "server",
		})
	}
	for _, e := range d.rnbd.Exports() {
		if open[e.Name] || (name != "" && e.Name != name) {
			continue
		}
		rows = append(rows, api.SrvDeviceRecord{DevName: e.Name, DevPath: e.Path, ReadOnly: e.ReadOnly,
			State: "exported", WriteCache: d.exportCache(e), Source: d.source(e.Name), Rules: exportRules(e), Direction: "server"})
	}
	for _, x := range d.unserved() {
		e := x.Export
		if name != "" && e.Name != name {
			continue
		}
		rows = append(rows, api.SrvDeviceRecord{DevName: e.Name, DevPath: e.Path, ReadOnly: e.ReadOnly,
			State: "not served", Source: x.Source, Reason: x.NotServed, Rules: exportRules(e), Direction: "server"})
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].DevName < rows[j].DevName })
	return rows
}

// exportRecords are the export records: the exports served, then those not
// served (by name if given).
func (d *Daemon) exportRecords(name string) []api.ExportRecord {
	rows := []api.ExportRecord{}
	for _, e := range d.rnbd.Exports() {
		if name == "" || e.Name == name {
			rows = append(rows, exportRecord(unservedExport{Export: e, Source: d.source(e.Name)}))
		}
	}
	for _, x := range d.unserved() {
		if name == "" || x.Name == name {
			rows = append(rows, exportRecord(x))
		}
	}
	return rows
}

// exportRecord is an export as GET /v1/exports gives it: its rules,
// where it comes from, and why it is not served ("" if it is).
func exportRecord(x unservedExport) api.ExportRecord {
	return api.ExportRecord{Name: x.Name, Path: x.Path, ReadOnly: x.ReadOnly, Rules: exportRules(x.Export), GrantsOnly: x.GrantsOnly,
		Source: x.Source, NotServed: x.NotServed}
}

// exportRules are an export's rules: session names (none: any), networks
// (none: any), identities with the most each may open it for (none:
// any), the bound on sessions.
func exportRules(e rnbd.Export) api.Rules {
	x := api.Rules{Allow: api.Strings{}, AllowFrom: api.Strings{}, AllowIdentities: grantsOf(e.AllowIdentities),
		Migration: e.Migration, WriteThrough: e.WriteThrough}
	x.Allow = append(x.Allow, e.Allow...)
	for _, p := range e.AllowFrom {
		x.AllowFrom = append(x.AllowFrom, p.String())
	}
	if e.MaxSessions > 0 {
		n := e.MaxSessions
		x.MaxSessions = &n
	}
	return x
}

// searchRules are the rules of a device opened under dev_search_path.
func (d *Daemon) searchRules() api.Rules {
	from, _ := parseNetworks(d.cfg.SearchAllowFrom)    // validated
	ids, _ := parseGrants(d.cfg.SearchAllowIdentities) // validated
	return exportRules(rnbd.Export{AllowFrom: from, AllowIdentities: ids, Migration: d.cfg.AllowMigration})
}

// grantsOf is allow_identities as the records give it: each identity
// and the most it may open the export for (of several grants of one
// identity the widest, the one that counts).
func grantsOf(gs []rnbd.Grant) api.Grants {
	o := api.Grants{}
	for _, g := range gs {
		acc, _ := rnbd.ParseAccessMode(g.Access)
		i := slices.IndexFunc(o, func(m rnbd.Grant) bool { return m.Identity == g.Identity })
		if i < 0 {
			o = append(o, g)
			continue
		}
		if was, _ := rnbd.ParseAccessMode(o[i].Access); accessRank(acc) > accessRank(was) {
			o[i].Access = g.Access
		}
	}
	return o
}

// accessRank orders access modes by what they allow: ro, rw, migration.
func accessRank(m rnbd.AccessMode) int {
	switch m {
	case rnbd.AccessRO:
		return 0
	case rnbd.AccessRW:
		return 1
	}
	return 2
}

// source says where a device comes from: "config" (an [[export]] of
// the configuration file), "map", or "search" (dev_search_path) for a
// device of no export.
func (d *Daemon) source(export string) string {
	switch {
	case export == "":
		return "search"
	case d.configured[export]:
		return "config"
	case d.isVolume(export):
		return "volume"
	}
	return "map"
}

// writeCache names a cache policy as the kernel's queue/write_cache does.
func writeCache(on bool) string {
	if on {
		return "write back"
	}
	return "write through"
}

// exportCache is the cache policy an export not open will announce when
// it is: known but for a block device opened with O_DIRECT, which
// announces its own ("device").
func (d *Daemon) exportCache(e rnbd.Export) string {
	if e.WriteThrough || !d.cfg.DirectIO {
		return writeCache(!e.WriteThrough)
	}
	if st, err := d.probe.stat(e.Path); err == nil && st.Mode()&fs.ModeDevice != 0 {
		return "device"
	}
	return writeCache(true)
}

func (d *Daemon) findSession(name string) *rtrs.SrvSession {
	for _, x := range d.rtrs.Sessions() {
		if x.Name() == name {
			return x
		}
	}
	return nil
}

func (d *Daemon) sessionRecords(name string) []api.SrvSessionRecord {
	devs := map[string]int{}
	for _, o := range d.rnbd.OpenDevices() {
		devs[o.Session]++
	}
	rows := []api.SrvSessionRecord{}
	for _, x := range d.rtrs.Sessions() {
		if name != "" && x.Name() != name {
			continue
		}
		sum := api.NewPathSum()
		for _, p := range x.Paths() {
			c := p.Stats().Counters()
			sum.Add(p.State() == rtrs.SrvPathConnected, c.WriteBytes, c.ReadBytes, c.Inflight)
		}
		rows = append(rows, api.SrvSessionRecord{SessName: x.Name(), PathSum: sum, Devices: devs[x.Name()], Peer: x.Identity(),
			Direction: "server"})
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i].SessName < rows[j].SessName })
	return rows
}

func pathRecord(p *rtrs.SrvPath) api.SrvPathRecord {
	c := p.Stats().Counters()
	return api.SrvPathRecord{
		SessName: p.Session().Name(), PathName: p.Name(),
		SrcAddr: rtrs.FormatAddr(p.ClientAddr().Addr(), false), DstAddr: rtrs.FormatAddr(p.ServerAddr().Addr(), false),
		HCAName: p.HCAName(), HCAPort: p.HCAPort(), State: p.State().SysfsString(),
		RxBytes: c.WriteBytes, TxBytes: c.ReadBytes, Inflights: c.Inflight, Direction: "server",
	}
}

func (d *Daemon) pathRecords(name, session string) []api.SrvPathRecord {
	rows := []api.SrvPathRecord{}
	for _, p := range d.sessionPaths(session) {
		if name == "" || p.Name() == name {
			rows = append(rows, pathRecord(p))
		}
	}
	return rows
}

// sessionPaths are the paths of every session, or of session if given,
// sorted by session and name: the one walk of sessions and paths that
// the path and stats records, and the lookup of a path by name, make.
func (d *Daemon) sessionPaths(session string) []*rtrs.SrvPath {
	var all []*rtrs.SrvPath
	for _, x := range d.rtrs.Sessions() {
		if session == "" || x.Name() == session {
			all = append(all, x.Paths()...)
		}
	}
	sort.Slice(all, func(i, j int) bool {
		a, b := all[i], all[j]
		if a.Session().Name() != b.Session().Name() {
			return a.Session().Name() < b.Session().Name()
		}
		return a.Name() < b.Name()
	})
	return all
}

// lookupPaths finds the paths a name as typed names, within session if
// given: their name, or the same written another way
// (rtrs.MatchPathName), sorted by session and name.
func (d *Daemon) lookupPaths(name, session string) ([]*rtrs.SrvPath, error) {
	return ctl.Lookup("path", name, d.sessionPaths(session), (*rtrs.SrvPath).Name, func(p *rtrs.SrvPath) bool {
		return rtrs.MatchPathName(name, p.ClientAddr().Addr(), p.ServerAddr().Addr())
	})
}

// findPath is the one path a name as typed names (lookupPaths); a name
// that several sessions' paths share needs the session.
func (d *Daemon) findPath(name, session string) (*rtrs.SrvPath, error) {
	found, err := d.lookupPaths(name, session)
	if err != nil {
		return nil, err
	}
	return ctl.One("path", name, found, (*rtrs.SrvPath).Name, func(p *rtrs.SrvPath) string { return p.Session().Name() })
}

func (d *Daemon) statRecords() []api.SrvStatsRecord {
	rows := []api.SrvStatsRecord{}
	for _, p := range d.sessionPaths("") {
		c := p.Stats().Counters()
		rows = append(rows, api.SrvStatsRecord{SessName: p.Session().Name(), PathName: p.Name(),
			RDMA:      api.SrvRDMA{RdCnt: c.ReadCount, RdBytes: c.ReadBytes, WrCnt: c.WriteCount, WrBytes: c.WriteBytes},
			Inflights: p.Stats().Inflight()})
	}
	return rows
}
