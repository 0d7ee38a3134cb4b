//! Idempotency keys taken from the JSON request body, by JSON Pointer
//! (RFC 6901): for senders that put the event's identity in the payload
//! (webhooks: `{"event_id": "evt_1", …}`) instead of a header.

use idem_core::IdempotencyKey;

/// Why a key could not be taken from the body.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BodyKeyError {
    /// The body is not JSON (or not I-JSON).
    #[error("the request body is not JSON")]
    NotJson,
    /// The member is there but is not a string or an integer.
    #[error("the member at {pointer:?} is not a string or an integer")]
    NotAKey {
        /// The pointer.
        pointer: String,
    },
    /// The member's value is not a valid key (1 to 255 characters of
    /// 0x20-0x7E, not all blank).
    #[error("the member at {pointer:?} is not a valid idempotency key: {reason}")]
    Invalid {
        /// The pointer.
        pointer: String,
        /// Why.
        reason: String,
    },
}

/// The key at `pointer` in the JSON `body`: `Ok(None)` when the body is
/// JSON but has no member there (or is empty).
///
/// ```
/// use idem_http::body_key::key_from_json;
/// let k = key_from_json(br#"{"event_id":"evt_1","n":2}"#, "/event_id").unwrap().unwrap();
/// assert_eq!(k.as_str(), "evt_1");
/// assert_eq!(key_from_json(br#"{"n":2}"#, "/event_id").unwrap(), None);
/// ```
///
/// # Errors
/// [`BodyKeyError`].
pub fn key_from_json(body: &[u8], pointer: &str) -> Result<Option<IdempotencyKey>, BodyKeyError> {
    // TODO(fp helper): strict parsing, integers, errors.
    let v: serde_json::Value = serde_json::from_slice(body).map_err(|_| BodyKeyError::NotJson)?;
    match v.pointer(pointer) {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => {
            IdempotencyKey::new(s.clone())
                .map(Some)
                .map_err(|e| BodyKeyError::Invalid {
                    pointer: pointer.to_owned(),
                    reason: e.to_string(),
                })
        }
        Some(_) => Err(BodyKeyError::NotAKey {
            pointer: pointer.to_owned(),
        }),
    }
}
