//! Sending a command to the node and waiting for its result: the deadline
//! is fixed at queue time, a caller that stops waiting leaves nothing in
//! flight, and a launch given up on is tombstoned.

use std::sync::atomic::Ordering;
use std::time::Duration;

use billet_proto::v1 as pb;
use tokio::sync::oneshot;
use tracing::debug;

use super::{CommandOutcome, InFlight, NodeLink, NodeStatus, tombstone};

impl NodeLink {
    /// Sends a command and waits for its result until `timeout` from now
    /// (the deadline the node enforces is fixed here, at queue time). Waits
    /// for a session if none is open. A caller may stop waiting by dropping
    /// the future: nothing is left in flight, and an abandoned launch is
    /// tombstoned as if it had timed out.
    pub async fn dispatch(&self, kind: pb::command::Kind, timeout: Duration) -> CommandOutcome {
        let deadline = tokio::time::Instant::now() + timeout;
        let deadline_unix_ms =
            crate::now_ms() + i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        self.dispatch_until(kind, deadline, deadline_unix_ms).await
    }

    /// [`NodeLink::dispatch`] with an explicit node-side deadline, which may
    /// already be past (to test expiry).
    pub async fn dispatch_until(
        &self,
        kind: pb::command::Kind,
        deadline: tokio::time::Instant,
        deadline_unix_ms: i64,
    ) -> CommandOutcome {
        let is_launch = matches!(kind, pb::command::Kind::Launch(_));
        let id = uuid::Uuid::new_v4().simple().to_string();
        // However this call ends (a caller that stops waiting drops it), its
        // in-flight entry goes with it.
        let _waiting = Waiting {
            link: self,
            id: id.clone(),
            is_launch,
        };
        let sent = tokio::time::timeout_at(
            deadline,
            self.send_when_attached(&id, kind, deadline_unix_ms, is_launch),
        )
        .await;
        let Ok(reply) = sent else {
            return CommandOutcome::NotDelivered(format!(
                "node {} had no open session",
                self.target.name
            ));
        };
        let mut reply = reply;
        match tokio::time::timeout_at(deadline, &mut reply).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => CommandOutcome::Lost("the plane stopped waiting".into()),
            Err(_) => {
                let given_up = {
                    let mut shared = self.shared.lock().expect("link");
                    let removed = shared.in_flight.remove(&id).is_some();
                    if removed && is_launch {
                        tombstone(&mut shared, id.clone());
                    }
                    removed
                };
                if !given_up {
                    // The result arrived and was acknowledged `accepted` just
                    // as the deadline passed: it is on its way to us, and the
                    // caller must see it, or plane and node would disagree
                    // about who holds the lease.
                    if let Ok(Ok(outcome)) =
                        tokio::time::timeout(Duration::from_secs(5), reply).await
                    {
                        return outcome;
                    }
                }
                CommandOutcome::Lost(format!("no result for command {id} before its deadline"))
            }
        }
    }
}

/// A dispatch still waiting for its result. Dropped however the dispatch
/// ends; if the command is still in flight then, the caller stopped waiting
/// (its future was dropped): the entry is removed so nothing waits for it,
/// and a launch is tombstoned like one that timed out, so a late success is
/// acknowledged `custody` and the node holds the lease no caller manages.
struct Waiting<'a> {
    link: &'a NodeLink,
    id: String,
    is_launch: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut shared = self
            .link
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if shared.in_flight.remove(&self.id).is_some() && self.is_launch {
            debug!(id = %self.id, "the caller stopped waiting for a launch; tombstoned");
            tombstone(&mut shared, self.id.clone());
        }
    }
}

impl NodeLink {
    /// Sends a command on the current session, waiting for one to open
    /// (and, for a launch, for the node to be healthy: a degraded node is
    /// given no new work); returns where its result will arrive.
    async fn send_when_attached(
        &self,
        id: &str,
        kind: pb::command::Kind,
        deadline_unix_ms: i64,
        is_launch: bool,
    ) -> oneshot::Receiver<CommandOutcome> {
        let mut status = self.status.subscribe();
        loop {
            let degraded = status
                .borrow_and_update()
                .as_ref()
                .is_some_and(NodeStatus::degraded);
            let session = self.shared.lock().expect("link").session.clone();
            let placeable =
                !is_launch || !degraded || self.faults.place_on_degraded.load(Ordering::SeqCst);
            if let Some((session, tx)) = session.filter(|_| placeable) {
                let (reply_tx, reply_rx) = oneshot::channel();
                self.shared.lock().expect("link").in_flight.insert(
                    id.to_owned(),
                    (
                        session,
                        InFlight {
                            is_launch,
                            is_destroy: matches!(kind, pb::command::Kind::Destroy(_)),
                            reply: reply_tx,
                        },
                    ),
                );
                // The node judges the time left on its own monotonic clock
                // (0: already past).
                let remaining = deadline_unix_ms.saturating_sub(crate::now_ms()).max(0);
                let command = pb::Command {
                    id: id.to_owned(),
                    deadline_unix_ms,
                    deadline_remaining_ms: Some(u64::try_from(remaining).unwrap_or(0)),
                    kind: Some(kind.clone()),
                };
                let message = pb::PlaneMessage {
                    body: Some(pb::plane_message::Body::Command(command)),
                };
                if tx.send(message).await.is_ok() {
                    return reply_rx;
                }
                self.shared.lock().expect("link").in_flight.remove(id);
            }
            let _ = status.changed().await;
        }
    }
}
