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
# (a truncated search fails below).
PAN_FLAGS=(-m100000 -w24)
failures=0
total_start=$(date +%s)

printf '%-24s %-6s %-9s %12s %7s %9s  %s\n' check kind result states depth "time(s)" defines

# check NAME KIND EXPECT DEFINE...
#   KIND    safety (assertions and end states) or ltl (p3, acceptance cycles
#           under weak fairness)
#   EXPECT  ok: no error; otherwise an extended regex that the violation
#           must match (an assert variable such as P6_shared_answer, or
#           "acceptance cycle")
check() {
  local name=$1 kind=$2 expect=$3
  shift 3
  local dir=$work/$name
  mkdir -p "$dir"
  cp "$model" "$dir/idem.pml"
  (cd "$dir" && spin -a "$@" idem.pml >spin.log 2>&1) \
    || { cat "$dir/spin.log"; die "$name: spin -a failed"; }
  local cflags=(-O2 -w)
  local run=("${PAN_FLAGS[@]}")
  if [ "$kind" = safety ]; then
    cflags+=(-DSAFETY -DNOCLAIM)
  else
    run+=(-a -f -N p3)
  fi
  (cd "$dir" && gcc "${cflags[@]}" -o pan pan.c 2>gcc.log) \
    || { cat "$dir/gcc.log"; die "$name: gcc failed"; }
  local t0 t1
  t0=$(date +%s.%N)
  (cd "$dir" && ./pan "${run[@]}" >pan.out 2>&1) || true
  t1=$(date +%s.%N)
  local out=$dir/pan.out
  local errors states depth secs result
  errors=$(sed -n 's/.*errors: \([0-9]*\).*/\1/p' "$out" | tail -1)
  states=$(awk '/states, stored/ {print $1; exit}' "$out")
  depth=$(sed -n 's/.*depth reached \([0-9]*\).*/\1/p' "$out" | tail -1)
  secs=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  [ -n "$errors" ] || { cat "$out"; die "$name: no result from pan"; }
  if [ "$expect" = ok ]; then
    if [ "$errors" = 0 ] && ! grep -q "max search depth too small" "$out"; then
      result=ok
    else
      result=FAILED
      failures=$((failures + 1))
      (cd "$dir" && spin -t "$@" idem.pml 2>&1 | tail -20) || true
      grep -E "violated|cycle|invalid end|depth too small" "$out" || true
    fi
  else
    if [ "$errors" != 0 ] && grep -Eq "$expect" "$out"; then
      result=caught
    else
      result=MISSED
      failures=$((failures + 1))
      grep -E "violated|cycle|invalid end" "$out" || echo "$name: no counterexample found"
    fi
  fi
  printf '%-24s %-6s %-9s %12s %7s %9s  %s\n' "$name" "$kind" "$result" "${states:-?}" "${depth:-?}" "$secs" "$*"
}

# The protocol as built (with the shared release, W = 1 tick).
check dup-safety      safety ok -DNC=2
check fp-safety       safety ok -DNC=3 -DNTRY=1
check w0-safety       safety ok -DNC=2 -DSHARE_W=0
check ghost-safety    safety ok -DNC=2 -DNTRY=1 -DGHOST
check dup-p3          ltl    ok -DNC=2 -DNTRY=1

# Broken variants: each must be caught by the property it breaks.
check bug-nonatomic-begin    safety 'violated P1_one_effect'      -DNC=2 -DBUG_NONATOMIC_BEGIN
check bug-takeover-any-fp    safety 'violated P4_no_foreign_run'  -DNC=3 -DNTRY=1 -DBUG_TAKEOVER_ANY_FP
check bug-no-share           safety 'violated P6_shared_answer'   -DNC=2 -DBUG_NO_SHARE
check bug-complete-any-fence safety 'violated (P2_retained_kept|P5_only_newest_writes)' -DNC=2 -DBUG_COMPLETE_ANY_FENCE
check bug-fence-reset        safety 'violated P5_fence_increases' -DNC=2 -DBUG_FENCE_RESET
check bug-hold-renews        ltl    'acceptance cycle'            -DNC=2 -DNTRY=1 -DBUG_HOLD_RENEWS

echo
if [ "$failures" != 0 ]; then
  die "$failures check(s) failed (see above; MODEL_KEEP=1 keeps the pan output and trails)"
fi
echo "scripts/model.sh: every property holds and every broken variant was caught, in $(( $(date +%s) - total_start )) s"
