#!/usr/bin/env bash
# The project's test command: formatting, lints, then every test of the
# workspace (unit, integration, doc tests and the Python end-to-end test).
#
#   ./scripts/test.sh
#
# Servers a test needs (PostgreSQL, MariaDB, Redis on loopback) are checked,
# and started or installed when possible, by need_service before the tests
# run. Environment:
#   CARGO_TARGET_DIR        where cargo builds (.ci/run points it outside the clone)
#   IDEM_TEST_POSTGRES_URL, IDEM_TEST_MYSQL_URL, IDEM_TEST_REDIS_URL
#                           use another server (its local check is skipped)
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."

log() { printf '\n==> %s\n' "$*"; }
die() { printf '\nscripts/test.sh: %s\n' "$*" >&2; exit 1; }

apt_updated=0
# apt_install PKG...: installs Debian packages when we are root; fails otherwise.
apt_install() {
  if [ "$(id -u)" != 0 ]; then
    return 1
  fi
  command -v apt-get >/dev/null 2>&1 || return 1
  if [ "$apt_updated" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq || return 1
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
}

# need_service NAME CHECK_CMD START_CMD DEBIAN_PKG
#   Makes sure a server a test needs is up: runs CHECK_CMD; when it fails,
#   installs DEBIAN_PKG if the server's program is missing (as root, via
#   apt-get), runs START_CMD, and waits up to 30 s for CHECK_CMD to pass.
#   Fails loudly, naming the start command, when none of that works.
#   The commands are shell strings (see /work/shared/SERVICES.md), e.g.
#     need_service redis "redis-cli -h 127.0.0.1 ping" \
#       "redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save '' --appendonly no" \
#       redis-server
need_service() {
  local name=$1 check=$2 start=$3 pkg=$4
  if bash -c "$check" >/dev/null 2>&1; then
    echo "service $name: up"
    return 0
  fi
  local prog
  prog=$(set -- $start; echo "$1")
  if [ "$prog" = start-stop-daemon ]; then
    # The program is the argument of --exec.
    prog=$(echo "$start" | sed -n 's/.*--exec \([^ ]*\).*/\1/p')
  fi
  if ! command -v "$prog" >/dev/null 2>&1 && [ ! -x "$prog" ]; then
    echo "service $name: $prog is not installed; installing Debian package $pkg"
    apt_install "$pkg" \
      || die "service $name is down and package $pkg could not be installed (need root and apt-get). Install it, then start it with: $start"
  fi
  echo "service $name: down; starting it with: $start"
  bash -c "$start" || die "service $name: the start command failed: $start"
  local i
  for i in $(seq 1 60); do
    if bash -c "$check" >/dev/null 2>&1; then
      echo "service $name: up"
      return 0
    fi
    sleep 0.5
  done
  die "service $name did not come up within 30 s. Check: $check   Start: $start"
}

# need_program PROG DEBIAN_PKG: a program the tests run.
need_program() {
  local prog=$1 pkg=$2
  command -v "$prog" >/dev/null 2>&1 && return 0
  echo "$prog is missing; installing Debian package $pkg"
  apt_install "$pkg" || die "$prog is needed by the tests; install it (Debian package $pkg)"
  command -v "$prog" >/dev/null 2>&1 || die "$prog is still missing after installing $pkg"
}

command -v cargo >/dev/null 2>&1 || die "cargo is not on PATH (install Rust, or source ~/.cargo/env)"

# The end-to-end test drives the gateway from Python (standard library only).
need_program python3 python3
# The status page test (crates/idem-cli/tests/status_page.rs) drives headless Chromium.
need_program chromium chromium

# Servers the tests talk to (crates/idem-sql/tests/{postgres,mysql}_tests.rs,
# crates/idem-redis/tests/). Commands and packages: /work/shared/SERVICES.md.
# A test pointed at another server by its IDEM_TEST_*_URL skips the local check.
if [ -z "${IDEM_TEST_POSTGRES_URL:-}" ]; then
  need_service postgresql "pg_isready -h 127.0.0.1 -p 5432" \
    "pg_ctlcluster --skip-systemctl-redirect \$(ls /etc/postgresql) main start" postgresql
fi
if [ -z "${IDEM_TEST_MYSQL_URL:-}" ]; then
  need_service mariadb "mariadb-admin -h127.0.0.1 -uroot ping" \
    "start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd" mariadb-server
fi
if [ -z "${IDEM_TEST_REDIS_URL:-}" ]; then
  need_service redis "redis-cli -h 127.0.0.1 ping" \
    "redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save '' --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log" \
    redis-server
fi
# The message-consumer tests (crates/idem-mq/tests/{nats,amqp}_tests.rs,
# examples/payments-consumer/tests) need NATS with JetStream and RabbitMQ.
if [ -z "${IDEM_TEST_NATS_URL:-}" ]; then
  need_service nats "timeout 2 bash -c '</dev/tcp/127.0.0.1/4222'" \
    "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log" \
    nats-server
fi
if [ -z "${IDEM_TEST_AMQP_URL:-}" ]; then
  need_service rabbitmq "timeout 2 bash -c '</dev/tcp/127.0.0.1/5672'" \
    "rabbitmq-server -detached" rabbitmq-server
fi
# The Redis Cluster tests start their own redis-server processes.
need_program redis-server redis-server
need_program redis-cli redis-tools
# The TLS store tests (crates/idem-sql/tests/tls_servers/) start their own
# TLS-only PostgreSQL (initdb and postgres under /usr/lib/postgresql/*/bin,
# run as the postgres user by setpriv), MariaDB and redis-server.
need_program pg_ctlcluster postgresql
need_program psql postgresql-client
need_program setpriv util-linux
need_program mariadb-install-db mariadb-server
need_program mariadb mariadb-client

start=$(date +%s)

log "scripts/model.sh (the key protocol's spin model, docs/model/)"
./scripts/model.sh || die "the key protocol's model failed (see above; docs/model/README.md)"

log "cargo fmt --all -- --check"
cargo fmt --all -- --check || die "cargo fmt --check failed (see above); where it shows differences, run 'cargo fmt --all'"

log "python3 scripts/module-cycles.py"
python3 scripts/module-cycles.py || die "two modules of one crate import each other (see above): move what both need into a third module"

log "cargo clippy --workspace --all-targets --all-features -- -D warnings"
cargo clippy --workspace --all-targets --all-features -- -D warnings

log "cargo test --workspace --all-features --no-fail-fast"
out=$(mktemp)
trap 'rm -f "$out"' EXIT
# --no-fail-fast: every test binary runs, so one run shows every failure.
set +e
cargo test --workspace --all-features --no-fail-fast 2>&1 | tee "$out"
status=${PIPESTATUS[0]}
set -e

# One closing line for the whole run, summed over every test binary and the
# doc tests ("test result: ok. 12 passed; 0 failed; 1 ignored; ...").
totals=$(awk '/^test result:/ {
    for (i = 1; i <= NF; i++) {
      if ($(i+1) ~ /^passed/)  p += $i
      if ($(i+1) ~ /^failed/)  f += $i
      if ($(i+1) ~ /^ignored/) s += $i
    }
  } END { printf "%d %d %d", p, f, s }' "$out")
read -r passed failed skipped <<<"$totals"

echo
if [ "$status" != 0 ]; then
  echo "scripts/test.sh: cargo test failed (exit $status; see the failures above)"
  echo "tests: $passed passed, $failed failed, $skipped skipped"
  exit "$status"
fi
[ "$passed" -gt 0 ] || die "cargo test ran no test"
echo "scripts/test.sh: fmt, clippy and tests passed in $(( $(date +%s) - start )) s"
echo "tests: $passed passed, $failed failed, $skipped skipped"
