# idem gateway, SQLite store (a fresh file per run), in front of the harness's upstream.
# shellcheck source=../lib/idem_target.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/idem_target.sh"
T_NAME="idem gateway (sqlite) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), SQLite file store (WAL, synchronous=FULL), same upstream"
idem_gateway_target idem-sqlite 18091 "unique repeat"
t_store() {
  local db="${RUN_DIR:-/tmp}/idem-bench-sqlite.db"
  rm -f "$db" "$db-wal" "$db-shm"
  echo "sqlite://$db"
}
