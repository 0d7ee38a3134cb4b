# idem gateway, SQLite store (a fresh file per run), in front of the harness's upstream.
# shellcheck source=../lib/scenarios.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/scenarios.sh"
T_NAME="idem gateway (sqlite) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), SQLite file store (WAL, synchronous=FULL), same upstream"
T_PORT=18091
T_URL="http://127.0.0.1:$T_PORT/orders"
T_COUNT_URL="http://127.0.0.1:$UPSTREAM_PORT/__count"
T_SCENARIOS="unique repeat"
t_start() {
  local db="${RUN_DIR:-/tmp}/idem-bench-sqlite.db"
  rm -f "$db" "$db-wal" "$db-shm"
  RUST_LOG=warn bench_bg idem-sqlite "${IDEM_BIN:?set IDEM_BIN to the release build of idem}" gateway \
    --listen 127.0.0.1:$T_PORT --upstream http://127.0.0.1:$UPSTREAM_PORT --store "sqlite://$db"
}
t_stop() { stop_bg idem-sqlite; }
