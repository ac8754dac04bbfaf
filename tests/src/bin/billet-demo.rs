//! `billet-demo`: the README's "run the main job".
//!
//! Starts a whole billet on this machine through [`Cluster`]: the scale-set emulator as GitHub,
//! the stub plane in this process, real `billet node` processes (one by default; `--nodes N`,
//! each then in a network namespace of its own on a private bridge, `billet_tests::fleet`) that
//! the plane dials over mTLS, and the stand-in runner image built from this checkout's own binary. It queues N jobs on
//! the emulator, prints one line per plane event while they run, then a row per job and the
//! checks that nothing was left behind: no billet container, no capacity charged in the ledger,
//! no runner registration in the emulator.
//!
//! ```text
//! cargo run -p billet-tests --bin billet-demo -- [--jobs 5] [--nodes 1] [--work-ms 3000] [--timeout-secs 300] [--verbose]
//! ```
//!
//! It needs a running Docker engine. The `billet` and `billet-standin-runner` binaries are built
//! first if stale, in the demo's own profile (see [`ensure_binaries`]).
//!
//! | exit code | meaning |
//! |---|---|
//! | 0 | PASS: every job completed `succeeded` in time and nothing leaked |
//! | 1 | FAIL: a job did not succeed in time, or something was left behind |
//! | 2 | the demo could not start: the build, Docker, or the cluster failed |
//! | 130 | interrupted (Ctrl-C or SIGTERM); the cluster was still shut down |

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use billet_controlplane_stub::ledger::Charge;
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions};
use billet_tests::fleet::Fleet;
use billet_tests::image::{PROCESS_BINARIES, binary_path, build_process_binaries, profile_dir};
use clap::Parser;
use scaleset::testing::JobState;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;

/// The first node of the demo (the only one without `--nodes`).
const NODE: &str = "node-1";
/// How long cleanup may take once every job has completed: the plane destroys each instance and
/// releases its lease after GitHub reports the job complete.
const CLEANUP_GRACE: Duration = Duration::from_secs(60);
/// How long shutting the cluster down may take before it is dropped instead (its `Drop` kills
/// the node and force-removes the deployment's containers).
const SHUTDOWN_GRACE: Duration = Duration::from_secs(30);
/// After this long without an event, a progress line says what is still awaited.
const QUIET_STATUS_EVERY: Duration = Duration::from_secs(15);
/// How often the emulator, Docker and the ledger are polled while waiting.
const POLL_EVERY: Duration = Duration::from_millis(500);

/// Runs N GitHub Actions jobs through the plane, a real `billet node` and real Docker, and
/// checks that everything is cleaned up afterwards.
#[derive(Debug, Parser)]
#[command(name = "billet-demo")]
struct Cli {
    /// How many jobs to queue.
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u16).range(1..=100))]
    jobs: u16,
    /// How many nodes to run. One runs on 127.0.0.1 as before; more run each in a network
    /// namespace of its own (`ip netns`, a veth into a bridge on a private /24, its own address
    /// and certificate), which needs root and the kernel's bridge and veth support.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=16))]
    nodes: u16,
    /// How long each stand-in runner works on its job, in milliseconds.
    #[arg(long, default_value_t = 3000)]
    work_ms: u64,
    /// How long every job has to complete, from the moment it is queued, in seconds.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
    /// Show the in-process plane's info logs (default: warnings and errors only). `RUST_LOG`, when
    /// set, wins over both.
    #[arg(long)]
    verbose: bool,
    /// Only build the stand-in runner image (`billet-standin-runner:dev`)
    /// from this checkout's binary, for a plane run by hand
    /// (`billet-plane --emulator`), and exit.
    #[arg(long)]
    build_image: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let logs = init_tracing(cli.verbose);
    if let Err(e) = ensure_binaries() {
        eprintln!("billet-demo: {e:#}");
        return ExitCode::from(2);
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("billet-demo: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.build_image {
        return runtime.block_on(async {
            let built = async {
                let docker = billet_tests::image::connect_docker().await?;
                billet_tests::image::build_standin_image(
                    &docker,
                    &billet_tests::image::binary_path("billet-standin-runner")?,
                    billet_tests::cluster::STANDIN_IMAGE,
                )
                .await
            };
            match built.await {
                Ok(()) => {
                    println!("built {}", billet_tests::cluster::STANDIN_IMAGE);
                    ExitCode::SUCCESS
                }
                Err(e) => {
                    eprintln!("billet-demo: {e:#}");
                    ExitCode::from(2)
                }
            }
        });
    }
    runtime.block_on(run(cli, &logs))
}

/// The plane runs in this process; its logs go to stderr at WARN unless `--verbose` (INFO) or
/// `RUST_LOG`. The node's own log goes to a file in the cluster's scratch directory.
///
/// Until the node has attached, the default is ERROR: the plane's first dial can race the
/// node's bind and warn about a refused connection, which is retried at once and means nothing
/// (a node that never attaches fails `Cluster::start` with the node's log). [`Logs::started`]
/// then lowers it to WARN.
fn init_tracing(verbose: bool) -> Logs {
    use tracing_subscriber::EnvFilter;
    use tracing_subscriber::prelude::*;
    let chosen = if verbose {
        Some(EnvFilter::new("info"))
    } else {
        None
    };
    match EnvFilter::try_from_default_env().ok().or(chosen) {
        Some(filter) => {
            tracing_subscriber::registry()
                .with(filter)
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_writer(std::io::stderr)
                        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                        .with_target(false),
                )
                .init();
            Logs { quiet_start: None }
        }
        None => {
            let (filter, handle) = tracing_subscriber::reload::Layer::new(EnvFilter::new("error"));
            tracing_subscriber::registry()
                .with(filter)
                .with(
                    tracing_subscriber::fmt::layer()
                        .with_writer(std::io::stderr)
                        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
                        .with_target(false),
                )
                .init();
            Logs {
                quiet_start: Some(handle),
            }
        }
    }
}

/// The plane's log level, quieter while the cluster starts.
#[derive(Debug)]
struct Logs {
    quiet_start: Option<
        tracing_subscriber::reload::Handle<
            tracing_subscriber::EnvFilter,
            tracing_subscriber::Registry,
        >,
    >,
}

impl Logs {
    /// The node has attached: from now on, warnings are shown.
    fn started(&self) {
        if let Some(handle) = &self.quiet_start {
            let _ = handle.reload(tracing_subscriber::EnvFilter::new("warn"));
        }
    }
}

/// Builds `billet` and `billet-standin-runner` ([`PROCESS_BINARIES`]) before anything starts,
/// through the harness's [`build_process_binaries`], in the demo's own profile.
///
/// `cargo run -p billet-tests` builds only this package and what it links: the node is
/// `billet-agent`, which this package does not depend on, and the stand-in runner is a binary
/// of `billet-controlplane-stub`. Without a build the demo would start a missing or stale node.
/// Comparing modification times with the demo binary would miss the commonest staleness, an
/// edit to the agent alone (the demo is not rebuilt, so it looks older than the stale node);
/// so cargo decides, and an up-to-date build costs well under a second. `cargo run` has
/// released its build lock by the time the demo runs, so this cargo does not wait on it.
///
/// [`Cluster::start`] makes the same call; making it here first shows the step (what is built,
/// where, how long it took), and reports a broken build as such (exit 2) rather than as a
/// cluster that did not start. The second call is then a no-op.
///
/// # Errors
///
/// Cargo cannot be run or the build fails (cargo's own messages are on stderr above), or a
/// binary is missing afterwards.
fn ensure_binaries() -> Result<()> {
    // As `build_process_binaries` names it: the `debug` directory is the `dev` profile.
    let profile = match profile_dir().file_name().and_then(|n| n.to_str()) {
        Some("debug") | None => "dev".to_owned(),
        Some(other) => other.to_owned(),
    };
    let packages: Vec<String> = PROCESS_BINARIES
        .iter()
        .map(|(package, bin)| format!("-p {package} --bin {bin}"))
        .collect();
    println!(
        "building the node and the stand-in runner if stale (cargo is quiet meanwhile; a first build takes a minute or two):"
    );
    println!(
        "  cargo build --quiet --profile {profile} {}",
        packages.join(" ")
    );
    let started = Instant::now();
    build_process_binaries()?;
    for (_, bin) in PROCESS_BINARIES {
        println!("  ready: {}", binary_path(bin)?.display());
    }
    println!("  ({:.1}s)", started.elapsed().as_secs_f64());
    println!();
    Ok(())
}

/// What the demo saw of one job.
#[derive(Debug)]
struct JobRow {
    id: i64,
    queued_at: Instant,
    /// Leases the plane reserved for this job, in order (more than one after a failed launch).
    reserved: Vec<String>,
    /// The runner that ran it, from `Started` or `Completed`.
    runner: Option<String>,
    completed_at: Option<Instant>,
    result: Option<String>,
    state: JobState,
}

impl JobRow {
    /// The lease whose compute ran the job: the one its runner was launched for (GitHub gives
    /// a job to any idle runner of the scale set), else the last one reserved for it.
    fn lease(&self) -> Option<&str> {
        self.runner
            .as_deref()
            .and_then(|r| r.strip_prefix("billet-"))
            .or_else(|| self.reserved.last().map(String::as_str))
    }
}

/// How the wait for the jobs ended.
#[derive(Debug, PartialEq)]
enum Waited {
    /// Every job completed and nothing is left.
    Clean,
    /// Every job completed, but cleanup did not finish within [`CLEANUP_GRACE`].
    CleanupTimedOut,
    /// Not every job completed within `--timeout-secs`.
    JobsTimedOut,
}

/// Everything left behind, from one look.
#[derive(Debug, Default)]
struct Leftovers {
    containers: Vec<String>,
    charge: Charge,
    runners: Vec<String>,
}

impl Leftovers {
    async fn look(cluster: &Cluster) -> Result<Self> {
        Ok(Self {
            containers: cluster
                .containers()
                .await
                .context("list the deployment's containers")?,
            charge: cluster
                .charged()
                .await
                .context("read the ledger's charge")?,
            runners: cluster
                .emulator
                .state()
                .runners
                .into_iter()
                .map(|r| r.name)
                .collect(),
        })
    }

    fn is_clean(&self) -> bool {
        self.containers.is_empty() && self.charge == Charge::default() && self.runners.is_empty()
    }
}

/// A clock for progress lines, from when the jobs were queued.
#[derive(Debug, Clone, Copy)]
struct Clock(Instant);

impl Clock {
    fn line(&self, text: &str) {
        println!("{:>7.1}s  {text}", self.0.elapsed().as_secs_f64());
    }
}

async fn run(cli: Cli, logs: &Logs) -> ExitCode {
    let options = ClusterOptions {
        nodes: (1..=cli.nodes).map(|i| format!("node-{i}")).collect(),
        work_ms: cli.work_ms,
        ..ClusterOptions::default()
    };
    let names = options.nodes.join(", ");
    println!(
        "billet demo: {} job(s), each stand-in runner works {} ms, every job must succeed within {} s",
        cli.jobs, cli.work_ms, cli.timeout_secs
    );
    println!(
        "starting: the scale-set emulator as GitHub, the stub plane in this process, `billet node` \
         {names} over mTLS{}, and the stand-in runner image",
        if cli.nodes > 1 {
            ", each in a network namespace of its own"
        } else {
            ""
        }
    );
    let started = Instant::now();
    // With more than one node, the network lives until the cluster is shut down.
    let mut network = None;
    let start = async {
        if cli.nodes > 1 {
            let fleet = Fleet::start(options).await?;
            network = Some(fleet.network);
            Ok(fleet.cluster)
        } else {
            Cluster::start(options).await
        }
    };
    let cluster = tokio::select! {
        cluster = start => cluster,
        () = interrupted() => {
            // Nothing ran yet: dropping the start kills the node process (kill_on_drop).
            println!("interrupted while starting; nothing was launched");
            return ExitCode::from(130);
        }
    };
    let cluster = match cluster {
        Ok(cluster) => cluster,
        Err(e) => {
            eprintln!("billet-demo: the cluster did not start: {e:#}");
            return ExitCode::from(2);
        }
    };
    logs.started();
    let node_log = cluster.nodes.get(NODE).map(|n| n.log.clone());
    let mut addrs: Vec<String> = cluster
        .nodes
        .values()
        .map(|n| format!("{} at {}", n.name, n.addr))
        .collect();
    addrs.sort();
    println!(
        "ready in {:.1}s: deployment {}, node {}, emulator at {}",
        started.elapsed().as_secs_f64(),
        cluster.deployment,
        addrs.join(", "),
        cluster.emulator.uri(),
    );
    if let Some(log) = &node_log {
        println!("node log: {}", log.display());
    }
    println!();

    let verdict = tokio::select! {
        verdict = demo(&cluster, &cli) => Some(verdict),
        () = interrupted() => None,
    };

    let dir = cluster.dir.clone();
    println!();
    if verdict.is_none() {
        println!("interrupted; shutting the cluster down (Ctrl-C again to skip the graceful part)");
    } else {
        println!("shutting down: the plane, the node, and any container of the deployment");
    }
    shutdown(cluster).await;
    // The nodes are gone: their namespaces and bridge can go too.
    drop(network);

    let keep = || {
        println!(
            "kept for inspection: {} (node log, ledger, certificates)",
            dir.display()
        )
    };
    match verdict {
        None => {
            keep();
            println!("INTERRUPTED");
            ExitCode::from(130)
        }
        Some(Ok(verdict)) if verdict.failures.is_empty() => {
            // Nothing to look at after a pass; the scratch directory would only pile up in /tmp.
            let _ = std::fs::remove_dir_all(&dir);
            println!();
            verdict.print();
            ExitCode::SUCCESS
        }
        Some(Ok(verdict)) => {
            keep();
            println!();
            verdict.print();
            ExitCode::from(1)
        }
        Some(Err(e)) => {
            keep();
            println!();
            println!("FAIL: {e:#}");
            ExitCode::from(1)
        }
    }
}

/// Shuts the cluster down within [`SHUTDOWN_GRACE`]; on a timeout or a second interrupt the
/// cluster is dropped instead, and its `Drop` kills the node and force-removes the containers.
async fn shutdown(cluster: Cluster) {
    let docker = cluster.docker.clone();
    let deployment = cluster.deployment.clone();
    tokio::select! {
        done = tokio::time::timeout(SHUTDOWN_GRACE, cluster.shutdown()) => match done {
            Ok(Ok(())) => {}
            Ok(Err(e)) => println!("  shutdown: {e:#}"),
            Err(_) => println!("  shutdown took longer than {SHUTDOWN_GRACE:?}; killed instead"),
        },
        () = interrupted() => println!("  skipped the graceful shutdown; killed instead"),
    }
    // Whatever happened above, say so if a container of the deployment survived it.
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![format!("sh.billet.deployment={deployment}")],
    )]);
    let left = docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        }))
        .await;
    match left {
        Ok(left) if left.is_empty() => {
            println!("  stopped; no container of deployment {deployment} remains")
        }
        Ok(left) => println!(
            "  warning: {} container(s) of deployment {deployment} survived the shutdown; remove them with \
             `docker rm -f $(docker ps -aq --filter label=sh.billet.deployment={deployment})`",
            left.len()
        ),
        Err(e) => println!("  warning: cannot list containers after the shutdown: {e}"),
    }
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    let Ok(mut term) = signal(SignalKind::terminate()) else {
        let _ = tokio::signal::ctrl_c().await;
        return;
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// Queues the jobs, follows them, prints the table and the checks.
async fn demo(cluster: &Cluster, cli: &Cli) -> Result<Verdict> {
    let timeout = Duration::from_secs(cli.timeout_secs);
    // Subscribe before queueing, so no event is missed.
    let mut events = cluster.plane.subscribe();
    let clock = Clock(Instant::now());
    let ids = cluster.queue_jobs(usize::from(cli.jobs));
    let mut jobs: BTreeMap<i64, JobRow> = ids
        .iter()
        .map(|id| {
            let row = JobRow {
                id: id.get(),
                queued_at: Instant::now(),
                reserved: Vec::new(),
                runner: None,
                completed_at: None,
                result: None,
                state: JobState::Available,
            };
            (id.get(), row)
        })
        .collect();
    let listed: Vec<String> = jobs.keys().map(i64::to_string).collect();
    clock.line(&format!(
        "queued {} job(s) on scale set {}: {}",
        jobs.len(),
        cluster.plane.scale_set(),
        listed.join(", ")
    ));

    // Which job each lease was reserved for.
    let mut lease_job: HashMap<String, i64> = HashMap::new();
    let jobs_deadline = clock.0 + timeout;
    let mut cleanup_deadline: Option<Instant> = None;
    let mut last_line = Instant::now();
    let mut poll = tokio::time::interval(POLL_EVERY);
    poll.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);

    let waited = loop {
        tokio::select! {
            event = events.recv() => {
                match event {
                    Ok(event) => {
                        if let Some(text) = describe(&event, &mut jobs, &mut lease_job) {
                            clock.line(&text);
                            last_line = Instant::now();
                        }
                    }
                    Err(RecvError::Lagged(n)) => clock.line(&format!("(missed {n} event(s); the final table reads the emulator)")),
                    Err(RecvError::Closed) => bail!("the plane stopped sending events"),
                }
            }
            _ = poll.tick() => {
                let state = cluster.emulator.state();
                for job in &state.jobs {
                    if let Some(row) = jobs.get_mut(&job.id.get()) {
                        row.state = job.state;
                        if job.state == JobState::Completed {
                            row.completed_at.get_or_insert_with(Instant::now);
                            if row.result.is_none() {
                                row.result.clone_from(&job.result);
                            }
                        }
                    }
                }
                let completed = jobs.values().filter(|r| r.state == JobState::Completed).count();
                if completed == jobs.len() {
                    let deadline = *cleanup_deadline.get_or_insert_with(|| Instant::now() + CLEANUP_GRACE);
                    let left = Leftovers::look(cluster).await?;
                    if left.is_clean() {
                        break Waited::Clean;
                    }
                    if Instant::now() >= deadline {
                        break Waited::CleanupTimedOut;
                    }
                } else if Instant::now() >= jobs_deadline {
                    break Waited::JobsTimedOut;
                }
                if last_line.elapsed() >= QUIET_STATUS_EVERY {
                    let waiting = if completed == jobs.len() {
                        "all jobs completed; waiting for cleanup".to_owned()
                    } else {
                        let mut by_state: BTreeMap<&str, usize> = BTreeMap::new();
                        for row in jobs.values() {
                            *by_state.entry(state_name(row.state)).or_default() += 1;
                        }
                        let parts: Vec<String> = by_state.iter().map(|(s, n)| format!("{n} {s}")).collect();
                        format!("waiting: {}", parts.join(", "))
                    };
                    clock.line(&waiting);
                    last_line = Instant::now();
                }
            }
        }
    };
    let total = clock.0.elapsed();
    // Drain what arrived meanwhile, so the table has every runner name.
    while let Ok(event) = events.try_recv() {
        if let Some(text) = describe(&event, &mut jobs, &mut lease_job) {
            clock.line(&text);
        }
    }

    println!();
    print_table(&jobs);
    println!();
    report(cluster, &jobs, &waited, timeout, total).await
}

/// One progress line for an event, updating what is known of the jobs; `None` for an event of
/// another job.
fn describe(
    event: &PlaneEvent,
    jobs: &mut BTreeMap<i64, JobRow>,
    lease_job: &mut HashMap<String, i64>,
) -> Option<String> {
    let job_of_lease = |lease: &str, lease_job: &HashMap<String, i64>| {
        lease_job
            .get(lease)
            .map_or_else(|| "job ?".to_owned(), |j| format!("job {j}"))
    };
    let lease_of_runner =
        |runner: &str| runner.strip_prefix("billet-").unwrap_or(runner).to_owned();
    match event {
        PlaneEvent::Reserved { request_id, lease } => {
            let row = jobs.get_mut(request_id)?;
            row.reserved.push(lease.clone());
            lease_job.insert(lease.clone(), *request_id);
            let retry = if row.reserved.len() > 1 {
                " (a new lease after a failed launch)"
            } else {
                ""
            };
            Some(format!(
                "job {request_id}  lease {lease}  reserved in the ledger{retry}"
            ))
        }
        PlaneEvent::Launched {
            lease,
            node,
            minted_ahead,
        } => Some(format!(
            "{}  lease {lease}  launched on {node}: container billet-{lease} started{}",
            job_of_lease(lease, lease_job),
            if *minted_ahead {
                " (its registration minted by the plane before dispatch)"
            } else {
                ""
            }
        )),
        PlaneEvent::LaunchFailed {
            lease,
            reason,
            custody,
            code: _,
        } => {
            let held = if *custody {
                "; the node holds the lease"
            } else {
                ""
            };
            Some(format!(
                "{}  lease {lease}  launch failed: {reason}{held}",
                job_of_lease(lease, lease_job)
            ))
        }
        PlaneEvent::LaunchBusy {
            lease,
            node,
            reason,
        } => Some(format!(
            "{}  lease {lease}  launch answered BUSY by {node}: {reason}",
            job_of_lease(lease, lease_job)
        )),
        PlaneEvent::Started {
            request_id,
            runner_name,
        } => {
            let row = jobs.get_mut(request_id)?;
            row.runner = Some(runner_name.clone());
            let lease = lease_of_runner(runner_name);
            Some(format!(
                "job {request_id}  lease {lease}  runner {runner_name} took the job{}",
                ran_elsewhere(*request_id, &lease, lease_job)
            ))
        }
        PlaneEvent::Completed {
            request_id,
            runner_name,
            result,
        } => {
            let row = jobs.get_mut(request_id)?;
            if !runner_name.is_empty() {
                row.runner = Some(runner_name.clone());
            }
            row.completed_at.get_or_insert_with(Instant::now);
            row.result = Some(result.clone());
            row.state = JobState::Completed;
            let lease = lease_of_runner(runner_name);
            Some(format!(
                "job {request_id}  lease {lease}  completed: {result} after {:.1}s",
                row.queued_at.elapsed().as_secs_f64()
            ))
        }
        PlaneEvent::ScaleDownBusy { lease } => Some(format!(
            "{}  lease {lease}  scale-down answered busy: the runner took a job",
            job_of_lease(lease, lease_job)
        )),
        PlaneEvent::Released { lease, outcome } => Some(format!(
            "{}  lease {lease}  container destroyed, lease released ({outcome})",
            job_of_lease(lease, lease_job)
        )),
    }
}

/// A note when a job ran on a runner launched for another job (GitHub hands a job to any idle
/// runner of the scale set).
fn ran_elsewhere(job: i64, lease: &str, lease_job: &HashMap<String, i64>) -> String {
    match lease_job.get(lease) {
        Some(other) if *other != job => format!(" (launched for job {other})"),
        _ => String::new(),
    }
}

fn state_name(state: JobState) -> &'static str {
    match state {
        JobState::Available => "queued",
        JobState::Assigned => "assigned",
        JobState::Running => "running",
        JobState::Completed => "completed",
    }
}

fn print_table(jobs: &BTreeMap<i64, JobRow>) {
    let rows: Vec<[String; 6]> = jobs
        .values()
        .map(|row| {
            let lease = row.lease().unwrap_or("-").to_owned();
            let instance = row
                .lease()
                .map_or_else(|| "-".to_owned(), |l| format!("billet-{l}"));
            let runner = row.runner.clone().unwrap_or_else(|| "-".to_owned());
            let duration = row.completed_at.map_or_else(
                || "-".to_owned(),
                |at| format!("{:.1}s", at.duration_since(row.queued_at).as_secs_f64()),
            );
            let result = match (&row.result, row.state) {
                (Some(result), _) => result.clone(),
                (None, state) => format!("not completed ({})", state_name(state)),
            };
            [
                row.id.to_string(),
                lease,
                instance,
                runner,
                duration,
                result,
            ]
        })
        .collect();
    let header = ["job", "lease", "instance", "runner", "duration", "result"];
    let mut widths = header.map(str::len);
    for row in &rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.len());
        }
    }
    let line = |cells: [&str; 6]| {
        let mut out = String::from(" ");
        for (i, (cell, w)) in cells.iter().zip(widths).enumerate() {
            // The duration column reads best right-aligned.
            let _ = if i == 4 {
                write!(out, " {cell:>w$} ")
            } else {
                write!(out, " {cell:<w$} ")
            };
        }
        println!("{}", out.trim_end());
    };
    line(header);
    line(widths.map(|w| "-".repeat(w)).each_ref().map(String::as_str));
    for row in &rows {
        line(row.each_ref().map(String::as_str));
    }
}

/// Prints the checks; the verdict says which failed.
async fn report(
    cluster: &Cluster,
    jobs: &BTreeMap<i64, JobRow>,
    waited: &Waited,
    timeout: Duration,
    total: Duration,
) -> Result<Verdict> {
    let left = Leftovers::look(cluster).await?;
    let succeeded = jobs
        .values()
        .filter(|r| r.result.as_deref() == Some("succeeded"))
        .count();
    let mut failures: Vec<String> = Vec::new();
    // While jobs are still running, what exists is their compute, not a leak: say what was
    // there, without counting it as a failure of its own (the job check already fails).
    let jobs_done = *waited != Waited::JobsTimedOut;
    let mut check = |ok: bool, text: String, counts: bool| {
        let mark = match (ok, counts) {
            (true, _) => "ok  ",
            (false, true) => "FAIL",
            (false, false) => "info",
        };
        println!("  {mark}  {text}");
        if !ok && counts {
            failures.push(text);
        }
    };
    println!("checks:");
    check(
        succeeded == jobs.len() && jobs_done,
        format!(
            "{succeeded} of {} job(s) completed `succeeded`{}",
            jobs.len(),
            if jobs_done {
                format!(" within {}s", timeout.as_secs())
            } else {
                format!("; the {}s bound passed first", timeout.as_secs())
            }
        ),
        true,
    );
    let left_behind = if jobs_done {
        "left behind"
    } else {
        "still there at the bound"
    };
    check(
        left.containers.is_empty(),
        if left.containers.is_empty() {
            format!(
                "no billet container left (label sh.billet.deployment={})",
                cluster.deployment
            )
        } else {
            format!("containers {left_behind}: {}", left.containers.join(", "))
        },
        jobs_done,
    );
    check(
        left.charge == Charge::default(),
        if left.charge == Charge::default() {
            "the ledger charges nothing (0 leases, 0 vCPU, 0 MiB)".to_owned()
        } else {
            format!(
                "ledger charges {left_behind}: {} lease(s), {} vCPU, {} MiB",
                left.charge.leases,
                left.charge.vcpu,
                left.charge.memory_bytes >> 20
            )
        },
        jobs_done,
    );
    check(
        left.runners.is_empty(),
        if left.runners.is_empty() {
            "no runner registration left in the emulator".to_owned()
        } else {
            format!(
                "runner registrations {left_behind} in the emulator: {}",
                left.runners.join(", ")
            )
        },
        jobs_done,
    );
    if *waited == Waited::CleanupTimedOut {
        println!(
            "        (cleanup was still unfinished {}s after the last job completed)",
            CLEANUP_GRACE.as_secs()
        );
    }
    let leases = cluster
        .plane
        .ledger()
        .leases()
        .await
        .context("read the ledger's leases")?;
    let mut phases: BTreeMap<&str, usize> = BTreeMap::new();
    for lease in &leases {
        *phases.entry(lease.phase.as_str()).or_default() += 1;
    }
    let phases: Vec<String> = phases.iter().map(|(p, n)| format!("{n} {p}")).collect();
    println!(
        "  info  ledger: {} lease(s): {}",
        leases.len(),
        phases.join(", ")
    );

    Ok(Verdict {
        failures,
        jobs: jobs.len(),
        nodes: cluster.nodes.len(),
        total,
    })
}

/// What the checks found; printed last, after the shutdown, so it is the final line.
#[derive(Debug)]
struct Verdict {
    /// The checks that failed, as sentences; empty is a pass.
    failures: Vec<String>,
    jobs: usize,
    nodes: usize,
    total: Duration,
}

impl Verdict {
    fn print(&self) {
        if self.failures.is_empty() {
            println!(
                "PASS: {} job(s) ran in Docker containers launched by {} over mTLS, \
                 and everything was cleaned up ({:.1}s from queueing)",
                self.jobs,
                if self.nodes == 1 {
                    format!("billet node {NODE}")
                } else {
                    format!("{} billet nodes", self.nodes)
                },
                self.total.as_secs_f64()
            );
        } else {
            println!("FAIL: {}", self.failures.join("; "));
        }
    }
}
