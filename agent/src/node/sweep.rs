//! Sweep and inventory: destroy what no open lease accounts for, and report
//! what the provider actually runs, never what the ledger believes
//! (seed/node-package.md `Sweep`, `Instances`; spec/node.md §2.6).

use tracing::{info, warn};

use super::runner::{Runner, RunnerError, Running};
use crate::cache::{Inventory, Listed};
use crate::model::{Epoch, InstanceName, LeaseId, RequestId};
use crate::provider::{Instance, ProviderError, Teardown};

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

impl Runner {
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
    pub(super) fn held_lease_names(&self) -> Vec<String> {
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
    pub(super) async fn sweep_listed(
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
    /// journal's launch record names and its epoch, else by lease at epoch
    /// 0, no epoch known; a lease never bound yet that a redelivered launch
    /// binds drops such a removal, `Removals::superseded`), and that launch record
    /// is kept until the removal is done, so a restart tries it again. Before
    /// this, an orphan destroyed at recovery left its runner registered for
    /// ever (the million-seed run, seed 134578: a lease force-released while
    /// its custody entry could not be journaled).
    pub(super) async fn destroy_orphan(&self, lease: &LeaseId, name: &InstanceName) -> bool {
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
}
