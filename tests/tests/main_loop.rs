//! The main job end to end: the plane drives a real node over mTLS, and
//! GitHub jobs run in real Docker containers and are cleaned up.

use std::time::Duration;

use anyhow::Result;
use billet_controlplane_stub::ledger::Phase;
use billet_tests::cluster::{Cluster, ClusterOptions};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queued_job_runs_in_a_container_and_everything_is_cleaned_up() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let jobs = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;

    let state = cluster.emulator.state();
    let job = state.jobs.iter().find(|j| j.id == jobs[0]).expect("job");
    assert_eq!(job.result.as_deref(), Some("succeeded"));
    assert!(
        state.runners.is_empty(),
        "runner registrations left: {:?}",
        state.runners
    );
    let leases = cluster.plane.ledger().leases().await?;
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].phase, Phase::Done);
    assert_eq!(leases[0].request_id, jobs[0].get());
    assert_eq!(leases[0].node.as_deref(), Some("node-1"));
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_jobs_queued_at_once_all_run_and_all_clean_up() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let jobs = cluster.queue_jobs(5);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(180))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;

    let state = cluster.emulator.state();
    for id in &jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).expect("job");
        assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
    }
    assert!(
        state.runners.is_empty(),
        "runner registrations left: {:?}",
        state.runners
    );
    let leases = cluster.plane.ledger().leases().await?;
    assert_eq!(leases.len(), 5, "{leases:?}");
    assert!(leases.iter().all(|l| l.phase == Phase::Done), "{leases:?}");
    cluster.shutdown().await
}

/// A tier asking for more vCPUs than the engine's host has. The engine
/// refuses such a container (`Range of CPUs is from 0.01 to N`), so the
/// node resizes the lease to the host's CPUs before the mint, the job
/// runs, and the ledger charged what ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tier_asking_for_more_cpus_than_the_host_has_runs_charged_what_it_got() -> Result<()> {
    let cpus = u32::try_from(std::thread::available_parallelism()?.get())?;
    let asked = cpus + 2;
    let cluster = Cluster::start(ClusterOptions {
        tier_vcpu: asked,
        node_vcpu: asked.max(8),
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;
    let state = cluster.emulator.state();
    let job = state.jobs.iter().find(|j| j.id == jobs[0]).expect("job");
    assert_eq!(job.result.as_deref(), Some("succeeded"));
    let leases = cluster.plane.ledger().leases().await?;
    assert_eq!(leases.len(), 1, "{leases:?}");
    assert_eq!(leases[0].phase, Phase::Done, "{leases:?}");
    assert_eq!(
        leases[0].vcpu, cpus,
        "the lease asked for {asked} vCPUs and ran at the host's {cpus}"
    );
    cluster.shutdown().await
}
