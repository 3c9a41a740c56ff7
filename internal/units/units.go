// Package units parses and prints byte sizes the way storage tools do:
// "4096", "4K", "64MiB", "1G" (binary multiples, as the rnbd tool's units).
package units

import (
	"fmt"
	"strconv"
	"strings"
)

var suffixes = []struct {
	s string
	m int64
}{
	{"E", 1 << 60}, {"P", 1 << 50}, {"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10},
}

// ParseSize parses a size: a number of bytes, optionally followed by
// K, M, G, T, P or E (each 1024 times the last), with an optional "iB"
// or "B"; case does not matter.
func ParseSize(s string) (int64, error) {
	t := strings.ToUpper(strings.TrimSpace(s))
	t = strings.TrimSuffix(t, "IB")
	t = strings.TrimSuffix(t, "B")
	mult := int64(1)
	for _, x := range suffixes {
		if strings.HasSuffix(t, x.s) {
			t, mult = strings.TrimSuffix(t, x.s), x.m
			break
		}
	}
	n, err := strconv.ParseInt(strings.TrimSpace(t), 10, 64)
	if err != nil || n < 0 {
		return 0, fmt.Errorf("bad size %q: want bytes, or a number with K, M, G, T, P or E", s)
	}
	if n > 0 && mult > (1<<63-1)/n {
		return 0, fmt.Errorf("size %q is too large", s)
	}
	return n * mult, nil
}

// FormatSize prints n bytes with the largest unit that divides it.
func FormatSize(n int64) string {
	for _, x := range suffixes {
		if n >= x.m && n%x.m == 0 {
			return strconv.FormatInt(n/x.m, 10) + x.s + "iB"
		}
	}
	return strconv.FormatInt(n, 10)
}

// Size is a byte count: a flag value (--max-chunk-memory 8GiB), and a
// configuration file's value written as 8589934592 or "8GiB".
type Size int64

func (v *Size) String() string { return FormatSize(int64(*v)) }
func (v *Size) Type() string   { return "size" }
func (v *Size) Set(s string) error {
	n, err := ParseSize(s)
	if err != nil {
		return err
	}
	*v = Size(n)
	return nil
}

// UnmarshalTOML reads a size from a configuration file: a number of
// bytes, or a string as ParseSize takes it.
func (v *Size) UnmarshalTOML(x any) error {
	switch t := x.(type) {
	case int64:
		if t < 0 {
			return fmt.Errorf("negative size %d", t)
		}
		*v = Size(t)
		return nil
	case string:
		n, err := ParseSize(t)
		*v = Size(n)
		return err
	}
	return fmt.Errorf("size %v: want a number of bytes or a string like \"8GiB\"", x)
}
