//! The NATS JetStream adapter against the real server
//! (`IDEM_TEST_NATS_URL`, default `nats://127.0.0.1:4222`, JetStream on;
//! unreachable → the test FAILS naming the start command). Each test makes
//! its own stream and deletes it at the end. Ledgers: the SQL inbox on
//! SQLite and PostgreSQL, and the store dedup on Redis.

mod common;

use std::sync::Arc;
use std::time::Duration;

use async_nats::jetstream::{
    self, consumer::pull, consumer::PullConsumer, message::PublishMessage,
};
use async_trait::async_trait;
use common::{eventually, payment, per_ledger, pg_ledger, sqlite_ledger, suffix, Broker, Ledger};
use futures::StreamExt;
use idem_mq::nats::{message_of, NatsConsumer, NatsOptions};
use idem_mq::{MessageKey, MissingIdPolicy, Outcome, Processor, Report};

const DUP_WINDOW: Duration = Duration::from_millis(200);

struct Js {
    js: jetstream::Context,
    stream: String,
    subject: String,
}

#[async_trait]
impl Broker for Js {
    async fn publish(&self, id: Option<&str>, payment_id: &str) {
        let mut m = PublishMessage::build().payload(payment(payment_id).into());
        if let Some(id) = id {
            m = m.message_id(id);
        }
        self.js
            .send_publish(self.subject.clone(), m)
            .await
            .unwrap()
            .await
            .unwrap();
    }
}

impl Js {
    async fn new() -> Self {
        let url = common::env_url("IDEM_TEST_NATS_URL", "nats://127.0.0.1:4222");
        let client = async_nats::ConnectOptions::new()
            .connection_timeout(Duration::from_secs(3))
            .connect(&url)
            .await
            .unwrap_or_else(|e| common::unreachable("NATS", &url, &e, common::START_NATS));
        let js = jetstream::new(client);
        let tag = suffix();
        let (stream, subject) = (
            format!("IDEMT_{}", tag.to_uppercase()),
            format!("idemt.{tag}"),
        );
        js.create_stream(jetstream::stream::Config {
            name: stream.clone(),
            subjects: vec![subject.clone()],
            // Short, so a test can re-publish an id after JetStream's own
            // publish dedup stopped catching it.
            duplicate_window: DUP_WINDOW,
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("creating stream {stream} (is JetStream on? `-js`): {e}"));
        Self {
            js,
            stream,
            subject,
        }
    }

    async fn consumer(&self, durable: &str, ack_wait: Duration) -> PullConsumer {
        self.js
            .get_stream(&self.stream)
            .await
            .unwrap()
            .create_consumer(pull::Config {
                durable_name: Some(durable.to_owned()),
                ack_policy: jetstream::consumer::AckPolicy::Explicit,
                ack_wait,
                ..Default::default()
            })
            .await
            .unwrap()
    }

    async fn idle(&self, consumer: &PullConsumer) -> bool {
        let mut c = consumer.clone();
        let info = c.info().await.unwrap();
        info.num_pending == 0 && info.num_ack_pending == 0
    }

    async fn delete(self) {
        self.js.delete_stream(&self.stream).await.unwrap();
    }
}

fn options(batch: usize) -> NatsOptions {
    NatsOptions {
        batch,
        wait: Duration::from_millis(500),
        retry_delay: Duration::from_millis(200),
        ..NatsOptions::default()
    }
}

/// Runs batches until the consumer is idle (nothing pending or unacked)
/// and `done` holds, bounded by 30 s.
async fn drain<L: Ledger>(
    js: &Js,
    c: &NatsConsumer<Arc<L>>,
    raw: &PullConsumer,
    want: usize,
) -> Report {
    let mut total = Report::default();
    let end = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        total.merge(&c.run_batch().await.unwrap());
        if c.processor().effects().await.len() >= want && js.idle(raw).await {
            return total;
        }
        assert!(
            tokio::time::Instant::now() < end,
            "not drained in 30 s: {total:?}"
        );
    }
}

/// Runs batches until `n` deliveries were received.
async fn received<P: Processor>(c: &NatsConsumer<P>, n: u64) -> Report {
    let mut report = Report::default();
    while report.received < n {
        report.merge(&c.run_batch().await.unwrap());
    }
    report
}

/// N distinct messages; some ids published again after JetStream's
/// duplicate window; a consumer that fetched 8 messages, committed 4 of
/// them, and stopped before acking any → exactly N effects.
async fn n_messages_with_duplicates<L: Ledger>(ledger: L) {
    let js = Js::new().await;
    let raw = js.consumer("payments", Duration::from_secs(1)).await;
    let n = 30;
    common::publish_with_duplicates(&js, n, DUP_WINDOW * 2).await;
    let ledger = Arc::new(ledger);
    // The consumer that dies before its acks.
    {
        let mut batch = raw.fetch().max_messages(8).messages().await.unwrap();
        let mut k = 0;
        while let Some(m) = batch.next().await {
            let m = m.unwrap();
            if k < 4 {
                let msg = message_of(&m, &options(8)).unwrap();
                assert!(matches!(ledger.process(&msg).await, Outcome::Applied));
            }
            k += 1;
            drop(m); // no ack
        }
        assert_eq!(k, 8);
    }
    let c = NatsConsumer::new(raw.clone(), ledger.clone(), options(10));
    let report = drain(&js, &c, &raw, n).await;
    common::assert_each_once(&*ledger, &report, n).await;
    // 10 re-published ids + the 4 committed-but-unacked redeliveries.
    assert!(report.duplicates >= 14, "{report:?}");
    assert_eq!(report.failed + report.rejected, 0, "{report:?}");
    ledger.cleanup().await;
    js.delete().await;
}

per_ledger!(n_messages_with_duplicates: all);

/// H2: committed, then the ack was lost (the consumer stopped) → the
/// redelivery is recognised, skipped and acked. And a crash before commit
/// → the redelivery is applied once.
async fn crash_windows<L: Ledger>(ledger: L) {
    let js = Js::new().await;
    let raw = js.consumer("payments", Duration::from_secs(1)).await;
    js.publish(Some("after-commit"), "after-commit").await;
    js.publish(Some("before-commit"), "before-commit").await;
    let ledger = Arc::new(ledger);
    {
        let mut batch = raw.fetch().max_messages(2).messages().await.unwrap();
        while let Some(m) = batch.next().await {
            let m = m.unwrap();
            let msg = message_of(&m, &options(2)).unwrap();
            if msg.key.as_ref().unwrap().raw_id() == "before-commit" {
                // The handler wrote, then the process died before COMMIT.
                ledger.fail_next(1);
                assert!(matches!(ledger.process(&msg).await, Outcome::Failed(_)));
            } else {
                assert!(matches!(ledger.process(&msg).await, Outcome::Applied));
            }
            // no ack, no nak: the consumer is gone
        }
    }
    let c = NatsConsumer::new(raw.clone(), ledger.clone(), options(10));
    let report = drain(&js, &c, &raw, 2).await;
    common::assert_crash_windows(&*ledger, &report).await;
    ledger.cleanup().await;
    js.delete().await;
}

per_ledger!(crash_windows: sql);

/// H1: one duplicate inside a batch is skipped and acked; the other five
/// are applied in the same pull; nothing stays unacked.
#[tokio::test]
async fn h1_duplicate_inside_a_batch_does_not_stall_it() {
    let js = Js::new().await;
    let raw = js.consumer("payments", Duration::from_secs(30)).await;
    let ledger = Arc::new(pg_ledger().await);
    // pay-3 was processed before (by this consumer, from this stream).
    common::processed_before(&*ledger, &js.stream, "pay-3").await;
    common::publish_payments(&js, 0..6).await;
    let c = NatsConsumer::new(raw.clone(), ledger.clone(), options(6));
    let report = received(&c, 6).await;
    assert_eq!(
        (report.applied, report.duplicates, report.ack_errors),
        (5, 1, 0),
        "{report:?}"
    );
    assert!(
        eventually(Duration::from_secs(10), || js.idle(&raw)).await,
        "all acked"
    );
    let effects = ledger.effects().await;
    assert_eq!(effects.len(), 6);
    assert!(effects.values().all(|&v| v == 1));
    ledger.cleanup().await;
    js.delete().await;
}

/// A handler that fails twice (after its write), then succeeds → one effect.
#[tokio::test]
async fn fails_twice_then_succeeds_once() {
    let js = Js::new().await;
    let raw = js.consumer("payments", Duration::from_secs(30)).await;
    let ledger = Arc::new(sqlite_ledger().await);
    ledger.fail_next(2);
    js.publish(Some("flaky"), "flaky").await;
    let c = NatsConsumer::new(raw.clone(), ledger.clone(), options(4));
    let report = drain(&js, &c, &raw, 1).await;
    assert_eq!((report.failed, report.applied), (2, 1), "{report:?}");
    assert_eq!(ledger.effects().await.get("flaky"), Some(&1));
    js.delete().await;
}

/// No `Nats-Msg-Id`: terminated, never processed (default); processed
/// without dedup only when the policy opts in.
#[tokio::test]
async fn missing_id_is_terminated_unless_opted_in() {
    let js = Js::new().await;
    let raw = js.consumer("payments", Duration::from_secs(30)).await;
    let ledger = Arc::new(sqlite_ledger().await);
    js.publish(None, "anon-1").await;
    let c = NatsConsumer::new(raw.clone(), ledger.clone(), options(4));
    let report = received(&c, 1).await;
    assert_eq!((report.rejected, report.applied), (1, 0), "{report:?}");
    assert!(
        eventually(Duration::from_secs(10), || js.idle(&raw)).await,
        "terminated, not pending"
    );
    assert!(ledger.effects().await.is_empty());

    js.publish(None, "anon-2").await;
    let opted = NatsConsumer::new(
        raw.clone(),
        ledger.clone(),
        NatsOptions {
            missing_id: MissingIdPolicy::ProcessWithoutDedup,
            ..options(4)
        },
    );
    let report = received(&opted, 1).await;
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(ledger.effects().await.get("anon-2"), Some(&1));
    js.delete().await;
}

/// Store dedup: a delivery whose id is claimed by a live lease elsewhere
/// (another consumer is processing it) is NAKed with a delay, not run; once
/// that claim is released, the redelivery runs it once.
#[tokio::test]
async fn in_flight_duplicate_is_naked_not_run() {
    use idem_core::{Begin, BeginRequest, Store};
    let js = Js::new().await;
    let raw = js.consumer("payments", Duration::from_secs(30)).await;
    let store = Arc::new(idem_core::MemoryStore::new());
    let dedup = Arc::new(
        idem_mq::Dedup::new(store.clone())
            .with_options(idem_mq::DedupOptions {
                lease: Duration::from_secs(30),
                retention: Duration::from_secs(600),
            })
            .unwrap()
            .with_handler(common::CountingCredit::default()),
    );
    // Another consumer holds pay-1 right now.
    let key = MessageKey::new("payments", "pay-1")
        .unwrap()
        .with_stream(&js.stream);
    let Begin::Acquired(lease) = store
        .begin(&BeginRequest {
            scope: key.scope(),
            key: key.idempotency_key(),
            fingerprint: idem_mq::message_fingerprint(),
            // The NAK delay is the time left on this lease.
            lease: Duration::from_secs(5),
        })
        .await
        .unwrap()
    else {
        panic!("fresh key");
    };
    js.publish(Some("pay-1"), "pay-1").await;
    let c = NatsConsumer::new(raw.clone(), dedup.clone(), options(4));
    let report = received(&c, 1).await;
    assert_eq!((report.in_flight, report.applied), (1, 0), "{report:?}");
    assert!(
        dedup.effects().await.is_empty(),
        "not run while the other holds it"
    );
    // The other consumer failed and released its claim: the redelivery runs.
    store.release(&lease).await.unwrap();
    let report = drain(&js, &c, &raw, 1).await;
    assert_eq!(report.applied, 1, "{report:?}");
    assert_eq!(dedup.effects().await.get("pay-1"), Some(&1));
    js.delete().await;
}
