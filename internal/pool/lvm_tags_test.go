// Tests of the LVM thin pool's LV names and of its metadata in LV tags,
// pure: they run everywhere.
package pool

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
	"time"
	"unicode/utf8"
)

var tagRE = regexp.MustCompile(`^[A-Za-z0-9_+.\-/=!:&#]+$`)

// LV names: readable where they fit, one to one, valid for LVM, without
// its reserved substrings, volumes and snapshots apart.
func TestLVMNames(t *testing.T) {
	for _, c := range []struct{ kind, name, want string }{
		{kindVolume, "vol-1", "rnbd.v.vol-1"},
		{kindSnapshot, "vol-1", "rnbd.s.vol-1"},
		{kindVolume, "a_tmeta", "rnbd.v.a+tmeta"},
		{kindVolume, "..", "rnbd.v..."},
	} {
		if got := lvName("vg0", c.kind, c.name); got != c.want {
			t.Errorf("lvName(%s %q) = %q, want %q", c.kind, c.name, got, c.want)
		}
	}
	names := []string{"a", "a_b", "a-b", "a.b", "_", "-", "snapshot", "pvmove0", "x_cdata_rimage",
		strings.Repeat("x", 120), strings.Repeat("x", 121), strings.Repeat("y", 128), strings.Repeat("-", 60), strings.Repeat("-", 128),
		strings.Repeat("_", 128)}
	seen := map[string]string{}
	for _, vg := range []string{"vg0", strings.Repeat("g-", 20)} {
		clear(seen)
		for _, n := range names {
			for _, kind := range []string{kindVolume, kindSnapshot} {
				lv := lvName(vg, kind, n)
				if err := validLVMName(lv); err != nil || strings.Contains(lv, "_") || len(lv) > lvNameMax || dmNameLen(vg, lv) > dmNameMax {
					t.Errorf("vg %s, %s %q: LV %q (dm name %d bytes) is not one LVM takes", vg, kind, n, lv, dmNameLen(vg, lv))
				}
				if other, dup := seen[lv]; dup {
					t.Errorf("vg %s: %s and %s are both LV %s", vg, other, kind+" "+n, lv)
				}
				seen[lv] = kind + " " + n
			}
		}
	}
	if lv := lvName("vg0", kindVolume, strings.Repeat("y", 128)); !strings.HasPrefix(lv, "rnbd.v+") || len(lv) != 39 {
		t.Errorf("a name too long for LVM: LV %q, want rnbd.v+ and 32 hex digits", lv)
	}
}

func metaForTest(labels map[string]string) lvmMeta {
	return lvmMeta{Kind: kindVolume, Name: "vol_1", Pool: "thin", Size: 64 << 20, Source: "v0", SourceSnapshot: "",
		Created: time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC), Labels: labels}
}

// The metadata survives its tags: every tag is one LVM takes (its
// alphabet, at most 1024 bytes), in any order, among others' tags,
// with labels at the bound made of what JSON escapes most.
func TestLVMTagsRoundTrip(t *testing.T) {
	hostile := hostileLabel(MaxLabelBytes - 4)
	for _, labels := range []map[string]string{nil, {"pvc": "data-0"}, {"k,=:": hostile}, {"a": strings.Repeat("z", MaxLabelBytes-1)}} {
		if err := checkLabels(labels); err != nil {
			t.Fatalf("labels for the test: %v", err)
		}
		m := metaForTest(labels)
		tags, err := encodeTags(m)
		if err != nil {
			t.Fatalf("encode: %v", err)
		}
		for _, tag := range tags {
			if !tagRE.MatchString(tag) || len(tag) > 1024 {
				t.Fatalf("tag %.60q... (%d bytes) is not one LVM takes", tag, len(tag))
			}
		}
		all := append([]string{"foreign", "other:tag", tagIncomplete}, tags...)
		rand.Shuffle(len(all), func(i, j int) { all[i], all[j] = all[j], all[i] })
		got, ok, err := decodeTags(all)
		if err != nil || !ok {
			t.Fatalf("decode: ok %v, %v", ok, err)
		}
		if gb, _ := json.Marshal(got); !bytes.Equal(gb, mustJSON(t, m)) {
			t.Fatalf("decoded %s\nwant %s", gb, mustJSON(t, m))
		}
	}
	if _, ok, err := decodeTags([]string{"foreign", "rnbdx"}); ok || err != nil {
		t.Fatalf("tags of another: ok %v, %v", ok, err)
	}
}

func mustJSON(t *testing.T, v any) []byte {
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// Damaged metadata is an error, never a volume with half its metadata.
func TestLVMTagsDamaged(t *testing.T) {
	tags, err := encodeTags(metaForTest(map[string]string{"a": strings.Repeat("z", 1500)}))
	if err != nil || len(tags) < 2 {
		t.Fatalf("want several tags: %d, %v", len(tags), err)
	}
	for name, ts := range map[string][]string{
		"a chunk missing":   tags[1:],
		"a chunk twice":     append(append([]string{}, tags...), tags[0]),
		"another count":     append([]string{strings.Replace(tags[0], fmt.Sprintf("/%d:", len(tags)), fmt.Sprintf("/%d:", len(tags)+1), 1)}, tags[1:]...),
		"no number":         {"rnbd:x:abc"},
		"index past count":  {"rnbd:3/2:abc"},
		"count 0":           {"rnbd:0/0:abc"},
		"huge count":        {"rnbd:0/99999999999999999999:abc"},
		"empty chunk":       {"rnbd:0/1:"},
		"not base64":        {"rnbd:0/1:!!!!"},
		"not JSON":          {"rnbd:0/1:" + "bm90IGpzb24="},
		"only incomplete":   {tagIncomplete},
		"another kind":      retagged(t, func(m *lvmMeta) { m.Kind = "disk" }),
		"a bad name":        retagged(t, func(m *lvmMeta) { m.Name = "a/b" }),
		"no size":           retagged(t, func(m *lvmMeta) { m.Size = 0 }),
		"a chunk corrupted": {tags[0][:len(tags[0])-4] + "####", tags[1], tags[2]},
	} {
		if _, ok, err := decodeTags(ts); !ok || err == nil {
			t.Errorf("%s: ok %v, err %v; want an error", name, ok, err)
		}
	}
}

func retagged(t *testing.T, f func(*lvmMeta)) []string {
	m := metaForTest(nil)
	f(&m)
	return []string{"rnbd:0/1:" + base64.StdEncoding.EncodeToString(mustJSON(t, m))}
}

// hostileLabel is n bytes of what JSON escapes (control characters, <>&,
// quotes, backslashes) and of multi-byte UTF-8, cut at a rune.
func hostileLabel(n int) string {
	var b strings.Builder
	for _, r := range strings.Repeat("\x01<>&\"\\é\u2028", n) {
		if b.Len()+utf8.RuneLen(r) > n {
			break
		}
		b.WriteRune(r)
	}
	return b.String()
}

// FuzzLVMTags: tags are what anyone with lvchange can write; no input
// makes the decoder panic, and what it accepts encodes back to the same.
func FuzzLVMTags(f *testing.F) {
	tags, _ := encodeTags(metaForTest(map[string]string{"k": "v"}))
	f.Add(strings.Join(tags, ","))
	f.Add("rnbd:0/1:e30=")
	f.Add("rnbd:0/2:eyJr,rnbd:1/2:aW5kIjoidm9sdW1lIn0=")
	f.Add(tagIncomplete + ",x")
	f.Fuzz(func(t *testing.T, s string) {
		m, ok, err := decodeTags(strings.Split(s, ","))
		if err != nil || !ok {
			return
		}
		again, err := encodeTags(m)
		if err != nil {
			return // valid JSON of more labels than a create allows
		}
		m2, ok, err := decodeTags(again)
		if err != nil || !ok || !bytes.Equal(mustJSON(t, m), mustJSON(t, m2)) {
			t.Fatalf("%+v encoded and decoded: %+v, %v, %v", m, m2, ok, err)
		}
	})
}
