package e2e

import (
	"strings"
	"testing"
	"time"
)

// TestFlagErrors: a port out of range, on the command line or in the
// kernel-style map string, is refused in plain words (before: strconv's
// "strconv.ParseUint: parsing "99999": value out of range") with exit 2,
// usage; so is a bad number of any flag.
func TestFlagErrors(t *testing.T) {
	for _, c := range []struct {
		bin  string
		args []string
		want string
	}{
		{"rnbd-client", []string{"map", "--sessname", "s", "--path", "ip:127.0.0.1", "--device-path", "v", "--dest-port", "99999"},
			`rnbd-client: invalid argument "99999" for "--dest-port" flag: want a port number from 1 to 65535` + "\n"},
		{"rnbd-client", []string{"map", "--dest-port", "0"},
			`rnbd-client: invalid argument "0" for "--dest-port" flag: want a port number from 1 to 65535` + "\n"},
		{"rnbd-client", []string{"map", "sessname=s path=ip:127.0.0.1 device_path=v dest_port=99999", "--socket", "/nonexistent/client.sock"},
			"rnbd-client: map: dest_port 99999: want a port number from 1 to 65535\n"},
		{"rnbd-server", []string{"daemon", "--queue-depth", "x"},
			`rnbd-server: invalid argument "x" for "--queue-depth" flag: not a number` + "\n"},
		{"rnbd-client", []string{"daemon", "--hb-missed-max", "99999999999999999999"},
			`rnbd-client: invalid argument "99999999999999999999" for "--hb-missed-max" flag: out of range` + "\n"},
	} {
		_, stderr, code := runCode(t, 10*time.Second, bin(c.bin), c.args...)
		if code != 2 || stderr != c.want || strings.Contains(stderr, "strconv") {
			t.Errorf("%s %s: exit %d, %q; want 2, %q", c.bin, strings.Join(c.args, " "), code, stderr, c.want)
		}
	}
}
