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

use super::ending::EndReason;
use super::plane::{PlaneError, Retired};
use super::runner::{LEASE_LIFE_WARN_EVERY, Runner, RunnerError, Running, now_plus};
use crate::cache::{Inventory, Listed};
use crate::journal::{BootStamp, CustodyRecord, LaunchRecord};
use crate::model::{
    DestroyOrder, Epoch, InstanceName, Lease, LeaseId, Phase, RequestId, parse_phase,
};
use crate::provider::{Instance, InstanceState, ProviderError, Teardown};

/// What a sweep saw and how it ended ([`Runner::sweep_inventory`]).
#[derive(Debug)]
pub struct Swept {
    /// The leases of the billet instances the provider listed when the
    /// sweep began (orphans it then destroyed included); `None` when the
    /// provider could not be listed, which is not the same as empty.
    pub listed: Option<Vec<LeaseId>>,
    /// How the sweep ended, as [`Runner::sweep`] answers.
    pub result: Result<(), RunnerError>,
}

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

/// What one [`Runner::interrupt`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Interrupted {
    /// Leases failed with the reason and set to be destroyed.
    pub ended: usize,
    /// Leases whose reason the plane could not record: left as they were,
    /// for the next pass.
    pub unrecorded: usize,
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
    /// What Release will record.
    pub(super) outcome: Phase,
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
    /// Why the compute ended, recorded as the lease's failure reason before
    /// a `failed` release. Not journaled: a restart releases without it.
    pub(super) reason: Option<EndReason>,
    /// The phase this process has reported to the ledger for the entry
    /// (advanced, or refused as a bad transition, which is an answer too);
    /// a tend reports `phase` only when it differs. Not journaled: a
    /// restarted node reports once more.
    pub(super) reported: Option<Phase>,
    /// The job's completion arrived while its runner still worked: the
    /// runner is left to exit on its own until the post-job grace (counted
    /// from `since`) passes. Journaled as a teardown that is not discarded.
    pub(super) ending: bool,
    /// The reason a forced destroy gave, recorded as the failure reason
    /// when there is no [`EndReason`]. Not journaled.
    pub(super) forced: Option<String>,
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
            outcome: Phase::Done,
            phase: Some(Phase::Custody),
            discard: false,
            observed,
            absent_since: None,
            unconfirmed: true,
            since: Instant::now(),
            reason: None,
            reported: None,
            ending: false,
            forced: None,
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
        outcome: Phase,
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
        outcome: e.outcome.as_str().to_owned(),
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
        outcome: parse_phase("journal.custody.outcome", &r.outcome).ok()?,
        phase,
        discard: r.discard,
        observed: r.observed,
        absent_since: None,
        unconfirmed: true,
        since: Instant::now().checked_sub(age).unwrap_or_else(Instant::now),
        reason: None,
        reported: None,
        // A teardown that is not discarded is only ever an ending runner.
        ending: !r.discard && r.phase.as_deref() == Some(Phase::Teardown.as_str()),
        forced: None,
        unjournaled: false,
        online: false,
        retire_tried: false,
        grace_reason: None,
    };
    Some((lease, entry))
}

/// The custody entry for compute found running under an open lease that
/// no request here manages: a job left to finish (discarded when the lease
/// records a failure), reporting `phase` unless quarantined.
fn adoption(lease: &Lease, instance: &InstanceName, phase: Option<Phase>) -> CustodyEntry {
    let failing = lease.failure_reason.is_some();
    CustodyEntry {
        outcome: if failing { Phase::Failed } else { Phase::Done },
        phase: if lease.phase == Phase::Quarantine {
            None
        } else {
            phase
        },
        discard: failing,
        ..CustodyEntry::job(lease.epoch, instance.clone(), lease.request_id, true)
    }
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

    /// The lease ids of the billet instances the provider runs, from the
    /// provider, never from the ledger.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the provider cannot be listed.
    pub(crate) async fn instances(&self) -> Result<Vec<LeaseId>, ProviderError> {
        Ok(self
            .provider
            .list()
            .await?
            .iter()
            .filter_map(crate::provider::Instance::lease)
            .collect())
    }

    /// Destroys instances no open lease on this node accounts for, and
    /// reports the complete inventory to the plane on every pass, an empty
    /// one included (spec/node.md §2.6). A provider that cannot be listed
    /// reports nothing: "could not read" never reads as "running nothing".
    ///
    /// Safe beside launches: Bind and Advance(launching) are durable before
    /// create, and the inventory is read before the ledger.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Failed`] when the provider or the ledger cannot be read,
    /// or when some orphans could not be destroyed (the next sweep retries).
    pub async fn sweep(&self) -> Result<(), RunnerError> {
        self.sweep_inventory().await.result
    }

    /// [`Runner::sweep`], saying also what the provider listed when the
    /// sweep began: what `Sweep` reports to the plane. The same inventory
    /// settles the sticky disks of leases whose compute it proves gone
    /// (`Runner::reconcile_cache`).
    pub async fn sweep_inventory(&self) -> Swept {
        let before = self.running_snapshot();
        let instances = match self.provider.list().await {
            Ok(instances) => instances,
            Err(e) => {
                self.reconcile_cache(Inventory::Unknown).await;
                return Swept {
                    listed: None,
                    result: Err(RunnerError::Failed(format!("list instances: {e}"))),
                };
            }
        };
        let listed: Vec<LeaseId> = instances.iter().filter_map(Instance::lease).collect();
        let result = self.sweep_listed(&before, &instances).await;
        self.reconcile_cache(Inventory::Listed(Listed::new(
            listed.iter().map(|l| l.as_str().to_owned()),
            self.held_lease_names(),
        )))
        .await;
        Swept {
            listed: Some(listed),
            result,
        }
    }

    /// The leases this runner holds (launching, running, in custody), by
    /// name.
    fn held_lease_names(&self) -> Vec<String> {
        let s = self.state();
        s.custody
            .keys()
            .chain(s.launching.keys())
            .map(|l| l.as_str().to_owned())
            .chain(s.running.values().map(|r| r.lease.as_str().to_owned()))
            .collect()
    }

    /// Closes the cache sessions and discards the sticky disks of every
    /// lease a successful `inventory` proves has no compute (spec/cache.md
    /// §3.2 `ReconcileInventory`, and `RetryClosed`: a disk whose settling
    /// failed when its job ended goes at the next one). An
    /// [`Inventory::Unknown`] (the provider could not be listed) touches
    /// nothing: every mount stays fenced (§3.4).
    pub(super) async fn reconcile_cache(&self, inventory: Inventory) {
        let Some(cache) = &self.cache else {
            return;
        };
        let listed = match inventory {
            Inventory::Listed(listed) => listed,
            Inventory::Unknown => {
                let open = cache.mounts().await.len();
                if open > 0 {
                    warn!(
                        mounts = open,
                        "the provider could not be listed; every sticky disk stays until a listing succeeds"
                    );
                }
                return;
            }
        };
        if let Some(sessions) = &self.sessions {
            sessions.reconcile(&listed).await;
        }
        if let Some(actions) = &self.actions {
            actions.archives().reconcile(&listed).await;
        }
        cache.reconcile(&listed).await;
    }

    /// The sweep once the provider has been listed.
    async fn sweep_listed(
        &self,
        before: &[(RequestId, Running)],
        instances: &[Instance],
    ) -> Result<(), RunnerError> {
        let inventory: Vec<(LeaseId, InstanceName)> = instances
            .iter()
            .filter_map(|i| i.lease().map(|l| (l.clone(), InstanceName::for_lease(&l))))
            .collect();
        let ids: Vec<LeaseId> = inventory.iter().map(|(l, _)| l.clone()).collect();
        self.end_gone_runners(before, instances).await;
        match self.ledger.reconcile(&ids).await {
            Ok(freed) if freed > 0 => {
                info!(freed, "the plane freed quarantined leases absent here")
            }
            Ok(_) => {}
            Err(e) => warn!(error = %e, "reporting the inventory failed"),
        }
        if inventory.is_empty() {
            return Ok(());
        }
        let set = self
            .ledger
            .launched()
            .await
            .map_err(|e| RunnerError::Failed(format!("read the launched set: {e}")))?;
        let (custody, launching): (Vec<LeaseId>, Vec<LeaseId>) = {
            let s = self.state();
            (
                s.custody.keys().cloned().collect(),
                s.launching.keys().cloned().collect(),
            )
        };
        let mut failed = 0;
        let mut orphans = 0;
        for (lease, name) in inventory {
            if set.launched.contains(&lease)
                || custody.contains(&lease)
                || launching.contains(&lease)
            {
                continue;
            }
            if set.quarantined.contains(&lease) {
                match self.ledger.lease(&lease).await {
                    Ok(l) => self.adopt(&l, &name, None).await,
                    Err(e) => {
                        warn!(%lease, error = %e, "cannot read a quarantined lease to adopt it")
                    }
                }
                continue;
            }
            orphans += 1;
            if !self.destroy_orphan(&lease, &name).await {
                failed += 1;
            }
        }
        if failed > 0 {
            return Err(RunnerError::Failed(format!(
                "{failed} of {orphans} orphaned instances could not be destroyed"
            )));
        }
        Ok(())
    }

    /// Destroys an instance no open lease accounts for; false when the
    /// provider refused (the next sweep retries). A destroy the provider only
    /// accepted is left for the next sweep to confirm.
    ///
    /// Its lease has ended, so nothing else will remove its runner's
    /// registration: the removal is queued first (with the registration the
    /// journal's launch record names, else by lease), and that launch record
    /// is kept until the removal is done, so a restart tries it again. Before
    /// this, an orphan destroyed at recovery left its runner registered for
    /// ever (the million-seed run, seed 134578: a lease force-released while
    /// its custody entry could not be journaled).
    async fn destroy_orphan(&self, lease: &LeaseId, name: &InstanceName) -> bool {
        let record = match self.journal.launches().await {
            Ok(all) => all.into_iter().find(|r| r.lease == lease.as_str()),
            Err(e) => {
                warn!(%lease, error = %e, "cannot read the journal; removing the orphan's registration by lease");
                None
            }
        };
        let (epoch, registration) = record.map_or((Epoch(0), (0, String::new())), |r| {
            (Epoch(r.epoch), (r.runner_id, r.runner_name))
        });
        self.state()
            .removals
            .pending_now(lease, epoch, registration);
        match self.provider.destroy(name).await {
            Err(e) => {
                warn!(%lease, error = %e, "destroying an orphan failed");
                false
            }
            Ok(Teardown::Requested) => true,
            Ok(Teardown::Stopped) => {
                info!(%lease, instance = %name, "destroyed an orphan");
                // Keeps the launch record while the removal is pending.
                self.ended(lease).await;
                true
            }
        }
    }

    /// The running requests, read before an inventory: each was created
    /// before the inventory was read, so its absence from it means gone.
    fn running_snapshot(&self) -> Vec<(RequestId, Running)> {
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
            let reason = match inventory.iter().find(|i| i.name == r.instance.as_str()) {
                None => Some(EndReason::Removed),
                Some(i) if !i.may_run() => EndReason::from_state(i.state),
                Some(_) => continue,
            };
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
            let outcome = if reason.is_some() {
                Phase::Failed
            } else {
                Phase::Done
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
                    reason,
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

    /// Running requests whose instance still runs, judged on time, by a
    /// complete inventory: past the operator's lease-life bound
    /// ([`RunnerOptions::max_lease_life`](super::runner::RunnerOptions)),
    /// the instance is torn down on that authority, busy or not, with
    /// reason `max_lease_life`; each whole hour of a lease's life is
    /// warned about. Past the start deadline and not known online, the
    /// registration is removed first: GitHub refuses to remove a runner
    /// holding a job, which marks it online for good; a removal that
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
                    if let Some(s) = self.state().running.get_mut(&request_id) {
                        s.online = true;
                    }
                }
            }
        }
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
        let why = reason.to_string();
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
                e.outcome = Phase::Failed;
                e.reason = Some(reason);
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
    async fn record_interruption(&self, lease: &LeaseId, epoch: Epoch, why: &str) -> bool {
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
                reason: Some(reason),
                registration,
                ..CustodyEntry::teardown(
                    r.epoch,
                    r.instance.clone(),
                    request_id,
                    Phase::Failed,
                    true,
                )
            },
        )
        .await;
    }

    /// Takes `request_id` out of the running requests if it still runs
    /// `lease`; whether it did.
    fn take_running(&self, request_id: RequestId, lease: &LeaseId) -> bool {
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
    async fn leave_to_exit(&self, request_id: RequestId, r: &Running) {
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

    /// Decides what to do with compute an earlier process left behind, once,
    /// before the first command runs (spec/node.md §2.5, with the journal):
    /// custody entries the journal remembers are held again as they were;
    /// instances whose lease is open on this node (launched or quarantined)
    /// are adopted into custody, their job left running; instances whose
    /// lease is not open are true orphans and are destroyed; instances
    /// without billet's name are never touched. A launch the journal
    /// remembers whose lease is still open but whose instance is not there
    /// (a node killed mid-launch) is held until its registration is removed
    /// and its absence has lasted the stray grace.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Failed`] when the journal, the provider or the ledger
    /// cannot be read (a failed read is never a licence to destroy), or when
    /// some orphans could not be destroyed.
    pub async fn recover(&self) -> Result<(), RunnerError> {
        let fail = |what: &str, e: &dyn std::fmt::Display| {
            RunnerError::Failed(format!("recover: {what}: {e}"))
        };
        let remembered = self
            .journal
            .custody()
            .await
            .map_err(|e| fail("read the journal", &e))?;
        let launches = self
            .journal
            .launches()
            .await
            .map_err(|e| fail("read the journal", &e))?;
        for record in &remembered {
            match custody_entry(record) {
                Some((lease, entry)) => {
                    self.state().custody.entry(lease).or_insert(entry);
                }
                None => {
                    warn!(lease = %record.lease, "ignoring a custody record this build cannot read")
                }
            }
        }
        let instances = self
            .provider
            .list()
            .await
            .map_err(|e| fail("list instances", &e))?;
        let set = self
            .ledger
            .launched()
            .await
            .map_err(|e| fail("read the launched set", &e))?;
        let requests: std::collections::HashMap<&str, &LaunchRecord> =
            launches.iter().map(|l| (l.lease.as_str(), l)).collect();
        let mut seen = std::collections::HashSet::new();
        let mut adopted = Vec::new();
        // Held together, journaled in one transaction before the renewal.
        let mut holding = Vec::new();
        let mut failed = 0;
        for instance in &instances {
            let Some(lease) = instance.lease() else {
                warn!(name = %instance.name, "ignoring an instance billet did not name");
                continue;
            };
            let name = InstanceName::for_lease(&lease);
            seen.insert(lease.clone());
            if self.state().custody.contains_key(&lease) {
                continue;
            }
            if set.launched.contains(&lease) || set.quarantined.contains(&lease) {
                // The set carries the lease itself (one round trip for all
                // of them); a plane that did not send it is asked.
                let read = match set.lease(&lease) {
                    Some(l) => Ok(l.clone()),
                    None => self.ledger.lease(&lease).await,
                };
                match read {
                    Ok(mut l) => {
                        if let Some(r) = requests.get(lease.as_str()) {
                            l.request_id = RequestId(r.request_id);
                        }
                        let record = requests.get(lease.as_str());
                        // An instance still `created` never ran, whatever
                        // its record says: the earlier process died
                        // before its start answered, or before the record
                        // of a launch that created beside its bind was
                        // synced, so there may be no record at all.
                        let unconfirmed = instance.state == InstanceState::Created
                            || record.is_some_and(|r| !r.created);
                        if unconfirmed
                            && self
                                .retire_idle_runner(&lease, l.epoch, record)
                                .await
                                .map_err(|e| {
                                    fail(&format!("ask whether the runner of {lease} is idle"), &e)
                                })?
                        {
                            // The earlier process never learned whether create
                            // worked, and the runner inside has no job: it had
                            // no future. Its routing is gone; the instance goes.
                            info!(%lease, instance = %name, "an unconfirmed launch left an idle runner; tearing it down");
                            holding.push((
                                lease.clone(),
                                CustodyEntry::teardown(
                                    l.epoch,
                                    name.clone(),
                                    l.request_id,
                                    Phase::Failed,
                                    true,
                                ),
                            ));
                            adopted.push((lease.clone(), l.epoch));
                            continue;
                        }
                        info!(%lease, instance = %name, "adopting an instance an earlier process started");
                        self.charge_adopted(&l);
                        holding.push((l.id.clone(), adoption(&l, &name, Some(Phase::Custody))));
                        adopted.push((lease.clone(), l.epoch));
                        continue;
                    }
                    Err(PlaneError::NotFound(_)) => {}
                    Err(e) => return Err(fail(&format!("read lease {lease}"), &e)),
                }
            }
            if !self.destroy_orphan(&lease, &name).await {
                failed += 1;
            }
        }
        self.hold_all(std::mem::take(&mut holding)).await;
        // What was adopted is renewed at once (spec/node.md §7.E.11): a plane
        // that cannot take the renewal is not one to take work from yet.
        // Refusals of single leases are the next tend's to judge.
        if !adopted.is_empty() {
            self.ledger
                .heartbeat(&adopted)
                .await
                .map_err(|e| fail("renew the adopted leases", &e))?;
        }
        for record in &launches {
            let Ok(lease) = LeaseId::parse("journal.launch.lease", &record.lease) else {
                continue;
            };
            if seen.contains(&lease) || self.state().custody.contains_key(&lease) {
                continue;
            }
            if set.launched.contains(&lease) || set.quarantined.contains(&lease) {
                let registration = (record.runner_id > 0)
                    .then(|| (record.runner_id, record.runner_name.clone()))
                    .or(Some((0, String::new())));
                // A create the journal saw succeed on this host's provider
                // is an instance that existed: its absence now is proof it
                // is gone (removed while the node was down), no grace.
                let observed = record.created && self.provider.runs_on_host();
                holding.push((
                    lease.clone(),
                    CustodyEntry {
                        registration,
                        absent_since: Some(Instant::now()),
                        reason: observed.then_some(EndReason::Removed),
                        ..CustodyEntry::teardown(
                            Epoch(record.epoch),
                            InstanceName::for_lease(&lease),
                            RequestId(record.request_id),
                            Phase::Failed,
                            observed,
                        )
                    },
                ));
            } else {
                // The lease ended and its launch is still remembered: a
                // registration removal an earlier process had pending (the
                // launch record is what keeps it across a restart). Tried
                // at the next tend, on its backoff from then on. A record
                // without the runner's id or name is removed by lease: a
                // crash between the mint and its journal write leaves the
                // registration unknown but real (the million-seed run,
                // seed 74039, found it forgotten here); a lease never
                // minted has none, and the plane answers that as done.
                let registration = (record.runner_id, record.runner_name.clone());
                self.state()
                    .removals
                    .pending_now(&lease, Epoch(record.epoch), registration);
            }
        }
        self.hold_all(holding).await;
        // Sticky disks the journal names for leases this process does not
        // hold any more and the provider does not run: their compute is
        // gone, and they are discarded. (A listing that failed returned
        // above: nothing is discarded without one.)
        self.reconcile_cache(Inventory::Listed(Listed::new(
            instances
                .iter()
                .filter_map(Instance::lease)
                .map(|l| l.as_str().to_owned()),
            self.held_lease_names(),
        )))
        .await;
        if failed > 0 {
            return Err(RunnerError::Failed(format!(
                "recover: {failed} instances could not be destroyed"
            )));
        }
        Ok(())
    }

    /// Asks the plane to remove the registration of a launch whose outcome
    /// an earlier process never learned. GitHub refuses to remove a runner
    /// that is running a job, so success means the runner was idle (or
    /// already gone) and is now unroutable: the reference's RecoverRunner
    /// question, asked through the removal itself. A refusal answers "keep
    /// it", the conservative reading.
    ///
    /// # Errors
    ///
    /// [`PlaneError::Unavailable`] when the plane could not be asked: no
    /// answer is not an answer, and Recover retries.
    async fn retire_idle_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        record: Option<&&LaunchRecord>,
    ) -> Result<bool, PlaneError> {
        let (id, name) =
            record.map_or((0, String::new()), |r| (r.runner_id, r.runner_name.clone()));
        match self.jit.remove_runner(lease, epoch, id, &name).await {
            Ok(()) => Ok(true),
            Err(e @ PlaneError::Unavailable(_)) => Err(e),
            Err(e) => {
                debug!(%lease, error = %e, "the registration stays; adopting the instance as a running job");
                Ok(false)
            }
        }
    }

    /// Takes custody of compute found running under an open lease that no
    /// request here manages: it is left to finish, and released once gone.
    async fn adopt(&self, lease: &Lease, instance: &InstanceName, phase: Option<Phase>) {
        self.charge_adopted(lease);
        self.hold(lease.id.clone(), adoption(lease, instance, phase))
            .await;
    }

    /// Adopted compute is charged like launched compute: the plane places
    /// against what the node says it holds.
    fn charge_adopted(&self, lease: &Lease) {
        self.state()
            .sizes
            .entry(lease.id.clone())
            .or_insert((lease.vcpu, lease.memory.0));
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
    /// restarts, goes too, unless the lease is held again.
    async fn removal_done(&self, lease: &LeaseId) {
        let held = {
            let mut s = self.state();
            s.removals.done(lease);
            s.custody.contains_key(lease)
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
        match self.jit.remove_runner(lease, entry.epoch, id, &name).await {
            Ok(()) => {
                entry.registration = None;
                Ok(())
            }
            Err(e) if ended => {
                if matches!(e, PlaneError::Busy(_))
                    && entry.outcome == Phase::Done
                    && entry.reason.is_none()
                    && entry.forced.is_none()
                    && !entry.ending
                {
                    // A runner that exited 0 on its own, while GitHub still
                    // runs a job on it (JobStillRunning): it did not finish
                    // that job, so its lease is not released `done`
                    // (a runner can crash with exit 0 mid-job).
                    warn!(%lease, instance = %entry.instance, "the runner exited 0 while GitHub still runs its job; releasing its lease as failed, exit 0");
                    entry.reason = Some(EndReason::Exit(0));
                    entry.outcome = Phase::Failed;
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
    /// job (online, never asked again); an outage leaves it to the next
    /// tend. An ending runner (its job complete) is the post-job grace's to
    /// judge.
    async fn past_start_deadline(&self, lease: &LeaseId, entry: &mut CustodyEntry) -> bool {
        let Some(deadline) = self.options.start_deadline.filter(|d| !d.is_zero()) else {
            return false;
        };
        if entry.online || entry.ending || entry.since.elapsed() < deadline {
            return false;
        }
        let (id, name) = entry.registration.clone().unwrap_or((0, String::new()));
        match self.jit.retire_runner(lease, entry.epoch, id, &name).await {
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
                entry.outcome = Phase::Failed;
                entry.reason = Some(EndReason::StartDeadline);
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
        entry.outcome = Phase::Failed;
        entry.reason = Some(entry.grace_reason.unwrap_or(EndReason::PostJobTimeout));
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
                if entry.forced.is_none() {
                    entry.forced.clone_from(&order.reason);
                }
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
                entry.outcome = Phase::Failed;
                entry.forced.clone_from(&order.reason);
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
            entry.reason = Some(died);
            entry.outcome = Phase::Failed;
            teardown(&mut entry);
        } else {
            // A scale-down of a held job: routing first, a busy one is kept.
            match self.jit.remove_runner(lease, entry.epoch, id, &name).await {
                Ok(()) => {
                    entry.registration = None;
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
                error!(%lease, ?age, "custody exceeded max_custody; destroying and releasing as failed");
                entry.discard = true;
                entry.outcome = Phase::Failed;
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
            entry.outcome = Phase::Failed;
            entry.reason = entry.reason.or(Some(EndReason::MaxLeaseLife));
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
                    entry.outcome = Phase::Failed;
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
            && entry.reason.is_none()
            && let Some(reason) = self.end_reason(&entry, found.as_ref())
        {
            // A held job whose runner died: the job did not finish.
            warn!(%lease, instance = %entry.instance, %reason, "a held runner's compute ended; releasing its lease as failed");
            entry.reason = Some(reason);
            entry.outcome = Phase::Failed;
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
        if entry.outcome == Phase::Failed
            && let Some(reason) = entry
                .reason
                .map(|r| r.to_string())
                .or_else(|| entry.forced.clone())
        {
            match self.ledger.mark_failure(lease, entry.epoch, &reason).await {
                Err(e @ PlaneError::Unavailable(_)) => {
                    self.update(lease, entry).await;
                    return Err(format!("record the failure reason {reason}: {e}"));
                }
                // Another reason recorded first, or the lease is not ours any
                // more: the release decides.
                Err(e) => {
                    debug!(%lease, %reason, error = %e, "the failure reason was not recorded")
                }
                Ok(()) => {}
            }
        }
        match self.ledger.release(lease, entry.epoch, entry.outcome).await {
            Ok(()) | Err(PlaneError::NotFound(_) | PlaneError::Fenced(_)) => {
                info!(%lease, outcome = %entry.outcome, reason = ?entry.reason.map(|r| r.to_string()).or_else(|| entry.forced.clone()), "custody ended");
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
