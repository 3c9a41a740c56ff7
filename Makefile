# rnbd — see README.md. Every target installs what it needs first (deps).
SHELL := /bin/bash
GO    ?= go
BIN   := bin

.PHONY: all deps build man deb test-deb demo demo-rtrs test test-vm test-k8s vet helm manifests bench bench-peers bench-mirror bench-fleet fuzz clean

all: build

# Install what the build and the tests need (Debian packages as root, Go
# modules), or say clearly what is missing.
deps:
	@scripts/deps.sh

# The binaries say their version, from git (scripts/version.sh;
# rnbd-server --version).
build: deps
	$(GO) build -ldflags "$$(scripts/version.sh)" -o $(BIN)/ ./cmd/...

# Man pages (section 8, one per command, from the cobra commands; section
# 5, the configuration files, from ConfigKeys) and bash completions into
# bin/man and bin/completion.
man: build
	$(BIN)/rnbd-server man $(BIN)/man
	$(BIN)/rnbd-client man $(BIN)/man
	$(BIN)/rnbd-csi man $(BIN)/man
	mkdir -p $(BIN)/completion
	$(BIN)/rnbd-server completion bash >$(BIN)/completion/rnbd-server
	$(BIN)/rnbd-client completion bash >$(BIN)/completion/rnbd-client

# Debian packages rnbd-server, rnbd-client and rnbd-csi into build/deb
# (version from git), and CI's check of them: lintian, install,
# systemd-analyze verify, man pages, upgrade, remove, purge (root).
deb: deps
	@scripts/mkdeb.sh build/deb

test-deb: deps
	@scripts/test-deb.sh

# The quick start's first command: both daemons, a sparse demo export, a
# mapping over RTRS/TCP on loopback and a short verified IO through it.
demo: build
	@scripts/demo.sh

# The transport on its own: an RTRS server and client exchanging verified
# IO over two loopback paths.
demo-rtrs: build
	@scripts/demo-rtrs.sh

# gVisor's checklocks analyzer checks the +checklocks annotations (which
# fields a mutex guards, which functions run with it held) on every
# package of the module (./...), so that new code is checked from its
# first line; not lock order (doc.go's Lock order blocks). A package it
# skips has a line CHECKLOCKS_SKIP.PACKAGE := REASON below (make vet
# prints them; a line for a package that is gone is an error). It is
# pinned and built outside the module: gvisor is large and no dependency
# of rnbd.
CHECKLOCKS_VERSION := v0.0.0-20260905035102-160fafc42237
CHECKLOCKS_SKIP    := $(sort $(patsubst CHECKLOCKS_SKIP.%,%,$(filter CHECKLOCKS_SKIP.%,$(.VARIABLES))))
CHECKLOCKS         := $(BIN)/tools/checklocks-$(CHECKLOCKS_VERSION)

$(CHECKLOCKS):
	GOBIN=$(abspath $(BIN))/tools $(GO) install gvisor.dev/gvisor/tools/checklocks/cmd/checklocks@$(CHECKLOCKS_VERSION)
	mv $(BIN)/tools/checklocks $@

vet: $(CHECKLOCKS)
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	$(GO) vet ./...
	@mod=$$($(GO) list -m) && pkgs=$$($(GO) list ./...) || exit 1; \
	for p in $(CHECKLOCKS_SKIP); do \
		echo "$$pkgs" | grep -qxF "$$mod/$$p" || { echo "CHECKLOCKS_SKIP.$$p: no such package: remove the line"; exit 1; }; \
		pkgs=$$(echo "$$pkgs" | grep -vxF "$$mod/$$p"); \
	done; \
	$(foreach p,$(CHECKLOCKS_SKIP),echo "checklocks skips $(p): $(CHECKLOCKS_SKIP.$(p))";) \
	echo "$(GO) vet -vettool=$(CHECKLOCKS) ./... (less what it skips)"; \
	$(GO) vet -vettool=$(abspath $(CHECKLOCKS)) $$pkgs

# Helm renders the chart deploy/helm/rnbd-csi in make test (test/lint:
# every object decoded strictly and checked, deploy/kubernetes its
# default rendering). Pinned and built outside the module, as checklocks
# is: helm's modules are no dependency of rnbd. The first build takes
# minutes (docs/testing.md).
HELM_VERSION := v3.22.0
HELM         := $(BIN)/tools/helm-$(HELM_VERSION)

$(HELM):
	GOBIN=$(abspath $(BIN))/tools $(GO) install helm.sh/helm/v3/cmd/helm@$(HELM_VERSION)
	mv $(BIN)/tools/helm $@

helm: $(HELM)

# deploy/kubernetes/*.yaml (but namespace.yaml) from the chart with its
# default values: run it after changing the chart.
manifests: $(HELM)
	RNBD_HELM=$(abspath $(HELM)) $(GO) test -count=1 -run '^TestHelmDefaultsArePlainManifests$$' ./test/lint -update

# The quick start's second command. As root it also runs the privileged
# tests (network namespaces); otherwise they skip and say why.
test: deps vet $(HELM)
	RNBD_HELM=$(abspath $(HELM)) RNBD_REQUIRE_PROMTOOL=$$([ "$$(id -u)" = 0 ] && echo 1) $(GO) test -race -count=1 -parallel 3 -timeout 30m ./...
	RNBD_E2E_TLS=1 $(GO) test -count=1 -parallel 3 -timeout 30m ./test/e2e
	# The hot paths' allocations per IO, which the race detector's own
	# hide above: none.
	$(GO) test -count=1 -run 'Allocs$$' ./pkg/rtrs ./pkg/mirror

# The VM tier: the kernel paths (/dev/nbdN, /dev/ublkbN) and RDMA
# (rdma_rxe) on a real Debian kernel under qemu (root; installs qemu from
# apt). VM_ONLY=rdma runs one part. See docs/testing.md.
# The whole tier on bookworm-backports' kernel (6.12) and, beside it
# (test/vm/both.sh: each qemu takes one core), the nbd and ublk parts on
# trixie-backports' newest, which has ublk's UPDATE_SIZE (6.16+): a
# server-pushed resize reaches /dev/ublkbN; and the mirror's fault
# schedules, which kill the ublk daemon at random moments (6.12's ublk
# oopses on one now and then). A run that picks its own part, kernel or
# suite (VM_ONLY, KPKG, VM_SUITE) is that run only.
test-vm: deps
	@if [ -z "$(VM_ONLY)$(KPKG)$(VM_SUITE)" ]; then test/vm/both.sh; else test/vm/run.sh; fi

# The Kubernetes tier (docs/testing.md): a pinned Kubernetes and the e2e
# suite built from the Go module proxy (test/k8s/build.sh, cached in
# /var/cache/rnbd-k8s by version), its control plane in a network
# namespace of its own, a qemu node whose kubelet joins it, rnbd-csi
# installed with the chart; pods get volumes, a failure case, the e2e
# suite's focused run. Root. K8S_PROFILE=ci is .ci/run's shorter run (its
# e2e specs stand in for the tier's own volume checks; docs/testing.md).
test-k8s: deps $(HELM)
	@RNBD_HELM=$(abspath $(HELM)) test/k8s/run.sh

bench: deps
	$(GO) test -run '^$$' -bench . -benchtime 2s -count 1 ./pkg/...

# The full path side by side with nbdkit-file (unix and TCP), an nbdkit
# relay of the same shape, go-nbd's file server (tools/gonbd) and rnbd,
# with fio's nbd engine: best of 3, about 20 minutes on an otherwise idle
# machine. Writes the rows and the
# plot to docs/bench/peers-DATE.{tsv,svg} and the table into
# docs/benchmarks.md. BENCH_PEERS_ARGS="-reps 1 -runtime 3s" for a quick look.
bench-peers: build
	$(GO) run ./tools/benchpeers -bin $(BIN) $(BENCH_PEERS_ARGS)

# The mirror of two legs against one device (issue 42's targets), the
# servers pinned to half the CPUs and fio and the client to the other
# half: storage nodes that do not take the client's CPU
# (docs/benchmarks.md, "Storage nodes on CPUs of their own"). Best of 5,
# about 12 minutes. Writes docs/bench/peers-DATE-mirror-pinned.{tsv,svg}
# and prints the tables.
bench-mirror: build
	$(GO) run ./tools/benchpeers -bin $(BIN) -pin -reps 5 -runtime 5s \
		-peers rnbd/unix,rnbd-mirror/unix -workloads rw4k_qd1,rw4k_qd32,rr4k_qd32 \
		-date $$(date -u +%F)-mirror-pinned -doc "" $(BENCH_MIRROR_ARGS)

# rnbd-server at a fleet's scale (issue 33): 100 volumes made, granted
# and deleted one after the other in a directory pool under $TMPDIR
# (best and median of 3), then the daemon's memory and idle CPU with no
# export and with 1000, and the restore of the 1000 at a restart; about
# 2 minutes, mostly the idle windows (docs/benchmarks.md, issue 33's
# section). The table goes to stdout, the rows
# to docs/bench/fleet-DATE.tsv. BENCH_FLEET_ARGS="-pool xfs" (root: an
# XFS loop mount), "-pool lvm-thin:VG/TP" (the VM tier), "-idle 5s" for
# a quick look.
bench-fleet: build
	$(GO) run ./tools/fleetbench -bin $(BIN) $(BENCH_FLEET_ARGS)

# Run every fuzz target for FUZZTIME each (their seeds run in make test).
FUZZTIME ?= 30s
fuzz: deps
	@scripts/fuzz.sh $(FUZZTIME)

clean:
	rm -rf $(BIN)
