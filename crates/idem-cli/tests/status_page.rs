//! The status page on the admin listener, in headless Chromium (Debian's
//! `chromium`): the page loads without data, refuses a wrong token, shows
//! the numbers of known traffic after the right one is entered, draws its
//! charts (the canvases get coloured pixels), and its numbers change under
//! more load. A screenshot is taken at the end: into the test's temporary
//! folder, and into `docs/status-page.png` when `IDEM_UPDATE_SCREENSHOT=1`.
//!
//! Chromium is driven through the DevTools protocol: started with
//! `--remote-debugging-port=0`, it prints its websocket address; the test
//! speaks JSON over that websocket (tokio-tungstenite).

mod support;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::{SinkExt, StreamExt};
use serde_json::{json, Value};
use support::{pay, GatewayProc, Upstream};
use tokio_tungstenite::tungstenite::Message;

const TOKEN: &str = "status-page-test-token-0123456789";
const INSTALL: &str = "apt-get update && apt-get install -y chromium";

// ---------------------------------------------------------------- browser

/// A headless Chromium child; killed on drop.
struct Chromium {
    child: Child,
    /// `ws://127.0.0.1:PORT/devtools/browser/…`
    ws: String,
    _profile: tempfile::TempDir,
}

impl Chromium {
    fn start() -> Self {
        let program = ["chromium", "chromium-browser"]
            .into_iter()
            .find(|p| {
                Command::new(p)
                    .arg("--version")
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success())
            })
            .unwrap_or_else(|| {
                panic!(
                    "chromium is not installed; this test needs it. Install it with:\n  {INSTALL}"
                )
            });
        let profile = tempfile::tempdir().unwrap();
        let mut child = Command::new(program)
            .args([
                "--headless=new",
                // Root (CI) cannot use the sandbox.
                "--no-sandbox",
                "--disable-gpu",
                "--disable-dev-shm-usage",
                "--no-first-run",
                "--no-default-browser-check",
                "--disable-extensions",
                "--disable-background-networking",
                "--hide-scrollbars",
                "--remote-debugging-address=127.0.0.1",
                "--remote-debugging-port=0",
                "--window-size=1280,1500",
            ])
            .arg(format!("--user-data-dir={}", profile.path().display()))
            .arg("about:blank")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("cannot start {program} ({e}); install it with:\n  {INSTALL}")
            });
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut seen = String::new();
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some(ws) = line.strip_prefix("DevTools listening on ") {
                    let _ = tx.send(Ok(ws.trim().to_owned()));
                } else if seen.len() < 8000 {
                    seen.push_str(&line);
                    seen.push('\n');
                }
            }
            let _ = tx.send(Err(seen));
        });
        let ws = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(Ok(ws)) => ws,
            Ok(Err(out)) => {
                let _ = child.kill();
                panic!("chromium exited before it listened for DevTools:\n{out}")
            }
            Err(_) => {
                let _ = child.kill();
                panic!("chromium did not print its DevTools address within 30 s")
            }
        };
        Self {
            child,
            ws,
            _profile: profile,
        }
    }

    /// The websocket of the first page target (`about:blank`).
    async fn page_ws(&self) -> String {
        let rest = self.ws.strip_prefix("ws://").unwrap();
        let host = rest.split('/').next().unwrap();
        let c = reqwest::Client::new();
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(r) = c.get(format!("http://{host}/json/list")).send().await {
                let targets: Value = r.json().await.unwrap_or(Value::Null);
                if let Some(ws) = targets
                    .as_array()
                    .into_iter()
                    .flatten()
                    .find(|t| t["type"] == "page")
                    .and_then(|t| t["webSocketDebuggerUrl"].as_str())
                {
                    return ws.to_owned();
                }
            }
            assert!(Instant::now() < deadline, "chromium has no page target");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

impl Drop for Chromium {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

type Ws =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// One page, spoken to over the DevTools protocol.
struct Cdp {
    ws: Ws,
    next: u64,
}

impl Cdp {
    async fn connect(url: &str) -> Self {
        let (ws, _) = tokio::time::timeout(
            Duration::from_secs(15),
            tokio_tungstenite::connect_async(url),
        )
        .await
        .expect("DevTools websocket: no answer within 15 s")
        .expect("DevTools websocket");
        Self { ws, next: 0 }
    }

    /// Sends `method` and returns its `result` (events in between are
    /// skipped); panics on a protocol error or after 30 s.
    async fn call(&mut self, method: &str, params: Value) -> Value {
        self.next += 1;
        let id = self.next;
        let msg = json!({ "id": id, "method": method, "params": params }).to_string();
        self.ws.send(Message::Text(msg.into())).await.unwrap();
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        loop {
            let next = tokio::time::timeout_at(deadline, self.ws.next())
                .await
                .unwrap_or_else(|_| panic!("DevTools {method}: no answer within 30 s"));
            let Some(Ok(Message::Text(text))) = next else {
                match next {
                    Some(Ok(_)) => continue,
                    other => panic!("DevTools websocket closed during {method}: {other:?}"),
                }
            };
            let v: Value = serde_json::from_str(&text).unwrap();
            if v["id"] != id {
                continue;
            }
            assert!(
                v["error"].is_null(),
                "DevTools {method} failed: {}",
                v["error"]
            );
            return v["result"].clone();
        }
    }

    /// The value of a JavaScript expression in the page (promises awaited).
    async fn eval(&mut self, expression: &str) -> Value {
        let r = self
            .call(
                "Runtime.evaluate",
                json!({ "expression": expression, "returnByValue": true, "awaitPromise": true }),
            )
            .await;
        assert!(
            r["exceptionDetails"].is_null(),
            "{expression} threw: {}",
            r["exceptionDetails"]
        );
        r["result"]["value"].clone()
    }

    /// Polls `expression` every 250 ms until `ok` holds for its value;
    /// panics after `bound`, naming `what` and the last value.
    async fn until(
        &mut self,
        what: &str,
        bound: Duration,
        expression: &str,
        ok: impl Fn(&Value) -> bool,
    ) -> Value {
        let deadline = Instant::now() + bound;
        loop {
            let v = self.eval(expression).await;
            if ok(&v) {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "the page did not show {what} within {bound:?}; last: {v}"
            );
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

/// What the page displays, read from the DOM and the canvases.
const READ_PAGE: &str = r##"(() => {
  if (!document.getElementById("chart-store")) return { loaded: false };
  const txt = (id) => { const e = document.getElementById(id); return e ? e.textContent : null; };
  const n = (s) => s === null || s === "–" ? null : Number(String(s).replace(/,/g, ""));
  const totals = {};
  for (const r of document.querySelectorAll("#outcomes tbody tr")) {
    totals[r.dataset.outcome] = n(r.querySelector(".total").textContent);
  }
  const ink = (id) => {
    const c = document.getElementById(id);
    const d = c.getContext("2d").getImageData(0, 0, c.width, c.height).data;
    let k = 0;
    for (let i = 0; i < d.length; i += 4) {
      if (Math.max(d[i], d[i + 1], d[i + 2]) - Math.min(d[i], d[i + 1], d[i + 2]) > 60) k++;
    }
    return k;
  };
  const charts = {};
  for (const id of ["chart-rates", "chart-latency", "chart-inflight", "chart-store"]) {
    charts[id] = { points: Number(document.getElementById(id).dataset.points || 0), ink: ink(id) };
  }
  return {
    statusShown: !document.getElementById("status").hidden,
    loginShown: !document.getElementById("login").hidden,
    loginError: txt("login-error"),
    renders: Number(document.body.dataset.renders || 0),
    totals,
    rate: n(txt("tile-rate")),
    replaysMinute: n(txt("tile-replays")),
    inFlight: n(txt("tile-inflight")),
    p99: txt("tile-p99"),
    store: txt("tile-store-state"),
    keysNote: txt("keys-note"),
    keyRows: document.querySelectorAll("#keys tbody tr").length,
    charts,
  };
})()"##;

/// Types `text` into the token field and submits the form.
async fn enter_token(page: &mut Cdp, text: &str) {
    page.eval("document.getElementById('token').focus(); true")
        .await;
    page.call("Input.insertText", json!({ "text": text })).await;
    page.eval("document.getElementById('login-submit').click(); true")
        .await;
}

// ------------------------------------------------------------------- load

/// `executed` new keys and `replayed` repeats of them, four at a time.
async fn burst(url: String, tag: &'static str, executed: usize, replayed: usize) {
    let c = reqwest::Client::new();
    let keys: Vec<String> = (0..executed).map(|i| format!("{tag}-{i}")).collect();
    for chunk in keys.chunks(4) {
        let runs = chunk.iter().map(|k| pay(&c, &url, k));
        for got in futures::future::join_all(runs).await {
            let got = got.expect("request through the gateway");
            assert_eq!(got.status, 201, "{got:?}");
            assert!(!got.replayed);
        }
    }
    for i in 0..replayed {
        let got = pay(&c, &url, &keys[i % keys.len()]).await.unwrap();
        assert!(got.replayed, "a repeat was not replayed: {got:?}");
    }
}

fn docs_png() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/status-page.png")
}

// ------------------------------------------------------------------- test

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_page_shows_live_numbers_and_charts_in_chromium() {
    let browser = Chromium::start();
    let up = Upstream::start().await;
    let dir = tempfile::tempdir().unwrap();
    let token_file = dir.path().join("admin.token");
    std::fs::write(&token_file, format!("{TOKEN}\n")).unwrap();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &[
            "--upstream",
            &up.url,
            "--store",
            "memory://",
            "--admin-token-file",
            token_file.to_str().unwrap(),
        ],
    )
    .await;
    let admin = format!("http://{}", gw.admin);
    let pay_url = gw.url("/pay?ms=20");

    // Over plain HTTP: the shell has no data and strict headers; the data
    // needs the token.
    let c = reqwest::Client::new();
    let shell = c.get(format!("{admin}/")).send().await.unwrap();
    assert_eq!(shell.status(), 200);
    let csp = shell.headers()["content-security-policy"].to_str().unwrap();
    assert!(
        csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"),
        "{csp}"
    );
    assert_eq!(shell.headers()["cache-control"], "no-store");
    assert_eq!(shell.headers()["x-content-type-options"], "nosniff");
    let no_token = c.get(format!("{admin}/status.json")).send().await.unwrap();
    assert_eq!(no_token.status(), 401);
    let wrong = c
        .get(format!("{admin}/status.json"))
        .bearer_auth("not-the-token-0123456789")
        .send()
        .await
        .unwrap();
    assert_eq!(wrong.status(), 401);

    // Known traffic in the background while the page opens: 24 executed,
    // 16 replayed.
    let first = tokio::spawn(burst(pay_url.clone(), "first", 24, 16));

    let mut page = Cdp::connect(&browser.page_ws().await).await;
    page.call(
        "Emulation.setDeviceMetricsOverride",
        json!({ "width": 1280, "height": 1500, "deviceScaleFactor": 1, "mobile": false }),
    )
    .await;
    page.call("Page.navigate", json!({ "url": format!("{admin}/") }))
        .await;
    page.until("the token form", Duration::from_secs(20), READ_PAGE, |v| {
        v["loginShown"] == true && v["statusShown"] == false
    })
    .await;

    // A wrong token is refused and the form comes back.
    enter_token(&mut page, "wrong-token-wrong-token-0000").await;
    page.until("the refusal", Duration::from_secs(10), READ_PAGE, |v| {
        v["loginShown"] == true
            && v["loginError"]
                .as_str()
                .is_some_and(|s| s.contains("refused"))
    })
    .await;

    enter_token(&mut page, TOKEN).await;
    tokio::time::timeout(Duration::from_secs(60), first)
        .await
        .expect("first burst within 60 s")
        .unwrap();
    let shown = page
        .until(
            "the first burst's totals",
            Duration::from_secs(20),
            READ_PAGE,
            |v| v["totals"]["executed"] == 24 && v["totals"]["replayed"] == 16,
        )
        .await;
    assert_eq!(shown["store"], "ready", "{shown}");
    assert!(shown["replaysMinute"].as_u64() == Some(16), "{shown}");
    assert!(
        shown["p99"].as_str().is_some_and(|s| s.ends_with("ms")),
        "{shown}"
    );

    // The charts: at least two samples (one every 5 s) drawn in colour
    // (the latency chart has points only for samples with requests).
    let shown = page
        .until("drawn charts", Duration::from_secs(30), READ_PAGE, |v| {
            let ch = &v["charts"];
            ch["chart-rates"]["points"].as_u64() >= Some(2)
                && ch["chart-rates"]["ink"].as_u64() > Some(100)
                && ch["chart-latency"]["points"].as_u64() >= Some(2)
                && ch["chart-latency"]["ink"].as_u64() > Some(30)
        })
        .await;
    let renders = shown["renders"].as_u64().unwrap();

    // More load: three requests held in flight, 10 executed, 10 replayed.
    let held: Vec<_> = (0..3)
        .map(|i| {
            let url = gw.url("/pay?ms=8000");
            tokio::spawn(async move {
                let c = reqwest::Client::new();
                pay(&c, &url, &format!("held-{i}")).await
            })
        })
        .collect();
    burst(pay_url.clone(), "second", 10, 10).await;
    let shown = page
        .until(
            "the numbers after more load",
            Duration::from_secs(20),
            READ_PAGE,
            |v| {
                v["totals"]["executed"] == 34
                    && v["totals"]["replayed"] == 26
                    && v["inFlight"] == 3
                    && v["renders"].as_u64() > Some(renders)
            },
        )
        .await;
    // In-flight keys: listed when the store can list, else said so.
    let data: Value = c
        .get(format!("{admin}/status.json"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    if data["in_flight_keys"]["supported"] == true {
        let shown = page
            .until(
                "three in-flight keys",
                Duration::from_secs(10),
                READ_PAGE,
                |v| v["keyRows"] == 3,
            )
            .await;
        assert!(shown["keysNote"].as_str().unwrap().contains("3"), "{shown}");
    } else {
        assert_eq!(
            shown["keysNote"], "listing not supported by this store",
            "{shown}"
        );
    }
    // A sample with the in-flight requests in it, then the screenshot.
    page.until(
        "the in-flight chart",
        Duration::from_secs(15),
        READ_PAGE,
        |v| v["charts"]["chart-inflight"]["ink"].as_u64() > Some(100),
    )
    .await;
    let shot = page
        .call(
            "Page.captureScreenshot",
            json!({ "format": "png", "captureBeyondViewport": true }),
        )
        .await;
    let png = base64::engine::general_purpose::STANDARD
        .decode(shot["data"].as_str().unwrap())
        .unwrap();
    assert!(png.starts_with(b"\x89PNG"), "not a PNG");
    assert!(
        png.len() > 20_000,
        "a {} byte screenshot is too plain",
        png.len()
    );
    std::fs::write(dir.path().join("status-page.png"), &png).unwrap();
    if std::env::var("IDEM_UPDATE_SCREENSHOT").as_deref() == Ok("1") {
        std::fs::write(docs_png(), &png).unwrap();
    }
    for h in held {
        let got = tokio::time::timeout(Duration::from_secs(30), h)
            .await
            .expect("held requests end")
            .unwrap()
            .unwrap();
        assert_eq!(got.status, 201);
    }
}
