//! Fleet throughput: jobs completed per minute by three nodes against one,
//! each node a host of its own (`billet_tests::fleet`: a network namespace,
//! its own address and certificate, the host's Docker), measured in one run
//! against the same engine, image and settings.
//!
//! Each fleet gets the same batch of jobs, queued at once; every node offers
//! two vCPUs (two runners at once), so the batch queues behind the fleet's
//! capacity. Timed: from queueing the batch to the last job completed in the
//! emulator; printed, jobs per minute of each fleet and their ratio (3 nodes
//! over 1). Every run ends clean (no container, nothing charged), or the
//! bench fails.
//!
//! ```text
//! cargo bench -p billet-tests --bench fleet
//! BILLET_BENCH_JOBS=24 BILLET_BENCH_WORK_MS=3000 cargo bench -p billet-tests --bench fleet
//! ```
//!
//! Run without `--bench` (as `cargo test --benches` does), it makes one
//! small unmeasured pass as a smoke test. It needs root, the kernel's bridge
//! and veth support, and a running Docker engine.

use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::Result;
use billet_tests::cluster::ClusterOptions;
use billet_tests::fleet::Fleet;

/// vCPUs per node: two runners at once.
const VCPU: u32 = 2;

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Runs `jobs` jobs of `work_ms` on a fleet of `nodes`; returns the time
/// from queueing to the last completion.
async fn batch(nodes: usize, jobs: usize, work_ms: u64) -> Result<Duration> {
    let fleet = Fleet::start(ClusterOptions {
        nodes: (1..=nodes).map(|i| format!("node-{i}")).collect(),
        work_ms,
        node_vcpu: VCPU,
        ..ClusterOptions::default()
    })
    .await?;
    let started = Instant::now();
    let ids = fleet.cluster.queue_jobs(jobs);
    fleet
        .cluster
        .wait_jobs_completed(&ids, Duration::from_secs(600))
        .await?;
    let took = started.elapsed();
    fleet.cluster.wait_clean(Duration::from_secs(120)).await?;
    fleet.cluster.shutdown().await?;
    Ok(took)
}

async fn run(measuring: bool) -> Result<()> {
    let (jobs, work_ms) = if measuring {
        (
            usize::try_from(env_or("BILLET_BENCH_JOBS", 18))?,
            env_or("BILLET_BENCH_WORK_MS", 3000),
        )
    } else {
        (2, 500)
    };
    let one = batch(1, jobs, work_ms).await?;
    let three = batch(3, jobs, work_ms).await?;
    let per_minute = |d: Duration| jobs as f64 * 60.0 / d.as_secs_f64();
    println!("fleet throughput: {jobs} jobs of {work_ms} ms, {VCPU} vCPUs (runners) per node");
    println!(
        "  1 node : {:6.1} s, {:6.1} jobs/min",
        one.as_secs_f64(),
        per_minute(one)
    );
    println!(
        "  3 nodes: {:6.1} s, {:6.1} jobs/min",
        three.as_secs_f64(),
        per_minute(three)
    );
    println!(
        "  ratio 3 nodes / 1 node: {:.2}x jobs per minute",
        per_minute(three) / per_minute(one)
    );
    Ok(())
}

fn main() -> ExitCode {
    // `cargo bench` passes `--bench`; `cargo test --benches` does not.
    let measuring = std::env::args().any(|a| a == "--bench");
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("fleet bench: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(measuring)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("fleet bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}
