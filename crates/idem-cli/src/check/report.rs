//! The outcome of a probe: one result per check (verdict, one-line reason,
//! details, the requests sent), printed as a table or as JSON.

use std::fmt::Write as _;

use serde::Serialize;

use super::client::{Exchange, RequestRecord};
use super::plan::CheckId;

/// A check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) enum Verdict {
    /// The API behaved as an idempotent API must.
    #[serde(rename = "pass")]
    Pass,
    /// A fault was seen (the exit status is then 1).
    #[serde(rename = "fail")]
    Fail,
    /// The check could not run with these options (the reason says why).
    #[serde(rename = "n/a")]
    NotApplicable,
    /// What the API does, with no right answer (a request without a key).
    #[serde(rename = "info")]
    Info,
}

impl Verdict {
    fn label(self) -> &'static str {
        match self {
            Verdict::Pass => "pass",
            Verdict::Fail => "FAIL",
            Verdict::NotApplicable => "n/a",
            Verdict::Info => "info",
        }
    }

    /// The ANSI colour of the label.
    fn colour(self) -> &'static str {
        match self {
            Verdict::Pass => "\x1b[32m",
            Verdict::Fail => "\x1b[1;31m",
            Verdict::NotApplicable => "\x1b[33m",
            Verdict::Info => "\x1b[36m",
        }
    }
}

/// The result of one check.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct CheckResult {
    /// The check's name (`concurrent`, `replay`, …).
    pub(crate) check: &'static str,
    /// What it expects.
    pub(crate) title: &'static str,
    pub(crate) verdict: Verdict,
    /// Why, in one line.
    pub(crate) reason: String,
    /// Evidence beyond the reason: each difference of a replay, notes.
    pub(crate) details: Vec<String>,
    /// The statuses seen, summarised (`1×201, 7×409`).
    pub(crate) statuses: String,
    /// The requests sent to the endpoint (count-URL reads not included).
    pub(crate) requests: Vec<RequestRecord>,
}

impl CheckResult {
    /// A result for `check` with these requests.
    pub(crate) fn new(
        check: CheckId,
        exchanges: &[Exchange],
        verdict: Verdict,
        reason: String,
    ) -> Self {
        CheckResult {
            check: check.name(),
            title: check.title(),
            verdict,
            reason,
            details: Vec::new(),
            statuses: statuses(exchanges),
            requests: exchanges.iter().map(Exchange::record).collect(),
        }
    }

    /// With these details.
    pub(crate) fn with_details(mut self, details: Vec<String>) -> Self {
        self.details = details;
        self
    }
}

/// `1×201, 7×409`, in order of first appearance; a lone status alone.
pub(crate) fn statuses(exchanges: &[Exchange]) -> String {
    let mut seen: Vec<(String, usize)> = Vec::new();
    for e in exchanges {
        let s = e.short();
        match seen.iter_mut().find(|(k, _)| *k == s) {
            Some((_, n)) => *n += 1,
            None => seen.push((s, 1)),
        }
    }
    seen.into_iter()
        .map(|(s, n)| if n == 1 { s } else { format!("{n}×{s}") })
        .collect::<Vec<_>>()
        .join(", ")
}

/// A whole probe.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// The method and URL probed.
    pub(crate) method: String,
    pub(crate) url: String,
    /// How executions were counted.
    pub(crate) executions: String,
    pub(crate) checks: Vec<CheckResult>,
    /// Requests sent in all, count-URL reads included.
    pub(crate) requests_sent: usize,
    /// How many checks passed, failed, …
    pub(crate) summary: Summary,
}

/// Counts of verdicts.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Summary {
    pub(crate) pass: usize,
    pub(crate) fail: usize,
    #[serde(rename = "n/a")]
    pub(crate) not_applicable: usize,
    pub(crate) info: usize,
}

impl Report {
    /// The report of these results.
    pub(crate) fn new(
        method: String,
        url: String,
        executions: String,
        checks: Vec<CheckResult>,
        requests_sent: usize,
    ) -> Self {
        let mut summary = Summary::default();
        for c in &checks {
            match c.verdict {
                Verdict::Pass => summary.pass += 1,
                Verdict::Fail => summary.fail += 1,
                Verdict::NotApplicable => summary.not_applicable += 1,
                Verdict::Info => summary.info += 1,
            }
        }
        Report {
            method,
            url,
            executions,
            checks,
            requests_sent,
            summary,
        }
    }

    /// Whether any check failed.
    pub(crate) fn failed(&self) -> bool {
        self.summary.fail > 0
    }

    /// The JSON report (`--json`).
    pub(crate) fn json(&self) -> String {
        serde_json::to_string_pretty(self).expect("the report serialises")
    }

    /// The table, with ANSI colours when `colour`.
    pub(crate) fn table(&self, colour: bool) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "idem check {} {}", self.method, self.url);
        let _ = writeln!(out, "{}\n", self.executions);
        let head = ["check", "verdict", "statuses", "reason"];
        let mut w = head.map(str::len);
        for c in &self.checks {
            w[0] = w[0].max(c.check.len());
            w[1] = w[1].max(c.verdict.label().len());
            w[2] = w[2].max(c.statuses.chars().count());
        }
        let _ = writeln!(
            out,
            "{:<w0$}  {:<w1$}  {:<w2$}  {}",
            head[0],
            head[1],
            head[2],
            head[3],
            w0 = w[0],
            w1 = w[1],
            w2 = w[2]
        );
        for c in &self.checks {
            let label = format!("{:<w1$}", c.verdict.label(), w1 = w[1]);
            let label = if colour {
                format!("{}{label}\x1b[0m", c.verdict.colour())
            } else {
                label
            };
            let pad = w[2].saturating_sub(c.statuses.chars().count());
            let _ = writeln!(
                out,
                "{:<w0$}  {label}  {}{}  {}",
                c.check,
                c.statuses,
                " ".repeat(pad),
                c.reason,
                w0 = w[0]
            );
            for d in &c.details {
                let _ = writeln!(out, "{}  - {d}", " ".repeat(w[0] + w[1] + w[2] + 6));
            }
        }
        let s = &self.summary;
        let _ = writeln!(
            out,
            "\n{} passed, {} failed, {} not applicable, {} informational; {} requests sent",
            s.pass, s.fail, s.not_applicable, s.info, self.requests_sent
        );
        out
    }
}
