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
}

impl<E> ResponseFuture<E> {
    pub(crate) fn new(
        fut: impl Future<Output = Result<Response<BoxBody>, E>> + Send + 'static,
    ) -> Self {
        Self {
            inner: Box::pin(fut),
        }
    }
}

impl<E> Future for ResponseFuture<E> {
    type Output = Result<Response<BoxBody>, E>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        self.inner.as_mut().poll(cx)
    }
}

impl<E> std::fmt::Debug for ResponseFuture<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ResponseFuture").finish_non_exhaustive()
    }
}
