//! Turning a response into a [`StoredResponse`] and back.
//!
//! A replay carries the stored status, header fields and body byte for byte
//! (RFC 9110, section 15, and the IETF httpapi draft "The Idempotency-Key
//! HTTP Header Field", section 2.6), plus `Idempotent-Replayed: true`.
//! Hop-by-hop fields (RFC 9110, section 7.6.1: `Connection`, `Keep-Alive`,
//! `Proxy-Connection`, `TE`, `Trailer`, `Transfer-Encoding`, `Upgrade`, and
//! every field named in `Connection`) are not stored; neither is
//! `Content-Length` (the replayed body sets it) nor `Idempotent-Replayed`.
//! Repeated fields (two `Set-Cookie`) keep their order and multiplicity.

use bytes::Bytes;
use http::{header, HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use idem_core::StoredResponse;

use crate::body::full;
use crate::key::IDEMPOTENT_REPLAYED;
use crate::problem::Problem;
use crate::BoxBody;

/// The hop-by-hop fields always removed (RFC 9110, section 7.6.1, and the
/// obsolete `Keep-Alive` and `Proxy-Connection`).
pub const HOP_BY_HOP: [&str; 7] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Removes hop-by-hop fields: those in [`HOP_BY_HOP`] and every field named
/// in a `Connection` field (comma-separated, case-insensitive), except
/// `Idempotency-Key`: a proxy's upstream must see the key the request was
/// guarded with. The gateway uses this in both directions.
///
/// ```
/// use http::HeaderMap;
/// let mut h = HeaderMap::new();
/// h.insert("connection", "close, x-hop".parse().unwrap());
/// h.insert("x-hop", "1".parse().unwrap());
/// h.insert("etag", "\"v1\"".parse().unwrap());
/// idem_http::replay::strip_hop_by_hop(&mut h);
/// assert_eq!(h.len(), 1);
/// assert!(h.contains_key("etag"));
/// ```
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    // One pass over the names present: most maps have no hop-by-hop field
    // at all, and then nothing is parsed, hashed or removed. `Connection`
    // is itself one of them, so a map without any names none either.
    let mut present = 0u8;
    for name in headers.keys() {
        if let Some(i) = hop_by_hop_index(name) {
            present |= 1 << i;
        }
    }
    if present == 0 {
        return;
    }
    if present & 1 != 0 {
        let listed: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .filter(|n| *n != crate::key::IDEMPOTENCY_KEY)
            .collect();
        for name in listed {
            headers.remove(name);
        }
    }
    for (i, name) in HOP_BY_HOP_NAMES.iter().enumerate() {
        if present & (1 << i) != 0 {
            headers.remove(name);
        }
    }
}

/// [`HOP_BY_HOP`] as header names, in the same order (`Connection` first).
static HOP_BY_HOP_NAMES: [HeaderName; 7] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
];

/// The index of `name` in [`HOP_BY_HOP`], if it is one of them.
fn hop_by_hop_index(name: &HeaderName) -> Option<usize> {
    Some(match name.as_str() {
        "connection" => 0,
        "keep-alive" => 1,
        "proxy-connection" => 2,
        "te" => 3,
        "trailer" => 4,
        "transfer-encoding" => 5,
        "upgrade" => 6,
        _ => return None,
    })
}

/// The headers a replay may carry: without hop-by-hop fields,
/// `Content-Length` and `Idempotent-Replayed`.
fn replayable(headers: &HeaderMap) -> HeaderMap {
    let mut h = headers.clone();
    strip_hop_by_hop(&mut h);
    h.remove(header::CONTENT_LENGTH);
    h.remove(IDEMPOTENT_REPLAYED);
    h
}

/// The record kept for a response with this status, these headers and
/// this body; `body_omitted` when the body was larger than the retention
/// limit (the body is then stored empty).
pub fn to_stored(
    status: StatusCode,
    headers: &HeaderMap,
    body: Bytes,
    body_omitted: bool,
) -> StoredResponse {
    let headers = replayable(headers)
        .iter()
        .map(|(n, v)| (n.as_str().to_owned(), v.as_bytes().to_vec()))
        .collect();
    StoredResponse {
        status: status.as_u16(),
        headers,
        body: if body_omitted { Bytes::new() } else { body },
        body_omitted,
        released: false,
    }
}

/// The response to a duplicate of a completed request:
///
/// - the stored status, headers (hop-by-hop, `Content-Length` and any
///   stored `Idempotent-Replayed` dropped) and body, plus
///   `Idempotent-Replayed: true`;
/// - when the body was not retained (`body_omitted`): 410 problem+json
///   `urn:idem:problem:response-not-retained`, whose `detail` and
///   `original_status` member name the original status;
/// - when the record holds a status outside 100–999: 500 problem+json
///   `urn:idem:problem:corrupt-record`. Header fields that are not valid
///   HTTP are skipped with a warning.
pub fn replay_response(stored: &StoredResponse) -> Response<BoxBody> {
    let Ok(status) = StatusCode::from_u16(stored.status) else {
        tracing::error!(target: "idem", status = stored.status, "stored response has an invalid status");
        return Problem::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "corrupt-record",
            "The stored response for this idempotency key is corrupt.",
        )
        .into_response();
    };
    if stored.body_omitted {
        return Problem::new(
            StatusCode::GONE,
            "response-not-retained",
            format!(
                "The request with this idempotency key already ran and completed with status {}, \
                 but its response body was larger than the retention limit and was not kept. \
                 It will not run again; use a new key for a new request.",
                stored.status
            ),
        )
        .with_member("original_status", stored.status)
        .into_response();
    }
    let mut headers = HeaderMap::with_capacity(stored.headers.len() + 1);
    for (name, value) in &stored.headers {
        match (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            (Ok(n), Ok(v)) => {
                headers.append(n, v);
            }
            _ => {
                tracing::warn!(target: "idem", header = %name, "skipping an invalid stored header")
            }
        }
    }
    let mut headers = replayable(&headers);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    let mut resp = Response::new(full(stored.body.clone()));
    *resp.status_mut() = status;
    *resp.headers_mut() = headers;
    resp
}

#[cfg(test)]
mod tests {
    use super::*;
    use http_body_util::BodyExt;

    /// A header map holding `fields` in order (repeated names appended).
    fn headers(fields: &[(&str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (name, value) in fields {
            let name = HeaderName::from_bytes(name.as_bytes()).expect("a field name");
            h.append(name, HeaderValue::from_static(value));
        }
        h
    }

    #[test]
    fn strips_listed_and_fixed_hop_by_hop_fields() {
        let mut h = headers(&[
            ("connection", "close, x-secret , Idempotency-Key"),
            ("x-secret", "1"),
            ("keep-alive", "timeout=5"),
            ("te", "trailers"),
            ("upgrade", "websocket"),
            ("transfer-encoding", "chunked"),
            ("proxy-connection", "keep-alive"),
            ("trailer", "x-checksum"),
            ("idempotency-key", "k1"),
            ("content-type", "text/plain"),
        ]);
        strip_hop_by_hop(&mut h);
        let names: Vec<&str> = h.keys().map(|k| k.as_str()).collect();
        assert_eq!(names.len(), 2, "{names:?}");
        assert!(h.contains_key("idempotency-key"));
        assert!(h.contains_key("content-type"));
    }

    /// The removal as it was before the one-pass scan: every listed field,
    /// then every name of [`HOP_BY_HOP`].
    fn strip_reference(headers: &mut HeaderMap) {
        let listed: Vec<HeaderName> = headers
            .get_all(header::CONNECTION)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(','))
            .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
            .filter(|n| *n != crate::key::IDEMPOTENCY_KEY)
            .collect();
        for name in listed {
            headers.remove(name);
        }
        for name in HOP_BY_HOP {
            headers.remove(name);
        }
    }

    #[test]
    fn hop_by_hop_names_match_the_list() {
        let names: Vec<&str> = HOP_BY_HOP_NAMES.iter().map(HeaderName::as_str).collect();
        assert_eq!(names, HOP_BY_HOP);
        for (i, name) in HOP_BY_HOP_NAMES.iter().enumerate() {
            assert_eq!(hop_by_hop_index(name), Some(i), "{name}");
        }
        for other in [
            "content-type",
            "host",
            "x-te",
            "connections",
            "upgrade-insecure-requests",
        ] {
            let n = HeaderName::from_static(other);
            assert_eq!(hop_by_hop_index(&n), None, "{other}");
        }
    }

    #[test]
    fn one_pass_strip_matches_the_reference() {
        let names = [
            "connection",
            "keep-alive",
            "proxy-connection",
            "te",
            "trailer",
            "transfer-encoding",
            "upgrade",
            "idempotency-key",
            "x-hop",
            "content-type",
            "set-cookie",
            "host",
        ];
        let connection_values: [&'static str; 8] = [
            "close",
            "keep-alive",
            "x-hop, Idempotency-Key",
            " X-Hop ,, content-type ,",
            "upgrade",
            "te, trailer, host",
            "bad name, x-hop",
            "",
        ];
        // Every subset of a few names, with each `Connection` value.
        for mask in 0u32..(1 << names.len()) {
            for (ci, conn) in connection_values.iter().enumerate() {
                if mask & 1 == 0 && ci > 0 {
                    continue;
                }
                let mut h = HeaderMap::new();
                for (i, name) in names.iter().enumerate() {
                    if mask & (1 << i) != 0 {
                        let value = if *name == "connection" { conn } else { "v" };
                        h.append(
                            HeaderName::from_static(name),
                            HeaderValue::from_static(value),
                        );
                        if *name == "set-cookie" {
                            h.append(header::SET_COOKIE, HeaderValue::from_static("w"));
                        }
                    }
                }
                let mut want = h.clone();
                strip_reference(&mut want);
                let mut got = h.clone();
                strip_hop_by_hop(&mut got);
                assert_eq!(got, want, "{h:?}");
            }
        }
        // Two `Connection` fields and a value that is not a string.
        let mut h = HeaderMap::new();
        h.append(header::CONNECTION, HeaderValue::from_static("x-a"));
        h.append(
            header::CONNECTION,
            HeaderValue::from_bytes(b"x-b, \xff").unwrap(),
        );
        h.append(header::CONNECTION, HeaderValue::from_static("x-c"));
        for n in ["x-a", "x-b", "x-c", "x-d"] {
            h.insert(HeaderName::from_static(n), HeaderValue::from_static("1"));
        }
        let mut want = h.clone();
        strip_reference(&mut want);
        let mut got = h;
        strip_hop_by_hop(&mut got);
        assert_eq!(got, want);
        assert_eq!(
            got.keys().map(HeaderName::as_str).collect::<Vec<_>>(),
            ["x-b", "x-d"]
        );
    }

    #[tokio::test]
    async fn round_trip_keeps_order_multiplicity_and_bytes() {
        let h = headers(&[
            ("location", "/orders/1"),
            ("set-cookie", "a=1"),
            ("set-cookie", "b=2"),
            ("etag", "\"v1\""),
            ("content-length", "5"),
            ("transfer-encoding", "chunked"),
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("keep-alive", "timeout=5"),
            (IDEMPOTENT_REPLAYED.as_str(), "true"),
        ]);
        let body = Bytes::from_static(&[0, 0xff, 0xfe, b'x', 0x80]);
        let stored = to_stored(StatusCode::CREATED, &h, body.clone(), false);
        assert_eq!(
            stored.headers,
            vec![
                ("location".to_owned(), b"/orders/1".to_vec()),
                ("set-cookie".to_owned(), b"a=1".to_vec()),
                ("set-cookie".to_owned(), b"b=2".to_vec()),
                ("etag".to_owned(), b"\"v1\"".to_vec()),
            ]
        );
        let resp = replay_response(&stored);
        assert_eq!(resp.status(), StatusCode::CREATED);
        let cookies: Vec<_> = resp.headers().get_all("set-cookie").iter().collect();
        assert_eq!(cookies, ["a=1", "b=2"]);
        assert_eq!(resp.headers()["idempotent-replayed"], "true");
        assert_eq!(resp.headers()["location"], "/orders/1");
        assert!(resp.headers().get("content-length").is_none());
        let got = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(got, body);
    }

    #[tokio::test]
    async fn omitted_body_is_a_410_naming_the_status() {
        let stored = to_stored(
            StatusCode::CREATED,
            &HeaderMap::new(),
            Bytes::from("big"),
            true,
        );
        assert!(stored.body.is_empty());
        let resp = replay_response(&stored);
        assert_eq!(resp.status(), StatusCode::GONE);
        assert!(resp.headers().get("idempotent-replayed").is_none());
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["type"], "urn:idem:problem:response-not-retained");
        assert_eq!(v["original_status"], 201);
        assert!(v["detail"].as_str().unwrap().contains("201"));
    }

    #[test]
    fn corrupt_records_are_a_500() {
        let mut stored = StoredResponse::new(42, "x");
        assert_eq!(replay_response(&stored).status(), 500);
        stored.status = 200;
        stored.headers.push(("bad name".into(), b"v".to_vec()));
        stored.headers.push(("x-ok".into(), b"v".to_vec()));
        stored
            .headers
            .push(("x-bad-value".into(), b"a\nb".to_vec()));
        let resp = replay_response(&stored);
        assert_eq!(resp.status(), 200);
        assert_eq!(resp.headers()["x-ok"], "v");
        assert_eq!(resp.headers().len(), 2);
    }
}
