package cli

import (
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/cobra/doc"
)

// ManCmd is a hidden command that writes root's man pages (section 8:
// NAME.8, NAME-SUBCOMMAND.8, ...) into a directory: the packages and
// `make man` install them.
func ManCmd(root *cobra.Command) *cobra.Command {
	return &cobra.Command{
		Use:    "man DIR",
		Short:  "Write the man pages into DIR",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if err := os.MkdirAll(args[0], 0o755); err != nil {
				return err
			}
			root.DisableAutoGenTag = true
			hdr := &doc.GenManHeader{Section: "8", Source: "rnbd", Manual: "System Administration"}
			// Reproducible pages: dated SOURCE_DATE_EPOCH (the
			// packages set the commit's date), not when they were made.
			if v := os.Getenv("SOURCE_DATE_EPOCH"); v != "" {
				sec, err := strconv.ParseInt(v, 10, 64)
				if err != nil {
					return fmt.Errorf("SOURCE_DATE_EPOCH %q: %w", v, err)
				}
				t := time.Unix(sec, 0).UTC()
				hdr.Date = &t
			}
			if err := doc.GenManTree(root, hdr, args[0]); err != nil {
				return fmt.Errorf("man pages: %w", err)
			}
			return nil
		},
	}
}
