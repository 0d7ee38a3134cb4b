//! The front door in process (issue 11, items 1, 2 and 9) where a raw
//! socket or HTTP/2 is cheaper than the binary: absolute-form targets are
//! normalised like origin-form ones, and over HTTP/2 (prior knowledge) a
//! lowercase method is refused and `:authority` stands in for `Host`.

mod common;

use bytes::Bytes;
use common::{read_request, upstream};
use http_body_util::{BodyExt, Full};
use tokio::io::AsyncWriteExt;

fn status_of(resp: &[u8]) -> u16 {
    String::from_utf8_lossy(resp)
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

#[tokio::test]
async fn absolute_form_targets_are_normalised_too() {
    let up = upstream().await;
    let gw = common::gateway(&up.url(), |c| c.layer.require_token = vec!["/echo".into()]).await;
    // A token route spelled otherwise inside an absolute-form target.
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(
        b"POST http://gw.test/%65cho/1 HTTP/1.1\r\nHost: gw.test\r\nContent-Length: 0\r\n\r\n",
    )
    .await
    .unwrap();
    let resp = read_request(&mut s).await;
    assert_eq!(status_of(&resp), 428, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(up.hits(), 0);
    // And an unguarded one reaches the upstream normalised.
    let mut s = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    s.write_all(b"GET http://gw.test/a/..//items?x=/../y HTTP/1.1\r\nHost: gw.test\r\n\r\n")
        .await
        .unwrap();
    let resp = read_request(&mut s).await;
    assert_eq!(status_of(&resp), 200, "{}", String::from_utf8_lossy(&resp));
    assert_eq!(up.last_seen().uri.to_string(), "/items?x=/../y");
}

#[tokio::test]
async fn http2_lowercase_methods_are_refused_and_authority_is_enough() {
    let up = upstream().await;
    let gw = common::gateway(&up.url(), |_| {}).await;
    let mut send = common::h2_sender(gw.addr).await;
    let req = |method: &str, path: &str| {
        http::Request::builder()
            .method(http::Method::from_bytes(method.as_bytes()).unwrap())
            .uri(format!("http://{}{path}", gw.addr))
            .header("idempotency-key", common::key("h2"))
            .body(Full::new(Bytes::from_static(b"{}")))
            .unwrap()
    };
    let resp = send.send_request(req("post", "/orders")).await.unwrap();
    assert_eq!(resp.status(), 400);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("urn:idem:problem:method-case"),
        "{body:?}"
    );
    assert_eq!(up.hits(), 0);
    // No Host field over HTTP/2: `:authority` is the host, not a 400.
    let resp = send.send_request(req("POST", "/%6Frders")).await.unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(up.last_seen().uri.path(), "/orders");
    // A Host that names another entity than :authority is malformed
    // (RFC 9113 §8.3.1); the same one (any case) is fine.
    let mut other = req("POST", "/orders");
    other
        .headers_mut()
        .insert("host", http::HeaderValue::from_static("evil.example"));
    let resp = send.send_request(other).await.unwrap();
    assert_eq!(resp.status(), 400);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert!(
        String::from_utf8_lossy(&body).contains("urn:idem:problem:invalid-host"),
        "{body:?}"
    );
    let mut same = req("POST", "/orders");
    same.headers_mut().insert(
        "host",
        http::HeaderValue::from_str(&gw.addr.to_string()).unwrap(),
    );
    let resp = send.send_request(same).await.unwrap();
    assert_eq!(resp.status(), 201);
    assert_eq!(
        up.hits(),
        2,
        "the mismatched Host never reached the upstream"
    );
}
