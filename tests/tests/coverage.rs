//! The plane keeps every assigned job covered until GitHub says a runner
//! took it: whatever a launch runs into (an engine that went away, a
//! missing image, a node killed mid-mint, a draining node, a deleted scale
//! set, a partition), the job gets a fresh lease and runs exactly once, and
//! at the end no container, registration or charged capacity is left.
//! Real binaries, real mTLS, real Docker, the scale-set emulator.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::ledger::Phase;
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions, STANDIN_IMAGE, Starts, wait_until};
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

/// Every job completed `succeeded`, started exactly once; then no
/// container, no registration and no charged capacity is left, and every
/// node's own report of what it holds agrees with the ledger: nothing.
async fn all_done_once(
    cluster: &Cluster,
    jobs: &[scaleset::JobRequestId],
    starts: &Starts,
    timeout: Duration,
) -> Result<()> {
    cluster.wait_jobs_completed(jobs, timeout).await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    starts.assert_each_succeeded_once(cluster, jobs)?;
    let state = cluster.emulator.state();
    assert!(
        state.runners.is_empty(),
        "registrations left: {:?}",
        state.runners
    );
    for name in cluster.nodes.keys() {
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
        let billet_controlplane_stub::node_link::CommandOutcome::Answered(result) = outcome else {
            bail!("node {name} did not answer Instances: {outcome:?}");
        };
        let report = result.instances.context("an instance report")?;
        let held = report.held.unwrap_or_default();
        let charged = cluster.plane.ledger().charged_on(name).await?;
        assert_eq!(
            (u64::from(held.vcpu), held.memory_bytes),
            (charged.vcpu, charged.memory_bytes),
            "node {name} holds what the ledger does not charge it"
        );
        assert!(
            report.capacity.is_some_and(|c| c.vcpu > 0),
            "node {name} reported no capacity"
        );
    }
    Ok(())
}

/// A condition that holds once `n` launches have failed from now on: more
/// than the three tries a plane that gives up would make.
fn launches_failed(cluster: &Cluster, n: usize) -> impl FnMut() -> bool + 'static {
    let mut events = cluster.plane.subscribe();
    let mut seen = 0;
    move || {
        seen += std::iter::from_fn(|| events.try_recv().ok())
            .filter(|e| matches!(e, PlaneEvent::LaunchFailed { .. }))
            .count();
        seen >= n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_while_docker_is_unreachable_for_20s_runs_once_docker_is_back() -> Result<()> {
    let proxy = EngineProxy::start().await?;
    let cluster = Cluster::start(ClusterOptions {
        docker_socket: proxy.path.clone(),
        ..options(1500)
    })
    .await?;
    let starts = Starts::watch(&cluster);
    // Start-up recovery reads the engine; the engine goes away after it.
    wait_until(Duration::from_secs(30), "the node to recover", || {
        cluster.nodes["node-1"]
            .log_text()
            .contains("recovered; taking commands")
    })
    .await?;
    // A node whose engine is gone reports itself degraded and the plane then
    // holds launches back; place them anyway, so that the node's own typed
    // refusal (nothing minted) is what fails them and the plane must replace
    // each one.
    cluster
        .plane
        .node("node-1")
        .context("node")?
        .faults
        .place_on_degraded
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let mut failed = launches_failed(&cluster, 4);
    proxy.set_up(false);
    let down = Instant::now();
    let jobs = cluster.queue_jobs(1);
    wait_until(
        Duration::from_secs(40),
        "four launches to fail",
        &mut failed,
    )
    .await?;
    // The engine stays away for 20 s; the job stays queued and covered.
    wait_until(Duration::from_secs(25), "20 s to pass", || {
        down.elapsed() >= Duration::from_secs(20)
    })
    .await?;
    assert!(
        !cluster.plane.uncovered_jobs().is_empty(),
        "the plane stopped covering the job"
    );
    proxy.set_up(true);
    all_done_once(&cluster, &jobs, &starts, Duration::from_secs(90)).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_image_missing_for_the_first_launch_runs_the_job_once_the_image_is_there() -> Result<()>
{
    let image = format!(
        "billet-standin-later-{}:dev",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let cluster = Cluster::start(ClusterOptions {
        tier_image: image.clone(),
        ..options(1500)
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let mut failed = launches_failed(&cluster, 4);
    let jobs = cluster.queue_jobs(1);
    wait_until(
        Duration::from_secs(30),
        "four launches to fail",
        &mut failed,
    )
    .await?;
    // Refused before anything was registered: no JIT config was minted.
    assert!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .is_empty(),
        "a JIT config was minted for a launch whose image is missing"
    );
    // The operator pulls the image while the job waits. It is an image of
    // its own (the stand-in plus a label), so another test process that
    // rebuilds the stand-in and removes its previous image cannot take it.
    billet_tests::image::derive_image(&cluster.docker, STANDIN_IMAGE, &image, &[]).await?;
    let outcome = all_done_once(&cluster, &jobs, &starts, Duration::from_secs(90)).await;
    let _ = cluster
        .docker
        .remove_image(
            &image,
            None::<bollard::query_parameters::RemoveImageOptions>,
            None,
        )
        .await;
    outcome?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_sigkilled_mid_mint_and_restarted_runs_the_job_on_a_fresh_lease() -> Result<()> {
    let mut cluster = Cluster::start(options(1500)).await?;
    let starts = Starts::watch(&cluster);
    // Minting takes three seconds: the node dies while it waits.
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::GenerateJitConfig, Duration::from_secs(3)).times(1));
    let jobs = cluster.queue_jobs(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let first = loop {
        if let Some(l) = cluster
            .plane
            .ledger()
            .leases()
            .await?
            .into_iter()
            .find(|l| l.phase == Phase::Launching)
        {
            break l;
        }
        if Instant::now() > deadline {
            bail!("no launch started");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.kill().await?;
    node.restart().await?;
    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    all_done_once(&cluster, &jobs, &starts, Duration::from_secs(90)).await?;
    let first = cluster
        .plane
        .ledger()
        .get(&first.id)
        .await?
        .context("the first lease")?;
    assert_eq!(
        first.phase,
        Phase::Failed,
        "the launch the node died in must end failed"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_while_the_only_node_drains_runs_on_a_second_node_once_it_attaches()
-> Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        nodes: vec!["node-1".into(), "node-2".into()],
        ..options(40_000)
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let second = cluster.plane.node("node-2").context("node-2")?.clone();
    // Only node-1 is reachable at first.
    second.partition(true);
    wait_until(Duration::from_secs(10), "node-2 to be cut off", || {
        second.status().borrow().is_none()
    })
    .await?;
    let first_job = cluster.queue_jobs(1);
    wait_until(Duration::from_secs(30), "the first job to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .any(|j| j.state == JobState::Running)
    })
    .await?;
    // node-1 drains (its job keeps running), then a job is queued.
    cluster.nodes["node-1"].terminate()?;
    wait_until(Duration::from_secs(10), "the drain to start", || {
        cluster.nodes["node-1"].log_text().contains("draining")
    })
    .await?;
    let mut failed = launches_failed(&cluster, 4);
    let waiting = cluster.queue_jobs(1);
    wait_until(
        Duration::from_secs(40),
        "the draining node to refuse four times",
        &mut failed,
    )
    .await?;
    second.partition(false);
    cluster
        .wait_attached("node-2", Duration::from_secs(30))
        .await?;
    cluster
        .wait_jobs_completed(&waiting, Duration::from_secs(60))
        .await?;
    let mut ran_on = Vec::new();
    for runner in starts.of(waiting[0]) {
        let lease = cluster
            .plane
            .ledger()
            .lease_by_runner_name(&runner)
            .await?
            .context("the runner's lease")?;
        ran_on.push(lease.node);
    }
    assert_eq!(
        ran_on,
        [Some("node-2".to_owned())],
        "where the waiting job ran"
    );
    let status = cluster
        .nodes
        .get_mut("node-1")
        .context("node-1")?
        .wait(Duration::from_secs(60))
        .await?;
    assert!(status.success(), "node-1 exited with {status}");
    let jobs = [first_job[0], waiting[0]];
    all_done_once(&cluster, &jobs, &starts, Duration::from_secs(60)).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_set_github_says_is_gone_is_asked_about_once_per_30s_and_the_job_runs_when_it_is_back()
-> Result<()> {
    let cluster = Cluster::start(options(1500)).await?;
    let starts = Starts::watch(&cluster);
    // GitHub answers the mint 404: the set is gone as far as minting goes.
    cluster
        .emulator
        .inject(Fault::status(Endpoint::GenerateJitConfig, 404).times(1));
    // Record when each call about the set (mint or lookup) is made.
    let calls: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let watch = async {
        let mut seen = 0;
        loop {
            let now = cluster
                .emulator
                .requests_to(Endpoint::GenerateJitConfig)
                .len()
                + cluster.emulator.requests_to(Endpoint::ScaleSets).len();
            if now > seen {
                calls
                    .lock()
                    .expect("calls")
                    .extend(std::iter::repeat_n(Instant::now(), now - seen));
                seen = now;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let before = cluster
        .emulator
        .requests_to(Endpoint::GenerateJitConfig)
        .len()
        + cluster.emulator.requests_to(Endpoint::ScaleSets).len();
    let jobs = cluster.queue_jobs(1);
    tokio::select! {
        done = all_done_once(&cluster, &jobs, &starts, Duration::from_secs(120)) => done?,
        () = watch => unreachable!("the watch never ends"),
    }
    let calls = calls.lock().expect("calls").clone();
    // Setup's own lookups came first; from the 404'd mint on, every call
    // about the set is at least the interval after the one before, until
    // the set is found again.
    let calls = &calls[before..];
    assert!(
        calls.len() >= 3,
        "expected the 404, a lookup and a mint: {calls:?}"
    );
    let gap = calls[1].duration_since(calls[0]);
    assert!(
        gap >= Duration::from_secs(29),
        "GitHub was asked about a missing set again after {gap:?}"
    );
    cluster.shutdown().await
}

/// GitHub deletes the scale set while a launch mints for it, and it is
/// made again by the same name, with a new id: the mint is answered with
/// the typed `SCALE_SET_NOT_FOUND` (from GitHub's 404, to the node, back
/// in the launch result); from then on at most one call about the set
/// reaches GitHub per 30 s until it is found again; the deleted set's job
/// (gone with it at GitHub) is no longer covered, and the new set's job
/// runs exactly once, leaving nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_set_deleted_and_made_again_with_a_new_id_is_typed_asked_about_once_per_30s_and_its_job_runs()
-> Result<()> {
    let cluster = Cluster::start(options(1500)).await?;
    let starts = Starts::watch(&cluster);
    let mut events = cluster.plane.subscribe();
    let old = cluster.plane.scale_set();
    // Minting takes four seconds: the set is deleted while it waits.
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::GenerateJitConfig, Duration::from_secs(4)).times(1));
    let gone = cluster.queue_jobs(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    while !cluster
        .plane
        .ledger()
        .leases()
        .await?
        .iter()
        .any(|l| l.phase == Phase::Launching)
    {
        if Instant::now() > deadline {
            bail!("no launch started minting");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let github = cluster.emulator.client();
    github.delete_runner_scale_set(old).await?;
    let new = github
        .create_runner_scale_set(&scaleset::RunnerScaleSetSpec::new(
            billet_tests::cluster::TIER,
        ))
        .await?
        .id;
    assert_ne!(new, old);
    let calls_about_the_set = || {
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len()
            + cluster.emulator.requests_to(Endpoint::ScaleSets).len()
    };
    let before = calls_about_the_set();
    let calls: Arc<Mutex<Vec<Instant>>> = Arc::default();
    let watch = async {
        let mut seen = before;
        loop {
            let now = calls_about_the_set();
            if now > seen {
                calls
                    .lock()
                    .expect("calls")
                    .extend(std::iter::repeat_n(Instant::now(), now - seen));
                seen = now;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    let job = cluster
        .emulator
        .queue_job(new, [billet_tests::cluster::TIER]);
    let typed = async {
        loop {
            match events.recv().await {
                Ok(PlaneEvent::LaunchFailed {
                    code: Some(billet_proto::v1::ErrorCode::ScaleSetNotFound),
                    ..
                }) => {
                    return Ok(());
                }
                Ok(PlaneEvent::LaunchFailed { code, reason, .. }) => {
                    bail!("a launch failed with {code:?}, not SCALE_SET_NOT_FOUND: {reason}")
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => bail!("plane events: {e}"),
            }
        }
    };
    let run = async {
        tokio::time::timeout(Duration::from_secs(30), typed)
            .await
            .context("no launch failed with SCALE_SET_NOT_FOUND")??;
        all_done_once(&cluster, &[job], &starts, Duration::from_secs(120)).await
    };
    tokio::select! {
        done = run => done?,
        () = watch => unreachable!("the watch never ends"),
    }
    assert_eq!(
        cluster.plane.scale_set(),
        new,
        "the plane listens on the new set"
    );
    assert!(
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .all(|j| j.id != gone[0]),
        "the deleted set's job is still at GitHub"
    );
    assert!(starts.of(gone[0]).is_empty(), "the deleted set's job ran");
    let calls = calls.lock().expect("calls").clone();
    assert!(
        calls.len() >= 3,
        "expected the 404, a lookup and a mint: {calls:?}"
    );
    let gap = calls[1].duration_since(calls[0]);
    assert!(
        gap >= Duration::from_secs(29),
        "GitHub was asked about the missing set again after {gap:?}"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_partitioned_for_60s_has_its_leases_quarantined_never_freed_and_reconciled_on_heal()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        nodes: vec!["node-1".into(), "node-2".into()],
        renewal_grace: Duration::from_secs(5),
        lease_ttl: Duration::from_secs(6),
        ..options(40_000)
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let jobs = cluster.queue_jobs(2);
    wait_until(Duration::from_secs(40), "both jobs to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            == 2
    })
    .await?;
    let leases = cluster.plane.ledger().open_leases().await?;
    let cut = leases
        .iter()
        .find(|l| l.node.as_deref() == Some("node-2"))
        .context("a lease on node-2: placement spreads two jobs over two nodes")?
        .clone();
    let link = cluster.plane.node("node-2").context("node-2")?.clone();
    link.partition(true);
    let partitioned = Instant::now();
    let container = format!("billet-{}", cut.id);
    let mut quarantined = false;
    while partitioned.elapsed() < Duration::from_secs(60) {
        let lease = cluster
            .plane
            .ledger()
            .get(&cut.id)
            .await?
            .context("the lease")?;
        quarantined |= lease.phase == Phase::Quarantine;
        let running = cluster
            .docker
            .inspect_container(&container, None)
            .await
            .ok()
            .and_then(|c| c.state)
            .and_then(|s| s.running)
            .unwrap_or(false);
        if running {
            assert!(
                !lease.phase.is_terminal(),
                "the lease was freed while its container runs: {lease:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert!(
        quarantined,
        "the partitioned node's lease was never quarantined: the plane kept renewing it"
    );
    link.partition(false);
    cluster
        .wait_attached("node-2", Duration::from_secs(30))
        .await?;
    all_done_once(&cluster, &jobs, &starts, Duration::from_secs(120)).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_runner_whose_registration_github_lost_is_destroyed_only_once_github_answers()
-> Result<()> {
    // The stand-in looks at the emulator for the first time 45 s after it
    // starts: until then its runner is registered and idle, and takes no
    // job. (The emulator never applies a fault to its control API, so a
    // 503 there cannot hold a runner idle: the runner took the job in the
    // moment between coming up and the removal below, and GitHub refused
    // that removal JobStillRunning.) The whole scenario, from the removal to
    // the reaping, takes about 15 s.
    let cluster = Cluster::start(ClusterOptions {
        registration_interval: Duration::from_secs(1),
        registration_grace: Duration::from_secs(3),
        tier_env: vec!["BILLET_STANDIN_FIRST_LOOK_MS=45000".into()],
        ..options(1500)
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let jobs = cluster.queue_jobs(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let (lease, runner) = loop {
        let state = cluster.emulator.state();
        if let Some(runner) = state.runners.first() {
            let lease = cluster
                .plane
                .ledger()
                .lease_by_runner_name(&runner.name)
                .await?
                .context("the runner's lease")?;
            if cluster.containers().await?.contains(&runner.name) {
                break (lease, runner.clone());
            }
        }
        if Instant::now() > deadline {
            bail!("no idle runner came up");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // GitHub loses the registration, and then answers 503 for a while.
    cluster.emulator.client().remove_runner(runner.id).await?;
    cluster
        .emulator
        .inject(Fault::status(Endpoint::Runners, 503));
    let asked = cluster.emulator.requests_to(Endpoint::Runners).len();
    wait_until(
        Duration::from_secs(60),
        "the plane to ask GitHub through the outage",
        || cluster.emulator.requests_to(Endpoint::Runners).len() >= asked + 8,
    )
    .await?;
    // Well past the grace, but GitHub never said 404: nothing was reaped.
    let during = cluster
        .plane
        .ledger()
        .get(&lease.id)
        .await?
        .context("lease")?;
    assert!(
        !during.phase.is_terminal(),
        "an idle runner was destroyed while GitHub answered 503: {during:?}"
    );
    assert!(cluster.containers().await?.contains(&runner.name));
    // GitHub answers again: 404 for longer than the grace, so it goes.
    cluster.emulator.clear_faults();
    let ended = cluster
        .wait_lease_ended(
            &lease.id,
            Duration::from_secs(60),
            "the runner without a registration was never destroyed",
        )
        .await?;
    assert_eq!(ended.phase, Phase::Failed);
    assert_eq!(
        ended.failure_reason.as_deref(),
        Some(billet_controlplane_stub::plane::REGISTRATION_LOST),
        "failed for another reason: {ended:?}"
    );
    wait_until(Duration::from_secs(30), "its container to go", || {
        !container_exists(&cluster, &runner.name)
    })
    .await?;
    // The job was covered afresh all along, and runs once a fresh runner
    // takes its first look.
    all_done_once(&cluster, &jobs, &starts, Duration::from_secs(150)).await?;
    cluster.shutdown().await
}

/// Whether a container named `name` exists, asked synchronously of the
/// Docker command line (a `wait_until` condition cannot await).
fn container_exists(cluster: &Cluster, name: &str) -> bool {
    std::process::Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=sh.billet.deployment={}", cluster.deployment),
            "--filter",
            &format!("name=^{name}$"),
        ])
        .output()
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(true)
}

/// Six idle runners whose registrations are deleted at GitHub, GitHub
/// answering 503 for the first part of the run. Nothing is reaped during
/// the 503s (unknown is not gone); then all six are destroyed with reason
/// `registration_lost`, a few per pass; once the jobs are cancelled
/// nothing is left. The runners never connect, so they stay idle and
/// cannot notice their registration go (the start deadline, 120 s here, is
/// well past the reaping).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn six_idle_runners_whose_registrations_github_deleted_are_reaped_only_after_its_503s()
-> Result<()> {
    const RUNNERS: usize = 6;
    let mut opts = ClusterOptions {
        registration_interval: Duration::from_secs(1),
        registration_grace: Duration::from_secs(3),
        tier_env: vec!["BILLET_STANDIN_MODE=never-connect".into()],
        ..options(1500)
    };
    opts.node_env
        .push(("BILLET_START_DEADLINE_SECS".into(), "120".into()));
    let cluster = Cluster::start(opts).await?;
    let jobs = cluster.queue_jobs(RUNNERS);
    let deadline = Instant::now() + Duration::from_secs(90);
    let runners = loop {
        let state = cluster.emulator.state();
        let containers = cluster.containers().await?;
        if state.runners.len() == RUNNERS
            && state.runners.iter().all(|r| containers.contains(&r.name))
        {
            break state.runners;
        }
        if Instant::now() > deadline {
            bail!(
                "six idle runners did not come up: {:?}, containers {containers:?}",
                state.runners
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let mut leases = Vec::new();
    for runner in &runners {
        leases.push(
            cluster
                .plane
                .ledger()
                .lease_by_runner_name(&runner.name)
                .await?
                .context("the runner's lease")?,
        );
    }
    // GitHub loses every registration, and then answers 503 for a while.
    for runner in &runners {
        cluster.emulator.client().remove_runner(runner.id).await?;
    }
    cluster
        .emulator
        .inject(Fault::status(Endpoint::Runners, 503));
    let asked = cluster.emulator.requests_to(Endpoint::Runners).len();
    wait_until(
        Duration::from_secs(60),
        "the plane to ask GitHub through the outage",
        || cluster.emulator.requests_to(Endpoint::Runners).len() >= asked + 8,
    )
    .await?;
    let containers = cluster.containers().await?;
    for lease in &leases {
        let now = cluster
            .plane
            .ledger()
            .get(&lease.id)
            .await?
            .context("lease")?;
        assert!(
            !now.phase.is_terminal(),
            "an idle runner was reaped while GitHub answered 503: {now:?}"
        );
        assert!(
            containers.contains(&format!("billet-{}", lease.id)),
            "a container went during the 503s"
        );
    }
    // GitHub answers again: 404 past the grace, so all six go.
    cluster.emulator.clear_faults();
    let deadline = Instant::now() + Duration::from_secs(90);
    loop {
        let mut ended = Vec::new();
        for lease in &leases {
            let l = cluster
                .plane
                .ledger()
                .get(&lease.id)
                .await?
                .context("lease")?;
            if l.phase.is_terminal() {
                ended.push(l);
            }
        }
        if ended.len() == RUNNERS {
            for l in &ended {
                assert_eq!(l.phase, Phase::Failed, "{l:?}");
                assert_eq!(
                    l.failure_reason.as_deref(),
                    Some(billet_controlplane_stub::plane::REGISTRATION_LOST),
                    "{l:?}"
                );
            }
            break;
        }
        if Instant::now() > deadline {
            bail!("not all six runners without a registration were destroyed: {ended:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    for lease in &leases {
        let name = format!("billet-{}", lease.id);
        wait_until(Duration::from_secs(30), "its container to go", || {
            !container_exists(&cluster, &name)
        })
        .await?;
    }
    // The jobs are cancelled; their replacement runners (never connecting
    // either) go by the start deadline, and nothing is left.
    for job in &jobs {
        cluster.emulator.complete_job(*job, Some("canceled"));
    }
    cluster.wait_clean(Duration::from_secs(180)).await?;
    wait_until(Duration::from_secs(60), "no registration left", || {
        cluster.emulator.state().runners.is_empty()
    })
    .await?;
    cluster.shutdown().await
}

/// A tier the engine refuses after the mint (memory under Docker's 6 MB
/// minimum): every launch fails at the create, its registration is removed
/// before the next is minted, and each failed lease says why in the ledger.
/// Without a reason, an operator reading the ledger could not tell what the
/// job was waiting on. The job stays covered (a fresh lease after each
/// backoff) and, cancelled at GitHub, leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_the_engine_refuses_ends_its_lease_failed_saying_why_and_leaks_nothing()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        tier_memory_bytes: 1 << 20,
        ..options(2_000)
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    let mut most_registrations = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    let failed = loop {
        most_registrations = most_registrations.max(cluster.emulator.state().runners.len());
        let failed: Vec<_> = cluster
            .plane
            .ledger()
            .leases()
            .await?
            .into_iter()
            .filter(|l| l.phase == Phase::Failed)
            .collect();
        let refused = failed.iter().any(|l| {
            l.failure_reason
                .as_deref()
                .is_some_and(|r| r.contains("memory"))
        });
        if failed.len() >= 2 && refused {
            break failed;
        }
        if Instant::now() > deadline {
            bail!(
                "within 60 s, not two failed leases of which one names the engine's refusal: {failed:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    // Each says why: the engine's refusal, or (a launch for the request
    // while the last one's failed create is still being cleaned up) that.
    for lease in &failed {
        let reason = lease.failure_reason.as_deref().unwrap_or_default();
        assert!(
            reason.starts_with("launch: "),
            "lease {} failed without saying why: {reason:?}",
            lease.id
        );
    }
    assert!(
        most_registrations <= 1,
        "registrations piled up: {most_registrations}"
    );
    for job in &jobs {
        cluster.emulator.complete_job(*job, Some("cancelled"));
    }
    cluster.wait_clean(Duration::from_secs(60)).await?;
    wait_until(Duration::from_secs(60), "no registration left", || {
        cluster.emulator.state().runners.is_empty()
    })
    .await?;
    cluster.shutdown().await
}

/// A plane's restart: jobs GitHub assigned while the only node had no
/// room, whose `JobAssigned` messages the old plane already acknowledged,
/// are still covered by the plane that replaces it. The emulator (GitHub)
/// keeps its state across the restart, as GitHub does; the new plane learns
/// those jobs only from the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_waiting_for_room_when_the_plane_restarts_are_covered_by_the_new_plane() -> Result<()>
{
    let mut cluster = Cluster::start(ClusterOptions {
        node_vcpu: 2,
        ..options(8_000)
    })
    .await?;
    let before = Starts::watch(&cluster);
    let jobs = cluster.queue_jobs(4);
    let set = cluster.plane.scale_set();
    // Two run; two are assigned, acknowledged, and wait for room.
    wait_until(
        Duration::from_secs(60),
        "two jobs running and two waiting, every message acknowledged",
        || {
            let state = cluster.emulator.state();
            let count = |s: JobState| {
                state
                    .jobs
                    .iter()
                    .filter(|j| j.scale_set_id == set && j.state == s)
                    .count()
            };
            count(JobState::Running) == 2
                && count(JobState::Assigned) == 2
                && state.queues_drained()
                && cluster.plane.uncovered_jobs().len() == 2
        },
    )
    .await?;
    cluster.restart_plane().await?;
    let after = Starts::watch(&cluster);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await
        .with_context(|| {
            format!(
                "the new plane covers {:?}; GitHub has {:?}",
                cluster.plane.uncovered_jobs(),
                cluster.emulator.state().jobs
            )
        })?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    let state = cluster.emulator.state();
    for id in &jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
        assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
        let mut runners = before.of(*id);
        runners.extend(after.of(*id));
        assert_eq!(runners.len(), 1, "job {id} started by {runners:?}");
    }
    assert!(
        state.runners.is_empty(),
        "registrations left: {:?}",
        state.runners
    );
    cluster.shutdown().await
}

/// GitHub answers a launch's mint 409 AgentExists: another scale set holds
/// a runner of the lease's name. The launch fails with its own code,
/// `RUNNER_NAME_TAKEN`, never `UNSPECIFIED` nor an outage's; the lease
/// ends `failed` naming the name; the job runs once on a fresh lease (a
/// fresh name); and the other set's runner is never touched, not even by
/// the registration pass that looks for an ended lease's registration by
/// name.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_name_held_by_another_scale_set_fails_the_launch_typed_and_the_job_runs_on_a_fresh_lease()
-> Result<()> {
    let cluster = Cluster::start(options(1500)).await?;
    let starts = Starts::watch(&cluster);
    let mut events = cluster.plane.subscribe();
    // The mint waits: the name is taken meanwhile in another set.
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::GenerateJitConfig, Duration::from_secs(3)).times(1));
    let jobs = cluster.queue_jobs(1);
    let deadline = Instant::now() + Duration::from_secs(30);
    let lease = loop {
        if let Some(l) = cluster
            .plane
            .ledger()
            .leases()
            .await?
            .into_iter()
            .find(|l| l.phase == Phase::Launching)
        {
            break l;
        }
        if Instant::now() > deadline {
            bail!("no launch started minting");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let name = format!("billet-{}", lease.id);
    let github = cluster.emulator.client();
    let other = github
        .create_runner_scale_set(&scaleset::RunnerScaleSetSpec::new("another-deployment"))
        .await?
        .id;
    let taken = github
        .generate_jit_config(other, &scaleset::JitRunnerSetting::new(&name))
        .await?
        .runner
        .context("the other set's runner")?;
    let typed = async {
        loop {
            match events.recv().await {
                Ok(PlaneEvent::LaunchFailed {
                    lease: failed,
                    code,
                    reason,
                    ..
                }) if failed == lease.id => {
                    return Ok::<_, anyhow::Error>((code, reason));
                }
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => bail!("plane events: {e}"),
            }
        }
    };
    let (code, reason) = tokio::time::timeout(Duration::from_secs(30), typed)
        .await
        .context("the launch never failed")??;
    assert_eq!(
        code,
        Some(billet_proto::v1::ErrorCode::RunnerNameTaken),
        "{reason}"
    );
    assert!(reason.contains(&name), "{reason}");
    // The plane ends the lease just after it tells of the failure.
    let deadline = Instant::now() + Duration::from_secs(30);
    let ended = loop {
        let l = cluster
            .plane
            .ledger()
            .get(&lease.id)
            .await?
            .context("the lease")?;
        if l.phase.is_terminal() || Instant::now() > deadline {
            break l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(ended.phase, Phase::Failed, "{ended:?}");
    assert!(
        ended
            .failure_reason
            .as_deref()
            .is_some_and(|r| r.contains(&name)),
        "{ended:?}"
    );
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    starts.assert_each_succeeded_once(&cluster, &jobs)?;
    // The registration pass looks the failed lease's name up once its
    // grace has passed, and, in the same pass or a later one, the job's own
    // lease, which ended after it, by its recorded id: once that is asked,
    // whatever the pass did with the name is done.
    let fresh = cluster
        .plane
        .ledger()
        .leases()
        .await?
        .into_iter()
        .find(|l| l.id != lease.id)
        .and_then(|l| l.runner_id)
        .context("the fresh lease's runner")?;
    let passed = || {
        let requests = cluster.emulator.requests_to(Endpoint::Runners);
        let by_name = requests.iter().position(|r| {
            r.method == "GET" && r.query.as_deref().is_some_and(|q| q.contains(&name))
        });
        by_name.is_some_and(|at| {
            requests[at..]
                .iter()
                .any(|r| r.method == "GET" && r.path.ends_with(&format!("/{fresh}")))
        })
    };
    wait_until(
        Duration::from_secs(60),
        "the registration pass past both ended leases",
        passed,
    )
    .await?;
    let runners = cluster.emulator.state().runners;
    assert_eq!(
        runners
            .iter()
            .map(|r| (r.id, r.name.clone()))
            .collect::<Vec<_>>(),
        vec![(taken.id, name.clone())],
        "only the other set's runner is left, untouched: {runners:?}"
    );
    cluster.shutdown().await
}
