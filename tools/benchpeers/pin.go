package main

import (
	"errors"
	"fmt"
	"os/exec"
)

// cpus is the CPU list taskset gets for a process of role ("server": the
// storage side; anything else, fio included: the client side) when
// pinned: the upper half of the CPUs for the servers, the lower for the
// rest.
func (c config) cpus(role string) string { return cpuList(role, numCPU()) }

// cpuList is cpus for a machine of n CPUs (n ≥ 2).
func cpuList(role string, n int) string {
	half := n / 2
	if role == "server" {
		return fmt.Sprintf("%d-%d", half, n-1)
	}
	return fmt.Sprintf("0-%d", half-1)
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
	if numCPU() < 2 {
		return errors.New("-pin needs at least 2 CPUs: one side each")
	}
	if _, err := exec.LookPath("taskset"); err != nil {
		return errors.New("-pin needs taskset (util-linux)")
	}
	return nil
}
