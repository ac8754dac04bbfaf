//! A runner's life is what the provider sees, end to end with real Docker,
//! the real `billet node`, the stub plane and the scaleset emulator. Each
//! scenario ends with no billet container, no runner registration and no
//! charged capacity, the lease terminal with the right outcome and failure
//! reason.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::ledger::{Lease, Phase};
use billet_controlplane_stub::plane::{PlaneEvent, ScaleDown};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until, wall_clock_off};
use scaleset::JobRequestId;
use scaleset::testing::{Endpoint, Fault, JobState};

/// How often the plane sends Tend (and Sweep).
const TEND_INTERVAL: Duration = Duration::from_secs(2);

/// "Within one tend interval": the next tend after the event, its own
/// provider and ledger calls, and the time to read the ledger back.
const ONE_TEND: Duration = Duration::from_secs(8);

fn options(work_ms: u64) -> ClusterOptions {
    ClusterOptions {
        work_ms,
        maintenance_interval: TEND_INTERVAL,
        node_env: vec![
            ("BILLET_ACK_TIMEOUT_SECS".into(), "2".into()),
            ("BILLET_STRAY_GRACE_SECS".into(), "2".into()),
        ],
        ..ClusterOptions::default()
    }
}

async fn leases(cluster: &Cluster) -> Result<Vec<Lease>> {
    Ok(cluster.plane.ledger().leases().await?)
}

async fn only_lease(cluster: &Cluster) -> Result<Lease> {
    match leases(cluster).await?.as_slice() {
        [one] => Ok(one.clone()),
        other => bail!("expected one lease, found {other:?}"),
    }
}

/// Waits until `n` jobs run at the emulator.
async fn wait_jobs_running(cluster: &Cluster, n: usize, timeout: Duration) -> Result<()> {
    wait_until(timeout, "the jobs to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            >= n
    })
    .await
}

/// Waits until every lease is terminal, and returns them.
async fn wait_all_terminal(cluster: &Cluster, timeout: Duration) -> Result<Vec<Lease>> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let all = leases(cluster).await?;
        if !all.is_empty() && all.iter().all(|l| l.phase.is_terminal()) {
            return Ok(all);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the leases were not all terminal within {timeout:?}: {all:?}\nnode log:\n{}",
                cluster.nodes["node-1"].log_text()
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// What GitHub does in time for a runner that died mid-job: it fails the
/// job, and the runner's registration can then be removed.
fn github_gives_up_on(cluster: &Cluster, jobs: &[JobRequestId]) {
    for job in jobs {
        cluster.emulator.complete_job(*job, Some("failed"));
    }
}

/// No container, no charge, no registration.
async fn ends_clean(cluster: &Cluster) -> Result<()> {
    cluster.wait_clean(Duration::from_secs(30)).await?;
    wait_until(Duration::from_secs(60), "no registration left", || {
        cluster.emulator.state().runners.is_empty()
    })
    .await
    .with_context(|| format!("registrations: {:?}", cluster.emulator.state().runners))
}

/// Kills the running runner's container as `docker kill` does, and checks
/// the lease is released `failed` with `reason` within one tend.
async fn a_runner_that_dies(cluster: &Cluster, how: Option<&str>, reason: &str) -> Result<()> {
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(cluster).await?;
    if let Some(signal) = how {
        cluster
            .docker
            .kill_container(
                &format!("billet-{}", lease.id),
                Some(
                    bollard::query_parameters::KillContainerOptionsBuilder::default()
                        .signal(signal)
                        .build(),
                ),
            )
            .await?;
    }
    let died = tokio::time::Instant::now();
    // The OOM kill happens on its own once the job runs; allow for it.
    let bound = if how.is_some() {
        ONE_TEND
    } else {
        ONE_TEND + Duration::from_secs(30)
    };
    let ended = wait_all_terminal(cluster, bound).await?;
    let took = died.elapsed();
    assert_eq!(ended[0].phase, Phase::Failed, "{ended:?}");
    assert_eq!(
        ended[0].failure_reason.as_deref(),
        Some(reason),
        "{ended:?}"
    );
    // Freed at once: no container and no charge, though GitHub still holds
    // the job on the dead runner.
    cluster.wait_clean(Duration::from_secs(5)).await?;
    assert!(
        !cluster.emulator.state().runners.is_empty(),
        "GitHub let the busy runner go before the test gave up on its job"
    );
    github_gives_up_on(cluster, &jobs);
    ends_clean(cluster).await?;
    eprintln!("released {took:?} after the runner died");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_by_docker_kill_frees_its_lease_failed_killed_within_one_tend() -> Result<()>
{
    let cluster = Cluster::start(options(120_000)).await?;
    a_runner_that_dies(&cluster, Some("SIGKILL"), "killed").await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_oom_killed_under_128_mib_frees_its_lease_failed_oom() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        tier_env: vec!["BILLET_STANDIN_MODE=allocate".into()],
        tier_memory_bytes: 128 << 20,
        ..options(120_000)
    })
    .await?;
    a_runner_that_dies(&cluster, None, "oom").await?;
    cluster.shutdown().await
}

/// A step of the job, not the runner, is OOM-killed: Docker marks the
/// container OOM-killed, but the runner goes on, completes its job
/// `succeeded` and exits 0. When the runner's exit reaches the node
/// before GitHub's completion reaches the plane (delayed here), the
/// lease must not be released `failed`, reason `oom`, for a job that
/// succeeded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_whose_step_is_oom_killed_and_that_completes_its_job_ends_done() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        tier_env: vec!["BILLET_STANDIN_MODE=oom-step".into()],
        tier_memory_bytes: 128 << 20,
        ..options(3_000)
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    // GitHub's completion reaches the plane late, as it can: the runner's
    // exit reaches the node first.
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::GetMessage, Duration::from_secs(20)));
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    // How the runner's container ended, while GitHub's completion is
    // still on its way (`None` when it was removed first).
    let mut exited = None;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    while tokio::time::Instant::now() < deadline {
        let Ok(container) = cluster
            .docker
            .inspect_container(&format!("billet-{}", lease.id), None)
            .await
        else {
            break;
        };
        let state = container.state.unwrap_or_default();
        if state.status == Some(bollard::models::ContainerStateStatusEnum::EXITED) {
            exited = Some((state.exit_code, state.oom_killed));
            break;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let ended = wait_all_terminal(&cluster, Duration::from_secs(60)).await?;
    cluster.emulator.clear_faults();
    assert_eq!(
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .find(|j| j.id == jobs[0])
            .and_then(|j| j.result.clone())
            .as_deref(),
        Some("succeeded")
    );
    assert_eq!(
        (ended[0].phase, ended[0].failure_reason.as_deref()),
        (Phase::Done, None),
        "{ended:?}"
    );
    // The fault this test is about happened: a process in the container
    // was OOM-killed and the runner still exited 0.
    assert_eq!(
        exited,
        Some((Some(0), Some(true))),
        "the runner's container did not end with exit 0 after an OOM kill inside it"
    );
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_whose_container_is_removed_out_of_band_frees_its_lease_failed_removed_within_one_tend()
-> Result<()> {
    let cluster = Cluster::start(options(120_000)).await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    remove_out_of_band(&cluster, &format!("billet-{}", lease.id)).await?;
    let ended = wait_all_terminal(&cluster, ONE_TEND).await?;
    assert_eq!(ended[0].phase, Phase::Failed, "{ended:?}");
    assert_eq!(ended[0].failure_reason.as_deref(), Some("removed"));
    cluster.wait_clean(Duration::from_secs(5)).await?;
    github_gives_up_on(&cluster, &jobs);
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_killed_with_three_running_containers_that_are_then_removed_frees_their_slots_after_restart()
-> Result<()> {
    let mut cluster = Cluster::start(options(120_000)).await?;
    let jobs = cluster.queue_jobs(3);
    wait_jobs_running(&cluster, 3, Duration::from_secs(90)).await?;
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.kill().await?;
    for name in cluster.containers().await? {
        remove_out_of_band(&cluster, &name).await?;
    }
    let node = cluster.nodes.get_mut("node-1").context("node")?;
    node.restart().await?;
    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    // Slots freed without waiting for GitHub, which still has the three
    // jobs on their dead runners, and well inside the stray grace a
    // never-seen instance would get.
    let ended = wait_all_terminal(&cluster, Duration::from_secs(30)).await?;
    assert_eq!(ended.len(), 3, "{ended:?}");
    for lease in &ended {
        assert_eq!(lease.phase, Phase::Failed, "{lease:?}");
    }
    cluster.wait_clean(Duration::from_secs(5)).await?;
    assert_eq!(cluster.emulator.state().runners.len(), 3);
    // Refused as busy (GitHub still has the jobs), the removals wait on
    // their backoff; once GitHub lets the jobs go, they succeed.
    github_gives_up_on(&cluster, &jobs);
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A launch whose image does not exist on the node is refused before
/// anything is registered: typed `IMAGE_UNAVAILABLE` naming the image, no
/// JIT config minted at GitHub, no container, and no lease left bound or
/// charged (the image is checked beside the bind, and the node releases
/// the lease it bound `failed`); the job stays covered and waits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_whose_image_does_not_exist_mints_nothing_and_is_refused_image_unavailable()
-> Result<()> {
    use scaleset::testing::Endpoint;

    let image = format!(
        "billet-no-such-image-{}:dev",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    );
    let cluster = Cluster::start(ClusterOptions {
        tier_image: image.clone(),
        ..options(1500)
    })
    .await?;
    let mut events = cluster.plane.subscribe();
    let jobs = cluster.queue_jobs(1);
    let mut refusals = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while refusals.len() < 2 {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .context("two refused launches")??;
        if let PlaneEvent::LaunchFailed {
            reason,
            custody,
            code,
            ..
        } = event
        {
            assert_eq!(
                code,
                Some(pb::ErrorCode::ImageUnavailable),
                "a launch failed otherwise: {reason}"
            );
            assert!(!custody, "the node holds a refused launch: {reason}");
            assert!(
                reason.contains(&image),
                "the refusal does not name the image: {reason}"
            );
            refusals.push(reason);
        }
    }
    assert_eq!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len(),
        0,
        "a JIT config was minted for a launch whose image is missing"
    );
    assert!(cluster.emulator.state().runners.is_empty());
    for lease in leases(&cluster).await? {
        assert!(
            lease.runner_id.is_none(),
            "a refused launch was registered: {lease:?}"
        );
        assert!(
            lease.node.is_none() || lease.phase == Phase::Failed,
            "a refused launch left its lease bound: {lease:?}"
        );
    }
    cluster.wait_clean(Duration::from_secs(10)).await?;
    assert!(
        !cluster.plane.uncovered_jobs().is_empty(),
        "the plane stopped covering the job"
    );
    // The job is cancelled: coverage ends, and nothing is left.
    github_gives_up_on(&cluster, &jobs);
    let ended = wait_all_terminal(&cluster, Duration::from_secs(30)).await?;
    // Each refused lease ended `failed` saying why: its image.
    for lease in ended.iter().filter(|l| l.node.is_some()) {
        assert_eq!(lease.phase, Phase::Failed, "{lease:?}");
        assert!(
            lease
                .failure_reason
                .as_deref()
                .is_some_and(|r| r.contains("image_unavailable") && r.contains(&image)),
            "a refused lease ended without its reason: {lease:?}"
        );
    }
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// With `--mint-before-dispatch`: once a node has run the tier's image,
/// the plane mints each launch's registration before dispatching it (the
/// node then creates beside its bind and asks no `MintJit`); the first
/// launch on a node is checked before anything is minted. When the image
/// is removed from the node afterwards, the next launch, minted ahead, is
/// refused `IMAGE_UNAVAILABLE` with nothing started and the plane removes
/// the registration it minted; the launch after that is checked before any
/// mint again. Every job that could run ran once, and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plane_mints_ahead_for_a_node_that_ran_the_image_and_removes_what_it_minted_when_the_image_is_gone()
-> Result<()> {
    let docker = billet_tests::image::connect_docker().await?;
    let standin = billet_tests::cluster::standin_image(&docker).await?;
    let tag = format!("ahead-{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let image = format!("billet-standin-runner:{tag}");
    docker
        .tag_image(
            &standin,
            Some(
                bollard::query_parameters::TagImageOptionsBuilder::default()
                    .repo("billet-standin-runner")
                    .tag(&tag)
                    .build(),
            ),
        )
        .await
        .with_context(|| format!("tag {standin} as {image}"))?;
    let cluster = Cluster::start(ClusterOptions {
        tier_image: image.clone(),
        mint_before_dispatch: true,
        // The registration pass, the backstop for a registration nothing
        // else removed, waits longer than this test.
        registration_grace: Duration::from_secs(300),
        ..options(300)
    })
    .await?;
    let mut events = cluster.plane.subscribe();
    let mut launched = Vec::new();
    for _ in 0..3 {
        let jobs = cluster.queue_jobs(1);
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            match tokio::time::timeout_at(deadline, events.recv())
                .await
                .context("a launch")??
            {
                PlaneEvent::Launched { minted_ahead, .. } => {
                    launched.push(minted_ahead);
                    break;
                }
                PlaneEvent::LaunchFailed { reason, .. } => bail!("a launch failed: {reason}"),
                _ => {}
            }
        }
        cluster
            .wait_jobs_completed(&jobs, Duration::from_secs(60))
            .await?;
    }
    assert_eq!(
        launched,
        [false, true, true],
        "the first launch is checked before its mint, the next ones are minted ahead"
    );
    let mints_before = cluster
        .emulator
        .requests_to(Endpoint::GenerateJitConfig)
        .len();
    assert_eq!(mints_before, 3, "one registration per launch");
    // No container refers to the tag any more, so removing it only untags.
    cluster.wait_clean(Duration::from_secs(30)).await?;
    docker
        .remove_image(
            &image,
            None::<bollard::query_parameters::RemoveImageOptions>,
            None,
        )
        .await
        .with_context(|| format!("remove {image}"))?;
    let jobs = cluster.queue_jobs(1);
    let mut refusals = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while refusals.len() < 2 {
        let event = tokio::time::timeout_at(deadline, events.recv())
            .await
            .context("two refused launches")??;
        match event {
            PlaneEvent::LaunchFailed {
                reason,
                custody,
                code,
                ..
            } => {
                assert_eq!(
                    code,
                    Some(pb::ErrorCode::ImageUnavailable),
                    "a launch failed otherwise: {reason}"
                );
                assert!(!custody, "the node holds a refused launch: {reason}");
                refusals.push(reason);
            }
            PlaneEvent::Launched { lease, .. } => bail!("lease {lease} launched without its image"),
            _ => {}
        }
    }
    assert_eq!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len(),
        mints_before + 1,
        "only the refused launch minted ahead registered a runner; the next was checked first"
    );
    wait_until(
        Duration::from_secs(5),
        "the plane to remove the registration it minted",
        || cluster.emulator.state().runners.is_empty(),
    )
    .await
    .with_context(|| format!("registrations: {:?}", cluster.emulator.state().runners))?;
    ends_clean(&cluster).await?;
    github_gives_up_on(&cluster, &jobs);
    wait_all_terminal(&cluster, Duration::from_secs(30)).await?;
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A runner whose container starts but which never connects to GitHub is
/// freed after the start deadline (5 s here): its registration removed,
/// its container destroyed, its lease released `failed` with reason
/// `start_deadline`; the plane keeps the job covered meanwhile, and once
/// the job is cancelled nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_never_connects_is_freed_after_the_start_deadline() -> Result<()> {
    const DEADLINE: Duration = Duration::from_secs(5);
    let mut opts = options(1500);
    opts.tier_env = vec!["BILLET_STANDIN_MODE=never-connect".into()];
    opts.node_env.push((
        "BILLET_START_DEADLINE_SECS".into(),
        DEADLINE.as_secs().to_string(),
    ));
    let cluster = Cluster::start(opts).await?;
    let jobs = cluster.queue_jobs(1);
    wait_until(
        Duration::from_secs(60),
        "a never-connecting runner's container",
        || !cluster.emulator.state().runners.is_empty(),
    )
    .await?;
    let first = wait_until_some(&cluster).await?;
    let container = format!("billet-{}", first.id);
    freed_by_the_start_deadline(
        &cluster,
        &first.id,
        DEADLINE + ONE_TEND + Duration::from_secs(10),
    )
    .await?;
    let registered = cluster
        .emulator
        .state()
        .runners
        .iter()
        .any(|r| r.name == container);
    assert!(!registered, "its registration outlived the lease");
    // The job is cancelled; the replacement runner (never connecting
    // either) goes by the same deadline, and nothing is left.
    github_gives_up_on(&cluster, &jobs);
    wait_all_terminal(&cluster, DEADLINE + ONE_TEND * 2).await?;
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// Waits until the emulator reports every one of `jobs` completed, and
/// returns when that was seen.
async fn wait_jobs_completed(
    cluster: &Cluster,
    jobs: &[JobRequestId],
    timeout: Duration,
) -> Result<tokio::time::Instant> {
    wait_until(timeout, "the jobs to complete at GitHub", || {
        let state = cluster.emulator.state();
        jobs.iter().all(|id| {
            state
                .jobs
                .iter()
                .any(|j| j.id == *id && j.state == JobState::Completed)
        })
    })
    .await?;
    Ok(tokio::time::Instant::now())
}

/// Whether the container is there and its process runs.
async fn runs(cluster: &Cluster, name: &str) -> Result<bool> {
    match cluster.docker.inspect_container(name, None).await {
        Ok(c) => Ok(c.state.and_then(|s| s.running).unwrap_or(false)),
        Err(bollard::errors::Error::DockerResponseServerError {
            status_code: 404, ..
        }) => Ok(false),
        Err(e) => Err(e.into()),
    }
}

/// Waits until the container no longer runs (exited or removed), for at
/// most `timeout`, and returns when that was seen.
async fn wait_stopped(
    cluster: &Cluster,
    name: &str,
    timeout: Duration,
) -> Result<tokio::time::Instant> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if !runs(cluster, name).await? {
            return Ok(tokio::time::Instant::now());
        }
        if tokio::time::Instant::now() > deadline {
            bail!("{name} still runs after {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// The job's result at GitHub.
fn result_of(cluster: &Cluster, job: JobRequestId) -> Option<String> {
    cluster
        .emulator
        .state()
        .jobs
        .iter()
        .find(|j| j.id == job)
        .and_then(|j| j.result.clone())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_while_the_runner_holds_a_job_is_answered_busy_and_the_job_completes()
-> Result<()> {
    scale_down_of_a_working_runner(15_000, false).await
}

/// GitHub's busy flag lags behind the job it assigns, so the registration
/// removal a scale-down starts with can be accepted (204) while the runner
/// works. The node does not take that as proof the runner is idle: the
/// runner's job process runs in its container, so the Destroy is answered
/// `BUSY`, nothing is destroyed, and the job runs to its end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_github_accepts_while_the_runner_works_is_answered_busy_and_the_job_completes()
-> Result<()> {
    scale_down_of_a_working_runner(20_000, true).await
}

/// The plane scales a runner down as if its listing showed it idle, while
/// the runner works `work_ms` on its job (with `github_accepts`, every
/// runner removal is accepted meanwhile). The Destroy is answered `BUSY`
/// at least once and nothing is killed: the job ends `succeeded` at GitHub
/// and its lease `done` with no failure reason, and nothing is left.
async fn scale_down_of_a_working_runner(work_ms: u64, github_accepts: bool) -> Result<()> {
    let cluster = Cluster::start(options(work_ms)).await?;
    let mut events = cluster.plane.subscribe();
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    if github_accepts {
        cluster
            .emulator
            .inject(Fault::status(Endpoint::Runners, 204));
    }
    let shutdown = tokio_util::sync::CancellationToken::new();
    let scaled = tokio::time::timeout(
        Duration::from_secs(90),
        cluster.plane.scale_down(&lease.id, &shutdown),
    )
    .await
    .context("the scale-down never ended")??;
    cluster.emulator.clear_faults();
    // Dropped when the completion arrived, or, when the runner had exited
    // before the plane heard of the completion, the exited runner's
    // container destroyed: never the job.
    assert!(
        matches!(scaled, ScaleDown::Completed | ScaleDown::Destroyed),
        "the scale-down ended {scaled:?}; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    let mut busy = 0;
    while let Ok(event) = events.try_recv() {
        if event
            == (PlaneEvent::ScaleDownBusy {
                lease: lease.id.clone(),
            })
        {
            busy += 1;
        }
    }
    assert!(
        busy >= 1,
        "the Destroy was never answered BUSY; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    wait_jobs_completed(&cluster, &jobs, Duration::from_secs(60)).await?;
    assert_eq!(result_of(&cluster, jobs[0]).as_deref(), Some("succeeded"));
    let ended = wait_all_terminal(&cluster, Duration::from_secs(30)).await?;
    assert_eq!(ended[0].phase, Phase::Done, "{ended:?}");
    assert_eq!(ended[0].failure_reason, None, "{ended:?}");
    assert!(!runs(&cluster, &name).await?);
    ends_clean(&cluster).await?;
    eprintln!("the scale-down was answered BUSY {busy} times");
    cluster.shutdown().await
}

/// While the job runs, the plane dispatches `Launch` for its lease at the
/// lease's epoch + 1. The node holds that lease's runner at the lease's
/// epoch, so the launch is not what it holds: it answers `BUSY` with the
/// typed code, names both epochs, logs them at warn, and starts nothing;
/// the job runs to its end and the lease ends `done`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_at_a_higher_epoch_for_a_working_runner_is_answered_busy_naming_both_epochs()
-> Result<()> {
    let cluster = Cluster::start(options(10_000)).await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let mut wire = billet_controlplane_stub::calls::lease_to_wire(&lease);
    wire.epoch = lease.epoch + 1;
    let node = cluster.plane.node("node-1").context("node-1")?;
    let outcome = node
        .dispatch(
            pb::command::Kind::Launch(pb::Launch {
                lease: Some(wire),
                tier: Some(pb::TierSpec {
                    label: billet_tests::cluster::TIER.into(),
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
                registration: None,
                warm_instance: String::new(),
            }),
            Duration::from_secs(30),
        )
        .await;
    let billet_controlplane_stub::node_link::CommandOutcome::Answered(result) = &outcome else {
        bail!("the launch was not answered: {}", outcome.describe());
    };
    assert_eq!(result.outcome, pb::Outcome::Busy as i32, "{result:?}");
    assert!(!result.custody, "{result:?}");
    let error = result.error.as_ref().context("an error")?;
    assert_eq!(error.code, pb::ErrorCode::Busy as i32, "{result:?}");
    let (held, sent) = (lease.epoch, lease.epoch + 1);
    assert!(
        error.message.contains(&format!("epoch {held}"))
            && error.message.contains(&format!("epoch {sent}")),
        "{result:?}"
    );
    let log = cluster.nodes["node-1"].log_text();
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains(&format!("held_epoch={held}"))
            && l.contains(&format!("launch_epoch={sent}"))),
        "no warning naming both epochs:\n{log}"
    );
    // Nothing else started; the job runs to its end.
    assert_eq!(cluster.containers().await?.len(), 1);
    wait_jobs_completed(&cluster, &jobs, Duration::from_secs(60)).await?;
    assert_eq!(result_of(&cluster, jobs[0]).as_deref(), Some("succeeded"));
    let ended = wait_all_terminal(&cluster, Duration::from_secs(30)).await?;
    assert_eq!(ended[0].phase, Phase::Done, "{ended:?}");
    assert_eq!(ended[0].failure_reason, None, "{ended:?}");
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// An operator forces a runner out mid-job (`Destroy { force, reason:
/// "operator_x" }`): the container goes at once, and so does the lease's
/// charge: it is released `failed` with the operator's reason as soon as
/// the compute is proven gone, not held until GitHub lets the job go, and
/// never `done`. GitHub then fails the job, and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forced_destroy_of_a_runner_mid_job_frees_its_capacity_and_ends_it_failed_with_the_reason()
-> Result<()> {
    let cluster = Cluster::start(options(60_000)).await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let node = cluster.plane.node("node-1").context("node-1")?;
    let outcome = node
        .dispatch(
            pb::command::Kind::Destroy(pb::Destroy {
                request_id: lease.request_id,
                job_result: None,
                force: true,
                reason: "operator_x".into(),
            }),
            Duration::from_secs(30),
        )
        .await;
    assert!(
        !matches!(
            outcome,
            billet_controlplane_stub::node_link::CommandOutcome::Lost(_)
        ),
        "{}",
        outcome.describe()
    );
    let ended = tend_until_ended(&cluster, &lease.id).await?;
    assert_eq!(ended.phase, Phase::Failed, "{ended:?}");
    assert_eq!(
        ended.failure_reason.as_deref(),
        Some("operator_x"),
        "{ended:?}"
    );
    let charged = cluster.charged().await?;
    assert_eq!(
        (charged.vcpu, charged.memory_bytes),
        (0, 0),
        "the forced-out lease is still charged: {charged:?}"
    );
    assert!(!runs(&cluster, &format!("billet-{}", lease.id)).await?);
    // GitHub fails the job of the runner that went; nothing is left.
    github_gives_up_on(&cluster, &jobs);
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_while_the_runner_still_works_for_30_s_does_not_kill_it() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        tier_env: vec!["BILLET_STANDIN_POST_JOB_MS=30000".into()],
        ..options(2_000)
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    let completed = wait_jobs_completed(&cluster, &jobs, Duration::from_secs(30)).await?;
    // The plane sends the completion's Destroy at once; the runner works on.
    let stopped = wait_stopped(&cluster, &name, Duration::from_secs(90)).await?;
    let worked = stopped - completed;
    assert!(
        worked >= Duration::from_secs(25),
        "the container stopped {worked:?} after its job's completion; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    let ended = wait_all_terminal(&cluster, ONE_TEND).await?;
    assert_eq!(ended[0].phase, Phase::Done, "{ended:?}");
    assert_eq!(ended[0].failure_reason, None, "{ended:?}");
    ends_clean(&cluster).await?;
    eprintln!("the runner worked {worked:?} after its completion and exited on its own");
    cluster.shutdown().await
}

/// GitHub has recorded the job `succeeded`; the runner, at its post-job
/// work, is then killed (`docker kill`). The job ended before its compute
/// did: the lease ends `done` with no failure reason, not `failed killed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_after_its_job_succeeded_is_released_done() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        tier_env: vec!["BILLET_STANDIN_POST_JOB_MS=60000".into()],
        ..options(2_000)
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    wait_jobs_completed(&cluster, &jobs, Duration::from_secs(30)).await?;
    assert_eq!(result_of(&cluster, jobs[0]).as_deref(), Some("succeeded"));
    // The completion reaches the node, which leaves the runner its post-job
    // grace; then the runner is killed behind its back.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        runs(&cluster, &name).await?,
        "the runner stopped on its own"
    );
    cluster.docker.kill_container(&name, None).await?;
    let ended = wait_all_terminal(&cluster, Duration::from_secs(30)).await?;
    assert_eq!(ended[0].phase, Phase::Done, "{ended:?}");
    assert_eq!(ended[0].failure_reason, None, "{ended:?}");
    assert!(!runs(&cluster, &name).await?);
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_ignoring_sigterm_past_the_post_job_grace_is_killed_and_released_failed_post_job_timeout()
-> Result<()> {
    let mut options = options(2_000);
    options
        .node_env
        .push(("BILLET_POST_JOB_GRACE_SECS".into(), "5".into()));
    let cluster = Cluster::start(ClusterOptions {
        tier_env: vec![
            "BILLET_STANDIN_MODE=ignore-sigterm".into(),
            "BILLET_STANDIN_POST_JOB_MS=600000".into(),
        ],
        ..options
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    let completed = wait_jobs_completed(&cluster, &jobs, Duration::from_secs(30)).await?;
    // The grace (5 s), then SIGTERM, ignored, then SIGKILL 10 s later.
    let stopped = wait_stopped(&cluster, &name, Duration::from_secs(60)).await?;
    let lived = stopped - completed;
    assert!(
        lived >= Duration::from_secs(14),
        "killed {lived:?} after its completion: before the grace and the stop timeout; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    let ended = wait_all_terminal(&cluster, ONE_TEND).await?;
    assert_eq!(ended[0].phase, Phase::Failed, "{ended:?}");
    assert_eq!(
        ended[0].failure_reason.as_deref(),
        Some("post_job_timeout"),
        "{ended:?}"
    );
    // The override was logged with both signals.
    let log = cluster.nodes["node-1"].log_text();
    let line = log
        .lines()
        .find(|l| l.contains("past the post-job grace"))
        .with_context(|| format!("no override line in the node log:\n{log}"))?;
    assert!(
        line.contains("github") && line.contains("provider"),
        "{line}"
    );
    ends_clean(&cluster).await?;
    eprintln!("killed {lived:?} after its completion");
    cluster.shutdown().await
}

/// Sends the plane's Tend to node-1 until `done` holds, for at most
/// `timeout`: for tests whose plane does not tend on its own, so that a
/// scale-down reaches the node before any tend has seen what happened.
async fn tend_until(
    cluster: &Cluster,
    timeout: Duration,
    what: &str,
    mut done: impl AsyncFnMut() -> Result<bool>,
) -> Result<()> {
    let node = cluster.plane.node("node-1").context("node-1")?;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        if done().await? {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "{what}: not within {timeout:?}; leases {:?}\nnode log:\n{}",
                leases(cluster).await?,
                cluster.nodes["node-1"].log_text()
            );
        }
        node.dispatch(
            pb::command::Kind::Tend(pb::Tend {}),
            Duration::from_secs(10),
        )
        .await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

/// Sends Tend until `lease` ends, for at most 30 s, and returns it ended.
async fn tend_until_ended(cluster: &Cluster, lease: &str) -> Result<Lease> {
    tend_until(
        cluster,
        Duration::from_secs(30),
        "the lease to end",
        async || {
            Ok(cluster
                .plane
                .ledger()
                .get(lease)
                .await?
                .is_some_and(|l| l.phase.is_terminal()))
        },
    )
    .await?;
    cluster
        .plane
        .ledger()
        .get(lease)
        .await?
        .context("the lease")
}

/// The scale-down of a runner killed mid-job, reaching the node before any
/// tend saw the kill. The runner's compute ended before its job did, so
/// the lease ends `failed` with reason `killed`, not `done`, as a tend
/// would have released it, and nothing is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_of_a_runner_killed_mid_job_releases_its_lease_failed_killed_not_done()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        // No tend of the plane's own: the scale-down is what finds the kill.
        maintenance_interval: Duration::from_secs(3600),
        ..options(120_000)
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    cluster.docker.kill_container(&name, None).await?;
    wait_stopped(&cluster, &name, Duration::from_secs(20)).await?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    let scaled = tokio::time::timeout(
        Duration::from_secs(60),
        cluster.plane.scale_down(&lease.id, &shutdown),
    )
    .await
    .context("the scale-down never ended")??;
    assert_eq!(
        scaled,
        ScaleDown::Ended,
        "the scale-down of a killed runner was not left to the node; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    let ended = tend_until_ended(&cluster, &lease.id).await?;
    assert_eq!(ended.phase, Phase::Failed, "{ended:?}");
    assert_eq!(ended.failure_reason.as_deref(), Some("killed"), "{ended:?}");
    github_gives_up_on(&cluster, &jobs);
    tend_until(
        &cluster,
        Duration::from_secs(60),
        "nothing left",
        async || {
            Ok(cluster.containers().await?.is_empty()
                && cluster.emulator.state().runners.is_empty())
        },
    )
    .await?;
    cluster.wait_clean(Duration::from_secs(10)).await?;
    cluster.shutdown().await
}

/// Kills node-1 with SIGKILL and starts it again with `env` added.
async fn kill_9_and_restart(cluster: &mut Cluster, env: Vec<(String, String)>) -> Result<()> {
    let node = cluster.nodes.get_mut("node-1").context("node-1")?;
    for (k, v) in env {
        node.set_env(&k, &v);
    }
    node.restart().await
}

/// A node killed -9 while its runner works inside the post-job grace,
/// restarted with its wall clock stepped 5 minutes ahead. Counting the step
/// as grace spent would kill the runner at once, released
/// `post_job_timeout`; across a restart the grace counts on the boot clock,
/// which a step does not move: the runner exits on its own and the lease is
/// `done`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ending_runner_survives_a_kill_9_restart_whose_wall_clock_jumped_5_minutes_ahead()
-> Result<()> {
    let skew = wall_clock_off("+300s")?;
    let mut options = options(2_000);
    options
        .node_env
        .push(("BILLET_POST_JOB_GRACE_SECS".into(), "120".into()));
    let mut cluster = Cluster::start(ClusterOptions {
        tier_env: vec!["BILLET_STANDIN_POST_JOB_MS=30000".into()],
        ..options
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    let completed = wait_jobs_completed(&cluster, &jobs, Duration::from_secs(30)).await?;
    wait_until(Duration::from_secs(20), "the runner held as ending", || {
        cluster.nodes["node-1"]
            .log_text()
            .contains("leaving it the post-job grace")
    })
    .await?;
    kill_9_and_restart(&mut cluster, skew).await?;
    let stopped = wait_stopped(&cluster, &name, Duration::from_secs(120)).await?;
    let worked = stopped - completed;
    assert!(
        worked >= Duration::from_secs(25),
        "the container stopped {worked:?} after its job's completion, inside the grace; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    let ended = wait_all_terminal(&cluster, ONE_TEND * 2).await?;
    assert_eq!(ended[0].phase, Phase::Done, "{ended:?}");
    assert_eq!(ended[0].failure_reason, None, "{ended:?}");
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A runner that never connects, its node killed -9 before the start
/// deadline and restarted, is not exempt from the deadline (held for
/// ever while its job waits). Adopted compute not known online is bound
/// by the deadline from its adoption: its registration removed, it is
/// torn down and its lease released `failed` with reason
/// `start_deadline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_never_connecting_runner_adopted_after_a_kill_9_is_still_freed_by_the_start_deadline()
-> Result<()> {
    const DEADLINE: Duration = Duration::from_secs(15);
    let mut opts = options(1500);
    opts.tier_env = vec!["BILLET_STANDIN_MODE=never-connect".into()];
    opts.node_env.push((
        "BILLET_START_DEADLINE_SECS".into(),
        DEADLINE.as_secs().to_string(),
    ));
    let mut cluster = Cluster::start(opts).await?;
    let mut events = cluster.plane.subscribe();
    let jobs = cluster.queue_jobs(1);
    // Killed once the launch is answered (the launch journaled created):
    // earlier, recovery takes the unconfirmed-launch path instead.
    let launched = wait_launched(&mut events).await?;
    kill_9_and_restart(&mut cluster, Vec::new()).await?;
    freed_by_the_start_deadline(
        &cluster,
        &launched,
        DEADLINE + ONE_TEND + Duration::from_secs(20),
    )
    .await?;
    github_gives_up_on(&cluster, &jobs);
    wait_all_terminal(&cluster, DEADLINE + ONE_TEND * 2).await?;
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// Waits up to `within` for `lease` to end, and checks it ended `failed`
/// with reason `start_deadline` and its container went with it.
async fn freed_by_the_start_deadline(
    cluster: &Cluster,
    lease: &str,
    within: Duration,
) -> Result<()> {
    let ended = cluster
        .wait_lease_ended(
            lease,
            within,
            "the runner that never connects still holds its lease",
        )
        .await
        .with_context(|| format!("node log:\n{}", cluster.nodes["node-1"].log_text()))?;
    assert_eq!(ended.phase, Phase::Failed, "{ended:?}");
    assert_eq!(
        ended.failure_reason.as_deref(),
        Some("start_deadline"),
        "{ended:?}"
    );
    assert!(
        !cluster
            .containers()
            .await?
            .contains(&format!("billet-{lease}")),
        "its container outlived the lease"
    );
    Ok(())
}

/// The first lease the plane records, waiting up to 10 s for one.
async fn wait_until_some(cluster: &Cluster) -> Result<Lease> {
    let started = tokio::time::Instant::now();
    loop {
        if let Some(l) = leases(cluster).await?.into_iter().next() {
            return Ok(l);
        }
        if started.elapsed() > Duration::from_secs(10) {
            bail!("no lease");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The lease of the plane's next `Launched` event (the launch answered,
/// so journaled created), waiting up to a minute.
async fn wait_launched(
    events: &mut tokio::sync::broadcast::Receiver<PlaneEvent>,
) -> Result<String> {
    tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match events.recv().await {
                Ok(PlaneEvent::Launched { lease, .. }) => return Ok(lease),
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => return Err(anyhow::anyhow!("plane events: {e}")),
            }
        }
    })
    .await
    .context("no launch")?
}

/// Removes a container behind the node's back, as `docker rm -f` does.
async fn remove_out_of_band(cluster: &Cluster, name: &str) -> Result<()> {
    cluster
        .docker
        .remove_container(
            name,
            Some(bollard::query_parameters::RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await?;
    Ok(())
}

/// Kills node-1 with SIGKILL, restarts it, and waits
/// until the restarted node has adopted what it finds.
async fn adopted_after_a_kill_9(cluster: &mut Cluster) -> Result<()> {
    kill_9_and_restart(cluster, Vec::new()).await?;
    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    wait_until(Duration::from_secs(30), "the runner adopted", || {
        cluster.nodes["node-1"]
            .log_text()
            .contains("adopting an instance")
    })
    .await
}

/// A runner adopted after a kill -9 that never took a job, killed by
/// `docker kill`, then scaled down before any tend saw the kill. The held
/// path asks GitHub, which has let the idle registration go, so a teardown
/// as a scale-down would release the lease `done`; ended compute is torn
/// down with its reason: `failed`, `killed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scale_down_of_an_adopted_runner_killed_before_it_releases_its_lease_failed_killed()
-> Result<()> {
    let mut opts = options(1500);
    opts.maintenance_interval = Duration::from_secs(3600);
    opts.tier_env = vec!["BILLET_STANDIN_MODE=never-connect".into()];
    opts.node_env
        .push(("BILLET_START_DEADLINE_SECS".into(), "0".into()));
    let mut cluster = Cluster::start(opts).await?;
    let mut events = cluster.plane.subscribe();
    let jobs = cluster.queue_jobs(1);
    let lease = wait_launched(&mut events).await?;
    let name = format!("billet-{lease}");
    adopted_after_a_kill_9(&mut cluster).await?;
    cluster.docker.kill_container(&name, None).await?;
    wait_stopped(&cluster, &name, Duration::from_secs(20)).await?;
    let shutdown = tokio_util::sync::CancellationToken::new();
    tokio::time::timeout(
        Duration::from_secs(60),
        cluster.plane.scale_down(&lease, &shutdown),
    )
    .await
    .context("the scale-down never ended")??;
    let ended = tend_until_ended(&cluster, &lease).await?;
    assert_eq!(
        (ended.phase, ended.failure_reason.as_deref()),
        (Phase::Failed, Some("killed")),
        "{ended:?}\nnode log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    github_gives_up_on(&cluster, &jobs);
    cluster.shutdown().await
}

/// A runner adopted after a kill -9 while its job ran, its container then
/// removed out of band while GitHub still holds the job on the dead
/// runner. As for a runner this process launched, it ends `failed`,
/// `removed`, not `done`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_runner_removed_out_of_band_mid_job_releases_its_lease_failed_removed()
-> Result<()> {
    let mut cluster = Cluster::start(options(120_000)).await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    adopted_after_a_kill_9(&mut cluster).await?;
    remove_out_of_band(&cluster, &name).await?;
    let ended = wait_all_terminal(&cluster, ONE_TEND * 2).await?;
    assert_eq!(
        (ended[0].phase, ended[0].failure_reason.as_deref()),
        (Phase::Failed, Some("removed")),
        "{ended:?}"
    );
    github_gives_up_on(&cluster, &jobs);
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A runner whose short job completed before the start deadline was first
/// judged, still at 40 s of post-job work, its completion reaching the
/// plane late (GitHub's messages delayed 45 s), with and without a kill -9
/// restart mid-job, must not be stopped at the deadline and its lease
/// released `failed` `start_deadline` for a job that succeeded. GitHub has
/// already let its ephemeral registration go, which says it took a job: it
/// is left to exit on its own, and the lease ends `done`.
async fn a_runner_whose_job_completed_before_the_start_deadline(
    restart_mid_job: bool,
) -> Result<()> {
    const DEADLINE: u64 = 12;
    let mut opts = options(if restart_mid_job { 6_000 } else { 2_000 });
    opts.tier_env = vec!["BILLET_STANDIN_POST_JOB_MS=40000".into()];
    opts.node_env
        .push(("BILLET_START_DEADLINE_SECS".into(), DEADLINE.to_string()));
    opts.node_env
        .push(("BILLET_POST_JOB_GRACE_SECS".into(), "120".into()));
    let mut cluster = Cluster::start(opts).await?;
    let jobs = cluster.queue_jobs(1);
    wait_jobs_running(&cluster, 1, Duration::from_secs(60)).await?;
    let lease = only_lease(&cluster).await?;
    let name = format!("billet-{}", lease.id);
    if restart_mid_job {
        kill_9_and_restart(&mut cluster, Vec::new()).await?;
    }
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::GetMessage, Duration::from_secs(45)));
    let completed = wait_jobs_completed(&cluster, &jobs, Duration::from_secs(30)).await?;
    let stopped = wait_stopped(&cluster, &name, Duration::from_secs(90)).await?;
    let worked = stopped - completed;
    cluster.emulator.clear_faults();
    assert_eq!(result_of(&cluster, jobs[0]).as_deref(), Some("succeeded"));
    assert!(
        worked >= Duration::from_secs(35),
        "the runner was stopped {worked:?} after its job completed, inside its post-job work; node log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    let ended = wait_all_terminal(&cluster, Duration::from_secs(60)).await?;
    assert_eq!(
        (ended[0].phase, ended[0].failure_reason.as_deref()),
        (Phase::Done, None),
        "{ended:?}"
    );
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_at_its_post_job_work_when_the_start_deadline_passes_is_not_killed() -> Result<()>
{
    a_runner_whose_job_completed_before_the_start_deadline(false).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_runner_at_its_post_job_work_when_the_start_deadline_passes_is_not_killed()
-> Result<()> {
    a_runner_whose_job_completed_before_the_start_deadline(true).await
}

/// A never-connecting runner adopted after a kill -9, its registration
/// removed out of band before the start deadline, the plane's own
/// registration check held off, must not be held for ever, its job waiting,
/// as though a registration already gone meant "took a job". It can take no
/// job: it gets the post-job grace to exit, then is stopped and its lease
/// released `failed` `start_deadline`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_adopted_never_connecting_runner_whose_registration_vanished_is_still_freed()
-> Result<()> {
    const DEADLINE: Duration = Duration::from_secs(10);
    const GRACE: Duration = Duration::from_secs(5);
    let mut opts = options(1500);
    opts.tier_env = vec!["BILLET_STANDIN_MODE=never-connect".into()];
    opts.registration_grace = Duration::from_secs(600);
    opts.node_env.extend([
        (
            "BILLET_START_DEADLINE_SECS".into(),
            DEADLINE.as_secs().to_string(),
        ),
        (
            "BILLET_POST_JOB_GRACE_SECS".into(),
            GRACE.as_secs().to_string(),
        ),
    ]);
    let mut cluster = Cluster::start(opts).await?;
    let mut events = cluster.plane.subscribe();
    let jobs = cluster.queue_jobs(1);
    let lease = wait_launched(&mut events).await?;
    adopted_after_a_kill_9(&mut cluster).await?;
    let runner = cluster
        .plane
        .ledger()
        .get(&lease)
        .await?
        .and_then(|l| l.runner_id)
        .context("no registration minted")?;
    cluster
        .emulator
        .client()
        .remove_runner(scaleset::RunnerId(runner))
        .await?;
    freed_by_the_start_deadline(
        &cluster,
        &lease,
        DEADLINE + GRACE + Duration::from_secs(10) + ONE_TEND * 2,
    )
    .await?;
    github_gives_up_on(&cluster, &jobs);
    cluster.shutdown().await
}

/// A runner that takes its job and exits 0 without completing it (a crash
/// whose exit code says nothing), while GitHub still runs the job on it
/// and refuses the registration's removal as busy (JobStillRunning): a job
/// whose runner died is never recorded `done`. Its lease is released
/// `failed`, `exit 0`, and nothing leaks once GitHub gives up.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_exiting_0_mid_job_is_released_failed_exit_0_not_done() -> Result<()> {
    let mut opts = options(1500);
    opts.tier_env = vec![
        "BILLET_STANDIN_MODE=exit".into(),
        "BILLET_STANDIN_EXIT_CODE=0".into(),
    ];
    let cluster = Cluster::start(opts).await?;
    let jobs = cluster.queue_jobs(1);
    let ended = wait_all_terminal(&cluster, Duration::from_secs(60)).await?;
    let job = cluster
        .emulator
        .state()
        .jobs
        .into_iter()
        .find(|j| j.id == jobs[0])
        .context("the job")?;
    assert_eq!(
        job.state,
        JobState::Running,
        "GitHub still holds the job on the runner that exited"
    );
    assert_eq!(
        (ended[0].phase, ended[0].failure_reason.as_deref()),
        (Phase::Failed, Some("exit 0")),
        "a runner that exited 0 while GitHub ran its job did not finish it: {ended:?}\nnode log:\n{}",
        cluster.nodes["node-1"].log_text()
    );
    github_gives_up_on(&cluster, &jobs);
    ends_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A runner that ends at start without taking a job (an image or
/// configuration the operator got wrong; here the stand-in exits 2 on an
/// unknown mode) must not be replaced about every 2 s for as long as its
/// job waits, each replacement minting a JIT config and registering a
/// runner, as it would be were the backoff reset whenever a launch is
/// answered. A launch that does not end with a runner serving a job is
/// replaced after exponential backoff (500 ms doubling to 15 s,
/// ARCHITECTURE "The plane's obligations"): about 7 launches in 30 s,
/// not 15.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_that_ends_at_start_is_replaced_with_backoff_not_every_2_s() -> Result<()> {
    let mut opts = options(1500);
    opts.tier_env = vec!["BILLET_STANDIN_MODE=bogus".into()];
    let cluster = Cluster::start(opts).await?;
    let jobs = cluster.queue_jobs(1);
    let window = Duration::from_secs(30);
    tokio::time::sleep(window).await;
    let all = leases(&cluster).await?;
    let mints = cluster
        .emulator
        .requests_to(Endpoint::GenerateJitConfig)
        .len();
    cluster.emulator.complete_job(jobs[0], Some("cancelled"));
    assert!(
        all.len() <= 10,
        "a runner ending at start was replaced {} times in {window:?} ({mints} JIT configs minted): expected exponential backoff from 500 ms to 15 s, about 7 at most; leases {all:?}",
        all.len()
    );
    assert!(
        all.len() >= 3,
        "it is still replaced while its job waits: {all:?}"
    );
    cluster.shutdown().await
}
