# Sourced by this project's target files (bench/targets/*.sh) inside the peer harness's run_peers.sh.
# Adds the "nokey" scenario (POST without an Idempotency-Key: the gateway's pass-through path) by wrapping
# the harness's run_wrk; "unique" and "repeat" go to the harness's own post.lua unchanged.
IDEM_BENCH_DIR=${IDEM_BENCH_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
if ! declare -F harness_run_wrk >/dev/null && declare -F run_wrk >/dev/null; then
  eval "harness_$(declare -f run_wrk)"
  run_wrk() { # run_wrk OUTFILE URL DURATION MODE NONCE
    if [[ $4 = nokey ]]; then
      wrk -t"$WRK_THREADS" -c"$CONNS" -d"$3"s --timeout 10s -s "$IDEM_BENCH_DIR/wrk/nokey.lua" "$2" >"$1" 2>&1
    else
      harness_run_wrk "$@"
    fi
  }
fi
