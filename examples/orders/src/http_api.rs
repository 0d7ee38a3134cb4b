//! The HTTP routes and their problem+json (RFC 9457) errors.

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Extension, Json, Router};
use idem_http::{Fence, IdempotencyLayer};
use serde_json::{json, Value};

use crate::{App, CreateOutcome, Error, KeyFence, Simulate, MAX_AMOUNT_CENTS, MAX_ORDER_NO_LEN};

/// The prefix of this service's problem `type`s.
pub(crate) const PROBLEM_PREFIX: &str = "urn:orders:problem:";

pub(crate) fn router(app: App, layer: IdempotencyLayer) -> Router {
    Router::new()
        .route("/", get(index))
        .route("/orders", post(create))
        .route("/orders/{id}", get(get_order))
        .route("/orders/{id}/charges", get(charges))
        .route("/orders/{id}/pay", post(pay).layer(layer))
        .fallback(not_found)
        .with_state(app)
}

/// An RFC 9457 problem response.
pub(crate) fn problem(
    status: StatusCode,
    kind: &str,
    title: &str,
    detail: impl Into<String>,
) -> Response {
    let body = json!({
        "type": format!("{PROBLEM_PREFIX}{kind}"),
        "title": title,
        "status": status.as_u16(),
        "detail": detail.into(),
    });
    (
        status,
        [(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        )],
        body.to_string(),
    )
        .into_response()
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let detail = self.to_string();
        match self {
            Error::NotFound(_) => problem(
                StatusCode::NOT_FOUND,
                "not-found",
                "Order not found",
                detail,
            ),
            Error::Busy { retry_after } => {
                let mut resp = problem(
                    StatusCode::CONFLICT,
                    "operation-in-progress",
                    "Operation in progress",
                    detail,
                );
                let secs = retry_after.as_millis().div_ceil(1000).max(1);
                if let Ok(v) = HeaderValue::from_str(&secs.to_string()) {
                    resp.headers_mut().insert(header::RETRY_AFTER, v);
                }
                resp
            }
            Error::LockLost { .. } => {
                let mut resp = problem(StatusCode::CONFLICT, "lock-lost", "Lock lost", detail);
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                resp
            }
            Error::StaleFence { .. } => problem(
                StatusCode::CONFLICT,
                "stale-fence",
                "Stale Idempotency-Fence",
                detail,
            ),
            Error::Conflict { .. } => problem(
                StatusCode::CONFLICT,
                "state-conflict",
                "Order state conflict",
                detail,
            ),
            Error::OutcomeUnknown { order, .. } => {
                let mut resp = problem(
                    StatusCode::GATEWAY_TIMEOUT,
                    "payment-outcome-unknown",
                    "Payment outcome unknown",
                    format!(
                        "{detail}. Order {} stays PAYING (attempt {}); retrying the pay resumes the same provider attempt.",
                        order.id, order.attempt
                    ),
                );
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                resp
            }
            Error::Config(_) | Error::Internal(_) | Error::Io(_) => {
                tracing::error!(error = %detail, "internal error");
                problem(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "internal",
                    "Internal error",
                    detail,
                )
            }
            Error::Database(_) | Error::Pattern(_) | Error::Store(_) | Error::Lock(_) => {
                tracing::warn!(error = %detail, "backend unavailable");
                let mut resp = problem(
                    StatusCode::SERVICE_UNAVAILABLE,
                    "unavailable",
                    "Database unavailable",
                    detail,
                );
                resp.headers_mut()
                    .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                resp
            }
        }
    }
}

async fn index() -> Json<Value> {
    Json(json!({
        "service": "orders (idem example)",
        "endpoints": {
            "POST /orders": "create: {\"outer_order_no\": \"A-1\", \"amount_cents\": 1999}; 201 new, 200 existing",
            "GET /orders/{id}": "the order",
            "POST /orders/{id}/pay": "pay; needs an Idempotency-Key; optional X-Simulate: fail | slow | lose-response",
            "GET /orders/{id}/charges": "the provider's ledger for the order",
        }
    }))
}

async fn not_found() -> Response {
    problem(
        StatusCode::NOT_FOUND,
        "not-found",
        "Not found",
        "no such route",
    )
}

/// A refused request, turned into a problem response by the caller.
#[derive(Debug)]
struct Reject {
    status: StatusCode,
    kind: &'static str,
    title: &'static str,
    detail: String,
}

impl IntoResponse for Reject {
    fn into_response(self) -> Response {
        problem(self.status, self.kind, self.title, self.detail)
    }
}

fn invalid(detail: impl Into<String>) -> Reject {
    Reject {
        status: StatusCode::UNPROCESSABLE_ENTITY,
        kind: "invalid-order",
        title: "Invalid order",
        detail: detail.into(),
    }
}

/// A JSON value whose top-level object (if it is one) has no key twice:
/// `serde_json::Value` keeps the last of repeated keys silently, so
/// `{"amount_cents": 1, "amount_cents": 999}` would be read as 999 here and
/// maybe as 1 by a proxy or log in front.
struct UniqueKeys(Value);

impl<'de> serde::Deserialize<'de> for UniqueKeys {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = UniqueKeys;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a JSON value")
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut map: A,
            ) -> Result<UniqueKeys, A::Error> {
                let mut obj = serde_json::Map::new();
                while let Some(k) = map.next_key::<String>()? {
                    let v: Value = map.next_value()?;
                    if obj.contains_key(&k) {
                        return Err(serde::de::Error::custom(format!("duplicate key {k:?}")));
                    }
                    obj.insert(k, v);
                }
                Ok(UniqueKeys(Value::Object(obj)))
            }
            // Anything but an object: kept as it is (refused below as 422).
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                seq: A,
            ) -> Result<UniqueKeys, A::Error> {
                serde::Deserialize::deserialize(serde::de::value::SeqAccessDeserializer::new(seq))
                    .map(UniqueKeys)
            }
            fn visit_bool<E: serde::de::Error>(self, v: bool) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::Bool(v)))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(v.into()))
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(v.into()))
            }
            fn visit_f64<E: serde::de::Error>(self, v: f64) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(v.into()))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(v.into()))
            }
            fn visit_unit<E: serde::de::Error>(self) -> Result<UniqueKeys, E> {
                Ok(UniqueKeys(Value::Null))
            }
        }
        d.deserialize_any(V)
    }
}

/// Validates a create body: `(outer_order_no, amount_cents)`. A key given
/// twice in the object is refused (400) rather than "last one wins".
fn parse_create(body: &[u8]) -> Result<(String, i64), Reject> {
    let UniqueKeys(value) = serde_json::from_slice(body).map_err(|e| Reject {
        status: StatusCode::BAD_REQUEST,
        kind: "invalid-json",
        title: "Invalid JSON",
        detail: format!("expected {{\"outer_order_no\": \"A-1\", \"amount_cents\": 1999}}: {e}"),
    })?;
    let Some(obj) = value.as_object() else {
        return Err(invalid("the body must be a JSON object"));
    };
    let no = match obj.get("outer_order_no") {
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(invalid("outer_order_no must be a string")),
        None => return Err(invalid("outer_order_no is missing")),
    };
    if no.is_empty() {
        return Err(invalid("outer_order_no is empty"));
    }
    if no.chars().count() > MAX_ORDER_NO_LEN {
        return Err(invalid(format!(
            "outer_order_no is longer than {MAX_ORDER_NO_LEN} characters"
        )));
    }
    if no.chars().any(char::is_control) {
        return Err(invalid("outer_order_no holds a control character"));
    }
    let amount = match obj.get("amount_cents") {
        Some(Value::Number(n)) => n.as_i64(),
        Some(_) => return Err(invalid("amount_cents must be an integer")),
        None => return Err(invalid("amount_cents is missing")),
    };
    match amount {
        Some(a) if (1..=MAX_AMOUNT_CENTS).contains(&a) => Ok((no, a)),
        _ => Err(invalid(format!(
            "amount_cents must be an integer from 1 to {MAX_AMOUNT_CENTS}"
        ))),
    }
}

async fn create(
    State(app): State<App>,
    body: Result<Bytes, axum::extract::rejection::BytesRejection>,
) -> Response {
    let body = match body {
        Ok(b) => b,
        Err(e) => {
            return problem(
                e.status(),
                "body-unreadable",
                "Request body could not be read",
                e.body_text(),
            )
        }
    };
    let (no, amount) = match parse_create(&body) {
        Ok(v) => v,
        Err(reject) => return reject.into_response(),
    };
    match app.orders().create(&no, amount).await {
        Ok(CreateOutcome::Created(order)) => (
            StatusCode::CREATED,
            [(header::LOCATION, format!("/orders/{}", order.id))],
            Json(order),
        )
            .into_response(),
        Ok(CreateOutcome::Existing(order)) => (StatusCode::OK, Json(order)).into_response(),
        Ok(CreateOutcome::Conflict(order)) => problem(
            StatusCode::CONFLICT,
            "order-conflict",
            "Order number used with another amount",
            format!(
                "order {} ({no}) exists with amount_cents {}, not {amount}",
                order.id, order.amount_cents
            ),
        ),
        Err(e) => e.into_response(),
    }
}

/// Parses an order id in its one canonical form: decimal digits, no sign,
/// no leading zero, at most `i64::MAX`. Anything else (`+1`, `01`, `-1`,
/// `abc`) is "no such order": one order has one path, so the
/// Idempotency-Key of `/orders/1/pay` cannot be reused as a "different
/// request" on `/orders/01/pay`.
fn order_id(raw: &str) -> Result<i64, Reject> {
    let canonical =
        !raw.is_empty() && raw.bytes().all(|b| b.is_ascii_digit()) && !raw.starts_with('0');
    canonical
        .then(|| raw.parse::<i64>().ok())
        .flatten()
        .filter(|id| *id > 0)
        .ok_or_else(|| Reject {
            status: StatusCode::NOT_FOUND,
            kind: "not-found",
            title: "Order not found",
            detail: format!("no order {raw:?}"),
        })
}

async fn get_order(State(app): State<App>, Path(raw): Path<String>) -> Response {
    let id = match order_id(&raw) {
        Ok(id) => id,
        Err(reject) => return reject.into_response(),
    };
    match app.orders().get(id).await {
        Ok(Some(order)) => Json(order).into_response(),
        Ok(None) => Error::NotFound(id).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn charges(State(app): State<App>, Path(raw): Path<String>) -> Response {
    let id = match order_id(&raw) {
        Ok(id) => id,
        Err(reject) => return reject.into_response(),
    };
    match app.orders().get(id).await {
        Ok(Some(_)) => {}
        Ok(None) => return Error::NotFound(id).into_response(),
        Err(e) => return e.into_response(),
    }
    match app.provider().charges(id).await {
        Ok(list) => Json(list).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn pay(
    State(app): State<App>,
    Path(raw): Path<String>,
    fence: Option<Extension<Fence>>,
    headers: HeaderMap,
) -> Response {
    let id = match order_id(&raw) {
        Ok(id) => id,
        Err(reject) => return reject.into_response(),
    };
    let simulate = match headers.get("x-simulate").map(|v| v.to_str()) {
        None => Simulate::Normal,
        Some(Ok(v)) => match Simulate::parse(v) {
            Ok(s) => s,
            Err(msg) => {
                return problem(
                    StatusCode::BAD_REQUEST,
                    "invalid-simulate",
                    "Invalid X-Simulate",
                    msg,
                )
            }
        },
        Some(Err(_)) => {
            return problem(
                StatusCode::BAD_REQUEST,
                "invalid-simulate",
                "Invalid X-Simulate",
                "X-Simulate is not visible ASCII",
            )
        }
    };
    // The layer put the fence of this run's claim in the extensions (never
    // read a header for it: a client could send one). Outside the layer
    // (no fence) the order's own fences still apply.
    let key = match (fence, headers.get(idem_http::IDEMPOTENCY_KEY)) {
        (Some(Extension(Fence(f))), Some(k)) => match (i64::try_from(f), k.to_str()) {
            (Ok(fence), Ok(key)) => Some(KeyFence {
                scope: app.key_scope(&headers),
                key: key.to_owned(),
                fence,
            }),
            _ => {
                return Error::Internal(format!("fence {f} or its key is out of range"))
                    .into_response()
            }
        },
        _ => None,
    };
    match app.pay_as(id, key, simulate).await {
        Ok(order) => Json(order).into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_bodies_are_validated() {
        assert_eq!(
            parse_create(br#"{"outer_order_no":"A-1","amount_cents":1999}"#).unwrap(),
            ("A-1".to_owned(), 1999)
        );
        for (body, status) in [
            (&b"not json"[..], 400),
            (b"", 400),
            (b"[]", 422),
            (br#"{"amount_cents":5}"#, 422),
            (br#"{"outer_order_no":"","amount_cents":5}"#, 422),
            (br#"{"outer_order_no":5,"amount_cents":5}"#, 422),
            (br#"{"outer_order_no":"a","amount_cents":0}"#, 422),
            (br#"{"outer_order_no":"a","amount_cents":-3}"#, 422),
            (br#"{"outer_order_no":"a","amount_cents":1.5}"#, 422),
            (br#"{"outer_order_no":"a","amount_cents":100000001}"#, 422),
            (br#"{"outer_order_no":"a","amount_cents":1e30}"#, 422),
            (
                br#"{"outer_order_no":"a","amount_cents":99999999999999999999999}"#,
                422,
            ),
            (br#"{"outer_order_no":"a","amount_cents":"5"}"#, 422),
            (
                br#"{"outer_order_no":"a","amount_cents":1,"amount_cents":999}"#,
                400,
            ),
            (
                br#"{"outer_order_no":"a","outer_order_no":"b","amount_cents":5}"#,
                400,
            ),
            (b"5", 422),
            (b"null", 422),
            (br#""x""#, 422),
        ] {
            let err = parse_create(body).unwrap_err().into_response();
            assert_eq!(
                err.status().as_u16(),
                status,
                "{}",
                String::from_utf8_lossy(body)
            );
            assert_eq!(err.headers()["content-type"], "application/problem+json");
        }
        let long = format!(
            r#"{{"outer_order_no":"{}","amount_cents":5}}"#,
            "x".repeat(65)
        );
        assert_eq!(parse_create(long.as_bytes()).unwrap_err().status, 422);
        // Nested objects are values; only the top level is checked.
        assert_eq!(
            parse_create(br#"{"outer_order_no":"n","amount_cents":7,"meta":{"a":1}}"#).unwrap(),
            ("n".to_owned(), 7)
        );
    }

    #[test]
    fn a_stale_fence_is_a_409_problem() {
        let r = Error::StaleFence {
            fence: 3,
            current: 7,
        }
        .into_response();
        assert_eq!(r.status(), StatusCode::CONFLICT);
        assert_eq!(r.headers()["content-type"], "application/problem+json");
    }

    #[test]
    fn only_canonical_order_ids() {
        assert_eq!(order_id("1").unwrap(), 1);
        assert_eq!(order_id("9223372036854775807").unwrap(), i64::MAX);
        for raw in [
            "",
            "0",
            "01",
            "+1",
            "-1",
            " 1",
            "1 ",
            "1.0",
            "0x1",
            "١",
            "9223372036854775808",
        ] {
            let r = order_id(raw);
            assert_eq!(
                r.map_err(|e| e.status),
                Err(StatusCode::NOT_FOUND),
                "{raw:?}"
            );
        }
    }
}
