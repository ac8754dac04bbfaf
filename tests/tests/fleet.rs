//! Nodes as hosts (issue #17 item 2): the plane and three real `billet
//! node`s, each in a network namespace of its own on a private bridge
//! (`billet_tests::fleet`), over real mTLS, running the stand-in runner in
//! real Docker, with jobs from the scale-set emulator. A node partitioned
//! (its traffic dropped) and healed, a host lost for good, the plane
//! restarted under a busy fleet, and the whole fleet upgraded one node at a
//! time: no job killed that should finish, no capacity double-booked,
//! nothing left behind.

use std::collections::BTreeSet;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use billet_controlplane_stub::ledger::Phase;
use billet_tests::cluster::{ClusterOptions, Starts, wait_until};
use billet_tests::fleet::Fleet;
use scaleset::testing::JobState;
use tokio::time::Instant;

/// vCPUs each node offers: two runners at once, so a fleet of three is
/// full with six jobs.
const VCPU: u32 = 2;

fn names(n: usize) -> Vec<String> {
    (1..=n).map(|i| format!("node-{i}")).collect()
}

/// Short settings, so a lost session's leases expire (and are
/// quarantined) within seconds.
fn options(nodes: usize, work_ms: u64) -> ClusterOptions {
    ClusterOptions {
        nodes: names(nodes),
        work_ms,
        node_vcpu: VCPU,
        lease_ttl: Duration::from_secs(5),
        renewal_grace: Duration::from_secs(2),
        maintenance_interval: Duration::from_secs(1),
        ..ClusterOptions::default()
    }
}

/// The jobs the runners of `node` are running now.
async fn jobs_on(fleet: &Fleet, node: &str) -> Result<BTreeSet<i64>> {
    let containers = fleet.containers_of(node).await?;
    let state = fleet.cluster.emulator.state();
    Ok(state
        .runners
        .iter()
        .filter(|r| containers.contains(&r.name))
        .filter_map(|r| r.job)
        .map(|j| j.get())
        .collect())
}

/// Every job in `jobs` completed as `result`, started by exactly one runner.
fn each_ran_once(
    fleet: &Fleet,
    starts: &Starts,
    jobs: &[scaleset::JobRequestId],
    result: &str,
) -> Result<()> {
    let state = fleet.cluster.emulator.state();
    for id in jobs {
        let job = state
            .jobs
            .iter()
            .find(|j| j.id == *id)
            .with_context(|| format!("job {id}"))?;
        ensure!(
            job.state == JobState::Completed && job.result.as_deref() == Some(result),
            "job {id} ended {:?} {:?}, not {result}",
            job.state,
            job.result
        );
        let runners = starts.of(*id);
        ensure!(
            runners.len() == 1,
            "job {id} was started by {runners:?}, not exactly one runner"
        );
    }
    Ok(())
}

/// One node is partitioned (every packet to and from it dropped in its
/// namespace) while its runners work, past the lease TTL and the renewal
/// grace, then healed. Its jobs finish (the runners never lose GitHub),
/// nothing is placed on it or beyond any node's capacity meanwhile, the
/// jobs queued during the partition run on the others, and once healed
/// the node reattaches and everything is cleaned up.
#[tokio::test(flavor = "multi_thread")]
async fn a_partitioned_node_keeps_its_jobs_and_is_recovered_once_healed() -> Result<()> {
    let fleet = Fleet::start(options(3, 12_000)).await?;
    let cluster = &fleet.cluster;
    let starts = Starts::watch(cluster);
    let watch = fleet.watch_capacity(VCPU);
    let mut jobs = cluster.queue_jobs(6);
    let cut = "node-1";
    wait_until(
        Duration::from_secs(60),
        "node-1's runners to take jobs",
        || {
            let state = cluster.emulator.state();
            state
                .jobs
                .iter()
                .filter(|j| j.state == JobState::Running)
                .count()
                == 6
        },
    )
    .await?;
    let running = jobs_on(&fleet, cut).await?;
    ensure!(
        running.len() == VCPU as usize,
        "{cut} runs {running:?}, not {VCPU} jobs"
    );
    fleet.network.partition(cut)?;
    let parted = Instant::now();
    // Queued while the node is cut off: the other two run them.
    jobs.extend(cluster.queue_jobs(3));
    // Past the TTL and the renewal grace: the reaper quarantines what the
    // node held.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let quarantined = cluster
            .plane
            .ledger()
            .open_leases()
            .await?
            .into_iter()
            .filter(|l| l.node.as_deref() == Some(cut) && l.phase == Phase::Quarantine)
            .count();
        if quarantined > 0 {
            println!(
                "{cut}'s leases quarantined {:.1} s after the partition (lease TTL 5 s)",
                parted.elapsed().as_secs_f64()
            );
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "no lease of {cut} was quarantined"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    fleet.network.heal(cut)?;
    println!("healed {cut} after {:.1} s", parted.elapsed().as_secs_f64());
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    cluster.wait_attached(cut, Duration::from_secs(60)).await?;
    cluster.wait_clean(Duration::from_secs(90)).await?;
    let seen = watch.finish().await?;
    println!(
        "most vCPUs charged and runners at once, per node: {:?}",
        seen.max
    );
    ensure!(seen.over.is_empty(), "over capacity: {:?}", seen.over);
    // The jobs the node ran when cut off succeeded, as did every other.
    each_ran_once(&fleet, &starts, &jobs, "succeeded")?;
    fleet.cluster.shutdown().await?;
    Ok(())
}
