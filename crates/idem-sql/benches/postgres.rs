//! `PostgresStore` throughput against the server at `IDEM_TEST_POSTGRES_URL`
//! (default `postgres://postgres@127.0.0.1:5432/test`), in a schema of its
//! own that is dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: two statements, two commits), and a replay
//! (`begin` on a completed key: one read-only statement).
//!
//! `cargo bench -p idem-sql --bench postgres`

mod common;

use common::servers::Server;
use idem_sql::{PostgresOptions, PostgresStore};

common::server_bench!(
    "postgres", Server::Postgres,
    |url, schema| PostgresStore::connect_with(PostgresOptions::new(&url).with_schema(&schema)),
    drop: "DROP SCHEMA IF EXISTS \"{0}\" CASCADE"
);
