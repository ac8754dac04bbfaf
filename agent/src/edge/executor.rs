//! The executor: takes commands from the single command slot one at a
//! time, in arrival order, runs each against the runner (or the updater),
//! and delivers its result up the session, holding a successful launch's
//! result until the plane acknowledges it (a lost acknowledgement moves the
//! lease into the node's custody).

use std::sync::Arc;
use std::time::Duration;

use billet_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use super::session::{failure, held};
use crate::edge::link::SessionLink;
use crate::edge::slot::{CommandSlot, Queued};
use crate::journal::{Durability, Journal};
use crate::model::NodeCommand;
use crate::model::RequestId;
use crate::node::health::Health;
use crate::node::recovery::Recovery;
use crate::node::runner::{Runner, RunnerError};
use crate::upgrade::dispatch::{self, UpgradeError, Upgrader};

/// What the executor needs besides the runner and the slot.
#[derive(Debug, Clone)]
pub(crate) struct Executor {
    /// Gates the first command.
    pub recovery: Arc<Recovery>,
    /// Where results are remembered across restarts.
    pub journal: Arc<dyn Journal>,
    /// How long a launch result waits for its acknowledgement.
    pub ack_timeout: Duration,
    /// What `StartUpgrade` execs; `None` refuses upgrades with a sentence
    /// saying to upgrade the node out of band.
    pub upgrader: Option<Arc<dyn Upgrader>>,
    /// What this node may run at once, as `Hello` says: every `Instances`
    /// report repeats it beside what is held.
    pub capacity: pb::Capacity,
    /// Whether a launch may start (refused while degraded).
    pub health: Arc<Health>,
}

/// Runs commands off the slot one at a time until `cancel`, once start-up
/// recovery has succeeded.
pub(crate) async fn execute_commands(
    runner: Arc<Runner>,
    slot: Arc<CommandSlot>,
    executor: Executor,
    cancel: CancellationToken,
) {
    // Ends with `cancel`, as the executor does.
    tokio::spawn(
        refuse_waiting_launches(slot.clone(), executor.health.clone(), cancel.clone())
            .instrument(info_span!("refuse_waiting_launches")),
    );
    tokio::select! {
        () = cancel.cancelled() => return,
        () = executor.recovery.wait() => {}
    }
    loop {
        let queued = tokio::select! {
            () = cancel.cancelled() => return,
            q = slot.next() => q,
        };
        let Queued {
            id,
            deadline,
            command,
            session,
        } = queued;
        let kind = command.kind();
        let durability = result_durability(&command);
        // Every line the command logs carries its lease, where it names one.
        let span = info_span!("command", %id, kind, lease = tracing::field::Empty);
        if let Some(lease) = command.lease_id() {
            span.record("lease", tracing::field::display(lease));
        }
        let (result, launched) = async {
            if tokio::time::Instant::now() > deadline {
                info!("expired before it started; doing nothing");
                return (
                    failure(
                        id.as_str(),
                        pb::Outcome::Expired,
                        pb::ErrorCode::Unspecified,
                        format!("command {id} ({kind}) expired in the queue before it started; nothing was done"),
                    ),
                    None,
                );
            }
            if matches!(command, NodeCommand::Launch { .. })
                && let Some(refusal) = executor.health.refusal()
            {
                info!(%refusal, "refused a launch while degraded");
                return (refused_launch(id.as_str(), &refusal), None);
            }
            execute(&runner, executor.upgrader.as_deref(), executor.capacity, id.as_str(), command).await
        }
        .instrument(span.clone())
        .await;
        // Expected before the command stops counting as in flight, so a
        // drain never sees a gap between the two (server.rs, DRAIN_SETTLE).
        // A session recycled and closed since hands its answers on.
        let session = session.live();
        let ack = session.expect_ack(id.as_str());
        slot.record(&id, &result);
        let encoded = durability.map(|_| prost::Message::encode_to_vec(&result));
        let journaled = async {
            if let (Some(durability), Some(encoded)) = (durability, &encoded)
                && let Err(e) = executor
                    .journal
                    .put_result(id.as_str(), encoded, durability)
                    .await
            {
                warn!(%id, error = %e, "cannot journal a result; a redelivery after a restart would run it again");
            }
        };
        let answered = deliver(
            &runner,
            session,
            ack,
            result,
            launched,
            executor.ack_timeout,
        );
        // A synced result is journaled before it is answered: nothing else
        // keeps a redelivery after a restart from running it again. A
        // launch's (committed) result is written beside the answer: its
        // synced launch record already keeps a redelivery from minting or
        // creating again. It is written before the next command starts
        // (ARCHITECTURE.md, "What each journal write survives").
        if durability == Some(Durability::Synced) {
            journaled.await;
            answered.instrument(span).await;
        } else {
            tokio::join!(journaled, answered.instrument(span));
        }
    }
}

/// While the node is degraded, answers every launch waiting in the slot
/// refused (typed as [`refused_launch`] says) instead of letting it wait
/// behind the command running, which may be the stuck one that made the
/// node degraded: a plane that waited past its timeout would take the lease
/// for held by the node although nothing started. Looks whenever the health
/// changes and every second (a launch may have been queued just as the node
/// became degraded), until `cancel`.
async fn refuse_waiting_launches(
    slot: Arc<CommandSlot>,
    health: Arc<Health>,
    cancel: CancellationToken,
) {
    let mut state = health.subscribe();
    loop {
        if let Some(refusal) = health.refusal() {
            for waiting in slot.take_waiting_launches() {
                info!(id = %waiting.id, %refusal, "refused a waiting launch: the node is degraded");
                let result = refused_launch(waiting.id.as_str(), &refusal);
                slot.record(&waiting.id, &result);
                let _ = waiting
                    .session
                    .live()
                    .send(pb::node_message::Body::Result(result))
                    .await;
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = state.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// A launch refused by a degraded node: `OUTCOME_REFUSED` with
/// `ERROR_CODE_RESOURCE_EXHAUSTED` for a full disk, else
/// `ERROR_CODE_UNAVAILABLE`; nothing was bound, minted or started.
pub(super) fn refused_launch(
    id: &str,
    refusal: &crate::node::health::Refusal,
) -> pb::CommandResult {
    let code = if refusal.exhausted {
        pb::ErrorCode::ResourceExhausted
    } else {
        pb::ErrorCode::Unavailable
    };
    failure(id, pb::Outcome::Refused, code, refusal.to_string())
}

/// Whether a command's result is journaled, and how durably: those whose
/// loss in a restart could make a redelivered copy do something twice are
/// synced before they are answered, or committed beside the answer where
/// another synced write already keeps the copy from doing anything twice.
/// `Tend`, `Sweep`, `Instances` and `Superseded` are idempotent passes
/// over what the node holds: run again, they do what is due then, so
/// their results are remembered in memory only (the slot still answers a
/// redelivered copy within this process).
fn result_durability(command: &NodeCommand) -> Option<Durability> {
    match command {
        // The launch record, synced before the mint, is what keeps a
        // redelivered launch from minting or creating again: recovery
        // finds the launch from it, and a launch of a lease this node holds
        // is answered with what it holds (`Runner::launch`). The result is
        // committed, so it survives the process, and a power cut loses only
        // the copy of an answer the record already stands for.
        NodeCommand::Launch { .. } => Some(Durability::Committed),
        NodeCommand::Destroy { .. }
        | NodeCommand::AssumeCustody { .. }
        | NodeCommand::StartUpgrade(_) => Some(Durability::Synced),
        NodeCommand::Instances
        | NodeCommand::Sweep
        | NodeCommand::Tend
        | NodeCommand::Superseded
        | NodeCommand::WarmPool(_) => None,
    }
}

/// A successful launch, for custody if its result goes unacknowledged.
#[derive(Debug)]
pub(super) struct Launched {
    lease: crate::model::LeaseId,
    epoch: crate::model::Epoch,
    request_id: RequestId,
}

pub(super) async fn execute(
    runner: &Runner,
    upgrader: Option<&dyn Upgrader>,
    capacity: pb::Capacity,
    id: &str,
    command: NodeCommand,
) -> (pb::CommandResult, Option<Launched>) {
    let ok = || pb::CommandResult {
        id: id.to_owned(),
        outcome: pb::Outcome::Ok.into(),
        custody: false,
        error: None,
        instances: None,
    };
    let from_runner = |r: Result<(), RunnerError>| match r {
        Ok(()) => ok(),
        Err(e) => {
            let (outcome, code) = match &e {
                RunnerError::Refused(_) => (pb::Outcome::Refused, pb::ErrorCode::Refused),
                RunnerError::ImageUnavailable { .. } => {
                    (pb::Outcome::Refused, pb::ErrorCode::ImageUnavailable)
                }
                RunnerError::RunnerOutdated(_) => {
                    (pb::Outcome::Refused, pb::ErrorCode::RunnerOutdated)
                }
                RunnerError::TierUnhealthy(_) => {
                    (pb::Outcome::Refused, pb::ErrorCode::TierUnhealthy)
                }
                RunnerError::ProviderUnavailable(_) | RunnerError::JournalUnwritable(_) => {
                    (pb::Outcome::Refused, pb::ErrorCode::Unavailable)
                }
                RunnerError::ScaleSetNotFound(_) => {
                    (pb::Outcome::Failed, pb::ErrorCode::ScaleSetNotFound)
                }
                RunnerError::RunnerNameTaken(_) => {
                    (pb::Outcome::Failed, pb::ErrorCode::RunnerNameTaken)
                }
                RunnerError::Busy { .. } => (pb::Outcome::Busy, pb::ErrorCode::Busy),
                RunnerError::Custody(_) | RunnerError::Failed(_) => {
                    (pb::Outcome::Failed, pb::ErrorCode::Unspecified)
                }
            };
            let mut result = failure(id, outcome, code, e.to_string());
            result.custody = e.is_custody();
            if let (RunnerError::TierUnhealthy(unhealthy), Some(error)) = (&e, &mut result.error) {
                error.retry_after_ms =
                    u64::try_from(unhealthy.retry_after.as_millis()).unwrap_or(u64::MAX);
            }
            result
        }
    };
    match command {
        NodeCommand::Launch {
            lease,
            tier,
            job,
            registration,
            warm,
        } => {
            let launched = Launched {
                lease: lease.id.clone(),
                epoch: lease.epoch,
                request_id: lease.request_id,
            };
            let r = runner
                .launch_onto(lease, tier, job, registration, warm)
                .await;
            let success = r.is_ok();
            (from_runner(r), success.then_some(launched))
        }
        NodeCommand::Destroy { request_id, order } => {
            (from_runner(runner.destroy(request_id, &order).await), None)
        }
        NodeCommand::AssumeCustody { lease, request_id } => (
            from_runner(
                runner
                    .assume_custody(&lease.id, lease.epoch, request_id)
                    .await,
            ),
            None,
        ),
        // Returns once the updater has answered (bounded by its ack wait),
        // never after the upgrade itself: the slot must stay free for the
        // destroys the drain needs. OK means only that the updater took
        // responsibility; progress is read from the rollout.
        NodeCommand::StartUpgrade(spec) => {
            let result = match dispatch::start(upgrader, &spec).await {
                Ok(()) => ok(),
                Err(e) => {
                    let (outcome, code) = match &e {
                        UpgradeError::NoUpgrader { .. } | UpgradeError::Refused { .. } => {
                            (pb::Outcome::Refused, pb::ErrorCode::Refused)
                        }
                        UpgradeError::Spec { .. } => {
                            (pb::Outcome::InvalidArgument, pb::ErrorCode::InvalidArgument)
                        }
                        UpgradeError::Spawn { .. } | UpgradeError::Ack { .. } => {
                            (pb::Outcome::Failed, pb::ErrorCode::Internal)
                        }
                    };
                    failure(id, outcome, code, e.to_string())
                }
            };
            (result, None)
        }
        NodeCommand::Instances => match runner.instances().await {
            Ok(ids) => {
                let mut r = ok();
                r.instances = Some(pb::InstanceReport {
                    lease_ids: ids.into_iter().map(|l| l.as_str().to_owned()).collect(),
                    inventory_known: true,
                    capacity: Some(capacity),
                    held: Some(held(runner)),
                });
                (r, None)
            }
            Err(e) => {
                let mut r = failure(
                    id,
                    pb::Outcome::Failed,
                    pb::ErrorCode::Unavailable,
                    e.to_string(),
                );
                r.instances = Some(pb::InstanceReport {
                    lease_ids: Vec::new(),
                    inventory_known: false,
                    capacity: Some(capacity),
                    held: Some(held(runner)),
                });
                (r, None)
            }
        },
        // Reported like `Instances`, so the plane learns what the node
        // holds on every maintenance pass, not only at `Hello`.
        NodeCommand::Sweep => {
            let swept = runner.sweep_inventory().await;
            let report = pb::InstanceReport {
                inventory_known: swept.listed.is_some(),
                lease_ids: swept
                    .listed
                    .unwrap_or_default()
                    .iter()
                    .map(|l| l.as_str().to_owned())
                    .collect(),
                capacity: Some(capacity),
                held: Some(held(runner)),
            };
            let mut result = from_runner(swept.result);
            result.instances = Some(report);
            (result, None)
        }
        NodeCommand::Tend => (from_runner(runner.tend().await), None),
        NodeCommand::Superseded => {
            runner.superseded().await;
            (ok(), None)
        }
        NodeCommand::WarmPool(targets) => match runner.warm() {
            Some(pool) => {
                pool.set_targets(targets);
                (ok(), None)
            }
            None => (
                failure(
                    id,
                    pb::Outcome::Refused,
                    pb::ErrorCode::Refused,
                    "this node keeps no warm runners".to_owned(),
                ),
                None,
            ),
        },
    }
}

/// Sends a result on the session its command came from and, for a
/// successful launch, takes custody unless the plane accepts it.
async fn deliver(
    runner: &Arc<Runner>,
    session: Arc<SessionLink>,
    ack: tokio::sync::oneshot::Receiver<pb::AckVerdict>,
    result: pb::CommandResult,
    launched: Option<Launched>,
    ack_timeout: Duration,
) {
    let sent = session.send(pb::node_message::Body::Result(result)).await;
    let Some(launched) = launched else {
        return;
    };
    let runner = Arc::clone(runner);
    tokio::spawn(
        async move {
            let verdict = if sent.is_err() {
                None
            } else {
                tokio::select! {
                    v = ack => v.ok(),
                    () = tokio::time::sleep(ack_timeout) => None,
                }
            };
            if verdict == Some(pb::AckVerdict::Accepted) {
                return;
            }
            info!(
                ?verdict,
                "the plane did not accept this launch's result; taking custody"
            );
            if let Err(e) = runner
                .assume_custody(&launched.lease, launched.epoch, launched.request_id)
                .await
            {
                warn!(error = %e, "custody after an unacknowledged launch");
            }
        }
        .instrument(info_span!("launch_ack")),
    );
}

#[cfg(test)]
mod scenarios;
#[cfg(test)]
mod tests;
