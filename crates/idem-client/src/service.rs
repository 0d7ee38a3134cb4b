//! [`IdempotentService`]: one logical request, one key, as many attempts
//! as the policy allows.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use bytes::Bytes;
use http::{HeaderMap, HeaderName, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, Full, LengthLimitError, Limited};
use tokio::time::Instant;
use tower::ServiceExt;
use tower_service::Service;

use crate::config::{Config, IDEMPOTENT_REPLAYED};
use crate::error::{BoxError, Error, Failure};
use crate::key::{IdempotencyKey, InvalidKey};
use crate::policy::{verdict, Verdict};
use crate::retry_after::retry_after;

/// Response extension: whether the final answer was a replay of a stored
/// response (`Idempotent-Replayed: true`), i.e. an earlier attempt (or
/// another copy of the request) ran it and this one got its outcome.
/// Treat it as success, as the draft advises. Always `false` for a request
/// sent without a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Replayed(pub bool);

/// Response extension: how many attempts the call made, the last one
/// included (1 when the first attempt got the final answer).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Attempts(pub u32);

/// The future of [`IdempotentService::call`].
pub type ResponseFuture<T> = Pin<Box<dyn Future<Output = Result<T, Error>> + Send>>;

/// The [`Service`] built by [`crate::IdempotentLayer`].
///
/// For a request whose method is keyed (POST and PATCH by default) it
///
/// 1. takes the key: the request's own key header (one field; an sf-string
///    `"…"` or a bare key, sent as it is), else an [`IdempotencyKey`]
///    request extension, else a fresh UUID v4 — one per call, i.e. per
///    logical request;
/// 2. **buffers the body** into [`Bytes`] once (up to the layer's
///    `max_body`), so the request can be sent again: the inner service
///    takes `Request<Full<Bytes>>` (a hyper-util
///    `Client<_, Full<Bytes>>`);
/// 3. sends it, and again with **the same key** after a retryable outcome —
///    a transport error (connection refused, reset, closed before the
///    answer), no response headers within the attempt timeout, or a
///    status [`crate::is_retryable_response`] accepts (409 with `Retry-After`, 429, 5xx) — waiting
///    the server's `Retry-After` (RFC 9110 §10.2.3, bounded by the policy's
///    `max_retry_after`) or else a jittered exponential backoff, within
///    the policy's attempts and deadline;
/// 4. returns the first final response as it is (its body streams), with
///    the extensions [`Replayed`], [`Attempts`] and the [`IdempotencyKey`]
///    used.
///
/// A request of another method is sent once, without a key; every
/// response to it is final.
///
/// A response body that breaks after its headers arrived is the caller's
/// to see (reading the body fails): resend the request with the response's
/// [`IdempotencyKey`] extension to get the stored answer.
///
/// # Errors
/// Before anything is sent: [`Error::InvalidKey`] (the request's key header
/// or extension breaks the draft's syntax, or there are two key fields),
/// [`Error::BodyTooLarge`], [`Error::Body`]. After: [`Error::AttemptsExhausted`]
/// (every attempt allowed got a retryable outcome) and
/// [`Error::DeadlineExceeded`] (no time left for the next attempt or wait),
/// both with the attempts made, the last [`crate::Failure`] and the key.
/// The outcome of a request whose attempts all failed is unknown: it may
/// have run (a lost response). Ask again later with the same key.
#[derive(Clone, Debug)]
pub struct IdempotentService<S> {
    inner: S,
    config: Arc<Config>,
}

impl<S> IdempotentService<S> {
    pub(crate) fn new(inner: S, config: Arc<Config>) -> Self {
        Self { inner, config }
    }

    /// The wrapped service.
    pub fn get_ref(&self) -> &S {
        &self.inner
    }
}

impl<S, B, ResBody> Service<Request<B>> for IdempotentService<S>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Clone + Send + 'static,
    S::Future: Send,
    S::Error: Into<BoxError>,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<BoxError>,
    ResBody: Send + 'static,
{
    type Response = Response<ResBody>;
    type Error = Error;
    type Future = ResponseFuture<Response<ResBody>>;

    /// Always ready: each attempt waits for the inner service's readiness
    /// (a readiness error counts as a transport failure of that attempt).
    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let inner = self.inner.clone();
        let config = self.config.clone();
        Box::pin(run(inner, config, req))
    }
}

async fn run<S, B, ResBody>(
    mut inner: S,
    config: Arc<Config>,
    req: Request<B>,
) -> Result<Response<ResBody>, Error>
where
    S: Service<Request<Full<Bytes>>, Response = Response<ResBody>> + Send,
    S::Error: Into<BoxError>,
    B: Body + Send,
    B::Error: Into<BoxError>,
{
    let start = Instant::now();
    let policy = &config.policy;
    let deadline_at = start + policy.deadline();
    let (mut parts, body) = req.into_parts();
    let keyed = config.methods.contains(&parts.method);
    let key = if keyed {
        let key = take_key(&config.header, &parts.headers, parts.extensions.get())
            .map_err(Error::InvalidKey)?;
        if !parts.headers.contains_key(&config.header) {
            parts
                .headers
                .insert(config.header.clone(), key.header_value(config.quoted));
        }
        Some(key)
    } else {
        None
    };
    let body = match Limited::new(body, config.max_body).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<LengthLimitError>() => {
            return Err(Error::BodyTooLarge {
                limit: config.max_body,
            })
        }
        Err(e) => return Err(Error::Body(e)),
    };
    let max_attempts = if keyed { policy.max_attempts() } else { 1 };

    let mut attempts = 0u32;
    let mut last: Option<Failure> = None;
    loop {
        let remaining = deadline_at.saturating_duration_since(Instant::now());
        if remaining.is_zero() {
            return Err(Error::DeadlineExceeded {
                attempts,
                key,
                deadline: policy.deadline(),
                last,
            });
        }
        attempts += 1;
        let limit = policy
            .attempt_timeout()
            .map_or(remaining, |t| t.min(remaining));
        let request = Request::from_parts(parts.clone(), Full::new(body.clone()));
        let sent = tokio::time::timeout(limit, async {
            let ready = inner.ready().await.map_err(Into::into)?;
            ready.call(request).await.map_err(Into::<BoxError>::into)
        })
        .await;
        let failure = match sent {
            Err(_elapsed) => Failure::Timeout(limit),
            Ok(Err(e)) => Failure::Transport(e),
            Ok(Ok(mut response)) => {
                if !keyed || verdict(response.status(), response.headers()) == Verdict::Final {
                    let replayed = keyed && is_replayed(response.headers());
                    let ext = response.extensions_mut();
                    ext.insert(Replayed(replayed));
                    ext.insert(Attempts(attempts));
                    if let Some(key) = key {
                        ext.insert(key);
                    }
                    return Ok(response);
                }
                Failure::Status {
                    status: response.status(),
                    retry_after: retry_after(response.headers(), SystemTime::now()),
                }
            }
        };
        if attempts >= max_attempts {
            return Err(Error::AttemptsExhausted {
                attempts,
                key,
                last: failure,
            });
        }
        let asked = match &failure {
            Failure::Status { retry_after, .. } => *retry_after,
            _ => None,
        };
        let wait = policy.wait(attempts, asked);
        if Instant::now() + wait >= deadline_at {
            return Err(Error::DeadlineExceeded {
                attempts,
                key,
                deadline: policy.deadline(),
                last: Some(failure),
            });
        }
        tracing::debug!(
            key = key.as_ref().map(IdempotencyKey::as_str),
            attempt = attempts,
            outcome = %failure,
            wait_ms = wait.as_millis() as u64,
            "idempotent request: retrying with the same key"
        );
        last = Some(failure);
        tokio::time::sleep(wait).await;
    }
}

/// The request's key: its own header field, else the extension, else a
/// fresh one.
fn take_key(
    header: &HeaderName,
    headers: &HeaderMap,
    extension: Option<&IdempotencyKey>,
) -> Result<IdempotencyKey, InvalidKey> {
    let mut fields = headers.get_all(header).iter();
    let Some(value) = fields.next() else {
        return match extension {
            Some(key) => IdempotencyKey::new(key.as_str()),
            None => Ok(IdempotencyKey::generate()),
        };
    };
    let count = 1 + fields.count();
    if count > 1 {
        return Err(InvalidKey::Multiple {
            header: header.to_string(),
            count,
        });
    }
    let text = value.to_str().map_err(|_| InvalidKey::Header {
        header: header.to_string(),
    })?;
    match unquote(text) {
        Some(inner) => IdempotencyKey::new(inner),
        None if text.starts_with('"') => Err(InvalidKey::Header {
            header: header.to_string(),
        }),
        None => IdempotencyKey::new(text),
    }
}

/// The string of an RFC 8941 sf-string field value (`"a\"b";p=1` →
/// `a"b`; parameters after it ignored), or `None` when `text` is not one.
fn unquote(text: &str) -> Option<String> {
    let rest = text.strip_prefix('"')?;
    let mut out = String::new();
    let mut chars = rest.char_indices();
    while let Some((i, c)) = chars.next() {
        match c {
            '\\' => match chars.next() {
                Some((_, e @ ('"' | '\\'))) => out.push(e),
                _ => return None,
            },
            '"' => {
                let tail = rest[i + 1..].trim_start_matches(' ');
                return (tail.is_empty() || tail.starts_with(';')).then_some(out);
            }
            c => out.push(c),
        }
    }
    None
}

fn is_replayed(headers: &HeaderMap) -> bool {
    headers
        .get(IDEMPOTENT_REPLAYED)
        .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"true"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(values: &[&str]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for v in values {
            h.append("idempotency-key", v.parse().unwrap());
        }
        h
    }

    const K: HeaderName = crate::config::IDEMPOTENCY_KEY;

    #[test]
    fn the_header_wins_then_the_extension_then_a_fresh_key() {
        let ext = IdempotencyKey::new("from-ext").unwrap();
        let key = take_key(&K, &headers(&["from-header"]), Some(&ext)).unwrap();
        assert_eq!(key.as_str(), "from-header");
        let key = take_key(&K, &headers(&[]), Some(&ext)).unwrap();
        assert_eq!(key.as_str(), "from-ext");
        let a = take_key(&K, &headers(&[]), None).unwrap();
        let b = take_key(&K, &headers(&[]), None).unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn header_forms() {
        let key = |v: &str| take_key(&K, &headers(&[v]), None);
        assert_eq!(key(r#""abc""#).unwrap().as_str(), "abc");
        assert_eq!(key(r#""a\"b";p=1"#).unwrap().as_str(), "a\"b");
        assert_eq!(key("abc").unwrap().as_str(), "abc");
        assert!(matches!(key(r#""abc"#), Err(InvalidKey::Header { .. })));
        assert!(matches!(key(r#""a"b"#), Err(InvalidKey::Header { .. })));
        assert_eq!(key(r#""""#), Err(InvalidKey::Blank));
        assert_eq!(key(""), Err(InvalidKey::Blank));
        assert!(matches!(
            take_key(&K, &headers(&["a", "b"]), None),
            Err(InvalidKey::Multiple { count: 2, .. })
        ));
        let mut h = HeaderMap::new();
        h.insert(&K, http::HeaderValue::from_bytes(b"k\xe9").unwrap());
        assert!(matches!(
            take_key(&K, &h, None),
            Err(InvalidKey::Header { .. })
        ));
    }

    #[test]
    fn replayed_marker() {
        let mut h = HeaderMap::new();
        assert!(!is_replayed(&h));
        h.insert(IDEMPOTENT_REPLAYED, "True".parse().unwrap());
        assert!(is_replayed(&h));
        h.insert(IDEMPOTENT_REPLAYED, "false".parse().unwrap());
        assert!(!is_replayed(&h));
    }
}
