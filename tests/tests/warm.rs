//! The warm pool end to end, with real Docker, the real `billet node`, the
//! stub plane and the scale-set emulator: runners started ahead of their
//! jobs hold no registration and no credential, a job's launch is handed
//! to one, the pool refills, follows the wanted count to zero, rotates
//! when the tier's image changes, and a node killed with warm runners and
//! running jobs leaks nothing and runs no job twice.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::plane::WarmConfig;
use billet_tests::cluster::{Cluster, ClusterOptions, Starts, wait_until};
use scaleset::testing::{Endpoint, JobState};

/// The label a warm runner carries (its tier).
const WARM_LABEL: &str = "sh.billet.warm";

/// How long a pool takes to fill a few runners, with room to spare on a
/// loaded 2-core machine.
const FILL: Duration = Duration::from_secs(60);

fn options(count: u32, work_ms: u64) -> ClusterOptions {
    ClusterOptions {
        work_ms,
        warm: WarmConfig {
            count,
            idle_retire: None,
            max_age: None,
        },
        node_env: vec![
            ("BILLET_ACK_TIMEOUT_SECS".into(), "2".into()),
            ("BILLET_STRAY_GRACE_SECS".into(), "2".into()),
        ],
        ..ClusterOptions::default()
    }
}

/// The names of the cluster's warm runners that are running.
async fn warm_running(cluster: &Cluster) -> Result<Vec<String>> {
    let mut running = Vec::new();
    for name in cluster
        .containers_labelled(vec![WARM_LABEL.to_owned()])
        .await?
    {
        // The pool retires runners while this looks: one listed a moment
        // ago may be gone by its inspect, and is then not running.
        let inspected = match cluster.docker.inspect_container(&name, None).await {
            Ok(inspected) => inspected,
            Err(bollard::errors::Error::DockerResponseServerError {
                status_code: 404, ..
            }) => continue,
            Err(e) => return Err(e.into()),
        };
        let up = inspected.state.and_then(|s| s.running).unwrap_or(false);
        if up && name.starts_with("billet_warm-") {
            running.push(name);
        }
    }
    running.sort();
    Ok(running)
}

/// Waits until exactly `n` warm runners run and the ledger charges the
/// room of exactly `n`.
async fn wait_warm(cluster: &Cluster, n: usize, timeout: Duration) -> Result<Vec<String>> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let running = warm_running(cluster).await?;
        let rooms = cluster.plane.ledger().warm_rooms().await?;
        if running.len() == n && rooms.len() == n {
            return Ok(running);
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "wanted {n} warm runners after {timeout:?}: running {running:?}, rooms charged {rooms:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Everything `docker inspect` records of a container that could carry a
/// credential: its environment, labels, entrypoint and command.
async fn recorded(cluster: &Cluster, name: &str) -> Result<String> {
    let inspected = cluster.docker.inspect_container(name, None).await?;
    let config = inspected.config.context("no config")?;
    Ok(format!(
        "{:?} {:?} {:?} {:?} {:?} {:?}",
        config.env, config.labels, config.entrypoint, config.cmd, inspected.args, inspected.path
    ))
}

/// Scales the pool to zero and waits until no warm runner or charged room
/// is left, then until nothing at all is.
async fn scale_to_zero_and_clean(cluster: &Cluster) -> Result<()> {
    cluster
        .plane
        .ledger()
        .set_warm_wanted(
            billet_tests::cluster::TIER,
            0,
            billet_controlplane_stub::now_ms(),
        )
        .await?;
    wait_warm(cluster, 0, FILL).await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    assert!(
        cluster.emulator.state().runners.is_empty(),
        "registrations left: {:?}",
        cluster.emulator.state().runners
    );
    Ok(())
}

/// A warm runner holds no registration and no credential; a job's launch
/// is handed to one (nothing created on its path), its runner runs the job
/// once, neither the warm nor the launched container records the JIT
/// config, the handoff is gone once read, and scaling to zero retires
/// every warm runner and hands its room back.
#[tokio::test]
async fn a_warm_launch_runs_its_job_once_and_nothing_is_registered_or_recorded_before_or_after()
-> Result<()> {
    let cluster = Cluster::start(options(2, 4000)).await?;
    let starts = Starts::watch(&cluster);
    let warm = wait_warm(&cluster, 2, FILL).await?;
    assert!(
        cluster.emulator.state().runners.is_empty(),
        "a warm runner is registered: {:?}",
        cluster.emulator.state().runners
    );
    assert!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .is_empty(),
        "a JIT config was minted for a warm runner"
    );
    for name in &warm {
        let seen = recorded(&cluster, name).await?;
        assert!(
            !seen.contains("JITCONFIG") && !seen.contains("jitconfig"),
            "{name}: {seen}"
        );
    }
    let jobs = cluster.queue_jobs(1);
    let launched = wait_until(Duration::from_secs(30), "the job to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .any(|j| j.id == jobs[0] && j.state == JobState::Running)
    })
    .await;
    launched?;
    let lease = cluster
        .plane
        .ledger()
        .leases()
        .await?
        .into_iter()
        .next()
        .context("a lease")?;
    let runner = format!("billet-{}", lease.id);
    let seen = recorded(&cluster, &runner).await?;
    assert!(!seen.contains("JITCONFIG"), "{runner}: {seen}");
    let inspected = cluster.docker.inspect_container(&runner, None).await?;
    let labels = inspected.config.and_then(|c| c.labels).unwrap_or_default();
    assert!(
        labels.contains_key(WARM_LABEL),
        "the job's runner was created on its path, not handed a warm runner: {labels:?}"
    );
    assert!(
        cluster.nodes["node-1"]
            .log_text()
            .contains("launching onto a warm runner"),
        "the node did not launch onto a warm runner"
    );
    // The handoff directory went with the read: a second read finds nothing.
    let handoff = cluster
        .dir
        .join("state-node-1")
        .join("handoff")
        .join(&runner);
    assert!(!handoff.exists(), "{} is still there", handoff.display());
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(60))
        .await?;
    starts.assert_each_succeeded_once(&cluster, &jobs)?;
    // The pool refills behind the launch.
    wait_warm(&cluster, 2, FILL).await?;
    scale_to_zero_and_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A burst of jobs takes the warm runners; every job runs once, and the
/// pool refills to its count behind them.
#[tokio::test]
async fn the_pool_refills_after_a_burst_takes_its_runners() -> Result<()> {
    let cluster = Cluster::start(options(3, 1000)).await?;
    let starts = Starts::watch(&cluster);
    let before = wait_warm(&cluster, 3, FILL).await?;
    let jobs = cluster.queue_jobs(3);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    starts.assert_each_succeeded_once(&cluster, &jobs)?;
    let after = wait_warm(&cluster, 3, FILL).await?;
    assert!(
        after.iter().all(|w| !before.contains(w)),
        "the burst took no warm runner: before {before:?}, after {after:?}"
    );
    scale_to_zero_and_clean(&cluster).await?;
    cluster.shutdown().await
}

/// A tier's image rebuilt under the same name (another image id) while its
/// warm runners wait: each is retired and replaced by one of the new image.
#[tokio::test]
async fn warm_runners_of_an_image_changed_under_them_are_rotated() -> Result<()> {
    let docker = billet_tests::image::connect_docker().await?;
    let standin = billet_tests::cluster::standin_image(&docker).await?;
    let image = format!("billet-warm-rotate:{}", std::process::id());
    billet_tests::image::derive_image(&docker, &standin, &image, &[("build", "1")]).await?;
    let cluster = Cluster::start(ClusterOptions {
        tier_image: image.clone(),
        ..options(2, 1000)
    })
    .await?;
    let before = wait_warm(&cluster, 2, FILL).await?;
    let first_id = cluster.docker.inspect_image(&image).await?.id;
    billet_tests::image::derive_image(&docker, &standin, &image, &[("build", "2")]).await?;
    let second_id = cluster.docker.inspect_image(&image).await?.id;
    assert_ne!(first_id, second_id, "the rebuild is the same image");
    let deadline = tokio::time::Instant::now() + FILL;
    loop {
        let names = warm_running(&cluster).await?;
        let mut fresh = names.len() == 2;
        for name in &names {
            let image = match cluster.docker.inspect_container(name, None).await {
                Ok(c) => c.image,
                Err(_) => None,
            };
            fresh &= !before.contains(name) && image == second_id;
        }
        if fresh {
            break;
        }
        if tokio::time::Instant::now() > deadline {
            bail!(
                "the warm runners were not rotated after {FILL:?}: before {before:?}, now {names:?}"
            );
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    scale_to_zero_and_clean(&cluster).await?;
    cluster.shutdown().await?;
    let _ = docker
        .remove_image(
            &image,
            None::<bollard::query_parameters::RemoveImageOptions>,
            None,
        )
        .await;
    Ok(())
}

/// A node SIGKILLed while it holds warm runners and a running job: the new
/// process retires the warm runners it did not start (nothing can hand
/// them a config), their room is handed back, the running job completes
/// once, and once the pool is scaled to zero nothing is left.
#[tokio::test]
async fn a_node_killed_with_warm_runners_and_a_running_job_leaks_nothing_and_runs_no_job_twice()
-> Result<()> {
    let mut cluster = Cluster::start(options(2, 6000)).await?;
    let starts = Starts::watch(&cluster);
    wait_warm(&cluster, 2, FILL).await?;
    let jobs = cluster.queue_jobs(1);
    wait_until(Duration::from_secs(30), "the job to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .any(|j| j.id == jobs[0] && j.state == JobState::Running)
    })
    .await?;
    let before = wait_warm(&cluster, 2, FILL).await?;
    let node = cluster.nodes.get_mut("node-1").context("node-1")?;
    node.restart().await?;
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    let after = wait_warm(&cluster, 2, FILL).await?;
    assert!(
        after.iter().all(|w| !before.contains(w)),
        "a warm runner of the killed process was kept: before {before:?}, after {after:?}"
    );
    starts.assert_each_succeeded_once(&cluster, &jobs)?;
    scale_to_zero_and_clean(&cluster).await?;
    cluster.shutdown().await
}
