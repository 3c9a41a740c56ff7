package cli

import (
	"context"
	"net/url"
	"sort"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/output"
)

// Completion: the shells' completion scripts (`completion bash`) ask
// the binary (`__complete`), which asks the running daemon for the
// names it has — devices, sessions, paths, exports — over the control
// socket (--socket as typed). With no daemon, or one that does not
// answer within a second, there is nothing to offer, and nothing is
// said: a completion must not print errors into the command line.

// completeWithin bounds a completion's question to the daemon.
const completeWithin = time.Second

// Names are the values of field in the records of list route rt (a
// GET of no name, with query), sorted and without repeats; nothing when
// the daemon does not answer.
func (g *Globals) Names(rt api.Route, query url.Values, field string) []string {
	ctx, cancel := context.WithTimeout(context.Background(), completeWithin)
	defer cancel()
	var recs []output.Record
	if err := api.Call(ctx, g.Client(), rt, nil, query, nil, &recs); err != nil {
		return nil
	}
	seen := map[string]bool{}
	var out []string
	for _, r := range recs {
		if s, ok := r[field].(string); ok && s != "" && !seen[s] {
			seen[s] = true
			out = append(out, s)
		}
	}
	sort.Strings(out)
	return out
}

// Completion completes one argument or flag value.
type Completion func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective)

// CompleteNames completes the arguments of a command in order: the
// first from the daemon's records of list route routes[0] (their
// field), the second from routes[1], ...; NoName completes nothing (a
// new name), and past the list, nothing either.
func (g *Globals) CompleteNames(field string, routes ...api.Route) Completion {
	return g.CompleteNamesQuery(field, nil, routes...)
}

// CompleteNamesQuery is CompleteNames with a query (a path's --session)
// added to each route, as it is when completing.
func (g *Globals) CompleteNamesQuery(field string, query func() url.Values, routes ...api.Route) Completion {
	return func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		if len(args) >= len(routes) || routes[len(args)] == NoName {
			return nil, cobra.ShellCompDirectiveNoFileComp
		}
		var q url.Values
		if query != nil {
			q = query()
		}
		return prefixed(g.Names(routes[len(args)], q, field), toComplete), cobra.ShellCompDirectiveNoFileComp
	}
}

// NoName is the route of an argument CompleteNames offers nothing for:
// a new name.
var NoName = api.Route{}

// CompleteFrom completes from a fixed list of words.
func CompleteFrom(words ...string) Completion {
	return func(_ *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		return prefixed(words, toComplete), cobra.ShellCompDirectiveNoFileComp
	}
}

// CompleteFiles completes file names ending in one of exts.
func CompleteFiles(exts ...string) Completion {
	return func(*cobra.Command, []string, string) ([]string, cobra.ShellCompDirective) {
		return exts, cobra.ShellCompDirectiveFilterFileExt
	}
}

// CompleteSettings completes KEY=VALUE words: the keys (with "=" and no
// space after), then the values a key takes where values has them.
func CompleteSettings(keys []string, values map[string][]string) Completion {
	return func(_ *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		if k, v, ok := strings.Cut(toComplete, "="); ok {
			var out []string
			for _, w := range prefixed(values[k], v) {
				out = append(out, k+"="+w)
			}
			return out, cobra.ShellCompDirectiveNoFileComp
		}
		var out []string
		for _, k := range prefixed(keys, toComplete) {
			out = append(out, k+"=")
		}
		return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
	}
}

// fieldsAnnotation is where a list command keeps the fields it has, for
// --fields' completion.
const fieldsAnnotation = "rnbd:fields"

// completeFields completes --fields: the command's field names, after
// what was typed up to the last comma, each with "+" or "-" kept.
func completeFields(cmd *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
	all := strings.Split(cmd.Annotations[fieldsAnnotation], ",")
	if cmd.Annotations[fieldsAnnotation] == "" {
		return nil, cobra.ShellCompDirectiveNoFileComp
	}
	done, last := "", toComplete
	if i := strings.LastIndexByte(toComplete, ','); i >= 0 {
		done, last = toComplete[:i+1], toComplete[i+1:]
	}
	sign := ""
	if last != "" && (last[0] == '+' || last[0] == '-') {
		sign, last = last[:1], last[1:]
	}
	var out []string
	if done == "" && sign == "" && strings.HasPrefix("all", last) {
		out = append(out, "all")
	}
	for _, f := range prefixed(all, last) {
		out = append(out, done+sign+f)
	}
	return out, cobra.ShellCompDirectiveNoFileComp | cobra.ShellCompDirectiveNoSpace
}

// prefixed are the words that start with p.
func prefixed(words []string, p string) []string {
	var out []string
	for _, w := range words {
		if strings.HasPrefix(w, p) {
			out = append(out, w)
		}
	}
	return out
}

// Fields marks a command as listing records of these fields, for
// --fields' completion.
func Fields(cmd *cobra.Command, all []string) *cobra.Command {
	if cmd.Annotations == nil {
		cmd.Annotations = map[string]string{}
	}
	cmd.Annotations[fieldsAnnotation] = strings.Join(all, ",")
	return cmd
}

// Complete sets a command's argument completion and returns it.
func Complete(cmd *cobra.Command, c Completion) *cobra.Command {
	cmd.ValidArgsFunction = c
	return cmd
}

// CompleteFlag sets a flag's completion (the flag must exist).
// A flag's value is completed as a first argument would be, whatever
// arguments come before it (volume create NAME --pool <TAB> offers the
// pools, not what a second argument would be).
func CompleteFlag(cmd *cobra.Command, flag string, c Completion) {
	asFirst := func(cmd *cobra.Command, _ []string, toComplete string) ([]string, cobra.ShellCompDirective) {
		return c(cmd, nil, toComplete)
	}
	if err := cmd.RegisterFlagCompletionFunc(flag, asFirst); err != nil {
		panic(err) // a programming error: no such flag
	}
}
