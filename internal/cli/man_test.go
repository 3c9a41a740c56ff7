package cli

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/spf13/cobra"
)

// TestManCmd writes a page per command, in section 8, naming the
// command and its flags.
func TestManCmd(t *testing.T) {
	root := &cobra.Command{Use: "tool", Short: "A tool"}
	sub := &cobra.Command{Use: "sub", Short: "Does a thing", Run: func(*cobra.Command, []string) {}}
	sub.Flags().Int("depth", 4, "how deep")
	root.AddCommand(sub, ManCmd(root))
	dir := t.TempDir()
	root.SetArgs([]string{"man", dir})
	if err := root.Execute(); err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(dir, "tool-sub.8"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{`.TH "TOOL-SUB" "8"`, "Does a thing", "depth"} {
		if !strings.Contains(string(b), want) {
			t.Errorf("tool-sub.8 lacks %q:\n%s", want, b)
		}
	}
	if _, err := os.Stat(filepath.Join(dir, "tool-man.8")); err == nil {
		t.Error("the hidden man command has a page")
	}
}
