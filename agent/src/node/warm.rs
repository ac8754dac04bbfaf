//! The warm pool: runners started ahead of their jobs.
//!
//! For each tier the plane names (`WarmPool`), the node keeps the wanted
//! number of *warm runners*: containers already started from the tier's
//! image, holding no registration and no credential, each with its runner
//! blocked on its handoff FIFO. A launch of the tier takes one
//! ([`WarmPool::claim`]) and the provider hands it the JIT config through
//! that FIFO ([`Provider::claim_warm`]): nothing is created on the job's
//! path. The pool refills on its own task, never in the command slot.
//!
//! Room: every warm runner's room is charged in the ledger before it is
//! created ([`WarmRooms::reserve`]; a refusal creates nothing), handed back
//! once it is gone ([`WarmRooms::release`]), and the node says which it
//! holds every [`CONFIRM_EVERY`] ([`WarmRooms::confirm`]), so rows a crash
//! or a lost reply left are dropped. A lease reserved on the node takes a
//! warm runner's room over in the ledger and its launch names that runner;
//! a warm runner whose room the ledger no longer charges is *taken* and
//! waits [`TAKEN_GRACE`] for the launch that names it, then goes.
//!
//! A restart retires every warm runner it finds (decision 113): the
//! process that started it is gone with its handoff, so nothing can hand
//! it a config, and a warm runner holds nothing worth adopting.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::{Notify, watch};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{debug, info, warn};

use super::freshness::Freshness;
use super::plane::PlaneError;
use crate::model::{ByteSize, InstanceName, TierSpec, WarmTarget};
use crate::provider::{InstanceState, Provider, Teardown, WarmSpec};

/// How often the pool looks at its runners and refills when nothing wakes
/// it sooner.
const TICK: Duration = Duration::from_secs(1);

/// How often the pool tells the ledger which warm runners it holds, and
/// reads the engine's view of them.
pub(crate) const CONFIRM_EVERY: Duration = Duration::from_secs(10);

/// How long a warm runner whose room a lease took over waits for that
/// lease's launch before it is retired.
pub(crate) const TAKEN_GRACE: Duration = Duration::from_secs(60);

/// How long a launch waits for a warm runner still being started, when its
/// plane named that one.
const STARTING_WAIT: Duration = Duration::from_secs(10);

/// How long refilling a tier pauses after a create failed.
const FAILED_PAUSE: Duration = Duration::from_secs(10);

/// The warm runners' room in the ledger: the plane calls the pool makes.
#[async_trait]
pub trait WarmRooms: Send + Sync + std::fmt::Debug {
    /// Charges a warm runner's room on this node before it is created.
    ///
    /// # Errors
    ///
    /// [`PlaneError::Refused`] when the node has no room left;
    /// [`PlaneError::Unavailable`] when the plane cannot be asked.
    async fn reserve(
        &self,
        name: &InstanceName,
        tier: &str,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError>;

    /// Hands a retired warm runner's room back. Unknown is success.
    ///
    /// # Errors
    ///
    /// [`PlaneError::Unavailable`] when the plane cannot be asked.
    async fn release(&self, name: &InstanceName) -> Result<(), PlaneError>;

    /// Says the node holds exactly `names`; answers those still charged.
    ///
    /// # Errors
    ///
    /// [`PlaneError::Unavailable`] when the plane cannot be asked.
    async fn confirm(&self, names: &[InstanceName]) -> Result<Vec<InstanceName>, PlaneError>;
}

/// What an attempt to start a warm runner came to.
enum Started {
    Yes,
    /// The ledger has no room for it, or the plane cannot be asked.
    NotNow,
    /// The provider could not start it: the tier pauses.
    Failed,
}

/// Where one warm runner stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Its room is being reserved, or it is being created.
    Starting,
    /// Running, waiting for a launch.
    Ready,
    /// The ledger no longer charges its room: a lease took it over, and
    /// its launch should come (since the instant held).
    Taken(Instant),
}

#[derive(Debug)]
struct Entry {
    tier: String,
    /// What it was started from, to match a launch's tier and notice a
    /// changed target.
    spec: TierSpec,
    /// The size a lease of the tier asks (the provider may run it at
    /// less, as it runs the lease).
    size: (u32, ByteSize),
    /// The id of the image it was started from: a rebuilt image retires
    /// it.
    image_id: String,
    stage: Stage,
    born: Instant,
    /// Set to `true` once it runs (or dropped when it failed to start).
    ready: watch::Sender<bool>,
}

#[derive(Debug, Default)]
struct Inner {
    targets: BTreeMap<String, WarmTarget>,
    entries: BTreeMap<InstanceName, Entry>,
    /// Refilling a tier waits until then after a failure.
    paused: BTreeMap<String, Instant>,
    /// No more refills: the node drains or stops.
    closed: bool,
    /// Warm runners retired whose removal is not confirmed yet: still
    /// held (their room stays charged), removed again every turn, and
    /// handed back (when the flag says the room is still theirs) once
    /// gone.
    retiring: BTreeMap<InstanceName, bool>,
    /// Warm runners a launch claimed and is handing its config to (they
    /// keep their warm name until the provider renames them): out of the
    /// pool, and no strays.
    taking: std::collections::BTreeSet<InstanceName>,
}

/// What the pool did, for status and metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmCounts {
    /// Warm runners waiting for a launch.
    pub ready: u32,
    /// Being reserved or started.
    pub starting: u32,
    /// Wanted in all.
    pub wanted: u32,
    /// Launches handed a warm runner since the pool was made.
    pub claimed: u64,
}

/// Where warm runners' names come from.
struct Names(Box<dyn Fn() -> InstanceName + Send + Sync>);

impl std::fmt::Debug for Names {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Names")
    }
}

/// This node's warm runners.
#[derive(Debug)]
pub struct WarmPool {
    provider: Arc<dyn Provider>,
    rooms: Arc<dyn WarmRooms>,
    freshness: Arc<Freshness>,
    inner: Mutex<Inner>,
    wake: Notify,
    claimed: std::sync::atomic::AtomicU64,
    names: Names,
}

impl WarmPool {
    /// An empty pool over `provider`, charging room through `rooms`,
    /// starting no runner `freshness` refuses.
    pub fn new(
        provider: Arc<dyn Provider>,
        rooms: Arc<dyn WarmRooms>,
        freshness: Arc<Freshness>,
    ) -> Self {
        Self {
            provider,
            rooms,
            freshness,
            inner: Mutex::new(Inner::default()),
            wake: Notify::new(),
            claimed: std::sync::atomic::AtomicU64::new(0),
            names: Names(Box::new(InstanceName::fresh_warm)),
        }
    }

    /// The same pool naming its warm runners with `names` rather than
    /// fresh random names: a test that replays a run needs the same names,
    /// since the pool visits its runners in name order.
    #[cfg(any(test, feature = "testing"))]
    #[must_use]
    pub fn with_names(mut self, names: impl Fn() -> InstanceName + Send + Sync + 'static) -> Self {
        self.names = Names(Box::new(names));
        self
    }

    fn inner(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes in the wanted state: a tier not in `targets` wants none.
    pub fn set_targets(&self, targets: Vec<WarmTarget>) {
        let mut inner = self.inner();
        inner.targets = targets
            .into_iter()
            .map(|t| (t.tier.label.clone(), t))
            .collect();
        inner.paused.clear();
        drop(inner);
        self.wake.notify_one();
    }

    /// Stops refilling and retires every warm runner on the next turn
    /// (the node drains).
    pub fn close(&self) {
        self.inner().closed = true;
        self.wake.notify_one();
    }

    /// What the pool holds and wants now.
    pub fn counts(&self) -> WarmCounts {
        let inner = self.inner();
        let mut counts = WarmCounts {
            wanted: if inner.closed {
                0
            } else {
                inner.targets.values().map(|t| t.count).sum()
            },
            claimed: self.claimed.load(std::sync::atomic::Ordering::Relaxed),
            ..WarmCounts::default()
        };
        for entry in inner.entries.values() {
            match entry.stage {
                Stage::Ready => counts.ready += 1,
                Stage::Starting => counts.starting += 1,
                Stage::Taken(_) => {}
            }
        }
        counts
    }

    /// Whether [`WarmPool::claim`] may find a runner for a launch of
    /// `tier` at `size` now: the one the plane named (`hint`) is here, or
    /// a ready one of the tier is.
    pub fn has(&self, hint: Option<&InstanceName>, tier: &TierSpec, size: (u32, ByteSize)) -> bool {
        let inner = self.inner();
        let fits = |e: &Entry| e.tier == tier.label && e.spec == *tier && e.size == size;
        hint.and_then(|h| inner.entries.get(h)).is_some_and(fits)
            || inner
                .entries
                .values()
                .any(|e| fits(e) && e.stage == Stage::Ready)
    }

    /// A warm runner for a launch of `tier` at `size`, taken out of the
    /// pool: the one the plane named (`hint`, waited for while it starts)
    /// when it is here and fits, else any ready one of the tier that fits.
    /// `None`: the launch creates its instance. A runner taken without the
    /// plane naming it still has its room charged as a warm runner's, which
    /// is handed back here. The launch says [`WarmPool::taken`] once the
    /// provider has renamed it, or failed to.
    pub async fn claim(
        &self,
        hint: Option<&InstanceName>,
        tier: &TierSpec,
        size: (u32, ByteSize),
    ) -> Option<InstanceName> {
        let fits = |e: &Entry| e.tier == tier.label && e.spec == *tier && e.size == size;
        if let Some(hint) = hint {
            let waiting = {
                let inner = self.inner();
                match inner.entries.get(hint) {
                    Some(e) if fits(e) && e.stage == Stage::Starting => Some(e.ready.subscribe()),
                    _ => None,
                }
            };
            if let Some(mut ready) = waiting {
                let _ = tokio::time::timeout(STARTING_WAIT, ready.wait_for(|r| *r)).await;
            }
            let mut inner = self.inner();
            if inner
                .entries
                .get(hint)
                .is_some_and(|e| fits(e) && matches!(e.stage, Stage::Ready | Stage::Taken(_)))
            {
                inner.entries.remove(hint);
                inner.taking.insert(hint.clone());
                drop(inner);
                self.claimed
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                self.wake.notify_one();
                return Some(hint.clone());
            }
        }
        let other = {
            let mut inner = self.inner();
            let name = inner
                .entries
                .iter()
                .find(|(_, e)| fits(e) && e.stage == Stage::Ready)
                .map(|(n, _)| n.clone())?;
            inner.entries.remove(&name);
            inner.taking.insert(name.clone());
            name
        };
        self.claimed
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.wake.notify_one();
        // Its room is still charged as a warm runner's; the lease has its own.
        if let Err(e) = self.rooms.release(&other).await {
            debug!(warm = %other, error = %e, "cannot hand back a taken warm runner's room; the next confirmation drops it");
        }
        Some(other)
    }

    /// The launch that claimed `warm` is done with it: renamed for its
    /// lease, or failed and left to the launch's own cleanup.
    pub fn taken(&self, warm: &InstanceName) {
        self.inner().taking.remove(warm);
    }

    /// Retires every warm runner the provider lists (those of an earlier
    /// process of this node), then keeps the pool until `shutdown`, and
    /// retires what it holds before it returns.
    pub async fn run(self: Arc<Self>, shutdown: CancellationToken) {
        self.retire_strays(&[]).await;
        let mut last_confirm: Option<Instant> = None;
        loop {
            // Biased: a wake and a tick due together make one turn, not one
            // or two as tokio's random branch order would choose.
            tokio::select! {
                biased;
                () = shutdown.cancelled() => break,
                () = self.wake.notified() => {}
                () = tokio::time::sleep(TICK) => {}
            }
            if last_confirm.is_none_or(|t| t.elapsed() >= CONFIRM_EVERY) {
                self.confirm().await;
                last_confirm = Some(Instant::now());
            }
            self.retry_retiring().await;
            self.retire_unwanted().await;
            self.refill(&shutdown).await;
        }
        self.close();
        self.retire_unwanted().await;
        self.retry_retiring().await;
    }

    /// Tells the ledger which warm runners this node holds, marks those
    /// whose room it no longer charges as taken, and retires any the
    /// engine no longer runs and any it runs that the pool does not know.
    async fn confirm(&self) {
        let held = self.held();
        match self.rooms.confirm(&held).await {
            Ok(charged) => {
                let mut inner = self.inner();
                for (name, entry) in &mut inner.entries {
                    if entry.stage == Stage::Ready && !charged.contains(name) {
                        entry.stage = Stage::Taken(Instant::now());
                    }
                }
            }
            Err(e) => {
                debug!(error = %e, "cannot confirm the warm runners with the plane; trying again")
            }
        }
        let taking: Vec<InstanceName> = self.inner().taking.iter().cloned().collect();
        let known = [self.held(), taking].concat();
        self.retire_strays(&known).await;
        self.retire_stale_images().await;
    }

    /// Retires the ready warm runners whose image changed since they
    /// started (rebuilt or retagged under the tier's name: a different
    /// id), or that the node now refuses for their runner's version.
    async fn retire_stale_images(&self) {
        let images: BTreeMap<String, TierSpec> = self
            .inner()
            .entries
            .values()
            .filter(|e| e.stage == Stage::Ready)
            .map(|e| (e.spec.image.clone(), e.spec.clone()))
            .collect();
        let mut current: BTreeMap<String, (String, bool)> = BTreeMap::new();
        for (image, spec) in images {
            match self.provider.check_image(&image).await {
                Ok(facts) => {
                    let refused = self
                        .freshness
                        .judge(&image, &facts, spec.min_runner_version.as_ref())
                        .is_err();
                    current.insert(image, (facts.id, refused));
                }
                Err(e) => {
                    debug!(%image, error = %e, "cannot check a warm runner's image; looking again later");
                }
            }
        }
        let doomed: Vec<InstanceName> = {
            let inner = self.inner();
            inner
                .entries
                .iter()
                .filter(|(_, e)| e.stage == Stage::Ready)
                .filter(|(_, e)| {
                    current
                        .get(&e.spec.image)
                        .is_some_and(|(id, refused)| *id != e.image_id || *refused)
                })
                .map(|(n, _)| n.clone())
                .collect()
        };
        for name in doomed {
            info!(warm = %name, why = "its image changed", "retiring a warm runner");
            self.retire(&name, true).await;
        }
    }

    /// Destroys every warm runner the provider lists that is not in
    /// `known`, and drops from the pool every known one it does not list
    /// running.
    async fn retire_strays(&self, known: &[InstanceName]) {
        let listed = match self.provider.list_warm().await {
            Ok(listed) => listed,
            Err(e) => {
                debug!(error = %e, "cannot list the warm runners; looking again later");
                return;
            }
        };
        for instance in &listed {
            let Some(name) = InstanceName::warm(&instance.name) else {
                continue;
            };
            if !known.contains(&name) {
                info!(warm = %name, "retiring a warm runner this process did not start");
                self.retire(&name, true).await;
            }
        }
        let dead: Vec<InstanceName> = {
            let inner = self.inner();
            inner
                .entries
                .iter()
                .filter(|(_, e)| e.stage != Stage::Starting)
                .filter(|(n, _)| {
                    !listed
                        .iter()
                        .any(|i| i.name == n.as_str() && i.state == InstanceState::Running)
                })
                .map(|(n, _)| n.clone())
                .collect()
        };
        for name in dead {
            warn!(warm = %name, "a warm runner stopped while it waited; replacing it");
            self.retire(&name, true).await;
        }
    }

    /// Retires the warm runners no target wants any longer: beyond their
    /// tier's count, of a changed tier, idle or old past their target's
    /// bounds, or taken and never launched.
    async fn retire_unwanted(&self) {
        let doomed: Vec<(InstanceName, &'static str, bool)> = {
            let inner = self.inner();
            let mut doomed = Vec::new();
            let mut kept: BTreeMap<&str, u32> = BTreeMap::new();
            for (name, entry) in &inner.entries {
                let target = inner.targets.get(&entry.tier).filter(|_| !inner.closed);
                let why = match (entry.stage, target) {
                    (Stage::Starting, _) => None,
                    (Stage::Taken(since), _) => {
                        (since.elapsed() >= TAKEN_GRACE).then_some("its launch never came")
                    }
                    (Stage::Ready, None) => Some("no longer wanted"),
                    (Stage::Ready, Some(t)) => {
                        let age = entry.born.elapsed();
                        if t.tier != entry.spec || (t.vcpu, t.memory) != entry.size {
                            Some("its tier changed")
                        } else if t.max_age.is_some_and(|max| age >= max) {
                            Some("it reached its maximum age")
                        } else if t.idle_retire.is_some_and(|idle| age >= idle) {
                            Some("it waited past its idle bound")
                        } else {
                            let n = kept.entry(entry.tier.as_str()).or_default();
                            *n += 1;
                            (*n > t.count).then_some("more are warm than wanted")
                        }
                    }
                };
                if let Some(why) = why {
                    let release = !matches!(entry.stage, Stage::Taken(_));
                    doomed.push((name.clone(), why, release));
                }
            }
            doomed
        };
        for (name, why, release) in doomed {
            info!(warm = %name, why, "retiring a warm runner");
            self.retire(&name, release).await;
        }
    }

    /// Starts warm runners until each tier has its count, one at a time,
    /// each only once the ledger has charged its room.
    async fn refill(&self, shutdown: &CancellationToken) {
        loop {
            if shutdown.is_cancelled() {
                return;
            }
            let next = {
                let inner = self.inner();
                if inner.closed {
                    return;
                }
                inner
                    .targets
                    .values()
                    .filter(|t| {
                        inner
                            .paused
                            .get(&t.tier.label)
                            .is_none_or(|until| Instant::now() >= *until)
                    })
                    .find(|t| {
                        let have = inner
                            .entries
                            .values()
                            .filter(|e| {
                                e.tier == t.tier.label && !matches!(e.stage, Stage::Taken(_))
                            })
                            .count();
                        have < t.count as usize
                    })
                    .cloned()
            };
            let Some(target) = next else { return };
            match self.start_one(&target).await {
                Started::Yes => {}
                // No room, or no plane to ask: the next turn asks again.
                Started::NotNow => return,
                Started::Failed => {
                    self.inner()
                        .paused
                        .insert(target.tier.label.clone(), Instant::now() + FAILED_PAUSE);
                }
            }
        }
    }

    /// Reserves and starts one warm runner of `target`.
    async fn start_one(&self, target: &WarmTarget) -> Started {
        let tier = &target.tier;
        let shaped = match self.provider.shape(target.vcpu, target.memory).await {
            Ok(shaped) => shaped,
            Err(e) => {
                warn!(tier = %tier.label, error = %e, "cannot ask the provider a warm runner's size; not refilling for now");
                return Started::Failed;
            }
        };
        let facts = match self.provider.check_image(&tier.image).await {
            Ok(facts) => facts,
            Err(e) => {
                warn!(tier = %tier.label, error = %e, "cannot check a warm runner's image; the tier's jobs start cold meanwhile");
                return Started::Failed;
            }
        };
        if let Err(outdated) =
            self.freshness
                .judge(&tier.image, &facts, tier.min_runner_version.as_ref())
        {
            warn!(tier = %tier.label, reason = %outdated.explain(), "starting no warm runner of an image GitHub will not run");
            return Started::Failed;
        }
        let name = (self.names.0)();
        let (ready, _) = watch::channel(false);
        self.inner().entries.insert(
            name.clone(),
            Entry {
                tier: tier.label.clone(),
                spec: tier.clone(),
                size: (target.vcpu, target.memory),
                image_id: facts.id,
                stage: Stage::Starting,
                born: Instant::now(),
                ready,
            },
        );
        if let Err(e) = self
            .rooms
            .reserve(&name, &tier.label, shaped.0, shaped.1)
            .await
        {
            self.inner().entries.remove(&name);
            match e {
                PlaneError::Refused(_) => {
                    debug!(tier = %tier.label, "no room for another warm runner")
                }
                e => debug!(tier = %tier.label, error = %e, "cannot reserve a warm runner's room"),
            }
            return Started::NotNow;
        }
        let created = self
            .provider
            .create_warm(WarmSpec {
                name: name.clone(),
                tier: tier.label.clone(),
                image: tier.image.clone(),
                command: tier.command.clone(),
                vcpu: shaped.0,
                memory: shaped.1,
                shm: tier.shm,
                network: tier.network.clone(),
                env: tier.env.clone(),
                host: tier.host.clone(),
                pids_limit: tier.pids_limit,
            })
            .await;
        match created {
            Ok(_) => {
                let mut inner = self.inner();
                if let Some(entry) = inner.entries.get_mut(&name) {
                    entry.stage = Stage::Ready;
                    entry.born = Instant::now();
                    entry.ready.send_replace(true);
                }
                Started::Yes
            }
            Err(e) => {
                warn!(warm = %name, tier = %tier.label, error = %e, "cannot start a warm runner; the tier's jobs start cold meanwhile");
                self.retire(&name, true).await;
                Started::Failed
            }
        }
    }

    /// Takes `name` out of the pool and removes it; its room is handed
    /// back (when `release`: it is still a warm runner's) only once the
    /// provider confirms it gone. Until then it stays held and charged
    /// ([`Inner::retiring`]).
    async fn retire(&self, name: &InstanceName, release: bool) {
        self.inner().entries.remove(name);
        match self.provider.destroy(name).await {
            Ok(Teardown::Stopped) => self.retired(name, release).await,
            Ok(Teardown::Requested) => {
                self.inner().retiring.insert(name.clone(), release);
            }
            Err(e) => {
                warn!(warm = %name, error = %e, "cannot remove a warm runner; its room stays charged and the next turn removes it");
                self.inner().retiring.insert(name.clone(), release);
            }
        }
    }

    /// Every warm runner this pool holds: in the pool, or retired and not
    /// yet confirmed gone.
    fn held(&self) -> Vec<InstanceName> {
        let inner = self.inner();
        inner
            .entries
            .keys()
            .chain(inner.retiring.keys())
            .cloned()
            .collect()
    }

    /// `name` is gone: it is no longer held, and its room goes back.
    async fn retired(&self, name: &InstanceName, release: bool) {
        self.inner().retiring.remove(name);
        if release {
            self.release(name).await;
        }
    }

    /// Removes again the warm runners whose removal was not confirmed; one
    /// the provider no longer lists is gone.
    async fn retry_retiring(&self) {
        let retiring: Vec<(InstanceName, bool)> = self
            .inner()
            .retiring
            .iter()
            .map(|(n, r)| (n.clone(), *r))
            .collect();
        if retiring.is_empty() {
            return;
        }
        let Ok(listed) = self.provider.list_warm().await else {
            return;
        };
        for (name, release) in retiring {
            if !listed.iter().any(|i| i.name == name.as_str()) {
                self.retired(&name, release).await;
                continue;
            }
            match self.provider.destroy(&name).await {
                Ok(Teardown::Stopped) => self.retired(&name, release).await,
                Ok(Teardown::Requested) => {}
                Err(e) => {
                    debug!(warm = %name, error = %e, "cannot remove a warm runner yet; trying again");
                }
            }
        }
    }

    async fn release(&self, name: &InstanceName) {
        if let Err(e) = self.rooms.release(name).await {
            debug!(warm = %name, error = %e, "cannot hand back a warm runner's room; the next confirmation drops it");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Trust;
    use crate::provider::fake::FakeProvider;

    /// Rooms that charge whatever is asked and confirm what the pool says
    /// it holds.
    #[derive(Debug, Default)]
    struct Unbounded;

    #[async_trait]
    impl WarmRooms for Unbounded {
        async fn reserve(
            &self,
            _: &InstanceName,
            _: &str,
            _: u32,
            _: ByteSize,
        ) -> Result<(), PlaneError> {
            Ok(())
        }

        async fn release(&self, _: &InstanceName) -> Result<(), PlaneError> {
            Ok(())
        }

        async fn confirm(&self, names: &[InstanceName]) -> Result<Vec<InstanceName>, PlaneError> {
            Ok(names.to_vec())
        }
    }

    fn tier() -> TierSpec {
        TierSpec {
            label: "warm-test".into(),
            image: "runner:test".into(),
            command: vec!["/run.sh".into()],
            trust: Trust::Trusted,
            shm: ByteSize(0),
            network: None,
            env: Vec::new(),
            sticky_disks: Vec::new(),
            actions_cache: None,
            docker_image_store: false,
            min_runner_version: None,
            host: Default::default(),
            pids_limit: None,
        }
    }

    /// A warm runner a launch claimed keeps its warm name until the
    /// provider renames it; the pool's confirmation turn meanwhile must
    /// not take it for a stray and remove it under the launch. Once the
    /// launch is done with it, one still under its warm name is a stray.
    #[tokio::test]
    async fn a_claimed_runner_is_no_stray_while_its_launch_takes_it() {
        let provider = Arc::new(FakeProvider::new());
        let pool = WarmPool::new(
            provider.clone(),
            Arc::new(Unbounded),
            Arc::new(Freshness::default()),
        );
        let size = (2, ByteSize(1 << 30));
        pool.set_targets(vec![WarmTarget {
            tier: tier(),
            count: 1,
            vcpu: size.0,
            memory: size.1,
            idle_retire: None,
            max_age: None,
        }]);
        pool.refill(&CancellationToken::new()).await;
        let warm = pool
            .claim(None, &tier(), size)
            .await
            .expect("the pool has a ready runner");

        pool.confirm().await;
        assert!(
            provider.instance(warm.as_str()).is_some(),
            "the confirmation turn removed {warm} while its launch was taking it"
        );

        pool.taken(&warm);
        pool.confirm().await;
        assert!(
            provider.instance(warm.as_str()).is_none(),
            "{warm}, left under its warm name once its launch was done, was not retired"
        );
    }
}
