//! Drives a running gateway from another language: starts
//! `idem demo --no-showcase` (the sample payment service with a gateway in
//! front of it, on free ports) and runs `tests/e2e/gateway_client.py`
//! against it with python3, then stops the demo with SIGINT (Ctrl-C).
//! A second test puts a separate `idem gateway` process (SQLite store, JSON
//! logs) in front of the demo's service and runs the same script through it.

mod support;

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use support::{idem, succeeded};

/// A child process that is killed if the test ends early.
struct Guard(Child);

impl Drop for Guard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Lines of a child's pipe, read on a thread.
fn lines_of(pipe: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(pipe).lines() {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    rx
}

/// Sends `signal` (e.g. "-INT") to `child` and waits up to 15 s for a clean exit.
fn stop_gracefully(child: &mut Child, signal: &str, what: &str) {
    let pid = child.id().to_string();
    let sent = Command::new("kill").args([signal, &pid]).status();
    assert!(
        sent.is_ok_and(|s| s.success()),
        "could not send {signal} to the {what}"
    );
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            assert!(
                status.success(),
                "the {what} exited with {status} after {signal}"
            );
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the {what} did not stop within 15 s of {signal}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Runs the Python client against a gateway; panics with its output on failure.
fn run_python_client(gateway: &str, stats: &str) {
    let python = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    if Command::new(&python).arg("--version").output().is_err() {
        panic!(
            "{python} is needed for the end-to-end test and was not found \
             (./scripts/test.sh installs it; or set PYTHON to a Python 3 interpreter)"
        );
    }
    let script: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "..",
        "..",
        "tests",
        "e2e",
        "gateway_client.py",
    ]
    .iter()
    .collect();
    assert!(script.exists(), "missing {}", script.display());
    let out = Command::new(&python)
        .arg(&script)
        .arg(gateway)
        .arg(stats)
        .output()
        .expect("run python3");
    let (stdout, _) = succeeded(&out, "gateway_client.py");
    assert!(stdout.contains("all end-to-end checks passed"), "{stdout}");
}

/// The first `http://…` word of a line that starts with `label`.
fn url_after(line: &str, label: &str) -> Option<String> {
    let rest = line.trim_start().strip_prefix(label)?;
    rest.split_whitespace()
        .find(|w| w.starts_with("http://"))
        .map(str::to_owned)
}

/// `idem demo --no-showcase` on free ports, with the URLs it printed.
struct Demo {
    child: Guard,
    gateway: String,
    service: String,
    stats: String,
    _dir: tempfile::TempDir,
}

fn start_demo() -> Demo {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut child = idem()
        .args(["demo", "--no-showcase", "--listen", "127.0.0.1:0"])
        .current_dir(dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start idem demo");
    let rx = lines_of(child.stdout.take().expect("stdout"));
    let mut demo = Demo {
        child: Guard(child),
        gateway: String::new(),
        service: String::new(),
        stats: String::new(),
        _dir: dir,
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = String::new();
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            panic!("idem demo did not get ready within 30 s; it printed:\n{seen}");
        };
        seen.push_str(&line);
        seen.push('\n');
        for (label, slot) in [
            ("gateway", &mut demo.gateway),
            ("service", &mut demo.service),
            ("stats", &mut demo.stats),
        ] {
            if let Some(u) = url_after(&line, label) {
                *slot = u;
            }
        }
        if line.starts_with("Serving.") {
            break;
        }
    }
    assert!(
        !demo.gateway.is_empty() && !demo.service.is_empty() && !demo.stats.is_empty(),
        "no gateway/service/stats URL in the demo's output:\n{seen}"
    );
    // Keep draining stdout so the demo never blocks on a full pipe.
    std::thread::spawn(move || for _ in rx {});
    demo
}

#[test]
fn python_client_sees_exactly_once_through_the_demo_gateway() {
    let mut demo = start_demo();
    run_python_client(&demo.gateway, &demo.stats);
    // Ctrl-C stops the demo gracefully (exit code 0).
    stop_gracefully(&mut demo.child.0, "-INT", "demo");
}

#[test]
fn python_client_sees_exactly_once_through_idem_gateway() {
    // The demo's payment service is the upstream; its own gateway is unused here.
    let demo = start_demo();
    let dir = tempfile::tempdir().expect("temp dir");
    let store = format!("sqlite://{}", dir.path().join("gateway.db").display());
    let mut child = idem()
        .args(["gateway", "--log-format", "json", "--listen", "127.0.0.1:0"])
        .args(["--upstream", &demo.service, "--store", &store])
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start idem gateway");
    let rx = lines_of(child.stderr.take().expect("stderr"));
    let mut gateway = Guard(child);

    // The gateway logs its address (JSON logs: one object per line).
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut seen = String::new();
    let listen = loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok(line) = rx.recv_timeout(left) else {
            panic!("idem gateway did not log its address within 30 s; it logged:\n{seen}");
        };
        seen.push_str(&line);
        seen.push('\n');
        let event: serde_json::Value = serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("a log line is not JSON ({e}): {line}"));
        if let Some(addr) = event["fields"]["listen"].as_str() {
            break addr.to_owned();
        }
    };
    std::thread::spawn(move || for _ in rx {});

    run_python_client(&format!("http://{listen}"), &demo.stats);
    // SIGTERM stops the gateway gracefully (exit code 0).
    stop_gracefully(&mut gateway.0, "-TERM", "gateway");
}
