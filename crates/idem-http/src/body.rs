//! Bodies: a whole buffered one ([`full`]), and the body of a first
//! response whose start was buffered for the store ([`Prefixed`]).

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};

use crate::{BoxBody, BoxError};

/// A [`BoxBody`] of one buffered chunk (none when `bytes` is empty).
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use http_body_util::BodyExt;
/// let body = idem_http::full("hello");
/// assert_eq!(body.collect().await.unwrap().to_bytes(), "hello");
/// # });
/// ```
pub fn full(bytes: impl Into<Bytes>) -> BoxBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A buffered prefix, then the rest of the inner body (if any), then the
/// trailers seen while buffering.
///
/// A body that failed while it was buffered is never sent: the caller gets
/// a 502 instead (see `first_response`). Only the unbuffered `rest` past the
/// retention limit can still fail, and its error is passed on as is.
pub(crate) struct Prefixed {
    prefix: Bytes,
    rest: Option<BoxBody>,
    trailers: Option<HeaderMap>,
}

impl std::fmt::Debug for Prefixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefixed")
            .field("prefix_len", &self.prefix.len())
            .field("rest", &self.rest.is_some())
            .field("trailers", &self.trailers)
            .finish()
    }
}

impl Prefixed {
    /// The whole body was buffered (with its trailers, if any).
    pub(crate) fn complete(body: Bytes, trailers: Option<HeaderMap>) -> Self {
        Self {
            prefix: body,
            rest: None,
            trailers,
        }
    }

    /// `prefix` was buffered; `rest` follows.
    pub(crate) fn then(prefix: Bytes, rest: BoxBody) -> Self {
        Self {
            prefix,
            rest: Some(rest),
            trailers: None,
        }
    }
}

impl Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = &mut *self;
        if !this.prefix.is_empty() {
            return Poll::Ready(Some(Ok(Frame::data(std::mem::take(&mut this.prefix)))));
        }
        if let Some(rest) = this.rest.as_mut() {
            match ready!(Pin::new(rest).poll_frame(cx)) {
                Some(frame) => return Poll::Ready(Some(frame)),
                None => this.rest = None,
            }
        }
        Poll::Ready(this.trailers.take().map(|t| Ok(Frame::trailers(t))))
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_empty()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
            && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let n = self.prefix.len() as u64;
        let rest = self
            .rest
            .as_ref()
            .map_or_else(|| SizeHint::with_exact(0), Body::size_hint);
        let mut h = SizeHint::new();
        h.set_lower(rest.lower().saturating_add(n));
        if let Some(u) = rest.upper() {
            h.set_upper(u.saturating_add(n));
        }
        h
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn prefix_then_rest() {
        let rest = full(Bytes::from_static(b" world"));
        let b = Prefixed::then(Bytes::from_static(b"hello"), rest);
        assert_eq!(b.size_hint().exact(), Some(11));
        assert_eq!(b.collect().await.unwrap().to_bytes(), "hello world");
    }

    #[tokio::test]
    async fn an_error_in_the_rest_is_passed_on() {
        let rest = http_body_util::StreamBody::new(futures::stream::iter(vec![Err::<
            Frame<Bytes>,
            BoxError,
        >(
            "boom".into()
        )]))
        .boxed_unsync();
        let b = Prefixed::then(Bytes::from_static(b"he"), rest);
        assert!(b.collect().await.is_err());
    }

    #[tokio::test]
    async fn complete_with_trailers() {
        let mut t = HeaderMap::new();
        t.insert("x-checksum", "1".parse().unwrap());
        let b = Prefixed::complete(Bytes::from_static(b"abc"), Some(t));
        let c = b.collect().await.unwrap();
        assert_eq!(c.trailers().unwrap()["x-checksum"], "1");
        assert_eq!(c.to_bytes(), "abc");
    }
}
