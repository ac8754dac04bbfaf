//! A seeded, randomized end-to-end run of the plane's obligations: real
//! `billet node` processes over real mTLS, real Docker, the stub plane and
//! the scale-set emulator, driven through a schedule of random operations:
//! jobs queued, a node SIGKILLed (at once or mid-launch) and restarted,
//! launch results dropped on the plane's side of the link, GitHub answering
//! 5xx and 409, containers removed out of band (`docker rm -f`), time
//! passing.
//!
//! At every quiescent point (the schedule stops; a bounded wait until no
//! lease is reserved, launching or tearing down, no job waits assigned and
//! every listener message is acknowledged) the ledger's charged leases,
//! the deployment's containers and GitHub's registrations name the same
//! runners, and each node's own report of what it holds is what the ledger
//! charges on it. Throughout, no lease is ever ended while its container
//! runs. At the end every job completed exactly once, and no container,
//! registration or charged capacity is left.
//!
//! `BILLET_E2E_SEED` replays a seed (printed at the start: the schedule is
//! the seed's; the timing is the machine's), `BILLET_E2E_OPS` sets the
//! number of operations (40 by default). A failure prints the seed, the
//! operations so far and the difference between the three views.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::ledger::{Lease, Phase};
use billet_controlplane_stub::node_link::CommandOutcome;
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions, Starts, wait_until};
use scaleset::testing::{Endpoint, Fault, JobState};

/// Operations when `BILLET_E2E_OPS` is not set: about 40, a run sized
/// for CI.
const DEFAULT_OPS: usize = 40;
/// A quiescent point at least every this many operations.
const QUIESCE_EVERY: usize = 10;
/// How long the run may take to reach a quiescent point: a launch's
/// backoff reaches 15 s and a dropped result costs the launch timeout
/// (20 s), and the shared machine can be ten times oversubscribed (the
/// ledger's writer was seen waiting 12 s for its connection there).
const QUIESCE_WITHIN: Duration = Duration::from_secs(180);
/// The nodes.
const NODES: [&str; 2] = ["node-1", "node-2"];

/// A seeded SplitMix64 (the same generator as the simulation's), so a seed
/// names one schedule on every machine.
#[derive(Debug, Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Self {
        Self(seed ^ 0x5DEE_CE66_D1CE_4E5B)
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `lo..=hi`.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// An index chosen with the given weights.
    fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut roll = self.next_u64() % total;
        for (i, w) in weights.iter().enumerate() {
            if roll < *w {
                return i;
            }
            roll -= w;
        }
        unreachable!("the roll is below the total")
    }
}

/// One operation of the schedule.
#[derive(Debug, Clone)]
enum Op {
    /// Queue this many jobs on the scale set.
    Queue(usize),
    /// SIGKILL the node (once one of its launches is in flight, if
    /// `mid_launch` and one comes within a few seconds), leave it down for
    /// `down_ms`, restart it and wait until it is attached again.
    Kill {
        node: &'static str,
        mid_launch: bool,
        down_ms: u64,
    },
    /// The plane drops the node's next `n` launch results on receipt.
    DropLaunchResults { node: &'static str, n: u64 },
    /// The plane breaks its session with the node instead of taking the
    /// next `n` destroy results (the node ran the destroy; the plane never
    /// hears how it went).
    CutOnDestroyResults { node: &'static str, n: u64 },
    /// GitHub answers `status` to the next `times` requests to `endpoint`
    /// (the client retries 5xx four times, so small counts are absorbed).
    Github {
        endpoint: Endpoint,
        status: u16,
        times: u32,
    },
    /// `docker rm -f` one of the deployment's containers, chosen by `pick`
    /// among those there are; a job its runner was running is failed, as
    /// GitHub does once it notices the runner lost.
    RemoveContainer { pick: u64 },
    /// Let time pass.
    Pause { ms: u64 },
    /// Stop and check a quiescent point.
    Quiesce,
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Queue(n) => write!(f, "queue {n} job(s)"),
            Op::Kill {
                node,
                mid_launch,
                down_ms,
            } => write!(
                f,
                "SIGKILL {node}{} and restart it after {down_ms} ms",
                if *mid_launch { " mid-launch" } else { "" }
            ),
            Op::DropLaunchResults { node, n } => {
                write!(f, "drop {node}'s next {n} launch result(s)")
            }
            Op::CutOnDestroyResults { node, n } => {
                write!(f, "cut {node}'s session on its next {n} destroy result(s)")
            }
            Op::Github {
                endpoint,
                status,
                times,
            } => write!(
                f,
                "GitHub answers {status} to {times} {endpoint:?} request(s)"
            ),
            Op::RemoveContainer { pick } => write!(f, "docker rm -f a container (pick {pick})"),
            Op::Pause { ms } => write!(f, "pause {ms} ms"),
            Op::Quiesce => write!(f, "quiescent point"),
        }
    }
}

/// The schedule of `seed`: `ops` operations, a quiescent point at least
/// every [`QUIESCE_EVERY`], and one at the end.
fn schedule(seed: u64, ops: usize) -> Vec<Op> {
    let mut rng = Rng::new(seed);
    let mut plan = Vec::with_capacity(ops + ops / QUIESCE_EVERY + 1);
    let mut since_quiesce = 0;
    for _ in 0..ops {
        let op = match rng.weighted(&[30, 9, 9, 8, 5, 8, 18, 4, 4]) {
            0 => Op::Queue(usize::try_from(rng.range(1, 3)).unwrap_or(1)),
            1 => Op::Kill {
                node: NODES[usize::try_from(rng.range(0, 1)).unwrap_or(0)],
                mid_launch: rng.range(0, 1) == 1,
                // One kill in five outlasts the renewal grace and the
                // lease TTL: the node's leases are quarantined meanwhile.
                down_ms: if rng.range(0, 4) == 0 {
                    rng.range(22_000, 28_000)
                } else {
                    rng.range(0, 6000)
                },
            },
            2 => Op::DropLaunchResults {
                node: NODES[usize::try_from(rng.range(0, 1)).unwrap_or(0)],
                n: rng.range(1, 2),
            },
            3 => {
                let endpoints = [
                    Endpoint::GenerateJitConfig,
                    Endpoint::GetMessage,
                    Endpoint::AcquireJobs,
                    Endpoint::DeleteMessage,
                    Endpoint::Runners,
                ];
                Op::Github {
                    endpoint: endpoints[usize::try_from(rng.range(0, 4)).unwrap_or(0)],
                    status: [500, 502, 503][usize::try_from(rng.range(0, 2)).unwrap_or(0)],
                    times: u32::try_from(rng.range(1, 10)).unwrap_or(1),
                }
            }
            4 => {
                // A 409 is not retried by the client: each one is an answer.
                let endpoints = [
                    Endpoint::GenerateJitConfig,
                    Endpoint::AcquireJobs,
                    Endpoint::Runners,
                ];
                Op::Github {
                    endpoint: endpoints[usize::try_from(rng.range(0, 2)).unwrap_or(0)],
                    status: 409,
                    times: u32::try_from(rng.range(1, 3)).unwrap_or(1),
                }
            }
            5 => Op::RemoveContainer {
                pick: rng.next_u64(),
            },
            6 => Op::Pause {
                ms: rng.range(200, 3000),
            },
            7 => Op::CutOnDestroyResults {
                node: NODES[usize::try_from(rng.range(0, 1)).unwrap_or(0)],
                n: 1,
            },
            _ => Op::Quiesce,
        };
        since_quiesce = if matches!(op, Op::Quiesce) {
            0
        } else {
            since_quiesce + 1
        };
        plan.push(op);
        if since_quiesce == QUIESCE_EVERY {
            plan.push(Op::Quiesce);
            since_quiesce = 0;
        }
    }
    if !matches!(plan.last(), Some(Op::Quiesce)) {
        plan.push(Op::Quiesce);
    }
    plan
}

/// What the run did, for the failure report.
#[derive(Debug, Default)]
struct Journal {
    start: Option<Instant>,
    lines: Vec<String>,
}

impl Journal {
    fn note(&mut self, line: impl fmt::Display) {
        let start = *self.start.get_or_insert_with(Instant::now);
        let line = format!("[{:7.1}s] {line}", start.elapsed().as_secs_f64());
        eprintln!("random_e2e: {line}");
        self.lines.push(line);
    }
}

/// The leases whose launch the plane has sent and not heard the end of
/// (reserved, neither launched nor failed yet), from the plane's events.
#[derive(Clone, Default)]
struct InFlight(Arc<Mutex<BTreeSet<String>>>);

impl InFlight {
    fn watch(cluster: &Cluster) -> Self {
        let in_flight = Self::default();
        let mut events = cluster.plane.subscribe();
        let set = Arc::clone(&in_flight.0);
        tokio::spawn(async move {
            loop {
                match events.recv().await {
                    Ok(PlaneEvent::Reserved { lease, .. }) => {
                        set.lock().expect("in flight").insert(lease);
                    }
                    Ok(
                        PlaneEvent::Launched { lease, .. } | PlaneEvent::LaunchFailed { lease, .. },
                    ) => {
                        set.lock().expect("in flight").remove(&lease);
                    }
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        in_flight
    }

    /// The in-flight leases still open in the ledger (one the ledger
    /// ended is not in flight, whatever events were missed).
    fn open(&self, open: &[Lease]) -> Vec<String> {
        let ids: BTreeSet<&str> = open.iter().map(|l| l.id.as_str()).collect();
        self.0
            .lock()
            .expect("in flight")
            .iter()
            .filter(|id| ids.contains(id.as_str()))
            .cloned()
            .collect()
    }
}

/// Watches, every 300 ms, that no lease is ended while its container
/// runs: the ledger is read first, then Docker, so a container seen
/// running after its lease was read ended outlived the lease.
fn watch_freed_while_running(cluster: &Cluster) -> Arc<Mutex<Vec<String>>> {
    let violations: Arc<Mutex<Vec<String>>> = Arc::default();
    let plane = Arc::clone(&cluster.plane);
    let docker = cluster.docker.clone();
    let deployment = cluster.deployment.clone();
    let found = Arc::clone(&violations);
    tokio::spawn(async move {
        loop {
            tokio::time::sleep(Duration::from_millis(300)).await;
            let Ok(leases) = plane.ledger().leases().await else {
                continue;
            };
            let Ok(running) = running_containers(&docker, &deployment).await else {
                continue;
            };
            for lease in leases.iter().filter(|l| l.phase.is_terminal()) {
                let name = format!("billet-{}", lease.id);
                if running.contains(&name) {
                    found.lock().expect("violations").push(format!(
                        "lease {} ended {} while its container {name} runs: {lease:?}",
                        lease.id, lease.phase
                    ));
                }
            }
        }
    });
    violations
}

async fn running_containers(
    docker: &bollard::Docker,
    deployment: &str,
) -> Result<BTreeSet<String>> {
    let filters: HashMap<String, Vec<String>> = HashMap::from([
        (
            "label".to_owned(),
            vec![format!("sh.billet.deployment={deployment}")],
        ),
        ("status".to_owned(), vec!["running".to_owned()]),
    ]);
    let list = docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        }))
        .await?;
    Ok(list
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .map(|n| n.trim_start_matches('/').to_owned())
        .collect())
}

/// The three views of what runs, by runner name (`billet-<lease>`).
#[derive(Debug, PartialEq, Eq)]
struct Views {
    /// Leases the ledger charges (open, quarantine included), with phases.
    charged: BTreeMap<String, String>,
    /// The deployment's containers, any state.
    containers: BTreeSet<String>,
    /// GitHub's registrations, with the job each runs.
    registrations: BTreeMap<String, Option<i64>>,
}

impl Views {
    async fn read(cluster: &Cluster) -> Result<Self> {
        let leases = cluster.plane.ledger().open_leases().await?;
        let containers: BTreeSet<String> = cluster.containers().await?.into_iter().collect();
        let state = cluster.emulator.state();
        Ok(Self {
            charged: leases
                .iter()
                .map(|l| (runner_name(l), l.phase.to_string()))
                .collect(),
            containers,
            registrations: state
                .runners
                .iter()
                .map(|r| (r.name.clone(), r.job.map(|j| j.get())))
                .collect(),
        })
    }

    fn agree(&self) -> bool {
        let charged: BTreeSet<&String> = self.charged.keys().collect();
        let containers: BTreeSet<&String> = self.containers.iter().collect();
        let registrations: BTreeSet<&String> = self.registrations.keys().collect();
        charged == containers && containers == registrations
    }

    /// Each name some view lacks, with what the others say of it.
    fn diff(&self) -> String {
        let all: BTreeSet<&String> = self
            .charged
            .keys()
            .chain(self.containers.iter())
            .chain(self.registrations.keys())
            .collect();
        let mut out = String::new();
        for name in all {
            let lease = self.charged.get(name);
            let container = self.containers.contains(name);
            let registration = self.registrations.get(name);
            if lease.is_some() && container && registration.is_some() {
                continue;
            }
            out.push_str(&format!(
                "  {name}: ledger {}, container {}, registration {}\n",
                lease.map_or("not charged".to_owned(), |p| format!("charged ({p})")),
                if container { "present" } else { "absent" },
                match registration {
                    None => "absent".to_owned(),
                    Some(None) => "idle".to_owned(),
                    Some(Some(job)) => format!("running job {job}"),
                }
            ));
        }
        if out.is_empty() {
            out.push_str("  (the three views agree)\n");
        }
        out
    }
}

fn runner_name(lease: &Lease) -> String {
    lease
        .runner_name
        .clone()
        .unwrap_or_else(|| format!("billet-{}", lease.id))
}

/// Whether the run is quiescent: no launch sent and not answered, no lease
/// reserved or tearing down, no job waiting to be taken, every listener
/// message acknowledged. (A lease stays `launching` in the ledger while its
/// runner waits for a job and while it runs one: the stand-in never tells
/// the node more. That is a steady state.) Returns what still moves.
async fn moving(cluster: &Cluster, in_flight: &InFlight) -> Result<Option<String>> {
    let leases = cluster.plane.ledger().open_leases().await?;
    let launches = in_flight.open(&leases);
    if !launches.is_empty() {
        return Ok(Some(format!("launches not answered yet: {launches:?}")));
    }
    let transient: Vec<String> = leases
        .iter()
        .filter(|l| matches!(l.phase, Phase::Capacity | Phase::Assigned | Phase::Teardown))
        .map(|l| format!("{} {}", l.id, l.phase))
        .collect();
    if !transient.is_empty() {
        return Ok(Some(format!(
            "leases reserved or tearing down: {transient:?}"
        )));
    }
    let state = cluster.emulator.state();
    let waiting: Vec<i64> = state
        .jobs
        .iter()
        .filter(|j| j.state == JobState::Assigned || j.state == JobState::Available)
        .map(|j| j.id.get())
        .collect();
    if !waiting.is_empty() {
        return Ok(Some(format!("jobs not taken yet: {waiting:?}")));
    }
    if !state.queues_drained() {
        return Ok(Some(format!(
            "listener messages not acknowledged: {:?}, undelivered {:?}",
            state.unacknowledged, state.undelivered
        )));
    }
    Ok(None)
}

/// Each attached node's own report of what it holds against what the
/// ledger charges on it.
async fn held_matches_charged(cluster: &Cluster) -> Result<Vec<String>> {
    let mut mismatches = Vec::new();
    for name in NODES {
        let Some(link) = cluster.plane.node(name) else {
            continue;
        };
        if link.status().borrow().is_none() {
            continue;
        }
        let outcome = link
            .dispatch(
                billet_proto::v1::command::Kind::Instances(billet_proto::v1::Instances {}),
                Duration::from_secs(10),
            )
            .await;
        let CommandOutcome::Answered(result) = outcome else {
            mismatches.push(format!("{name} did not answer Instances: {outcome:?}"));
            continue;
        };
        let report = result.instances.context("an instance report")?;
        let held = report.held.unwrap_or_default();
        let charged = cluster.plane.ledger().charged_on(name).await?;
        if (u64::from(held.vcpu), held.memory_bytes) != (charged.vcpu, charged.memory_bytes) {
            mismatches.push(format!(
                "{name} says it holds {} vCPU / {} bytes, the ledger charges it {} / {}",
                held.vcpu, held.memory_bytes, charged.vcpu, charged.memory_bytes
            ));
        }
    }
    Ok(mismatches)
}

/// The run's state of mind.
struct Run {
    cluster: Cluster,
    starts: Starts,
    in_flight: InFlight,
    journal: Journal,
    freed_while_running: Arc<Mutex<Vec<String>>>,
    /// Every job queued.
    jobs: Vec<scaleset::JobRequestId>,
    /// Jobs whose runner's container the run removed while it ran them,
    /// and which the run (as GitHub) then failed.
    lost: BTreeSet<i64>,
    quiescent_points: usize,
}

impl Run {
    async fn apply(&mut self, op: &Op) -> Result<()> {
        match op {
            Op::Queue(n) => {
                let queued = self.cluster.queue_jobs(*n);
                self.journal.note(format_args!(
                    "  queued {:?}",
                    queued.iter().map(|j| j.get()).collect::<Vec<_>>()
                ));
                self.jobs.extend(queued);
            }
            Op::Kill {
                node,
                mid_launch,
                down_ms,
            } => {
                if *mid_launch {
                    let deadline = Instant::now() + Duration::from_secs(5);
                    while Instant::now() < deadline {
                        let launching = self
                            .cluster
                            .plane
                            .ledger()
                            .open_leases()
                            .await?
                            .iter()
                            .any(|l| {
                                l.phase == Phase::Launching && l.node.as_deref() == Some(node)
                            });
                        if launching {
                            self.journal.note("  a launch is in flight on it");
                            break;
                        }
                        tokio::time::sleep(Duration::from_millis(50)).await;
                    }
                }
                let process = self.cluster.nodes.get_mut(*node).context("node")?;
                process.kill().await?;
                // The schedule's own time: the node stays down this long.
                tokio::time::sleep(Duration::from_millis(*down_ms)).await;
                process.restart().await?;
                self.cluster
                    .wait_attached(node, Duration::from_secs(60))
                    .await?;
                self.journal
                    .note(format_args!("  {node} is attached again"));
            }
            Op::DropLaunchResults { node, n } => {
                self.cluster
                    .plane
                    .node(node)
                    .context("node")?
                    .faults
                    .drop_launch_results
                    .fetch_add(*n, Ordering::SeqCst);
            }
            Op::CutOnDestroyResults { node, n } => {
                self.cluster
                    .plane
                    .node(node)
                    .context("node")?
                    .faults
                    .cut_on_destroy_results
                    .fetch_add(*n, Ordering::SeqCst);
            }
            Op::Github {
                endpoint,
                status,
                times,
            } => {
                self.cluster
                    .emulator
                    .inject(Fault::status(*endpoint, *status).times(*times));
            }
            Op::RemoveContainer { pick } => self.remove_container(*pick).await?,
            Op::Pause { ms } => {
                // The schedule's own time passing, not a synchronisation.
                tokio::time::sleep(Duration::from_millis(*ms)).await;
            }
            Op::Quiesce => self.quiesce().await?,
        }
        Ok(())
    }

    async fn remove_container(&mut self, pick: u64) -> Result<()> {
        let containers = self.cluster.containers().await?;
        if containers.is_empty() {
            self.journal.note("  no container to remove");
            return Ok(());
        }
        let mut containers = containers;
        containers.sort();
        let name = &containers[usize::try_from(pick % containers.len() as u64).unwrap_or(0)];
        let removed = self
            .cluster
            .docker
            .remove_container(
                name,
                Some(bollard::query_parameters::RemoveContainerOptions {
                    force: true,
                    ..Default::default()
                }),
            )
            .await;
        self.journal.note(format_args!(
            "  removed {name}: {:?}",
            removed.map(|()| "ok")
        ));
        // GitHub notices a runner lost mid-job and fails its job; the
        // emulator leaves that to its caller.
        let state = self.cluster.emulator.state();
        if let Some(job) = state
            .runners
            .iter()
            .find(|r| r.name == *name)
            .and_then(|r| r.job)
        {
            self.cluster.emulator.complete_job(job, Some("failed"));
            self.lost.insert(job.get());
            self.journal.note(format_args!(
                "  its runner was running job {job}: GitHub fails it"
            ));
        }
        Ok(())
    }

    /// A quiescent point: the faults end (GitHub answers again), the run
    /// waits until nothing moves, then the three views must agree within
    /// the time the plane's registration reconciliation takes.
    async fn quiesce(&mut self) -> Result<()> {
        self.quiescent_points += 1;
        self.cluster.emulator.clear_faults();
        let started = Instant::now();
        let mut last = String::new();
        let mut noted = String::new();
        let mut agreed_once = false;
        loop {
            let still = moving(&self.cluster, &self.in_flight).await?;
            let views = Views::read(&self.cluster).await?;
            match still {
                Some(what) => {
                    agreed_once = false;
                    last = what;
                }
                None if views.agree() => {
                    // Twice in a row, a beat apart: a settled state, not a
                    // passing coincidence.
                    if agreed_once {
                        let held = held_matches_charged(&self.cluster).await?;
                        if held.is_empty() {
                            self.journal.note(format_args!(
                                "  quiescent after {:.1}s: {} runner(s) charged, running and registered",
                                started.elapsed().as_secs_f64(),
                                views.charged.len()
                            ));
                            return self.check_watch();
                        }
                        last = held.join("; ");
                        agreed_once = false;
                    } else {
                        agreed_once = true;
                    }
                }
                None => {
                    agreed_once = false;
                    last = format!("the views disagree:\n{}", views.diff());
                }
            }
            if last != noted {
                self.journal
                    .note(format_args!("  waiting: {}", last.trim_end()));
                noted.clone_from(&last);
            }
            if started.elapsed() > QUIESCE_WITHIN {
                bail!(
                    "no quiescent point within {QUIESCE_WITHIN:?}; last: {last}\nstate:\n{}",
                    views.diff()
                );
            }
            self.check_watch()?;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    fn check_watch(&self) -> Result<()> {
        let found = self.freed_while_running.lock().expect("violations").clone();
        if !found.is_empty() {
            bail!(
                "capacity freed while its instance runs:\n{}",
                found.join("\n")
            );
        }
        Ok(())
    }

    /// The end: every job completed exactly once, nothing is left.
    async fn finish(&mut self) -> Result<()> {
        self.cluster.emulator.clear_faults();
        self.cluster
            .wait_jobs_completed(&self.jobs, Duration::from_secs(180))
            .await
            .context("every job to complete")?;
        self.cluster
            .wait_clean(Duration::from_secs(150))
            .await
            .context("no container and no charge left")?;
        wait_until(Duration::from_secs(30), "no registration left", || {
            self.cluster.emulator.state().runners.is_empty()
        })
        .await?;
        let state = self.cluster.emulator.state();
        let mut wrong = Vec::new();
        for id in &self.jobs {
            let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
            let starts = self.starts.of(*id);
            let result_ok = match job.result.as_deref() {
                Some("succeeded") => true,
                Some("failed") => self.lost.contains(&id.get()),
                _ => false,
            };
            if starts.len() != 1 || !result_ok {
                wrong.push(format!(
                    "job {id}: result {:?}, started by {starts:?}",
                    job.result
                ));
            }
        }
        if !wrong.is_empty() {
            bail!("jobs not completed exactly once:\n{}", wrong.join("\n"));
        }
        let held = held_matches_charged(&self.cluster).await?;
        if !held.is_empty() {
            bail!("at the end: {}", held.join("; "));
        }
        self.check_watch()
    }
}

fn seed_from_env() -> Result<u64> {
    match std::env::var("BILLET_E2E_SEED") {
        Ok(s) => s
            .trim()
            .parse()
            .with_context(|| format!("BILLET_E2E_SEED={s:?} is not a number")),
        Err(_) => Ok(uuid::Uuid::new_v4().as_u64_pair().0 % 1_000_000),
    }
}

fn ops_from_env() -> Result<usize> {
    match std::env::var("BILLET_E2E_OPS") {
        Ok(s) => s
            .trim()
            .parse()
            .with_context(|| format!("BILLET_E2E_OPS={s:?} is not a number")),
        Err(_) => Ok(DEFAULT_OPS),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seeded_random_run_keeps_ledger_containers_and_registrations_in_step_and_ends_with_every_job_done_once()
-> Result<()> {
    let seed = seed_from_env()?;
    let ops = ops_from_env()?;
    let plan = schedule(seed, ops);
    // The plane runs in this process: its log goes to a file of its own.
    let plane_log = std::env::temp_dir().join(format!(
        "billet-random-e2e-{seed}-{}.log",
        std::process::id()
    ));
    let file = std::fs::File::create(&plane_log)
        .with_context(|| format!("create {}", plane_log.display()))?;
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(
            "info,billet_controlplane_stub=debug,scaleset=debug",
        ))
        .with_ansi(false)
        .with_writer(Mutex::new(file))
        .try_init();
    eprintln!(
        "random_e2e: seed {seed}, {ops} operations; replay with BILLET_E2E_SEED={seed} BILLET_E2E_OPS={ops} cargo test -p billet-tests --test random_e2e"
    );
    let cluster = Cluster::start(ClusterOptions {
        nodes: NODES.iter().map(|n| (*n).to_owned()).collect(),
        // Long enough that a quiescent point finds runners at work, so
        // the three views are compared on something.
        work_ms: 8000,
        node_env: vec![
            ("BILLET_ACK_TIMEOUT_SECS".into(), "2".into()),
            ("BILLET_STRAY_GRACE_SECS".into(), "2".into()),
        ],
        launch_timeout: Duration::from_secs(20),
        registration_interval: Duration::from_secs(1),
        registration_grace: Duration::from_secs(3),
        quarantine_grace: Duration::from_secs(10),
        // A node down past the grace and the TTL (20 s) has its leases
        // quarantined.
        renewal_grace: Duration::from_secs(5),
        lease_ttl: Duration::from_secs(15),
        ..ClusterOptions::default()
    })
    .await?;
    let mut run = Run {
        starts: Starts::watch(&cluster),
        in_flight: InFlight::watch(&cluster),
        freed_while_running: watch_freed_while_running(&cluster),
        cluster,
        journal: Journal::default(),
        jobs: Vec::new(),
        lost: BTreeSet::new(),
        quiescent_points: 0,
    };
    let mut outcome = Ok(());
    for (i, op) in plan.iter().enumerate() {
        run.journal.note(format_args!("op {i}: {op}"));
        if let Err(e) = run.apply(op).await {
            outcome = Err(e.context(format!("op {i} ({op})")));
            break;
        }
    }
    if outcome.is_ok() {
        run.journal
            .note("the end: every job completes, nothing is left");
        outcome = run.finish().await.context("the end");
    }
    if let Err(e) = outcome {
        let views = Views::read(&run.cluster)
            .await
            .map_or_else(|e| format!("  (views unreadable: {e})\n"), |v| v.diff());
        let leases = run
            .cluster
            .plane
            .ledger()
            .open_leases()
            .await
            .unwrap_or_default();
        let state = run.cluster.emulator.state();
        let jobs: Vec<String> = state
            .jobs
            .iter()
            .filter(|j| j.state != JobState::Completed)
            .map(|j| format!("{} {:?} on {:?}", j.id, j.state, j.runner_id))
            .collect();
        bail!(
            "seed {seed} failed (replay: BILLET_E2E_SEED={seed} BILLET_E2E_OPS={ops}): {e:#}\n\
             operations so far:\n{}\n\
             state diff (ledger, containers, registrations):\n{views}\
             open leases: {leases:#?}\n\
             jobs not completed at GitHub: {jobs:?}\n\
             GitHub's sessions {:?}, unacknowledged {:?}, undelivered {:?}\n\
             the plane's wanted jobs: {:?}\n\
             node logs in {}, the plane's log in {}",
            run.journal.lines.join("\n"),
            state.sessions,
            state.unacknowledged,
            state.undelivered,
            run.cluster.plane.uncovered_jobs(),
            run.cluster.dir.display(),
            plane_log.display()
        );
    }
    eprintln!(
        "random_e2e: seed {seed} passed: {} operations, {} jobs, {} quiescent points",
        ops,
        run.jobs.len(),
        run.quiescent_points
    );
    run.cluster.shutdown().await
}
