//! `/keys…`: list, show and delete records over HTTP (admin token
//! required; see [`super`]). The JSON shapes are [`crate::keys`]'s, the
//! same as `idem keys --json`.
//!
//! | request | answer |
//! |---|---|
//! | `GET /keys?state=&scope=&limit=&cursor=` | 200 `{"records": [record, …], "next": cursor \| null, "newest_first": bool}` |
//! | `GET /keys/{scope}/{key}` | 200 record; 404 `key-not-found` |
//! | `DELETE /keys/{scope}/{key}` | 200 `{"deleted": true, "key", "scope", "key_hash", "record"}`; 404 `key-not-found` (an in-flight or held key is released: the next request runs) |
//! | `POST /keys/{scope}/{key}/complete` | body [`keys::CompleteRequest`] (JSON, at most 1 MiB); 200 `{"completed": true, "key", "scope", "key_hash", "fence", "record"}`; 404 `key-not-found`; 409 `not-held`, `already-completed`, `record-changed`; 400 `invalid-parameter` |
//! | `POST /keys/purge` | 200 `{"purged": N}` (expired records removed) |
//!
//! Parameters of the listing, all optional: `state` = `in-flight`,
//! `completed` or `any` (default); `scope` = a scope hash (64 hex digits)
//! or `anonymous` (default: every scope); `limit` = 1..=1000 (default 100);
//! `cursor` = the `next` of the previous page. `{scope}` in a path is a
//! scope hash or `anonymous`; `{key}` is the idempotency key,
//! percent-encoded (`/` as `%2F`, space as `%20`).
//!
//! Errors are `application/problem+json` (RFC 9457): 400
//! `invalid-parameter` (an unknown, repeated or malformed parameter, a bad
//! key or scope, a cursor the store did not make), 404 `key-not-found`,
//! 405 `method-not-allowed` with `Allow`, 409 (see above), 501 `list-unsupported` (a store
//! without listing), 503 `store-unavailable` (the store failed or did not
//! answer within `--store-timeout`), 500 `corrupt-record`.

use std::net::SocketAddr;

use http::{header, HeaderValue, Method, Request, Response, StatusCode};
use hyper::body::Incoming;
use idem_core::admin::ListQuery;
use idem_core::{IdempotencyKey, Scope, StoreError};
use idem_http::{BoxBody, Problem};
use serde::Serialize;

use super::AdminState;
use crate::keys::{self, KeysError};

/// Answers one `/keys…` request (already authorised).
pub(crate) async fn handle(
    req: Request<Incoming>,
    state: &AdminState,
    peer: SocketAddr,
) -> Response<BoxBody> {
    let path = req.uri().path().to_owned();
    let rest = path.strip_prefix("/keys").unwrap_or_default();
    let method = req.method().clone();
    let reading = method == Method::GET || method == Method::HEAD;
    match rest {
        "" | "/" => {
            if !reading {
                return not_allowed("GET");
            }
            match list_query(req.uri().query().unwrap_or_default()) {
                Ok(q) => reply(keys::list(&*state.store, &q, state.store_timeout).await),
                Err(detail) => invalid(detail),
            }
        }
        "/purge" => {
            if method != Method::POST {
                return not_allowed("POST");
            }
            reply(keys::purge(&*state.store, state.store_timeout).await)
        }
        r => {
            let Some((scope, key)) = r.strip_prefix('/').and_then(|r| r.split_once('/')) else {
                return Problem::new(
                    StatusCode::NOT_FOUND,
                    "not-found",
                    "no such admin endpoint; a record is at /keys/{scope}/{key}",
                )
                .into_response();
            };
            let (key, completing) = match key.strip_suffix("/complete") {
                Some(k) => (k, true),
                None => (key, false),
            };
            let (scope, key) = match named(scope, key) {
                Ok(sk) => sk,
                Err(detail) => return invalid(detail),
            };
            if completing {
                if method != Method::POST {
                    return not_allowed("POST");
                }
                return complete(req, state, peer, &scope, &key).await;
            }
            if reading {
                match keys::get(&*state.store, &scope, &key, state.store_timeout).await {
                    Ok(Some(rec)) => json(&rec),
                    Ok(None) => not_found(&scope, &key),
                    Err(e) => failed(&e),
                }
            } else if method == Method::DELETE {
                match keys::delete(&*state.store, &scope, &key, state.store_timeout).await {
                    Ok(Some(d)) => {
                        keys::log_deleted(
                            &d,
                            &format!("peer {peer} with the admin token"),
                            "admin-api",
                        );
                        json(&d)
                    }
                    Ok(None) => not_found(&scope, &key),
                    Err(e) => failed(&e),
                }
            } else {
                not_allowed("GET, DELETE")
            }
        }
    }
}

/// Most bytes of a `POST …/complete` body: 1 MiB.
const MAX_COMPLETE_BODY: usize = 1 << 20;

/// `POST /keys/{scope}/{key}/complete`: an operator's answer for a held key.
async fn complete(
    req: Request<Incoming>,
    state: &AdminState,
    peer: SocketAddr,
    scope: &Scope,
    key: &IdempotencyKey,
) -> Response<BoxBody> {
    use http_body_util::BodyExt;
    let body = match http_body_util::Limited::new(req.into_body(), MAX_COMPLETE_BODY)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Problem::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                "body-too-large",
                format!("a completion is at most {MAX_COMPLETE_BODY} bytes"),
            )
            .into_response()
        }
        Err(e) => {
            return invalid(format!("the body could not be read: {e}"));
        }
    };
    let asked: keys::CompleteRequest = match serde_json::from_slice(&body) {
        Ok(a) => a,
        Err(e) => {
            return invalid(format!(
                "the body is not a completion ({{\"status\": 201, \"headers\": {{…}}, \"body\": \"…\", \"ttl\": \"24h\", \"force\": false}}): {e}"
            ))
        }
    };
    let (response, ttl) = match asked.to_response() {
        Ok(r) => r,
        Err(e) => return failed(&e),
    };
    match keys::complete(
        &*state.store,
        scope,
        key,
        &response,
        ttl,
        asked.force,
        state.store_timeout,
    )
    .await
    {
        Ok(Some(c)) => {
            keys::log_completed(
                &c,
                response.status,
                &format!("peer {peer} with the admin token"),
                "admin-api",
            );
            json(&c)
        }
        Ok(None) => not_found(scope, key),
        Err(e) => failed(&e),
    }
}

/// The scope and key of `/keys/{scope}/{key}`.
fn named(scope: &str, key: &str) -> Result<(Scope, IdempotencyKey), String> {
    let scope = keys::parse_scope_hash(&decode(scope, "scope")?)?;
    let key = IdempotencyKey::new(decode(key, "key")?)
        .map_err(|e| format!("the key in the path: {e}"))?;
    Ok((scope, key))
}

fn decode(part: &str, what: &str) -> Result<String, String> {
    percent_encoding::percent_decode_str(part)
        .decode_utf8()
        .map(|s| s.into_owned())
        .map_err(|_| format!("the {what} in the path is not percent-encoded UTF-8"))
}

/// Reads the listing's parameters: `state`, `scope`, `limit`, `cursor`.
fn list_query(query: &str) -> Result<ListQuery, String> {
    let mut q = ListQuery::default();
    let mut seen: Vec<String> = Vec::new();
    for (name, value) in form_urlencoded::parse(query.as_bytes()) {
        if seen.iter().any(|s| *s == name) {
            return Err(format!("parameter {name:?} is given more than once"));
        }
        seen.push(name.clone().into_owned());
        match &*name {
            "state" => q.state = keys::parse_state(&value).map_err(|e| format!("state: {e}"))?,
            "scope" => {
                q.scope = Some(keys::parse_scope_hash(&value).map_err(|e| format!("scope: {e}"))?);
            }
            "limit" => {
                q.limit = match value.trim().parse::<usize>() {
                    Ok(n) if (1..=idem_core::admin::MAX_LIST_LIMIT).contains(&n) => n,
                    _ => {
                        return Err(format!(
                            "limit: {value:?} is not a number of records in 1..={}",
                            idem_core::admin::MAX_LIST_LIMIT
                        ))
                    }
                }
            }
            "cursor" => {
                if !value.is_empty() {
                    q.cursor = Some(value.into_owned());
                }
            }
            other => {
                return Err(format!(
                    "unknown parameter {other:?}; /keys takes state, scope, limit and cursor"
                ))
            }
        }
    }
    Ok(q)
}

fn reply<T: Serialize>(r: Result<T, KeysError>) -> Response<BoxBody> {
    match r {
        Ok(v) => json(&v),
        Err(e) => failed(&e),
    }
}

/// 200 with `v` as `application/json`, never cached.
fn json<T: Serialize>(v: &T) -> Response<BoxBody> {
    match serde_json::to_vec(v) {
        Ok(body) => {
            let mut resp = Response::new(idem_http::full(body));
            let h = resp.headers_mut();
            h.insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            );
            h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
            resp
        }
        Err(e) => Problem::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", e.to_string())
            .into_response(),
    }
}

fn failed(e: &KeysError) -> Response<BoxBody> {
    let (status, kind) = match e {
        KeysError::NoListing => (StatusCode::NOT_IMPLEMENTED, "list-unsupported"),
        KeysError::Changed => (StatusCode::CONFLICT, "record-changed"),
        KeysError::NotHeld => (StatusCode::CONFLICT, "not-held"),
        KeysError::AlreadyCompleted => (StatusCode::CONFLICT, "already-completed"),
        KeysError::BadResponse(_) => (StatusCode::BAD_REQUEST, "invalid-parameter"),
        KeysError::Store(StoreError::Invalid(_)) => (StatusCode::BAD_REQUEST, "invalid-parameter"),
        KeysError::Store(StoreError::Corrupt { .. }) => {
            (StatusCode::INTERNAL_SERVER_ERROR, "corrupt-record")
        }
        KeysError::Store(_) => (StatusCode::SERVICE_UNAVAILABLE, "store-unavailable"),
    };
    if status.is_server_error() {
        tracing::warn!(error = %e.chain(), "admin API: a key-administration call failed");
    }
    Problem::new(status, kind, e.chain()).into_response()
}

fn invalid(detail: String) -> Response<BoxBody> {
    Problem::new(StatusCode::BAD_REQUEST, "invalid-parameter", detail).into_response()
}

fn not_found(scope: &Scope, key: &IdempotencyKey) -> Response<BoxBody> {
    Problem::new(
        StatusCode::NOT_FOUND,
        "key-not-found",
        "no live record of this key in this scope (absent, or past its TTL or lease)",
    )
    .with_member("scope", scope.as_str())
    .with_member("key_hash", idem_core::key_hash(scope, key))
    .into_response()
}

/// 405 with `Allow: allow`.
fn not_allowed(allow: &'static str) -> Response<BoxBody> {
    Problem::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "method-not-allowed",
        format!("this admin endpoint answers {allow}"),
    )
    .with_header(header::ALLOW, HeaderValue::from_static(allow))
    .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::admin::StateFilter;

    #[test]
    fn list_parameters() {
        let q = list_query("").unwrap();
        assert_eq!(q, ListQuery::default());
        let q = list_query("state=in-flight&scope=anonymous&limit=5&cursor=f12").unwrap();
        assert_eq!(q.state, StateFilter::InFlight);
        assert_eq!(q.scope, Some(Scope::anonymous()));
        assert_eq!((q.limit, q.cursor.as_deref()), (5, Some("f12")));
        for bad in [
            "limit=0",
            "limit=1001",
            "limit=x",
            "state=done",
            "scope=abc",
            "nope=1",
            "limit=1&limit=2",
        ] {
            assert!(list_query(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn paths_name_scope_and_key() {
        let (s, k) = named("anonymous", "a%2Fb%20c").unwrap();
        assert_eq!((s, k.as_str()), (Scope::anonymous(), "a/b c"));
        assert!(named("anonymous", "").is_err());
        assert!(named("anonymous", "%FF").is_err());
        assert!(named("nope", "k").is_err());
    }
}
