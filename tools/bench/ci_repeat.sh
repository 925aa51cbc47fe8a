#!/usr/bin/env bash
# The suite's steadiness: N runs in a row of `bash .ci/run` on a fresh clone of this
# repository's HEAD, with a CPU burner (`python3 -c 'while True: pass'`) beside every run.
# The first run creates the environments and fills the empty compilation cache.
# One line per run in OUT/runs.txt (exit status, seconds, pytest's summary, dev.sh's phases);
# each run's whole output in OUT/run_<i>.log.
#
#   tools/bench/ci_repeat.sh [RUNS=10] [CLONE_DIR=/tmp/kserve_trio_ci_repeat] [OUT=CLONE_DIR.out]
set -uo pipefail
runs=${1:-10}
clone=${2:-/tmp/kserve_trio_ci_repeat}
out=${3:-$clone.out}
source_repo=$(git -C "$(dirname "$0")" rev-parse --show-toplevel)
rm -rf "$clone" "$out"
mkdir -p "$out"
git clone -q "$source_repo" "$clone"
cd "$clone" || exit 1
git log --oneline -1 > "$out/runs.txt"
python3 -c 'while True: pass' &
burner=$!
trap 'kill $burner' EXIT
for i in $(seq 1 "$runs"); do
  start=$(date +%s)
  bash .ci/run > "$out/run_$i.log" 2>&1
  rc=$?
  summary=$(grep -E "^=+ .*(passed|failed)" "$out/run_$i.log" | tail -1)
  phases=$(grep -E "dev.sh: (environments ready|pyright done|tests done)" "$out/run_$i.log" | tr '\n' ' ')
  echo "run $i rc=$rc $(($(date +%s) - start)) s $(date -u +%H:%M) $summary | $phases" >> "$out/runs.txt"
done
