//! `idem demo --no-serve`: the showcase runs the orders example behind the
//! gateway: a lost provider answer and a retry make one charge, 20
//! concurrent duplicates make one charge, and the demo exits.

mod support;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use support::{idem, succeeded};

/// Runs the `idem` binary with `args` in `dir`, killing it after `limit`.
fn run_idem(dir: &std::path::Path, args: &[&str], limit: Duration) -> Output {
    // Settings from the developer's environment must not change the outcome.
    let mut cmd = idem();
    cmd.args(args)
        .current_dir(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().expect("start idem");
    let start = Instant::now();
    while child.try_wait().expect("wait for idem").is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("collect output");
            panic!(
                "idem {args:?} did not finish within {limit:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().expect("collect output")
}

#[test]
fn demo_walks_the_lost_response_story_and_charges_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = run_idem(
        dir.path(),
        &["demo", "--no-serve", "--listen", "127.0.0.1:0"],
        Duration::from_secs(60),
    );
    let (stdout, _) = succeeded(&out, "idem demo");
    assert!(
        stdout.contains(" 1 time for 20 concurrent requests (order PAID)."),
        "the demo did not report 1 charge for 20 requests:\n{stdout}"
    );
    // The story: 504 with the provider's answer lost, then the retry: PAID,
    // one charge.
    assert!(
        stdout.contains("504 Gateway Timeout, urn:orders:problem:payment-outcome-unknown"),
        "no lost answer shown:\n{stdout}"
    );
    assert!(
        stdout.contains("200 OK, order PAID\n") && stdout.contains("is PAID, 1 charge:"),
        "the retry was not shown as PAID with one charge:\n{stdout}"
    );
    assert!(stdout.contains("Result: order "), "{stdout}");
    assert!(
        stdout.contains("Idempotent-Replayed: true"),
        "no replay shown:\n{stdout}"
    );
    assert!(stdout.contains("422"), "no key-mismatch shown:\n{stdout}");
    assert!(
        !stdout.contains("Serving."),
        "--no-serve must not serve:\n{stdout}"
    );
    // The default store is a SQLite file in the current folder.
    assert!(
        dir.path().join("idem-demo.db").exists(),
        "idem-demo.db was not created in the current folder"
    );
}

#[test]
fn a_second_demo_run_uses_a_fresh_key_and_still_charges_once() {
    let dir = tempfile::tempdir().expect("temp dir");
    for _ in 0..2 {
        let out = run_idem(
            dir.path(),
            &[
                "demo",
                "--no-serve",
                "--listen",
                "127.0.0.1:0",
                "--requests",
                "5",
                "--database",
                "sqlite://orders.db",
            ],
            Duration::from_secs(60),
        );
        let (stdout, _) = succeeded(&out, "idem demo");
        assert!(
            stdout.contains(" 1 time for 5 concurrent requests (order PAID)."),
            "{stdout}"
        );
        // --database puts the orders service's tables where it says; the
        // second run shares them (fresh order numbers each run).
        assert!(dir.path().join("orders.db").exists(), "{stdout}");
    }
}

#[test]
fn help_describes_the_commands() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (args, needles) in [
        (&["--help"][..], &["gateway", "demo"][..]),
        (&["gateway", "--help"][..], &["--upstream", "IDEM_"][..]),
        (&["demo", "--help"][..], &["--no-serve", "--listen"][..]),
    ] {
        let out = run_idem(dir.path(), args, Duration::from_secs(10));
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{args:?}");
        assert!(needles.iter().all(|n| text.contains(n)), "{args:?}: {text}");
    }
}

#[test]
fn gateway_without_upstream_fails_with_a_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = run_idem(dir.path(), &["gateway"], Duration::from_secs(10));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "idem gateway without --upstream succeeded"
    );
    assert!(stderr.contains("upstream"), "unclear message: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn demo_on_a_taken_port_fails_with_a_message() {
    let dir = tempfile::tempdir().expect("temp dir");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let out = run_idem(
        dir.path(),
        &["demo", "--no-serve", "--listen", &addr],
        Duration::from_secs(30),
    );
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the demo started on a taken port");
    assert!(
        stderr.contains(&addr),
        "the message does not name the address: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn gateway_config_errors_exit_2_with_the_flag_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    for (args, needle) in [
        (
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--lease",
                "0",
            ][..],
            "--lease",
        ),
        (
            &[
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--store",
                "nosuchstore://x",
            ][..],
            "--store",
        ),
        (
            &["gateway", "--upstream", "ftp://127.0.0.1:9"][..],
            "--upstream",
        ),
    ] {
        let out = run_idem(dir.path(), args, Duration::from_secs(10));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(
            stderr.contains(needle),
            "{args:?}: the message does not name {needle}: {stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
}
