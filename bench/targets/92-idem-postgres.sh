# idem gateway, PostgreSQL store (the shared server; a table of its own per run), same upstream.
# shellcheck source=../lib/scenarios.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/scenarios.sh"
T_NAME="idem gateway (postgres) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), PostgreSQL store at ${IDEM_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}"
T_PORT=18092
T_URL="http://127.0.0.1:$T_PORT/orders"
T_COUNT_URL="http://127.0.0.1:$UPSTREAM_PORT/__count"
T_SCENARIOS="unique repeat"
t_start() {
  local table="idem_bench_$(date +%s)"
  RUST_LOG=warn bench_bg idem-postgres "${IDEM_BIN:?set IDEM_BIN to the release build of idem}" gateway \
    --listen 127.0.0.1:$T_PORT --upstream http://127.0.0.1:$UPSTREAM_PORT \
    --store "${IDEM_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}?idem_table=$table"
}
t_stop() { stop_bg idem-postgres; }
