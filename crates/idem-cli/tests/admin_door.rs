//! The admin listener's own door, through the binary: a bad token file is
//! a configuration error (exit 2), the bearer scheme is case-insensitive,
//! the old `/_idem/health` name answers there too, and silent connections
//! can neither pile up past the admin cap nor starve the client port.

mod support;

use std::io::Read;
use std::time::{Duration, Instant};

use support::*;

const TOKEN: &str = "door-token-0123456789abcdef";

#[tokio::test]
async fn an_unusable_token_file_is_a_configuration_error() {
    let dir = tempfile::tempdir().unwrap();
    let short = dir.path().join("short.token");
    std::fs::write(&short, "abc\n").unwrap();
    let missing = dir.path().join("missing.token");
    for file in [&short, &missing] {
        let out = idem()
            .args([
                "gateway",
                "--upstream",
                "http://127.0.0.1:9",
                "--store",
                "memory://",
            ])
            .args(["--listen", &free_addr().to_string()])
            .args(["--admin-listen", &free_addr().to_string()])
            .arg("--admin-token-file")
            .arg(file)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{}: {err}", file.display());
        assert!(err.contains("admin-token-file"), "{err}");
    }
}

#[tokio::test]
async fn bearer_in_any_case_health_alias_and_silent_connections() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upstream::start().await;
    let token = dir.path().join("admin.token");
    std::fs::write(&token, format!("{TOKEN}\r\n")).unwrap();
    let gw = GatewayProc::start(
        dir.path(),
        "gw",
        &[
            "--upstream",
            &up.url,
            "--store",
            "memory://",
            "--admin-token-file",
            token.to_str().unwrap(),
        ],
    )
    .await;
    let c = reqwest::Client::new();
    let admin = format!("http://{}", gw.admin);
    for scheme in ["Bearer", "bearer", "BEARER"] {
        let r = c
            .get(format!("{admin}/status.json"))
            .header("authorization", format!("{scheme} {TOKEN}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "scheme {scheme}");
    }
    for wrong in [
        format!("Bearer {TOKEN}x"),
        format!("Bearer  {TOKEN}"),
        TOKEN.to_owned(),
    ] {
        let r = c
            .get(format!("{admin}/status.json"))
            .header("authorization", wrong.as_str())
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{wrong:?}");
    }
    let r = c.get(format!("{admin}/_idem/health")).send().await.unwrap();
    assert_eq!(r.status(), 200);

    // Silent connections fill the admin cap (16); one more is closed at
    // once; the client port serves throughout; the silent ones are closed
    // after the 10 s first-byte wait and the admin port serves again.
    let silent: Vec<std::net::TcpStream> = (0..16)
        .map(|_| std::net::TcpStream::connect(gw.admin).unwrap())
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut extra = std::net::TcpStream::connect(gw.admin).unwrap();
    extra
        .set_read_timeout(Some(Duration::from_secs(3)))
        .unwrap();
    let mut buf = [0u8; 1];
    let n = extra.read(&mut buf);
    assert!(
        matches!(n, Ok(0)) || n.is_err_and(|e| e.kind() == std::io::ErrorKind::ConnectionReset),
        "a 17th silent admin connection was kept open"
    );
    let r = c.get(gw.url("/_idem/live")).send().await.unwrap();
    assert_eq!(r.status(), 200, "the client port stopped serving");
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let scraped = reqwest::Client::new()
            .get(format!("{admin}/metrics"))
            .timeout(Duration::from_secs(2))
            .send()
            .await;
        if scraped.is_ok_and(|r| r.status() == 200) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the admin port did not recover after its silent connections"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    drop(silent);
}
