//! `orders --listen ADDR --database URL`: the example order/payment service.

use std::net::SocketAddr;
use std::process::ExitCode;
use std::time::Duration;

use clap::Parser;

/// An order/payment service guarded by an Idempotency-Key layer, a fenced
/// lock and database constraints (idem example).
#[derive(Debug, Parser)]
#[command(name = "orders", version)]
struct Args {
    /// Address to listen on (port 0: a free port; the bound address is
    /// printed on stdout).
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8080")]
    listen: SocketAddr,

    /// The database: sqlite://FILE (created when missing) or
    /// postgres://USER@HOST:PORT/DB. Tables are created when missing.
    #[arg(
        long,
        value_name = "URL",
        env = "ORDERS_DATABASE",
        default_value = "sqlite://orders.db"
    )]
    database: String,

    /// PostgreSQL only: keep every table in this schema (created when missing).
    #[arg(long, value_name = "NAME")]
    schema: Option<String>,

    /// How long to wait for the payment provider before the outcome counts
    /// as unknown, in ms.
    #[arg(long, value_name = "MS", default_value_t = 3000)]
    provider_timeout_ms: u64,
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    match run(args).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("orders: {e}");
            ExitCode::FAILURE
        }
    }
}

async fn run(args: Args) -> Result<(), String> {
    let mut config = orders::Config::new(args.database.clone())
        .with_provider_timeout(Duration::from_millis(args.provider_timeout_ms.max(1)));
    if let Some(schema) = args.schema {
        config = config.with_schema(schema);
    }
    let app = orders::App::connect(config)
        .await
        .map_err(|e| format!("cannot open {}: {e}", args.database))?;
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let addr = listener
        .local_addr()
        .map_err(|e| format!("listen address: {e}"))?;
    println!("orders listening on http://{addr}");
    let shutdown = async {
        let ctrl_c = tokio::signal::ctrl_c();
        #[cfg(unix)]
        {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
            tokio::select! {
                _ = ctrl_c => {}
                _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
            }
        }
        #[cfg(not(unix))]
        {
            let _ = ctrl_c.await;
        }
    };
    axum::serve(listener, app.router())
        .with_graceful_shutdown(shutdown)
        .await
        .map_err(|e| format!("server: {e}"))?;
    // Pay requests run detached from their connections: let them finish
    // (and store their answers) before exiting.
    app.tracker().close();
    if tokio::time::timeout(Duration::from_secs(10), app.tracker().wait())
        .await
        .is_err()
    {
        eprintln!("orders: pay requests still running after 10 s; exiting anyway");
    }
    Ok(())
}
