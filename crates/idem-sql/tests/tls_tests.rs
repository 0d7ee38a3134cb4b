//! PostgreSQL and MariaDB over TLS: the store URL's TLS parameters reach
//! sqlx unchanged (PostgreSQL `sslmode`, `sslrootcert`, `sslcert`,
//! `sslkey`; MySQL `ssl-mode`, `ssl-ca`, `ssl-cert`, `ssl-key`), against
//! servers this binary starts on loopback with TLS required
//! (`tls_servers`): a core subset of the conformance suite over a verified
//! TLS connection, the connection really encrypted, the right CA and name
//! accepted, a wrong CA, a wrong host name, a missing client certificate
//! and a plain connection refused with an error that says why.
//!
//! `cargo test -p idem-sql --test tls_tests` (needs initdb/postgres,
//! mariadb-install-db/mariadbd and the clients psql and mariadb; runs as
//! root or as a user that may `setpriv` to `postgres`).

mod tls_servers;

use idem_core::StoreError;
use idem_sql::{MySqlOptions, MySqlStore, PostgresOptions, PostgresStore};
use idem_testkit::support::random_hex;
use idem_testkit::SleepingHarness;
use tls_servers::{chain, expect_connect_error, TlsFiles, TlsServer};

fn p(path: &std::path::Path) -> String {
    TlsFiles::param(path)
}

// ---- PostgreSQL ----

fn pg() -> &'static TlsServer {
    tls_servers::postgres()
}

/// `postgres://postgres@<host>:<port>/<db>?<query>` on the TLS server.
fn pg_url(host: &str, db: &str, query: &str) -> String {
    format!("postgres://postgres@{host}:{}/{db}?{query}", pg().port)
}

/// Verified TLS: the server's certificate chains to the test CA and names
/// `localhost`.
fn pg_verified_url() -> String {
    let ca = p(&pg().files.ca);
    pg_url(
        "localhost",
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    )
}

async fn pg_open(url: &str) -> Result<PostgresStore, StoreError> {
    let o = PostgresOptions::from_url(url)?
        .with_schema(format!("idem_t_{}", random_hex(8)))
        .with_max_connections(8);
    PostgresStore::connect_with(o).await
}

async fn pg_harness() -> SleepingHarness<PostgresStore> {
    SleepingHarness(
        pg_open(&pg_verified_url())
            .await
            .unwrap_or_else(|e| panic!("PostgreSQL over TLS: {}", chain(&e))),
    )
}

/// Whether the pool's connection is encrypted, by the server's account.
async fn pg_ssl(store: &PostgresStore) -> bool {
    sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(store.pool())
        .await
        .expect("pg_stat_ssl")
}

mod postgres_tls {
    use super::*;

    idem_testkit::conformance_tests!(@core conformance, pg_harness);

    /// `verify-full` with the right CA and host name connects, encrypted.
    #[tokio::test]
    async fn verify_full_with_the_ca_is_encrypted() {
        let s = pg_open(&pg_verified_url()).await.expect("verify-full");
        assert!(pg_ssl(&s).await, "the connection is not encrypted");
    }

    /// `verify-full` for a host the certificate does not name (it names
    /// `localhost`, the URL `127.0.0.1`) fails at once, naming the cause.
    #[tokio::test]
    async fn verify_full_for_another_host_fails() {
        let ca = p(&pg().files.ca);
        let url = pg_url(
            "127.0.0.1",
            "postgres",
            &format!("sslmode=verify-full&sslrootcert={ca}"),
        );
        expect_connect_error(
            "wrong host",
            pg_open(&url).await,
            &["invalid peer certificate: certificate not valid for name \"127.0.0.1\""],
        );
    }

    /// `verify-ca` with the right CA connects. In this build it checks the
    /// host name too, like `verify-full` (stricter than libpq): sqlx 0.8.6
    /// skips only rustls's `NotValidForName`, and rustls 0.23 now reports
    /// `NotValidForNameContext`. Should sqlx change that, this test fails
    /// and docs/STORES.md's TLS paragraph needs its note removed.
    #[tokio::test]
    async fn verify_ca_works_and_checks_the_name_too() {
        let ca = p(&pg().files.ca);
        let query = format!("sslmode=verify-ca&sslrootcert={ca}");
        let s = pg_open(&pg_url("localhost", "postgres", &query))
            .await
            .expect("verify-ca");
        assert!(pg_ssl(&s).await);
        expect_connect_error(
            "verify-ca, another host",
            pg_open(&pg_url("127.0.0.1", "postgres", &query)).await,
            &["certificate not valid for name"],
        );
    }

    /// A CA that did not sign the server's certificate: refused.
    #[tokio::test]
    async fn another_ca_fails() {
        let other = p(&pg().files.other_ca);
        let url = pg_url(
            "localhost",
            "postgres",
            &format!("sslmode=verify-full&sslrootcert={other}"),
        );
        expect_connect_error(
            "wrong CA",
            pg_open(&url).await,
            &["certificate", "UnknownIssuer"],
        );
    }

    /// Without `sslrootcert`, the system's roots do not know the test CA.
    #[tokio::test]
    async fn system_roots_do_not_trust_the_test_ca() {
        let url = pg_url("localhost", "postgres", "sslmode=verify-full");
        expect_connect_error("system roots", pg_open(&url).await, &["UnknownIssuer"]);
    }

    /// `sslmode=disable` against a server that allows only TLS: refused by
    /// the server, which says so.
    #[tokio::test]
    async fn disable_against_a_tls_only_server_fails() {
        let url = pg_url("localhost", "postgres", "sslmode=disable");
        expect_connect_error("sslmode=disable", pg_open(&url).await, &["no encryption"]);
    }

    /// `sslmode=require` encrypts without checking the certificate;
    /// without `sslmode` sqlx prefers TLS.
    #[tokio::test]
    async fn require_and_the_default_encrypt() {
        for query in ["sslmode=require", ""] {
            let s = pg_open(&pg_url("localhost", "postgres", query))
                .await
                .unwrap_or_else(|e| panic!("{query:?}: {}", chain(&e)));
            assert!(pg_ssl(&s).await, "{query:?}");
        }
    }

    /// A database that asks for a client certificate: `sslcert` and
    /// `sslkey` pass through; without them the server refuses.
    #[tokio::test]
    async fn client_certificate() {
        let f = &pg().files;
        let base = format!("sslmode=verify-full&sslrootcert={}", p(&f.ca));
        let with = format!(
            "{base}&sslcert={}&sslkey={}",
            p(&f.client_cert),
            p(&f.client_key)
        );
        let s = pg_open(&pg_url("localhost", "certdb", &with))
            .await
            .unwrap_or_else(|e| panic!("client certificate: {}", chain(&e)));
        assert!(pg_ssl(&s).await);
        expect_connect_error(
            "no client certificate",
            pg_open(&pg_url("localhost", "certdb", &base)).await,
            &["certificate"],
        );
    }

    /// The URL's TLS parameters reach sqlx unchanged, `idem_*` taken out
    /// (the files must exist: they are checked when the URL is read).
    #[test]
    fn tls_parameters_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        let f = |name: &str| {
            let path = dir.path().join(name);
            std::fs::write(&path, "x").unwrap();
            p(&path)
        };
        let (ca, cert, key) = (f("ca.pem"), f("c.crt"), f("c.key"));
        let url = format!(
            "postgres://u@h/db?sslmode=verify-full&idem_schema=s&sslrootcert={ca}\
             &sslcert={cert}&sslkey={key}"
        );
        let o = PostgresOptions::from_url(&url).unwrap();
        assert_eq!(
            o.url,
            format!("postgres://u@h/db?sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}")
        );
    }
}

// ---- MariaDB ----

fn my() -> &'static TlsServer {
    tls_servers::mariadb()
}

/// `mysql://<user>@<host>:<port>/test?<query>` on the TLS server.
fn my_url(user: &str, host: &str, query: &str) -> String {
    format!("mysql://{user}@{host}:{}/test?{query}", my().port)
}

fn my_verified_url() -> String {
    let ca = p(&my().files.ca);
    my_url(
        "idem",
        "localhost",
        &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
    )
}

async fn my_open(url: &str) -> Result<MySqlStore, StoreError> {
    let o = MySqlOptions::from_url(url)?
        .with_table(format!("idem_t_{}", random_hex(8)))
        .with_max_connections(8);
    MySqlStore::connect_with(o).await
}

async fn my_harness() -> SleepingHarness<MySqlStore> {
    SleepingHarness(
        my_open(&my_verified_url())
            .await
            .unwrap_or_else(|e| panic!("MariaDB over TLS: {}", chain(&e))),
    )
}

/// The TLS version of the pool's connection (empty: not encrypted).
async fn my_tls_version(store: &MySqlStore) -> String {
    let (_, v): (String, String) = sqlx::query_as("SHOW SESSION STATUS LIKE 'Ssl_version'")
        .fetch_one(store.pool())
        .await
        .expect("Ssl_version");
    v
}

mod mariadb_tls {
    use super::*;

    idem_testkit::conformance_tests!(@core conformance, my_harness);

    /// `VERIFY_IDENTITY` with the right CA and name connects, encrypted.
    #[tokio::test]
    async fn verify_identity_with_the_ca_is_encrypted() {
        let s = my_open(&my_verified_url()).await.expect("VERIFY_IDENTITY");
        assert!(my_tls_version(&s).await.starts_with("TLSv1."));
    }

    /// `VERIFY_IDENTITY` for a host the certificate does not name fails.
    #[tokio::test]
    async fn verify_identity_for_another_host_fails() {
        let ca = p(&my().files.ca);
        let url = my_url(
            "idem",
            "127.0.0.1",
            &format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}"),
        );
        expect_connect_error(
            "wrong host",
            my_open(&url).await,
            &["invalid peer certificate: certificate not valid for name \"127.0.0.1\""],
        );
    }

    /// `VERIFY_CA` with a CA that did not sign the certificate fails.
    #[tokio::test]
    async fn another_ca_fails() {
        let other = p(&my().files.other_ca);
        let url = my_url(
            "idem",
            "localhost",
            &format!("ssl-mode=VERIFY_CA&ssl-ca={other}"),
        );
        expect_connect_error("wrong CA", my_open(&url).await, &["UnknownIssuer"]);
    }

    /// `ssl-mode=DISABLED` against `--require-secure-transport=ON`: the
    /// server refuses a user without TLS requirement of its own as well as
    /// one created `REQUIRE SSL`. (MariaDB 10.11 answers only "Access
    /// denied"; its log says why.)
    #[tokio::test]
    async fn disabled_against_a_tls_only_server_fails() {
        let url = my_url("idem_plain", "localhost", "ssl-mode=DISABLED");
        expect_connect_error(
            "DISABLED",
            my_open(&url).await,
            &["Access denied for user 'idem_plain'"],
        );
        let url = my_url("idem", "localhost", "ssl-mode=DISABLED");
        expect_connect_error(
            "DISABLED, REQUIRE SSL",
            my_open(&url).await,
            &["Access denied"],
        );
    }

    /// A user created `REQUIRE X509`: `ssl-cert` and `ssl-key` pass
    /// through; without them the server refuses.
    #[tokio::test]
    async fn client_certificate() {
        let f = &my().files;
        let base = format!("ssl-mode=VERIFY_IDENTITY&ssl-ca={}", p(&f.ca));
        let with = format!(
            "{base}&ssl-cert={}&ssl-key={}",
            p(&f.client_cert),
            p(&f.client_key)
        );
        let s = my_open(&my_url("idem_x509", "localhost", &with))
            .await
            .unwrap_or_else(|e| panic!("client certificate: {}", chain(&e)));
        assert!(my_tls_version(&s).await.starts_with("TLSv1."));
        expect_connect_error(
            "no client certificate",
            my_open(&my_url("idem_x509", "localhost", &base)).await,
            &["Access denied"],
        );
    }

    /// `mariadb://` URLs keep their TLS parameters.
    #[test]
    fn tls_parameters_pass_through() {
        let dir = tempfile::tempdir().unwrap();
        let ca = dir.path().join("ca.pem");
        std::fs::write(&ca, "x").unwrap();
        let ca = p(&ca);
        let o = MySqlOptions::from_url(&format!(
            "mariadb://u@h/db?ssl-mode=VERIFY_IDENTITY&idem_table=t&ssl-ca={ca}"
        ))
        .unwrap();
        assert_eq!(
            o.url,
            format!("mysql://u@h/db?ssl-mode=VERIFY_IDENTITY&ssl-ca={ca}")
        );
    }
}
