#!/usr/bin/env bash
# What metrics cost per request: instructions counted by valgrind's callgrind in the gateway process only
# (stable on a loaded machine, unlike wall-clock numbers), for variants of the gateway side by side.
#
#   bench/metrics_cost.sh "on:IDEM_ADMIN_LISTEN=127.0.0.1:0" "off:IDEM_ADMIN_LISTEN=off"
#   N=2000 MODES="unique repeat nokey" bench/metrics_cost.sh "base:IDEM_BIN=/path/old,IDEM_ADMIN_LISTEN=off" ...
#
# A variant is NAME:VAR=VALUE,VAR=VALUE (IDEM_BIN picks the binary, the rest go to its environment).
# For each variant and mode: start `idem gateway` (memory://, one runtime thread, RUST_LOG=warn) under
# callgrind, send a warm-up, zero the counters, send N requests over one keep-alive connection, dump,
# and print instructions per request. Modes: unique (a new key each: first executions), repeat (one key
# created in the warm-up: replays), nokey (no Idempotency-Key: pass-through). Needs valgrind, node, python3.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
harness=${IDEM_PEER_HARNESS:-$root/../shared/bench}
: "${N:=2000}" "${WARMUP:=200}" "${MODES:=unique repeat nokey}"
: "${IDEM_BIN:=${CARGO_TARGET_DIR:-$root/target}/release/idem}"
run=${RUN_DIR:-/tmp/idem-metrics-cost}
mkdir -p "$run"
up=18280 gw=18290
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

node "$harness/servers/upstream.js" "$up" >"$run/upstream.log" 2>&1 &
pids+=($!)

wait_port() { # wait_port PORT SECONDS
  local i
  for ((i = 0; i < $2 * 10; i++)); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.1
  done
  echo "port $1 not open after $2 s" >&2
  return 1
}
wait_port "$up" 10

load() { # load MODE COUNT NONCE
  python3 - "$gw" "$@" <<'PY'
import http.client, sys
port, mode, n, nonce = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
c = http.client.HTTPConnection("127.0.0.1", port)
body = '{"item":"book","qty":2,"note":"metrics cost"}'
for i in range(n):
    h = {"content-type": "application/json"}
    if mode == "unique":
        h["idempotency-key"] = f"{nonce}-{i}"
    elif mode == "repeat":
        h["idempotency-key"] = f"{nonce}-repeat"
    c.request("POST", "/orders", body=body, headers=h)
    r = c.getresponse()
    r.read()
    if r.status not in (200, 201):
        sys.exit(f"unexpected status {r.status}")
PY
}

printf '%-10s %-8s %12s\n' variant mode instr/req
for spec in "$@"; do
  name=${spec%%:*}
  envs=() bin=$IDEM_BIN
  IFS=',' read -ra kvs <<<"${spec#*:}"
  for kv in "${kvs[@]}"; do
    case $kv in IDEM_BIN=*) bin=${kv#*=} ;; ?*) envs+=("$kv") ;; esac
  done
  for mode in $MODES; do
    out=$run/cg.$name.$mode
    rm -f "$out"*
    env RUST_LOG=warn IDEM_RUNTIME_THREADS=1 IDEM_ADMIN_LISTEN=off "${envs[@]}" \
      valgrind --tool=callgrind --callgrind-out-file="$out" "$bin" gateway \
      --listen 127.0.0.1:$gw --upstream http://127.0.0.1:$up --store memory:// >"$run/gw.$name.$mode.log" 2>&1 &
    vpid=$!
    pids+=("$vpid")
    wait_port "$gw" 120
    nonce="$name-$mode-$RANDOM"
    load "$mode" "$WARMUP" "$nonce-w"
    [[ $mode = repeat ]] && nonce="$nonce-w"
    callgrind_control -z "$vpid" >/dev/null 2>&1
    load "$mode" "$N" "$nonce"
    callgrind_control -d "$vpid" >/dev/null 2>&1
    kill "$vpid"
    wait "$vpid" 2>/dev/null || true
    # The dump made after zeroing is the one with a part number: its totals are the N requests'.
    dump=$(ls -t "$out".* 2>/dev/null | grep -v '\.log$' | head -1)
    total=$(awk '/^(summary|totals):/ {print $2; exit}' "$dump")
    printf '%-10s %-8s %12d\n' "$name" "$mode" $((total / N)) | tee -a "$run/results.txt"
  done
done
