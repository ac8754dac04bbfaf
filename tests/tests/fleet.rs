//! Nodes as hosts: the plane and three real `billet node`s, each in a
//! network namespace of its own on a private bridge
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
use billet_controlplane_stub::node_link::Keepalive;
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

/// The plane's keepalive to its nodes in these tests: a PING every second,
/// two seconds to answer it (a loaded machine answers late, not never), so
/// a silent node's session is lost within 3 s.
const KEEPALIVE: Keepalive = Keepalive {
    interval: Duration::from_secs(1),
    timeout: Duration::from_secs(2),
};

/// Short settings, so a lost session's leases expire (and are
/// quarantined) within seconds.
fn options(nodes: usize, work_ms: u64) -> ClusterOptions {
    ClusterOptions {
        node_keepalive: KEEPALIVE,
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

/// A node's host is lost for good while its runners work (the node killed,
/// its network cut, its containers gone, GitHub failing their jobs): the
/// plane notices the silence, and once the renewal grace and the lease TTL
/// have passed its leases are quarantined (still charged: nothing vouches
/// for that host again). The jobs queued behind it run on the other two.
/// Prints the time from the loss to the quarantine against the grace, and
/// holds it to the configured bound: the keepalive's interval and timeout
/// (the session's loss), the renewal grace, the lease TTL and a reaper tick,
/// with 3 s to spare for a loaded machine.
#[tokio::test(flavor = "multi_thread")]
async fn a_host_lost_for_good_is_quarantined_and_its_work_covered_by_the_others() -> Result<()> {
    let options = options(3, 8_000);
    let (grace, ttl) = (options.renewal_grace, options.lease_ttl);
    let keepalive = options.node_keepalive;
    let mut fleet = Fleet::start(options).await?;
    let starts = Starts::watch(&fleet.cluster);
    let watch = fleet.watch_capacity(VCPU);
    let first = fleet.cluster.queue_jobs(6);
    wait_until(Duration::from_secs(60), "six jobs to run", || {
        let state = fleet.cluster.emulator.state();
        state
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            == 6
    })
    .await?;
    let lost = "node-1";
    let on_lost = jobs_on(&fleet, lost).await?;
    ensure!(on_lost.len() == VCPU as usize, "{lost} runs {on_lost:?}");
    // Queued before the loss, waiting for room: the survivors run them.
    let queued = fleet.cluster.queue_jobs(4);
    let lost_at = Instant::now();
    let failed = fleet.lose_host(lost).await?;
    let failed: BTreeSet<i64> = failed.iter().map(|j| j.get()).collect();
    ensure!(
        failed == on_lost,
        "GitHub failed {failed:?}, {lost} ran {on_lost:?}"
    );
    let link = fleet.cluster.plane.node(lost).context("link")?;
    let mut status = link.status();
    tokio::time::timeout(Duration::from_secs(90), status.wait_for(Option::is_none))
        .await
        .context("the plane never noticed the loss")??;
    let noticed = lost_at.elapsed();
    let deadline = Instant::now() + Duration::from_secs(60);
    let quarantined = loop {
        let leases: Vec<_> = fleet
            .cluster
            .plane
            .ledger()
            .open_leases()
            .await?
            .into_iter()
            .filter(|l| l.node.as_deref() == Some(lost))
            .collect();
        if !leases.is_empty() && leases.iter().all(|l| l.phase == Phase::Quarantine) {
            break leases;
        }
        ensure!(
            Instant::now() < deadline,
            "{lost}'s leases are not all quarantined: {leases:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    let to_quarantine = lost_at.elapsed();
    println!(
        "host loss: the plane lost the session after {:.1} s (keepalive {:.0} s + {:.0} s); {} lease(s) quarantined {:.1} s after the loss \
         (renewal grace {:.0} s + lease TTL {:.0} s = {:.0} s after the session's loss, {:.1} s measured)",
        noticed.as_secs_f64(),
        keepalive.interval.as_secs_f64(),
        keepalive.timeout.as_secs_f64(),
        quarantined.len(),
        to_quarantine.as_secs_f64(),
        grace.as_secs_f64(),
        ttl.as_secs_f64(),
        (grace + ttl).as_secs_f64(),
        (to_quarantine - noticed).as_secs_f64(),
    );
    ensure!(
        to_quarantine - noticed >= grace,
        "quarantined before the renewal grace had passed"
    );
    // The reaper ticks every second (ClusterOptions' reap interval).
    let bound = keepalive.interval
        + keepalive.timeout
        + grace
        + ttl
        + Duration::from_secs(1)
        + Duration::from_secs(3);
    ensure!(
        to_quarantine <= bound,
        "the lost host's leases were quarantined {:.1} s after the loss, past {:.0} s \
         (keepalive, renewal grace, TTL, a reaper tick and 3 s): the plane lost the session after {:.1} s",
        to_quarantine.as_secs_f64(),
        bound.as_secs_f64(),
        noticed.as_secs_f64()
    );
    fleet
        .cluster
        .wait_jobs_completed(&queued, Duration::from_secs(120))
        .await?;
    let survivors: Vec<_> = first
        .iter()
        .copied()
        .filter(|j| !on_lost.contains(&j.get()))
        .chain(queued.iter().copied())
        .collect();
    each_ran_once(&fleet, &starts, &survivors, "succeeded")?;
    for job in &queued {
        let runner = starts.of(*job).concat();
        ensure!(
            !fleet.containers_of(lost).await?.contains(&runner),
            "job {job} ran on the lost host"
        );
    }
    // Nothing is left but the lost host's quarantine, still charged.
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let containers = fleet.cluster.containers().await?;
        let mut charged = Vec::new();
        for node in ["node-2", "node-3"] {
            charged.push(fleet.cluster.plane.ledger().charged_on(node).await?.leases);
        }
        if containers.is_empty() && charged == [0, 0] {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "not clean: containers {containers:?}, leases charged on the survivors {charged:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let charged = fleet.cluster.plane.ledger().charged_on(lost).await?;
    ensure!(
        charged.leases as usize == quarantined.len(),
        "the lost host's quarantine is charged as {charged:?}"
    );
    let seen = watch.finish().await?;
    ensure!(seen.over.is_empty(), "over capacity: {:?}", seen.over);
    fleet.cluster.shutdown().await?;
    Ok(())
}

/// The plane is stopped and started again on the same ledger while every
/// node runs jobs: the nodes attach to the new plane, every job completes
/// once, and nothing is left behind.
#[tokio::test(flavor = "multi_thread")]
async fn the_plane_restarted_under_a_busy_fleet_loses_no_job_and_leaks_nothing() -> Result<()> {
    let mut fleet = Fleet::start(options(3, 8_000)).await?;
    let before = Starts::watch(&fleet.cluster);
    let watch = fleet.watch_capacity(VCPU);
    let mut jobs = fleet.cluster.queue_jobs(6);
    wait_until(Duration::from_secs(60), "every node to run jobs", || {
        let state = fleet.cluster.emulator.state();
        state
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            == 6
    })
    .await?;
    for node in names(3) {
        ensure!(
            jobs_on(&fleet, &node).await?.len() == VCPU as usize,
            "{node} is not full"
        );
    }
    let restarting = Instant::now();
    fleet.cluster.restart_plane().await?;
    println!(
        "the plane restarted and every node attached again in {:.1} s",
        restarting.elapsed().as_secs_f64()
    );
    let after = Starts::watch(&fleet.cluster);
    jobs.extend(fleet.cluster.queue_jobs(3));
    fleet
        .cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    fleet.cluster.wait_clean(Duration::from_secs(90)).await?;
    let state = fleet.cluster.emulator.state();
    for id in &jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
        ensure!(job.result.as_deref() == Some("succeeded"), "{job:?}");
        let runners = [before.of(*id), after.of(*id)].concat();
        ensure!(runners.len() == 1, "job {id} was started by {runners:?}");
    }
    ensure!(
        state.runners.is_empty(),
        "registrations left: {:?}",
        state.runners
    );
    let seen = watch.finish().await?;
    ensure!(seen.over.is_empty(), "over capacity: {:?}", seen.over);
    fleet.cluster.shutdown().await?;
    Ok(())
}

/// The whole fleet upgraded one node at a time while jobs run (through
/// the same `StartUpgrade` and `billet host-upgrade` path as
/// `upgrade.rs`, each node installed as an operator installs it): each
/// node comes back on the new release before the next is asked, every job
/// (those running across each node's restart and those queued during the
/// rollout) completes once and succeeded, no node is booked beyond its
/// capacity, and nothing is left behind.
#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_upgrade_of_the_fleet_kills_no_job_and_double_books_nothing() -> Result<()> {
    let fleet = Fleet::start(ClusterOptions {
        installed: true,
        ..options(3, 8_000)
    })
    .await?;
    let cluster = &fleet.cluster;
    let starts = Starts::watch(cluster);
    let watch = fleet.watch_capacity(VCPU);
    let first = cluster.nodes["node-1"]
        .installed
        .clone()
        .context("installed")?;
    let before = billet_agent::upgrade::updater::binary_version(&first.binary)
        .map_err(anyhow::Error::msg)?;
    let next = format!("{before}-rolling.1");
    // One release source serves the fleet.
    let digest = first.publish(&next)?;
    let mut jobs = cluster.queue_jobs(6);
    wait_until(Duration::from_secs(60), "every node to run jobs", || {
        let state = cluster.emulator.state();
        state
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            >= 4
    })
    .await?;
    let rollout = Instant::now();
    for node in names(3) {
        let result = cluster
            .start_upgrade(&node, &next, &digest, "rollout-fleet", 1)
            .await?;
        ensure!(
            result.outcome == billet_proto::v1::Outcome::Ok as i32,
            "{node}'s updater refused: {:?}",
            result.error
        );
        // Work keeps arriving while the node restarts.
        jobs.extend(cluster.queue_jobs(2));
        cluster
            .wait_hello_version(&node, &next, Duration::from_secs(120))
            .await?;
        println!(
            "{node} serves {next} {:.1} s into the rollout",
            rollout.elapsed().as_secs_f64()
        );
    }
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(180))
        .await?;
    cluster.wait_clean(Duration::from_secs(90)).await?;
    each_ran_once(&fleet, &starts, &jobs, "succeeded")?;
    for node in cluster.nodes.values() {
        let installed = node.installed.as_ref().context("installed")?;
        let version = billet_agent::upgrade::updater::binary_version(&installed.binary)
            .map_err(anyhow::Error::msg)?;
        ensure!(version == next, "{} runs {version}", node.name);
    }
    let seen = watch.finish().await?;
    ensure!(seen.over.is_empty(), "over capacity: {:?}", seen.over);
    fleet.cluster.shutdown().await?;
    Ok(())
}

/// Two `billet-plane` processes share one PostgreSQL ledger, each with a
/// scale set and two nodes of its own, both reapers running over the whole
/// ledger. Plane A is killed (SIGKILL, nothing written on the way out)
/// while its nodes run jobs: plane B's reaper quarantines each of A's
/// leases once (its epoch moves by one, and B's log names it once) and
/// reaps none of its own; B's jobs, those queued after the kill included,
/// run on; A's runners finish their jobs at GitHub. Once GitHub has timed
/// A's session out, A is started again: it attaches its nodes, runs the
/// jobs queued on its set while it was dead, and the quarantine is
/// resolved. Every job completed once, succeeded, on a node of its own
/// plane; no node was charged beyond its capacity; nothing is left: no
/// container, no charge, no registration.
#[tokio::test(flavor = "multi_thread")]
async fn two_plane_processes_on_one_postgres_ledger_survive_one_killed_without_double_booking()
-> Result<()> {
    use billet_tests::planes::{PlaneFleet, PlaneSpec};
    let options = options(4, 15_000);
    let ttl = options.lease_ttl;
    let planes = vec![
        PlaneSpec {
            name: "plane-a".into(),
            tier: "billet-a".into(),
            nodes: vec!["node-a1".into(), "node-a2".into()],
        },
        PlaneSpec {
            name: "plane-b".into(),
            tier: "billet-b".into(),
            nodes: vec!["node-b1".into(), "node-b2".into()],
        },
    ];
    let mut fleet = PlaneFleet::start(options, planes).await?;
    let watch = fleet.watch_capacity(VCPU);
    let (a, b) = (0, 1);
    let a_nodes = fleet.planes[a].spec.nodes.clone();
    let b_nodes = fleet.planes[b].spec.nodes.clone();
    let mut a_jobs = fleet.queue_jobs(a, 4)?;
    let mut b_jobs = fleet.queue_jobs(b, 4)?;
    wait_until(Duration::from_secs(90), "eight jobs to run", || {
        let state = fleet.emulator.state();
        state
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            == 8
    })
    .await?;
    // What A's nodes hold when A dies: four leases, each running its job.
    let held: Vec<_> = fleet
        .ledger
        .open_leases()
        .await?
        .into_iter()
        .filter(|l| l.node.as_ref().is_some_and(|n| a_nodes.contains(n)))
        .collect();
    ensure!(held.len() == 4, "A's nodes hold {held:?}");
    let killed = Instant::now();
    fleet.planes[a].kill().await?;
    // Work keeps coming for both: B runs its own; A's waits for A.
    b_jobs.extend(fleet.queue_jobs(b, 2)?);
    let a_later = fleet.queue_jobs(a, 2)?;
    a_jobs.extend(a_later.iter().copied());
    // Past the TTL nothing renews A's leases: B's reaper quarantines each.
    let deadline = Instant::now() + Duration::from_secs(60);
    let quarantined = loop {
        let mut now = Vec::new();
        for l in &held {
            now.push(fleet.ledger.get(&l.id).await?.context("lease")?);
        }
        if now.iter().all(|l| l.phase == Phase::Quarantine) {
            break now;
        }
        ensure!(
            Instant::now() < deadline,
            "A's leases are not all quarantined {:?} after A was killed: {now:?}",
            killed.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "plane A killed: its {} leases quarantined by plane B's reaper {:.1} s later (lease TTL {:.0} s)",
        quarantined.len(),
        killed.elapsed().as_secs_f64(),
        ttl.as_secs_f64()
    );
    let reaped_by_b = fleet.planes[b].quarantined();
    for (before, after) in held.iter().zip(&quarantined) {
        ensure!(
            after.epoch == before.epoch + 1,
            "lease {} went from epoch {} to {} when reaped: not reclaimed exactly once",
            before.id,
            before.epoch,
            after.epoch
        );
        let times = reaped_by_b.iter().filter(|id| **id == before.id).count();
        ensure!(
            times == 1,
            "plane B's reaper reported {} {times} times; its reports: {reaped_by_b:?}",
            before.id
        );
    }
    // B's jobs, the ones queued after the kill included, complete on B.
    fleet
        .wait_jobs_completed(&b_jobs, Duration::from_secs(120))
        .await?;
    // A's runners finish the jobs they had at GitHub, plane or not.
    fleet
        .wait_jobs_completed(&a_jobs[..4], Duration::from_secs(120))
        .await?;
    // Silence freed nothing: long after the quarantine (several ticks of
    // B's reaper), each of A's leases is still quarantined at the epoch it
    // was reaped at, and still charged on its node.
    let mut charged = 0;
    for node in &a_nodes {
        charged += fleet.ledger.charged_on(node).await?.leases;
    }
    for l in &quarantined {
        let now = fleet.ledger.get(&l.id).await?.context("lease")?;
        ensure!(
            now.phase == Phase::Quarantine && now.epoch == l.epoch,
            "lease {} was quarantined at epoch {}; {:.1} s after A was killed it is {:?} at epoch {}",
            l.id,
            l.epoch,
            killed.elapsed().as_secs_f64(),
            now.phase,
            now.epoch
        );
    }
    ensure!(
        charged as usize >= held.len(),
        "A's nodes are charged {charged} leases while {} of theirs are quarantined",
        held.len()
    );
    // GitHub times the dead plane's message session out (it was never
    // deleted); then A comes back on the same ledger and nodes.
    let set = fleet.scale_set(a)?;
    // (It panics if A's session is not open at GitHub any more.)
    fleet.emulator.expire_session(set);
    let attached = a_nodes
        .iter()
        .map(|n| fleet.planes[a].attachments(n))
        .min()
        .unwrap_or(0);
    let restarted_ms = billet_controlplane_stub::now_ms();
    fleet.planes[a].start_again().await?;
    fleet.wait_plane_ready(a, attached).await?;
    fleet
        .wait_jobs_completed(&a_later, Duration::from_secs(120))
        .await?;
    fleet.wait_clean(Duration::from_secs(120)).await?;
    // No plane's reaper reclaimed any lease of B's nodes, nor reclaimed one
    // of A's twice.
    let leases = fleet.ledger.leases().await?;
    let reaped: Vec<String> = fleet
        .planes
        .iter()
        .flat_map(billet_tests::planes::PlaneProcess::reclaimed)
        .collect();
    for l in &leases {
        let times = reaped.iter().filter(|id| **id == l.id).count();
        let on_b = l.node.as_ref().is_some_and(|n| b_nodes.contains(n));
        let was_held = held.iter().any(|h| h.id == l.id);
        ensure!(
            times == usize::from(was_held) && !(on_b && times > 0),
            "lease {} (on {:?}) was reclaimed by a reaper {times} times",
            l.id,
            l.node
        );
    }
    // A's quarantine was resolved only once A's nodes could speak again.
    for h in &held {
        let l = leases.iter().find(|l| l.id == h.id).context("lease")?;
        println!(
            "A's lease {} ended {:?} at epoch {} ({:?})",
            l.id, l.phase, l.epoch, l.failure_reason
        );
        ensure!(
            l.ended_at_ms.is_some_and(|t| t >= restarted_ms),
            "lease {} of the dead plane ended before its plane came back: {l:?}",
            l.id
        );
    }
    // Every job completed once, succeeded, run by a runner of a lease on a
    // node of its own plane.
    let state = fleet.emulator.state();
    for (jobs, nodes) in [(&a_jobs, &a_nodes), (&b_jobs, &b_nodes)] {
        for id in jobs.iter() {
            let job = state
                .jobs
                .iter()
                .find(|j| j.id == *id)
                .with_context(|| format!("job {id}"))?;
            ensure!(
                job.state == JobState::Completed && job.result.as_deref() == Some("succeeded"),
                "job {id} ended {:?} {:?}",
                job.state,
                job.result
            );
            let runner = job
                .runner_id
                .with_context(|| format!("job {id} had no runner"))?;
            let ran: Vec<_> = leases
                .iter()
                .filter(|l| l.runner_id == Some(runner.get()))
                .collect();
            ensure!(
                ran.len() == 1 && ran[0].node.as_ref().is_some_and(|n| nodes.contains(n)),
                "job {id} was run by runner {runner} of {ran:?}, not by one lease on {nodes:?}"
            );
        }
    }
    let seen = watch.finish().await?;
    println!(
        "most vCPUs charged and runners at once, per node: {:?}",
        seen.max
    );
    ensure!(seen.over.is_empty(), "over capacity: {:?}", seen.over);
    fleet.shutdown().await?;
    Ok(())
}
