//! `idem`: the command-line front end of idem.
//!
//! - `idem gateway` runs the idempotency gateway, a reverse proxy that makes
//!   POST/PATCH requests carrying an `Idempotency-Key` header take effect
//!   once for any HTTP service behind it.
//! - `idem demo` starts a sample payment service with a gateway in front of
//!   it, fires concurrent duplicate requests through the gateway and shows
//!   that the service ran the charge once.
//! - `idem config check FILE` validates a configuration file and prints the
//!   effective configuration with the source of every value; `idem config
//!   schema` prints the file's JSON Schema (docs/CONFIG.md).
//! - `idem keys` lists, shows, deletes and purges records in a store (a key
//!   stuck in flight after a crash, freed so that a retry runs now).
//! - `idem check URL` probes any HTTP endpoint (through idem or not) for
//!   idempotency faults: concurrent duplicates that run twice, replays
//!   that differ, keys not tied to the request, and more.

mod check;
#[cfg(feature = "demo")]
mod demo;
mod keys;

use std::error::Error;
use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::{ArgMatches, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use idem_gateway::{Gateway, GatewayArgs, GatewayConfig};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

use tracing_subscriber::{EnvFilter, Layer};

/// mimalloc rather than the system allocator: a proxied request makes 50 (no key) to 140 (first
/// execution) small allocations, and mimalloc spends fewer instructions on each (bench/instructions.sh).
#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[cfg(feature = "demo")]
const LONG_ABOUT: &str = "Make write operations take effect exactly once per Idempotency-Key.\n\n\
     `idem gateway` is a reverse proxy that gives any HTTP service the guarantee without a change \
     to its code; `idem demo` shows it at work in front of a sample payment service; `idem keys` \
     finds and frees keys in a store; `idem check URL` probes any API for idempotency faults.";
#[cfg(not(feature = "demo"))]
const LONG_ABOUT: &str = "Make write operations take effect exactly once per Idempotency-Key.\n\n\
     `idem gateway` is a reverse proxy that gives any HTTP service the guarantee without a change \
     to its code; `idem keys` finds and frees keys in a store; `idem check URL` probes any API \
     for idempotency faults. (This binary was built without the Cargo feature `demo`, so `idem demo` is \
     not in it.)";
#[cfg(feature = "demo")]
const AFTER_HELP: &str = "Start with `idem demo`. Logs go to stderr; set RUST_LOG (e.g. \
     RUST_LOG=debug) to change how much is logged.";
#[cfg(not(feature = "demo"))]
const AFTER_HELP: &str = "Logs go to stderr; set RUST_LOG (e.g. RUST_LOG=debug) to change how \
     much is logged.";

/// Make write operations take effect exactly once per Idempotency-Key.
#[derive(Debug, Parser)]
#[command(
    name = "idem",
    version,
    about = "Make write operations take effect exactly once per Idempotency-Key",
    long_about = LONG_ABOUT,
    after_help = AFTER_HELP
)]
struct Cli {
    /// Log format (logs go to stderr).
    #[arg(
        long,
        global = true,
        display_order = 1000,
        env = "IDEM_LOG_FORMAT",
        value_enum,
        default_value_t = LogFormat::Text
    )]
    log_format: LogFormat,

    #[command(subcommand)]
    command: Command,
}

// Parsed once at start-up; the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum Command {
    /// Run the gateway: a reverse proxy that makes requests carrying an
    /// Idempotency-Key take effect once.
    #[command(
        long_about = "Run the gateway: a reverse proxy in front of --upstream that makes \
                      guarded requests (POST and PATCH by default) carrying an Idempotency-Key \
                      header take effect once. The first request with a key runs upstream; its \
                      response is stored and replayed (with `Idempotent-Replayed: true`) to \
                      every retry with the same key and the same request; a retry while the \
                      first is still running gets 409 with Retry-After; the same key with a \
                      different request gets 422. Every flag can also be set by the IDEM_* \
                      environment variable shown next to it, and in the --config file by its \
                      long name with '-' written '_' (flag > variable > file > default).",
        after_help = "Example:\n  idem gateway --listen 127.0.0.1:8080 --upstream http://127.0.0.1:3000 \
                      --store sqlite://idem.db"
    )]
    Gateway(GatewayArgs),

    /// Check a configuration file, or print its JSON Schema.
    #[command(subcommand)]
    Config(ConfigCommand),

    /// Find and free keys: list, show, delete or purge records in a store.
    #[command(long_about = keys::LONG_ABOUT)]
    Keys(keys::KeysArgs),

    /// Probe an HTTP endpoint for idempotency faults (concurrent
    /// duplicates, replays, key reuse); exit status 1 when a check fails.
    #[command(long_about = check::LONG_ABOUT)]
    Check(check::CheckArgs),

    /// Start a sample payment service behind a gateway and show that 20
    /// concurrent duplicate requests charge once.
    #[cfg(feature = "demo")]
    #[command(long_about = demo::LONG_ABOUT)]
    Demo(demo::DemoArgs),

    /// `idem demo` in a binary built without it: says so instead of
    /// clap's "unrecognized subcommand".
    #[cfg(not(feature = "demo"))]
    #[command(hide = true, disable_help_flag = true)]
    Demo {
        #[arg(trailing_var_arg = true, allow_hyphen_values = true, hide = true)]
        _args: Vec<String>,
    },
}

/// `idem config …`.
// Parsed once; the size difference between variants costs nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
enum ConfigCommand {
    /// Validate a configuration file and print the effective configuration.
    #[command(
        long_about = "Validate a configuration file and print the effective configuration: \
                      every setting with its value and where it came from (`default`, \
                      `file:LINE`, `env IDEM_X`, `flag`), then the routes in match order \
                      (`route:LINE` or `inherited`) and the implicit route `default`. Gateway \
                      flags and IDEM_* variables given here override the file as they would \
                      for `idem gateway --config FILE`. Exit status 0 for a good file, 2 for a \
                      bad one (the error names the line).",
        mut_arg("config", |a| a.hide(true)),
        after_help = "Example:\n  idem config check idem.toml\n  idem config check idem.toml --ttl 1h"
    )]
    Check {
        /// The configuration file (TOML).
        #[arg(value_name = "FILE")]
        file: std::path::PathBuf,
        #[command(flatten)]
        gateway: GatewayArgs,
    },
    /// Print the JSON Schema (draft 2020-12) of the configuration file, for
    /// editors (docs/config.schema.json).
    Schema,
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

fn main() -> ExitCode {
    let matches = Cli::command().get_matches();
    let cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // `idem config` needs no runtime and no logger.
    if let Command::Config(cmd) = &cli.command {
        let sub = matches
            .subcommand_matches("config")
            .and_then(|m| m.subcommand_matches("check"));
        return run_config(cmd, sub);
    }
    // The gateway's configuration is layered first: the file may name the
    // trace exporter.
    let gateway_config = match &cli.command {
        Command::Gateway(args) => {
            let sub = matches
                .subcommand_matches("gateway")
                .expect("the gateway subcommand was parsed");
            match gateway_config(args, sub) {
                Ok(c) => Some(c),
                Err(code) => return code,
            }
        }
        _ => None,
    };
    let default_filter = match cli.command {
        Command::Gateway(_) => "info",
        Command::Config(_) => unreachable!("answered above"),
        // Tables and JSON go to stdout; stderr gets warnings (a deletion's
        // who/what/when line) unless RUST_LOG asks for more.
        Command::Keys(_) => "warn",
        // The report goes to stdout.
        Command::Check(_) => "warn",
        // The demo prints its own story on stdout; logs would interleave with
        // it, so only warnings unless RUST_LOG asks for more.
        #[cfg(feature = "demo")]
        Command::Demo(_) => "warn",
        #[cfg(not(feature = "demo"))]
        Command::Demo { .. } => {
            eprintln!(
                "idem: this binary was built without the Cargo feature `demo` (on by default), \
                 so it has no `idem demo`; build it with that feature, e.g. `cargo build --release`"
            );
            return ExitCode::from(2);
        }
    };
    let otlp = gateway_config
        .as_ref()
        .and_then(|(args, _, _)| args.otlp_endpoint.clone());
    // The file's `log_format`, unless the flag or its variable set it.
    let log_format = match gateway_config.as_ref().and_then(|(_, _, f)| f.as_deref()) {
        Some(from_file)
            if !matches!(
                matches.value_source("log_format"),
                Some(
                    clap::parser::ValueSource::CommandLine | clap::parser::ValueSource::EnvVariable
                )
            ) =>
        {
            if from_file == "json" {
                LogFormat::Json
            } else {
                LogFormat::Text
            }
        }
        _ => cli.log_format,
    };
    let traces = match init_logging(log_format, default_filter, otlp.as_ref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("idem: {e}");
            return ExitCode::from(2);
        }
    };
    let runtime = match build_runtime(std::env::var(RUNTIME_THREADS_VAR).ok().as_deref()) {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("idem: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let code = runtime.block_on(async move {
        match cli.command {
            Command::Gateway(_) => {
                let (_, config, _) = gateway_config.expect("layered above");
                run_gateway(config).await
            }
            Command::Config(_) => unreachable!("answered before the runtime starts"),
            Command::Keys(args) => keys::run(args).await,
            Command::Check(args) => check::run(args).await,
            #[cfg(feature = "demo")]
            Command::Demo(args) => demo::run(args).await,
            #[cfg(not(feature = "demo"))]
            Command::Demo { .. } => unreachable!("answered before the runtime starts"),
        }
    });
    // The spans of the last requests are still queued: export them.
    traces.flush();
    code
}

/// Environment variable choosing the async runtime's threads: `1` runs
/// everything on one thread (Tokio's current-thread runtime), `N` > 1 runs
/// `N` worker threads; unset or `0`, one worker per CPU (Tokio's default).
///
/// On small machines where the upstream shares the CPUs, one thread is
/// usually faster (less cross-thread wake-up work; see docs/BENCHMARKS.md).
const RUNTIME_THREADS_VAR: &str = "IDEM_RUNTIME_THREADS";

/// The runtime for `threads` (the value of [`RUNTIME_THREADS_VAR`]).
fn build_runtime(threads: Option<&str>) -> Result<tokio::runtime::Runtime, String> {
    let n = match threads.map(str::trim) {
        None | Some("") => 0,
        Some(v) => v.parse::<usize>().map_err(|_| {
            format!("{RUNTIME_THREADS_VAR}={v:?} is not a number of threads (0 = one per CPU)")
        })?,
    };
    let built = match n {
        1 => tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build(),
        0 => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build(),
        n => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(n)
            .enable_all()
            .build(),
    };
    built.map_err(|e| e.to_string())
}

/// The trace exporter, while one runs (`--otlp-endpoint`).
struct Traces {
    #[cfg(feature = "otel")]
    guard: Option<idem_gateway::otel::OtelGuard>,
}

impl Traces {
    /// Exports the queued spans and stops the exporter (bounded by its
    /// export timeout).
    fn flush(self) {
        #[cfg(feature = "otel")]
        if let Some(guard) = self.guard {
            if let Err(e) = guard.shutdown() {
                eprintln!("idem: the last traces were not exported: {e}");
            }
        }
    }
}

/// Installs the tracing subscriber: log lines filtered by `RUST_LOG` when
/// set, else `default_filter`; with `otlp`, the OpenTelemetry layer too
/// (its own filter: the `idem.*` spans, whatever the log filter says).
fn init_logging(
    format: LogFormat,
    default_filter: &str,
    otlp: Option<&idem_gateway::OtlpEndpoint>,
) -> Result<Traces, String> {
    let filter = match std::env::var("RUST_LOG") {
        Ok(v) if !v.trim().is_empty() => {
            EnvFilter::try_new(&v).map_err(|e| format!("invalid RUST_LOG value {v:?}: {e}"))?
        }
        _ => EnvFilter::new(default_filter),
    };
    // Colours only on a terminal, and not when NO_COLOR is set.
    let ansi = std::io::stderr().is_terminal() && std::env::var_os("NO_COLOR").is_none();
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(ansi)
        .with_writer(std::io::stderr);
    let fmt = match format {
        LogFormat::Text => fmt.boxed(),
        LogFormat::Json => fmt.json().boxed(),
    };
    let logs = tracing_subscriber::registry().with(fmt.with_filter(filter));
    #[cfg(feature = "otel")]
    {
        let (layer, guard) = match otlp {
            Some(endpoint) => {
                let (layer, guard) =
                    idem_gateway::otel::layer(endpoint).map_err(|e| e.to_string())?;
                (Some(layer), Some(guard))
            }
            None => (None, None),
        };
        logs.with(layer)
            .try_init()
            .map_err(|e| format!("cannot install the logger: {e}"))?;
        if let Some(endpoint) = otlp {
            tracing::info!(
                target: "idem",
                otlp = %endpoint,
                service = %idem_gateway::otel::service_name(),
                "idem exporting traces"
            );
        }
        Ok(Traces { guard })
    }
    #[cfg(not(feature = "otel"))]
    {
        if otlp.is_some() {
            return Err(
                "--otlp-endpoint: this binary was built without the Cargo feature \
                        `otel` (on by default), so it cannot export traces"
                    .to_owned(),
            );
        }
        logs.try_init()
            .map_err(|e| format!("cannot install the logger: {e}"))?;
        Ok(Traces {})
    }
}

/// The configuration of `idem gateway`: the flags, the IDEM_* variables
/// and, with `--config`/IDEM_CONFIG, the file under them. Exit status 2
/// (with the reason on stderr) when it is refused.
fn gateway_config(
    args: &GatewayArgs,
    matches: &ArgMatches,
) -> Result<(GatewayArgs, GatewayConfig, Option<String>), ExitCode> {
    let refused = |e: &dyn Error| {
        eprintln!("idem gateway: invalid configuration: {}", chain(e));
        eprintln!(
            "Run `idem gateway --help` for the flags and their IDEM_* variables, \
             `idem config check FILE` to check a configuration file."
        );
        ExitCode::from(2)
    };
    match &args.config {
        Some(path) => idem_gateway::config_file::load(matches, path)
            .map(|l| (l.args, l.config, l.log_format))
            .map_err(|e| refused(&e)),
        None => args
            .clone()
            .into_config()
            .map(|c| (args.clone(), c, None))
            .map_err(|e| refused(&e)),
    }
}

/// `idem config check FILE` and `idem config schema`.
fn run_config(cmd: &ConfigCommand, matches: Option<&ArgMatches>) -> ExitCode {
    match cmd {
        ConfigCommand::Schema => {
            let schema = idem_gateway::config_file::schema();
            let text = serde_json::to_string_pretty(&schema).expect("a JSON value prints");
            // A closed pipe (`| head`) is no error worth a panic.
            let _ = writeln!(std::io::stdout(), "{text}");
            ExitCode::SUCCESS
        }
        ConfigCommand::Check { file, .. } => {
            let matches = matches.expect("the check subcommand was parsed");
            match idem_gateway::config_file::load(matches, file) {
                Ok(loaded) => {
                    let _ = write!(
                        std::io::stdout(),
                        "# {}: valid; the effective configuration:\n{}",
                        file.display(),
                        loaded.report
                    );
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("idem config check: {}", chain(&e));
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// `idem gateway`: binds, serves until Ctrl-C / SIGTERM, then drains.
async fn run_gateway(config: GatewayConfig) -> ExitCode {
    let gateway = match Gateway::bind(config).await {
        Ok(g) => g,
        Err(e) => {
            eprintln!("idem gateway: cannot start: {}", chain(&e));
            return exit_code(&e);
        }
    };
    match gateway.serve(idem_gateway::shutdown_signal()).await {
        Ok(()) => {
            tracing::info!("idem gateway stopped");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("idem gateway: {}", chain(&e));
            exit_code(&e)
        }
    }
}

/// 2 for a configuration the gateway refuses (found at bind or start: an
/// unusable `--admin-token-file`, a file-descriptor limit that leaves no
/// room), 1 for anything else (an unreachable store, a taken port).
fn exit_code(e: &idem_gateway::GatewayError) -> ExitCode {
    match e {
        idem_gateway::GatewayError::Config(_) => ExitCode::from(2),
        _ => ExitCode::FAILURE,
    }
}

/// An error and its sources, joined with ": ".
pub(crate) fn chain(e: &dyn Error) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        // Some errors repeat their source in their own message.
        if !out.contains(&s_text) {
            out.push_str(": ");
            out.push_str(&s_text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_definition_is_valid() {
        Cli::command().debug_assert();
    }

    #[test]
    fn runtime_threads_are_parsed() {
        use tokio::runtime::RuntimeFlavor;
        let flavor = |v: Option<&str>| build_runtime(v).map(|rt| rt.handle().runtime_flavor());
        assert_eq!(flavor(Some("1")), Ok(RuntimeFlavor::CurrentThread));
        assert_eq!(flavor(Some(" 2 ")), Ok(RuntimeFlavor::MultiThread));
        assert_eq!(flavor(None), Ok(RuntimeFlavor::MultiThread));
        assert_eq!(flavor(Some("0")), Ok(RuntimeFlavor::MultiThread));
        assert!(flavor(Some("two"))
            .unwrap_err()
            .contains(RUNTIME_THREADS_VAR));
    }

    #[test]
    fn chain_joins_sources_once() {
        let outer = Wrapped(std::io::Error::other("disk gone"));
        assert_eq!(chain(&outer), "wrapped: disk gone");
    }

    #[derive(Debug)]
    struct Wrapped(std::io::Error);
    impl std::fmt::Display for Wrapped {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("wrapped")
        }
    }
    impl Error for Wrapped {
        fn source(&self) -> Option<&(dyn Error + 'static)> {
            Some(&self.0)
        }
    }
}
