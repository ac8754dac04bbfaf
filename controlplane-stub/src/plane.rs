//! The stand-in plane: receives job assignments and completions from the
//! scale-set listener, reserves a lease per assigned job, launches it on a
//! node with the tier's spec, destroys it with the job's result when GitHub
//! reports it complete, and releases the lease. Renews the leases it manages
//! itself, reaps expired ones, and exposes a library API for tests.

use std::collections::{BTreeSet, HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use billet_proto::v1 as pb;
use scaleset::JobMessage;
use scaleset::listener::{Event, Listener, Scaler};
use thiserror::Error;
use tokio::sync::{Notify, broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, error, info, info_span, warn};

use crate::calls::{CallHandler, lease_to_wire};
use crate::github::Github;
use crate::ledger::{Ledger, NewLease, NodeCapacity, Phase, WantedChange};
use crate::node_link::{CommandOutcome, NodeLink, NodeTarget, PlaneTls};

/// A tier: which scale set, and how to run its runner.
#[derive(Debug, Clone)]
pub struct Tier {
    /// Tier label, also the scale-set name.
    pub label: String,
    /// Runner image.
    pub image: String,
    /// Runner argv.
    pub command: Vec<String>,
    /// "trusted" or "untrusted".
    pub trust: String,
    /// vCPUs per runner.
    pub vcpu: u32,
    /// Memory per runner, in bytes.
    pub memory_bytes: u64,
    /// Container network mode, or empty for the default.
    pub network: String,
    /// Plain environment for the runner (`KEY=value`).
    pub env: Vec<String>,
    /// Sticky disks each runner gets (the node checks them).
    pub sticky_disks: Vec<pb::StickyDisk>,
    /// The transparent Actions cache's scope when the tier opts in
    /// (`TierSpec.actions_cache`, `cache_scope`; the node checks it).
    pub actions_cache: Option<pb::CacheScope>,
    /// Whether runners get the Docker image store at /var/lib/docker
    /// (`TierSpec.docker_image_store`).
    pub docker_image_store: bool,
}

/// Everything the plane needs.
#[derive(Debug, Clone)]
pub struct PlaneConfig {
    /// Deployment id sent in `Open`.
    pub deployment: String,
    /// Lease TTL.
    pub lease_ttl: Duration,
    /// Where the ledger is: a SQLite file (the default) or a PostgreSQL
    /// database several planes may share.
    pub ledger: crate::ledger::LedgerLocation,
    /// mTLS material.
    pub tls: PlaneTls,
    /// Nodes to dial.
    pub nodes: Vec<NodeTarget>,
    /// The tier every job of the scale set runs on.
    pub tier: Tier,
    /// How long a launch may wait in a node's queue and run.
    pub launch_timeout: Duration,
    /// Mint a launch's runner registration before dispatching it, and send
    /// it in `Launch.registration`, to a node whose `Hello` said it takes
    /// one, that the plane does not see degraded, and whose last answered
    /// launch ran the tier's image (the node then creates beside its bind).
    /// The cost: a node that refuses the launch anyway (it became degraded,
    /// or lost the image, before the plane heard) finds a registration
    /// minted, which the plane then removes; nothing should be minted for a
    /// refused launch, so `billet-plane` leaves this off unless asked. Off,
    /// or for an older node, the node mints through `MintJit` after its own
    /// checks.
    pub mint_before_dispatch: bool,
    /// How long a destroy may take.
    pub destroy_timeout: Duration,
    /// How often the reaper runs.
    pub reap_interval: Duration,
    /// How many runners the scale set may have at once.
    pub max_runners: u32,
    /// How often every attached node is sent Tend and then Sweep.
    pub maintenance_interval: Duration,
    /// How long a quarantined lease must be absent from its node's inventory
    /// before the ledger frees it.
    pub quarantine_grace: Duration,
    /// How long the plane keeps renewing a node's leases after losing its
    /// session with it ([`RENEWAL_GRACE`] by default).
    pub renewal_grace: Duration,
    /// How long a scale set GitHub said it does not have is believed
    /// missing ([`crate::github::SCALE_SET_RETRY`] by default).
    pub scale_set_retry: Duration,
    /// How often registrations are reconciled with open leases
    /// ([`REGISTRATION_INTERVAL`] by default).
    pub registration_interval: Duration,
    /// How long a registration may outlive its lease, and how long GitHub
    /// may answer 404 for an idle runner's registration, before the plane
    /// acts ([`REGISTRATION_GRACE`] by default).
    pub registration_grace: Duration,
    /// The deployment CA with its key, to sign nodes' certificate requests
    /// (renewals over the session, enrolments with a join token); `None`:
    /// the plane signs nothing.
    pub node_ca: Option<Arc<crate::identity::NodeCa>>,
    /// How the plane's connections to nodes notice a silent node
    /// ([`crate::node_link::Keepalive`]; 20 s PINGs, 20 s to answer, by
    /// default).
    pub node_keepalive: crate::node_link::Keepalive,
}

/// What happened to a job, for progress displays and tests.
#[derive(Debug, Clone, PartialEq)]
pub enum PlaneEvent {
    /// A lease was reserved for an assigned job.
    Reserved {
        /// The GitHub job request.
        request_id: i64,
        /// The lease.
        lease: String,
    },
    /// The node launched it.
    Launched {
        /// The lease.
        lease: String,
        /// The node.
        node: String,
        /// The plane minted its registration before dispatching the
        /// launch, rather than the node through `MintJit`.
        minted_ahead: bool,
    },
    /// The launch failed; the outcome says how.
    LaunchFailed {
        /// The lease.
        lease: String,
        /// What the node said.
        reason: String,
        /// The node holds the lease.
        custody: bool,
        /// The error code the node answered with, for a launch it answered
        /// (`ERROR_CODE_IMAGE_UNAVAILABLE`, ...): what a retry decision
        /// reads, never the message.
        code: Option<pb::ErrorCode>,
    },
    /// A runner started a job.
    Started {
        /// The job.
        request_id: i64,
        /// The runner.
        runner_name: String,
    },
    /// GitHub reported the job complete.
    Completed {
        /// The job.
        request_id: i64,
        /// The runner that ran it.
        runner_name: String,
        /// GitHub's result.
        result: String,
    },
    /// A scale-down's Destroy was answered `BUSY`: the runner has taken a
    /// job, nothing was destroyed, and the plane asks again later.
    ScaleDownBusy {
        /// The lease.
        lease: String,
    },
    /// The lease's compute was destroyed and the lease released.
    Released {
        /// The lease.
        lease: String,
        /// "done" or "failed".
        outcome: String,
    },
}

/// How a scale-down ([`Plane::scale_down`]) ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleDown {
    /// The node destroyed the idle runner; the lease is released `done`.
    Destroyed,
    /// The runner's job completed meanwhile: the completion's own Destroy
    /// ends it, and the scale-down is dropped.
    Completed,
    /// The lease ended, or the node holds it: nothing left to scale down.
    Ended,
}

/// The plane could not start.
#[derive(Debug, Error)]
pub enum PlaneError {
    /// The ledger failed.
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
    /// GitHub failed.
    #[error(transparent)]
    Github(#[from] crate::github::GithubError),
}

/// How long the plane keeps renewing the leases bound to a node after it
/// lost its session with that node, when [`PlaneConfig::renewal_grace`] is
/// not set otherwise. Past it the reaper quarantines them.
pub const RENEWAL_GRACE: Duration = Duration::from_secs(30);

/// The first wait after a launch that did not end with a runner; it grows
/// exponentially, with jitter, to [`RELAUNCH_MAX_DELAY`], with no limit on
/// the number of tries.
pub const RELAUNCH_MIN_DELAY: Duration = Duration::from_millis(500);

/// The longest wait between two launches for the same uncovered jobs.
pub const RELAUNCH_MAX_DELAY: Duration = Duration::from_secs(15);

/// How long after its lease ended a registration the ledger never recorded
/// is still looked for by name ([`Plane::registrations_once`]), in
/// milliseconds: one hour. Such a registration exists only when a mint's
/// recording and its immediate removal both failed, which is seconds
/// before the lease ended, not hours.
const UNRECORDED_LOOKBACK_MS: i64 = 60 * 60 * 1000;

/// How often the plane compares registrations with open leases.
pub const REGISTRATION_INTERVAL: Duration = Duration::from_secs(60);

/// How long a registration may outlive its lease, or be missing at GitHub
/// under an idle runner, before the plane removes or destroys it.
pub const REGISTRATION_GRACE: Duration = Duration::from_secs(120);

/// The failure reason of a lease whose idle runner lost its registration.
pub const REGISTRATION_LOST: &str = "registration_lost";

/// How often the plane looks at coverage without being woken.
const COVER_TICK: Duration = Duration::from_millis(500);

enum Work {
    Complete { runner_name: String, result: String },
}

/// A launch whose result the plane never saw: the node may hold compute
/// for it, so the plane hands it over with `AssumeCustody` on the node's
/// next session (DESIGN.md, custody moves causally).
#[derive(Debug, Clone)]
struct LostLaunch {
    lease: String,
    request_id: i64,
}

/// Coverage of the assigned jobs, in memory (the ledger holds the leases,
/// and the wanted jobs durably: `Ledger::wanted_jobs`).
#[derive(Debug)]
struct Cover {
    /// Jobs GitHub assigned to the scale set that no runner has taken and
    /// that are not completed or cancelled. The ledger holds the same set,
    /// written before the message that changed it is acknowledged.
    wanted: BTreeSet<i64>,
    /// Wanted jobs this plane read from the ledger at start and no message
    /// has mentioned since, the earliest recorded first: the only ones a
    /// quiet poll may judge GitHub no longer has (`Cover::quiet_poll`).
    recovered: Vec<i64>,
    /// How many wanted jobs the last quiet poll found beyond the jobs
    /// GitHub says wait, when it found some and no message came since.
    excess_seen: Option<usize>,
    /// Runner names that took a job (their leases cover nothing more).
    taken: HashSet<String>,
    /// Leases whose launch did not end with a runner: failed, refused,
    /// expired, not delivered, held by the node after a failure. (A lost
    /// launch covers while its lease is open: see `Plane::launch`.)
    not_covering: HashSet<String>,
    /// Leases placed on a node whose launch is not answered yet.
    in_flight: HashMap<String, String>,
    /// Runner names whose job GitHub reported completed.
    completed: HashSet<String>,
    /// Leases whose launch was answered and that have not been seen closed
    /// yet: one that closes with its runner having taken no job, and that
    /// the plane did not end itself, was a launch that did not end with a
    /// runner serving a job.
    launched: HashSet<String>,
    /// Launch delays after consecutive failures; `None` once a runner took
    /// a job.
    backoff: Option<backon::ExponentialBackoff>,
    /// No launch before this instant.
    retry_at: Option<Instant>,
    /// Nodes that refused a launch, avoided until the instant.
    avoid: HashMap<String, Instant>,
    /// Lost launches to hand over, per node.
    lost: HashMap<String, Vec<LostLaunch>>,
    /// The last time "no node has room" was logged.
    no_room_logged: Option<Instant>,
    /// Nodes whose last launch the plane heard of ran the tier's image:
    /// only their launches carry a registration minted before dispatch,
    /// so a node without the image is asked to check it before anything
    /// is minted, and so is a node whose launch failed in any way,
    /// until one runs again.
    image_ran: HashSet<String>,
}

impl Cover {
    /// Coverage that starts out wanting `recovered` (request ids, the
    /// earliest recorded first), as read from the ledger.
    fn recovering(recovered: Vec<i64>) -> Self {
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
        }
    }

    /// A launch did not end with a runner: the next one waits, longer each
    /// time in a row, with jitter.
    fn failed(&mut self) -> Duration {
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
        delay
    }

    /// A runner took a job: launches work, and the next failure waits the
    /// shortest time again. Not on a launch's answer: a runner that starts
    /// and then ends without taking a job (a broken image or configuration:
    /// it exits at once) has its launch answered every time, and would be
    /// replaced every 2 s for as long as the job waited.
    fn succeeded(&mut self) {
        self.backoff = None;
        self.retry_at = None;
    }

    /// A message arrived: it changes what is wanted, so a count from an
    /// earlier quiet poll no longer says anything.
    fn message_seen(&mut self) {
        self.excess_seen = None;
    }

    /// Job `request_id` is wanted no more (taken, ended, or judged gone).
    fn forget(&mut self, request_id: i64) {
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
    fn quiet_poll(&mut self, waiting: usize) -> Vec<i64> {
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
    fn covers(&self, lease: &crate::ledger::Lease) -> bool {
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

/// A running plane.
#[derive(Debug)]
pub struct Plane {
    config: PlaneConfig,
    ledger: Arc<Ledger>,
    github: Arc<Github>,
    nodes: Vec<Arc<NodeLink>>,
    events: broadcast::Sender<PlaneEvent>,
    /// Leases the plane renews itself (reserved and launched, not held by a
    /// node), while their node is reachable or within the renewal grace.
    managed: Mutex<HashSet<String>>,
    cover: Mutex<Cover>,
    /// Wakes the coverage loop.
    wake: Notify,
    /// One coverage pass at a time, so two never reserve for the same gap.
    pass: tokio::sync::Mutex<()>,
    scale_set: Mutex<scaleset::ScaleSetId>,
    tasks: TaskTracker,
}

impl Plane {
    /// Opens the ledger, finds or creates the scale set, dials the nodes and
    /// starts the listener, workers, renewal and reaper.
    ///
    /// # Errors
    ///
    /// [`PlaneError`] when the ledger or GitHub cannot be reached.
    pub async fn start(
        config: PlaneConfig,
        github: scaleset::Client,
        shutdown: CancellationToken,
    ) -> Result<Arc<Plane>, PlaneError> {
        let ledger = Arc::new(Ledger::connect(&config.ledger, config.lease_ttl).await?);
        let github = Arc::new(Github::with_retry(github, config.scale_set_retry));
        let scale_set = github.ensure_scale_set(&config.tier.label).await?;
        // The jobs a predecessor was told are assigned and not yet taken:
        // their messages were acknowledged, so only the ledger still knows
        // them. Those of a set made again under the tier's name went with
        // the old set.
        let label = &config.tier.label;
        let dropped = ledger
            .forget_other_scale_sets(label, scale_set.get())
            .await?;
        let recovered = ledger.wanted_jobs(label, scale_set.get()).await?;
        if dropped > 0 || !recovered.is_empty() {
            info!(scale_set = %label, wanted = recovered.len(), dropped,
                  "recovered the jobs a previous plane was covering");
        }
        let nodes: Vec<_> = config
            .nodes
            .iter()
            .cloned()
            .map(|target| NodeLink::with_keepalive(target, config.node_keepalive))
            .collect();
        let (events, _) = broadcast::channel(1024);
        let plane = Arc::new(Plane {
            ledger: ledger.clone(),
            github: github.clone(),
            nodes,
            events,
            managed: Mutex::new(HashSet::new()),
            cover: Mutex::new(Cover::recovering(recovered)),
            wake: Notify::new(),
            pass: tokio::sync::Mutex::new(()),
            scale_set: Mutex::new(scale_set),
            tasks: TaskTracker::new(),
            config,
        });
        let calls = Arc::new(
            CallHandler::new(ledger, github, plane.config.quarantine_grace)
                .with_ca(plane.config.node_ca.clone()),
        );
        let open = pb::Open {
            protocol_version: billet_proto::PROTOCOL_VERSION,
            deployment: plane.config.deployment.clone(),
            lease_ttl_ms: u64::try_from(plane.config.lease_ttl.as_millis()).unwrap_or(u64::MAX),
            // Stamped by the link when it sends Open.
            plane_clock_unix_ms: 0,
        };
        for node in &plane.nodes {
            plane.tasks.spawn(
                Arc::clone(node)
                    .run(
                        plane.config.tls.clone(),
                        open.clone(),
                        calls.clone(),
                        shutdown.clone(),
                    )
                    .instrument(info_span!("node", name = %node.name())),
            );
            plane.tasks.spawn(
                Arc::clone(&plane)
                    .hand_over(Arc::clone(node), shutdown.clone())
                    .instrument(info_span!("handover", node = %node.name())),
            );
        }
        let (work_tx, work_rx) = mpsc::unbounded_channel();
        plane
            .tasks
            .spawn(Arc::clone(&plane).work(work_rx, shutdown.clone()));
        plane
            .tasks
            .spawn(Arc::clone(&plane).listen(work_tx, shutdown.clone()));
        plane
            .tasks
            .spawn(Arc::clone(&plane).renew_and_reap(shutdown.clone()));
        plane
            .tasks
            .spawn(Arc::clone(&plane).maintain(shutdown.clone()));
        plane
            .tasks
            .spawn(Arc::clone(&plane).keep_covered(shutdown.clone()));
        plane
            .tasks
            .spawn(Arc::clone(&plane).reconcile_registrations(shutdown.clone()));
        Ok(plane)
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// Serves the enrolment endpoint (`enroll.rs`) on `listener` until
    /// `shutdown`, with the plane's certificate and its CA.
    pub fn serve_enrollment(&self, listener: tokio::net::TcpListener, shutdown: CancellationToken) {
        let service =
            crate::enroll::EnrollmentService::new(self.ledger.clone(), self.config.node_ca.clone());
        let tls = self.config.tls.clone();
        self.tasks.spawn(
            async move {
                if let Err(e) = crate::enroll::serve(listener, &tls, service, shutdown).await {
                    warn!(error = %e, "the enrolment endpoint stopped");
                }
            }
            .instrument(info_span!("enrollment")),
        );
    }

    /// Issues a one-time join token for `node`, good for `ttl`; the token
    /// is answered once and never stored.
    ///
    /// # Errors
    ///
    /// [`PlaneError`] when the ledger cannot record it.
    pub async fn issue_join_token(&self, node: &str, ttl: Duration) -> Result<String, PlaneError> {
        Ok(crate::identity::issue_join_token(&self.ledger, node, ttl, crate::now_ms()).await?)
    }

    /// The scale set jobs are queued on (its current id: a set deleted and
    /// made again has a new one).
    pub fn scale_set(&self) -> scaleset::ScaleSetId {
        *self.scale_set.lock().expect("scale set")
    }

    /// The link to a node by name.
    pub fn node(&self, name: &str) -> Option<&Arc<NodeLink>> {
        self.nodes.iter().find(|n| n.name() == name)
    }

    /// Subscribes to job events.
    pub fn subscribe(&self) -> broadcast::Receiver<PlaneEvent> {
        self.events.subscribe()
    }

    /// The assigned jobs no runner has taken yet, which the plane keeps
    /// covered.
    pub fn uncovered_jobs(&self) -> Vec<i64> {
        self.cover
            .lock()
            .expect("cover")
            .wanted
            .iter()
            .copied()
            .collect()
    }

    /// Waits for every task to stop after shutdown.
    pub async fn stopped(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }

    fn emit(&self, event: PlaneEvent) {
        let _ = self.events.send(event);
    }

    /// Runs the scale-set listener, restarting it with backoff. A listener
    /// that fails because GitHub no longer has the set marks it missing and
    /// waits for the set to be found again (one lookup per retry interval),
    /// then listens on the set's current id.
    async fn listen(
        self: Arc<Self>,
        work: mpsc::UnboundedSender<Work>,
        shutdown: CancellationToken,
    ) {
        let mut scaler = PlaneScaler {
            plane: Arc::clone(&self),
            work,
        };
        let label = self.config.tier.label.clone();
        let mut backoff = restart_backoff();
        loop {
            let set = self.scale_set();
            // No retries inside: every failure comes back here, where a
            // missing set is told apart from an outage.
            let listener =
                Listener::new(self.github.client().clone(), set, self.config.max_runners)
                    .owner("billet-plane")
                    .max_failures(0);
            let wait = match listener
                .run(&mut scaler, shutdown.clone().cancelled_owned())
                .await
            {
                Ok(()) => return,
                Err(scaleset::listener::Error::Session(e)) if e.is_not_found() => {
                    self.github.mark_missing(&label);
                    None
                }
                Err(e) => {
                    warn!(error = %e, "scale-set listener stopped; restarting");
                    Some(backoff.next().unwrap_or(RELAUNCH_MAX_DELAY))
                }
            };
            match wait {
                Some(wait) => {
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(wait) => {}
                    }
                }
                None => loop {
                    match self.github.scale_set(&label).await {
                        Ok(id) => {
                            let old = std::mem::replace(
                                &mut *self.scale_set.lock().expect("scale set"),
                                id,
                            );
                            if old != id {
                                // A set made again is a new set: GitHub
                                // dropped the old one's jobs with it, so
                                // they are not covered any more; the new
                                // set's session assigns its own.
                                let dropped = {
                                    let mut cover = self.cover.lock().expect("cover");
                                    cover.recovered.clear();
                                    cover.excess_seen = None;
                                    std::mem::take(&mut cover.wanted)
                                };
                                info!(scale_set = %label, old = %old, new = %id, dropped = dropped.len(),
                                      "the runner scale set was made again; listening on its new id");
                                // Best effort: a plane started later drops
                                // them too.
                                if let Err(e) =
                                    self.ledger.forget_other_scale_sets(&label, id.get()).await
                                {
                                    warn!(error = %e, "forgetting the old set's wanted jobs");
                                }
                            }
                            backoff = restart_backoff();
                            break;
                        }
                        Err(e) => {
                            if !e.is_scale_set_not_found() {
                                warn!(error = %e, "looking the scale set up");
                            }
                            tokio::select! {
                                () = shutdown.cancelled() => return,
                                () = tokio::time::sleep(self.config.scale_set_retry.min(Duration::from_secs(1))) => {}
                            }
                        }
                    }
                },
            }
        }
    }

    async fn work(
        self: Arc<Self>,
        mut rx: mpsc::UnboundedReceiver<Work>,
        shutdown: CancellationToken,
    ) {
        loop {
            let item = tokio::select! {
                () = shutdown.cancelled() => return,
                w = rx.recv() => match w { Some(w) => w, None => return },
            };
            let plane = Arc::clone(&self);
            match item {
                Work::Complete {
                    runner_name,
                    result,
                } => {
                    let span = info_span!("complete", runner = %runner_name);
                    let shutdown = shutdown.clone();
                    self.tasks.spawn(
                        async move { plane.complete(runner_name, result, shutdown).await }
                            .instrument(span),
                    );
                }
            }
        }
    }

    /// Keeps every assigned job covered: on every wake-up and every
    /// [`COVER_TICK`], launches what is missing.
    async fn keep_covered(self: Arc<Self>, shutdown: CancellationToken) {
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
    async fn cover_once(self: Arc<Self>) -> Result<(), crate::ledger::LedgerError> {
        let _pass = self.pass.lock().await;
        let tier = self.config.tier.clone();
        {
            let cover = self.cover.lock().expect("cover");
            if cover.wanted.is_empty() {
                return Ok(());
            }
            if cover.retry_at.is_some_and(|at| Instant::now() < at) {
                return Ok(());
            }
        }
        // The plane is the tier authority: it asks whether the set exists
        // (from the cache; one lookup per retry interval while missing)
        // before it mints anything through a node.
        match self.github.scale_set(&tier.label).await {
            Ok(_) => {}
            Err(e) if e.is_scale_set_not_found() => return Ok(()),
            Err(e) => {
                warn!(error = %e, "cannot ask GitHub for the scale set; not launching");
                let mut cover = self.cover.lock().expect("cover");
                cover.failed();
                return Ok(());
            }
        }
        let open = self.ledger.open_leases().await?;
        if self.note_runners_ended_idle(&open).await? {
            return Ok(());
        }
        let mut launches = Vec::new();
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
            let need = cover.wanted.len().saturating_sub(covering.len());
            let live = u32::try_from(open.iter().filter(|l| l.tier == tier.label).count())
                .unwrap_or(u32::MAX);
            let room = usize::try_from(self.config.max_runners.saturating_sub(live)).unwrap_or(0);
            let need = need.min(room);
            if need == 0 {
                return Ok(());
            }
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
            let now = Instant::now();
            cover.avoid.retain(|_, until| *until > now);
            let wanted: Vec<i64> = cover.wanted.iter().copied().collect();
            for _ in 0..need {
                let Some(node) = self.pick_node(&charged, &cover.avoid) else {
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
                let c = charged.entry(node.name().to_owned()).or_default();
                c.0 += u64::from(tier.vcpu);
                c.1 += tier.memory_bytes;
                launches.push((node, request_id));
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
            let lease = match self.reserve(request_id, node.name(), capacity).await {
                Ok(lease) => lease,
                Err(e @ crate::ledger::LedgerError::NoCapacity { .. }) => {
                    info!(error = %e, "the ledger has no room on the node; the job waits");
                    continue;
                }
                Err(e) => return Err(e),
            };
            self.cover
                .lock()
                .expect("cover")
                .in_flight
                .insert(lease.id.clone(), node.name().to_owned());
            let span = info_span!("launch", lease = %lease.id, node = node.name());
            let plane = Arc::clone(&self);
            self.tasks
                .spawn(async move { plane.launch(lease, node).await }.instrument(span));
        }
        Ok(())
    }

    /// The attached node with the most free capacity that fits one more
    /// runner of the tier, never one that refused a launch within its
    /// backoff nor one that says it is degraded. Free is what the node said
    /// it may run less the larger of what the ledger charges on it and what
    /// the node said it holds (`Hello`, then every `Instances` and `Sweep`
    /// report): compute the node adopted counts even before the ledger
    /// charges it there, and a lease placed and not yet bound counts even
    /// before the node reports it.
    /// Why no runner of the tier can ever be placed, when that is so: it
    /// asks for more than every attached node has in all, empty, so its
    /// jobs would wait for ever behind a warning that read like a node
    /// briefly full. `None` when some attached node could run it once it
    /// has room, or no node is attached.
    fn too_large_for_every_node(&self) -> Option<String> {
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

    fn pick_node(
        &self,
        charged: &HashMap<String, (u64, u64)>,
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
                (free_vcpu >= u64::from(tier.vcpu) && free_memory >= tier.memory_bytes)
                    .then(|| (free_vcpu, Arc::clone(n)))
            })
            .max_by_key(|(free, _)| *free)
            .map(|(_, n)| n)
    }

    /// Launched leases that `open` no longer holds: one whose runner took
    /// no job (its name neither started nor completed a job) and that the
    /// plane did not end itself (`not_covering`: a scale-down, a refused
    /// or failed launch) is a launch that did not end with a runner
    /// serving a job, so the next launch waits, longer each time in a row
    /// (else a runner image that exits at once is replaced every 2 s).
    /// Returns whether a wait began.
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
            let runner = self.ledger.get(&id).await?.and_then(|l| l.runner_name);
            let mut cover = self.cover.lock().expect("cover");
            cover.launched.remove(&id);
            let served = runner
                .as_ref()
                .is_some_and(|n| cover.taken.contains(n) || cover.completed.contains(n));
            if !served && !cover.not_covering.contains(&id) {
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

    async fn launch(self: Arc<Self>, lease: crate::ledger::Lease, node: Arc<NodeLink>) {
        let tier = &self.config.tier;
        let mut wire = lease_to_wire(&lease);
        wire.providers = vec!["docker".into()];
        let ahead = self.config.mint_before_dispatch
            && node
                .status()
                .borrow()
                .as_ref()
                .is_some_and(|s| s.hello.launches_with_registration && !s.degraded())
            && self
                .cover
                .lock()
                .expect("cover")
                .image_ran
                .contains(node.name());
        let registration = if ahead {
            match self.mint_ahead(&lease).await {
                Ok(minted) => Some(minted),
                Err(refused) => {
                    // Nothing was dispatched: a failure like a node's
                    // failed mint, with nothing started.
                    self.launch_ended(lease, node, CommandOutcome::Answered(refused), None)
                        .await;
                    return;
                }
            }
        } else {
            None
        };
        let command = pb::command::Kind::Launch(pb::Launch {
            registration: registration.clone(),
            lease: Some(wire),
            tier: Some(pb::TierSpec {
                label: tier.label.clone(),
                image: tier.image.clone(),
                command: tier.command.clone(),
                trust: tier.trust.clone(),
                shm_bytes: 0,
                network: tier.network.clone(),
                env: tier.env.clone(),
                sticky_disks: tier.sticky_disks.clone(),
                actions_cache: tier.actions_cache.is_some(),
                cache_scope: tier.actions_cache.clone(),
                docker_image_store: tier.docker_image_store,
            }),
            job: Some(pb::Job {
                request_id: lease.request_id,
                ..Default::default()
            }),
        });
        let outcome = node.dispatch(command, self.config.launch_timeout).await;
        self.launch_ended(lease, node, outcome, registration).await;
    }

    /// Mints the registration of `lease` for its launch with the code a
    /// node's `MintJit` runs ([`crate::calls::mint_and_record`]): the runner
    /// named `billet-<lease>`, recorded against the lease before it is sent.
    /// Returns the failed command result the launch ends with when it cannot
    /// be minted (`SCALE_SET_NOT_FOUND`, `UNAVAILABLE`, or the ledger's
    /// code).
    /// Public so the launch bench times the plane's own mint.
    ///
    /// # Errors
    ///
    /// The failed [`pb::CommandResult`] above.
    pub async fn mint_ahead(
        &self,
        lease: &crate::ledger::Lease,
    ) -> Result<pb::JitConfig, pb::CommandResult> {
        crate::calls::mint_and_record(&self.github, &self.ledger, lease)
            .await
            .map_err(|error| pb::CommandResult {
                outcome: pb::Outcome::Failed as i32,
                error: Some(error),
                ..Default::default()
            })
    }

    /// Removes the registration this plane minted for a launch that ended
    /// with nothing started (the plane's obligation once it mints before
    /// dispatch). GitHub no longer having it is success; a removal that
    /// fails is left to the registration pass, which removes the
    /// registrations of ended leases.
    async fn remove_minted(&self, lease: &str, registration: &pb::JitConfig) {
        match self
            .github
            .remove_runner(registration.runner_id, &registration.runner_name)
            .await
        {
            Ok(_) => {
                info!(%lease, runner = %registration.runner_name, "removed the registration of a launch that started nothing");
            }
            Err(e) => {
                warn!(%lease, runner = %registration.runner_name, error = %e,
                      "cannot remove the registration of a launch that started nothing; the registration pass removes it");
            }
        }
    }

    /// What the plane does with a launch's outcome: a launched lease is
    /// covered; a lost one is the node's if it may have started a runner;
    /// any other is failed, released and backed off. `registration` is the
    /// one this plane minted before dispatching, removed here whenever the
    /// lease ends with nothing started.
    async fn launch_ended(
        self: Arc<Self>,
        lease: crate::ledger::Lease,
        node: Arc<NodeLink>,
        outcome: CommandOutcome,
        registration: Option<pb::JitConfig>,
    ) {
        let tier = &self.config.tier;
        self.cover
            .lock()
            .expect("cover")
            .in_flight
            .remove(&lease.id);
        if outcome.is_ok() {
            info!("launched");
            {
                let mut cover = self.cover.lock().expect("cover");
                cover.launched.insert(lease.id.clone());
                cover.image_ran.insert(node.name().to_owned());
            }
            self.emit(PlaneEvent::Launched {
                lease: lease.id.clone(),
                node: node.name().to_owned(),
                minted_ahead: registration.is_some(),
            });
            self.wake.notify_one();
            return;
        }
        let custody = outcome.is_custody();
        let reason = outcome.describe();
        let code = match &outcome {
            CommandOutcome::Answered(r) => r
                .error
                .as_ref()
                .and_then(|e| pb::ErrorCode::try_from(e.code).ok()),
            _ => None,
        };
        self.emit(PlaneEvent::LaunchFailed {
            lease: lease.id.clone(),
            reason: reason.clone(),
            custody,
            code,
        });
        self.managed.lock().expect("managed").remove(&lease.id);
        // A lost launch whose lease never had a registration minted has no
        // runner and cannot get one (the ledger refuses a mint, and records
        // none, once the lease has ended): it is a failure like any other.
        // The node may still be launching, so the check and the release are
        // one ledger transaction: a mint recorded in between would leave a
        // runner started on a lease already ended. A ledger error counts as
        // minted, the careful side (the lease stays open and covered).
        //
        // A registration this plane minted before dispatching is recorded
        // from the start, so there the question is the bind instead: the
        // node starts nothing before its bind holds.
        let minted = match &outcome {
            CommandOutcome::Lost(_) => {
                let judged = if registration.is_some() {
                    self.ledger
                        .release_unbound(&lease.id, lease.epoch, crate::now_ms())
                        .await
                } else {
                    self.ledger
                        .release_unminted(&lease.id, lease.epoch, crate::now_ms())
                        .await
                };
                match judged {
                    Ok(released) => released.is_none(),
                    Err(e) => {
                        warn!(error = %e, "the lost launch's lease could not be judged; it is treated as minted");
                        true
                    }
                }
            }
            _ => false,
        };
        if minted {
            // The node may well have started the runner: the lease covers
            // its job for as long as the node keeps it open, and is
            // replaced once the ledger closes or quarantines it (a node
            // that restarted and found nothing, or one that went silent).
            // The node is told it holds the lease now if a session is
            // open, else on the next one.
            warn!(%reason, "the launch's result was lost; the node holds the lease");
            self.cover
                .lock()
                .expect("cover")
                .lost
                .entry(node.name().to_owned())
                .or_default()
                .push(LostLaunch {
                    lease: lease.id.clone(),
                    request_id: lease.request_id,
                });
            if node.status().borrow().is_some() {
                let plane = Arc::clone(&self);
                self.tasks
                    .spawn(async move { plane.hand_over_lost(&node).await }.in_current_span());
            }
            self.wake.notify_one();
            return;
        }
        let custody = custody && !matches!(outcome, CommandOutcome::Lost(_));
        // A node that refused (draining, degraded, without the tier's image)
        // or is out of room says so in the outcome and the code: it is
        // avoided for the backoff. A missing image minted nothing and
        // charged nothing; the job waits, covered, and the launch is tried
        // again after the backoff, so an image built or loaded meanwhile
        // lets it run.
        let refused = matches!(&outcome, CommandOutcome::Answered(r)
            if r.outcome == pb::Outcome::Refused as i32)
            || matches!(
                code,
                Some(pb::ErrorCode::ResourceExhausted | pb::ErrorCode::ImageUnavailable)
            );
        // Whatever the node said, its next launch is checked by the node
        // before anything is minted.
        self.cover
            .lock()
            .expect("cover")
            .image_ran
            .remove(node.name());
        if code == Some(pb::ErrorCode::ImageUnavailable) {
            warn!(image = %tier.image, node = node.name(), "the node does not have the tier's image; the job waits until it does");
        }
        let delay = {
            let mut cover = self.cover.lock().expect("cover");
            cover.not_covering.insert(lease.id.clone());
            let delay = cover.failed();
            if refused {
                cover
                    .avoid
                    .insert(node.name().to_owned(), Instant::now() + delay);
            }
            delay
        };
        warn!(%reason, custody, retry_in = ?delay, "the launch did not end with a runner; the job gets a fresh lease");
        if !matches!(outcome, CommandOutcome::Lost(_)) {
            // The lease says why its launch failed, so an operator reading
            // the ledger sees what a launch that keeps failing (a tier the
            // engine refuses) fails on: one the plane ends now, and one the
            // node holds until what it started is proven gone (it ends it
            // `failed` then; the job has a fresh lease meanwhile).
            if let Err(e) = self
                .ledger
                .mark_failure(
                    &lease.id,
                    lease.epoch,
                    &launch_failure_reason(&reason),
                    crate::now_ms(),
                )
                .await
            {
                warn!(error = %e, "recording why a launch failed");
            }
        }
        if !custody && !matches!(outcome, CommandOutcome::Lost(_)) {
            // Nothing was started: the plane ends the lease itself (a lost
            // launch's lease was ended above, with the mint check).
            if let Err(e) = self
                .ledger
                .release(&lease.id, lease.epoch, None, Phase::Failed, crate::now_ms())
                .await
            {
                warn!(error = %e, "release after a failed launch");
            }
        }
        // Nothing started (the node said so, or never bound the lost
        // launch's lease): the registration minted for it goes now. A node
        // holding the lease removes it itself with what it started.
        if !custody && let Some(registration) = &registration {
            self.remove_minted(&lease.id, registration).await;
        }
        self.wake.notify_one();
    }

    /// Hands every lost launch of `node` to it with `AssumeCustody` on each
    /// new session: the plane stopped waiting for the result, so the node
    /// holds whatever it started until it is proven gone or its job ends.
    async fn hand_over(self: Arc<Self>, node: Arc<NodeLink>, shutdown: CancellationToken) {
        let mut status = node.status();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = status.changed() => if changed.is_err() { return },
            }
            if status.borrow_and_update().is_none() {
                continue;
            }
            self.hand_over_lost(&node).await;
        }
    }

    /// Sends `AssumeCustody` for each lost launch of `node` still open; one
    /// the node did not answer waits for the next session.
    async fn hand_over_lost(&self, node: &Arc<NodeLink>) {
        let lost = self
            .cover
            .lock()
            .expect("cover")
            .lost
            .remove(node.name())
            .unwrap_or_default();
        for launch in lost {
            let Ok(Some(lease)) = self.ledger.get(&launch.lease).await else {
                continue;
            };
            if lease.phase.is_terminal() {
                continue;
            }
            let outcome = node
                .dispatch(
                    pb::command::Kind::AssumeCustody(pb::AssumeCustody {
                        lease: Some(lease_to_wire(&lease)),
                        request_id: launch.request_id,
                    }),
                    self.config.destroy_timeout,
                )
                .await;
            match outcome {
                CommandOutcome::Answered(_) => {
                    info!(lease = %launch.lease, outcome = %outcome.describe(), "handed a lost launch to its node")
                }
                // Not heard: send it again on the next session.
                _ => self
                    .cover
                    .lock()
                    .expect("cover")
                    .lost
                    .entry(node.name().to_owned())
                    .or_default()
                    .push(launch),
            }
        }
    }

    /// Reserves a lease for a job request and starts renewing it.
    /// Reserves a lease for `request_id` aimed at `node`, whose capacity is
    /// `capacity`: the ledger refuses it (`NoCapacity`) when the node's open
    /// leases leave no room, whoever booked them.
    async fn reserve(
        &self,
        request_id: i64,
        node: &str,
        capacity: NodeCapacity,
    ) -> Result<crate::ledger::Lease, crate::ledger::LedgerError> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let tier = &self.config.tier;
        let lease = self
            .ledger
            .reserve_on(
                NewLease {
                    id: id.clone(),
                    tier: tier.label.clone(),
                    request_id,
                    vcpu: tier.vcpu,
                    memory_bytes: tier.memory_bytes,
                    runner_name: Some(format!("billet-{id}")),
                },
                node,
                capacity,
                crate::now_ms(),
            )
            .await?;
        info!(lease = %id, request_id, node, "reserved a lease for an assigned job");
        self.managed.lock().expect("managed").insert(id.clone());
        self.emit(PlaneEvent::Reserved {
            request_id,
            lease: id,
        });
        Ok(lease)
    }

    async fn complete(&self, runner_name: String, result: String, shutdown: CancellationToken) {
        let lease = match self.ledger.lease_by_runner_name(&runner_name).await {
            Ok(Some(l)) => l,
            Ok(None) => {
                warn!("a completion for a runner no lease knows");
                return;
            }
            Err(e) => {
                error!(error = %e, "ledger read for a completion");
                return;
            }
        };
        if lease.phase.is_terminal() {
            return;
        }
        let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
            warn!(lease = %lease.id, "completed lease is bound to no known node");
            return;
        };
        let mut backoff = restart_backoff();
        loop {
            let outcome = node
                .dispatch(
                    pb::command::Kind::Destroy(pb::Destroy {
                        request_id: lease.request_id,
                        job_result: Some(result.clone()),
                        force: false,
                        reason: String::new(),
                    }),
                    self.config.destroy_timeout,
                )
                .await;
            if outcome.is_ok() {
                break;
            }
            if let CommandOutcome::Answered(result) = &outcome
                && result.custody
            {
                info!(lease = %lease.id, "the node holds the lease until its instance is gone");
                self.managed.lock().expect("managed").remove(&lease.id);
                return;
            }
            // A lost or failed destroy is repeated, and a busy one later:
            // destroys are idempotent, and the lease stays held meanwhile.
            let wait = backoff.next().unwrap_or(RELAUNCH_MAX_DELAY);
            warn!(lease = %lease.id, outcome = %outcome.describe(), retry_in = ?wait, "destroy did not finish; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(wait) => {}
            }
        }
        self.managed.lock().expect("managed").remove(&lease.id);
        let current = self.ledger.get(&lease.id).await.ok().flatten();
        let epoch = current.as_ref().map_or(lease.epoch, |l| l.epoch);
        match self
            .ledger
            .release(&lease.id, epoch, None, Phase::Done, crate::now_ms())
            .await
        {
            Ok(_) => {
                self.emit(PlaneEvent::Released {
                    lease: lease.id.clone(),
                    outcome: "done".into(),
                });
            }
            Err(e) => warn!(lease = %lease.id, error = %e, "release after destroy"),
        }
    }

    /// Scales down the runner of `lease_id`: a Destroy without a completion
    /// and without force. A node that answers `BUSY` (GitHub says the
    /// runner has taken a job) destroyed nothing; the plane asks again with
    /// backoff (200 ms doubling to 5 s, jittered), and drops the scale-down
    /// once the job's completion arrives (its own Destroy ends the runner),
    /// the lease ends, or the node holds it. A destroyed runner's lease is
    /// released `done`.
    ///
    /// # Errors
    ///
    /// [`crate::ledger::LedgerError`] when the ledger cannot be read.
    pub async fn scale_down(
        &self,
        lease_id: &str,
        shutdown: &CancellationToken,
    ) -> Result<ScaleDown, crate::ledger::LedgerError> {
        // The plane's own end of the runner, however it goes: never a
        // runner that ended without a job (`note_runners_ended_idle`), even
        // when the node releases the lease before this marks it.
        self.cover.lock().expect("cover").launched.remove(lease_id);
        let mut backoff = restart_backoff();
        loop {
            let Some(lease) = self.ledger.get(lease_id).await? else {
                return Ok(ScaleDown::Ended);
            };
            let completed = lease
                .runner_name
                .as_ref()
                .is_some_and(|n| self.cover.lock().expect("cover").completed.contains(n));
            if completed {
                info!(lease = %lease.id, "the job completed; the scale-down is dropped and its completion ends the runner");
                return Ok(ScaleDown::Completed);
            }
            if lease.phase.is_terminal() {
                return Ok(ScaleDown::Ended);
            }
            let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
                return Ok(ScaleDown::Ended);
            };
            let outcome = node
                .dispatch(
                    pb::command::Kind::Destroy(pb::Destroy {
                        request_id: lease.request_id,
                        job_result: None,
                        force: false,
                        reason: String::new(),
                    }),
                    self.config.destroy_timeout,
                )
                .await;
            if outcome.is_ok() {
                self.managed.lock().expect("managed").remove(&lease.id);
                self.cover
                    .lock()
                    .expect("cover")
                    .not_covering
                    .insert(lease.id.clone());
                self.wake.notify_one();
                match self
                    .ledger
                    .release(&lease.id, lease.epoch, None, Phase::Done, crate::now_ms())
                    .await
                {
                    Ok(_) => self.emit(PlaneEvent::Released {
                        lease: lease.id.clone(),
                        outcome: "done".into(),
                    }),
                    Err(e) => warn!(lease = %lease.id, error = %e, "release after a scale-down"),
                }
                return Ok(ScaleDown::Destroyed);
            }
            if outcome.is_custody() {
                self.managed.lock().expect("managed").remove(&lease.id);
                return Ok(ScaleDown::Ended);
            }
            let busy = matches!(&outcome, CommandOutcome::Answered(r)
                if r.outcome == pb::Outcome::Busy as i32
                    || r.error.as_ref().is_some_and(|e| e.code == pb::ErrorCode::Busy as i32));
            let wait = backoff.next().unwrap_or(RELAUNCH_MAX_DELAY);
            if busy {
                info!(lease = %lease.id, retry_in = ?wait, "scale-down answered BUSY: the runner took a job; asking again later");
                self.emit(PlaneEvent::ScaleDownBusy {
                    lease: lease.id.clone(),
                });
            } else {
                warn!(lease = %lease.id, outcome = %outcome.describe(), retry_in = ?wait, "scale-down did not finish; retrying");
            }
            tokio::select! {
                () = shutdown.cancelled() => return Ok(ScaleDown::Ended),
                () = tokio::time::sleep(wait) => {}
            }
        }
    }

    /// Sends Tend, then Sweep, to every attached node on each tick.
    async fn maintain(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.maintenance_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
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

    async fn renew_and_reap(self: Arc<Self>, shutdown: CancellationToken) {
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

/// What registration reconciliation remembers between passes.
#[derive(Debug, Default)]
struct Registrations {
    /// Open leases whose registration GitHub answered 404, since when.
    missing_since: HashMap<String, Instant>,
    /// Ended leases whose registration is known gone.
    gone: HashSet<String>,
}

/// Why a reconciliation pass stopped: GitHub or the ledger could not say.
#[derive(Debug, Error)]
enum ReconcileError {
    #[error(transparent)]
    Github(#[from] crate::github::GithubError),
    #[error(transparent)]
    Ledger(#[from] crate::ledger::LedgerError),
}

impl Plane {
    /// Compares GitHub's registrations with the ledger's open leases every
    /// [`PlaneConfig::registration_interval`]. The plane mints every
    /// registration of this deployment, named `billet-<lease>` and recorded
    /// against its lease, so the ledger names every candidate.
    async fn reconcile_registrations(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(self.config.registration_interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut memory = Registrations::default();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.registrations_once(&mut memory, &shutdown).await {
                warn!(error = %e, "registration reconciliation stopped; nothing more is reaped until GitHub answers");
            }
        }
    }

    /// One pass. A registration whose lease ended more than the grace ago
    /// is removed (found by its recorded id, or by its name when the ledger
    /// recorded none and the lease ended within an hour). An idle runner (launched, no job taken) whose
    /// registration GitHub has answered 404 for longer than the grace is
    /// destroyed and its lease failed with [`REGISTRATION_LOST`], at most
    /// max(1, max_runners / 4) per pass, each after a random delay. Any
    /// answer other than found or 404 (5xx, a timeout) ends the pass at
    /// once: unknown is not gone, and nothing is reaped on it.
    async fn registrations_once(
        &self,
        memory: &mut Registrations,
        shutdown: &CancellationToken,
    ) -> Result<(), ReconcileError> {
        let leases = self.ledger.leases().await?;
        let grace_ms =
            i64::try_from(self.config.registration_grace.as_millis()).unwrap_or(i64::MAX);
        let now_ms = crate::now_ms();
        for l in &leases {
            let Some(ended) = l.ended_at_ms else {
                continue;
            };
            if memory.gone.contains(&l.id) || now_ms.saturating_sub(ended) < grace_ms {
                continue;
            }
            let runner_id = match l.runner_id {
                Some(id) => Some(id),
                // A lease that ended with no registration recorded may still
                // have one: a mint GitHub answered whose recording the
                // ledger refused (the lease ended meanwhile) and whose
                // immediate removal failed. It can only be named, so it is
                // looked up by name, once, for leases that ended within
                // UNRECORDED_LOOKBACK.
                None if now_ms.saturating_sub(ended) <= UNRECORDED_LOOKBACK_MS => {
                    self.github
                        .runner_by_name(&format!("billet-{}", l.id))
                        .await?
                }
                None => None,
            };
            let Some(runner_id) = runner_id else {
                memory.gone.insert(l.id.clone());
                continue;
            };
            if self.github.runner_exists(runner_id).await? {
                let name = l
                    .runner_name
                    .clone()
                    .unwrap_or_else(|| format!("billet-{}", l.id));
                match self.github.remove_runner(runner_id, &name).await {
                    Ok(_) => {
                        info!(lease = %l.id, runner = %name, "removed a registration no open lease accounts for")
                    }
                    Err(e) if e.is_job_still_running() => {
                        warn!(lease = %l.id, runner = %name, "a registration with no open lease is running a job; left alone");
                        continue;
                    }
                    Err(e) => return Err(e.into()),
                }
            }
            memory.gone.insert(l.id.clone());
        }

        let idle: Vec<&crate::ledger::Lease> = {
            let cover = self.cover.lock().expect("cover");
            leases
                .iter()
                .filter(|l| matches!(l.phase, Phase::Launching | Phase::Online))
                .filter(|l| l.runner_id.is_some() && l.node.is_some())
                .filter(|l| !cover.in_flight.contains_key(&l.id) && cover.covers(l))
                .collect()
        };
        let open: HashSet<&str> = idle.iter().map(|l| l.id.as_str()).collect();
        memory
            .missing_since
            .retain(|id, _| open.contains(id.as_str()));
        let mut lost = Vec::new();
        for l in idle {
            let Some(runner_id) = l.runner_id else {
                continue;
            };
            if self.github.runner_exists(runner_id).await? {
                memory.missing_since.remove(&l.id);
                continue;
            }
            let since = *memory
                .missing_since
                .entry(l.id.clone())
                .or_insert_with(Instant::now);
            if since.elapsed() >= self.config.registration_grace {
                lost.push(l.clone());
            }
        }
        let per_pass = usize::try_from((self.config.max_runners / 4).max(1)).unwrap_or(1);
        for lease in lost.into_iter().take(per_pass) {
            let jitter = jitter(self.config.registration_interval / 4);
            tokio::select! {
                () = shutdown.cancelled() => return Ok(()),
                () = tokio::time::sleep(jitter) => {}
            }
            memory.missing_since.remove(&lease.id);
            self.destroy_lost(&lease).await;
        }
        Ok(())
    }

    /// Destroys an idle runner whose registration GitHub no longer has: it
    /// can never take a job. Its job is covered afresh at once.
    async fn destroy_lost(&self, lease: &crate::ledger::Lease) {
        let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
            return;
        };
        warn!(lease = %lease.id, node = node.name(), reason = REGISTRATION_LOST,
              "an idle runner's registration is gone at GitHub; destroying it");
        self.cover
            .lock()
            .expect("cover")
            .not_covering
            .insert(lease.id.clone());
        self.wake.notify_one();
        // The reason is the plane's, recorded before the node tears down
        // (the first reason recorded stays).
        let _ = self
            .ledger
            .mark_failure(&lease.id, lease.epoch, REGISTRATION_LOST, crate::now_ms())
            .await;
        // The registration is gone, so the runner can take no job: the
        // destroy has no job result, and is forced, with the reason.
        let outcome = node
            .dispatch(
                pb::command::Kind::Destroy(pb::Destroy {
                    request_id: lease.request_id,
                    job_result: None,
                    force: true,
                    reason: REGISTRATION_LOST.into(),
                }),
                self.config.destroy_timeout,
            )
            .await;
        if !outcome.is_ok() {
            warn!(lease = %lease.id, outcome = %outcome.describe(), "destroy of a runner without a registration; the next pass tries again");
            return;
        }
        self.managed.lock().expect("managed").remove(&lease.id);
        let now = crate::now_ms();
        match self
            .ledger
            .release(&lease.id, lease.epoch, None, Phase::Failed, now)
            .await
        {
            Ok(_) => self.emit(PlaneEvent::Released {
                lease: lease.id.clone(),
                outcome: "failed".into(),
            }),
            Err(e) => {
                warn!(lease = %lease.id, error = %e, "release after destroying a runner without a registration")
            }
        }
    }
}

/// A random duration below `max`, for spreading the plane's actions.
fn jitter(max: Duration) -> Duration {
    let nanos = u64::try_from(max.as_nanos()).unwrap_or(u64::MAX).max(1);
    // A v4 UUID is 122 random bits; a few of them are enough here.
    let random = u64::try_from(uuid::Uuid::new_v4().as_u128() & u128::from(u64::MAX)).unwrap_or(0);
    Duration::from_nanos(random % nanos)
}

/// The backoff between listener restarts and destroy retries: 200 ms
/// doubling to 5 s, with jitter, without end.
fn restart_backoff() -> backon::ExponentialBackoff {
    backon::BackoffBuilder::build(
        backon::ExponentialBuilder::default()
            .with_jitter()
            .with_min_delay(Duration::from_millis(200))
            .with_max_delay(Duration::from_secs(5))
            .without_max_times(),
    )
}

/// Feeds listener events to the plane: an assigned job becomes wanted (and
/// the coverage pass that reserves its lease runs before the message is
/// acknowledged); a started job is taken, and its runner covers nothing
/// more; a completed or cancelled job is no longer wanted. What a message
/// changes in the wanted jobs is written to the ledger before anything
/// else, so it is durable before the message is acknowledged; a poll that
/// ends with no message lets the plane drop recovered jobs GitHub no
/// longer counts (`Cover::quiet_poll`).
struct PlaneScaler {
    plane: Arc<Plane>,
    work: mpsc::UnboundedSender<Work>,
}

impl Scaler for PlaneScaler {
    type Error = crate::ledger::LedgerError;

    async fn scale(&mut self, event: Event<'_>) -> Result<(), Self::Error> {
        let Some(message) = event.message() else {
            if matches!(event, Event::Idle { .. }) {
                self.quiet_poll(event.statistics()).await;
            }
            return Ok(());
        };
        let plane = &self.plane;
        let changes: Vec<WantedChange> = message
            .jobs
            .iter()
            .filter_map(|job| match job {
                JobMessage::Assigned(job) => {
                    Some(WantedChange::Assigned(job.job.runner_request_id.get()))
                }
                JobMessage::Started(job) => {
                    Some(WantedChange::Gone(job.job.runner_request_id.get()))
                }
                JobMessage::Completed(job) => {
                    Some(WantedChange::Gone(job.job.runner_request_id.get()))
                }
                _ => None,
            })
            .collect();
        // An error leaves the message unacknowledged: GitHub delivers it
        // again, and every step below is safe to repeat.
        plane
            .ledger
            .record_wanted(
                &plane.config.tier.label,
                plane.scale_set().get(),
                &changes,
                crate::now_ms(),
            )
            .await?;
        plane.cover.lock().expect("cover").message_seen();
        let mut assigned = false;
        for job in &message.jobs {
            match job {
                JobMessage::Assigned(job) => {
                    let request_id = job.job.runner_request_id.get();
                    let mut cover = plane.cover.lock().expect("cover");
                    // Delivered again: GitHub still has it.
                    cover.recovered.retain(|r| *r != request_id);
                    assigned |= cover.wanted.insert(request_id);
                }
                JobMessage::Started(job) => {
                    let request_id = job.job.runner_request_id.get();
                    {
                        let mut cover = plane.cover.lock().expect("cover");
                        cover.forget(request_id);
                        cover.taken.insert(job.runner_name.clone());
                        cover.succeeded();
                    }
                    plane.emit(PlaneEvent::Started {
                        request_id,
                        runner_name: job.runner_name.clone(),
                    });
                }
                JobMessage::Completed(job) => {
                    let request_id = job.job.runner_request_id.get();
                    {
                        let mut cover = plane.cover.lock().expect("cover");
                        cover.forget(request_id);
                        cover.completed.insert(job.runner_name.clone());
                    }
                    plane.emit(PlaneEvent::Completed {
                        request_id,
                        runner_name: job.runner_name.clone(),
                        result: job.result.clone(),
                    });
                    if !job.runner_name.is_empty() {
                        let _ = self.work.send(Work::Complete {
                            runner_name: job.runner_name.clone(),
                            result: job.result.clone(),
                        });
                    }
                }
                _ => {}
            }
        }
        if assigned {
            Arc::clone(plane).cover_once().await?;
        }
        plane.wake.notify_one();
        Ok(())
    }
}

impl PlaneScaler {
    /// A poll ended with no message, with GitHub's `statistics`: recovered
    /// jobs GitHub no longer counts are dropped (`Cover::quiet_poll`), in
    /// memory and then in the ledger. A failed ledger write is only
    /// logged: a plane started later recovers those jobs and judges them
    /// again.
    async fn quiet_poll(&self, statistics: &scaleset::ScaleSetStatistics) {
        let plane = &self.plane;
        let waiting = statistics
            .total_assigned_jobs
            .saturating_sub(statistics.total_running_jobs);
        let gone = plane
            .cover
            .lock()
            .expect("cover")
            .quiet_poll(usize::try_from(waiting).unwrap_or(usize::MAX));
        if gone.is_empty() {
            return;
        }
        info!(jobs = ?gone, waiting,
              "GitHub no longer counts these recovered jobs (they ended while no plane listened); not covering them");
        let changes: Vec<WantedChange> = gone.into_iter().map(WantedChange::Gone).collect();
        if let Err(e) = plane
            .ledger
            .record_wanted(
                &plane.config.tier.label,
                plane.scale_set().get(),
                &changes,
                crate::now_ms(),
            )
            .await
        {
            warn!(error = %e, "forgetting recovered jobs GitHub no longer counts");
        }
    }
}

/// The failure reason a lease whose launch failed is ended with: `launch: `
/// and what the node (or the session) said, at most
/// [`LAUNCH_FAILURE_REASON_CHARS`] characters of it.
fn launch_failure_reason(described: &str) -> String {
    let mut reason = format!("launch: {described}");
    if let Some((cut, _)) = reason.char_indices().nth(LAUNCH_FAILURE_REASON_CHARS) {
        reason.truncate(cut);
    }
    reason
}

/// The longest failure reason [`launch_failure_reason`] records, in
/// characters.
const LAUNCH_FAILURE_REASON_CHARS: usize = 500;

#[cfg(test)]
mod tests {
    use super::*;

    /// A plane over an in-memory ledger with links to `nodes`, none dialed:
    /// tests attach them with `NodeLink::attach_for_test`.
    async fn plane(nodes: &[&str]) -> (Arc<Plane>, scaleset::testing::Emulator) {
        plane_configured(nodes, |_| {}).await
    }

    /// As [`plane`], with `configure` applied to the configuration first.
    async fn plane_configured(
        nodes: &[&str],
        configure: impl FnOnce(&mut PlaneConfig),
    ) -> (Arc<Plane>, scaleset::testing::Emulator) {
        let emulator = scaleset::testing::Emulator::builder().start().await;
        let mut config = test_config(nodes);
        configure(&mut config);
        let lease_ttl = config.lease_ttl;
        let targets = config.nodes.clone();
        let plane = Arc::new(Plane {
            ledger: Arc::new(Ledger::open_in_memory(lease_ttl).await.expect("ledger")),
            github: Arc::new(Github::new(emulator.client())),
            nodes: targets.into_iter().map(NodeLink::new).collect(),
            events: broadcast::channel(64).0,
            managed: Mutex::new(HashSet::new()),
            cover: Mutex::new(Cover::recovering(Vec::new())),
            wake: Notify::new(),
            pass: tokio::sync::Mutex::new(()),
            scale_set: Mutex::new(scaleset::ScaleSetId(1)),
            tasks: TaskTracker::new(),
            config,
        });
        (plane, emulator)
    }

    /// The tests' configuration: links to `nodes` (none dialed), an
    /// in-memory ledger, the tier `linux` of 1 vCPU and 1 MiB.
    fn test_config(nodes: &[&str]) -> PlaneConfig {
        let lease_ttl = Duration::from_secs(60);
        let targets: Vec<NodeTarget> = nodes
            .iter()
            .map(|name| NodeTarget {
                name: (*name).into(),
                addr: "127.0.0.1:9".parse().expect("addr"),
            })
            .collect();
        PlaneConfig {
            deployment: "dev".into(),
            lease_ttl,
            ledger: crate::ledger::LedgerLocation::SqliteMemory,
            tls: PlaneTls {
                ca_pem: Vec::new(),
                cert_pem: Vec::new(),
                key_pem: Vec::new(),
            },
            nodes: targets,
            tier: Tier {
                label: "linux".into(),
                image: "billet-standin-runner:dev".into(),
                command: vec!["/run".into()],
                trust: "trusted".into(),
                vcpu: 1,
                memory_bytes: 1 << 20,
                network: String::new(),
                env: Vec::new(),
                sticky_disks: Vec::new(),
                actions_cache: None,
                docker_image_store: false,
            },
            launch_timeout: Duration::from_secs(30),
            mint_before_dispatch: true,
            destroy_timeout: Duration::from_secs(30),
            reap_interval: Duration::from_secs(60),
            max_runners: 10,
            maintenance_interval: Duration::from_secs(60),
            quarantine_grace: crate::calls::QUARANTINE_GRACE,
            renewal_grace: RENEWAL_GRACE,
            scale_set_retry: crate::github::SCALE_SET_RETRY,
            registration_interval: REGISTRATION_INTERVAL,
            registration_grace: REGISTRATION_GRACE,
            node_ca: None,
            node_keepalive: crate::node_link::Keepalive::default(),
        }
    }

    /// A lease for job `request_id`, bound to `node` and launching there.
    async fn launched_on(plane: &Plane, request_id: i64, node: &str) -> crate::ledger::Lease {
        let room = NodeCapacity {
            vcpu: 64,
            memory_bytes: 1 << 40,
        };
        let lease = plane
            .reserve(request_id, node, room)
            .await
            .expect("reserve");
        let now = crate::now_ms();
        plane
            .ledger
            .bind(&lease.id, lease.epoch, node, now)
            .await
            .expect("bind");
        plane
            .ledger
            .advance(&lease.id, lease.epoch, node, Phase::Launching, now)
            .await
            .expect("advance")
    }

    /// 7.N.10: GitHub's completion of a job reaches only the node its lease
    /// is bound to, with GitHub's result; another attached node (listed
    /// first, and holding a lease of its own) hears nothing.
    #[tokio::test]
    async fn a_completion_is_sent_only_to_the_node_holding_the_job() {
        let (plane, _emulator) = plane(&["node-a", "node-b"]).await;
        let (_tx_a, mut rx_a) = plane.nodes[0].attach_for_test(1, 16);
        let (tx_b, mut rx_b) = plane.nodes[1].attach_for_test(1, 16);
        let _other = launched_on(&plane, 4, "node-a").await;
        let lease = launched_on(&plane, 5, "node-b").await;
        let mut events = plane.subscribe();

        let completing = tokio::spawn({
            let plane = Arc::clone(&plane);
            let runner = format!("billet-{}", lease.id);
            async move {
                plane
                    .complete(runner, "succeeded".into(), CancellationToken::new())
                    .await;
            }
        });
        let command = match tokio::time::timeout(Duration::from_secs(5), rx_b.recv())
            .await
            .expect("node-b was sent something")
            .and_then(|m| m.body)
        {
            Some(pb::plane_message::Body::Command(c)) => c,
            other => panic!("expected a command for node-b, got {other:?}"),
        };
        assert_eq!(
            command.kind,
            Some(pb::command::Kind::Destroy(pb::Destroy {
                request_id: 5,
                job_result: Some("succeeded".into()),
                force: false,
                reason: String::new(),
            }))
        );
        plane.nodes[1]
            .answer_for_test(
                pb::CommandResult {
                    id: command.id.clone(),
                    outcome: pb::Outcome::Ok.into(),
                    custody: false,
                    error: None,
                    instances: None,
                },
                &tx_b,
            )
            .await;
        tokio::time::timeout(Duration::from_secs(5), completing)
            .await
            .expect("the completion finished")
            .expect("complete");

        assert!(
            rx_a.try_recv().is_err(),
            "node-a, which does not hold the job, was sent a command"
        );
        let released = plane
            .ledger
            .get(&lease.id)
            .await
            .expect("read")
            .expect("lease");
        assert_eq!(released.phase, Phase::Done);
        let mut saw_release = false;
        while let Ok(event) = events.try_recv() {
            saw_release |= event
                == PlaneEvent::Released {
                    lease: lease.id.clone(),
                    outcome: "done".into(),
                };
        }
        assert!(saw_release, "no Released event for the completed lease");
    }

    /// A registration whose lease ended more than the grace ago is
    /// removed at GitHub; one GitHub no longer has is remembered as
    /// gone and not asked about again.
    #[tokio::test]
    async fn a_registration_that_outlived_its_lease_is_removed_once() {
        let (plane, emulator) = plane(&["node-a"]).await;
        plane.github.ensure_scale_set("linux").await.expect("set");
        let lease = launched_on(&plane, 4, "node-a").await;
        let minted = plane
            .github
            .mint("linux", &format!("billet-{}", lease.id))
            .await
            .expect("mint");
        plane
            .ledger
            .set_runner(
                &lease.id,
                lease.epoch,
                minted.runner_id,
                &minted.runner_name,
            )
            .await
            .expect("set runner");
        plane
            .ledger
            .release(
                &lease.id,
                lease.epoch,
                Some("node-a"),
                Phase::Failed,
                crate::now_ms(),
            )
            .await
            .expect("release");
        assert_eq!(emulator.state().runners.len(), 1);
        let mut memory = Registrations::default();
        let shutdown = CancellationToken::new();
        // Within the grace nothing is touched.
        plane
            .registrations_once(&mut memory, &shutdown)
            .await
            .expect("pass");
        assert_eq!(
            emulator.state().runners.len(),
            1,
            "removed within the grace"
        );
        let mut config = plane.config.clone();
        config.registration_grace = Duration::ZERO;
        let plane = Plane {
            config,
            ledger: Arc::clone(&plane.ledger),
            github: Arc::clone(&plane.github),
            nodes: plane.nodes.clone(),
            events: broadcast::channel(4).0,
            managed: Mutex::new(HashSet::new()),
            cover: Mutex::new(Cover::recovering(Vec::new())),
            wake: Notify::new(),
            pass: tokio::sync::Mutex::new(()),
            scale_set: Mutex::new(scaleset::ScaleSetId(1)),
            tasks: TaskTracker::new(),
        };
        plane
            .registrations_once(&mut memory, &shutdown)
            .await
            .expect("pass");
        assert!(
            emulator.state().runners.is_empty(),
            "the registration was left"
        );
        let asked = emulator.requests().len();
        plane
            .registrations_once(&mut memory, &shutdown)
            .await
            .expect("pass");
        assert_eq!(
            emulator.requests().len(),
            asked,
            "a gone registration was asked about again"
        );
    }

    /// A mint GitHub answered but the ledger refused to record (the lease
    /// ended meanwhile), whose immediate removal failed too, leaves a
    /// registration no lease names by id: the pass finds it by its name
    /// once the lease has ended, removes it, and asks no more.
    #[tokio::test]
    async fn a_registration_the_ledger_never_recorded_is_found_by_name_and_removed() {
        let (plane, emulator) = plane_configured(&["node-a"], |c| {
            c.registration_grace = Duration::ZERO;
        })
        .await;
        plane.github.ensure_scale_set("linux").await.expect("set");
        let lease = launched_on(&plane, 5, "node-a").await;
        plane
            .github
            .mint("linux", &format!("billet-{}", lease.id))
            .await
            .expect("mint");
        plane
            .ledger
            .release(
                &lease.id,
                lease.epoch,
                Some("node-a"),
                Phase::Failed,
                crate::now_ms(),
            )
            .await
            .expect("release");
        assert_eq!(emulator.state().runners.len(), 1);
        let mut memory = Registrations::default();
        let shutdown = CancellationToken::new();
        plane
            .registrations_once(&mut memory, &shutdown)
            .await
            .expect("pass");
        assert!(
            emulator.state().runners.is_empty(),
            "the unrecorded registration was left: {:?}",
            emulator.state().runners
        );
        let asked = emulator.requests().len();
        plane
            .registrations_once(&mut memory, &shutdown)
            .await
            .expect("pass");
        assert_eq!(emulator.requests().len(), asked, "asked about it again");
    }

    /// Five jobs assigned at once get five leases in one pass, one per job
    /// (a node refuses a second lease for a request it already runs), and
    /// never more than the set's maximum.
    #[tokio::test]
    async fn one_pass_covers_each_assigned_job_with_its_own_lease_up_to_the_sets_maximum() {
        let (plane, _emulator) = plane(&["node-a"]).await;
        plane.github.ensure_scale_set("linux").await.expect("set");
        let (_tx, mut rx) = plane.nodes[0].attach_for_test(1, 64);
        plane
            .cover
            .lock()
            .expect("cover")
            .wanted
            .extend([11, 12, 13, 14, 15]);
        Arc::clone(&plane).cover_once().await.expect("pass");
        let mut requests = Vec::new();
        for _ in 0..5 {
            let body = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("a launch")
                .and_then(|m| m.body);
            let Some(pb::plane_message::Body::Command(pb::Command {
                kind: Some(pb::command::Kind::Launch(launch)),
                ..
            })) = body
            else {
                panic!("expected a launch, got {body:?}");
            };
            requests.push(launch.lease.expect("lease").request_id);
        }
        requests.sort_unstable();
        assert_eq!(requests, [11, 12, 13, 14, 15]);
        // Covered: another pass launches nothing more.
        Arc::clone(&plane).cover_once().await.expect("pass");
        assert!(
            tokio::time::timeout(Duration::from_millis(300), rx.recv())
                .await
                .is_err(),
            "a covered job was launched again"
        );
        // The set's maximum (10 here) bounds coverage, however many wait.
        plane.cover.lock().expect("cover").wanted.extend(100..200);
        Arc::clone(&plane).cover_once().await.expect("pass");
        assert_eq!(plane.ledger.charged().await.expect("charged").leases, 10);
    }

    /// A degraded node is never picked, and a node is never given more
    /// than its capacity less what it says it holds, even when the ledger
    /// charges it nothing (compute it adopted). A tier larger than every
    /// node must not wait for ever behind "no attached node has room",
    /// which reads like a node briefly full: the plane says the tier fits
    /// no node, and which is largest.
    #[tokio::test]
    async fn a_tier_larger_than_every_node_is_named_as_such_not_as_a_full_node() {
        let (large, _emulator) = plane_configured(&["node-a", "node-b"], |c| {
            c.tier.memory_bytes = 128 << 30;
        })
        .await;
        assert_eq!(large.too_large_for_every_node(), None, "no node attached");
        let (_tx_a, _rx_a) = large.nodes[0].attach_for_test(1, 16);
        let (_tx_b, _rx_b) = large.nodes[1].attach_for_test(1, 16);
        let why = large
            .too_large_for_every_node()
            .expect("a 128 GiB tier on 64 GiB nodes fits none");
        assert!(
            why.contains("more than any attached node has in all")
                && why.contains("131072 MiB")
                && why.contains("65536 MiB"),
            "{why}"
        );
        let (small, _emulator) = plane(&["node-a"]).await;
        let (_tx, _rx) = small.nodes[0].attach_for_test(1, 16);
        assert_eq!(small.too_large_for_every_node(), None, "the tier fits");
    }

    #[tokio::test]
    async fn pick_node_skips_a_degraded_node_and_counts_what_the_node_says_it_holds() {
        let (plane, _emulator) = plane(&["node-a", "node-b"]).await;
        let (_tx_a, _rx_a) = plane.nodes[0].attach_for_test(1, 16);
        let (_tx_b, _rx_b) = plane.nodes[1].attach_for_test(1, 16);
        let none = HashMap::new();
        let picked = |charged: &HashMap<String, (u64, u64)>| {
            plane.pick_node(charged, &none).map(|n| n.name().to_owned())
        };
        // Both have 64 vCPU free; b holds 60 of them: a has more room.
        plane.nodes[1].report_for_test(
            pb::Capacity {
                vcpu: 60,
                memory_bytes: 1 << 30,
            },
            false,
        );
        assert_eq!(picked(&HashMap::new()).as_deref(), Some("node-a"));
        // a degraded: only b, while it has room for one more (1 vCPU).
        plane.nodes[0].report_for_test(pb::Capacity::default(), true);
        assert_eq!(picked(&HashMap::new()).as_deref(), Some("node-b"));
        // b holds all it has: nothing fits, whatever the ledger charges.
        plane.nodes[1].report_for_test(
            pb::Capacity {
                vcpu: 64,
                memory_bytes: 1 << 30,
            },
            false,
        );
        assert_eq!(picked(&HashMap::new()), None);
        // The ledger's charge counts too when it is the larger.
        plane.nodes[0].report_for_test(pb::Capacity::default(), false);
        let full = HashMap::from([("node-a".to_owned(), (64, 0))]);
        assert_eq!(picked(&full), None);
    }

    /// What a node reports in `Instances` or `Sweep` replaces what it
    /// said in `Hello`.
    #[tokio::test]
    async fn a_sweep_report_updates_what_the_plane_believes_the_node_holds() {
        let (plane, _emulator) = plane(&["node-a"]).await;
        let (tx, _rx) = plane.nodes[0].attach_for_test(1, 16);
        let held = pb::Capacity {
            vcpu: 3,
            memory_bytes: 3 << 30,
        };
        plane.nodes[0]
            .answer_for_test(
                pb::CommandResult {
                    id: "sweep-1".into(),
                    outcome: pb::Outcome::Ok.into(),
                    instances: Some(pb::InstanceReport {
                        inventory_known: true,
                        held: Some(held),
                        capacity: Some(pb::Capacity {
                            vcpu: 4,
                            memory_bytes: 4 << 30,
                        }),
                        ..Default::default()
                    }),
                    ..Default::default()
                },
                &tx,
            )
            .await;
        let status = plane.nodes[0].status().borrow().clone().expect("attached");
        assert_eq!(status.held, held);
        assert_eq!(status.capacity.vcpu, 4);
        // One vCPU left, and the tier needs one: still placeable, once.
        let none = HashMap::new();
        assert!(plane.pick_node(&HashMap::new(), &none).is_some());
        let one_more = HashMap::from([("node-a".to_owned(), (4, 0))]);
        assert!(plane.pick_node(&one_more, &none).is_none());
    }

    /// A plane that runs with `config` on `emulator`'s GitHub, dialing no
    /// node (`config.nodes` is empty), until `shutdown`.
    async fn started(
        config: &PlaneConfig,
        emulator: &scaleset::testing::Emulator,
        shutdown: &CancellationToken,
    ) -> Arc<Plane> {
        Plane::start(config.clone(), emulator.client(), shutdown.clone())
            .await
            .expect("start the plane")
    }

    /// Waits up to 20 s for `plane` to want exactly `jobs`, then for
    /// GitHub's queue to be drained (every message acknowledged).
    async fn wait_wanted(
        plane: &Plane,
        emulator: &scaleset::testing::Emulator,
        jobs: &[scaleset::JobRequestId],
    ) {
        let mut want: Vec<i64> = jobs.iter().map(|j| j.get()).collect();
        want.sort_unstable();
        let deadline = Instant::now() + Duration::from_secs(20);
        while plane.uncovered_jobs() != want || !emulator.state().queues_drained() {
            assert!(
                Instant::now() < deadline,
                "the plane wants {:?}, not {want:?}; GitHub: {:?}",
                plane.uncovered_jobs(),
                emulator.state()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// A fresh SQLite ledger file in the temp directory.
    fn ledger_file() -> std::path::PathBuf {
        std::env::temp_dir().join(format!("billet-plane-test-{}.db", uuid::Uuid::new_v4()))
    }

    /// A plane's restart, at the plane: jobs assigned and acknowledged by
    /// one plane, which no runner took, are wanted by the plane started
    /// after it on the same ledger, and a job GitHub then cancels is
    /// wanted no more, by either the set in memory or the ledger.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_plane_started_again_wants_the_jobs_its_predecessor_acknowledged() {
        let emulator = scaleset::testing::Emulator::builder()
            .long_poll(Duration::from_millis(200))
            .start()
            .await;
        let file = ledger_file();
        let mut config = test_config(&[]);
        config.ledger = crate::ledger::LedgerLocation::Sqlite(file.clone());
        let first_shutdown = CancellationToken::new();
        let first = started(&config, &emulator, &first_shutdown).await;
        let jobs: Vec<_> = (0..2)
            .map(|_| emulator.queue_job(first.scale_set(), ["linux"]))
            .collect();
        wait_wanted(&first, &emulator, &jobs).await;
        first_shutdown.cancel();
        first.stopped().await;
        first.ledger().close().await;

        let shutdown = CancellationToken::new();
        let second = started(&config, &emulator, &shutdown).await;
        wait_wanted(&second, &emulator, &jobs).await;
        emulator.complete_job(jobs[0], None);
        wait_wanted(&second, &emulator, &jobs[1..]).await;
        shutdown.cancel();
        second.stopped().await;
        second.ledger().close().await;

        let shutdown = CancellationToken::new();
        let third = started(&config, &emulator, &shutdown).await;
        wait_wanted(&third, &emulator, &jobs[1..]).await;
        shutdown.cancel();
        third.stopped().await;
        third.ledger().close().await;
        for suffix in ["", "-wal", "-shm"] {
            let mut path = file.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }

    /// A quiet poll forgets only recovered jobs, the earliest first, and
    /// only after two quiet polls in a row, with no message between, both
    /// count more wanted than GitHub says wait; one that counts no excess
    /// confirms what is left recovered.
    #[test]
    fn a_quiet_poll_forgets_only_recovered_jobs_and_only_twice_in_a_row() {
        let mut cover = Cover::recovering(vec![1, 2, 3]);
        cover.wanted.insert(4);
        assert!(
            cover.quiet_poll(2).is_empty(),
            "one quiet poll is not enough"
        );
        cover.message_seen();
        assert!(cover.quiet_poll(2).is_empty(), "a message came between");
        assert_eq!(
            cover.quiet_poll(3),
            vec![1],
            "the smaller excess of the two"
        );
        assert_eq!(cover.wanted, BTreeSet::from([2, 3, 4]));
        assert!(cover.quiet_poll(3).is_empty());
        assert!(cover.recovered.is_empty(), "confirmed");
        assert!(cover.quiet_poll(0).is_empty());
        assert!(cover.quiet_poll(0).is_empty());
        assert_eq!(
            cover.wanted,
            BTreeSet::from([2, 3, 4]),
            "never what it was told"
        );
    }

    /// A job recorded as wanted that ended while no plane listened, and
    /// whose message never reaches the new plane, is dropped once GitHub's
    /// statistics on quiet polls say fewer jobs wait; the job GitHub still
    /// has stays wanted.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_recovered_job_github_no_longer_counts_is_dropped_after_quiet_polls() {
        let emulator = scaleset::testing::Emulator::builder()
            .long_poll(Duration::from_millis(200))
            .start()
            .await;
        let file = ledger_file();
        let mut config = test_config(&[]);
        config.ledger = crate::ledger::LedgerLocation::Sqlite(file.clone());
        let shutdown = CancellationToken::new();
        let first = started(&config, &emulator, &shutdown).await;
        let set = first.scale_set().get();
        let job = emulator.queue_job(first.scale_set(), ["linux"]);
        wait_wanted(&first, &emulator, &[job]).await;
        shutdown.cancel();
        first.stopped().await;
        // A job recorded earlier whose completion no plane will hear of.
        first
            .ledger()
            .record_wanted("linux", set, &[WantedChange::Assigned(999_999)], 1)
            .await
            .expect("record");
        first.ledger().close().await;

        let shutdown = CancellationToken::new();
        let second = started(&config, &emulator, &shutdown).await;
        assert_eq!(second.uncovered_jobs(), vec![job.get(), 999_999]);
        wait_wanted(&second, &emulator, &[job]).await;
        let deadline = Instant::now() + Duration::from_secs(2);
        while Instant::now() < deadline {
            assert_eq!(second.uncovered_jobs(), vec![job.get()]);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert_eq!(
            second
                .ledger()
                .wanted_jobs("linux", set)
                .await
                .expect("read"),
            vec![job.get()]
        );
        shutdown.cancel();
        second.stopped().await;
        second.ledger().close().await;
        for suffix in ["", "-wal", "-shm"] {
            let mut path = file.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}
