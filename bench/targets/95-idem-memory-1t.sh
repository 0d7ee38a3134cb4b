# idem gateway, memory store, current-thread runtime (IDEM_RUNTIME_THREADS=1), in front of the harness's upstream. Compare with "nginx proxy -> upstream".
# shellcheck source=../lib/scenarios.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/scenarios.sh"
T_NAME="idem gateway (memory, 1 runtime thread) -> upstream"
T_DESC="idem gateway release build (IDEM_RUNTIME_THREADS=1: one runtime thread), memory:// store, in front of the same node upstream"
T_PORT=18095
T_URL="http://127.0.0.1:$T_PORT/orders"
T_COUNT_URL="http://127.0.0.1:$UPSTREAM_PORT/__count"
T_SCENARIOS="unique repeat nokey"
t_start() {
  RUST_LOG=warn IDEM_RUNTIME_THREADS=1 bench_bg idem-memory-1t "${IDEM_BIN:?set IDEM_BIN to the release build of idem}" gateway \
    --listen 127.0.0.1:$T_PORT --upstream http://127.0.0.1:$UPSTREAM_PORT --store memory://
}
t_stop() { stop_bg idem-memory-1t; }
