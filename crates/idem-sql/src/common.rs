//! Pieces the PostgreSQL and MySQL stores share: identifier validation,
//! record decoding, the notification hash, and bounded retries.

use std::time::Duration;

use idem_core::{Begin, BeginRequest, Fingerprint, Phase, StoreError, StoredResponse};
use rand::Rng;

/// Record states as stored in the `state` column (as in the SQLite store).
pub(crate) const IN_PROGRESS: i64 = 0;
pub(crate) const COMPLETED: i64 = 1;

/// Longest schema name accepted (PostgreSQL's `NAMEDATALEN - 1`).
#[cfg(feature = "postgres")]
pub(crate) const MAX_SCHEMA_LEN: usize = 63;

/// Longest table name accepted: 63 bytes less the longest suffix the stores
/// derive from it (`_deadline`), so no derived name is ever truncated by the
/// database (PostgreSQL truncates identifiers past 63 bytes silently, which
/// could make two tables share an index or sequence name).
pub(crate) const MAX_TABLE_LEN: usize = 54;

/// How many times a step is tried when the database reports a transient
/// conflict (a deadlock or a serialization failure), and the base pause.
pub(crate) const MAX_ATTEMPTS: u32 = 5;
const BACKOFF_BASE: Duration = Duration::from_millis(5);

/// Checks `name` against `[A-Za-z_][A-Za-z0-9_]{0,max-1}`. Names are always
/// checked before they are quoted into SQL; values are always bound.
pub(crate) fn validate_ident(what: &str, name: &str, max: usize) -> Result<(), StoreError> {
    let mut chars = name.chars();
    let ok_first = chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
    let ok_rest = chars.all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok_first && ok_rest && name.len() <= max {
        Ok(())
    } else {
        Err(StoreError::Config(format!(
            "{what} name {name:?} is not a plain identifier: use 1 to {max} characters of \
             [A-Za-z0-9_], not starting with a digit"
        )))
    }
}

/// 64-bit FNV-1a over the key, a zero byte and the scope (keys are visible
/// ASCII, so the zero byte separates unambiguously). Used to name a record in
/// notifications and advisory locks: a collision only costs a spurious
/// wake-up or a moment of waiting, never a wrong answer.
#[cfg(feature = "postgres")]
pub(crate) fn record_hash(scope: &str, key: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in key.bytes().chain([0u8]).chain(scope.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// 64-bit FNV-1a of a string (for names derived from the table name).
pub(crate) fn name_hash(s: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in s.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// A pause before retry `attempt` (1-based): 5 ms × 2^(attempt-1), with
/// ±50 % jitter so racing callers spread out.
pub(crate) fn backoff(attempt: u32) -> Duration {
    let base = BACKOFF_BASE * 2u32.saturating_pow(attempt.saturating_sub(1)).min(64);
    let jitter = rand::thread_rng().gen_range(0.5..1.5);
    base.mul_f64(jitter)
}

/// A duration in whole milliseconds as an `i64` for SQL, rounded up (a
/// non-zero duration never becomes 0 ms) and saturating.
pub(crate) fn ms_i64(d: Duration) -> i64 {
    i64::try_from(idem_core::duration_ms(d)).unwrap_or(i64::MAX)
}

/// Longest lease or TTL written, in ms (about 31,700 years): keeps
/// `now + span` far from `i64` overflow in SQL.
const MAX_SPAN_MS: i64 = 1_000_000_000_000_000;

/// A lease or TTL in whole milliseconds for SQL: rounded up, capped at
/// [`MAX_SPAN_MS`].
pub(crate) fn span_ms(d: Duration) -> i64 {
    ms_i64(d).min(MAX_SPAN_MS)
}

pub(crate) fn corrupt(phase: Phase, detail: impl Into<String>) -> StoreError {
    StoreError::Corrupt {
        phase,
        detail: detail.into(),
    }
}

/// One record row, undecoded. `deadline` and `now` are milliseconds since
/// the Unix epoch by the database's clock.
#[derive(Debug)]
pub(crate) struct RawRecord {
    pub(crate) fingerprint: Vec<u8>,
    pub(crate) state: i64,
    pub(crate) fence: i64,
    pub(crate) deadline: i64,
    pub(crate) response: Option<Vec<u8>>,
}

impl RawRecord {
    pub(crate) fn fingerprint(&self, phase: Phase) -> Result<Fingerprint, StoreError> {
        <[u8; 32]>::try_from(self.fingerprint.as_slice())
            .map(Fingerprint)
            .map_err(|_| {
                corrupt(
                    phase,
                    format!("fingerprint is {} bytes, not 32", self.fingerprint.len()),
                )
            })
    }

    pub(crate) fn fence(&self, phase: Phase) -> Result<u64, StoreError> {
        match u64::try_from(self.fence) {
            Ok(f) if f > 0 => Ok(f),
            _ => Err(corrupt(
                phase,
                format!("fence {} is not positive", self.fence),
            )),
        }
    }

    pub(crate) fn until(&self) -> idem_core::Millis {
        idem_core::Millis(u64::try_from(self.deadline).unwrap_or(0))
    }

    pub(crate) fn response(&self, phase: Phase) -> Result<StoredResponse, StoreError> {
        let blob = self
            .response
            .as_deref()
            .ok_or_else(|| corrupt(phase, "completed record without a response"))?;
        StoredResponse::decode(blob).map_err(|e| corrupt(phase, format!("stored response: {e}")))
    }

    /// Whether the record is live at `now` (in progress before its lease
    /// end, or completed before its expiry).
    pub(crate) fn is_live(&self, now: i64) -> bool {
        self.deadline > now
    }

    /// The answer to `begin` from a live record (the caller checked
    /// [`Self::is_live`]). `retry_after` is at least 1 ms.
    pub(crate) fn answer(
        &self,
        req: &BeginRequest,
        now: i64,
        phase: Phase,
    ) -> Result<Begin, StoreError> {
        let same = self.fingerprint(phase)? == req.fingerprint;
        Ok(match self.state {
            IN_PROGRESS if same => {
                self.fence(phase)?;
                Begin::InFlight {
                    retry_after: Duration::from_millis(
                        u64::try_from(self.deadline.saturating_sub(now))
                            .unwrap_or(0)
                            .max(1),
                    ),
                }
            }
            COMPLETED if same => Begin::Replay(self.response(phase)?),
            IN_PROGRESS | COMPLETED => Begin::Mismatch,
            s => return Err(corrupt(phase, format!("unknown record state {s}"))),
        })
    }

    /// The record as [`idem_core::Store::get`] reports it (the caller
    /// checked liveness).
    pub(crate) fn to_record(&self, phase: Phase) -> Result<idem_core::Record, StoreError> {
        let fingerprint = self.fingerprint(phase)?;
        let state = match self.state {
            IN_PROGRESS => idem_core::RecordState::InProgress {
                fence: self.fence(phase)?,
                lease_until: self.until(),
            },
            COMPLETED => idem_core::RecordState::Completed {
                response: self.response(phase)?,
                expires_at: self.until(),
            },
            s => return Err(corrupt(phase, format!("unknown record state {s}"))),
        };
        Ok(idem_core::Record { fingerprint, state })
    }
}

/// What a failed database call means for the caller.
#[derive(Debug)]
pub(crate) enum Failure {
    /// A transient conflict (deadlock, serialization failure): the statement
    /// was rolled back and may be tried again.
    Retry(sqlx::Error),
    /// The final error to report.
    Fail(StoreError),
}

/// Runs `op` up to [`MAX_ATTEMPTS`] times while it fails with
/// [`Failure::Retry`], pausing with [`backoff`] in between; the last
/// transient error is reported as [`StoreError::Unavailable`].
pub(crate) async fn with_retries<T, F, Fut>(phase: Phase, mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, Failure>>,
{
    let mut attempt = 1;
    loop {
        match op().await {
            Ok(v) => return Ok(v),
            Err(Failure::Fail(e)) => return Err(e),
            Err(Failure::Retry(e)) if attempt >= MAX_ATTEMPTS => {
                return Err(StoreError::unavailable(phase, e));
            }
            Err(Failure::Retry(e)) => {
                tracing::debug!(%phase, attempt, error = %e, "transient database conflict; retrying");
                tokio::time::sleep(backoff(attempt)).await;
                attempt += 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers() {
        for ok in ["idem_records", "_x", "A1", &"a".repeat(54)] {
            assert!(validate_ident("table", ok, MAX_TABLE_LEN).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "1abc",
            "a-b",
            "a b",
            "a;drop",
            "a\"b",
            "a`b",
            "é",
            "a.b",
            &"a".repeat(55),
        ] {
            assert!(
                matches!(
                    validate_ident("table", bad, MAX_TABLE_LEN),
                    Err(StoreError::Config(_))
                ),
                "{bad:?}"
            );
        }
        #[cfg(feature = "postgres")]
        assert!(validate_ident("schema", &"s".repeat(63), MAX_SCHEMA_LEN).is_ok());
    }

    #[test]
    #[cfg(feature = "postgres")]
    fn record_hash_separates_key_and_scope() {
        assert_ne!(record_hash("ab", "c"), record_hash("a", "bc"));
        assert_ne!(record_hash("", "k"), record_hash("k", ""));
        assert_eq!(record_hash("s", "k"), record_hash("s", "k"));
    }

    #[test]
    fn backoff_grows_and_is_bounded() {
        for attempt in 1..=10 {
            let d = backoff(attempt);
            assert!(d >= Duration::from_micros(2500) && d <= Duration::from_millis(480));
        }
    }
}
