//! Ending runners: the `Destroy` that follows a job's completion, and a
//! scale-down of an idle runner ([`ScaleDown`]), each retried until the node
//! answers, then the lease released.

use billet_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

use crate::ledger::Phase;
use crate::node_link::CommandOutcome;

use super::coverage::RELAUNCH_MAX_DELAY;
use super::{Plane, PlaneEvent, restart_backoff};

/// How a scale-down ([`Plane::scale_down`]) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleDown {
    /// The node destroyed the idle runner; the lease is released `done`.
    Destroyed,
    /// The runner's job completed meanwhile: the completion's own Destroy
    /// ends it, and the scale-down is dropped.
    Completed,
    /// The lease ended, or the node holds it: nothing left to scale down.
    Ended,
}

impl Plane {
    pub(super) async fn complete(
        &self,
        runner_name: String,
        result: String,
        shutdown: CancellationToken,
    ) {
        let lease = match self.ledger.lease_by_runner_name(&runner_name).await {
            Ok(Some(l)) => l,
            Ok(None) => {
                warn!("a completion for a runner no lease knows");
                return;
            }
            Err(e) => {
                error!(error = %e, "ledger read for a completion");
                return;
            }
        };
        if lease.phase.is_terminal() {
            return;
        }
        let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
            warn!(lease = %lease.id, "completed lease is bound to no known node");
            return;
        };
        let mut backoff = restart_backoff();
        loop {
            let outcome = node
                .dispatch(
                    pb::command::Kind::Destroy(pb::Destroy {
                        request_id: lease.request_id,
                        job_result: Some(result.clone()),
                        force: false,
                        reason: String::new(),
                    }),
                    self.config.destroy_timeout,
                )
                .await;
            if outcome.is_ok() {
                break;
            }
            if let CommandOutcome::Answered(result) = &outcome
                && result.custody
            {
                info!(lease = %lease.id, "the node holds the lease until its instance is gone");
                self.managed.lock().expect("managed").remove(&lease.id);
                return;
            }
            // A lost or failed destroy is repeated, and a busy one later:
            // destroys are idempotent, and the lease stays held meanwhile.
            let wait = backoff.next().unwrap_or(RELAUNCH_MAX_DELAY);
            warn!(lease = %lease.id, outcome = %outcome.describe(), retry_in = ?wait, "destroy did not finish; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        self.managed.lock().expect("managed").remove(&lease.id);
        let current = self.ledger.get(&lease.id).await.ok().flatten();
        let epoch = current.as_ref().map_or(lease.epoch, |l| l.epoch);
        match self
            .ledger
            .release(&lease.id, epoch, None, Phase::Done, crate::now_ms())
            .await
        {
            Ok(_) => {
                self.emit(PlaneEvent::Released {
                    lease: lease.id.clone(),
                    outcome: "done".into(),
                });
            }
            Err(e) => warn!(lease = %lease.id, error = %e, "release after destroy"),
        }
    }

    /// Scales down the runner of `lease_id`: a Destroy without a completion
    /// and without force. A node that answers `BUSY` (GitHub says the
    /// runner has taken a job) destroyed nothing; the plane asks again with
    /// backoff (200 ms doubling to 5 s, jittered), and drops the scale-down
    /// once the job's completion arrives (its own Destroy ends the runner),
    /// the lease ends, or the node holds it. A destroyed runner's lease is
    /// released `done`.
    ///
    /// # Errors
    ///
    /// [`crate::ledger::LedgerError`] when the ledger cannot be read.
    pub async fn scale_down(
        &self,
        lease_id: &str,
        shutdown: &CancellationToken,
    ) -> Result<ScaleDown, crate::ledger::LedgerError> {
        // The plane's own end of the runner, however it goes: never a
        // runner that ended without a job (`note_runners_ended_idle`), even
        // when the node releases the lease before this marks it.
        self.cover.lock().expect("cover").launched.remove(lease_id);
        let mut backoff = restart_backoff();
        loop {
            let Some(lease) = self.ledger.get(lease_id).await? else {
                return Ok(ScaleDown::Ended);
            };
            let completed = lease
                .runner_name
                .as_ref()
                .is_some_and(|n| self.cover.lock().expect("cover").completed.contains(n));
            if completed {
                info!(lease = %lease.id, "the job completed; the scale-down is dropped and its completion ends the runner");
                return Ok(ScaleDown::Completed);
            }
            if lease.phase.is_terminal() {
                return Ok(ScaleDown::Ended);
            }
            let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
                return Ok(ScaleDown::Ended);
            };
            let outcome = node
                .dispatch(
                    pb::command::Kind::Destroy(pb::Destroy {
                        request_id: lease.request_id,
                        job_result: None,
                        force: false,
                        reason: String::new(),
                    }),
                    self.config.destroy_timeout,
                )
                .await;
            if outcome.is_ok() {
                self.managed.lock().expect("managed").remove(&lease.id);
                self.cover
                    .lock()
                    .expect("cover")
                    .not_covering
                    .insert(lease.id.clone());
                self.wake.notify_one();
                match self
                    .ledger
                    .release(&lease.id, lease.epoch, None, Phase::Done, crate::now_ms())
                    .await
                {
                    Ok(_) => self.emit(PlaneEvent::Released {
                        lease: lease.id.clone(),
                        outcome: "done".into(),
                    }),
                    Err(e) => warn!(lease = %lease.id, error = %e, "release after a scale-down"),
                }
                return Ok(ScaleDown::Destroyed);
            }
            if outcome.is_custody() {
                self.managed.lock().expect("managed").remove(&lease.id);
                return Ok(ScaleDown::Ended);
            }
            let busy = matches!(&outcome, CommandOutcome::Answered(r)
                if r.outcome == pb::Outcome::Busy as i32
                    || r.error.as_ref().is_some_and(|e| e.code == pb::ErrorCode::Busy as i32));
            let wait = backoff.next().unwrap_or(RELAUNCH_MAX_DELAY);
            if busy {
                info!(lease = %lease.id, retry_in = ?wait, "scale-down answered BUSY: the runner took a job; asking again later");
                self.emit(PlaneEvent::ScaleDownBusy {
                    lease: lease.id.clone(),
                });
            } else {
                warn!(lease = %lease.id, outcome = %outcome.describe(), retry_in = ?wait, "scale-down did not finish; retrying");
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(ScaleDown::Ended),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }
}
