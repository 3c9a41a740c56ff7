package cli

import (
	"errors"
	"fmt"
	"io/fs"
	"os"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

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
// one if no FILE is given, which may then be missing), validates it and
// loads the files it names (TLS), starting nothing. It says "FILE: ok"
// or fails as the daemon would, with ConfigError's exit code.
func ConfigCmd(daemon, defaultFile string, check func(path string, mustExist bool) error) *cobra.Command {
	cmd := &cobra.Command{Use: "config", Short: "Check a configuration file"}
	cmd.AddCommand(&cobra.Command{
		Use:   "check [FILE]",
		Short: "Check a configuration file (default " + defaultFile + ") without starting anything: exit 0 if " + daemon + " daemon would start with it",
		Long: `Check a configuration file as "` + daemon + ` daemon --config FILE" reads it, without
starting anything: every key known (an unknown one is named with its line
and the nearest known key), every value valid, the TLS files it names
readable and matching. Without FILE, ` + defaultFile + `, whose absence
is no error (the daemon then runs on its defaults). The packaged unit runs
it before the daemon (ExecStartPre).`,
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
			if err := check(path, explicit); err != nil {
				return ConfigError(err)
			}
			if _, err := os.Stat(path); !explicit && errors.Is(err, fs.ErrNotExist) {
				fmt.Fprintf(cmd.OutOrStdout(), "%s: no such file; the defaults are ok\n", path)
				return nil
			}
			fmt.Fprintf(cmd.OutOrStdout(), "%s: ok\n", path)
			return nil
		},
	})
	return cmd
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
