//! The Lua scripts, one per step, embedded at build time.
//!
//! Each is `lua/lib.lua` (shared helpers) followed by the step's own file.
//! A step sends `EVALSHA`; on `NOSCRIPT` (a restarted or flushed server, a
//! new Cluster primary) it sends the same call as `EVAL` with the full
//! source, which cannot fail with `NOSCRIPT` and caches the script on that
//! server again. So no step depends on an earlier `SCRIPT LOAD`, and a
//! `SCRIPT FLUSH` racing with the retry cannot make it fail either.

use std::sync::LazyLock;

use redis::{ErrorKind, RedisResult, Script, ServerErrorKind, Value};

use crate::conn::Conn;

/// One embedded script: its source and its SHA-1 (for `EVALSHA`).
#[derive(Debug)]
pub(crate) struct Lua {
    script: Script,
    source: &'static str,
}

impl Lua {
    pub(crate) fn new(source: &'static str) -> Self {
        Self {
            script: Script::new(source),
            source,
        }
    }

    /// The script for `SCRIPT LOAD`.
    pub(crate) fn script(&self) -> &Script {
        &self.script
    }

    /// The SHA-1 of the source, lowercase hex.
    pub(crate) fn hash(&self) -> &str {
        self.script.get_hash()
    }

    /// The full source, for `EVAL`.
    pub(crate) fn source(&self) -> &'static str {
        self.source
    }
}

/// Calls a script by its SHA-1 `hash` with `keys` and `args` (`EVALSHA`),
/// and on `NOSCRIPT` sends the same call as `EVAL` with its `source`.
/// Unbounded: the caller puts its own timeout around it.
pub(crate) async fn eval(
    conn: &mut Conn,
    hash: &str,
    source: &str,
    keys: &[&str],
    args: &[&[u8]],
) -> RedisResult<Value> {
    let call = |first: &str, body: &str| {
        let mut c = redis::cmd(first);
        c.arg(body).arg(keys.len());
        for k in keys {
            c.arg(*k);
        }
        for a in args {
            c.arg(*a);
        }
        c
    };
    match call("EVALSHA", hash).query_async(conn).await {
        Err(e) if e.kind() == ErrorKind::Server(ServerErrorKind::NoScript) => {
            call("EVAL", source).query_async(conn).await
        }
        other => other,
    }
}

macro_rules! lua {
    ($file:literal) => {
        LazyLock::new(|| {
            Lua::new(concat!(
                include_str!("../lua/lib.lua"),
                include_str!(concat!("../lua/", $file))
            ))
        })
    };
}

pub(crate) static BEGIN: LazyLock<Lua> = lua!("begin.lua");
pub(crate) static COMPLETE: LazyLock<Lua> = lua!("complete.lua");
pub(crate) static RELEASE: LazyLock<Lua> = lua!("release.lua");
pub(crate) static EXTEND: LazyLock<Lua> = lua!("extend.lua");
pub(crate) static HOLD: LazyLock<Lua> = lua!("hold.lua");
pub(crate) static GET: LazyLock<Lua> = lua!("get.lua");
pub(crate) static DELETE: LazyLock<Lua> = lua!("delete.lua");
pub(crate) static PURGE: LazyLock<Lua> = lua!("purge.lua");

/// Every script, for loading them all at connect time.
pub(crate) fn all() -> [&'static Lua; 8] {
    [
        &BEGIN, &COMPLETE, &RELEASE, &EXTEND, &HOLD, &GET, &DELETE, &PURGE,
    ]
}
