//! Launch latency: what billet adds on top of Docker.
//!
//! Measures, interleaved in one run against the same engine and image:
//!
//! - **(a) Launch**: the plane's launch of a lease on a real `billet node` process over mTLS, from
//!   the plane's first step to receiving the node's result. By default (`BILLET_BENCH_MINT=plane`)
//!   the plane mints the JIT config from the scale-set emulator and records it in its SQLite
//!   ledger first, as `billet-plane` does for a node that takes a registration, then
//!   [`NodeLink::dispatch`]es the `Launch` carrying it; the node creates the container beside
//!   `BindAdvance` (Bind and Advance(launching) in one node call and one ledger transaction) and
//!   starts it once the bind holds. With `BILLET_BENCH_MINT=node` the `Launch` carries no
//!   registration and the node asks the plane to mint (`MintJit`) after its bind and before its
//!   create, as an older plane or node does. Either way it covers the session, the node's single
//!   slot, the mint and the Docker provider's create and start of the container.
//! - **(b) baseline**: what a launch cannot do without: a JIT config minted from the scale-set
//!   emulator exactly as the plane mints one (the stub's `Github::mint`), then the same container
//!   (image, entrypoint, environment with that config, labels, CPU and memory limits, network)
//!   created and started directly through the Docker API with bollard.
//!
//! Each iteration runs (a) and (b) once, alternating which goes first, after a warm-up. Only
//! launch and mint+create+start are timed; the teardown of each is not (for (a): a `Destroy`
//! command, releasing the lease in the ledger and removing the runner registration from the
//! emulator; for (b): `docker rm -f` and removing the minted registration). Nothing is left
//! behind: no container, no open lease, no registration. Printed: median, p90, min and max of
//! each, the ratio of the medians, and the min, median and max of the per-iteration ratios
//! (a)/(b), with the 95% interval of that median (distribution-free, from the order
//! statistics), which says whether a run has enough iterations to tell the goal's 1.02 from
//! its neighbours.
//!
//! ```text
//! cargo bench -p billet-tests --bench launch
//! BILLET_BENCH_ITERATIONS=1000 BILLET_BENCH_WARMUP=10 cargo bench -p billet-tests --bench launch
//! BILLET_BENCH_MINT=node cargo bench -p billet-tests --bench launch
//! ```
//!
//! Run without `--bench` (as `cargo test --benches` does), it makes one unmeasured pass as a
//! smoke test.
//!
//! It needs a running Docker engine. [`Cluster::start`] builds `billet` and
//! `billet-standin-runner` first if stale, in the bench's own profile (release), so the node
//! measured is an optimised one.

use std::collections::HashMap;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use billet_controlplane_stub::calls::lease_to_wire;
use billet_controlplane_stub::github::Github;
use billet_controlplane_stub::ledger::{Charge, Lease, NewLease, Phase};
use billet_controlplane_stub::node_link::NodeLink;
use billet_controlplane_stub::now_ms;
use billet_proto::v1 as pb;
use billet_tests::bench::{MetricsReading, Samples, median_interval};
use billet_tests::cluster::{Cluster, ClusterOptions, STANDIN_IMAGE, TIER, free_port};
use billet_tests::image::{STANDIN_ENTRYPOINT, connect_docker, profile_dir};
use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions,
};

/// The one node.
const NODE: &str = "node-1";
/// Measured iterations, unless `BILLET_BENCH_ITERATIONS` says otherwise.
const DEFAULT_ITERATIONS: usize = 300;
/// Unmeasured iterations first, unless `BILLET_BENCH_WARMUP` says otherwise.
const DEFAULT_WARMUP: usize = 3;
/// The bound of each command sent to the node.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// CPU and memory of every container, as the demo's tier.
const VCPU: u32 = 1;
const MEMORY_BYTES: u64 = 256 << 20;
/// The environment of every container. A runner that is somehow left running gives up on its
/// own after the idle timeout; no job is ever queued, so it never gets to work.
const RUNNER_ENV: [&str; 2] = [
    "BILLET_STANDIN_WORK_MS=0",
    "BILLET_STANDIN_IDLE_TIMEOUT_MS=10000",
];
/// Request ids of the bench's leases start here (the emulator's own job ids are small).
const FIRST_REQUEST_ID: i64 = 900_000;

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    let measuring = std::env::args().any(|a| a == "--bench");
    let (iterations, warmup) = if measuring {
        match (
            count("BILLET_BENCH_ITERATIONS", DEFAULT_ITERATIONS),
            count("BILLET_BENCH_WARMUP", DEFAULT_WARMUP),
        ) {
            (Ok(i), Ok(w)) if i > 0 => (i, w),
            (Ok(_), Ok(_)) => {
                eprintln!("launch bench: BILLET_BENCH_ITERATIONS must be at least 1");
                return ExitCode::from(2);
            }
            (Err(e), _) | (_, Err(e)) => {
                eprintln!("launch bench: {e:#}");
                return ExitCode::from(2);
            }
        }
    } else {
        (1, 0)
    };
    // The plane runs in this process. Errors only, unless RUST_LOG: its first dial can race the
    // node's bind and warn about a refused connection, and every command's outcome is checked
    // here anyway.
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("launch bench: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(iterations, warmup, measuring)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("launch bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// A positive count from the environment, or `default`.
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

/// The cluster, the engine, and what the bench has started but not yet cleaned up.
#[derive(Debug)]
struct Bench {
    cluster: Cluster,
    docker: Docker,
    /// The baseline's containers carry this deployment label rather than the cluster's, so the
    /// node never counts them as its own instances.
    baseline_deployment: String,
    next_request_id: i64,
    /// Mints as the plane does, for the baseline.
    github: Github,
    /// The node's `--metrics-listen` address, read for the per-step breakdown.
    metrics: std::net::SocketAddr,
    /// (a) mints before dispatching and sends the registration in the `Launch`; otherwise the
    /// node mints (`BILLET_BENCH_MINT`).
    plane_mints: bool,
}

/// What one run measured: (a) whole, (b) whole and in its two parts, and the node's own
/// metrics over the measured iterations (warm-up excluded).
#[derive(Debug, Default)]
struct Measured {
    launch: Samples,
    /// Of `launch`, the plane's mint and its record before the dispatch (`BILLET_BENCH_MINT=plane`).
    plane_mint: Samples,
    baseline: Samples,
    baseline_mint: Samples,
    baseline_create: Samples,
    /// Of `baseline_create`, until the engine's create answered (the rest is the start).
    baseline_created: Samples,
    node: MetricsReading,
}

async fn run(iterations: usize, warmup: usize, measuring: bool) -> Result<()> {
    let plane_mints = match std::env::var("BILLET_BENCH_MINT").as_deref() {
        Ok("plane") | Err(_) => true,
        Ok("node") => false,
        Ok(other) => bail!("BILLET_BENCH_MINT must be `plane` or `node`, not {other:?}"),
    };
    let docker = connect_docker().await?;
    let engine = docker
        .version()
        .await
        .context("ask the Docker engine its version")?;
    println!(
        "launch bench: starting the cluster; `billet` and `billet-standin-runner` are built in {} \
         first if stale (cargo is quiet meanwhile; a first build takes minutes)",
        profile_dir().display()
    );
    let metrics = free_port()?;
    let cluster = Cluster::start(ClusterOptions {
        nodes: vec![NODE.to_owned()],
        node_log: "warn".into(),
        node_env: vec![("BILLET_METRICS_LISTEN".into(), metrics.to_string())],
        ..ClusterOptions::default()
    })
    .await
    .context("start the cluster")?;
    let dir = cluster.dir.clone();
    let mut bench = Bench {
        baseline_deployment: format!("{}-baseline", cluster.deployment),
        github: Github::new(cluster.emulator.client()),
        cluster,
        docker,
        next_request_id: FIRST_REQUEST_ID,
        metrics,
        plane_mints,
    };

    let measuring_since = Instant::now();
    let measured = tokio::select! {
        measured = bench.measure(iterations, warmup) => Some(measured),
        _ = tokio::signal::ctrl_c() => None,
    };
    let measuring_took = measuring_since.elapsed();
    // Always: whatever the measurement left (after an error or an interrupt) is removed here.
    let leftovers = bench.clean_up().await;
    let baseline_deployment = bench.baseline_deployment.clone();
    let docker = bench.docker.clone();
    bench
        .cluster
        .shutdown()
        .await
        .context("shut the cluster down")?;
    let after = containers_labelled(&docker, &baseline_deployment).await?;
    ensure!(
        after.is_empty(),
        "baseline containers survived the cleanup: {after:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);

    let Some(measured) = measured else {
        bail!("interrupted; everything was cleaned up");
    };
    let Measured {
        launch,
        plane_mint,
        baseline,
        baseline_mint,
        baseline_create,
        baseline_created,
        node,
    } = measured?;
    let leftovers = leftovers?;
    ensure!(
        leftovers.is_empty(),
        "left behind after the bench: {}",
        leftovers.join("; ")
    );
    if !measuring {
        println!(
            "launch bench: one launch and one baseline ran and were cleaned up (run with `cargo bench` to measure)"
        );
        return Ok(());
    }

    let version = engine.version.as_deref().unwrap_or("?");
    let api = docker.client_version();
    println!();
    println!(
        "launch latency: {iterations} iterations after {warmup} warm-up, (a) and (b) interleaved; \
         Docker {version}, engine API {api}"
    );
    println!(
        "container: {STANDIN_IMAGE}, {VCPU} vCPU, {} MiB, network host; node `billet node` over mTLS on this host",
        MEMORY_BYTES >> 20
    );
    println!(
        "(a) mints {} (BILLET_BENCH_MINT={})",
        if plane_mints {
            "at the plane before dispatch; the node creates beside its bind"
        } else {
            "at the node's MintJit, after its bind and before its create"
        },
        if plane_mints { "plane" } else { "node" }
    );
    println!();
    println!(
        "  {:<52} {:>8} {:>8} {:>8} {:>8}",
        "ms", "median", "p90", "min", "max"
    );
    for (label, samples) in [
        (
            "(a) Launch: plane's mint or dispatch -> node result",
            &launch,
        ),
        ("(b) baseline: JIT mint + Docker create + start", &baseline),
    ] {
        println!(
            "  {label:<52} {:>8.1} {:>8.1} {:>8.1} {:>8.1}",
            samples.median_ms(),
            samples.percentile_ms(90.0),
            samples.percentile_ms(0.0),
            samples.percentile_ms(100.0),
        );
    }
    let (a, b) = (launch.median_ms(), baseline.median_ms());
    println!();
    println!(
        "  ratio (a)/(b) of medians: {:.3}  (billet adds {:.1} ms per launch at the median)",
        a / b,
        a - b
    );
    let mut ratios: Vec<f64> = launch
        .0
        .iter()
        .zip(&baseline.0)
        .map(|(a, b)| a.as_secs_f64() / b.as_secs_f64())
        .collect();
    ratios.sort_by(f64::total_cmp);
    let (low, high) = median_interval(&ratios);
    println!(
        "  per-iteration ratio (a)/(b): min {:.2}, median {:.3}, max {:.2}  (goal: median <= 1.02)",
        ratios[0],
        billet_tests::bench::median(&ratios),
        ratios[ratios.len() - 1]
    );
    println!(
        "    95% interval of that median: {low:.3} to {high:.3}  (ranks n/2 -/+ 0.98 sqrt(n) of the sorted ratios; it narrows as BILLET_BENCH_ITERATIONS grows)"
    );
    print_breakdown(
        &node,
        iterations,
        plane_mints.then_some(&plane_mint),
        &baseline_mint,
        &baseline_create,
        &baseline_created,
    );
    println!();
    println!(
        "  nothing left behind: no container, no open lease, no runner registration ({:.1}s measuring)",
        measuring_took.as_secs_f64()
    );
    Ok(())
}

/// Where a launch's time goes, as the node's own metrics saw it over the measured iterations,
/// beside the baseline's two parts. Means, since the node exports histograms (sum and count).
fn print_breakdown(
    node: &MetricsReading,
    iterations: usize,
    plane_mint: Option<&Samples>,
    mint: &Samples,
    create: &Samples,
    created: &Samples,
) {
    let mean_ms = |family: &str, labels: &[(&str, &str)]| {
        let count = node.sum(&format!("{family}_count"), labels);
        (count > 0.0).then(|| node.sum(&format!("{family}_sum"), labels) * 1000.0 / count)
    };
    let per_launch_ms = |family: &str, labels: &[(&str, &str)]| {
        node.sum(&format!("{family}_sum"), labels) * 1000.0 / iterations as f64
    };
    let mean = |s: &Samples| {
        s.0.iter().map(Duration::as_secs_f64).sum::<f64>() * 1000.0 / s.0.len().max(1) as f64
    };
    let show = |v: Option<f64>| v.map_or_else(|| "-".to_owned(), |v| format!("{v:.1}"));
    println!();
    println!(
        "  where (a)'s time goes, means over the measured iterations (ms; the node's metrics):"
    );
    println!("  {:<60} {:>8} {:>8}", "step", "(a)", "(b)");
    let command = mean_ms("billet_command_duration_seconds", &[("kind", "launch")]);
    let queued = mean_ms("billet_command_queue_wait_seconds", &[("kind", "launch")]);
    let check = mean_ms(
        "billet_provider_call_duration_seconds",
        &[("call", "check_image")],
    );
    let bind = mean_ms(
        "billet_launch_step_duration_seconds",
        &[("step", "bind_advance")],
    );
    let minted = mean_ms("billet_launch_step_duration_seconds", &[("step", "mint")]);
    let create_start = mean_ms("billet_launch_step_duration_seconds", &[("step", "create")]);
    let exists = mean_ms(
        "billet_launch_step_duration_seconds",
        &[("step", "created")],
    );
    let journal = ["put_launch", "amend_launch"]
        .map(|w| per_launch_ms("billet_journal_write_duration_seconds", &[("call", w)]));
    // A launch's result is committed; a destroy's is synced.
    let result = mean_ms(
        "billet_journal_write_duration_seconds",
        &[("call", "put_result_committed")],
    );
    let rows: [(&str, Option<f64>, Option<f64>); 9] = [
        ("wait for the command slot (launches)", queued, None),
        ("image check (one Docker inspect)", check, None),
        ("BindAdvance: plane round trip + ledger commit", bind, None),
        ("launch record, synced (per launch)", Some(journal[0]), None),
        match plane_mint {
            Some(ahead) => (
                "JIT mint at the plane, before dispatch: GitHub + ledger record",
                Some(mean(ahead)),
                Some(mean(mint)),
            ),
            None => (
                "JIT mint: plane round trip + GitHub + ledger commit",
                minted,
                Some(mean(mint)),
            ),
        },
        (
            "launch record amended, committed (registration, then created)",
            Some(journal[1]),
            None,
        ),
        (
            "  of which Docker create (until the container exists)",
            exists,
            Some(mean(created)),
        ),
        ("Docker create + start", create_start, Some(mean(create))),
        (
            "the launch's result, committed beside the answer",
            result,
            None,
        ),
    ];
    for (label, a, b) in rows {
        println!("  {label:<60} {:>8} {:>8}", show(a), show(b));
    }
    // The result is written after the command's own duration ends.
    let parts: f64 = [check, bind, minted, create_start]
        .into_iter()
        .flatten()
        .sum::<f64>()
        + journal.iter().sum::<f64>();
    println!(
        "  {:<60} {:>8}",
        "the launch command in the node (slot start -> result)",
        show(command)
    );
    if let Some(command) = command {
        println!(
            "  {:<60} {:>8.1}",
            "  of which not in a step above (overlapped steps make it negative)",
            command - parts
        );
    }
}

impl Bench {
    fn node(&self) -> Result<&NodeLink> {
        self.cluster
            .plane
            .node(NODE)
            .map(AsRef::as_ref)
            .context("the plane has no link to the node")
    }

    /// Warm-up, then `iterations` of (a) and (b), alternating which goes first.
    async fn measure(&mut self, iterations: usize, warmup: usize) -> Result<Measured> {
        let mut measured = Measured::default();
        let mut before = MetricsReading::default();
        for i in 0..warmup + iterations {
            if i == warmup {
                before = MetricsReading::read(self.metrics).await?;
            }
            let ((a, ahead), (mint, created, create)) = if i % 2 == 0 {
                let a = self.launch_once().await.context("(a) launch")?;
                (a, self.baseline_once().await.context("(b) baseline")?)
            } else {
                let b = self.baseline_once().await.context("(b) baseline")?;
                (self.launch_once().await.context("(a) launch")?, b)
            };
            if i >= warmup {
                measured.launch.0.push(a);
                measured.plane_mint.0.push(ahead);
                measured.baseline.0.push(mint + create);
                measured.baseline_mint.0.push(mint);
                measured.baseline_create.0.push(create);
                measured.baseline_created.0.push(created);
            }
        }
        measured.node = MetricsReading::read(self.metrics).await?.since(&before);
        Ok(measured)
    }

    /// Reserves a lease, times its Launch, then destroys it, releases it and removes its runner
    /// registration (untimed). Returns the launch's time and, of it, the plane's mint before dispatch
    /// (zero when the node mints).
    async fn launch_once(&mut self) -> Result<(Duration, Duration)> {
        let request_id = self.take_request_id();
        let id = short_id();
        let ledger = self.cluster.plane.ledger();
        let lease = ledger
            .reserve(
                NewLease {
                    id: id.clone(),
                    tier: TIER.into(),
                    request_id,
                    vcpu: VCPU,
                    memory_bytes: MEMORY_BYTES,
                    runner_name: Some(format!("billet-{id}")),
                },
                now_ms(),
            )
            .await
            .context("reserve a lease")?;
        let node = self.node()?;

        let started = Instant::now();
        let registration = if self.plane_mints {
            Some(self.mint_ahead(&lease).await?)
        } else {
            None
        };
        let minted_ahead = started.elapsed();
        let command = launch_command(&lease, registration);
        let outcome = node.dispatch(command, COMMAND_TIMEOUT).await;
        let elapsed = started.elapsed();

        ensure!(
            outcome.is_ok(),
            "the launch of lease {id} did not succeed: {}",
            outcome.describe()
        );
        // A launch that answered OK without a running container would measure nothing.
        let name = format!("billet-{id}");
        let inspected = self
            .docker
            .inspect_container(&name, None)
            .await
            .with_context(|| format!("inspect {name}"))?;
        ensure!(
            inspected.state.and_then(|s| s.running) == Some(true),
            "{name} is not running after a successful launch"
        );
        self.tear_down(&lease).await?;
        Ok((elapsed, minted_ahead))
    }

    /// Mints the lease's registration and records it in the ledger with the stub plane's own
    /// step before a dispatch ([`Plane::mint_ahead`](billet_controlplane_stub::plane::Plane)).
    async fn mint_ahead(&self, lease: &Lease) -> Result<pb::JitConfig> {
        self.cluster
            .plane
            .mint_ahead(lease)
            .await
            .map_err(|failed| {
                anyhow::anyhow!(
                    "the plane could not mint for lease {}: {:?}",
                    lease.id,
                    failed.error
                )
            })
    }

    /// Destroys the lease's instance through the node, releases the lease and removes its runner
    /// registration from the emulator.
    async fn tear_down(&self, lease: &Lease) -> Result<()> {
        let destroy = pb::command::Kind::Destroy(pb::Destroy {
            request_id: lease.request_id,
            job_result: None,
            force: false,
            reason: String::new(),
        });
        let outcome = self.node()?.dispatch(destroy, COMMAND_TIMEOUT).await;
        ensure!(
            outcome.is_ok(),
            "the destroy of lease {} did not succeed: {}",
            lease.id,
            outcome.describe()
        );
        let ledger = self.cluster.plane.ledger();
        let current = ledger
            .get(&lease.id)
            .await?
            .with_context(|| format!("lease {} vanished", lease.id))?;
        if !current.phase.is_terminal() {
            ledger
                .release(&lease.id, current.epoch, None, Phase::Done, now_ms())
                .await
                .with_context(|| format!("release lease {}", lease.id))?;
        }
        // No job ran, so the ephemeral runner never deregistered itself.
        let runner_name = format!("billet-{}", lease.id);
        let registered = self
            .cluster
            .emulator
            .state()
            .runners
            .into_iter()
            .filter(|r| r.name == runner_name);
        for runner in registered {
            self.cluster
                .emulator
                .client()
                .remove_runner(runner.id)
                .await
                .with_context(|| format!("remove the runner registration {runner_name}"))?;
        }
        Ok(())
    }

    /// Times minting a JIT config, then creating and starting the same container directly, then
    /// removes both (untimed). Returns its parts: (mint, create, create + start).
    async fn baseline_once(&mut self) -> Result<(Duration, Duration, Duration)> {
        let request_id = self.take_request_id();
        let id = short_id();
        let name = format!("billet-{id}");
        let mut env: Vec<String> = RUNNER_ENV.iter().map(|e| (*e).to_owned()).collect();

        let started = Instant::now();
        let minted = self
            .github
            .mint(TIER, &name)
            .await
            .with_context(|| format!("mint a JIT config for {name}"))?;
        let mint_took = started.elapsed();
        env.push(format!("ACTIONS_RUNNER_INPUT_JITCONFIG={}", minted.config));
        let labels = HashMap::from([
            (
                "sh.billet.deployment".to_owned(),
                self.baseline_deployment.clone(),
            ),
            ("sh.billet.node".to_owned(), NODE.to_owned()),
            ("sh.billet.lease".to_owned(), id.clone()),
            ("sh.billet.epoch".to_owned(), "1".to_owned()),
            ("sh.billet.request".to_owned(), request_id.to_string()),
        ]);
        // As the node's Docker provider builds it (agent/src/provider/docker.rs, container_for).
        let body = ContainerCreateBody {
            image: Some(STANDIN_IMAGE.to_owned()),
            entrypoint: Some(vec![STANDIN_ENTRYPOINT.to_owned()]),
            cmd: Some(Vec::new()),
            env: Some(env),
            labels: Some(labels),
            host_config: Some(HostConfig {
                nano_cpus: Some(i64::from(VCPU) * 1_000_000_000),
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
        let created_took = started.elapsed() - mint_took;
        self.docker
            .start_container(&created.id, None)
            .await
            .with_context(|| format!("start {name}"))?;
        let elapsed = started.elapsed();
        let create_took = elapsed - mint_took;

        self.docker
            .remove_container(
                &created.id,
                Some(RemoveContainerOptions {
                    force: true,
                    v: true,
                    ..Default::default()
                }),
            )
            .await
            .with_context(|| format!("remove {name}"))?;
        self.github
            .remove_runner(minted.runner_id, &minted.runner_name)
            .await
            .with_context(|| format!("remove the runner registration {name}"))?;
        Ok((mint_took, created_took, create_took))
    }

    fn take_request_id(&mut self) -> i64 {
        self.next_request_id += 1;
        self.next_request_id
    }

    /// Removes whatever an interrupted or failed measurement left, then says what was found:
    /// the node's instances, baseline containers, open leases, runner registrations.
    async fn clean_up(&self) -> Result<Vec<String>> {
        let mut found = Vec::new();
        let open: Vec<Lease> = self
            .cluster
            .plane
            .ledger()
            .leases()
            .await?
            .into_iter()
            .filter(|l| !l.phase.is_terminal())
            .collect();
        for lease in &open {
            found.push(format!("open lease {} ({})", lease.id, lease.phase));
            if let Err(e) = self.tear_down(lease).await {
                eprintln!("launch bench: cleaning up lease {}: {e:#}", lease.id);
            }
        }
        for name in self.cluster.containers().await? {
            found.push(format!("instance {name}"));
        }
        self.cluster.remove_containers().await;
        for name in containers_labelled(&self.docker, &self.baseline_deployment).await? {
            found.push(format!("baseline container {name}"));
            let _ = self
                .docker
                .remove_container(
                    &name,
                    Some(RemoveContainerOptions {
                        force: true,
                        v: true,
                        ..Default::default()
                    }),
                )
                .await;
        }
        for runner in self.cluster.emulator.state().runners {
            found.push(format!("runner registration {}", runner.name));
            let _ = self
                .cluster
                .emulator
                .client()
                .remove_runner(runner.id)
                .await;
        }
        let charge = self.cluster.charged().await?;
        if charge != Charge::default() {
            found.push(format!("ledger charge {charge:?}"));
        }
        Ok(found)
    }
}

/// A launch as the plane sends it (tests/tests/commands.rs), with [`RUNNER_ENV`] and the
/// registration the plane minted, if it did.
fn launch_command(lease: &Lease, registration: Option<pb::JitConfig>) -> pb::command::Kind {
    pb::command::Kind::Launch(pb::Launch {
        registration,
        lease: Some(lease_to_wire(lease)),
        tier: Some(pb::TierSpec {
            label: TIER.into(),
            image: STANDIN_IMAGE.into(),
            command: vec![STANDIN_ENTRYPOINT.into()],
            trust: "trusted".into(),
            network: "host".into(),
            env: RUNNER_ENV.iter().map(|e| (*e).to_owned()).collect(),
            ..Default::default()
        }),
        job: Some(pb::Job {
            request_id: lease.request_id,
            ..Default::default()
        }),
        warm_instance: String::new(),
    })
}

/// A lease id as the plane makes them: 12 hex digits.
fn short_id() -> String {
    uuid::Uuid::new_v4().simple().to_string()[..12].to_owned()
}

/// Names of every container (any state) whose deployment label is `deployment`.
async fn containers_labelled(docker: &Docker, deployment: &str) -> Result<Vec<String>> {
    let filters = HashMap::from([(
        "label".to_owned(),
        vec![format!("sh.billet.deployment={deployment}")],
    )]);
    let list = docker
        .list_containers(Some(ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        }))
        .await
        .context("list containers")?;
    Ok(list
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .map(|n| n.trim_start_matches('/').to_owned())
        .collect())
}
