// Tests of what the LVM thin pool reads from lvs and counts from it,
// pure: they run everywhere.
package pool

import (
	"errors"
	"strings"
	"syscall"
	"testing"
)

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
	c, full, err := p.capacity(rows, 0)
	want := Capacity{Total: 100 << 20, Used: 50 << 20, Promised: 38 << 20, Allocatable: 12 << 20, MetadataSize: 4 << 20, MetadataUsed: 1 << 20}
	if err != nil || c != want || full != "" {
		t.Fatalf("capacity %+v, %q, %v; want %+v", c, full, err, want)
	}
	rows[0].Data = 95
	if c, full, _ = p.capacity(rows, 0); !strings.Contains(full, "data 95.00% used") || c.Allocatable != 0 {
		t.Fatalf("at the mark: %+v, %q", c, full)
	}
	rows[0].Data, rows[0].Meta = 10, 99.5
	if _, full, _ = p.capacity(rows, 0); !strings.Contains(full, "metadata 99.50% used") {
		t.Fatalf("metadata full: %q", full)
	}
	if _, _, err := p.capacity(rows[1:], 0); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("no thin pool: %v", err)
	}
}
