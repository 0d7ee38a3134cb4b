//! `payments-consumer`: credits accounts from payment-captured messages
//! exactly once (see the library docs and `docs/patterns/consumers.md`).
//!
//! ```text
//! payments-consumer consume --broker nats://127.0.0.1:4222 --database sqlite://payments.db [--run-for 10]
//! payments-consumer publish --broker amqp://guest:guest@127.0.0.1:5672/%2f --payment-id p-1 --account alice --amount-cents 500
//! payments-consumer balance --database sqlite://payments.db --account alice
//! ```

use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use payments_consumer::{consume, publish, Ledger, PaymentCaptured, Source};

#[derive(Parser, Debug)]
#[command(about = "Credit accounts from payment-captured messages, exactly once (idem SQL inbox)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Args, Debug)]
struct BrokerArgs {
    /// nats://host:4222 (JetStream) or amqp://user:pass@host:5672/%2f (RabbitMQ).
    #[arg(long, env = "PAYMENTS_BROKER")]
    broker: String,
    /// NATS stream (created if missing).
    #[arg(long, default_value = "PAYMENTS")]
    stream: String,
    /// NATS subject / RabbitMQ queue.
    #[arg(long, default_value = "payments.captured")]
    subject: String,
    /// Consumer name (JetStream durable consumer; dedup scope).
    #[arg(long, default_value = "payments-consumer")]
    consumer: String,
}

impl BrokerArgs {
    fn source(&self) -> Source {
        Source {
            broker: self.broker.clone(),
            stream: self.stream.clone(),
            subject: self.subject.clone(),
            consumer: self.consumer.clone(),
        }
    }
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Consume and credit until Ctrl-C (or --run-for seconds).
    Consume {
        #[command(flatten)]
        broker: BrokerArgs,
        /// sqlite://payments.db or postgres://user@host/db.
        #[arg(long, env = "PAYMENTS_DATABASE")]
        database: String,
        /// Stop after this many seconds (default: run until Ctrl-C).
        #[arg(long)]
        run_for: Option<u64>,
    },
    /// Publish one payment-captured message (message id = payment id).
    Publish {
        #[command(flatten)]
        broker: BrokerArgs,
        #[arg(long)]
        payment_id: String,
        #[arg(long)]
        account: String,
        #[arg(long)]
        amount_cents: i64,
    },
    /// Print an account's balance in cents.
    Balance {
        #[arg(long, env = "PAYMENTS_DATABASE")]
        database: String,
        #[arg(long)]
        account: String,
    },
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        // Logs go to stderr (stdout carries the command's answer), in
        // colour only on a terminal.
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    match Cli::parse().cmd {
        Cmd::Consume {
            broker,
            database,
            run_for,
        } => {
            let ledger = Ledger::open(&database).await?;
            let shutdown = async move {
                match run_for {
                    Some(s) => tokio::time::sleep(Duration::from_secs(s)).await,
                    None => {
                        let _ = tokio::signal::ctrl_c().await;
                    }
                }
            };
            let report = consume(&broker.source(), ledger, shutdown).await?;
            println!(
                "received {} applied {} duplicates {} in-flight {} failed {} rejected {} ack-errors {}",
                report.received,
                report.applied,
                report.duplicates,
                report.in_flight,
                report.failed,
                report.rejected,
                report.ack_errors
            );
        }
        Cmd::Publish {
            broker,
            payment_id,
            account,
            amount_cents,
        } => {
            let p = PaymentCaptured {
                payment_id,
                account,
                amount_cents,
            };
            publish(&broker.source(), &p).await?;
            println!("published {}", p.payment_id);
        }
        Cmd::Balance { database, account } => {
            let ledger = Ledger::open(&database).await?;
            println!("{}", ledger.balance(&account).await?);
        }
    }
    Ok(())
}
