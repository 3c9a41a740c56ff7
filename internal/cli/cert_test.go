package cli

import (
	"crypto/tls"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// TestCertCommands: cert create-ca, create-node, create-client and list
// as the binaries run them: the files they write load as a key pair, a
// file there is not replaced without --overwrite (already_exists, exit
// 4), a missing authority is not_found (3), and what is wrong on the
// command line is a usage error (2).
func TestCertCommands(t *testing.T) {
	dir := t.TempDir()
	pki, caKey := filepath.Join(dir, "pki"), filepath.Join(dir, "ca.key")
	run := func(args ...string) (int, string, string) {
		t.Helper()
		var g Globals
		root := &cobra.Command{Use: "rnbd-test"}
		g.Add(root, filepath.Join(dir, "none.sock"))
		root.AddCommand(g.CertCmd())
		var out, errb strings.Builder
		code := Run("rnbd-test", root, append(append([]string{"cert"}, args...), "--certs-dir", pki), &out, &errb)
		return code, out.String(), errb.String()
	}
	expect := func(want int, say string, args ...string) string {
		t.Helper()
		code, out, errOut := run(args...)
		if code != want || !strings.Contains(out+errOut, say) {
			t.Errorf("cert %s: exit %d, %q %q; want exit %d saying %q", strings.Join(args, " "), code, out, errOut, want, say)
		}
		return out
	}
	expect(3, "make one with cert create-ca", "create-client", "ops", "--ca-key", caKey)
	expect(2, "give --ca-key", "create-ca")
	expect(0, "wrote "+filepath.Join(pki, "ca.crt"), "create-ca", "--ca-key", caKey, "--lifetime", "5y")
	expect(4, "exists: not replaced (give --overwrite", "create-ca", "--ca-key", caKey)
	expect(0, "node \"srv\", serverAuth and clientAuth, for 127.0.0.1, srv.example", "create-node", "srv", "127.0.0.1", "srv.example", "--ca-key", caKey, "--file", "server")
	expect(2, "give the node's NAME and the addresses", "create-node", "srv2", "--ca-key", caKey)
	expect(0, "client \"ops\", clientAuth", "create-client", "ops", "--ca-key", caKey, "--lifetime", "30d")
	expect(4, "ops.crt exists", "create-client", "ops", "--ca-key", caKey)
	expect(0, "wrote", "create-client", "ops", "--ca-key", caKey, "--overwrite")
	expect(2, "accepts 1 arg(s)", "create-client", "ops", "extra", "--ca-key", caKey)
	expect(2, "the authority expires", "create-client", "late", "--ca-key", caKey, "--lifetime", "6y")
	expect(2, "want a duration", "create-client", "x", "--ca-key", caKey, "--lifetime", "soon")
	expect(2, "the key "+filepath.Join(pki, "ops.key")+" is not the key of", "create-client", "x", "--ca-key", filepath.Join(pki, "ops.key"))
	for _, p := range []string{"server.crt", "ops.crt"} {
		base := strings.TrimSuffix(p, ".crt")
		if _, err := tls.LoadX509KeyPair(filepath.Join(pki, p), filepath.Join(pki, base+".key")); err != nil {
			t.Errorf("%s: %v", p, err)
		}
	}
	if st, err := os.Stat(caKey); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("the authority's key: %v, %v", st, err)
	}

	out := expect(0, "", "list", "-f", "json", "--fields", "all")
	var recs []map[string]any
	if err := json.Unmarshal([]byte(out), &recs); err != nil {
		t.Fatalf("cert list -f json: %v\n%s", err, out)
	}
	var got []string
	for _, r := range recs {
		got = append(got, r["file"].(string)+":"+r["kind"].(string)+":"+r["key"].(string)+":"+r["status"].(string))
	}
	if strings.Join(got, " ") != "ca.crt:ca:-:ok ops.crt:client:ok:ok server.crt:node:ok:ok" {
		t.Errorf("cert list: %v", got)
	}
	if ips, _ := recs[2]["ips"].([]any); len(ips) != 1 || ips[0] != "127.0.0.1" {
		t.Errorf("cert list: server.crt's ips %v", recs[2]["ips"])
	}
}
