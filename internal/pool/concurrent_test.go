// Tests of pools used by several goroutines at once, as the storage node
// uses them: changes of different names run at once and each gives the
// answer it gives alone, changes of one name one after the other, and
// running at once never promises more space than one after the other.
package pool

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rnbd/rnbd/test/kit"
)

// Creates, resizes, reads, lists and deletes of different names from 8
// goroutines at once on a directory pool: each answers as it would
// alone, every list holds what its goroutine has made and not deleted,
// and what is left is exactly what was not deleted, with nothing under
// .rnbd-tmp/.
func TestDirChangesAtOnce(t *testing.T) {
	dir := t.TempDir()
	p := openTest(t, dir)
	const workers, rounds = 8, 12
	var wg sync.WaitGroup
	errs := make(chan error, workers)
	for w := range workers {
		wg.Go(func() {
			errs <- func() error {
				for i := range rounds {
					name := fmt.Sprintf("w%d-%d", w, i)
					v, created, err := p.Create(Spec{Name: name, Size: 1 << 20, Labels: map[string]string{"w": strconv.Itoa(w)}})
					if err != nil || !created || v.Name != name {
						return fmt.Errorf("create %s: %+v, created %v, %v", name, v, created, err)
					}
					if v, err := p.Resize(name, 2<<20); err != nil || v.Size != 2<<20 {
						return fmt.Errorf("resize %s: %+v, %v", name, v, err)
					}
					if v, err := p.Get(name); err != nil || v.Size != 2<<20 || v.Labels["w"] != strconv.Itoa(w) {
						return fmt.Errorf("get %s: %+v, %v", name, v, err)
					}
					vs, err := p.List()
					if err != nil {
						return fmt.Errorf("list: %v", err)
					}
					for j := 0; j <= i; j++ {
						mine := fmt.Sprintf("w%d-%d", w, j)
						if has := slices.ContainsFunc(vs, func(v Volume) bool { return v.Name == mine }); has != (j%2 == 0 || j == i) {
							return fmt.Errorf("a list after %s: %s there %v", name, mine, has)
						}
					}
					if i%2 == 1 {
						if err := p.Delete(name); err != nil {
							return fmt.Errorf("delete %s: %v", name, err)
						}
						if _, err := p.Get(name); !errors.Is(err, syscall.ENOENT) {
							return fmt.Errorf("get %s after its delete: %v", name, err)
						}
					}
				}
				return nil
			}()
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Error(err)
		}
	}
	vs, err := p.List()
	if err != nil {
		t.Fatal(err)
	}
	var got, want []string
	for _, v := range vs {
		got = append(got, v.Name)
	}
	for w := range workers {
		for i := 0; i < rounds; i += 2 {
			want = append(want, fmt.Sprintf("w%d-%d", w, i))
		}
	}
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("left %v\nwant %v", got, want)
	}
	if es, _ := os.ReadDir(filepath.Join(dir, tmpDir)); len(es) != 0 {
		t.Fatalf("left under %s: %v", tmpDir, es)
	}
}

// The same name created by 8 goroutines at once: one makes it, the
// others answer it (created false), all with the same volume.
func TestDirSameNameAtOnce(t *testing.T) {
	p := openTest(t, t.TempDir())
	type answer struct {
		v       Volume
		created bool
		err     error
	}
	answers := make(chan answer, 8)
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			v, created, err := p.Create(Spec{Name: "same", Size: 1 << 20})
			answers <- answer{v, created, err}
		})
	}
	wg.Wait()
	close(answers)
	made := 0
	for a := range answers {
		if a.err != nil || a.v.Name != "same" || a.v.Size != 1<<20 {
			t.Fatalf("create: %+v, %v", a.v, a.err)
		}
		if a.created {
			made++
		}
	}
	if made != 1 {
		t.Fatalf("%d creates made the volume, want 1", made)
	}
}

// gate holds the changes that reach it until opened; reached says
// which one has.
type gate struct {
	reached chan string
	open    chan struct{}
}

func newGate() *gate { return &gate{reached: make(chan string, 16), open: make(chan struct{})} }

func (g *gate) wait(what string) {
	g.reached <- what
	<-g.open
}

// held waits for a change to reach the gate, and says which.
func (g *gate) held(t *testing.T) string {
	t.Helper()
	select {
	case what := <-g.reached:
		return what
	case <-time.After(30 * time.Second):
		t.Fatal("no change reached the gate")
		return ""
	}
}

// lockWaiters counts the goroutines waiting for a name's lock.
func lockWaiters() int {
	buf := make([]byte, 1<<20)
	n := 0
	for _, g := range strings.Split(string(buf[:runtime.Stack(buf, true)]), "\n\n") {
		if strings.Contains(g, "[chan receive") && strings.Contains(g, "(*nameLocks).with") && !strings.Contains(g, "(*gate).wait") {
			n++
		}
	}
	return n
}

// within fails t unless fn returns within d: what must not wait for a
// change held at a gate.
func within(t *testing.T, d time.Duration, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() {
		defer close(done)
		fn()
	}()
	select {
	case <-done:
	case <-time.After(d):
		t.Fatalf("%s waited for the change held at the gate", what)
	}
}

// A change of one name does not wait for a slow change of another: with
// the create of v2 held before its file is in place, v1 is created,
// read, listed, grown and deleted, and a snapshot's name and another
// volume's are free; a second create of v2 waits for the first and
// answers what it made. The space the held create was promised counts:
// a create that would take it is ENOSPC (as it is one after the
// other), and Capacity shows it promised until the create ends.
func TestDirOtherNamesDoNotWait(t *testing.T) {
	dir := t.TempDir()
	p := openTest(t, dir)
	c, err := p.Capacity()
	if err != nil {
		t.Fatal(err)
	}
	big := (c.Allocatable * 6 / 10) / BlockSize * BlockSize
	g := newGate()
	p.beforeRename = func(tmp string) {
		if strings.HasSuffix(tmp, ".v2.img") {
			g.wait(filepath.Base(tmp))
		}
	}
	first, second := make(chan error, 1), make(chan error, 1)
	var made [2]bool
	go func() {
		var err error
		_, made[0], err = p.Create(Spec{Name: "v2", Size: big})
		first <- err
	}()
	if got := g.held(t); got != "volume.v2.img" {
		t.Fatalf("held %s", got)
	}
	go func() {
		var err error
		_, made[1], err = p.Create(Spec{Name: "v2", Size: big})
		second <- err
	}()
	kit.WaitFor(t, 10*time.Second, "the second create of v2 to wait for the first", func() bool { return lockWaiters() == 1 })

	within(t, 30*time.Second, "a change of v1", func() {
		if _, created, err := p.Create(Spec{Name: "v1", Size: 1 << 20}); err != nil || !created {
			t.Errorf("create v1: created %v, %v", created, err)
		}
		if _, _, err := p.Create(Spec{Name: "v3", Size: big}); !errors.Is(err, syscall.ENOSPC) {
			t.Errorf("a create of the space promised to v2: %v, want ENOSPC", err)
		}
		if c, err := p.Capacity(); err != nil || c.Promised < big {
			t.Errorf("capacity while v2 is made: %+v, %v; want %d promised", c, err, big)
		}
		if _, err := p.Resize("v1", 2<<20); err != nil {
			t.Errorf("resize v1: %v", err)
		}
		if vs, err := p.List(); err != nil || len(vs) != 1 || vs[0].Name != "v1" {
			t.Errorf("list while v2 is made: %+v, %v", vs, err)
		}
		if _, err := p.Get("v2"); !errors.Is(err, syscall.ENOENT) {
			t.Errorf("get v2 while it is made: %v, want ENOENT", err)
		}
		if err := p.Delete("v1"); err != nil {
			t.Errorf("delete v1: %v", err)
		}
		if err := p.DeleteSnapshot("v2"); err != nil {
			t.Errorf("delete snapshot v2 (a snapshot's name is not a volume's): %v", err)
		}
	})
	close(g.open)
	if err := <-first; err != nil {
		t.Fatal(err)
	}
	if err := <-second; err != nil {
		t.Fatal(err)
	}
	if made[0] == made[1] {
		t.Fatalf("the two creates of v2: created %v and %v, want one of each", made[0], made[1])
	}
	if c, err := p.Capacity(); err != nil || c.Promised > big || c.Promised < big-1<<20 {
		t.Fatalf("capacity after: %+v, %v; want only v2's %d promised", c, err, big)
	}
	if p.space.held() != 0 {
		t.Fatalf("%d bytes still reserved", p.space.held())
	}
}

// --- the LVM thin pool, on a stand-in for lvm2's tools ---

// fakeLVM stands in for lvm2's tools on a thin pool "thin" of 1 GiB in
// volume group "vg": lvs, lvcreate of thin volumes, lvremove, lvchange.
// It serialises nothing itself (lvm2 does, on the volume group's lock):
// what it shows is what the pool's own locks do.
type fakeLVM struct {
	mu sync.Mutex
	// +checklocks:mu
	lvs map[string]fakeLV
	// gate, if set, is called by lvcreate with the new LV's name before
	// the LV is there.
	gate func(lv string)
}

type fakeLV struct {
	size int64
	tags []string
}

const fakeThinSize = 1 << 30

func (f *fakeLVM) run(tool string, args ...string) ([]byte, error) {
	switch tool {
	case "lvs":
		return f.report()
	case "lvcreate":
		var lv fakeLV
		var name string
		for i := 0; i < len(args); i++ {
			switch args[i] {
			case "-V":
				n, err := strconv.ParseInt(strings.TrimSuffix(args[i+1], "b"), 10, 64)
				if err != nil {
					return nil, err
				}
				lv.size = roundUp(n, 4<<20)
				i++
			case "-n":
				name = args[i+1]
				i++
			case "--addtag":
				lv.tags = append(lv.tags, args[i+1])
				i++
			case "-s":
				return nil, errors.New("fakeLVM: no snapshots")
			}
		}
		if f.gate != nil {
			f.gate(name)
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		if _, ok := f.lvs[name]; ok {
			return nil, &toolError{cmd: "lvcreate", err: errors.New("exit status 5"), stderr: "Logical Volume " + name + " already exists"}
		}
		f.lvs[name] = lv
		return nil, nil
	case "lvremove":
		_, name, _ := strings.Cut(args[len(args)-1], "/")
		f.mu.Lock()
		defer f.mu.Unlock()
		delete(f.lvs, name)
		return nil, nil
	case "lvchange":
		return nil, nil
	}
	return nil, fmt.Errorf("fakeLVM: no %s", tool)
}

func (f *fakeLVM) report() ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	rows := []map[string]string{{"lv_name": "thin", "lv_attr": "twi-aotz--", "segtype": "thin-pool", "lv_size": strconv.Itoa(fakeThinSize),
		"vg_extent_size": strconv.Itoa(4 << 20), "lv_metadata_size": strconv.Itoa(4 << 20), "data_percent": "0.00", "metadata_percent": "1.00"}}
	for name, lv := range f.lvs {
		rows = append(rows, map[string]string{"lv_name": name, "pool_lv": "thin", "lv_attr": "Vwi-a-tz--", "segtype": "thin",
			"lv_size": strconv.FormatInt(lv.size, 10), "vg_extent_size": strconv.Itoa(4 << 20), "data_percent": "0.00", "lv_tags": strings.Join(lv.tags, ",")})
	}
	return json.Marshal(map[string]any{"report": []any{map[string]any{"lv": rows}}})
}

// On an LVM thin pool too a change of one name does not wait for a slow
// change of another (the pool's locks; lvm2's own lock of the volume
// group is not faked), and the space promised to a create under way
// counts against the others until its LV is there.
func TestLVMOtherNamesDoNotWait(t *testing.T) {
	f := &fakeLVM{lvs: map[string]fakeLV{}}
	p, removed, err := openLVMThin("p", "vg", "thin", f.run)
	if err != nil || len(removed) != 0 {
		t.Fatalf("open: %v, removed %v", err, removed)
	}
	g := newGate()
	f.gate = func(lv string) {
		if lv == "rnbd.v.v2" {
			g.wait(lv)
		}
	}
	done := make(chan error, 1)
	go func() {
		_, _, err := p.Create(Spec{Name: "v2", Size: 600 << 20})
		done <- err
	}()
	g.held(t)
	within(t, 30*time.Second, "a change of v1", func() {
		if _, _, err := p.Create(Spec{Name: "v1", Size: 600 << 20}); !errors.Is(err, syscall.ENOSPC) {
			t.Errorf("a create of the space promised to v2: %v, want ENOSPC", err)
		}
		if _, created, err := p.Create(Spec{Name: "v1", Size: 64 << 20}); err != nil || !created {
			t.Errorf("create v1: created %v, %v", created, err)
		}
		if c, err := p.Capacity(); err != nil || c.Promised != 664<<20 {
			t.Errorf("capacity while v2 is made: %+v, %v; want 664 MiB promised", c, err)
		}
		if vs, err := p.List(); err != nil || len(vs) != 1 || vs[0].Name != "v1" {
			t.Errorf("list while v2 is made: %+v, %v", vs, err)
		}
		if err := p.Delete("v1"); err != nil {
			t.Errorf("delete v1: %v", err)
		}
	})
	close(g.open)
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if c, err := p.Capacity(); err != nil || c.Promised != 600<<20 {
		t.Fatalf("capacity after: %+v, %v; want v2's 600 MiB promised", c, err)
	}
	if vs, err := p.List(); err != nil || len(vs) != 1 || vs[0].Name != "v2" {
		t.Fatalf("list after: %+v, %v", vs, err)
	}
}
