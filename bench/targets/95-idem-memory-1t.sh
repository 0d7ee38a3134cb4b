# idem gateway, memory store, current-thread runtime (IDEM_RUNTIME_THREADS=1), in front of the harness's upstream. Compare with "nginx proxy -> upstream".
# shellcheck source=../lib/idem_target.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/idem_target.sh"
T_NAME="idem gateway (memory, 1 runtime thread) -> upstream"
T_DESC="idem gateway release build (IDEM_RUNTIME_THREADS=1: one runtime thread), memory:// store, in front of the same node upstream"
T_THREADS=1
idem_gateway_target idem-memory-1t 18095 "unique repeat nokey" memory://
