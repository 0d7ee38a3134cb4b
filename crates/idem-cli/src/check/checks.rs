//! The checks themselves: each sends its requests with fresh keys, counts
//! executions when it can, and gives a verdict with its evidence.

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Method, StatusCode};

use super::client::{Answer, Client, Exchange, Outcome, Req, Url};
use super::plan::{invalid_keys, CheckId, Plan, Witness, MAX_POLLS, SETTLE_READS};
use super::report::{CheckResult, Report, Verdict};

/// Whether a replay may leave out or change response field `name`: `Date`,
/// the hop-by-hop fields ([`idem_gateway::HOP_BY_HOP`], RFC 9110,
/// section 7.6.1), `Content-Length` (the body is compared itself) and
/// `Idempotent-Replayed`.
fn ignored(name: &str) -> bool {
    idem_gateway::HOP_BY_HOP.contains(&name)
        || matches!(name, "date" | "content-length" | "idempotent-replayed")
}

/// The most Retry-After (in seconds) a 409 may name and still be sane.
const MAX_RETRY_AFTER: u64 = 3600;

/// A fresh key: `idem-check-` and 32 random hex digits.
fn fresh_key() -> HeaderValue {
    HeaderValue::from_str(&format!("idem-check-{:032x}", rand::random::<u128>()))
        .expect("hex digits are a valid field value")
}

/// Reads an execution count: a number, or JSON holding exactly one
/// number (anywhere in it) that is a whole number ≥ 0.
///
/// # Errors
/// What the body is instead.
pub(crate) fn parse_count(body: &[u8]) -> Result<u64, String> {
    let text = String::from_utf8_lossy(body);
    let text = text.trim();
    if let Ok(n) = text.parse::<u64>() {
        return Ok(n);
    }
    let shown: String = text.chars().take(60).collect();
    let value: serde_json::Value = serde_json::from_str(text)
        .map_err(|_| format!("answered {shown:?}, not a number or JSON holding one"))?;
    let mut numbers = Vec::new();
    collect_numbers(&value, &mut numbers);
    match numbers.as_slice() {
        [n] => n
            .as_u64()
            .ok_or_else(|| format!("answered {shown:?}: {n} is not a whole number ≥ 0")),
        [] => Err(format!("answered {shown:?}, which holds no number")),
        _ => Err(format!(
            "answered {shown:?}, which holds {} numbers; it must hold one",
            numbers.len()
        )),
    }
}

fn collect_numbers<'a>(v: &'a serde_json::Value, out: &mut Vec<&'a serde_json::Number>) {
    match v {
        serde_json::Value::Number(n) => out.push(n),
        serde_json::Value::Array(items) => items.iter().for_each(|i| collect_numbers(i, out)),
        serde_json::Value::Object(m) => m.values().for_each(|i| collect_numbers(i, out)),
        _ => {}
    }
}

/// How many executions a check saw.
#[derive(Debug, Clone)]
enum Count {
    /// The count URL's difference.
    Exact { before: u64, after: u64 },
    /// The distinct ids of the 2xx answers, and how many 2xx answers had
    /// none.
    Ids {
        distinct: Vec<String>,
        missing: usize,
        what: String,
    },
    /// Not counted.
    Unknown,
}

impl Count {
    /// The number of executions, or why it is not known.
    fn executions(&self) -> Result<u64, String> {
        match self {
            Count::Exact { before, after } => Ok(after.saturating_sub(*before)),
            Count::Ids { missing, what, .. } if *missing > 0 => Err(format!(
                "{missing} 2xx answer(s) carry no {what}; check the flag that names it"
            )),
            Count::Ids { distinct, .. } => Ok(distinct.len() as u64),
            Count::Unknown => Err(
                "executions are not counted (give --id-pointer, --id-header or --count-url)"
                    .to_owned(),
            ),
        }
    }

    /// How they were counted, for the reason.
    fn how(&self) -> String {
        match self {
            Count::Exact { before, after } => format!("count {before} → {after}"),
            Count::Ids { distinct, what, .. } => {
                let shown: Vec<&str> = distinct.iter().take(4).map(String::as_str).collect();
                let more = if distinct.len() > 4 { ", …" } else { "" };
                match distinct.len() {
                    0 => format!("no {what} seen"),
                    1 => format!("one {what}: {}", shown[0]),
                    n => format!("{n} different values of {what}: {}{more}", shown.join(", ")),
                }
            }
            Count::Unknown => "executions not counted".to_owned(),
        }
    }
}

/// Runs the plan's checks.
#[derive(Debug)]
pub(crate) struct Probe {
    client: Client,
    plan: Plan,
}

impl Probe {
    /// A probe of `plan`.
    pub(crate) fn new(plan: Plan) -> Self {
        let client = Client::new(
            plan.rate,
            plan.concurrency,
            plan.max_requests,
            plan.timeout,
            plan.key_header.clone(),
        );
        Probe { client, plan }
    }

    /// Runs every check of the plan, one after the other.
    pub(crate) async fn run(&self) -> Report {
        let mut results = Vec::new();
        for &check in &self.plan.checks {
            let result = match self.plan.not_applicable(check) {
                Some(why) => CheckResult::new(check, &[], Verdict::NotApplicable, why),
                None => {
                    let run = match check {
                        CheckId::Concurrent => self.concurrent().await,
                        CheckId::Replay => self.replay().await,
                        CheckId::InFlight => self.in_flight().await,
                        CheckId::Disconnect => self.disconnect().await,
                        CheckId::OtherBody => self.other_body().await,
                        CheckId::OtherPath => self.other_path().await,
                        CheckId::JsonVariants => self.json_variants().await,
                        CheckId::InvalidKeys => self.invalid_keys().await,
                        CheckId::NoKey => self.no_key().await,
                    };
                    run.unwrap_or_else(|e| CheckResult::new(check, &[], Verdict::Fail, e))
                }
            };
            results.push(result);
        }
        Report::new(
            self.plan.method.to_string(),
            self.plan.url.to_string(),
            self.plan.witness.describe(),
            results,
            self.client.used(),
        )
    }

    // ------------------------------------------------------------ requests

    /// The request, with `key` (none: no key field), to `url` (none: the
    /// probed URL), with `body` (none: the request body), with the
    /// `--slow-header` when `slow`.
    fn request(
        &self,
        key: Option<&HeaderValue>,
        url: Option<&Url>,
        body: Option<&Bytes>,
        slow: bool,
    ) -> Req {
        let mut headers = self.plan.headers.clone();
        if slow {
            if let Some((n, v)) = &self.plan.slow {
                headers.push((n.clone(), v.clone()));
            }
        }
        if let Some(k) = key {
            headers.push((self.plan.key_header.clone(), k.clone()));
        }
        Req {
            method: self.plan.method.clone(),
            url: url.unwrap_or(&self.plan.url).clone(),
            headers,
            body: body.unwrap_or(&self.plan.body).clone(),
        }
    }

    /// The count URL's number now (`None` without `--count-url`).
    async fn read_count(&self) -> Result<Option<u64>, String> {
        let Witness::CountUrl(url) = &self.plan.witness else {
            return Ok(None);
        };
        let req = Req {
            method: Method::GET,
            url: url.clone(),
            headers: Vec::new(),
            body: Bytes::new(),
        };
        let ex = self.client.send(&req, "count").await;
        match &ex.outcome {
            Outcome::Answered(a) if a.success() => parse_count(&a.body)
                .map(Some)
                .map_err(|e| format!("--count-url {url} {e}")),
            Outcome::Answered(a) => Err(format!("--count-url {url} answered {}", a.status)),
            Outcome::Failed(e) => Err(format!("--count-url {url}: {e}")),
            Outcome::HungUp => Err(format!("--count-url {url}: no answer")),
        }
    }

    /// The count once two reads 100 ms apart agree (at most
    /// [`SETTLE_READS`] reads): executions still landing are counted.
    async fn settled_count(&self) -> Result<Option<u64>, String> {
        let Some(mut last) = self.read_count().await? else {
            return Ok(None);
        };
        for _ in 1..SETTLE_READS {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now = self.read_count().await?.unwrap_or(last);
            if now == last {
                break;
            }
            last = now;
        }
        Ok(Some(last))
    }

    /// What the check saw: the count's difference, or the distinct ids of
    /// the 2xx answers among `exchanges`.
    fn count(&self, before: Option<u64>, after: Option<u64>, exchanges: &[&Exchange]) -> Count {
        if let (Some(before), Some(after)) = (before, after) {
            return Count::Exact { before, after };
        }
        let what = match &self.plan.witness {
            Witness::Pointer(p) => format!("id at {p}"),
            Witness::Header(h) => format!("{h} value"),
            Witness::None | Witness::CountUrl(_) => return Count::Unknown,
        };
        let mut distinct: Vec<String> = Vec::new();
        let mut missing = 0;
        for a in exchanges
            .iter()
            .filter_map(|e| e.answer())
            .filter(|a| a.success())
        {
            match self.plan.witness.id_of(a) {
                Some(id) if !distinct.contains(&id) => distinct.push(id),
                Some(_) => {}
                None => missing += 1,
            }
        }
        Count::Ids {
            distinct,
            missing,
            what,
        }
    }

    /// The first request of a check that needs it answered 2xx: its
    /// answer, or the failed result.
    fn premise<'a>(
        &self,
        check: CheckId,
        first: &'a Exchange,
        all: &[Exchange],
    ) -> Result<&'a Answer, Box<CheckResult>> {
        match &first.outcome {
            Outcome::Answered(a) if a.success() => Ok(a),
            Outcome::Answered(a) => Err(Box::new(
                CheckResult::new(
                    check,
                    all,
                    Verdict::Fail,
                    format!(
                    "the first request got {}, not 2xx, so there is nothing to compare; fix the \
                     request (--data, -H, -X) first",
                    a.status
                ),
                )
                .with_details(vec![format!("body: {}", super::plan::excerpt(&a.body))]),
            )),
            Outcome::Failed(e) => Err(Box::new(CheckResult::new(
                check,
                all,
                Verdict::Fail,
                format!("the first request got no answer: {e}"),
            ))),
            Outcome::HungUp => Err(Box::new(CheckResult::new(
                check,
                all,
                Verdict::Fail,
                "the first request got no answer".to_owned(),
            ))),
        }
    }

    // -------------------------------------------------------------- checks

    /// (a) N concurrent copies with one key → one execution (CASES A1).
    async fn concurrent(&self) -> Result<CheckResult, String> {
        let check = CheckId::Concurrent;
        let n = self.plan.concurrency;
        let key = fresh_key();
        let req = self.request(Some(&key), None, None, true);
        let before = self.read_count().await?;
        // Every connection is open before the first copy is sent.
        let mut conns = Vec::with_capacity(n);
        for _ in 0..n {
            match self.client.connect(&req.url.origin).await {
                Ok(c) => conns.push(c),
                Err(e) => return Ok(CheckResult::new(check, &[], Verdict::Fail, e)),
            }
        }
        if let Err(e) = self.client.permit(n).await {
            return Ok(CheckResult::new(check, &[], Verdict::Fail, e));
        }
        let labels: Vec<String> = (1..=n).map(|i| format!("copy {i}")).collect();
        let sends = conns
            .into_iter()
            .zip(&labels)
            .map(|(c, label)| self.client.send_on(c, &req, label, None));
        let exchanges = futures::future::join_all(sends).await;
        let after = self.settled_count().await?;
        let all: Vec<&Exchange> = exchanges.iter().collect();
        let count = self.count(before, after, &all);
        let mut details = failures(&exchanges);
        let waits: Vec<String> = exchanges
            .iter()
            .filter_map(Exchange::answer)
            .filter(|a| a.status == StatusCode::CONFLICT)
            .map(|a| retry_after_of(a).unwrap_or_else(|| "none".to_owned()))
            .fold(Vec::new(), |mut v, s| {
                if !v.contains(&s) {
                    v.push(s);
                }
                v
            });
        if !waits.is_empty() {
            details.push(format!(
                "the 409s carried Retry-After: {}",
                waits.join(", ")
            ));
        }
        let (verdict, reason) = match count.executions() {
            Ok(1) => (
                Verdict::Pass,
                format!(
                    "1 execution for {n} concurrent copies of one key ({})",
                    count.how()
                ),
            ),
            Ok(0) => (
                Verdict::Fail,
                format!(
                    "no copy ran ({}), so nothing shows the key at work",
                    count.how()
                ),
            ),
            Ok(k) => (
                Verdict::Fail,
                format!(
                    "{k} executions for {n} concurrent copies of one key ({})",
                    count.how()
                ),
            ),
            Err(why) => (Verdict::Fail, why),
        };
        Ok(CheckResult::new(check, &exchanges, verdict, reason).with_details(details))
    }

    /// (b) A retry after the first completed → the same status, headers
    /// and body, and no second execution (CASES C2, D1).
    async fn replay(&self) -> Result<CheckResult, String> {
        let check = CheckId::Replay;
        let key = fresh_key();
        let req = self.request(Some(&key), None, None, false);
        let before = self.read_count().await?;
        let first = self.client.send(&req, "first").await;
        let a = match self.premise(check, &first, std::slice::from_ref(&first)) {
            Ok(a) => a.clone(),
            Err(r) => return Ok(*r),
        };
        let retry = self.client.send(&req, "retry after it completed").await;
        let after = self.settled_count().await?;
        let exchanges = [first.clone(), retry.clone()];
        let Some(b) = retry.answer() else {
            return Ok(CheckResult::new(
                check,
                &exchanges,
                Verdict::Fail,
                format!("the retry got no answer: {}", failure_of(&retry)),
            ));
        };
        let diffs = differences(&a, b, &self.plan.ignore_headers);
        let count = self.count(before, after, &[&first, &retry]);
        let counted = match count.executions() {
            Ok(k) => format!(
                "; {k} execution{} ({})",
                if k == 1 { "" } else { "s" },
                count.how()
            ),
            Err(_) => " (executions not counted)".to_owned(),
        };
        let result = match count.executions() {
            Ok(k) if k >= 2 => CheckResult::new(
                check,
                &exchanges,
                Verdict::Fail,
                format!("the retry ran again: {k} executions ({})", count.how()),
            ),
            _ if !diffs.is_empty() => CheckResult::new(
                check,
                &exchanges,
                Verdict::Fail,
                format!(
                    "the retry's answer differs from the first in {} way{}{counted}",
                    diffs.len(),
                    if diffs.len() == 1 { "" } else { "s" }
                ),
            ),
            _ => CheckResult::new(
                check,
                &exchanges,
                Verdict::Pass,
                format!(
                    "the same status ({}), headers and body ({} bytes){}{counted}",
                    b.status.as_u16(),
                    b.body.len(),
                    if b.replayed() {
                        ", marked Idempotent-Replayed: true"
                    } else {
                        ""
                    }
                ),
            ),
        };
        Ok(result.with_details(diffs))
    }

    /// (i) A retry while the first still runs → 409 with a sane
    /// Retry-After, or the replay; never a second execution (CASES A2).
    async fn in_flight(&self) -> Result<CheckResult, String> {
        let check = CheckId::InFlight;
        let key = fresh_key();
        let req = self.request(Some(&key), None, None, true);
        let before = self.read_count().await?;
        let conn = match self.client.connect(&req.url.origin).await {
            Ok(c) => c,
            Err(e) => return Ok(CheckResult::new(check, &[], Verdict::Fail, e)),
        };
        if let Err(e) = self.client.permit(1).await {
            return Ok(CheckResult::new(check, &[], Verdict::Fail, e));
        }
        let first = self.client.send_on(conn, &req, "first", None);
        tokio::pin!(first);
        if let Ok(first) = tokio::time::timeout(self.plan.overlap_after, &mut first).await {
            let reason = format!(
                "the first answered in {} ms, before the retry was due at {}: make the endpoint \
                 slower (--slow-header NAME:VALUE) or lower --overlap-after",
                first.took.as_millis(),
                humantime::format_duration(self.plan.overlap_after)
            );
            return Ok(CheckResult::new(
                check,
                &[first],
                Verdict::NotApplicable,
                reason,
            ));
        }
        let (first, second) = tokio::join!(first, self.client.send(&req, "retry while it runs"));
        let after = self.settled_count().await?;
        let exchanges = [first.clone(), second.clone()];
        let mut timing = vec![format!(
            "the retry was sent at {} ms, the first answered at {} ms",
            (second.sent_at.saturating_sub(first.sent_at)).as_millis(),
            first.took.as_millis()
        )];
        // On a loaded host the retry may reach the service first: then the
        // first is the copy that must get 409 or the replay.
        let (first, second) =
            if first.status() == Some(409) && second.answer().is_some_and(Answer::success) {
                timing.push("the retry overtook the first, which got the 409".to_owned());
                (second, first)
            } else {
                (first, second)
            };
        let a = match self.premise(check, &first, &exchanges) {
            Ok(a) => a,
            Err(r) => return Ok(*r),
        };
        let count = self.count(before, after, &[&first, &second]);
        let fail = |reason: String| {
            Ok(CheckResult::new(check, &exchanges, Verdict::Fail, reason)
                .with_details(timing.clone()))
        };
        let b = match &second.outcome {
            Outcome::Answered(b) => b,
            _ => return fail(format!("the retry got no answer: {}", failure_of(&second))),
        };
        if let Ok(k) = count.executions() {
            if k >= 2 {
                return fail(format!(
                    "the retry ran while the first was still running: {k} executions ({}; the \
                     retry got {})",
                    count.how(),
                    b.status.as_u16()
                ));
            }
        }
        if b.status == StatusCode::CONFLICT {
            return match sane_retry_after(b) {
                Ok(secs) => Ok(CheckResult::new(
                    check,
                    &exchanges,
                    Verdict::Pass,
                    format!(
                        "409 with Retry-After: {secs} while the first was running{}",
                        match count.executions() {
                            Ok(k) => format!("; {} ({})", runs(k), count.how()),
                            Err(_) => String::new(),
                        }
                    ),
                )
                .with_details(timing)),
                Err(why) => fail(format!("409 while the first was running, but {why}")),
            };
        }
        if b.success() {
            return match count.executions() {
                Ok(1) => {
                    let mut details = timing;
                    if !b.same_as(a) {
                        details.push("the retry's body differs from the first's".to_owned());
                    }
                    Ok(CheckResult::new(
                        check,
                        &exchanges,
                        Verdict::Pass,
                        format!(
                            "the retry waited and got {} (the replay); 1 execution ({})",
                            b.status.as_u16(),
                            count.how()
                        ),
                    )
                    .with_details(details))
                }
                Ok(k) => fail(format!(
                    "the retry got {}, but {k} executions were seen ({})",
                    b.status.as_u16(),
                    count.how()
                )),
                Err(why) => Ok(CheckResult::new(
                    check,
                    &exchanges,
                    Verdict::NotApplicable,
                    format!(
                        "the retry got {}, and a replay cannot be told from a second execution: {why}",
                        b.status.as_u16()
                    ),
                )
                .with_details(timing)),
            };
        }
        fail(format!(
            "the retry got {}; expected 409 with Retry-After, or the replay",
            b.status.as_u16()
        ))
    }

    /// (h) A client that hangs up before the answer, then retries with the
    /// same key → one execution, and the retry gets the answer (CASES D2).
    async fn disconnect(&self) -> Result<CheckResult, String> {
        let check = CheckId::Disconnect;
        let key = fresh_key();
        let req = self.request(Some(&key), None, None, true);
        let d = humantime::format_duration(self.plan.disconnect_after);
        let before = self.read_count().await?;
        let conn = match self.client.connect(&req.url.origin).await {
            Ok(c) => c,
            Err(e) => return Ok(CheckResult::new(check, &[], Verdict::Fail, e)),
        };
        if let Err(e) = self.client.permit(1).await {
            return Ok(CheckResult::new(check, &[], Verdict::Fail, e));
        }
        let first = self
            .client
            .send_on(
                conn,
                &req,
                "first (hung up)",
                Some(self.plan.disconnect_after),
            )
            .await;
        match &first.outcome {
            Outcome::HungUp => {}
            Outcome::Answered(a) => {
                let reason = format!(
                    "the first answered ({}) in {} ms, before the hang-up at {d}: make the \
                     endpoint slower (--slow-header NAME:VALUE) or lower --disconnect-after",
                    a.status.as_u16(),
                    first.took.as_millis()
                );
                return Ok(CheckResult::new(
                    check,
                    &[first],
                    Verdict::NotApplicable,
                    reason,
                ));
            }
            Outcome::Failed(e) => {
                let reason = format!("the first request failed before the hang-up: {e}");
                return Ok(CheckResult::new(check, &[first], Verdict::Fail, reason));
            }
        }
        let mut exchanges = vec![first];
        let deadline = Instant::now() + self.plan.timeout;
        let mut pause = Duration::from_millis(100);
        loop {
            let n = exchanges.len();
            let ex = self.client.send(&req, &format!("retry {n}")).await;
            let again = ex.status() == Some(409);
            exchanges.push(ex);
            if !again || n >= MAX_POLLS || Instant::now() + pause > deadline {
                break;
            }
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_secs(1));
        }
        let after = self.settled_count().await?;
        let all: Vec<&Exchange> = exchanges.iter().collect();
        let count = self.count(before, after, &all);
        let retries = exchanges.len() - 1;
        let conflicts = exchanges.iter().filter(|e| e.status() == Some(409)).count();
        let last = exchanges.last().expect("one retry at least").clone();
        let executions = count.executions();
        let (verdict, reason) = match (&last.outcome, executions) {
            (_, Ok(k)) if k >= 2 => (
                Verdict::Fail,
                format!(
                    "the retry ran again after a hang-up at {d}: {k} executions ({})",
                    count.how()
                ),
            ),
            (Outcome::Answered(b), _) if b.status == StatusCode::CONFLICT => (
                Verdict::Fail,
                format!(
                    "still 409 after {retries} retries within {}: the key stayed in flight",
                    humantime::format_duration(self.plan.timeout)
                ),
            ),
            (Outcome::Answered(b), Ok(1)) if b.success() => (
                Verdict::Pass,
                format!(
                    "after a hang-up at {d} the retry got {}{}; 1 execution ({})",
                    b.status.as_u16(),
                    if conflicts > 0 {
                        format!(" (after {conflicts}×409)")
                    } else {
                        String::new()
                    },
                    count.how()
                ),
            ),
            (Outcome::Answered(b), Ok(k)) if b.success() => (
                Verdict::Fail,
                format!(
                    "the retry got {} but {k} executions were counted ({}): does --count-url \
                     count this endpoint?",
                    b.status.as_u16(),
                    count.how()
                ),
            ),
            (Outcome::Answered(b), _) => (
                Verdict::Fail,
                format!(
                    "the retry got {}; expected the first's answer",
                    b.status.as_u16()
                ),
            ),
            (_, _) => (
                Verdict::Fail,
                format!("the retry got no answer: {}", failure_of(&last)),
            ),
        };
        Ok(CheckResult::new(check, &exchanges, verdict, reason))
    }

    /// (c) The same key with another body → 4xx (422 preferred), never the
    /// first answer, never a second execution.
    async fn other_body(&self) -> Result<CheckResult, String> {
        let check = CheckId::OtherBody;
        let key = fresh_key();
        let first = self
            .client
            .send(&self.request(Some(&key), None, None, false), "first")
            .await;
        let a = match self.premise(check, &first, std::slice::from_ref(&first)) {
            Ok(a) => a.clone(),
            Err(r) => return Ok(*r),
        };
        let mid = self.read_count().await?;
        let other = self.plan.other_body.clone();
        let second = self
            .client
            .send(
                &self.request(Some(&key), None, Some(&other), false),
                "same key, other body",
            )
            .await;
        let after = self.settled_count().await?;
        let control = self
            .client
            .send(
                &self.request(Some(&fresh_key()), None, Some(&other), false),
                "other body, fresh key",
            )
            .await;
        let exchanges = [first.clone(), second.clone(), control.clone()];
        let ran = match (mid, after) {
            (Some(m), Some(x)) => Some(x.saturating_sub(m)),
            _ => None,
        };
        let ids_equal = |b: &Answer| {
            let ia = self.plan.witness.id_of(&a);
            ia.is_some() && ia == self.plan.witness.id_of(b)
        };
        let result =
            |v: Verdict, reason: String| Ok(CheckResult::new(check, &exchanges, v, reason));
        let b = match &second.outcome {
            Outcome::Answered(b) => b,
            _ => {
                return result(
                    Verdict::Fail,
                    format!("the other body got no answer: {}", failure_of(&second)),
                )
            }
        };
        let s = b.status.as_u16();
        if b.success() || b.status.is_redirection() {
            if b.same_as(&a) || ids_equal(b) {
                return result(
                    Verdict::Fail,
                    format!(
                        "the other body got the first request's answer ({s}): the key is not \
                         tied to the request"
                    ),
                );
            }
            let ran = ran.map_or(String::new(), |k| format!("; {} more", runs(k)));
            return result(
                Verdict::Fail,
                format!("the other body ran under the same key ({s}{ran})"),
            );
        }
        if b.status.is_client_error() {
            if let Some(k) = ran.filter(|k| *k > 0) {
                return result(
                    Verdict::Fail,
                    format!("the other body got {s}, but it ran: {} more", runs(k)),
                );
            }
            if !control.answer().is_some_and(Answer::success) {
                return result(
                    Verdict::NotApplicable,
                    format!(
                        "inconclusive: the other body gets {} with a fresh key too, so the {s} \
                         may not be about the key; give --other-data a body the API takes",
                        control.short()
                    ),
                );
            }
            if s == 422 {
                return result(
                    Verdict::Pass,
                    "422 for the same key with another body; the first answer was not replayed"
                        .to_owned(),
                );
            }
            return result(
                Verdict::Pass,
                format!(
                    "{s} for the same key with another body (note: 422 is the status the IETF \
                     draft names)"
                ),
            );
        }
        result(
            Verdict::Fail,
            format!("the other body got {s}: a server error, not a refusal of the reused key"),
        )
    }

    /// (d) The same key on another path: never the first path's answer
    /// (CASES E2).
    async fn other_path(&self) -> Result<CheckResult, String> {
        let check = CheckId::OtherPath;
        let key = fresh_key();
        let first = self
            .client
            .send(&self.request(Some(&key), None, None, false), "first")
            .await;
        let a = match self.premise(check, &first, std::slice::from_ref(&first)) {
            Ok(a) => a.clone(),
            Err(r) => return Ok(*r),
        };
        let mid = self.read_count().await?;
        let path = &self.plan.other_path;
        let second = self
            .client
            .send(
                &self.request(Some(&key), Some(path), None, false),
                "same key, other path",
            )
            .await;
        let after = self.settled_count().await?;
        let exchanges = [first.clone(), second.clone()];
        let t = &path.target;
        let result =
            |v: Verdict, reason: String| Ok(CheckResult::new(check, &exchanges, v, reason));
        let b = match &second.outcome {
            Outcome::Answered(b) => b,
            _ => {
                return result(
                    Verdict::Fail,
                    format!("no answer on {t}: {}", failure_of(&second)),
                )
            }
        };
        let s = b.status.as_u16();
        let ia = self.plan.witness.id_of(&a);
        let leaked = b.same_as(&a)
            || (ia.is_some() && ia == self.plan.witness.id_of(b))
            || (b.replayed() && b.success());
        if leaked {
            return result(
                Verdict::Fail,
                format!(
                    "{t} got the first path's answer ({s}{}): the key is not tied to the path",
                    if b.replayed() {
                        ", marked Idempotent-Replayed"
                    } else {
                        ""
                    }
                ),
            );
        }
        let ran = match (mid, after) {
            (Some(m), Some(x)) => format!("; {} there", runs(x.saturating_sub(m))),
            _ => String::new(),
        };
        let what = match s {
            422 => "the key was used for another request".to_owned(),
            404 | 405 => format!(
                "not the first answer (no such route: --other-path names one that exists){ran}"
            ),
            _ if b.success() => format!("not the first answer: it ran on its own{ran}"),
            _ => format!("not the first answer{ran}"),
        };
        result(Verdict::Pass, format!("{s} on {t}: {what}"))
    }

    /// (e) Key order and whitespace variants of a JSON body with the same
    /// key → the replay, not 422 and not a second execution.
    async fn json_variants(&self) -> Result<CheckResult, String> {
        let check = CheckId::JsonVariants;
        let key = fresh_key();
        let before = self.read_count().await?;
        let first = self
            .client
            .send(&self.request(Some(&key), None, None, false), "first")
            .await;
        let a = match self.premise(check, &first, std::slice::from_ref(&first)) {
            Ok(a) => a.clone(),
            Err(r) => return Ok(*r),
        };
        let mut exchanges = vec![first];
        let mut bad = Vec::new();
        for v in &self.plan.variants {
            let body = Bytes::from(v.body.clone());
            let ex = self
                .client
                .send(&self.request(Some(&key), None, Some(&body), false), v.what)
                .await;
            match &ex.outcome {
                Outcome::Answered(b) if b.same_as(&a) => {}
                Outcome::Answered(b) if b.status.is_client_error() => bad.push(format!(
                    "{}: {} (treated as another request)",
                    v.what,
                    b.status.as_u16()
                )),
                Outcome::Answered(b) => bad.push(format!(
                    "{}: {} with another body than the first answer's (not the replay)",
                    v.what,
                    b.status.as_u16()
                )),
                _ => bad.push(format!("{}: no answer: {}", v.what, failure_of(&ex))),
            }
            exchanges.push(ex);
        }
        let after = self.settled_count().await?;
        let all: Vec<&Exchange> = exchanges.iter().collect();
        let count = self.count(before, after, &all);
        if let Ok(k) = count.executions() {
            if k >= 2 {
                bad.insert(0, format!("{k} executions ({})", count.how()));
            }
        }
        let whats: Vec<&str> = self.plan.variants.iter().map(|v| v.what).collect();
        if bad.is_empty() {
            let counted = match count.executions() {
                Ok(k) => format!("; {} ({})", runs(k), count.how()),
                Err(_) => String::new(),
            };
            return Ok(CheckResult::new(
                check,
                &exchanges,
                Verdict::Pass,
                format!(
                    "the same key with {} got the first answer back{counted}",
                    whats.join(" and ")
                ),
            ));
        }
        let reason = format!(
            "a variant of the same JSON was not treated as the same request: {}",
            first_of(&bad)
        );
        let details = if bad.len() > 1 { bad } else { Vec::new() };
        Ok(CheckResult::new(check, &exchanges, Verdict::Fail, reason).with_details(details))
    }

    /// (g) Invalid keys → 4xx, and nothing runs (CASES E1).
    async fn invalid_keys(&self) -> Result<CheckResult, String> {
        let check = CheckId::InvalidKeys;
        let before = self.read_count().await?;
        let mut exchanges = Vec::new();
        let mut bad = Vec::new();
        for (what, value) in invalid_keys() {
            let ex = self
                .client
                .send(&self.request(Some(&value), None, None, false), what)
                .await;
            match &ex.outcome {
                Outcome::Answered(b) if b.status.is_client_error() => {}
                Outcome::Answered(b) if b.status.is_server_error() => bad.push(format!(
                    "{what}: {} (a server error, not a refusal)",
                    b.status.as_u16()
                )),
                Outcome::Answered(b) => {
                    bad.push(format!("{what} was accepted ({})", b.status.as_u16()))
                }
                // No answer is no refusal: a server that cannot be
                // reached, or one that drops the connection, says nothing.
                _ => bad.push(format!("{what}: no answer ({})", failure_of(&ex))),
            }
            exchanges.push(ex);
        }
        let after = self.settled_count().await?;
        if let (Some(b), Some(a)) = (before, after) {
            if a > b {
                bad.push(format!(
                    "{} for invalid keys (count {b} → {a})",
                    runs(a - b)
                ));
            }
        }
        let statuses: Vec<String> = exchanges.iter().map(Exchange::short).collect();
        if bad.is_empty() {
            return Ok(CheckResult::new(
                check,
                &exchanges,
                Verdict::Pass,
                format!("all {} refused ({})", exchanges.len(), statuses.join(", ")),
            ));
        }
        let reason = first_of(&bad);
        let details = if bad.len() > 1 { bad } else { Vec::new() };
        Ok(CheckResult::new(check, &exchanges, Verdict::Fail, reason).with_details(details))
    }

    /// (f) A request without a key: what the API does (informational;
    /// CASES E1).
    async fn no_key(&self) -> Result<CheckResult, String> {
        let check = CheckId::NoKey;
        let before = self.read_count().await?;
        let ex = self
            .client
            .send(&self.request(None, None, None, false), "no key")
            .await;
        let after = self.settled_count().await?;
        let ran = match (before, after) {
            (Some(b), Some(a)) => format!(" and ran ({})", runs(a.saturating_sub(b))),
            _ => String::new(),
        };
        let reason = match ex.answer() {
            Some(a) if a.success() => format!(
                "{}: served without a key{ran}; such a request has no protection against duplicates",
                a.status.as_u16()
            ),
            Some(a) if matches!(a.status.as_u16(), 400 | 428) => {
                format!("{}: the API requires a key", a.status.as_u16())
            }
            Some(a) => format!("{} without a key{ran}", a.status.as_u16()),
            None => format!("no answer: {}", failure_of(&ex)),
        };
        Ok(CheckResult::new(check, &[ex], Verdict::Info, reason))
    }
}

/// `1 execution`, `2 executions`.
fn runs(n: u64) -> String {
    if n == 1 {
        "1 execution".to_owned()
    } else {
        format!("{n} executions")
    }
}

/// The first of `items`, and how many more there are.
fn first_of(items: &[String]) -> String {
    match items {
        [] => String::new(),
        [one] => one.clone(),
        [first, rest @ ..] => format!("{first} (and {} more)", rest.len()),
    }
}

/// Why `ex` has no answer.
fn failure_of(ex: &Exchange) -> String {
    match &ex.outcome {
        Outcome::Failed(e) => e.clone(),
        Outcome::HungUp => "the probe hung up".to_owned(),
        Outcome::Answered(a) => format!("answered {}", a.status),
    }
}

/// One line per distinct failure among `exchanges`.
fn failures(exchanges: &[Exchange]) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    for e in exchanges {
        if let Outcome::Failed(msg) = &e.outcome {
            let line = format!("no answer: {msg}");
            if !out.contains(&line) {
                out.push(line);
            }
        }
    }
    out
}

/// The `Retry-After` value as sent, if any.
fn retry_after_of(a: &Answer) -> Option<String> {
    a.headers
        .get(http::header::RETRY_AFTER)
        .map(|v| String::from_utf8_lossy(v.as_bytes()).trim().to_owned())
}

/// `Retry-After` as whole seconds in 0..=3600, or what is wrong with it.
fn sane_retry_after(a: &Answer) -> Result<u64, String> {
    let v = retry_after_of(a).ok_or_else(|| "it carries no Retry-After".to_owned())?;
    match v.parse::<u64>() {
        Ok(n) if v.bytes().all(|b| b.is_ascii_digit()) && n <= MAX_RETRY_AFTER => Ok(n),
        _ => Err(format!(
            "its Retry-After {v:?} is not whole seconds in 0..={MAX_RETRY_AFTER}"
        )),
    }
}

/// Each way `retry` differs from `first`: status, each header that
/// matters (not [`ignored`], not named in `Connection`, not in `ignore`),
/// body bytes.
fn differences(first: &Answer, retry: &Answer, ignore: &[HeaderName]) -> Vec<String> {
    let mut out = Vec::new();
    if first.status != retry.status {
        out.push(format!(
            "status: {} → {}",
            first.status.as_u16(),
            retry.status.as_u16()
        ));
    }
    let connection_listed = |n: &HeaderName| {
        [first, retry].iter().any(|a| {
            a.headers
                .get_all(http::header::CONNECTION)
                .iter()
                .filter_map(|v| v.to_str().ok())
                .flat_map(|v| v.split(','))
                .any(|t| t.trim().eq_ignore_ascii_case(n.as_str()))
        })
    };
    let mut names: Vec<&HeaderName> = Vec::new();
    for n in first.headers.keys().chain(retry.headers.keys()) {
        if !names.contains(&n) {
            names.push(n);
        }
    }
    for name in names {
        if ignored(name.as_str()) || ignore.contains(name) || connection_listed(name) {
            continue;
        }
        let values = |a: &Answer| -> Vec<String> {
            a.headers
                .get_all(name)
                .iter()
                .map(|v| format!("{:?}", String::from_utf8_lossy(v.as_bytes())))
                .collect()
        };
        let (x, y) = (values(first), values(retry));
        if x != y {
            let show = |v: &[String]| {
                if v.is_empty() {
                    "missing".to_owned()
                } else {
                    v.join(", ")
                }
            };
            out.push(format!("header {name}: {} → {}", show(&x), show(&y)));
        }
    }
    if first.body != retry.body {
        let (x, y) = (&first.body, &retry.body);
        let at = x
            .iter()
            .zip(y.iter())
            .position(|(p, q)| p != q)
            .unwrap_or(x.len().min(y.len()));
        let window = |b: &Bytes| {
            let from = at.saturating_sub(8);
            let to = (at + 24).min(b.len());
            format!(
                "{:?}",
                String::from_utf8_lossy(b.get(from..to).unwrap_or_default())
            )
        };
        out.push(format!(
            "body: {} bytes → {} bytes, first difference at byte {at}: {} → {}",
            x.len(),
            y.len(),
            window(x),
            window(y)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, headers: &[(&str, &str)], body: &str) -> Answer {
        let mut h = http::HeaderMap::new();
        for (n, v) in headers {
            h.append(
                HeaderName::from_bytes(n.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        Answer {
            status: StatusCode::from_u16(status).unwrap(),
            headers: h,
            body: Bytes::from(body.to_owned()),
        }
    }

    #[test]
    fn counts_are_read_from_numbers_and_json() {
        assert_eq!(parse_count(b" 7\n"), Ok(7));
        assert_eq!(parse_count(br#"{"executions": 3}"#), Ok(3));
        assert_eq!(
            parse_count(br#"{"stats": {"runs": [12]}, "name": "x"}"#),
            Ok(12)
        );
        assert!(parse_count(br#"{"a": 1, "b": 2}"#)
            .unwrap_err()
            .contains("2 numbers"));
        assert!(parse_count(br#"{"a": -1}"#)
            .unwrap_err()
            .contains("whole number"));
        assert!(parse_count(b"<html>").unwrap_err().contains("not a number"));
        assert!(parse_count(br#"{"a": "1"}"#)
            .unwrap_err()
            .contains("no number"));
    }

    #[test]
    fn differences_name_each_change_and_skip_what_may_change() {
        let a = answer(
            201,
            &[
                ("date", "Mon"),
                ("location", "/o/1"),
                ("etag", "\"1\""),
                ("connection", "x-hop"),
                ("x-hop", "a"),
            ],
            r#"{"id":1,"sku":"A"}"#,
        );
        let same = answer(
            201,
            &[
                ("date", "Tue"),
                ("location", "/o/1"),
                ("etag", "\"1\""),
                ("idempotent-replayed", "true"),
                ("x-hop", "b"),
            ],
            r#"{"id":1,"sku":"A"}"#,
        );
        assert!(
            differences(&a, &same, &[]).is_empty(),
            "{:?}",
            differences(&a, &same, &[])
        );
        let lost = answer(200, &[("etag", "\"2\"")], r#"{"id":2,"sku":"A"}"#);
        let d = differences(&a, &lost, &[]);
        assert_eq!(d.len(), 4, "{d:?}");
        assert_eq!(d[0], "status: 201 → 200");
        assert!(
            d.contains(&r#"header location: "/o/1" → missing"#.to_owned()),
            "{d:?}"
        );
        assert!(
            d.contains(&r#"header etag: "\"1\"" → "\"2\"""#.to_owned()),
            "{d:?}"
        );
        assert!(
            d[3].starts_with("body: 18 bytes → 18 bytes, first difference at byte 6"),
            "{d:?}"
        );
        let ignored = differences(
            &a,
            &lost,
            &[
                HeaderName::from_static("etag"),
                HeaderName::from_static("location"),
            ],
        );
        assert_eq!(ignored.len(), 2, "{ignored:?}");
    }

    #[test]
    fn retry_after_must_be_whole_seconds_up_to_an_hour() {
        assert_eq!(
            sane_retry_after(&answer(409, &[("retry-after", "30")], "")),
            Ok(30)
        );
        assert_eq!(
            sane_retry_after(&answer(409, &[("retry-after", "0")], "")),
            Ok(0)
        );
        assert!(sane_retry_after(&answer(409, &[], ""))
            .unwrap_err()
            .contains("no Retry-After"));
        for bad in [
            "3601",
            "-1",
            "1.5",
            "soon",
            "Wed, 21 Oct 2015 07:28:00 GMT",
            "+5",
        ] {
            assert!(
                sane_retry_after(&answer(409, &[("retry-after", bad)], "")).is_err(),
                "{bad}"
            );
        }
    }
}
