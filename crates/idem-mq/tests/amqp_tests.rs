//! The RabbitMQ adapter against the real server (`IDEM_TEST_AMQP_URL`,
//! default `amqp://guest:guest@127.0.0.1:5672/%2f`; unreachable → the test
//! FAILS naming the start command). Each test declares its own queue and
//! deletes it at the end. Ledgers: the SQL inbox on SQLite and PostgreSQL,
//! the store dedup on Redis.
//!
//! "All acked" is checked the strict way: after the consumer's channel is
//! closed (which requeues every unacked delivery) the queue must be empty.

mod common;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use common::{
    eventually, payment, per_ledger, pg_ledger, sqlite_ledger, suffix, Broker, Counted, Ledger,
};
use idem_mq::amqp::{message_of, AmqpConsumer, AmqpOptions};
use idem_mq::{MissingIdPolicy, Outcome, Report};
use lapin::options::{
    BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
    QueueDeleteOptions,
};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

struct Rabbit {
    conn: Connection,
    ch: Channel,
    queue: String,
}

#[async_trait]
impl Broker for Rabbit {
    async fn publish(&self, id: Option<&str>, payment_id: &str) {
        let mut props = BasicProperties::default();
        if let Some(id) = id {
            props = props.with_message_id(id.into());
        }
        self.ch
            .basic_publish(
                "",
                &self.queue,
                BasicPublishOptions::default(),
                &payment(payment_id),
                props,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

impl Rabbit {
    async fn new() -> Self {
        let url = common::env_url(
            "IDEM_TEST_AMQP_URL",
            "amqp://guest:guest@127.0.0.1:5672/%2f",
        );
        let conn = tokio::time::timeout(
            Duration::from_secs(5),
            Connection::connect(&url, ConnectionProperties::default()),
        )
        .await
        .unwrap_or_else(|e| common::unreachable("RabbitMQ", &url, &e, common::START_RABBIT))
        .unwrap_or_else(|e| common::unreachable("RabbitMQ", &url, &e, common::START_RABBIT));
        let ch = conn.create_channel().await.unwrap();
        ch.confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let queue = format!("idemt.{}", suffix());
        ch.queue_declare(
            &queue,
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
        Self { conn, ch, queue }
    }

    async fn ready(&self) -> u32 {
        self.ch
            .queue_declare(
                &self.queue,
                QueueDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .unwrap()
            .message_count()
    }

    /// A consumer that takes `n` deliveries, lets `f` process some, and
    /// dies (its channel closes) before acking any of them.
    async fn crashing_consumer<L: Ledger>(
        &self,
        ledger: &L,
        n: usize,
        mut f: impl FnMut(usize, &idem_mq::Message) -> Option<u32>,
    ) {
        let ch = self.conn.create_channel().await.unwrap();
        let mut taken = 0;
        while taken < n {
            let Some(got) = ch
                .basic_get(&self.queue, BasicGetOptions { no_ack: false })
                .await
                .unwrap()
            else {
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let msg = message_of(&got.delivery, &self.queue, &options()).unwrap();
            if let Some(fail) = f(taken, &msg) {
                ledger.fail_next(fail);
                let o = ledger.process(&msg).await;
                assert_eq!(matches!(o, Outcome::Applied), fail == 0, "{o:?}");
            }
            taken += 1;
        }
        ch.close(200, "crash").await.unwrap();
    }

    async fn delete(self) {
        self.ch
            .queue_delete(&self.queue, QueueDeleteOptions::default())
            .await
            .unwrap();
        let _ = self.conn.close(200, "done").await;
    }
}

fn options() -> AmqpOptions {
    AmqpOptions {
        prefetch: 10,
        retry_delay: Duration::from_millis(200),
        ..AmqpOptions::new("payments")
    }
}

/// Consumes on its own channel until `calls` deliveries were processed
/// and `want` payments have an effect, then stops and closes the channel.
async fn consume<L: Ledger>(
    rabbit: &Rabbit,
    ledger: Arc<L>,
    opts: AmqpOptions,
    calls: u64,
    want: usize,
) -> Report {
    let ch = rabbit.conn.create_channel().await.unwrap();
    let counter = Arc::new(AtomicU64::new(0));
    let proc = Counted {
        inner: ledger.clone(),
        calls: counter.clone(),
    };
    let c = Arc::new(AmqpConsumer::new(
        ch.clone(),
        rabbit.queue.clone(),
        proc,
        opts,
    ));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = {
        let c = c.clone();
        tokio::spawn(async move {
            c.run_until(async {
                let _ = stopped.await;
            })
            .await
        })
    };
    let ok =
        eventually(Duration::from_secs(30), || {
            let (counter, ledger) = (counter.clone(), ledger.clone());
            async move {
                counter.load(Ordering::SeqCst) >= calls && ledger.effects().await.len() >= want
            }
        })
        .await;
    let _ = stop.send(());
    let report = task.await.unwrap().unwrap();
    assert!(
        ok,
        "consumer did not finish: {} calls, {report:?}",
        counter.load(Ordering::SeqCst)
    );
    // Delayed nacks (if any) have had their time; closing requeues whatever is unacked.
    ch.close(200, "done").await.unwrap();
    report
}

/// N distinct messages, 10 of them published twice, and a consumer that
/// took 8 deliveries, committed 4, and died before acking → exactly N
/// effects, and nothing left unacked.
async fn n_messages_with_duplicates<L: Ledger>(ledger: L) {
    let rabbit = Rabbit::new().await;
    let n = 30;
    common::publish_with_duplicates(&rabbit, n, Duration::ZERO).await;
    let ledger = Arc::new(ledger);
    rabbit
        .crashing_consumer(&*ledger, 8, |k, _| (k < 4).then_some(0))
        .await;
    let report = consume(&rabbit, ledger.clone(), options(), n as u64 + 10, n).await;
    common::assert_each_once(&*ledger, &report, n).await;
    assert_eq!(report.duplicates, 14, "{report:?}");
    assert_eq!(rabbit.ready().await, 0, "everything acked");
    ledger.cleanup().await;
    rabbit.delete().await;
}

per_ledger!(n_messages_with_duplicates: all);

/// H2: committed, then the consumer died before its ack → the redelivery
/// is skipped and acked. A crash before commit → applied once.
async fn crash_windows<L: Ledger>(ledger: L) {
    let rabbit = Rabbit::new().await;
    rabbit.publish(Some("after-commit"), "after-commit").await;
    rabbit.publish(Some("before-commit"), "before-commit").await;
    let ledger = Arc::new(ledger);
    rabbit
        .crashing_consumer(&*ledger, 2, |_, m| {
            // before-commit: the handler wrote, then failed = no commit.
            Some(u32::from(
                m.key.as_ref().unwrap().raw_id() == "before-commit",
            ))
        })
        .await;
    let report = consume(&rabbit, ledger.clone(), options(), 2, 2).await;
    common::assert_crash_windows(&*ledger, &report).await;
    assert_eq!(rabbit.ready().await, 0);
    ledger.cleanup().await;
    rabbit.delete().await;
}

per_ledger!(crash_windows: sql);

/// H1: a duplicate among six prefetched deliveries is skipped and acked;
/// the other five are applied.
#[tokio::test]
async fn h1_duplicate_inside_a_batch_does_not_stall_it() {
    let rabbit = Rabbit::new().await;
    let ledger = Arc::new(pg_ledger().await);
    common::processed_before(&*ledger, &rabbit.queue, "pay-3").await;
    common::publish_payments(&rabbit, 0..6).await;
    let report = consume(&rabbit, ledger.clone(), options(), 6, 6).await;
    assert_eq!(
        (report.applied, report.duplicates, report.ack_errors),
        (5, 1, 0),
        "{report:?}"
    );
    assert_eq!(rabbit.ready().await, 0);
    assert!(ledger.effects().await.values().all(|&v| v == 1));
    ledger.cleanup().await;
    rabbit.delete().await;
}

/// Fails twice (after its write), requeued each time, then succeeds → one effect.
#[tokio::test]
async fn fails_twice_then_succeeds_once() {
    let rabbit = Rabbit::new().await;
    let ledger = Arc::new(sqlite_ledger().await);
    ledger.fail_next(2);
    rabbit.publish(Some("flaky"), "flaky").await;
    let report = consume(&rabbit, ledger.clone(), options(), 3, 1).await;
    assert_eq!((report.failed, report.applied), (2, 1), "{report:?}");
    assert_eq!(ledger.effects().await.get("flaky"), Some(&1));
    assert_eq!(rabbit.ready().await, 0);
    rabbit.delete().await;
}

/// No `message_id`: rejected (dead-lettered where configured), never
/// processed; processed without dedup only when the policy opts in.
#[tokio::test]
async fn missing_id_is_rejected_unless_opted_in() {
    let rabbit = Rabbit::new().await;
    let ledger = Arc::new(sqlite_ledger().await);
    rabbit.publish(None, "anon-1").await;
    let ch = rabbit.conn.create_channel().await.unwrap();
    let got = ch
        .basic_get(&rabbit.queue, BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("one message");
    let c = AmqpConsumer::new(ch.clone(), rabbit.queue.clone(), ledger.clone(), options());
    let report = c.handle(got.delivery).await;
    assert_eq!((report.rejected, report.applied), (1, 0));
    ch.close(200, "done").await.unwrap();
    assert_eq!(rabbit.ready().await, 0, "rejected, not requeued");
    assert!(ledger.effects().await.is_empty());

    rabbit.publish(None, "anon-2").await;
    let opts = AmqpOptions {
        missing_id: MissingIdPolicy::ProcessWithoutDedup,
        ..options()
    };
    let report = consume(&rabbit, ledger.clone(), opts, 1, 1).await;
    assert_eq!(report.applied, 1);
    assert_eq!(ledger.effects().await.get("anon-2"), Some(&1));
    rabbit.delete().await;
}
