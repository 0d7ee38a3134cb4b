//! `/keys…`: list, show and delete records over HTTP.
//! (Skeleton: the key-administration helper fills this in.)

use std::net::SocketAddr;

use http::{Request, Response};
use hyper::body::Incoming;
use idem_http::BoxBody;

use super::AdminState;

/// Answers one `/keys…` request (already authorised).
pub(crate) async fn handle(
    req: Request<Incoming>,
    state: &AdminState,
    peer: SocketAddr,
) -> Response<BoxBody> {
    let _ = (req, state, peer);
    super::not_found()
}
