// Tests of the LVM thin pool. The pure parts (LV names, the metadata in
// tags, lvs's JSON, the capacity's arithmetic) run everywhere; the rest
// runs against a real thin pool on a loop device, made by lvmTestPool,
// which needs root, device-mapper with its thin-pool target and lvm2's
// tools: where one is missing they skip saying which (the VM tier's lvm
// part has them all, and sets RNBD_LVM_REQUIRED=1 to make a skip a
// failure).
package pool

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode/utf8"

	"golang.org/x/sys/unix"
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

// What lvs writes (lvm2 2.03, --reportformat json --units b --nosuffix).
const lvsSample = `  {
      "report": [
          {
              "lv": [
                  {"lv_name":"thin", "pool_lv":"", "lv_attr":"twi-aotz--", "segtype":"thin-pool", "lv_size":"67108864", "vg_extent_size":"4194304", "lv_metadata_size":"4194304", "data_percent":"12.50", "metadata_percent":"10.99", "lv_tags":""},
                  {"lv_name":"rnbd.v.a", "pool_lv":"thin", "lv_attr":"Vwi-a-tz--", "segtype":"thin", "lv_size":"33554432", "vg_extent_size":"4194304", "lv_metadata_size":"", "data_percent":"25.00", "metadata_percent":"", "lv_tags":"rnbd:0/1:e30=,other"},
                  {"lv_name":"rnbd.v.b", "pool_lv":"thin", "lv_attr":"Vwi---tz--", "segtype":"thin", "lv_size":"8388608.00", "vg_extent_size":"4194304", "lv_metadata_size":"", "data_percent":"", "metadata_percent":"", "lv_tags":""},
                  {"lv_name":"[thin_tdata]", "pool_lv":"", "lv_attr":"Twi-ao----", "segtype":"linear", "lv_size":"67108864", "vg_extent_size":"4194304", "lv_metadata_size":"", "data_percent":"", "metadata_percent":"", "lv_tags":""}
              ]
          }
      ]
  }
`

func TestLVMParseLVs(t *testing.T) {
	rows, err := parseLVs([]byte(lvsSample))
	if err != nil || len(rows) != 4 {
		t.Fatalf("%d rows, %v", len(rows), err)
	}
	tp, a, b := rows[0], rows[1], rows[2]
	if tp.Name != "thin" || tp.Segtype != "thin-pool" || tp.Size != 64<<20 || tp.MetaSize != 4<<20 || tp.Data != 12.5 || tp.Meta != 10.99 || !tp.active() || tp.Extent != 4<<20 {
		t.Errorf("thin pool %+v", tp)
	}
	if a.Pool != "thin" || a.Size != 32<<20 || a.mapped() != 8<<20 || !a.writable() || !a.active() || len(a.Tags) != 2 || a.Tags[1] != "other" {
		t.Errorf("thin LV %+v", a)
	}
	if b.Size != 8<<20 || b.Data != -1 || b.active() || b.mapped() != 0 || b.Tags != nil {
		t.Errorf("inactive thin LV %+v", b)
	}
	for _, bad := range []string{`{`, `{"report":[{"lv":[{"lv_name":"x","lv_size":"lots"}]}]}`, `{"report":[{"lv":[{"lv_name":"x","data_percent":"101"}]}]}`} {
		if _, err := parseLVs([]byte(bad)); err == nil {
			t.Errorf("%s: parsed", bad)
		}
	}
}

// The capacity's arithmetic: what writable thin LVs of the thin pool may
// still claim (an inactive one whole), nothing for read-only snapshots
// or other pools' LVs; full at the high-water mark, naming which.
func TestLVMCapacityArithmetic(t *testing.T) {
	p := &LVMThin{name: "p", vg: "vg", thin: "thin"}
	rows := []lvRow{
		{Name: "thin", Segtype: "thin-pool", Size: 100 << 20, MetaSize: 4 << 20, Data: 50, Meta: 25, Attr: "twi-aotz--"},
		{Name: "a", Segtype: "thin", Pool: "thin", Size: 40 << 20, Data: 25, Attr: "Vwi-a-tz--"}, // 30 MiB more
		{Name: "b", Segtype: "thin", Pool: "thin", Size: 8 << 20, Data: -1, Attr: "Vwi---tz--"},  // inactive: 8
		{Name: "s", Segtype: "thin", Pool: "thin", Size: 40 << 20, Data: 25, Attr: "Vri-a-tz--"}, // read-only: 0
		{Name: "o", Segtype: "thin", Pool: "other", Size: 40 << 20, Data: 0, Attr: "Vwi-a-tz--"}, // another pool
		{Name: "l", Segtype: "linear", Size: 40 << 20, Data: -1, Attr: "-wi-a-----"},
	}
	c, full, err := p.capacity(rows)
	want := Capacity{Total: 100 << 20, Used: 50 << 20, Promised: 38 << 20, Allocatable: 12 << 20, MetadataSize: 4 << 20, MetadataUsed: 1 << 20}
	if err != nil || c != want || full != "" {
		t.Fatalf("capacity %+v, %q, %v; want %+v", c, full, err, want)
	}
	rows[0].Data = 95
	if c, full, _ = p.capacity(rows); !strings.Contains(full, "data 95.00% used") || c.Allocatable != 0 {
		t.Fatalf("at the mark: %+v, %q", c, full)
	}
	rows[0].Data, rows[0].Meta = 10, 99.5
	if _, full, _ = p.capacity(rows); !strings.Contains(full, "metadata 99.50% used") {
		t.Fatalf("metadata full: %q", full)
	}
	if _, _, err := p.capacity(rows[1:]); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("no thin pool: %v", err)
	}
}

// --- against a real thin pool ---

var lvmSeq atomic.Int32

// lvmSkip says why a real thin pool cannot be made here ("" if it can).
func lvmSkip() string {
	if os.Geteuid() != 0 {
		return "needs root (device-mapper, loop devices)"
	}
	for _, tool := range []string{"lvcreate", "lvs", "vgcreate", "pvcreate", "vgremove", "pvremove"} {
		if _, err := exec.LookPath(tool); err != nil {
			return "no lvm2 tools (" + tool + ": Debian's lvm2 package)"
		}
	}
	if _, err := os.Stat("/dev/mapper/control"); err != nil {
		return "no device-mapper (/dev/mapper/control: the dm-mod module)"
	}
	if _, err := os.Stat("/sys/module/dm_thin_pool"); err != nil {
		exec.Command("modprobe", "dm-thin-pool").Run()
		if _, err := os.Stat("/sys/module/dm_thin_pool"); err != nil {
			return "no thin-pool target of device-mapper (the dm-thin-pool module)"
		}
	}
	if _, err := os.Stat("/dev/loop-control"); err != nil {
		return "no loop devices (/dev/loop-control)"
	}
	return ""
}

// run runs a tool the test needs to succeed.
func run(t *testing.T, tool string, args ...string) string {
	t.Helper()
	out, err := exec.Command(tool, args...).CombinedOutput()
	if err != nil {
		t.Fatalf("%s %s: %v: %s", tool, strings.Join(args, " "), err, out)
	}
	return string(out)
}

// lvmTestPool makes a volume group on a loop device over a sparse file
// and a thin pool "thin" of dataMiB in it, removed at the end; it
// returns the volume group's name.
func lvmTestPool(t *testing.T, dataMiB int) string {
	t.Helper()
	if why := lvmSkip(); why != "" {
		if os.Getenv("RNBD_LVM_REQUIRED") != "" {
			t.Fatalf("RNBD_LVM_REQUIRED is set, but %s", why)
		}
		t.Skip(why)
	}
	img := filepath.Join(t.TempDir(), "pv.img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(int64(dataMiB+32) << 20); err != nil {
		t.Fatal(err)
	}
	loop := attachLoop(t, f)
	f.Close()
	vg := fmt.Sprintf("rnbdtest%d.%d", os.Getpid(), lvmSeq.Add(1))
	run(t, "pvcreate", "-y", "-q", loop)
	t.Cleanup(func() { exec.Command("pvremove", "-y", "-q", loop).Run() })
	run(t, "vgcreate", "-q", vg, loop)
	t.Cleanup(func() {
		if out, err := exec.Command("vgremove", "-ff", "-y", vg).CombinedOutput(); err != nil {
			t.Errorf("vgremove %s: %v: %s", vg, err, out)
		}
	})
	run(t, "lvcreate", "-q", "-y", "--type", "thin-pool", "-L", fmt.Sprintf("%dm", dataMiB), "-n", "thin", vg)
	return vg
}

// attachLoop attaches f to a free loop device (detached when the test
// ends and LVM has let go of it: autoclear).
func attachLoop(t *testing.T, f *os.File) string {
	t.Helper()
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	for range 10 {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			t.Fatalf("LOOP_CTL_GET_FREE: %v", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		var l *os.File
		for range 50 { // devtmpfs makes the node
			if l, err = os.OpenFile(dev, os.O_RDWR, 0); err == nil || !errors.Is(err, os.ErrNotExist) {
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			t.Fatal(err)
		}
		cfg := unix.LoopConfig{Fd: uint32(f.Fd()), Info: unix.LoopInfo64{Flags: unix.LO_FLAGS_AUTOCLEAR}}
		err = unix.IoctlLoopConfigure(int(l.Fd()), &cfg)
		if errors.Is(err, unix.EBUSY) { // taken by another meanwhile
			l.Close()
			continue
		}
		if err != nil {
			l.Close()
			t.Fatalf("LOOP_CONFIGURE %s: %v", dev, err)
		}
		t.Cleanup(func() { l.Close() })
		return dev
	}
	t.Fatal("no free loop device")
	return ""
}

func openLVMTest(t *testing.T, vg string) *LVMThin {
	t.Helper()
	p, removed, err := OpenLVMThin("thin", vg, "thin")
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 0 {
		t.Fatalf("a new pool removed %v", removed)
	}
	p.now = func() time.Time { return time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC) }
	return p
}

// lvsOf is the LVs of vg by name (hidden ones left out), with their
// size and tags.
func lvsOf(t *testing.T, vg string) map[string]lvRow {
	t.Helper()
	out := run(t, "lvs", "--reportformat", "json", "--units", "b", "--nosuffix", "-o", lvsFields, vg)
	rows, err := parseLVs([]byte(out))
	if err != nil {
		t.Fatal(err)
	}
	m := map[string]lvRow{}
	for _, r := range rows {
		m[r.Name] = r
	}
	return m
}

func wantLVs(t *testing.T, vg string, want ...string) {
	t.Helper()
	got := lvsOf(t, vg)
	var names []string
	for n := range got {
		names = append(names, n)
	}
	if len(got) != len(want) {
		t.Fatalf("LVs of %s: %v, want %v", vg, names, want)
	}
	for _, n := range want {
		if _, ok := got[n]; !ok {
			t.Fatalf("LVs of %s: %v, want %v", vg, names, want)
		}
	}
}

func devSize(t *testing.T, path string) int64 {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	n, err := f.Seek(0, 2)
	if err != nil {
		t.Fatal(err)
	}
	return n
}

// Opening: a volume group or thin pool that is not there is ENOENT, an
// LV that is not a thin pool EINVAL.
func TestLVMOpen(t *testing.T) {
	vg := lvmTestPool(t, 32)
	run(t, "lvcreate", "-q", "-y", "-L", "4m", "-n", "plain", vg)
	for _, c := range []struct {
		vg, thin string
		errno    syscall.Errno
		says     string
	}{
		{"rnbd-no-such-vg", "thin", syscall.ENOENT, "no volume group rnbd-no-such-vg"},
		{vg, "nothin", syscall.ENOENT, "no thin pool nothin"},
		{vg, "plain", syscall.EINVAL, "not a thin pool"},
		{vg, "bad/name", syscall.EINVAL, "not an LVM name"},
	} {
		_, _, err := OpenLVMThin("thin", c.vg, c.thin)
		wantErrno(t, c.vg+"/"+c.thin, err, c.errno)
		if !strings.Contains(err.Error(), c.says) {
			t.Errorf("%s/%s: %v, want it to say %q", c.vg, c.thin, err, c.says)
		}
	}
	// An inactive thin pool is activated (its usage is read from it).
	run(t, "lvchange", "-an", vg+"/thin")
	p := openLVMTest(t, vg)
	if !lvsOf(t, vg)["thin"].active() {
		t.Fatal("the thin pool is not active after open")
	}
	if c, err := p.Capacity(); err != nil || c.Total != 32<<20 || c.Allocatable != 32<<20 || c.MetadataSize == 0 {
		t.Fatalf("capacity of an empty pool: %+v, %v", c, err)
	}
	if p.Type() != "lvm-thin" || p.Name() != "thin" {
		t.Fatalf("%s %s", p.Type(), p.Name())
	}
}

// Made by name with its metadata in the LV's tags; a retry answers it;
// other parameters are EEXIST saying what differs; a pool opened again
// reads the same; bad input is EINVAL and makes nothing.
func TestLVMCreateIdempotent(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	hostile := hostileLabel(MaxLabelBytes - 3)
	labels := map[string]string{"pvc": hostile}
	v, created, err := p.Create(Spec{Name: "vol_1", Size: 1 << 20, Labels: labels})
	if err != nil || !created {
		t.Fatalf("create: %v, created %v", err, created)
	}
	if v.Path != "/dev/"+vg+"/rnbd.v.vol+1" || devSize(t, v.Path) < 1<<20 {
		t.Fatalf("path %s", v.Path)
	}
	lv := lvsOf(t, vg)["rnbd.v.vol+1"]
	if lv.Segtype != "thin" || lv.Pool != "thin" || len(lv.Tags) < 10 {
		t.Fatalf("the LV: %+v", lv)
	}
	again, created, err := p.Create(Spec{Name: "vol_1", Size: 1 << 20, Labels: map[string]string{"pvc": hostile}})
	if err != nil || created || !again.Created.Equal(v.Created) {
		t.Fatalf("the same create again: %+v, created %v, %v", again, created, err)
	}
	_, _, err = p.Create(Spec{Name: "vol_1", Size: 2 << 20, Labels: labels})
	wantErrno(t, "another size", err, syscall.EEXIST)
	if !strings.Contains(err.Error(), "size 1048576 (asked 2097152)") {
		t.Fatalf("the refusal does not say what differs: %v", err)
	}
	_, _, err = p.Create(Spec{Name: "vol_1", Size: 1 << 20})
	wantErrno(t, "other labels", err, syscall.EEXIST)
	p2 := openLVMTest(t, vg)
	got, err := p2.Get("vol_1")
	if err != nil || got.Size != 1<<20 || got.Pool != "thin" || got.Labels["pvc"] != hostile || !got.Created.Equal(v.Created) || got.Path != v.Path {
		t.Fatalf("read again: %+v, %v", got, err)
	}
	// A name too long for LVM as it is: a hashed LV, the same volume.
	long := strings.Repeat("n", 128)
	lv2 := lvName(vg, kindVolume, long)
	if _, _, err := p.Create(Spec{Name: long, Size: 4096}); err != nil {
		t.Fatal(err)
	}
	if g, err := p.Get(long); err != nil || g.Name != long || g.Path != "/dev/"+vg+"/"+lv2 || devSize(t, g.Path) < 4096 {
		t.Fatalf("long name: %+v, %v", g, err)
	}
	vs, err := p.List()
	if err != nil || len(vs) != 2 || vs[0].Name != long || vs[1].Name != "vol_1" {
		t.Fatalf("list %v, %v", vs, err)
	}
	_, err = p.Get("nope")
	wantErrno(t, "get of nothing", err, syscall.ENOENT)
	for _, s := range []Spec{{Name: "a/b", Size: 4096}, {Name: "s", Size: 4097}, {Name: "s", Size: 0},
		{Name: "l", Size: 4096, Labels: map[string]string{"k": strings.Repeat("v", MaxLabelBytes)}},
		{Name: "c", Size: 4096, From: "vol_1", FromSnapshot: "x"}} {
		_, _, err := p.Create(s)
		wantErrno(t, fmt.Sprintf("%+.60v", s), err, syscall.EINVAL)
	}
	_, _, err = p.Create(Spec{Name: "c", Size: 4096, From: "nope"})
	wantErrno(t, "a clone of nothing", err, syscall.ENOENT)
	_, _, err = p.Create(Spec{Name: "c", Size: 4096, FromSnapshot: "nope"})
	wantErrno(t, "a clone of no snapshot", err, syscall.ENOENT)
	wantLVs(t, vg, "thin", "rnbd.v.vol+1", lv2)
}

// Grow only; the device grows; a crash between lvextend and the tags is
// finished by a retry.
func TestLVMResize(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	v, _, err := p.Create(Spec{Name: "r", Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	if got, err := p.Resize("r", 8<<20); err != nil || got.Size != 8<<20 {
		t.Fatalf("the same size: %+v, %v", got, err)
	}
	_, err = p.Resize("r", 4<<20)
	wantErrno(t, "smaller", err, syscall.EINVAL)
	_, err = p.Resize("r", (8<<20)+1)
	wantErrno(t, "not a multiple of 4096", err, syscall.EINVAL)
	_, err = p.Resize("nope", 8<<20)
	wantErrno(t, "no such volume", err, syscall.ENOENT)
	_, err = p.Resize("r", 128<<20)
	wantErrno(t, "over the pool", err, syscall.ENOSPC)
	if got, err := p.Resize("r", 16<<20); err != nil || got.Size != 16<<20 || devSize(t, v.Path) != 16<<20 {
		t.Fatalf("grown: %+v, %v; device %d bytes", got, err, devSize(t, v.Path))
	}
	if got, _ := p.Get("r"); got.Size != 16<<20 {
		t.Fatalf("read again: %d bytes", got.Size)
	}
	// A crash after lvextend, before the tags: the volume still says
	// its old size, and a retry only records the new one.
	run(t, "lvextend", "-q", "-y", "-L", "24m", vg+"/rnbd.v.r")
	if got, _ := p.Get("r"); got.Size != 16<<20 {
		t.Fatalf("after a half-done resize: %d bytes, want the old 16 MiB", got.Size)
	}
	if got, err := p.Resize("r", 24<<20); err != nil || got.Size != 24<<20 {
		t.Fatalf("retry: %+v, %v", got, err)
	}
	if got, _ := p.Get("r"); got.Size != 24<<20 || devSize(t, got.Path) != 24<<20 {
		t.Fatalf("after the retry: %+v", got)
	}
}

// Delete removes the LV; gone is success; an LV that only has the name
// of a volume, and any other LV, are never touched.
func TestLVMDeleteAndForeignLVs(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	run(t, "lvcreate", "-q", "-y", "--type", "thin", "--thinpool", "thin", "-V", "4m", "-n", "other", vg)
	run(t, "lvcreate", "-q", "-y", "--type", "thin", "--thinpool", "thin", "-V", "4m", "-n", "rnbd.v.x", "--addtag", "mine", vg)
	if _, _, err := p.Create(Spec{Name: "d", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete("d"); err != nil {
		t.Fatal(err)
	}
	if err := p.Delete("d"); err != nil {
		t.Fatalf("delete of what is gone: %v", err)
	}
	_, err := p.Get("x")
	wantErrno(t, "an LV without our tags", err, syscall.ENOENT)
	wantErrno(t, "delete of it", p.Delete("x"), syscall.ENOENT)
	_, _, err = p.Create(Spec{Name: "x", Size: 4 << 20})
	wantErrno(t, "create over it", err, syscall.EEXIST)
	if vs, err := p.List(); err != nil || len(vs) != 0 {
		t.Fatalf("list: %v, %v", vs, err)
	}
	// Another pool's volume in the same volume group is not this one's.
	other, _, err := OpenLVMThin("other-pool", vg, "thin")
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := other.Create(Spec{Name: "y", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	_, err = p.Get("y")
	wantErrno(t, "another pool's volume", err, syscall.ENOENT)
	wantErrno(t, "delete of another pool's volume", p.Delete("y"), syscall.ENOENT)
	wantLVs(t, vg, "thin", "other", "rnbd.v.x", "rnbd.v.y")
	if tags := lvsOf(t, vg)["rnbd.v.x"].Tags; len(tags) != 1 || tags[0] != "mine" {
		t.Fatalf("the foreign LV's tags: %v", tags)
	}
}

// Snapshots are read-only images at a moment, active; clones of a
// snapshot or of a volume are writable thin snapshots, grown to the size
// asked; each is idempotent by name.
func TestLVMSnapshotsAndClones(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	v, _, err := p.Create(Spec{Name: "v1", Size: 8 << 20})
	if err != nil {
		t.Fatal(err)
	}
	first := bytes.Repeat([]byte("first..."), 512)
	second := bytes.Repeat([]byte("second.."), 512)
	writeDev(t, v.Path, 1<<20, first)
	s, created, err := p.CreateSnapshot("v1", "s1")
	if err != nil || !created || s.Volume != "v1" || s.Size != 8<<20 || s.Path != "/dev/"+vg+"/rnbd.s.s1" {
		t.Fatalf("snapshot: %+v, %v, %v", s, created, err)
	}
	writeDev(t, v.Path, 1<<20, second)
	if got := readDev(t, s.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the snapshot does not hold the data of its moment")
	}
	if lvsOf(t, vg)["rnbd.s.s1"].writable() {
		t.Fatal("the snapshot's LV is writable")
	}
	if f, err := os.OpenFile(s.Path, os.O_WRONLY, 0); err == nil {
		_, err = f.WriteAt(second, 1<<20)
		if err == nil {
			err = f.Sync()
		}
		f.Close()
		if err == nil {
			t.Fatal("a write to the snapshot succeeded")
		}
	}
	if got := readDev(t, s.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the snapshot changed")
	}
	if again, created, err := p.CreateSnapshot("v1", "s1"); err != nil || created || !again.Created.Equal(s.Created) {
		t.Fatalf("the same snapshot again: %+v, %v, %v", again, created, err)
	}
	if _, _, err := p.Create(Spec{Name: "v0", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	_, _, err = p.CreateSnapshot("v0", "s1")
	wantErrno(t, "a snapshot of that name of another volume", err, syscall.EEXIST)
	_, _, err = p.CreateSnapshot("nope", "s2")
	wantErrno(t, "a snapshot of nothing", err, syscall.ENOENT)

	// A clone of the snapshot, grown: it has the snapshot's data and
	// is writable without touching the snapshot.
	c, created, err := p.Create(Spec{Name: "c1", Size: 16 << 20, FromSnapshot: "s1"})
	if err != nil || !created || c.SourceSnapshot != "s1" || c.Size != 16<<20 || devSize(t, c.Path) != 16<<20 {
		t.Fatalf("clone of s1: %+v, %v, %v", c, created, err)
	}
	if got := readDev(t, c.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the clone does not hold its snapshot's data")
	}
	writeDev(t, c.Path, 12<<20, second)
	if got := readDev(t, c.Path, 12<<20, len(second)); !bytes.Equal(got, second) {
		t.Fatal("the clone's grown part does not keep what is written")
	}
	if tags := lvsOf(t, vg)["rnbd.v.c1"].Tags; strings.Contains(strings.Join(tags, ","), tagIncomplete) {
		t.Fatalf("the clone is left marked incomplete: %v", tags)
	}
	if again, created, err := p.Create(Spec{Name: "c1", Size: 16 << 20, FromSnapshot: "s1"}); err != nil || created || again.Size != 16<<20 {
		t.Fatalf("the same clone again: %+v, %v, %v", again, created, err)
	}
	_, _, err = p.Create(Spec{Name: "c1", Size: 16 << 20, From: "v1"})
	wantErrno(t, "the clone's name from another source", err, syscall.EEXIST)
	_, _, err = p.Create(Spec{Name: "c2", Size: 4 << 20, FromSnapshot: "s1"})
	wantErrno(t, "a clone smaller than its snapshot", err, syscall.EINVAL)

	// A clone of the volume, the same size: one lvcreate.
	c2, _, err := p.Create(Spec{Name: "c2", Size: 8 << 20, From: "v1"})
	if err != nil || c2.Source != "v1" || devSize(t, c2.Path) != 8<<20 {
		t.Fatalf("clone of v1: %+v, %v", c2, err)
	}
	if got := readDev(t, c2.Path, 1<<20, len(second)); !bytes.Equal(got, second) {
		t.Fatal("the clone of v1 does not hold v1's data")
	}
	ss, err := p.Snapshots()
	if err != nil || len(ss) != 1 || ss[0].Name != "s1" || ss[0].Volume != "v1" {
		t.Fatalf("snapshots %+v, %v", ss, err)
	}
	// The origin can go; its snapshot and clones stay.
	if err := p.Delete("v1"); err != nil {
		t.Fatal(err)
	}
	if got := readDev(t, s.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the snapshot lost its data with its volume")
	}
	if err := p.DeleteSnapshot("s1"); err != nil {
		t.Fatal(err)
	}
	if err := p.DeleteSnapshot("s1"); err != nil {
		t.Fatalf("delete of a snapshot that is gone: %v", err)
	}
	if ss, err := p.Snapshots(); err != nil || len(ss) != 0 {
		t.Fatalf("snapshots after delete: %v, %v", ss, err)
	}
	if got := readDev(t, c.Path, 1<<20, len(first)); !bytes.Equal(got, first) {
		t.Fatal("the clone lost its data with its snapshot")
	}
	wantLVs(t, vg, "thin", "rnbd.v.v0", "rnbd.v.c1", "rnbd.v.c2")
}

// Over what the pool can promise is ENOSPC and makes nothing; a full
// thin pool refuses volumes, growth and snapshots naming what is full,
// and takes them again once space is freed.
func TestLVMCapacityAndFull(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	_, _, err := p.Create(Spec{Name: "big", Size: (64 << 20) + 4096})
	wantErrno(t, "over the pool", err, syscall.ENOSPC)
	wantLVs(t, vg, "thin")
	v, _, err := p.Create(Spec{Name: "big", Size: 64 << 20})
	if err != nil {
		t.Fatal(err)
	}
	c, err := p.Capacity()
	if err != nil || c.Total != 64<<20 || c.Promised != 64<<20 || c.Allocatable != 0 || c.MetadataUsed <= 0 || c.MetadataUsed > c.MetadataSize {
		t.Fatalf("capacity %+v, %v", c, err)
	}
	_, _, err = p.Create(Spec{Name: "more", Size: 4096})
	wantErrno(t, "nothing allocatable", err, syscall.ENOSPC)
	_, err = p.Resize("big", (64<<20)+(4<<20))
	wantErrno(t, "growth past the pool", err, syscall.ENOSPC)
	// 62 MiB written: over the high-water mark.
	f, err := os.OpenFile(v.Path, os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	chunk := bytes.Repeat([]byte{0xa5}, 1<<20)
	for i := range 62 {
		if _, err := f.WriteAt(chunk, int64(i)<<20); err != nil {
			t.Fatal(err)
		}
	}
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	f.Close()
	c, err = p.Capacity()
	if err != nil || c.Used < 62<<20 || c.Promised > 2<<20 {
		t.Fatalf("capacity after the writes: %+v, %v", c, err)
	}
	_, _, err = p.Create(Spec{Name: "more", Size: 4096})
	wantErrno(t, "a full pool", err, syscall.ENOSPC)
	if !strings.Contains(err.Error(), "full: data") {
		t.Fatalf("the refusal does not say the data is full: %v", err)
	}
	_, err = p.Resize("big", (64<<20)+(4<<20))
	wantErrno(t, "growth in a full pool", err, syscall.ENOSPC)
	_, _, err = p.CreateSnapshot("big", "s")
	wantErrno(t, "a snapshot in a full pool", err, syscall.ENOSPC)
	if !strings.Contains(err.Error(), "full: data") {
		t.Fatalf("the refusal does not say the data is full: %v", err)
	}
	wantLVs(t, vg, "thin", "rnbd.v.big")
	if err := p.Delete("big"); err != nil {
		t.Fatal(err)
	}
	if _, _, err := p.Create(Spec{Name: "more", Size: 4096}); err != nil {
		t.Fatalf("after space is freed: %v", err)
	}
}

// A clone a crash left between its lvcreate and its lvextend (tagged
// incomplete) is not a volume; open removes it, and so does a retry.
func TestLVMHalfMadeClone(t *testing.T) {
	vg := lvmTestPool(t, 64)
	p := openLVMTest(t, vg)
	if _, _, err := p.Create(Spec{Name: "v", Size: 4 << 20}); err != nil {
		t.Fatal(err)
	}
	half := func(name string) {
		tags, err := encodeTags(lvmMeta{Kind: kindVolume, Name: name, Pool: "thin", Size: 8 << 20, Source: "v", Created: time.Now().UTC()})
		if err != nil {
			t.Fatal(err)
		}
		args := []string{"-q", "-y", "-s", "-kn", "-n", "rnbd.v." + name}
		args = append(append(args, tagArgs("--addtag", append(tags, tagIncomplete))...), vg+"/rnbd.v.v")
		run(t, "lvcreate", args...)
	}
	half("c")
	_, err := p.Get("c")
	wantErrno(t, "a half-made clone", err, syscall.ENOENT)
	if vs, _ := p.List(); len(vs) != 1 {
		t.Fatalf("list shows a half-made clone: %v", vs)
	}
	_, removed, err := OpenLVMThin("thin", vg, "thin")
	if err != nil || len(removed) != 1 || !strings.Contains(removed[0], "rnbd.v.c") {
		t.Fatalf("open: removed %v, %v", removed, err)
	}
	wantLVs(t, vg, "thin", "rnbd.v.v")
	half("c")
	c, created, err := p.Create(Spec{Name: "c", Size: 8 << 20, From: "v"})
	if err != nil || !created || devSize(t, c.Path) != 8<<20 {
		t.Fatalf("retry over a half-made clone: %+v, %v, %v", c, created, err)
	}
	if tags := lvsOf(t, vg)["rnbd.v.c"].Tags; strings.Contains(strings.Join(tags, ","), tagIncomplete) {
		t.Fatalf("left incomplete: %v", tags)
	}
	// Deleting what a crash left half-made removes it too.
	half("d")
	if err := p.Delete("d"); err != nil {
		t.Fatal(err)
	}
	wantLVs(t, vg, "thin", "rnbd.v.v", "rnbd.v.c")
}

// An inactive volume (a node restarted without activating it) is
// activated by Get: its Path is a device.
func TestLVMGetActivates(t *testing.T) {
	vg := lvmTestPool(t, 32)
	p := openLVMTest(t, vg)
	v, _, err := p.Create(Spec{Name: "a", Size: 4 << 20})
	if err != nil {
		t.Fatal(err)
	}
	run(t, "lvchange", "-an", vg+"/rnbd.v.a")
	if _, err := os.Stat(v.Path); err == nil {
		t.Fatalf("%s still there after lvchange -an", v.Path)
	}
	if got, err := p.Get("a"); err != nil || devSize(t, got.Path) != 4<<20 {
		t.Fatalf("get: %+v, %v", got, err)
	}
}
