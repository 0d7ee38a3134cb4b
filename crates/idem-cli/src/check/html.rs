//! `--html FILE`: the report as one self-contained HTML page, with a
//! timeline of the requests of the concurrency checks (`concurrent`,
//! `in-flight`, `disconnect`): when each was sent and answered, and how —
//! ran, replayed, waited, refused with 409, hung up.

use std::fmt::Write as _;

use super::client::RequestRecord;
use super::report::{CheckResult, Report, Verdict};

/// The checks drawn as timelines.
const TIMELINES: [&str; 3] = ["concurrent", "in-flight", "disconnect"];

/// Left column (request labels), chart width, right margin (answer
/// labels), row height, in SVG units.
const LABELS: f64 = 150.0;
const CHART: f64 = 700.0;
const MARGIN: f64 = 190.0;
const ROW: f64 = 24.0;

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}\
h1{font-size:20px}h2{font-size:16px;margin-top:2em}code{font-size:13px}\
.pass{color:#2e7d32}.fail{color:#c62828;font-weight:bold}.na{color:#a66d00}.info{color:#00838f}\
table{border-collapse:collapse}td,th{border-bottom:1px solid #ddd;padding:4px 8px;text-align:left;vertical-align:top}\
svg text{font:12px system-ui,sans-serif}\
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 14px;vertical-align:-1px}";

/// `&`, `<`, `>` and `"` escaped.
fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn verdict_class(v: Verdict) -> (&'static str, &'static str) {
    match v {
        Verdict::Pass => ("pass", "pass"),
        Verdict::Fail => ("fail", "FAIL"),
        Verdict::NotApplicable => ("na", "n/a"),
        Verdict::Info => ("info", "info"),
    }
}

/// The fill and stroke of a bar of `class` (attributes, so that the SVG
/// keeps its colours when copied out of the page).
fn paint(class: &str) -> &'static str {
    match class {
        "run" => "fill=\"#2e7d32\"",
        "replay" => "fill=\"#1565c0\"",
        "conflict" => "fill=\"#ef6c00\"",
        "refused" => "fill=\"#9e9e9e\"",
        "hungup" => "fill=\"#ffffff\" stroke=\"#c62828\" stroke-dasharray=\"4 2\"",
        _ => "fill=\"#c62828\"",
    }
}

/// How a request ended, as a CSS class and a label.
fn kind(r: &RequestRecord) -> (&'static str, String) {
    match (r.outcome, r.status) {
        ("hung-up", _) => ("hungup", "hung up".to_owned()),
        (_, Some(s)) if (200..300).contains(&s) && r.replayed => {
            ("replay", format!("{s} replayed"))
        }
        (_, Some(s)) if (200..300).contains(&s) => ("run", s.to_string()),
        (_, Some(409)) => (
            "conflict",
            match &r.retry_after {
                Some(ra) => format!("409 · Retry-After {ra}"),
                None => "409 · no Retry-After".to_owned(),
            },
        ),
        (_, Some(s)) if (400..500).contains(&s) => ("refused", s.to_string()),
        (_, Some(s)) => ("error", s.to_string()),
        (_, None) => ("error", "no answer".to_owned()),
    }
}

/// One check's requests as an SVG timeline.
fn timeline(c: &CheckResult) -> String {
    let reqs = &c.requests;
    let t0 = reqs.iter().map(|r| r.sent_ms).fold(f64::INFINITY, f64::min);
    let t1 = reqs
        .iter()
        .map(|r| r.sent_ms + r.took_ms)
        .fold(f64::NEG_INFINITY, f64::max);
    let span = (t1 - t0).max(1.0);
    let x = |t: f64| LABELS + (t - t0) / span * CHART;
    let height = 20.0 + ROW * reqs.len() as f64 + 30.0;
    let width = LABELS + CHART + MARGIN;
    let mut svg = String::new();
    let _ = write!(
        svg,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{width}\" height=\"{height}\" \
         viewBox=\"0 0 {width} {height}\" role=\"img\" aria-label=\"timeline of {}\">",
        esc(c.check)
    );
    for (i, r) in reqs.iter().enumerate() {
        let y = 10.0 + ROW * i as f64;
        let (class, label) = kind(r);
        let (from, to) = (x(r.sent_ms), x(r.sent_ms + r.took_ms));
        let w = (to - from).max(2.0);
        let tip = format!(
            "{}: sent at {:.1} ms, {} after {:.1} ms{}",
            r.label,
            r.sent_ms - t0,
            label,
            r.took_ms,
            r.error
                .as_ref()
                .map_or(String::new(), |e| format!(" ({e})"))
        );
        let _ = write!(
            svg,
            "<text x=\"4\" y=\"{}\">{}</text>\
             <rect class=\"{class}\" {} x=\"{from:.1}\" y=\"{y}\" width=\"{w:.1}\" height=\"16\" rx=\"2\">\
             <title>{}</title></rect>\
             <text x=\"{:.1}\" y=\"{}\">{}</text>",
            y + 12.0,
            esc(&r.label),
            paint(class),
            esc(&tip),
            from + w + 4.0,
            y + 12.0,
            esc(&label)
        );
    }
    let axis_y = 10.0 + ROW * reqs.len() as f64 + 4.0;
    let _ = write!(
        svg,
        "<line stroke=\"#999\" x1=\"{LABELS}\" y1=\"{axis_y}\" x2=\"{}\" y2=\"{axis_y}\"/>",
        LABELS + CHART
    );
    for q in 0..=4 {
        let t = span * f64::from(q) / 4.0;
        let tx = LABELS + CHART * f64::from(q) / 4.0;
        let _ = write!(
            svg,
            "<line stroke=\"#999\" x1=\"{tx:.1}\" y1=\"{axis_y}\" x2=\"{tx:.1}\" y2=\"{}\"/>\
             <text fill=\"#666\" x=\"{tx:.1}\" y=\"{}\" text-anchor=\"middle\">{t:.0} ms</text>",
            axis_y + 4.0,
            axis_y + 18.0
        );
    }
    svg.push_str("</svg>");
    svg
}

/// The whole page.
pub(crate) fn page(report: &Report) -> String {
    let mut out = String::new();
    let title = format!("idem check {} {}", report.method, report.url);
    let _ = write!(
        out,
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{}</title>\
         <style>{STYLE}</style></head><body><h1>{}</h1><p>{}. {} passed, {} failed, {} not \
         applicable, {} informational; {} requests sent.</p>",
        esc(&title),
        esc(&title),
        esc(&report.executions),
        report.summary.pass,
        report.summary.fail,
        report.summary.not_applicable,
        report.summary.info,
        report.requests_sent
    );
    out.push_str(
        "<p class=\"legend\">Each bar is one request, from sending to its answer (or the \
         hang-up), on its own connection:<span style=\"background:#2e7d32\"></span>2xx \
         (ran, or an answer not marked replayed)<span style=\"background:#1565c0\"></span>2xx \
         marked <code>Idempotent-Replayed</code> (a long bar: it waited for the first)\
         <span style=\"background:#ef6c00\"></span>409<span style=\"background:#9e9e9e\"></span>\
         other 4xx<span style=\"background:#c62828\"></span>5xx or no answer\
         <span style=\"border:1px dashed #c62828\"></span>hung up by the probe</p>",
    );
    for c in report
        .checks
        .iter()
        .filter(|c| TIMELINES.contains(&c.check) && !c.requests.is_empty())
    {
        let (class, label) = verdict_class(c.verdict);
        let _ = write!(
            out,
            "<h2>{} — <span class=\"{class}\">{label}</span></h2><p>{}: {}</p>{}",
            esc(c.check),
            esc(c.title),
            esc(&c.reason),
            timeline(c)
        );
    }
    out.push_str("<h2>All checks</h2><table><tr><th>check</th><th>verdict</th><th>statuses</th><th>reason</th></tr>");
    for c in &report.checks {
        let (class, label) = verdict_class(c.verdict);
        let details: String = c
            .details
            .iter()
            .map(|d| format!("<br>– {}", esc(d)))
            .collect();
        let _ = write!(
            out,
            "<tr><td>{}</td><td class=\"{class}\">{label}</td><td>{}</td><td>{}{details}</td></tr>",
            esc(c.check),
            esc(&c.statuses),
            esc(&c.reason)
        );
    }
    out.push_str("</table></body></html>\n");
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_is_escaped() {
        assert_eq!(
            esc(r#"<a href="x">&</a>"#),
            "&lt;a href=&quot;x&quot;&gt;&amp;&lt;/a&gt;"
        );
    }
}
