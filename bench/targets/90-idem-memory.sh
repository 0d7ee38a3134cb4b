# idem gateway, memory store, in front of the harness's upstream. Compare with "nginx proxy -> upstream".
# shellcheck source=../lib/idem_target.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/idem_target.sh"
T_NAME="idem gateway (memory) -> upstream"
T_DESC="idem gateway release build (default runtime: a worker per CPU), memory:// store, in front of the same node upstream"
T_THREADS=${IDEM_RUNTIME_THREADS:-0}
idem_gateway_target idem-memory 18090 "unique repeat nokey" memory://
