//! `GET /metrics`: Prometheus text exposition.
//! (Skeleton: the metrics helper fills this in.)

use http::{Response, StatusCode};
use idem_http::{problem, BoxBody};

/// The current metrics as Prometheus text.
pub(crate) fn render() -> Response<BoxBody> {
    problem(
        StatusCode::NOT_IMPLEMENTED,
        "not-implemented",
        "metrics are not built yet",
    )
}
