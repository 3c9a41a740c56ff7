package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"
	"slices"
	"strings"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rnbd/rnbd/internal/conf"
	"github.com/rnbd/rnbd/internal/ctl"
)

// ConfigError gives a configuration's error its exit code: that of its
// class where it has one (a file that does not exist: not_found, 3; one
// that cannot be read: permission_denied, 7), else invalid_argument (2).
func ConfigError(err error) error {
	if err == nil || ctl.Classify(err) != ctl.CodeInternal {
		return err
	}
	return &ctl.Error{Code: ctl.CodeInvalid, Message: err.Error()}
}

// ConfigCmd is "config check [FILE]": check reads the file (the default
// one if no FILE is given, which may then be missing), validates it, loads
// the files it names (TLS) and checks this host as far as it can without
// starting anything (conf.Findings). It prints each warning, then says
// "FILE: ok", or fails with every error at once, one a line, and the
// exit code of the worst (CheckReport).
func ConfigCmd(daemon, defaultFile string, check func(path string, mustExist bool) conf.Findings) *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Check a configuration file"}
	cmd.AddCommand(&cobra.Command{
		Use:   "check [FILE]",
		Short: "Check a configuration file (default " + defaultFile + ") and this host without starting anything: exit 0 if " + daemon + " daemon would start with it",
		Long: `Check a configuration file as "` + daemon + ` daemon --config FILE" reads it, and
this host as far as can be done without starting anything: every key known (an
unknown one is named with its line and the nearest known key), every value
valid, the TLS files it names readable and matching, the addresses it
listens on this host's (and an rdma:// one's interface an RDMA device's), and,
as warnings the daemon starts with, pools and exports not there and
certificates without the usage their peers check or about to expire. Every
problem is reported, each on a line; the exit code is the worst's, in the
order invalid_argument (2), not_found (3), permission_denied (7),
not_supported (8). Warnings alone exit 0. Without FILE, ` + defaultFile + `,
whose absence is no error (the daemon then runs on its defaults). The
packaged unit runs it before the daemon (ExecStartPre).`,
		Example: "  " + daemon + " config check " + defaultFile,
		Args:    cobra.MaximumNArgs(1),
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			if len(args) > 0 {
				return nil, cobra.ShellCompDirectiveNoFileComp
			}
			return CompleteFiles("toml")(cmd, args, toComplete)
		},
		RunE: func(cmd *cobra.Command, args []string) error {
			path, explicit := defaultFile, len(args) == 1
			if explicit {
				path = args[0]
			}
			f := check(path, explicit)
			for _, w := range f.Warnings {
				fmt.Fprintf(cmd.ErrOrStderr(), "%s: config %s: warning: %s\n", cmd.Root().Name(), path, w)
			}
			if err := CheckReport(f.Errors); err != nil {
				return err
			}
			ok := "ok"
			if n := len(f.Warnings); n > 0 {
				ok = fmt.Sprintf("ok, with %d warning(s)", n)
			}
			if _, err := os.Stat(path); !explicit && errors.Is(err, fs.ErrNotExist) {
				fmt.Fprintf(cmd.OutOrStdout(), "%s: no such file; the defaults are %s\n", path, ok)
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: %s\n", path, ok)
			return nil
		},
	})
	return cmd
}

// checkOrder ranks the classes of config check's errors: the exit code
// is that of the first class any error has.
var checkOrder = []ctl.Code{ctl.CodeInvalid, ctl.CodeNotFound, ctl.CodePermission, ctl.CodeNotSupported, ctl.CodeUnavailable}

// CheckReport is one error of errs (nil if none): every message, one a
// line, with the class of the worst (checkOrder; ConfigError's class
// for each).
func CheckReport(errs []error) error {
	if len(errs) == 0 {
		return nil
	}
	rank := func(c ctl.Code) int {
		if i := slices.Index(checkOrder, c); i >= 0 {
			return i
		}
		return len(checkOrder)
	}
	var lines []string
	code := ctl.Classify(ConfigError(errs[0]))
	for _, err := range errs {
		lines = append(lines, err.Error())
		if c := ctl.Classify(ConfigError(err)); rank(c) < rank(code) {
			code = c
		}
	}
	return &ctl.Error{Code: code, Message: strings.Join(lines, "\n")}
}

// DaemonConfig is the configuration "daemon" runs with: the file of its
// --config (load reads it over the defaults; one not given may be
// missing), under the flags given on the command line. bind binds every
// flag of the daemon to a field of a configuration, defaulting to the
// field's value: the command binds them over the defaults (its help),
// and here they are bound again over the file's configuration, and each
// flag given is set again there. A new flag is thus one line, in bind.
func DaemonConfig[C any](cmd *cobra.Command, load func(path string, mustExist bool) (C, error), bind func(*pflag.FlagSet, *C)) (C, error) {
	path, _ := cmd.Flags().GetString("config")
	cfg, err := load(path, cmd.Flags().Changed("config"))
	if err != nil {
		return cfg, ConfigError(err)
	}
	over := pflag.NewFlagSet(cmd.Name(), pflag.ContinueOnError)
	bind(over, &cfg)
	cmd.Flags().Visit(func(f *pflag.Flag) {
		to := over.Lookup(f.Name)
		if to == nil || err != nil {
			return // --config, or a global flag
		}
		if from, ok := f.Value.(pflag.SliceValue); ok {
			err = to.Value.(pflag.SliceValue).Replace(from.GetSlice())
		} else {
			err = to.Value.Set(f.Value.String())
		}
		if err != nil {
			err = fmt.Errorf("--%s: %w", f.Name, err)
		}
	})
	return cfg, err
}
