//! `Retry-After` (RFC 9110 §10.2.3): how long a server asks the client to
//! wait before the next attempt.

use std::time::{Duration, SystemTime};

use http::HeaderMap;

/// How long the `Retry-After` field of `headers` asks to wait, as of `now`.
///
/// RFC 9110 §10.2.3: `Retry-After = HTTP-date / delay-seconds`, where
/// `delay-seconds` is one or more decimal digits (seconds) and an
/// HTTP-date is any of the three forms of §5.6.7 (IMF-fixdate
/// `Sun, 06 Nov 1994 08:49:37 GMT`, the obsolete RFC 850 and asctime
/// forms). Surrounding whitespace is ignored.
///
/// - a date at or before `now` is [`Duration::ZERO`] (retry at once);
/// - a number of seconds too large for a `u64` saturates to `u64::MAX`
///   seconds (callers bound the wait anyway: [`crate::RetryPolicy::with_max_retry_after`]);
/// - no field, two or more fields, or a value that is neither form
///   (`-1`, `1.5`, `soon`, non-ASCII) is `None`: the caller falls back to
///   its own backoff.
pub fn retry_after(headers: &HeaderMap, now: SystemTime) -> Option<Duration> {
    let mut values = headers.get_all(http::header::RETRY_AFTER).iter();
    let value = values.next()?;
    if values.next().is_some() {
        return None;
    }
    parse_retry_after(value.to_str().ok()?, now)
}

/// Parses one `Retry-After` value as of `now`; see [`retry_after`].
pub fn parse_retry_after(value: &str, now: SystemTime) -> Option<Duration> {
    let value = value.trim_matches([' ', '\t']);
    if value.is_empty() {
        return None;
    }
    if value.bytes().all(|b| b.is_ascii_digit()) {
        // Only digits: a delay in seconds; too many of them saturate.
        let secs = value.parse::<u64>().unwrap_or(u64::MAX);
        return Some(Duration::from_secs(secs));
    }
    let at = httpdate::parse_http_date(value).ok()?;
    Some(at.duration_since(now).unwrap_or(Duration::ZERO))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn at(secs: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs)
    }

    // Sun, 06 Nov 1994 08:49:37 GMT, the example of RFC 9110 §5.6.7.
    const RFC_EXAMPLE: u64 = 784_111_777;

    #[test]
    fn delay_seconds() {
        let now = at(RFC_EXAMPLE);
        assert_eq!(
            parse_retry_after("120", now),
            Some(Duration::from_secs(120))
        );
        assert_eq!(parse_retry_after("0", now), Some(Duration::ZERO));
        assert_eq!(parse_retry_after(" 7\t", now), Some(Duration::from_secs(7)));
        assert_eq!(
            parse_retry_after("99999999999999999999999", now),
            Some(Duration::from_secs(u64::MAX))
        );
    }

    #[test]
    fn the_three_date_forms() {
        let now = at(RFC_EXAMPLE - 30);
        for form in [
            "Sun, 06 Nov 1994 08:49:37 GMT",
            "Sunday, 06-Nov-94 08:49:37 GMT",
            "Sun Nov  6 08:49:37 1994",
        ] {
            assert_eq!(
                parse_retry_after(form, now),
                Some(Duration::from_secs(30)),
                "{form}"
            );
        }
    }

    #[test]
    fn a_past_date_is_now() {
        let now = at(RFC_EXAMPLE + 3600);
        assert_eq!(
            parse_retry_after("Sun, 06 Nov 1994 08:49:37 GMT", now),
            Some(Duration::ZERO)
        );
    }

    #[test]
    fn garbage_is_none() {
        let now = at(RFC_EXAMPLE);
        for bad in [
            "",
            " ",
            "-1",
            "+5",
            "1.5",
            "1e3",
            "soon",
            "5 s",
            "Sun, 06 Nov 1994",
            "Sun, 32 Nov 1994 08:49:37 GMT",
            "١٢",
        ] {
            assert_eq!(parse_retry_after(bad, now), None, "{bad:?}");
        }
    }

    #[test]
    fn the_field() {
        let now = at(RFC_EXAMPLE);
        let mut h = HeaderMap::new();
        assert_eq!(retry_after(&h, now), None);
        h.insert("retry-after", "3".parse().unwrap());
        assert_eq!(retry_after(&h, now), Some(Duration::from_secs(3)));
        h.append("retry-after", "4".parse().unwrap());
        assert_eq!(retry_after(&h, now), None, "two fields: ambiguous");
        let mut h = HeaderMap::new();
        h.insert(
            "retry-after",
            http::HeaderValue::from_bytes(b"\xff3").unwrap(),
        );
        assert_eq!(retry_after(&h, now), None);
    }

    proptest! {
        #[test]
        fn any_delay_seconds_round_trips(secs in any::<u64>(), pad in "[ \t]{0,3}") {
            let value = format!("{pad}{secs}{pad}");
            prop_assert_eq!(parse_retry_after(&value, at(0)), Some(Duration::from_secs(secs)));
        }

        #[test]
        fn any_formatted_date_is_its_distance(now in 0u64..4_000_000_000, ahead in 0u64..1_000_000) {
            let date = httpdate::fmt_http_date(at(now + ahead));
            prop_assert_eq!(parse_retry_after(&date, at(now)), Some(Duration::from_secs(ahead)));
        }

        #[test]
        fn any_string_never_panics(s in "\\PC{0,40}") {
            let _ = parse_retry_after(&s, at(RFC_EXAMPLE));
        }
    }
}
