package rnbd

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"github.com/rnbd/rnbd/test/kit"
	"net"
	"net/netip"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
	"github.com/rnbd/rnbd/test/testca"
)

// TestMapRefusesUnservable: a directory (EISDIR), a FIFO, a socket or a
// character device (EINVAL) is refused at Map, saying what it is; a
// symbolic link is judged by what it leads to.
func TestMapRefusesUnservable(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	dir := t.TempDir()
	fifo, sock, link := filepath.Join(dir, "fifo"), filepath.Join(dir, "sock"), filepath.Join(dir, "link")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		path, is string
		errno    syscall.Errno
	}{
		{dir, "a directory", syscall.EISDIR},
		{link, "a directory", syscall.EISDIR},
		{fifo, "a FIFO", syscall.EINVAL},
		{sock, "a socket", syscall.EINVAL},
		{"/dev/null", "a character device", syscall.EINVAL},
	} {
		err := r.srv.Map(Export{Name: "bad", Path: c.path})
		if want := "export bad: " + c.path + " is " + c.is + ": an export is a regular file or a block device"; !errors.Is(err, c.errno) || fmt.Sprint(err) != want {
			t.Errorf("map of %s: %v, want %q (%v)", c.path, err, want, c.errno)
		}
	}
	if es := r.srv.Exports(); len(es) != 0 {
		t.Fatalf("exports after the refusals: %v", es)
	}
	if err := r.srv.Map(Export{Name: "vol", Path: r.file("vol", 1<<20)}); err != nil {
		t.Fatalf("a regular file: %v", err)
	}
}

// TestMapStat: MapStat maps with the look at the path its caller made and
// looks at nothing itself (SrvConfig.Stat, os.Stat): a stat that
// failed is refused with its error, as Map refuses it, and what the stat
// found is judged, whatever the path is now.
func TestMapStat(t *testing.T) {
	r := newSrig(t, SrvConfig{Stat: func(p string) (os.FileInfo, error) {
		t.Errorf("MapStat looked at %s", p)
		return os.Stat(p)
	}})
	p := r.file("vol", 1<<20)
	dirInfo, err := os.Stat(r.dir)
	if err != nil {
		t.Fatal(err)
	}
	_, gone := os.Stat(filepath.Join(r.dir, "gone"))
	if err := r.srv.MapStat(Export{Name: "gone", Path: p}, nil, gone); !errors.Is(err, syscall.ENOENT) || err.Error() != "export gone: "+gone.Error() {
		t.Errorf("a stat that failed: %v", err)
	}
	if err := r.srv.MapStat(Export{Name: "dir", Path: p}, dirInfo, nil); !errors.Is(err, syscall.EISDIR) {
		t.Errorf("a stat that found a directory: %v, want EISDIR", err)
	}
	if err := r.srv.MapStat(Export{Name: "rel", Path: "vol"}, dirInfo, nil); !errors.Is(err, syscall.EINVAL) || !strings.Contains(err.Error(), "must be absolute") {
		t.Errorf("a relative path: %v, want the path refused before the stat is judged", err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if err := r.srv.MapStat(Export{Name: "vol", Path: p}, fi, nil); err != nil {
		t.Fatal(err)
	}
	if es := r.srv.Exports(); len(es) != 1 || es[0].Name != "vol" {
		t.Fatalf("exports: %v", es)
	}
}

func TestExports(t *testing.T) {
	r := newSrig(t, SrvConfig{DevSearchPath: ""})
	r.srv.cfg.DevSearchPath = "" // explicit exports only
	other := t.TempDir()
	p := filepath.Join(other, "img")
	os.WriteFile(p, make([]byte, 1<<20), 0o600)
	if err := r.srv.Map(Export{Name: "vol", Path: p, Allow: []string{"ok"}}); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Map(Export{Name: "vol", Path: p}); !errors.Is(err, syscall.EEXIST) {
		t.Fatalf("second map: %v", err)
	}
	if err := r.srv.Map(Export{Name: "ro", Path: p, ReadOnly: true}); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Map(Export{Name: "x", Path: "relative"}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("relative path: %v", err)
	}
	if err := r.srv.Map(Export{Name: "y", Path: "/nonexistent/img"}); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("missing path: %v", err)
	}
	ok, nope := r.client("ok"), r.client("nope")
	x := r.dev(ok, "vol", AccessRW)
	if _, err := nope.open(context.Background(), "vol", AccessRO); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("session not in the allow list: %v", err)
	}
	if _, err := nope.open(context.Background(), "ro", AccessRW); !errors.Is(err, syscall.EROFS) ||
		!strings.Contains(err.Error(), "the export is read-only: map it with access_mode=ro") {
		t.Fatalf("rw open of a read-only export: %v, want EROFS saying so", err)
	}
	if _, err := nope.open(context.Background(), "ro", AccessRO); err != nil {
		t.Fatal(err)
	}
	if _, err := nope.open(context.Background(), "unknown", AccessRO); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("unknown export without a search path: %v", err)
	}
	// Two names of one file share the writer count.
	if _, err := ok.open(context.Background(), "ro", AccessRO); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Unmap("vol", false); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("unmap of an open export: %v", err)
	}
	if err := x.write(0, bytes.Repeat([]byte("still works!"), 128), 0); err != nil {
		t.Fatalf("IO after a refused unmap: %v", err)
	}
	if err := r.srv.Unmap("vol", true); err != nil {
		t.Fatal(err)
	}
	if err := x.write(0, make([]byte, 512), 0); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("IO after a forced unmap: %v, want ENOTCONN", err)
	}
	if _, err := ok.open(context.Background(), "vol", AccessRW); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("open after unmap: %v", err)
	}
	if err := r.srv.Unmap("vol", false); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("second unmap: %v", err)
	}
	if got := r.srv.Exports(); len(got) != 1 || got[0].Name != "ro" {
		t.Fatalf("exports %+v", got)
	}
}

// access_mode=migration beside a writer only where it is allowed, and an
// export's allow_from against the address of the path an OPEN arrives
// on.
func TestMigrationAndNetworks(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	r.file("found", 1<<20)
	exp, exp2 := r.file("exp/x", 1<<20), r.file("exp/y", 1<<20)
	open := func(cl *CltSession, name string, mode AccessMode) error {
		_, err := cl.open(context.Background(), name, mode)
		return err
	}
	a, b := r.client("a"), r.client("b") // paths from 10.20.1.x
	if err := open(a, "found", AccessRW); err != nil {
		t.Fatal(err)
	}
	if err := open(b, "found", AccessMigration); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("migration beside a writer without allow_migration: %v, want EBUSY", err)
	}
	for _, e := range []Export{
		{Name: "nomig", Path: exp},
		{Name: "mig", Path: exp2, Migration: true},
		{Name: "net", Path: exp, AllowFrom: []netip.Prefix{netip.MustParsePrefix("10.20.1.7/24")}},
	} {
		if err := r.srv.Map(e); err != nil {
			t.Fatal(err)
		}
	}
	// Alone, migration opens as rw does.
	if err := open(a, "nomig", AccessMigration); err != nil {
		t.Fatalf("migration as the only writer: %v", err)
	}
	if err := open(b, "nomig", AccessMigration); !errors.Is(err, syscall.EBUSY) {
		t.Fatalf("migration on an export without it: %v, want EBUSY", err)
	}
	if err := open(a, "mig", AccessRW); err != nil {
		t.Fatal(err)
	}
	if err := open(b, "mig", AccessMigration); err != nil {
		t.Fatalf("migration on an export with it: %v", err)
	}
	if err := open(b, "net", AccessRO); err != nil {
		t.Fatalf("an OPEN from inside allow_from: %v", err)
	}
	c := r.cltSession("c", 0) // a path from 10.20.2.x
	if err := open(c, "net", AccessRO); !errors.Is(err, syscall.EPERM) {
		t.Fatalf("an OPEN from outside allow_from: %v, want EPERM", err)
	}
	if err := r.srv.Map(Export{Name: "bad", Path: exp, AllowFrom: []netip.Prefix{{}}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("an invalid network: %v, want EINVAL", err)
	}
}

// An export's allow_identities lets only the clients its grants name open
// it, each for at most its grant; the names are those of the client's TLS
// certificate, whatever session name it chose.
func TestExportIdentities(t *testing.T) {
	ca := testca.New(t, "test ca")
	r := newSrigOn(t, SrvConfig{}, nil, tcp.Options{TLS: ca.Config(ca.Issue(t, "server", srvAddr.Addr().String()))})
	p := r.file("exp/x", 1<<20)
	grants := []Grant{{"alice", "rw"}, {"bob", "ro"}, {"carol.example", "migration"}}
	if err := r.srv.Map(Export{Name: "acl", Path: p, AllowIdentities: grants}); err != nil {
		t.Fatal(err)
	}
	as := func(cn, sess string, sans ...string) *CltSession {
		return r.clientOn(r.net.FabricWith(tcp.Options{TLS: ca.Config(ca.Issue(t, cn, sans...))}), sess)
	}
	open := func(cl *CltSession, mode AccessMode) error {
		_, err := cl.open(context.Background(), "acl", mode)
		return err
	}
	alice, bob, carol := as("alice", "s1"), as("bob", "s2"), as("carol", "s3", "carol.example")
	mallory := as("mallory", "alice") // the session name of another is nothing
	if err := open(mallory, AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("an identity without a grant: %v, want EACCES", err)
	}
	if err := open(bob, AccessRW); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("rw by an identity granted ro: %v, want EACCES", err)
	}
	if err := open(bob, AccessRO); err != nil {
		t.Fatalf("ro by an identity granted ro: %v", err)
	}
	if err := open(alice, AccessMigration); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("migration by an identity granted rw: %v, want EACCES", err)
	}
	if err := open(alice, AccessRW); err != nil {
		t.Fatalf("rw by an identity granted rw: %v", err)
	}
	// A grant of migration (to a name among the certificate's
	// alternative names) lets a second writer in although the export has
	// no migration flag.
	if err := open(carol, AccessMigration); err != nil {
		t.Fatalf("migration beside a writer by an identity granted it: %v", err)
	}
	if err := r.srv.Map(Export{Name: "bad", Path: p, AllowIdentities: []Grant{{"x", "rwx"}}}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("a grant of rwx: %v, want EINVAL", err)
	}
	if es := r.srv.Exports(); len(es) != 1 || !slices.Equal(es[0].AllowIdentities, grants) {
		t.Fatalf("exports %+v", es)
	}

	// Without TLS no client has an identity: such an export opens to
	// none.
	plain := newSrig(t, SrvConfig{})
	if err := plain.srv.Map(Export{Name: "acl", Path: plain.file("exp/y", 1<<20), AllowIdentities: grants}); err != nil {
		t.Fatal(err)
	}
	if _, err := plain.client("alice").open(context.Background(), "acl", AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("a client without a certificate: %v, want EACCES", err)
	}
}

// Grants given and revoked one at a time: a grant lets its identity
// open the export (at most for its access), leaves the others' as they
// are, and the same again changes nothing; revoking the last grant
// closes the export to every client (GrantsOnly), rather than opening
// it to all as an export without allow_identities is.
func TestGrantRevoke(t *testing.T) {
	ca := testca.New(t, "test ca")
	r := newSrigOn(t, SrvConfig{}, nil, tcp.Options{TLS: ca.Config(ca.Issue(t, "server", srvAddr.Addr().String()))})
	if err := r.srv.Map(Export{Name: "v", Path: r.file("exp/v", 1<<20)}); err != nil {
		t.Fatal(err)
	}
	as := func(cn, sess string) *CltSession {
		return r.clientOn(r.net.FabricWith(tcp.Options{TLS: ca.Config(ca.Issue(t, cn))}), sess)
	}
	alice, bob := as("alice", "s1"), as("bob", "s2")
	open := func(cl *CltSession, mode AccessMode) error {
		d, err := cl.open(context.Background(), "v", mode)
		if err == nil {
			cl.close(context.Background(), "v", d.DeviceID)
		}
		return err
	}
	grants := func() []Grant { return r.srv.Exports()[0].AllowIdentities }
	if changed, err := r.srv.Grant("v", Grant{"alice", "rw"}); err != nil || !changed {
		t.Fatalf("grant: %v %v", changed, err)
	}
	if changed, err := r.srv.Grant("v", Grant{"alice", "rw"}); err != nil || changed {
		t.Fatalf("the same grant again: changed %v, %v", changed, err)
	}
	if err := open(bob, AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("bob without a grant: %v, want EACCES", err)
	}
	r.srv.Grant("v", Grant{"bob", "ro"})
	if err := open(bob, AccessRO); err != nil {
		t.Fatalf("bob granted ro: %v", err)
	}
	if err := open(bob, AccessRW); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("rw by bob granted ro: %v, want EACCES", err)
	}
	if changed, _ := r.srv.Grant("v", Grant{"bob", "rw"}); !changed || !slices.Equal(grants(), []Grant{{"alice", "rw"}, {"bob", "rw"}}) {
		t.Fatalf("bob's grant widened: %v %+v", changed, grants())
	}
	if changed, err := r.srv.Revoke("v", "alice"); err != nil || !changed || !slices.Equal(grants(), []Grant{{"bob", "rw"}}) {
		t.Fatalf("revoke alice: %v %v %+v", changed, err, grants())
	}
	if changed, err := r.srv.Revoke("v", "alice"); err != nil || changed {
		t.Fatalf("revoke alice again: changed %v, %v", changed, err)
	}
	if err := open(alice, AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("alice revoked: %v, want EACCES", err)
	}
	r.srv.Revoke("v", "bob")
	if err := open(bob, AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("the last grant revoked: %v, want EACCES", err)
	}
	if _, err := r.srv.Grant("nope", Grant{"a", "rw"}); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("a grant on no export: %v", err)
	}
	if _, err := r.srv.Grant("v", Grant{"a", "all"}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("a grant of all: %v", err)
	}
}

func TestParseGrant(t *testing.T) {
	for in, want := range map[string]Grant{
		"a":                 {"a", "rw"},
		"a=ro":              {"a", "ro"},
		"a=migration":       {"a", "migration"},
		"spiffe://x/y?z=1":  {"spiffe://x/y?z=1", "rw"},
		"spiffe://x/y?z=ro": {"spiffe://x/y?z", "ro"},
	} {
		if g, err := ParseGrant(in); err != nil || g != want {
			t.Errorf("ParseGrant(%q) = %+v, %v; want %+v", in, g, err, want)
		}
	}
	if _, err := ParseGrant("=ro"); err == nil {
		t.Error("ParseGrant(=ro) took an empty identity")
	}
}

// An export's max_sessions bounds the sessions that have it open at
// once; a session that closes it makes room, and a refused OPEN leaves
// nothing counted.
func TestExportMaxSessions(t *testing.T) {
	r := newSrig(t, SrvConfig{})
	p := r.file("exp/x", 1<<20)
	if err := r.srv.Map(Export{Name: "two", Path: p, MaxSessions: 2}); err != nil {
		t.Fatal(err)
	}
	if err := r.srv.Map(Export{Name: "bad", Path: p, MaxSessions: -1}); !errors.Is(err, syscall.EINVAL) {
		t.Fatalf("max_sessions -1: %v, want EINVAL", err)
	}
	open := func(cl *CltSession) (OpenRsp, error) { return cl.open(context.Background(), "two", AccessRO) }
	a, b, c := r.client("a"), r.client("b"), r.client("c")
	if _, err := open(a); err != nil {
		t.Fatal(err)
	}
	rb, err := open(b)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := open(a); err != nil {
		t.Fatalf("the same session again: %v", err)
	}
	for i := 0; i < 3; i++ {
		if _, err := open(c); !errors.Is(err, syscall.EUSERS) {
			t.Fatalf("a third session: %v, want EUSERS", err)
		}
	}
	if err := b.close(context.Background(), "two", rb.DeviceID); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "b's open to close", func() bool {
		_, err := open(c)
		return err == nil
	})
}

// The devices under dev_search_path have the rules an export can have:
// the networks an OPEN may come from and the identities that may open
// them, for what.
func TestSearchPathRules(t *testing.T) {
	open := func(cl *CltSession, name string, mode AccessMode) error {
		_, err := cl.open(context.Background(), name, mode)
		return err
	}
	r := newSrig(t, SrvConfig{SearchAllowFrom: []netip.Prefix{netip.MustParsePrefix("10.20.1.0/24")}})
	r.file("found", 1<<20)
	if err := open(r.client("a"), "found", AccessRW); err != nil { // a path from 10.20.1.x
		t.Fatalf("an OPEN from inside dev_search_path_allow_from: %v", err)
	}
	if err := open(r.cltSession("c", 0), "found", AccessRO); !errors.Is(err, syscall.EPERM) { // from 10.20.2.x
		t.Fatalf("an OPEN from outside dev_search_path_allow_from: %v, want EPERM", err)
	}

	ca := testca.New(t, "test ca")
	r = newSrigOn(t, SrvConfig{SearchAllowIdentities: []Grant{{"alice", "rw"}, {"bob", "ro"}}}, nil,
		tcp.Options{TLS: ca.Config(ca.Issue(t, "server", srvAddr.Addr().String()))})
	r.file("found", 1<<20)
	as := func(cn, sess string) *CltSession {
		return r.clientOn(r.net.FabricWith(tcp.Options{TLS: ca.Config(ca.Issue(t, cn))}), sess)
	}
	if err := open(as("mallory", "s0"), "found", AccessRO); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("an identity without a grant: %v, want EACCES", err)
	}
	bob := as("bob", "s1")
	if err := open(bob, "found", AccessRW); !errors.Is(err, syscall.EACCES) {
		t.Fatalf("rw by an identity granted ro: %v, want EACCES", err)
	}
	if err := open(bob, "found", AccessRO); err != nil {
		t.Fatalf("ro by an identity granted ro: %v", err)
	}
	if err := open(as("alice", "s2"), "found", AccessRW); err != nil {
		t.Fatalf("rw by an identity granted rw: %v", err)
	}
}
