# idem gateway, Redis store: the harness's own Redis ($REDIS_URL, persistence off), same upstream.
# shellcheck source=../lib/scenarios.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/scenarios.sh"
T_NAME="idem gateway (redis) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), Redis store at \$REDIS_URL (the harness's Redis)"
T_PORT=18094
T_URL="http://127.0.0.1:$T_PORT/orders"
T_COUNT_URL="http://127.0.0.1:$UPSTREAM_PORT/__count"
T_SCENARIOS="unique repeat"
t_start() {
  RUST_LOG=warn bench_bg idem-redis "${IDEM_BIN:?set IDEM_BIN to the release build of idem}" gateway \
    --listen 127.0.0.1:$T_PORT --upstream http://127.0.0.1:$UPSTREAM_PORT \
    --store "${REDIS_URL:?the harness sets REDIS_URL}?idem_prefix=bench$(date +%s)"
}
t_stop() { stop_bg idem-redis; }
