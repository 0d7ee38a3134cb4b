//! The body of a first response whose start was buffered for the store.

use std::pin::Pin;
use std::task::{ready, Context, Poll};

use bytes::Bytes;
use http::HeaderMap;
use http_body::{Body, Frame, SizeHint};

use crate::{BoxBody, BoxError};

/// A buffered prefix, then either an error (the inner body failed while it
/// was buffered) or the rest of the inner body, then the trailers seen while
/// buffering.
pub(crate) struct Prefixed {
    prefix: Bytes,
    error: Option<BoxError>,
    rest: Option<BoxBody>,
    trailers: Option<HeaderMap>,
}

impl std::fmt::Debug for Prefixed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Prefixed")
            .field("prefix_len", &self.prefix.len())
            .field("error", &self.error)
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
            error: None,
            rest: None,
            trailers,
        }
    }

    /// `prefix` was buffered; `rest` follows.
    pub(crate) fn then(prefix: Bytes, rest: BoxBody) -> Self {
        Self {
            prefix,
            error: None,
            rest: Some(rest),
            trailers: None,
        }
    }

    /// `prefix` was buffered, then the body failed with `error`.
    pub(crate) fn failed(prefix: Bytes, error: BoxError) -> Self {
        Self {
            prefix,
            error: Some(error),
            rest: None,
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
        if let Some(e) = this.error.take() {
            return Poll::Ready(Some(Err(e)));
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
            && self.error.is_none()
            && self.rest.as_ref().is_none_or(Body::is_end_stream)
            && self.trailers.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        let n = self.prefix.len() as u64;
        if self.error.is_some() {
            // Unknown length, so the failure reaches the client as a broken
            // (chunked) body rather than a complete-looking one.
            let mut h = SizeHint::new();
            h.set_lower(n);
            return h;
        }
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
    use http_body_util::{BodyExt, Full};

    #[tokio::test]
    async fn prefix_then_rest() {
        let rest = Full::new(Bytes::from_static(b" world"))
            .map_err(|never| match never {})
            .boxed_unsync();
        let b = Prefixed::then(Bytes::from_static(b"hello"), rest);
        assert_eq!(b.size_hint().exact(), Some(11));
        assert_eq!(b.collect().await.unwrap().to_bytes(), "hello world");
    }

    #[tokio::test]
    async fn prefix_then_error() {
        let b = Prefixed::failed(Bytes::from_static(b"he"), "boom".into());
        assert_eq!(b.size_hint().exact(), None);
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
