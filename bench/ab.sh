#!/usr/bin/env bash
# A/B comparison of gateway variants on a noisy machine: the variants run BACK TO BACK, round after round,
# against the same node upstream and an nginx plain proxy, and each is reported as a ratio to the nginx runs
# of the same rounds (so drift of the machine's speed cancels out). For profiling work, not the final table.
#
#   bench/ab.sh "mt:IDEM_RUNTIME_THREADS=0" "ct:IDEM_RUNTIME_THREADS=1"
#   ROUNDS=5 DURATION=5 MODE=repeat bench/ab.sh "a:IDEM_BIN=/path/a" "b:IDEM_BIN=/path/b"
#
# A variant is NAME:VAR=VALUE,VAR=VALUE (IDEM_BIN, IDEM_RUNTIME_THREADS, STORE, RUST_LOG, ...).
# Knobs: ROUNDS (3), DURATION (s, 5), MODE (unique | repeat | nokey), CONNS (32), STORE (memory://).
# Needs wrk, nginx and node (bench/gateway.sh installs them through the peer harness).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
harness=${IDEM_PEER_HARNESS:-$root/../shared/bench}
: "${ROUNDS:=3}" "${DURATION:=5}" "${MODE:=unique}" "${CONNS:=32}" "${STORE:=memory://}"
: "${IDEM_BIN:=${CARGO_TARGET_DIR:-$root/target}/release/idem}"
export RUN_DIR=${RUN_DIR:-/tmp/idem-ab-run}
out=$RUN_DIR/out; mkdir -p "$out"
source "$harness/lib/common.sh"
trap stop_all EXIT
trap 'stop_all; exit 130' INT TERM
up=18180 ng=18181 gw=18190

bench_bg ab-upstream node "$harness/servers/upstream.js" "$up"
wait_port "$up"
source "$root/bench/lib/nginx_conf.sh"
nginx_conf "$RUN_DIR/nginx" "$up" "$ng"
bench_bg ab-nginx nginx -p "$RUN_DIR/nginx" -c "$RUN_DIR/nginx/nginx.conf" -g 'daemon off;'
wait_port "$ng"

run_wrk() { # run_wrk URL MODE NONCE -> req/s p99_us non-2xx p50_us
  local script=$harness/wrk/post.lua
  [[ $2 = nokey ]] && script=$root/bench/wrk/nokey.lua
  wrk -t1 -c"$CONNS" -d"$DURATION"s --timeout 10s -s "$script" "$1" -- "$2" "$3" 100 |
    python3 -c 'import sys,json
for l in sys.stdin:
    if l.startswith("WRK_JSON"):
        j=json.loads(l[9:]); print("%.0f %d %d %d" % (j["requests"]/j["duration_us"]*1e6, j["lat_p99_us"], j["err_status"], j["lat_p50_us"]))'
}

start_gw() { # start_gw SPEC
  local spec=$1 name=${1%%:*} envs=() kv
  IFS=',' read -ra kvs <<<"${spec#*:}"
  for kv in "${kvs[@]}"; do [[ -n $kv ]] && envs+=("$kv"); done
  local bin=$IDEM_BIN store=$STORE threads=${IDEM_RUNTIME_THREADS:-1}
  for kv in "${envs[@]}"; do case $kv in IDEM_BIN=*) bin=${kv#*=};; STORE=*) store=${kv#*=};; esac; done
  RUST_LOG=warn IDEM_RUNTIME_THREADS=$threads IDEM_ADMIN_LISTEN=${IDEM_ADMIN_LISTEN:-127.0.0.1:$((gw + 1))} bench_bg "ab-$name" env "${envs[@]}" "$bin" gateway \
    --listen 127.0.0.1:$gw --upstream http://127.0.0.1:$up --store "$store"
  wait_port "$gw"
  sleep 0.3
}

: >"$out/results.txt"
for round in $(seq "$ROUNDS"); do
  echo "nginx $round $(run_wrk "http://127.0.0.1:$ng/orders" unique "n$round$RANDOM")" | tee -a "$out/results.txt"
  for spec in "$@"; do
    name=${spec%%:*}
    start_gw "$spec"
    nonce="$name-$round-$RANDOM"
    [[ $MODE = repeat ]] && run_wrk "http://127.0.0.1:$gw/orders" repeat "$nonce" >/dev/null # create the keys
    echo "$name $round $(run_wrk "http://127.0.0.1:$gw/orders" "$MODE" "$nonce") $(ps -o rss= -p "$(<"$RUN_DIR/pids/ab-$name")" | tr -d ' ')" |
      tee -a "$out/results.txt"
    stop_bg "ab-$name"
  done
done
python3 - "$out/results.txt" <<'PY'
import sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    p = line.split()
    if len(p) < 5: continue
    rows.setdefault(p[0], []).append((int(p[1]), float(p[2]), int(p[3]), int(p[4]), int(p[6]) if len(p) > 6 else 0, int(p[5])))
ng = {r[0]: r[1] for r in rows.get("nginx", [])}
print("\n| variant | req/s median | × nginx (per round, median) | p50 median | p99 median | non-2xx | RSS KiB |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name, rs in rows.items():
    ratios = [r[1] / ng[r[0]] for r in rs if r[0] in ng and ng[r[0]]]
    print("| %s | %.0f | %.2f | %.3f ms | %.2f ms | %d | %s |" % (name, st.median(r[1] for r in rs), st.median(ratios) if ratios else 0,
          st.median(r[5] for r in rs) / 1000, st.median(r[2] for r in rs) / 1000, sum(r[3] for r in rs),
          max(r[4] for r in rs) if name != "nginx" else ""))
PY
