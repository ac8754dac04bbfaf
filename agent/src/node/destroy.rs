//! Destroy: ending what was started for a request as the plane's order
//! allows (a completion, a scale-down, or an operator's force), and the
//! evidence it weighs first: whether the runner is at work.

use backon::{BackoffBuilder as _, ConstantBuilder};
use tracing::{info, warn};

use super::custody::{CustodyEntry, Seen};
use super::ending::{EndReason, Ending, FailureReason};
use super::plane::PlaneError;
use super::runner::{COMPLETION_POLL, COMPLETION_SETTLE, Runner, RunnerError};
use crate::model::{DestroyOrder, InstanceName, LeaseId, RequestId};
use crate::provider::{Instance, Teardown, Work};

impl Runner {
    /// Whether a runner still working when its job's completion arrives
    /// exits within [`COMPLETION_SETTLE`], the usual case (an ephemeral
    /// runner exits right after reporting its job), read every
    /// [`COMPLETION_POLL`]. A read that fails is "not yet".
    async fn exits_soon(&self, name: &InstanceName) -> bool {
        let polls = u32::try_from(COMPLETION_SETTLE.as_millis() / COMPLETION_POLL.as_millis())
            .unwrap_or(1)
            .max(1);
        let waits = ConstantBuilder::default()
            .with_delay(COMPLETION_POLL)
            .with_max_times(polls as usize)
            .build();
        for wait in waits {
            tokio::time::sleep(wait).await;
            match self.provider.find(name).await {
                Ok(Some(i)) if i.may_run() => {}
                Ok(_) => return true,
                Err(_) => return false,
            }
        }
        false
    }

    /// Whether the runner in `instance`, whose registration GitHub has just
    /// let go without a finished job (a scale-down, a drain, the start
    /// deadline, recovery), is at work all the same, by the node's own
    /// evidence: its job process ([`crate::provider::Provider::work`]). GitHub's busy flag
    /// lags behind the job it assigns, so its accepting the removal does
    /// not prove the runner idle; either word that the runner works keeps
    /// it. A provider that cannot see processes leaves GitHub's word alone.
    /// The removed registration is never minted again: the runner finishes
    /// its job and exits, and its lease ends as a finished job's does.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Failed`] when the provider cannot be read: nothing is
    /// proven, so nothing may be destroyed on this call.
    pub(super) async fn at_work(
        &self,
        lease: &LeaseId,
        instance: &InstanceName,
    ) -> Result<bool, RunnerError> {
        match self.provider.work(instance).await {
            Ok(Work::Busy) => {
                info!(%lease, %instance, "GitHub let the registration go, but the runner's job process runs: it is at work and keeps running");
                Ok(true)
            }
            Ok(Work::Idle) => Ok(false),
            Ok(Work::Unknown) => {
                info!(%lease, %instance, "this provider cannot show whether the runner is at work; GitHub's removal is the only evidence");
                Ok(false)
            }
            Err(e) => Err(RunnerError::Failed(format!(
                "cannot read whether the runner in {instance} is at work ({e}); its registration is removed, so it takes no new job, and nothing was destroyed"
            ))),
        }
    }

    /// Marks a running request's runner online: it has taken a job, so the
    /// start deadline and a drain's retirement no longer apply to it.
    pub(super) fn mark_online(&self, request_id: RequestId) {
        if let Some(s) = self.state().running.get_mut(&request_id) {
            s.online = true;
        }
    }

    /// Ends whatever was started for a request, as `order` allows.
    /// Idempotent: a request nothing was started for, or whose compute is
    /// proven gone, is success.
    ///
    /// - A scale-down (no completion, no force) of compute that already
    ///   ended other than by exiting 0 (killed, OOM, a crash, removed) holds
    ///   it in custody as a teardown released `failed` with that reason
    ///   ([`RunnerError::Custody`]), as a tend would have.
    /// - Any other scale-down removes the runner's
    ///   registration first. GitHub refusing it as busy (JobStillRunning)
    ///   answers [`RunnerError::Busy`] and leaves the instance running and
    ///   the lease held; a removal that fails for an outage destroys nothing
    ///   either ([`RunnerError::Failed`], ask again). A removal GitHub
    ///   accepts is checked against the runner's job process
    ///   ([`Runner::at_work`]): a runner at work is answered
    ///   [`RunnerError::Busy`] and kept all the same.
    /// - A completion destroys an instance that no longer runs. One whose
    ///   runner still works is held in custody as *ending*, left to exit on
    ///   its own within the post-job grace and judged by every tend; the
    ///   answer is [`RunnerError::Busy`] with `held`.
    /// - Force destroys whatever GitHub or the runner says; the override is
    ///   logged with both, and the reason is recorded as the lease's failure
    ///   reason.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Busy`] as above; [`RunnerError::Custody`] while
    /// anything for the request is not proven gone; [`RunnerError::Failed`]
    /// when the provider or the plane could not be asked (retry).
    pub async fn destroy(
        &self,
        request_id: RequestId,
        order: &DestroyOrder,
    ) -> Result<(), RunnerError> {
        if order.job_result.as_deref() == Some("succeeded")
            && !order.force
            && let Some(cache) = &self.cache
        {
            // GitHub says the job succeeded: its sticky disks are committed
            // once its compute is gone, whichever path ends it.
            let leases: Vec<LeaseId> = {
                let s = self.state();
                s.running
                    .get(&request_id)
                    .map(|r| r.lease.clone())
                    .into_iter()
                    .chain(
                        s.custody
                            .iter()
                            .filter(|(_, e)| e.request_id == request_id)
                            .map(|(l, _)| l.clone()),
                    )
                    .collect()
            };
            for lease in leases {
                if let Err(e) = cache.mark_succeeded(&lease).await {
                    warn!(%lease, error = %e, "cannot journal that the job succeeded; a restart before its end discards its sticky disks");
                }
                // SettleDocker (spec/cache.md §3.3): a trusted tier's image
                // store publishes once its guest says it is ready. The guest
                // has until its compute ends: the wait below for a runner
                // to exit (COMPLETION_SETTLE), then the post-job grace in
                // custody; the store is published after the compute is
                // proven gone, since a bind mount cannot be detached from
                // a running container.
                if let Some(sessions) = &self.sessions {
                    sessions.open_settlement(&lease).await;
                }
            }
        }
        let held: Vec<LeaseId> = {
            let s = self.state();
            let mut held: Vec<LeaseId> = s
                .custody
                .iter()
                .filter(|(_, e)| e.request_id == request_id)
                .map(|(l, _)| l.clone())
                .collect();
            held.sort_by(|a, b| a.as_str().cmp(b.as_str()));
            held
        };
        let mut busy = None;
        for lease in held {
            if let Err(e) = self.destroy_held(&lease, order).await {
                if e.is_busy() {
                    busy = Some(e);
                } else {
                    warn!(%lease, error = %e, "ending a held lease during destroy");
                }
            }
        }
        let running = self.state().running.get(&request_id).cloned();
        let Some(running) = running else {
            if let Some(busy) = busy {
                return Err(busy);
            }
            let unconfirmed = self
                .state()
                .custody
                .values()
                .any(|e| e.request_id == request_id && e.unconfirmed);
            return if unconfirmed {
                Err(RunnerError::Custody(format!(
                    "request {request_id}: held until its instance is confirmed gone"
                )))
            } else {
                Ok(())
            };
        };
        let instance = self.provider.find(&running.instance).await.map_err(|e| {
            RunnerError::Failed(format!(
                "read {} before destroying it: {e}; nothing was destroyed",
                running.instance
            ))
        })?;
        let mut runs = instance.as_ref().is_some_and(Instance::may_run);
        if runs && order.job_result.is_some() && !order.force {
            runs = !self.exits_soon(&running.instance).await;
        }
        let provider_says = instance
            .as_ref()
            .map_or_else(|| "gone".to_owned(), |i| format!("{:?}", i.state));
        let (id, name) = running.registration.clone();
        let reason = order.reason.as_deref().unwrap_or("-");
        if order.force {
            // Routing first, but no answer stops a forced destroy.
            let github_says = match self
                .jit
                .remove_runner(&running.lease, running.epoch, id, &name)
                .await
            {
                Ok(()) => "registration removed".to_owned(),
                Err(e) => {
                    self.state().removals.failed(
                        &running.lease,
                        running.epoch,
                        running.registration.clone(),
                    );
                    e.to_string()
                }
            };
            if runs {
                warn!(lease = %running.lease, request = request_id.0, instance = %running.instance,
                      %reason, github = %github_says, provider = %provider_says,
                      "forced destroy: ending the runner whatever it is doing");
                if let Some(why) = &order.reason
                    && let Err(e) = self
                        .ledger
                        .mark_failure(
                            &running.lease,
                            running.epoch,
                            &FailureReason::forced(Some(why)),
                        )
                        .await
                {
                    warn!(lease = %running.lease, error = %e, "the forced destroy's reason was not recorded");
                }
            }
        } else if order.job_result.is_none() {
            // A scale-down: GitHub has not retired this runner, and it may
            // have just taken a job its listing does not show yet. Routing
            // first; a busy runner is kept.
            // The create saw it exist: its absence is proof it is gone.
            if let Some(died) = EndReason::of_instance(instance.as_ref(), true) {
                // Its compute ended before its job did (killed, OOM, a
                // crash, removed): a scale-down must not turn that into a
                // `done`. Torn down as a tend would, released `failed`.
                warn!(lease = %running.lease, request = request_id.0, instance = %running.instance, reason = %died,
                      "scale-down of a runner whose compute already ended; tearing it down and releasing the lease as failed");
                self.end_running(
                    request_id,
                    &running,
                    died,
                    Some(running.registration.clone()),
                )
                .await;
                return Err(RunnerError::Custody(format!(
                    "{} ended ({died}) before its job did; this node releases lease {} as failed once it is torn down",
                    running.instance, running.lease
                )));
            }
            match self
                .jit
                .remove_runner(&running.lease, running.epoch, id, &name)
                .await
            {
                Ok(()) if runs => {
                    if self.at_work(&running.lease, &running.instance).await? {
                        self.mark_online(request_id);
                        info!(lease = %running.lease, request = request_id.0, provider = %provider_says,
                              "scale-down refused: the runner's job process runs; it keeps running");
                        return Err(RunnerError::Busy {
                            message: format!(
                                "runner {name} is running a job (its job process runs, though GitHub let its registration go); nothing was destroyed"
                            ),
                            held: false,
                        });
                    }
                }
                Ok(()) => {}
                Err(e) if !runs => {
                    // Its compute has ended: the removal policy's backoff.
                    let wait = self.state().removals.failed(
                        &running.lease,
                        running.epoch,
                        running.registration.clone(),
                    );
                    warn!(lease = %running.lease, error = %e, retry_in_s = wait.as_secs_f32(), "the registration of ended compute is not removed yet; retrying with backoff");
                }
                Err(e @ (PlaneError::Busy(_) | PlaneError::Refused(_))) => {
                    info!(lease = %running.lease, request = request_id.0, github = %e, provider = %provider_says,
                          "scale-down refused: the runner is busy; it keeps running");
                    return Err(RunnerError::Busy {
                        message: format!(
                            "runner {name} is running a job (GitHub: {e}); nothing was destroyed"
                        ),
                        held: false,
                    });
                }
                Err(e) => {
                    return Err(RunnerError::Failed(format!(
                        "could not remove the registration of {name} before destroying it ({e}); nothing was destroyed"
                    )));
                }
            }
        } else if runs {
            // A completion while the runner still works (GitHub has been
            // seen to send it early): an ephemeral runner exits on its own
            // after its job, so it gets the post-job grace; every tend
            // judges it, and the node releases the lease itself.
            let taken = {
                let mut s = self.state();
                let same = s
                    .running
                    .get(&request_id)
                    .is_some_and(|r| r.lease == running.lease);
                if same {
                    s.running.remove(&request_id);
                }
                same
            };
            if taken {
                self.hold(
                    running.lease.clone(),
                    CustodyEntry::ending(
                        running.epoch,
                        running.instance.clone(),
                        request_id,
                        running.registration.clone(),
                    ),
                )
                .await;
            }
            info!(lease = %running.lease, request = request_id.0, instance = %running.instance,
                  result = order.job_result.as_deref().unwrap_or("-"), grace_s = self.options.post_job_grace.as_secs(),
                  "the job is complete and its runner still works; leaving it the post-job grace to exit");
            return Err(RunnerError::Busy {
                message: format!(
                    "{} still runs after its job's completion; this node holds lease {} and ends it once the runner exits, or after {}s",
                    running.instance,
                    running.lease,
                    self.options.post_job_grace.as_secs()
                ),
                held: true,
            });
        }
        match self.provider.destroy(&running.instance).await {
            Err(e) => Err(RunnerError::Failed(format!(
                "destroy {}: {e}",
                running.instance
            ))),
            Ok(teardown) => {
                self.state().running.remove(&request_id);
                info!(lease = %running.lease, request = request_id.0, instance = %running.instance,
                      result = order.job_result.as_deref().unwrap_or("-"), force = order.force, %reason, ?teardown, "destroyed");
                // A runner forced out mid-work is the node's to end: its
                // lease is released `failed` with the operator's reason once
                // its compute is proven gone (now, or when a requested stop
                // has taken), freeing its capacity, rather than left open
                // until GitHub gives its job up. A custody half of the same
                // lease was already given the reason by its own step.
                let forced =
                    order.force && runs && !self.state().custody.contains_key(&running.lease);
                if teardown == Teardown::Requested || forced {
                    let outcome = if order.force && runs {
                        Ending::Failed(FailureReason::forced(order.reason.as_deref()))
                    } else {
                        Ending::Done
                    };
                    self.hold(
                        running.lease.clone(),
                        CustodyEntry::teardown(
                            running.epoch,
                            running.instance.clone(),
                            request_id,
                            outcome,
                            self.provider.runs_on_host(),
                        ),
                    )
                    .await;
                    if teardown == Teardown::Requested {
                        return Err(RunnerError::Custody(format!(
                            "{} was asked to stop and is not yet gone",
                            running.instance
                        )));
                    }
                    if let Err(e) = self.tend_one(&running.lease, Seen::Ask).await {
                        warn!(lease = %running.lease, error = %e, "the forced-out runner's lease is not released yet; the next tend tries again");
                    }
                    return if self.state().custody.contains_key(&running.lease) {
                        Err(RunnerError::Custody(format!(
                            "{} is gone; this node releases lease {} failed once the plane takes the release",
                            running.instance, running.lease
                        )))
                    } else {
                        Ok(())
                    };
                }
                let (held, pending) = {
                    let s = self.state();
                    (
                        s.custody.contains_key(&running.lease),
                        s.removals.contains(&running.lease),
                    )
                };
                if held {
                    // A custody half of the same lease ends on its own step.
                } else if pending {
                    // The launch record keeps the removal across a restart.
                    self.ended(&running.lease).await;
                } else {
                    self.forget(&running.lease).await;
                }
                Ok(())
            }
        }
    }
}
