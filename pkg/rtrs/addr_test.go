package rtrs

import (
	"crypto/sha256"
	"net/netip"
	"testing"
)

// TestMatchPathName: a path is found by its name, by the same without
// the "ip:" prefixes, or by one of its addresses; not by another's.
func TestMatchPathName(t *testing.T) {
	src, dst := netip.MustParseAddr("10.0.0.2"), netip.MustParseAddr("10.0.0.1")
	for name, want := range map[string]bool{
		"ip:10.0.0.2@ip:10.0.0.1": true,
		"10.0.0.2@10.0.0.1":       true,
		"ip:10.0.0.2@10.0.0.1":    true,
		"10.0.0.1":                true,
		"ip:10.0.0.2":             true,
		"10.0.0.1@10.0.0.2":       false, // the other way round
		"10.0.0.3":                false,
		"10.0.0.2@":               false,
		"host":                    false,
		"":                        false,
	} {
		if got := MatchPathName(name, src, dst); got != want {
			t.Errorf("MatchPathName(%q) = %v, want %v", name, got, want)
		}
	}
	// A source not known yet matches nothing; an IPv4 address in IPv6
	// form is the same address.
	if MatchPathName("0.0.0.0", netip.Addr{}, dst) || !MatchPathName("10.0.0.1", netip.Addr{}, netip.MustParseAddr("::ffff:10.0.0.1")) {
		t.Error("an unset source or a mapped address")
	}
	if !MatchPathName("fe80::1", netip.MustParseAddr("fe80::1%eth0"), dst) {
		t.Error("an address with a zone")
	}
}

// TestPathUUIDUnchanged: a path without a source is named by its
// destination alone, but its UUID is derived as before from the
// kernel's form of the name, so a client restarted on a new version
// is the same path to its server.
func TestPathUUIDUnchanged(t *testing.T) {
	sess := [16]byte{1, 2, 3}
	pa, err := ParsePathAddr("ip:10.0.0.1", 1234)
	if err != nil || pa.String() != "ip:10.0.0.1" {
		t.Fatalf("%v %v", pa, err)
	}
	h := sha256.New()
	h.Write(sess[:])
	h.Write([]byte("<invalid address family>@ip:10.0.0.1"))
	var want [16]byte
	copy(want[:], h.Sum(nil))
	if got := derivePathUUID(sess, pa); got != want {
		t.Fatalf("path UUID %x, want %x", got, want)
	}
}
