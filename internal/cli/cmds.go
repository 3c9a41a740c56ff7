package cli

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/api"
)

// ListCmds are "list" and "show NAME" of the records of kind: GET of
// route list, and of route show with NAME; show prints every field.
// query, if not nil, adds a query to both (a path's --session).
func (g *Globals) ListCmds(kind string, list, show api.Route, listShort, showShort string, query func() url.Values, defaults, all []string) []*cobra.Command {
	if query == nil {
		query = func() url.Values { return nil }
	}
	return []*cobra.Command{Fields(&cobra.Command{
		Use:   "list",
		Short: listShort,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.List(cmd.OutOrStdout(), list, nil, query(), kind, defaults, all)
		},
	}, all), Fields(&cobra.Command{
		Use:   "show NAME",
		Short: showShort,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.List(cmd.OutOrStdout(), show, args, query(), kind, all, all)
		},
		ValidArgsFunction: g.CompleteNamesQuery(nameFields[kind], query, list),
	}, all)}
}

// nameFields are the record fields that name an object of each kind:
// what "show NAME" and the other commands of one object complete.
var nameFields = map[string]string{"device": "devname", "session": "sessname", "path": "pathname", "export": "name", "session-name": "sessname",
	"volume": "name", "snapshot": "name", "pool": "name", "grant": "identity"}

// Action is a control command that sends one request of Route to one
// object and says what it did: Body(args) to Route with args (and
// Query, if set), then Done(args) on a line.
type Action struct {
	Use, Short string
	Args       int // number of arguments, the route's names
	Route      api.Route
	Query      func() url.Values
	Body       func(args []string) any // nil: no body
	Done       func(args []string) string
	// Complete completes the arguments (nil: none).
	Complete Completion
}

// Command makes the cobra command of a.
func (g *Globals) Command(a Action) *cobra.Command {
	return &cobra.Command{
		Use:               a.Use,
		Short:             a.Short,
		Args:              cobra.ExactArgs(a.Args),
		ValidArgsFunction: a.Complete,
		RunE: func(cmd *cobra.Command, args []string) error {
			var body any
			if a.Body != nil {
				body = a.Body(args)
			}
			var q url.Values
			if a.Query != nil {
				q = a.Query()
			}
			// The first arguments name the object; the others (a
			// size, a path) are in the body.
			if err := g.Call(a.Route, args[:a.Route.Names()], q, body, nil); err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), a.Done(args))
			return nil
		},
	}
}

// PathCmd is the "path" command both daemons have: list and show (routes
// list and show), then one command per op in ops, all taking --session
// for a path name more than one session has. more adds commands that
// may use the --session query.
func (g *Globals) PathCmd(short, showWhat string, list, show api.Route, defaults, all []string, ops []PathOp,
	more func(query func() url.Values) []*cobra.Command) *cobra.Command {
	cmd := &cobra.Command{Use: "path", Short: short}
	var session string
	cmd.PersistentFlags().StringVar(&session, "session", "", "the session the path belongs to")
	q := func() url.Values {
		if session == "" {
			return nil
		}
		return url.Values{"session": {session}}
	}
	lists := g.ListCmds("path", list, show, "List paths", "Show a path ("+showWhat+")", q, defaults, all)
	lists[1].Use = "show PATH"
	cmd.AddCommand(lists...)
	if more != nil {
		cmd.AddCommand(more(q)...)
	}
	for _, op := range ops {
		cmd.AddCommand(g.Command(Action{
			Use: op.Name + " PATH", Short: op.Short, Args: 1, Route: op.Route, Query: q,
			Done:     func(args []string) string { return fmt.Sprintf(op.Done, args[0]) },
			Complete: g.CompleteNamesQuery("pathname", q, list),
		}))
	}
	CompleteFlag(cmd, "session", g.CompleteNames("sessname", sessionsOf(list)))
	return cmd
}

// sessionsOf is the session list route of the daemon whose path list
// route is paths.
func sessionsOf(paths api.Route) api.Route {
	if paths == api.CltPaths {
		return api.CltSessions
	}
	return api.SrvSessions
}

// PathOp is one of PathCmd's commands: its name, its route (of the path
// named), its help and what it prints when done (a format of the path's
// name).
type PathOp struct {
	Name  string
	Route api.Route
	Short string
	Done  string
}

// StatsCmd is "stats [--reset]": the records of route stats, or route
// reset.
func (g *Globals) StatsCmd(short string, stats, reset api.Route, fields []string) *cobra.Command {
	var doReset bool
	cmd := &cobra.Command{
		Annotations: map[string]string{fieldsAnnotation: strings.Join(fields, ",")},
		Use:         "stats",
		Short:       short,
		Args:        cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if doReset {
				if err := g.Call(reset, nil, nil, nil, nil); err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), "stats reset")
				return nil
			}
			return g.List(cmd.OutOrStdout(), stats, nil, nil, "stats", fields, fields)
		},
	}
	cmd.Flags().BoolVar(&doReset, "reset", false, "reset the counters")
	return cmd
}

// Port is a flag's TCP port, 1 to 65535: a number outside says so
// rather than with strconv's words.
type Port uint16

func (p *Port) String() string { return strconv.Itoa(int(*p)) }

func (p *Port) Set(s string) error {
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("want a port number from 1 to 65535")
	}
	*p = Port(n)
	return nil
}

func (p *Port) Type() string { return "port" }
