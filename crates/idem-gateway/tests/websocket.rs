//! WebSocket (RFC 6455) through the gateway: a real tokio-tungstenite
//! server on loopback behind a real gateway, a real tokio-tungstenite
//! client in front; and what is never upgraded (a guarded request, a 101
//! the client did not ask for).

mod common;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use futures::{SinkExt, StreamExt};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_tungstenite::tungstenite::handshake::server::{Request, Response};
use tokio_tungstenite::tungstenite::protocol::frame::coding::CloseCode;
use tokio_tungstenite::tungstenite::protocol::CloseFrame;
use tokio_tungstenite::tungstenite::Message;
use tokio_tungstenite::{MaybeTlsStream, WebSocketStream};

/// Every test's bound: a hang fails instead of blocking the run.
const BOUND: Duration = Duration::from_secs(20);

type Client = WebSocketStream<MaybeTlsStream<TcpStream>>;

/// What the WebSocket server saw: each handshake's request head, and how
/// each connection ended.
#[derive(Default)]
struct Saw {
    heads: Mutex<Vec<(String, http::HeaderMap)>>,
}

/// A WebSocket echo server on 127.0.0.1:0 (tokio-tungstenite
/// `accept_hdr_async`). On `/close-after-one` it closes (1000, "bye")
/// after echoing the first message. Each connection's end goes to `ends`:
/// `client-close` when the client's Close frame came first, `closed` when
/// the server's own close was answered.
struct WsServer {
    addr: SocketAddr,
    saw: Arc<Saw>,
    ends: mpsc::UnboundedReceiver<&'static str>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for WsServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl WsServer {
    fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    async fn next_end(&mut self) -> &'static str {
        tokio::time::timeout(BOUND, self.ends.recv())
            .await
            .expect("the server saw its connection end")
            .expect("the server runs")
    }
}

// The handshake callback's `Result` is tungstenite's, its error a whole response.
#[allow(clippy::result_large_err)]
async fn ws_server() -> WsServer {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let saw = Arc::new(Saw::default());
    let (tx, ends) = mpsc::unbounded_channel();
    let seen = saw.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let (seen, tx) = (seen.clone(), tx.clone());
            tokio::spawn(async move {
                let mut path = String::new();
                let record = |req: &Request, mut resp: Response| {
                    path = req.uri().path().to_owned();
                    seen.heads
                        .lock()
                        .unwrap()
                        .push((path.clone(), req.headers().clone()));
                    let h = resp.headers_mut();
                    h.insert("x-upstream", "ws-echo".parse().unwrap());
                    if let Some(p) = req.headers().get("sec-websocket-protocol") {
                        h.insert("sec-websocket-protocol", p.clone());
                    }
                    Ok(resp)
                };
                let Ok(ws) = tokio_tungstenite::accept_hdr_async(stream, record).await else {
                    return;
                };
                let end = if path == "/drop-after-one" {
                    drop_after_one(ws).await
                } else {
                    echo(ws, path == "/close-after-one").await
                };
                let _ = tx.send(end);
            });
        }
    });
    WsServer {
        addr,
        saw,
        ends,
        task,
    }
}

/// Echoes one message, then drops the connection without a Close frame
/// (a crashed server).
async fn drop_after_one(mut ws: WebSocketStream<TcpStream>) -> &'static str {
    if let Some(Ok(m)) = ws.next().await {
        let _ = ws.send(m).await;
    }
    "dropped"
}

/// Echoes text and binary messages until the connection ends; closes
/// after the first echo when `close_after_one`.
async fn echo(mut ws: WebSocketStream<TcpStream>, close_after_one: bool) -> &'static str {
    let mut closing = false;
    while let Some(msg) = ws.next().await {
        match msg {
            Ok(m @ (Message::Text(_) | Message::Binary(_))) => {
                if ws.send(m).await.is_err() {
                    return "send-failed";
                }
                if close_after_one && !closing {
                    closing = true;
                    let bye = CloseFrame {
                        code: CloseCode::Normal,
                        reason: "bye".into(),
                    };
                    if ws.close(Some(bye)).await.is_err() {
                        return "close-failed";
                    }
                }
            }
            Ok(Message::Close(_)) if closing => return "closed",
            Ok(Message::Close(_)) => {
                // tungstenite answers the Close; drain to the end.
                while let Some(Ok(_)) = ws.next().await {}
                return "client-close";
            }
            Ok(_) => {}
            Err(_) => return if closing { "closed" } else { "error" },
        }
    }
    if closing {
        "closed"
    } else {
        "eof"
    }
}

/// A WebSocket client through the gateway at `gw`, to `path`.
async fn connect(gw: &TestGateway, path: &str) -> Client {
    connect_with(gw, path, &[]).await.0
}

/// [`connect`] with extra request `headers`; the 101's headers beside.
async fn connect_with(
    gw: &TestGateway,
    path: &str,
    headers: &[(&'static str, &'static str)],
) -> (Client, http::HeaderMap) {
    use tokio_tungstenite::tungstenite::client::IntoClientRequest;
    let mut req = format!("ws://{}{path}", gw.addr)
        .into_client_request()
        .unwrap();
    for (name, value) in headers {
        req.headers_mut().insert(*name, value.parse().unwrap());
    }
    let (ws, resp) = tokio::time::timeout(BOUND, tokio_tungstenite::connect_async(req))
        .await
        .expect("the handshake finishes")
        .expect("the handshake succeeds through the gateway");
    assert_eq!(resp.status(), 101);
    assert!(
        resp.headers().contains_key("sec-websocket-accept"),
        "{:?}",
        resp.headers()
    );
    (ws, resp.headers().clone())
}

/// The next data message, bounded.
async fn next<S>(ws: &mut WebSocketStream<S>) -> Message
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    loop {
        let m = tokio::time::timeout(BOUND, ws.next())
            .await
            .expect("a message in time")
            .expect("the connection is open")
            .expect("a message, not an error");
        if m.is_text() || m.is_binary() || m.is_close() {
            return m;
        }
    }
}

async fn rig_ws() -> (WsServer, TestGateway) {
    let up = ws_server().await;
    let gw = gateway(&up.url(), |_| {}).await;
    (up, gw)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn text_and_binary_are_echoed_through_the_gateway() {
    let (up, gw) = rig_ws().await;
    let (mut ws, answer) =
        connect_with(&gw, "/chat?room=1", &[("sec-websocket-protocol", "chat")]).await;
    assert_eq!(answer["upgrade"], "websocket", "{answer:?}");
    let connection = answer["connection"].to_str().unwrap().to_ascii_lowercase();
    assert_eq!(connection, "upgrade", "{answer:?}");
    assert_eq!(answer["sec-websocket-protocol"], "chat", "{answer:?}");
    assert_eq!(
        answer["x-upstream"], "ws-echo",
        "the upstream's fields pass"
    );
    ws.send(Message::text("hello")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("hello"));
    let bytes: Vec<u8> = (0..=255).collect();
    ws.send(Message::binary(bytes.clone())).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::binary(bytes));
    ws.close(None).await.unwrap();

    let heads = up.saw.heads.lock().unwrap().clone();
    let (path, h) = &heads[0];
    assert_eq!(path, "/chat");
    assert_eq!(h["sec-websocket-protocol"], "chat");
    let connection = h["connection"].to_str().unwrap().to_ascii_lowercase();
    assert_eq!(connection, "upgrade", "{h:?}");
    assert_eq!(h["upgrade"], "websocket");
    assert!(h.contains_key("sec-websocket-key"), "{h:?}");
    assert_eq!(h["sec-websocket-version"], "13");
    assert_eq!(h["x-forwarded-for"], "127.0.0.1");
    assert_eq!(h["host"], up.addr.to_string().as_str());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_messages_flow_both_ways_at_once() {
    let (_up, gw) = rig_ws().await;
    let ws = connect(&gw, "/ws").await;
    let (mut tx, mut rx) = ws.split();
    const N: usize = 2000;
    let sender = tokio::spawn(async move {
        for i in 0..N {
            let m = if i % 2 == 0 {
                Message::text(format!("m{i}"))
            } else {
                Message::binary(i.to_be_bytes().to_vec())
            };
            tx.send(m).await.unwrap();
        }
        tx
    });
    for i in 0..N {
        let m = tokio::time::timeout(BOUND, rx.next())
            .await
            .expect("in time")
            .unwrap()
            .unwrap();
        let want = if i % 2 == 0 {
            Message::text(format!("m{i}"))
        } else {
            Message::binary(i.to_be_bytes().to_vec())
        };
        assert_eq!(m, want, "message {i}");
    }
    let tx = sender.await.unwrap();
    let mut ws = tx.reunite(rx).unwrap();
    ws.close(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_message_passes_whole() {
    let (_up, gw) = rig_ws().await;
    let mut ws = connect(&gw, "/ws").await;
    let big: Vec<u8> = (0..(1 << 20)).map(|i| (i % 251) as u8).collect();
    ws.send(Message::binary(big.clone())).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::binary(big));
    let text = "é".repeat(1 << 19); // 1 MiB of UTF-8
    ws.send(Message::text(text.clone())).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text(text));
    ws.close(None).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_from_the_client_reaches_the_server_and_is_answered() {
    let (mut up, gw) = rig_ws().await;
    let mut ws = connect(&gw, "/ws").await;
    ws.send(Message::text("x")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("x"));
    let bye = CloseFrame {
        code: CloseCode::Away,
        reason: "done".into(),
    };
    ws.close(Some(bye)).await.unwrap();
    // The server's answer to the Close comes back, then the end.
    let answer = next(&mut ws).await;
    assert!(answer.is_close(), "{answer:?}");
    let end = tokio::time::timeout(BOUND, ws.next()).await.expect("ends");
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
    assert_eq!(up.next_end().await, "client-close");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_close_from_the_server_reaches_the_client_and_is_answered() {
    let (mut up, gw) = rig_ws().await;
    let mut ws = connect(&gw, "/close-after-one").await;
    ws.send(Message::text("last")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("last"));
    match next(&mut ws).await {
        Message::Close(Some(frame)) => {
            assert_eq!(frame.code, CloseCode::Normal);
            assert_eq!(frame.reason.as_str(), "bye");
        }
        other => panic!("expected the server's Close, got {other:?}"),
    }
    // tungstenite answered the Close; the connection ends on both sides.
    let end = tokio::time::timeout(BOUND, ws.next()).await.expect("ends");
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
    assert_eq!(up.next_end().await, "closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_that_drops_the_connection_ends_the_clients() {
    let (mut up, gw) = rig_ws().await;
    let mut ws = connect(&gw, "/drop-after-one").await;
    ws.send(Message::text("one")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("one"));
    assert_eq!(up.next_end().await, "dropped");
    let end = tokio::time::timeout(BOUND, ws.next())
        .await
        .expect("the client's connection ends");
    assert!(!matches!(end, Some(Ok(_))), "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_drops_the_connection_ends_the_servers() {
    let (mut up, gw) = rig_ws().await;
    let mut ws = connect(&gw, "/ws").await;
    ws.send(Message::text("one")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("one"));
    drop(ws);
    let end = up.next_end().await;
    assert!(end == "error" || end == "eof", "{end}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn several_websockets_run_at_once() {
    let (up, gw) = rig_ws().await;
    let gw = Arc::new(gw);
    let mut tasks = Vec::new();
    for n in 0..8 {
        let gw = gw.clone();
        tasks.push(tokio::spawn(async move {
            let mut ws = connect(&gw, &format!("/ws/{n}")).await;
            for i in 0..50 {
                let m = Message::text(format!("{n}:{i}"));
                ws.send(m.clone()).await.unwrap();
                assert_eq!(next(&mut ws).await, m);
            }
            ws.close(None).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let heads = up.saw.heads.lock().unwrap().len();
    assert_eq!(heads, 8, "one handshake each");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gateway_shutting_down_closes_an_open_websocket_by_the_grace_deadline() {
    let up = ws_server().await;
    let gw = gateway(&up.url(), |c| c.shutdown_grace = Duration::from_secs(1)).await;
    let mut ws = connect(&gw, "/ws").await;
    ws.send(Message::text("before")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("before"));
    let stopped = tokio::time::timeout(Duration::from_secs(15), gw.stop()).await;
    assert!(
        matches!(stopped, Ok(Ok(()))),
        "serve did not return: {stopped:?}"
    );
    // The tunnel was cut: the client sees its connection end.
    let end = tokio::time::timeout(BOUND, async {
        loop {
            match ws.next().await {
                Some(Ok(m)) if !m.is_close() => continue,
                other => return other,
            }
        }
    })
    .await
    .expect("the client's connection ends");
    assert!(!matches!(end, Some(Ok(ref m)) if !m.is_close()), "{end:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgraded_connection_keeps_its_slot_under_the_connection_cap() {
    let up = ws_server().await;
    let gw = gateway(&up.url(), |c| c.max_connections = 1).await;
    let mut ws = connect(&gw, "/ws").await;
    ws.send(Message::text("hold")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("hold"));
    // The only slot is the WebSocket's: a second connection waits.
    let waiting = tokio::spawn({
        let url = gw.url("/plain");
        async move { client().get(url).send().await.map(|r| r.status()) }
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!waiting.is_finished(), "a second connection was served");
    ws.close(None).await.unwrap();
    while let Ok(Some(Ok(_))) = tokio::time::timeout(BOUND, ws.next()).await {}
    drop(ws);
    let answered = tokio::time::timeout(BOUND, waiting)
        .await
        .expect("served once the WebSocket closed")
        .unwrap();
    // Whatever the WebSocket server makes of a plain GET, the gateway
    // accepted the connection and answered it.
    assert!(answered.is_ok(), "{answered:?}");
}

// ------------------------------------------------------------ not upgraded

/// An upstream that answers every request with `101 Switching Protocols`
/// naming `protocol` (then holds the connection a moment), recording each
/// request head.
struct Switching {
    addr: SocketAddr,
    heads: Arc<Mutex<Vec<String>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Switching {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn switching(protocol: &'static str) -> Switching {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let seen = heads.clone();
    let task = tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = listener.accept().await else {
                return;
            };
            let seen = seen.clone();
            tokio::spawn(async move {
                let head = read_request(&mut s).await;
                seen.lock()
                    .unwrap()
                    .push(String::from_utf8_lossy(&head).into_owned());
                let answer = format!(
                    "HTTP/1.1 101 Switching Protocols\r\nConnection: upgrade\r\nUpgrade: {protocol}\r\n\r\n"
                );
                let _ = s.write_all(answer.as_bytes()).await;
                tokio::time::sleep(Duration::from_millis(500)).await;
            });
        }
    });
    Switching { addr, heads, task }
}

/// Sends `head` (CRLF-separated fields, no final blank line) and `body` to
/// `addr`, and returns the status and the whole answer as text.
async fn raw(addr: SocketAddr, head: &str, body: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).await.unwrap();
    let req = format!(
        "{head}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // `Connection: close` is appended as a second field: the upgrade
    // requests carry their own `Connection: upgrade` too.
    s.write_all(req.as_bytes()).await.unwrap();
    let mut out = Vec::new();
    let _ = tokio::time::timeout(BOUND, s.read_to_end(&mut out)).await;
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guarded_post_asking_for_an_upgrade_is_guarded_not_upgraded() {
    let Rig { up, gw, .. } = rig(|_| {}).await;
    let k = key("ws-post");
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: gw.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\
         Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\
         Content-Type: application/json\r\nIdempotency-Key: {k}"
    );
    let (first, text) = raw(gw.addr, &head, "{}").await;
    assert_eq!(first, 201, "{text}");
    let seen = up.last_seen();
    assert!(!seen.headers.contains_key("upgrade"), "{:?}", seen.headers);
    assert!(
        seen.headers.get_all("connection").iter().all(|v| !v
            .to_str()
            .unwrap()
            .to_ascii_lowercase()
            .contains("upgrade")),
        "{:?}",
        seen.headers
    );
    let (again, text) = raw(gw.addr, &head, "{}").await;
    assert_eq!(again, 201, "{text}");
    assert!(
        text.to_ascii_lowercase()
            .contains("idempotent-replayed: true"),
        "{text}"
    );
    assert_eq!(up.hits(), 1, "the replay did not run upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_101_to_a_guarded_post_is_a_502_and_the_key_is_released() {
    let up = switching("websocket").await;
    let gw = gateway(&format!("http://{}", up.addr), |_| {}).await;
    let k = key("ws-101");
    let head = format!(
        "POST /orders HTTP/1.1\r\nHost: gw.test\r\nConnection: upgrade\r\nUpgrade: websocket\r\n\
         Idempotency-Key: {k}"
    );
    for round in 1..=2 {
        let (status, text) = raw(gw.addr, &head, "{}").await;
        assert_eq!(status, 502, "round {round}: {text}");
        assert!(text.contains("upstream-protocol"), "{text}");
        assert_eq!(
            up.heads.lock().unwrap().len(),
            round,
            "the key was not released"
        );
    }
    for head in up.heads.lock().unwrap().iter() {
        assert!(!head.to_ascii_lowercase().contains("upgrade"), "{head}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_101_the_client_did_not_ask_for_is_a_502() {
    let up = switching("websocket").await;
    let gw = gateway(&format!("http://{}", up.addr), |_| {}).await;
    for head in [
        "GET /ws HTTP/1.1\r\nHost: gw.test",
        // `Upgrade` without the `upgrade` connection option asks for nothing.
        "GET /ws HTTP/1.1\r\nHost: gw.test\r\nUpgrade: websocket",
        // HTTP/1.0 has no upgrades (RFC 9110 §7.8).
        "GET /ws HTTP/1.0\r\nHost: gw.test\r\nConnection: upgrade\r\nUpgrade: websocket",
        // h2c upgrades one connection to HTTP/2: never tunnelled.
        "GET /ws HTTP/1.1\r\nHost: gw.test\r\nConnection: upgrade, HTTP2-Settings\r\n\
         Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__",
    ] {
        let (status, text) = raw(gw.addr, head, "").await;
        assert_eq!(status, 502, "{head:?}: {text}");
        assert!(text.contains("upstream-protocol"), "{text}");
        let seen = up.heads.lock().unwrap().last().cloned().unwrap();
        assert!(!seen.to_ascii_lowercase().contains("upgrade"), "{seen}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_switching_to_a_protocol_not_offered_is_a_502() {
    let up = switching("h2c").await;
    let gw = gateway(&format!("http://{}", up.addr), |_| {}).await;
    let (status, text) = raw(
        gw.addr,
        "GET /ws HTTP/1.1\r\nHost: gw.test\r\nConnection: upgrade\r\nUpgrade: websocket",
        "",
    )
    .await;
    assert_eq!(status, 502, "{text}");
    assert!(text.contains("upstream-protocol"), "{text}");
    let seen = up.heads.lock().unwrap().last().cloned().unwrap();
    assert!(
        seen.to_ascii_lowercase().contains("upgrade: websocket"),
        "the upgrade was asked for upstream: {seen}"
    );
}

// ------------------------------------------------------------------ wss://

/// `wss://`: the TLS listener's connections are upgraded like plain ones
/// (a WebSocket client over rustls, ALPN `http/1.1`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wss_through_the_tls_listener() {
    use common::tls::{client_config, connect as tls_connect, TestCa, Usage};
    let mut up = ws_server().await;
    let dir = tempfile::tempdir().unwrap();
    let ca = TestCa::new("idem test server CA");
    let (cert, key) = ca
        .issue(&["localhost", "127.0.0.1"], Usage::Server)
        .write(dir.path(), "server");
    let gw = gateway(&up.url(), |c| {
        c.tls = Some(idem_gateway::tls::ListenerTls {
            cert,
            key,
            client_ca: None,
        });
    })
    .await;
    let tls = tls_connect(gw.addr, client_config(&ca, &[b"http/1.1"], None))
        .await
        .expect("the TLS handshake");
    let url = format!("wss://localhost:{}/secure", gw.addr.port());
    let (mut ws, resp) = tokio::time::timeout(BOUND, tokio_tungstenite::client_async(url, tls))
        .await
        .expect("the handshake finishes")
        .expect("the WebSocket handshake over TLS");
    assert_eq!(resp.status(), 101);
    ws.send(Message::text("over tls")).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::text("over tls"));
    let big: Vec<u8> = (0..(1 << 20)).map(|i| (i % 253) as u8).collect();
    ws.send(Message::binary(big.clone())).await.unwrap();
    assert_eq!(next(&mut ws).await, Message::binary(big));
    ws.close(None).await.unwrap();
    let answer = next(&mut ws).await;
    assert!(answer.is_close(), "{answer:?}");
    assert_eq!(up.next_end().await, "client-close");
    let heads = up.saw.heads.lock().unwrap().clone();
    assert_eq!(heads[0].0, "/secure");
}
