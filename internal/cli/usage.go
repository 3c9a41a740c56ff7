package cli

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/ctl"
)

// strictAnnotation marks a tree Strict has been applied to;
// GroupAnnotation marks the commands it made groups: they only choose
// one of their commands.
const (
	strictAnnotation = "rnbd_strict"
	GroupAnnotation  = "rnbd_group"
)

// Strict makes root's command groups refuse what they do not know, so
// that a script with a mistyped or missing command fails instead of
// printing help and succeeding:
//
//   - a word after a group that is none of its commands is a usage error
//     (invalid_argument, exit 2) naming the nearest commands, or all of
//     them when none is near ("rnbd-client session frob");
//   - a group given no command prints its usage on standard error and is
//     a usage error too ("rnbd-server volume"): it did nothing;
//   - "help" of a command that does not exist is a usage error.
//
// --help, -h and "help COMMAND" still print the help on standard output
// and exit 0. A group is a command with subcommands and no action of its
// own; cobra's completion command is one. Strict may be called more than
// once; Run calls it, so every binary run by Main is strict.
func Strict(root *cobra.Command) {
	if root.Annotations[strictAnnotation] != "" {
		return
	}
	if root.Annotations == nil {
		root.Annotations = map[string]string{}
	}
	root.Annotations[strictAnnotation] = "yes"
	// A group's usage shows "GROUP [command]", not also its own use
	// line as a command's that runs would.
	if t := root.UsageTemplate(); strings.Contains(t, usageLine) {
		root.SetUsageTemplate(strings.Replace(t, usageLine, groupUsageLine, 1))
	}
	// The commands cobra adds as it executes, added now so that they
	// are strict as well.
	root.InitDefaultHelpCmd()
	root.InitDefaultCompletionCmd()
	for _, c := range root.Commands() {
		if c.Name() == "help" && c.Run != nil && c.RunE == nil {
			strictHelp(c)
		}
	}
	strictGroups(root)
}

// usageLine is how cobra's usage template starts, groupUsageLine what
// Strict makes it.
const (
	usageLine      = "Usage:{{if .Runnable}}"
	groupUsageLine = "Usage:{{if and .Runnable (not .HasAvailableSubCommands)}}"
)

// strictGroups gives every group under c (and c) an action that
// refuses its arguments.
func strictGroups(c *cobra.Command) {
	for _, sub := range c.Commands() {
		strictGroups(sub)
	}
	if !c.HasSubCommands() || c.Runnable() {
		return
	}
	if !strings.Contains(c.Use, " ") {
		c.Use += " COMMAND"
	}
	if c.Annotations == nil {
		c.Annotations = map[string]string{}
	}
	c.Annotations[GroupAnnotation] = "yes"
	c.Args = cobra.ArbitraryArgs
	c.RunE = func(cmd *cobra.Command, args []string) error {
		if len(args) > 0 {
			return UnknownCommand(cmd, args[0])
		}
		fmt.Fprint(cmd.ErrOrStderr(), cmd.UsageString())
		return ctl.Errorf(ctl.CodeInvalid, "%q needs a command: %s", cmd.CommandPath(), commandNames(cmd))
	}
}

// UnknownCommand is the usage error of a word that is none of group's
// commands: it names the nearest of them as cobra finds them, or all of
// them when none is near.
func UnknownCommand(group *cobra.Command, word string) error {
	if group.SuggestionsMinimumDistance <= 0 {
		group.SuggestionsMinimumDistance = 2
	}
	msg := fmt.Sprintf("unknown command %q for %q", word, group.CommandPath())
	if s := group.SuggestionsFor(word); len(s) > 0 {
		for i := range s {
			s[i] = strconv.Quote(s[i])
		}
		return ctl.Errorf(ctl.CodeInvalid, "%s; did you mean %s?", msg, strings.Join(s, " or "))
	}
	return ctl.Errorf(ctl.CodeInvalid, "%s; its commands: %s", msg, commandNames(group))
}

// commandNames are the names of group's commands one may type.
func commandNames(group *cobra.Command) string {
	var names []string
	for _, c := range group.Commands() {
		if c.IsAvailableCommand() {
			names = append(names, c.Name())
		}
	}
	return strings.Join(names, ", ")
}

// strictHelp makes cobra's help command refuse a topic that is no
// command ("help volume frob") instead of printing the usage and
// succeeding.
func strictHelp(help *cobra.Command) {
	run := help.Run
	help.Run = nil
	help.Args = cobra.ArbitraryArgs // a topic is any words; RunE checks them
	help.RunE = func(c *cobra.Command, args []string) error {
		cmd, rest, err := c.Root().Find(args)
		if err != nil {
			return ctl.Errorf(ctl.CodeInvalid, "%v", err)
		}
		if len(rest) > 0 && cmd.HasSubCommands() {
			return UnknownCommand(cmd, rest[0])
		}
		if len(rest) > 0 {
			return ctl.Errorf(ctl.CodeInvalid, "unknown help topic %q: %q has no commands", strings.Join(args, " "), cmd.CommandPath())
		}
		run(c, args)
		return nil
	}
}
