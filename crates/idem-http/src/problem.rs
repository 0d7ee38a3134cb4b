//! RFC 9457 problem details (`application/problem+json`).

use http::{header, HeaderName, HeaderValue, Response, StatusCode};
use serde_json::{Map, Value};

use crate::body::full;
use crate::BoxBody;

/// The media type of every error the layer produces (RFC 9457, section 3).
pub const PROBLEM_JSON: &str = "application/problem+json";

/// The prefix of every problem `type` the layer produces: the type is
/// `urn:idem:problem:<kind>`, stable across releases.
pub const PROBLEM_TYPE_PREFIX: &str = "urn:idem:problem:";

/// The title of each kind the layer and the gateway use; other kinds get
/// the status's reason phrase.
fn title_of(kind: &str, status: StatusCode) -> String {
    let t = match kind {
        "invalid-key" => "Invalid Idempotency-Key",
        "multiple-keys" => "More than one Idempotency-Key",
        "key-required" => "Idempotency-Key required",
        "body-too-large" => "Request body too large",
        "body-unreadable" => "Request body could not be read",
        "in-flight" => "Request in flight",
        "key-mismatch" => "Idempotency-Key reused for a different request",
        "token-required" => "Submit token required",
        "token-unknown" => "Unknown or expired submit token",
        "response-not-retained" => "Response not retained",
        "store-unavailable" => "Idempotency store unavailable",
        "store-full" => "Idempotency store full",
        "corrupt-record" => "Corrupt idempotency record",
        "internal" => "Internal error",
        "upstream-unreachable" => "Upstream unreachable",
        "upstream-timeout" => "Upstream timed out",
        "upstream-failed" => "Upstream failed",
        _ => return status.canonical_reason().unwrap_or("Error").to_owned(),
    };
    t.to_owned()
}

/// An RFC 9457 problem details object, built into an HTTP response.
///
/// Members: `type` (`urn:idem:problem:<kind>`), `title` (fixed per kind),
/// `status` (the HTTP status code), `detail` (a human-readable explanation
/// of this occurrence), plus any extension members added with
/// [`Problem::with_member`]. Use [`problem()`] for the common case.
///
/// ```
/// use http::StatusCode;
/// use idem_http::Problem;
/// let resp = Problem::new(StatusCode::CONFLICT, "in-flight", "the original request is still running")
///     .with_header(http::header::RETRY_AFTER, http::HeaderValue::from_static("2"))
///     .into_response();
/// assert_eq!(resp.status(), StatusCode::CONFLICT);
/// assert_eq!(resp.headers()["content-type"], "application/problem+json");
/// ```
#[derive(Debug, Clone)]
pub struct Problem {
    status: StatusCode,
    members: Map<String, Value>,
    headers: Vec<(HeaderName, HeaderValue)>,
}

impl Problem {
    /// A problem of `kind` (the part after `urn:idem:problem:`, e.g.
    /// `"invalid-key"`) with HTTP `status` and a human-readable `detail`.
    pub fn new(status: StatusCode, kind: impl AsRef<str>, detail: impl Into<String>) -> Self {
        let kind = kind.as_ref();
        let mut members = Map::new();
        members.insert(
            "type".into(),
            Value::String(format!("{PROBLEM_TYPE_PREFIX}{kind}")),
        );
        members.insert("title".into(), Value::String(title_of(kind, status)));
        members.insert("status".into(), Value::from(status.as_u16()));
        members.insert("detail".into(), Value::String(detail.into()));
        Self {
            status,
            members,
            headers: Vec::new(),
        }
    }

    /// Adds an extension member (RFC 9457, section 3.2). The standard
    /// members `type`, `title`, `status` and `detail` cannot be replaced.
    pub fn with_member(mut self, name: impl Into<String>, value: impl Into<Value>) -> Self {
        let name = name.into();
        if !matches!(name.as_str(), "type" | "title" | "status" | "detail") {
            self.members.insert(name, value.into());
        }
        self
    }

    /// Adds a response header (e.g. `Retry-After`).
    pub fn with_header(mut self, name: HeaderName, value: HeaderValue) -> Self {
        self.headers.push((name, value));
        self
    }

    /// The HTTP status.
    pub fn status(&self) -> StatusCode {
        self.status
    }

    /// The response: `status`, `Content-Type: application/problem+json`,
    /// `Cache-Control: no-store`, the added headers, and the JSON object.
    pub fn into_response(self) -> Response<BoxBody> {
        // Serialising a map of strings and numbers cannot fail.
        let body = serde_json::to_vec(&Value::Object(self.members)).unwrap_or_default();
        let mut resp = Response::new(full(body));
        *resp.status_mut() = self.status;
        let h = resp.headers_mut();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static(PROBLEM_JSON));
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
        for (n, v) in self.headers {
            h.append(n, v);
        }
        resp
    }
}

/// An RFC 9457 `application/problem+json` response with
/// `type = "urn:idem:problem:<kind>"`, a fixed `title` per kind, `status`
/// and `detail`. The gateway uses it for its own 502/503/504 answers.
///
/// Kinds the layer produces: `invalid-key`, `multiple-keys`, `key-required`,
/// `body-too-large`, `body-unreadable`, `in-flight`, `key-mismatch`,
/// `response-not-retained`, `store-unavailable`, `store-full`,
/// `corrupt-record`, `internal`, `upstream-failed` (a response body that
/// failed while it was buffered), `token-required` and `token-unknown`
/// (routes that require a submit token, [`crate::Options::require_token`]).
///
/// ```
/// use http::StatusCode;
/// let resp = idem_http::problem(StatusCode::BAD_GATEWAY, "upstream-unreachable", "connection refused");
/// assert_eq!(resp.status(), 502);
/// assert_eq!(resp.headers()["content-type"], "application/problem+json");
/// ```
pub fn problem(
    status: StatusCode,
    kind: impl AsRef<str>,
    detail: impl Into<String>,
) -> Response<BoxBody> {
    Problem::new(status, kind, detail).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    #[tokio::test]
    async fn problem_body_has_the_rfc_9457_members() {
        let resp = Problem::new(StatusCode::GONE, "response-not-retained", "gone")
            .with_member("original_status", 201)
            .with_member("type", "ignored")
            .into_response();
        assert_eq!(resp.status(), StatusCode::GONE);
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "urn:idem:problem:response-not-retained");
        assert_eq!(v["title"], "Response not retained");
        assert_eq!(v["status"], 410);
        assert_eq!(v["detail"], "gone");
        assert_eq!(v["original_status"], 201);
    }

    #[test]
    fn unknown_kinds_get_the_reason_phrase() {
        let p = Problem::new(StatusCode::GATEWAY_TIMEOUT, "whatever", "x");
        assert_eq!(p.members["title"], "Gateway Timeout");
    }
}
