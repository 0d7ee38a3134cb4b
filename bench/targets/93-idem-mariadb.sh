# idem gateway, MySQL/MariaDB store (the shared server; a table of its own per run), same upstream.
# shellcheck source=../lib/scenarios.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/scenarios.sh"
T_NAME="idem gateway (mariadb) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), MariaDB store at ${IDEM_BENCH_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}"
T_PORT=18093
T_URL="http://127.0.0.1:$T_PORT/orders"
T_COUNT_URL="http://127.0.0.1:$UPSTREAM_PORT/__count"
T_SCENARIOS="unique repeat"
t_start() {
  local table="idem_bench_$(date +%s)"
  RUST_LOG=warn bench_bg idem-mariadb "${IDEM_BIN:?set IDEM_BIN to the release build of idem}" gateway \
    --listen 127.0.0.1:$T_PORT --upstream http://127.0.0.1:$UPSTREAM_PORT \
    --store "${IDEM_BENCH_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}?idem_table=$table"
}
t_stop() { stop_bg idem-mariadb; }
