//! Coverage: as many runners starting or idle as there are assigned jobs no
//! runner has taken ([`Cover`], in memory; the wanted jobs themselves are in
//! the ledger), bounded by the set's maximum and the nodes' free capacity,
//! with a backoff after launches that did not end with a runner.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use billet_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::jobs::WaitKind;
use crate::ledger::{NodeCapacity, Phase};
use crate::node_link::NodeLink;

use super::Plane;
use super::jobs::Decision;
use super::launches::LostLaunch;

/// The first wait after a launch that did not end with a runner; it grows
/// exponentially, with jitter, to [`RELAUNCH_MAX_DELAY`], with no limit on
/// the number of tries.
pub(crate) const RELAUNCH_MIN_DELAY: Duration = Duration::from_millis(500);

/// The longest wait between two launches for the same uncovered jobs.
pub(crate) const RELAUNCH_MAX_DELAY: Duration = Duration::from_secs(15);

/// How long the tier's jobs are held after its image was found to carry a
/// runner GitHub will not run, at first; each hold in a row doubles it, to
/// [`OUTDATED_MAX_HOLD`]. The launch after a hold mints nothing unless the
/// node finds the image changed.
pub(crate) const OUTDATED_HOLD: Duration = Duration::from_secs(60);

/// The longest hold of a tier whose image's runner is refused.
pub(crate) const OUTDATED_MAX_HOLD: Duration = Duration::from_secs(15 * 60);

/// The reason a node ends a lease whose runner exited saying GitHub
/// refused its version.
const RUNNER_VERSION_REJECTED: &str = "runner_version_rejected";

/// How often the plane looks at coverage without being woken.
const COVER_TICK: Duration = Duration::from_millis(500);

/// Coverage of the assigned jobs, in memory (the ledger holds the leases,
/// and the wanted jobs durably: `Ledger::wanted_jobs`).
#[derive(Debug)]
pub(super) struct Cover {
    /// Jobs GitHub assigned to the scale set that no runner has taken and
    /// that are not completed or cancelled. The ledger holds the same set,
    /// written before the message that changed it is acknowledged.
    pub(super) wanted: BTreeSet<i64>,
    /// Wanted jobs this plane read from the ledger at start and no message
    /// has mentioned since, the earliest recorded first: the only ones a
    /// quiet poll may judge GitHub no longer has (`Cover::quiet_poll`).
    pub(super) recovered: Vec<i64>,
    /// How many wanted jobs the last quiet poll found beyond the jobs
    /// GitHub says wait, when it found some and no message came since.
    pub(super) excess_seen: Option<usize>,
    /// Runner names that took a job (their leases cover nothing more).
    pub(super) taken: HashSet<String>,
    /// Leases whose launch did not end with a runner: failed, refused,
    /// expired, not delivered, held by the node after a failure. (A lost
    /// launch covers while its lease is open: see `Plane::launch`.)
    pub(super) not_covering: HashSet<String>,
    /// Leases placed on a node whose launch is not answered yet.
    pub(super) in_flight: HashMap<String, String>,
    /// Runner names whose job GitHub reported completed.
    pub(super) completed: HashSet<String>,
    /// Leases whose launch was answered and that have not been seen closed
    /// yet: one that closes with its runner having taken no job, and that
    /// the plane did not end itself, was a launch that did not end with a
    /// runner serving a job.
    pub(super) launched: HashSet<String>,
    /// Launch delays after consecutive failures; `None` once a runner took
    /// a job.
    pub(super) backoff: Option<backon::ExponentialBackoff>,
    /// No launch before this instant.
    pub(super) retry_at: Option<Instant>,
    /// Nodes that refused a launch, avoided until the instant.
    pub(super) avoid: HashMap<String, Instant>,
    /// Lost launches to hand over, per node.
    pub(super) lost: HashMap<String, Vec<LostLaunch>>,
    /// The last time "no node has room" was logged.
    pub(super) no_room_logged: Option<Instant>,
    /// Nodes whose last launch the plane heard of ran the tier's image: only
    /// their launches carry a registration minted before dispatch, so a node
    /// without the image is asked to check it before anything is minted, and so
    /// is a node whose launch failed in any way, until one runs again.
    pub(super) image_ran: HashSet<String>,
    /// The tier's image carries a runner GitHub will not run: no launch
    /// until the instant, and how many holds in a row.
    pub(super) outdated: Option<(Instant, u32)>,
    /// Launches in a row that did not end with a runner.
    pub(super) failures: u32,
    /// Why the last launch that did not end with a runner failed, as a
    /// job's wait names it during the backoff after it.
    pub(super) last_failure: Option<(WaitKind, String)>,
}

impl Cover {
    /// Coverage that starts out wanting `recovered` (request ids, the
    /// earliest recorded first), as read from the ledger.
    pub(super) fn recovering(recovered: Vec<i64>) -> Self {
        Self {
            wanted: recovered.iter().copied().collect(),
            recovered,
            excess_seen: None,
            taken: HashSet::new(),
            not_covering: HashSet::new(),
            in_flight: HashMap::new(),
            completed: HashSet::new(),
            launched: HashSet::new(),
            backoff: None,
            retry_at: None,
            avoid: HashMap::new(),
            lost: HashMap::new(),
            no_room_logged: None,
            image_ran: HashSet::new(),
            outdated: None,
            failures: 0,
            last_failure: None,
        }
    }

    /// A launch did not end with a runner: the next one waits, longer each
    /// time in a row, with jitter.
    pub(super) fn failed(&mut self) -> Duration {
        let backoff = self.backoff.get_or_insert_with(|| {
            backon::BackoffBuilder::build(
                backon::ExponentialBuilder::default()
                    .with_jitter()
                    .with_min_delay(RELAUNCH_MIN_DELAY)
                    .with_max_delay(RELAUNCH_MAX_DELAY)
                    .without_max_times(),
            )
        });
        let delay = backoff.next().unwrap_or(RELAUNCH_MAX_DELAY);
        self.retry_at = Some(Instant::now() + delay);
        self.failures = self.failures.saturating_add(1);
        delay
    }

    /// Why the jobs wait during a backoff: the last failure, numbered.
    fn backing_off(&self) -> (WaitKind, String) {
        match &self.last_failure {
            Some((kind, why)) => (*kind, format!("after failure {}: {why}", self.failures)),
            None => (
                WaitKind::BackingOff,
                format!(
                    "after failure {}: a launch did not end with a runner",
                    self.failures
                ),
            ),
        }
    }

    /// A runner took a job: launches work, and the next failure waits the
    /// shortest time again. Not on a launch's answer: a runner that starts and
    /// then ends without taking a job (a broken image or configuration: it
    /// exits at once) has its launch answered every time, and would be replaced
    /// every 2 s for as long as the job waited.
    pub(super) fn succeeded(&mut self) {
        self.backoff = None;
        self.retry_at = None;
        self.outdated = None;
        self.failures = 0;
        self.last_failure = None;
    }

    /// The tier's image carries a runner GitHub will not run: its jobs are
    /// held, longer each time in a row, and the next launch is checked by
    /// the node before anything is minted. Returns the hold.
    pub(super) fn hold_outdated(&mut self) -> Duration {
        let times = self.outdated.map_or(0, |(_, n)| n);
        let hold = OUTDATED_HOLD
            .saturating_mul(1 << times.min(10))
            .min(OUTDATED_MAX_HOLD);
        self.outdated = Some((Instant::now() + hold, times + 1));
        self.image_ran.clear();
        hold
    }

    /// A message arrived: it changes what is wanted, so a count from an
    /// earlier quiet poll no longer says anything.
    pub(super) fn message_seen(&mut self) {
        self.excess_seen = None;
    }

    /// Job `request_id` is wanted no more (taken, ended, or judged gone).
    pub(super) fn forget(&mut self, request_id: i64) {
        self.wanted.remove(&request_id);
        self.recovered.retain(|r| *r != request_id);
    }

    /// A poll ended with no message: every message GitHub had was handled,
    /// so the jobs wanted should be the `waiting` jobs GitHub counts
    /// (assigned less running). More are wanted only when a job a
    /// predecessor recorded ended while no plane listened and its message
    /// never came; which one cannot be told, and need not be (any runner of
    /// the set takes any of its jobs): after two quiet polls in a row that
    /// both count an excess, the smaller excess is forgotten from the
    /// recovered jobs, the earliest recorded first, and returned. Nothing
    /// this plane was told itself is ever forgotten this way. Once a quiet
    /// poll counts no excess, what is left recovered is confirmed.
    pub(super) fn quiet_poll(&mut self, waiting: usize) -> Vec<i64> {
        if self.recovered.is_empty() {
            self.excess_seen = None;
            return Vec::new();
        }
        let excess = self.wanted.len().saturating_sub(waiting);
        if excess == 0 {
            self.recovered.clear();
            self.excess_seen = None;
            return Vec::new();
        }
        let Some(before) = self.excess_seen.replace(excess) else {
            return Vec::new();
        };
        let gone: Vec<i64> = self
            .recovered
            .iter()
            .copied()
            .take(before.min(excess))
            .collect();
        for request_id in &gone {
            self.forget(*request_id);
        }
        self.excess_seen = None;
        gone
    }

    /// Whether `lease` still stands for a runner that may take an assigned
    /// job: open, not quarantined, not tearing down, not busy, its launch
    /// not known to have failed, its runner not known to have taken a job.
    pub(super) fn covers(&self, lease: &crate::ledger::Lease) -> bool {
        !lease.phase.is_terminal()
            && !matches!(
                lease.phase,
                Phase::Quarantine | Phase::Teardown | Phase::Busy
            )
            && !self.not_covering.contains(&lease.id)
            && !lease
                .runner_name
                .as_ref()
                .is_some_and(|n| self.taken.contains(n))
    }
}

impl Plane {
    /// Keeps every assigned job covered: on every wake-up and every
    /// [`COVER_TICK`], launches what is missing.
    pub(super) async fn keep_covered(self: Arc<Self>, shutdown: CancellationToken) {
        loop {
            if let Err(e) = Arc::clone(&self).cover_once().await {
                warn!(error = %e, "coverage pass failed; trying again");
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(COVER_TICK) => {}
            }
        }
    }

    /// One coverage pass: as many runners starting or idle as there are
    /// assigned jobs no runner has taken, bounded by the set's maximum and
    /// by the nodes' free capacity. Nothing is launched during a backoff or
    /// while the scale set is believed missing.
    ///
    /// Each wanted job's wait reason, as the pass decided it, is recorded
    /// when it changed ([`Plane::note_waits`]).
    pub(super) async fn cover_once(self: Arc<Self>) -> Result<(), crate::ledger::LedgerError> {
        let _pass = self.pass.lock().await;
        let decisions = Arc::clone(&self).cover_pass().await?;
        self.note_waits(decisions).await;
        Ok(())
    }

    /// The body of [`Plane::cover_once`]; returns why each wanted job has
    /// no runner yet, or which lease it waits on.
    async fn cover_pass(self: Arc<Self>) -> Result<Vec<Decision>, crate::ledger::LedgerError> {
        let tier = self.config.tier.clone();
        let wanted_now: Vec<i64>;
        {
            let cover = self.cover.lock().expect("cover");
            wanted_now = cover.wanted.iter().copied().collect();
            let all = |(kind, detail): (WaitKind, String)| -> Vec<Decision> {
                wanted_now
                    .iter()
                    .map(|r| (*r, kind, detail.clone()))
                    .collect()
            };
            if cover.wanted.is_empty() {
                return Ok(Vec::new());
            }
            if cover.retry_at.is_some_and(|at| Instant::now() < at) {
                return Ok(all(cover.backing_off()));
            }
            if let Some((until, _)) = cover.outdated
                && Instant::now() < until
            {
                return Ok(all((
                    WaitKind::TierHeld,
                    format!(
                        "image {} carries a runner GitHub refuses; asked again in {}s",
                        tier.image,
                        until.saturating_duration_since(Instant::now()).as_secs()
                    ),
                )));
            }
        }
        let all = |(kind, detail): (WaitKind, String)| -> Vec<Decision> {
            wanted_now
                .iter()
                .map(|r| (*r, kind, detail.clone()))
                .collect()
        };
        // The plane is the tier authority: it asks whether the set exists
        // (from the cache; one lookup per retry interval while missing)
        // before it mints anything through a node.
        match self.github.scale_set(&tier.label).await {
            Ok(_) => {}
            Err(e) if e.is_scale_set_not_found() => {
                return Ok(all((
                    WaitKind::ScaleSetMissing,
                    format!("GitHub has no scale set named {}", tier.label),
                )));
            }
            Err(e) => {
                warn!(error = %e, "cannot ask GitHub for the scale set; not launching");
                let mut cover = self.cover.lock().expect("cover");
                cover.last_failure = Some((
                    WaitKind::BackingOff,
                    format!("cannot ask GitHub for the scale set: {e}"),
                ));
                cover.failed();
                return Ok(all(cover.backing_off()));
            }
        }
        let open = self.ledger.open_leases().await?;
        if self.note_runners_ended_idle(&open).await? {
            return Ok(all(self.cover.lock().expect("cover").backing_off()));
        }
        let warm_rooms = self.ledger.warm_rooms().await?;
        let mut launches = Vec::new();
        let mut decisions: HashMap<i64, (WaitKind, String)> = HashMap::new();
        {
            let mut cover = self.cover.lock().expect("cover");
            // Forget what the ledger has closed.
            let open_ids: HashSet<&str> = open.iter().map(|l| l.id.as_str()).collect();
            cover
                .not_covering
                .retain(|id| open_ids.contains(id.as_str()));
            let covering: Vec<&crate::ledger::Lease> = open
                .iter()
                .filter(|l| l.tier == tier.label && cover.covers(l))
                .collect();
            let uncovered = cover.wanted.len().saturating_sub(covering.len());
            let live = u32::try_from(open.iter().filter(|l| l.tier == tier.label).count())
                .unwrap_or(u32::MAX);
            let room = usize::try_from(self.config.max_runners.saturating_sub(live)).unwrap_or(0);
            let need = uncovered.min(room);
            // What each node has charged: its open leases, plus leases placed
            // on it and not yet bound.
            let mut charged: HashMap<String, (u64, u64)> = HashMap::new();
            for l in &open {
                let node = l
                    .node
                    .clone()
                    .or_else(|| l.target_node.clone())
                    .or_else(|| cover.in_flight.get(&l.id).cloned());
                if let Some(node) = node {
                    let c = charged.entry(node).or_default();
                    c.0 += u64::from(l.vcpu);
                    c.1 += l.memory_bytes;
                }
            }
            // Warm runners take room as leases do; those of this tier are
            // room a lease of the tier takes over.
            let mut warm: HashMap<String, u32> = HashMap::new();
            for room in &warm_rooms {
                let c = charged.entry(room.node.clone()).or_default();
                c.0 += room.vcpu;
                c.1 += room.memory_bytes;
                if room.tier == tier.label {
                    *warm.entry(room.node.clone()).or_default() += 1;
                }
            }
            let now = Instant::now();
            cover.avoid.retain(|_, until| *until > now);
            let wanted: Vec<i64> = cover.wanted.iter().copied().collect();
            let mut unplaced = None;
            for _ in 0..need {
                let Some(node) = self.pick_node(&charged, &warm, &cover.avoid) else {
                    unplaced = Some(self.why_unplaced(&charged, &cover));
                    if cover
                        .no_room_logged
                        .is_none_or(|t| t.elapsed() >= Duration::from_secs(30))
                    {
                        match self.too_large_for_every_node() {
                            Some(why) => warn!(uncovered = need, "{why}"),
                            None => warn!(
                                uncovered = need,
                                "no attached node has room for another runner; the jobs wait"
                            ),
                        }
                        cover.no_room_logged = Some(Instant::now());
                    }
                    break;
                };
                // A job with no lease of its own yet, and none on this node
                // (a node refuses a second lease for a request it holds).
                let on_node = |r: i64| {
                    open.iter()
                        .any(|l| l.request_id == r && l.node.as_deref() == Some(node.name()))
                        || launches
                            .iter()
                            .any(|(n, p): &(Arc<NodeLink>, i64)| *p == r && n.name() == node.name())
                };
                let has_cover = |r: i64| {
                    covering.iter().any(|l| l.request_id == r)
                        || launches.iter().any(|(_, p)| *p == r)
                };
                let request_id = wanted
                    .iter()
                    .copied()
                    .find(|r| !has_cover(*r) && !on_node(*r))
                    .or_else(|| wanted.iter().copied().find(|r| !has_cover(*r)))
                    .or_else(|| wanted.first().copied());
                let Some(request_id) = request_id else { break };
                match warm.get_mut(node.name()).filter(|n| **n > 0) {
                    // The lease takes the warm runner's room over.
                    Some(n) => *n -= 1,
                    None => {
                        let c = charged.entry(node.name().to_owned()).or_default();
                        c.0 += u64::from(tier.vcpu);
                        c.1 += tier.memory_bytes;
                    }
                }
                launches.push((node, request_id));
            }
            let waits_on = |l: &crate::ledger::Lease| {
                let node = l
                    .node
                    .clone()
                    .or_else(|| l.target_node.clone())
                    .unwrap_or_default();
                let kind = if self.jobs.lock().expect("jobs").warm_leases.contains(&l.id) {
                    WaitKind::WarmRunner
                } else {
                    WaitKind::RunnerStarting
                };
                (kind, format!("lease {} on node {node}", l.id))
            };
            for r in &wanted {
                if launches.iter().any(|(_, p)| p == r) {
                    continue;
                }
                let decision = if let Some(l) = covering.iter().find(|l| l.request_id == *r) {
                    waits_on(l)
                } else if let Some(why) = &unplaced {
                    why.clone()
                } else if uncovered > room {
                    (
                        WaitKind::AtMaximum,
                        format!(
                            "the scale set has {live} runners, its maximum of {}",
                            self.config.max_runners
                        ),
                    )
                } else {
                    (
                        WaitKind::RunnerStarting,
                        "runners of the scale set are starting; any of them may take it".to_owned(),
                    )
                };
                decisions.insert(*r, decision);
            }
        }
        for (node, request_id) in launches {
            // The ledger checks the node's room again, in the reservation's
            // own transaction: another plane sharing the ledger may have
            // booked it since this pass read it.
            let capacity = node
                .status()
                .borrow()
                .as_ref()
                .map(|s| NodeCapacity {
                    vcpu: u64::from(s.capacity.vcpu),
                    memory_bytes: s.capacity.memory_bytes,
                })
                .unwrap_or_default();
            let (lease, warm) = match self.reserve(request_id, node.name(), capacity).await {
                Ok(reserved) => reserved,
                Err(e @ crate::ledger::LedgerError::NoCapacity { .. }) => {
                    info!(error = %e, "the ledger has no room on the node; the job waits");
                    decisions.insert(
                        request_id,
                        (
                            WaitKind::NoCapacity,
                            format!("the ledger has no room on node {}", node.name()),
                        ),
                    );
                    continue;
                }
                Err(e) => return Err(e),
            };
            let kind = if warm.is_some() {
                WaitKind::WarmRunner
            } else {
                WaitKind::RunnerStarting
            };
            decisions.insert(
                request_id,
                (kind, format!("lease {} on node {}", lease.id, node.name())),
            );
            self.cover
                .lock()
                .expect("cover")
                .in_flight
                .insert(lease.id.clone(), node.name().to_owned());
            let span = info_span!("launch", lease = %lease.id, node = node.name());
            let plane = Arc::clone(&self);
            self.tasks
                .spawn(async move { plane.launch(lease, node, warm).await }.instrument(span));
        }
        Ok(decisions
            .into_iter()
            .map(|(r, (kind, detail))| (r, kind, detail))
            .collect())
    }

    /// Why no attached node takes another runner of the tier now: no node
    /// attached, every one degraded (with its reasons), every one avoided
    /// after a refusal (the image missing, or another), or no room.
    fn why_unplaced(
        &self,
        charged: &HashMap<String, (u64, u64)>,
        cover: &Cover,
    ) -> (WaitKind, String) {
        let tier = &self.config.tier;
        if let Some(why) = self.too_large_for_every_node() {
            return (WaitKind::NoCapacity, why);
        }
        let mut parts = Vec::new();
        let (mut attached, mut degraded, mut avoided) = (0, 0, 0);
        for n in &self.nodes {
            let Some(status) = n.status().borrow().clone() else {
                continue;
            };
            attached += 1;
            if status.degraded() {
                degraded += 1;
                let reasons: Vec<&str> = status
                    .health
                    .reasons
                    .iter()
                    .map(|r| {
                        pb::DegradedReason::try_from(*r)
                            .map_or("unknown", |r| r.as_str_name())
                            .trim_start_matches("DEGRADED_REASON_")
                    })
                    .collect();
                parts.push(format!(
                    "{} degraded ({})",
                    n.name(),
                    reasons.join(", ").to_lowercase()
                ));
            } else if cover.avoid.contains_key(n.name()) {
                avoided += 1;
                parts.push(format!("{} avoided after refusing a launch", n.name()));
            } else {
                let (vcpu, memory) = charged.get(n.name()).copied().unwrap_or_default();
                let vcpu = vcpu.max(u64::from(status.held.vcpu));
                let memory = memory.max(status.held.memory_bytes);
                parts.push(format!(
                    "{} full ({} vCPU and {} MiB free)",
                    n.name(),
                    u64::from(status.capacity.vcpu).saturating_sub(vcpu),
                    status.capacity.memory_bytes.saturating_sub(memory) >> 20
                ));
            }
        }
        if attached == 0 {
            return (
                WaitKind::NoNode,
                format!("none of {} nodes is attached", self.nodes.len()),
            );
        }
        let kind = if degraded == attached {
            WaitKind::NodeDegraded
        } else if degraded + avoided == attached {
            match &cover.last_failure {
                Some((WaitKind::ImageMissing, _)) => WaitKind::ImageMissing,
                _ if degraded > 0 => WaitKind::NodeDegraded,
                _ => WaitKind::BackingOff,
            }
        } else {
            WaitKind::NoCapacity
        };
        (
            kind,
            format!(
                "a runner takes {} vCPU and {} MiB: {}",
                tier.vcpu,
                tier.memory_bytes >> 20,
                parts.join("; ")
            ),
        )
    }

    /// Why no runner of the tier can ever be placed, when that is so: it asks
    /// for more than every attached node has in all, empty, so its jobs would
    /// wait for ever behind a warning that reads like a node briefly full.
    /// `None` when some attached node could run it once it has room, or no node
    /// is attached.
    pub(super) fn too_large_for_every_node(&self) -> Option<String> {
        let tier = &self.config.tier;
        let largest = self
            .nodes
            .iter()
            .filter_map(|n| {
                let status = n.status().borrow().clone()?;
                Some((n.name().to_owned(), status.capacity))
            })
            .max_by_key(|(_, c)| (c.memory_bytes, c.vcpu))?;
        let fits = |c: &pb::Capacity| {
            u64::from(c.vcpu) >= u64::from(tier.vcpu) && c.memory_bytes >= tier.memory_bytes
        };
        if self
            .nodes
            .iter()
            .filter_map(|n| n.status().borrow().clone())
            .any(|s| fits(&s.capacity))
        {
            return None;
        }
        Some(format!(
            "tier {} asks for {} vCPU and {} MiB per runner, more than any attached node has in all (the largest, {}, has {} vCPU and {} MiB): its jobs wait until a node that large attaches; give the tier less (--vcpu, --memory-bytes) or attach a larger node",
            tier.label,
            tier.vcpu,
            tier.memory_bytes >> 20,
            largest.0,
            largest.1.vcpu,
            largest.1.memory_bytes >> 20
        ))
    }

    /// The attached node with a warm runner of the tier, else the one with
    /// the most free capacity that fits one more runner of the tier, never
    /// one that refused a launch within its backoff nor one that says it is
    /// degraded. Free is what the node said it may run less the larger of
    /// what the ledger charges on it (its leases and warm runners) and what
    /// the node said it holds (`Hello`, then every `Instances` and `Sweep`
    /// report): compute the node adopted counts even before the ledger
    /// charges it there, and a lease placed and not yet bound counts even
    /// before the node reports it. A warm runner of the tier (`warm`, per
    /// node) is room the lease takes over, however full the node.
    pub(super) fn pick_node(
        &self,
        charged: &HashMap<String, (u64, u64)>,
        warm: &HashMap<String, u32>,
        avoid: &HashMap<String, Instant>,
    ) -> Option<Arc<NodeLink>> {
        let tier = &self.config.tier;
        self.nodes
            .iter()
            .filter(|n| !avoid.contains_key(n.name()))
            .filter_map(|n| {
                let status = n.status().borrow().clone()?;
                if status.degraded()
                    && !n
                        .faults
                        .place_on_degraded
                        .load(std::sync::atomic::Ordering::SeqCst)
                {
                    return None;
                }
                let capacity = status.capacity;
                let (vcpu, memory) = charged.get(n.name()).copied().unwrap_or_default();
                let vcpu = vcpu.max(u64::from(status.held.vcpu));
                let memory = memory.max(status.held.memory_bytes);
                let free_vcpu = u64::from(capacity.vcpu).saturating_sub(vcpu);
                let free_memory = capacity.memory_bytes.saturating_sub(memory);
                let has_warm = warm.get(n.name()).is_some_and(|c| *c > 0);
                (has_warm
                    || (free_vcpu >= u64::from(tier.vcpu) && free_memory >= tier.memory_bytes))
                    .then(|| ((has_warm, free_vcpu), Arc::clone(n)))
            })
            .max_by_key(|(free, _)| *free)
            .map(|(_, n)| n)
    }

    /// Launched leases that `open` no longer holds: one whose runner took
    /// no job (its name neither started nor completed a job) and that the
    /// plane did not end itself (`not_covering`: a scale-down, a refused
    /// or failed launch) is a launch that did not end with a runner
    /// serving a job, so the next launch waits, longer each time in a row
    /// (a runner image that exits at once would otherwise be replaced every
    /// 2 s). Returns whether a wait began.
    async fn note_runners_ended_idle(
        &self,
        open: &[crate::ledger::Lease],
    ) -> Result<bool, crate::ledger::LedgerError> {
        let closed: Vec<String> = {
            let open_ids: HashSet<&str> = open.iter().map(|l| l.id.as_str()).collect();
            let cover = self.cover.lock().expect("cover");
            cover
                .launched
                .iter()
                .filter(|id| !open_ids.contains(id.as_str()))
                .cloned()
                .collect()
        };
        let mut idle = Vec::new();
        for id in closed {
            let lease = self.ledger.get(&id).await?;
            let rejected = lease
                .as_ref()
                .and_then(|l| l.failure_reason.as_deref())
                .is_some_and(|r| r.starts_with(RUNNER_VERSION_REJECTED));
            let why = lease
                .as_ref()
                .and_then(|l| l.failure_reason.clone())
                .unwrap_or_else(|| "no reason recorded".to_owned());
            let runner = lease.and_then(|l| l.runner_name);
            let mut cover = self.cover.lock().expect("cover");
            if rejected {
                let hold = cover.hold_outdated();
                tracing::error!(lease = %id, image = %self.config.tier.image, hold_s = hold.as_secs(),
                    "a runner exited saying GitHub refused its version: no more runners of this image are minted; the tier's jobs wait until it is rebuilt on a newer actions/runner (asked again after the hold)");
            }
            cover.launched.remove(&id);
            let served = runner
                .as_ref()
                .is_some_and(|n| cover.taken.contains(n) || cover.completed.contains(n));
            if !served && !cover.not_covering.contains(&id) {
                cover.last_failure = Some((
                    WaitKind::BackingOff,
                    format!("lease {id}'s runner ended without taking a job: {why}"),
                ));
                idle.push(id);
            }
        }
        if idle.is_empty() {
            return Ok(false);
        }
        let delay = self.cover.lock().expect("cover").failed();
        warn!(leases = ?idle, delay_ms = u64::try_from(delay.as_millis()).unwrap_or(u64::MAX),
              "a launched runner ended without taking a job; the next launch waits");
        Ok(true)
    }
}
