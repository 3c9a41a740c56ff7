package main

import (
	"errors"
	"os/exec"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// cpus is the CPU list taskset gets for a process of role ("server": the
// storage side; anything else, fio included: the client side) when
// pinned: the upper half of the CPUs this process may run on for the
// servers, the lower half for the rest.
func (c config) cpus(role string) string {
	var set unix.CPUSet
	if err := unix.SchedGetaffinity(0, &set); err != nil {
		return ""
	}
	var allowed []int
	for i := 0; i < len(set)*64; i++ {
		if set.IsSet(i) {
			allowed = append(allowed, i)
		}
	}
	return cpuList(role, allowed)
}

// cpuList is cpus for a process allowed the CPUs allowed (at least 2).
func cpuList(role string, allowed []int) string {
	half := len(allowed) / 2
	side := allowed[:half]
	if role == "server" {
		side = allowed[half:]
	}
	s := make([]string, len(side))
	for i, c := range side {
		s[i] = strconv.Itoa(c)
	}
	return strings.Join(s, ",")
}

// argv is args run as role: as they are, or under taskset when pinned.
// taskset execs the command, so the process's pid is the command's.
func (c config) argv(role string, args []string) []string {
	if !c.pin {
		return args
	}
	return append([]string{"taskset", "--cpu-list", c.cpus(role)}, args...)
}

// command is exec.Command of args run as role.
func (c config) command(role string, args ...string) *exec.Cmd {
	a := c.argv(role, args)
	return exec.Command(a[0], a[1:]...)
}

// checkPin says why pinning cannot be done here, or nil.
func (c config) checkPin() error {
	if !c.pin {
		return nil
	}
	if c.cpus("fio") == "" || c.cpus("server") == "" {
		return errors.New("-pin needs at least 2 CPUs this process may run on, one for each side")
	}
	if _, err := exec.LookPath("taskset"); err != nil {
		return errors.New("-pin needs taskset (util-linux)")
	}
	return nil
}
