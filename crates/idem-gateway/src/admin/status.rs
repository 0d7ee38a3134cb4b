//! `GET /` and `GET /status.json`: the live status page.
//! (Skeleton: the status-page helper fills this in.)

use http::{Request, Response};
use hyper::body::Incoming;
use idem_http::BoxBody;

use super::AdminState;

/// Answers `GET /` or `GET /status.json` (already authorised).
pub(crate) async fn handle(req: Request<Incoming>, state: &AdminState) -> Response<BoxBody> {
    let _ = (req, state);
    super::not_found()
}
