#!/usr/bin/env bash
# Gateway load benchmark, one command, side by side in ONE run on 127.0.0.1, all in front of the same node
# upstream and measured with wrk (32 connections, median of RUNS runs):
#   - the upstream called directly, and nginx as a plain reverse proxy (the price of proxying alone);
#   - the peer idempotency middlewares with a Redis store: express-idempotency, @node-idempotency/nestjs,
#     fastapi-idempotency-key, and AWS Lambda Powertools' idempotent_function (in-process, calls/s);
#   - `idem gateway` with the memory (twice: default runtime, one runtime thread), SQLite, PostgreSQL,
#     MariaDB and Redis stores.
# Scenarios: unique (a new key per request), repeat (100 keys: replays), nokey (no Idempotency-Key:
# pass-through; memory-store gateway only, the path is the same for every store).
#
#   bench/gateway.sh                          # full run: RUNS=3 DURATION=10
#   RUNS=1 DURATION=3 bench/gateway.sh        # smoke run
#   TARGETS="upstream nginx-proxy idem-memory" bench/gateway.sh
#
# It uses the peer harness in ../shared/bench (override with IDEM_PEER_HARNESS): the upstream, the peers,
# the wrk script, the shared-machine guard and the raw report. The harness installs what is missing
# (apt: wrk nginx-light redis-server redis-tools; npm and PyPI packages for the peers, pinned).
# PostgreSQL and MariaDB are the servers on 127.0.0.1 (IDEM_BENCH_POSTGRES_URL / IDEM_BENCH_MYSQL_URL).
# The gateway runs Tokio's default runtime (a worker per CPU); idem-memory-1t repeats the memory store
# with IDEM_RUNTIME_THREADS=1 (one runtime thread), to compare in the same run.
# Results: $BENCH_OUT/results/latest/ (default /tmp/idem-bench): BASELINE.md (the harness's report, with
# the behaviour checks) and SUMMARY.md (this project's table: ratios to nginx, p99 added, RSS).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
harness=${IDEM_PEER_HARNESS:-$root/../shared/bench}
[ -f "$harness/run_peers.sh" ] || { echo "bench/gateway.sh: the peer harness is not at $harness (set IDEM_PEER_HARNESS)" >&2; exit 1; }
(cd "$root" && cargo build --release -p idem-cli)
export IDEM_BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/idem}
export EXTRA_TARGETS="$root/bench/targets"
peers="express-idempotency nest-node-idempotency fastapi-idempotency-key"
ours="idem-memory idem-memory-1t idem-sqlite idem-postgres idem-mariadb idem-redis"
export TARGETS=${TARGETS:-"upstream nginx-proxy $peers $ours"}
# redis-benchmark (raw Redis ops/s) is off unless asked for; Powertools runs unless SKIP_POWERTOOLS=1.
export SKIP_REDIS=${SKIP_REDIS:-1}
if [[ -n ${SKIP_POWERTOOLS:-} && ${SKIP_POWERTOOLS} != 0 ]]; then export SKIP_POWERTOOLS; else unset SKIP_POWERTOOLS; fi
export RUNS=${RUNS:-3} DURATION=${DURATION:-10} WRITE_BASELINE=${WRITE_BASELINE:-0}
export BENCH_OUT=${BENCH_OUT:-/tmp/idem-bench}
bash "$harness/run_peers.sh"
latest="$BENCH_OUT/results/latest"
python3 "$root/bench/summary.py" "$latest" | tee "$latest/SUMMARY.md"
