//! The stand-in plane: receives job assignments and completions from the
//! scale-set listener, reserves a lease per assigned job, launches it on a
//! node with the tier's spec, destroys it with the job's result when GitHub
//! reports it complete, and releases the lease. Renews the leases it manages
//! itself, reaps expired ones, and exposes a library API for tests.
//!
//! # Layout
//!
//! [`Plane`] is one type; its methods are split by subject:
//!
//! - `mod.rs` (here): [`PlaneConfig`], [`Tier`], [`PlaneEvent`], the
//!   defaults, and [`Plane::start`] with the accessors tests use.
//! - `scaler.rs`: the scale-set listener and the messages it turns into
//!   wanted jobs.
//! - `coverage.rs`: keeping every wanted job covered by a runner, and where
//!   to place one.
//! - `launches.rs`: reserving, launching, and handing lost launches over.
//! - `teardown.rs`: the destroy after a completion, and scale-downs.
//! - `maintenance.rs`: `Tend` and `Sweep`, lease renewal, the reaper.
//! - `registrations.rs`: the pass that reconciles GitHub's registrations
//!   with the ledger.
//! - `warm.rs`: the warm runners each node is told to keep.
//! - `jobs.rs`: each job's record (messages, attempts, waits), the ends
//!   counted, stuck jobs, pruning; `metrics.rs`: the figures about jobs on
//!   `--metrics-listen`.

mod coverage;
mod jobs;
mod launches;
mod maintenance;
mod metrics;
mod registrations;
mod scaler;
mod teardown;
#[cfg(test)]
mod tests;
mod warm;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio::sync::{Notify, broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span, warn};

use crate::calls::CallHandler;
use crate::github::Github;
use crate::ledger::Ledger;
use crate::node_link::{NodeLink, NodeTarget, PlaneTls};

use coverage::Cover;

pub use jobs::{DEFAULT_JOB_RETENTION, DEFAULT_STUCK_AFTER, JobsConfig};
pub use registrations::REGISTRATION_LOST;
pub use teardown::ScaleDown;
pub use warm::WarmConfig;

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
    /// The oldest runner version the tier may run (`2.331.0`): a node
    /// refuses, before anything is minted, an image labelled older
    /// (`TierSpec.min_runner_version`). Empty: no minimum.
    pub min_runner_version: String,
}

/// The oldest `actions/runner` a tier runs unless the operator says
/// otherwise (`billet-plane --min-runner-version`): GitHub's own floor
/// moves (it refuses runners below a minimum, and releases older than 30
/// days), so an operator raises it as GitHub does (decision 114).
pub const DEFAULT_MIN_RUNNER_VERSION: &str = "2.330.0";

/// The runner version the stand-in runner plays, as its image's
/// `org.opencontainers.image.version` label says.
pub const STANDIN_RUNNER_VERSION: &str = "2.333.0";

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
    /// Mint a launch's runner registration before dispatching it, and send it
    /// in `Launch.registration`, to a node whose `Hello` said it takes one,
    /// that the plane does not see degraded, and whose last answered launch ran
    /// the tier's image (the node then creates beside its bind). The cost: a
    /// node that refuses the launch anyway (it became degraded, or lost the
    /// image, before the plane heard) finds a registration minted, which the
    /// plane then removes, where nothing should be minted for a refused launch;
    /// so `billet-plane` leaves this off unless asked. Off, or for an older
    /// node, the node mints through `MintJit` after its own checks.
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
    /// The warm runners each node keeps for the tier (none by default).
    pub warm: WarmConfig,
    /// How long job records are kept, and when a job is stuck.
    pub jobs: JobsConfig,
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
    /// A launch was answered `BUSY`: the node already holds a runner of
    /// the lease, at another epoch than the launch's. Nothing was started
    /// and nothing is ended; the lease stays open, covered by that runner.
    LaunchBusy {
        /// The lease.
        lease: String,
        /// The node.
        node: String,
        /// What the node said (both epochs).
        reason: String,
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

/// How often the plane compares registrations with open leases.
pub const REGISTRATION_INTERVAL: Duration = Duration::from_secs(60);

/// How long a registration may outlive its lease, or be missing at GitHub
/// under an idle runner, before the plane removes or destroys it.
pub const REGISTRATION_GRACE: Duration = Duration::from_secs(120);

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
    /// The jobs' waits and starts between passes (`jobs.rs`).
    jobs: Mutex<jobs::JobBook>,
    metrics: Arc<metrics::PlaneMetrics>,
    registry: Arc<prometheus_client::registry::Registry>,
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
        let (registry, metrics) = metrics::registry(&config.tier.label);
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
            jobs: Mutex::new(jobs::JobBook::default()),
            metrics,
            registry,
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
        plane
            .tasks
            .spawn(Arc::clone(&plane).keep_warm(shutdown.clone()));
        plane
            .tasks
            .spawn(Arc::clone(&plane).observe_ends(shutdown.clone()));
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

    /// Serves the plane's metrics (`GET /metrics`, `metrics.rs`) on
    /// `listener` until `shutdown`.
    pub fn serve_metrics(&self, listener: tokio::net::TcpListener, shutdown: CancellationToken) {
        self.tasks.spawn(
            metrics::serve(listener, self.registry.clone(), shutdown)
                .instrument(info_span!("metrics")),
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
