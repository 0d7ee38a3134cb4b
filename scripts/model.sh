#!/usr/bin/env bash
# Checks the key protocol's Promela model (docs/model/idem.pml) with spin:
# every configuration of the protocol as built exhaustively (safety
# assertions P1, P2, P4, P5, P6; LTL p3 with weak fairness), and every
# deliberately broken variant (-DBUG_*), which must yield a counterexample
# for the property it breaks. See docs/model/README.md.
#
#   ./scripts/model.sh
#
# Installs spin (Debian package spin) when it is missing and we are root.
# Builds in a temporary directory, never in the repository. Fails on any
# violation in the correct model, on an incomplete search, and on a broken
# variant that is not caught. Environment:
#   MODEL_KEEP=1   keep the build directory (its path is printed), with
#                  each check's pan output and trail
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

die() { printf '\nscripts/model.sh: %s\n' "$*" >&2; exit 1; }

if ! command -v spin >/dev/null 2>&1; then
  echo "spin is missing; installing Debian package spin"
  [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 \
    || die "spin is needed; install it (Debian package spin)"
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq spin
  command -v spin >/dev/null 2>&1 || die "spin is still missing after installing it"
fi
command -v gcc >/dev/null 2>&1 || die "gcc is needed to compile spin's verifier"

model=$PWD/docs/model/idem.pml
[ -f "$model" ] || die "no $model"
work=$(mktemp -d "${TMPDIR:-/tmp}/idem-model.XXXXXX")
if [ "${MODEL_KEEP:-}" = 1 ]; then
  echo "build directory: $work"
else
  trap 'rm -rf "$work"' EXIT
fi

# Hash table of 2^24 slots, search depth bound far above the model's depth
# (a truncated search fails below). The verifiers are compiled without
# optimisation: gcc -O2 on a pan.c takes ~60 s of CPU, -O0 ~10 s, and the
# searches are short, so -O0 is the faster whole.
PAN_FLAGS=(-m100000 -w24)
# Checks run side by side, up to MODEL_JOBS (default: the number of CPUs, at most 2).
jobs=${MODEL_JOBS:-$(nproc 2>/dev/null || echo 1)}
[ "$jobs" -ge 1 ] 2>/dev/null || jobs=1
[ "$jobs" -le 2 ] || jobs=2
total_start=$(date +%s)
names=()

# check NAME KIND EXPECT DEFINE...
#   KIND    safety (assertions and end states) or ltl (p3, acceptance cycles
#           under weak fairness)
#   EXPECT  ok: no error; otherwise an extended regex that the violation
#           must match (an assert variable such as P6_shared_answer, or
#           "acceptance cycle")
#   Writes its table line to $work/NAME/line, and $work/NAME/failed on failure.
check() {
  local name=$1 kind=$2 expect=$3
  shift 3
  local dir=$work/$name
  mkdir -p "$dir"
  cp "$model" "$dir/idem.pml"
  (cd "$dir" && spin -a "$@" idem.pml >spin.log 2>&1) \
    || { cat "$dir/spin.log"; echo "$name: spin -a failed" >"$dir/failed"; return; }
  local cflags=(-O0 -w)
  local run=("${PAN_FLAGS[@]}")
  if [ "$kind" = safety ]; then
    cflags+=(-DSAFETY -DNOCLAIM)
  else
    run+=(-a -f -N p3)
  fi
  (cd "$dir" && gcc "${cflags[@]}" -o pan pan.c 2>gcc.log) \
    || { cat "$dir/gcc.log"; echo "$name: gcc failed" >"$dir/failed"; return; }
  (cd "$dir" && ./pan "${run[@]}" >pan.out 2>&1) || true
  local out=$dir/pan.out
  local errors states depth secs result
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | tail -1)
  states=$(awk '/states, stored/ {print $1; exit}' "$out")
  depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$out" | tail -1)
  secs=$(sed -n 's/^pan: elapsed time \([0-9.e+]*\) seconds.*/\1/p' "$out" | tail -1)
  if [ -z "$errors" ]; then
    cat "$out"
    echo "$name: no result from pan" >"$dir/failed"
    return
  fi
  if [ "$expect" = ok ]; then
    if [ "$errors" = 0 ] && ! grep -q "max search depth too small" "$out"; then
      result=ok
    else
      result=FAILED
      { grep -E "violated|cycle|invalid end|depth too small" "$out" || true
        (cd "$dir" && spin -t "$@" idem.pml 2>&1 | tail -20) || true; } >"$dir/failed"
    fi
  else
    if [ "$errors" != 0 ] && grep -Eq "$expect" "$out"; then
      result=caught
    else
      result=MISSED
      { grep -E "violated|cycle|invalid end" "$out" || echo "no counterexample found"; } >"$dir/failed"
    fi
  fi
  printf '%-24s %-6s %-7s %10s %6s %8s  %s\n' "$name" "$kind" "$result" "${states:-?}" \
    "${depth:-?}" "${secs:-?}" "$*" >"$dir/line"
}

# spawn NAME ...: check in the background, at most $jobs at once.
spawn() {
  names+=("$1")
  while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
    wait -n || true
  done
  check "$@" &
}

# The protocol as built (with the shared release, W = 1 tick).
spawn dup-safety      safety ok -DNC=2
spawn fp-safety       safety ok -DNC=3 -DNTRY=1
spawn w0-safety       safety ok -DNC=2 -DSHARE_W=0
spawn ghost-safety    safety ok -DNC=2 -DNTRY=1 -DGHOST
spawn dup-p3          ltl    ok -DNC=2 -DNTRY=1

# Broken variants: each must be caught by the property it breaks.
spawn bug-nonatomic-begin    safety 'violated (P1_one_effect|P2_retained_replayed)' -DNC=2 -DBUG_NONATOMIC_BEGIN
spawn bug-takeover-any-fp    safety 'violated P4_no_foreign_run'  -DNC=3 -DNTRY=1 -DBUG_TAKEOVER_ANY_FP
spawn bug-no-share           safety 'violated P6_shared_answer'   -DNC=2 -DBUG_NO_SHARE
spawn bug-complete-any-fence safety 'violated (P2_retained_kept|P5_only_newest_writes)' -DNC=2 -DBUG_COMPLETE_ANY_FENCE
spawn bug-fence-reset        safety 'violated P5_fence_increases' -DNC=2 -DBUG_FENCE_RESET
spawn bug-hold-renews        ltl    'acceptance cycle'            -DNC=2 -DNTRY=1 -DBUG_HOLD_RENEWS
wait

printf '%-24s %-6s %-7s %10s %6s %8s  %s\n' check kind result states depth "pan(s)" defines
failures=0
for n in "${names[@]}"; do
  if [ -f "$work/$n/line" ]; then cat "$work/$n/line"; else echo "$n: no result"; fi
  if [ -f "$work/$n/failed" ] || [ ! -f "$work/$n/line" ]; then
    failures=$((failures + 1))
  fi
done
for n in "${names[@]}"; do
  if [ -f "$work/$n/failed" ]; then
    echo
    echo "--- $n"
    cat "$work/$n/failed"
  fi
done

echo
if [ "$failures" != 0 ]; then
  die "$failures check(s) failed (see above; MODEL_KEEP=1 keeps the pan output and trails)"
fi
echo "scripts/model.sh: every property holds and every broken variant was caught, in $(( $(date +%s) - total_start )) s"
