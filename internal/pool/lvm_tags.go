// The LVM thin pool's names and metadata (lvm.go is the pool).
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

package pool

import (
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"
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
	if checkStored(m.Name) != nil || m.Size <= 0 {
		return m, true, fmt.Errorf("metadata of %q, size %d", m.Name, m.Size)
	}
	return m, true, nil
}

func tagArgs(flag string, tags []string) []string {
	var a []string
	for _, t := range tags {
		a = append(a, flag, t)
	}
	return a
}
