//! The stand-in plane: receives job assignments and completions from the
//! scale-set listener, reserves a lease per assigned job, launches it on a
//! node with the tier's spec, destroys it with the job's result when GitHub
//! reports it complete, and releases the lease. Renews the leases it manages
//! itself, reaps expired ones, and exposes a library API for tests.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use billet_proto::v1 as pb;
use scaleset::listener::{Event, Listener, Scaler};
use thiserror::Error;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, error, info, info_span, warn};

use crate::calls::{CallHandler, lease_to_wire};
use crate::github::Github;
use crate::ledger::{Ledger, NewLease, Phase};
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
}

/// Everything the plane needs.
#[derive(Debug, Clone)]
pub struct PlaneConfig {
    /// Deployment id sent in `Open`.
    pub deployment: String,
    /// Lease TTL.
    pub lease_ttl: Duration,
    /// The ledger's SQLite file.
    pub ledger_path: std::path::PathBuf,
    /// mTLS material.
    pub tls: PlaneTls,
    /// Nodes to dial.
    pub nodes: Vec<NodeTarget>,
    /// The tier every job of the scale set runs on.
    pub tier: Tier,
    /// How long a launch may wait in a node's queue and run.
    pub launch_timeout: Duration,
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
    },
    /// The launch failed; the outcome says how.
    LaunchFailed {
        /// The lease.
        lease: String,
        /// What the node said.
        reason: String,
        /// The node holds the lease.
        custody: bool,
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

/// How many leases the plane tries for one job before giving up on it.
pub const MAX_LAUNCH_ATTEMPTS: u32 = 3;

enum Work {
    Launch(crate::ledger::Lease),
    Complete { runner_name: String, result: String },
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
    /// node).
    managed: Mutex<HashSet<String>>,
    /// Leases whose node holds them after a lost launch reply.
    node_held: Mutex<HashSet<String>>,
    /// Job request ids already given a lease.
    seen: Mutex<HashSet<i64>>,
    /// Launch attempts per job request.
    attempts: Mutex<HashMap<i64, u32>>,
    /// Which node each launched lease went to.
    placement: Mutex<HashMap<String, String>>,
    scale_set: scaleset::ScaleSetId,
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
        let ledger = Arc::new(Ledger::open(&config.ledger_path, config.lease_ttl).await?);
        let github = Arc::new(Github::new(github));
        let scale_set = github.ensure_scale_set(&config.tier.label).await?;
        let nodes: Vec<_> = config.nodes.iter().cloned().map(NodeLink::new).collect();
        let (events, _) = broadcast::channel(1024);
        let plane = Arc::new(Plane {
            ledger: ledger.clone(),
            github: github.clone(),
            nodes,
            events,
            managed: Mutex::new(HashSet::new()),
            node_held: Mutex::new(HashSet::new()),
            seen: Mutex::new(HashSet::new()),
            attempts: Mutex::new(HashMap::new()),
            placement: Mutex::new(HashMap::new()),
            scale_set,
            tasks: TaskTracker::new(),
            config,
        });
        let calls = Arc::new(CallHandler::new(
            ledger,
            github,
            plane.config.quarantine_grace,
        ));
        let open = pb::Open {
            protocol_version: billet_proto::PROTOCOL_VERSION,
            deployment: plane.config.deployment.clone(),
            lease_ttl_ms: u64::try_from(plane.config.lease_ttl.as_millis()).unwrap_or(u64::MAX),
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
        Ok(plane)
    }

    /// The ledger.
    pub fn ledger(&self) -> &Ledger {
        &self.ledger
    }

    /// The scale set jobs are queued on.
    pub fn scale_set(&self) -> scaleset::ScaleSetId {
        self.scale_set
    }

    /// The link to a node by name.
    pub fn node(&self, name: &str) -> Option<&Arc<NodeLink>> {
        self.nodes.iter().find(|n| n.name() == name)
    }

    /// Subscribes to job events.
    pub fn subscribe(&self) -> broadcast::Receiver<PlaneEvent> {
        self.events.subscribe()
    }

    /// Waits for every task to stop after shutdown.
    pub async fn stopped(&self) {
        self.tasks.close();
        self.tasks.wait().await;
    }

    fn emit(&self, event: PlaneEvent) {
        let _ = self.events.send(event);
    }

    async fn listen(
        self: Arc<Self>,
        work: mpsc::UnboundedSender<Work>,
        shutdown: CancellationToken,
    ) {
        let mut scaler = PlaneScaler {
            plane: Arc::clone(&self),
            work,
        };
        let listener = Listener::new(
            self.github.client().clone(),
            self.scale_set,
            self.config.max_runners,
        )
        .owner("billet-plane")
        .backoff(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            match listener
                .run(&mut scaler, shutdown.clone().cancelled_owned())
                .await
            {
                Ok(()) => return,
                Err(e) => {
                    error!(error = %e, "scale-set listener stopped; restarting");
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                    }
                }
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
                Work::Launch(lease) => {
                    let span = info_span!("launch", lease = %lease.id);
                    self.tasks
                        .spawn(async move { plane.launch(lease).await }.instrument(span));
                }
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

    /// Picks the node with an open session and the fewest leases placed.
    fn pick_node(&self) -> Option<Arc<NodeLink>> {
        let placement = self.placement.lock().expect("placement");
        self.nodes
            .iter()
            .min_by_key(|n| {
                let attached = n.status().borrow().is_some();
                let load = placement
                    .values()
                    .filter(|p| p.as_str() == n.name())
                    .count();
                (!attached, load)
            })
            .cloned()
    }

    async fn launch(&self, lease: crate::ledger::Lease) {
        let Some(node) = self.pick_node() else {
            warn!("no node is configured");
            return;
        };
        let tier = &self.config.tier;
        let mut wire = lease_to_wire(&lease);
        wire.providers = vec!["docker".into()];
        let command = pb::command::Kind::Launch(pb::Launch {
            lease: Some(wire),
            tier: Some(pb::TierSpec {
                label: tier.label.clone(),
                image: tier.image.clone(),
                command: tier.command.clone(),
                trust: tier.trust.clone(),
                shm_bytes: 0,
                network: tier.network.clone(),
                env: tier.env.clone(),
            }),
            job: Some(pb::Job {
                request_id: lease.request_id,
                ..Default::default()
            }),
        });
        self.placement
            .lock()
            .expect("placement")
            .insert(lease.id.clone(), node.name().to_owned());
        let outcome = node.dispatch(command, self.config.launch_timeout).await;
        if outcome.is_ok() {
            info!(node = node.name(), "launched");
            self.emit(PlaneEvent::Launched {
                lease: lease.id.clone(),
                node: node.name().to_owned(),
            });
            return;
        }
        let custody = outcome.is_custody();
        let reason = outcome.describe();
        warn!(node = node.name(), %reason, custody, "launch did not succeed");
        self.emit(PlaneEvent::LaunchFailed {
            lease: lease.id.clone(),
            reason,
            custody,
        });
        self.managed.lock().expect("managed").remove(&lease.id);
        if custody {
            self.node_held
                .lock()
                .expect("held")
                .insert(lease.id.clone());
            return;
        }
        // Nothing was started: release, and try again with a new lease.
        if let Err(e) = self
            .ledger
            .release(&lease.id, lease.epoch, None, Phase::Failed, crate::now_ms())
            .await
        {
            warn!(error = %e, "release after a failed launch");
        }
        self.placement.lock().expect("placement").remove(&lease.id);
        let attempt = {
            let mut attempts = self.attempts.lock().expect("attempts");
            let n = attempts.entry(lease.request_id).or_insert(1);
            *n += 1;
            *n
        };
        if attempt > MAX_LAUNCH_ATTEMPTS {
            error!(
                request_id = lease.request_id,
                "giving up on this job after {MAX_LAUNCH_ATTEMPTS} launch attempts"
            );
            return;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
        match self.reserve(lease.request_id).await {
            Ok(next) => Box::pin(self.launch(next)).await,
            Err(e) => error!(error = %e, "reserve a lease to retry the launch"),
        }
    }

    /// Reserves a lease for a job request and starts renewing it.
    async fn reserve(
        &self,
        request_id: i64,
    ) -> Result<crate::ledger::Lease, crate::ledger::LedgerError> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let tier = &self.config.tier;
        let lease = self
            .ledger
            .reserve(
                NewLease {
                    id: id.clone(),
                    tier: tier.label.clone(),
                    request_id,
                    vcpu: tier.vcpu,
                    memory_bytes: tier.memory_bytes,
                    runner_name: Some(format!("billet-{id}")),
                },
                crate::now_ms(),
            )
            .await?;
        info!(lease = %id, request_id, "reserved a lease for an assigned job");
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
        if self.node_held.lock().expect("held").contains(&lease.id) {
            // The node holds it: the runner exits, Tend sees it gone and releases.
            info!(lease = %lease.id, "completion for a lease its node holds; the node will release it");
        }
        let Some(node) = lease.node.as_deref().and_then(|n| self.node(n)).cloned() else {
            warn!(lease = %lease.id, "completed lease is bound to no known node");
            return;
        };
        let mut backoff = Duration::from_millis(500);
        loop {
            let outcome = node
                .dispatch(
                    pb::command::Kind::Destroy(pb::Destroy {
                        request_id: lease.request_id,
                        job_result: Some(result.clone()),
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
            // A lost or failed destroy is repeated: destroys are idempotent.
            warn!(lease = %lease.id, outcome = %outcome.describe(), "destroy failed; retrying");
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(10));
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
                self.placement.lock().expect("placement").remove(&lease.id);
                self.emit(PlaneEvent::Released {
                    lease: lease.id.clone(),
                    outcome: "done".into(),
                });
            }
            Err(e) => warn!(lease = %lease.id, error = %e, "release after destroy"),
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
                        }
                        Ok(_) => {}
                        Err(e) => warn!(error = %e, "reap failed"),
                    }
                }
            }
        }
    }
}

/// Feeds listener events to the plane: a lease is reserved durably for each
/// newly assigned job before the message is acknowledged.
struct PlaneScaler {
    plane: Arc<Plane>,
    work: mpsc::UnboundedSender<Work>,
}

impl Scaler for PlaneScaler {
    type Error = crate::ledger::LedgerError;

    async fn scale(&mut self, event: Event<'_>) -> Result<(), Self::Error> {
        let Some(message) = event.message() else {
            return Ok(());
        };
        let plane = &self.plane;
        for job in message.jobs_assigned() {
            let request_id = job.job.runner_request_id.get();
            if !plane.seen.lock().expect("seen").insert(request_id) {
                continue;
            }
            let lease = plane.reserve(request_id).await?;
            let _ = self.work.send(Work::Launch(lease));
        }
        for job in message.jobs_started() {
            plane.emit(PlaneEvent::Started {
                request_id: job.job.runner_request_id.get(),
                runner_name: job.runner_name.clone(),
            });
        }
        for job in message.jobs_completed() {
            plane.emit(PlaneEvent::Completed {
                request_id: job.job.runner_request_id.get(),
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
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A plane over an in-memory ledger with links to `nodes`, none dialed:
    /// tests attach them with `NodeLink::attach_for_test`.
    async fn plane(nodes: &[&str]) -> (Arc<Plane>, scaleset::testing::Emulator) {
        let emulator = scaleset::testing::Emulator::builder().start().await;
        let lease_ttl = Duration::from_secs(60);
        let targets: Vec<NodeTarget> = nodes
            .iter()
            .map(|name| NodeTarget {
                name: (*name).into(),
                addr: "127.0.0.1:9".parse().expect("addr"),
            })
            .collect();
        let config = PlaneConfig {
            deployment: "dev".into(),
            lease_ttl,
            ledger_path: std::path::PathBuf::from(":memory:"),
            tls: PlaneTls {
                ca_pem: Vec::new(),
                cert_pem: Vec::new(),
                key_pem: Vec::new(),
            },
            nodes: targets.clone(),
            tier: Tier {
                label: "linux".into(),
                image: "billet-standin-runner:dev".into(),
                command: vec!["/run".into()],
                trust: "trusted".into(),
                vcpu: 1,
                memory_bytes: 1 << 20,
                network: String::new(),
                env: Vec::new(),
            },
            launch_timeout: Duration::from_secs(30),
            destroy_timeout: Duration::from_secs(30),
            reap_interval: Duration::from_secs(60),
            max_runners: 10,
            maintenance_interval: Duration::from_secs(60),
            quarantine_grace: crate::calls::QUARANTINE_GRACE,
        };
        let plane = Arc::new(Plane {
            ledger: Arc::new(Ledger::open_in_memory(lease_ttl).await.expect("ledger")),
            github: Arc::new(Github::new(emulator.client())),
            nodes: targets.into_iter().map(NodeLink::new).collect(),
            events: broadcast::channel(64).0,
            managed: Mutex::new(HashSet::new()),
            node_held: Mutex::new(HashSet::new()),
            seen: Mutex::new(HashSet::new()),
            attempts: Mutex::new(HashMap::new()),
            placement: Mutex::new(HashMap::new()),
            scale_set: scaleset::ScaleSetId(1),
            tasks: TaskTracker::new(),
            config,
        });
        (plane, emulator)
    }

    /// A lease for job `request_id`, bound to `node` and launching there.
    async fn launched_on(plane: &Plane, request_id: i64, node: &str) -> crate::ledger::Lease {
        let lease = plane.reserve(request_id).await.expect("reserve");
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
}
