//! What a Redis server keeps on disk, and so what a restart forgets.
//!
//! idem's records live in Redis memory. Without persistence a restarted
//! Redis has forgotten every completed key, and a client's retry of one of
//! them runs its operation **again**. [`RedisStore::persistence`] and
//! [`check_persistence`] read the server's settings (`CONFIG GET
//! appendonly appendfsync save`, falling back to `INFO persistence` where
//! `CONFIG` is disabled, as on most managed Redis services) so a program
//! can warn at start; [`Persistence::warning`] is the text to log.

use std::time::Duration;

use idem_core::{Phase, StoreError};
use redis::Value;

use crate::conn::{self, Conn, ConnectSettings, NoPush};
use crate::target::Target;
use crate::{RedisOptions, RedisStore};

/// What a Redis server persists, as [`RedisStore::persistence`] and
/// [`check_persistence`] read it. On a Redis Cluster every node that
/// answered is read and the weakest setting is reported.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Persistence {
    /// The append-only file is on (`appendonly yes`): every write is logged
    /// and replayed at restart.
    Aof {
        /// `appendfsync`: `always` (each write is on disk before Redis
        /// answers), `everysec` (at most about one second of writes is lost
        /// on a crash), `no` (the operating system decides, often 30 s);
        /// empty when it could not be read.
        appendfsync: String,
    },
    /// Only RDB snapshots (`save` set, `appendonly no`): a restart loses
    /// every write since the last snapshot.
    Rdb {
        /// The `save` schedule, e.g. `3600 1 300 100 60 10000`
        /// (seconds and changes).
        save: String,
    },
    /// Neither AOF nor RDB (`appendonly no`, `save ""`): a restart forgets
    /// every record.
    Off,
    /// The settings could not be read (`CONFIG` disabled or not permitted,
    /// and `INFO persistence` did not say that AOF is on).
    Unknown {
        /// Why, with the server's own message.
        reason: String,
    },
}

impl Persistence {
    /// Whether a Redis restart (not a crash) keeps the completed records:
    /// AOF or RDB is on. `false` for [`Persistence::Unknown`].
    pub fn survives_restart(&self) -> bool {
        matches!(self, Persistence::Aof { .. } | Persistence::Rdb { .. })
    }

    /// The warning for an operator, or `None` when AOF is on with
    /// `appendfsync always` or `everysec`.
    pub fn warning(&self) -> Option<String> {
        const AOF: &str = "`appendonly yes` with `appendfsync everysec` (at most about a second \
                           of records lost on a crash) or `appendfsync always` (none) makes a \
                           restart keep them";
        match self {
            Persistence::Aof { appendfsync }
                if appendfsync == "always" || appendfsync == "everysec" =>
            {
                None
            }
            Persistence::Aof { appendfsync } => Some(format!(
                "Redis has AOF on with appendfsync {:?}: a crash of the machine can lose the \
                 last records written (often 30 s), and those keys then run again; \
                 `appendfsync everysec` loses at most about a second, `always` none",
                appendfsync
            )),
            Persistence::Rdb { save } => Some(format!(
                "Redis persists only RDB snapshots (save {save:?}): a restart forgets the keys \
                 completed since the last snapshot, and their retries run again; {AOF}"
            )),
            Persistence::Off => Some(format!(
                "Redis has no persistence (appendonly no, save \"\"): a restart forgets every \
                 completed key, and its retries run again; {AOF}"
            )),
            Persistence::Unknown { reason } => Some(format!(
                "Redis persistence could not be checked ({reason}): make sure the server runs \
                 with `appendonly yes` (and `appendfsync everysec` or `always`), or a restart \
                 forgets completed keys and their retries run again"
            )),
        }
    }
}

impl std::fmt::Display for Persistence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Persistence::Aof { appendfsync } => write!(f, "aof (appendfsync {appendfsync})"),
            Persistence::Rdb { save } => write!(f, "rdb (save {save})"),
            Persistence::Off => f.write_str("none"),
            Persistence::Unknown { .. } => f.write_str("unknown"),
        }
    }
}

impl RedisStore {
    /// Reads what the server persists (see [`Persistence`]), within the
    /// store's response timeout. Never fails: a server that cannot be read
    /// is [`Persistence::Unknown`] with the reason.
    ///
    /// ```no_run
    /// # async fn f() -> Result<(), idem_core::StoreError> {
    /// let store = idem_redis::RedisStore::connect("redis://127.0.0.1:6379/").await?;
    /// if let Some(w) = store.persistence().await.warning() {
    ///     eprintln!("warning: {w}");
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn persistence(&self) -> Persistence {
        let mut conn = self.connection();
        read(&mut conn, self.options().response_timeout).await
    }
}

/// Connects to the Redis named by `url` (as [`RedisStore::connect_with`]
/// does, without loading scripts), reads what it persists, and closes the
/// connection. For a program that holds its store as a `dyn Store`.
///
/// ```no_run
/// # async fn f() -> Result<(), idem_core::StoreError> {
/// use idem_redis::{check_persistence, Persistence, RedisOptions};
/// let p = check_persistence("redis://127.0.0.1:6379/", &RedisOptions::default()).await?;
/// assert!(matches!(p, Persistence::Aof { .. }), "{p}");
/// # Ok(()) }
/// ```
///
/// # Errors
/// [`StoreError::Config`] for a malformed URL or invalid options;
/// [`StoreError::Unavailable`] / [`StoreError::Timeout`] (phase `Connect`)
/// when the server cannot be reached within the connection timeout. A
/// server that refuses `CONFIG` is not an error: [`Persistence::Unknown`].
pub async fn check_persistence(
    url: &str,
    options: &RedisOptions,
) -> Result<Persistence, StoreError> {
    options.validate()?;
    let target = Target::parse(url)?;
    let settings = ConnectSettings::new(options);
    let mut conn = conn::bounded(
        Phase::Connect,
        options.connection_timeout,
        conn::open(&target, &settings, None::<NoPush>),
    )
    .await?;
    Ok(read(&mut conn, options.response_timeout).await)
}

/// `CONFIG GET`, then `INFO persistence` where `CONFIG` is refused.
async fn read(conn: &mut Conn, limit: Duration) -> Persistence {
    let mut get = redis::cmd("CONFIG");
    get.arg("GET")
        .arg("appendonly")
        .arg("appendfsync")
        .arg("save");
    let config_error = match tokio::time::timeout(limit, get.query_async::<Value>(conn)).await {
        Ok(Ok(reply)) => match from_config(&reply) {
            Some(p) => return p,
            None => "CONFIG GET answered without appendonly".to_owned(),
        },
        Ok(Err(e)) => format!("CONFIG GET failed: {e}"),
        Err(_) => format!("CONFIG GET got no answer within {limit:?}"),
    };
    let mut info = redis::cmd("INFO");
    info.arg("persistence");
    match tokio::time::timeout(limit, info.query_async::<Value>(conn)).await {
        Ok(Ok(reply)) => from_info(&reply, config_error),
        Ok(Err(e)) => Persistence::Unknown {
            reason: format!("{config_error}; INFO persistence failed: {e}"),
        },
        Err(_) => Persistence::Unknown {
            reason: format!("{config_error}; INFO persistence got no answer"),
        },
    }
}

/// Reads a `CONFIG GET appendonly appendfsync save` reply (one node's
/// pairs, or a Cluster's map of node → pairs); `None` without
/// `appendonly`.
fn from_config(reply: &Value) -> Option<Persistence> {
    let mut nodes: Vec<Vec<(String, String)>> = Vec::new();
    pairs_by_node(reply, &mut nodes);
    let mut weakest: Option<Persistence> = None;
    for pairs in nodes {
        let get = |name: &str| {
            pairs
                .iter()
                .find(|(n, _)| n.eq_ignore_ascii_case(name))
                .map(|(_, v)| v.trim().to_owned())
        };
        let aof = get("appendonly")?;
        let p = if aof.eq_ignore_ascii_case("yes") {
            Persistence::Aof {
                appendfsync: get("appendfsync").unwrap_or_default(),
            }
        } else {
            match get("save") {
                Some(save) if !save.is_empty() => Persistence::Rdb { save },
                _ => Persistence::Off,
            }
        };
        weakest = Some(match weakest {
            Some(w) if rank(&w) <= rank(&p) => w,
            _ => p,
        });
    }
    weakest
}

/// How much a setting keeps: lower is weaker.
fn rank(p: &Persistence) -> u8 {
    match p {
        Persistence::Off | Persistence::Unknown { .. } => 0,
        Persistence::Rdb { .. } => 1,
        Persistence::Aof { appendfsync } if appendfsync == "no" => 2,
        Persistence::Aof { .. } => 3,
    }
}

/// Splits a reply into each node's `(name, value)` pairs: a flat array or
/// RESP3 map is one node; a map whose values are arrays or maps (redis-rs'
/// answer from several Cluster nodes) is one node per value.
fn pairs_by_node(reply: &Value, out: &mut Vec<Vec<(String, String)>>) {
    match reply {
        Value::Map(entries)
            if entries
                .iter()
                .all(|(_, v)| matches!(v, Value::Array(_) | Value::Map(_))) =>
        {
            for (_, v) in entries {
                pairs_by_node(v, out);
            }
        }
        Value::Map(entries) => out.push(
            entries
                .iter()
                .filter_map(|(k, v)| Some((text(k)?, text(v)?)))
                .collect(),
        ),
        Value::Array(items) => {
            let words: Vec<String> = items.iter().filter_map(text).collect();
            out.push(
                words
                    .chunks_exact(2)
                    .map(|c| (c[0].clone(), c[1].clone()))
                    .collect(),
            );
        }
        _ => {}
    }
}

fn text(v: &Value) -> Option<String> {
    match v {
        Value::BulkString(b) => Some(String::from_utf8_lossy(b).into_owned()),
        Value::SimpleString(s) => Some(s.clone()),
        Value::VerbatimString { text, .. } => Some(text.clone()),
        _ => None,
    }
}

/// Reads `INFO persistence`: `aof_enabled:1` on every node is AOF (its
/// fsync policy is not in INFO); otherwise the RDB schedule is unknown.
fn from_info(reply: &Value, config_error: String) -> Persistence {
    let mut texts = Vec::new();
    all_text(reply, &mut texts);
    let flags: Vec<bool> = texts
        .iter()
        .flat_map(|t| t.lines())
        .filter_map(|l| l.trim().strip_prefix("aof_enabled:"))
        .map(|v| v.trim() == "1")
        .collect();
    if !flags.is_empty() && flags.iter().all(|on| *on) {
        return Persistence::Aof {
            appendfsync: String::new(),
        };
    }
    let aof = if flags.is_empty() {
        "INFO does not say whether AOF is on"
    } else {
        "INFO says AOF is off"
    };
    Persistence::Unknown {
        reason: format!(
            "{config_error}; {aof}, and the RDB schedule cannot be read without CONFIG"
        ),
    }
}

fn all_text(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Array(items) | Value::Set(items) => items.iter().for_each(|i| all_text(i, out)),
        Value::Map(pairs) => pairs.iter().for_each(|(_, v)| all_text(v, out)),
        other => out.extend(text(other)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn flat(pairs: &[(&str, &str)]) -> Value {
        Value::Array(pairs.iter().flat_map(|(k, v)| [bulk(k), bulk(v)]).collect())
    }

    #[test]
    fn config_replies() {
        let off = flat(&[
            ("appendonly", "no"),
            ("appendfsync", "everysec"),
            ("save", ""),
        ]);
        assert_eq!(from_config(&off), Some(Persistence::Off));
        let rdb = flat(&[("save", "3600 1"), ("appendonly", "no")]);
        assert_eq!(
            from_config(&rdb),
            Some(Persistence::Rdb {
                save: "3600 1".into()
            })
        );
        let aof = flat(&[
            ("appendonly", "yes"),
            ("appendfsync", "always"),
            ("save", ""),
        ]);
        let p = from_config(&aof).unwrap();
        assert_eq!(
            p,
            Persistence::Aof {
                appendfsync: "always".into()
            }
        );
        assert_eq!(p.warning(), None);
        assert!(Persistence::Off
            .warning()
            .unwrap()
            .contains("appendonly yes"));
        assert_eq!(from_config(&flat(&[("save", "")])), None);
    }

    #[test]
    fn a_cluster_reports_its_weakest_node() {
        let reply = Value::Map(vec![
            (
                bulk("n1:7000"),
                flat(&[("appendonly", "yes"), ("appendfsync", "everysec")]),
            ),
            (bulk("n2:7001"), flat(&[("appendonly", "no"), ("save", "")])),
        ]);
        assert_eq!(from_config(&reply), Some(Persistence::Off));
    }

    #[test]
    fn info_fallback() {
        let on = bulk("# Persistence\r\nloading:0\r\naof_enabled:1\r\n");
        assert!(matches!(
            from_info(&on, "x".into()),
            Persistence::Aof { .. }
        ));
        let off = bulk("# Persistence\r\naof_enabled:0\r\n");
        match from_info(&off, "CONFIG GET failed: NOPERM".into()) {
            Persistence::Unknown { reason } => {
                assert!(
                    reason.contains("NOPERM") && reason.contains("AOF is off"),
                    "{reason}"
                );
            }
            p => panic!("{p:?}"),
        }
    }
}
