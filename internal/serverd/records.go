// The records of the control API: devices, exports, sessions, paths
// and stats, as the rnbd tool names their fields.

package serverd

import (
	"io/fs"
	"slices"
	"sort"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/pkg/rnbd"
	"github.com/rnbd/rnbd/pkg/rtrs"
)

func (d *Daemon) deviceRecords(name string) []output.Record {
	rows := []output.Record{}
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
		rows = append(rows, withRules(output.Record{
			"devname": devname, "devpath": o.Path, "sessname": o.Session, "mapping_path": o.Name,
			"access_mode": o.AccessMode.String(), "read_only": o.ReadOnly, "device_id": o.DeviceID,
			"state": "open", "write_cache": writeCache(o.WriteCache), "rx_sect": o.WrittenSectors, "tx_sect": o.ReadSectors, "flush_cnt": o.Flushes,
			"fua_cnt": o.FUAWrites, "discard_cnt": o.Discards, "wzero_cnt": o.WriteZeroes, "source": d.source(o.Export),
			"direction": "server", "reason": "",
		}, rules))
	}
	for _, e := range d.rnbd.Exports() {
		if open[e.Name] || (name != "" && e.Name != name) {
			continue
		}
		rows = append(rows, withRules(output.Record{
			"devname": e.Name, "devpath": e.Path, "sessname": "", "mapping_path": "",
			"access_mode": "", "read_only": e.ReadOnly, "device_id": nil,
			"state": "exported", "write_cache": d.exportCache(e), "rx_sect": 0, "tx_sect": 0, "flush_cnt": 0, "fua_cnt": 0, "discard_cnt": 0,
			"wzero_cnt": 0, "source": d.source(e.Name), "direction": "server", "reason": "",
		}, exportRules(e)))
	}
	for _, x := range d.unserved() {
		e := x.Export
		if name != "" && e.Name != name {
			continue
		}
		rows = append(rows, withRules(output.Record{
			"devname": e.Name, "devpath": e.Path, "sessname": "", "mapping_path": "",
			"access_mode": "", "read_only": e.ReadOnly, "device_id": nil,
			"state": "not served", "write_cache": "", "rx_sect": 0, "tx_sect": 0, "flush_cnt": 0, "fua_cnt": 0, "discard_cnt": 0,
			"wzero_cnt": 0, "source": x.Source, "direction": "server", "reason": x.NotServed,
		}, exportRules(e)))
	}
	sort.SliceStable(rows, func(i, j int) bool { return rows[i]["devname"].(string) < rows[j]["devname"].(string) })
	return rows
}

// exportRecords are the export records: the exports served, then those not
// served (by name if given).
func (d *Daemon) exportRecords(name string) []output.Record {
	rows := []output.Record{}
	for _, e := range d.rnbd.Exports() {
		if name == "" || e.Name == name {
			rows = append(rows, exportRecord(ExportRecord{Export: e, Source: d.source(e.Name)}))
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
func exportRecord(x ExportRecord) output.Record {
	return withRules(output.Record{"name": x.Name, "path": x.Path, "read_only": x.ReadOnly, "grants_only": x.GrantsOnly,
		"source": x.Source, "not_served": x.NotServed}, exportRules(x.Export))
}

// rules are who may open a device, as the records give them (the
// access rules of docs/server.md).
type rules struct {
	allow, allowFrom []string
	identities       output.Object
	maxSessions      any // a number, or nil: no bound
	migration        bool
	writeThrough     bool
}

// withRules adds the rules' fields to a record.
func withRules(r output.Record, x rules) output.Record {
	r["allow"], r["allow_from"], r["allow_identities"] = x.allow, x.allowFrom, x.identities
	r["max_sessions"], r["migration"], r["write_through"] = x.maxSessions, x.migration, x.writeThrough
	return r
}

// exportRules are an export's rules: session names (none: any), networks
// (none: any), identities with the most each may open it for (none:
// any), the bound on sessions.
func exportRules(e rnbd.Export) rules {
	x := rules{allow: []string{}, allowFrom: []string{}, identities: grantsObject(e.AllowIdentities),
		migration: e.Migration, writeThrough: e.WriteThrough}
	x.allow = append(x.allow, e.Allow...)
	for _, p := range e.AllowFrom {
		x.allowFrom = append(x.allowFrom, p.String())
	}
	if e.MaxSessions > 0 {
		x.maxSessions = e.MaxSessions
	}
	return x
}

// searchRules are the rules of a device opened under dev_search_path.
func (d *Daemon) searchRules() rules {
	from, _ := parseNetworks(d.cfg.SearchAllowFrom)    // validated
	ids, _ := parseGrants(d.cfg.SearchAllowIdentities) // validated
	return exportRules(rnbd.Export{AllowFrom: from, AllowIdentities: ids, Migration: d.cfg.AllowMigration})
}

// grantsObject is allow_identities as an object: each identity and the
// most it may open the export for (of several grants of one identity
// the widest, the one that counts).
func grantsObject(gs []rnbd.Grant) output.Object {
	o := output.Object{}
	for _, g := range gs {
		acc, _ := rnbd.ParseAccessMode(g.Access)
		i := slices.IndexFunc(o, func(m output.Member) bool { return m.Key == g.Identity })
		if i < 0 {
			o = append(o, output.Member{Key: g.Identity, Value: g.Access})
			continue
		}
		if was, _ := rnbd.ParseAccessMode(o[i].Value.(string)); accessRank(acc) > accessRank(was) {
			o[i].Value = g.Access
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

func (d *Daemon) sessionRecords(name string) []output.Record {
	devs := map[string]int{}
	for _, o := range d.rnbd.OpenDevices() {
		devs[o.Session]++
	}
	rows := []output.Record{}
	for _, x := range d.rtrs.Sessions() {
		if name != "" && x.Name() != name {
			continue
		}
		var sum output.PathSum
		for _, p := range x.Paths() {
			c := p.Stats().Counters()
			sum.Add(p.State() == rtrs.SrvPathConnected, c.WriteBytes, c.ReadBytes, c.Inflight)
		}
		rows = append(rows, sum.Fields(output.Record{
			"sessname": x.Name(), "devices": devs[x.Name()], "peer": x.Identity(), "direction": "server",
		}))
	}
	sort.Slice(rows, func(i, j int) bool { return rows[i]["sessname"].(string) < rows[j]["sessname"].(string) })
	return rows
}

func pathRecord(p *rtrs.SrvPath) output.Record {
	c := p.Stats().Counters()
	return output.Record{
		"sessname": p.Session().Name(), "pathname": p.Name(),
		"src_addr": rtrs.FormatAddr(p.ClientAddr().Addr(), false), "dst_addr": rtrs.FormatAddr(p.ServerAddr().Addr(), false),
		"hca_name": p.HCAName(), "hca_port": p.HCAPort(), "state": p.State().SysfsString(),
		"rx_bytes": c.WriteBytes, "tx_bytes": c.ReadBytes, "inflights": c.Inflight, "direction": "server",
	}
}

func (d *Daemon) pathRecords(name, session string) []output.Record {
	rows := []output.Record{}
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

func (d *Daemon) statRecords() []output.Record {
	rows := []output.Record{}
	for _, p := range d.sessionPaths("") {
		c := p.Stats().Counters()
		rows = append(rows, output.Record{
			"sessname": p.Session().Name(), "pathname": p.Name(),
			// The kernel server's stats/rdma, "rd_cnt rd_bytes
			// wr_cnt wr_bytes", by name.
			"rdma": output.Object{{Key: "rd_cnt", Value: c.ReadCount}, {Key: "rd_bytes", Value: c.ReadBytes},
				{Key: "wr_cnt", Value: c.WriteCount}, {Key: "wr_bytes", Value: c.WriteBytes}},
			"inflights": p.Stats().Inflight(),
		})
	}
	return rows
}
