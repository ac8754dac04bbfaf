//! Custody end to end, with real Docker and the stub's fault injection: the
//! node never loses, leaks or wrongly kills compute across lost replies,
//! restarts, cut sessions and an engine that goes away. Every scenario ends
//! with no billet container left and the lease terminal with the right
//! outcome.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::ledger::{Lease, NewLease, Phase};
use billet_controlplane_stub::node_link::CommandOutcome;
use billet_controlplane_stub::now_ms;
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, TIER, wait_until};
// Cuts open connections too, as a stopped engine does: the node keeps its
// connections to the engine between calls.
use billet_tests::engine_proxy::EngineProxy;
use scaleset::testing::{Endpoint, Fault, JobState};

fn options(work_ms: u64) -> ClusterOptions {
    ClusterOptions {
        work_ms,
        node_env: vec![
            ("BILLET_ACK_TIMEOUT_SECS".into(), "2".into()),
            ("BILLET_STRAY_GRACE_SECS".into(), "2".into()),
        ],
        ..ClusterOptions::default()
    }
}

async fn only_lease(cluster: &Cluster) -> Result<Lease> {
    let leases = cluster.plane.ledger().leases().await?;
    match leases.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!("expected one lease, found {other:?}"),
    }
}

async fn wait_lease_phase(cluster: &Cluster, phase: Phase, timeout: Duration) -> Result<Lease> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if let Some(l) = cluster
            .plane
            .ledger()
            .leases()
            .await?
            .into_iter()
            .find(|l| l.phase == phase)
        {
            return Ok(l);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "no lease reached {phase} within {timeout:?}: {:?}",
                cluster.plane.ledger().leases().await?
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn wait_job_running(cluster: &Cluster, timeout: Duration) -> Result<()> {
    wait_until(timeout, "a job to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .any(|j| j.state == JobState::Running)
    })
    .await
}

async fn container_id(cluster: &Cluster, name: &str) -> Option<String> {
    cluster
        .docker
        .inspect_container(name, None)
        .await
        .ok()
        .and_then(|c| c.id)
}

async fn end_done(cluster: &Cluster, jobs: &[scaleset::JobRequestId]) -> Result<()> {
    cluster
        .wait_jobs_completed(jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    let state = cluster.emulator.state();
    for id in jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
        assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
    }
    assert!(
        state.runners.is_empty(),
        "registrations left: {:?}",
        state.runners
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_launch_result_leaves_the_lease_with_the_node_until_the_job_completes()
-> Result<()> {
    // A short TTL: once the plane gives up, only the node's renewals keep
    // the lease from the reaper for the rest of the eight-second job.
    let cluster = Cluster::start(ClusterOptions {
        launch_timeout: Duration::from_secs(4),
        lease_ttl: Duration::from_secs(3),
        ..options(8000)
    })
    .await?;
    let node = cluster.plane.node("node-1").context("node")?;
    node.faults.drop_launch_results.store(1, Ordering::SeqCst);
    let jobs = cluster.queue_jobs(1);
    // The plane gives up on the launch; the node must hold the lease.
    wait_until(
        Duration::from_secs(30),
        "the node to report custody",
        || {
            cluster.nodes["node-1"]
                .log_text()
                .contains("assumed custody")
        },
    )
    .await?;
    end_done(&cluster, &jobs).await?;
    let lease = only_lease(&cluster).await?;
    assert_eq!(lease.phase, Phase::Done);
    assert_eq!(
        lease.epoch, 1,
        "the reaper reclaimed the lease: nobody renewed it while the node held it"
    );
    cluster.shutdown().await
}

/// The `billet_leases_held` samples of a node's metrics, by state.
fn leases_held(metrics: std::net::SocketAddr) -> Result<Vec<(String, f64)>> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect_timeout(&metrics, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        stream,
        "GET /metrics HTTP/1.0\r\nHost: {metrics}\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    Ok(response
        .lines()
        .filter_map(|l| l.strip_prefix("billet_leases_held{state=\""))
        .filter_map(|l| {
            let (state, value) = l.split_once("\"} ")?;
            Some((state.to_owned(), value.trim().parse().ok()?))
        })
        .collect())
}

/// A launch whose result the plane never acknowledged leaves its lease in
/// the node's custody while the job runs: `billet node status` lists it
/// once, in custody, and `billet_leases_held` counts it once, in every
/// sample until the job is done.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lease_in_custody_while_its_job_runs_is_one_row_in_status_and_in_metrics() -> Result<()> {
    let metrics = billet_tests::cluster::free_port()?;
    let mut opts = options(8000);
    opts.node_env
        .push(("BILLET_METRICS_LISTEN".into(), metrics.to_string()));
    let cluster = Cluster::start(opts).await?;
    let node = cluster.plane.node("node-1").context("node")?;
    node.faults.drop_launch_results.store(1, Ordering::SeqCst);
    let jobs = cluster.queue_jobs(1);
    wait_until(Duration::from_secs(30), "the node to hold custody", || {
        cluster.nodes["node-1"]
            .log_text()
            .contains("assumed custody")
    })
    .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let mut samples = 0;
    loop {
        let status = cluster.status_json("node-1")?;
        let leases = status["leases"].as_array().context("leases")?.clone();
        let held = leases_held(metrics)?;
        let counted: f64 = held.iter().map(|(_, n)| n).sum();
        if leases.is_empty() {
            break;
        }
        samples += 1;
        let ids: BTreeSet<&str> = leases
            .iter()
            .filter_map(|l| l["lease_id"].as_str())
            .collect();
        assert_eq!(ids.len(), leases.len(), "a lease listed twice: {status}");
        assert!(
            counted <= 1.0,
            "billet_leases_held counts one lease {counted} times: {held:?}"
        );
        if leases.iter().all(|l| l["state"] == "running") {
            // Custody is taken when the ack times out; until then it runs.
        } else {
            assert!(
                leases.iter().all(|l| l["custody"] == true),
                "held on the node's authority, said once: {status}"
            );
        }
        if tokio::time::Instant::now() > deadline {
            bail!("the lease was still held after 60 s: {status}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(samples > 0, "no sample while the job ran");
    end_done(&cluster, &jobs).await?;
    assert_eq!(only_lease(&cluster).await?.phase, Phase::Done);
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_while_a_job_runs_adopts_the_container_after_restart() -> Result<()> {
    let mut cluster = Cluster::start(options(10_000)).await?;
    let jobs = cluster.queue_jobs(1);
    wait_job_running(&cluster, Duration::from_secs(30)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    let before = container_id(&cluster, &name).await.context("container")?;

    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.kill().await?;
    node.restart().await?;
    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    wait_until(Duration::from_secs(30), "adoption", || {
        cluster.nodes["node-1"]
            .log_text()
            .contains("adopting an instance")
    })
    .await?;
    // Adopted, not killed: the same container keeps running its job.
    assert_eq!(
        container_id(&cluster, &name).await.as_deref(),
        Some(before.as_str())
    );
    end_done(&cluster, &jobs).await?;
    assert_eq!(only_lease(&cluster).await?.phase, Phase::Done);
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_mid_launch_leaks_nothing_and_starts_no_container_after_restart() -> Result<()>
{
    let mut cluster = Cluster::start(options(2000)).await?;
    // Minting takes three seconds: the node dies while it waits.
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::GenerateJitConfig, Duration::from_secs(3)).times(1));
    let jobs = cluster.queue_jobs(1);
    let lease = wait_lease_phase(&cluster, Phase::Launching, Duration::from_secs(30)).await?;
    let name = format!("billet-{}", lease.id);
    let ids: Arc<std::sync::Mutex<BTreeSet<String>>> = Arc::default();
    let watching = Arc::new(AtomicBool::new(true));
    let watcher = {
        let (docker, ids, watching, name) = (
            cluster.docker.clone(),
            ids.clone(),
            watching.clone(),
            name.clone(),
        );
        tokio::spawn(async move {
            while watching.load(Ordering::SeqCst) {
                if let Ok(c) = docker.inspect_container(&name, None).await
                    && let Some(id) = c.id
                {
                    ids.lock().expect("ids").insert(id);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.kill().await?;
    tokio::time::sleep(Duration::from_secs(4)).await;
    node.restart().await?;
    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let l = cluster
            .plane
            .ledger()
            .get(&lease.id)
            .await?
            .context("lease")?;
        if l.phase.is_terminal() {
            assert_eq!(
                l.phase,
                Phase::Failed,
                "a launch that never finished must end failed"
            );
            // Said by whichever ended it: the plane, which lost the
            // launch's result with nothing minted, or the restarted node,
            // which found the launch it was cut short in.
            assert!(
                matches!(
                    l.failure_reason.as_deref(),
                    Some("launch_lost" | "launch_interrupted")
                ),
                "and say why: {l:?}"
            );
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!("lease {} still {} after the restart", l.id, l.phase);
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    watching.store(false, Ordering::SeqCst);
    watcher.await?;
    // The node died before minting answered, so it never had a JIT config
    // to start a container with; the restarted node must not start one.
    let ids = ids.lock().expect("ids").clone();
    assert!(
        ids.is_empty(),
        "a container was started for a launch the node died in: {ids:?}"
    );
    let runners = cluster.emulator.state().runners;
    assert!(
        runners.iter().all(|r| r.name != name),
        "the registration minted for the dead launch was left behind: {runners:?}"
    );
    // The job itself runs on a fresh lease, and then nothing is left.
    end_done(&cluster, &jobs).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_cut_during_a_destroy_is_re_established_and_the_destroy_completes() -> Result<()>
{
    let cluster = Cluster::start(options(1500)).await?;
    cluster
        .plane
        .node("node-1")
        .context("node")?
        .faults
        .cut_on_destroy_results
        .store(1, Ordering::SeqCst);
    let jobs = cluster.queue_jobs(1);
    end_done(&cluster, &jobs).await?;
    assert_eq!(only_lease(&cluster).await?.phase, Phase::Done);
    assert_eq!(
        cluster
            .plane
            .node("node-1")
            .context("node")?
            .faults
            .cut_on_destroy_results
            .load(Ordering::SeqCst),
        0,
        "the fault never fired"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_container_removed_behind_the_nodes_back_ends_its_lease_failed() -> Result<()> {
    let cluster = Cluster::start(options(60_000)).await?;
    let _jobs = cluster.queue_jobs(1);
    wait_job_running(&cluster, Duration::from_secs(30)).await?;
    let lease = only_lease(&cluster).await?;
    cluster
        .docker
        .remove_container(
            &format!("billet-{}", lease.id),
            Some(bollard::query_parameters::RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;
    assert_eq!(only_lease(&cluster).await?.phase, Phase::Failed);
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_with_a_job_running_drains_lets_the_job_finish_and_exits_cleanly() -> Result<()> {
    let mut cluster = Cluster::start(options(6000)).await?;
    let jobs = cluster.queue_jobs(1);
    wait_job_running(&cluster, Duration::from_secs(30)).await?;
    cluster.nodes["node-1"].terminate()?;
    wait_until(Duration::from_secs(10), "the drain to start", || {
        cluster.nodes["node-1"].log_text().contains("draining")
    })
    .await?;
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(60))
        .await?;
    let status = cluster
        .nodes
        .get_mut("node-1")
        .context("node")?
        .wait(Duration::from_secs(60))
        .await?;
    assert!(status.success(), "the node exited with {status}");
    cluster.wait_clean(Duration::from_secs(30)).await?;
    let state = cluster.emulator.state();
    assert_eq!(state.jobs[0].result.as_deref(), Some("succeeded"));
    assert_eq!(only_lease(&cluster).await?.phase, Phase::Done);
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_quarantined_lease_whose_container_is_gone_is_freed_only_after_the_grace_period()
-> Result<()> {
    let grace = Duration::from_secs(4);
    let cluster = Cluster::start(ClusterOptions {
        lease_ttl: Duration::from_secs(2),
        quarantine_grace: grace,
        maintenance_interval: Duration::from_millis(500),
        ..options(1000)
    })
    .await?;
    let ledger = cluster.plane.ledger();
    // A lease node-1 launched and then stopped renewing, with no container.
    let lease = ledger
        .reserve(
            NewLease {
                id: "quarantined1".into(),
                tier: TIER.into(),
                request_id: 777,
                vcpu: 1,
                memory_bytes: 1 << 28,
                runner_name: Some("billet-quarantined1".into()),
            },
            now_ms(),
        )
        .await?;
    ledger
        .bind(&lease.id, lease.epoch, "node-1", now_ms())
        .await?;
    let launched = ledger
        .advance(&lease.id, lease.epoch, "node-1", Phase::Launching, now_ms())
        .await?;
    let quarantined =
        wait_lease_phase(&cluster, Phase::Quarantine, Duration::from_secs(20)).await?;
    assert_eq!(
        quarantined.epoch,
        lease.epoch + 1,
        "the reaper bumps the epoch"
    );
    // Still charged while the grace runs, though every sweep reports it absent.
    let free_at = launched.expires_at_ms + i64::try_from(grace.as_millis())?;
    while now_ms() < free_at - 700 {
        let l = ledger.get(&lease.id).await?.context("lease")?;
        assert_eq!(
            l.phase,
            Phase::Quarantine,
            "freed {} ms before the grace ended",
            free_at - now_ms()
        );
        assert!(cluster.charged().await?.leases >= 1);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let freed = wait_lease_phase(&cluster, Phase::Failed, Duration::from_secs(20)).await?;
    assert_eq!(freed.id, lease.id);
    cluster.wait_clean(Duration::from_secs(10)).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn while_docker_cannot_be_reached_the_inventory_is_unknown_and_no_capacity_is_freed()
-> Result<()> {
    let proxy = EngineProxy::start().await?;
    let grace = Duration::from_secs(1);
    let cluster = Cluster::start(ClusterOptions {
        docker_socket: proxy.path.clone(),
        maintenance_interval: Duration::from_millis(500),
        quarantine_grace: grace,
        lease_ttl: Duration::from_secs(2),
        ..options(16_000)
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_job_running(&cluster, Duration::from_secs(30)).await?;
    proxy.set_up(false);

    let node = cluster.plane.node("node-1").context("node")?;
    let outcome = node
        .dispatch(
            pb::command::Kind::Instances(pb::Instances {}),
            Duration::from_secs(10),
        )
        .await;
    let CommandOutcome::Answered(result) = &outcome else {
        bail!("{outcome:?}")
    };
    let report = result.instances.clone().context("report")?;
    assert!(
        !report.inventory_known,
        "an unreadable engine was reported as a known inventory"
    );

    // A lease node-1 launched and stopped renewing, whose container does
    // not exist: only a vouched inventory may free it once quarantined.
    let ledger = cluster.plane.ledger();
    let lease = ledger
        .reserve(
            NewLease {
                id: "unseen1".into(),
                tier: TIER.into(),
                request_id: 778,
                vcpu: 1,
                memory_bytes: 1 << 28,
                runner_name: Some("billet-unseen1".into()),
            },
            now_ms(),
        )
        .await?;
    ledger
        .bind(&lease.id, lease.epoch, "node-1", now_ms())
        .await?;
    ledger
        .advance(&lease.id, lease.epoch, "node-1", Phase::Launching, now_ms())
        .await?;
    let quarantined =
        wait_lease_phase(&cluster, Phase::Quarantine, Duration::from_secs(20)).await?;
    assert_eq!(
        quarantined.id, lease.id,
        "only the unrenewed lease is quarantined"
    );
    let charged = cluster.charged().await?;
    // Sweeps and tends pass, well beyond the grace; nothing may be freed.
    for _ in 0..8 {
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert_eq!(
            cluster.charged().await?,
            charged,
            "capacity was freed while the engine was unreachable"
        );
        assert_eq!(
            ledger.get(&lease.id).await?.context("lease")?.phase,
            Phase::Quarantine,
            "a quarantined lease was freed on an unknown inventory"
        );
    }
    // The engine is back: the next vouched inventory frees it, and the job
    // that ran all along completes.
    proxy.set_up(true);
    let freed = wait_lease_phase(&cluster, Phase::Failed, Duration::from_secs(30)).await?;
    assert_eq!(freed.id, lease.id);
    end_done(&cluster, &jobs).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_holding_nothing_stops_at_once_on_sigterm() -> Result<()> {
    let mut cluster = Cluster::start(options(1000)).await?;
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.terminate()?;
    let status = node.wait(Duration::from_secs(10)).await?;
    assert!(status.success(), "the node exited with {status}");
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_is_bounded_and_destroys_nothing_when_it_times_out() -> Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        node_env: vec![("BILLET_DRAIN_TIMEOUT_SECS".into(), "2".into())],
        ..options(60_000)
    })
    .await?;
    let _jobs = cluster.queue_jobs(1);
    wait_job_running(&cluster, Duration::from_secs(30)).await?;
    let lease = only_lease(&cluster).await?;
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.terminate()?;
    let status = node.wait(Duration::from_secs(20)).await?;
    assert!(status.success(), "the node exited with {status}");
    assert!(
        container_id(&cluster, &format!("billet-{}", lease.id))
            .await
            .is_some(),
        "a drain that timed out destroyed the running job's container"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_sigterm_ends_the_drain_at_once_and_destroys_nothing() -> Result<()> {
    let mut cluster = Cluster::start(options(60_000)).await?;
    let _jobs = cluster.queue_jobs(1);
    wait_job_running(&cluster, Duration::from_secs(30)).await?;
    let lease = only_lease(&cluster).await?;
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.terminate()?;
    wait_until(Duration::from_secs(10), "the drain to start", || {
        node.log_text().contains("draining")
    })
    .await?;
    node.terminate()?;
    let status = node.wait(Duration::from_secs(15)).await?;
    assert!(status.success(), "the node exited with {status}");
    assert!(
        container_id(&cluster, &format!("billet-{}", lease.id))
            .await
            .is_some(),
        "stopping at once destroyed the running job's container"
    );
    cluster.shutdown().await
}

/// A drain ends what cannot finish. One runner registered and never given
/// a job, one drain of up to 60 s, SIGTERM: the idle runner is retired
/// (its registration removed, then its container destroyed, its lease
/// released `failed` `drained`, nothing left charged), and the node exits
/// cleanly long before its drain timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_retires_a_runner_that_took_no_job_and_ends_without_waiting_for_its_timeout()
-> Result<()> {
    let mut opts = options(60_000);
    opts.node_env
        .push(("BILLET_DRAIN_TIMEOUT_SECS".into(), "60".into()));
    let mut cluster = Cluster::start(opts).await?;
    let ledger = cluster.plane.ledger();
    let lease = cluster.reserve("drainidle1", 5252).await?;
    // No job is queued: the runner registers and waits, idle.
    let node = cluster.plane.node("node-1").context("node")?;
    let launched = node
        .dispatch(
            pb::command::Kind::Launch(pb::Launch {
                registration: None,
                lease: Some(billet_controlplane_stub::calls::lease_to_wire(&lease)),
                tier: Some(pb::TierSpec {
                    label: TIER.into(),
                    image: billet_tests::cluster::STANDIN_IMAGE.into(),
                    command: vec!["/billet-standin-runner".into()],
                    trust: "trusted".into(),
                    network: "host".into(),
                    ..Default::default()
                }),
                job: Some(pb::Job {
                    request_id: lease.request_id,
                    ..Default::default()
                }),
                warm_instance: String::new(),
            }),
            Duration::from_secs(30),
        )
        .await;
    assert!(launched.is_ok(), "{}", launched.describe());
    assert_eq!(cluster.emulator.state().runners.len(), 1);
    let stopping = tokio::time::Instant::now();
    let process = cluster.nodes.get_mut("node-1").context("node")?;
    process.terminate()?;
    let status = process.wait(Duration::from_secs(30)).await?;
    assert!(status.success(), "the node exited with {status}");
    assert!(
        stopping.elapsed() < Duration::from_secs(30),
        "the drain waited {:?} for a runner that had no job",
        stopping.elapsed()
    );
    let ended = ledger.get("drainidle1").await?.context("the lease")?;
    assert_eq!(ended.phase, Phase::Failed, "{ended:?}");
    assert_eq!(
        ended.failure_reason.as_deref(),
        Some("drained"),
        "{ended:?}"
    );
    assert!(
        container_id(&cluster, "billet-drainidle1").await.is_none(),
        "the idle runner's container was left"
    );
    assert!(
        cluster.emulator.state().runners.is_empty(),
        "the idle runner's registration was left"
    );
    let charged = cluster.charged().await?;
    assert_eq!((charged.vcpu, charged.memory_bytes), (0, 0), "{charged:?}");
    cluster.shutdown().await
}
