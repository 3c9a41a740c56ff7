package cli

import (
	"fmt"
	"net/url"
	"strconv"
	"strings"

	"github.com/spf13/cobra"
)

// ListCmds are "list" and "show NAME" of the records of kind at path
// (GET path, GET path/NAME); show prints every field. query, if not nil,
// adds a query string to both (a path's --session).
func (g *Globals) ListCmds(kind, path, listShort, showShort string, query func() string, defaults, all []string) []*cobra.Command {
	if query == nil {
		query = func() string { return "" }
	}
	return []*cobra.Command{Fields(&cobra.Command{
		Use:   "list",
		Short: listShort,
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.List(cmd.OutOrStdout(), path+query(), kind, defaults, all)
		},
	}, all), Fields(&cobra.Command{
		Use:   "show NAME",
		Short: showShort,
		Args:  cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return g.List(cmd.OutOrStdout(), path+"/"+url.PathEscape(args[0])+query(), kind, all, all)
		},
		ValidArgsFunction: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
			return g.CompleteNames(nameFields[kind], path+query())(cmd, args, toComplete)
		},
	}, all)}
}

// nameFields are the record fields that name an object of each kind:
// what "show NAME" and the other commands of one object complete.
var nameFields = map[string]string{"device": "devname", "session": "sessname", "path": "pathname", "export": "name", "session-name": "sessname",
	"volume": "name", "snapshot": "name", "pool": "name", "grant": "identity"}

// Action is a control command that POSTs to one object and says what it
// did: "POST Path(args) Body(args)", then Done(args) on a line.
type Action struct {
	Use, Short string
	Args       int // number of arguments
	Path       func(args []string) string
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
			if err := g.Call("POST", a.Path(args), body, nil); err != nil {
				return err
			}
			fmt.Fprintln(cmd.OutOrStdout(), a.Done(args))
			return nil
		},
	}
}

// Under is the path of an object by its name, escaped: base/NAME + rest.
func Under(base, rest string) func(args []string) string {
	return func(args []string) string { return base + "/" + url.PathEscape(args[0]) + rest }
}

// PathCmd is the "path" command both daemons have: list and show, then
// one command per op in ops (POST /v1/paths/NAME/OP), all taking
// --session for a path name more than one session has. more adds
// commands that may use the --session query.
func (g *Globals) PathCmd(short, showWhat string, defaults, all []string, ops []PathOp, more func(query func() string) []*cobra.Command) *cobra.Command {
	cmd := &cobra.Command{Use: "path", Short: short}
	var session string
	cmd.PersistentFlags().StringVar(&session, "session", "", "the session the path belongs to")
	q := func() string {
		if session == "" {
			return ""
		}
		return "?session=" + url.QueryEscape(session)
	}
	lists := g.ListCmds("path", "/v1/paths", "List paths", "Show a path ("+showWhat+")", q, defaults, all)
	lists[1].Use = "show PATH"
	cmd.AddCommand(lists...)
	if more != nil {
		cmd.AddCommand(more(q)...)
	}
	for _, op := range ops {
		cmd.AddCommand(g.Command(Action{
			Use: op.Name + " PATH", Short: op.Short, Args: 1,
			Path: func(args []string) string { return "/v1/paths/" + url.PathEscape(args[0]) + "/" + op.Name + q() },
			Done: func(args []string) string { return fmt.Sprintf(op.Done, args[0]) },
			Complete: func(cmd *cobra.Command, args []string, toComplete string) ([]string, cobra.ShellCompDirective) {
				return g.CompleteNames("pathname", "/v1/paths"+q())(cmd, args, toComplete)
			},
		}))
	}
	CompleteFlag(cmd, "session", g.CompleteNames("sessname", "/v1/sessions"))
	return cmd
}

// PathOp is one of PathCmd's commands: its name, its help and what it
// prints when done (a format of the path's name).
type PathOp struct{ Name, Short, Done string }

// StatsCmd is "stats [--reset]": the records of GET /v1/stats, or POST
// /v1/stats/reset.
func (g *Globals) StatsCmd(short string, fields []string) *cobra.Command {
	var reset bool
	cmd := &cobra.Command{
		Annotations: map[string]string{fieldsAnnotation: strings.Join(fields, ",")},
		Use:         "stats",
		Short:       short,
		Args:        cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			if reset {
				if err := g.Call("POST", "/v1/stats/reset", nil, nil); err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), "stats reset")
				return nil
			}
			return g.List(cmd.OutOrStdout(), "/v1/stats", "stats", fields, fields)
		},
	}
	cmd.Flags().BoolVar(&reset, "reset", false, "reset the counters")
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
