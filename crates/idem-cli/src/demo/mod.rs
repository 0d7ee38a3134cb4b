//! `idem demo`: the example orders service (`examples/orders`: idempotency
//! key, fenced lock, database constraints) with an idem gateway in front of
//! it, and a showcase that walks the lost-response story and fires
//! concurrent duplicates through the gateway.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener as StdListener};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use clap::Parser;
use idem_gateway::{Gateway, GatewayArgs};
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use self::service::Payments;
use crate::chain;

mod service;

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
Start the example orders service (examples/orders) and an idem gateway in
front of it, both on 127.0.0.1, and walk the story that idem exists for:

  1. create an order;
  2. pay it while the payment provider's answer gets lost (the provider
     charged, the service times out and answers 504);
  3. retry the same request: the service resumes the attempt with the same
     provider key, finds the charge and answers PAID: one charge;
  4. fire N concurrent copies of one pay request (same Idempotency-Key) for
     another order: one charge; the copies get the stored answer or a 409;
  5. reuse the key for another request: 422.

The service guards each pay with three layers: the Idempotency-Key (its own
idem layer, behind the gateway's), a per-order lock with fencing tokens, and
database constraints with compare-and-set transitions.

The service also has a naive POST /payments endpoint that knows nothing
about idempotency (every call is a new charge; GET /payments/stats counts
them): only the gateway protects it.

Then it keeps serving until Ctrl-C and prints curl lines to try by hand. The
gateway keeps its records in ./idem-demo.db (SQLite) unless --store says
otherwise; the orders service uses a temporary SQLite file unless --database
says otherwise. Each run uses fresh order numbers and keys. The demo's
gateway also honours the IDEM_* variables of `idem gateway` (e.g.
IDEM_WAIT=5s) except the listen address, upstream and store, which the demo
sets.";

/// Default gateway address when `--listen` is not given (if it is free).
const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 8000);

/// Flags of `idem demo`.
#[derive(Debug, clap::Args)]
pub(crate) struct DemoArgs {
    /// Address of the demo's gateway [default: 127.0.0.1:8000, or a free
    /// port when 8000 is taken]. Port 0 picks a free port.
    #[arg(long, value_name = "ADDR")]
    listen: Option<SocketAddr>,

    /// Address of the orders service (port 0: a free port).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:0")]
    service_listen: SocketAddr,

    /// Where the gateway keeps its records: any `idem gateway --store` URL.
    #[arg(long, value_name = "URL", default_value = "sqlite://idem-demo.db")]
    store: String,

    /// The orders service's database: sqlite://FILE or postgres://… [default:
    /// a temporary SQLite file, removed at exit].
    #[arg(long, value_name = "URL")]
    database: Option<String>,

    /// How many concurrent copies of the pay request the showcase sends.
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

    // 1. The orders service, on its own database.
    let (database, _temp_dir) = match &args.database {
        Some(url) => (url.clone(), None),
        None => {
            let dir = tempfile::Builder::new()
                .prefix("idem-demo-orders-")
                .tempdir()
                .map_err(|e| {
                    format!("cannot create a temporary folder for the orders database: {e}")
                })?;
            let url = format!("sqlite://{}", dir.path().join("orders.db").display());
            (url, Some(dir))
        }
    };
    let app = orders::App::connect(orders::Config::new(database.clone()))
        .await
        .map_err(|e| format!("cannot start the orders service on {database}: {e}"))?;
    let service_listener = tokio::net::TcpListener::bind(args.service_listen)
        .await
        .map_err(|e| {
            format!(
                "cannot listen on {} for the orders service: {e}",
                args.service_listen
            )
        })?;
    let service_addr = service_listener
        .local_addr()
        .map_err(|e| format!("orders service address: {e}"))?;
    let service_url = format!("http://{}", reachable(service_addr));
    let service_task: JoinHandle<std::io::Result<()>> = {
        // The orders routes, plus the naive `/payments` endpoint that only
        // the gateway protects (kept for contrast and for the end-to-end
        // client in tests/e2e).
        let router = app
            .router()
            .merge(service::router(Arc::new(Payments::default())));
        let stopped = stop.clone().cancelled_owned();
        tokio::spawn(async move {
            axum::serve(service_listener, router)
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
        // The demo is for trying the key protocol; it keeps no admin port.
        "--admin-listen".to_owned(),
        "off".to_owned(),
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

    say!("idem demo: the orders example service with an idem gateway in front of it");
    say!();
    say!("  gateway   {gateway_url}   <- send requests here (idem, in front of the service)");
    if let Some(note) = &port_note {
        say!("            {note}");
    }
    say!("  service   {service_url}   (the orders service itself)");
    say!("  stats     {service_url}/payments/stats   (charges of the naive /payments endpoint, which only the gateway protects)");
    say!("  store     {}   (the gateway's records)", args.store);
    say!("  database  {database}   (orders, the provider's ledger, the service's keys and locks)");
    say!();
    say!(
        "The orders service pays an order through a simulated payment provider. It guards every pay\n\
         with an Idempotency-Key layer, a per-order lock with fencing tokens and database constraints;\n\
         the provider charges at most once per provider key (order-ID-attempt-N). The request header\n\
         X-Simulate: fail | slow | lose-response makes the provider decline, take 1.5 s, or lose its answer."
    );

    let mut ok = true;
    if !args.no_showcase {
        say!();
        tokio::select! {
            r = showcase(&gateway_url, args.requests) => ok = r,
            () = stop.cancelled() => say!("Interrupted."),
        }
    }

    if !args.no_serve && !stop.is_cancelled() {
        print_try_it(&gateway_url);
        say!();
        say!("Serving. Press Ctrl-C to stop.");
        stop.cancelled().await;
        say!("Stopping...");
    }
    stop.cancel();
    join("orders service", service_task).await;
    join("gateway", gateway_task).await;
    app.tracker().close();
    let _ = tokio::time::timeout(Duration::from_secs(10), app.tracker().wait()).await;
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
    fn json(&self) -> Value {
        serde_json::from_slice(&self.body).unwrap_or(Value::Null)
    }

    fn order_status(&self) -> String {
        self.json()
            .get("status")
            .and_then(Value::as_str)
            .unwrap_or("")
            .to_owned()
    }

    /// `504 Gateway Timeout, urn:…` / `200 OK, PAID` / `… Idempotent-Replayed: true`.
    fn summary(&self) -> String {
        let mut s = status_text(self.status);
        if let Some(t) = &self.problem_type {
            s.push_str(&format!(", {t}"));
        } else if self.status.is_success() {
            let st = self.order_status();
            if !st.is_empty() {
                s.push_str(&format!(", order {st}"));
            }
        }
        if self.replayed {
            s.push_str(", Idempotent-Replayed: true");
        }
        s
    }

    /// What this answer was and what it means, for the tally.
    fn meaning(&self) -> (String, String) {
        let status = status_text(self.status);
        if self.status.is_success() {
            let st = self.order_status();
            return if self.replayed {
                (
                    format!("{status} {st}, Idempotent-Replayed: true"),
                    "a replay: the original's stored response".to_owned(),
                )
            } else {
                (
                    format!("{status} {st}"),
                    "the original: this copy ran the payment".to_owned(),
                )
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

/// One request through the gateway.
#[derive(Debug, Clone, Default)]
struct Call {
    method: reqwest::Method,
    url: String,
    key: Option<String>,
    simulate: Option<&'static str>,
    body: Option<String>,
}

async fn send(client: &reqwest::Client, call: &Call) -> Result<Reply, reqwest::Error> {
    let mut req = client.request(call.method.clone(), &call.url);
    if let Some(key) = &call.key {
        req = req.header("Idempotency-Key", key);
    }
    if let Some(sim) = call.simulate {
        req = req.header("X-Simulate", sim);
    }
    if let Some(body) = &call.body {
        req = req
            .header("Content-Type", "application/json")
            .body(body.clone());
    }
    let resp = req.send().await?;
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
        serde_json::from_slice::<Value>(&body)
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

/// The showcase's client and the gateway's address.
struct Walk {
    client: reqwest::Client,
    base: String,
}

impl Walk {
    async fn send(&self, call: &Call) -> Result<Reply, String> {
        send(&self.client, call)
            .await
            .map_err(|e| format!("no answer: {}", chain(&e)))
    }

    async fn create(&self, amount: i64) -> Result<i64, String> {
        let no = format!("demo-{:012x}", rand::random::<u64>() >> 16);
        let body = format!(r#"{{"outer_order_no":"{no}","amount_cents":{amount}}}"#);
        say!("  POST {}/orders  {body}", self.base);
        let r = self
            .send(&Call {
                method: reqwest::Method::POST,
                url: format!("{}/orders", self.base),
                body: Some(body),
                ..Call::default()
            })
            .await?;
        let id = r.json().get("id").and_then(Value::as_i64);
        match id {
            Some(id) if r.status == reqwest::StatusCode::CREATED => {
                say!("    {}, order {id} PENDING", status_text(r.status));
                Ok(id)
            }
            _ => Err(format!(
                "creating an order answered {}: {}",
                status_text(r.status),
                String::from_utf8_lossy(&r.body)
            )),
        }
    }

    fn pay(&self, id: i64, key: &str, simulate: Option<&'static str>) -> Call {
        Call {
            method: reqwest::Method::POST,
            url: format!("{}/orders/{id}/pay", self.base),
            key: Some(key.to_owned()),
            simulate,
            body: None,
        }
    }

    /// `(status, number of charges)` of order `id`, read through the gateway
    /// (GETs pass through).
    async fn state(&self, id: i64) -> Result<(String, usize), String> {
        let get = |path: String| Call {
            method: reqwest::Method::GET,
            url: format!("{}{path}", self.base),
            ..Call::default()
        };
        let order = self.send(&get(format!("/orders/{id}"))).await?;
        let charges = self.send(&get(format!("/orders/{id}/charges"))).await?;
        let n = charges
            .json()
            .as_array()
            .map(Vec::len)
            .ok_or_else(|| format!("the charges of order {id} are not a list"))?;
        Ok((order.order_status(), n))
    }
}

fn plural(n: usize, one: &str, many: &str) -> String {
    format!("{n} {}", if n == 1 { one } else { many })
}

/// Walks the lost-response story, fires `n` concurrent duplicates, and
/// tells what happened. Returns whether the guarantee held.
async fn showcase(gateway_url: &str, n: u32) -> bool {
    match showcase_inner(gateway_url, n).await {
        Ok(ok) => ok,
        Err(e) => {
            say!("    {e}");
            say!();
            say!("Result: the showcase could not finish; see above.");
            false
        }
    }
}

async fn showcase_inner(gateway_url: &str, n: u32) -> Result<bool, String> {
    let client = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(30))
        .build()
        .map_err(|e| format!("cannot build an HTTP client for the showcase: {e}"))?;
    let walk = Walk {
        client,
        base: gateway_url.to_owned(),
    };
    let mut ok = true;

    // --- The story: a lost answer, a retry, one charge.
    say!("Showcase, part 1: the provider charges but its answer is lost; the client retries");
    say!();
    say!("  1. Create an order:");
    let a = walk.create(1999).await?;
    let key = format!("demo-{:016x}", rand::random::<u64>());
    let pay_a = walk.pay(a, &key, Some("lose-response"));
    say!();
    say!("  2. Pay it; the provider's answer gets lost on the way back:");
    say!(
        "  POST {}  Idempotency-Key: {key}  X-Simulate: lose-response",
        pay_a.url
    );
    let first = walk.send(&pay_a).await?;
    let (st, charges) = walk.state(a).await?;
    say!("    {}", first.summary());
    say!(
        "    order {a} is {st}, the provider's ledger holds {}: the service could not know",
        plural(charges, "charge", "charges")
    );
    ok &= first.status == reqwest::StatusCode::GATEWAY_TIMEOUT && charges == 1;

    say!();
    say!("  3. The client retries the same request (same key):");
    let retry = walk.send(&pay_a).await?;
    let (st, charges) = walk.state(a).await?;
    say!("    {}", retry.summary());
    say!(
        "    order {a} is {st}, {}: the service asked the provider again with the same\n    \
         provider key (order-{a}-attempt-1) and found the charge instead of making a second one",
        plural(charges, "charge", "charges")
    );
    ok &= retry.status.is_success() && retry.order_status() == "PAID" && charges == 1;

    say!();
    say!("  4. And once more, after it completed:");
    let again = walk.send(&pay_a).await?;
    let (_, charges) = walk.state(a).await?;
    say!(
        "    {}; still {}",
        again.summary(),
        plural(charges, "charge", "charges")
    );
    ok &= again.status.is_success() && again.replayed && charges == 1;

    // --- Concurrent duplicates.
    say!();
    say!("Showcase, part 2: {n} concurrent copies of one pay request, sent at once through the gateway");
    say!();
    let b = walk.create(2500).await?;
    let key_b = format!("demo-{:016x}", rand::random::<u64>());
    let pay_b = walk.pay(b, &key_b, None);
    say!("  POST {}  Idempotency-Key: {key_b}   x {n}", pay_b.url);
    let n_usize = n as usize;
    let barrier = Arc::new(tokio::sync::Barrier::new(n_usize));
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..n {
        let (client, call, barrier) = (walk.client.clone(), pay_b.clone(), barrier.clone());
        tasks.spawn(async move {
            barrier.wait().await;
            send(&client, &call).await
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
    // A late retry: every copy must end up with the paid order.
    let late = walk.send(&pay_b).await?;
    let (st, charged) = walk.state(b).await?;
    say!();
    say!(
        "  The payment provider charged order {b} {} for {n} concurrent requests (order {st}).",
        if charged == 1 {
            "1 time".to_owned()
        } else {
            format!("{charged} times")
        }
    );
    say!("  A retry afterwards: {}", late.summary());
    ok &= charged == 1
        && st == "PAID"
        && late.status.is_success()
        && late.replayed
        && replies.len() == n_usize
        && replies.iter().all(|r| {
            (r.status.is_success() && r.order_status() == "PAID")
                || r.status == reqwest::StatusCode::CONFLICT
        });

    // --- The key reused for another request.
    say!();
    say!("  The same key on another request (paying order {a} instead):");
    let mismatch = walk.send(&walk.pay(a, &key_b, None)).await?;
    say!("    {}", mismatch.summary());
    say!("    (a key belongs to one request; reusing it for another is refused, not run)");
    ok &= mismatch.status == reqwest::StatusCode::UNPROCESSABLE_ENTITY;

    let (_, charges_a) = walk.state(a).await?;
    say!();
    if ok && charges_a == 1 {
        say!(
            "Result: order {a} was paid once despite a lost answer and a retry; order {b} was paid once\n\
             for {n} concurrent copies. Every duplicate got the stored answer, a 409 to retry later, or\n\
             a 422; none charged again."
        );
        Ok(true)
    } else {
        say!(
            "Result: NOT as expected: order {a} has {charges_a} charge(s), order {b} has {charged}; see the answers above."
        );
        Ok(false)
    }
}

/// Prints ready-to-paste curl lines.
fn print_try_it(gateway_url: &str) {
    let no = format!("try-{:08x}", rand::random::<u32>());
    let key = format!("try-{:08x}", rand::random::<u32>());
    say!();
    say!("Try it yourself in another terminal while this runs:");
    say!();
    say!("  # 1. Create an order (201; the same body again: 200 with the same order)");
    say!(
        "  curl -i {gateway_url}/orders -H 'Content-Type: application/json' \
         -d '{{\"outer_order_no\":\"{no}\",\"amount_cents\":2500}}'"
    );
    say!();
    say!("  # 2. Pay it (use the id from step 1), losing the provider's answer: 504 after 3 s");
    say!(
        "  curl -i -X POST {gateway_url}/orders/ID/pay -H 'Idempotency-Key: {key}' \
         -H 'X-Simulate: lose-response'"
    );
    say!();
    say!("  # 3. Retry the same request: 200, PAID");
    say!("  curl -i -X POST {gateway_url}/orders/ID/pay -H 'Idempotency-Key: {key}'");
    say!();
    say!("  # 4. The provider's ledger for the order: one charge");
    say!("  curl {gateway_url}/orders/ID/charges");
    say!();
    say!("  # 5. X-Simulate: fail declines (PAYMENT_FAILED); pay again with a new key to retry");
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
