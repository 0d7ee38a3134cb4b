# idem gateway, PostgreSQL store (the shared server; a table of its own per run), same upstream.
# shellcheck source=../lib/idem_target.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/idem_target.sh"
pg=${IDEM_BENCH_POSTGRES_URL:-postgres://postgres@127.0.0.1:5432/test}
T_NAME="idem gateway (postgres) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), PostgreSQL store at $pg"
idem_gateway_target idem-postgres 18092 "unique repeat" "$pg?idem_table=idem_bench_{run}"
