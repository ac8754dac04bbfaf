//! Upkeep: `Tend`, then `Sweep`, to every attached node on each tick;
//! renewing the leases the plane manages while their node is reachable or
//! within the renewal grace; and reaping expired leases.

use std::sync::Arc;
use std::time::Duration;

use billet_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::ledger::Phase;

use super::Plane;

impl Plane {
    /// Sends Tend, then Sweep, to every attached node on each tick.
    pub(super) async fn maintain(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.maintenance_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            self.prune_job_records().await;
            for node in &self.nodes {
                if node.status().borrow().is_none() {
                    continue;
                }
                let timeout = self
                    .config
                    .maintenance_interval
                    .max(Duration::from_secs(10));
                for kind in [
                    pb::command::Kind::Tend(pb::Tend {}),
                    pb::command::Kind::Sweep(pb::Sweep {}),
                ] {
                    let outcome = node.dispatch(kind, timeout).await;
                    if !outcome.is_ok() {
                        warn!(node = node.name(), outcome = %outcome.describe(), "maintenance command");
                    }
                }
            }
        }
    }

    /// Whether the plane may renew a lease bound to `node` (or to none):
    /// only while it holds a session with that node, or within the renewal
    /// grace after losing it. Past it the lease expires and the reaper
    /// quarantines it: silence frees nothing and renews nothing.
    fn may_renew(&self, node: Option<&str>) -> bool {
        let Some(node) = node.and_then(|n| self.node(n)) else {
            return true;
        };
        node.detached_for()
            .is_none_or(|d| d < self.config.renewal_grace)
    }

    pub(super) async fn renew_and_reap(self: Arc<Self>, shutdown: CancellationToken) {
        let renew_every = self.config.lease_ttl / 3;
        let mut renew = tokio::time::interval(renew_every);
        let mut reap = tokio::time::interval(self.config.reap_interval);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = renew.tick() => {
                    let managed: Vec<String> = self.managed.lock().expect("managed").iter().cloned().collect();
                    for id in managed {
                        if let Ok(Some(l)) = self.ledger.get(&id).await {
                            // Ended, or reclaimed by the reaper: not the plane's to renew.
                            if l.phase.is_terminal() || l.phase == Phase::Quarantine {
                                self.managed.lock().expect("managed").remove(&id);
                                continue;
                            }
                            let placed = self.cover.lock().expect("cover").in_flight.get(&id).cloned();
                            if !self.may_renew(l.node.as_deref().or(placed.as_deref())) {
                                continue;
                            }
                            let node = l.node.clone().unwrap_or_default();
                            if let Err(e) = self.ledger.heartbeat(&id, l.epoch, &node, crate::now_ms()).await {
                                warn!(lease = %id, error = %e, "plane renewal refused");
                            }
                        }
                    }
                }
                _ = reap.tick() => {
                    match self.ledger.reap(crate::now_ms()).await {
                        Ok(report) if !(report.quarantined.is_empty() && report.failed.is_empty()) => {
                            warn!(?report, "reaped expired leases");
                            self.wake.notify_one();
                        }
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "reap failed"),
                    }
                }
            }
        }
    }
}
