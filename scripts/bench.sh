#!/usr/bin/env bash
# Run the RTRS transport benchmarks and regenerate docs/bench/rtrs.txt and
# the plot docs/bench/rtrs.svg.
set -euo pipefail
cd "$(dirname "$0")/.."
out=docs/bench/rtrs.txt
{
	echo "# go test -run '^\$' -bench BenchmarkIO -benchtime 3s -count 3 ./pkg/rtrs/"
	echo "# $(date -u +%Y-%m-%d) $(go version | cut -d' ' -f3) $(nproc) CPUs: $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
	go test -run '^$' -bench BenchmarkIO -benchtime 3s -count 3 ./pkg/rtrs/
} | tee "$out"
grep '^Benchmark' "$out" | go run ./tools/benchplot -title "RTRS over TCP loopback, 4 KiB requests (3 runs each)" > docs/bench/rtrs.svg
echo "wrote $out and docs/bench/rtrs.svg"
