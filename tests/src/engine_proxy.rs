//! A Unix-socket forwarder in front of the Docker engine that a test can
//! take down, hang and bring back, at run time:
//! - down ([`EngineProxy::set_up`] `false`): every new connection is
//!   refused and every open one is cut, so the node sees an engine it
//!   cannot reach, the way a stopped or restarting `dockerd` looks;
//! - hung ([`EngineProxy::set_hung`] `true`): connections are accepted and
//!   nothing sent on them, new or pooled, reaches the engine or is
//!   answered, the way a wedged `dockerd` looks (the socket takes the
//!   connection and the call never returns). Answers to requests the engine
//!   already had still come back. When it answers again, what was held is
//!   passed on, as a `dockerd` woken from a stall would.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::watch;

use crate::cluster::scratch_dir;

/// What the proxied engine does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Up,
    Down,
    Hung,
}

/// The forwarder. Point a node's `--docker-socket` at [`EngineProxy::path`].
#[derive(Debug)]
pub struct EngineProxy {
    /// The socket it listens on.
    pub path: PathBuf,
    mode: Arc<watch::Sender<Mode>>,
    task: tokio::task::JoinHandle<()>,
}

impl EngineProxy {
    /// Starts forwarding to `/var/run/docker.sock`, up.
    ///
    /// # Errors
    ///
    /// When the socket cannot be bound.
    pub async fn start() -> Result<Self> {
        let path = scratch_dir("engine-proxy")?.join("docker.sock");
        let listener = tokio::net::UnixListener::bind(&path)?;
        let mode = Arc::new(watch::Sender::new(Mode::Up));
        let state = Arc::clone(&mode);
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                if *state.borrow() == Mode::Down {
                    drop(client);
                    continue;
                }
                let mode = state.subscribe();
                tokio::spawn(forward(client, mode));
            }
        });
        Ok(Self { path, mode, task })
    }

    /// Takes the engine away (`false`) or brings it back (`true`).
    pub fn set_up(&self, up: bool) {
        self.mode
            .send_replace(if up { Mode::Up } else { Mode::Down });
    }

    /// Hangs the engine (`true`: accepting, never answering) or lets it
    /// answer again (`false`).
    pub fn set_hung(&self, hung: bool) {
        self.mode
            .send_replace(if hung { Mode::Hung } else { Mode::Up });
    }
}

/// One client connection: bytes toward the engine flow only while up (held
/// while hung), answers flow back freely; down cuts both.
async fn forward(client: tokio::net::UnixStream, mut mode: watch::Receiver<Mode>) {
    // Even connecting waits while hung: the engine has not accepted yet.
    match mode.wait_for(|m| *m != Mode::Hung).await {
        Ok(m) if *m == Mode::Up => {}
        _ => return,
    }
    let Ok(engine) = tokio::net::UnixStream::connect("/var/run/docker.sock").await else {
        return;
    };
    let (mut client_read, mut client_write) = client.into_split();
    let (mut engine_read, mut engine_write) = engine.into_split();
    let mut down = mode.clone();
    let toward_engine = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => {
                    let _ = engine_write.shutdown().await;
                    return;
                }
                Ok(n) => n,
            };
            // A request that arrives while hung waits, unanswered.
            match mode.wait_for(|m| *m != Mode::Hung).await {
                Ok(m) if *m == Mode::Up => {}
                _ => return,
            }
            if engine_write.write_all(&buf[..n]).await.is_err() {
                return;
            }
        }
    };
    let back = async move {
        let _ = tokio::io::copy(&mut engine_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::select! {
        _ = async { tokio::join!(toward_engine, back) } => {}
        _ = down.wait_for(|m| *m == Mode::Down) => {}
    }
}

impl Drop for EngineProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
