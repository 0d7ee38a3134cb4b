//! Store URLs: which server(s) to talk to.

use idem_core::StoreError;
use redis::{ConnectionInfo, IntoConnectionInfo};

/// The URL forms [`RedisStore::connect`](crate::RedisStore::connect) accepts.
pub(crate) const SUPPORTED: &str = "redis://[user:password@]host[:port][/db], \
     rediss://… (TLS, feature `tls`), redis+unix:///path/to.sock, \
     redis+cluster://host:port,host:port[,…] (also rediss+cluster://)";

/// Where the store's data lives.
#[derive(Clone)]
pub(crate) enum Target {
    /// One Redis server (or a primary behind a fixed address).
    Single(Box<ConnectionInfo>),
    /// A Redis Cluster, by its seed nodes.
    Cluster(Vec<ConnectionInfo>),
}

impl std::fmt::Debug for Target {
    // Connection infos may hold a password: show only their shape.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Single(_) => f.write_str("Single"),
            Self::Cluster(n) => write!(f, "Cluster({} seed nodes)", n.len()),
        }
    }
}

impl Target {
    /// Parses a store URL.
    pub(crate) fn parse(url: &str) -> Result<Self, StoreError> {
        let url = url.trim();
        if url.contains('#') {
            // redis-rs reads `rediss://…#insecure` as "check no certificate".
            return Err(StoreError::Config(format!(
                "Redis URL takes no #fragment (#insecure, which turns off certificate \
                 checks, is refused); supported: {SUPPORTED}"
            )));
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            return Err(StoreError::Config(format!(
                "Redis URL has no scheme; supported: {SUPPORTED}"
            )));
        };
        match scheme.to_ascii_lowercase().as_str() {
            "redis" | "rediss" | "redis+unix" | "unix" => {
                if rest.is_empty() {
                    return Err(StoreError::Config(format!(
                        "Redis URL names no host; supported: {SUPPORTED}"
                    )));
                }
                Ok(Self::Single(Box::new(info(url)?)))
            }
            s @ ("redis+cluster" | "rediss+cluster") => {
                let base = s.trim_end_matches("+cluster");
                Ok(Self::Cluster(cluster_nodes(base, rest)?))
            }
            s => Err(StoreError::Config(format!(
                "unknown Redis URL scheme {s:?}; supported: {SUPPORTED}"
            ))),
        }
    }
}

/// A connection info for one node URL, with a readable error that does not
/// echo a password.
fn info(url: &str) -> Result<ConnectionInfo, StoreError> {
    url.into_connection_info().map_err(|e| {
        let hint = if cfg!(not(feature = "tls")) && url.to_ascii_lowercase().starts_with("rediss") {
            " (rediss:// needs idem-redis's `tls` feature)"
        } else {
            ""
        };
        StoreError::Config(format!("bad Redis URL: {e}{hint}; supported: {SUPPORTED}"))
    })
}

/// `[user:pass@]h1:p1,h2:p2[/][?query]` → one node URL per host.
fn cluster_nodes(base: &str, rest: &str) -> Result<Vec<ConnectionInfo>, StoreError> {
    let cut = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(cut);
    let (path, query) = tail.split_once('?').unwrap_or((tail, ""));
    if !(path.is_empty() || path == "/" || path == "/0") {
        return Err(StoreError::Config(format!(
            "a Redis Cluster has only database 0; remove {path:?} from the URL"
        )));
    }
    let (userinfo, hosts) = match authority.rfind('@') {
        Some(at) => (&authority[..=at], &authority[at + 1..]),
        None => ("", authority),
    };
    let query = if query.is_empty() {
        String::new()
    } else {
        format!("/?{query}")
    };
    let nodes = hosts
        .split(',')
        .map(str::trim)
        .filter(|h| !h.is_empty())
        .map(|h| info(&format!("{base}://{userinfo}{h}{query}")))
        .collect::<Result<Vec<_>, _>>()?;
    if nodes.is_empty() {
        return Err(StoreError::Config(format!(
            "Redis Cluster URL names no node; supported: {SUPPORTED}"
        )));
    }
    Ok(nodes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use redis::ConnectionAddr;

    fn tcp(i: &ConnectionInfo) -> (String, u16) {
        match i.addr() {
            ConnectionAddr::Tcp(h, p) => (h.clone(), *p),
            other => panic!("not plain TCP: {other:?}"),
        }
    }

    #[test]
    fn single_node_forms() {
        let Target::Single(i) = Target::parse("redis://127.0.0.1:6380/2").expect("parse") else {
            panic!("single")
        };
        assert_eq!(tcp(&i), ("127.0.0.1".into(), 6380));
        assert_eq!(i.redis_settings().db(), 2);
        let Target::Single(i) = Target::parse("redis://u:p%40ss@localhost").expect("parse") else {
            panic!("single")
        };
        assert_eq!(i.redis_settings().password(), Some("p@ss"));
        assert_eq!(tcp(&i).1, 6379);
        assert!(matches!(
            Target::parse("redis+unix:///run/redis.sock"),
            Ok(Target::Single(_))
        ));
    }

    #[test]
    fn cluster_forms() {
        let Target::Cluster(nodes) = Target::parse(
            "redis+cluster://u:pw@127.0.0.1:7000, 127.0.0.1:7001,[::1]:7002/?protocol=3",
        )
        .expect("parse") else {
            panic!("cluster")
        };
        assert_eq!(nodes.len(), 3);
        assert_eq!(tcp(&nodes[0]), ("127.0.0.1".into(), 7000));
        assert_eq!(tcp(&nodes[1]), ("127.0.0.1".into(), 7001));
        assert_eq!(tcp(&nodes[2]).1, 7002);
        for n in &nodes {
            assert_eq!(n.redis_settings().password(), Some("pw"));
            assert_eq!(n.redis_settings().username(), Some("u"));
        }
    }

    #[test]
    fn bad_urls_are_config_errors_without_secrets() {
        for bad in [
            "",
            "127.0.0.1:6379",
            "postgres://localhost/x",
            "redis://",
            "redis+cluster://",
            "redis+cluster://h:1,h:2/3",
            "redis://u:secret@host:notaport",
            "rediss://u:secret@host:6380#insecure",
            "rediss+cluster://h:1,h:2#insecure",
        ] {
            match Target::parse(bad) {
                Err(StoreError::Config(msg)) => {
                    assert!(!msg.contains("secret"), "{bad:?}: {msg}")
                }
                other => panic!("{bad:?} must be a config error, got {other:?}"),
            }
        }
    }
}
