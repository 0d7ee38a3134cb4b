//! gRPC through the gateway: a real tonic server behind `idem gateway`
//! with `--upstream-http2` (h2c prior knowledge to the upstream), a real
//! tonic client speaking h2c to the gateway. The messages are written by
//! hand with `prost::Message` and the calls go through tonic's generic
//! client and server (`tonic::client::Grpc`, `tonic::server::Grpc`): no
//! protoc, no build script. Also: HTTP/2 trailers in both directions on a
//! plain (non-gRPC) unguarded request.

mod common;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use bytes::Bytes;
use http::uri::PathAndQuery;
use http::{HeaderMap, HeaderValue};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::Frame;
use hyper_util::rt::{TokioExecutor, TokioIo};
use idem_core::{DynStore, MemoryStore};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tonic::body::Body as TonicBody;
use tonic::metadata::MetadataValue;
use tonic::{Code, Request as GrpcRequest, Response as GrpcResponse, Status};
use tonic_prost::ProstCodec;

/// `test.Echo` request.
#[derive(Clone, PartialEq, prost::Message)]
struct Ask {
    #[prost(string, tag = "1")]
    text: String,
    /// How many replies a streaming call sends.
    #[prost(uint32, tag = "2")]
    count: u32,
    /// Fail (the unary call at once; the streaming call after its replies).
    #[prost(bool, tag = "3")]
    fail: bool,
}

/// `test.Echo` reply.
#[derive(Clone, PartialEq, prost::Message)]
struct Reply {
    #[prost(string, tag = "1")]
    text: String,
}

type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;
type Replies = Pin<Box<dyn futures::Stream<Item = Result<Reply, Status>> + Send>>;

/// A failure status with custom metadata (sent in the trailers).
fn failure(text: &str) -> Status {
    let mut meta = tonic::metadata::MetadataMap::new();
    meta.insert("x-why", MetadataValue::from_static("asked-to-fail"));
    Status::with_metadata(Code::FailedPrecondition, format!("failing: {text}"), meta)
}

struct Say;

impl tonic::server::UnaryService<Ask> for Say {
    type Response = Reply;
    type Future = BoxFuture<Result<GrpcResponse<Reply>, Status>>;

    fn call(&mut self, req: GrpcRequest<Ask>) -> Self::Future {
        Box::pin(async move {
            let caller = req
                .metadata()
                .get("x-caller")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            let ask = req.into_inner();
            if ask.fail {
                return Err(failure(&ask.text));
            }
            let mut resp = GrpcResponse::new(Reply {
                text: format!("{} from {caller}", ask.text),
            });
            resp.metadata_mut()
                .insert("x-served-by", MetadataValue::from_static("tonic"));
            Ok(resp)
        })
    }
}

struct Count;

impl tonic::server::ServerStreamingService<Ask> for Count {
    type Response = Reply;
    type ResponseStream = Replies;
    type Future = BoxFuture<Result<GrpcResponse<Replies>, Status>>;

    fn call(&mut self, req: GrpcRequest<Ask>) -> Self::Future {
        let ask = req.into_inner();
        Box::pin(async move {
            let mut items: Vec<Result<Reply, Status>> = (1..=ask.count)
                .map(|i| {
                    Ok(Reply {
                        text: format!("{} {i}", ask.text),
                    })
                })
                .collect();
            if ask.fail {
                items.push(Err(failure(&ask.text)));
            }
            let stream: Replies = Box::pin(futures::stream::iter(items));
            Ok(GrpcResponse::new(stream))
        })
    }
}

/// The `test.Echo` service, by hand: what tonic's code generator would
/// write, with the `te` of every request recorded.
#[derive(Clone, Default)]
struct Echo {
    te: Arc<Mutex<Vec<Option<HeaderValue>>>>,
    versions: Arc<Mutex<Vec<http::Version>>>,
}

impl tonic::server::NamedService for Echo {
    const NAME: &'static str = "test.Echo";
}

impl tower_service::Service<http::Request<TonicBody>> for Echo {
    type Response = http::Response<TonicBody>;
    type Error = Infallible;
    type Future = BoxFuture<Result<http::Response<TonicBody>, Infallible>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: http::Request<TonicBody>) -> Self::Future {
        self.te
            .lock()
            .unwrap()
            .push(req.headers().get("te").cloned());
        self.versions.lock().unwrap().push(req.version());
        Box::pin(async move {
            let mut grpc = tonic::server::Grpc::new(ProstCodec::<Reply, Ask>::default());
            Ok(match req.uri().path() {
                "/test.Echo/Say" => grpc.unary(Say, req).await,
                "/test.Echo/Count" => grpc.server_streaming(Count, req).await,
                _ => Status::unimplemented("no such method").into_http(),
            })
        })
    }
}

struct Rig {
    echo: Echo,
    gw: common::TestGateway,
    _server: JoinHandle<()>,
}

/// A tonic server and a gateway with `--upstream-http2` in front of it.
async fn rig() -> Rig {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let echo = Echo::default();
    let svc = echo.clone();
    let server = tokio::spawn(async move {
        tonic::transport::Server::builder()
            .add_service(svc)
            .serve_with_incoming(tonic::transport::server::TcpIncoming::from(listener))
            .await
            .unwrap();
    });
    let mut config = common::config(&format!("http://{addr}"));
    config.upstream_http2 = true;
    let store: DynStore = Arc::new(MemoryStore::new());
    let gw = common::gateway_with(config, store).await;
    Rig {
        echo,
        gw,
        _server: server,
    }
}

/// A tonic client connected (h2c prior knowledge) to the gateway.
type Client = tonic::client::Grpc<tonic::transport::Channel>;

async fn grpc_client(gw: SocketAddr) -> Client {
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{gw}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    // Each call is preceded by `ready` (the channel is a buffer).
    tonic::client::Grpc::new(channel)
}

fn ask(text: &str, count: u32, fail: bool) -> Ask {
    Ask {
        text: text.into(),
        count,
        fail,
    }
}

/// The unary call `path` (`/test.Echo/Say`, …) with `req`.
async fn unary(
    grpc: &mut Client,
    path: &'static str,
    req: GrpcRequest<Ask>,
) -> Result<GrpcResponse<Reply>, Status> {
    grpc.ready().await.unwrap();
    grpc.unary(req, PathAndQuery::from_static(path), ProstCodec::default())
        .await
}

/// The server-streaming call `/test.Echo/Count` with `ask`.
async fn count(grpc: &mut Client, ask: Ask) -> tonic::Streaming<Reply> {
    grpc.ready().await.unwrap();
    grpc.server_streaming(
        GrpcRequest::new(ask),
        PathAndQuery::from_static("/test.Echo/Count"),
        ProstCodec::default(),
    )
    .await
    .unwrap()
    .into_inner()
}

#[tokio::test]
async fn a_unary_call_goes_through_with_its_metadata() {
    let rig = rig().await;
    let mut grpc = grpc_client(rig.gw.addr).await;
    let mut req = GrpcRequest::new(ask("hello", 0, false));
    req.metadata_mut()
        .insert("x-caller", MetadataValue::from_static("test"));
    let resp = unary(&mut grpc, "/test.Echo/Say", req).await.unwrap();
    assert_eq!(resp.metadata().get("x-served-by").unwrap(), "tonic");
    assert_eq!(resp.into_inner().text, "hello from test");
    // The upstream got HTTP/2 and the client's `te: trailers`.
    assert_eq!(*rig.echo.versions.lock().unwrap(), [http::Version::HTTP_2]);
    assert_eq!(
        *rig.echo.te.lock().unwrap(),
        [Some(HeaderValue::from_static("trailers"))]
    );
}

#[tokio::test]
async fn a_grpc_error_status_passes_through() {
    let rig = rig().await;
    let mut grpc = grpc_client(rig.gw.addr).await;
    let err = unary(
        &mut grpc,
        "/test.Echo/Say",
        GrpcRequest::new(ask("nope", 0, true)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(err.message(), "failing: nope");
    assert_eq!(err.metadata().get("x-why").unwrap(), "asked-to-fail");
    let err = unary(
        &mut grpc,
        "/test.Echo/Missing",
        GrpcRequest::new(ask("x", 0, false)),
    )
    .await
    .unwrap_err();
    assert_eq!(err.code(), Code::Unimplemented, "{err:?}");
}

#[tokio::test]
async fn a_server_streaming_call_gets_every_message_and_the_trailers() {
    let rig = rig().await;
    let mut grpc = grpc_client(rig.gw.addr).await;
    let mut stream = count(&mut grpc, ask("tick", 5, false)).await;
    let mut got = Vec::new();
    while let Some(reply) = stream.message().await.unwrap() {
        got.push(reply.text);
    }
    assert_eq!(got, ["tick 1", "tick 2", "tick 3", "tick 4", "tick 5"]);
    // The stream ended on its trailers (grpc-status 0): without them
    // tonic reports the stream as cut short.
    assert!(stream.trailers().await.unwrap().is_some());

    // A stream that fails after its messages: the status and its metadata
    // come in the trailers.
    let mut stream = count(&mut grpc, ask("boom", 2, true)).await;
    assert_eq!(stream.message().await.unwrap().unwrap().text, "boom 1");
    assert_eq!(stream.message().await.unwrap().unwrap().text, "boom 2");
    let err = stream.message().await.unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    assert_eq!(err.message(), "failing: boom");
    assert_eq!(err.metadata().get("x-why").unwrap(), "asked-to-fail");
}

/// A plain HTTP/2 upstream (hyper, h2c) that answers every request with
/// its body and, as trailers, the request's trailers plus `x-upstream`.
async fn trailer_echo() -> (SocketAddr, JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let task = tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let service = hyper::service::service_fn(
                    |req: http::Request<hyper::body::Incoming>| async move {
                        let collected = req.into_body().collect().await.unwrap();
                        let mut trailers = collected.trailers().cloned().unwrap_or_default();
                        trailers.insert("x-upstream", HeaderValue::from_static("done"));
                        let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
                            Ok(Frame::data(collected.to_bytes())),
                            Ok(Frame::trailers(trailers)),
                        ];
                        let mut resp =
                            http::Response::new(StreamBody::new(futures::stream::iter(frames)));
                        // Announced, for an HTTP/1.1 client of the gateway.
                        resp.headers_mut().insert(
                            "trailer",
                            HeaderValue::from_static("x-upstream, x-checksum"),
                        );
                        Ok::<_, Infallible>(resp)
                    },
                );
                let _ = hyper::server::conn::http2::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(tcp), service)
                    .await;
            });
        }
    });
    (addr, task)
}

/// A gateway with `--upstream-http2` in front of [`trailer_echo`].
async fn trailer_rig() -> (common::TestGateway, JoinHandle<()>) {
    let (up, task) = trailer_echo().await;
    let mut config = common::config(&format!("http://{up}"));
    config.upstream_http2 = true;
    (
        common::gateway_with(config, Arc::new(MemoryStore::new())).await,
        task,
    )
}

type Frames = futures::stream::Iter<std::vec::IntoIter<Result<Frame<Bytes>, Infallible>>>;

/// A body of `data` then the trailer `x-checksum: abc123`.
fn with_trailers(data: &'static [u8]) -> StreamBody<Frames> {
    let mut trailers = HeaderMap::new();
    trailers.insert("x-checksum", HeaderValue::from_static("abc123"));
    let frames: Vec<Result<Frame<Bytes>, Infallible>> = vec![
        Ok(Frame::data(Bytes::from_static(data))),
        Ok(Frame::trailers(trailers)),
    ];
    StreamBody::new(futures::stream::iter(frames))
}

#[tokio::test]
async fn http2_trailers_pass_in_both_directions_on_an_unguarded_request() {
    let (gw, _task) = trailer_rig().await;

    let mut send = common::h2_sender(gw.addr).await;
    // PUT is guarded by default only with a key; this one has none.
    let req = http::Request::builder()
        .method("PUT")
        .uri(format!("http://{}/stream", gw.addr))
        .header("te", "trailers")
        .body(with_trailers(b"payload"))
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected.trailers().cloned().expect("response trailers");
    assert_eq!(trailers["x-upstream"], "done");
    assert_eq!(
        trailers["x-checksum"], "abc123",
        "the request's trailers reached the upstream"
    );
    assert_eq!(collected.to_bytes(), "payload");
}

#[tokio::test]
async fn an_http1_client_asking_for_trailers_gets_them_from_an_http2_upstream() {
    let (gw, _task) = trailer_rig().await;
    let tcp = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let (mut send, conn) = hyper::client::conn::http1::handshake(TokioIo::new(tcp))
        .await
        .unwrap();
    tokio::spawn(conn);
    let req = http::Request::builder()
        .method("GET")
        .uri("/stream")
        .header("host", "gw")
        .header("te", "trailers")
        .body(http_body_util::Empty::<Bytes>::new())
        .unwrap();
    let resp = send.send_request(req).await.unwrap();
    assert_eq!(resp.status(), 200);
    let collected = resp.into_body().collect().await.unwrap();
    let trailers = collected
        .trailers()
        .cloned()
        .expect("response trailers over HTTP/1.1");
    assert_eq!(trailers["x-upstream"], "done");
}

/// The documented policy for a guarded request: the first caller gets the
/// upstream's trailers (the layer buffers the body with them), the stored
/// result has none, so a replay carries none; the request's own trailers
/// are not forwarded (its body is buffered as data).
#[tokio::test]
async fn a_guarded_response_keeps_its_trailers_for_the_first_caller_only() {
    let (gw, _task) = trailer_rig().await;
    let mut send = common::h2_sender(gw.addr).await;
    let k = common::key("guarded-trailers");
    let mut calls = Vec::new();
    for _ in 0..2 {
        let req = http::Request::builder()
            .method("POST")
            .uri(format!("http://{}/orders", gw.addr))
            .header("idempotency-key", k.as_str())
            .header("content-type", "application/json")
            .header("te", "trailers")
            .body(with_trailers(b"{}"))
            .unwrap();
        let resp = send.send_request(req).await.unwrap();
        let replayed = resp.headers().get("idempotent-replayed").cloned();
        let collected = resp.into_body().collect().await.unwrap();
        calls.push((replayed, collected.trailers().cloned()));
    }
    let (first_replayed, first) = &calls[0];
    assert_eq!(first_replayed, &None);
    let first = first.as_ref().expect("the first caller gets the trailers");
    assert_eq!(first["x-upstream"], "done");
    assert!(
        first.get("x-checksum").is_none(),
        "a guarded request's trailers are not forwarded"
    );
    let (again_replayed, again) = &calls[1];
    assert_eq!(again_replayed.as_ref().unwrap(), "true");
    assert!(
        again.as_ref().is_none_or(|t| t.get("x-upstream").is_none()),
        "a replay carries no trailers: {again:?}"
    );
}
