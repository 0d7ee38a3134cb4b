//! `rediss://` store URLs against TLS-only `redis-server`s this binary
//! starts on loopback (`tls_servers`, shared with idem-sql's TLS tests): a
//! core subset of the conformance suite over a connection verified with
//! the CA named by `idem_tls_ca`, the system's roots refusing the test CA,
//! a wrong CA and a wrong host refused, `#insecure` refused, and client
//! certificates (`idem_tls_cert` / `idem_tls_key`) for a server with
//! `--tls-auth-clients yes`.
//!
//! `cargo test -p idem-redis --features tls --test tls_tests`

#[path = "../../idem-sql/tests/tls_servers/mod.rs"]
mod tls_servers;

use std::time::Duration;

use idem_core::{Store, StoreError};
use idem_redis::{RedisStore, RedisUrl};
use idem_testkit::support::{acquire, fp, fresh_key, fresh_scope, random_hex, req, response};
use idem_testkit::SleepingHarness;
use tls_servers::{chain, expect_connect_error, TlsFiles, TlsServer};

fn p(path: &std::path::Path) -> String {
    TlsFiles::param(path)
}

/// `rediss://<host>:<port>/?<query>` on `server`.
fn url(server: &TlsServer, host: &str, query: &str) -> String {
    format!("rediss://{host}:{}/?{query}", server.port)
}

/// The store a URL names, as the gateway opens it: [`RedisUrl::parse`],
/// then [`RedisStore::connect_with`] with a prefix of the check's own.
async fn open(url: &str) -> Result<RedisStore, StoreError> {
    let u = RedisUrl::parse(url)?;
    let prefix = format!("idem-tls-{}", random_hex(8));
    let o = u
        .options
        .with_key_prefix(prefix)
        .with_keep_expired(Duration::from_secs(30));
    RedisStore::connect_with(u.url.expose(), o).await
}

/// `idem_tls_ca` names the CA that signed the server's certificate (for
/// `localhost`).
fn verified_url() -> String {
    let s = tls_servers::redis();
    url(s, "localhost", &format!("idem_tls_ca={}", p(&s.files.ca)))
}

async fn harness() -> SleepingHarness<RedisStore> {
    SleepingHarness(
        open(&verified_url())
            .await
            .unwrap_or_else(|e| panic!("Redis over TLS: {}", chain(&e))),
    )
}

idem_testkit::conformance_tests!(@core conformance, harness);

/// A claim and its result over a verified `rediss://` connection.
async fn round_trip(store: &RedisStore) {
    let (scope, key) = (fresh_scope(), fresh_key("tls"));
    let r = req(&scope, &key, fp("a"), Duration::from_secs(60));
    let lease = acquire(store, &r).await;
    store
        .complete(&lease, &response("over TLS"), Duration::from_secs(60))
        .await
        .expect("complete");
    assert!(store.get(&scope, &key).await.expect("get").is_some());
}

/// Without `idem_tls_ca`, the system's root certificates are used, and
/// they do not know the test CA: refused at connect, saying why.
#[tokio::test]
async fn system_roots_do_not_trust_the_test_ca() {
    let s = tls_servers::redis();
    expect_connect_error(
        "system roots",
        open(&url(s, "localhost", "")).await,
        &["invalid peer certificate: UnknownIssuer"],
    );
}

/// A CA that did not sign the server's certificate: refused.
#[tokio::test]
async fn another_ca_fails() {
    let s = tls_servers::redis();
    let query = format!("idem_tls_ca={}", p(&s.files.other_ca));
    expect_connect_error(
        "wrong CA",
        open(&url(s, "localhost", &query)).await,
        &["invalid peer certificate: UnknownIssuer"],
    );
}

/// The certificate names `localhost`; `127.0.0.1` is another host.
#[tokio::test]
async fn another_host_fails() {
    let s = tls_servers::redis();
    let query = format!("idem_tls_ca={}", p(&s.files.ca));
    expect_connect_error(
        "wrong host",
        open(&url(s, "127.0.0.1", &query)).await,
        &["certificate not valid for name"],
    );
}

/// `#insecure` (redis-rs: accept any certificate) is a configuration
/// error, through the URL reader and through `RedisStore::connect` alike.
#[tokio::test]
async fn insecure_is_refused() {
    let s = tls_servers::redis();
    let insecure = format!("rediss://localhost:{}/#insecure", s.port);
    for got in [open(&insecure).await, RedisStore::connect(&insecure).await] {
        match got {
            Err(StoreError::Config(m)) => assert!(m.contains("#insecure"), "{m}"),
            Err(e) => panic!("not a config error: {e:?}"),
            Ok(_) => panic!("#insecure must be refused"),
        }
    }
}

/// A server that checks clients: with `idem_tls_cert` and `idem_tls_key`
/// the store connects and works; without them the server refuses the
/// handshake (`CertificateRequired`).
#[tokio::test]
async fn client_certificate() {
    let s = tls_servers::redis_mtls();
    let ca = format!("idem_tls_ca={}", p(&s.files.ca));
    let with = format!(
        "{ca}&idem_tls_cert={}&idem_tls_key={}",
        p(&s.files.client_cert),
        p(&s.files.client_key)
    );
    let store = open(&url(s, "localhost", &with))
        .await
        .unwrap_or_else(|e| panic!("client certificate: {}", chain(&e)));
    round_trip(&store).await;
    expect_connect_error(
        "no client certificate",
        open(&url(s, "localhost", &ca)).await,
        &["CertificateRequired"],
    );
}

/// A Redis Cluster over TLS (`rediss+cluster://`): the CA given once
/// reaches every node, the ones found by redirection too; without it the
/// system's roots refuse the test CA.
mod cluster {
    use super::*;

    fn cluster_url(query: &str) -> String {
        let c = tls_servers::redis_cluster();
        let nodes: Vec<String> = c.ports.iter().map(|p| format!("127.0.0.1:{p}")).collect();
        format!("rediss+cluster://{}/?{query}", nodes.join(","))
    }

    async fn cluster_harness() -> SleepingHarness<RedisStore> {
        let ca = p(&tls_servers::redis_cluster().files.ca);
        SleepingHarness(
            open(&cluster_url(&format!("idem_tls_ca={ca}")))
                .await
                .unwrap_or_else(|e| panic!("Redis Cluster over TLS: {}", chain(&e))),
        )
    }

    idem_testkit::conformance_tests!(@module conformance, cluster_harness;
        store_checks: [
            claim_once,
            concurrent_begins_one_winner,
            complete_then_replay,
            release_then_reclaim,
            get_and_delete,
            wait_for_change_returns_early_on_complete,
            purge_expired_removes_only_expired,
        ]
        admin_checks: [list_filters_by_state_and_scope]
        engine_checks: []
        token_checks: []
    );

    /// Many keys, so every primary (slot ranges) is written over TLS.
    #[tokio::test]
    async fn keys_on_every_primary() {
        let store = cluster_harness().await.0;
        for _ in 0..30 {
            round_trip(&store).await;
        }
    }

    #[tokio::test]
    async fn system_roots_do_not_trust_the_test_ca() {
        expect_connect_error(
            "cluster, system roots",
            open(&cluster_url("")).await,
            &["UnknownIssuer"],
        );
    }
}
