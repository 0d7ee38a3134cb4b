//! Messages/s through the SQL inbox path against the same consumer without
//! dedup, side by side, on SQLite (a WAL file) and PostgreSQL
//! (`IDEM_TEST_POSTGRES_URL`, default `postgres://postgres@127.0.0.1:5432/test`).
//!
//! ```text
//! cargo bench -p idem-mq --bench inbox            # 2,000 messages per run
//! IDEM_BENCH_MESSAGES=10000 cargo bench -p idem-mq --bench inbox
//! ```
//!
//! Both sides process the same messages through a [`Processor`] with the
//! same business write (one credit row) in one transaction; the inbox side
//! adds the inbox insert to that transaction. The broker is left out (it
//! costs the same on both sides). One consumer, sequential, as a consumer
//! processes one partition. First distinct messages only (the pure
//! overhead of the inbox); then every 4th message is delivered a second time
//! in a second run (a duplicate: the inbox skips it with a rollback, the
//! plain consumer credits again, so that run is not like for like).

use std::time::Instant;

use async_trait::async_trait;
use idem_mq::{Message, MessageKey, Outcome, Processor, SqlInbox, TxHandler};

#[path = "../tests/common/mod.rs"]
mod common;

struct Credit {
    table: String,
}

// `TxHandler` for each database: the insert credits the message's id.
idem_mq::tx_handler!(Credit, |this, tx, msg, insert| {
    sqlx::query(&insert(&this.table))
        .bind(msg.key.as_ref().map(|k| k.raw_id().to_owned()))
        .execute(&mut **tx)
        .await?;
    Ok(())
},
    sqlx::Sqlite => |t: &str| format!("INSERT INTO {t} (payment_id, cents) VALUES (?1, 500)"),
    sqlx::Postgres => |t: &str| format!("INSERT INTO {t} (payment_id, cents) VALUES ($1, 500)"),
);

/// The same handler in a plain transaction: no dedup.
struct Plain<DB: sqlx::Database> {
    pool: sqlx::Pool<DB>,
    handler: Credit,
}

#[async_trait]
impl<DB: idem_mq::inbox::InboxDatabase> Processor for Plain<DB>
where
    Credit: TxHandler<DB>,
{
    async fn process(&self, msg: &Message) -> Outcome {
        let mut tx = match self.pool.begin().await {
            Ok(tx) => tx,
            Err(e) => return Outcome::Failed(Box::new(e)),
        };
        if let Err(e) = self.handler.handle(&mut tx, msg).await {
            return Outcome::Failed(e);
        }
        match tx.commit().await {
            Ok(()) => Outcome::Applied,
            Err(e) => Outcome::Failed(Box::new(e)),
        }
    }
}

fn messages(n: usize, run: &str, dups: bool) -> Vec<Message> {
    let mut out = Vec::with_capacity(n + n / 4);
    for i in 0..n {
        let m = Message {
            key: Some(
                MessageKey::new(format!("bench-{run}"), format!("pay-{i}"))
                    .unwrap()
                    .with_stream("S"),
            ),
            payload: Vec::new(),
            delivery_attempt: 1,
        };
        if dups && i % 4 == 0 {
            out.push(m.clone());
        }
        out.push(m);
    }
    out
}

async fn measure<P: Processor>(p: &P, msgs: &[Message]) -> f64 {
    let start = Instant::now();
    for m in msgs {
        match p.process(m).await {
            Outcome::Applied | Outcome::Duplicate => {}
            o => panic!("bench message failed: {o:?}"),
        }
    }
    msgs.len() as f64 / start.elapsed().as_secs_f64()
}

fn row(db: &str, load: &str, plain: f64, inbox: f64) {
    println!(
        "{db:<11} {load:<16} {plain:>14.0} {inbox:>14.0} {:>8.2}",
        inbox / plain
    );
}

/// Warm-up, then both sides on distinct messages (the inbox's pure
/// overhead), then with every 4th delivered twice.
async fn compare<A: Processor, B: Processor>(db: &str, without: &A, with: &B, n: usize) {
    measure(without, &messages(200, "warm-plain", false)).await;
    measure(with, &messages(200, "warm-inbox", false)).await;
    for (load, dups) in [("distinct", false), ("+25% duplicates", true)] {
        // Rounds alternate the two sides so load from elsewhere on the
        // machine hits both alike; the median round is reported.
        let (mut plain, mut inboxed) = (Vec::new(), Vec::new());
        for r in 0..ROUNDS {
            let chunk = (n / ROUNDS).max(1);
            plain.push(
                measure(
                    without,
                    &messages(chunk, &format!("plain-{load}-{r}"), dups),
                )
                .await,
            );
            inboxed.push(measure(with, &messages(chunk, &format!("inbox-{load}-{r}"), dups)).await);
        }
        row(db, load, median(plain), median(inboxed));
    }
}

const ROUNDS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// The two sides on `$pool`, sharing one credits table (made by
/// `$credits`, `{}` its name): `(pool, table, without, with)`.
macro_rules! sides {
    ($pool:expr, $credits:literal) => {{
        let pool = $pool;
        let (t, inbox) = common::inbox_on!(pool.clone(), $credits);
        let with = SqlInbox::new(inbox, Credit { table: t.clone() });
        let without = Plain {
            pool: pool.clone(),
            handler: Credit { table: t.clone() },
        };
        (pool, t, without, with)
    }};
}

async fn sqlite(n: usize) {
    let dir = tempfile::tempdir().unwrap();
    let pool = common::sqlite_pool(&dir.path().join("bench.db")).await;
    let (_, _, without, with) = sides!(
        pool,
        "CREATE TABLE {} (payment_id TEXT, cents INTEGER NOT NULL)"
    );
    // Warm up, then interleave the two sides.
    compare("SQLite", &without, &with, n).await;
}

async fn postgres(n: usize) {
    let url = std::env::var("IDEM_TEST_POSTGRES_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap_or_else(|e| {
            panic!(
                "PostgreSQL at {url} is not reachable ({e}). Start it with:\n    \
                 pg_ctlcluster --skip-systemctl-redirect $(ls /etc/postgresql) main start"
            )
        });
    let (pool, t, without, with) = sides!(
        pool,
        "CREATE TABLE {} (payment_id TEXT, cents BIGINT NOT NULL)"
    );
    compare("PostgreSQL", &without, &with, n).await;
    for table in [format!("{t}_inbox"), t] {
        sqlx::query(&format!("DROP TABLE {table}"))
            .execute(&pool)
            .await
            .unwrap();
    }
}

fn main() {
    // `cargo test --benches` runs this with no `--bench`: keep that quick.
    let benching = std::env::args().any(|a| a == "--bench");
    let n: usize = std::env::var("IDEM_BENCH_MESSAGES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if benching { 2000 } else { 40 });
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        println!(
            "messages/s (median of 5 alternating rounds), one sequential consumer, {n} distinct messages \
             (the second run delivers every 4th twice)"
        );
        println!(
            "{:<11} {:<16} {:>14} {:>14} {:>8}",
            "database", "deliveries", "without dedup", "inbox", "ratio"
        );
        sqlite(n).await;
        postgres(n).await;
    });
}
