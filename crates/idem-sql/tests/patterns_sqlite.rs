//! `idem_sql::patterns` on SQLite (a WAL file shared by a pool of
//! connections, so races are real).

mod patterns_common;

use idem_sql::patterns::{InsertOrGet, PatternError, StateMachine, Transition};
use patterns_common::{self as pc, servers, Backend};
use sqlx::Connection;

type Sqlite = pc::Db<sqlx::Sqlite>;

async fn sqlite() -> Sqlite {
    let dir = tempfile::tempdir().expect("tempdir");
    let pool = servers::sqlite_file_pool(
        &dir.path().join("p.db"),
        20,
        std::time::Duration::from_secs(30),
    )
    .await;
    Sqlite {
        keep: Some(Box::new(dir)),
        ..Sqlite::new(pool, "INTEGER PRIMARY KEY")
    }
}

pc::pattern_checks!(
    sqlite(),
    pc::close,
    transactions:
    /// Deferred transactions, opened before the start line (an IMMEDIATE
    /// one would take the write lock there, before its task runs); with no
    /// read before the insert, no snapshot can go stale.
    insert_or_get_16_transactions = |pool, _| async move {
        Some(pool.begin().await.expect("begin"))
    }
);

#[test]
fn bad_identifiers() {
    pc::bad_identifiers();
}

/// A read transaction whose snapshot went stale cannot write: the
/// transition is refused with the typed retryable error, never a wrong
/// answer.
#[tokio::test]
async fn stale_read_snapshot_is_a_serialization_failure() {
    let b = sqlite().await;
    let (t, sm) = pc::state_machine(&b, 1).await;
    let mut reader = b.pool.acquire().await.unwrap();
    let mut tx = reader.begin().await.unwrap();
    let seen: String =
        pc::scalar_in(&mut *tx, &format!("SELECT state FROM {t} WHERE id = 0")).await;
    assert_eq!(seen, "pending");
    pc::complete_elsewhere(&b, &sm, 0).await;
    pc::expect_serialization_failure(sm.transition(&mut *tx, 0, &["pending"], "cancelled").await);
    tx.rollback().await.unwrap();
    // Retried in a fresh transaction: the current state.
    let mut tx = reader.begin().await.unwrap();
    pc::expect_cancel_conflicts(&sm, &mut *tx).await;
    tx.commit().await.unwrap();
}

/// Text ids and keys, and a `main.` schema prefix.
#[tokio::test]
async fn text_ids_and_schema_prefix() {
    let b = sqlite().await;
    b.exec("CREATE TABLE tx_ids (id TEXT PRIMARY KEY, k TEXT UNIQUE NOT NULL, state TEXT)")
        .await;
    let iog = InsertOrGet::new("main.tx_ids", "id", "k").unwrap();
    let mut c = b.pool.acquire().await.unwrap();
    let made = iog
        .insert_or_get(
            &mut *c,
            "k1",
            &[("id", "ü-1".into()), ("state", "new".into())],
        )
        .await
        .unwrap();
    assert_eq!((made.id.as_str(), made.inserted), (Some("ü-1"), true));
    let again = iog
        .insert_or_get(&mut *c, "k1", &[("id", "other".into())])
        .await
        .unwrap();
    assert_eq!((again.id.as_str(), again.inserted), (Some("ü-1"), false));
    let sm = StateMachine::new("main.tx_ids", "id", "state").unwrap();
    assert_eq!(
        sm.transition(&mut *c, "ü-1", &["new"], "done")
            .await
            .unwrap(),
        Transition::Transitioned
    );
}

/// Another connection holds the write lock past the busy timeout: `Busy`
/// (retryable), nothing written; once it commits, the call succeeds.
#[tokio::test]
async fn busy_writer_is_a_typed_retryable_error() {
    let b = sqlite().await;
    let (t, iog) = pc::keyed_insert_or_get(&b).await;
    let mut holder = b.pool.acquire().await.unwrap();
    let tx = holder.begin_with("BEGIN IMMEDIATE").await.unwrap();
    let mut impatient = sqlx::SqliteConnection::connect_with(
        &b.pool
            .connect_options()
            .as_ref()
            .clone()
            .busy_timeout(std::time::Duration::from_millis(200)),
    )
    .await
    .unwrap();
    match iog.insert_or_get(&mut impatient, "k", &[]).await {
        Err(e @ PatternError::Busy { .. }) => assert!(e.is_retryable()),
        other => panic!("expected Busy, got {other:?}"),
    }
    let sm = StateMachine::new(&t, "id", "note").unwrap();
    match sm.transition(&mut impatient, 1, &["a"], "b").await {
        Err(PatternError::Busy { .. }) => {}
        other => panic!("expected Busy, got {other:?}"),
    }
    tx.commit().await.unwrap();
    assert!(
        iog.insert_or_get(&mut impatient, "k", &[])
            .await
            .unwrap()
            .inserted
    );
}

/// SQLite binds each value with its own storage class, so a cached
/// statement run with a `Text` id after an `I64` one compares the text (by
/// the column's INTEGER affinity: the number 12345678), never reinterprets
/// it: row 3544952156018063160 is untouched. A key column without a UNIQUE
/// index is refused by the database (ON CONFLICT does not match).
#[tokio::test]
async fn another_value_type_on_the_same_connection_is_sent_as_itself() {
    let b = sqlite().await;
    let victim = i64::from_be_bytes(*b"12345678");
    b.exec(&format!(
        "CREATE TABLE types (id INTEGER PRIMARY KEY, state TEXT NOT NULL, n INTEGER NOT NULL DEFAULT 0); \
         INSERT INTO types (id, state) VALUES (1, 'a'), (2, 'a'), ({victim}, 'a'); \
         CREATE TABLE plain (id INTEGER PRIMARY KEY, k TEXT NOT NULL)"
    ))
    .await;
    let m = StateMachine::new("types", "id", "state").unwrap();
    let mut c = b.pool.acquire().await.unwrap();
    pc::text_id_after_int_id(&m, &mut *c).await;
    let plain = InsertOrGet::new("plain", "id", "k").unwrap();
    let r = plain.insert_or_get(&mut *c, "x", &[]).await;
    assert!(matches!(r, Err(PatternError::Database { .. })), "{r:?}");
    drop(c);
    assert_eq!(
        b.text(&format!("SELECT state FROM types WHERE id = {victim}"))
            .await
            .as_deref(),
        Some("a")
    );
    assert_eq!(b.int("SELECT COUNT(*) FROM plain").await, 0);
}
