package main

import (
	"slices"
	"testing"
)

func TestCPUList(t *testing.T) {
	for _, tc := range []struct {
		role    string
		allowed []int
		want    string
	}{
		{"server", []int{0, 1}, "1"}, {"client", []int{0, 1}, "0"}, {"fio", []int{0, 1}, "0"},
		{"server", []int{0, 1, 2}, "1,2"}, {"client", []int{0, 1, 2}, "0"},
		{"server", []int{2, 3, 6, 7}, "6,7"}, {"client", []int{2, 3, 6, 7}, "2,3"},
		{"server", []int{5}, "5"}, {"client", []int{5}, ""},
	} {
		if got := cpuList(tc.role, tc.allowed); got != tc.want {
			t.Errorf("cpuList(%q, %v) = %q, want %q", tc.role, tc.allowed, got, tc.want)
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
