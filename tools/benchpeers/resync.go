package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/rnbd/rnbd/tools/internal/logtail"
)

// measureResync is the mirror's resync (docs/replication.md, "Resync
// while mapped") with its figures: a leg whose storage node is killed
// and started again resyncs from the bitmap what it missed; one that
// comes back as a new, empty device is rebuilt in full, at the client's
// resync rate, while fio runs workload w through the mirror. It prints
// the bytes copied, the time and the rate of each, and w's IOPS during
// the rebuild against before it.
func measureResync(ctx context.Context, c config, w string) (string, error) {
	if _, ok := workloads[w]; !ok || w == "verify" {
		return "", fmt.Errorf("unknown workload %q (have %s; not verify)", w, strings.Join(workloadNames(), ", "))
	}
	dir, err := os.MkdirTemp("", "benchpeers-resync-")
	if err != nil {
		return "", err
	}
	defer os.RemoveAll(dir)
	img, err := makeImage(c.sizeMB)
	if err != nil {
		return "", err
	}
	defer os.Remove(img)
	for _, leg := range []string{".leg0", ".leg1"} {
		defer os.Remove(img + leg)
	}
	p, err := newPeer("rnbd-mirror/unix", c, img, filepath.Join(dir, "peer"))
	if err != nil {
		return "", err
	}
	if err := p.start(ctx, c); err != nil {
		p.stop()
		return "", err
	}
	defer p.stop()
	clt := []string{filepath.Join(c.bin, "rnbd-client"), "--socket", filepath.Join(p.dir, "c.sock")}
	var out strings.Builder
	fmt.Fprintf(&out, "mirror of two legs of %d MiB on rnbd-servers on loopback, %s; fio %s (%s runs)\n", c.sizeMB, img, w, c.runtime)
	if c.pin {
		fmt.Fprintf(&out, "pinned: fio and the client on CPUs %s, the servers on CPUs %s\n", c.cpus("client"), c.cpus("server"))
	}

	before, err := runFio(ctx, p, w, c)
	if err != nil || before.err != "" {
		return "", fmt.Errorf("fio before: %v %s", err, before.err)
	}
	fmt.Fprintf(&out, "before: %s %.0f IOPS\n", w, before.iops)

	srv := p.daemons[1] // the second leg's server
	for _, kind := range []string{"bitmap", "full"} {
		if err := srv.cmd.Process.Kill(); err != nil {
			return "", err
		}
		srv.cmd.Wait()
		leg := img + ".leg1"
		if kind == "bitmap" {
			// What the leg misses: 64 MiB written in 1 MiB blocks at
			// random (the first write waits for the leg's timeout).
			if err := command(ctx, "fio", "--name=miss", "--ioengine=nbd", "--uri="+p.uri, "--rw=randwrite", "--bs=1m",
				"--io_size=64m", "--iodepth=8", "--randrepeat=0", "--output=/dev/null"); err != nil {
				return "", err
			}
		} else {
			// A new device in its place: empty, no superblock.
			if err := os.Truncate(leg, 0); err != nil {
				return "", err
			}
			if err := os.Truncate(leg, int64(c.sizeMB)<<20); err != nil {
				return "", err
			}
		}
		srv.cmd = c.command(srv.role, srv.args...)
		srv.cmd.Stdout, srv.cmd.Stderr = srv.log, srv.log
		if err := srv.cmd.Start(); err != nil {
			return "", err
		}
		// The client's rejoiner dials the leg within 5 s.
		var started time.Time
		if err := waitFor(ctx, func() bool {
			st, _, err := legState(ctx, clt)
			if err == nil && st == "resyncing" {
				started = time.Now()
				return true
			}
			return false
		}); err != nil {
			st, _, serr := legState(context.Background(), clt)
			return "", fmt.Errorf("%s resync: not started (leg %q %v): %w; client log: %s", kind, st, serr, err, logtail.Tail(p.daemons[2].log.Name()))
		}
		var during row
		fioDone := make(chan error, 1)
		if kind == "full" {
			go func() {
				var err error
				if during, err = runFio(ctx, p, w, c); err == nil && during.err != "" {
					err = errors.New(during.err)
				}
				fioDone <- err
			}()
		} else {
			fioDone <- nil
		}
		var total int64
		if err := waitFor(ctx, func() bool {
			st, t, err := legState(ctx, clt)
			if t > 0 {
				total = t
			}
			return err == nil && st == "in sync"
		}); err != nil {
			return "", fmt.Errorf("%s resync: not done: %w", kind, err)
		}
		took := time.Since(started)
		if err := <-fioDone; err != nil {
			return "", fmt.Errorf("fio during the rebuild: %w", err)
		}
		fmt.Fprintf(&out, "%s resync: %d MiB of %d copied in %.2f s: %.0f MiB/s\n", kind, total>>20, c.sizeMB, took.Seconds(),
			float64(total)/(1<<20)/took.Seconds())
		if kind == "full" {
			fmt.Fprintf(&out, "during the rebuild: %s %.0f IOPS, %.2f of before (the first %s of it)\n", w, during.iops,
				during.iops/before.iops, c.runtime+c.ramp)
		}
	}
	return out.String(), nil
}

// legState is the second leg's state in the mirror's device record, and
// the bytes its resync copies (0 when none runs).
func legState(ctx context.Context, clt []string) (string, int64, error) {
	b, err := exec.CommandContext(ctx, clt[0], append(clt[1:], "device", "show", "rnbd0", "--format", "json", "--fields", "all")...).Output()
	if err != nil {
		return "", 0, err
	}
	var recs []struct {
		Legs []struct {
			State string `json:"state"`
			Total int64  `json:"resync_total_bytes"`
		} `json:"legs"`
	}
	if err := json.Unmarshal(b, &recs); err != nil || len(recs) != 1 || len(recs[0].Legs) < 2 {
		return "", 0, fmt.Errorf("device show: %v: %s", err, b)
	}
	l := recs[0].Legs[1]
	return l.State, l.Total, nil
}
