//! Start-up recovery: adopt instances whose lease is open (into custody),
//! destroy true orphans, and never touch an instance without billet's
//! labels (seed/node-package.md `Recover`; spec/node.md §2.5).

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::custody::{CustodyEntry, custody_entry};
use super::ending::{EndReason, Ending, FailureReason};
use super::plane::PlaneError;
use super::runner::{Runner, RunnerError};
use crate::cache::{Inventory, Listed};
use crate::journal::LaunchRecord;
use crate::model::{Epoch, InstanceName, Lease, LeaseId, Phase, RequestId};
use crate::provider::{Instance, InstanceState};

/// The custody entry for compute found running under an open lease that
/// no request here manages: a job left to finish (discarded when the lease
/// records a failure), reporting `phase` unless quarantined.
fn adoption(lease: &Lease, instance: &InstanceName, phase: Option<Phase>) -> CustodyEntry {
    let failing = lease.failure_reason.is_some();
    CustodyEntry {
        outcome: match &lease.failure_reason {
            Some(why) => Ending::Failed(FailureReason::recorded(why)),
            None => Ending::Done,
        },
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
                        // synced, so there may be no record at all. One
                        // that has exited ran, whatever its record says:
                        // it is adopted and its exit judged as any other
                        // (an exit 0 is its job's end, and its lease
                        // `done`), never retired as an idle runner.
                        let unconfirmed = instance.state == InstanceState::Created
                            || (record.is_some_and(|r| !r.created) && instance.may_run());
                        if unconfirmed
                            && self
                                .retire_idle_runner(&lease, l.epoch, record, instance)
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
                                    Ending::Failed(FailureReason::LaunchInterrupted),
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
                        ..CustodyEntry::teardown(
                            Epoch(record.epoch),
                            InstanceName::for_lease(&lease),
                            RequestId(record.request_id),
                            // Created and gone since: removed while the
                            // node was down; never created: the launch was
                            // cut short by the node's stop.
                            Ending::Failed(if observed {
                                FailureReason::Compute(EndReason::Removed)
                            } else {
                                FailureReason::LaunchInterrupted
                            }),
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
    /// it", the conservative reading, and so does a running instance whose
    /// job process runs ([`Runner::at_work`]) whatever GitHub answered.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Failed`] when the plane or the provider could not be
    /// asked: no answer is not an answer, and Recover retries.
    pub(super) async fn retire_idle_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        record: Option<&&LaunchRecord>,
        instance: &Instance,
    ) -> Result<bool, RunnerError> {
        let (id, name) =
            record.map_or((0, String::new()), |r| (r.runner_id, r.runner_name.clone()));
        match self.jit.remove_runner(lease, epoch, id, &name).await {
            Ok(()) if instance.may_run() => {
                let name = InstanceName::for_lease(lease);
                Ok(!self.at_work(lease, &name).await?)
            }
            Ok(()) => Ok(true),
            Err(e @ PlaneError::Unavailable(_)) => Err(RunnerError::Failed(e.to_string())),
            Err(e) => {
                debug!(%lease, error = %e, "the registration stays; adopting the instance as a running job");
                Ok(false)
            }
        }
    }

    /// Takes custody of compute found running under an open lease that no
    /// request here manages: it is left to finish, and released once gone.
    pub(super) async fn adopt(&self, lease: &Lease, instance: &InstanceName, phase: Option<Phase>) {
        self.charge_adopted(lease);
        self.hold(lease.id.clone(), adoption(lease, instance, phase))
            .await;
    }

    /// Adopted compute is charged like launched compute: the plane places
    /// against what the node says it holds.
    pub(super) fn charge_adopted(&self, lease: &Lease) {
        self.state()
            .sizes
            .entry(lease.id.clone())
            .or_insert((lease.vcpu, lease.memory.0));
    }
}
