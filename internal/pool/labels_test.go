package pool

import (
	"maps"
	"syscall"
	"testing"
)

// SetLabels replaces a volume's labels, kept as a pool opened again
// reads them; nothing else of the volume changes; no volume is ENOENT,
// a bad name or too many bytes EINVAL. A directory pool here, an LVM
// thin pool where lvm2 is (the VM tier).
func TestSetLabels(t *testing.T) {
	t.Run("dir", func(t *testing.T) {
		dir := t.TempDir()
		testSetLabels(t, openTest(t, dir), func() Pool { return openTest(t, dir) })
	})
	t.Run("lvm-thin", func(t *testing.T) {
		vg := lvmTestPool(t, 64)
		testSetLabels(t, openLVMTest(t, vg), func() Pool { return openLVMTest(t, vg) })
	})
}

func testSetLabels(t *testing.T, p Pool, reopen func() Pool) {
	v, _, err := p.Create(Spec{Name: "l", Size: 4 << 20, Labels: map[string]string{"a": "1", "b": "2"}})
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{"a": "9", "c": "3"}
	got, err := p.SetLabels("l", want)
	if err != nil || !maps.Equal(got.Labels, want) {
		t.Fatalf("SetLabels: %+v %v", got, err)
	}
	back, err := reopen().Get("l")
	if err != nil || !maps.Equal(back.Labels, want) || back.Size != v.Size || !back.Created.Equal(v.Created) || back.Path != v.Path {
		t.Fatalf("read again: %+v %v; made %+v", back, err, v)
	}
	// The labels a create compares with are the new ones.
	if _, created, err := p.Create(Spec{Name: "l", Size: 4 << 20, Labels: want}); err != nil || created {
		t.Fatalf("a create with the new labels: created %v, %v", created, err)
	}
	_, err = p.SetLabels("none", want)
	wantErrno(t, "no such volume", err, syscall.ENOENT)
	_, err = p.SetLabels("a/b", want)
	wantErrno(t, "a bad name", err, syscall.EINVAL)
	big := map[string]string{"k": string(make([]byte, MaxLabelBytes))}
	_, err = p.SetLabels("l", big)
	wantErrno(t, "labels too large", err, syscall.EINVAL)
	if err := p.Delete("l"); err != nil {
		t.Fatal(err)
	}
}
