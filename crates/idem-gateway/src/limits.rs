//! How many client connections the gateway accepts at once: the smaller of
//! `--max-connections` and what the process's file-descriptor limit
//! (`RLIMIT_NOFILE`) leaves once the store and the upstream have their
//! share.

/// File descriptors kept for everything but client connections and their
/// upstream connections: standard streams, the listening socket, the
/// runtime's epoll and wake-up descriptors, a log file, DNS look-ups, a
/// SQLite store's files (4 connections × database, WAL and shared memory)
/// or a Redis store's connections.
pub(crate) const SLACK_FDS: u64 = 32;

/// The connection cap the gateway runs with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ConnectionCap {
    /// Client connections served at once (and guarded or proxied requests
    /// in flight at once, so that HTTP/2 streams cannot open more upstream
    /// connections than that).
    pub(crate) connections: usize,
    /// The soft `RLIMIT_NOFILE` read at start (`None`: unlimited or not a
    /// Unix system).
    pub(crate) nofile: Option<u64>,
    /// Descriptors kept back from client connections: the store's pool
    /// plus [`SLACK_FDS`].
    pub(crate) reserve: u64,
}

impl ConnectionCap {
    /// Whether the descriptor limit, not `--max-connections`, sets the cap.
    pub(crate) fn limited_by_nofile(&self, max_connections: usize) -> bool {
        self.connections < max_connections
    }
}

/// The soft `RLIMIT_NOFILE` of this process, `None` when unlimited (or on
/// a system without it).
pub(crate) fn nofile() -> Option<u64> {
    #[cfg(unix)]
    {
        rustix::process::getrlimit(rustix::process::Resource::Nofile).current
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// The cap for `max_connections` and a store pool of `pool_size` under a
/// descriptor limit of `nofile`: each client connection is counted with one
/// upstream connection, so the cap is
/// `min(max_connections, (nofile − pool_size − SLACK_FDS) / 2)`.
///
/// # Errors
/// [`NoRoom`] when the limit leaves room for no connection at all (the
/// configuration reports it as `ConfigError::NoRoomForConnections`).
pub(crate) fn connection_cap(
    max_connections: usize,
    pool_size: u32,
    nofile: Option<u64>,
) -> Result<ConnectionCap, NoRoom> {
    let reserve = u64::from(pool_size) + SLACK_FDS;
    let connections = match nofile {
        None => max_connections,
        Some(n) => {
            let room = n.saturating_sub(reserve) / 2;
            if room == 0 {
                return Err(NoRoom { nofile: n, reserve });
            }
            usize::try_from(room).map_or(max_connections, |r| r.min(max_connections))
        }
    };
    Ok(ConnectionCap {
        connections,
        nofile,
        reserve,
    })
}

/// A descriptor limit that leaves room for no client connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct NoRoom {
    /// The soft limit read at start.
    pub(crate) nofile: u64,
    /// The descriptors kept back.
    pub(crate) reserve: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cap_is_the_smaller_of_the_flag_and_the_room() {
        let c = connection_cap(10_000, 16, Some(1024)).unwrap();
        assert_eq!(c.connections, (1024 - 48) / 2);
        assert_eq!(c.reserve, 48);
        assert!(c.limited_by_nofile(10_000));
        assert_eq!(
            connection_cap(100, 16, Some(1 << 20)).unwrap().connections,
            100
        );
        assert_eq!(connection_cap(100, 16, None).unwrap().connections, 100);
        assert_eq!(connection_cap(100, 16, Some(50)).unwrap().connections, 1);
        for tight in [49, 48, 20, 0] {
            assert!(
                matches!(connection_cap(100, 16, Some(tight)), Err(NoRoom { .. })),
                "{tight}"
            );
        }
    }

    #[test]
    fn reads_the_limit() {
        // Whatever the test runner's limit, it is above the reserve.
        if let Some(n) = nofile() {
            assert!(n > 0);
        }
    }
}
