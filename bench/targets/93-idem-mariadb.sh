# idem gateway, MySQL/MariaDB store (the shared server; a table of its own per run), same upstream.
# shellcheck source=../lib/idem_target.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/idem_target.sh"
my=${IDEM_BENCH_MYSQL_URL:-mysql://root@127.0.0.1:3306/test}
T_NAME="idem gateway (mariadb) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), MariaDB store at $my"
idem_gateway_target idem-mariadb 18093 "unique repeat" "$my?idem_table=idem_bench_{run}"
