//! The sticky-disk store's life beside its jobs (spec/cache.md §3.2, §3.4,
//! §4.2): what proves a mount's compute is gone, and the periodic eviction.
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
//! - **Eviction** ([`keep_evicting`], each pass [`evict`]): every interval,
//!   the sticky disks' generations and the Actions cache's archives by the
//!   operator's retentions and byte budget, least recently used first
//!   across both, never a generation a mount was cloned from nor an archive
//!   a live session reads; each pass renews the mounted generations' last
//!   use (the reference's `RenewActive`). The walk takes no lock: mounts,
//!   commits and lookups go on while it reads sizes, and each victim is
//!   looked at again, and removed, under its lock.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::actions::archives::{Archives, EntryUse};
use super::store::{CacheError, EvictReport, GenerationUse, WalkSeam};
use super::{Eviction, Store};

/// How often the node evicts by default: every 10 minutes.
pub const DEFAULT_EVICT_INTERVAL: Duration = Duration::from_secs(600);

/// What eviction removed since the store opened: the node's
/// `billet_cache_evicted_generations_total`,
/// `billet_cache_evicted_archives_total` and
/// `billet_cache_evicted_bytes_total`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Evicted {
    /// Sticky-disk (and image store) generations removed.
    pub generations: u64,
    /// Actions cache archives removed.
    pub archives: u64,
    /// Bytes both held on the disk (allocated blocks).
    pub bytes: u64,
}

impl Evicted {
    pub(super) fn add(&mut self, generations: u64, bytes: u64) {
        self.generations += generations;
        self.bytes += bytes;
    }

    pub(super) fn add_archive(&mut self, bytes: u64) {
        self.archives += 1;
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
    pub(crate) fn new(
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
    pub(crate) fn may_run(&self, lease: &str) -> bool {
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

/// Something an eviction pass found on the cache's disk.
#[derive(Debug)]
enum Held {
    Generation(GenerationUse),
    Archive(EntryUse),
}

impl Held {
    fn bytes(&self) -> u64 {
        match self {
            Self::Generation(g) => g.bytes,
            Self::Archive(a) => a.bytes,
        }
    }

    /// Its last use, in Unix milliseconds.
    fn used_unix_ms(&self) -> i64 {
        match self {
            Self::Generation(g) => g.used_unix_ms,
            Self::Archive(a) => a
                .last_used
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
        }
    }

    /// Never removed: mounted, or read by a live session.
    fn protected(&self) -> bool {
        match self {
            Self::Generation(g) => g.mounted,
            Self::Archive(a) => a.in_use,
        }
    }

    /// Whether the rules remove it whatever the budget: a generation no
    /// longer its key's head, or anything unused for its retention.
    fn expired(&self, rules: &Eviction, now_unix_ms: i64) -> bool {
        let unused_ms = now_unix_ms.saturating_sub(self.used_unix_ms());
        let past = |retention: Duration| {
            unused_ms >= i64::try_from(retention.as_millis()).unwrap_or(i64::MAX)
        };
        match self {
            Self::Generation(g) => !g.head || past(rules.retention_of(&g.key)),
            Self::Archive(_) => past(rules.retention),
        }
    }

    /// The order the budget removes in: least recently used first, then
    /// generations before archives, then by key and number.
    fn order(&self) -> (i64, u8, String, u64) {
        match self {
            Self::Generation(g) => (g.used_unix_ms, 0, g.key.clone(), g.generation.0),
            Self::Archive(a) => (self.used_unix_ms(), 1, a.dir.display().to_string(), 0),
        }
    }
}

/// One eviction pass at `now_unix_ms` over `store`'s generations and, when
/// given, `archives`' published entries, by `rules`:
///
/// 1. under the store's lock, every mounted generation is renewed as used
///    now (`Store::renew_mounted`);
/// 2. **without any lock**, the walk reads every generation's and
///    archive's size and last use (`Store::survey`,
///    [`Archives::entries`]);
/// 3. victims are chosen from what the walk read: every generation no
///    longer its key's head, everything unused for its retention
///    ([`Eviction::retention_of`]), then, least recently used first across
///    generations and archives, until what is kept fits
///    [`Eviction::budget_bytes`]; never a mounted generation or an archive
///    a live session reads;
/// 4. each victim is looked at again and removed under its lock
///    (`Store::remove_generation`, [`Archives::evict_entry`]): one
///    mounted, read or used since the walk stays.
///
/// # Errors
///
/// [`CacheError`] when the store cannot be read or a generation removed;
/// what was removed before stays removed. An archive that cannot be
/// listed or removed is logged and the pass goes on.
pub(crate) async fn evict(
    store: &Store,
    archives: Option<&Arc<Archives>>,
    rules: Eviction,
    now_unix_ms: i64,
) -> Result<EvictReport, CacheError> {
    evict_walking(store, archives, rules, now_unix_ms, None).await
}

/// [`evict`], with `seam` called by the walk before each generation's size
/// is read.
pub(crate) async fn evict_walking(
    store: &Store,
    archives: Option<&Arc<Archives>>,
    rules: Eviction,
    now_unix_ms: i64,
    seam: Option<WalkSeam>,
) -> Result<EvictReport, CacheError> {
    let pinned = store.renew_mounted(now_unix_ms).await?;
    let mut found: Vec<Held> = store
        .survey(&pinned, seam)
        .await?
        .into_iter()
        .map(Held::Generation)
        .collect();
    if let Some(archives) = archives {
        let a = archives.clone();
        match tokio::task::spawn_blocking(move || a.entries()).await {
            Ok(Ok(entries)) => found.extend(entries.into_iter().map(Held::Archive)),
            Ok(Err(e)) => {
                warn!(error = %e, "cannot list the Actions cache archives; this pass evicts none")
            }
            Err(e) => std::panic::resume_unwind(e.into_panic()),
        }
    }
    let mut report = EvictReport::default();
    let mut victims = Vec::new();
    let mut kept = Vec::new();
    for held in found {
        match &held {
            Held::Generation(g) if g.mounted => report.kept_mounted += 1,
            Held::Archive(a) if a.in_use => report.kept_in_use += 1,
            _ => {}
        }
        if !held.protected() && held.expired(&rules, now_unix_ms) {
            victims.push(held);
        } else {
            kept.push(held);
        }
    }
    let mut kept_bytes: u64 = kept.iter().map(Held::bytes).sum();
    if let Some(budget) = rules.budget_bytes {
        kept.sort_by_key(Held::order);
        for held in kept {
            if kept_bytes <= budget {
                break;
            }
            if held.protected() {
                continue;
            }
            kept_bytes = kept_bytes.saturating_sub(held.bytes());
            victims.push(held);
        }
    }
    for victim in victims {
        let removed = match &victim {
            Held::Generation(g) => store.remove_generation(g).await?,
            Held::Archive(a) => match archives {
                Some(archives) => archives.evict_entry(a).await.unwrap_or_else(|e| {
                    warn!(error = %e, key = %a.key, "cannot evict an Actions cache archive; the next pass tries again");
                    false
                }),
                None => false,
            },
        };
        if !removed {
            report.kept_used_since += 1;
            kept_bytes += victim.bytes();
            continue;
        }
        report.freed_bytes += victim.bytes();
        match victim {
            Held::Generation(g) => report.removed.push((g.key, g.generation)),
            Held::Archive(a) => {
                store.count_evicted_archive(a.bytes);
                report.archives_removed.push(a.dir);
            }
        }
    }
    report.kept_bytes = kept_bytes;
    Ok(report)
}

/// Evicts from `store` and, when given, `archives` by `rules` every
/// `interval` (the first pass one interval after the start, so a node
/// restarting in a loop does not walk its whole cache each time) until
/// `stop`. Each pass is logged; one that fails is logged and the next one
/// tries again.
pub(crate) async fn keep_evicting(
    store: Arc<Store>,
    archives: Option<Arc<Archives>>,
    rules: Eviction,
    interval: Duration,
    stop: CancellationToken,
) {
    info!(
        retention_hours = rules.retention.as_secs() / 3600,
        image_store_retention_hours = rules.image_store_retention.as_secs() / 3600,
        max_bytes = rules.budget_bytes,
        interval_s = interval.as_secs(),
        actions_archives = archives.is_some(),
        "evicting the cache periodically"
    );
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
        let now_unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX));
        match evict(&store, archives.as_ref(), rules, now_unix_ms).await {
            Ok(report) => {
                info!(
                    generations = report.removed.len(),
                    archives = report.archives_removed.len(),
                    freed_bytes = report.freed_bytes,
                    kept_mounted = report.kept_mounted,
                    kept_in_use = report.kept_in_use,
                    kept_used_since = report.kept_used_since,
                    kept_bytes = report.kept_bytes,
                    "cache eviction pass"
                );
                if let Some(budget) = rules.budget_bytes
                    && report.kept_bytes > budget
                {
                    warn!(
                        kept_bytes = report.kept_bytes,
                        max_bytes = budget,
                        kept_mounted = report.kept_mounted,
                        kept_in_use = report.kept_in_use,
                        "the cache still holds more than --cache-max-bytes: what is left is mounted or read by running jobs"
                    );
                }
            }
            Err(e) => {
                warn!(error = %e, "the cache eviction pass failed; the next one tries again")
            }
        }
    }
}
