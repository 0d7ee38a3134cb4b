//! Sending the probe's requests: one fresh connection per request (so
//! concurrent copies really are concurrent, and a hang-up closes exactly
//! one request's socket), a rate limit, and a budget of requests.

use std::fmt;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use hyper_util::rt::TokioIo;
use serde::Serialize;

/// The largest answer body read; a longer one is a failed request.
const MAX_ANSWER_BODY: usize = 4 * 1024 * 1024;

/// Where requests go: the host and port of an `http://` URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Origin {
    /// The host as written in the URL, without IPv6 brackets.
    pub(crate) host: String,
    /// The port (80 when the URL names none).
    pub(crate) port: u16,
    /// The authority as written (`host[:port]`), sent as `Host`.
    pub(crate) authority: String,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "http://{}", self.authority)
    }
}

/// An `http://` URL: its origin, and its path and query.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Url {
    pub(crate) origin: Origin,
    /// The origin-form request target (`/orders?x=1`), never empty.
    pub(crate) target: String,
}

impl Url {
    /// Parses an absolute `http://` URL.
    ///
    /// # Errors
    /// A message naming what is wrong: not a URL, another scheme, user
    /// information, no host.
    pub(crate) fn parse(s: &str) -> Result<Url, String> {
        if !s.contains("://") {
            return Err(format!(
                "{s:?} is not an absolute URL; write http://host:port/path"
            ));
        }
        let uri: http::Uri = s
            .trim()
            .parse()
            .map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some("https") => {
                return Err(format!(
                    "{s:?}: https:// is not supported yet; probe the service's plain-HTTP \
                     listener (e.g. on 127.0.0.1)"
                ))
            }
            Some(other) => return Err(format!("{s:?}: the scheme {other}:// is not http://")),
            None => {
                return Err(format!(
                    "{s:?} is not an absolute URL; write http://host:port/path"
                ))
            }
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{s:?} names no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!("{s:?}: user information in the URL is not supported; send it with -H 'Authorization: …'"));
        }
        let host = authority
            .host()
            .trim_start_matches('[')
            .trim_end_matches(']');
        if host.is_empty() {
            return Err(format!("{s:?} names no host"));
        }
        // A port that is not one (`:99999`, `:`) must not fall back to 80.
        let raw = authority.as_str();
        let after_host = &raw[raw.rfind(']').map_or(0, |i| i + 1)..];
        let port = match after_host.rsplit_once(':') {
            Some((_, p)) => p
                .parse::<u16>()
                .ok()
                .filter(|p| *p > 0)
                .ok_or_else(|| format!("{s:?}: {p:?} is not a port (1 to 65535)"))?,
            None => 80,
        };
        let target = match uri.path_and_query().map(|p| p.as_str()) {
            None | Some("") => "/".to_owned(),
            Some(p) if !p.starts_with('/') => format!("/{p}"),
            Some(p) => p.to_owned(),
        };
        Ok(Url {
            origin: Origin {
                host: host.to_owned(),
                port,
                authority: authority.as_str().to_owned(),
            },
            target,
        })
    }

    /// The same origin with another request target.
    pub(crate) fn with_target(&self, target: &str) -> Url {
        Url {
            origin: self.origin.clone(),
            target: target.to_owned(),
        }
    }

    /// The path without the query.
    pub(crate) fn path(&self) -> &str {
        self.target.split('?').next().unwrap_or("/")
    }

    /// The query, with its `?`, or "".
    pub(crate) fn query(&self) -> &str {
        self.target.find('?').map_or("", |i| &self.target[i..])
    }
}

impl fmt::Display for Url {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.origin, self.target)
    }
}

/// One request to send.
#[derive(Debug, Clone)]
pub(crate) struct Req {
    pub(crate) method: Method,
    pub(crate) url: Url,
    /// Header fields in order (the key field among them, when sent).
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
}

/// An answer, read to the end.
#[derive(Debug, Clone)]
pub(crate) struct Answer {
    pub(crate) status: StatusCode,
    pub(crate) headers: HeaderMap,
    pub(crate) body: Bytes,
}

impl Answer {
    /// Whether it carries `Idempotent-Replayed: true`.
    pub(crate) fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
    }

    /// Whether the status is 2xx.
    pub(crate) fn success(&self) -> bool {
        self.status.is_success()
    }

    /// The same status and body bytes as `other`.
    pub(crate) fn same_as(&self, other: &Answer) -> bool {
        self.status == other.status && self.body == other.body
    }
}

/// What became of one request.
#[derive(Debug, Clone)]
pub(crate) enum Outcome {
    /// An answer came.
    Answered(Answer),
    /// The probe hung up before the answer, on purpose.
    HungUp,
    /// No answer: a connection error, a timeout, the budget.
    Failed(String),
}

/// One request and what became of it, with its timing (for the report).
#[derive(Debug, Clone)]
pub(crate) struct Exchange {
    /// What the request was for ("copy 3", "retry").
    pub(crate) label: String,
    pub(crate) method: Method,
    pub(crate) target: String,
    /// The key field's value as sent (lossy), or `None` without one.
    pub(crate) key: Option<String>,
    /// When it was sent, since the probe started.
    pub(crate) sent_at: Duration,
    /// How long until the answer (or the hang-up, or the failure).
    pub(crate) took: Duration,
    pub(crate) outcome: Outcome,
}

impl Exchange {
    /// The answer, when one came.
    pub(crate) fn answer(&self) -> Option<&Answer> {
        match &self.outcome {
            Outcome::Answered(a) => Some(a),
            _ => None,
        }
    }

    /// The status code, when an answer came.
    pub(crate) fn status(&self) -> Option<u16> {
        self.answer().map(|a| a.status.as_u16())
    }

    /// The status, or what happened instead ("hung up", "error").
    pub(crate) fn short(&self) -> String {
        match &self.outcome {
            Outcome::Answered(a) => a.status.as_u16().to_string(),
            Outcome::HungUp => "hung up".to_owned(),
            Outcome::Failed(_) => "error".to_owned(),
        }
    }

    /// The record of it in the report.
    pub(crate) fn record(&self) -> RequestRecord {
        let (outcome, error) = match &self.outcome {
            Outcome::Answered(_) => ("answered", None),
            Outcome::HungUp => ("hung-up", None),
            Outcome::Failed(e) => ("failed", Some(e.clone())),
        };
        RequestRecord {
            label: self.label.clone(),
            method: self.method.to_string(),
            target: self.target.clone(),
            key: self.key.clone(),
            sent_ms: millis(self.sent_at),
            took_ms: millis(self.took),
            outcome,
            status: self.status(),
            replayed: self.answer().is_some_and(Answer::replayed),
            retry_after: self.answer().and_then(|a| {
                a.headers
                    .get(header::RETRY_AFTER)
                    .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
            }),
            error,
        }
    }
}

/// Milliseconds with one decimal.
fn millis(d: Duration) -> f64 {
    (d.as_secs_f64() * 10_000.0).round() / 10.0
}

/// One request in the JSON report.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct RequestRecord {
    pub(crate) label: String,
    pub(crate) method: String,
    pub(crate) target: String,
    /// The key sent (`null`: none).
    pub(crate) key: Option<String>,
    /// When it was sent, in ms since the probe started.
    pub(crate) sent_ms: f64,
    /// How long until its answer, hang-up or failure, in ms.
    pub(crate) took_ms: f64,
    /// `answered`, `hung-up` or `failed`.
    pub(crate) outcome: &'static str,
    pub(crate) status: Option<u16>,
    /// Whether the answer carried `Idempotent-Replayed: true`.
    pub(crate) replayed: bool,
    /// The answer's `Retry-After`, as sent.
    pub(crate) retry_after: Option<String>,
    pub(crate) error: Option<String>,
}

/// An open connection for one request; closed (the socket dropped) when
/// this is dropped.
pub(crate) struct Conn {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    task: tokio::task::JoinHandle<()>,
}

impl fmt::Debug for Conn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Conn").finish_non_exhaustive()
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// A token bucket: `rate` tokens a second, at most `cap` saved.
#[derive(Debug)]
struct Bucket {
    tokens: f64,
    cap: f64,
    rate: f64,
    last: Instant,
}

/// Sends requests within the rate limit and the budget.
#[derive(Debug)]
pub(crate) struct Client {
    start: Instant,
    timeout: Duration,
    key_header: HeaderName,
    bucket: Mutex<Bucket>,
    budget: usize,
    used: AtomicUsize,
}

impl Client {
    /// A client allowing `rate` requests a second (bursts of `burst`),
    /// `budget` requests in all, each given `timeout`.
    pub(crate) fn new(
        rate: f64,
        burst: usize,
        budget: usize,
        timeout: Duration,
        key_header: HeaderName,
    ) -> Self {
        let cap = burst.max(1) as f64;
        Client {
            start: Instant::now(),
            timeout,
            key_header,
            bucket: Mutex::new(Bucket {
                tokens: cap,
                cap,
                rate,
                last: Instant::now(),
            }),
            budget,
            used: AtomicUsize::new(0),
        }
    }

    /// How many requests were sent (or were about to be) so far.
    pub(crate) fn used(&self) -> usize {
        self.used.load(Ordering::SeqCst)
    }

    /// Takes `n` requests from the budget, then waits until the rate limit
    /// allows `n` at once.
    ///
    /// # Errors
    /// The budget is spent.
    pub(crate) async fn permit(&self, n: usize) -> Result<(), String> {
        let budget = self.budget;
        self.used
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |u| {
                (u + n <= budget).then_some(u + n)
            })
            .map_err(|_| format!("the request budget (--max-requests {budget}) is spent"))?;
        loop {
            let wait = {
                let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
                let now = Instant::now();
                let gained = now.duration_since(b.last).as_secs_f64() * b.rate;
                b.tokens = (b.tokens + gained).min(b.cap);
                b.last = now;
                let want = (n as f64).min(b.cap);
                if b.tokens >= want {
                    b.tokens -= want;
                    None
                } else {
                    Some(Duration::from_secs_f64((want - b.tokens) / b.rate))
                }
            };
            match wait {
                None => return Ok(()),
                Some(d) => tokio::time::sleep(d).await,
            }
        }
    }

    /// Opens a connection to `origin`.
    ///
    /// # Errors
    /// The connection failed or timed out.
    pub(crate) async fn connect(&self, origin: &Origin) -> Result<Conn, String> {
        let connect = tokio::net::TcpStream::connect((origin.host.as_str(), origin.port));
        let stream = tokio::time::timeout(self.timeout, connect)
            .await
            .map_err(|_| {
                format!(
                    "cannot connect to {origin}: no answer within {:?}",
                    self.timeout
                )
            })?
            .map_err(|e| format!("cannot connect to {origin}: {e}"))?;
        let _ = stream.set_nodelay(true);
        let (sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(|e| format!("cannot talk HTTP/1.1 to {origin}: {e}"))?;
        let task = tokio::spawn(async move {
            let _ = conn.await;
        });
        Ok(Conn { sender, task })
    }

    /// Takes a permit, connects and sends `req`.
    pub(crate) async fn send(&self, req: &Req, label: &str) -> Exchange {
        let sent_at = self.start.elapsed();
        if let Err(e) = self.permit(1).await {
            return self.exchange(req, label, sent_at, Duration::ZERO, Outcome::Failed(e));
        }
        let sent_at = self.start.elapsed();
        let t0 = Instant::now();
        match self.connect(&req.url.origin).await {
            Ok(conn) => self.send_on(conn, req, label, None).await,
            Err(e) => self.exchange(req, label, sent_at, t0.elapsed(), Outcome::Failed(e)),
        }
    }

    /// Sends `req` on `conn` (its permit already taken) and reads the
    /// answer; with `hang_up_after`, closes the connection when no full
    /// answer came by then.
    pub(crate) async fn send_on(
        &self,
        mut conn: Conn,
        req: &Req,
        label: &str,
        hang_up_after: Option<Duration>,
    ) -> Exchange {
        let sent_at = self.start.elapsed();
        let t0 = Instant::now();
        let request = match build(req) {
            Ok(r) => r,
            Err(e) => {
                return self.exchange(req, label, sent_at, Duration::ZERO, Outcome::Failed(e))
            }
        };
        let exchange = async {
            conn.sender
                .ready()
                .await
                .map_err(|e| format!("connection closed before the request: {e}"))?;
            let resp = conn
                .sender
                .send_request(request)
                .await
                .map_err(|e| format!("no answer: {e}"))?;
            let (parts, body) = resp.into_parts();
            let body = Limited::new(body, MAX_ANSWER_BODY)
                .collect()
                .await
                .map_err(|e| format!("the answer's body broke off: {e}"))?
                .to_bytes();
            Ok::<_, String>(Answer {
                status: parts.status,
                headers: parts.headers,
                body,
            })
        };
        let outcome = match hang_up_after {
            Some(d) => match tokio::time::timeout(d.min(self.timeout), exchange).await {
                Ok(Ok(a)) => Outcome::Answered(a),
                Ok(Err(e)) => Outcome::Failed(e),
                Err(_) => Outcome::HungUp,
            },
            None => match tokio::time::timeout(self.timeout, exchange).await {
                Ok(Ok(a)) => Outcome::Answered(a),
                Ok(Err(e)) => Outcome::Failed(e),
                Err(_) => {
                    Outcome::Failed(format!("no answer within {:?} (--timeout)", self.timeout))
                }
            },
        };
        // Closes the socket now, whatever the server still sends.
        drop(conn);
        self.exchange(req, label, sent_at, t0.elapsed(), outcome)
    }

    fn exchange(
        &self,
        req: &Req,
        label: &str,
        sent_at: Duration,
        took: Duration,
        outcome: Outcome,
    ) -> Exchange {
        let key = req
            .headers
            .iter()
            .find(|(n, _)| *n == self.key_header)
            .map(|(_, v)| String::from_utf8_lossy(v.as_bytes()).into_owned());
        Exchange {
            label: label.to_owned(),
            method: req.method.clone(),
            target: req.url.target.clone(),
            key,
            sent_at,
            took,
            outcome,
        }
    }
}

/// The hyper request for `req`: origin-form target, `Host` (unless given),
/// the fields, `Content-Length` (unless a bodiless GET/HEAD).
fn build(req: &Req) -> Result<Request<Full<Bytes>>, String> {
    let mut b = Request::builder()
        .method(req.method.clone())
        .uri(req.url.target.as_str());
    if !req.headers.iter().any(|(n, _)| *n == header::HOST) {
        b = b.header(header::HOST, req.url.origin.authority.as_str());
    }
    for (n, v) in &req.headers {
        b = b.header(n, v);
    }
    let bodiless = req.body.is_empty() && matches!(req.method, Method::GET | Method::HEAD);
    if !bodiless {
        b = b.header(header::CONTENT_LENGTH, req.body.len());
    }
    b.body(Full::new(req.body.clone()))
        .map_err(|e| format!("cannot build the request: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_are_parsed_and_refused_with_reasons() {
        let u = Url::parse("http://127.0.0.1:8080/orders?x=1").unwrap();
        assert_eq!(u.origin.host, "127.0.0.1");
        assert_eq!(u.origin.port, 8080);
        assert_eq!(u.target, "/orders?x=1");
        assert_eq!(u.path(), "/orders");
        assert_eq!(u.query(), "?x=1");
        let v6 = Url::parse("http://[::1]:9/").unwrap();
        assert_eq!(v6.origin.host, "::1");
        assert_eq!(v6.origin.authority, "[::1]:9");
        assert_eq!(Url::parse("http://localhost").unwrap().target, "/");
        assert!(Url::parse("https://x/").unwrap_err().contains("https"));
        assert!(Url::parse("/orders").unwrap_err().contains("absolute"));
        assert!(Url::parse("http://u:p@x/").unwrap_err().contains("user"));
        assert!(Url::parse("not a url").is_err());
        assert!(Url::parse("http://127.0.0.1:99999/")
            .unwrap_err()
            .contains("not a port"));
        assert!(Url::parse("http://127.0.0.1:/").is_err());
        assert_eq!(Url::parse("http://[::1]/").unwrap().origin.port, 80);
    }
}
