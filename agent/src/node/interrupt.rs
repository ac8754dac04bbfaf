//! The runner's side of a host interruption: every running lease is ended
//! with the notice's reason and left to exit, and the plane is told why
//! (the notice itself comes from `interruption`).

use tracing::{error, info, warn};

use super::custody::{CustodyEntry, Seen, custody_record};
use super::ending::{EndReason, Ending, FailureReason};
use super::freshness::says_version_refused;
use super::plane::{PlaneError, Retired};
use super::runner::{LEASE_LIFE_WARN_EVERY, Runner, Running};
use crate::model::{Epoch, LeaseId, Phase, RequestId};
use crate::provider::Instance;

/// What one [`Runner::interrupt`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted {
    /// Leases failed with the reason and set to be destroyed.
    pub ended: usize,
    /// Leases whose reason the plane could not record: left as they were,
    /// for the next pass.
    pub unrecorded: usize,
}

impl Runner {
    /// The running requests, read before an inventory: each was created
    /// before the inventory was read, so its absence from it means gone.
    pub(super) fn running_snapshot(&self) -> Vec<(RequestId, Running)> {
        self.state()
            .running
            .iter()
            .map(|(q, r)| (*q, r.clone()))
            .collect()
    }

    /// Running requests whose compute ended, by a complete inventory read
    /// after `before` was taken: an instance missing (removed behind this
    /// node's back) or no longer running (exited, OOM-killed, killed, being
    /// removed). Each moves to custody as a teardown, with its
    /// [`EndReason`], released `failed` (or `done` for a runner that exited
    /// 0 on its own, the end of an ephemeral runner's job) once its
    /// instance is destroyed; this host's provider saw it exist, so no grace
    /// applies. The same tend tears it down.
    pub(super) async fn end_gone_runners(
        &self,
        before: &[(RequestId, Running)],
        inventory: &[Instance],
    ) {
        for (request_id, r) in before {
            if self.state().custody.contains_key(&r.lease) {
                // Held already: custody's own step decides.
                continue;
            }
            let mut reason = match inventory.iter().find(|i| i.name == r.instance.as_str()) {
                None => Some(EndReason::Removed),
                Some(i) if !i.may_run() => EndReason::from_state(i.state),
                Some(_) => continue,
            };
            if matches!(reason, Some(EndReason::Exit(_)))
                && !r.online
                && self.version_refused(r).await
            {
                reason = Some(EndReason::RunnerVersionRejected);
            }
            if let Some(why @ (EndReason::Exit(_) | EndReason::RunnerVersionRejected)) = reason
                && !r.online
            {
                // An ephemeral runner exits 0 after its job: one that exits
                // otherwise before it was seen online never became a runner.
                let threshold = self.options.tier_failures_before_unhealthy;
                let error = format!("its runner exited before coming online ({why})");
                let tripped = self
                    .state()
                    .tiers
                    .exited_before_online(&r.lease, &error, threshold);
                if let Some(unhealthy) = tripped {
                    warn!(tier = %unhealthy.tier, failures = unhealthy.failures, retry_after = ?unhealthy.retry_after,
                          "the tier keeps failing to start here; refusing its launches until the wait passes or its definition changes");
                }
            }
            let still = {
                let mut s = self.state();
                let same = s
                    .running
                    .get(request_id)
                    .is_some_and(|now| now.lease == r.lease);
                if same {
                    s.running.remove(request_id);
                }
                same
            };
            if !still {
                continue;
            }
            let outcome = match reason {
                Some(reason) => Ending::Failed(FailureReason::Compute(reason)),
                None => Ending::Done,
            };
            match reason {
                Some(reason) => {
                    warn!(lease = %r.lease, instance = %r.instance, %reason, "the runner's compute ended while its job ran; tearing it down and releasing the lease as failed");
                }
                None => {
                    info!(lease = %r.lease, instance = %r.instance, "the runner exited 0 on its own; tearing it down and releasing the lease");
                }
            }
            self.hold(
                r.lease.clone(),
                CustodyEntry {
                    registration: Some(r.registration.clone()),
                    ..CustodyEntry::teardown(
                        r.epoch,
                        r.instance.clone(),
                        *request_id,
                        outcome,
                        true,
                    )
                },
            )
            .await;
        }
    }

    /// Whether the runner of `r`, which exited before coming online, said
    /// GitHub refused its version; if so its image launches no more here
    /// until it changes ([`Freshness::rejected`]). Output that cannot be
    /// read says nothing.
    ///
    /// [`Freshness::rejected`]: super::freshness::Freshness::rejected
    async fn version_refused(&self, r: &Running) -> bool {
        let output = match self.provider.output_tail(&r.instance).await {
            Ok(output) => output,
            Err(e) => {
                warn!(lease = %r.lease, instance = %r.instance, error = %e, "cannot read why the runner exited");
                return false;
            }
        };
        if !says_version_refused(&output) {
            return false;
        }
        if let Some((image, id)) = &r.image {
            error!(lease = %r.lease, %image, image_id = %id,
                   "the runner exited before coming online saying GitHub refused its version; this image launches no more here until it changes: rebuild it on a newer actions/runner");
            self.freshness.rejected(image, id, None);
        } else {
            error!(lease = %r.lease, instance = %r.instance,
                   "the runner exited before coming online saying GitHub refused its version; rebuild its image on a newer actions/runner");
        }
        true
    }

    /// Running requests whose instance still runs, judged on time, by a
    /// complete inventory: past the operator's lease-life bound
    /// ([`RunnerOptions::max_lease_life`](super::runner::RunnerOptions)),
    /// the instance is torn down on that authority, busy or not, with
    /// reason `max_lease_life`; each whole hour of a lease's life is
    /// warned about. Past the start deadline and not known online, the
    /// registration is removed first: GitHub refuses to remove a runner
    /// holding a job, which marks it online for good, as does a job process
    /// running in it ([`Runner::at_work`]) whatever GitHub said; a removal that
    /// succeeds leaves a runner that took nothing and can take nothing, torn
    /// down with reason `start_deadline`; an outage leaves it to the next
    /// tend. Either teardown moves the request into custody, where this
    /// tend's own step destroys it and releases the lease `failed`.
    pub(super) async fn judge_running(&self, inventory: &[Instance]) {
        let max_life = self.options.max_lease_life.filter(|d| !d.is_zero());
        let deadline = self.options.start_deadline.filter(|d| !d.is_zero());
        for (request_id, r) in self.running_snapshot() {
            if self.state().custody.contains_key(&r.lease) {
                continue;
            }
            let runs = inventory
                .iter()
                .any(|i| i.name == r.instance.as_str() && i.may_run());
            if !runs {
                continue;
            }
            let age = r.since.elapsed();
            if let Some(max) = max_life
                && age > max
            {
                error!(lease = %r.lease, instance = %r.instance, age_s = age.as_secs(), max_s = max.as_secs(),
                       online = r.online, "the lease outlived max_lease_life; destroying on the operator's bound, busy or not, and releasing it as failed");
                self.end_running(request_id, &r, EndReason::MaxLeaseLife, None)
                    .await;
                continue;
            }
            let hours = age.as_secs() / LEASE_LIFE_WARN_EVERY.as_secs();
            if hours > r.warned_hours {
                if let Some(s) = self.state().running.get_mut(&request_id) {
                    s.warned_hours = hours;
                }
                match max_life {
                    Some(max) => warn!(lease = %r.lease, age_h = hours, max_s = max.as_secs(),
                                       "this lease has lived over {hours} h; it is destroyed once it passes max_lease_life"),
                    None => warn!(lease = %r.lease, age_h = hours,
                                  "this lease has lived over {hours} h; no max_lease_life is set, so time alone never ends it"),
                }
            }
            let Some(deadline) = deadline else { continue };
            if r.online || age < deadline {
                continue;
            }
            let (id, name) = &r.registration;
            match self.jit.retire_runner(&r.lease, r.epoch, *id, name).await {
                Ok(Retired::AlreadyGone) if !r.retire_tried => {
                    self.leave_to_exit(request_id, &r).await;
                }
                Ok(_) => {
                    if !self.idle_after_removal(request_id, &r).await {
                        continue;
                    }
                    warn!(lease = %r.lease, instance = %r.instance, deadline_s = deadline.as_secs(),
                          "the runner did not come online within the start deadline; its registration is removed, tearing it down");
                    self.end_running(request_id, &r, EndReason::StartDeadline, None)
                        .await;
                }
                Err(e @ PlaneError::Unavailable(_)) => {
                    warn!(lease = %r.lease, error = %e, "past the start deadline, but the registration could not be removed; the next tend tries again");
                    if let Some(s) = self.state().running.get_mut(&request_id) {
                        s.retire_tried = true;
                    }
                }
                Err(e) => {
                    // GitHub will not remove a runner holding a job (or the
                    // plane answered for good): it is online.
                    info!(lease = %r.lease, answer = %e, "past the start deadline, the runner is busy at GitHub; it came online");
                    self.mark_online(request_id);
                }
            }
        }
    }

    /// After GitHub accepted the removal of a running runner's registration
    /// (the start deadline, a drain): whether it may be torn down, by its
    /// job process ([`Runner::at_work`]). One at work is online from now
    /// on; one whose processes cannot be read is asked about again later
    /// (a removal then proves nothing).
    async fn idle_after_removal(&self, request_id: RequestId, r: &Running) -> bool {
        match self.at_work(&r.lease, &r.instance).await {
            Ok(false) => true,
            Ok(true) => {
                self.mark_online(request_id);
                false
            }
            Err(e) => {
                warn!(lease = %r.lease, error = %e, "asking again later");
                if let Some(s) = self.state().running.get_mut(&request_id) {
                    s.retire_tried = true;
                }
                false
            }
        }
    }

    /// While the node drains: retires each running runner that has not
    /// taken a job, so the drain ends when the working jobs do rather than
    /// at its timeout. Routing first, asked through the removal itself: a
    /// removal GitHub refuses holds a job (online for good, never asked
    /// again); one that succeeds leaves a runner that took nothing and can
    /// take nothing, torn down with reason `drained` and its lease released
    /// `failed` once its compute is proven gone; GitHub no longer having
    /// the registration is a job it ended, the runner left to exit on its
    /// own; an outage leaves it to the next call. Runners held in custody
    /// are custody's to judge. Returns how many it retired.
    pub async fn retire_idle_runners(&self) -> usize {
        let mut retired = 0;
        for (request_id, r) in self.running_snapshot() {
            if r.online || self.state().custody.contains_key(&r.lease) {
                continue;
            }
            let (id, name) = &r.registration;
            match self.jit.retire_runner(&r.lease, r.epoch, *id, name).await {
                Ok(Retired::AlreadyGone) if !r.retire_tried => {
                    self.leave_to_exit(request_id, &r).await;
                }
                Ok(_) => {
                    if !self.idle_after_removal(request_id, &r).await {
                        continue;
                    }
                    info!(lease = %r.lease, instance = %r.instance,
                          "draining: the runner has taken no job and its registration is removed; retiring it");
                    self.end_running(request_id, &r, EndReason::Drained, None)
                        .await;
                    if let Err(e) = self.tend_one(&r.lease, Seen::Ask).await {
                        warn!(lease = %r.lease, error = %e, "the retired runner is not gone yet; the next tend goes on");
                    }
                    retired += 1;
                }
                Err(e @ PlaneError::Unavailable(_)) => {
                    warn!(lease = %r.lease, error = %e, "draining: cannot ask whether the runner has a job; asking again later");
                    if let Some(s) = self.state().running.get_mut(&request_id) {
                        s.retire_tried = true;
                    }
                }
                Err(e) => {
                    info!(lease = %r.lease, answer = %e, "draining: the runner holds a job; it finishes it");
                    self.mark_online(request_id);
                }
            }
        }
        retired
    }

    /// Acts on a notice that the host's capacity is being taken back (a spot
    /// interruption, [`crate::node::interruption`]; the reference's
    /// `WatchInterruptions` handling, spec/node.md §2.11, applied to the
    /// whole host since a Docker node's leases share its capacity). Every
    /// running lease and every custody entry not already discarded first
    /// has `reason` recorded as its failure reason, durable in the ledger
    /// before anything is destroyed; then it becomes a custody teardown
    /// released `failed`, and its instance is destroyed at once rather than
    /// at the next tend (the tend proves it gone and releases the lease). A
    /// lease whose reason the plane could not record (unavailable) is left
    /// as it is and counted in [`Interrupted::unrecorded`]; the caller asks
    /// again while the notice stands. An answer other than success (the
    /// lease fenced, ended, or already holding another reason) is an answer
    /// from the ledger: the lease is ended all the same. Idempotent.
    pub async fn interrupt(&self, reason: EndReason) -> Interrupted {
        let why = FailureReason::Compute(reason);
        let mut done = Interrupted::default();
        let mut destroy = Vec::new();
        for (request_id, r) in self.running_snapshot() {
            if self.state().custody.contains_key(&r.lease) {
                continue;
            }
            if !self.record_interruption(&r.lease, r.epoch, &why).await {
                done.unrecorded += 1;
                continue;
            }
            warn!(lease = %r.lease, instance = %r.instance, reason = %why,
                  "the host's capacity is being taken back: failing the lease and destroying its runner");
            self.end_running(request_id, &r, reason, None).await;
            destroy.push(r.instance.clone());
            done.ended += 1;
        }
        let held: Vec<(LeaseId, Epoch)> = self
            .state()
            .custody
            .iter()
            .filter(|(_, e)| !e.discard)
            .map(|(l, e)| (l.clone(), e.epoch))
            .collect();
        for (lease, epoch) in held {
            if !self.record_interruption(&lease, epoch, &why).await {
                done.unrecorded += 1;
                continue;
            }
            let record = {
                let mut s = self.state();
                let Some(e) = s.custody.get_mut(&lease) else {
                    continue;
                };
                if e.discard || e.epoch != epoch {
                    continue;
                }
                e.discard = true;
                e.ending = false;
                e.outcome = Ending::Failed(FailureReason::Compute(reason));
                if e.phase.is_some() {
                    e.phase = Some(Phase::Teardown);
                }
                destroy.push(e.instance.clone());
                custody_record(&lease, e)
            };
            warn!(%lease, reason = %why, "the host's capacity is being taken back: the held lease is failed and its instance destroyed");
            if let Err(e) = self.journal.put_custody_all(&[record]).await {
                error!(%lease, error = %e, "cannot journal the interrupted custody entry; a restart holds it as it was");
            }
            done.ended += 1;
        }
        for instance in destroy {
            if let Err(e) = self.provider.destroy(&instance).await {
                warn!(%instance, error = %e, "destroying an interrupted instance failed; the next tend destroys it");
            }
        }
        done
    }

    /// Records an interruption's reason for one lease: `false` when the
    /// plane could not be asked (nothing is ended then).
    pub(super) async fn record_interruption(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        why: &FailureReason,
    ) -> bool {
        match self.ledger.mark_failure(lease, epoch, why).await {
            Ok(()) => true,
            Err(e @ PlaneError::Unavailable(_)) => {
                warn!(%lease, error = %e, "the interruption's reason could not be recorded; the lease is ended once it is");
                false
            }
            Err(e) => {
                info!(%lease, answer = %e, "the ledger answered the interruption's reason; ending the lease");
                true
            }
        }
    }

    /// Moves a running request into custody as a teardown released `failed`
    /// with `reason`, its registration `registration` still to remove
    /// (`None`: by lease, not holding the teardown back). A no-op when the
    /// request no longer runs that lease.
    pub(super) async fn end_running(
        &self,
        request_id: RequestId,
        r: &Running,
        reason: EndReason,
        registration: Option<(i64, String)>,
    ) {
        if !self.take_running(request_id, &r.lease) {
            return;
        }
        self.hold(
            r.lease.clone(),
            CustodyEntry {
                registration,
                ..CustodyEntry::teardown(
                    r.epoch,
                    r.instance.clone(),
                    request_id,
                    Ending::Failed(FailureReason::Compute(reason)),
                    true,
                )
            },
        )
        .await;
    }

    /// Takes `request_id` out of the running requests if it still runs
    /// `lease`; whether it did.
    pub(super) fn take_running(&self, request_id: RequestId, lease: &LeaseId) -> bool {
        let mut s = self.state();
        let same = s
            .running
            .get(&request_id)
            .is_some_and(|now| now.lease == *lease);
        if same {
            s.running.remove(&request_id);
        }
        same
    }

    /// A running request past the start deadline whose registration GitHub
    /// no longer had: an ephemeral runner's goes with its completed job (a
    /// runner at its post-job work, its completion not yet delivered,
    /// which must not be killed and recorded `failed` `start_deadline`),
    /// but a registration removed out of band looks the same (and such a
    /// never-connecting runner must not be held for ever). Either way it
    /// can take no job: it is held as *ending*, left the post-job grace to
    /// exit on its own (`done`), and stopped past it, released `failed`
    /// with reason `start_deadline`.
    pub(super) async fn leave_to_exit(&self, request_id: RequestId, r: &Running) {
        if !self.take_running(request_id, &r.lease) {
            return;
        }
        info!(lease = %r.lease, instance = %r.instance, grace_s = self.options.post_job_grace.as_secs(),
              "past the start deadline, GitHub no longer has the runner's registration (a job it finished, or removed out of band); it can take no job and is left the post-job grace to exit");
        self.hold(
            r.lease.clone(),
            CustodyEntry {
                registration: None,
                grace_reason: Some(EndReason::StartDeadline),
                ..CustodyEntry::ending(
                    r.epoch,
                    r.instance.clone(),
                    request_id,
                    r.registration.clone(),
                )
            },
        )
        .await;
    }
}
