#!/usr/bin/env bash
# make test-vm: the whole VM tier on bookworm-backports' kernel (6.12)
# and, beside it, the nbd and ublk parts and the mirror's fault schedules on
# trixie-backports' newest (VM_MIN_KERNEL=6.16: ublk's UPDATE_SIZE; the
# schedules kill the ublk daemon, which 6.12's ublk does not always
# survive). Each qemu runs single-threaded TCG, one host core: on two
# cores the second run takes the core the first leaves idle, and the
# tier takes the first run's time instead of both. What both would
# install or fetch (apt's lock, the kernels in the cache) is done first,
# one at a time; the downloads they share settle in the cache whichever
# finishes first (run.sh, settle). The second run's lines are prefixed
# "[trixie] ". Fails if either fails.
set -euo pipefail
cd "$(dirname "$0")/../.."
log() { printf '== [%(%T)T] %s\n' -1 "$*" >&2; }

VM_KERNEL_ONLY=1 test/vm/run.sh >/dev/null
VM_SUITE=trixie-backports VM_KERNEL_ONLY=1 test/vm/run.sh >/dev/null

# The second run in a session of its own, so that it can be stopped whole.
export VM_LOG_TRIXIE=${VM_LOG:+$VM_LOG.trixie}
setsid bash -c 'set -o pipefail
	VM_SUITE=trixie-backports VM_MIN_KERNEL=6.16 VM_ONLY=nbd,ublk,mirror-schedules VM_KMODS=none VM_LOG=$VM_LOG_TRIXIE \
		test/vm/run.sh 2>&1 | sed -u "s/^/[trixie] /"' &
pid=$!
trap 'kill -- -$pid 2>/dev/null || true' EXIT
rc1=0
test/vm/run.sh || rc1=$?
rc2=0
wait $pid || rc2=$?
trap - EXIT
log "make test-vm: bookworm-backports' kernel $([ $rc1 = 0 ] && echo passed || echo "FAILED ($rc1)"), trixie-backports' $([ $rc2 = 0 ] && echo passed || echo "FAILED ($rc2)")"
[ $rc1 = 0 ] && [ $rc2 = 0 ]
