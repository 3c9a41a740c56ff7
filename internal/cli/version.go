package cli

import (
	"encoding/json"
	"fmt"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/output"
	"github.com/rnbd/rnbd/internal/version"
)

// AddVersion gives root --version and a "version" command: the release,
// the commit (with -dirty for a tree with changes), the Go version and
// the build's flags (internal/version). "version -f json" is one
// object: name, version, revision, modified, goversion, build.
func (g *Globals) AddVersion(root *cobra.Command) {
	info := version.Get()
	root.Version = info.String()
	root.SetVersionTemplate("{{.Name}} {{.Version}}")
	root.AddCommand(&cobra.Command{
		Use:   "version",
		Short: "Show the version, the commit it was built from, the Go version and the build's flags",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			w := cmd.OutOrStdout()
			switch g.Format {
			case "", "table":
				fmt.Fprintf(w, "%s %s", root.Name(), info)
				return nil
			case "json":
				b, _ := json.MarshalIndent(struct {
					Name string `json:"name"`
					version.Info
				}{root.Name(), info}, "", "  ")
				_, err := fmt.Fprintf(w, "%s\n", b)
				return err
			}
			rec := output.Record{"name": root.Name(), "version": info.Version, "revision": info.Revision,
				"modified": info.Modified, "goversion": info.GoVersion, "build": strings.Join(info.Build, " ")}
			err := output.Print(w, g.Format, output.List{Kind: "version",
				Fields: []string{"name", "version", "revision", "modified", "goversion", "build"}, Records: []output.Record{rec}})
			if err != nil {
				return ctl.Errorf(ctl.CodeInvalid, "%v", err)
			}
			return nil
		},
	})
}
