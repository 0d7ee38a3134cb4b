//! What `idem check` will do: the options checked and resolved, the checks
//! chosen, how many requests each may send, and the plan `--dry-run`
//! prints.

use std::fmt::Write as _;
use std::net::IpAddr;
use std::time::Duration;

use bytes::Bytes;
use http::{header, HeaderName, HeaderValue, Method};

use super::body::{other_body, same_request_variants, Variant};
use super::client::Url;
use super::CheckArgs;

/// How executions are told apart.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Witness {
    /// No way given: checks that count executions are not applicable.
    None,
    /// `--id-pointer`: a JSON Pointer to a value that differs per execution.
    Pointer(String),
    /// `--id-header`: a response field that differs per execution.
    Header(HeaderName),
    /// `--count-url`: a GET answering the number of executions so far.
    CountUrl(Url),
}

impl Witness {
    /// How it counts, for the report.
    pub(crate) fn describe(&self) -> String {
        match self {
            Witness::None => {
                "executions not counted (no --id-pointer, --id-header or --count-url)".to_owned()
            }
            Witness::Pointer(p) => format!("executions told apart by the body's {p}"),
            Witness::Header(h) => format!("executions told apart by the {h} header"),
            Witness::CountUrl(u) => format!("executions counted by GET {u}"),
        }
    }

    /// The value that tells executions apart in `answer`, if any (only for
    /// `Pointer` and `Header`).
    pub(crate) fn id_of(&self, answer: &super::client::Answer) -> Option<String> {
        match self {
            Witness::Pointer(p) => serde_json::from_slice::<serde_json::Value>(&answer.body)
                .ok()
                .and_then(|v| v.pointer(p).cloned())
                .map(|v| match v {
                    serde_json::Value::String(s) => s,
                    other => other.to_string(),
                }),
            Witness::Header(h) => answer
                .headers
                .get(h)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned()),
            Witness::None | Witness::CountUrl(_) => None,
        }
    }
}

/// The checks, in the order they run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum CheckId {
    /// N concurrent duplicates → one execution.
    Concurrent,
    /// A retry after the first completed → the same answer.
    Replay,
    /// A retry while the first is still running → 409 or the replay.
    InFlight,
    /// A hang-up before the answer, then a retry → one execution.
    Disconnect,
    /// The same key with another body → 4xx.
    OtherBody,
    /// The same key on another path.
    OtherPath,
    /// Key order and whitespace variants of a JSON body → the same request.
    JsonVariants,
    /// Invalid keys → 4xx.
    InvalidKeys,
    /// A request without a key (informational).
    NoKey,
}

impl CheckId {
    /// Every check, in running order.
    pub(crate) const ALL: [CheckId; 9] = [
        CheckId::Concurrent,
        CheckId::Replay,
        CheckId::InFlight,
        CheckId::Disconnect,
        CheckId::OtherBody,
        CheckId::OtherPath,
        CheckId::JsonVariants,
        CheckId::InvalidKeys,
        CheckId::NoKey,
    ];

    /// The name used by `--checks` and in the report.
    pub(crate) fn name(self) -> &'static str {
        match self {
            CheckId::Concurrent => "concurrent",
            CheckId::Replay => "replay",
            CheckId::InFlight => "in-flight",
            CheckId::Disconnect => "disconnect",
            CheckId::OtherBody => "other-body",
            CheckId::OtherPath => "other-path",
            CheckId::JsonVariants => "json-variants",
            CheckId::InvalidKeys => "invalid-keys",
            CheckId::NoKey => "no-key",
        }
    }

    /// What the check expects, in one line.
    pub(crate) fn title(self) -> &'static str {
        match self {
            CheckId::Concurrent => "concurrent duplicates run once",
            CheckId::Replay => "a retry after the first completed gets the same answer",
            CheckId::InFlight => {
                "a retry while the first runs gets 409 (sane Retry-After) or the replay"
            }
            CheckId::Disconnect => "a hang-up before the answer, then a retry: one execution",
            CheckId::OtherBody => "the same key with another body is refused (4xx, 422 preferred)",
            CheckId::OtherPath => "the same key on another path never gets the first answer",
            CheckId::JsonVariants => "key order and whitespace of a JSON body do not matter",
            CheckId::InvalidKeys => "invalid keys (empty, 300 characters, a tab) are refused",
            CheckId::NoKey => "what a request without a key gets (informational)",
        }
    }

    fn parse(s: &str) -> Result<CheckId, String> {
        let s = s.trim();
        CheckId::ALL
            .into_iter()
            .find(|c| c.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                let names: Vec<&str> = CheckId::ALL.iter().map(|c| c.name()).collect();
                format!(
                    "--checks: unknown check {s:?}; the checks are {}",
                    names.join(", ")
                )
            })
    }
}

/// The lowest `--rate` (requests a second).
pub(crate) const MIN_RATE: f64 = 0.1;

/// Most polls of a retry that keeps getting 409 (the disconnect check).
pub(crate) const MAX_POLLS: usize = 20;
/// Most reads of the count URL to see it settle after a check.
pub(crate) const SETTLE_READS: usize = 5;

/// The three invalid keys: what each is, and the value sent.
pub(crate) fn invalid_keys() -> [(&'static str, HeaderValue); 3] {
    [
        ("an empty key", HeaderValue::from_static("")),
        (
            "a 300-character key",
            HeaderValue::from_str(&"k".repeat(300)).expect("ASCII"),
        ),
        (
            "a key with a control character (tab)",
            HeaderValue::from_bytes(b"idem\tcheck").expect("HTAB is a valid field byte"),
        ),
    ]
}

/// Everything `idem check` needs, checked.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub(crate) method: Method,
    pub(crate) url: Url,
    /// The `-H` fields (and a `Content-Type` added for a JSON body).
    pub(crate) headers: Vec<(HeaderName, HeaderValue)>,
    pub(crate) body: Bytes,
    /// Whether `Content-Type: application/json` was added.
    pub(crate) added_json_type: bool,
    pub(crate) key_header: HeaderName,
    pub(crate) witness: Witness,
    pub(crate) concurrency: usize,
    pub(crate) slow: Option<(HeaderName, HeaderValue)>,
    pub(crate) disconnect_after: Duration,
    pub(crate) overlap_after: Duration,
    pub(crate) timeout: Duration,
    pub(crate) other_path: Url,
    pub(crate) other_body: Bytes,
    /// Same-request variants of a JSON body (empty: not JSON).
    pub(crate) variants: Vec<Variant>,
    /// Response fields left out of the replay comparison, besides `Date`,
    /// the hop-by-hop fields and `Content-Length`.
    pub(crate) ignore_headers: Vec<HeaderName>,
    pub(crate) rate: f64,
    pub(crate) max_requests: usize,
    pub(crate) checks: Vec<CheckId>,
}

/// Whether `host` is a loopback host: `localhost`, 127.0.0.0/8, `::1`.
pub(crate) fn is_loopback(host: &str) -> bool {
    host.eq_ignore_ascii_case("localhost")
        || host.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

/// `NAME: VALUE` (or `NAME:VALUE`) as a header field.
pub(crate) fn parse_field(flag: &str, s: &str) -> Result<(HeaderName, HeaderValue), String> {
    let (name, value) = s
        .split_once(':')
        .ok_or_else(|| format!("{flag} {s:?}: write the field as 'Name: value'"))?;
    let name = HeaderName::from_bytes(name.trim().as_bytes())
        .map_err(|_| format!("{flag} {s:?}: {:?} is not a header name", name.trim()))?;
    let value = HeaderValue::from_str(value.trim())
        .map_err(|_| format!("{flag} {s:?}: the value holds a byte a header cannot carry"))?;
    Ok((name, value))
}

fn header_name(flag: &str, s: &str) -> Result<HeaderName, String> {
    HeaderName::from_bytes(s.trim().as_bytes())
        .map_err(|_| format!("{flag} {s:?} is not a header name"))
}

impl Plan {
    /// Checks the arguments and resolves the defaults.
    ///
    /// # Errors
    /// A message naming the flag at fault (a usage error: exit status 2).
    pub(crate) fn from_args(args: &CheckArgs) -> Result<Plan, String> {
        let method = Method::from_bytes(args.method.trim().to_ascii_uppercase().as_bytes())
            .map_err(|_| format!("-X {:?} is not an HTTP method", args.method))?;
        let url = Url::parse(&args.url)?;
        let allowed = |host: &str| {
            is_loopback(host)
                || args
                    .allow_hosts
                    .iter()
                    .any(|h| h.trim().eq_ignore_ascii_case(host))
        };
        if !allowed(&url.origin.host) {
            return Err(format!(
                "{} is not a loopback host: idem check sends duplicate writes, so it probes \
                 127.0.0.0/8, ::1 and localhost only, unless --allow-host {} names the host",
                url.origin.host, url.origin.host
            ));
        }
        let key_header = header_name("--key-header", &args.key_header)?;
        let body = match (&args.data, &args.data_file) {
            (Some(d), None) => Bytes::from(d.clone().into_bytes()),
            (None, Some(path)) => Bytes::from(
                std::fs::read(path)
                    .map_err(|e| format!("--data-file {}: cannot read it: {e}", path.display()))?,
            ),
            (None, None) => Bytes::new(),
            (Some(_), Some(_)) => return Err("give --data or --data-file, not both".to_owned()),
        };
        let mut headers = Vec::new();
        for h in &args.headers {
            let (name, value) = parse_field("-H", h)?;
            if name == key_header {
                return Err(format!(
                    "-H {h:?}: idem check sends {key_header} itself, a fresh key per check"
                ));
            }
            if name == header::CONTENT_LENGTH || name == header::TRANSFER_ENCODING {
                return Err(format!("-H {h:?}: idem check frames the body itself"));
            }
            headers.push((name, value));
        }
        let text = std::str::from_utf8(&body).ok();
        let is_json = text.is_some_and(|t| serde_json::from_str::<serde_json::Value>(t).is_ok());
        let added_json_type =
            is_json && !body.is_empty() && !headers.iter().any(|(n, _)| *n == header::CONTENT_TYPE);
        if added_json_type {
            headers.push((
                header::CONTENT_TYPE,
                HeaderValue::from_static("application/json"),
            ));
        }
        let variants = text.map(same_request_variants).unwrap_or_default();
        let witness = match (&args.id_pointer, &args.id_header, &args.count_url) {
            (Some(p), None, None) => {
                if !(p.is_empty() || p.starts_with('/')) {
                    return Err(format!(
                        "--id-pointer {p:?} is not a JSON Pointer (RFC 6901): it starts with '/', \
                         as in /id or /order/id"
                    ));
                }
                Witness::Pointer(p.clone())
            }
            (None, Some(h), None) => Witness::Header(header_name("--id-header", h)?),
            (None, None, Some(u)) => {
                let count = Url::parse(u).map_err(|e| format!("--count-url: {e}"))?;
                if !allowed(&count.origin.host) {
                    return Err(format!(
                        "--count-url: {} is not a loopback host; name it with --allow-host",
                        count.origin.host
                    ));
                }
                Witness::CountUrl(count)
            }
            (None, None, None) => Witness::None,
            _ => {
                return Err(
                    "give one of --id-pointer, --id-header and --count-url, not several".to_owned(),
                )
            }
        };
        let slow = match &args.slow_header {
            Some(s) => Some(parse_field("--slow-header", s)?),
            None => None,
        };
        let other_path = match &args.other_path {
            Some(p) if p.starts_with('/') => url.with_target(p),
            Some(p) => {
                return Err(format!(
                    "--other-path {p:?}: give a path starting with '/', as /orders-other"
                ))
            }
            None => url.with_target(&format!(
                "{}/idem-check-other{}",
                url.path().trim_end_matches('/'),
                url.query()
            )),
        };
        let other_body = match &args.other_data {
            Some(d) => Bytes::from(d.clone().into_bytes()),
            None => Bytes::from(other_body(&body)),
        };
        if other_body == body {
            return Err("--other-data is the same as the request body; give another body".into());
        }
        let mut ignore_headers = Vec::new();
        for h in &args.ignore_headers {
            ignore_headers.push(header_name("--ignore-header", h)?);
        }
        if !(args.rate.is_finite() && args.rate >= MIN_RATE) {
            return Err(format!(
                "--rate {}: give a number of requests a second, at least {MIN_RATE}",
                args.rate
            ));
        }
        let mut checks = Vec::new();
        for name in &args.checks {
            let id = CheckId::parse(name)?;
            if !checks.contains(&id) {
                checks.push(id);
            }
        }
        if checks.is_empty() {
            checks = CheckId::ALL.to_vec();
        } else {
            checks.sort_by_key(|c| CheckId::ALL.iter().position(|a| a == c));
        }
        let plan = Plan {
            method,
            url,
            headers,
            body,
            added_json_type,
            key_header,
            witness,
            concurrency: usize::from(args.concurrency),
            slow,
            disconnect_after: args.disconnect_after,
            overlap_after: args.overlap_after,
            timeout: args.timeout,
            other_path,
            other_body,
            variants,
            ignore_headers,
            rate: args.rate,
            max_requests: args.max_requests,
            checks,
        };
        let needed = plan.most_requests();
        if needed > plan.max_requests {
            return Err(format!(
                "the plan may send up to {needed} requests, more than --max-requests {}: \
                 raise it, lower --concurrency or pick fewer --checks",
                plan.max_requests
            ));
        }
        Ok(plan)
    }

    /// Whether the count URL counts executions.
    fn counts(&self) -> bool {
        matches!(self.witness, Witness::CountUrl(_))
    }

    /// Why `check` cannot run with these options, if it cannot.
    pub(crate) fn not_applicable(&self, check: CheckId) -> Option<String> {
        match check {
            CheckId::Concurrent if self.witness == Witness::None => Some(
                "counting executions needs --id-pointer, --id-header or --count-url".to_owned(),
            ),
            CheckId::Disconnect if !self.counts() => Some(
                "needs --count-url: the first answer is never read, so only a count tells a \
                 replay from a second execution"
                    .to_owned(),
            ),
            CheckId::JsonVariants if self.variants.is_empty() => {
                Some("the request body is not a JSON object or array".to_owned())
            }
            _ => None,
        }
    }

    /// The most requests `check` may send (count-URL reads included).
    pub(crate) fn requests_of(&self, check: CheckId) -> usize {
        if self.not_applicable(check).is_some() {
            return 0;
        }
        let reads = if self.counts() { 1 + SETTLE_READS } else { 0 };
        match check {
            CheckId::Concurrent => self.concurrency + reads,
            CheckId::Replay => 2 + reads,
            CheckId::InFlight => 2 + reads,
            CheckId::Disconnect => 1 + MAX_POLLS + reads,
            // The first, the other body, and the other body with a fresh
            // key (the control); one more read between them.
            CheckId::OtherBody => 3 + reads + usize::from(self.counts()),
            CheckId::OtherPath => 2 + reads,
            CheckId::JsonVariants => 1 + self.variants.len() + reads,
            CheckId::InvalidKeys => 3 + reads,
            CheckId::NoKey => 1 + reads,
        }
    }

    /// The most requests the whole plan may send.
    pub(crate) fn most_requests(&self) -> usize {
        self.checks.iter().map(|c| self.requests_of(*c)).sum()
    }

    /// The plan as `--dry-run` prints it.
    pub(crate) fn describe(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "idem check {} {} — the plan (nothing sent)",
            self.method, self.url
        );
        let _ = writeln!(out, "  {}", self.witness.describe());
        let mut fields: Vec<String> = self
            .headers
            .iter()
            .map(|(n, v)| format!("{n}: {}", String::from_utf8_lossy(v.as_bytes())))
            .collect();
        if self.added_json_type {
            if let Some(last) = fields.last_mut() {
                last.push_str(" (added: the body is JSON)");
            }
        }
        if !fields.is_empty() {
            let _ = writeln!(out, "  headers: {}", fields.join("; "));
        }
        let _ = writeln!(out, "  body: {}", excerpt(&self.body));
        let _ = writeln!(
            out,
            "  every check uses fresh keys ({}: idem-check-<32 hex digits>); at most {} requests \
             ({} a second, bursts of {}; --max-requests {})",
            self.key_header,
            self.most_requests(),
            self.rate,
            self.concurrency,
            self.max_requests
        );
        let slow = self.slow.as_ref().map_or(String::new(), |(n, v)| {
            format!(" + {n}: {}", String::from_utf8_lossy(v.as_bytes()))
        });
        let m = &self.method;
        let t = &self.url.target;
        let count = match &self.witness {
            Witness::CountUrl(u) => format!("GET {u} before and after (until it settles)"),
            _ => String::new(),
        };
        for check in &self.checks {
            let _ = writeln!(out, "\n  {} — {}", check.name(), check.title());
            if let Some(why) = self.not_applicable(*check) {
                let _ = writeln!(out, "    not applicable: {why}");
                continue;
            }
            let mut steps: Vec<String> = match check {
                CheckId::Concurrent => vec![format!(
                    "{} × {m} {t} with key K{slow}, all at once on {} connections",
                    self.concurrency, self.concurrency
                )],
                CheckId::Replay => vec![
                    format!("{m} {t} with key K"),
                    format!("after its answer, {m} {t} with key K again; compare status, headers, body"),
                ],
                CheckId::InFlight => vec![
                    format!("{m} {t} with key K{slow}"),
                    format!(
                        "{} later, while it runs, {m} {t} with key K{slow} on another connection",
                        humantime::format_duration(self.overlap_after)
                    ),
                ],
                CheckId::Disconnect => vec![
                    format!(
                        "{m} {t} with key K{slow}; hang up after {}",
                        humantime::format_duration(self.disconnect_after)
                    ),
                    format!("{m} {t} with key K{slow} again, repeated while it gets 409 (at most {MAX_POLLS} times)"),
                ],
                CheckId::OtherBody => vec![
                    format!("{m} {t} with key K"),
                    format!("{m} {t} with key K and body {}", excerpt(&self.other_body)),
                    format!("{m} {t} with key K2 and that body (does the API take it at all?)"),
                ],
                CheckId::OtherPath => vec![
                    format!("{m} {t} with key K"),
                    format!("{m} {} with key K", self.other_path.target),
                ],
                CheckId::JsonVariants => {
                    let mut s = vec![format!("{m} {t} with key K")];
                    for v in &self.variants {
                        s.push(format!("{m} {t} with key K, {}: {}", v.what, excerpt(v.body.as_bytes())));
                    }
                    s
                }
                CheckId::InvalidKeys => invalid_keys()
                    .iter()
                    .map(|(what, _)| format!("{m} {t} with {what}"))
                    .collect(),
                CheckId::NoKey => vec![format!("{m} {t} without {}", self.key_header)],
            };
            if !count.is_empty() {
                steps.insert(0, count.clone());
            }
            for s in steps {
                let _ = writeln!(out, "    {s}");
            }
            let _ = writeln!(out, "    (at most {} requests)", self.requests_of(*check));
        }
        out
    }
}

/// A body for one line: its text (escaped, at most 80 characters) or its
/// size.
pub(crate) fn excerpt(body: &[u8]) -> String {
    if body.is_empty() {
        return "(empty)".to_owned();
    }
    match std::str::from_utf8(body) {
        Ok(t) if t.chars().count() <= 80 => format!("{t:?}"),
        Ok(t) => {
            let head: String = t.chars().take(77).collect();
            format!("{:?}… ({} bytes)", head, body.len())
        }
        Err(_) => format!("({} bytes, not UTF-8)", body.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_hosts() {
        for h in ["localhost", "LOCALHOST", "127.0.0.1", "127.9.9.9", "::1"] {
            assert!(is_loopback(h), "{h}");
        }
        for h in [
            "example.com",
            "10.0.0.1",
            "128.0.0.1",
            "::2",
            "localhost.example",
        ] {
            assert!(!is_loopback(h), "{h}");
        }
    }

    #[test]
    fn fields_are_parsed() {
        let (n, v) = parse_field("-H", "X-Delay-Ms: 300").unwrap();
        assert_eq!(n, "x-delay-ms");
        assert_eq!(v, "300");
        assert!(parse_field("-H", "no colon")
            .unwrap_err()
            .contains("Name: value"));
        assert!(parse_field("-H", "bad name: 1")
            .unwrap_err()
            .contains("not a header name"));
    }
}
