package main

import (
	"slices"
	"testing"
)

func TestCPUList(t *testing.T) {
	for _, tc := range []struct {
		role string
		n    int
		want string
	}{
		{"server", 2, "1-1"}, {"client", 2, "0-0"}, {"fio", 2, "0-0"},
		{"server", 3, "1-2"}, {"client", 3, "0-0"},
		{"server", 8, "4-7"}, {"client", 8, "0-3"},
	} {
		if got := cpuList(tc.role, tc.n); got != tc.want {
			t.Errorf("cpuList(%q, %d) = %q, want %q", tc.role, tc.n, got, tc.want)
		}
	}
}

func TestArgvPinned(t *testing.T) {
	args := []string{"fio", "--name=x"}
	if got := (config{}).argv("fio", args); !slices.Equal(got, args) {
		t.Errorf("unpinned: %q, want the command as it is", got)
	}
	got := (config{pin: true}).argv("server", args)
	if len(got) != 5 || got[0] != "taskset" || got[1] != "--cpu-list" || !slices.Equal(got[3:], args) {
		t.Errorf("pinned: %q, want taskset --cpu-list LIST %q", got, args)
	}
}
