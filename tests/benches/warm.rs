//! The warm pool: what a runner started ahead of its job saves, against what Docker and GitHub
//! cost anyway, all measured in one run on the same engine and image.
//!
//! One cluster (the stub plane in this process, the scale-set emulator, one real `billet node`
//! over mTLS, real Docker), its warm count changed at run time through the ledger as
//! `billet-plane warm --count N` does. Four parts:
//!
//! 1. **Launch.** Single jobs queued one at a time, cold (no warm runner) and then warm (one
//!    ready before each job). For each job the node's own `Launch` command duration (its
//!    `billet_command_duration_seconds{kind="launch"}`, read before and after the job, so exactly
//!    that one launch), beside the baseline measured in the same iteration: bollard's create and
//!    start of a container of the same image, shape and network. Goal: warm launch ÷ create and
//!    start ≤ 0.05 (per-iteration median, with its distribution-free 95% interval).
//! 2. **Queued → taken.** From the emulator's queue of a job to the moment it is running on a
//!    runner (the stand-in takes it), for the same single jobs, and for bursts of
//!    `BILLET_BENCH_BURST` jobs queued at once on a node with that many warm runners and with none.
//!    The floor has no plane and no node: a stand-in runner process on this host, already blocked
//!    on its credentials FIFO as a warm runner is; the bench queues the job, acquires it as the
//!    plane's listener does, mints its JIT config and writes it into the FIFO. Goals: single job
//!    p50 ≤ 25 ms, a burst's p95 ≤ 300 ms.
//! 3. **Refill.** From no warm runner to `BILLET_BENCH_REFILL`: warm runners started per second,
//!    from the node taking the wanted count in to the last one ready, beside bollard's create and
//!    start of as many containers one after another.
//! 4. **Memory.** The node's RSS with `BILLET_BENCH_RSS_WARM` warm runners against none, and
//!    the containers' memory per warm runner (Docker's stats: usage and RSS).
//!
//! ```text
//! cargo bench -p billet-tests --bench warm
//! BILLET_BENCH_ITERATIONS=10 BILLET_BENCH_BURST_ROUNDS=1 BILLET_BENCH_REFILL_ROUNDS=1 \
//!     BILLET_BENCH_RSS_WARM=20 cargo bench -p billet-tests --bench warm
//! ```
//!
//! Knobs: `BILLET_BENCH_ITERATIONS` (single jobs per mode, 30), `BILLET_BENCH_BURST` (jobs per
//! burst, 20), `BILLET_BENCH_BURST_ROUNDS` (bursts per mode, 3), `BILLET_BENCH_REFILL` (runners
//! per refill, 10), `BILLET_BENCH_REFILL_ROUNDS` (3), `BILLET_BENCH_RSS_WARM` (50),
//! `BILLET_BENCH_MINT` (`node`, the shipped default: the node mints through `MintJit` inside its
//! launch; `plane`: the plane mints before it dispatches).
//!
//! Run without `--bench` (as `cargo test --benches` does), it makes one small unmeasured pass
//! of each part as a smoke test. Every container it starts is removed, every warm runner
//! retired through the pool, and the ledger left charging nothing.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use billet_controlplane_stub::now_ms;
use billet_controlplane_stub::plane::WarmConfig;
use billet_tests::bench::{MetricsReading, Samples, median, median_interval, rss_bytes};
use billet_tests::cluster::{Cluster, ClusterOptions, TIER, free_port, scratch_dir, standin_image};
use billet_tests::image::{STANDIN_ENTRYPOINT, binary_path, connect_docker};
use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{CreateContainerOptions, RemoveContainerOptions};
use futures::StreamExt as _;
use scaleset::JobRequestId;
use scaleset::testing::{Emulator, EmulatorState, JobState};

const NODE: &str = "node-1";
/// Memory per runner: small, so that the node's 8 GiB hold every warm runner and job at once.
const MEMORY_BYTES: u64 = 64 << 20;
/// How long each stand-in works on its job: short, so a job's teardown ends soon after.
const WORK_MS: u64 = 200;
/// A warm runner's container name starts so.
const WARM_PREFIX: &str = "billet_warm-";
/// The bound of every wait for jobs, runners and cleanups.
const PATIENCE: Duration = Duration::from_secs(180);

/// What the run measures, from the environment.
#[derive(Debug, Clone, Copy)]
struct Knobs {
    iterations: usize,
    burst: usize,
    burst_rounds: usize,
    refill: usize,
    refill_rounds: usize,
    rss_warm: usize,
    plane_mints: bool,
}

impl Knobs {
    fn read(measuring: bool) -> Result<Self> {
        let plane_mints = match std::env::var("BILLET_BENCH_MINT").as_deref() {
            Ok("node") | Err(_) => false,
            Ok("plane") => true,
            Ok(other) => bail!("BILLET_BENCH_MINT must be `node` or `plane`, not {other:?}"),
        };
        if !measuring {
            return Ok(Self {
                iterations: 1,
                burst: 2,
                burst_rounds: 1,
                refill: 2,
                refill_rounds: 1,
                rss_warm: 2,
                plane_mints,
            });
        }
        let knobs = Self {
            iterations: count("BILLET_BENCH_ITERATIONS", 30)?,
            burst: count("BILLET_BENCH_BURST", 20)?,
            burst_rounds: count("BILLET_BENCH_BURST_ROUNDS", 3)?,
            refill: count("BILLET_BENCH_REFILL", 10)?,
            refill_rounds: count("BILLET_BENCH_REFILL_ROUNDS", 3)?,
            rss_warm: count("BILLET_BENCH_RSS_WARM", 50)?,
            plane_mints,
        };
        ensure!(
            [
                knobs.iterations,
                knobs.burst,
                knobs.burst_rounds,
                knobs.refill,
                knobs.refill_rounds,
                knobs.rss_warm
            ]
            .iter()
            .all(|n| *n > 0),
            "every BILLET_BENCH_* count must be at least 1"
        );
        Ok(knobs)
    }
}

/// A count from the environment, or `default`.
fn count(var: &str, default: usize) -> Result<usize> {
    match std::env::var(var) {
        Ok(text) => text
            .trim()
            .parse()
            .with_context(|| format!("{var}={text:?} is not a count")),
        Err(std::env::VarError::NotPresent) => Ok(default),
        Err(e) => Err(e).with_context(|| format!("read {var}")),
    }
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    let measuring = std::env::args().any(|a| a == "--bench");
    let knobs = match Knobs::read(measuring) {
        Ok(knobs) => knobs,
        Err(e) => {
            eprintln!("warm bench: {e:#}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("warm bench: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(knobs, measuring)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("warm bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// The cluster, the engine and the baseline's containers.
#[derive(Debug)]
struct Bench {
    cluster: Cluster,
    docker: Docker,
    metrics: std::net::SocketAddr,
    /// The tier's image as the plane names it (pinned by content).
    image: String,
    /// The baseline's containers carry this deployment label, so the node never counts them.
    baseline_deployment: String,
    /// The warm count last asked for.
    warm: u32,
}

/// Parts 1 and 2 for single jobs of one mode.
#[derive(Debug, Default)]
struct Singles {
    /// The node's launch command, per job.
    launch: Samples,
    /// Create and start by bollard, in the same iteration.
    baseline: Samples,
    /// Queued -> taken, per job.
    taken: Samples,
    /// The node's metrics over the measured jobs.
    node: MetricsReading,
    /// Launches the node handed to a warm runner.
    claims: f64,
}

async fn run(knobs: Knobs, measuring: bool) -> Result<()> {
    let docker = connect_docker().await?;
    let engine = docker.version().await.context("ask Docker its version")?;
    println!(
        "warm bench: starting the cluster (`billet` and `billet-standin-runner` are built first if stale)"
    );
    let metrics = free_port()?;
    let vcpu = u32::try_from((2 * knobs.burst).max(knobs.rss_warm).max(knobs.refill) + 4)?;
    let cluster = Cluster::start(ClusterOptions {
        nodes: vec![NODE.to_owned()],
        node_log: "warn".into(),
        node_env: vec![("BILLET_METRICS_LISTEN".into(), metrics.to_string())],
        work_ms: WORK_MS,
        node_vcpu: vcpu,
        tier_memory_bytes: MEMORY_BYTES,
        mint_before_dispatch: knobs.plane_mints,
        warm: WarmConfig {
            count: 0,
            idle_retire: None,
            max_age: None,
        },
        ..ClusterOptions::default()
    })
    .await
    .context("start the cluster")?;
    let image = standin_image(&docker).await?;
    let dir = cluster.dir.clone();
    let mut bench = Bench {
        baseline_deployment: format!("{}-baseline", cluster.deployment),
        cluster,
        docker,
        metrics,
        image,
        warm: 0,
    };
    let started = Instant::now();
    let measured = tokio::select! {
        m = bench.measure(knobs) => Some(m),
        _ = tokio::signal::ctrl_c() => None,
    };
    let took = started.elapsed();
    let api = bench.docker.client_version().to_string();
    let cleaned = bench.clean_up().await;
    let Bench {
        cluster,
        docker,
        baseline_deployment,
        ..
    } = bench;
    cluster.shutdown().await.context("shut the cluster down")?;
    let left = labelled(&docker, &baseline_deployment).await?;
    ensure!(left.is_empty(), "baseline containers survived: {left:?}");
    let _ = std::fs::remove_dir_all(&dir);
    let Some(measured) = measured else {
        bail!("interrupted; everything was cleaned up");
    };
    let report = measured?;
    cleaned?;
    if !measuring {
        println!(
            "warm bench: one small pass of each part ran and was cleaned up (run with `cargo bench` to measure)"
        );
        return Ok(());
    }
    println!();
    println!(
        "warm pool: Docker {}, engine API {api}; {} (1 vCPU, {} MiB, network host), one `billet node` \
         over mTLS (--vcpu {vcpu}); the node mints: {}; {:.0} s measuring",
        engine.version.as_deref().unwrap_or("?"),
        report.image,
        MEMORY_BYTES >> 20,
        if knobs.plane_mints {
            "no (the plane mints before dispatch)"
        } else {
            "yes (MintJit inside the launch)"
        },
        took.as_secs_f64()
    );
    println!("load average at the end: {}", loadavg());
    report.print(knobs);
    Ok(())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Everything measured.
#[derive(Debug, Default)]
struct Report {
    image: String,
    cold: Singles,
    warm: Singles,
    floor_single: Samples,
    cold_burst: Samples,
    warm_burst: Samples,
    floor_burst: Samples,
    /// Per round: (node's refill, bollard's sequential create+start), for the same count.
    refill: Vec<(Duration, Duration)>,
    refill_node: MetricsReading,
    rss: Option<Memory>,
}

#[derive(Debug)]
struct Memory {
    warm: usize,
    node_idle: u64,
    node_warm: u64,
    usage: u64,
    rss: u64,
}

impl Bench {
    async fn measure(&mut self, knobs: Knobs) -> Result<Report> {
        let mut report = Report {
            image: self.image.clone(),
            ..Report::default()
        };
        // A first job of each mode, unmeasured: the node's first launch checks the image and
        // opens its journal's connections.
        println!("warm bench: part 1 and 2, single jobs, cold then warm");
        self.set_warm(0).await?;
        self.one_job().await.context("warm-up job")?;
        report.cold = self.singles(knobs.iterations).await.context("cold jobs")?;
        self.set_warm(1).await?;
        self.one_job().await.context("warm-up job")?;
        report.warm = self.singles(knobs.iterations).await.context("warm jobs")?;
        ensure!(
            report.warm.claims >= knobs.iterations as f64,
            "only {} of {} warm launches were handed a warm runner",
            report.warm.claims,
            knobs.iterations
        );
        ensure!(
            report.cold.claims == 0.0,
            "a cold launch was handed a warm runner"
        );

        println!(
            "warm bench: part 2, the floor (no plane, no node) and bursts of {}",
            knobs.burst
        );
        let floor = Floor::start().await?;
        for _ in 0..knobs.iterations {
            for d in floor.burst(1).await.context("floor, single")? {
                report.floor_single.push(d);
            }
        }
        for round in 0..knobs.burst_rounds {
            for d in floor.burst(knobs.burst).await.context("floor, burst")? {
                report.floor_burst.push(d);
            }
            // Alternate which mode goes first.
            let modes = if round % 2 == 0 {
                [0, knobs.burst]
            } else {
                [knobs.burst, 0]
            };
            for warm in modes {
                self.set_warm(u32::try_from(warm)?).await?;
                let taken = self.burst(knobs.burst).await.context("burst")?;
                let into = if warm == 0 {
                    &mut report.cold_burst
                } else {
                    &mut report.warm_burst
                };
                into.0.extend(taken.0);
            }
        }
        drop(floor);

        println!(
            "warm bench: part 3, refilling {} warm runners",
            knobs.refill
        );
        self.set_warm(0).await?;
        let before = MetricsReading::read(self.metrics).await?;
        for round in 0..knobs.refill_rounds {
            let (node, baseline) = if round % 2 == 0 {
                let node = self.refill(knobs.refill).await?;
                (node, self.baseline_sequential(knobs.refill).await?)
            } else {
                let baseline = self.baseline_sequential(knobs.refill).await?;
                (self.refill(knobs.refill).await?, baseline)
            };
            report.refill.push((node, baseline));
        }
        report.refill_node = MetricsReading::read(self.metrics).await?.since(&before);

        println!(
            "warm bench: part 4, memory with {} warm runners",
            knobs.rss_warm
        );
        report.rss = Some(self.memory(knobs.rss_warm).await?);
        self.set_warm(0).await?;
        Ok(report)
    }

    /// Asks for `n` warm runners and waits until exactly that many are ready and charged, and
    /// nothing else runs.
    async fn set_warm(&mut self, n: u32) -> Result<()> {
        self.cluster
            .plane
            .ledger()
            .set_warm_wanted(TIER, n, now_ms())
            .await?;
        self.warm = n;
        self.wait_settled().await
    }

    /// Waits until every lease has ended, no job's container is left, and the pool holds
    /// exactly the wanted warm runners, ready and charged.
    async fn wait_settled(&self) -> Result<()> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let containers = self.cluster.containers().await?;
            let (warm, jobs): (Vec<_>, Vec<_>) =
                containers.iter().partition(|n| n.starts_with(WARM_PREFIX));
            let open = self
                .cluster
                .plane
                .ledger()
                .leases()
                .await?
                .into_iter()
                .filter(|l| !l.phase.is_terminal())
                .count();
            let rooms = self.cluster.plane.ledger().warm_rooms().await?.len();
            let reading = MetricsReading::read(self.metrics).await?;
            let ready = reading.sum("billet_warm_runners", &[("state", "ready")]);
            let n = self.warm as usize;
            if jobs.is_empty() && open == 0 && warm.len() == n && rooms == n && ready == n as f64 {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "not settled after {PATIENCE:?} at {n} warm: job containers {jobs:?}, warm \
                     containers {}, open leases {open}, warm rooms {rooms}, ready {ready}",
                    warm.len()
                );
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }

    /// `iterations` single jobs, each beside a baseline create and start, alternating which
    /// goes first.
    async fn singles(&self, iterations: usize) -> Result<Singles> {
        let mut singles = Singles::default();
        let before = MetricsReading::read(self.metrics).await?;
        for i in 0..iterations {
            let (job, baseline) = if i % 2 == 0 {
                let job = self.one_job().await?;
                (job, self.baseline_once().await?)
            } else {
                let baseline = self.baseline_once().await?;
                (self.one_job().await?, baseline)
            };
            singles.launch.push(job.launch);
            singles.taken.push(job.taken);
            singles.baseline.push(baseline);
            singles.claims += job.claims;
        }
        singles.node = MetricsReading::read(self.metrics).await?.since(&before);
        Ok(singles)
    }

    /// Queues one job and waits until a runner took it, it completed and everything settled.
    async fn one_job(&self) -> Result<Job> {
        let before = MetricsReading::read(self.metrics).await?;
        let queued = Instant::now();
        let job = self
            .cluster
            .emulator
            .queue_job(self.cluster.plane.scale_set(), [TIER]);
        let taken = wait_taken(&self.cluster.emulator, &[(job, queued)]).await?[0];
        self.cluster.wait_jobs_completed(&[job], PATIENCE).await?;
        self.wait_settled().await?;
        let node = MetricsReading::read(self.metrics).await?.since(&before);
        let launches = node.sum(
            "billet_command_duration_seconds_count",
            &[("kind", "launch")],
        );
        ensure!(
            launches == 1.0,
            "one job made {launches} launches on the node"
        );
        let launch = node.sum("billet_command_duration_seconds_sum", &[("kind", "launch")]);
        Ok(Job {
            taken,
            launch: Duration::from_secs_f64(launch),
            claims: node.sum("billet_warm_claims_total", &[]),
        })
    }

    /// Queues `n` jobs at once; returns each one's queued -> taken once all settled.
    async fn burst(&self, n: usize) -> Result<Samples> {
        let set = self.cluster.plane.scale_set();
        let jobs: Vec<(JobRequestId, Instant)> = (0..n)
            .map(|_| {
                let queued = Instant::now();
                (self.cluster.emulator.queue_job(set, [TIER]), queued)
            })
            .collect();
        let taken = wait_taken(&self.cluster.emulator, &jobs).await?;
        let ids: Vec<JobRequestId> = jobs.iter().map(|(j, _)| *j).collect();
        self.cluster.wait_jobs_completed(&ids, PATIENCE).await?;
        self.wait_settled().await?;
        Ok(Samples(taken))
    }

    /// From no warm runner to `n`: the time from the node taking the count in to the `n`th
    /// ready, then back to none.
    async fn refill(&mut self, n: usize) -> Result<Duration> {
        self.cluster
            .plane
            .ledger()
            .set_warm_wanted(TIER, u32::try_from(n)?, now_ms())
            .await?;
        self.warm = u32::try_from(n)?;
        let deadline = Instant::now() + PATIENCE;
        let mut told = None;
        loop {
            let reading = MetricsReading::read(self.metrics).await?;
            let wanted = reading.sum("billet_warm_runners", &[("state", "wanted")]);
            let ready = reading.sum("billet_warm_runners", &[("state", "ready")]);
            if told.is_none() && wanted == n as f64 {
                told = Some(Instant::now());
            }
            if let Some(told) = told
                && ready == n as f64
            {
                let took = told.elapsed();
                self.wait_settled().await?;
                self.set_warm(0).await?;
                return Ok(took);
            }
            if Instant::now() > deadline {
                bail!(
                    "{n} warm runners not ready after {PATIENCE:?}: wanted {wanted}, ready {ready}"
                );
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Fills the pool to `n`, reads the node's RSS and the containers' memory, and empties it.
    async fn memory(&mut self, n: usize) -> Result<Memory> {
        self.set_warm(0).await?;
        let pid = self.cluster.nodes[NODE].pid().context("the node's pid")?;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let node_idle = rss_bytes(pid)?;
        self.set_warm(u32::try_from(n)?).await?;
        // Past one confirmation with the ledger and the engine, which walks every warm runner.
        tokio::time::sleep(Duration::from_secs(11)).await;
        let node_warm = rss_bytes(pid)?;
        let (mut usage, mut rss) = (0, 0);
        for name in self.cluster.containers().await? {
            let stats = self
                .docker
                .stats(
                    &name,
                    Some(
                        bollard::query_parameters::StatsOptionsBuilder::new()
                            .stream(false)
                            .one_shot(true)
                            .build(),
                    ),
                )
                .next()
                .await
                .with_context(|| format!("no stats of {name}"))?
                .with_context(|| format!("stats of {name}"))?;
            let memory = stats.memory_stats.unwrap_or_default();
            usage += memory.usage.unwrap_or(0);
            let parts = memory.stats.unwrap_or_default();
            // cgroup v1 says rss (and total_rss); v2 says anon.
            rss += ["total_rss", "rss", "anon"]
                .iter()
                .find_map(|k| parts.get(*k))
                .copied()
                .unwrap_or(0);
        }
        self.set_warm(0).await?;
        Ok(Memory {
            warm: n,
            node_idle,
            node_warm,
            usage,
            rss,
        })
    }

    /// Creates and starts one container as the node shapes a runner, timed; removes it untimed.
    async fn baseline_once(&self) -> Result<Duration> {
        let started = Instant::now();
        let id = self.baseline_create_start().await?;
        let took = started.elapsed();
        self.remove(&id).await?;
        Ok(took)
    }

    /// Creates and starts `n` containers one after another, timed; removes them untimed.
    async fn baseline_sequential(&self, n: usize) -> Result<Duration> {
        let started = Instant::now();
        let mut ids = Vec::with_capacity(n);
        for _ in 0..n {
            ids.push(self.baseline_create_start().await?);
        }
        let took = started.elapsed();
        for id in ids {
            self.remove(&id).await?;
        }
        Ok(took)
    }

    /// As the node's Docker provider builds a warm runner (image, entrypoint, the tier's
    /// environment, CPU and memory limits, network), its runner blocked waiting as a warm one is
    /// (mode `never-connect` with a config that points nowhere).
    async fn baseline_create_start(&self) -> Result<String> {
        let name = format!(
            "billet-baseline-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        );
        let config = base64::Engine::encode(
            &base64::engine::general_purpose::STANDARD,
            serde_json::json!({
                "runnerId": 1,
                "runnerName": name,
                "scaleSetId": 1,
                "emulator": "http://127.0.0.1:9",
            })
            .to_string(),
        );
        let body = ContainerCreateBody {
            image: Some(self.image.clone()),
            entrypoint: Some(vec![STANDIN_ENTRYPOINT.to_owned()]),
            cmd: Some(Vec::new()),
            env: Some(vec![
                format!("BILLET_STANDIN_WORK_MS={WORK_MS}"),
                "BILLET_STANDIN_IDLE_TIMEOUT_MS=120000".into(),
                "BILLET_STANDIN_MODE=never-connect".into(),
                format!("ACTIONS_RUNNER_INPUT_JITCONFIG={config}"),
            ]),
            labels: Some(HashMap::from([(
                "sh.billet.deployment".to_owned(),
                self.baseline_deployment.clone(),
            )])),
            host_config: Some(HostConfig {
                nano_cpus: Some(1_000_000_000),
                memory: Some(i64::try_from(MEMORY_BYTES)?),
                memory_swap: Some(i64::try_from(MEMORY_BYTES)?),
                network_mode: Some("host".to_owned()),
                ..Default::default()
            }),
            ..Default::default()
        };
        let created = self
            .docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.clone()),
                    ..Default::default()
                }),
                body,
            )
            .await
            .with_context(|| format!("create {name}"))?;
        self.docker
            .start_container(&created.id, None)
            .await
            .with_context(|| format!("start {name}"))?;
        Ok(created.id)
    }

    async fn remove(&self, id: &str) -> Result<()> {
        self.docker
            .remove_container(
                id,
                Some(RemoveContainerOptions {
                    force: true,
                    v: true,
                    ..Default::default()
                }),
            )
            .await
            .with_context(|| format!("remove {id}"))
    }

    /// Retires the pool through the plane, waits until the node's containers are gone and the
    /// ledger charges nothing, and removes any baseline container an error left.
    async fn clean_up(&mut self) -> Result<()> {
        let pool = async {
            self.cluster
                .plane
                .ledger()
                .set_warm_wanted(TIER, 0, now_ms())
                .await?;
            self.cluster.wait_clean(PATIENCE).await
        }
        .await;
        for id in labelled(&self.docker, &self.baseline_deployment).await? {
            let _ = self.remove(&id).await;
        }
        for runner in self.cluster.emulator.state().runners {
            let _ = self
                .cluster
                .emulator
                .client()
                .remove_runner(runner.id)
                .await;
        }
        pool
    }
}

/// One single job: queued -> taken, the node's launch, and whether it was handed a warm runner.
#[derive(Debug)]
struct Job {
    taken: Duration,
    launch: Duration,
    claims: f64,
}

/// Waits until each job is running on a runner (or done), and returns how long after its
/// `Instant` each was first seen so. The emulator wakes the wait on every change.
async fn wait_taken(
    emulator: &Emulator,
    jobs: &[(JobRequestId, Instant)],
) -> Result<Vec<Duration>> {
    let mut taken: Vec<Option<Duration>> = vec![None; jobs.len()];
    let seen = |state: &EmulatorState| {
        let now = Instant::now();
        for ((id, queued), at) in jobs.iter().zip(taken.iter_mut()) {
            if at.is_none()
                && state.jobs.iter().any(|j| {
                    j.id == *id && matches!(j.state, JobState::Running | JobState::Completed)
                })
            {
                *at = Some(now - *queued);
            }
        }
        taken.iter().all(Option::is_some)
    };
    // The emulator's own wait panics at its bound; this one ends first.
    let waited = tokio::time::timeout(PATIENCE, emulator.wait_until(PATIENCE * 2, seen)).await;
    if waited.is_err() {
        bail!(
            "jobs not taken within {PATIENCE:?}: {:?}",
            emulator.state().jobs
        );
    }
    Ok(taken.into_iter().flatten().collect())
}

/// Names of every container (any state) whose deployment label is `deployment`.
async fn labelled(docker: &Docker, deployment: &str) -> Result<Vec<String>> {
    billet_tests::cluster::containers_of(docker, deployment, Vec::new()).await
}

/// The floor of queued -> taken: the emulator, a session as the plane's listener holds, and
/// stand-in runner processes on this host, each already blocked on its credentials FIFO.
struct Floor {
    emulator: Emulator,
    set: scaleset::ScaleSetId,
    session: scaleset::MessageSession,
    dir: std::path::PathBuf,
}

impl std::fmt::Debug for Floor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Floor")
            .field("set", &self.set)
            .finish_non_exhaustive()
    }
}

impl Drop for Floor {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Floor {
    async fn start() -> Result<Self> {
        let emulator = Emulator::builder()
            .long_poll(Duration::from_millis(300))
            .start()
            .await;
        let client = emulator.client();
        let set = client
            .create_runner_scale_set(&scaleset::RunnerScaleSetSpec::new("floor"))
            .await
            .context("create the floor's scale set")?
            .id;
        let session = client
            .create_message_session(set, "warm-bench")
            .await
            .context("open the floor's session")?;
        Ok(Self {
            emulator,
            set,
            session,
            dir: scratch_dir("billet-warm-floor")?,
        })
    }

    /// `n` runners waiting on their FIFOs, then `n` jobs queued at once, acquired, each
    /// registration minted and written to a FIFO: each job's queued -> taken.
    async fn burst(&self, n: usize) -> Result<Vec<Duration>> {
        use scaleset::ExposeSecret as _;
        let mut runners = Vec::with_capacity(n);
        for _ in 0..n {
            let fifo = self.dir.join(uuid::Uuid::new_v4().simple().to_string());
            let made = std::process::Command::new("mkfifo")
                .arg(&fifo)
                .status()
                .context("mkfifo")?;
            ensure!(made.success(), "mkfifo {} failed", fifo.display());
            let child = tokio::process::Command::new(binary_path("billet-standin-runner")?)
                .env("BILLET_SECRETS_FILE", &fifo)
                .env("BILLET_STANDIN_WORK_MS", "100")
                .env("BILLET_STANDIN_IDLE_TIMEOUT_MS", "60000")
                .stdin(std::process::Stdio::null())
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .kill_on_drop(true)
                .spawn()
                .context("start a stand-in runner")?;
            runners.push((fifo, child));
        }
        // Long enough for every runner to have opened its FIFO and blocked on it.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let jobs: Vec<(JobRequestId, Instant)> = (0..n)
            .map(|_| {
                let queued = Instant::now();
                (
                    self.emulator.queue_job(self.set, Vec::<String>::new()),
                    queued,
                )
            })
            .collect();
        let ids: Vec<JobRequestId> = jobs.iter().map(|(j, _)| *j).collect();
        let acquired = self.session.acquire_jobs(&ids).await.context("acquire")?;
        ensure!(acquired.len() == n, "acquired {acquired:?} of {ids:?}");
        let client = self.emulator.client();
        let mut writes = Vec::with_capacity(n);
        for (fifo, _) in &runners {
            let name = format!("floor-{}", &uuid::Uuid::new_v4().simple().to_string()[..12]);
            let jit = client
                .generate_jit_config(self.set, &scaleset::JitRunnerSetting::new(&name))
                .await
                .context("mint")?;
            let line = format!(
                "ACTIONS_RUNNER_INPUT_JITCONFIG={}\n",
                jit.encoded_jit_config.expose_secret()
            );
            let fifo = fifo.clone();
            writes.push(tokio::task::spawn_blocking(move || {
                std::fs::write(fifo, line)
            }));
        }
        let taken = wait_taken(&self.emulator, &jobs).await?;
        for write in writes {
            write.await?.context("write a runner's credentials")?;
        }
        for (fifo, mut child) in runners {
            let status = tokio::time::timeout(PATIENCE, child.wait())
                .await
                .context("a floor runner did not exit")??;
            ensure!(status.success(), "a floor runner ended {status}");
            let _ = std::fs::remove_file(fifo);
        }
        Ok(taken)
    }
}

impl Report {
    fn print(&self, knobs: Knobs) {
        let n = knobs.iterations;
        println!();
        println!(
            "1. the launch in the node against Docker's create + start ({n} jobs per mode, each beside one baseline)"
        );
        println!(
            "  {:<56} {:>8} {:>8} {:>8} {:>8}",
            "ms", "median", "p90", "min", "max"
        );
        for (label, s) in [
            ("warm: Launch command in the node", &self.warm.launch),
            (
                "  its baseline: bollard create + start",
                &self.warm.baseline,
            ),
            ("cold: Launch command in the node", &self.cold.launch),
            (
                "  its baseline: bollard create + start",
                &self.cold.baseline,
            ),
        ] {
            row(label, s);
        }
        for (label, singles, goal) in [("warm", &self.warm, Some(0.05)), ("cold", &self.cold, None)]
        {
            let mut ratios: Vec<f64> = singles
                .launch
                .0
                .iter()
                .zip(&singles.baseline.0)
                .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64())
                .collect();
            ratios.sort_by(f64::total_cmp);
            let (low, high) = median_interval(&ratios);
            let m = median(&ratios);
            let verdict = goal.map_or_else(String::new, |g| {
                format!(
                    "  goal <= {g}: {}",
                    if high <= g {
                        "met"
                    } else if m <= g {
                        "met at the median, within noise"
                    } else if low <= g {
                        "not met at the median, within noise"
                    } else {
                        "not met"
                    }
                )
            });
            println!(
                "  {label} launch / create+start, per iteration: median {m:.4} (95% interval {low:.4} to {high:.4}), ratio of medians {:.4}{verdict}",
                singles.launch.median_ms() / singles.baseline.median_ms()
            );
        }
        println!("  where a warm launch's time goes (means, ms, the node's metrics):");
        let node = &self.warm.node;
        let mean = |family: &str, labels: &[(&str, &str)]| {
            let count = node.sum(&format!("{family}_count"), labels);
            if count > 0.0 {
                format!(
                    "{:.2}",
                    node.sum(&format!("{family}_sum"), labels) * 1000.0 / count
                )
            } else {
                "-".into()
            }
        };
        for (label, family, labels) in [
            (
                "whole command",
                "billet_command_duration_seconds",
                [("kind", "launch")],
            ),
            (
                "bind + advance",
                "billet_launch_step_duration_seconds",
                [("step", "bind_advance")],
            ),
            (
                "mint (MintJit)",
                "billet_launch_step_duration_seconds",
                [("step", "mint")],
            ),
            (
                "claim: rename + handoff",
                "billet_provider_call_duration_seconds",
                [("call", "claim_warm")],
            ),
            (
                "image check",
                "billet_provider_call_duration_seconds",
                [("call", "check_image")],
            ),
        ] {
            println!("    {label:<40} {:>8}", mean(family, &labels));
        }

        println!();
        println!("2. queued -> taken (the job running on a runner)");
        println!(
            "  {:<56} {:>8} {:>8} {:>8} {:>8}",
            "ms", "median", "p95", "min", "max"
        );
        for (label, s) in [
            ("single job, warm (1 ready)", &self.warm.taken),
            ("single job, cold", &self.cold.taken),
            ("single job, floor (no plane, no node)", &self.floor_single),
        ] {
            row95(label, s);
        }
        let bursts = format!("{} bursts of {}", knobs.burst_rounds, knobs.burst);
        for (label, s) in [
            (
                format!("burst, warm ({} ready), {bursts}", knobs.burst),
                &self.warm_burst,
            ),
            (format!("burst, cold, {bursts}"), &self.cold_burst),
            (format!("burst, floor, {bursts}"), &self.floor_burst),
        ] {
            row95(&label, s);
        }
        let single = self.warm.taken.median_ms();
        println!(
            "  single warm p50 {single:.1} ms (goal <= 25: {}); cold/warm {:.1}x; warm - floor {:.1} ms",
            if single <= 25.0 { "met" } else { "not met" },
            self.cold.taken.median_ms() / single,
            single - self.floor_single.median_ms()
        );
        let p95 = self.warm_burst.percentile_ms(95.0);
        println!(
            "  burst warm p95 {p95:.1} ms (goal <= 300: {}); cold/warm {:.1}x; floor p95 {:.1} ms",
            if p95 <= 300.0 { "met" } else { "not met" },
            self.cold_burst.percentile_ms(95.0) / p95,
            self.floor_burst.percentile_ms(95.0)
        );

        println!();
        println!("3. refill from 0 to {} warm runners", knobs.refill);
        #[allow(clippy::cast_precision_loss)]
        let per_s = |d: &Duration| knobs.refill as f64 / d.as_secs_f64();
        for (i, (node, baseline)) in self.refill.iter().enumerate() {
            println!(
                "  round {}: node {:.2} s ({:.1}/s), bollard create+start one after another {:.2} s ({:.1}/s), ratio of rates {:.2}",
                i + 1,
                node.as_secs_f64(),
                per_s(node),
                baseline.as_secs_f64(),
                per_s(baseline),
                per_s(node) / per_s(baseline)
            );
        }
        let r = &self.refill_node;
        let create = r.sum(
            "billet_provider_call_duration_seconds_sum",
            &[("call", "create_warm")],
        );
        let count = r.sum(
            "billet_provider_call_duration_seconds_count",
            &[("call", "create_warm")],
        );
        if count > 0.0 {
            println!(
                "  the node's create_warm (create + start) mean {:.1} ms over {count} runners",
                create * 1000.0 / count
            );
        }

        if let Some(m) = &self.rss {
            let mib = |b: u64| b as f64 / f64::from(1 << 20);
            #[allow(clippy::cast_precision_loss)]
            let per = |b: u64| mib(b) / m.warm as f64;
            println!();
            println!("4. memory with {} warm runners", m.warm);
            println!(
                "  node RSS: {:.1} MiB with none, {:.1} MiB with {} ({:+.1} MiB, {:.3} MiB per warm runner)",
                mib(m.node_idle),
                mib(m.node_warm),
                m.warm,
                mib(m.node_warm) - mib(m.node_idle),
                (mib(m.node_warm) - mib(m.node_idle)) / m.warm as f64
            );
            println!(
                "  containers: usage {:.1} MiB in all, {:.2} MiB per warm runner; RSS {:.2} MiB per warm runner",
                mib(m.usage),
                per(m.usage),
                per(m.rss)
            );
        }
    }
}

fn row(label: &str, s: &Samples) {
    println!(
        "  {label:<56} {:>8.2} {:>8.2} {:>8.2} {:>8.2}",
        s.median_ms(),
        s.percentile_ms(90.0),
        s.min_ms(),
        s.max_ms()
    );
}

fn row95(label: &str, s: &Samples) {
    println!(
        "  {label:<56} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
        s.median_ms(),
        s.percentile_ms(95.0),
        s.min_ms(),
        s.max_ms()
    );
}
