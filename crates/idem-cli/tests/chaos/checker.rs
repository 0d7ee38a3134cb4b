//! The checker: reads the upstream's log of executions, every client
//! answer and the fault log of one store's run, and reports the figures
//! and every violation.
//!
//! Rules (docs/RELIABILITY.md):
//! - every execution of a key after its first is *explained* when its
//!   fence is higher than every earlier execution's of the key AND either
//!   the previous execution's answer reached no client as a 2xx, or a
//!   fault touched the previous execution's gateway or its links between
//!   the start of the previous execution and the start of this one;
//!   otherwise it is an unexplained double execution;
//! - every 2xx a client got carries the answer of an execution of the
//!   same scope, key and body; all 2xx answers of a key carry the same
//!   execution and every replay the key's last one — except when an
//!   acknowledged execution's result was never stored because a store or
//!   gateway fault hit its gateway before the next run, which then has a
//!   higher fence (counted as *superseded*, reported, not a violation);
//!   a key acknowledged in the run still answers 2xx in the final pass;
//! - no final-pass answer is a 409 (in flight) — the final pass starts
//!   after a quiet period longer than the lease plus the bounds;
//! - every key ends with a 2xx in the final pass, and a reused key's other
//!   body gets 422 there;
//! - no guarded request reaches the upstream without a fence.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fmt::Write as _;

use sha2::{Digest, Sha256};

use super::clients::{Outcome, Phase, ScopedKey, Sent};
use super::faults::{Fault, FaultKind};
use super::upstream::{Exec, Kind};

/// The figures of one store's run.
#[derive(Debug, Default, Clone)]
pub struct Report {
    pub store: String,
    pub keys: usize,
    pub requests: usize,
    pub faults: BTreeMap<FaultKind, usize>,
    /// Requests the upstream received, by kind.
    pub upstream_calls: usize,
    /// Executions with an effect.
    pub executions: usize,
    pub upstream_500: usize,
    pub upstream_dropped: usize,
    pub upstream_slow: usize,
    pub stale_fence_refused: usize,
    pub keys_multi: usize,
    pub extra: usize,
    pub extra_unacked: usize,
    pub extra_fault: usize,
    pub unexplained: usize,
    pub acked_changed: usize,
    /// Acknowledged answers superseded by a later execution after a fault
    /// that kept the result from being stored (explained, not violations).
    pub acked_superseded: usize,
    /// One line per superseded answer (printed, not failing).
    pub superseded: Vec<String>,
    pub acked_lost: usize,
    pub stuck: usize,
    pub unsettled: usize,
    pub wrong_scope: usize,
    pub wrong_fingerprint: usize,
    pub reuse_violations: usize,
    pub no_fence: usize,
    pub client_2xx: usize,
    pub client_409: usize,
    pub client_422: usize,
    pub client_5xx: usize,
    pub client_timeouts: usize,
    pub client_errors: usize,
    pub seconds: f64,
    /// One line per violation, with what is needed to look into it.
    pub violations: Vec<String>,
}

impl Report {
    /// All violations counted (must be 0).
    pub fn violation_count(&self) -> usize {
        self.unexplained
            + self.acked_changed
            + self.acked_lost
            + self.stuck
            + self.unsettled
            + self.wrong_scope
            + self.wrong_fingerprint
            + self.reuse_violations
            + self.no_fence
    }

    fn faults_total(&self) -> usize {
        self.faults.values().sum()
    }
}

/// Faults that can keep a finished execution's result from being stored
/// by its gateway: the store gone or slow, or the gateway itself gone.
const SAVE_FAULTS: [FaultKind; 6] = [
    FaultKind::StoreRestart,
    FaultKind::StoreDelay,
    FaultKind::StoreBlackhole,
    FaultKind::StoreReset,
    FaultKind::GatewayKill,
    FaultKind::GatewayPause,
];

/// The first 16 hex digits of the SHA-256 of `body` (as the upstream).
pub fn body_hash(body: &str) -> String {
    Sha256::digest(body.as_bytes())
        .iter()
        .take(8)
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// A 2xx body as the upstream writes it.
struct Answer {
    exec: u64,
    scope: String,
    key: String,
    body: String,
}

/// Reads a 2xx body of the upstream.
fn parse(body: &str) -> Option<Answer> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    Some(Answer {
        exec: v["exec"].as_u64()?,
        scope: v["scope"].as_str()?.to_owned(),
        key: v["key"].as_str()?.to_owned(),
        body: v["body"].as_str()?.to_owned(),
    })
}

/// One execution, for a violation's context.
fn describe_exec(e: &Exec) -> String {
    format!(
        "exec {} gw{} fence {:?} {:?} {}..{}ms",
        e.id,
        e.gw,
        e.fence,
        e.kind,
        e.start_ms,
        e.end_ms.map_or("?".to_owned(), |t| t.to_string())
    )
}

/// One request and its outcome, for a violation's context.
fn describe_sent(s: &Sent) -> String {
    let o = match &s.outcome {
        Outcome::Answer {
            status,
            replayed,
            problem,
            body,
        } => {
            let exec = parse(body).map_or(String::new(), |a| format!(" exec {}", a.exec));
            format!(
                "{status}{}{}{exec}",
                if *replayed { " replayed" } else { "" },
                if problem.is_empty() {
                    String::new()
                } else {
                    format!(" {problem}")
                }
            )
        }
        Outcome::Timeout => format!("timeout ({:?})", s.timeout),
        Outcome::Error(e) => format!("error {e}"),
    };
    format!(
        "{:?} gw{}{} {}..{}ms → {o}",
        s.phase,
        s.gw,
        if s.other { " other-body" } else { "" },
        s.sent_ms,
        s.done_ms
    )
}

/// Checks one store's run.
pub fn check(
    store: &str,
    keys: &[ScopedKey],
    sent: &[Sent],
    execs: &[Exec],
    faults: &[Fault],
) -> Report {
    let mut r = Report {
        store: store.to_owned(),
        keys: keys.len(),
        requests: sent.len(),
        upstream_calls: execs.len(),
        ..Report::default()
    };
    for f in faults {
        *r.faults.entry(f.kind).or_default() += 1;
    }
    let mut by_scoped: HashMap<(&str, &str), Vec<&Exec>> = HashMap::new();
    for e in execs {
        match e.kind {
            Kind::Fail => r.upstream_500 += 1,
            Kind::Dropped => r.upstream_dropped += 1,
            Kind::Slow => r.upstream_slow += 1,
            Kind::StaleFence => r.stale_fence_refused += 1,
            Kind::NoFence => {
                r.no_fence += 1;
                r.violations
                    .push(format!("{store}: no fence: {}", describe_exec(e)));
            }
            Kind::Ok => {}
        }
        if e.kind.effect() {
            r.executions += 1;
        }
        by_scoped
            .entry((e.scope.as_str(), e.key.as_str()))
            .or_default()
            .push(e);
    }
    let mut sent_by_key: HashMap<usize, Vec<&Sent>> = HashMap::new();
    for s in sent {
        sent_by_key.entry(s.key).or_default().push(s);
        match &s.outcome {
            Outcome::Answer { status, .. } => match status {
                200..=299 => r.client_2xx += 1,
                409 => r.client_409 += 1,
                422 => r.client_422 += 1,
                500..=599 => r.client_5xx += 1,
                _ => {}
            },
            Outcome::Timeout => r.client_timeouts += 1,
            Outcome::Error(_) => r.client_errors += 1,
        }
    }
    let empty = Vec::new();
    for (k, sk) in keys.iter().enumerate() {
        let mut ex: Vec<&Exec> = by_scoped
            .get(&(sk.scope.as_str(), sk.key.as_str()))
            .cloned()
            .unwrap_or_default();
        // In the order the upstream applied them: the execution id is
        // drawn at the fence check, the service's one atomic step (a
        // request's head may arrive before another's and its body after).
        ex.sort_by_key(|e| e.id);
        let mut answers: Vec<&Sent> = sent_by_key.get(&k).unwrap_or(&empty).clone();
        answers.sort_by_key(|s| (s.done_ms, s.sent_ms));
        let main_hash = body_hash(&sk.body);
        let other_hash = body_hash(&sk.other);
        let context = || {
            let mut s = String::new();
            for e in &ex {
                let _ = write!(s, "\n    upstream: {}", describe_exec(e));
            }
            for a in &answers {
                let _ = write!(s, "\n    client:   {}", describe_sent(a));
            }
            s
        };
        let effects: Vec<&Exec> = ex.iter().copied().filter(|e| e.kind.effect()).collect();
        // Which executions some client got as a 2xx.
        let mut acked: HashSet<u64> = HashSet::new();
        for a in &answers {
            let Some(body) = a.ok_body() else { continue };
            let Some(p) = parse(body) else {
                r.wrong_fingerprint += 1;
                r.violations.push(format!(
                    "{store}: {} {}: a 2xx that is no upstream answer: {body:?}{}",
                    sk.scope,
                    sk.key,
                    context()
                ));
                continue;
            };
            if p.scope != sk.scope || p.key != sk.key {
                r.wrong_scope += 1;
                r.violations.push(format!(
                    "{store}: {} {}: got the answer of {} {} (exec {}){}",
                    sk.scope,
                    sk.key,
                    p.scope,
                    p.key,
                    p.exec,
                    context()
                ));
                continue;
            }
            let want = if a.other { &other_hash } else { &main_hash };
            if &p.body != want || a.other {
                r.wrong_fingerprint += 1;
                r.violations.push(format!(
                    "{store}: {} {}: a request with body {want} got the answer of body {} (exec {}){}",
                    sk.scope,
                    sk.key,
                    p.body,
                    p.exec,
                    context()
                ));
                continue;
            }
            if !effects.iter().any(|e| e.id == p.exec) {
                r.wrong_fingerprint += 1;
                r.violations.push(format!(
                    "{store}: {} {}: a 2xx of exec {}, not an execution of this key{}",
                    sk.scope,
                    sk.key,
                    p.exec,
                    context()
                ));
                continue;
            }
            acked.insert(p.exec);
        }
        // The other body never runs.
        if ex
            .iter()
            .any(|e| e.kind.effect() && e.body_hash == other_hash)
        {
            r.reuse_violations += 1;
            r.violations.push(format!(
                "{store}: {} {}: the other body ran on a used key{}",
                sk.scope,
                sk.key,
                context()
            ));
        }
        // Executions after the first.
        if effects.len() > 1 {
            r.keys_multi += 1;
        }
        for j in 1..effects.len() {
            r.extra += 1;
            let (prev, cur) = (effects[j - 1], effects[j]);
            let max_before = effects[..j].iter().filter_map(|e| e.fence).max();
            let higher = match (cur.fence, max_before) {
                (Some(c), Some(m)) => c > m,
                (Some(_), None) => true,
                _ => false,
            };
            let unacked = !acked.contains(&prev.id);
            let touched: Vec<&Fault> = faults
                .iter()
                .filter(|f| f.touches(prev.gw, prev.start_ms, cur.start_ms))
                .collect();
            if higher && unacked {
                r.extra_unacked += 1;
            } else if higher && !touched.is_empty() {
                r.extra_fault += 1;
            } else {
                r.unexplained += 1;
                r.violations.push(format!(
                    "{store}: {} {}: unexplained execution {} (fence {:?}) after {} (fence {:?}, {}; faults touching it: {}){}",
                    sk.scope,
                    sk.key,
                    cur.id,
                    cur.fence,
                    prev.id,
                    prev.fence,
                    if unacked { "not acknowledged" } else { "acknowledged" },
                    touched.len(),
                    context()
                ));
            }
        }
        // One acknowledged answer per key, kept to the end.
        let main_ok: Vec<(&Sent, u64)> = answers
            .iter()
            .filter(|a| !a.other)
            .filter_map(|a| Some((*a, parse(a.ok_body()?)?.exec)))
            .collect();
        let distinct: HashSet<u64> = main_ok.iter().map(|(_, e)| *e).collect();
        // A replay comes from the stored record, and a stored record is
        // never taken over: it carries the key's last execution.
        let last = effects.last().map(|e| e.id);
        let stale_replays: Vec<u64> = answers
            .iter()
            .filter(|a| !a.other && matches!(a.outcome, Outcome::Answer { replayed: true, .. }))
            .filter_map(|a| parse(a.ok_body()?).map(|p| p.exec))
            .filter(|e| Some(*e) != last)
            .collect();
        if distinct.len() > 1 || !stale_replays.is_empty() {
            // The documented class: an acknowledged execution's result was
            // not stored (its gateway lost the store, or died, before the
            // save landed), the key was taken over after the lease and run
            // again with a higher fence. Each acknowledged execution but
            // the last must be explained so.
            let mut acked_execs: Vec<u64> = distinct.iter().copied().collect();
            acked_execs.sort_unstable();
            acked_execs.pop();
            let mut why = Vec::new();
            let mut all_explained = stale_replays.is_empty();
            for first in acked_execs {
                let pos = effects.iter().position(|e| e.id == first);
                let save_fault = pos.and_then(|p| {
                    let (e, next) = (effects[p], effects.get(p + 1)?);
                    let higher = matches!((e.fence, next.fence), (Some(a), Some(b)) if b > a);
                    let touching: Vec<String> = faults
                        .iter()
                        .filter(|f| {
                            SAVE_FAULTS.contains(&f.kind)
                                && f.touches(e.gw, e.start_ms, next.start_ms)
                        })
                        .map(|f| {
                            format!(
                                "{} gw{:?} {}..{}ms {}",
                                f.kind.name(),
                                f.gw,
                                f.start_ms,
                                f.end_ms,
                                f.detail
                            )
                        })
                        .collect();
                    (higher && !touching.is_empty()).then(|| touching.join("; "))
                });
                match save_fault {
                    Some(f) => why.push(format!("exec {first} superseded after {f}")),
                    None => {
                        all_explained = false;
                        why.push(format!(
                            "exec {first} superseded with no store or gateway fault on its gateway \
                             before the next run"
                        ));
                    }
                }
            }
            if !stale_replays.is_empty() {
                why.push(format!(
                    "replays of superseded executions {stale_replays:?}"
                ));
            }
            let line = format!(
                "{store}: {} {}: 2xx answers of executions {distinct:?}: {}{}",
                sk.scope,
                sk.key,
                why.join("; "),
                context()
            );
            if all_explained {
                r.acked_superseded += 1;
                r.superseded.push(line);
            } else {
                r.acked_changed += 1;
                r.violations.push(line);
            }
        }
        let run_acked = main_ok.iter().any(|(a, _)| a.phase == Phase::Run);
        let finals: Vec<&Sent> = answers
            .iter()
            .copied()
            .filter(|a| a.phase == Phase::Final && !a.other)
            .collect();
        let final_ok = finals.iter().any(|a| a.ok_body().is_some());
        // A 409 is a stuck key unless an earlier final-pass attempt of the
        // key failed without an answer from the upstream (a 5xx, a timeout,
        // an error): a begin cut off by the store timeout may land late and
        // hold the key until the gateway releases it — that claim is the
        // final pass's own, not one left from the run.
        let stuck = finals.iter().enumerate().any(|(i, a)| {
            let in_flight = matches!(&a.outcome, Outcome::Answer { status: 409, problem, .. }
                if problem == "urn:idem:problem:in-flight");
            let own_claim_possible = finals[..i]
                .iter()
                .any(|b| !matches!(&b.outcome, Outcome::Answer { status, .. } if *status < 500));
            in_flight && !own_claim_possible
        });
        if stuck {
            r.stuck += 1;
            r.violations.push(format!(
                "{store}: {} {}: in flight after the quiet period{}",
                sk.scope,
                sk.key,
                context()
            ));
        } else if run_acked && !final_ok {
            r.acked_lost += 1;
            r.violations.push(format!(
                "{store}: {} {}: acknowledged in the run, no 2xx in the final pass{}",
                sk.scope,
                sk.key,
                context()
            ));
        } else if !final_ok {
            r.unsettled += 1;
            r.violations.push(format!(
                "{store}: {} {}: no 2xx in the final pass{}",
                sk.scope,
                sk.key,
                context()
            ));
        }
        if sk.reuse {
            // The last final-pass answer to the other body (earlier ones
            // may be 5xx or timeouts, as for the key's own body).
            let last = answers
                .iter()
                .filter(|a| a.other && a.phase == Phase::Final)
                .max_by_key(|a| a.sent_ms);
            let bad =
                !last.is_some_and(|a| matches!(&a.outcome, Outcome::Answer { status: 422, .. }));
            if bad {
                r.reuse_violations += 1;
                r.violations.push(format!(
                    "{store}: {} {}: the other body did not get 422 in the final pass{}",
                    sk.scope,
                    sk.key,
                    context()
                ));
            }
        }
    }
    r
}

/// One row of the figures table: its label and how to read it.
type Row = (&'static str, fn(&Report) -> String);

/// The figures of every store as markdown tables (figures, then faults by
/// kind).
pub fn table(reports: &[Report]) -> String {
    let mut s = String::new();
    let rows: [Row; 23] = [
        ("keys (scoped)", |r| r.keys.to_string()),
        ("client requests", |r| r.requests.to_string()),
        ("client answers 2xx / 409 / 422 / 5xx", |r| {
            format!(
                "{} / {} / {} / {}",
                r.client_2xx, r.client_409, r.client_422, r.client_5xx
            )
        }),
        ("client timeouts / errors", |r| {
            format!("{} / {}", r.client_timeouts, r.client_errors)
        }),
        ("faults injected", |r| r.faults_total().to_string()),
        ("upstream calls", |r| r.upstream_calls.to_string()),
        ("executions (with effect)", |r| r.executions.to_string()),
        ("upstream 500 (no effect) / dropped / slow", |r| {
            format!(
                "{} / {} / {}",
                r.upstream_500, r.upstream_dropped, r.upstream_slow
            )
        }),
        ("stale-fence writes refused by the upstream", |r| {
            r.stale_fence_refused.to_string()
        }),
        ("keys executed more than once", |r| r.keys_multi.to_string()),
        ("extra executions", |r| r.extra.to_string()),
        ("  explained: earlier answer not acknowledged", |r| {
            r.extra_unacked.to_string()
        }),
        ("  explained: fault on the earlier execution", |r| {
            r.extra_fault.to_string()
        }),
        ("**unexplained double executions**", |r| {
            r.unexplained.to_string()
        }),
        (
            "acknowledged 2xx superseded after a store or gateway fault (explained)",
            |r| r.acked_superseded.to_string(),
        ),
        (
            "**acknowledged 2xx replayed differently, unexplained**",
            |r| r.acked_changed.to_string(),
        ),
        ("**acknowledged 2xx lost**", |r| r.acked_lost.to_string()),
        ("**keys in flight after lease + bound**", |r| {
            r.stuck.to_string()
        }),
        ("**keys without a 2xx in the final pass**", |r| {
            r.unsettled.to_string()
        }),
        ("**wrong-scope replays**", |r| r.wrong_scope.to_string()),
        ("**wrong-fingerprint replays**", |r| {
            r.wrong_fingerprint.to_string()
        }),
        ("**key reuse not refused (422)**", |r| {
            r.reuse_violations.to_string()
        }),
        ("**requests without a fence**", |r| r.no_fence.to_string()),
    ];
    let _ = write!(s, "| |");
    for r in reports {
        let _ = write!(s, " {} |", r.store);
    }
    let _ = write!(s, " all |\n|---|");
    for _ in 0..=reports.len() {
        s.push_str("---:|");
    }
    s.push('\n');
    let all = sum(reports);
    for (name, f) in rows {
        let _ = write!(s, "| {name} |");
        for r in reports.iter().chain(std::iter::once(&all)) {
            let _ = write!(s, " {} |", f(r));
        }
        s.push('\n');
    }
    let _ = write!(s, "| run time (s) |");
    for r in reports {
        let _ = write!(s, " {:.0} |", r.seconds);
    }
    s.push_str(" |\n\n| fault | ");
    for r in reports {
        let _ = write!(s, " {} |", r.store);
    }
    s.push_str(" all |\n|---|");
    for _ in 0..=reports.len() {
        s.push_str("---:|");
    }
    s.push('\n');
    for k in FaultKind::ALL {
        let _ = write!(s, "| {} |", k.name());
        for r in reports.iter().chain(std::iter::once(&all)) {
            let _ = write!(s, " {} |", r.faults.get(&k).copied().unwrap_or(0));
        }
        s.push('\n');
    }
    s
}

/// The figures of all stores added up.
fn sum(reports: &[Report]) -> Report {
    let mut a = Report {
        store: "all".into(),
        ..Report::default()
    };
    for r in reports {
        a.keys += r.keys;
        a.requests += r.requests;
        for (k, v) in &r.faults {
            *a.faults.entry(*k).or_default() += v;
        }
        a.upstream_calls += r.upstream_calls;
        a.executions += r.executions;
        a.upstream_500 += r.upstream_500;
        a.upstream_dropped += r.upstream_dropped;
        a.upstream_slow += r.upstream_slow;
        a.stale_fence_refused += r.stale_fence_refused;
        a.keys_multi += r.keys_multi;
        a.extra += r.extra;
        a.extra_unacked += r.extra_unacked;
        a.extra_fault += r.extra_fault;
        a.unexplained += r.unexplained;
        a.acked_changed += r.acked_changed;
        a.acked_superseded += r.acked_superseded;
        a.acked_lost += r.acked_lost;
        a.stuck += r.stuck;
        a.unsettled += r.unsettled;
        a.wrong_scope += r.wrong_scope;
        a.wrong_fingerprint += r.wrong_fingerprint;
        a.reuse_violations += r.reuse_violations;
        a.no_fence += r.no_fence;
        a.client_2xx += r.client_2xx;
        a.client_409 += r.client_409;
        a.client_422 += r.client_422;
        a.client_5xx += r.client_5xx;
        a.client_timeouts += r.client_timeouts;
        a.client_errors += r.client_errors;
    }
    a
}
