//! The response future of [`crate::IdempotencyService`].

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use http::Response;

use crate::BoxBody;

type Inner<E> = Pin<Box<dyn Future<Output = Result<Response<BoxBody>, E>> + Send + 'static>>;

/// The future returned by [`crate::IdempotencyService`]: resolves to the
/// response, or to the inner service's error (after which the key was
/// released).
///
/// Dropping it (a client that disconnects) does not cancel the work of a
/// guarded request: that runs in a spawned task that still stores the
/// result.
pub struct ResponseFuture<E> {
    inner: Inner<E>,
    /// Entered while the future is polled (the request's span; none for
    /// answers decided in `call`).
    span: tracing::Span,
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(
        fut: impl Future<Output = Result<Response<BoxBody>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(fut),
            span: tracing::Span::none(),
        }
    }

    /// The same future, polled inside `span`.
    pub(crate) fn in_span(mut self, span: tracing::Span) -> Self {
        self.span = span;
        self
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<BoxBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = &mut *self;
        let _entered = this.span.enter();
        this.inner.as_mut().poll(cx)
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
