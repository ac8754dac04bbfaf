//! A Unix-socket forwarder in front of the Docker engine that a test can
//! take down and bring back: while it is down, every new connection is
//! refused and every open one is cut, so the node sees an engine it cannot
//! reach, the way a stopped or restarting `dockerd` looks.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use tokio::sync::watch;

use crate::cluster::scratch_dir;

/// The forwarder. Point a node's `--docker-socket` at [`EngineProxy::path`].
#[derive(Debug)]
pub struct EngineProxy {
    /// The socket it listens on.
    pub path: PathBuf,
    up: Arc<watch::Sender<bool>>,
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
        let up = Arc::new(watch::Sender::new(true));
        let state = Arc::clone(&up);
        let task = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !*state.borrow() {
                    drop(client);
                    continue;
                }
                let mut down = state.subscribe();
                tokio::spawn(async move {
                    let Ok(mut engine) =
                        tokio::net::UnixStream::connect("/var/run/docker.sock").await
                    else {
                        return;
                    };
                    tokio::select! {
                        _ = tokio::io::copy_bidirectional(&mut client, &mut engine) => {}
                        _ = down.wait_for(|up| !*up) => {}
                    }
                });
            }
        });
        Ok(Self { path, up, task })
    }

    /// Takes the engine away (`false`) or brings it back (`true`).
    pub fn set_up(&self, up: bool) {
        self.up.send_replace(up);
    }
}

impl Drop for EngineProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}
