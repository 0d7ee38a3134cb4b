#!/usr/bin/env bash
# Instructions per request, counted by callgrind (user-space instructions, Ir), of nginx as a plain reverse
# proxy and of `idem gateway` on its stores, all in front of the harness's node upstream. Only the proxy
# process runs under callgrind; the upstream and the client (bench/lib/instr_client.py) are not counted.
#
#   bench/instructions.sh                       # every case, N=200 M=1200
#   CASES="nginx mem-unique" N=100 M=600 bench/instructions.sh
#
# Start-up cancels by differencing: each case runs twice, serving WARMUP+N and WARMUP+M requests (the same
# warm-up both times, so lazy initialisation is in both), and the figure is (Ir(M) - Ir(N)) / (M - N).
# The M run lasts longer than the N run, so work done per unit of time (timers, the purge loop) is in the
# difference too; the table's "s(M)-s(N)" column says how much longer.
#
# Two corrections, both shown in the table:
# - Time-bound start-up work is left out of each run's total: the inclusive cost of the functions named by
#   EXCLUDE_FN (a regex on callgrind_annotate's names; default quanta::Clock::new, the TSC calibration of
#   the metrics crates, a loop on clock_gettime that runs ~14-18 M instructions, a different number each
#   run, which differencing does not cancel).
# - memcpy: glibc copies of more than ~8 KiB use `rep movsb`, which callgrind counts as ONE instruction PER
#   BYTE (a 64 KiB copy is 65,535 Ir), while the vector loop glibc uses below the threshold costs ~1 Ir per
#   10 bytes. Each case is therefore measured twice (MEMCPY=both, the default): as is ("rep" columns) and
#   with GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold raised so that every copy takes the vector loop
#   ("vector" columns, closer to the work a CPU does). MEMCPY=rep or MEMCPY=vector measures one way only.
# Cases: nginx, mem-unique, mem-replay, mem-nokey, sqlite-unique, redis-unique.
#   unique  a new Idempotency-Key per request (every request a first execution)
#   replay  one key sent once before the warm-up, then repeated with the same body
#   nokey   no Idempotency-Key header (the gateway's pass-through)
# Knobs: N (200), M (1200), WARMUP (20), CONNS (1; keep-alive connections, one request at a time),
#   OUT (/tmp/idem-instr: the table instructions.md, the callgrind files CASE.COUNT.out, logs),
#   IDEM_BIN (default: builds the release binary), REDIS_URL (redis://127.0.0.1:6379),
#   UPSTREAM_PORT (18300), NGINX_PORT (18301), GATEWAY_PORT (18302), IDEM_PEER_HARNESS (../shared/bench, beside
#   the main checkout when run from a git worktree).
# Needs valgrind, nginx, node, python3 (and Redis for redis-unique: it is not started here).
# Annotate a case per request: bench/lib/callgrind_diff.py $OUT/mem-unique.200.out $OUT/mem-unique.1200.out
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
harness=${IDEM_PEER_HARNESS:-$root/../shared/bench}
if [[ -z ${IDEM_PEER_HARNESS:-} && ! -d $harness ]]; then # in a git worktree: beside the main checkout
  common=$(git -C "$root" rev-parse --path-format=absolute --git-common-dir 2>/dev/null || true)
  [[ -n $common ]] && harness=$(dirname "$common")/../shared/bench
fi
: "${N:=200}" "${M:=1200}" "${WARMUP:=20}" "${CONNS:=1}" "${OUT:=/tmp/idem-instr}"
: "${CASES:=nginx mem-unique mem-replay mem-nokey sqlite-unique redis-unique}"
: "${REDIS_URL:=redis://127.0.0.1:6379}" "${EXCLUDE_FN:=quanta::Clock::new}" "${MEMCPY:=both}"
case $MEMCPY in both) variants="rep vector" ;; rep | vector) variants=$MEMCPY ;; *) echo "MEMCPY is both, rep or vector" >&2; exit 1 ;; esac
: "${UPSTREAM_PORT:=18300}" "${NGINX_PORT:=18301}" "${GATEWAY_PORT:=18302}"
client=$root/bench/lib/instr_client.py
upstream_js=$harness/servers/upstream.js

log() { printf '[%(%H:%M:%S)T] %s\n' -1 "$*" >&2; }
die() { log "FAIL: $*"; exit 1; }
((M > N)) || die "M ($M) must be larger than N ($N)"
for tool in valgrind node python3; do command -v "$tool" >/dev/null || die "$tool is not installed"; done
[[ -f $upstream_js ]] || die "no upstream at $upstream_js (set IDEM_PEER_HARNESS)"
[[ " $CASES " = *" nginx "* ]] && { command -v nginx >/dev/null || die "nginx is not installed (apt-get install nginx-light)"; }

if [[ " $CASES " = *" redis-"* ]]; then
  hostport=${REDIS_URL#*://}; hostport=${hostport##*@}; hostport=${hostport%%/*}; hostport=${hostport%%\?*}
  rhost=${hostport%%:*} rport=${hostport##*:}; [[ $rport = "$hostport" ]] && rport=6379
  pong=$( (exec 3<>"/dev/tcp/$rhost/$rport" && printf 'PING\r\n' >&3 && timeout 2 head -c 7 <&3) 2>/dev/null || true)
  [[ $pong = +PONG* ]] || die "Redis does not answer PING on $rhost:$rport (REDIS_URL=$REDIS_URL). Start it, e.g.
  redis-server --port $rport --save '' --appendonly no --daemonize yes   (or: service redis-server start)
or set REDIS_URL, or leave redis-unique out of CASES."
fi

if [[ -z ${IDEM_BIN:-} ]]; then
  IDEM_BIN=${CARGO_TARGET_DIR:-$root/target}/release/idem
  if [[ " $CASES " != " nginx " ]]; then
    log "building $IDEM_BIN (set IDEM_BIN to skip)"
    (cd "$root" && nice -n 19 cargo build --release -p idem-cli) || die "cargo build failed"
  fi
fi

mkdir -p "$OUT/logs" "$OUT/nginx/tmp" "$OUT/nginx/logs"
pids=()
cleanup() {
  local p
  for p in "${pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do
    for _ in $(seq 50); do kill -0 "$p" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$p" 2>/dev/null || true
  done
  pids=()
}
trap cleanup EXIT
trap 'cleanup; exit 130' INT TERM
forget() { local p keep=(); for p in "${pids[@]}"; do [[ $p = "$1" ]] || keep+=("$p"); done; pids=("${keep[@]}"); }

# wait_port PORT PID SECONDS: until 127.0.0.1:PORT accepts, failing if PID dies first
wait_port() {
  local i
  for i in $(seq $(($3 * 10))); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.1
  done
  return 1
}
port_free() { ! (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
for p in "$UPSTREAM_PORT" "$NGINX_PORT" "$GATEWAY_PORT"; do port_free "$p" || die "port $p on 127.0.0.1 is taken"; done

node "$upstream_js" "$UPSTREAM_PORT" >"$OUT/logs/upstream.log" 2>&1 </dev/null &
pids+=($!)
wait_port "$UPSTREAM_PORT" $! 30 || die "the upstream did not start (see $OUT/logs/upstream.log)"

source "$root/bench/lib/nginx_conf.sh"
nginx_conf "$OUT/nginx" "$UPSTREAM_PORT" "$NGINX_PORT" $'master_process off;\ndaemon off;\n'

redis_prefix=
# server_cmd CASE COUNT: sets port, mode, envs (its environment) and cmd (the server's command line, without
# valgrind: valgrind must run the server itself, not `env`, since it does not follow an exec)
server_cmd() {
  case $1 in
  nginx) port=$NGINX_PORT mode=plain envs=() cmd=(nginx -p "$OUT/nginx" -c "$OUT/nginx/nginx.conf") ;;
  mem-* | sqlite-* | redis-*)
    local store
    case $1 in
    mem-*) store=memory:// ;;
    sqlite-*) store=sqlite://$OUT/$1.$2.db; rm -f "$OUT/$1.$2.db" "$OUT/$1.$2.db-wal" "$OUT/$1.$2.db-shm" ;;
    redis-*) redis_prefix=instr$(date +%s%N); store="$REDIS_URL?idem_prefix=$redis_prefix" ;;
    esac
    port=$GATEWAY_PORT mode=${1#*-}
    envs=(RUST_LOG=warn IDEM_RUNTIME_THREADS=1)
    cmd=("$IDEM_BIN" gateway --listen "127.0.0.1:$GATEWAY_PORT"
      --upstream "http://127.0.0.1:$UPSTREAM_PORT" --store "$store")
    ;;
  *) die "unknown case $1 (nginx mem-unique mem-replay mem-nokey sqlite-unique redis-unique)" ;;
  esac
}

# measure CASE COUNT VARIANT: runs the server under callgrind for WARMUP+COUNT requests; sets m_ir (the Ir
# total less EXCLUDE_FN's), m_x (EXCLUDE_FN's inclusive Ir) and m_s (the seconds the requests took). Runs
# in this shell (not $(...)), so the cleanup trap knows its PID. Files: $OUT/CASE.COUNT.out (rep) and
# $OUT/CASE.vector.COUNT.out (vector).
measure() {
  local case=$1 count=$2 port mode envs cmd pid file=$OUT/$1.$2.out t0 t1
  [[ $3 = vector ]] && file=$OUT/$1.vector.$2.out
  server_cmd "$case" "$count"
  [[ $3 = vector ]] && envs+=(GLIBC_TUNABLES=glibc.cpu.x86_rep_movsb_threshold=4294967295)
  rm -f "$file"
  env "${envs[@]}" nice -n 19 valgrind --tool=callgrind --trace-children=no --dump-instr=no --callgrind-out-file="$file" \
    "${cmd[@]}" >"$OUT/logs/$case.$count.log" 2>&1 </dev/null &
  pid=$!
  pids+=("$pid")
  wait_port "$port" "$pid" 300 || { tail -20 "$OUT/logs/$case.$count.log" >&2; die "$case did not start under callgrind"; }
  t0=$EPOCHREALTIME
  python3 "$client" "$port" "$mode" "$case$count$RANDOM" "$WARMUP" "$count" "$CONNS" >/dev/null ||
    die "$case: requests failed (see above)"
  t1=$EPOCHREALTIME
  # SIGTERM: the gateway drains and returns from main, nginx (master_process off) exits; valgrind then
  # writes the callgrind file. A server that does not exit in time gets a dump, then SIGKILL.
  kill -TERM "$pid"
  local i
  for i in $(seq 1200); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  if kill -0 "$pid" 2>/dev/null; then
    log "$case: still running 120 s after SIGTERM; dumping and killing it"
    callgrind_control --dump "$pid" >/dev/null 2>&1 || true
    sleep 2
    kill -KILL "$pid" 2>/dev/null || true
  fi
  wait "$pid" || log "$case: exit status $? (see $OUT/logs/$case.$count.log)"
  forget "$pid"
  if [[ -n $redis_prefix ]] && command -v redis-cli >/dev/null; then # leave the shared Redis as it was
    # the store's names are {PREFIX:HASH}:r, :f and :chg
    redis-cli -u "$REDIS_URL" --scan --pattern "{$redis_prefix:*" | xargs -r -n 500 redis-cli -u "$REDIS_URL" del >/dev/null || true
    redis_prefix=
  fi
  local files=("$file"*)
  [[ -s ${files[0]} ]] || die "$case: callgrind wrote no $file"
  # one file per dump (one, unless callgrind_control --dump ran): add up each file's total (its
  # totals: line, else its summary: line)
  m_ir=$(awk 'FNR == 1 {if (t != "") s += t; t = ""} /^totals:/ {t = $2} /^summary:/ && t == "" {t = $2}
    END {if (t != "") s += t; printf "%d", s}' "${files[@]}")
  ((m_ir > 0)) || die "$case: no summary/totals in $file"
  m_x=0
  if [[ -n $EXCLUDE_FN ]]; then
    local f x
    for f in "${files[@]}"; do
      x=$(callgrind_annotate --inclusive=yes --threshold=100 "$f" |
        awk -v re="$EXCLUDE_FN" '$0 ~ re {gsub(",", "", $1); s += $1} END {printf "%d", s}')
      m_x=$((m_x + x))
    done
    m_ir=$((m_ir - m_x))
  fi
  m_s=$(python3 -c "print('%.1f' % ($t1 - $t0))")
}

rows=()
for case in $CASES; do
  row=$case
  for v in rep vector; do
    if [[ " $variants " != *" $v "* ]]; then row+=" - - - - - -"; continue; fi
    log "$case ($v memcpy): $((WARMUP + N)) requests under callgrind"
    measure "$case" "$N" "$v"
    irn=$m_ir xn=$m_x sn=$m_s
    log "$case ($v memcpy): $((WARMUP + M)) requests under callgrind"
    measure "$case" "$M" "$v"
    row+=" $irn $m_ir $xn $m_x $sn $m_s"
    log "$case ($v memcpy): Ir($N)=$irn Ir($M)=$m_ir (less $xn and $m_x of $EXCLUDE_FN) -> $(((m_ir - irn) / (M - N))) instructions/request"
  done
  rows+=("$row")
done

EXCLUDE_FN=$EXCLUDE_FN python3 - "$N" "$M" "$WARMUP" "$CONNS" "$(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo '?')" "$IDEM_BIN" \
  "${rows[@]}" <<'PY' | tee "$OUT/instructions.md"
import os, sys, time
n, m, warmup, conns, commit, binary = sys.argv[1:7]
n, m = int(n), int(m)
names = {
    "nginx": "nginx plain reverse proxy (1 worker, upstream keep-alive)",
    "mem-unique": "idem gateway, memory, first execution",
    "mem-replay": "idem gateway, memory, replay",
    "mem-nokey": "idem gateway, memory, no key (pass-through)",
    "sqlite-unique": "idem gateway, SQLite, first execution",
    "redis-unique": "idem gateway, Redis, first execution",
}
rows = []
for r in sys.argv[7:]:
    p = r.split()
    case, cols = p[0], []
    for o in (1, 7):
        if p[o] == "-":
            cols.append(None)
            continue
        irn, irm, xn, xm = (int(x) for x in p[o:o + 4])
        cols.append(dict(irn=irn, irm=irm, xn=xn, xm=xm, ds=float(p[o + 5]) - float(p[o + 4]), per=(irm - irn) / (m - n)))
    rows.append((case, cols))
ng = next((c for case, c in rows if case == "nginx"), [None, None])


def cell(c, ref, what):
    if c is None:
        return ""
    if what == "per":
        return format(round(c["per"]), ",")
    if what == "ratio":
        return "%.2f" % (c["per"] / ref["per"]) if ref else ""
    return what(c)


print("Instructions per request (callgrind Ir, user space, the proxy process only): (Ir(M) - Ir(N)) / (M - N),")
print("N=%d M=%d, the same %s warm-up requests in both runs, %s keep-alive connection(s), POST /orders with a" % (n, m, warmup, conns))
print("45-byte JSON body; %s, commit %s, %s." % (time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), commit, binary))
print("rep: memcpy as glibc runs it (copies above ~8 KiB by `rep movsb`, which callgrind counts 1 Ir per byte);")
print("vector: glibc.cpu.x86_rep_movsb_threshold raised, every copy by the vector loop (~1 Ir per 10 bytes).")
print("Each run's total leaves out the inclusive cost of %s (time-bound start-up): 'left out' (N run / M run)." % (os.environ.get("EXCLUDE_FN") or "nothing"))
print()
print("| case | instr/request (rep) | × nginx | instr/request (vector) | × nginx | Ir(N) / Ir(M) (rep) | left out | s(M) − s(N) |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
for case, (r, v) in rows:
    any_ = r or v
    print("| %s | %s | %s | %s | %s | %s | %s | %.1f |" % (
        names.get(case, case), cell(r, None, "per"), cell(r, ng[0], "ratio"), cell(v, None, "per"), cell(v, ng[1], "ratio"),
        "%s / %s" % (format(any_["irn"], ","), format(any_["irm"], ",")),
        "%.1f M / %.1f M" % (any_["xn"] / 1e6, any_["xm"] / 1e6), any_["ds"]))
PY
