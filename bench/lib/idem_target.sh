# Sourced by the `idem gateway` target files (bench/targets/9*.sh): one definition of what the harness
# wants from a target (T_PORT, T_URL, T_COUNT_URL, T_SCENARIOS, t_start, t_stop), so a target file only
# names its store.
# shellcheck source=scenarios.sh
source "$(dirname "${BASH_SOURCE[0]}")/scenarios.sh"
# Nothing carries over from a target sourced earlier into the same shell.
unset T_THREADS T_STORE

# idem_gateway_target ID PORT "SCENARIOS" [STORE_URL]
#   ID         the harness's process name (bench_bg / stop_bg), e.g. idem-sqlite
#   PORT       the gateway's port on 127.0.0.1
#   SCENARIOS  e.g. "unique repeat nokey"
#   STORE_URL  the --store URL, `{run}` in it replaced by the start time (s) so each run gets a table
#              of its own; without it the target defines t_store, which prints the URL when the
#              gateway starts
# Optional before the call: T_THREADS, passed as IDEM_RUNTIME_THREADS (unset: the environment's).
idem_gateway_target() {
  T_ID=$1 T_PORT=$2 T_SCENARIOS=$3 T_STORE=${4:-}
  T_URL="http://127.0.0.1:$T_PORT/orders"
  T_COUNT_URL="http://127.0.0.1:$UPSTREAM_PORT/__count"
}

# The store URL when the target gives none of its own (overridden by target files).
t_store() {
  local url=${T_STORE:?the target sets a store URL or defines t_store}
  echo "${url//\{run\}/$(date +%s)}"
}

t_start() {
  local store bin=${IDEM_BIN:?set IDEM_BIN to the release build of idem}
  store=$(t_store) || return
  local args=(gateway --listen "127.0.0.1:$T_PORT" --upstream "http://127.0.0.1:$UPSTREAM_PORT" --store "$store")
  if [[ -n ${T_THREADS:-} ]]; then
    RUST_LOG=warn IDEM_RUNTIME_THREADS=$T_THREADS bench_bg "$T_ID" "$bin" "${args[@]}"
  else
    RUST_LOG=warn bench_bg "$T_ID" "$bin" "${args[@]}"
  fi
}

t_stop() { stop_bg "$T_ID"; }
