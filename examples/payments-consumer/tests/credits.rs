//! The example end to end: payments published (some twice) to NATS
//! JetStream / RabbitMQ, consumed into SQLite through the inbox → each
//! account credited once per payment. Real servers (`IDEM_TEST_NATS_URL`,
//! `IDEM_TEST_AMQP_URL`); unreachable → the test fails naming the start command.

use std::time::Duration;

use payments_consumer::{consume, publish, Ledger, PaymentCaptured, Source};
use rand::Rng;

fn tag() -> String {
    format!(
        "{:012x}",
        rand::thread_rng().gen::<u64>() & 0xffff_ffff_ffff
    )
}

async fn run(broker: &str, start: &str) {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("payments.db").display());
    let t = tag();
    let source = Source {
        broker: broker.to_owned(),
        stream: format!("PAYT_{}", t.to_uppercase()),
        subject: format!("payt.{t}"),
        consumer: format!("payments-{t}"),
    };
    let payments: Vec<PaymentCaptured> = (0..5)
        .map(|i| PaymentCaptured {
            payment_id: format!("p-{i}"),
            account: if i % 2 == 0 {
                "alice".into()
            } else {
                "bob".into()
            },
            amount_cents: 100 * (i + 1),
        })
        .collect();
    for p in payments.iter().chain(payments.iter().take(2)) {
        publish(&source, p)
            .await
            .unwrap_or_else(|e| panic!("publishing to {broker} failed ({e}: {:?}); is the broker up? Start it with:\n    {start}", std::error::Error::source(&e)));
    }
    let ledger = Ledger::open(&db).await.unwrap();
    let watcher = Ledger::open(&db).await.unwrap();
    let done = async {
        let end = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::time::Instant::now() < end {
            if watcher.balance("alice").await.unwrap() == 100 + 300 + 500
                && watcher.balance("bob").await.unwrap() == 200 + 400
            {
                // Give the duplicates time to arrive and be skipped.
                tokio::time::sleep(Duration::from_secs(1)).await;
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    let report = consume(&source, ledger, done).await.unwrap();
    assert_eq!(watcher.balance("alice").await.unwrap(), 900, "{report:?}");
    assert_eq!(watcher.balance("bob").await.unwrap(), 600, "{report:?}");
    for p in &payments {
        assert_eq!(watcher.credits_for(&p.payment_id).await.unwrap(), 1);
    }
    assert_eq!(report.applied, 5, "{report:?}");
    cleanup(&source).await;
}

async fn cleanup(source: &Source) {
    if source.broker.starts_with("nats://") {
        let client = async_nats::connect(&source.broker).await.unwrap();
        async_nats::jetstream::new(client)
            .delete_stream(&source.stream)
            .await
            .unwrap();
    } else {
        let conn =
            lapin::Connection::connect(&source.broker, lapin::ConnectionProperties::default())
                .await
                .unwrap();
        let ch = conn.create_channel().await.unwrap();
        ch.queue_delete(&source.subject, Default::default())
            .await
            .unwrap();
        let _ = conn.close(200, "done").await;
    }
}

#[tokio::test]
async fn nats_into_sqlite_credits_once() {
    let url =
        std::env::var("IDEM_TEST_NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".into());
    run(&url, "start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- -a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log").await;
}

#[tokio::test]
async fn rabbitmq_into_sqlite_credits_once() {
    let url = std::env::var("IDEM_TEST_AMQP_URL")
        .unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into());
    run(&url, "rabbitmq-server -detached").await;
}
