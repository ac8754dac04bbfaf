//! Custody: compute this node holds on its own authority until it is
//! proven gone, and the passes that keep the node's view true.
//!
//! Behaviour follows the reference's custody (seed/node-package.md,
//! `Runner.AssumeCustody`, `KeepAlive`, `Tend`, `Recover`, `Sweep`;
//! spec/node.md §2.1, §2.4 to §2.7). A lease enters custody on a lost or
//! refused reply, an adoption at start-up, a supersession, or a failed
//! launch that may have started something. [`Runner::keep_alive`] renews
//! what is held every third of the TTL on its own task, touching only the
//! ledger; [`Runner::tend`] advances each entry one step (heartbeat first:
//! a refused heartbeat means the capacity is no longer ours); time alone
//! never kills a job (`max_custody` is off by default).
//!
//! Architecture Invariant: nothing here releases a lease while an instance
//! for it may still run; absence counts as proof only after the instance
//! was seen, or after the stray grace.

use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, error, info, warn};

use super::ending::{EndReason, Ending, FailureReason};
use super::plane::{PlaneError, Retired};
use super::runner::{Runner, RunnerError, now_plus};
use crate::journal::{BootStamp, CustodyRecord};
use crate::model::{DestroyOrder, Epoch, InstanceName, LeaseId, Phase, RequestId, parse_phase};
use crate::provider::{Instance, Teardown};

/// Where one custody step reads its instance from.
#[derive(Clone, Copy, Debug)]
pub(super) enum Seen<'a> {
    /// This tend's complete inventory.
    Listed(&'a [Instance]),
    /// This tend could not list the provider: nothing is judged.
    Unread,
    /// Ask the provider for this one instance (outside a tend).
    Ask,
}

/// How one custody step learns whether its lease was renewed.
#[derive(Debug)]
pub(super) enum Renewal {
    /// This tend's one batched heartbeat answered for the lease (`None`:
    /// its answer did not name the lease).
    Answered(Option<Result<(), PlaneError>>),
    /// Renew this lease alone (a step outside a tend).
    Ask,
}

/// After this long in custody every tend warns, naming the lease.
pub(crate) const CUSTODY_WARN_AFTER: Duration = Duration::from_secs(3600);

/// How often KeepAlive wakes to see whether renewal is due.
pub(crate) const KEEPALIVE_WAKE: Duration = Duration::from_millis(500);

/// Compute the node holds on its own clock until it is proven gone
/// (spec/node.md §2.1).
#[derive(Debug, Clone)]
pub(super) struct CustodyEntry {
    pub(super) epoch: Epoch,
    pub(super) instance: InstanceName,
    pub(super) request_id: RequestId,
    /// A registration still to be removed: (runner id, runner name).
    pub(super) registration: Option<(i64, String)>,
    /// What Release will record: `done`, or `failed` with its reason.
    /// Journaled with the reason, so a restart releases it as it was.
    pub(super) outcome: Ending,
    /// Ledger phase to report each tick; `None` once quarantined.
    pub(super) phase: Option<Phase>,
    /// Destroy on sight, rather than let a running job finish.
    pub(super) discard: bool,
    /// The provider has seen this instance exist.
    pub(super) observed: bool,
    /// Start of the current run of absences.
    pub(super) absent_since: Option<Instant>,
    /// Not yet proven gone.
    pub(super) unconfirmed: bool,
    pub(super) since: Instant,
    /// The phase this process has reported to the ledger for the entry
    /// (advanced, or refused as a bad transition, which is an answer too);
    /// a tend reports `phase` only when it differs. Not journaled: a
    /// restarted node reports once more.
    pub(super) reported: Option<Phase>,
    /// The job's completion arrived while its runner still worked: the
    /// runner is left to exit on its own until the post-job grace (counted
    /// from `since`) passes. Journaled as a teardown that is not discarded.
    pub(super) ending: bool,
    /// The journal may not hold the entry as it is: its last write failed
    /// (a full or failing disk). The next tend writes it again, changed or
    /// not ([`Runner::rejournal`]). Not journaled.
    pub(super) unjournaled: bool,
    /// The runner is known online (GitHub refused to remove its
    /// registration: it holds a job), so the start deadline no longer
    /// applies. Not journaled: a restarted node asks once more.
    pub(super) online: bool,
    /// As [`Running`]'s: a removal at the start deadline failed without an
    /// answer. Not journaled.
    pub(super) retire_tried: bool,
    /// The reason an ending runner that overruns its grace is stopped
    /// with; `None` is `post_job_timeout`. `start_deadline` for a runner
    /// whose registration GitHub no longer had at the start deadline. Not
    /// journaled: after a restart an overrun is `post_job_timeout`.
    pub(super) grace_reason: Option<EndReason>,
}

impl CustodyEntry {
    /// Compute held so that a job can finish: renewed, reported as
    /// `custody`, released `done` once the instance is gone.
    pub(super) fn job(
        epoch: Epoch,
        instance: InstanceName,
        request_id: RequestId,
        observed: bool,
    ) -> Self {
        Self {
            epoch,
            instance,
            request_id,
            registration: None,
            outcome: Ending::Done,
            phase: Some(Phase::Custody),
            discard: false,
            observed,
            absent_since: None,
            unconfirmed: true,
            since: Instant::now(),
            reported: None,
            ending: false,
            unjournaled: false,
            online: false,
            retire_tried: false,
            grace_reason: None,
        }
    }

    /// A runner still working after its job's completion: renewed, reported
    /// as `teardown`, left to exit on its own within the post-job grace,
    /// released `done` once its instance is gone.
    pub(super) fn ending(
        epoch: Epoch,
        instance: InstanceName,
        request_id: RequestId,
        registration: (i64, String),
    ) -> Self {
        Self {
            registration: Some(registration),
            phase: Some(Phase::Teardown),
            ending: true,
            ..Self::job(epoch, instance, request_id, true)
        }
    }

    /// Compute to tear down: destroyed on sight, reported as `teardown`,
    /// released with `outcome` once proven gone.
    pub(super) fn teardown(
        epoch: Epoch,
        instance: InstanceName,
        request_id: RequestId,
        outcome: Ending,
        observed: bool,
    ) -> Self {
        Self {
            outcome,
            phase: Some(Phase::Teardown),
            discard: true,
            ..Self::job(epoch, instance, request_id, observed)
        }
    }
}

pub(super) fn custody_record(lease: &LeaseId, e: &CustodyEntry) -> CustodyRecord {
    let since = e.since.elapsed();
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    CustodyRecord {
        lease: lease.as_str().to_owned(),
        epoch: e.epoch.0,
        instance: e.instance.as_str().to_owned(),
        request_id: e.request_id.0,
        registration: e.registration.clone(),
        outcome: e.outcome.to_journal(),
        phase: e.phase.map(|p| p.as_str().to_owned()),
        discard: e.discard,
        observed: e.observed,
        since_unix_ms: now_ms - i64::try_from(since.as_millis()).unwrap_or(0),
        since_boot: BootStamp::now().map(|now| now.before(since)),
    }
}

/// Whether `new` differs from `old` in anything the journal records (the
/// fields of [`CustodyRecord`]); what only this process tracks (absences,
/// the phase reported, the reason) is not journaled.
fn journaled_changed(old: &CustodyEntry, new: &CustodyEntry) -> bool {
    old.epoch != new.epoch
        || old.instance != new.instance
        || old.request_id != new.request_id
        || old.registration != new.registration
        || old.outcome != new.outcome
        || old.phase != new.phase
        || old.discard != new.discard
        || old.observed != new.observed
        || old.since != new.since
}

/// How long ago the custody a journaled record describes began: by the
/// boot clock when the record was written in this boot (a wall-clock step
/// while the node was down does not count: a clock that jumped 5 minutes
/// ahead across a restart must not kill a runner inside its post-job
/// grace), else by the wall clock (after a reboot, or a record of a
/// release that did not keep the boot clock).
fn custody_age(r: &CustodyRecord) -> Duration {
    if let (Some(then), Some(now)) = (&r.since_boot, BootStamp::now())
        && let Some(age) = now.since(then)
    {
        return age;
    }
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
    Duration::from_millis(u64::try_from(now_ms - r.since_unix_ms).unwrap_or(0))
}

/// Rebuilds a custody entry from the journal; `None` for a record this build
/// cannot read (it is then re-derived from the ledger and the provider).
pub(super) fn custody_entry(r: &CustodyRecord) -> Option<(LeaseId, CustodyEntry)> {
    let lease = LeaseId::parse("journal.custody.lease", &r.lease).ok()?;
    let age = custody_age(r);
    let phase = match &r.phase {
        Some(p) => Some(parse_phase("journal.custody.phase", p).ok()?),
        None => None,
    };
    let entry = CustodyEntry {
        epoch: Epoch(r.epoch),
        instance: InstanceName::for_lease(&lease),
        request_id: RequestId(r.request_id),
        registration: r.registration.clone(),
        outcome: Ending::from_journal(&r.outcome)?,
        phase,
        discard: r.discard,
        observed: r.observed,
        absent_since: None,
        unconfirmed: true,
        since: Instant::now().checked_sub(age).unwrap_or_else(Instant::now),
        reported: None,
        // A teardown that is not discarded is only ever an ending runner.
        ending: !r.discard && r.phase.as_deref() == Some(Phase::Teardown.as_str()),
        unjournaled: false,
        online: false,
        retire_tried: false,
        grace_reason: None,
    };
    Some((lease, entry))
}

impl Runner {
    pub(super) async fn hold(&self, lease: LeaseId, entry: CustodyEntry) {
        self.hold_all(vec![(lease, entry)]).await;
    }

    /// Holds every entry of `entries`, journaled in one synced transaction
    /// (recovery holds N at once: one sync, not N).
    pub(super) async fn hold_all(&self, entries: Vec<(LeaseId, CustodyEntry)>) {
        if entries.is_empty() {
            return;
        }
        let records: Vec<CustodyRecord> = entries
            .iter()
            .map(|(lease, entry)| {
                info!(%lease, instance = %entry.instance, "holding the lease in custody");
                custody_record(lease, entry)
            })
            .collect();
        let leases: Vec<LeaseId> = entries.iter().map(|(lease, _)| lease.clone()).collect();
        {
            let mut s = self.state();
            for (lease, entry) in entries {
                s.custody.insert(lease, entry);
            }
        }
        let written = self.journal.put_custody_all(&records).await;
        if let Err(e) = &written
            && let Some(suppressed) = self.journal_log.admit()
        {
            error!(error = %e, suppressed, "cannot journal a custody entry; the next tend tries again, and a restart before it succeeds would forget the entry");
        }
        self.mark_journaled(&leases, written.is_ok());
    }

    /// Records whether the journal now holds the held entries of `leases`
    /// as they are (`journaled`), or must be written again by the next
    /// tend.
    fn mark_journaled(&self, leases: &[LeaseId], journaled: bool) {
        let mut s = self.state();
        for lease in leases {
            if let Some(entry) = s.custody.get_mut(lease) {
                entry.unjournaled = !journaled;
            }
        }
    }

    /// Writes again, in one synced transaction, every held entry whose
    /// last journal write failed; run at the start of each tend, so a
    /// failed write is retried on the tend's clock and not only when the
    /// entry next changes. Nothing to write: no I/O.
    pub(super) async fn rejournal(&self) {
        let (leases, records): (Vec<LeaseId>, Vec<CustodyRecord>) = {
            let s = self.state();
            s.custody
                .iter()
                .filter(|(_, entry)| entry.unjournaled)
                .map(|(lease, entry)| (lease.clone(), custody_record(lease, entry)))
                .unzip()
        };
        if records.is_empty() {
            return;
        }
        let written = self.journal.put_custody_all(&records).await;
        match &written {
            Ok(()) => info!(
                entries = records.len(),
                "journaled custody entries whose earlier write had failed"
            ),
            Err(e) => {
                if let Some(suppressed) = self.journal_log.admit() {
                    error!(error = %e, suppressed, entries = records.len(), "still cannot journal custody entries; the next tend tries again, and a restart before it succeeds would forget them");
                }
            }
        }
        self.mark_journaled(&leases, written.is_ok());
    }

    /// Takes responsibility for a lease whose successful launch the plane
    /// did not acknowledge. Idempotent.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Custody`] when the entry is held but its first renewal
    /// failed (KeepAlive retries).
    pub async fn assume_custody(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        request_id: RequestId,
    ) -> Result<(), RunnerError> {
        let held_epoch = {
            let s = self.state();
            match (s.custody.get(lease), s.running.get(&request_id)) {
                // Already held: holding twice changes nothing but a renewal.
                (Some(entry), _) => Some(entry.epoch),
                (None, Some(running)) if running.lease == *lease => None,
                // Nothing runs for it here: the plane's release is correct.
                (None, _) => return Ok(()),
            }
        };
        let epoch = match held_epoch {
            Some(e) => e,
            None => {
                let running = self.state().running.get(&request_id).cloned();
                let Some(running) = running else {
                    return Ok(());
                };
                let epoch = epoch.max(running.epoch);
                self.hold(
                    lease.clone(),
                    CustodyEntry {
                        online: running.online,
                        retire_tried: running.retire_tried,
                        ..CustodyEntry::job(
                            epoch,
                            running.instance.clone(),
                            request_id,
                            self.provider.runs_on_host(),
                        )
                    },
                )
                .await;
                info!(%lease, instance = %running.instance, "assumed custody");
                epoch
            }
        };
        match self.ledger.heartbeat(&[(lease.clone(), epoch)]).await {
            Ok(results) => match results.into_iter().next() {
                Some(Err(e)) => Err(RunnerError::Custody(format!(
                    "custody of {lease} is held; its renewal was refused ({e}) and the next tend decides"
                ))),
                _ => Ok(()),
            },
            Err(e) => Err(RunnerError::Custody(format!(
                "custody of {lease} is held; renewal will be retried ({e})"
            ))),
        }
    }

    /// Moves every running request into custody: another process owns this
    /// node's name now, so completions will not reach this one.
    pub async fn superseded(&self) {
        let running: Vec<_> = self.state().running.drain().collect();
        for (request_id, r) in running {
            if self.state().custody.contains_key(&r.lease) {
                continue;
            }
            let lease = r.lease.clone();
            self.hold(
                lease,
                CustodyEntry {
                    online: r.online,
                    retire_tried: r.retire_tried,
                    ..CustodyEntry::job(
                        r.epoch,
                        r.instance,
                        request_id,
                        self.provider.runs_on_host(),
                    )
                },
            )
            .await;
        }
    }

    /// Renews held and launching leases every third of the TTL until
    /// `cancel`, touching only the ledger.
    pub async fn keep_alive(&self, cancel: CancellationToken) {
        let mut last = Instant::now();
        loop {
            tokio::select! {
                () = cancel.cancelled() => return,
                () = tokio::time::sleep(KEEPALIVE_WAKE) => {}
            }
            let ttl = self.ledger.lease_ttl();
            if ttl.is_zero() || last.elapsed() < ttl / 3 {
                continue;
            }
            last = Instant::now();
            let held: Vec<(LeaseId, Epoch)> = {
                let s = self.state();
                s.custody
                    .iter()
                    .map(|(l, e)| (l.clone(), e.epoch))
                    .chain(s.launching.iter().map(|(l, e)| (l.clone(), *e)))
                    .collect()
            };
            if held.is_empty() {
                continue;
            }
            match self.ledger.heartbeat(&held).await {
                Ok(results) => {
                    for ((lease, _), r) in held.iter().zip(results) {
                        if let Err(e) = r
                            && !e.is_gone()
                            && !matches!(e, PlaneError::ForceRelease(_))
                        {
                            warn!(%lease, error = %e, "renewal refused");
                        }
                    }
                }
                Err(e) => warn!(error = %e, leases = held.len(), "renewal failed"),
            }
        }
    }

    /// One pass over this node's compute, on one provider list: running
    /// requests whose compute ended are moved to custody
    /// (`Runner::end_gone_runners`), every custody entry advances by one
    /// step, and registration removals whose backoff has passed are tried
    /// again. When the list fails, each custody entry asks the provider
    /// itself.
    ///
    /// # Errors
    ///
    /// The joined messages of the entries that could not progress.
    pub async fn tend(&self) -> Result<(), RunnerError> {
        let before = self.running_snapshot();
        let mut errors = Vec::new();
        if before.is_empty() && self.state().custody.is_empty() {
            // Nothing runs and nothing is held: no inventory to read, no
            // lease to renew; only registration removals may be due.
            self.retry_removals().await;
            return Ok(());
        }
        // A custody entry the journal failed to take is written again
        // first, whatever this tend then does with it.
        self.rejournal().await;
        let inventory = match self.provider.list().await {
            Ok(list) => {
                self.end_gone_runners(&before, &list).await;
                self.judge_running(&list).await;
                Some(list)
            }
            Err(e) => {
                errors.push(format!("list instances: {e}"));
                None
            }
        };
        let held: Vec<(LeaseId, Epoch)> = self
            .state()
            .custody
            .iter()
            .map(|(l, e)| (l.clone(), e.epoch))
            .collect();
        // One heartbeat for every entry (spec/node.md §2.4: heartbeat first).
        let mut renewals: std::collections::HashMap<LeaseId, Result<(), PlaneError>> =
            if held.is_empty() {
                std::collections::HashMap::new()
            } else {
                match self.ledger.heartbeat(&held).await {
                    Ok(results) => held.iter().map(|(l, _)| l.clone()).zip(results).collect(),
                    Err(e) => held
                        .iter()
                        .map(|(l, _)| (l.clone(), Err(e.clone())))
                        .collect(),
                }
            };
        for (lease, _) in held {
            let seen = match &inventory {
                Some(list) => Seen::Listed(list),
                None => Seen::Unread,
            };
            let renewal = Renewal::Answered(renewals.remove(&lease));
            if let Err(e) = self.tend_step(&lease, seen, renewal).await {
                errors.push(format!("{lease}: {e}"));
            }
        }
        self.retry_removals().await;
        if errors.is_empty() {
            Ok(())
        } else {
            Err(RunnerError::Failed(errors.join("; ")))
        }
    }

    /// Tries again each registration removal whose backoff has passed.
    /// Removed, or answered as not this node's or not in the ledger any
    /// more, is done; refused as busy or failed for an outage waits longer.
    pub(super) async fn retry_removals(&self) {
        let due = self.state().removals.due();
        for (lease, removal) in due {
            let (id, name) = &removal.registration;
            match self
                .jit
                .remove_runner(&lease, removal.epoch, *id, name)
                .await
            {
                Ok(()) => {
                    info!(%lease, tries = removal.failures + 1, "removed the registration of ended compute");
                    self.removal_done(&lease).await;
                }
                Err(e @ (PlaneError::NotFound(_) | PlaneError::WrongNode(_))) => {
                    warn!(%lease, error = %e, "giving up removing a registration the plane says is not ours");
                    self.removal_done(&lease).await;
                }
                Err(e) => {
                    let wait = self.state().removals.failed(
                        &lease,
                        removal.epoch,
                        removal.registration.clone(),
                    );
                    warn!(%lease, error = %e, tries = removal.failures + 1, retry_in_s = wait.as_secs_f32(), "the registration of ended compute is not removed yet");
                }
            }
        }
    }

    /// A pending removal is over: its launch record, which kept it across
    /// restarts, goes too, unless the lease is held again, in custody or
    /// launched anew here (a launch redelivered after a restart, whose
    /// record is now the live launch's: without it, a restart forgets the
    /// runner, and a lease whose compute then vanishes is never ended).
    async fn removal_done(&self, lease: &LeaseId) {
        let held = {
            let mut s = self.state();
            s.removals.done(lease);
            s.custody.contains_key(lease)
                || s.launching.contains_key(lease)
                || s.running.values().any(|r| r.lease == *lease)
        };
        if !held && let Err(e) = self.journal.forget_launch(lease.as_str()).await {
            warn!(%lease, error = %e, "cannot clear the journal; a restart tries the removal again");
        }
    }

    /// Removes the registration of compute being torn down, routing before
    /// compute, by the one removal policy: removed is done; for compute
    /// that has ended (`ended`: the instance is absent or no longer runs)
    /// any failure goes to the backoff queue and the teardown goes on, since
    /// a runner that is gone takes no job; for compute that may still run,
    /// an outage stops this step (the next tend tries again), and a refusal
    /// of the exact registration holds the entry. Returns whether the
    /// teardown may go on.
    async fn remove_registration(
        &self,
        lease: &LeaseId,
        entry: &mut CustodyEntry,
        ended: bool,
    ) -> Result<(), String> {
        if self.state().removals.contains(lease) {
            // The backoff queue owns this removal now.
            entry.registration = None;
            return Ok(());
        }
        let exact = entry.registration.clone();
        if exact.is_none() && !entry.discard && !ended {
            return Ok(());
        }
        let (id, name) = exact.clone().unwrap_or((0, String::new()));
        // Compute that died holding its exact registration, asked for the
        // first time: GitHub answering that it no longer has it means
        // GitHub had already ended the runner's job (it retires an
        // ephemeral runner's registration with its job), so the job ended
        // before the compute did and the lease is `done`, however the
        // container ended after. A runner killed mid-job keeps its
        // registration until GitHub gives the job up, and an idle one
        // keeps it too.
        let judged = ended
            && exact.is_some()
            && !entry.retire_tried
            && matches!(entry.outcome, Ending::Failed(FailureReason::Compute(_)));
        let removed = if judged {
            self.jit
                .retire_runner(lease, entry.epoch, id, &name)
                .await
                .map(|retired| {
                    if retired == Retired::AlreadyGone {
                        info!(%lease, instance = %entry.instance, was = %entry.outcome,
                              "GitHub had already ended the runner's job when its compute ended; releasing the lease done");
                        entry.outcome = Ending::Done;
                    }
                })
        } else {
            self.jit.remove_runner(lease, entry.epoch, id, &name).await
        };
        match removed {
            Ok(()) => {
                entry.registration = None;
                Ok(())
            }
            Err(e) if ended => {
                if matches!(e, PlaneError::Busy(_))
                    && entry.outcome == Ending::Done
                    && !entry.ending
                {
                    // A runner that exited 0 on its own, while GitHub still
                    // runs a job on it (JobStillRunning): it did not finish
                    // that job, so its lease is not released `done`
                    // (a runner can crash with exit 0 mid-job).
                    warn!(%lease, instance = %entry.instance, "the runner exited 0 while GitHub still runs its job; releasing its lease as failed, exit 0");
                    entry
                        .outcome
                        .fail(FailureReason::Compute(EndReason::Exit(0)));
                }
                let wait = self.state().removals.failed(lease, entry.epoch, (id, name));
                warn!(%lease, error = %e, retry_in_s = wait.as_secs_f32(), "the registration of ended compute is not removed yet; retrying with backoff");
                entry.registration = None;
                Ok(())
            }
            Err(e @ PlaneError::Unavailable(_)) => Err(format!(
                "remove the registration of {lease} before destroying: {e}"
            )),
            Err(e) if exact.is_some() => Err(format!("remove registration {name}: {e}")),
            Err(e) => {
                // An answer (the lease or runner is not this node's; GitHub
                // will not remove a busy runner) does not stop a teardown the
                // node has authority for.
                warn!(%lease, error = %e, "the registration was not removed; destroying on the node's authority");
                Ok(())
            }
        }
    }

    /// Whether a held runner that may still run, never known online, has
    /// passed the start deadline and took nothing: then its registration is
    /// gone and the entry becomes a teardown released `failed` with reason
    /// `start_deadline`. The deadline counts from custody's start (compute
    /// adopted after a restart, or held when the plane assumed custody), so
    /// a runner is never cut sooner than it would have been had it kept
    /// running here, and an adopted runner that never connects is not held,
    /// its job waiting, for ever. As in [`Runner::judge_running`], the node
    /// asks GitHub by removing the registration: a refusal means it holds a
    /// job (online, never asked again), and so does a job process running
    /// in it whatever GitHub answered ([`Runner::at_work`]); an outage leaves
    /// it to the next tend. An ending runner (its job complete) is the
    /// post-job grace's to judge.
    async fn past_start_deadline(&self, lease: &LeaseId, entry: &mut CustodyEntry) -> bool {
        let Some(deadline) = self.options.start_deadline.filter(|d| !d.is_zero()) else {
            return false;
        };
        if entry.online || entry.ending || entry.since.elapsed() < deadline {
            return false;
        }
        let (id, name) = entry.registration.clone().unwrap_or((0, String::new()));
        let retired = self.jit.retire_runner(lease, entry.epoch, id, &name).await;
        if retired.is_ok() {
            // GitHub let the registration go, which its lagging busy flag
            // allows for a runner that has just taken its job: the job
            // process decides (`Runner::at_work`), and one that cannot be
            // read decides nothing on this tend.
            match self.at_work(lease, &entry.instance).await {
                Ok(false) => {}
                Ok(true) => {
                    entry.registration = None;
                    entry.online = true;
                    return false;
                }
                Err(e) => {
                    warn!(%lease, error = %e, "a held runner is past the start deadline and its registration is removed, but whether it is at work is unknown; the next tend asks again");
                    entry.registration = None;
                    entry.retire_tried = true;
                    return false;
                }
            }
        }
        match retired {
            Ok(Retired::AlreadyGone) if !entry.retire_tried => {
                info!(%lease, instance = %entry.instance, grace_s = self.options.post_job_grace.as_secs(),
                      "a held runner is past the start deadline and GitHub no longer has its registration (a job it finished, or removed out of band); it can take no job and is left the post-job grace to exit");
                entry.registration = None;
                entry.ending = true;
                entry.since = Instant::now();
                entry.grace_reason = Some(EndReason::StartDeadline);
                if entry.phase.is_some() {
                    entry.phase = Some(Phase::Teardown);
                }
                false
            }
            Ok(_) => {
                warn!(%lease, instance = %entry.instance, deadline_s = deadline.as_secs(),
                      "a held runner did not come online within the start deadline; its registration is removed, tearing it down");
                entry.registration = None;
                entry.discard = true;
                entry
                    .outcome
                    .fail(FailureReason::Compute(EndReason::StartDeadline));
                if entry.phase.is_some() {
                    entry.phase = Some(Phase::Teardown);
                }
                true
            }
            Err(e @ PlaneError::Unavailable(_)) => {
                warn!(%lease, error = %e, "a held runner is past the start deadline, but its registration could not be removed; the next tend tries again");
                entry.retire_tried = true;
                false
            }
            Err(e) => {
                info!(%lease, answer = %e, "a held runner is past the start deadline and busy at GitHub; it came online");
                entry.online = true;
                false
            }
        }
    }

    /// The post-job grace has passed and the runner still works: the
    /// operator's bound overrides it. Its registration is removed (routing
    /// first; a refusal or an outage goes to the removal backoff, since the
    /// compute ends now), the override is logged with both signals, and the
    /// runner is stopped: SIGTERM, then SIGKILL after the stop timeout. The
    /// entry becomes a teardown released `failed` with `post_job_timeout`.
    async fn overrun_post_job_grace(
        &self,
        lease: &LeaseId,
        entry: &mut CustodyEntry,
        instance: &Instance,
    ) {
        let (id, name) = entry.registration.clone().unwrap_or((0, String::new()));
        let github = match self.jit.remove_runner(lease, entry.epoch, id, &name).await {
            Ok(()) => "registration removed".to_owned(),
            Err(e) => {
                self.state().removals.failed(lease, entry.epoch, (id, name));
                e.to_string()
            }
        };
        entry.registration = None;
        warn!(%lease, instance = %entry.instance, grace_s = self.options.post_job_grace.as_secs(),
              %github, provider = ?instance.state, stop_timeout_s = self.options.stop_timeout.as_secs(),
              "the runner kept working past the post-job grace after its job's completion; stopping it (SIGTERM, then SIGKILL)");
        entry.discard = true;
        entry.outcome.fail(FailureReason::Compute(
            entry.grace_reason.unwrap_or(EndReason::PostJobTimeout),
        ));
        if let Err(e) = self
            .provider
            .stop(&entry.instance, self.options.stop_timeout)
            .await
        {
            warn!(%lease, error = %e, "stopping the runner failed; destroying it");
        }
    }

    /// Applies a Destroy to a lease held in custody for its request, and
    /// journals the entry before anything else happens (so a restart keeps
    /// a teardown the Destroy asked for), then takes one custody step.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Busy`] (held) when the runner is left working: GitHub
    /// refused a scale-down's removal, or it is ending after its job;
    /// [`RunnerError::Custody`] when the removal could not be asked;
    /// [`RunnerError::Failed`] when the step failed.
    pub(super) async fn destroy_held(
        &self,
        lease: &LeaseId,
        order: &DestroyOrder,
    ) -> Result<(), RunnerError> {
        let Some(mut entry) = self.state().custody.get(lease).cloned() else {
            return Ok(());
        };
        let teardown = |entry: &mut CustodyEntry| {
            entry.discard = true;
            entry.ending = false;
            if entry.phase.is_some() {
                entry.phase = Some(Phase::Teardown);
            }
        };
        let (id, name) = entry.registration.clone().unwrap_or((0, String::new()));
        if order.force {
            if entry.discard {
                // A teardown under way keeps the outcome it has: a failed
                // one its first reason, a job that ended its `done`.
            } else {
                let provider = match self.provider.find(&entry.instance).await {
                    Ok(Some(i)) => format!("{:?}", i.state),
                    Ok(None) => "gone".to_owned(),
                    Err(e) => format!("unknown ({e})"),
                };
                let github = match self.jit.remove_runner(lease, entry.epoch, id, &name).await {
                    Ok(()) => "registration removed".to_owned(),
                    Err(e) => {
                        self.state()
                            .removals
                            .failed(lease, entry.epoch, (id, name.clone()));
                        e.to_string()
                    }
                };
                entry.registration = None;
                warn!(%lease, instance = %entry.instance, reason = order.reason.as_deref().unwrap_or("-"),
                      %github, %provider, "forced destroy of a held lease: ending the runner whatever it is doing");
                teardown(&mut entry);
                entry
                    .outcome
                    .fail(FailureReason::forced(order.reason.as_deref()));
            }
        } else if entry.discard || entry.ending {
            // A teardown, or an ending runner, is already under way.
        } else if order.job_result.is_some() {
            // A held job's completion: its runner exits on its own, within
            // the post-job grace from now.
            entry.ending = true;
            entry.since = Instant::now();
            if entry.phase.is_some() {
                entry.phase = Some(Phase::Teardown);
            }
        } else if let Some(died) = self.died_while_held(&entry).await {
            // A scale-down of a held job whose compute already ended other
            // than by exiting 0 (a kill no tend has seen yet): torn down
            // with its reason, as a tend would have, never a `done`
            // (a runner adopted after a restart included).
            warn!(%lease, instance = %entry.instance, reason = %died,
                  "scale-down of a held runner whose compute already ended; tearing it down and releasing the lease as failed");
            entry.outcome.fail(FailureReason::Compute(died));
            teardown(&mut entry);
        } else {
            // A scale-down of a held job: routing first, a busy one is kept,
            // and so is one whose job process runs though GitHub let its
            // registration go (its busy flag lags behind the job).
            match self.jit.remove_runner(lease, entry.epoch, id, &name).await {
                Ok(()) => {
                    entry.registration = None;
                    let at_work = self.at_work(lease, &entry.instance).await;
                    if !matches!(at_work, Ok(false)) {
                        entry.online = matches!(at_work, Ok(true));
                        self.update(lease, entry).await;
                        return Err(match at_work {
                            Err(e) => RunnerError::Custody(format!(
                                "the registration of held lease {lease} is removed; {e}"
                            )),
                            _ => RunnerError::Busy {
                                message: format!(
                                    "the runner of lease {lease} is running a job (its job process runs, though GitHub let its registration go); nothing was destroyed, and this node holds the lease"
                                ),
                                held: true,
                            },
                        });
                    }
                    teardown(&mut entry);
                }
                Err(e @ (PlaneError::Busy(_) | PlaneError::Refused(_))) => {
                    info!(%lease, github = %e, "scale-down refused: the held runner is busy; it keeps running");
                    return Err(RunnerError::Busy {
                        message: format!(
                            "the runner of lease {lease} is running a job (GitHub: {e}); nothing was destroyed, and this node holds the lease"
                        ),
                        held: true,
                    });
                }
                Err(e) => {
                    return Err(RunnerError::Custody(format!(
                        "could not remove the registration of held lease {lease} ({e}); nothing was destroyed"
                    )));
                }
            }
        }
        self.update(lease, entry).await;
        self.tend_one(lease, Seen::Ask)
            .await
            .map_err(RunnerError::Failed)?;
        let ending = self
            .state()
            .custody
            .get(lease)
            .is_some_and(|e| e.ending && !e.discard);
        if ending {
            return Err(RunnerError::Busy {
                message: format!(
                    "the runner of lease {lease} still works after its job; this node holds the lease and ends it once the runner exits, or after {}s",
                    self.options.post_job_grace.as_secs()
                ),
                held: true,
            });
        }
        Ok(())
    }

    /// Why a held entry's compute, as `found` by the provider, ended
    /// before its job did ([`EndReason::of_instance`]); an absence is proof
    /// for an instance this host's provider saw (so an adopted runner
    /// removed behind the node's back is not released `done`).
    fn end_reason(&self, entry: &CustodyEntry, found: Option<&Instance>) -> Option<EndReason> {
        EndReason::of_instance(found, entry.observed && self.provider.runs_on_host())
    }

    /// [`Runner::end_reason`] for a held entry's instance, asked of the
    /// provider now; `None` too when the provider cannot be asked (the
    /// caller's ordinary path then decides).
    async fn died_while_held(&self, entry: &CustodyEntry) -> Option<EndReason> {
        let found = self.provider.find(&entry.instance).await.ok()?;
        self.end_reason(entry, found.as_ref())
    }

    /// One step for one custody entry (spec/node.md §2.7), reading the
    /// instance as `seen` says.
    pub(super) async fn tend_one(&self, lease: &LeaseId, seen: Seen<'_>) -> Result<(), String> {
        self.tend_step(lease, seen, Renewal::Ask).await
    }

    /// One step for one custody entry, its renewal answered as `renewal`
    /// says.
    async fn tend_step(
        &self,
        lease: &LeaseId,
        seen: Seen<'_>,
        renewal: Renewal,
    ) -> Result<(), String> {
        let Some(mut entry) = self.state().custody.get(lease).cloned() else {
            return Ok(());
        };
        let age = entry.since.elapsed();
        if let Some(max) = self.options.max_custody.filter(|max| !max.is_zero()) {
            if age > max && !entry.discard {
                error!(%lease, age_s = age.as_secs(), "custody exceeded max_custody; destroying and releasing as failed");
                entry.discard = true;
                entry.outcome.fail(FailureReason::MaxCustody);
                if entry.phase.is_some() {
                    entry.phase = Some(Phase::Teardown);
                }
            }
        } else if age > CUSTODY_WARN_AFTER {
            warn!(%lease, age_s = age.as_secs(), "billet has held this lease in custody for over an hour");
        }
        // The operator's bound on a lease's whole life holds in custody too,
        // counted from custody's start (the journal keeps no earlier time).
        if let Some(max) = self.options.max_lease_life.filter(|max| !max.is_zero())
            && age > max
            && !entry.discard
        {
            error!(%lease, age_s = age.as_secs(), max_s = max.as_secs(), "a lease in custody outlived max_lease_life; destroying on the operator's bound, busy or not, and releasing it as failed");
            entry.discard = true;
            entry
                .outcome
                .fail(FailureReason::Compute(EndReason::MaxLeaseLife));
            if entry.phase.is_some() {
                entry.phase = Some(Phase::Teardown);
            }
        }

        let mut renewed = false;
        let renewal = match renewal {
            Renewal::Answered(answer) => Ok(answer),
            Renewal::Ask => self
                .ledger
                .heartbeat(&[(lease.clone(), entry.epoch)])
                .await
                .map(|mut r| r.pop()),
        };
        match renewal {
            Ok(answer) => match answer {
                Some(Ok(())) => renewed = true,
                Some(Err(PlaneError::ForceRelease(_))) => {
                    entry.discard = true;
                    entry.outcome.fail(FailureReason::ForceRelease);
                }
                Some(Err(e)) if e.is_gone() => match self.ledger.lease(lease).await {
                    Ok(l) if l.phase == Phase::Quarantine => {
                        entry.epoch = l.epoch;
                        entry.phase = None;
                    }
                    Ok(_) | Err(PlaneError::NotFound(_)) => entry.discard = true,
                    Err(e) => return Err(format!("read after a refused renewal: {e}")),
                },
                Some(Err(e)) => return Err(format!("renew: {e}")),
                None => return Err("renew: no answer for the lease".into()),
            },
            Err(e) => return Err(format!("renew: {e}")),
        }
        if renewed
            && let Some(phase) = entry.phase
            && entry.reported != Some(phase)
        {
            match self.ledger.advance(lease, entry.epoch, phase).await {
                Ok(()) | Err(PlaneError::BadTransition(_)) => entry.reported = Some(phase),
                Err(e) => {
                    self.update(lease, entry).await;
                    return Err(format!("report {phase}: {e}"));
                }
            }
        }
        let found = match seen {
            Seen::Listed(list) => list
                .iter()
                .find(|i| i.name == entry.instance.as_str())
                .cloned(),
            Seen::Unread => {
                // Could not read is not gone: a run of absences restarts.
                entry.absent_since = None;
                self.update(lease, entry).await;
                return Err("the provider could not be listed".to_owned());
            }
            Seen::Ask => match self.provider.find(&entry.instance).await {
                Ok(found) => found,
                Err(e) => {
                    entry.absent_since = None;
                    self.update(lease, entry).await;
                    return Err(format!("find {}: {e}", lease));
                }
            },
        };
        if entry.ending && !entry.discard {
            match &found {
                Some(instance) if instance.may_run() => {
                    if entry.since.elapsed() < self.options.post_job_grace {
                        self.update(lease, entry).await;
                        return Ok(());
                    }
                    self.overrun_post_job_grace(lease, &mut entry, instance)
                        .await;
                }
                // It exited on its own, or is gone: its job's normal end.
                _ => entry.discard = true,
            }
        }
        let ended = found.as_ref().is_none_or(|i| !i.may_run());
        if !entry.discard
            && entry.outcome == Ending::Done
            && let Some(reason) = self.end_reason(&entry, found.as_ref())
        {
            // A held job whose runner died: the job did not finish.
            warn!(%lease, instance = %entry.instance, %reason, "a held runner's compute ended; releasing its lease as failed");
            entry.outcome.fail(FailureReason::Compute(reason));
        }
        if let Err(e) = self.remove_registration(lease, &mut entry, ended).await {
            self.update(lease, entry).await;
            return Err(e);
        }
        match found {
            None => {
                let grace = if entry.observed && self.provider.runs_on_host() {
                    Duration::ZERO
                } else {
                    self.options.stray_grace
                };
                let since = *entry.absent_since.get_or_insert_with(Instant::now);
                if !now_plus(grace, since) {
                    self.update(lease, entry).await;
                    return Ok(());
                }
                entry.unconfirmed = false;
                self.finish(lease, entry).await
            }
            Some(instance) => {
                entry.absent_since = None;
                entry.observed = true;
                // An instance that no longer runs is ended compute: present
                // until destroyed, as Docker keeps an exited container.
                if !entry.discard
                    && instance.may_run()
                    && !self.past_start_deadline(lease, &mut entry).await
                {
                    self.update(lease, entry).await;
                    return Ok(());
                }
                match self.provider.destroy(&entry.instance).await {
                    Err(e) => {
                        self.update(lease, entry).await;
                        Err(format!("destroy: {e}"))
                    }
                    Ok(Teardown::Requested) => {
                        self.update(lease, entry).await;
                        Ok(())
                    }
                    Ok(Teardown::Stopped) => {
                        entry.unconfirmed = false;
                        info!(%lease, instance = %entry.instance, "held instance destroyed");
                        self.finish(lease, entry).await
                    }
                }
            }
        }
    }

    /// Forgets a lease's launch and custody records, once its compute is
    /// proven gone (or was never started), and settles its sticky disks.
    pub(super) async fn forget(&self, lease: &LeaseId) {
        self.state().tiers.ended(lease);
        self.settle_disks(lease).await;
        let forgot = async {
            self.journal.forget_custody(lease.as_str()).await?;
            self.journal.forget_launch(lease.as_str()).await
        };
        if let Err(e) = forgot.await {
            warn!(%lease, error = %e, "cannot clear the journal; a restart re-checks this lease");
        }
    }

    /// A held lease has ended: it is no longer held, and its journal records
    /// go, except the launch record of a registration removal still
    /// pending, which keeps that removal across a restart.
    pub(super) async fn ended(&self, lease: &LeaseId) {
        let pending = {
            let mut s = self.state();
            s.tiers.ended(lease);
            s.custody.remove(lease);
            s.running.retain(|_, r| r.lease != *lease);
            s.removals.contains(lease)
        };
        if pending {
            self.settle_disks(lease).await;
            if let Err(e) = self.journal.forget_custody(lease.as_str()).await {
                warn!(%lease, error = %e, "cannot clear the journal; a restart re-checks this lease");
            }
        } else {
            self.forget(lease).await;
        }
    }

    /// Replaces the held entry of `lease` (if it is still held) and
    /// journals it when anything the journal records changed, or when its
    /// last write failed: a tend of an entry whose state stayed the same
    /// writes nothing. A write that fails marks the entry for the next
    /// tend ([`Runner::rejournal`]).
    pub(super) async fn update(&self, lease: &LeaseId, entry: CustodyEntry) {
        let record = {
            let mut s = self.state();
            let Some(slot) = s.custody.get_mut(lease) else {
                return;
            };
            let write = slot.unjournaled || entry.unjournaled || journaled_changed(slot, &entry);
            let record = write.then(|| custody_record(lease, &entry));
            let unjournaled = slot.unjournaled || entry.unjournaled;
            *slot = CustodyEntry {
                unjournaled,
                ..entry
            };
            record
        };
        if let Some(record) = record {
            let written = self.journal.put_custody(&record).await;
            if let Err(e) = &written
                && let Some(suppressed) = self.journal_log.admit()
            {
                error!(%lease, error = %e, suppressed, "cannot journal a custody entry; the next tend tries again, and a restart before it succeeds would forget the entry");
            }
            self.mark_journaled(std::slice::from_ref(lease), written.is_ok());
        }
    }

    async fn finish(&self, lease: &LeaseId, entry: CustodyEntry) -> Result<(), String> {
        match self
            .ledger
            .release(lease, entry.epoch, &entry.outcome)
            .await
        {
            Ok(()) | Err(PlaneError::NotFound(_) | PlaneError::Fenced(_)) => {
                info!(%lease, outcome = %entry.outcome, "custody ended");
                self.ended(lease).await;
                Ok(())
            }
            Err(e) => {
                // Refused: if the lease has already ended (with either
                // outcome: the plane released it after a destroy), nothing is
                // left to hold.
                if let Ok(l) = self.ledger.lease(lease).await
                    && l.phase.is_terminal()
                {
                    debug!(%lease, phase = %l.phase, "custody ended: the lease had already ended");
                    self.ended(lease).await;
                    return Ok(());
                }
                self.update(lease, entry).await;
                Err(format!("release: {e}"))
            }
        }
    }
}
