//! The runner: owns this host's lease state and turns commands into compute.
//!
//! Behaviour follows the reference's `node.Runner` (seed/node-package.md,
//! spec/node.md §2). The launch order is fixed: Bind and Advance(launching)
//! are durable in the ledger before the provider is asked to create anything,
//! so a sweep can never mistake a starting instance for an orphan. A failed
//! launch removes the exact runner registration before touching compute, and
//! holds the lease in custody while anything it may have started is not
//! proven gone. Nothing is retried blindly: no second mint, no second create.
//!
//! State lives in one mutex held only for short, non-async sections. The
//! single command slot serialises launches and destroys; custody's passes
//! (`custody.rs`: [`Runner::keep_alive`], [`Runner::tend`], recovery, sweep)
//! may run beside them and touch only what they own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use thiserror::Error;
use tracing::{info, warn};

use super::custody::CustodyEntry;
use super::ending::{Ending, FailureReason, Removals};
use super::plane::{JitSource, LeaseStore, PlaneError};
use super::tiers::Definition;
use crate::cache::Store;
use crate::journal::{Journal, LaunchRecord, MemoryJournal};
use crate::model::Registration;
use crate::model::{
    ByteSize, Epoch, InstanceName, Job, Lease, LeaseId, Phase, RequestId, TierSpec, Trust,
};
use crate::provider::{Bind, Instance, InstanceSpec, Provider, ProviderError, Teardown};

/// Without evidence the instance ever existed, how long it must stay absent
/// before absence counts as proof (spec/node.md §2.0, `strayGrace`).
pub const STRAY_GRACE: Duration = Duration::from_secs(300);

/// How long a runner may take from its instance's creation to coming online
/// before it is torn down with reason `start_deadline`, by default
/// ([`RunnerOptions::start_deadline`]). A runner pulls nothing and connects
/// within seconds; five minutes covers a slow host without holding a slot
/// for long for a runner that will never connect.
pub(crate) const START_DEADLINE: Duration = Duration::from_secs(300);

/// How often a long-lived lease is warned about: once per whole hour of its
/// life ([`RunnerOptions::max_lease_life`]).
pub(crate) const LEASE_LIFE_WARN_EVERY: Duration = Duration::from_secs(3600);
/// How long an ephemeral runner still working when its job's completion
/// arrives is left to exit on its own before the node stops it
/// (2 minutes by default; `--post-job-grace-secs`).
pub const POST_JOB_GRACE: Duration = Duration::from_secs(120);

/// How long a stopped runner gets between SIGTERM and SIGKILL.
pub(crate) const STOP_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a Destroy carrying a completion waits for a runner still
/// running to exit, before it leaves it the post-job grace in custody.
pub(crate) const COMPLETION_SETTLE: Duration = Duration::from_secs(2);

/// How often that wait reads the instance.
pub(crate) const COMPLETION_POLL: Duration = Duration::from_millis(200);

/// Why a runner operation did not succeed.
#[derive(Debug, Error)]
pub enum RunnerError {
    /// Nothing was started, or everything started is proven gone: the caller
    /// may release the lease.
    #[error("{0}")]
    Failed(String),
    /// This node holds the lease: something may be running that is not yet
    /// proven gone. The caller must not release it.
    #[error("held in custody: {0}")]
    Custody(String),
    /// The node refuses this command outright (draining, no updater).
    #[error("{0}")]
    Refused(String),
    /// A launch whose image is not present where this node runs instances
    /// (providers never pull), found before anything was minted; a lease
    /// bound meanwhile was released `failed`.
    #[error(
        "image {image} is not present on this node, so nothing was minted or started; build or load it here"
    )]
    ImageUnavailable {
        /// The image reference the tier names.
        image: String,
    },
    /// A launch whose image carries a runner GitHub will not run (its label
    /// names a version older than the tier's minimum, or a runner of the
    /// same image already exited saying its version was refused), found
    /// before anything was minted; a lease bound meanwhile was released
    /// `failed` (wire: `OUTCOME_REFUSED`, `ERROR_CODE_RUNNER_OUTDATED`).
    #[error("{0}")]
    RunnerOutdated(String),
    /// A launch the provider could not be asked about (its engine did not
    /// answer), found before anything was minted (a lease bound meanwhile
    /// was released `failed`): retry later.
    #[error("{0}")]
    ProviderUnavailable(String),
    /// A launch whose record this node's journal could not write (its disk
    /// filled, or it cannot be written, before the health probe said so):
    /// nothing was started, anything created was removed, and the lease may
    /// be released (wire: `OUTCOME_REFUSED`, `ERROR_CODE_UNAVAILABLE`, as a
    /// node degraded by an unwritable journal refuses).
    #[error("{0}")]
    JournalUnwritable(String),
    /// A launch whose mint the plane answered `SCALE_SET_NOT_FOUND`: no
    /// registration was made and nothing was created; the lease may be
    /// released (wire code `ERROR_CODE_SCALE_SET_NOT_FOUND`).
    #[error("{0}")]
    ScaleSetNotFound(String),
    /// A launch whose mint the plane answered `RUNNER_NAME_TAKEN` (GitHub
    /// has a runner of that name in another scale set): no registration
    /// was made and nothing was created; the lease may be released (wire
    /// code `ERROR_CODE_RUNNER_NAME_TAKEN`).
    #[error("{0}")]
    RunnerNameTaken(String),
    /// A launch of a tier that failed to start here too many times in a
    /// row, refused before anything was bound, minted or started (wire:
    /// `OUTCOME_REFUSED`, `ERROR_CODE_TIER_UNHEALTHY`, with the wait).
    #[error("{0}")]
    TierUnhealthy(super::tiers::Unhealthy),
    /// The runner is working, so nothing was destroyed and its instance runs
    /// on: GitHub refused to remove its registration (JobStillRunning) under
    /// a scale-down, or it is still working after its job's completion; or a
    /// launch named a lease whose runner this node holds at another epoch,
    /// and nothing was started.
    #[error("busy: {message}")]
    Busy {
        /// What GitHub and the provider said.
        message: String,
        /// This node holds the lease and ends the compute itself (once the
        /// runner exits, or the post-job grace passes); otherwise the plane
        /// keeps the lease and may ask again later.
        held: bool,
    },
}

impl RunnerError {
    /// Whether the node holds the lease.
    pub fn is_custody(&self) -> bool {
        matches!(
            self,
            RunnerError::Custody(_) | RunnerError::Busy { held: true, .. }
        )
    }

    /// Whether the runner was found busy and left running.
    pub fn is_busy(&self) -> bool {
        matches!(self, RunnerError::Busy { .. })
    }
}

/// Compute started for a request and managed normally.
#[derive(Debug, Clone)]
pub(super) struct Running {
    pub(super) lease: LeaseId,
    pub(super) epoch: Epoch,
    pub(super) instance: InstanceName,
    /// The runner registration: (GitHub runner id, name).
    pub(super) registration: (i64, String),
    /// When its instance was created (for status and metrics, the start
    /// deadline and the lease-life bound).
    pub(super) since: Instant,
    /// GitHub has said the runner is busy (it refused to remove the
    /// registration of a runner holding a job): the runner came online,
    /// and the start deadline no longer applies.
    pub(super) online: bool,
    /// A removal at the start deadline failed without an answer: it may
    /// have removed the registration, so a later "already gone" proves
    /// nothing.
    pub(super) retire_tried: bool,
    /// Whole hours of the lease's life already warned about.
    pub(super) warned_hours: u64,
    /// The image it runs and that image's id, as its launch checked them;
    /// `None` for a runner adopted after a restart.
    pub(super) image: Option<(String, String)>,
}

#[derive(Debug, Default)]
pub(super) struct State {
    pub(super) running: HashMap<RequestId, Running>,
    pub(super) launching: HashMap<LeaseId, Epoch>,
    pub(super) custody: HashMap<LeaseId, CustodyEntry>,
    /// Registrations still to be removed after their compute ended.
    pub(super) removals: Removals,
    pub(super) draining: bool,
    /// What each lease this process launched charges: (vCPUs, memory
    /// bytes), for [`Runner::held_charge`].
    pub(super) sizes: HashMap<LeaseId, (u32, u64)>,
    /// The epoch each lease held when this process mounted its sticky
    /// disks, for the cache observation recorded when they are settled.
    /// In memory: a restarted node records none.
    pub(super) disk_epochs: HashMap<LeaseId, Epoch>,
    /// The warm runner each launch in progress was told to take.
    pub(super) warm_hints: HashMap<LeaseId, InstanceName>,
    /// The image and image id each launch in progress checked.
    pub(super) images: HashMap<LeaseId, (String, String)>,
    /// Each tier's consecutive start failures here.
    pub(super) tiers: super::tiers::TierHealth,
}

/// Where a held lease stands on this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeldState {
    /// Bound and being launched.
    Launching,
    /// Launched for its request and managed normally.
    Running,
    /// Held in custody, renewed until its compute is proven gone.
    Custody,
    /// In custody while the ledger quarantines it (no phase reported).
    Quarantine,
    /// In custody, to be destroyed on sight.
    Discard,
    /// In custody after its job's completion, its runner left to exit on
    /// its own within the post-job grace.
    Ending,
}

impl HeldState {
    /// Its name in status and metrics.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            HeldState::Launching => "launching",
            HeldState::Running => "running",
            HeldState::Custody => "custody",
            HeldState::Quarantine => "quarantine",
            HeldState::Discard => "discard",
            HeldState::Ending => "ending",
        }
    }

    /// Whether the node holds the lease on its own authority.
    pub(crate) fn in_custody(self) -> bool {
        matches!(
            self,
            HeldState::Custody | HeldState::Quarantine | HeldState::Discard | HeldState::Ending
        )
    }
}

/// One lease this node holds ([`Runner::held`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HeldLease {
    /// The lease.
    pub lease: LeaseId,
    /// The epoch the node holds it at.
    pub epoch: Epoch,
    /// Where it stands.
    pub state: HeldState,
    /// Its instance (`billet-<lease id>`).
    pub instance: InstanceName,
    /// The runner registration's name, when known.
    pub runner: Option<String>,
    /// Since its instance was created (running) or custody began; `None`
    /// while launching.
    pub age: Option<Duration>,
}

/// Options the operator sets.
#[derive(Debug, Clone)]
pub struct RunnerOptions {
    /// Destroy and release custody older than this. `None` (the default)
    /// means time alone never kills a job; it only drives a warning. Zero
    /// means off too, as in the reference (`DefaultMaxCustody`, 0 = off):
    /// a zero bound would otherwise kill every held job at the next tend.
    pub max_custody: Option<Duration>,
    /// How long an instance never seen must stay absent before its absence
    /// counts as proof it is gone ([`STRAY_GRACE`] by default).
    pub stray_grace: Duration,
    /// A runner not online this long after its instance was created is torn
    /// down with reason `start_deadline`, its registration removed first
    /// and its lease released `failed` ([`START_DEADLINE`] by default).
    /// Online means GitHub says the runner is busy: the node asks by
    /// removing the registration, which GitHub refuses for a runner holding
    /// a job. `None` or zero: off.
    pub start_deadline: Option<Duration>,
    /// An operator's bound on a lease's whole life, running or in custody:
    /// past it the instance is destroyed (on the operator's authority, busy
    /// or not) and the lease released `failed` with reason
    /// `max_lease_life`. `None` (the default) or zero: off, as for
    /// [`RunnerOptions::max_custody`], since time alone is not evidence a
    /// job stalled; each whole hour of a running lease's life is warned
    /// about either way ([`LEASE_LIFE_WARN_EVERY`]). A running lease's life
    /// is counted from its instance's creation, one in custody from when
    /// custody began (the journal keeps no earlier time), so the bound
    /// never passes early.
    pub max_lease_life: Option<Duration>,
    /// How long a runner still working when its job's completion arrives is
    /// left to exit on its own ([`POST_JOB_GRACE`] by default).
    pub post_job_grace: Duration,
    /// How long a runner stopped past its post-job grace gets between
    /// SIGTERM and SIGKILL ([`STOP_TIMEOUT`]).
    pub stop_timeout: Duration,
    /// The operator says this node's instances are isolated from its
    /// kernel by other means than the provider's own (`--isolated-containers`:
    /// a gVisor or Kata runtime as dockerd's default, a VM per node), so an
    /// untrusted tier may run on a provider that shares the host's kernel.
    /// False by default: such a tier is refused.
    pub isolated_containers: bool,
    /// Consecutive start failures after which a tier's launches are
    /// refused here for a backoff ([`super::tiers`]); 0: never.
    pub tier_failures_before_unhealthy: u32,
}

impl Default for RunnerOptions {
    fn default() -> Self {
        Self {
            max_custody: None,
            stray_grace: STRAY_GRACE,
            start_deadline: Some(START_DEADLINE),
            max_lease_life: None,
            post_job_grace: POST_JOB_GRACE,
            stop_timeout: STOP_TIMEOUT,
            isolated_containers: false,
            tier_failures_before_unhealthy: super::tiers::FAILURES_BEFORE_UNHEALTHY,
        }
    }
}

/// Starts and stops the compute for assigned leases on this host.
#[derive(Debug)]
pub struct Runner {
    pub(super) provider: Arc<dyn Provider>,
    pub(super) ledger: Arc<dyn LeaseStore>,
    pub(super) jit: Arc<dyn JitSource>,
    pub(super) options: RunnerOptions,
    pub(super) journal: Arc<dyn Journal>,
    /// Rate limit of the line a failed custody journal write logs (it may
    /// fail on every tend while the disk is full).
    pub(super) journal_log: crate::node::health::LogLimit,
    pub(super) state: Mutex<State>,
    /// The sticky-disk store; `None`: tiers' sticky disks are not mounted.
    pub(super) cache: Option<Arc<Store>>,
    /// The guests' cache sessions (`cache/session.rs`); `None` without a
    /// cache.
    pub(super) sessions: Option<Arc<crate::cache::session::Sessions>>,
    /// The Actions cache proxy (`cache/actions/`); `None`: no guest gets
    /// one.
    pub(super) actions: Option<Arc<crate::cache::actions::proxy::ActionsProxy>>,
    /// Runners started ahead of their jobs; `None`: every launch creates.
    pub(super) warm: Option<Arc<super::warm::WarmPool>>,
    /// The images this node refuses for their runner's version.
    pub(super) freshness: Arc<super::freshness::Freshness>,
}

/// Why a launch beside its bind did not start its instance.
enum Unready {
    /// Nothing of this launch holds the lease: the check or the bind
    /// refused it (a lease the bind took is released already).
    Refused(RunnerError),
    /// The lease is bound here and the launch cannot go on: the plane
    /// would not resize it.
    Bound(String),
    /// The lease is bound here and the launch's record could not be
    /// journaled.
    Unjournaled(String),
}

/// The instance a launch of `lease` on `tier` creates, named `name`, at
/// the size the provider runs it, with the registration's config and the
/// tier's plain environment; no binds, no cache session (a launch with
/// disks sets those).
fn instance_spec(
    lease: &Lease,
    tier: &TierSpec,
    name: &InstanceName,
    (vcpu, memory): (u32, ByteSize),
    jit_config: crate::model::JitConfig,
) -> InstanceSpec {
    InstanceSpec {
        name: name.clone(),
        lease: lease.id.clone(),
        epoch: lease.epoch,
        request_id: lease.request_id,
        image: tier.image.clone(),
        command: tier.command.clone(),
        vcpu,
        memory,
        shm: tier.shm,
        network: tier.network.clone(),
        env: tier.env.clone(),
        host: tier.host.clone(),
        pids_limit: tier.pids_limit,
        jit_config,
        binds: Vec::new(),
        cache_token: None,
        actions_proxy: None,
    }
}

/// Whether a launch of `tier` mounts nothing and opens no cache session
/// (no sticky disk, no Docker image store, no Actions cache): only such a
/// launch is created beside its bind, since a mount is taken under the
/// bound lease.
fn asks_nothing_of_the_cache(tier: &TierSpec) -> bool {
    tier.sticky_disks.is_empty() && !tier.docker_image_store && tier.actions_cache.is_none()
}

pub(super) fn now_plus(grace: Duration, since: Instant) -> bool {
    since.elapsed() >= grace
}

impl Runner {
    /// A runner over a provider, the ledger and a JIT source.
    pub fn new(
        provider: Arc<dyn Provider>,
        ledger: Arc<dyn LeaseStore>,
        jit: Arc<dyn JitSource>,
        options: RunnerOptions,
    ) -> Self {
        Self {
            provider,
            ledger,
            jit,
            options,
            journal: Arc::new(MemoryJournal::default()),
            journal_log: crate::node::health::LogLimit::default(),
            state: Mutex::new(State::default()),
            cache: None,
            sessions: None,
            actions: None,
            warm: None,
            freshness: Arc::default(),
        }
    }

    /// Shares `freshness` (the warm pool's) as the images this node
    /// refuses.
    #[must_use]
    pub fn with_freshness(mut self, freshness: Arc<super::freshness::Freshness>) -> Self {
        self.freshness = freshness;
        self
    }

    /// The images this node refuses for their runner's version.
    pub fn freshness(&self) -> &Arc<super::freshness::Freshness> {
        &self.freshness
    }

    /// Launches of a tier that asks nothing of the cache take a runner
    /// from `pool` when it has one.
    #[must_use]
    pub fn with_warm(mut self, pool: Arc<super::warm::WarmPool>) -> Self {
        self.warm = Some(pool);
        self
    }

    /// The warm pool, when this node keeps one.
    pub fn warm(&self) -> Option<&Arc<super::warm::WarmPool>> {
        self.warm.as_ref()
    }

    /// Creates `spec`'s instance for a launch of `lease` on `tier`, or,
    /// for a tier that asks nothing of the cache, hands it to a warm runner
    /// the pool gives (the one the plane named first): as
    /// [`Provider::create_then_start`] either way. A warm runner is taken
    /// only once `start` opens: it is already running, so taking it beside
    /// a bind that is then refused would leave a running runner the launch
    /// never started; and there is nothing to create beside the bind.
    async fn create_for(
        &self,
        lease: &Lease,
        tier: &TierSpec,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: crate::provider::StartGate,
    ) -> Result<Instance, ProviderError> {
        let hint = self.state().warm_hints.remove(&lease.id);
        let pool = match &self.warm {
            Some(pool)
                if asks_nothing_of_the_cache(tier)
                    && pool.has(hint.as_ref(), tier, (lease.vcpu, lease.memory)) =>
            {
                pool
            }
            _ => return self.provider.create_then_start(spec, created, start).await,
        };
        crate::provider::await_start(start, &format!("launch {}", spec.name)).await?;
        match pool
            .claim(hint.as_ref(), tier, (lease.vcpu, lease.memory))
            .await
        {
            Some(warm) => {
                info!(lease = %lease.id, %warm, "launching onto a warm runner");
                let claimed = self
                    .provider
                    .claim_warm(&warm, spec, created, crate::provider::start_now())
                    .await;
                pool.taken(&warm);
                claimed
            }
            None => {
                self.provider
                    .create_then_start(spec, created, crate::provider::start_now())
                    .await
            }
        }
    }

    /// Hands the guests of trusted tiers that opt in (`actions_cache`) a
    /// session on `proxy`.
    #[must_use]
    pub(crate) fn with_actions(
        mut self,
        proxy: Arc<crate::cache::actions::proxy::ActionsProxy>,
    ) -> Self {
        self.actions = Some(proxy);
        self
    }

    /// Mounts tiers' sticky disks from `cache` and settles them when their
    /// compute is gone.
    #[must_use]
    pub fn with_cache(
        mut self,
        cache: Arc<Store>,
        sessions: Arc<crate::cache::session::Sessions>,
    ) -> Self {
        self.cache = Some(cache);
        self.sessions = Some(sessions);
        self
    }

    /// The sticky disks' store, when this node has a cache.
    pub(crate) fn cache(&self) -> Option<&Arc<Store>> {
        self.cache.as_ref()
    }

    /// Mounts each sticky disk of `tier` for `lease`, before its compute
    /// starts. A disk that cannot be mounted at all is left out (a
    /// warning): the job goes on without it.
    ///
    /// With at least one disk mounted, also prepares the lease's cache
    /// session (`cache/session.rs`): its directory is bound at
    /// [`crate::cache::session::GUEST_DIR`], its endpoint is added to the
    /// environment and its token returned for the provider to hand over.
    /// A session that cannot be prepared is a warning: the disks are still
    /// settled at the job's end.
    async fn mount_disks(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        tier: &TierSpec,
        env: &mut Vec<(String, String)>,
    ) -> (
        Vec<Bind>,
        Option<crate::cache::session::CacheToken>,
        Option<crate::cache::actions::proxy::ProxyUrl>,
    ) {
        let Some(cache) = &self.cache else {
            if !tier.sticky_disks.is_empty() || tier.docker_image_store {
                warn!(%lease, disks = tier.sticky_disks.len(), docker_image_store = tier.docker_image_store,
                      "this node has no cache; the job runs without its sticky disks and image store");
            }
            return (Vec::new(), None, None);
        };
        // Only a trusted tier is intercepted (spec/cache.md §5.1): an
        // untrusted one's opt-in gets no proxy, so its traffic is GitHub's.
        let intercept = match (&tier.actions_cache, &self.actions) {
            (Some(scope), Some(proxy)) if tier.trust == crate::model::Trust::Trusted => {
                Some((scope.clone(), proxy.clone()))
            }
            (Some(_), None) => {
                warn!(%lease, "this node serves no Actions cache proxy; the job's cache goes to GitHub");
                None
            }
            _ => None,
        };
        // The Docker image store first: slot 0 (spec/cache.md §1.2), under
        // last-writer-wins, published only by its settlement.
        let architecture = crate::cache::docker_architecture();
        let store = tier
            .docker_image_store
            .then(|| crate::cache::DiskKey::docker_images(architecture))
            .flatten()
            .map(|key| crate::cache::StickyDisk {
                key,
                path: crate::cache::DOCKER_STORE_PATH.to_owned(),
                policy: crate::cache::Policy::LastWriterWins,
            });
        if tier.docker_image_store && store.is_none() {
            warn!(%lease, architecture, "this node's architecture names no Docker image store; the job runs without it");
        }
        let disks: Vec<&crate::cache::StickyDisk> =
            store.iter().chain(&tier.sticky_disks).collect();
        if !disks.is_empty() {
            self.state().disk_epochs.insert(lease.clone(), epoch);
        }
        let mut binds = Vec::new();
        let mut slots = Vec::new();
        let untrusted = tier.trust == Trust::Untrusted;
        for disk in disks {
            match cache.mount(lease, &disk.key, disk.policy).await {
                Ok(mount) => {
                    // An untrusted job reads the key's head and never
                    // publishes: its mount is withdrawn (journaled) before
                    // its compute exists, so no end of it, a restart's
                    // included, commits what it wrote. One that cannot be
                    // withdrawn is not handed over at all.
                    if untrusted && let Err(e) = cache.withdraw(&mount.id).await {
                        warn!(%lease, key = %disk.key, error = %e, "cannot withdraw an untrusted job's sticky disk from publication; the job runs without it");
                        if let Err(e) = cache.discard(&mount.id).await {
                            warn!(%lease, key = %disk.key, error = %e, "cannot discard the sticky disk; it is discarded when the lease ends");
                        }
                        continue;
                    }
                    let mut slot = crate::cache::session::Slot::of(
                        &mount,
                        disk.key.as_str(),
                        &disk.path,
                        disk.policy.as_str(),
                    );
                    slot.untrusted = untrusted;
                    if disk.key.is_docker_images() {
                        slot.docker = Some(crate::cache::session::DockerStore {
                            architecture: architecture.to_owned(),
                            settling: false,
                            ready: None,
                        });
                    }
                    slots.push(slot);
                    binds.push(Bind {
                        host: mount.dir,
                        guest: disk.path.clone(),
                    });
                }
                Err(e) => {
                    warn!(%lease, key = %disk.key, error = %e, "the sticky disk cannot be mounted; the job runs without it");
                }
            }
        }
        let mut token = None;
        let mut proxy_url = None;
        if let Some(sessions) = &self.sessions
            && (!slots.is_empty() || intercept.is_some())
        {
            match sessions.prepare(lease, slots).await {
                Ok(prepared) => {
                    binds.push(Bind {
                        host: prepared.dir.clone(),
                        guest: crate::cache::session::GUEST_DIR.to_owned(),
                    });
                    env.push((
                        crate::cache::session::ENDPOINT_ENV.to_owned(),
                        crate::cache::session::guest_endpoint(),
                    ));
                    if let Some((scope, proxy)) = intercept {
                        let ca_file = prepared.dir.join(crate::cache::actions::CA_FILE);
                        let opened = match std::fs::write(&ca_file, proxy.ca_pem()) {
                            Ok(()) => proxy
                                .archives()
                                .open_session(lease.as_str(), &prepared.token, scope)
                                .await
                                .map_err(|e| e.to_string()),
                            Err(e) => Err(format!("{}: {e}", ca_file.display())),
                        };
                        match opened {
                            Ok(()) => {
                                env.push((
                                    crate::cache::actions::CA_FILE_ENV.to_owned(),
                                    format!(
                                        "{}/{}",
                                        crate::cache::session::GUEST_DIR,
                                        crate::cache::actions::CA_FILE
                                    ),
                                ));
                                proxy_url = Some(proxy.guest_url(&prepared.token));
                            }
                            Err(e) => {
                                warn!(%lease, error = %e, "cannot open the Actions cache session; the job's cache goes to GitHub");
                            }
                        }
                    }
                    token = Some(prepared.token);
                }
                Err(e) => {
                    warn!(%lease, error = %e, "cannot prepare the cache session; the job's disks are settled at its end, and it is told nothing");
                }
            }
        }
        (binds, token, proxy_url)
    }

    /// Settles the sticky disks of `lease`, whose compute is proven gone:
    /// committed when its job succeeded, discarded otherwise. Then, when
    /// this process mounted the lease's disks, records what the cache did
    /// for the job against the lease ([`LeaseStore::record_cache_observation`],
    /// at the epoch it held at the mount), once, in a task of its own: the
    /// teardown never waits for the plane, and a refusal or no answer is
    /// logged and not retried (the call's own timeout bounds it).
    pub(super) async fn settle_disks(&self, lease: &LeaseId) {
        if let Some(sessions) = &self.sessions {
            sessions.close(lease).await;
        }
        if let Some(actions) = &self.actions {
            actions.archives().close(lease.as_str()).await;
        }
        if let Some(cache) = &self.cache {
            cache.settle(lease).await;
            let observed = cache.take_observation(lease);
            if let Some(o) = &observed {
                info!(%lease, hits = o.hits, misses = o.misses, bytes_restored = o.bytes_restored,
                      bytes_committed = o.bytes_committed, conflicts = o.conflicts,
                      fallbacks = o.fallbacks, "what the cache did for the job");
            }
            let epoch = self.state().disk_epochs.remove(lease);
            if let Some(epoch) = epoch {
                let observation = observed.unwrap_or_default();
                let ledger = Arc::clone(&self.ledger);
                let lease = lease.clone();
                tokio::spawn(async move {
                    match ledger
                        .record_cache_observation(&lease, epoch, &observation)
                        .await
                    {
                        Ok(kept) if kept != observation => {
                            info!(%lease, epoch = epoch.0, "the ledger keeps an earlier cache observation for the lease");
                        }
                        Ok(_) => {}
                        Err(e) => {
                            warn!(%lease, epoch = epoch.0, error = %e, "the cache observation was not recorded in the ledger");
                        }
                    }
                });
            }
        }
    }

    /// Keeps the runner's memory in `journal`, so a restarted node knows what
    /// it launched and what it holds.
    #[must_use]
    pub fn with_journal(mut self, journal: Arc<dyn Journal>) -> Self {
        self.journal = journal;
        self
    }

    pub(super) fn state(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().expect("runner state")
    }

    /// The provider kind this runner launches on.
    pub(crate) fn provider_kind(&self) -> &'static str {
        self.provider.kind()
    }

    /// Stops taking launches (destroys, sweeps and tends still run).
    pub fn start_draining(&self) {
        self.state().draining = true;
        if let Some(pool) = &self.warm {
            pool.close();
        }
    }

    /// Whether a drain has started.
    pub(crate) fn is_draining(&self) -> bool {
        self.state().draining
    }

    /// Whether this node is still responsible for compute.
    pub fn holding(&self) -> bool {
        let s = self.state();
        !(s.running.is_empty() && s.launching.is_empty() && s.custody.is_empty())
    }

    /// Every lease this node holds, for status and metrics, ordered by lease
    /// id: one row per lease, whatever its state.
    ///
    /// The state keeps a lease in more than one place for a while (a running
    /// request is also held in custody once the plane did not acknowledge
    /// its launch, or its job's completion left its runner ending; a launch
    /// is running before it stops counting as launching), so the rows are
    /// gathered by lease, and each lease is told by the strongest claim the
    /// node has on it: custody (the node's own authority, which outlives the
    /// request), then running, then launching. The runner's name comes from
    /// whichever place knows it.
    pub fn held(&self) -> Vec<HeldLease> {
        let s = self.state();
        let mut held: std::collections::BTreeMap<String, HeldLease> = s
            .custody
            .iter()
            .map(|(lease, e)| {
                let row = HeldLease {
                    lease: lease.clone(),
                    epoch: e.epoch,
                    state: if e.discard {
                        HeldState::Discard
                    } else if e.ending {
                        HeldState::Ending
                    } else if e.phase.is_none() {
                        HeldState::Quarantine
                    } else {
                        HeldState::Custody
                    },
                    instance: e.instance.clone(),
                    runner: e.registration.as_ref().map(|(_, name)| name.clone()),
                    age: Some(e.since.elapsed()),
                };
                (lease.as_str().to_owned(), row)
            })
            .collect();
        for r in s.running.values() {
            match held.entry(r.lease.as_str().to_owned()) {
                std::collections::btree_map::Entry::Occupied(mut held) => {
                    let row = held.get_mut();
                    row.runner.get_or_insert_with(|| r.registration.1.clone());
                }
                std::collections::btree_map::Entry::Vacant(slot) => {
                    slot.insert(HeldLease {
                        lease: r.lease.clone(),
                        epoch: r.epoch,
                        state: HeldState::Running,
                        instance: r.instance.clone(),
                        runner: Some(r.registration.1.clone()),
                        age: Some(r.since.elapsed()),
                    });
                }
            }
        }
        for (lease, epoch) in &s.launching {
            held.entry(lease.as_str().to_owned())
                .or_insert_with(|| HeldLease {
                    lease: lease.clone(),
                    epoch: *epoch,
                    state: HeldState::Launching,
                    instance: InstanceName::for_lease(lease),
                    runner: None,
                    age: None,
                });
        }
        held.into_values().collect()
    }

    /// What the leases this node holds (launching, running, in custody)
    /// charge, as (vCPUs, memory bytes): what `Hello` and `Instances`
    /// report as `held`. A lease adopted after a restart is counted once
    /// this process has launched it; until then only the plane's ledger
    /// knows its size.
    pub fn held_charge(&self) -> (u32, u64) {
        let mut s = self.state();
        let held: std::collections::HashSet<LeaseId> = s
            .running
            .values()
            .map(|r| r.lease.clone())
            .chain(s.launching.keys().cloned())
            .chain(s.custody.keys().cloned())
            .collect();
        s.sizes.retain(|l, _| held.contains(l));
        s.sizes.values().fold((0, 0), |(v, m), (lv, lm)| {
            (v.saturating_add(*lv), m.saturating_add(*lm))
        })
    }

    /// Lease ids this node holds in custody, for tests and status.
    pub fn custody_leases(&self) -> Vec<LeaseId> {
        self.state().custody.keys().cloned().collect()
    }

    /// Launches compute for a lease: Bind, Advance(launching), mint the JIT
    /// config, create the instance.
    ///
    /// # Errors
    ///
    /// [`RunnerError::Failed`] when nothing was started (the caller releases
    /// the lease); [`RunnerError::Custody`] when something may have started
    /// and this node now holds the lease.
    pub async fn launch(&self, lease: Lease, tier: TierSpec, job: Job) -> Result<(), RunnerError> {
        self.launch_with(lease, tier, job, None).await
    }

    /// [`Runner::launch`], with the runner registration the plane minted
    /// before it dispatched the launch (`Launch.registration`) when it
    /// sent one. With a registration the node asks no mint; for a tier
    /// that asks nothing of the cache (whose mounts need the bind) it also
    /// creates the instance beside the bind and starts it only once the
    /// bind holds (`Runner::launch_beside_bind`), so the create no longer
    /// waits for a plane round trip. A registration whose launch is
    /// answered neither OK nor with custody is the plane's to remove.
    ///
    /// # Errors
    ///
    /// As [`Runner::launch`].
    pub async fn launch_with(
        &self,
        lease: Lease,
        tier: TierSpec,
        job: Job,
        registration: Option<Registration>,
    ) -> Result<(), RunnerError> {
        self.launch_onto(lease, tier, job, registration, None).await
    }

    /// [`Runner::launch_with`], naming the warm runner whose room the
    /// lease took over (`Launch.warm_instance`): the launch hands its
    /// registration to that runner when the pool still has it.
    ///
    /// # Errors
    ///
    /// As [`Runner::launch`].
    pub async fn launch_onto(
        &self,
        lease: Lease,
        tier: TierSpec,
        job: Job,
        registration: Option<Registration>,
        warm: Option<InstanceName>,
    ) -> Result<(), RunnerError> {
        if let Some(warm) = warm {
            self.state().warm_hints.insert(lease.id.clone(), warm);
        }
        let result = self
            .launch_checked(lease.clone(), tier, job, registration)
            .await;
        let mut s = self.state();
        s.warm_hints.remove(&lease.id);
        s.images.remove(&lease.id);
        drop(s);
        result
    }

    async fn launch_checked(
        &self,
        lease: Lease,
        tier: TierSpec,
        job: Job,
        registration: Option<Registration>,
    ) -> Result<(), RunnerError> {
        let kind = self.provider.kind();
        if !lease.providers.is_empty() && !lease.providers.iter().any(|p| p == kind) {
            return Err(RunnerError::Failed(format!(
                "lease {} may run on {:?}, and this node's provider is {kind}",
                lease.id, lease.providers
            )));
        }
        if tier.trust == Trust::Untrusted
            && self.provider.runs_on_host()
            && !self.options.isolated_containers
        {
            return Err(RunnerError::Failed(format!(
                "tier {} is untrusted, and {kind} shares this host's kernel; run untrusted tiers on an isolating provider, or, if this node's containers are isolated by other means (such as gVisor's runsc as dockerd's default runtime), start the node with --isolated-containers",
                tier.label
            )));
        }
        let definition = Definition::new(&tier, lease.vcpu, lease.memory.0);
        {
            let mut s = self.state();
            if s.draining {
                return Err(RunnerError::Refused(
                    "this node is draining and takes no new launches".into(),
                ));
            }
            // The same lease again (a launch redelivered after a restart or a
            // lost reply): whatever it started is here already. Never mint
            // or create twice; report what this node holds, and only if it
            // is what the launch names: at another epoch the plane believes
            // something false about this lease, and an OK would confirm it.
            let working = s
                .running
                .get(&lease.request_id)
                .filter(|r| r.lease == lease.id)
                .map(|r| r.epoch);
            if let Some(held) = working {
                return Self::launched_already(&lease, held);
            }
            if let Some(held) = s.custody.get(&lease.id) {
                return if held.discard {
                    Err(RunnerError::Custody(format!(
                        "lease {} is being torn down on this node; it stays held until its instance is gone",
                        lease.id
                    )))
                } else {
                    Self::launched_already(&lease, held.epoch)
                };
            }
            if let Err(unhealthy) = s.tiers.admit(&definition) {
                return Err(RunnerError::TierUnhealthy(unhealthy));
            }
            // Compute being torn down for the request (a failed launch's
            // instance still being removed) whose registration is gone takes
            // no job and is destroyed on sight: the job's next runner goes
            // on beside it. One whose registration is not yet removed could
            // still take the job, and waits for its removal.
            let failed_launch = |e: &CustodyEntry| {
                e.request_id == lease.request_id
                    && e.discard
                    && e.outcome == Ending::Failed(FailureReason::LaunchFailed)
            };
            let teardown = s
                .custody
                .values()
                .filter(|e| failed_launch(e))
                .find(|e| e.registration.is_some());
            if let Some(e) = teardown {
                return Err(RunnerError::Failed(format!(
                    "request {} has a failed launch's compute ({}) being torn down on this node, whose runner registration is not removed yet; release lease {}, and launch again once it is",
                    lease.request_id, e.instance, lease.id
                )));
            }
            // Another lease for a request that already has compute here: the
            // job is running under the first lease, so this one may go.
            // Any other teardown (a runner that may have taken the job, its
            // registration removed once its compute is gone) still holds the
            // request.
            if s.custody
                .values()
                .any(|e| e.request_id == lease.request_id && !failed_launch(e))
                || s.running.contains_key(&lease.request_id)
            {
                return Err(RunnerError::Failed(format!(
                    "request {} already has compute on this node under another lease; release lease {}",
                    lease.request_id, lease.id
                )));
            }
        }
        let name = InstanceName::for_lease(&lease.id);
        // Remembered before anything is minted or created, so a node killed
        // from here on finds the launch again after a restart.
        let mut record = LaunchRecord {
            lease: lease.id.as_str().to_owned(),
            epoch: lease.epoch.0,
            request_id: lease.request_id.0,
            instance: name.as_str().to_owned(),
            runner_id: registration.as_ref().map_or(0, |r| r.runner_id),
            runner_name: registration
                .as_ref()
                .map(|r| r.runner_name.clone())
                .unwrap_or_default(),
            created: false,
        };
        // The record is synced while the image is checked and the lease
        // bound, since neither needs it: only the mint must wait for it. A
        // record whose lease was never bound is safe to find after a crash
        // (recovery fails the launch or removes a registration by lease,
        // which the plane answers as done when none was minted). A lease
        // whose earlier record still carries a pending registration removal
        // is not overwritten until its bind proves this launch current.
        let pending_removal = self.state().removals.contains(&lease.id);
        if let Some(registration) = &registration
            && !pending_removal
            && asks_nothing_of_the_cache(&tier)
        {
            let result = self
                .launch_beside_bind(
                    &lease,
                    &tier,
                    &name,
                    &job,
                    &mut record,
                    registration.clone(),
                )
                .await;
            return self.launch_over(&lease.id, result).await;
        }
        let (journaled, prepared) = if pending_removal {
            let prepared = self.check_and_bind(&lease, &tier).await;
            let journaled = match &prepared {
                Ok(()) => {
                    if self.state().removals.superseded(&lease.id, lease.epoch) {
                        info!(lease = %lease.id, "the lease was bound again: its record's pending removal was of a launch never bound, and is dropped");
                    }
                    self.journal.put_launch(&record).await
                }
                Err(_) => Ok(()),
            };
            (journaled, prepared)
        } else {
            tokio::join!(
                self.journal.put_launch(&record),
                self.check_and_bind(&lease, &tier)
            )
        };
        if let Err(refused) = prepared {
            // Nothing was minted. The record this launch wrote goes; one an
            // earlier launch of the lease left (a pending removal) stays.
            if !pending_removal && let Err(e) = self.journal.forget_launch(lease.id.as_str()).await
            {
                warn!(lease = %lease.id, error = %e, "cannot clear the record of a launch that was refused; a restart re-checks it");
            }
            self.state().launching.remove(&lease.id);
            return Err(refused);
        }
        let result = match journaled {
            Err(e) => Err(RunnerError::JournalUnwritable(format!(
                "cannot journal the launch of {}, so nothing was started: {e}",
                lease.id
            ))),
            Ok(()) => {
                self.launch_bound(&lease, &tier, &name, &job, &mut record, registration)
                    .await
            }
        };
        self.launch_over(&lease.id, result).await
    }

    /// The answer to a launch of `lease`, whose runner this node already
    /// holds at `held`: OK at that epoch (a redelivery), else BUSY, with
    /// nothing started and the plane keeping the lease, both epochs logged
    /// and named.
    fn launched_already(lease: &Lease, held: Epoch) -> Result<(), RunnerError> {
        if held == lease.epoch {
            return Ok(());
        }
        warn!(lease = %lease.id, held_epoch = held.0, launch_epoch = lease.epoch.0,
              "a launch of a lease whose runner this node holds at another epoch: answered BUSY, nothing started");
        Err(RunnerError::Busy {
            message: format!(
                "lease {} has a runner on this node at epoch {held}, and this launch is at epoch {}: nothing was started, and the runner runs on",
                lease.id, lease.epoch
            ),
            held: false,
        })
    }

    /// A launch of `lease` has its answer: the lease is no longer
    /// launching here, and a launch that started nothing, or proved
    /// everything it started gone, forgets it.
    async fn launch_over(
        &self,
        lease: &LeaseId,
        result: Result<(), RunnerError>,
    ) -> Result<(), RunnerError> {
        self.state().launching.remove(lease);
        if matches!(
            result,
            Err(RunnerError::Failed(_)
                | RunnerError::Refused(_)
                | RunnerError::RunnerOutdated(_)
                | RunnerError::JournalUnwritable(_))
        ) {
            self.forget(lease).await;
        }
        result
    }

    /// What can be checked before a registration exists is checked beside
    /// the bind (neither needs the other, and only the mint waits for
    /// both): the provider answers and has the image, while the lease is
    /// bound and advanced to launching in one round trip (one ledger
    /// transaction). A refused check answers its refusal with nothing
    /// minted, and a lease the bind took meanwhile is released `failed`
    /// here ([`Runner::release_refused`]); a refused bind with the image
    /// present fails the launch with nothing to release. Once both pass,
    /// the lease counts as launching here.
    async fn check_and_bind(&self, lease: &Lease, tier: &TierSpec) -> Result<(), RunnerError> {
        let (checked, bound) = tokio::join!(
            self.provider.check_image(&tier.image),
            self.ledger
                .bind_advance(&lease.id, lease.epoch, Phase::Launching)
        );
        let refusal = match checked {
            Ok(facts) => {
                match self
                    .freshness
                    .judge(&tier.image, &facts, tier.min_runner_version.as_ref())
                {
                    Ok(()) => {
                        self.state()
                            .images
                            .insert(lease.id.clone(), (tier.image.clone(), facts.id));
                        None
                    }
                    Err(outdated) => {
                        let why = outdated.explain();
                        warn!(lease = %lease.id, image = %tier.image, reason = %why, "refusing a launch whose runner GitHub will not run");
                        Some(RunnerError::RunnerOutdated(why))
                    }
                }
            }
            Err(ProviderError::ImageUnavailable { image }) => {
                warn!(lease = %lease.id, %image, "refusing a launch whose image is not on this node");
                self.tier_failed_to_start(
                    lease,
                    tier,
                    &format!("image {image} is not on this node"),
                );
                Some(RunnerError::ImageUnavailable { image })
            }
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "refusing a launch: the provider cannot be asked about its image");
                Some(RunnerError::ProviderUnavailable(format!(
                    "cannot check image {} before launching lease {}, so nothing was minted or started: {e}",
                    tier.image, lease.id
                )))
            }
        };
        match (refusal, bound) {
            (None, Ok(())) => {
                let mut s = self.state();
                s.launching.insert(lease.id.clone(), lease.epoch);
                s.sizes
                    .insert(lease.id.clone(), (lease.vcpu, lease.memory.0));
                Ok(())
            }
            (None, Err(e)) => Err(RunnerError::Failed(format!(
                "bind {} and advance it to launching: {e}",
                lease.id
            ))),
            (Some(refusal), Err(_)) => Err(refusal),
            (Some(refusal), Ok(())) => {
                let why = match &refusal {
                    RunnerError::ImageUnavailable { image } => {
                        FailureReason::ImageUnavailable(image.clone())
                    }
                    RunnerError::RunnerOutdated(_) => FailureReason::RunnerOutdated,
                    _ => FailureReason::ProviderUnavailable,
                };
                self.release_refused(lease, why).await;
                Err(refusal)
            }
        }
    }

    /// Ends a lease this launch bound beside an image check that refused
    /// it: released `failed` with `why` (nothing was minted or started), so it is
    /// never left bound to this node. A release that fails is logged: the
    /// plane ends the lease itself on the refusal (the stub's ledger
    /// answers a release of a lease already `failed` as done).
    async fn release_refused(&self, lease: &Lease, why: FailureReason) {
        match self
            .ledger
            .release(&lease.id, lease.epoch, &Ending::Failed(why))
            .await
        {
            Ok(()) => {
                info!(lease = %lease.id, "released the lease bound beside a refused image check");
            }
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "cannot release the lease bound beside a refused image check; the plane ends it on the refusal");
            }
        }
    }

    /// The size the provider will really run the bound lease at; when it
    /// is not the lease's, the lease is resized to it first (fenced, the
    /// node's room checked by the plane), so the ledger charges what runs.
    /// Before the mint: a refusal leaves nothing minted, and the lease is
    /// released.
    async fn resize_to_shape(&self, lease: &Lease) -> Result<(u32, ByteSize), RunnerError> {
        let (vcpu, memory) = self.shape(lease).await?;
        self.resize_to(lease, vcpu, memory).await?;
        Ok((vcpu, memory))
    }

    /// The size the provider runs `lease` at ([`Provider::shape`]); asked
    /// before anything is minted or started.
    async fn shape(&self, lease: &Lease) -> Result<(u32, ByteSize), RunnerError> {
        self.provider
            .shape(lease.vcpu, lease.memory)
            .await
            .map_err(|e| {
                RunnerError::Failed(format!(
                    "ask the provider what lease {} would run at, so nothing was minted or started: {e}",
                    lease.id
                ))
            })
    }

    /// After the bind: the lease resized to `vcpu` and `memory` when the
    /// provider runs it at another size than it asks (fenced; the plane
    /// checks the node's room), before anything starts.
    async fn resize_to(
        &self,
        lease: &Lease,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), RunnerError> {
        if (vcpu, memory) == (lease.vcpu, lease.memory) {
            return Ok(());
        }
        self.ledger
            .resize(&lease.id, lease.epoch, vcpu, memory)
            .await
            .map_err(|e| {
                RunnerError::Failed(format!(
                    "lease {} asks for {} vCPU and {} MiB, this node's {} provider runs it at {vcpu} vCPU and {} MiB, and the plane would not resize it, so nothing was started: {e}",
                    lease.id,
                    lease.vcpu,
                    lease.memory.0 >> 20,
                    self.provider.kind(),
                    memory.0 >> 20
                ))
            })?;
        info!(lease = %lease.id, asked_vcpu = lease.vcpu, vcpu, memory_mib = memory.0 >> 20,
              "resized the lease to what the provider runs");
        self.state()
            .sizes
            .insert(lease.id.clone(), (vcpu, memory.0));
        Ok(())
    }

    async fn launch_bound(
        &self,
        lease: &Lease,
        tier: &TierSpec,
        name: &InstanceName,
        job: &Job,
        record: &mut LaunchRecord,
        minted: Option<Registration>,
    ) -> Result<(), RunnerError> {
        let (vcpu, memory) = self.resize_to_shape(lease).await?;
        let minted = match minted {
            Some(r) => Ok(r),
            None => self.jit.mint(&lease.id, lease.epoch, name).await,
        };
        let registration = match minted {
            Ok(r) => r,
            Err(mint_error) => {
                // The mint may have happened and only its answer been lost:
                // remove whatever registration the plane holds for the lease.
                if let Err(e) = self.jit.remove_runner(&lease.id, lease.epoch, 0, "").await {
                    self.hold(
                        lease.id.clone(),
                        CustodyEntry {
                            registration: Some((0, String::new())),
                            absent_since: Some(Instant::now()),
                            ..CustodyEntry::teardown(
                                lease.epoch,
                                name.clone(),
                                lease.request_id,
                                Ending::Failed(FailureReason::LaunchFailed),
                                false,
                            )
                        },
                    )
                    .await;
                    return Err(RunnerError::Custody(format!(
                        "mint a JIT config for {name} failed ({mint_error}) and a registration it may have made could not be removed ({e}); holding the lease until it is"
                    )));
                }
                let message = format!("mint a JIT config for {name}: {mint_error}");
                return Err(match mint_error {
                    PlaneError::ScaleSetNotFound(_) => RunnerError::ScaleSetNotFound(message),
                    PlaneError::RunnerNameTaken(_) => RunnerError::RunnerNameTaken(message),
                    _ => RunnerError::Failed(message),
                });
            }
        };
        record.runner_id = registration.runner_id;
        record.runner_name = registration.runner_name.clone();
        let mut env = tier.env.clone();
        let (binds, cache_token, actions_proxy) = self
            .mount_disks(&lease.id, lease.epoch, tier, &mut env)
            .await;
        let spec = InstanceSpec {
            env,
            binds,
            cache_token,
            actions_proxy,
            ..instance_spec(lease, tier, name, (vcpu, memory), registration.config)
        };
        // The registration is journaled while the instance is created: the
        // create needs only the JIT config, and a record that lost this
        // amendment (the node killed during both) removes the registration
        // by lease instead of by id, as after a power cut.
        let (exists, _) = tokio::sync::oneshot::channel();
        let (amended, created) = tokio::join!(
            self.journal.amend_launch(record),
            self.create_for(lease, tier, spec, exists, crate::provider::start_now())
        );
        if let Err(e) = amended {
            warn!(error = %e, "cannot journal the runner registration; a restart removes it by lease");
        }
        match created {
            Ok(instance) => {
                self.started(lease, tier, name, job, record, &instance)
                    .await;
                Ok(())
            }
            Err(create_error) => {
                warn!(lease = %lease.id, error = %create_error, "create failed; removing the registration, then any stray");
                self.create_failed(lease, tier, &create_error);
                self.fail_launch(
                    lease,
                    name,
                    (registration.runner_id, registration.runner_name),
                    &format!("create {name}: {create_error}"),
                )
                .await
            }
        }
    }

    /// A launch's instance started: it runs here from now on, and its
    /// record says so.
    async fn started(
        &self,
        lease: &Lease,
        tier: &TierSpec,
        name: &InstanceName,
        job: &Job,
        record: &mut LaunchRecord,
        instance: &Instance,
    ) {
        info!(lease = %lease.id, request = lease.request_id.0, instance = %instance.name,
              repository = %job.repository, "launched");
        {
            let mut s = self.state();
            s.tiers.started(
                &lease.id,
                &Definition::new(tier, lease.vcpu, lease.memory.0),
            );
            let image = s.images.remove(&lease.id);
            s.running.insert(
                lease.request_id,
                Running {
                    lease: lease.id.clone(),
                    epoch: lease.epoch,
                    instance: name.clone(),
                    registration: (record.runner_id, record.runner_name.clone()),
                    since: Instant::now(),
                    online: false,
                    retire_tried: false,
                    warned_hours: 0,
                    image,
                },
            );
        }
        // Only once the start has answered: a record saying created
        // is adopted as a job by recovery without asking GitHub, so
        // it must not name an instance whose start may have failed
        // (a record written beside the start adopted a runner with no
        // job in the simulation's seed 9344: a create that fails after
        // starting, and a crash).
        record.created = true;
        if let Err(e) = self.journal.amend_launch(record).await {
            warn!(error = %e, "cannot journal a created instance; a restart adopts it from the ledger");
        }
    }

    /// A launch carrying its registration, of a tier that asks nothing of
    /// the cache: the instance is created beside the launch record's
    /// sync, the image check and `BindAdvance`, and started only once all
    /// three have passed (and the lease is resized, when the provider
    /// runs it at another size), so the create, about ten times the bind,
    /// hides the bind. Nothing runs before the lease is bound here and
    /// the launch is journaled: a refusal or a failed journal write
    /// withholds the start and removes the created instance; a restart
    /// that finds the instance still `created` tears it down without
    /// adopting it, record or no record. The registration is already in
    /// the record, so no amendment waits beside the create.
    async fn launch_beside_bind(
        &self,
        lease: &Lease,
        tier: &TierSpec,
        name: &InstanceName,
        job: &Job,
        record: &mut LaunchRecord,
        registration: Registration,
    ) -> Result<(), RunnerError> {
        let (vcpu, memory) = self.shape(lease).await?;
        let spec = instance_spec(lease, tier, name, (vcpu, memory), registration.config);
        let (open, gate) = tokio::sync::oneshot::channel();
        let (created, _) = tokio::sync::oneshot::channel();
        let written = record.clone();
        let ready = async {
            let (journaled, prepared) = tokio::join!(
                self.journal.put_launch(&written),
                self.check_and_bind(lease, tier)
            );
            let ready = match (journaled, prepared) {
                (_, Err(refused)) => Err(Unready::Refused(refused)),
                (Err(e), Ok(())) => Err(Unready::Unjournaled(format!(
                    "cannot journal the launch of {}, so nothing was started: {e}",
                    lease.id
                ))),
                (Ok(()), Ok(())) => self
                    .resize_to(lease, vcpu, memory)
                    .await
                    .map_err(|e| Unready::Bound(e.to_string())),
            };
            let _ = open.send(ready.is_ok());
            ready
        };
        let (ready, created) =
            tokio::join!(ready, self.create_for(lease, tier, spec, created, gate));
        let registered = (registration.runner_id, registration.runner_name);
        match (ready, created) {
            (Ok(()), Ok(instance)) => {
                self.started(lease, tier, name, job, record, &instance)
                    .await;
                Ok(())
            }
            (Ok(()), Err(create_error)) => {
                warn!(lease = %lease.id, error = %create_error, "create failed; removing the registration, then any stray");
                self.create_failed(lease, tier, &create_error);
                self.fail_launch(
                    lease,
                    name,
                    registered,
                    &format!("create {name}: {create_error}"),
                )
                .await
            }
            // Bound here, and nothing started: the registration and the
            // created instance go as after a failed create, and what is not
            // proven gone is held.
            (Err(Unready::Bound(cause)), _) => {
                warn!(lease = %lease.id, %cause, "the launch cannot go on; removing the registration and the created instance");
                self.fail_launch(lease, name, registered, &cause).await
            }
            (Err(Unready::Unjournaled(cause)), _) => {
                warn!(lease = %lease.id, %cause, "the launch cannot go on; removing the registration and the created instance");
                match self.fail_launch(lease, name, registered, &cause).await {
                    Err(RunnerError::Failed(cause)) => Err(RunnerError::JournalUnwritable(cause)),
                    other => other,
                }
            }
            // Not bound here (or released by the refused check): nothing
            // started, and the plane removes the registration it minted.
            // An instance created meanwhile is removed; one that cannot be
            // is never started and goes with the next sweep.
            (Err(Unready::Refused(refused)), _) => {
                match self.provider.destroy(name).await {
                    Ok(_) => {}
                    Err(e) => {
                        warn!(lease = %lease.id, instance = %name, error = %e, "cannot remove the instance created beside a refused launch; it was never started, and the next sweep removes it");
                    }
                }
                if let Err(e) = self.journal.forget_launch(lease.id.as_str()).await {
                    warn!(lease = %lease.id, error = %e, "cannot clear the record of a launch that was refused; a restart re-checks it");
                }
                Err(refused)
            }
        }
    }

    /// A launch's create or start failed with `error`: a start failure of
    /// its tier when the engine refused the instance (not when it could not
    /// be asked, which degrades the node instead, nor when the start was
    /// withheld for a refused bind).
    fn create_failed(&self, lease: &Lease, tier: &TierSpec, error: &ProviderError) {
        match error {
            ProviderError::Engine { .. }
            | ProviderError::Refused(_)
            | ProviderError::ImageUnavailable { .. } => {
                self.tier_failed_to_start(lease, tier, &error.to_string());
            }
            ProviderError::Unreachable { .. }
            | ProviderError::Timeout { .. }
            | ProviderError::StartWithheld { .. } => {}
        }
    }

    /// Counts a start failure of `tier`, launched for `lease`, and says so
    /// when it makes the tier unhealthy.
    pub(super) fn tier_failed_to_start(&self, lease: &Lease, tier: &TierSpec, error: &str) {
        let definition = Definition::new(tier, lease.vcpu, lease.memory.0);
        let threshold = self.options.tier_failures_before_unhealthy;
        let tripped = self.state().tiers.failed(&definition, error, threshold);
        if let Some(unhealthy) = tripped {
            warn!(tier = %unhealthy.tier, failures = unhealthy.failures, retry_after = ?unhealthy.retry_after,
                  last_error = %unhealthy.last_error, "the tier keeps failing to start here; refusing its launches until the wait passes or its definition changes");
        }
    }

    /// The tiers this node refuses after consecutive start failures, by
    /// label, for status and metrics.
    pub fn unhealthy_tiers(&self) -> Vec<super::tiers::UnhealthyTier> {
        self.state().tiers.unhealthy()
    }

    /// spec/node.md §2.2 step 14: routing first, then compute, and hold
    /// whatever is not proven gone.
    async fn fail_launch(
        &self,
        lease: &Lease,
        name: &InstanceName,
        registration: (i64, String),
        cause: &str,
    ) -> Result<(), RunnerError> {
        // Held (and journaled) before any cleanup, so a node that dies
        // midway finds a failed launch to tear down, not a job to adopt.
        let mut entry = CustodyEntry {
            registration: Some(registration.clone()),
            ..CustodyEntry::teardown(
                lease.epoch,
                name.clone(),
                lease.request_id,
                Ending::Failed(FailureReason::LaunchFailed),
                false,
            )
        };
        self.hold(lease.id.clone(), entry.clone()).await;
        if let Err(e) = self
            .jit
            .remove_runner(&lease.id, lease.epoch, registration.0, &registration.1)
            .await
        {
            return Err(RunnerError::Custody(format!(
                "{cause}, and the registration could not be removed ({e}); holding the lease until both are cleaned up"
            )));
        }
        entry.registration = None;
        match self.provider.find(name).await {
            Ok(None) => {
                entry.absent_since = Some(Instant::now());
            }
            Ok(Some(_)) => {
                // Running or exited, it is present until destroyed.
                entry.observed = true;
                match self.provider.destroy(name).await {
                    Ok(Teardown::Stopped) => entry.unconfirmed = false,
                    Ok(Teardown::Requested) | Err(_) => {}
                }
            }
            Err(_) => {}
        }
        if entry.unconfirmed {
            self.update(&lease.id, entry).await;
            return Err(RunnerError::Custody(format!(
                "{cause}; holding the lease until the instance is proven gone"
            )));
        }
        // Registration removed and instance proven gone: nothing is held,
        // and the caller releases the lease.
        self.state().custody.remove(&lease.id);
        self.forget(&lease.id).await;
        Err(RunnerError::Failed(cause.to_owned()))
    }
}
