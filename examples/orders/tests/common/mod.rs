//! Shared helpers: start the orders router on a real socket over SQLite (a
//! temp file) or PostgreSQL (a random schema), and a small HTTP client.

#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use orders::{App, Config, Error};
use serde_json::Value;

pub const PG_START: &str =
    "pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start";

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Sqlite,
    Postgres,
}

pub fn postgres_url() -> String {
    std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// A running orders service.
pub struct Server {
    pub base: String,
    pub app: App,
    pub client: reqwest::Client,
    pub backend: Backend,
    schema: Option<String>,
    _dir: Option<tempfile::TempDir>,
}

/// The answer to one request.
#[derive(Debug)]
pub struct Reply {
    pub status: u16,
    pub replayed: bool,
    pub content_type: String,
    pub retry_after: Option<String>,
    pub body: Value,
}

impl Reply {
    pub fn is_problem(&self) -> bool {
        self.content_type.starts_with("application/problem+json")
    }
}

pub fn config(backend: Backend) -> (Config, Option<tempfile::TempDir>, Option<String>) {
    match backend {
        Backend::Sqlite => {
            let dir = tempfile::tempdir().expect("temp dir");
            let url = format!("sqlite://{}", dir.path().join("orders.db").display());
            (Config::new(url), Some(dir), None)
        }
        Backend::Postgres => {
            let schema = format!("orders_t_{:016x}", rand::random::<u64>());
            (
                Config::new(postgres_url()).with_schema(schema.clone()),
                None,
                Some(schema),
            )
        }
    }
}

/// Connects; an unreachable PostgreSQL fails the test naming the start command.
pub async fn connect(backend: Backend, config: Config) -> App {
    match App::connect(config).await {
        Ok(app) => app,
        Err(Error::Database(e @ (sqlx::Error::Io(_) | sqlx::Error::PoolTimedOut)))
            if backend == Backend::Postgres =>
        {
            panic!(
                "PostgreSQL at {} is not reachable ({e}).\n\
                 These tests need the real server. Start it with:\n    {PG_START}\n\
                 (or point IDEM_TEST_POSTGRES_URL at another server)",
                postgres_url()
            )
        }
        Err(e) => panic!("starting the orders service on {backend:?} failed: {e} ({e:?})"),
    }
}

pub async fn start(backend: Backend) -> Server {
    start_with(backend, |c| c).await
}

pub async fn start_with(backend: Backend, tweak: impl FnOnce(Config) -> Config) -> Server {
    let (config, dir, schema) = config(backend);
    let config = tweak(config.with_provider_timeout(Duration::from_millis(2500)));
    let app = connect(backend, config).await;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let router = app.router();
    tokio::spawn(async move { axum::serve(listener, router).await });
    Server {
        base: format!("http://{addr}"),
        app,
        client: reqwest::Client::builder()
            .no_proxy()
            .timeout(Duration::from_secs(60))
            .build()
            .expect("client"),
        backend,
        schema,
        _dir: dir,
    }
}

pub async fn reply(resp: reqwest::Response) -> Reply {
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header("idempotent-replayed").is_some_and(|v| v == "true");
    let content_type = header("content-type").unwrap_or_default();
    let retry_after = header("retry-after");
    let status = resp.status().as_u16();
    let bytes = resp.bytes().await.expect("body");
    let body = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    Reply {
        status,
        replayed,
        content_type,
        retry_after,
        body,
    }
}

impl Server {
    pub async fn create(&self, no: &str, amount: i64) -> Reply {
        self.post_json(
            "/orders",
            &serde_json::json!({"outer_order_no": no, "amount_cents": amount}).to_string(),
        )
        .await
    }

    pub async fn post_json(&self, path: &str, body: &str) -> Reply {
        let resp = self
            .client
            .post(format!("{}{path}", self.base))
            .header("content-type", "application/json")
            .body(body.to_owned())
            .send()
            .await
            .expect("POST");
        reply(resp).await
    }

    /// A fresh order; returns its id.
    pub async fn new_order(&self, amount: i64) -> i64 {
        let r = self
            .create(&format!("ext-{:016x}", rand::random::<u64>()), amount)
            .await;
        assert_eq!(r.status, 201, "{r:?}");
        r.body["id"].as_i64().expect("id")
    }

    pub fn pay_request(
        &self,
        id: i64,
        key: &str,
        simulate: Option<&str>,
    ) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(format!("{}/orders/{id}/pay", self.base))
            .header("idempotency-key", key);
        if let Some(s) = simulate {
            req = req.header("x-simulate", s);
        }
        req
    }

    pub async fn pay(&self, id: i64, key: &str, simulate: Option<&str>) -> Reply {
        reply(
            self.pay_request(id, key, simulate)
                .send()
                .await
                .expect("pay"),
        )
        .await
    }

    pub async fn get(&self, path: &str) -> Reply {
        let resp = self
            .client
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .expect("GET");
        reply(resp).await
    }

    pub async fn order(&self, id: i64) -> Value {
        let r = self.get(&format!("/orders/{id}")).await;
        assert_eq!(r.status, 200, "{r:?}");
        r.body
    }

    pub async fn charges(&self, id: i64) -> Vec<Value> {
        let r = self.get(&format!("/orders/{id}/charges")).await;
        assert_eq!(r.status, 200, "{r:?}");
        r.body.as_array().expect("array").clone()
    }

    /// Drops the PostgreSQL schema (the SQLite temp dir goes with `self`).
    pub async fn finish(self) {
        if let (Some(schema), orders::Db::Postgres(pool)) = (&self.schema, self.app.db()) {
            let _ = sqlx::query(&format!("DROP SCHEMA IF EXISTS \"{schema}\" CASCADE"))
                .execute(pool)
                .await;
        }
    }
}

pub fn fresh_key(tag: &str) -> String {
    format!("{tag}-{:016x}", rand::random::<u64>())
}

/// Generates a SQLite and a PostgreSQL test for `async fn $name(Backend)`.
#[macro_export]
macro_rules! on_both {
    ($($name:ident),* $(,)?) => {$(
        mod $name {
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                super::$name(super::common::Backend::Sqlite).await
            }
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                super::$name(super::common::Backend::Postgres).await
            }
        }
    )*};
}
