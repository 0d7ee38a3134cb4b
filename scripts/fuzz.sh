#!/usr/bin/env bash
# Runs idem's fuzz targets (fuzz/) for a bounded time each, one at a time.
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
# Default: 60 s per target, every target. Needs cargo-fuzz (installed here
# when missing) and a nightly compiler, or RUSTC_BOOTSTRAP=1 on stable.
# Not part of the test command: CI replays fuzz/corpus/ through
# crates/idem-fuzz/tests/corpus.rs instead.
set -euo pipefail
cd "$(dirname "$0")/.."
secs=${1:-60}
shift || true
command -v cargo-fuzz >/dev/null || cargo install cargo-fuzz --locked
export RUSTC_BOOTSTRAP=1
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/tmp/idem-fuzz-target}
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  mapfile -t targets < <(cd fuzz && cargo fuzz list)
fi
(cd fuzz && nice -n 10 cargo fuzz build -O --debug-assertions)
status=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/corpus/$t"
  log=$(mktemp)
  set +e
  (cd fuzz && nice -n 10 cargo fuzz run -O --debug-assertions "$t" "corpus/$t" -- \
    -max_total_time="$secs" -max_len=4096 -print_final_stats=1) >"$log" 2>&1
  rc=$?
  set -e
  execs=$(grep -m1 'stat::number_of_executed_units' "$log" | awk '{print $2}')
  crashes=$(ls fuzz/artifacts/"$t"/ 2>/dev/null | wc -l)
  echo "$t: executions ${execs:-?} crashes $crashes (exit $rc)"
  if [ "$rc" -ne 0 ]; then status=1; tail -30 "$log"; fi
  rm -f "$log"
done
exit $status
