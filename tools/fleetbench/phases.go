package main

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rnbd/rnbd/internal/api"
)

// poolSpec is a -pool: a directory pool ("dir", under path if set), a
// directory pool on an XFS loop mount ("xfs"), or an LVM thin pool.
type poolSpec struct {
	spec     string
	kind     string
	path     string
	vg, thin string
}

func parsePool(s string) (poolSpec, error) {
	p := poolSpec{spec: s}
	kind, arg, _ := strings.Cut(s, ":")
	switch {
	case s == "dir", s == "xfs":
		p.kind = s
	case kind == "dir" && arg != "":
		p.kind, p.path = kind, arg
	case kind == "lvm-thin":
		vg, thin, ok := strings.Cut(arg, "/")
		if !ok || vg == "" || thin == "" || strings.Contains(thin, "/") {
			return p, fmt.Errorf("-pool %s: want lvm-thin:VG/THINPOOL", s)
		}
		p.kind, p.vg, p.thin = kind, vg, thin
	default:
		return p, fmt.Errorf("-pool %s: want dir, dir:PATH, xfs or lvm-thin:VG/THINPOOL", s)
	}
	return p, nil
}

const poolName = "bench"

// setup makes the pool's place under work: the [[pool]] table, the
// directory of a directory pool ("" for LVM), what the table's rows
// call the pool, and what undoes it.
func (p poolSpec) setup(work string, need int64) (conf, dir, label string, undo func() error, err error) {
	undo = func() error { return nil }
	switch p.kind {
	case "dir", "xfs":
		parent := p.path
		if p.kind == "dir" && parent == "" {
			parent = os.TempDir()
		}
		if p.kind == "xfs" {
			if parent, undo, err = mountXFS(work, need); err != nil {
				return "", "", "", nil, err
			}
		}
		if dir, err = os.MkdirTemp(parent, "fleetbench-pool-"); err != nil {
			return "", "", "", nil, errors.Join(err, undo())
		}
		mounted := undo
		undo = func() error { return errors.Join(os.RemoveAll(dir), mounted()) }
		conf = fmt.Sprintf("\n[[pool]]\nname = %q\ntype = \"dir\"\npath = %q\n", poolName, dir)
		label = fmt.Sprintf("dir on %s (%s)", fsType(dir), parent)
		if p.kind == "xfs" {
			label = "dir on xfs (loop mount)"
		}
	case "lvm-thin":
		conf = fmt.Sprintf("\n[[pool]]\nname = %q\ntype = \"lvm-thin\"\nvolume_group = %q\nthin_pool = %q\n", poolName, p.vg, p.thin)
		label = "lvm-thin " + p.vg + "/" + p.thin
	}
	return conf, dir, label, undo, nil
}

// mountXFS makes an XFS file system of at least need bytes on a sparse
// image under work (reflinks on, as test/testfs.ReflinkDir) and mounts
// it by a loop device; undo unmounts it.
func mountXFS(work string, need int64) (string, func() error, error) {
	if os.Geteuid() != 0 {
		return "", nil, errors.New("-pool xfs mounts a loop device: run as root")
	}
	if _, err := exec.LookPath("mkfs.xfs"); err != nil {
		return "", nil, errors.New("mkfs.xfs is missing (make deps installs xfsprogs)")
	}
	img, mnt := filepath.Join(work, "xfs.img"), filepath.Join(work, "xfs")
	if err := os.MkdirAll(mnt, 0o755); err != nil {
		return "", nil, err
	}
	size := max(need+need/8+1<<30, 2<<30)
	for _, c := range [][]string{{"truncate", "-s", fmt.Sprint(size), img}, {"mkfs.xfs", "-q", "-m", "reflink=1", img}, {"mount", "-o", "loop", img, mnt}} {
		if out, err := exec.Command(c[0], c[1:]...).CombinedOutput(); err != nil {
			os.Remove(img)
			return "", nil, fmt.Errorf("%s: %v: %s", strings.Join(c, " "), err, strings.TrimSpace(string(out)))
		}
	}
	return mnt, func() error {
		out, err := exec.Command("umount", mnt).CombinedOutput()
		if err != nil {
			// Lazily if something still holds it; the loop device goes
			// with the last reference.
			exec.Command("umount", "-l", mnt).Run()
			err = fmt.Errorf("umount %s: %v: %s", mnt, err, strings.TrimSpace(string(out)))
		}
		return errors.Join(err, os.Remove(img))
	}, nil
}

// fsType names the file system dir is on.
func fsType(dir string) string {
	var st unix.Statfs_t
	if err := unix.Statfs(dir, &st); err != nil {
		return "?"
	}
	switch st.Type {
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	}
	return fmt.Sprintf("fs 0x%x", st.Type)
}

func volumeName(i int) string { return fmt.Sprintf("fleet-%03d", i) }

// phaseA measures making, granting and deleting c.volumes volumes in
// pool p, c.reps times, on one daemon; then starts the daemon again,
// which adopts whatever its pool still has, and checks it has nothing.
func phaseA(ctx context.Context, c config, srv, work string, p poolSpec, size int64) (rows []row, err error) {
	if err := os.MkdirAll(work, 0o700); err != nil {
		return nil, err
	}
	conf, dir, label, undo, err := p.setup(work, int64(c.volumes)*size)
	if err != nil {
		return nil, err
	}
	defer func() { err = errors.Join(err, undo()) }()
	profile := ""
	if c.cpuprofile != "" {
		profile = c.cpuprofile + "-" + strings.NewReplacer(":", "-", "/", "-").Replace(p.spec) + ".pprof"
	}
	ddir := filepath.Join(work, "daemon")
	d, err := startDaemon(ctx, srv, ddir, conf, profile)
	if err != nil {
		return nil, err
	}
	defer func() {
		if d != nil {
			err = errors.Join(err, d.stop())
		}
	}()
	if err := checkPool(ctx, d); err != nil {
		return nil, err
	}
	if err := checkEmpty(ctx, d, dir); err != nil {
		return nil, fmt.Errorf("before the first repetition: %w (use an empty pool)", err)
	}
	fmt.Fprintf(os.Stderr, "== pool %s: %s\n", p.spec, label)
	for rep := 1; rep <= c.reps; rep++ {
		rs, err := oneRep(ctx, c, d, label, rep, size)
		rows = append(rows, rs...)
		if err == nil {
			err = checkEmpty(ctx, d, dir)
		}
		if err != nil {
			return rows, errors.Join(fmt.Errorf("repetition %d: %w", rep, err), sweep(d, c.volumes))
		}
	}
	// What the pool has, a daemon adopts at start: none after a restart
	// proves the pool itself is empty, whatever its type.
	err = d.stop()
	d = nil
	if err != nil {
		return rows, err
	}
	if d, err = startDaemon(ctx, srv, ddir, conf, ""); err != nil {
		return rows, err
	}
	if err := checkEmpty(ctx, d, dir); err != nil {
		return rows, errors.Join(fmt.Errorf("after a restart: %w", err), sweep(d, c.volumes))
	}
	return rows, nil
}

// checkPool: the pool is served.
func checkPool(ctx context.Context, d *daemon) error {
	var pools []api.PoolRecord
	if err := d.do(ctx, api.SrvPools, nil, nil, nil, &pools); err != nil {
		return err
	}
	for _, p := range pools {
		if p.Name == poolName {
			if p.State != "served" {
				return fmt.Errorf("pool not served: %v", p.Reason)
			}
			return nil
		}
	}
	return fmt.Errorf("the daemon has no pool %s: %v", poolName, pools)
}

// checkEmpty: the daemon has no volume and no export of one, and a
// directory pool's directory holds no file but its own empty working
// directories.
func checkEmpty(ctx context.Context, d *daemon, dir string) error {
	var vols []api.VolumeRecord
	var exps []api.ExportRecord
	if err := d.do(ctx, api.SrvVolumes, nil, nil, nil, &vols); err != nil {
		return err
	}
	if len(vols) > 0 {
		return fmt.Errorf("%d volumes left (%v, …)", len(vols), vols[0].Name)
	}
	if err := d.do(ctx, api.SrvExports, nil, nil, nil, &exps); err != nil {
		return err
	}
	for _, e := range exps {
		if n := e.Name; strings.HasPrefix(n, "fleet-") {
			return fmt.Errorf("export %s left", n)
		}
	}
	if dir == "" {
		return nil
	}
	var left []string
	err := filepath.WalkDir(dir, func(path string, e os.DirEntry, err error) error {
		if err != nil || path == dir {
			return err
		}
		if !e.IsDir() {
			rel, _ := filepath.Rel(dir, path)
			left = append(left, rel)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if len(left) > 0 {
		slices.Sort(left)
		return fmt.Errorf("%d files left in the pool's directory (%s, …)", len(left), left[0])
	}
	return nil
}

// sweep deletes what a failed repetition may have left, forcibly.
func sweep(d *daemon, n int) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	var errs []error
	for i := range n {
		if err := d.do(ctx, api.SrvVolumeDelete, []string{volumeName(i)}, url.Values{"force": {"true"}}, nil, nil); err != nil {
			errs = append(errs, err)
		}
	}
	if len(errs) > 0 {
		return fmt.Errorf("cleaning up: %d deletes failed (%w)", len(errs), errs[0])
	}
	return nil
}

// oneRep makes and grants the volumes one after the other, as an
// orchestrator would, then deletes them.
func oneRep(ctx context.Context, c config, d *daemon, label string, rep int, size int64) ([]row, error) {
	var create, grant, del []time.Duration
	start := time.Now()
	for i := range c.volumes {
		name := volumeName(i)
		t0 := time.Now()
		var resp api.CreatedVolume
		yes := true
		req := api.VolumeRequest{Name: name, Pool: poolName, Size: c.size, Export: api.MapRequest{GrantsOnly: &yes}}
		if err := d.do(ctx, api.SrvVolumeCreate, nil, nil, req, &resp); err != nil {
			return nil, fmt.Errorf("create %s: %w", name, err)
		}
		if !resp.Created {
			return nil, fmt.Errorf("create %s: it was there already", name)
		}
		t1 := time.Now()
		g := api.GrantRequest{Identity: fmt.Sprintf("host-%d", i), Access: "rw"}
		if err := d.do(ctx, api.SrvVolumeGrant, []string{name}, nil, g, nil); err != nil {
			return nil, fmt.Errorf("grant %s: %w", name, err)
		}
		t2 := time.Now()
		create, grant = append(create, t1.Sub(t0)), append(grant, t2.Sub(t1))
	}
	made := time.Since(start)
	// Every volume is there, served, of its size, with its grant.
	var vols []api.VolumeRecord
	if err := d.do(ctx, api.SrvVolumes, nil, nil, nil, &vols); err != nil {
		return nil, err
	}
	if len(vols) != c.volumes {
		return nil, fmt.Errorf("%d volumes listed, %d made", len(vols), c.volumes)
	}
	for _, v := range vols {
		var i int
		fmt.Sscanf(v.Name, "fleet-%d", &i)
		access, _ := v.AllowIdentities.Access(fmt.Sprintf("host-%d", i))
		if v.State != api.VolumeServed || v.Size == nil || *v.Size != size || len(v.AllowIdentities) != 1 || access != "rw" {
			return nil, fmt.Errorf("volume %v: state %v, size %v, grants %v", v.Name, v.State, v.Size, v.AllowIdentities)
		}
	}
	start = time.Now()
	for i := range c.volumes {
		t0 := time.Now()
		if err := d.do(ctx, api.SrvVolumeDelete, []string{volumeName(i)}, nil, nil, nil); err != nil {
			return nil, fmt.Errorf("delete %s: %w", volumeName(i), err)
		}
		del = append(del, time.Since(t0))
	}
	gone := time.Since(start)
	r := func(metric string, v float64) row { return row{subject: label, rep: rep, metric: metric, value: v} }
	rows := []row{
		r("create_grant_total_s", made.Seconds()),
		r("create_p50_ms", ms(percentile(create, 50))), r("create_p99_ms", ms(percentile(create, 99))),
		r("grant_p50_ms", ms(percentile(grant, 50))), r("grant_p99_ms", ms(percentile(grant, 99))),
		r("delete_total_s", gone.Seconds()),
		r("delete_p50_ms", ms(percentile(del, 50))), r("delete_p99_ms", ms(percentile(del, 99))),
	}
	fmt.Fprintf(os.Stderr, "   rep %d: %d create+grant %.2f s (create p50 %.1f ms, grant p50 %.1f ms), delete %.2f s (p50 %.1f ms)\n",
		rep, c.volumes, made.Seconds(), ms(percentile(create, 50)), ms(percentile(grant, 50)), gone.Seconds(), ms(percentile(del, 50)))
	return rows, nil
}

// phaseB measures the daemon idle with no export, maps c.exports, and
// measures it idle again; then the time a start takes with them in the
// state file.
func phaseB(ctx context.Context, c config, srv, work string, size int64) (rows []row, err error) {
	files := filepath.Join(work, "files")
	if err := os.MkdirAll(files, 0o700); err != nil {
		return nil, err
	}
	for i := range c.exports {
		f, err := os.Create(filepath.Join(files, exportName(i)+".img"))
		if err == nil {
			err = errors.Join(f.Truncate(size), f.Close())
		}
		if err != nil {
			return nil, err
		}
	}
	profile := ""
	if c.cpuprofile != "" {
		profile = c.cpuprofile + "-exports.pprof"
	}
	ddir := filepath.Join(work, "daemon")
	d, err := startDaemon(ctx, srv, ddir, "", profile)
	if err != nil {
		return nil, err
	}
	defer func() {
		if d != nil {
			err = errors.Join(err, d.stop())
		}
	}()
	fmt.Fprintf(os.Stderr, "== exports: idle with none, %s\n", c.idle)
	zero := "exports=0"
	rs, err := measureIdle(ctx, c, d, zero)
	rows = append(rows, rs...)
	if err != nil {
		return rows, err
	}
	many := fmt.Sprintf("exports=%d", c.exports)
	fmt.Fprintf(os.Stderr, "== exports: mapping %d\n", c.exports)
	var lat []time.Duration
	start := time.Now()
	for i := range c.exports {
		t0 := time.Now()
		req := api.MapRequest{Name: exportName(i), Path: filepath.Join(files, exportName(i)+".img")}
		if err := d.do(ctx, api.SrvExportMap, nil, nil, req, nil); err != nil {
			return rows, fmt.Errorf("map %s: %w", req.Name, err)
		}
		lat = append(lat, time.Since(t0))
	}
	mapped := time.Since(start)
	if err := checkServed(ctx, d, c.exports); err != nil {
		return rows, err
	}
	r := func(metric string, v float64) row { return row{subject: many, rep: 1, metric: metric, value: v} }
	rows = append(rows, r("map_total_s", mapped.Seconds()), r("map_p50_ms", ms(percentile(lat, 50))), r("map_p99_ms", ms(percentile(lat, 99))))
	fmt.Fprintf(os.Stderr, "   mapped in %.2f s (p50 %.1f ms, p99 %.1f ms); idle, %s\n", mapped.Seconds(), ms(percentile(lat, 50)), ms(percentile(lat, 99)), c.idle)
	rs, err = measureIdle(ctx, c, d, many)
	rows = append(rows, rs...)
	if err != nil {
		return rows, err
	}
	// A start that restores them from the state file: until all are
	// listed served.
	err = d.stop()
	d = nil
	if err != nil {
		return rows, err
	}
	start = time.Now()
	if d, err = startDaemon(ctx, srv, ddir, "", ""); err != nil {
		return rows, err
	}
	first, err := servedCount(ctx, d)
	if err != nil {
		return rows, err
	}
	rows = append(rows, r("restart_served_first", float64(first)), r("restart_answer_s", time.Since(start).Seconds()))
	fmt.Fprintf(os.Stderr, "   restarted: control API answers in %.2f s with %d of %d served; waiting (up to %s) for all\n",
		time.Since(start).Seconds(), first, c.exports, restoreWait)
	err = waitFor(ctx, restoreWait, func() (bool, error) { return checkServed(ctx, d, c.exports) == nil, nil })
	if err != nil {
		return rows, fmt.Errorf("%s after a restart: %w", time.Since(start).Round(time.Second), checkServed(ctx, d, c.exports))
	}
	rows = append(rows, r("restart_s", time.Since(start).Seconds()))
	if err := pause(ctx, c.settle); err != nil {
		return rows, err
	}
	m, err := readMem(d.pid())
	if err != nil {
		return rows, err
	}
	rows = append(rows, r("rss_restarted_mib", mib(m.rss)))
	fmt.Fprintf(os.Stderr, "   restarted with them in %.2f s, VmRSS %.1f MiB\n", rows[len(rows)-2].value, mib(m.rss))
	return rows, nil
}

func exportName(i int) string { return fmt.Sprintf("exp-%04d", i) }

// restoreWait bounds the wait for a restarted daemon to serve every
// export of its state file (those it could not at start it tries again
// every export_retry, 10 s).
const restoreWait = 5 * time.Minute

// servedCount is the number of exports listed served.
func servedCount(ctx context.Context, d *daemon) (int, error) {
	var exps []api.ExportRecord
	if err := d.do(ctx, api.SrvExports, nil, nil, nil, &exps); err != nil {
		return 0, err
	}
	n := 0
	for _, e := range exps {
		if e.NotServed == "" {
			n++
		}
	}
	return n, nil
}

// checkServed: n exports listed, all served.
func checkServed(ctx context.Context, d *daemon, n int) error {
	var exps []api.ExportRecord
	if err := d.do(ctx, api.SrvExports, nil, nil, nil, &exps); err != nil {
		return err
	}
	if len(exps) != n {
		return fmt.Errorf("%d exports listed, want %d", len(exps), n)
	}
	for _, e := range exps {
		if ns := e.NotServed; ns != "" {
			return fmt.Errorf("export %v not served: %s", e.Name, ns)
		}
	}
	return nil
}

// measureIdle waits c.settle, then measures the daemon's CPU and wakeups
// over c.idle and its memory at the end.
func measureIdle(ctx context.Context, c config, d *daemon, subject string) ([]row, error) {
	if err := pause(ctx, c.settle); err != nil {
		return nil, err
	}
	t0, err := cpuTicks(d.pid())
	if err != nil {
		return nil, err
	}
	s0, err := switches(d.pid())
	if err != nil {
		return nil, err
	}
	n0, err := onCPU(d.pid())
	if err != nil {
		return nil, err
	}
	start := time.Now()
	if err := pause(ctx, c.idle); err != nil {
		return nil, err
	}
	t1, err := cpuTicks(d.pid())
	if err != nil {
		return nil, err
	}
	s1, err := switches(d.pid())
	if err != nil {
		return nil, err
	}
	n1, err := onCPU(d.pid())
	if err != nil {
		return nil, err
	}
	el := time.Since(start).Seconds()
	m, err := readMem(d.pid())
	if err != nil {
		return nil, err
	}
	cpuMS := float64(t1-t0) * 1000 / userHZ
	r := func(metric string, v float64) row { return row{subject: subject, rep: 1, metric: metric, value: v} }
	rows := []row{
		r("rss_mib", mib(m.rss)), r("hwm_mib", mib(m.hwm)), r("threads", float64(m.threads)),
		r("idle_cpu_ms_per_s", cpuMS/el), r("idle_cpu_pct", cpuMS/el/10),
		r("idle_oncpu_us_per_s", float64(n1-n0)/1000/el), r("idle_wakeups_per_s", float64(s1-s0)/el),
	}
	fmt.Fprintf(os.Stderr, "   %s: VmRSS %.1f MiB, VmHWM %.1f MiB, %d threads; idle %.2f ms CPU/s (%.1f µs/s on CPU), %.1f wakeups/s\n",
		subject, mib(m.rss), mib(m.hwm), m.threads, cpuMS/el, float64(n1-n0)/1000/el, float64(s1-s0)/el)
	return rows, nil
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
func mib(n int64) float64        { return float64(n) / (1 << 20) }
