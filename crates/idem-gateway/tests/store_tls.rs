//! The gateway's `open_store` with TLS store URLs, against TLS-only
//! PostgreSQL, MariaDB and Redis servers this binary starts on loopback
//! (idem-sql's `tls_servers`): each store opens over a verified connection
//! and keeps a claim and its result; a certificate for another host, and
//! `rediss://…#insecure`, fail at start with an error that says why.
//!
//! `cargo test -p idem-gateway --test store_tls`

#![cfg(all(feature = "postgres", feature = "mysql", feature = "redis-tls"))]

#[path = "../../idem-sql/tests/tls_servers/mod.rs"]
mod tls_servers;

use std::time::Duration;

use idem_core::StoreError;
use idem_gateway::{open_store_with, StoreOptions};
use idem_testkit::support::{acquire, fp, fresh_key, fresh_scope, random_hex, req, response};
use tls_servers::{chain, expect_connect_error, TlsFiles};

fn options() -> StoreOptions {
    StoreOptions::default()
        .with_pool_size(4)
        .with_timeout(Duration::from_secs(5))
}

/// Opens `url` as the gateway does and keeps one claim and its result.
async fn opens_and_works(url: &str) {
    let store = open_store_with(url, &options())
        .await
        .unwrap_or_else(|e| panic!("open_store({url}): {}", chain(&e)));
    let (scope, key) = (fresh_scope(), fresh_key("tls"));
    let r = req(&scope, &key, fp("a"), Duration::from_secs(60));
    let lease = acquire(&*store, &r).await;
    store
        .complete(&lease, &response("over TLS"), Duration::from_secs(60))
        .await
        .expect("complete");
    assert!(store.get(&scope, &key).await.expect("get").is_some());
}

/// Opening `url` fails at connect (not by running out of time), and the
/// error chain holds `needle`.
async fn fails_at_start(url: &str, needle: &str) {
    expect_connect_error(url, open_store_with(url, &options()).await, &[needle]);
}

fn p(path: &std::path::Path) -> String {
    TlsFiles::param(path)
}

#[tokio::test]
async fn postgres_verify_full() {
    let s = tls_servers::postgres();
    let q = format!(
        "sslmode=verify-full&sslrootcert={}&idem_schema=idem_t_{}",
        p(&s.files.ca),
        random_hex(8)
    );
    opens_and_works(&format!(
        "postgres://postgres@localhost:{}/postgres?{q}",
        s.port
    ))
    .await;
    fails_at_start(
        &format!("postgres://postgres@127.0.0.1:{}/postgres?{q}", s.port),
        "invalid peer certificate: certificate not valid for name \"127.0.0.1\"",
    )
    .await;
    // A CA file that is not there: a configuration error naming it.
    let missing = format!(
        "postgres://postgres@localhost:{}/postgres?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem",
        s.port
    );
    match open_store_with(&missing, &options()).await {
        Err(StoreError::Config(m)) => {
            assert!(m.contains("sslrootcert \"/nonexistent/ca.pem\""), "{m}")
        }
        other => panic!(
            "a missing CA file must be a config error: {:?}",
            other.err()
        ),
    }
}

#[tokio::test]
async fn mariadb_verify_identity() {
    let s = tls_servers::mariadb();
    let q = format!(
        "ssl-mode=VERIFY_IDENTITY&ssl-ca={}&idem_table=idem_t_{}",
        p(&s.files.ca),
        random_hex(8)
    );
    opens_and_works(&format!("mariadb://idem@localhost:{}/test?{q}", s.port)).await;
    fails_at_start(
        &format!("mariadb://idem@127.0.0.1:{}/test?{q}", s.port),
        "certificate not valid for name \"127.0.0.1\"",
    )
    .await;
}

#[tokio::test]
async fn rediss_with_a_private_ca() {
    let s = tls_servers::redis();
    let prefix = random_hex(8);
    let base = format!("rediss://localhost:{}/?idem_prefix=t{prefix}", s.port);
    opens_and_works(&format!("{base}&idem_tls_ca={}", p(&s.files.ca))).await;
    fails_at_start(&base, "invalid peer certificate: UnknownIssuer").await;
    match open_store_with(&format!("{base}#insecure"), &options()).await {
        Err(StoreError::Config(m)) => assert!(m.contains("#insecure"), "{m}"),
        other => panic!("#insecure must be a config error: {:?}", other.err()),
    }
}
