//! `idem demo`: a sample payment service with an idem gateway in front of
//! it, and a showcase that fires concurrent duplicates through the gateway.

mod service;

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener as StdListener};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use clap::Parser;
use idem_gateway::{Gateway, GatewayArgs};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::service::{Payments, CHARGE_TIME};
use crate::chain;

/// Writes a line to stdout; a closed stdout (e.g. `| head`) is not a panic.
macro_rules! say {
    () => { say!("") };
    ($($arg:tt)*) => {{
        let mut out = std::io::stdout().lock();
        let _ = writeln!(out, $($arg)*);
    }};
}

/// `idem demo --help` text.
pub(crate) const LONG_ABOUT: &str = "\
Start a sample payment service and an idem gateway in front of it, both on
127.0.0.1, and show the guarantee: fire 20 concurrent copies of one payment
request (same Idempotency-Key, same body) through the gateway and count how
many charges the service ran (1), how the other copies were answered, and what
a retry after completion gets (the stored response, replayed).

Then it keeps serving until Ctrl-C and prints curl lines to try by hand. The
gateway keeps its records in ./idem-demo.db (SQLite) unless --store says
otherwise; each run uses fresh random keys. The demo's gateway also honours
the IDEM_* variables of `idem gateway` (e.g. IDEM_WAIT=5s) except the listen
address, upstream and store, which the demo sets.";

/// Default gateway address when `--listen` is not given (if it is free).
const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000);

/// The body of the showcase's payment request.
const SHOWCASE_BODY: &str = r#"{"amount_cents":1999,"currency":"EUR"}"#;
/// The same key with another body (must be refused with 422).
const OTHER_BODY: &str = r#"{"amount_cents":2999,"currency":"EUR"}"#;

/// Flags of `idem demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Address of the demo's gateway [default: 127.0.0.1:8000, or a free
    /// port when 8000 is taken]. Port 0 picks a free port.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,

    /// Address of the sample payment service (port 0: a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    service_listen: SocketAddr,

    /// Where the gateway keeps its records: any `idem gateway --store` URL.
    #[arg(long, value_name = "URL", default_value = "sqlite://idem-demo.db")]
    store: String,

    /// How many concurrent copies of the payment request the showcase sends.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 20,
        value_parser = clap::value_parser!(u32).range(2..=500)
    )]
    requests: u32,

    /// Exit after the showcase instead of serving until Ctrl-C.
    #[arg(long, conflicts_with = "no_showcase")]
    no_serve: bool,

    /// Skip the showcase: only start the service and the gateway and serve
    /// until Ctrl-C (for driving them from another program).
    #[arg(long)]
    no_showcase: bool,
}

/// Flattens the gateway's own flags, so the demo configures its gateway the
/// way `idem gateway` does.
#[derive(Debug, Parser)]
struct DemoGateway {
    #[command(flatten)]
    args: GatewayArgs,
}

/// Runs the demo. Exit code 1 when something failed to start or the
/// showcase did not see exactly one charge.
pub(crate) async fn run(args: DemoArgs) -> ExitCode {
    match run_inner(args).await {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(message) => {
            eprintln!("idem demo: {message}");
            ExitCode::FAILURE
        }
    }
}

async fn run_inner(args: DemoArgs) -> Result<bool, String> {
    let stop = CancellationToken::new();
    // Ctrl-C / SIGTERM stop everything. The handlers are installed now (by
    // polling the signal future once), so a signal that arrives at any
    // later point is seen.
    let mut signal = Box::pin(idem_gateway::shutdown_signal());
    tokio::select! {
        biased;
        () = &mut signal => stop.cancel(),
        () = std::future::ready(()) => {}
    }
    tokio::spawn({
        let stop = stop.clone();
        async move {
            signal.await;
            stop.cancel();
        }
    });

    // 1. The payment service.
    let payments = Arc::new(Payments::default());
    let service_listener = tokio::net::TcpListener::bind(args.service_listen)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {} for the payment service: {e}",
                args.service_listen
            )
        })?;
    let service_addr = service_listener
        .local_addr()
        .map_err(|e| format!("payment service address: {e}"))?;
    let service_url = format!("http://{}", reachable(service_addr));
    let service_task: JoinHandle<std::io::Result<()>> = {
        let app = service::router(payments.clone());
        let stopped = stop.clone().cancelled_owned();
        tokio::spawn(async move {
            axum::serve(service_listener, app)
                .with_graceful_shutdown(stopped)
                .await
        })
    };

    // 2. The gateway in front of it.
    let (listen, port_note) = match args.listen {
        Some(addr) => (addr, None),
        None if StdListener::bind(DEFAULT_LISTEN).is_ok() => (DEFAULT_LISTEN, None),
        None => (
            SocketAddr::new(DEFAULT_LISTEN.ip(), 0),
            Some(format!(
                "({} is taken, so the gateway uses a free port)",
                DEFAULT_LISTEN
            )),
        ),
    };
    let gateway_cli = DemoGateway::try_parse_from([
        "idem demo".to_owned(),
        "--listen".to_owned(),
        listen.to_string(),
        "--upstream".to_owned(),
        service_url.clone(),
        "--store".to_owned(),
        args.store.clone(),
    ])
    .map_err(|e| format!("gateway settings: {e}"))?;
    let config = gateway_cli
        .args
        .into_config()
        .map_err(|e| format!("gateway settings: {}", chain(&e)))?;
    let gateway = Gateway::bind(config)
        .await
        .map_err(|e| format!("cannot start the gateway: {}", chain(&e)))?;
    let gateway_url = format!("http://{}", reachable(gateway.local_addr()));
    let gateway_task = tokio::spawn(gateway.serve(stop.clone().cancelled_owned()));

    say!("idem demo: a sample payment service with an idem gateway in front of it");
    say!();
    say!("  gateway   {gateway_url}   <- send requests here (idem, in front of the service)");
    if let Some(note) = &port_note {
        say!("            {note}");
    }
    say!("  service   {service_url}   (the payment service itself, unprotected)");
    say!("  stats     {service_url}/payments/stats   (how many charges the service ran)");
    say!("  store     {}", args.store);
    say!();
    say!(
        "The payment service knows nothing about idempotency: every POST /payments it gets is a new\n\
         charge, and each takes {} ms. The gateway is what stops duplicates.",
        CHARGE_TIME.as_millis()
    );

    let mut ok = true;
    if !args.no_showcase {
        say!();
        tokio::select! {
            r = showcase(&gateway_url, &payments, args.requests) => ok = r,
            () = stop.cancelled() => say!("Interrupted."),
        }
    }

    if !args.no_serve && !stop.is_cancelled() {
        print_try_it(&gateway_url, &service_url);
        say!();
        say!("Serving. Press Ctrl-C to stop.");
        stop.cancelled().await;
        say!("Stopping...");
    }
    stop.cancel();
    join("payment service", service_task).await;
    join("gateway", gateway_task).await;
    Ok(ok)
}

/// Waits (bounded) for a server task to end after the stop signal.
async fn join<E: std::error::Error>(name: &str, task: JoinHandle<Result<(), E>>) {
    match tokio::time::timeout(Duration::from_secs(10), task).await {
        Ok(Ok(Ok(()))) => {}
        Ok(Ok(Err(e))) => eprintln!("idem demo: the {name} stopped with an error: {}", chain(&e)),
        Ok(Err(e)) => eprintln!("idem demo: the {name} task failed: {e}"),
        Err(_) => eprintln!("idem demo: the {name} did not stop within 10 s; exiting anyway"),
    }
}

/// An address a client on this machine can connect to (0.0.0.0 → 127.0.0.1).
fn reachable(addr: SocketAddr) -> SocketAddr {
    match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port())
        }
        IpAddr::V6(ip) if ip.is_unspecified() => {
            SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), addr.port())
        }
        _ => addr,
    }
}

/// One answer the gateway gave.
#[derive(Debug)]
struct Reply {
    status: reqwest::StatusCode,
    replayed: bool,
    retry_after: Option<String>,
    problem_type: Option<String>,
    body: Bytes,
}

impl Reply {
    fn payment_id(&self) -> Option<String> {
        let v: serde_json::Value = serde_json::from_slice(&self.body).ok()?;
        v.get("payment_id")?.as_str().map(str::to_owned)
    }

    /// What this answer was and what it means, for the tally.
    fn meaning(&self) -> (String, String) {
        let status = status_text(self.status);
        if self.status.is_success() || self.status.is_redirection() {
            return if self.replayed {
                (
                    format!("{status}, Idempotent-Replayed: true"),
                    "a replay: the original's stored response".to_owned(),
                )
            } else {
                (status, "the original: this copy ran the charge".to_owned())
            };
        }
        if self.status == reqwest::StatusCode::CONFLICT {
            let retry = self.retry_after.as_deref().unwrap_or("(none)");
            return (
                format!("{status}, Retry-After: {retry}"),
                "in flight: the original was still running; retry later".to_owned(),
            );
        }
        (status, self.problem_type.clone().unwrap_or_default())
    }
}

fn status_text(s: reqwest::StatusCode) -> String {
    format!("{} {}", s.as_u16(), s.canonical_reason().unwrap_or(""))
        .trim_end()
        .to_owned()
}

async fn send(
    client: &reqwest::Client,
    url: &str,
    key: &str,
    body: &'static str,
) -> Result<Reply, reqwest::Error> {
    let resp = client
        .post(url)
        .header("Idempotency-Key", key)
        .header("Content-Type", "application/json")
        .body(body)
        .send()
        .await?;
    let header = |name: &str| {
        resp.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let replayed = header("idempotent-replayed").is_some_and(|v| v.eq_ignore_ascii_case("true"));
    let retry_after = header("retry-after");
    let is_problem =
        header("content-type").is_some_and(|v| v.starts_with("application/problem+json"));
    let status = resp.status();
    let body = resp.bytes().await?;
    let problem_type = if is_problem {
        serde_json::from_slice::<serde_json::Value>(&body)
            .ok()
            .and_then(|v| v.get("type")?.as_str().map(str::to_owned))
    } else {
        None
    };
    Ok(Reply {
        status,
        replayed,
        retry_after,
        problem_type,
        body,
    })
}

/// Fires `n` concurrent duplicates, a retry after completion and a
/// mismatching request, and tells what happened. Returns whether the
/// guarantee held.
async fn showcase(gateway_url: &str, payments: &Payments, n: u32) -> bool {
    let client = match reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            say!("Cannot build an HTTP client for the showcase: {e}");
            return false;
        }
    };
    let url = format!("{gateway_url}/payments");
    let key = format!("demo-{:016x}", rand::random::<u64>());
    let n_usize = n as usize;

    say!(
        "Showcase: {n} concurrent copies of one payment request, sent at once through the gateway"
    );
    say!("  POST {url}");
    say!("  Idempotency-Key: {key}");
    say!("  body: {SHOWCASE_BODY}");

    let before = payments.charges();
    let barrier = Arc::new(tokio::sync::Barrier::new(n_usize));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (client, url, key, barrier) =
            (client.clone(), url.clone(), key.clone(), barrier.clone());
        tasks.spawn(async move {
            barrier.wait().await;
            send(&client, &url, &key, SHOWCASE_BODY).await
        });
    }
    let mut replies = Vec::with_capacity(n_usize);
    let mut failures: BTreeMap<String, usize> = BTreeMap::new();
    while let Some(joined) = tasks.join_next().await {
        match joined {
            Ok(Ok(reply)) => replies.push(reply),
            Ok(Err(e)) => {
                *failures
                    .entry(format!("no answer: {}", chain(&e)))
                    .or_default() += 1
            }
            Err(e) => {
                *failures
                    .entry(format!("request task failed: {e}"))
                    .or_default() += 1
            }
        }
    }
    let charged = payments.charges() - before;

    let mut tally: BTreeMap<(String, String), usize> = BTreeMap::new();
    for r in &replies {
        *tally.entry(r.meaning()).or_default() += 1;
    }
    for (failure, count) in failures {
        tally.insert((failure, String::new()), count);
    }
    let width = tally.keys().map(|(s, _)| s.len()).max().unwrap_or(0);
    say!();
    say!("  How the gateway answered the {n} copies:");
    for ((answer, meaning), count) in &tally {
        say!("    {count:>3} x  {answer:<width$}  {meaning}");
    }
    let times = if charged == 1 { "time" } else { "times" };
    say!();
    say!("  The payment service ran the charge {charged} {times} for {n} concurrent requests.");

    let originals: Vec<&Reply> = replies
        .iter()
        .filter(|r| r.status.is_success() && !r.replayed)
        .collect();
    let mut ok = charged == 1 && originals.len() == 1;
    // Every answer must be the original, a replay of it, or "in flight".
    ok &= replies.len() == n_usize
        && replies.iter().all(|r| {
            (r.status.is_success()
                && (!r.replayed || Some(&r.body) == originals.first().map(|o| &o.body)))
                || r.status == reqwest::StatusCode::CONFLICT
        });

    // A retry after the original finished.
    say!();
    say!("  A retry with the same key and body, after the original finished:");
    let before_retry = payments.charges();
    match send(&client, &url, &key, SHOWCASE_BODY).await {
        Ok(r) => {
            let same = originals.first().is_some_and(|o| o.body == r.body);
            let replayed = if r.replayed {
                "Idempotent-Replayed: true"
            } else {
                "no Idempotent-Replayed header"
            };
            say!("    {}, {replayed}", status_text(r.status));
            match (r.payment_id(), same) {
                (Some(id), true) => {
                    say!("    body: byte for byte the original's (payment {id}); no new charge")
                }
                (Some(id), false) => say!("    body: payment {id}, NOT the original's body"),
                (None, _) => say!("    body: {}", String::from_utf8_lossy(&r.body)),
            }
            ok &= r.status.is_success() && r.replayed && same;
        }
        Err(e) => {
            say!("    no answer: {}", chain(&e));
            ok = false;
        }
    }

    // The same key with another body.
    say!();
    say!("  The same key with another amount ({OTHER_BODY}):");
    match send(&client, &url, &key, OTHER_BODY).await {
        Ok(r) => {
            say!(
                "    {}{}",
                status_text(r.status),
                r.problem_type
                    .as_deref()
                    .map(|t| format!(", {t}"))
                    .unwrap_or_default()
            );
            say!("    (a key belongs to one request; reusing it for another is refused, not run)");
            ok &= r.status == reqwest::StatusCode::UNPROCESSABLE_ENTITY;
        }
        Err(e) => {
            say!("    no answer: {}", chain(&e));
            ok = false;
        }
    }
    let extra = payments.charges() - before_retry;
    let total = charged + extra;
    say!();
    if ok && total == 1 {
        say!(
            "Result: {} requests with one Idempotency-Key, 1 charge. Every duplicate got the stored\n\
             answer, a 409 to retry later, or a 422; none ran the charge again.",
            n + 2
        );
        if replies
            .iter()
            .any(|r| r.status == reqwest::StatusCode::CONFLICT)
        {
            say!(
                "(A copy that arrives while the original runs gets 409 by default. With a wait time,\n\
                 e.g. `IDEM_WAIT=5s idem demo`, it waits for the original and gets the replay instead.)"
            );
        }
        true
    } else {
        say!(
            "Result: NOT as expected: {total} charge(s) for {} requests with one key; see the answers above.",
            n + 2
        );
        false
    }
}

/// Prints ready-to-paste curl lines.
fn print_try_it(gateway_url: &str, service_url: &str) {
    let key = format!("try-{:08x}", rand::random::<u32>());
    let post = |body: &str| {
        format!(
            "curl -i {gateway_url}/payments -H 'Idempotency-Key: {key}' \
             -H 'Content-Type: application/json' -d '{body}'"
        )
    };
    say!();
    say!("Try it yourself in another terminal while this runs:");
    say!();
    say!("  # 1. A payment through the gateway: the service runs the charge (201 Created)");
    say!("  {}", post(r#"{"amount_cents":2500,"currency":"EUR"}"#));
    say!();
    say!(
        "  # 2. The same again: the stored response, with Idempotent-Replayed: true; no new charge"
    );
    say!("  {}", post(r#"{"amount_cents":2500,"currency":"EUR"}"#));
    say!();
    say!("  # 3. The same key with another body: 422, urn:idem:problem:key-mismatch");
    say!("  {}", post(r#"{"amount_cents":9900,"currency":"EUR"}"#));
    say!();
    say!("  # 4. How many charges the service has run so far");
    say!("  curl {service_url}/payments/stats");
    say!();
    say!("  # 5. Without an Idempotency-Key the gateway passes requests through: each one charges again");
    say!(
        "  curl -i {gateway_url}/payments -H 'Content-Type: application/json' \
         -d '{{\"amount_cents\":2500,\"currency\":\"EUR\"}}'"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unspecified_addresses_become_loopback() {
        let a: SocketAddr = "0.0.0.0:8000".parse().unwrap();
        assert_eq!(reachable(a), "127.0.0.1:8000".parse().unwrap());
        let b: SocketAddr = "[::]:9".parse().unwrap();
        assert_eq!(reachable(b), "[::1]:9".parse().unwrap());
        let c: SocketAddr = "127.0.0.2:1".parse().unwrap();
        assert_eq!(reachable(c), c);
    }
}
