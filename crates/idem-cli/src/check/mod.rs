//! `idem check URL`: probes an HTTP endpoint for idempotency faults from
//! the outside, through idem or not.
//!
//! ```text
//! idem check http://127.0.0.1:8080/orders -d '{"sku":"A-1","qty":1}' --count-url http://127.0.0.1:3000/count
//! ```
//!
//! - [`plan`]: the options checked, the checks chosen, their request
//!   budget and the `--dry-run` plan;
//! - [`client`]: the requests (one connection each, a rate limit, a
//!   budget);
//! - [`checks`]: the checks;
//! - [`report`]: verdicts, the table and the JSON;
//! - [`body`]: the body variants (same JSON in another order or spacing,
//!   another body);
//! - [`html`]: `--html FILE`, the report with a timeline of the
//!   concurrency checks.
//!
//! Exit status: 0 no check failed, 1 a check failed, 2 a usage error or a
//! target that cannot be reached (nothing judged).

mod body;
mod checks;
mod client;
mod html;
mod plan;
mod report;

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::Args;

/// The long help of `idem check`.
pub(crate) const LONG_ABOUT: &str = "Probe an HTTP endpoint for idempotency faults, from the \
     outside: through idem or not, any language. Each check sends its own requests with fresh \
     keys and gives a verdict (pass, FAIL, n/a, info) with a one-line reason and its evidence:\n\n\
     \x20 concurrent     N concurrent copies with one key run once\n\
     \x20 replay         a retry after the first completed gets the same status, headers \
     (not Date, hop-by-hop fields, Content-Length) and body, byte for byte\n\
     \x20 in-flight      a retry while the first still runs gets 409 with Retry-After \
     (whole seconds, 0..=3600) or the replay, never a second execution\n\
     \x20 disconnect     a client that hangs up before the answer and retries: one execution\n\
     \x20 other-body     the same key with another body gets 4xx (422 preferred), never the \
     first answer\n\
     \x20 other-path     the same key on another path never gets the first path's answer\n\
     \x20 json-variants  the same JSON body with its members reordered or re-spaced is the \
     same request (the replay, not 422)\n\
     \x20 invalid-keys   an empty key, a 300-character key and a key with a tab get 4xx\n\
     \x20 no-key         what a request without a key gets (informational)\n\n\
     To tell executions apart, name a value that differs per execution: --id-pointer (in the \
     JSON answer), --id-header (a response field such as Location), or --count-url (a GET that \
     answers the number of executions so far; the only way for `disconnect`). Without one, \
     checks that must count executions are n/a. in-flight and disconnect need a first request \
     that is still running after --overlap-after / --disconnect-after (50 ms): name a header \
     that makes the endpoint slow with --slow-header, or they are n/a.\n\n\
     Polite by default: loopback hosts only (127.0.0.0/8, ::1, localhost; others with \
     --allow-host), --rate requests a second, at most --max-requests in all (the plan's upper \
     bound is checked before anything is sent), --dry-run prints the plan. Counts from \
     --count-url include any other traffic the endpoint gets meanwhile: probe a quiet instance.\n\n\
     Exit status: 0 no check failed, 1 a check failed, 2 a usage error or a target that cannot \
     be reached (nothing judged).";

/// `idem check URL …`.
#[derive(Debug, Args)]
#[command(after_help = "Examples:\n  \
    idem check http://127.0.0.1:8080/orders -d '{\"sku\":\"A-1\",\"qty\":1}' --id-pointer /id\n  \
    idem check http://127.0.0.1:8080/orders --data-file order.json --count-url \
    http://127.0.0.1:3000/count --slow-header 'X-Delay-Ms: 300' --json")]
pub(crate) struct CheckArgs {
    /// The endpoint to probe: an http:// URL.
    #[arg(value_name = "URL")]
    pub(crate) url: String,

    /// The request method.
    #[arg(short = 'X', long, value_name = "METHOD", default_value = "POST")]
    pub(crate) method: String,

    /// The request body. A JSON body gets `Content-Type: application/json`
    /// unless -H sets one.
    #[arg(short = 'd', long, value_name = "BODY", conflicts_with = "data_file")]
    pub(crate) data: Option<String>,

    /// Read the request body from FILE.
    #[arg(long, value_name = "FILE")]
    pub(crate) data_file: Option<PathBuf>,

    /// A request header field, 'Name: value' (repeat for several).
    #[arg(short = 'H', long = "header", value_name = "NAME: VALUE")]
    pub(crate) headers: Vec<String>,

    /// The header that carries the key.
    #[arg(long, value_name = "NAME", default_value = "Idempotency-Key")]
    pub(crate) key_header: String,

    /// A JSON Pointer (RFC 6901) to a value of the answer's body that
    /// differs per execution (an id): /id, /order/id.
    #[arg(long, value_name = "POINTER", conflicts_with_all = ["id_header", "count_url"])]
    pub(crate) id_pointer: Option<String>,

    /// A response header that differs per execution, such as Location.
    #[arg(long, value_name = "NAME", conflicts_with = "count_url")]
    pub(crate) id_header: Option<String>,

    /// A URL answering GET with the number of executions so far: a
    /// number, or JSON holding exactly one number.
    #[arg(long, value_name = "URL")]
    pub(crate) count_url: Option<String>,

    /// How many concurrent copies `concurrent` sends.
    #[arg(short = 'n', long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u16).range(2..=64))]
    pub(crate) concurrency: u16,

    /// A header field that makes the endpoint slow, NAME:VALUE (sent on
    /// the requests of concurrent, in-flight and disconnect).
    #[arg(long, value_name = "NAME:VALUE")]
    pub(crate) slow_header: Option<String>,

    /// When `disconnect` hangs up on its first request.
    #[arg(long, value_name = "DURATION", default_value = "50ms", value_parser = positive_duration)]
    pub(crate) disconnect_after: Duration,

    /// When `in-flight` sends its retry after the first request.
    #[arg(long, value_name = "DURATION", default_value = "50ms", value_parser = positive_duration)]
    pub(crate) overlap_after: Duration,

    /// The longest a request may take; also how long `disconnect` retries
    /// while it gets 409.
    #[arg(long, value_name = "DURATION", default_value = "10s", value_parser = positive_duration)]
    pub(crate) timeout: Duration,

    /// The other path of `other-path` (default: the URL's path with
    /// /idem-check-other appended).
    #[arg(long, value_name = "PATH")]
    pub(crate) other_path: Option<String>,

    /// The other body of `other-body` (default: the body with its first
    /// value changed).
    #[arg(long, value_name = "BODY")]
    pub(crate) other_data: Option<String>,

    /// A response header left out of the replay comparison (repeat for
    /// several), e.g. X-Request-Id.
    #[arg(long = "ignore-header", value_name = "NAME")]
    pub(crate) ignore_headers: Vec<String>,

    /// Allow probing this host, which is not a loopback host (repeat for
    /// several).
    #[arg(long = "allow-host", value_name = "HOST")]
    pub(crate) allow_hosts: Vec<String>,

    /// Most requests a second, at least 0.1 (bursts of --concurrency).
    #[arg(long, value_name = "N", default_value_t = 50.0)]
    pub(crate) rate: f64,

    /// Most requests in all, count-URL reads included.
    #[arg(long, value_name = "N", default_value_t = 200)]
    pub(crate) max_requests: usize,

    /// Run only these checks, comma-separated (default: all).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub(crate) checks: Vec<String>,

    /// Print the report as JSON.
    #[arg(long)]
    pub(crate) json: bool,

    /// Print the plan (the requests it would send) and send nothing.
    #[arg(long)]
    pub(crate) dry_run: bool,

    /// Also write the report as an HTML page to FILE, with a timeline of
    /// the requests of concurrent, in-flight and disconnect (who ran, who
    /// waited, who got 409 or the replay).
    #[arg(long, value_name = "FILE")]
    pub(crate) html: Option<PathBuf>,
}

fn positive_duration(s: &str) -> Result<Duration, String> {
    match idem_gateway::parse_duration(s)? {
        Duration::ZERO => Err("must be more than 0".into()),
        d => Ok(d),
    }
}

/// `idem check`: plans, probes, prints the report.
pub(crate) async fn run(args: CheckArgs) -> ExitCode {
    let plan = match plan::Plan::from_args(&args) {
        Ok(p) => p,
        Err(e) => {
            eprintln!("idem check: {e}");
            return ExitCode::from(2);
        }
    };
    let mut out = std::io::stdout();
    if args.dry_run {
        // A closed pipe (`| head`) is no error worth a panic.
        let _ = write!(out, "{}", plan.describe());
        return ExitCode::SUCCESS;
    }
    // The file is made before anything is sent: a path that cannot be
    // written is a usage error, not a lost report.
    let html = match &args.html {
        Some(path) => match std::fs::File::create(path) {
            Ok(file) => Some((path, file)),
            Err(e) => {
                eprintln!("idem check: --html {}: {e}", path.display());
                return ExitCode::from(2);
            }
        },
        None => None,
    };
    // A target that cannot be reached is the setup's fault, not the API's:
    // exit 2 before any check is judged (one TCP connect, no request).
    let origin = &plan.url.origin;
    let reach = tokio::time::timeout(
        plan.timeout,
        tokio::net::TcpStream::connect((origin.host.as_str(), origin.port)),
    )
    .await;
    match reach {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            eprintln!("idem check: cannot connect to {origin}: {e}; is the service running there?");
            return ExitCode::from(2);
        }
        Err(_) => {
            eprintln!(
                "idem check: no connection to {origin} within {:?}; is the service running there?",
                plan.timeout
            );
            return ExitCode::from(2);
        }
    }
    let report = checks::Probe::new(plan).run().await;
    if let Some((path, mut file)) = html {
        if let Err(e) = file.write_all(html::page(&report).as_bytes()) {
            eprintln!("idem check: --html {}: {e}", path.display());
        }
    }
    let text = if args.json {
        format!("{}\n", report.json())
    } else {
        let colour = out.is_terminal() && std::env::var_os("NO_COLOR").is_none();
        report.table(colour)
    };
    let _ = write!(out, "{text}");
    if report.failed() {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
