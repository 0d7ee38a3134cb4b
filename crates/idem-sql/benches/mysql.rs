//! `MySqlStore` throughput against the server at `IDEM_TEST_MYSQL_URL`
//! (default `mysql://root@127.0.0.1:3306/test`), on tables of its own that
//! are dropped at the end: a claim and its completion (`begin` then
//! `complete` on a fresh key: a read, the claim transaction, one update),
//! and a replay (`begin` on a completed key: one read).
//!
//! `cargo bench -p idem-sql --bench mysql`

mod common;

use common::servers::Server;
use idem_sql::{MySqlOptions, MySqlStore};

common::server_bench!(
    "mysql", Server::MySql,
    |url, table| MySqlStore::connect_with(MySqlOptions::new(&url).with_table(&table)),
    drop: "DROP TABLE IF EXISTS `{0}`, `{0}_fence`"
);
