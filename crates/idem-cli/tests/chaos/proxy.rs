//! A fault-injecting TCP proxy for one link (a gateway's store connection
//! or its upstream connection), in the test process.
//!
//! Modes, switched at any time: [`Mode::Pass`] forwards bytes as they come;
//! [`Mode::Delay`] holds every chunk for a while before forwarding it;
//! [`Mode::Blackhole`] accepts connections and forwards nothing (bytes
//! are held, as a network partition holds segments, and flow on when the
//! mode changes — unless the connection is reset first); [`Mode::Refuse`]
//! resets each new connection at once. [`FaultProxy::reset_all`] resets
//! every open connection (RST, `SO_LINGER` 0) in both directions.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does with bytes and connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Forward at once.
    Pass,
    /// Hold each chunk this long, then forward it.
    Delay(Duration),
    /// Accept, forward nothing (bytes wait until the mode changes).
    Blackhole,
    /// Reset new connections as they are accepted.
    Refuse,
}

/// One proxy: listens on a free loopback port, forwards to `target`.
pub struct FaultProxy {
    /// Where clients connect (the gateway is given this address).
    pub addr: SocketAddr,
    mode: watch::Sender<Mode>,
    resets: watch::Sender<u64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    /// Starts a proxy in [`Mode::Pass`] on a free port.
    pub async fn start(target: SocketAddr) -> Arc<Self> {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().unwrap();
        let (mode, mode_rx) = watch::channel(Mode::Pass);
        let (resets, resets_rx) = watch::channel(0u64);
        let task = tokio::spawn(async move {
            loop {
                let Ok((client, _)) = listener.accept().await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                if *mode_rx.borrow() == Mode::Refuse {
                    let _ = client.set_zero_linger();
                    drop(client);
                    continue;
                }
                let (mode_rx, resets_rx) = (mode_rx.clone(), resets_rx.clone());
                tokio::spawn(connection(client, target, mode_rx, resets_rx));
            }
        });
        Arc::new(Self {
            addr,
            mode,
            resets,
            task,
        })
    }

    /// Switches the mode (open connections follow it from their next chunk).
    pub fn set(&self, mode: Mode) {
        self.mode.send_replace(mode);
    }

    /// Resets every open connection.
    pub fn reset_all(&self) {
        self.resets.send_modify(|n| *n += 1);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.reset_all();
    }
}

/// One proxied connection: connects to `target`, pumps both ways until
/// either side closes or a reset is asked for.
async fn connection(
    client: TcpStream,
    target: SocketAddr,
    mode: watch::Receiver<Mode>,
    mut resets: watch::Receiver<u64>,
) {
    resets.mark_unchanged();
    let server = tokio::select! {
        s = TcpStream::connect(target) => s,
        _ = resets.changed() => Err(std::io::Error::other("reset")),
    };
    let Ok(server) = server else {
        let _ = client.set_zero_linger();
        return;
    };
    let _ = server.set_nodelay(true);
    let client = Arc::new(client);
    let server = Arc::new(server);
    let up = pump(client.clone(), server.clone(), mode.clone());
    let down = pump(server.clone(), client.clone(), mode);
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        _ = resets.changed() => {
            let _ = client.set_zero_linger();
            let _ = server.set_zero_linger();
        }
    }
}

/// Copies `from` → `to` chunk by chunk, obeying the mode; on EOF shuts the
/// write side of `to`.
async fn pump(from: Arc<TcpStream>, to: Arc<TcpStream>, mut mode: watch::Receiver<Mode>) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match read(&from, &mut buf).await {
            Ok(0) | Err(_) => {
                let _ = shutdown_write(&to);
                return;
            }
            Ok(n) => n,
        };
        loop {
            let m = *mode.borrow_and_update();
            match m {
                Mode::Pass | Mode::Refuse => break,
                Mode::Delay(d) => {
                    tokio::time::sleep(d).await;
                    break;
                }
                Mode::Blackhole => {
                    if mode.changed().await.is_err() {
                        return;
                    }
                }
            }
        }
        if write_all(&to, &buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Reads what is there (at least one byte, or 0 at EOF).
async fn read(s: &TcpStream, buf: &mut [u8]) -> std::io::Result<usize> {
    loop {
        s.readable().await?;
        match s.try_read(buf) {
            Ok(n) => return Ok(n),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
}

/// Writes all of `buf`.
async fn write_all(s: &TcpStream, mut buf: &[u8]) -> std::io::Result<()> {
    while !buf.is_empty() {
        s.writable().await?;
        match s.try_write(buf) {
            Ok(n) => buf = &buf[n..],
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Half-closes `s` (FIN): the peer reads EOF.
fn shutdown_write(s: &TcpStream) -> std::io::Result<()> {
    let sock = socket2::SockRef::from(s);
    sock.shutdown(std::net::Shutdown::Write)
}
