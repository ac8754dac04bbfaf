//! `billet-demo`: the README's "run the main job".
//!
//! Starts a whole billet on this machine through [`Cluster`]: the scale-set emulator as GitHub,
//! the stub plane in this process, one real `billet node` process that the plane dials over
//! mTLS, and the stand-in runner image built from this checkout's own binary. It queues N jobs on
//! the emulator, prints one line per plane event while they run, then a row per job and the
//! checks that nothing was left behind: no billet container, no capacity charged in the ledger,
//! no runner registration in the emulator.
//!
//! ```text
//! cargo run -p billet-tests --bin billet-demo -- [--jobs 5] [--work-ms 3000] [--timeout-secs 300] [--verbose]
//! ```
//!
//! It needs a running Docker engine. The `billet` and `billet-standin-runner` binaries are built
//! first, in the demo's own profile (see [`ensure_binaries`]).
//!
//! | exit code | meaning |
//! |---|---|
//! | 0 | PASS: every job completed `succeeded` in time and nothing leaked |
//! | 1 | FAIL: a job did not succeed in time, or something was left behind |
//! | 2 | the demo could not start: the build, Docker, or the cluster failed |
//! | 130 | interrupted (Ctrl-C or SIGTERM); the cluster was still shut down |

use std::collections::{BTreeMap, HashMap};
use std::ffi::OsString;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, Result, bail};
use billet_controlplane_stub::ledger::{Charge, Phase};
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions};
use billet_tests::image::{STANDIN_BINARY, binary_path, profile_dir, workspace_target_dir};
use clap::Parser;
use scaleset::testing::JobState;
use tokio::signal::unix::{SignalKind, signal};
use tokio::sync::broadcast::error::RecvError;
use tokio::time::Instant;

/// The node binary the cluster starts.
const NODE_BINARY: &str = "billet";
/// The one node of the demo.
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.verbose);
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
    runtime.block_on(run(cli))
}

/// The plane runs in this process; its logs go to stderr at WARN unless `--verbose` (INFO) or
/// `RUST_LOG`. The node's own log goes to a file in the cluster's scratch directory.
fn init_tracing(verbose: bool) {
    let default = if verbose { "info" } else { "warn" };
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
}

/// Makes sure `billet` and `billet-standin-runner` are built, and fresh, in the profile directory
/// the harness takes them from ([`binary_path`]: the demo's own, such as `target/debug`).
///
/// `cargo run -p billet-tests` builds only this package and what it links: the stand-in runner
/// is a binary of `billet-controlplane-stub` and the node is `billet-agent`, which this package
/// does not depend on at all. Comparing modification times against the demo binary would miss
/// the commonest staleness, an edit to the agent alone (the demo is not rebuilt, so it looks
/// older than the stale node). So the decision is cargo's, which knows the dependency graph:
/// the demo always runs `cargo build` for both binaries, in the same profile, target directory
/// and target triple as itself. When nothing changed that costs about a second. `cargo run`
/// has released its build lock by the time the demo runs, so this does not wait on it.
///
/// Only when cargo cannot be run at all (the demo binary was copied somewhere without a
/// toolchain or without this checkout) does it fall back to looking at the files: a missing
/// binary is an error, one older than the demo a warning.
///
/// # Errors
///
/// The build fails (its output is on stderr above the message), or a binary is still missing
/// afterwards.
fn ensure_binaries() -> Result<()> {
    let binaries = [NODE_BINARY, STANDIN_BINARY];
    let profile = profile_dir();
    let target_dir = workspace_target_dir();
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    // `cargo run` sets CARGO to the cargo that built us; use the same one.
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| OsString::from("cargo"));

    let mut args: Vec<OsString> = vec![
        "build".into(),
        "--manifest-path".into(),
        manifest.clone().into(),
    ];
    args.extend(["--target-dir".into(), target_dir.clone().into_os_string()]);
    // target/<profile> or target/<triple>/<profile>.
    if let Some(parent) = profile.parent().filter(|p| *p != target_dir)
        && let Some(triple) = parent.file_name()
    {
        args.extend(["--target".into(), triple.to_owned()]);
    }
    let profile_name = profile
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or("debug");
    match profile_name {
        "debug" => {}
        "release" => args.push("--release".into()),
        other => args.extend(["--profile".into(), other.into()]),
    }
    args.extend(
        [
            "-p",
            "billet-agent",
            "--bin",
            NODE_BINARY,
            "-p",
            "billet-controlplane-stub",
            "--bin",
            STANDIN_BINARY,
        ]
        .map(OsString::from),
    );

    let shown: Vec<String> = std::iter::once(Path::new(&cargo).display().to_string())
        .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
        .collect();
    if manifest.is_file() {
        println!("building the node and the stand-in runner (cargo decides what is stale):");
        println!("  {}", shown.join(" "));
        match std::process::Command::new(&cargo).args(&args).status() {
            Ok(status) if status.success() => {
                for name in binaries {
                    let path = binary_path(name)?;
                    println!("  ready: {}", path.display());
                }
                println!();
                return Ok(());
            }
            Ok(status) => bail!(
                "`{}` failed ({status}); the demo will not run stale binaries",
                shown.join(" ")
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                println!("  cargo is not available ({e}); using the binaries already built");
            }
            Err(e) => return Err(e).with_context(|| format!("cannot run `{}`", shown.join(" "))),
        }
    } else {
        println!(
            "this checkout's Cargo.toml is not at {}; using the binaries already built",
            manifest.display()
        );
    }
    let demo_built = std::env::current_exe()
        .and_then(std::fs::metadata)
        .and_then(|m| m.modified())
        .ok();
    for name in binaries {
        let path = binary_path(name)?;
        let built = std::fs::metadata(&path).and_then(|m| m.modified()).ok();
        if let (Some(built), Some(demo)) = (built, demo_built)
            && built < demo
        {
            println!(
                "  warning: {} is older than the demo itself and may be stale",
                path.display()
            );
        }
    }
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

async fn run(cli: Cli) -> ExitCode {
    let options = ClusterOptions {
        nodes: vec![NODE.to_owned()],
        work_ms: cli.work_ms,
        ..ClusterOptions::default()
    };
    println!(
        "billet demo: {} job(s), each stand-in runner works {} ms, every job must succeed within {} s",
        cli.jobs, cli.work_ms, cli.timeout_secs
    );
    println!(
        "starting: the scale-set emulator as GitHub, the stub plane in this process, `billet node` \
         {NODE} over mTLS, and the stand-in runner image"
    );
    let started = Instant::now();
    let cluster = tokio::select! {
        cluster = Cluster::start(options) => cluster,
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
    let node_log = cluster.nodes.get(NODE).map(|n| n.log.clone());
    println!(
        "ready in {:.1}s: deployment {}, node {NODE} at {}, emulator at {}",
        started.elapsed().as_secs_f64(),
        cluster.deployment,
        cluster
            .nodes
            .get(NODE)
            .map(|n| n.addr.to_string())
            .unwrap_or_default(),
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

    match verdict {
        None => ExitCode::from(130),
        Some(Ok(true)) => {
            // Nothing to look at after a pass; the scratch directory would only pile up in /tmp.
            let _ = std::fs::remove_dir_all(&dir);
            ExitCode::SUCCESS
        }
        Some(Ok(false)) => {
            println!(
                "kept for inspection: {} (node log, ledger, certificates)",
                dir.display()
            );
            ExitCode::from(1)
        }
        Some(Err(e)) => {
            eprintln!("billet-demo: {e:#}");
            println!(
                "kept for inspection: {} (node log, ledger, certificates)",
                dir.display()
            );
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
        Ok(left) if left.is_empty() => {}
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

/// Queues the jobs, follows them, prints the table and the checks. `Ok(true)` is a pass.
async fn demo(cluster: &Cluster, cli: &Cli) -> Result<bool> {
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
        PlaneEvent::Launched { lease, node } => Some(format!(
            "{}  lease {lease}  launched on {node}: container billet-{lease} started",
            job_of_lease(lease, lease_job)
        )),
        PlaneEvent::LaunchFailed {
            lease,
            reason,
            custody,
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
        PlaneEvent::Started {
            request_id,
            runner_name,
        } => {
            let row = jobs.get_mut(request_id)?;
            row.runner = Some(runner_name.clone());
            let lease = lease_of_runner(runner_name);
            Some(format!(
                "job {request_id}  lease {lease}  started on runner {runner_name}{}",
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

/// Prints the checks and the verdict; `Ok(true)` when everything passed.
async fn report(
    cluster: &Cluster,
    jobs: &BTreeMap<i64, JobRow>,
    waited: &Waited,
    timeout: Duration,
    total: Duration,
) -> Result<bool> {
    let left = Leftovers::look(cluster).await?;
    let succeeded = jobs
        .values()
        .filter(|r| r.result.as_deref() == Some("succeeded"))
        .count();
    let mut failures: Vec<String> = Vec::new();
    let mut check = |ok: bool, text: String| {
        println!("  {}  {text}", if ok { "ok  " } else { "FAIL" });
        if !ok {
            failures.push(text);
        }
    };
    println!("checks:");
    let in_time = *waited != Waited::JobsTimedOut;
    check(
        succeeded == jobs.len() && in_time,
        format!(
            "{succeeded} of {} job(s) completed `succeeded`{}",
            jobs.len(),
            if in_time {
                format!(" within {}s", timeout.as_secs())
            } else {
                format!("; the {}s bound passed", timeout.as_secs())
            }
        ),
    );
    check(
        left.containers.is_empty(),
        if left.containers.is_empty() {
            format!(
                "no billet container left (label sh.billet.deployment={})",
                cluster.deployment
            )
        } else {
            format!("containers left behind: {}", left.containers.join(", "))
        },
    );
    check(
        left.charge == Charge::default(),
        format!(
            "the ledger charges {} lease(s), {} vCPU, {} bytes",
            left.charge.leases, left.charge.vcpu, left.charge.memory_bytes
        ),
    );
    check(
        left.runners.is_empty(),
        if left.runners.is_empty() {
            "no runner registration left in the emulator".to_owned()
        } else {
            format!(
                "runner registrations left in the emulator: {}",
                left.runners.join(", ")
            )
        },
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
    let done = leases.iter().filter(|l| l.phase == Phase::Done).count();
    println!(
        "  info  ledger: {} lease(s): {}",
        leases.len(),
        phases.join(", ")
    );
    let _ = done;

    println!();
    if failures.is_empty() {
        println!(
            "PASS: {} job(s) ran in Docker containers launched by billet node {NODE} over mTLS, and \
             everything was cleaned up ({:.1}s)",
            jobs.len(),
            total.as_secs_f64()
        );
        Ok(true)
    } else {
        println!("FAIL: {}", failures.join("; "));
        Ok(false)
    }
}

#[allow(dead_code)]
fn unused(_: PathBuf, _: SystemTime) {}
