//! The demo's naive payment endpoint, served next to the orders example:
//! an ordinary handler that knows nothing about idempotency. Every `POST
//! /payments` it receives is a new charge; only the gateway in front of it
//! makes duplicates harmless (the orders routes, by contrast, carry their
//! own three layers). `tests/e2e/gateway_client.py` drives it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::Deserialize;
use serde_json::{json, Value};

/// How long a charge takes: long enough that concurrent duplicates overlap
/// with the original, as they do with a real payment provider.
pub(crate) const CHARGE_TIME: Duration = Duration::from_millis(300);

/// Largest amount the service accepts, in cents.
const MAX_AMOUNT_CENTS: u64 = 100_000_000;

/// Payments kept for `GET /payments/{id}`; older ones are forgotten.
const MAX_KEPT: usize = 10_000;

/// The service's state: the charge counter and the payments made.
#[derive(Debug, Default)]
pub(crate) struct Payments {
    charges: AtomicU64,
    made: Mutex<HashMap<String, Value>>,
}

impl Payments {
    /// How many charges have run (each `POST /payments` that got past
    /// validation counts once, as soon as it starts).
    pub(crate) fn charges(&self) -> u64 {
        self.charges.load(Ordering::SeqCst)
    }
}

#[derive(Debug, Deserialize)]
struct ChargeRequest {
    amount_cents: u64,
    #[serde(default = "default_currency")]
    currency: String,
}

fn default_currency() -> String {
    "EUR".to_owned()
}

/// The service's routes.
pub(crate) fn router(state: Arc<Payments>) -> Router {
    Router::new()
        .route("/payments", post(charge))
        .route("/payments/stats", get(stats))
        .route("/payments/{id}", get(payment))
        .with_state(state)
}

async fn charge(State(state): State<Arc<Payments>>, headers: HeaderMap, body: Bytes) -> Response {
    let req: ChargeRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return bad_request(&format!(
                "expected a JSON body like {{\"amount_cents\": 1999, \"currency\": \"EUR\"}}: {e}"
            ))
        }
    };
    if req.amount_cents == 0 || req.amount_cents > MAX_AMOUNT_CENTS {
        return bad_request(&format!(
            "amount_cents must be between 1 and {MAX_AMOUNT_CENTS}"
        ));
    }
    let currency = req.currency.trim().to_ascii_uppercase();
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_uppercase()) {
        return bad_request("currency must be a three-letter code such as EUR");
    }

    // The charge: counted as soon as it starts, then "talks to the bank".
    let number = state.charges.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::time::sleep(CHARGE_TIME).await;

    let id = format!("pay_{:016x}", rand::random::<u64>());
    let key = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let payment = json!({
        "payment_id": id,
        "amount_cents": req.amount_cents,
        "currency": currency,
        "status": "captured",
        "charge_number": number,
        "idempotency_key": key,
    });
    {
        let mut made = state.made.lock().unwrap_or_else(|p| p.into_inner());
        if made.len() >= MAX_KEPT {
            made.clear();
        }
        made.insert(id.clone(), payment.clone());
    }
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/payments/{id}"))],
        Json(payment),
    )
        .into_response()
}

async fn payment(State(state): State<Arc<Payments>>, Path(id): Path<String>) -> Response {
    let made = state.made.lock().unwrap_or_else(|p| p.into_inner());
    match made.get(&id) {
        Some(p) => Json(p.clone()).into_response(),
        None => (
            StatusCode::NOT_FOUND,
            Json(json!({ "error": format!("no payment {id}") })),
        )
            .into_response(),
    }
}

async fn stats(State(state): State<Arc<Payments>>) -> Json<Value> {
    Json(json!({ "charges": state.charges() }))
}

fn bad_request(message: &str) -> Response {
    (StatusCode::BAD_REQUEST, Json(json!({ "error": message }))).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    async fn serve() -> (String, Arc<Payments>) {
        let state = Arc::new(Payments::default());
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = router(state.clone());
        tokio::spawn(async move { axum::serve(listener, app).await });
        (format!("http://{addr}"), state)
    }

    #[tokio::test]
    async fn a_charge_counts_and_answers_201_with_location() {
        let (base, state) = serve().await;
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        let resp = client
            .post(format!("{base}/payments"))
            .header("content-type", "application/json")
            .header("idempotency-key", "k1")
            .body(r#"{"amount_cents":1999}"#)
            .send()
            .await
            .unwrap();
        assert_eq!(resp.status(), 201);
        let location = resp.headers()["location"].to_str().unwrap().to_owned();
        let body: Value = resp.json().await.unwrap();
        assert_eq!(body["amount_cents"], 1999);
        assert_eq!(body["currency"], "EUR");
        assert_eq!(body["idempotency_key"], "k1");
        assert_eq!(
            location,
            format!("/payments/{}", body["payment_id"].as_str().unwrap())
        );
        assert_eq!(state.charges(), 1);

        let again = client
            .get(format!("{base}{location}"))
            .send()
            .await
            .unwrap();
        assert_eq!(again.status(), 200);
        let stats: Value = client
            .get(format!("{base}/payments/stats"))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        assert_eq!(stats["charges"], 1);
    }

    #[tokio::test]
    async fn bad_bodies_are_400_and_charge_nothing() {
        let (base, state) = serve().await;
        let client = reqwest::Client::builder().no_proxy().build().unwrap();
        for body in [
            "",
            "not json",
            r#"{"amount_cents":0}"#,
            r#"{"amount_cents":5,"currency":"euro"}"#,
        ] {
            let resp = client
                .post(format!("{base}/payments"))
                .body(body)
                .send()
                .await
                .unwrap();
            assert_eq!(resp.status(), 400, "body {body:?}");
        }
        assert_eq!(state.charges(), 0);
    }
}
