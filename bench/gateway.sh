#!/usr/bin/env bash
# Gateway load benchmark, one command, side by side in ONE run on 127.0.0.1:
# the upstream called directly, nginx as a plain reverse proxy, and `idem gateway`
# with the memory, SQLite, PostgreSQL, MariaDB and Redis stores, all in front of
# the same upstream, measured with wrk (32 connections, median of RUNS runs).
#
#   bench/gateway.sh                 # RUNS=3 DURATION=10 by default
#   RUNS=1 DURATION=3 bench/gateway.sh
#
# It uses the peer harness in ../shared/bench (the upstream, wrk script, machine
# guard and report); that folder installs wrk, nginx and Redis from Debian's
# packages. PostgreSQL and MariaDB are the ones on 127.0.0.1 (see scripts/test.sh).
# Results: $BENCH_OUT/results/latest/ (default /tmp/idem-bench).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
harness=${IDEM_PEER_HARNESS:-$root/../shared/bench}
[ -f "$harness/run_peers.sh" ] || { echo "bench/gateway.sh: the peer harness is not at $harness (set IDEM_PEER_HARNESS)" >&2; exit 1; }
(cd "$root" && cargo build --release -p idem-cli)
export IDEM_BIN=${IDEM_BIN:-${CARGO_TARGET_DIR:-$root/target}/release/idem}
export EXTRA_TARGETS="$root/bench/targets"
export TARGETS=${TARGETS:-"upstream nginx-proxy idem-memory idem-sqlite idem-postgres idem-mariadb idem-redis"}
export SKIP_POWERTOOLS=${SKIP_POWERTOOLS:-1} SKIP_REDIS=${SKIP_REDIS:-1}
export RUNS=${RUNS:-3} DURATION=${DURATION:-10}
exec bash "$harness/run_peers.sh"
