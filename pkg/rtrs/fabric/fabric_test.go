package fabric

import (
	"net/netip"
	"testing"
)

// TestPeerGroup: peers are counted by address — two hosts of one IPv6
// /64 (a storage network's link) are two peers; a mapped IPv4 address and
// a zoned one are the address itself.
func TestPeerGroup(t *testing.T) {
	g := func(s string) netip.Prefix { return PeerGroup(netip.MustParseAddr(s)) }
	if g("fd00:10::1") == g("fd00:10::2") {
		t.Fatal("two hosts of one /64 counted as one peer")
	}
	if g("::ffff:192.0.2.1") != g("192.0.2.1") {
		t.Fatalf("mapped %v, plain %v", g("::ffff:192.0.2.1"), g("192.0.2.1"))
	}
	if g("fe80::1%eth0") != g("fe80::1") || !g("fe80::1%eth0").IsValid() {
		t.Fatalf("zoned %v, plain %v", g("fe80::1%eth0"), g("fe80::1"))
	}
	if p := g("192.0.2.1"); p.Bits() != 32 {
		t.Fatalf("IPv4 group %v", p)
	}
}
