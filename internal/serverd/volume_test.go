package serverd

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/internal/api"
	"github.com/rnbd/rnbd/internal/ctl"
	"github.com/rnbd/rnbd/internal/pool"
	"github.com/rnbd/rnbd/pkg/log"
	"github.com/rnbd/rnbd/test/kit"
	"github.com/rnbd/rnbd/test/testfs"
)

// slowPool is a pool whose Create, Delete, List, Capacity and
// CreateSnapshot take delay longer than the pool it wraps, as lvm2's
// commands take seconds. It is a fake at the component interface
// (pool.Pool) around a real Dir pool: the daemon above it, its API and
// its state file are the real ones; only the pool's time is made up. It
// counts the slow calls under way.
type slowPool struct {
	pool.Pool
	delay    atomic.Int64                  // nanoseconds
	hold     atomic.Pointer[chan struct{}] // if set, a slow call also waits for it to close
	under    atomic.Int32                  // slow calls under way
	creating atomic.Int32                  // of which Creates
	maxMade  atomic.Int32                  // the most Creates under way at once
	made     atomic.Int32                  // Creates that made a volume
	failList atomic.Bool                   // List fails, as an lvs that does
}

func (p *slowPool) slow(create bool) func() {
	p.under.Add(1)
	if create {
		n := p.creating.Add(1)
		for m := p.maxMade.Load(); n > m && !p.maxMade.CompareAndSwap(m, n); m = p.maxMade.Load() {
		}
	}
	time.Sleep(time.Duration(p.delay.Load())) // the fake's whole point: a pool command's time
	if h := p.hold.Load(); h != nil {
		<-*h
	}
	return func() {
		if create {
			p.creating.Add(-1)
		}
		p.under.Add(-1)
	}
}

func (p *slowPool) Create(s pool.Spec) (pool.Volume, bool, error) {
	defer p.slow(true)()
	v, made, err := p.Pool.Create(s)
	if made {
		p.made.Add(1)
	}
	return v, made, err
}

func (p *slowPool) Delete(name string) error {
	defer p.slow(false)()
	return p.Pool.Delete(name)
}

func (p *slowPool) List() ([]pool.Volume, error) {
	defer p.slow(false)()
	if p.failList.Load() {
		return nil, errors.New("lvs: volume group not found")
	}
	return p.Pool.List()
}

func (p *slowPool) Capacity() (pool.Capacity, error) {
	defer p.slow(false)()
	return p.Pool.Capacity()
}

func (p *slowPool) CreateSnapshot(volume, name string, labels map[string]string) (pool.Snapshot, bool, error) {
	defer p.slow(false)()
	return p.Pool.CreateSnapshot(volume, name, labels)
}

// slowDaemon is a daemon whose pools are slowPools (delay 0 until a
// test sets it), and clients of its control socket.
type slowDaemon struct {
	*Daemon
	pools map[string]*slowPool
	srv   *api.Server
	c     *ctl.Client
}

// startSlowPools starts a daemon with a slowPool on each directory of
// dirs, by pool name.
func startSlowPools(t *testing.T, dirs map[string]string) slowDaemon {
	t.Helper()
	dir := t.TempDir()
	cfg := DefaultConfig()
	cfg.Listen = []string{"tcp://127.0.0.1:0"}
	cfg.ControlSocket = filepath.Join(dir, "s.sock")
	cfg.StateFile = filepath.Join(dir, "s.json")
	sd := slowDaemon{pools: map[string]*slowPool{}}
	for _, name := range slices.Sorted(maps.Keys(dirs)) {
		cfg.Pools = append(cfg.Pools, PoolConfig{Name: name, Type: "dir", Path: dirs[name]})
		sd.pools[name] = &slowPool{}
	}
	lg, _ := kit.LogRecorder()
	d, err := Start(cfg, Options{Log: lg, OpenPool: func(c PoolConfig) (pool.Pool, []string, error) {
		p, cleaned, err := pool.OpenDir(c.Name, c.Path, pool.DirOptions{})
		if err != nil {
			return nil, nil, err
		}
		sd.pools[c.Name].Pool = p
		return sd.pools[c.Name], cleaned, nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { d.Stop() })
	sd.Daemon, sd.c = d, ctl.Dial(cfg.ControlSocket)
	t.Cleanup(sd.c.Close)
	sd.srv = api.NewServer(sd.c)
	return sd
}

// TestSlowPoolHoldsNoMap: while volume creates, deletes and lists wait
// for a slow pool (2 s a command, as lvm2 may take), maps and unmaps of
// a plain file, and the reads that need no pool command, answer at
// once: the daemon's state lock is not held across a pool command. The
// creates of different names run in the pool at once. (The pool's
// commands also wait until the maps and reads are done, so that these
// always run while the pool works, however slow the machine.)
func TestSlowPoolHoldsNoMap(t *testing.T) {
	const (
		delay = 2 * time.Second
		bound = delay / 4 // a map's answer (a save of the state file: an fsync); loose on a busy machine
	)
	sd := startSlowPools(t, map[string]string{"slow": t.TempDir()})
	sp, srv, c := sd.pools["slow"], sd.srv, sd.c
	ctx := context.Background()
	vol := func(name string) api.VolumeRequest {
		return api.VolumeRequest{Name: name, Pool: "slow", Size: "1MiB"}
	}
	for _, n := range []string{"old-0", "old-1", "shown"} {
		if _, err := srv.CreateVolume(ctx, vol(n)); err != nil {
			t.Fatal(err)
		}
	}
	file := filepath.Join(t.TempDir(), "plain.img")
	kit.SparseFile(t, file, 1<<20)
	sp.delay.Store(int64(delay))
	hold := make(chan struct{})
	sp.hold.Store(&hold)

	// The slow work: 4 creates, 2 deletes, 2 volume lists, a pool list.
	var wg sync.WaitGroup
	errs := make(chan error, 16)
	var slowest atomic.Int64
	slow := func(what string, f func() error) {
		wg.Go(func() {
			t0 := time.Now()
			if err := f(); err != nil {
				errs <- fmt.Errorf("%s: %w", what, err)
			}
			for d := int64(time.Since(t0)); d > slowest.Load(); {
				if slowest.CompareAndSwap(slowest.Load(), d) {
					break
				}
			}
		})
	}
	began := time.Now()
	for i := range 4 {
		n := fmt.Sprintf("new-%d", i)
		slow("create "+n, func() error {
			r, err := srv.CreateVolume(ctx, vol(n))
			if err == nil && (!r.Created || r.Record.State != api.VolumeServed) {
				err = fmt.Errorf("answered %+v, want made and served", r)
			}
			return err
		})
	}
	for i := range 2 {
		n := fmt.Sprintf("old-%d", i)
		slow("delete "+n, func() error {
			if ok, err := srv.DeleteVolume(ctx, n, false); err != nil || !ok {
				return fmt.Errorf("deleted %v, %v", ok, err)
			}
			return nil
		})
		slow("volume list", func() error { _, err := srv.Volumes(ctx); return err })
	}
	slow("pool list", func() error { _, err := srv.Pools(ctx); return err })
	kit.WaitFor(t, 10*time.Second, "a create in the pool", func() bool { return sp.creating.Load() > 0 })

	// Meanwhile: maps and unmaps of a plain file, and reads, each given
	// up after 2 delays. The first over the bound ends them: behind a
	// pool that holds its commands until they end, the rest would only
	// wait as long.
	timed := func(what string, f func(context.Context) error) time.Duration {
		ctx, cancel := context.WithTimeout(ctx, 2*delay)
		defer cancel()
		t0 := time.Now()
		if err := f(ctx); err != nil {
			t.Errorf("%s: %v", what, err)
		}
		return time.Since(t0)
	}
	var took []time.Duration
	for i := 0; i < 20 && slices.Max(append(took, 0)) <= bound; i++ {
		name := fmt.Sprintf("plain-%d", i)
		took = append(took, timed("map "+name, func(ctx context.Context) error {
			return api.Call(ctx, c, api.SrvExportMap, nil, nil, api.MapRequest{Name: name, Path: file}, nil)
		}))
		took = append(took, timed("unmap "+name, func(ctx context.Context) error {
			return api.Call(ctx, c, api.SrvExportUnmap, []string{name}, nil, nil, nil)
		}))
	}
	var reads []time.Duration
	for i := 0; i < 5 && slices.Max(append(reads, 0)) <= bound; i++ {
		reads = append(reads, timed("volume show", func(ctx context.Context) error {
			r, err := srv.Volume(ctx, "shown")
			if err == nil && r.State != api.VolumeServed {
				err = fmt.Errorf("state %s", r.State)
			}
			return err
		}))
		reads = append(reads, timed("export list", func(ctx context.Context) error {
			var recs []api.ExportRecord
			return api.Call(ctx, c, api.SrvExports, nil, nil, nil, &recs)
		}))
	}
	under := sp.under.Load()
	close(hold)
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
	all := time.Since(began)
	t.Logf("pool commands of %v: 4 creates, 2 deletes, 2 volume lists and a pool list took %v in all (the slowest %v), "+
		"at most %d creates in the pool at once; %d maps and unmaps: the slowest %v, the median %v; %d reads: the slowest %v",
		delay, all.Round(time.Millisecond), time.Duration(slowest.Load()).Round(time.Millisecond), sp.maxMade.Load(), len(took),
		slices.Max(took).Round(time.Microsecond), median(took).Round(time.Microsecond), len(reads), slices.Max(reads).Round(time.Microsecond))
	if m := slices.Max(took); m > bound {
		t.Errorf("a map or unmap took %v while the pool was slow, want under %v: it waited for a pool command", m, bound)
	}
	if m := slices.Max(reads); m > bound {
		t.Errorf("a read took %v while the pool was slow, want under %v: it waited for a pool command", m, bound)
	}
	if under == 0 && !t.Failed() {
		t.Fatalf("the maps and reads outlasted the pool's commands: they tested nothing (make the delay longer)")
	}
	if sp.maxMade.Load() < 2 {
		t.Errorf("at most %d creates were in the pool at once: creates of different names waited for each other", sp.maxMade.Load())
	}
	sp.delay.Store(0)
	vs, err := srv.Volumes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, v := range vs {
		names = append(names, v.Name)
	}
	if want := []string{"new-0", "new-1", "new-2", "new-3", "shown"}; !slices.Equal(names, want) {
		t.Errorf("volumes %v, want %v", names, want)
	}
}

func median(ds []time.Duration) time.Duration {
	s := slices.Clone(ds)
	slices.Sort(s)
	return s[len(s)/2]
}

// TestSameNameOneAtATime: changes of one volume name wait for each
// other. Identical creates sent at once (a caller's retries) all answer
// the one volume, made once; a delete sent while a create of its name is
// under way waits for it and then deletes what it made; and one that
// waits longer than the bound is refused busy, saying what it waited
// for, with nothing changed.
func TestSameNameOneAtATime(t *testing.T) {
	sd := startSlowPools(t, map[string]string{"slow": t.TempDir()})
	sp, srv := sd.pools["slow"], sd.srv
	ctx := context.Background()
	sp.delay.Store(int64(300 * time.Millisecond))
	req := api.VolumeRequest{Name: "same", Pool: "slow", Size: "1MiB"}

	var wg sync.WaitGroup
	answers := make(chan api.CreatedVolume, 3)
	for range 3 {
		wg.Go(func() {
			r, err := srv.CreateVolume(ctx, req)
			if err != nil {
				t.Errorf("a create sent at once with others of its name: %v", err)
			}
			answers <- r
		})
	}
	wg.Wait()
	close(answers)
	made := 0
	for r := range answers {
		if r.Created {
			made++
		}
		if r.Record.Name != "same" || r.Record.State != api.VolumeServed {
			t.Errorf("answered %+v", r.Record)
		}
	}
	if made != 1 || sp.made.Load() != 1 || sp.maxMade.Load() != 1 {
		t.Errorf("3 identical creates: %d said created, the pool made %d, at most %d in the pool at once; want 1, 1, 1",
			made, sp.made.Load(), sp.maxMade.Load())
	}

	// A delete behind a create of its name: it waits, then deletes.
	created := make(chan error, 1)
	go func() {
		_, err := srv.CreateVolume(ctx, api.VolumeRequest{Name: "next", Pool: "slow", Size: "1MiB"})
		created <- err
	}()
	kit.WaitFor(t, 10*time.Second, "the create in the pool", func() bool { return sp.creating.Load() == 1 })
	if ok, err := srv.DeleteVolume(ctx, "next", false); err != nil || !ok {
		t.Fatalf("a delete behind the create of its name: deleted %v, %v; want it to wait and delete", ok, err)
	}
	if err := <-created; err != nil {
		t.Fatal(err)
	}
	if _, err := srv.Volume(ctx, "next"); ctl.Classify(err) != ctl.CodeNotFound {
		t.Fatalf("volume next after its delete: %v", err)
	}
	if _, err := sp.Pool.Get("next"); !errors.Is(err, syscall.ENOENT) {
		t.Fatalf("the pool has volume next after its delete: %v", err)
	}

	// Waiting longer than the bound: busy, naming the change waited for.
	sd.nameWait = 50 * time.Millisecond // (only read by the requests below)
	sp.delay.Store(int64(time.Second))
	go func() {
		_, err := srv.CreateVolume(ctx, api.VolumeRequest{Name: "late", Pool: "slow", Size: "1MiB"})
		created <- err
	}()
	kit.WaitFor(t, 10*time.Second, "the create in the pool", func() bool { return sp.creating.Load() == 1 })
	_, err := srv.DeleteVolume(ctx, "late", false)
	if ctl.Classify(err) != ctl.CodeBusy || !strings.Contains(err.Error(), "volume late: a create under way") {
		t.Fatalf("a delete that waited past the bound: %v, want busy naming the create", err)
	}
	if err := <-created; err != nil {
		t.Fatal(err)
	}
	if r, err := srv.Volume(ctx, "late"); err != nil || r.State != api.VolumeServed {
		t.Fatalf("the volume whose delete was refused busy: %+v, %v", r, err)
	}
}

// TestSnapshotNamesAcrossPools: snapshot names are the node's. Two
// snapshots of one name taken at once of volumes in two pools: one is
// taken, the other refused already_exists naming the pool that has it —
// the name is held across the look at the other pools and the taking.
// (Clones and snapshots need reflinks: an XFS mount, as root.)
func TestSnapshotNamesAcrossPools(t *testing.T) {
	base := testfs.ReflinkDir(t)
	dirs := map[string]string{"a": filepath.Join(base, "a"), "b": filepath.Join(base, "b")}
	for _, d := range dirs {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	sd := startSlowPools(t, dirs)
	ctx := context.Background()
	for _, p := range []string{"a", "b"} {
		if _, err := sd.srv.CreateVolume(ctx, api.VolumeRequest{Name: "v" + p, Pool: p, Size: "1MiB"}); err != nil {
			t.Fatal(err)
		}
		sd.pools[p].delay.Store(int64(300 * time.Millisecond))
	}
	var wg sync.WaitGroup
	errs := make(chan error, 2)
	for _, p := range []string{"a", "b"} {
		wg.Go(func() {
			_, err := sd.srv.CreateSnapshot(ctx, api.SnapshotRequest{Name: "s", Volume: "v" + p})
			errs <- err
		})
	}
	wg.Wait()
	close(errs)
	var refused []error
	for err := range errs {
		if err != nil {
			refused = append(refused, err)
		}
	}
	if len(refused) != 1 || ctl.Classify(refused[0]) != ctl.CodeExists || !strings.Contains(refused[0].Error(), "snapshot s exists in pool") {
		t.Fatalf("two snapshots s at once in two pools: refused %v; want one already_exists", refused)
	}
	if ss, err := sd.srv.Snapshots(ctx, ""); err != nil || len(ss) != 1 {
		t.Fatalf("snapshots %+v, %v; want one", ss, err)
	}
}

// TestPoolRetry: a pool whose directory is missing at start is not
// served, nor are its volumes; it is tried again every export_retry,
// and when its directory is back it is served without a restart: its
// volumes of the state file are served again (with their grants), one
// the pool has that the state file does not is adopted, each logged as
// at start, and new volumes are made in it.
func TestPoolRetry(t *testing.T) {
	dir, base := t.TempDir(), t.TempDir()
	pdir := filepath.Join(base, "pool")
	if err := os.Mkdir(pdir, 0o755); err != nil {
		t.Fatal(err)
	}
	cfg := DefaultConfig()
	cfg.Listen = []string{"tcp://127.0.0.1:0"}
	cfg.ControlSocket = filepath.Join(dir, "s.sock")
	cfg.StateFile = filepath.Join(dir, "s.json")
	cfg.ExportRetry = Duration{Duration: 100 * time.Millisecond}
	cfg.Pools = []PoolConfig{{Name: "late", Type: "dir", Path: pdir}}
	ctx := context.Background()

	// A volume made and granted, then the daemon stopped.
	d, err := Start(cfg, Options{Log: discard()})
	if err != nil {
		t.Fatal(err)
	}
	c := ctl.Dial(cfg.ControlSocket)
	defer c.Close()
	srv := api.NewServer(c)
	if _, err := srv.CreateVolume(ctx, api.VolumeRequest{Name: "v1", Pool: "late", Size: "1MiB"}); err != nil {
		t.Fatal(err)
	}
	if err := srv.GrantVolume(ctx, "v1", api.GrantRequest{Identity: "host7", Access: "ro"}); err != nil {
		t.Fatal(err)
	}
	d.Stop()

	// Started with the directory gone: the pool and v1 not served.
	moved := filepath.Join(base, "away")
	if err := os.Rename(pdir, moved); err != nil {
		t.Fatal(err)
	}
	lg, logged := kit.LogRecorder()
	d, err = Start(cfg, Options{Log: lg})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	ps, err := srv.Pools(ctx)
	if err != nil || len(ps) != 1 || ps[0].State != "not served" || !strings.Contains(ps[0].Reason, pdir) {
		t.Fatalf("pool list with the directory missing: %+v, %v", ps, err)
	}
	if r, err := srv.Volume(ctx, "v1"); err != nil || r.State != api.VolumeNotServed || !strings.Contains(r.Reason, "pool late is not served") {
		t.Fatalf("v1 with its pool missing: %+v, %v", r, err)
	}
	if _, err := srv.CreateVolume(ctx, api.VolumeRequest{Name: "v2", Pool: "late", Size: "1MiB"}); ctl.Classify(err) != ctl.CodeUnavailable {
		t.Fatalf("a create in the pool not served: %v, want unavailable", err)
	}

	// Meanwhile a file mapped under a name the pool will have too.
	plain := filepath.Join(base, "plain.img")
	kit.SparseFile(t, plain, 1<<20)
	if err := api.Call(ctx, c, api.SrvExportMap, nil, nil, api.MapRequest{Name: "clash", Path: plain}, nil); err != nil {
		t.Fatal(err)
	}

	// Back, with volumes the state file does not know: one adopted, one
	// not (an export has its name).
	p, _, err := pool.OpenDir("late", moved, pool.DirOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, n := range []string{"stray", "clash"} {
		if _, _, err := p.Create(pool.Spec{Name: n, Size: 1 << 20}); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Rename(moved, pdir); err != nil {
		t.Fatal(err)
	}
	kit.WaitFor(t, 10*time.Second, "the pool served", func() bool {
		ps, err := srv.Pools(ctx)
		return err == nil && len(ps) == 1 && ps[0].State == "served"
	})
	vs, err := srv.Volumes(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(vs) != 2 || vs[0].Name != "stray" || vs[1].Name != "v1" {
		t.Fatalf("volumes once the pool is served: %+v", vs)
	}
	for _, v := range vs {
		if v.State != api.VolumeServed || v.Path != filepath.Join(pdir, v.Name+".img") || !v.GrantsOnly {
			t.Errorf("volume %s once its pool is served: %+v", v.Name, v)
		}
	}
	if g := vs[1].AllowIdentities; len(g) != 1 || g[0].Identity != "host7" || g[0].Access != "ro" {
		t.Errorf("v1's grants once its pool is served: %v", g)
	}
	if _, err := srv.CreateVolume(ctx, api.VolumeRequest{Name: "v2", Pool: "late", Size: "1MiB"}); err != nil {
		t.Fatalf("a create in the pool served again: %v", err)
	}
	var said []string
	for _, e := range logged() {
		if e.Data["pool"] == "late" {
			said = append(said, e.Message)
		}
	}
	for _, want := range []string{"pool not served: its volumes are not served until it is (tried again every 100ms)",
		"volume adopted: its pool has it and the state file did not; exported with no grant (give one to open it)",
		"a volume of the pool has the name of an export that is not a volume: not adopted, not served", "pool served now"} {
		if !slices.Contains(said, want) {
			t.Errorf("not logged: %q (logged of the pool: %q)", want, said)
		}
	}
	// The state file has them as served: a restart serves them at once;
	// and the mapped file is still an export, not a volume.
	d.Stop()
	d, err = Start(cfg, Options{Log: discard()})
	if err != nil {
		t.Fatal(err)
	}
	defer d.Stop()
	if vs, err := srv.Volumes(ctx); err != nil || len(vs) != 3 {
		t.Fatalf("volumes after a restart: %+v, %v", vs, err)
	}
	var es []api.ExportRecord
	if err := api.Call(ctx, c, api.SrvExport, []string{"clash"}, nil, nil, &es); err != nil || len(es) != 1 || es[0].Source != "map" || es[0].Path != plain {
		t.Fatalf("export clash after a restart: %+v, %v; want the file mapped", es, err)
	}
}

// discard is a log entry that keeps nothing.
func discard() *log.Entry {
	lg, _ := kit.LogRecorder()
	return lg
}

// TestCreatingShowsItsLabels: a volume whose create is under way (its
// pool still making it) is shown with the labels the create asked for,
// so a caller that looks for its name meanwhile (rnbd-csi's retry)
// sees whose it is, not a volume of no one; a pool that cannot say
// what it has is an error, not records without its labels.
func TestCreatingShowsItsLabels(t *testing.T) {
	sd := startSlowPools(t, map[string]string{"files": t.TempDir()})
	p := sd.pools["files"]
	hold := make(chan struct{})
	p.hold.Store(&hold)
	ctx := context.Background()
	done := make(chan error, 1)
	go func() {
		_, err := sd.srv.CreateVolume(ctx, api.VolumeRequest{Name: "v", Pool: "files", Size: "1MiB", Labels: map[string]string{"csi.name": "pvc-v"}})
		done <- err
	}()
	kit.WaitFor(t, 10*time.Second, "the create in the pool", func() bool { return p.creating.Load() == 1 })
	v, err := sd.srv.Volume(ctx, "v")
	if err != nil || v.State != api.VolumeCreating || v.Labels["csi.name"] != "pvc-v" {
		t.Errorf("a volume being made: %+v %v; want state creating with its labels", v, err)
	}
	p.hold.Store(nil)
	close(hold)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if v, err := sd.srv.Volume(ctx, "v"); err != nil || v.State != api.VolumeServed || v.Labels["csi.name"] != "pvc-v" {
		t.Errorf("the volume made: %+v %v", v, err)
	}
	// A delete on a condition: the labels the caller read, or nothing.
	if _, err := sd.srv.DeleteVolumeIf(ctx, "v", map[string]string{"csi.name": "pvc-other"}); ctl.Classify(err) != ctl.CodeBusy {
		t.Errorf("a delete if a label the volume has not: %v, want busy", err)
	}
	if _, err := sd.srv.Volume(ctx, "v"); err != nil {
		t.Fatalf("the volume after a delete refused for its labels: %v", err)
	}
	if ok, err := sd.srv.DeleteVolumeIf(ctx, "v", map[string]string{"csi.name": "pvc-v"}); err != nil || !ok {
		t.Errorf("a delete if the labels it has: %v %v", ok, err)
	}
	// The pool's directory gone: the pool cannot list, and says so.
	p.failList.Store(true)
	if _, err := sd.srv.Volumes(ctx); ctl.Classify(err) != ctl.CodeUnavailable {
		t.Errorf("the volumes of a pool that cannot list them: %v, want unavailable", err)
	}
}
