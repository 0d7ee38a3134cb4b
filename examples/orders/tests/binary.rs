//! The real `orders` binary: `--listen 127.0.0.1:0 --database sqlite://…`,
//! the lost-response story over HTTP, then a clean stop.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::Value;

struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_binary_serves_the_story_on_sqlite() {
    let dir = tempfile::tempdir().expect("temp dir");
    let db = dir.path().join("data").join("orders.db");
    let mut child = Child(
        Command::new(env!("CARGO_BIN_EXE_orders"))
            .args([
                "--listen",
                "127.0.0.1:0",
                "--database",
                &format!("sqlite://{}", db.display()),
                "--provider-timeout-ms",
                "1000",
            ])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start orders"),
    );
    let stdout = child.0.stdout.take().expect("stdout");
    let line = tokio::task::spawn_blocking(move || {
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line).map(|_| line)
    });
    let line = tokio::time::timeout(Duration::from_secs(60), line)
        .await
        .expect("the binary printed its address within 60 s")
        .expect("join")
        .expect("read stdout");
    let base = line
        .trim()
        .strip_prefix("orders listening on ")
        .unwrap_or_else(|| panic!("unexpected first line {line:?}"))
        .to_owned();
    assert!(db.exists(), "the database file was not created");

    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .expect("client");
    let created = client
        .post(format!("{base}/orders"))
        .header("content-type", "application/json")
        .body(r#"{"outer_order_no":"bin-1","amount_cents":1999}"#)
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201);
    let order: Value = created.json().await.expect("json");
    let id = order["id"].as_i64().expect("id");
    assert_eq!(order["status"], "PENDING");

    let pay = |sim: Option<&'static str>| {
        let mut req = client
            .post(format!("{base}/orders/{id}/pay"))
            .header("idempotency-key", "bin-pay-1");
        if let Some(s) = sim {
            req = req.header("x-simulate", s);
        }
        req.send()
    };
    let lost = pay(Some("lose-response")).await.expect("pay");
    assert_eq!(lost.status(), 504);
    assert_eq!(
        lost.headers()["content-type"],
        "application/problem+json",
        "{lost:?}"
    );
    let paid = pay(Some("lose-response")).await.expect("retry");
    assert_eq!(paid.status(), 200);
    let paid: Value = paid.json().await.expect("json");
    assert_eq!(paid["status"], "PAID");
    let charges: Value = client
        .get(format!("{base}/orders/{id}/charges"))
        .send()
        .await
        .expect("charges")
        .json()
        .await
        .expect("json");
    assert_eq!(charges.as_array().map(Vec::len), Some(1), "{charges}");
    assert_eq!(charges[0]["provider_key"], format!("order-{id}-attempt-1"));

    // A bad database URL is an error message and exit code 1, not a panic.
    let out = Command::new(env!("CARGO_BIN_EXE_orders"))
        .args(["--listen", "127.0.0.1:0", "--database", "nosuch://x"])
        .output()
        .expect("run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("nosuch://x") && !stderr.contains("panicked"),
        "{stderr}"
    );
}
