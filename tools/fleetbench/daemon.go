package main

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/tools/internal/logtail"
)

// daemon is one rnbd-server this tool started, in a directory of its
// own: configuration, control socket, state file, log.
type daemon struct {
	dir  string
	sock string
	cmd  *exec.Cmd
	log  *os.File
	done chan struct{}
	cl   *ctl.Client
}

// startDaemon writes a configuration in dir (listening on a free port of
// 127.0.0.1, with the [[pool]] table poolConf if set) and starts
// rnbd-server daemon on it, with RNBD_CPUPROFILE=profile if set. It
// returns once the control API answers.
func startDaemon(ctx context.Context, srv, dir, poolConf, profile string) (*daemon, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, err
	}
	d := &daemon{dir: dir, sock: filepath.Join(dir, "server.sock"), done: make(chan struct{})}
	port, err := freePort()
	if err != nil {
		return nil, err
	}
	conf := filepath.Join(dir, "server.toml")
	text := fmt.Sprintf("version = 1\nlisten = [\"tcp://127.0.0.1:%d\"]\ncontrol_socket = %q\nstate_file = %q\nlog_level = \"warn\"\n",
		port, d.sock, filepath.Join(dir, "state.json")) + poolConf
	if err := os.WriteFile(conf, []byte(text), 0o600); err != nil {
		return nil, err
	}
	if d.log, err = os.OpenFile(filepath.Join(dir, "server.log"), os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o600); err != nil {
		return nil, err
	}
	d.cmd = exec.Command(srv, "daemon", "--config", conf)
	d.cmd.Stdout, d.cmd.Stderr = d.log, d.log
	d.cmd.Env = os.Environ()
	if profile != "" {
		d.cmd.Env = append(d.cmd.Env, "RNBD_CPUPROFILE="+profile)
	}
	if err := d.cmd.Start(); err != nil {
		d.log.Close()
		return nil, err
	}
	go func() { d.cmd.Wait(); close(d.done) }()
	d.cl = ctl.Dial(d.sock)
	err = waitFor(ctx, 30*time.Second, func() (bool, error) {
		select {
		case <-d.done:
			return false, fmt.Errorf("rnbd-server exited: %s", logtail.Tail(d.log.Name()))
		default:
		}
		return d.do(ctx, api.SrvPools, nil, nil, nil, nil) == nil, nil
	})
	if err != nil {
		d.stop()
		return nil, fmt.Errorf("rnbd-server did not answer on %s: %w", d.sock, err)
	}
	return d, nil
}

func (d *daemon) pid() int { return d.cmd.Process.Pid }

// do is one control API request of route rt, bounded to a minute.
func (d *daemon) do(ctx context.Context, rt api.Route, args []string, q url.Values, body, out any) error {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	return api.Call(ctx, d.cl, rt, args, q, body, out)
}

// stop ends the daemon by its PID: SIGTERM, SIGKILL after 10 s. An
// error says it had exited before, or did not stop by itself.
func (d *daemon) stop() error {
	defer d.log.Close()
	select {
	case <-d.done:
		return fmt.Errorf("rnbd-server had exited: %s", logtail.Tail(d.log.Name()))
	default:
	}
	d.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-d.done:
		return nil
	case <-time.After(10 * time.Second):
		d.cmd.Process.Kill()
		<-d.done
		return errors.New("rnbd-server did not stop within 10 s of SIGTERM: killed")
	}
}

// freePort asks the kernel for a free port on 127.0.0.1.
func freePort() (int, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port, nil
}

// waitFor polls ok every 20 ms until it is true, fails, or limit or ctx
// ends.
func waitFor(ctx context.Context, limit time.Duration, ok func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	t := time.NewTicker(20 * time.Millisecond)
	defer t.Stop()
	for {
		done, err := ok()
		if err != nil || done {
			return err
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-t.C:
		}
	}
}

// pause waits for d or until ctx ends.
func pause(ctx context.Context, d time.Duration) error {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}

// Measures of a process from /proc.

// procMem is a process's resident memory (VmRSS) and its peak (VmHWM)
// in bytes, and its threads.
type procMem struct {
	rss, hwm int64
	threads  int
}

func readMem(pid int) (procMem, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return procMem{}, err
	}
	return parseStatus(string(b))
}

func parseStatus(s string) (procMem, error) {
	var m procMem
	seen := 0
	for _, l := range strings.Split(s, "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		n, err := strconv.ParseInt(f[0], 10, 64)
		if err != nil {
			continue
		}
		switch k {
		case "VmRSS":
			m.rss, seen = n<<10, seen+1
		case "VmHWM":
			m.hwm, seen = n<<10, seen+1
		case "Threads":
			m.threads, seen = int(n), seen+1
		}
	}
	if seen != 3 {
		return m, errors.New("/proc/PID/status: no VmRSS, VmHWM or Threads")
	}
	return m, nil
}

// cpuTicks is the CPU time of pid, user and system (utime + stime of
// /proc/PID/stat), in clock ticks (USER_HZ, 100 on Linux).
func cpuTicks(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseStat(string(b))
}

func parseStat(s string) (int64, error) {
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0, errors.New("/proc/PID/stat: no command field")
	}
	f := strings.Fields(s[i+1:])
	// After the command: state is field 3 of proc(5), utime 14, stime 15.
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/PID/stat: %d fields after the command", len(f))
	}
	var t int64
	for _, k := range []int{11, 12} {
		v, err := strconv.ParseInt(f[k], 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/PID/stat: %w", err)
		}
		t += v
	}
	return t, nil
}

const userHZ = 100

// switches is the context switches of all pid's threads (voluntary and
// not): how often it woke up.
func switches(pid int) (int64, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var n int64
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", pid, t.Name()))
		if err != nil {
			continue // a thread that ended
		}
		for _, l := range strings.Split(string(b), "\n") {
			k, v, _ := strings.Cut(l, ":")
			if k == "voluntary_ctxt_switches" || k == "nonvoluntary_ctxt_switches" {
				x, _ := strconv.ParseInt(strings.TrimSpace(v), 10, 64)
				n += x
			}
		}
	}
	return n, nil
}

// onCPU is the time pid's threads have run, in nanoseconds (the first
// field of each /proc/PID/task/TID/schedstat): finer than cpuTicks, for
// a daemon that hardly runs; a thread that ended takes its time along.
func onCPU(pid int) (int64, error) {
	tasks, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return 0, err
	}
	var n int64
	for _, t := range tasks {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/schedstat", pid, t.Name()))
		if err != nil {
			continue
		}
		f := strings.Fields(string(b))
		if len(f) > 0 {
			x, _ := strconv.ParseInt(f[0], 10, 64)
			n += x
		}
	}
	return n, nil
}

func numCPU() int {
	b, err := os.ReadFile("/sys/devices/system/cpu/online")
	if err != nil {
		return 0
	}
	n := 0
	for _, r := range strings.Split(strings.TrimSpace(string(b)), ",") {
		lo, hi, found := strings.Cut(r, "-")
		a, _ := strconv.Atoi(lo)
		z := a
		if found {
			z, _ = strconv.Atoi(hi)
		}
		n += z - a + 1
	}
	return n
}
