// Command rtrs-demo runs the RTRS transport on its own: "server" serves a
// memory backend, "load" opens a multipath session to it and drives a
// verified mixed read/write load, then prints what every path did in the
// kernel's stats formats.
package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/rnbd/rnbd/internal/demo"
	"github.com/rnbd/rnbd/internal/units"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/pkg/rtrs"
	"github.com/rnbd/rnbd/pkg/rtrs/fabric/tcp"
)

func main() {
	if err := newRootCommand().Execute(); err != nil {
		fmt.Fprintln(os.Stderr, "rtrs-demo:", err)
		os.Exit(1)
	}
}

func newRootCommand() *cobra.Command {
	var level string
	root := &cobra.Command{
		Use:           "rtrs-demo",
		Short:         "Run the RTRS transport: a memory server and a verifying load client",
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(cmd *cobra.Command, args []string) error {
			l, err := log.ParseLevel(level)
			if err != nil {
				return err
			}
			log.SetLevel(l)
			log.SetOutput(cmd.ErrOrStderr())
			return nil
		},
	}
	root.PersistentFlags().StringVar(&level, "log-level", "warn", "log level: error, warn, info, debug")
	root.AddCommand(newServerCommand(), newLoadCommand())
	return root
}

func newServerCommand() *cobra.Command {
	var (
		listen    []string
		size      = units.Size(64 << 20)
		qd        int
		chunk     int
		inv       bool
		hb        time.Duration
		hbMissed  int
		readyFile string
	)
	cmd := &cobra.Command{
		Use:   "server",
		Short: "Serve a memory backend over RTRS until SIGTERM",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			var addrs []netip.AddrPort
			for _, l := range listen {
				a, err := rtrs.ParseListenAddr(l)
				if err != nil {
					return err
				}
				addrs = append(addrs, a)
			}
			backend := demo.NewBackend(int(size))

			cfg := rtrs.DefaultSrvConfig()
			cfg.Fabric, cfg.Handler, cfg.Listen = tcp.New(tcp.Options{}), backend, addrs
			cfg.QueueDepth, cfg.MaxChunkSize, cfg.AlwaysInvalidate = qd, chunk, inv
			cfg.HBInterval, cfg.HBMissedMax = hb, hbMissed
			srv, err := rtrs.NewServer(cfg)
			if err != nil {
				return err
			}
			defer srv.Close()
			var bound []string
			for _, a := range srv.Addrs() {
				bound = append(bound, "tcp://"+a.String())
			}
			fmt.Fprintf(cmd.OutOrStdout(), "rtrs-demo server: listening on %s, %v of memory, queue depth %d, chunk %d, always_invalidate %v\n",
				strings.Join(bound, " "), &size, qd, chunk, inv)
			if readyFile != "" {
				if err := os.WriteFile(readyFile, []byte(strings.Join(bound, "\n")+"\n"), 0o644); err != nil {
					return err
				}
			}
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, syscall.SIGTERM, syscall.SIGINT)
			<-sig
			fmt.Fprintf(cmd.OutOrStdout(), "rtrs-demo server: served %d reads and %d writes\n", backend.Reads.Load(), backend.Writes.Load())
			return nil
		},
	}
	f := cmd.Flags()
	f.StringArrayVar(&listen, "listen", []string{"tcp://127.0.0.1:1234"}, "address to listen on, tcp://HOST[:PORT] (repeatable)")
	f.Var(&size, "size", "memory to serve (bytes, or K, M, G)")
	f.IntVar(&qd, "queue-depth", rtrs.DefaultQueueDepth, "chunks per session")
	f.IntVar(&chunk, "chunk-size", rtrs.DefaultMaxChunkSize, "bytes per chunk (a power of two)")
	f.BoolVar(&inv, "always-invalidate", true, "rotate each chunk's rkey after every IO")
	f.DurationVar(&hb, "hb-interval", rtrs.DefaultHBInterval, "heartbeat interval")
	f.IntVar(&hbMissed, "hb-missed-max", rtrs.DefaultHBMissedMax, "heartbeats missed before a path is dead")
	f.StringVar(&readyFile, "ready-file", "", "write the listening addresses here once ready")
	return cmd
}

type pathReport struct {
	Name         string             `json:"name"`
	State        string             `json:"state"`
	HCAName      string             `json:"hca_name"`
	Rdma         string             `json:"rdma"`
	Reconnects   string             `json:"reconnects"`
	CurLatencyNs int64              `json:"cur_latency_ns"`
	Counters     rtrs.StatsCounters `json:"counters"`
}

type loadReport struct {
	Session  string       `json:"session"`
	Policy   string       `json:"mpath_policy"`
	Result   demo.Result  `json:"result"`
	Paths    []pathReport `json:"paths"`
	Error    string       `json:"error,omitempty"`
	Duration string       `json:"duration"`
}

func newLoadCommand() *cobra.Command {
	var (
		sessname    string
		paths       []string
		port        uint16
		conns       int
		policy      string
		size        = units.Size(64 << 20)
		bs          int
		qd          int
		writePct    int
		duration    time.Duration
		ios         int64
		hb          time.Duration
		hbMissed    int
		reconDelay  time.Duration
		reconMax    time.Duration
		jsonOut     bool
		connTimeout time.Duration
	)
	cmd := &cobra.Command{
		Use:   "load",
		Short: "Open a session over the given paths and run a verified read/write load",
		Args:  cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			cfg := rtrs.DefaultCltConfig()
			cfg.SessName, cfg.Fabric = sessname, tcp.New(tcp.Options{})
			for _, s := range paths {
				p, err := rtrs.ParsePathAddr(s, port)
				if err != nil {
					return err
				}
				cfg.Paths = append(cfg.Paths, p)
			}
			mp, err := rtrs.ParseMPPolicy(policy)
			if err != nil {
				return err
			}
			cfg.MPPolicy = mp
			if conns > 0 {
				cfg.ConnsPerPath = conns
			}
			cfg.HBInterval, cfg.HBMissedMax = hb, hbMissed
			cfg.ReconnectDelay, cfg.ReconnectMaxDelay, cfg.ConnectTimeout = reconDelay, reconMax, connTimeout
			ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGINT, syscall.SIGTERM)
			defer stop()
			sess, err := rtrs.DialSession(ctx, cfg)
			if err != nil {
				return err
			}
			defer sess.Close()
			out := cmd.OutOrStdout()
			if !jsonOut {
				fmt.Fprintf(out, "session %s: %d paths connected, queue depth %d, max IO %d bytes, policy %s\n",
					sess.Name(), len(sess.Paths()), sess.QueueDepth(), sess.MaxIOSize(), sess.MPPolicy())
				fmt.Fprintf(out, "running %d%% writes of %d bytes at queue depth %d over %v for %v...\n",
					writePct, bs, qd, &size, duration)
			}
			res, runErr := demo.Run(ctx, demo.LoadConfig{
				Session: sess, Size: int64(size), BlockSize: bs, QueueDepth: qd,
				WritePct: writePct, Duration: duration, IOs: ios, Seed: uint64(time.Now().UnixNano()),
			})
			rep := loadReport{Session: sess.Name(), Policy: sess.MPPolicy().Name(), Result: res, Duration: res.Elapsed.String()}
			if runErr != nil {
				rep.Error = runErr.Error()
			}
			for _, p := range sess.Paths() {
				rep.Paths = append(rep.Paths, pathReport{
					Name: p.Name(), State: p.State().SysfsString(), HCAName: p.HCAName(),
					Rdma: strings.TrimSpace(p.Stats().RDMA()), Reconnects: strings.TrimSpace(p.Stats().Reconnects()),
					CurLatencyNs: int64(p.CurLatency()), Counters: p.Stats().Counters(),
				})
			}
			if jsonOut {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				if err := enc.Encode(rep); err != nil {
					return err
				}
			} else {
				printReport(out, rep)
			}
			if runErr != nil {
				return fmt.Errorf("load failed: %w", runErr)
			}
			if res.Reads+res.Writes == 0 {
				return errors.New("load did no IO")
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&sessname, "sessname", "rtrs-demo", "session name")
	f.StringArrayVar(&paths, "path", nil, "path [src@]dst, e.g. ip:127.0.0.2@ip:127.0.0.1 (repeatable)")
	f.Uint16Var(&port, "dest-port", rtrs.DefaultPort, "server port")
	f.IntVar(&conns, "conns-per-path", 0, "IO connections per path (default: number of CPUs)")
	f.StringVar(&policy, "mpath-policy", "min-inflight", "round-robin, min-inflight or min-latency")
	f.Var(&size, "size", "how much of the server's memory to use (bytes, or K, M, G)")
	f.IntVar(&bs, "bs", 4096, "IO size in bytes")
	f.IntVar(&qd, "qd", 32, "requests in flight")
	f.IntVar(&writePct, "write-pct", 50, "share of writes in percent")
	f.DurationVar(&duration, "duration", 5*time.Second, "how long to run")
	f.Int64Var(&ios, "ios", 0, "stop after this many IOs (0: run for the duration)")
	f.DurationVar(&hb, "hb-interval", rtrs.DefaultHBInterval, "heartbeat interval")
	f.IntVar(&hbMissed, "hb-missed-max", rtrs.DefaultHBMissedMax, "heartbeats missed before a path is dead")
	f.DurationVar(&reconDelay, "reconnect-delay", time.Second, "first reconnect delay")
	f.DurationVar(&reconMax, "reconnect-max-delay", 30*time.Second, "longest reconnect delay")
	f.DurationVar(&connTimeout, "connect-timeout", rtrs.DefaultConnectTimeout, "bound on establishing one path")
	f.BoolVar(&jsonOut, "json", false, "print the report as JSON")
	cmd.MarkFlagRequired("path")
	return cmd
}

func printReport(w io.Writer, r loadReport) {
	res := r.Result
	secs := res.Elapsed.Seconds()
	fmt.Fprintf(w, "done in %v: %d reads (%.1f MiB), %d writes (%.1f MiB), %.0f IOPS, max latency %d us, %d errors, %d verify failures\n",
		res.Elapsed.Round(time.Millisecond), res.Reads, float64(res.BytesRead)/(1<<20), res.Writes,
		float64(res.BytesWritten)/(1<<20), float64(res.Reads+res.Writes)/secs, res.LatencyMaxMicros,
		res.Errors, res.VerifyFailures)
	for _, p := range r.Paths {
		fmt.Fprintf(w, "path %s (%s, %s)\n", p.Name, p.State, p.HCAName)
		fmt.Fprintf(w, "  stats/rdma:       %s   (rd_cnt rd_bytes wr_cnt wr_bytes inflight failover_cnt)\n", p.Rdma)
		fmt.Fprintf(w, "  stats/reconnects: %s   (successful failed)\n", p.Reconnects)
		fmt.Fprintf(w, "  cur_latency:      %d ns\n", p.CurLatencyNs)
	}
	if r.Error != "" {
		fmt.Fprintf(w, "error: %s\n", r.Error)
	}
}
