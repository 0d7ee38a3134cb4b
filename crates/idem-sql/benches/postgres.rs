//! `PostgresStore` throughput against the server at `IDEM_TEST_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`), in a schema of its
//! own that is dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: two statements, two commits), and a replay
//! (`begin` on a completed key: one read-only statement).
//!
//! `cargo bench -p idem-sql --bench postgres`

// `criterion_group!` defines an undocumented `pub fn`.
#![allow(missing_docs)]

mod common;
#[path = "../tests/servers/mod.rs"]
mod servers;

use idem_sql::{PostgresOptions, PostgresStore};

common::server_bench!(
    "postgres", "PostgreSQL", servers::pg_url, servers::START_PG,
    |url, schema| PostgresStore::connect_with(PostgresOptions::new(&url).with_schema(&schema)),
    drop: "DROP SCHEMA IF EXISTS \"{0}\" CASCADE"
);
