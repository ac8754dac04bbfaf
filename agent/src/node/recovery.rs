//! Start-up recovery's gate: recovery runs once, on the first session (it
//! needs the plane), and the executor takes no command before it is done.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;
use tracing::{Instrument, info, info_span, warn};

use crate::node::runner::Runner;

/// Start-up recovery: run once, on the first session (it needs the plane),
/// before the executor takes the first command.
#[derive(Debug)]
pub(crate) struct Recovery {
    done: watch::Sender<bool>,
    running: AtomicBool,
}

impl Default for Recovery {
    fn default() -> Self {
        Self {
            done: watch::Sender::new(false),
            running: AtomicBool::new(false),
        }
    }
}

impl Recovery {
    /// Resolves once recovery has succeeded.
    pub(crate) async fn wait(&self) {
        let mut done = self.done.subscribe();
        let _ = done.wait_for(|d| *d).await;
    }

    /// A recovery that has already succeeded, for tests that drive the
    /// executor without a plane.
    #[cfg(test)]
    pub(crate) fn done() -> Self {
        let recovery = Self::default();
        recovery.done.send_replace(true);
        recovery
    }

    /// Marks recovery done, for tests that hold the executor back until
    /// they let it go.
    #[cfg(test)]
    pub(crate) fn mark_done(&self) {
        self.done.send_replace(true);
    }

    /// Whether recovery has succeeded.
    pub(crate) fn is_done(&self) -> bool {
        *self.done.borrow()
    }

    /// Runs recovery unless it is done or already running, retrying every
    /// two seconds through whichever session is current (the plane link
    /// follows the newest one) until it succeeds. Not tied to the session
    /// that started it: a reconnect mid-recovery must not strand it.
    pub(crate) fn start(self: &Arc<Self>, runner: Arc<Runner>) {
        if self.is_done() || self.running.swap(true, Ordering::SeqCst) {
            return;
        }
        let this = Arc::clone(self);
        tokio::spawn(
            async move {
                loop {
                    match runner.recover().await {
                        Ok(()) => {
                            info!("recovered; taking commands");
                            this.done.send_replace(true);
                            break;
                        }
                        Err(e) => warn!(error = %e, "recovery failed; retrying"),
                    }
                    tokio::time::sleep(Duration::from_secs(2)).await;
                }
                this.running.store(false, Ordering::SeqCst);
            }
            .instrument(info_span!("recover")),
        );
    }
}
