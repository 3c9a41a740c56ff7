package units

import "testing"

func TestParseSize(t *testing.T) {
	for s, want := range map[string]int64{
		"4096": 4096, "4K": 4096, "4k": 4096, "64MiB": 64 << 20, "1G": 1 << 30, "2gb": 2 << 30, " 3 T ": 3 << 40, "0": 0,
	} {
		if got, err := ParseSize(s); err != nil || got != want {
			t.Errorf("ParseSize(%q) = %d, %v; want %d", s, got, err, want)
		}
	}
	for _, s := range []string{"", "x", "-1", "1X", "9999999E"} {
		if _, err := ParseSize(s); err == nil {
			t.Errorf("ParseSize(%q) accepted", s)
		}
	}
	if FormatSize(64<<20) != "64MiB" || FormatSize(1000) != "1000" || FormatSize(3<<10) != "3KiB" {
		t.Error("FormatSize")
	}
}

// TestSizeUnmarshalTOML: a configuration file's size, as bytes or as a
// string; a negative one or another type is refused.
func TestSizeUnmarshalTOML(t *testing.T) {
	for _, c := range []struct {
		in   any
		want Size
		ok   bool
	}{{int64(4096), 4096, true}, {"8GiB", 8 << 30, true}, {int64(-1), 0, false}, {"8 apples", 0, false}, {1.5, 0, false}} {
		var v Size
		if err := v.UnmarshalTOML(c.in); (err == nil) != c.ok || (c.ok && v != c.want) {
			t.Errorf("UnmarshalTOML(%v) = %d, %v", c.in, v, err)
		}
	}
}
