# idem gateway, Redis store: the harness's own Redis ($REDIS_URL, persistence off), same upstream.
# shellcheck source=../lib/idem_target.sh
source "$(dirname "${BASH_SOURCE[0]}")/../lib/idem_target.sh"
T_NAME="idem gateway (redis) -> upstream"
T_DESC="idem gateway release build (default runtime unless IDEM_RUNTIME_THREADS is set), Redis store at \$REDIS_URL (the harness's Redis)"
idem_gateway_target idem-redis 18094 "unique repeat"
t_store() { echo "${REDIS_URL:?the harness sets REDIS_URL}?idem_prefix=bench$(date +%s)"; }
