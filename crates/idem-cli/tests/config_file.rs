//! The configuration file through the real `idem` binary:
//!
//! - `idem config check` on a good file prints every value with its source
//!   (`default`, `file:LINE`, `env IDEM_X`, `flag`; `route:LINE`,
//!   `inherited`) and the implicit `default` route; on bad files it exits 2
//!   naming the line (unknown key, bad duration, bad route).
//! - Precedence: flag > IDEM_* variable > file > default.
//! - `idem config schema` is docs/config.schema.json (fails when stale:
//!   regenerate with `idem config schema > docs/config.schema.json`).
//! - A gateway started from a file only (`idem gateway --config f`, no
//!   other flag or variable) serves its routes.
//! - Reload under load: a client loop sees no failed request while the
//!   file is rewritten 20 times (SIGHUP after each), invalid versions
//!   included; the reload metrics move; `/_idem/ready` stays 200; a setting
//!   that needs a restart is named in a WARN. The poll sees an editor's
//!   rename-write without a signal.
//! - A changed route rule takes effect after a reload (`require_key` flips
//!   so a keyless POST gets 400, then passes again): this one needs the
//!   layer's real `IdempotencyLayer::reload`.
//! - Files caught mid-write: an emptied file is refused on reload (the
//!   routes stay); a file written in place in two parts is applied once,
//!   whole. A file over 1 MiB is refused at start (exit 2) and on reload,
//!   and requests are not held up meanwhile. A deleted file is reported
//!   once (ERROR, gauge 0) and reloaded when it is back.
//! - A reload that changes a route's scope names the route in a WARN.

mod support;

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use support::*;

fn write(path: &Path, text: &str) {
    std::fs::write(path, text).unwrap();
}

/// `idem config check FILE ARGS` with `env`; (exit code, stdout, stderr).
fn check(file: &Path, args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = idem();
    cmd.env_remove("IDEM_ADMIN_LISTEN");
    cmd.arg("config").arg("check").arg(file).args(args);
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// The `# source` of top-level `key` in a check listing.
fn source_of<'a>(listing: &'a str, key: &str) -> &'a str {
    listing
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .and_then(|l| l.rsplit("# ").next())
        .unwrap_or_else(|| panic!("no {key} in\n{listing}"))
        .trim()
}

/// The `value` of top-level `key` in a check listing (unquoted).
fn value_of(listing: &str, key: &str) -> String {
    let line = listing
        .lines()
        .find(|l| l.split_whitespace().next() == Some(key))
        .unwrap_or_else(|| panic!("no {key} in\n{listing}"));
    let v = line.split_once('=').unwrap().1;
    let v = v.rsplit_once(" # ").map_or(v, |(v, _)| v).trim();
    v.trim_matches('"').to_owned()
}

const EXAMPLE: &str = r#"upstream = "http://127.0.0.1:3000"
store = "memory://"
ttl = "1h"

[[routes]]
name = "payments"
methods = ["POST"]
path = "/payments"
require_key = true
status_policy = "store-5xx"
ttl = "24h"
lease = "60s"

[[routes]]
name = "carts"
path = "/carts"
guard = false

[[routes]]
name = "webhooks"
path = "/webhooks"
key_json_pointer = "/event_id"
fingerprint_exclude = ["/delivered_at"]
"#;

#[test]
fn check_shows_every_value_and_its_source() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("idem.toml");
    write(&f, EXAMPLE);
    let (code, out, err) = check(&f, &["--wait", "2s"], &[("IDEM_LEASE", "20s")]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(source_of(&out, "upstream"), "file:1");
    assert_eq!(source_of(&out, "ttl"), "file:3");
    assert_eq!(source_of(&out, "lease"), "env IDEM_LEASE");
    assert_eq!(source_of(&out, "wait"), "flag");
    assert_eq!(source_of(&out, "listen"), "default");
    assert_eq!(value_of(&out, "listen"), "127.0.0.1:8000");
    // Routes in match order, then the implicit default.
    let order: Vec<usize> = [
        "# payments, line 5",
        "# carts, line 14",
        "# webhooks, line 19",
        "# default: implicit",
    ]
    .iter()
    .map(|h| out.find(h).unwrap_or_else(|| panic!("{h} missing:\n{out}")))
    .collect();
    assert!(order.windows(2).all(|w| w[0] < w[1]), "{out}");
    let payments = &out[order[0]..order[1]];
    assert!(
        payments.contains("\"24h\"") && payments.contains("# route:11"),
        "{payments}"
    );
    assert!(payments.contains("\"store-5xx\""), "{payments}");
    let carts = &out[order[1]..order[2]];
    // The route's lease is the effective top-level one (from IDEM_LEASE).
    assert!(
        carts
            .lines()
            .any(|l| l.starts_with("lease") && l.contains("\"20s\"") && l.ends_with("# inherited")),
        "{carts}"
    );
    assert!(
        carts
            .lines()
            .any(|l| l.starts_with("guard") && l.contains("false") && l.ends_with("# route:17")),
        "{carts}"
    );
    let webhooks = &out[order[2]..order[3]];
    assert!(
        webhooks.lines().any(|l| l.starts_with("key_json_pointer")
            && l.contains("/event_id")
            && l.ends_with("# route:22")),
        "{webhooks}"
    );
    assert!(
        webhooks
            .lines()
            .any(|l| l.starts_with("fingerprint_exclude") && l.contains("/delivered_at")),
        "{webhooks}"
    );
    let default = &out[order[3]..];
    assert!(
        default
            .lines()
            .any(|l| l.starts_with("ttl") && l.contains("\"1h\"") && l.ends_with("# inherited")),
        "{default}"
    );
    // A key with no top-level setting shows the route key's own default.
    assert!(
        default
            .lines()
            .any(|l| l.starts_with("guard") && l.ends_with("# default")),
        "{default}"
    );
    // The count says what it counts.
    assert!(
        out.contains("(first match wins): 3 routes + default:"),
        "{out}"
    );
}

#[test]
fn check_refuses_bad_files_with_the_line() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("bad.toml");
    for (text, needle) in [
        ("upstream = \"http://127.0.0.1:3000\"\nstore = \"memory://\"\nttls = \"1h\"\n", "bad.toml:3:1: unknown key `ttls`"),
        ("upstream = \"http://127.0.0.1:3000\"\n\nlease = \"soon\"\n", "bad.toml:3:"),
        ("upstream = \"http://127.0.0.1:3000\"\nmax_body = true\n", "bad.toml:2:"),
        (
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nttl = \"one day\"\n",
            "bad.toml:6:",
        ),
        (
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nretries = 3\n",
            "bad.toml:6:1: routes[0]: unknown route key `retries`",
        ),
        (
            "upstream = \"http://127.0.0.1:3000\"\n\n[[routes]]\nname = \"payments\"\npath = \"/payments\"\nlease = \"500ms\"\n",
            "bad.toml:3:1: route \"payments\": the lease (500ms)",
        ),
        (
            "upstream = \"http://127.0.0.1:3000\"\n[[routes]]\nname = \"a\"\npath = \"payments\"\n",
            "bad.toml:4:",
        ),
        ("upstream = \"http://127.0.0.1:3000\"\nttl = \"1h\n", "bad.toml:2:"),
        ("store = \"memory://\"\n", "--upstream or `upstream` in the config file is required"),
        // An empty list is not the default in disguise.
        ("upstream = \"http://127.0.0.1:3000\"\nscope_header = []\n", "bad.toml:2:16: `scope_header`: names no header"),
        ("upstream = \"http://127.0.0.1:3000\"\nmethods = []\n", "bad.toml:2:11: `methods`: names no method"),
    ] {
        write(&f, text);
        let (code, out, err) = check(&f, &[], &[]);
        assert_eq!(code, 2, "{text}\n{out}{err}");
        assert!(err.contains(needle), "{text}\nwanted {needle:?} in:\n{err}");
        assert!(out.is_empty(), "{out}");
    }
    let (code, _, err) = check(&dir.path().join("missing.toml"), &[], &[]);
    assert_eq!(code, 2);
    assert!(err.contains("missing.toml: cannot read"), "{err}");
}

#[test]
fn flag_beats_env_beats_file_beats_default() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("idem.toml");
    write(
        &f,
        "upstream = \"http://127.0.0.1:3000\"\nttl = \"1h\"\nscope_header = [\"x-api-key\", \"x-tenant\"]\nrequire_key = true\n",
    );
    let env = [("IDEM_TTL", "2h")];
    let (code, out, err) = check(&f, &["--ttl", "3h"], &env);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        (value_of(&out, "ttl").as_str(), source_of(&out, "ttl")),
        ("3h", "flag")
    );
    let (_, out, _) = check(&f, &[], &env);
    assert_eq!(
        (value_of(&out, "ttl").as_str(), source_of(&out, "ttl")),
        ("2h", "env IDEM_TTL")
    );
    let (_, out, _) = check(&f, &[], &[]);
    assert_eq!(
        (value_of(&out, "ttl").as_str(), source_of(&out, "ttl")),
        ("1h", "file:2")
    );
    assert_eq!(value_of(&out, "scope_header"), "x-api-key,x-tenant");
    assert_eq!(value_of(&out, "require_key"), "true");
    assert_eq!(
        (value_of(&out, "lease").as_str(), source_of(&out, "lease")),
        ("30s", "default")
    );
    // A list from the command line replaces the file's, it does not add to it.
    let (_, out, _) = check(&f, &["--scope-header", "authorization"], &[]);
    assert_eq!(value_of(&out, "scope_header"), "authorization");
    // Every file value is checked, even one a flag overrides: the file
    // must be valid on its own (it may be used without that flag).
    write(&f, "upstream = \"http://127.0.0.1:3000\"\nttl = \"soon\"\n");
    let (code, _, err) = check(&f, &["--ttl", "3h"], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("idem.toml:2:"), "{err}");
}

#[test]
fn schema_file_is_current() {
    let out = idem().args(["config", "schema"]).output().unwrap();
    assert!(out.status.success());
    let printed: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        printed["$schema"],
        "https://json-schema.org/draft/2020-12/schema"
    );
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/config.schema.json");
    let stored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap_or_default())
            .unwrap_or_default();
    assert!(
        printed == stored,
        "docs/config.schema.json is stale: run `idem config schema > docs/config.schema.json`"
    );
    // Every flag of `idem gateway --help` has its key.
    let help = idem().args(["gateway", "--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for long in help.split_whitespace().filter(|w| w.starts_with("--")) {
        let key = long
            .trim_start_matches("--")
            .split(['=', ' ', ',', '<'])
            .next()
            .unwrap()
            .replace('-', "_");
        if key.is_empty() || ["help", "config", "log_format"].contains(&key.as_str()) {
            continue;
        }
        assert!(
            printed["properties"].get(&key).is_some(),
            "--{key} has no file key"
        );
    }
}

/// Starts `idem gateway --config FILE` with nothing else: no flag, no
/// IDEM_* variable (the listen and admin addresses are in the file).
async fn start_from_file(
    dir: &Path,
    file: &Path,
    addr: std::net::SocketAddr,
) -> std::process::Child {
    let mut cmd = idem();
    cmd.env_remove("IDEM_ADMIN_LISTEN")
        .args(["gateway", "--config"])
        .arg(file)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("gw.log")).unwrap());
    let mut child = cmd.spawn().unwrap();
    let c = reqwest::Client::new();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(Some(s)) = child.try_wait() {
            panic!(
                "gateway exited ({s}):\n{}",
                std::fs::read_to_string(dir.join("gw.log")).unwrap_or_default()
            );
        }
        if let Ok(r) = c.get(format!("http://{addr}/_idem/health")).send().await {
            if r.status() == 200 {
                return child;
            }
        }
        assert!(Instant::now() < deadline, "not healthy");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test]
async fn gateway_runs_from_a_file_only() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let addr = free_addr();
    let admin = free_addr();
    let f = dir.path().join("idem.toml");
    write(
        &f,
        &format!(
            "listen = \"{addr}\"\nadmin_listen = \"{admin}\"\nupstream = \"{}\"\nstore = \"memory://\"\n\
             require_key = true\nmethods = [\"POST\"]\n\n\
             [[routes]]\nname = \"carts\"\npath = \"/carts\"\nguard = false\n",
            up.url
        ),
    );
    let mut child = start_from_file(dir.path(), &f, addr).await;
    let c = reqwest::Client::new();
    let url = format!("http://{addr}/pay?ms=1");
    let keyless = c.post(&url).body("{}").send().await.unwrap();
    assert_eq!(keyless.status(), 400, "require_key from the file");
    let a = pay(&c, &url, "k1").await.unwrap();
    let b = pay(&c, &url, "k1").await.unwrap();
    assert_eq!((a.status, b.status, b.replayed), (201, 201, true));
    assert_eq!(up.of_key("k1"), 1);
    let metrics = c
        .get(format!("http://{admin}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(
        metrics.contains("idem_config_last_reload_success 1"),
        "{metrics}"
    );
    // The startup line names the file and the routes.
    let log = std::fs::read_to_string(dir.path().join("gw.log")).unwrap();
    let line = log
        .lines()
        .find(|l| l.contains("idem gateway listening"))
        .unwrap_or_else(|| panic!("{log}"));
    assert!(
        line.contains(&format!("config_file={}", f.display()))
            && line.contains("routes=1 + default"),
        "{line}"
    );
    let _ = child.kill();
    let _ = child.wait();
}

/// `idem_config_reloads_total` by result, and the last-success gauge.
async fn reload_metrics(c: &reqwest::Client, gw: &GatewayProc) -> (u64, u64, Option<u64>) {
    let text = c
        .get(format!("http://{}/metrics", gw.admin))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let find = |prefix: &str| {
        text.lines()
            .find(|l| l.starts_with(prefix))
            .and_then(|l| l.rsplit(' ').next())
            .and_then(|v| v.parse::<f64>().ok())
            .map(|v| v as u64)
    };
    (
        find("idem_config_reloads_total{result=\"ok\"}").unwrap_or(0),
        find("idem_config_reloads_total{result=\"error\"}").unwrap_or(0),
        find("idem_config_last_reload_success"),
    )
}

/// Waits until the reload task is up (its gauge shows): from then on
/// SIGHUP reloads instead of ending the process.
async fn reload_ready(c: &reqwest::Client, gw: &GatewayProc) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while reload_metrics(c, gw).await.2.is_none() {
        assert!(Instant::now() < deadline, "no reload gauge:\n{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until ok + error reloads reach `n`.
async fn reloads_reach(c: &reqwest::Client, gw: &GatewayProc, n: u64) -> (u64, u64, Option<u64>) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let m = reload_metrics(c, gw).await;
        if m.0 + m.1 >= n {
            return m;
        }
        assert!(
            Instant::now() < deadline,
            "{n} reloads not reached ({m:?}):\n{}",
            gw.logs()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn config_text(upstream: &str, require_key: bool, extra: &str) -> String {
    format!(
        "upstream = \"{upstream}\"\nstore = \"memory://\"\n{extra}\n\
         [[routes]]\nname = \"pay\"\npath = \"/pay\"\nrequire_key = {require_key}\nttl = \"1h\"\n"
    )
}

/// A gateway started from `config_text(upstream, false, "")` in a new
/// folder (kept until the tuple is dropped), its upstream, the file, and a
/// client, once the reload task is ready.
async fn from_file() -> (
    tempfile::TempDir,
    Upstream,
    PathBuf,
    GatewayProc,
    reqwest::Client,
) {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let f = dir.path().join("idem.toml");
    write(&f, &config_text(&up.url, false, ""));
    let gw = GatewayProc::start(dir.path(), "gw", &["--config", f.to_str().unwrap()]).await;
    let c = reqwest::Client::new();
    reload_ready(&c, &gw).await;
    (dir, up, f, gw, c)
}

/// Writes `text` as editors do: a new file renamed over the old one.
fn rename_write(path: &Path, text: &str) {
    let tmp: PathBuf = path.with_extension("toml.tmp");
    write(&tmp, text);
    std::fs::rename(&tmp, path).unwrap();
}

#[tokio::test]
async fn reload_under_load_fails_no_request() {
    let (_dir, up, f, gw, c) = from_file().await;

    // The client loop: 4 workers, each request with a fresh key.
    let stop = Arc::new(AtomicBool::new(false));
    let sent = Arc::new(AtomicUsize::new(0));
    let mut workers = Vec::new();
    for w in 0..4 {
        let (stop, sent, c) = (stop.clone(), sent.clone(), c.clone());
        let url = gw.url("/pay?ms=2");
        workers.push(tokio::spawn(async move {
            let mut failures = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) && i < 5000 {
                i += 1;
                match pay(&c, &url, &format!("w{w}-{i}")).await {
                    Ok(g) if g.status == 201 && !g.replayed => {}
                    Ok(g) => failures.push(format!("{} {}", g.status, g.body)),
                    Err(e) => failures.push(e.to_string()),
                }
                sent.fetch_add(1, Ordering::SeqCst);
            }
            failures
        }));
    }

    let invalid = [
        "upstream = \"http://127.0.0.1:1\"\nttls = \"1h\"\n",
        "[[routes]]\nname = \"pay\"\npath = \"/pay\"\nlease = \"soon\"\n",
        "ttl = [\n",
        "[[routes]]\nname = \"default\"\npath = \"/pay\"\n",
        "[[routes]]\nname = \"pay\"\npath = \"/pay\"\nlease = \"500ms\"\n",
    ];
    let (mut want_ok, mut want_err) = (0, 0);
    let mut total = 0;
    for round in 0..20 {
        let text = if round % 3 == 2 {
            want_err += 1;
            invalid[round % invalid.len()].to_owned()
        } else {
            want_ok += 1;
            config_text(
                &up.url,
                round % 2 == 0,
                &format!("wait = \"{}ms\"", round * 10),
            )
        };
        if round % 2 == 0 {
            rename_write(&f, &text);
        } else {
            write(&f, &text);
        }
        gw.signal("-HUP");
        total += 1;
        // Each write is reloaded once by the signal; the poll may reload it
        // too before the signal lands, never less.
        let m = reloads_reach(&c, &gw, total).await;
        total = m.0 + m.1;
        let ready = c.get(gw.url("/_idem/ready")).send().await.unwrap();
        assert_eq!(ready.status(), 200, "round {round}: ready is unaffected");
    }
    stop.store(true, Ordering::SeqCst);
    let mut failures = Vec::new();
    for w in workers {
        failures.extend(w.await.unwrap());
    }
    let sent = sent.load(Ordering::SeqCst);
    assert!(sent >= 40, "the loop ran ({sent} requests)");
    assert!(
        failures.is_empty(),
        "{} of {sent} requests failed: {:?}",
        failures.len(),
        &failures[..failures.len().min(5)]
    );
    assert_eq!(up.total(), sent, "each request ran once");

    let (ok, err, last) = reload_metrics(&c, &gw).await;
    assert!(
        ok >= want_ok && err >= want_err,
        "ok {ok} (≥ {want_ok}), error {err} (≥ {want_err})"
    );
    assert_eq!(last, Some(1), "the last version was valid");
    let logs = gw.logs();
    assert!(logs.contains("configuration reloaded"), "{logs}");
    assert!(logs.contains("configuration reload failed"), "{logs}");
    assert!(
        logs.contains("unknown key `ttls`"),
        "the reason is logged:\n{logs}"
    );

    // A bad version last: the gauge drops to 0, the running rules stay.
    write(&f, invalid[0]);
    gw.signal("-HUP");
    let m = reloads_reach(&c, &gw, total + 1).await;
    total = m.0 + m.1;
    assert_eq!(reload_metrics(&c, &gw).await.2, Some(0));
    let g = pay(&c, &gw.url("/pay?ms=1"), "after-bad").await.unwrap();
    assert_eq!(g.status, 201);

    // A setting that needs a restart: named in a WARN, not applied.
    write(
        &f,
        &config_text(&up.url, false, "upstream_timeout = \"7s\""),
    );
    gw.signal("-HUP");
    reloads_reach(&c, &gw, total + 1).await;
    let deadline = Instant::now() + Duration::from_secs(5);
    while !gw.logs().contains("need a restart") {
        assert!(Instant::now() < deadline, "{}", gw.logs());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let warn = gw
        .logs()
        .lines()
        .find(|l| l.contains("need a restart"))
        .unwrap()
        .to_owned();
    assert!(
        warn.contains("upstream_timeout") && warn.contains("WARN"),
        "{warn}"
    );
}

#[tokio::test]
async fn a_changed_file_is_reloaded_without_a_signal() {
    let (_dir, up, f, gw, c) = from_file().await;
    assert_eq!(reload_metrics(&c, &gw).await, (0, 0, Some(1)));
    // Touching the file without a change is no reload.
    write(&f, &config_text(&up.url, false, ""));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(reload_metrics(&c, &gw).await.0, 0);
    // An editor's rename-write is seen by the poll (every second).
    rename_write(&f, &config_text(&up.url, true, ""));
    let m = reloads_reach(&c, &gw, 1).await;
    assert_eq!(m, (1, 0, Some(1)), "{}", gw.logs());
    rename_write(&f, "ttl = \"soon\"\n");
    let m = reloads_reach(&c, &gw, 2).await;
    assert_eq!(m, (1, 1, Some(0)), "{}", gw.logs());
    assert!(
        gw.logs().contains("idem.toml:1:"),
        "the line is logged:\n{}",
        gw.logs()
    );
}

/// Needs `IdempotencyLayer::reload` to swap the rules (the `core` branch).
#[tokio::test]
async fn a_changed_route_rule_takes_effect_after_reload() {
    let (_dir, up, f, gw, c) = from_file().await;
    let keyless = |c: reqwest::Client, url: String| async move {
        c.post(url)
            .body("{}")
            .send()
            .await
            .unwrap()
            .status()
            .as_u16()
    };
    let url = gw.url("/pay?ms=1");
    assert_eq!(
        keyless(c.clone(), url.clone()).await,
        201,
        "no key required yet"
    );
    write(&f, &config_text(&up.url, true, ""));
    gw.signal("-HUP");
    reloads_reach(&c, &gw, 1).await;
    assert_eq!(
        keyless(c.clone(), url.clone()).await,
        400,
        "the reloaded route requires a key"
    );
    write(&f, &config_text(&up.url, false, ""));
    gw.signal("-HUP");
    reloads_reach(&c, &gw, 2).await;
    assert_eq!(
        keyless(c.clone(), url.clone()).await,
        201,
        "and no longer does"
    );
    assert_eq!(reload_metrics(&c, &gw).await, (2, 0, Some(1)));
}

/// The complete example of docs/CONFIG.md is a valid file.
#[test]
fn the_documented_example_is_valid() {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../docs/CONFIG.md"))
            .unwrap();
    let start = doc.find("```toml\n#:schema").expect("the example") + "```toml\n".len();
    let example = &doc[start..start + doc[start..].find("```").unwrap()];
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("idem.toml");
    write(&f, example);
    let (code, out, err) = check(&f, &[], &[]);
    assert_eq!(code, 0, "{err}");
    for route in ["# payments, line", "# carts, line", "# webhooks, line"] {
        assert!(out.contains(route), "{out}");
    }
}

/// A reload cannot add a token route to a gateway that does not serve
/// `POST /_idem/tokens`: its keys could never be had. Refused, the running
/// rules stay.
#[tokio::test]
async fn a_reload_that_needs_the_token_endpoint_is_refused() {
    let (_dir, up, f, gw, c) = from_file().await;
    let token_route = "\n[[routes]]\nname = \"tok\"\npath = \"/tok\"\nrequire_token = true\n";
    write(&f, &config_text(&up.url, false, token_route));
    gw.signal("-HUP");
    let m = reloads_reach(&c, &gw, 1).await;
    assert_eq!(m, (0, 1, Some(0)), "{}", gw.logs());
    assert!(gw.logs().contains("restart it to apply"), "{}", gw.logs());
    let status = c
        .post(gw.url("/pay?ms=1"))
        .header("idempotency-key", "not-a-token")
        .body("{}")
        .send()
        .await
        .unwrap()
        .status();
    assert_eq!(status, 201, "the running rules stay: no token needed");
}

/// Waits until `needle` shows in the log; the log.
async fn log_shows(gw: &GatewayProc, needle: &str) -> String {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let logs = gw.logs();
        if logs.contains(needle) {
            return logs;
        }
        assert!(Instant::now() < deadline, "no {needle:?} in:\n{logs}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The status of a keyless POST to `/pay`.
async fn keyless_status(c: &reqwest::Client, gw: &GatewayProc) -> u16 {
    c.post(gw.url("/pay?ms=1"))
        .body("{}")
        .send()
        .await
        .unwrap()
        .status()
        .as_u16()
}

/// `: > idem.toml` (or an editor's in-place write caught at its start):
/// the poll refuses the empty file, the routes stay. A file written in
/// place in two parts, 100 ms apart, is applied once, whole: the poll
/// waits until two looks 250 ms apart agree.
#[tokio::test]
async fn a_file_caught_mid_write_is_not_applied() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let f = dir.path().join("idem.toml");
    write(&f, &config_text(&up.url, true, ""));
    let gw = GatewayProc::start(dir.path(), "gw", &["--config", f.to_str().unwrap()]).await;
    let c = reqwest::Client::new();
    reload_ready(&c, &gw).await;
    assert_eq!(
        keyless_status(&c, &gw).await,
        400,
        "the route requires a key"
    );

    write(&f, "");
    let m = reloads_reach(&c, &gw, 1).await;
    assert_eq!(m, (0, 1, Some(0)), "{}", gw.logs());
    assert!(
        gw.logs().contains("the configuration file is empty"),
        "{}",
        gw.logs()
    );
    assert_eq!(keyless_status(&c, &gw).await, 400, "the routes stay");

    // In place, in two parts: the first part alone is a valid file
    // without the route (a keyless POST would pass).
    let whole = config_text(&up.url, true, "wait = \"10ms\"");
    let cut = whole.find("[[routes]]").unwrap();
    {
        use std::io::Write as _;
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .truncate(true)
            .open(&f)
            .unwrap();
        file.write_all(&whole.as_bytes()[..cut]).unwrap();
        file.sync_all().unwrap();
        tokio::time::sleep(Duration::from_millis(100)).await;
        file.write_all(&whole.as_bytes()[cut..]).unwrap();
    }
    let m = reloads_reach(&c, &gw, 2).await;
    assert_eq!(m, (1, 1, Some(1)), "{}", gw.logs());
    // No second reload comes later: the half file was never applied.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        reload_metrics(&c, &gw).await,
        (1, 1, Some(1)),
        "{}",
        gw.logs()
    );
    assert!(gw.logs().contains("routes=1"), "{}", gw.logs());
    assert_eq!(keyless_status(&c, &gw).await, 400, "the route is there");
}

/// A file over 1 MiB: refused at start with exit status 2, and on reload
/// without holding up requests.
#[tokio::test]
async fn a_file_over_1_mib_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let f = dir.path().join("idem.toml");
    let mut big = config_text(&up.url, false, "");
    big.push_str(&"# padding padding padding padding padding padding padding\n".repeat(20_000));
    assert!(big.len() > 1 << 20);
    write(&f, &big);
    let out = idem()
        .args(["gateway", "--config"])
        .arg(&f)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("larger than 1048576 bytes"), "{err}");
    let (code, _, err) = check(&f, &[], &[]);
    assert_eq!(code, 2, "{err}");

    write(&f, &config_text(&up.url, false, ""));
    let gw = GatewayProc::start(dir.path(), "gw", &["--config", f.to_str().unwrap()]).await;
    let c = reqwest::Client::new();
    reload_ready(&c, &gw).await;
    let mut huge = config_text(&up.url, false, "");
    huge.push_str(&"# padding padding padding padding padding padding padding\n".repeat(400_000));
    write(&f, &huge);
    // Requests go on meanwhile (a 24 MB file once held one up for 35 s).
    let started = Instant::now();
    let mut i = 0;
    while started.elapsed() < Duration::from_secs(3) {
        i += 1;
        let t = Instant::now();
        let g = pay(&c, &gw.url("/pay?ms=1"), &format!("big-{i}"))
            .await
            .unwrap();
        assert_eq!((g.status, g.replayed), (201, false));
        assert!(
            t.elapsed() < Duration::from_secs(3),
            "a request waited {:?}",
            t.elapsed()
        );
    }
    let m = reloads_reach(&c, &gw, 1).await;
    assert_eq!(m, (0, 1, Some(0)), "{}", gw.logs());
    assert!(
        gw.logs().contains("larger than 1048576 bytes"),
        "{}",
        gw.logs()
    );
}

/// A deleted configuration file: one ERROR, the gauge 0, one failed
/// reload counted (not one a second); reloaded when it is back.
#[tokio::test]
async fn a_deleted_file_is_reported_once_and_reloaded_when_back() {
    let (_dir, up, f, gw, c) = from_file().await;
    std::fs::remove_file(&f).unwrap();
    let m = reloads_reach(&c, &gw, 1).await;
    assert_eq!(m, (0, 1, Some(0)), "{}", gw.logs());
    let logs = log_shows(&gw, "cannot be read").await;
    let line = logs.lines().find(|l| l.contains("cannot be read")).unwrap();
    assert!(
        line.contains("ERROR") && line.contains("idem.toml"),
        "{line}"
    );
    tokio::time::sleep(Duration::from_millis(2500)).await;
    assert_eq!(
        reload_metrics(&c, &gw).await,
        (0, 1, Some(0)),
        "reported once"
    );
    assert_eq!(gw.logs().matches("cannot be read").count(), 1);
    assert_eq!(keyless_status(&c, &gw).await, 201, "the running rules stay");
    // Back (with another rule): reloaded, the gauge 1 again.
    write(&f, &config_text(&up.url, true, ""));
    let m = reloads_reach(&c, &gw, 2).await;
    assert_eq!(m, (1, 1, Some(1)), "{}", gw.logs());
    assert!(gw.logs().contains("file readable again"), "{}", gw.logs());
    assert_eq!(keyless_status(&c, &gw).await, 400);
}

/// A reload that changes a route's `scope_headers` names the route in a
/// WARN: retries of requests stored before are not recognised.
#[tokio::test]
async fn a_reload_that_rescopes_a_route_warns() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let f = dir.path().join("idem.toml");
    let text = |scope: &str| {
        format!(
            "upstream = \"{}\"\nstore = \"memory://\"\n\n[[routes]]\nname = \"pay\"\npath = \"/pay\"\n\
             scope_headers = [\"{scope}\"]\n\n[[routes]]\nname = \"other\"\npath = \"/other\"\n",
            up.url
        )
    };
    write(&f, &text("x-api-key"));
    let gw = GatewayProc::start(dir.path(), "gw", &["--config", f.to_str().unwrap()]).await;
    let c = reqwest::Client::new();
    reload_ready(&c, &gw).await;
    write(&f, &text("x-tenant"));
    gw.signal("-HUP");
    let m = reloads_reach(&c, &gw, 1).await;
    assert_eq!(m.0, 1, "{}", gw.logs());
    let logs = log_shows(&gw, "scope or the key source").await;
    let warn = logs
        .lines()
        .find(|l| l.contains("scope or the key source"))
        .unwrap();
    assert!(
        warn.contains("WARN") && warn.contains("routes=pay") && !warn.contains("other"),
        "{warn}"
    );
}

/// `log_format` in the file sets the log format; the flag wins over it.
#[tokio::test]
async fn the_log_format_comes_from_the_file_unless_the_flag_sets_it() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let f = dir.path().join("idem.toml");
    write(
        &f,
        &format!("log_format = \"json\"\n{}", config_text(&up.url, false, "")),
    );
    let gw = GatewayProc::start(dir.path(), "json", &["--config", f.to_str().unwrap()]).await;
    let first = gw.logs().lines().next().unwrap_or_default().to_owned();
    assert!(
        serde_json::from_str::<serde_json::Value>(&first).is_ok(),
        "a JSON line: {first}"
    );
    drop(gw);
    let gw = GatewayProc::start(
        dir.path(),
        "text",
        &["--config", f.to_str().unwrap(), "--log-format", "text"],
    )
    .await;
    let first = gw.logs().lines().next().unwrap_or_default().to_owned();
    assert!(
        serde_json::from_str::<serde_json::Value>(&first).is_err() && first.contains("INFO"),
        "a text line: {first}"
    );
    write(&f, "log_format = \"yaml\"\n");
    let (code, _, err) = check(&f, &[], &[]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains(":1:"), "{err}");
}
