// What the LVM thin pool learns from lvs, and how it runs lvm2's tools
// (lvm.go is the pool).

package pool

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// lvmTimeout bounds each of lvm2's tools.
const lvmTimeout = 2 * time.Minute

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

// lvm runs one of lvm2's tools.
func (p *LVMThin) lvm(tool string, args ...string) ([]byte, error) { return p.run(tool, args...) }

// runLVM runs one of lvm2's tools, bounded by lvmTimeout; a failure
// carries what the tool wrote on stderr.
func runLVM(tool string, args ...string) ([]byte, error) {
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

func extentOf(rows []lvRow, thin string) int64 {
	for _, r := range rows {
		if r.Name == thin {
			return r.Extent
		}
	}
	return 0
}
