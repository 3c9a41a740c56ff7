package cli

import (
	"reflect"
	"testing"

	"github.com/spf13/cobra"
)

// TestCompleteFields: --fields completes the command's field names
// after what was typed up to the last comma, keeping a "+" or "-".
func TestCompleteFields(t *testing.T) {
	cmd := Fields(&cobra.Command{Use: "list"}, []string{"devname", "sessname", "size", "state"})
	for typed, want := range map[string][]string{
		"":           {"all", "devname", "sessname", "size", "state"},
		"s":          {"sessname", "size", "state"},
		"devname,st": {"devname,state"},
		"+si":        {"+size"},
		"a,-d":       {"a,-devname"},
		"x":          nil,
	} {
		got, _ := completeFields(cmd, nil, typed)
		if !reflect.DeepEqual(got, want) {
			t.Errorf("%q: %q, want %q", typed, got, want)
		}
	}
	if got, _ := completeFields(&cobra.Command{Use: "map"}, nil, ""); got != nil {
		t.Errorf("a command without records: %q", got)
	}
}

// TestCompleteSettings: KEY= first (no space after), then the key's
// values.
func TestCompleteSettings(t *testing.T) {
	c := CompleteSettings([]string{"mpath_policy", "max_reconnect_attempts"}, map[string][]string{"mpath_policy": {"round-robin", "min-inflight"}})
	if got, d := c(nil, nil, "m"); !reflect.DeepEqual(got, []string{"mpath_policy=", "max_reconnect_attempts="}) || d&cobra.ShellCompDirectiveNoSpace == 0 {
		t.Errorf("keys: %q %v", got, d)
	}
	if got, _ := c(nil, nil, "mpath_policy=r"); !reflect.DeepEqual(got, []string{"mpath_policy=round-robin"}) {
		t.Errorf("values: %q", got)
	}
}
