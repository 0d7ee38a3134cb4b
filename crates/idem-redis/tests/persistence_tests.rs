//! `RedisStore::persistence` and `check_persistence` against private
//! `redis-server` processes started with and without AOF/RDB, and with
//! `CONFIG` renamed away (as managed Redis services do).
//!
//! `cargo test -p idem-redis --test persistence_tests`.

mod common;

use common::{connect, free_port, test_options, Server};
use idem_redis::{check_persistence, Persistence};

fn server(dir: &tempfile::TempDir, extra: &[&str]) -> Server {
    Server::start(free_port(), dir.path(), extra)
}

#[tokio::test]
async fn no_persistence_is_reported_with_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir, &["--appendonly", "no", "--save", ""]);
    let store = connect(&s.url(), test_options()).await;
    let p = store.persistence().await;
    assert_eq!(p, Persistence::Off);
    assert!(!p.survives_restart());
    let w = p.warning().expect("a warning");
    assert!(
        w.contains("appendonly yes") && w.contains("run again"),
        "{w}"
    );
    // The same through a connection of its own.
    let q = check_persistence(&s.url(), &test_options()).await.unwrap();
    assert_eq!(q, Persistence::Off);
}

#[tokio::test]
async fn aof_everysec_and_always_need_no_warning() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir, &["--appendonly", "yes"]);
    let p = check_persistence(&s.url(), &test_options()).await.unwrap();
    assert_eq!(
        p,
        Persistence::Aof {
            appendfsync: "everysec".into()
        }
    );
    assert!(p.survives_restart());
    assert_eq!(p.warning(), None);

    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir, &["--appendonly", "yes", "--appendfsync", "no"]);
    let p = check_persistence(&s.url(), &test_options()).await.unwrap();
    assert_eq!(
        p,
        Persistence::Aof {
            appendfsync: "no".into()
        }
    );
    assert!(p.warning().unwrap().contains("everysec"));
}

#[tokio::test]
async fn rdb_only_is_reported_with_its_schedule() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir, &["--appendonly", "no", "--save", "3600 1"]);
    let p = check_persistence(&s.url(), &test_options()).await.unwrap();
    assert_eq!(
        p,
        Persistence::Rdb {
            save: "3600 1".into()
        }
    );
    assert!(p.warning().unwrap().contains("since the last snapshot"));
}

#[tokio::test]
async fn without_config_info_is_read_and_the_rest_is_unknown() {
    let dir = tempfile::tempdir().unwrap();
    let s = server(&dir, &["--rename-command", "CONFIG", ""]);
    let p = check_persistence(&s.url(), &test_options()).await.unwrap();
    match &p {
        Persistence::Unknown { reason } => {
            assert!(reason.contains("CONFIG GET failed"), "{reason}");
            assert!(reason.contains("AOF is off"), "{reason}");
        }
        p => panic!("expected Unknown, got {p:?}"),
    }
    assert!(p.warning().unwrap().contains("could not be checked"));

    let dir = tempfile::tempdir().unwrap();
    let s = server(
        &dir,
        &["--appendonly", "yes", "--rename-command", "CONFIG", ""],
    );
    let p = check_persistence(&s.url(), &test_options()).await.unwrap();
    assert_eq!(
        p,
        Persistence::Aof {
            appendfsync: String::new()
        }
    );
}

#[tokio::test]
async fn an_unreachable_server_is_an_error() {
    let url = format!("redis://127.0.0.1:{}/", free_port());
    let e = check_persistence(&url, &test_options()).await.unwrap_err();
    assert!(
        matches!(
            e,
            idem_core::StoreError::Unavailable { .. } | idem_core::StoreError::Timeout { .. }
        ),
        "{e:?}"
    );
}
