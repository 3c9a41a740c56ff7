package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"time"
)

// workload is one fio job: its direction and options.
type workload struct {
	dir  string // "read" or "write": the side of fio's JSON that counts
	opts []string
	seq  bool // judged by MB/s rather than IOPS
}

var workloads = map[string]workload{
	"rr4k_qd1":    {"read", []string{"--rw=randread", "--bs=4k", "--iodepth=1", "--norandommap", "--randrepeat=0"}, false},
	"rr4k_qd32":   {"read", []string{"--rw=randread", "--bs=4k", "--iodepth=32", "--norandommap", "--randrepeat=0"}, false},
	"rr4k_qd32x2": {"read", []string{"--rw=randread", "--bs=4k", "--iodepth=32", "--numjobs=2", "--norandommap", "--randrepeat=0"}, false},
	"rw4k_qd1":    {"write", []string{"--rw=randwrite", "--bs=4k", "--iodepth=1", "--norandommap", "--randrepeat=0"}, false},
	"rw4k_qd32":   {"write", []string{"--rw=randwrite", "--bs=4k", "--iodepth=32", "--norandommap", "--randrepeat=0"}, false},
	"sr128k_qd8":  {"read", []string{"--rw=read", "--bs=128k", "--iodepth=8"}, true},
	"sr1m_qd8":    {"read", []string{"--rw=read", "--bs=1m", "--iodepth=8"}, true},
	"sw128k_qd8":  {"write", []string{"--rw=write", "--bs=128k", "--iodepth=8"}, true},
	"sw1m_qd8":    {"write", []string{"--rw=write", "--bs=1m", "--iodepth=8"}, true},
	// Random writes of random sizes, each block carrying a crc32c, then
	// read back and checked: the data must survive the path.
	"verify": {"read", []string{"--rw=randwrite", "--bsrange=4k-128k", "--iodepth=16", "--size=256M",
		"--verify=crc32c", "--do_verify=1", "--verify_fatal=1", "--verify_state_save=0", "--randrepeat=0"}, false},
}

var defaultWorkloads = []string{"rr4k_qd1", "rr4k_qd32", "rw4k_qd32", "sr1m_qd8", "sw1m_qd8", "verify"}

func workloadNames() []string {
	var n []string
	for k := range workloads {
		n = append(n, k)
	}
	sort.Strings(n)
	return n
}

// row is one fio run on one peer.
type row struct {
	peer, workload string
	rep            int
	iops, mbps     float64
	p50, p99       float64            // µs
	cpu            map[string]float64 // daemon role → CPU µs per IO
	err            string             // "" when fio succeeded (and, for verify, verified)
}

// runFio runs workload w against p and measures its daemons' CPU.
func runFio(ctx context.Context, p *peer, w string, c config) (row, error) {
	wl := workloads[w]
	out := filepath.Join(p.dir, w+".json")
	args := []string{"--name=" + w, "--ioengine=nbd", "--uri=" + p.uri, "--group_reporting",
		"--lat_percentiles=1", "--percentile_list=50:99", "--output-format=json", "--output=" + out}
	if w != "verify" {
		args = append(args, "--time_based", "--runtime="+secs(c.runtime), "--ramp_time="+secs(c.ramp))
	}
	args = append(args, wl.opts...)
	limit := c.runtime + c.ramp + time.Minute
	if w == "verify" {
		limit = 5 * time.Minute
	}
	before := map[int]int64{}
	for i, d := range p.daemons {
		t, err := cpuTicks(d.cmd.Process.Pid)
		if err != nil {
			return row{}, fmt.Errorf("%s %s: %w", p.name, d.role, err)
		}
		before[i] = t
	}
	fctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	t0 := time.Now()
	fa := c.argv("fio", append([]string{"fio"}, args...))
	fout, ferr := exec.CommandContext(fctx, fa[0], fa[1:]...).CombinedOutput()
	wall := time.Since(t0).Seconds()
	if ctx.Err() != nil {
		return row{}, ctx.Err()
	}
	r := row{peer: p.name, workload: w, cpu: map[string]float64{}}
	if ferr != nil {
		r.err = "fio: " + firstLine(string(fout))
	}
	raw, err := os.ReadFile(out)
	if err == nil {
		err = parseFio(raw, wl.dir, w == "verify", &r)
	}
	if err != nil && r.err == "" {
		r.err = err.Error()
	}
	// Per role: a mirror's two servers are summed.
	for i, d := range p.daemons {
		t, err := cpuTicks(d.cmd.Process.Pid)
		if err != nil {
			return r, fmt.Errorf("%s %s: %w", p.name, d.role, err)
		}
		if r.iops > 0 {
			r.cpu[d.role] += float64(t-before[i]) / userHZ / wall / r.iops * 1e6
		}
	}
	return r, nil
}

func secs(d time.Duration) string { return strconv.FormatFloat(d.Seconds(), 'f', -1, 64) }

func firstLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return strings.ReplaceAll(s, "\t", " ")
}

// fioJSON is the part of fio's JSON output read here.
type fioJSON struct {
	Jobs []struct {
		Error int     `json:"error"`
		Read  fioSide `json:"read"`
		Write fioSide `json:"write"`
	} `json:"jobs"`
}

type fioSide struct {
	IOPS    float64 `json:"iops"`
	BW      float64 `json:"bw_bytes"`
	IOBytes int64   `json:"io_bytes"`
	Lat     struct {
		Percentile map[string]float64 `json:"percentile"`
	} `json:"lat_ns"`
}

// parseFio reads fio's JSON (after whatever fio printed before it) into r.
func parseFio(raw []byte, dir string, verify bool, r *row) error {
	if i := bytes.IndexByte(raw, '{'); i > 0 {
		raw = raw[i:]
	}
	var j fioJSON
	if err := json.Unmarshal(raw, &j); err != nil {
		return fmt.Errorf("fio output: %w", err)
	}
	if len(j.Jobs) == 0 {
		return fmt.Errorf("fio output: no jobs")
	}
	job := j.Jobs[0]
	s := job.Read
	if dir == "write" {
		s = job.Write
	}
	r.iops, r.mbps = s.IOPS, s.BW/1e6
	r.p50, r.p99 = s.Lat.Percentile["50.000000"]/1e3, s.Lat.Percentile["99.000000"]/1e3
	if job.Error != 0 {
		return fmt.Errorf("fio: error %d", job.Error)
	}
	if verify && job.Read.IOBytes == 0 {
		return fmt.Errorf("fio: nothing read back to verify")
	}
	return nil
}
