// The LVM thin pool: each volume is a thin logical volume of an existing
// thin pool in a volume group, each snapshot a read-only thin snapshot,
// made and changed through lvm2's own tools (lvs, lvcreate, lvextend,
// lvchange, lvremove), never by writing LVM's metadata here.
//
// Naming. Volume NAME is the LV "rnbd.v." + NAME and snapshot NAME the LV
// "rnbd.s." + NAME, with every '_' written '+' (our names have no '+',
// so the mapping is one to one, and none of LVM's reserved substrings,
// which all begin with '_', can appear). A name whose LV or device-mapper
// name would be too long for LVM (127 bytes; the device-mapper name is
// VG-LV with every '-' doubled) is the LV "rnbd.v+" or "rnbd.s+" and 32
// hex digits of the name's SHA-256 instead. The LV's tags, not its name,
// say what it is: an LV without them is never a volume, and is never
// changed or removed.
//
// Metadata. A volume's or snapshot's metadata (lvmMeta, JSON) is kept in
// the LV's tags, base64 in chunks "rnbd:I/N:CHUNK" of at most
// maxTagChunk characters, set by the lvcreate that makes the LV: LVM
// commits an LV and its tags at once, so a crash leaves the volume whole
// or not at all. A clone that must grow past its source's size takes two
// calls (lvcreate -s, then lvextend): it is made with the tag
// "rnbd:incomplete", removed once it has its size, and an LV still
// carrying it is removed when the pool is opened, or by a Create retry.
// The size in the metadata is the size asked for; the LV may be larger,
// up to the volume group's extent size (LVM rounds sizes up to it).
//
// Capacity. Total is the thin pool's data size and Used its data in use
// (lvs data_percent, to 0.01%). Promised is what the writable thin LVs of
// the thin pool (ours and any other) may still claim: each one's size
// less what it maps (an inactive LV, whose mapping lvs cannot report,
// counts whole); read-only snapshots promise nothing. Blocks a clone
// shares with its source count as mapped, so after snapshots and clones
// Promised is a lower bound: that is the over-commit thin provisioning
// is for, and the high-water mark guards what is left. Allocatable is
// Total less Used and Promised. A thin pool whose data or metadata is at
// or over highWater percent refuses Create, Resize and CreateSnapshot
// (ENOSPC naming which is full), so LVM never reaches the point where a
// full pool stops writes to every volume in it.

package pool

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

const (
	lvVolPrefix  = "rnbd.v."
	lvSnapPrefix = "rnbd.s."
	// lvHashMark replaces the prefix's last '.' in a hashed LV name.
	lvHashMark = '+'
	// lvNameMax is the longest LV name LVM takes, and dmNameMax the
	// longest device-mapper name (both 128 bytes with the NUL).
	lvNameMax = 127
	dmNameMax = 127

	tagPrefix     = "rnbd:"
	tagIncomplete = "rnbd:incomplete"
	// maxTagChunk bounds the base64 in one tag (LVM takes up to 1024
	// bytes in a tag): with "rnbd:I/N:" the tag stays under 1024.
	maxTagChunk = 960
	// maxTags bounds the chunks a decoder accepts: the largest metadata
	// (labels of MaxLabelBytes, each byte escaped as \u00XX) fits in
	// far fewer.
	maxTags = 64

	// highWater is the percentage of a thin pool's data or metadata at
	// which it counts as full.
	highWater = 95.0

	lvmTimeout = 2 * time.Minute
)

// lvmMeta is what the tags of a volume's or snapshot's LV hold.
type lvmMeta struct {
	Kind string `json:"kind"` // "volume" or "snapshot"
	Name string `json:"name"`
	Pool string `json:"pool"`
	Size int64  `json:"size"`
	// A volume's source; a snapshot's volume.
	Source         string            `json:"source,omitempty"`
	SourceSnapshot string            `json:"source_snapshot,omitempty"`
	Volume         string            `json:"volume,omitempty"`
	Created        time.Time         `json:"created"`
	Labels         map[string]string `json:"labels,omitempty"`
}

const (
	kindVolume   = "volume"
	kindSnapshot = "snapshot"
)

// LVMThin is a pool of thin volumes in an LVM thin pool.
type LVMThin struct {
	name, vg, thin string
	now            func() time.Time
	mu             sync.Mutex // serialises the changes
}

// OpenLVMThin opens the pool name on the thin pool thinPool of volume
// group vg, both of which must exist (ENOENT otherwise), activates the
// thin pool if it is not active (its usage is read from it), and removes
// what a crash left half-made. It returns what it removed, for the
// caller to log.
func OpenLVMThin(name, vg, thinPool string) (*LVMThin, []string, error) {
	if err := CheckName(name); err != nil {
		return nil, nil, err
	}
	p := &LVMThin{name: name, vg: vg, thin: thinPool, now: time.Now}
	for _, n := range []string{vg, thinPool} {
		if n == "" || validLVMName(n) != nil {
			return nil, nil, errorf(syscall.EINVAL, "pool %s: %q is not an LVM name", name, n)
		}
	}
	if n := dmNameLen(vg, lvName(vg, kindVolume, strings.Repeat("-", 128))); n > dmNameMax {
		return nil, nil, errorf(syscall.EINVAL, "pool %s: volume group name %q is too long to name the pool's LVs within LVM's %d bytes", name, vg, dmNameMax)
	}
	rows, err := p.scan()
	if err != nil {
		return nil, nil, err
	}
	tp, err := p.thinPoolRow(rows)
	if err != nil {
		return nil, nil, err
	}
	if !tp.active() {
		if _, err := p.lvm("lvchange", "-ay", p.vg+"/"+p.thin); err != nil {
			return nil, nil, fmt.Errorf("pool %s: activating thin pool %s/%s: %w", name, vg, thinPool, err)
		}
	}
	var removed []string
	for _, r := range rows {
		m, ok, err := p.ours(r)
		if err != nil || !ok || !r.incomplete() {
			continue
		}
		if _, err := p.lvm("lvremove", "-y", p.vg+"/"+r.Name); err != nil {
			return nil, nil, fmt.Errorf("pool %s: removing the half-made %s %s: %w", name, m.Kind, m.Name, err)
		}
		removed = append(removed, fmt.Sprintf("%s/%s (%s %s, half-made)", vg, r.Name, m.Kind, m.Name))
	}
	return p, removed, nil
}

// Name implements Pool.
func (p *LVMThin) Name() string { return p.name }

// Type implements Pool.
func (p *LVMThin) Type() string { return "lvm-thin" }

// validLVMName refuses what LVM refuses as a VG or LV name.
func validLVMName(n string) error {
	if n == "" || len(n) > lvNameMax || n[0] == '-' || n == "." || n == ".." {
		return errors.New("bad LVM name")
	}
	for _, c := range []byte(n) {
		if !isAlnum(c) && c != '.' && c != '_' && c != '-' && c != '+' {
			return errors.New("bad LVM name")
		}
	}
	return nil
}

func isAlnum(c byte) bool {
	return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// lvName is the LV of volume (kind volume) or snapshot name in volume
// group vg: readable where it fits, hashed where it does not.
func lvName(vg, kind, name string) string {
	prefix := lvVolPrefix
	if kind == kindSnapshot {
		prefix = lvSnapPrefix
	}
	lv := prefix + strings.ReplaceAll(name, "_", "+")
	if len(lv) <= lvNameMax && dmNameLen(vg, lv) <= dmNameMax {
		return lv
	}
	sum := sha256.Sum256([]byte(name))
	return prefix[:len(prefix)-1] + string(lvHashMark) + hex.EncodeToString(sum[:16])
}

// dmNameLen is the length of the device-mapper name of vg/lv: VG-LV,
// every '-' in either doubled.
func dmNameLen(vg, lv string) int {
	return len(vg) + strings.Count(vg, "-") + 1 + len(lv) + strings.Count(lv, "-")
}

// encodeTags writes m as the tags of its LV.
func encodeTags(m lvmMeta) ([]string, error) {
	b, err := json.Marshal(m)
	if err != nil {
		return nil, err
	}
	s := base64.StdEncoding.EncodeToString(b)
	n := (len(s) + maxTagChunk - 1) / maxTagChunk
	if n > maxTags {
		return nil, errorf(syscall.EINVAL, "metadata of %d bytes: more than an LV's tags hold", len(b))
	}
	tags := make([]string, 0, n)
	for i := range n {
		tags = append(tags, fmt.Sprintf("%s%d/%d:%s", tagPrefix, i, n, s[i*maxTagChunk:min((i+1)*maxTagChunk, len(s))]))
	}
	return tags, nil
}

// decodeTags reads the metadata out of an LV's tags. ok is false if
// none of them is ours (the LV is not a volume); an error says that
// they are ours but damaged.
func decodeTags(tags []string) (m lvmMeta, ok bool, err error) {
	var chunks []string
	n := -1
	for _, t := range tags {
		rest, mine := strings.CutPrefix(t, tagPrefix)
		if !mine {
			continue
		}
		ok = true
		if t == tagIncomplete {
			continue
		}
		pos, chunk, found := strings.Cut(rest, ":")
		is, ns, found2 := strings.Cut(pos, "/")
		if !found || !found2 {
			return m, true, fmt.Errorf("tag %.40q: not rnbd:I/N:DATA", t)
		}
		i, err1 := strconv.Atoi(is)
		tn, err2 := strconv.Atoi(ns)
		if err1 != nil || err2 != nil || tn < 1 || tn > maxTags || i < 0 || i >= tn {
			return m, true, fmt.Errorf("tag %.40q: a bad chunk number", t)
		}
		if n == -1 {
			n = tn
			chunks = make([]string, n)
		}
		if tn != n {
			return m, true, fmt.Errorf("tags of %d and of %d chunks", n, tn)
		}
		if chunks[i] != "" {
			return m, true, fmt.Errorf("chunk %d twice", i)
		}
		if chunk == "" {
			return m, true, fmt.Errorf("chunk %d empty", i)
		}
		chunks[i] = chunk
	}
	if !ok {
		return m, false, nil
	}
	if n == -1 {
		return m, true, errors.New("no metadata tags")
	}
	for i, c := range chunks {
		if c == "" {
			return m, true, fmt.Errorf("chunk %d of %d missing", i, n)
		}
	}
	b, err := base64.StdEncoding.DecodeString(strings.Join(chunks, ""))
	if err != nil {
		return m, true, fmt.Errorf("metadata: %v", err)
	}
	if err := json.Unmarshal(b, &m); err != nil {
		return m, true, fmt.Errorf("metadata: %v", err)
	}
	if m.Kind != kindVolume && m.Kind != kindSnapshot {
		return m, true, fmt.Errorf("metadata of kind %q", m.Kind)
	}
	if CheckName(m.Name) != nil || m.Size <= 0 {
		return m, true, fmt.Errorf("metadata of %q, size %d", m.Name, m.Size)
	}
	return m, true, nil
}

// lvRow is one LV as lvs reports it.
type lvRow struct {
	Name       string
	Pool       string // the thin pool of a thin LV
	Attr       string
	Segtype    string
	Size       int64
	Extent     int64
	MetaSize   int64   // a thin pool's metadata LV
	Data, Meta float64 // percent; -1 if lvs gave none (inactive)
	Tags       []string
}

func (r lvRow) active() bool { return len(r.Attr) > 4 && r.Attr[4] == 'a' }

func (r lvRow) writable() bool { return len(r.Attr) > 1 && r.Attr[1] == 'w' }

func (r lvRow) incomplete() bool {
	for _, t := range r.Tags {
		if t == tagIncomplete {
			return true
		}
	}
	return false
}

// mapped is what a thin LV maps, in bytes (0 if lvs could not say).
func (r lvRow) mapped() int64 {
	if r.Data < 0 {
		return 0
	}
	return int64(r.Data * float64(r.Size) / 100)
}

const lvsFields = "lv_name,pool_lv,lv_attr,segtype,lv_size,vg_extent_size,lv_metadata_size,data_percent,metadata_percent,lv_tags"

// parseLVs reads the JSON lvs writes with --reportformat json.
func parseLVs(out []byte) ([]lvRow, error) {
	var rep struct {
		Report []struct {
			LV []map[string]string `json:"lv"`
		} `json:"report"`
	}
	if err := json.Unmarshal(out, &rep); err != nil {
		return nil, fmt.Errorf("lvs: its JSON: %w", err)
	}
	var rows []lvRow
	for _, part := range rep.Report {
		for _, f := range part.LV {
			r := lvRow{Name: f["lv_name"], Pool: f["pool_lv"], Attr: f["lv_attr"], Segtype: f["segtype"]}
			var err error
			if r.Size, err = lvsInt(f["lv_size"]); err != nil {
				return nil, fmt.Errorf("lvs: LV %s: lv_size: %w", r.Name, err)
			}
			if r.Extent, err = lvsInt(f["vg_extent_size"]); err != nil {
				return nil, fmt.Errorf("lvs: LV %s: vg_extent_size: %w", r.Name, err)
			}
			if r.MetaSize, err = lvsInt(f["lv_metadata_size"]); err != nil {
				return nil, fmt.Errorf("lvs: LV %s: lv_metadata_size: %w", r.Name, err)
			}
			if r.Data, err = lvsPercent(f["data_percent"]); err != nil {
				return nil, fmt.Errorf("lvs: LV %s: data_percent: %w", r.Name, err)
			}
			if r.Meta, err = lvsPercent(f["metadata_percent"]); err != nil {
				return nil, fmt.Errorf("lvs: LV %s: metadata_percent: %w", r.Name, err)
			}
			if t := f["lv_tags"]; t != "" {
				r.Tags = strings.Split(t, ",")
			}
			rows = append(rows, r)
		}
	}
	return rows, nil
}

func lvsInt(s string) (int64, error) {
	if s == "" {
		return 0, nil
	}
	// --units b --nosuffix: whole bytes, though some versions print a
	// fraction (".00").
	s, _, _ = strings.Cut(s, ".")
	return strconv.ParseInt(s, 10, 64)
}

func lvsPercent(s string) (float64, error) {
	if s == "" {
		return -1, nil
	}
	f, err := strconv.ParseFloat(s, 64)
	if err != nil || f < 0 || f > 100 {
		return 0, fmt.Errorf("%q: not a percentage", s)
	}
	return f, nil
}

// lvm runs one of lvm2's tools, bounded by lvmTimeout; a failure carries
// what the tool wrote on stderr.
func (p *LVMThin) lvm(tool string, args ...string) ([]byte, error) {
	ctx, cancel := context.WithTimeout(context.Background(), lvmTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, tool, args...)
	// English messages (matched below), numbers with a '.', no
	// complaint about descriptors the tool inherits.
	cmd.Env = append(os.Environ(), "LC_ALL=C", "LVM_SUPPRESS_FD_WARNINGS=1")
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	if ctx.Err() != nil {
		return nil, fmt.Errorf("%s %s: no answer in %v", tool, strings.Join(args, " "), lvmTimeout)
	}
	if err != nil {
		msg := strings.TrimSpace(stderr.String())
		if msg == "" {
			msg = strings.TrimSpace(stdout.String())
		}
		return nil, &toolError{cmd: tool + " " + strings.Join(args, " "), err: err, stderr: msg}
	}
	return stdout.Bytes(), nil
}

// toolError is a failed lvm2 tool, with what it said.
type toolError struct {
	cmd, stderr string
	err         error
}

func (e *toolError) Error() string { return fmt.Sprintf("%s: %v: %s", e.cmd, e.err, e.stderr) }
func (e *toolError) Unwrap() error { return e.err }

// scan lists the LVs of the volume group (ENOENT if there is none).
func (p *LVMThin) scan() ([]lvRow, error) {
	out, err := p.lvm("lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "-a", "-o", lvsFields, p.vg)
	var te *toolError
	if errors.As(err, &te) && strings.Contains(te.stderr, "not found") {
		return nil, errorf(syscall.ENOENT, "pool %s: no volume group %s (%s)", p.name, p.vg, te.stderr)
	}
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", p.name, err)
	}
	rows, err := parseLVs(out)
	if err != nil {
		return nil, fmt.Errorf("pool %s: %w", p.name, err)
	}
	return rows, nil
}

func (p *LVMThin) thinPoolRow(rows []lvRow) (lvRow, error) {
	for _, r := range rows {
		if r.Name != p.thin {
			continue
		}
		if r.Segtype != "thin-pool" {
			return r, errorf(syscall.EINVAL, "pool %s: %s/%s is a %s LV, not a thin pool (lvcreate --type thin-pool makes one)", p.name, p.vg, p.thin, r.Segtype)
		}
		return r, nil
	}
	return lvRow{}, errorf(syscall.ENOENT, "pool %s: no thin pool %s in volume group %s (lvcreate --type thin-pool -L SIZE -n %s %s makes one)", p.name, p.thin, p.vg, p.thin, p.vg)
}

// ours reads an LV's metadata if it is a volume or snapshot of this
// pool: a thin LV of its thin pool with its tags naming it.
func (p *LVMThin) ours(r lvRow) (lvmMeta, bool, error) {
	if r.Segtype != "thin" || r.Pool != p.thin {
		return lvmMeta{}, false, nil
	}
	m, ok, err := decodeTags(r.Tags)
	if err != nil {
		return m, ok, fmt.Errorf("pool %s: LV %s/%s: its tags: %w", p.name, p.vg, r.Name, err)
	}
	if !ok || m.Pool != p.name || lvName(p.vg, m.Kind, m.Name) != r.Name {
		return m, false, nil
	}
	return m, true, nil
}

// find looks up the LV of a volume or snapshot: the LV's row (ok false
// if no LV has its name) and its metadata (mine false if the LV is not
// it).
type found struct {
	row  lvRow
	meta lvmMeta
	ok   bool // an LV of that name
	mine bool // and it is the volume or snapshot
}

func (p *LVMThin) find(rows []lvRow, kind, name string) (found, error) {
	lv := lvName(p.vg, kind, name)
	for _, r := range rows {
		if r.Name != lv {
			continue
		}
		m, mine, err := p.ours(r)
		if err != nil {
			return found{row: r, ok: true}, err
		}
		return found{row: r, meta: m, ok: true, mine: mine && m.Kind == kind && m.Name == name}, nil
	}
	return found{}, nil
}

func (p *LVMThin) devPath(lv string) string { return "/dev/" + p.vg + "/" + lv }

func (p *LVMThin) volume(m lvmMeta, lv string) Volume {
	return Volume{Name: m.Name, Pool: p.name, Size: m.Size, Source: m.Source, SourceSnapshot: m.SourceSnapshot,
		Created: m.Created, Labels: m.Labels, Path: p.devPath(lv)}
}

func (p *LVMThin) snapshot(m lvmMeta, lv string) Snapshot {
	return Snapshot{Name: m.Name, Pool: p.name, Volume: m.Volume, Size: m.Size, Created: m.Created, Path: p.devPath(lv)}
}

// get finds a whole volume or snapshot (ENOENT if there is none, or
// only a half-made one).
func (p *LVMThin) get(kind, name string) (found, error) {
	rows, err := p.scan()
	if err != nil {
		return found{}, err
	}
	f, err := p.find(rows, kind, name)
	if err != nil {
		return f, err
	}
	switch {
	case !f.ok || (f.mine && f.row.incomplete()):
		return f, errorf(syscall.ENOENT, "pool %s: no %s %s", p.name, kind, name)
	case !f.mine:
		return f, errorf(syscall.ENOENT, "pool %s: LV %s/%s is not %s %s of the pool (its tags do not say so)", p.name, p.vg, f.row.Name, kind, name)
	}
	return f, nil
}

// activate makes an LV's block device there (a restart of the node
// leaves LVs inactive unless the system activates them).
func (p *LVMThin) activate(r lvRow) error {
	if r.active() {
		return nil
	}
	if _, err := p.lvm("lvchange", "-ay", "-K", p.vg+"/"+r.Name); err != nil {
		return fmt.Errorf("pool %s: activating %s/%s: %w", p.name, p.vg, r.Name, err)
	}
	return nil
}

// Get returns the volume name, its block device active; ENOENT if there
// is none.
func (p *LVMThin) Get(name string) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	f, err := p.get(kindVolume, name)
	if err != nil {
		return Volume{}, err
	}
	if err := p.activate(f.row); err != nil {
		return Volume{}, err
	}
	return p.volume(f.meta, f.row.Name), nil
}

// List implements Pool. LVs that are not the pool's are left out; one
// whose tags are the pool's but damaged is an error naming it.
func (p *LVMThin) List() ([]Volume, error) {
	rows, err := p.scan()
	if err != nil {
		return nil, err
	}
	var vs []Volume
	for _, r := range rows {
		m, ok, err := p.ours(r)
		if err != nil {
			return nil, err
		}
		if ok && m.Kind == kindVolume && !r.incomplete() {
			vs = append(vs, p.volume(m, r.Name))
		}
	}
	sort.Slice(vs, func(i, j int) bool { return vs[i].Name < vs[j].Name })
	return vs, nil
}

// Capacity implements Pool (the file's comment says how it counts).
func (p *LVMThin) Capacity() (Capacity, error) {
	rows, err := p.scan()
	if err != nil {
		return Capacity{}, err
	}
	c, _, err := p.capacity(rows)
	return c, err
}

// capacity counts the space of the thin pool; full says which of its
// data or metadata is at the high-water mark ("" if neither).
func (p *LVMThin) capacity(rows []lvRow) (c Capacity, full string, err error) {
	tp, err := p.thinPoolRow(rows)
	if err != nil {
		return c, "", err
	}
	c.Total = tp.Size
	c.MetadataSize = tp.MetaSize
	if tp.Data >= 0 {
		c.Used = int64(tp.Data * float64(tp.Size) / 100)
	}
	if tp.Meta >= 0 {
		c.MetadataUsed = int64(tp.Meta * float64(tp.MetaSize) / 100)
	}
	for _, r := range rows {
		if r.Segtype == "thin" && r.Pool == p.thin && r.writable() {
			c.Promised += max(r.Size-r.mapped(), 0)
		}
	}
	c.Allocatable = max(c.Total-c.Used-c.Promised, 0)
	switch {
	case tp.Data >= highWater:
		full = fmt.Sprintf("thin pool %s/%s is full: data %.2f%% used (at most %.0f%% before new volumes are refused)", p.vg, p.thin, tp.Data, highWater)
	case tp.Meta >= highWater:
		full = fmt.Sprintf("thin pool %s/%s is full: metadata %.2f%% used (at most %.0f%% before new volumes are refused)", p.vg, p.thin, tp.Meta, highWater)
	}
	return c, full, nil
}

// roundUp is size rounded up to the volume group's extents, as LVM
// makes it.
func roundUp(size, extent int64) int64 {
	if extent <= 0 {
		return size
	}
	return (size + extent - 1) / extent * extent
}

// Create implements Pool. A clone (Spec.From, Spec.FromSnapshot) is a
// writable thin snapshot of its source, grown to the size asked.
func (p *LVMThin) Create(s Spec) (Volume, bool, error) {
	if err := CheckSpec(s); err != nil {
		return Volume{}, false, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	rows, err := p.scan()
	if err != nil {
		return Volume{}, false, err
	}
	f, err := p.find(rows, kindVolume, s.Name)
	if err != nil {
		return Volume{}, false, err
	}
	lv := lvName(p.vg, kindVolume, s.Name)
	switch {
	case f.ok && !f.mine:
		return Volume{}, false, errorf(syscall.EEXIST, "pool %s: volume %s would be LV %s/%s, which is there and is not the pool's", p.name, s.Name, p.vg, lv)
	case f.ok && f.row.incomplete():
		// A clone a crash left half-made: made again from the start.
		if _, err := p.lvm("lvremove", "-y", p.vg+"/"+lv); err != nil {
			return Volume{}, false, fmt.Errorf("pool %s: removing the half-made volume %s: %w", p.name, s.Name, err)
		}
		if rows, err = p.scan(); err != nil {
			return Volume{}, false, err
		}
	case f.ok:
		v := p.volume(f.meta, lv)
		if diff := differs(v, s); diff != "" {
			return v, false, errorf(syscall.EEXIST, "pool %s: volume %s exists with %s", p.name, s.Name, diff)
		}
		if err := p.activate(f.row); err != nil {
			return v, false, err
		}
		return v, false, nil
	}
	var src lvRow // the clone's source
	switch {
	case s.From != "":
		from, err := p.find(rows, kindVolume, s.From)
		if err != nil {
			return Volume{}, false, err
		}
		if !from.mine || from.row.incomplete() {
			return Volume{}, false, errorf(syscall.ENOENT, "pool %s: no volume %s to clone", p.name, s.From)
		}
		if s.Size < from.meta.Size {
			return Volume{}, false, errorf(syscall.EINVAL, "pool %s: a clone of %s (%d bytes) cannot be smaller (%d)", p.name, s.From, from.meta.Size, s.Size)
		}
		src = from.row
	case s.FromSnapshot != "":
		from, err := p.find(rows, kindSnapshot, s.FromSnapshot)
		if err != nil {
			return Volume{}, false, err
		}
		if !from.mine {
			return Volume{}, false, errorf(syscall.ENOENT, "pool %s: no snapshot %s to clone", p.name, s.FromSnapshot)
		}
		if s.Size < from.meta.Size {
			return Volume{}, false, errorf(syscall.EINVAL, "pool %s: a clone of snapshot %s (%d bytes) cannot be smaller (%d)", p.name, s.FromSnapshot, from.meta.Size, s.Size)
		}
		src = from.row
	}
	c, full, err := p.capacity(rows)
	if err != nil {
		return Volume{}, false, err
	}
	if full != "" {
		return Volume{}, false, errorf(syscall.ENOSPC, "pool %s: %s", p.name, full)
	}
	ext := extentOf(rows, p.thin)
	// What the new LV promises: its size, less what a clone maps from
	// its source from the start.
	need := roundUp(s.Size, ext) - src.mapped()
	if need > c.Allocatable {
		return Volume{}, false, errorf(syscall.ENOSPC, "pool %s: %d bytes asked, %d allocatable in thin pool %s/%s", p.name, s.Size, c.Allocatable, p.vg, p.thin)
	}
	m := lvmMeta{Kind: kindVolume, Name: s.Name, Pool: p.name, Size: s.Size, Source: s.From, SourceSnapshot: s.FromSnapshot,
		Created: p.now().UTC().Truncate(time.Second), Labels: maps.Clone(s.Labels)}
	tags, err := encodeTags(m)
	if err != nil {
		return Volume{}, false, err
	}
	if src.Name == "" {
		args := []string{"-y", "--type", "thin", "--thinpool", p.thin, "-V", strconv.FormatInt(s.Size, 10) + "b", "-n", lv}
		args = append(append(args, tagArgs("--addtag", tags)...), p.vg)
		if _, err := p.lvm("lvcreate", args...); err != nil {
			return Volume{}, false, p.createError(s.Name, err)
		}
		return p.volume(m, lv), true, nil
	}
	grow := s.Size > src.Size
	if grow {
		tags = append(tags, tagIncomplete)
	}
	args := []string{"-y", "-s", "-kn", "-ay", "-prw", "-n", lv}
	args = append(append(args, tagArgs("--addtag", tags)...), p.vg+"/"+src.Name)
	if _, err := p.lvm("lvcreate", args...); err != nil {
		return Volume{}, false, p.createError(s.Name, err)
	}
	if grow {
		if _, err := p.lvm("lvextend", "-y", "-L", strconv.FormatInt(s.Size, 10)+"b", p.vg+"/"+lv); err != nil {
			return Volume{}, false, fmt.Errorf("pool %s: growing the clone %s (left half-made, removed by a retry): %w", p.name, s.Name, err)
		}
		if _, err := p.lvm("lvchange", "--deltag", tagIncomplete, p.vg+"/"+lv); err != nil {
			return Volume{}, false, fmt.Errorf("pool %s: the clone %s (left half-made, removed by a retry): %w", p.name, s.Name, err)
		}
	}
	return p.volume(m, lv), true, nil
}

// createError classifies a failed lvcreate: LVM's own refusal for
// space is ENOSPC.
func (p *LVMThin) createError(name string, err error) error {
	var te *toolError
	if errors.As(err, &te) && (strings.Contains(te.stderr, "nsufficient") || strings.Contains(te.stderr, "threshold")) {
		return errorf(syscall.ENOSPC, "pool %s: volume %s: %s", p.name, name, te.stderr)
	}
	return fmt.Errorf("pool %s: volume %s: %w", p.name, name, err)
}

func extentOf(rows []lvRow, thin string) int64 {
	for _, r := range rows {
		if r.Name == thin {
			return r.Extent
		}
	}
	return 0
}

func tagArgs(flag string, tags []string) []string {
	var a []string
	for _, t := range tags {
		a = append(a, flag, t)
	}
	return a
}

// Resize grows volume name to size; smaller is EINVAL, the same size
// succeeds. The LV is grown first (lvextend), the size in its tags then:
// a crash between the two leaves an LV larger than its metadata says,
// which a retry finds grown and only records.
func (p *LVMThin) Resize(name string, size int64) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkSize(size); err != nil {
		return Volume{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	f, err := p.get(kindVolume, name)
	if err != nil {
		return Volume{}, err
	}
	v := p.volume(f.meta, f.row.Name)
	if f.row.Size < v.Size {
		// Only a tool outside the pool makes this (lvreduce): the
		// metadata is the truth.
		if _, err := p.lvm("lvextend", "-y", "-L", strconv.FormatInt(v.Size, 10)+"b", p.vg+"/"+f.row.Name); err != nil {
			return v, fmt.Errorf("pool %s: growing %s back to %d bytes: %w", p.name, name, v.Size, err)
		}
	}
	switch {
	case size == v.Size:
		return v, nil
	case size < v.Size:
		return v, errorf(syscall.EINVAL, "pool %s: volume %s is %d bytes: a volume grows only (asked %d)", p.name, name, v.Size, size)
	}
	if f.row.Size < size {
		rows, err := p.scan()
		if err != nil {
			return v, err
		}
		c, full, err := p.capacity(rows)
		if err != nil {
			return v, err
		}
		if full != "" {
			return v, errorf(syscall.ENOSPC, "pool %s: %s", p.name, full)
		}
		if more := roundUp(size, f.row.Extent) - f.row.Size; more > c.Allocatable {
			return v, errorf(syscall.ENOSPC, "pool %s: %d more bytes asked, %d allocatable in thin pool %s/%s", p.name, more, c.Allocatable, p.vg, p.thin)
		}
		if _, err := p.lvm("lvextend", "-y", "-L", strconv.FormatInt(size, 10)+"b", p.vg+"/"+f.row.Name); err != nil {
			return v, fmt.Errorf("pool %s: growing %s: %w", p.name, name, err)
		}
	}
	grown := f.meta
	grown.Size = size
	if err := p.retag(f.row, grown); err != nil {
		return v, err
	}
	v.Size = size
	return v, nil
}

// retag replaces the metadata in an LV's tags, in one lvchange (one
// commit of LVM's metadata): tags that stay are not touched.
func (p *LVMThin) retag(r lvRow, m lvmMeta) error {
	tags, err := encodeTags(m)
	if err != nil {
		return err
	}
	keep := map[string]bool{}
	for _, t := range tags {
		keep[t] = true
	}
	var args []string
	for _, t := range r.Tags {
		if strings.HasPrefix(t, tagPrefix) && t != tagIncomplete && !keep[t] {
			args = append(args, "--deltag", t)
		}
		delete(keep, t)
	}
	for _, t := range tags {
		if keep[t] {
			args = append(args, "--addtag", t)
		}
	}
	if len(args) == 0 {
		return nil
	}
	if _, err := p.lvm("lvchange", append(args, p.vg+"/"+r.Name)...); err != nil {
		return fmt.Errorf("pool %s: the metadata of %s: %w", p.name, m.Name, err)
	}
	return nil
}

// Delete removes volume name; one that is not there is success. An LV
// of its name that is not the pool's is not removed (ENOENT).
func (p *LVMThin) Delete(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return p.remove(kindVolume, name)
}

func (p *LVMThin) remove(kind, name string) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	rows, err := p.scan()
	if err != nil {
		return err
	}
	f, err := p.find(rows, kind, name)
	switch {
	case err != nil:
		return err
	case !f.ok:
		return nil
	case !f.mine:
		return errorf(syscall.ENOENT, "pool %s: LV %s/%s is not %s %s of the pool (its tags do not say so): not removed", p.name, p.vg, f.row.Name, kind, name)
	}
	if _, err := p.lvm("lvremove", "-y", p.vg+"/"+f.row.Name); err != nil {
		return fmt.Errorf("pool %s: removing %s %s: %w", p.name, kind, name, err)
	}
	return nil
}

// CreateSnapshot implements Pool: a read-only thin snapshot of the
// volume's LV, activated (without LVM's activation-skip flag, which
// thin snapshots otherwise get).
func (p *LVMThin) CreateSnapshot(volume, name string) (Snapshot, bool, error) {
	for _, n := range []string{volume, name} {
		if err := CheckName(n); err != nil {
			return Snapshot{}, false, err
		}
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	rows, err := p.scan()
	if err != nil {
		return Snapshot{}, false, err
	}
	f, err := p.find(rows, kindSnapshot, name)
	if err != nil {
		return Snapshot{}, false, err
	}
	lv := lvName(p.vg, kindSnapshot, name)
	switch {
	case f.ok && !f.mine:
		return Snapshot{}, false, errorf(syscall.EEXIST, "pool %s: snapshot %s would be LV %s/%s, which is there and is not the pool's", p.name, name, p.vg, lv)
	case f.ok:
		s := p.snapshot(f.meta, lv)
		if s.Volume != volume {
			return s, false, errorf(syscall.EEXIST, "pool %s: snapshot %s exists, of volume %s (asked %s)", p.name, name, s.Volume, volume)
		}
		return s, false, p.activate(f.row)
	}
	v, err := p.find(rows, kindVolume, volume)
	if err != nil {
		return Snapshot{}, false, err
	}
	if !v.mine || v.row.incomplete() {
		return Snapshot{}, false, errorf(syscall.ENOENT, "pool %s: no volume %s", p.name, volume)
	}
	if _, full, err := p.capacity(rows); err != nil {
		return Snapshot{}, false, err
	} else if full != "" {
		return Snapshot{}, false, errorf(syscall.ENOSPC, "pool %s: %s", p.name, full)
	}
	m := lvmMeta{Kind: kindSnapshot, Name: name, Pool: p.name, Volume: volume, Size: v.meta.Size, Created: p.now().UTC().Truncate(time.Second)}
	tags, err := encodeTags(m)
	if err != nil {
		return Snapshot{}, false, err
	}
	args := []string{"-y", "-s", "-kn", "-ay", "-pr", "-n", lv}
	args = append(append(args, tagArgs("--addtag", tags)...), p.vg+"/"+v.row.Name)
	if _, err := p.lvm("lvcreate", args...); err != nil {
		return Snapshot{}, false, fmt.Errorf("pool %s: snapshot %s of %s: %w", p.name, name, volume, err)
	}
	return p.snapshot(m, lv), true, nil
}

// Snapshots implements Pool.
func (p *LVMThin) Snapshots() ([]Snapshot, error) {
	rows, err := p.scan()
	if err != nil {
		return nil, err
	}
	var ss []Snapshot
	for _, r := range rows {
		m, ok, err := p.ours(r)
		if err != nil {
			return nil, err
		}
		if ok && m.Kind == kindSnapshot && !r.incomplete() {
			ss = append(ss, p.snapshot(m, r.Name))
		}
	}
	sort.Slice(ss, func(i, j int) bool { return ss[i].Name < ss[j].Name })
	return ss, nil
}

// DeleteSnapshot implements Pool.
func (p *LVMThin) DeleteSnapshot(name string) error {
	if err := CheckName(name); err != nil {
		return err
	}
	return p.remove(kindSnapshot, name)
}

var _ Pool = (*LVMThin)(nil)

// SetLabels replaces volume name's labels: its LV retagged in one
// lvchange.
func (p *LVMThin) SetLabels(name string, labels map[string]string) (Volume, error) {
	if err := CheckName(name); err != nil {
		return Volume{}, err
	}
	if err := checkLabels(labels); err != nil {
		return Volume{}, err
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	f, err := p.get(kindVolume, name)
	if err != nil {
		return Volume{}, err
	}
	m := f.meta
	m.Labels = maps.Clone(labels)
	if err := p.retag(f.row, m); err != nil {
		return p.volume(f.meta, f.row.Name), err
	}
	return p.volume(m, f.row.Name), nil
}
