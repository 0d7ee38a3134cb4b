#!/usr/bin/env bash
# The long chaos run (crates/idem-cli/tests/chaos.rs with IDEM_CHAOS_LONG=1):
# ≥ 10,000 scoped keys over PostgreSQL, MariaDB, Redis and SQLite, three
# gateways each, faults at random; fails on any violation of the checker.
#
#   scripts/chaos.sh [REPORT.md]
#
# Writes the figures as markdown tables to REPORT.md (default
# target/chaos-report.md under CARGO_TARGET_DIR, else ./chaos-report.md).
# Needs, as for the short run: PostgreSQL (/usr/lib/postgresql/*/bin,
# package postgresql), MariaDB (mariadb-server, mariadb-client),
# redis-server, util-linux (setpriv); run as root (PostgreSQL runs as the
# OS user postgres). Environment: IDEM_CHAOS_STORES=postgres,redis to run
# only some stores; IDEM_CHAOS_SEQUENTIAL=0 to run the four stores at
# once (default: one after another); CARGO_TARGET_DIR as for cargo.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
report=${1:-${CARGO_TARGET_DIR:-.}/chaos-report.md}
report=$(realpath -m "$report")
for p in redis-server mariadbd mariadb-install-db mariadb setpriv; do
  command -v "$p" >/dev/null || { echo "scripts/chaos.sh: $p is missing (see the header)" >&2; exit 1; }
done
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 \
  || { echo "scripts/chaos.sh: PostgreSQL's initdb is missing: apt-get install -y postgresql" >&2; exit 1; }
IDEM_CHAOS_LONG=1 IDEM_CHAOS_SEQUENTIAL=${IDEM_CHAOS_SEQUENTIAL:-1} IDEM_CHAOS_REPORT="$report" \
  cargo test --workspace --all-features --test chaos -- --nocapture
echo "figures: $report"
