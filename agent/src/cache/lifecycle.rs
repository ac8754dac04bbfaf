//! The sticky-disk store's life beside its jobs (issue #16 item 6,
//! spec/cache.md §3.2, §3.4, §4.2): what proves a mount's compute is gone,
//! and the periodic eviction.
//!
//! - **Only a successful inventory is evidence** (§3.4). A mount is
//!   discarded behind its job's back only on a [`Listed`]: a provider
//!   listing that succeeded, plus the leases the runner still holds. A
//!   listing that failed is [`Inventory::Unknown`], which carries no lease
//!   at all, so it cannot be mistaken for an empty listing: every mount
//!   stays fenced until a listing succeeds.
//! - **Reconcile and retry** ([`super::Store::reconcile`]): the runner hands
//!   the store each successful inventory, at recovery and at every sweep.
//!   A mount whose lease is neither held nor listed is discarded. That
//!   covers a restarted node's leftovers (the reference's
//!   `ReconcileInventory`) and a mount whose settling failed when its job
//!   ended (the reference's `RetryClosed`, every 5 minutes there; here at
//!   the plane's sweep interval).
//! - **Eviction** ([`keep_evicting`]): every interval, [`super::Store::evict`]
//!   by the operator's retention and byte budget, least recently used first,
//!   never a generation a mount was cloned from; each pass renews those
//!   generations' last use (the reference's `RenewActive`).

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::{Eviction, Store};

/// How often the node evicts by default: every 10 minutes.
pub const DEFAULT_EVICT_INTERVAL: Duration = Duration::from_secs(600);

/// What eviction removed since the store opened: the node's
/// `billet_cache_evicted_generations_total` and
/// `billet_cache_evicted_bytes_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Generations removed.
    pub generations: u64,
    /// Bytes they held on the disk (allocated blocks).
    pub bytes: u64,
}

impl Evicted {
    pub(super) fn add(&mut self, generations: u64, bytes: u64) {
        self.generations += generations;
        self.bytes += bytes;
    }
}

/// The leases that may still have compute on this node, by a provider
/// listing that succeeded: those it listed and those the runner holds
/// (launching, running or in custody). Make one only from a listing that
/// succeeded; a failed one is [`Inventory::Unknown`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    leases: BTreeSet<String>,
}

impl Listed {
    /// The leases of the instances a successful listing `listed`, and
    /// those the runner `held` when it was read.
    pub fn new(
        listed: impl IntoIterator<Item = String>,
        held: impl IntoIterator<Item = String>,
    ) -> Self {
        Self {
            leases: listed.into_iter().chain(held).collect(),
        }
    }

    /// Whether `lease` may still have compute: a mount of a lease for which
    /// this is false is discarded.
    #[must_use]
    pub fn may_run(&self, lease: &str) -> bool {
        self.leases.contains(lease)
    }
}

/// What a provider inventory says about the compute of mounts: a listing
/// that succeeded, or nothing at all (spec/cache.md §3.4: "call it only
/// with a successful listing"). There is no way to turn a failed listing
/// into an empty one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Inventory {
    /// The provider listed everything it runs.
    Listed(Listed),
    /// The listing failed: no evidence that anything is gone, so every
    /// mount stays as it is.
    Unknown,
}

/// Evicts from `store` by `rules` every `interval` (the first pass one
/// interval after the start, so a node restarting in a loop does not walk
/// its whole cache each time) until `stop`. A pass that fails is logged and
/// the next one tries again.
pub async fn keep_evicting(
    store: Arc<Store>,
    rules: Eviction,
    interval: Duration,
    stop: CancellationToken,
) {
    info!(
        retention_hours = rules.retention.as_secs() / 3600,
        max_bytes = ?rules.budget_bytes,
        interval_s = interval.as_secs(),
        "evicting sticky-disk generations periodically"
    );
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let now_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        match store.evict(rules, now_unix_ms).await {
            Ok(report) => {
                if !report.removed.is_empty() {
                    info!(
                        generations = report.removed.len(),
                        freed_bytes = report.freed_bytes,
                        kept_mounted = report.kept_mounted,
                        kept_bytes = report.kept_bytes,
                        "sticky-disk eviction pass"
                    );
                }
                if let Some(budget) = rules.budget_bytes
                    && report.kept_bytes > budget
                {
                    warn!(
                        kept_bytes = report.kept_bytes,
                        max_bytes = budget,
                        kept_mounted = report.kept_mounted,
                        "the sticky disks still hold more than --cache-max-bytes: what is left is mounted by running jobs"
                    );
                }
            }
            Err(e) => {
                warn!(error = %e, "the sticky-disk eviction pass failed; the next one tries again")
            }
        }
    }
}
