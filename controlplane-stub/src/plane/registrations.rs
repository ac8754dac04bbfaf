//! The registration pass: GitHub's runner registrations compared with the
//! ledger's leases. A registration that outlived its lease is removed; an
//! idle runner whose registration GitHub lost is destroyed
//! ([`REGISTRATION_LOST`]).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::ledger::Phase;

use super::{Plane, PlaneEvent, jitter};

/// How long after its lease ended a registration the ledger never recorded
/// is still looked for by name ([`Plane::registrations_once`]), in
/// milliseconds: one hour. Such a registration exists only when a mint's
/// recording and its immediate removal both failed, which is seconds
/// before the lease ended, not hours.
const UNRECORDED_LOOKBACK_MS: i64 = 60 * 60 * 1000;

/// The failure reason of a lease whose idle runner lost its registration.
pub const REGISTRATION_LOST: &str = "registration_lost";

/// What registration reconciliation remembers between passes.
#[derive(Debug, Default)]
pub(super) struct Registrations {
    /// Open leases whose registration GitHub answered 404, since when.
    missing_since: HashMap<String, Instant>,
    /// Ended leases whose registration is known gone.
    gone: HashSet<String>,
}

/// Why a reconciliation pass stopped: GitHub or the ledger could not say.
#[derive(Debug, Error)]
pub(super) enum ReconcileError {
    #[error(transparent)]
    Github(#[from] crate::github::GithubError),
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
}

impl Plane {
    /// Compares GitHub's registrations with the ledger's open leases every
    /// [`PlaneConfig::registration_interval`](super::PlaneConfig::registration_interval).
    /// The plane mints every registration of this deployment, named
    /// `billet-<lease>` and recorded against its lease, so the ledger names
    /// every candidate.
    pub(super) async fn reconcile_registrations(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.registration_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut memory = Registrations::default();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.registrations_once(&mut memory, &shutdown).await {
                warn!(error = %e, "registration reconciliation stopped; nothing more is reaped until GitHub answers");
            }
        }
    }

    /// One pass. A registration whose lease ended more than the grace ago
    /// is removed (found by its recorded id, or by its name when the ledger
    /// recorded none and the lease ended within an hour). An idle runner (launched, no job taken) whose
    /// registration GitHub has answered 404 for longer than the grace is
    /// destroyed and its lease failed with [`REGISTRATION_LOST`], at most
    /// max(1, max_runners / 4) per pass, each after a random delay. Any
    /// answer other than found or 404 (5xx, a timeout) ends the pass at
    /// once: unknown is not gone, and nothing is reaped on it.
    pub(super) async fn registrations_once(
        &self,
        memory: &mut Registrations,
        shutdown: &CancellationToken,
    ) -> Result<(), ReconcileError> {
        let leases = self.ledger.leases().await?;
        let grace_ms =
            i64::try_from(self.config.registration_grace.as_millis()).unwrap_or(i64::MAX);
        let now_ms = crate::now_ms();
        for l in &leases {
            let Some(ended) = l.ended_at_ms else {
                continue;
            };
            if memory.gone.contains(&l.id) || now_ms.saturating_sub(ended) < grace_ms {
                continue;
            }
            let runner_id = match l.runner_id {
                Some(id) => Some(id),
                // A lease that ended with no registration recorded may still
                // have one: a mint GitHub answered whose recording the
                // ledger refused (the lease ended meanwhile) and whose
                // immediate removal failed. It can only be named, so it is
                // looked up by name, once, for leases that ended within
                // UNRECORDED_LOOKBACK. Only a runner of the lease's own
                // scale set is this plane's: a runner of that name in
                // another set (a mint GitHub refused as AgentExists) belongs
                // to someone else and is never removed.
                None if now_ms.saturating_sub(ended) <= UNRECORDED_LOOKBACK_MS => {
                    match self
                        .github
                        .runner_by_name(&format!("billet-{}", l.id))
                        .await?
                    {
                        None => None,
                        Some(found) => match self.github.scale_set(&l.tier).await {
                            Ok(set) if found.runner_scale_set_id == set => Some(found.id.0),
                            Ok(_) => {
                                info!(lease = %l.id, runner = %found.name, set = %found.runner_scale_set_id,
                                      "a runner of an ended lease's name belongs to another scale set; left alone");
                                None
                            }
                            // The tier's set is gone, and its runners with it.
                            Err(e) if e.is_scale_set_not_found() => None,
                            Err(e) => return Err(e.into()),
                        },
                    }
                }
                None => None,
            };
            let Some(runner_id) = runner_id else {
                memory.gone.insert(l.id.clone());
                continue;
            };
            if self.github.runner_exists(runner_id).await? {
                let name = l
                    .runner_name
                    .clone()
                    .unwrap_or_else(|| format!("billet-{}", l.id));
                match self.github.remove_runner(runner_id, &name).await {
                    Ok(_) => {
                        info!(lease = %l.id, runner = %name, "removed a registration no open lease accounts for")
                    }
                    Err(e) if e.is_job_still_running() => {
                        warn!(lease = %l.id, runner = %name, "a registration with no open lease is running a job; left alone");
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            memory.gone.insert(l.id.clone());
        }

        let idle: Vec<&crate::ledger::Lease> = {
            let cover = self.cover.lock().expect("cover");
            leases
                .iter()
                .filter(|l| matches!(l.phase, Phase::Launching | Phase::Online))
                .filter(|l| l.runner_id.is_some() && l.node.is_some())
                .filter(|l| !cover.in_flight.contains_key(&l.id) && cover.covers(l))
                .collect()
        };
        let open: HashSet<&str> = idle.iter().map(|l| l.id.as_str()).collect();
        memory
            .missing_since
            .retain(|id, _| open.contains(id.as_str()));
        let mut lost = Vec::new();
        for l in idle {
            let Some(runner_id) = l.runner_id else {
                continue;
            };
            if self.github.runner_exists(runner_id).await? {
                memory.missing_since.remove(&l.id);
                continue;
            }
            let since = *memory
                .missing_since
                .entry(l.id.clone())
                .or_insert_with(Instant::now);
            if since.elapsed() >= self.config.registration_grace {
                lost.push(l.clone());
            }
        }
        let per_pass = usize::try_from((self.config.max_runners / 4).max(1)).unwrap_or(1);
        for lease in lost.into_iter().take(per_pass) {
            let jitter = jitter(self.config.registration_interval / 4);
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(jitter) => {}
            }
            memory.missing_since.remove(&lease.id);
            self.destroy_lost(&lease).await;
        }
        Ok(())
    }

    /// Destroys an idle runner whose registration GitHub no longer has: it
    /// can never take a job. Its job is covered afresh at once.
    async fn destroy_lost(&self, lease: &crate::ledger::Lease) {
        let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
            return;
        };
        warn!(lease = %lease.id, node = node.name(), reason = REGISTRATION_LOST,
              "an idle runner's registration is gone at GitHub; destroying it");
        self.cover
            .lock()
            .expect("cover")
            .not_covering
            .insert(lease.id.clone());
        self.wake.notify_one();
        // The reason is the plane's, recorded before the node tears down
        // (the first reason recorded stays).
        let _ = self
            .ledger
            .mark_failure(&lease.id, lease.epoch, REGISTRATION_LOST, crate::now_ms())
            .await;
        // The registration is gone, so the runner can take no job: the
        // destroy has no job result, and is forced, with the reason.
        let outcome = node
            .dispatch(
                pb::command::Kind::Destroy(pb::Destroy {
                    request_id: lease.request_id,
                    job_result: None,
                    force: true,
                    reason: REGISTRATION_LOST.into(),
                }),
                self.config.destroy_timeout,
            )
            .await;
        if !outcome.is_ok() {
            warn!(lease = %lease.id, outcome = %outcome.describe(), "destroy of a runner without a registration; the next pass tries again");
            return;
        }
        self.managed.lock().expect("managed").remove(&lease.id);
        let now = crate::now_ms();
        match self
            .ledger
            .release(&lease.id, lease.epoch, None, Phase::Failed, now)
            .await
        {
            Ok(_) => self.emit(PlaneEvent::Released {
                lease: lease.id.clone(),
                outcome: "failed".into(),
            }),
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "release after destroying a runner without a registration")
            }
        }
    }
}
