//! Fresh by construction, end to end with real Docker, the real `billet
//! node`, the stub plane and the scale-set emulator: a tier whose runner
//! GitHub refuses for its version is found out once (by its image's label
//! before anything is minted, or by the runner's own exit), typed, shown in
//! `billet node status`, and its job is never relaunched in a loop.

use std::time::Duration;

use anyhow::{Context, Result};
use billet_controlplane_stub::ledger::{Lease, Phase};
use billet_tests::cluster::{Cluster, ClusterOptions};
use scaleset::testing::{Endpoint, JobState};

/// How long a job is watched for relaunches: the window in which, before,
/// 7 JIT configs were minted for one job.
const WATCH: Duration = Duration::from_secs(60);

/// Builds a tier image of the stand-in whose version label says `version`
/// ("" for none), named for this test process.
async fn image_labelled(name: &str, version: &str) -> Result<String> {
    let docker = billet_tests::image::connect_docker().await?;
    let standin = billet_tests::cluster::standin_image(&docker).await?;
    let image = format!("billet-fresh-{name}:{}", std::process::id());
    billet_tests::image::derive_image(
        &docker,
        &standin,
        &image,
        &[("org.opencontainers.image.version", version)],
    )
    .await?;
    Ok(image)
}

async fn remove_image(cluster: &Cluster, image: &str) {
    let _ = cluster
        .docker
        .remove_image(
            image,
            None::<bollard::query_parameters::RemoveImageOptions>,
            None,
        )
        .await;
}

async fn leases(cluster: &Cluster) -> Result<Vec<Lease>> {
    Ok(cluster.plane.ledger().leases().await?)
}

fn job_waits(cluster: &Cluster, job: scaleset::JobRequestId) -> bool {
    cluster
        .emulator
        .state()
        .jobs
        .iter()
        .any(|j| j.id == job && j.state != JobState::Completed)
}

/// The runner prints GitHub's refusal of its version and exits 1 before it
/// polls, from an image with no version label: its lease ends
/// `runner_version_rejected` (not `exit 1`), no further JIT config is
/// minted for the job while it waits, the job is not relaunched in a loop,
/// and the node's status names the image.
#[tokio::test]
async fn a_runner_refused_for_its_version_ends_runner_version_rejected_and_nothing_more_is_minted()
-> Result<()> {
    let image = image_labelled("stale", "").await?;
    let cluster = Cluster::start(ClusterOptions {
        tier_image: image.clone(),
        tier_env: vec![
            "BILLET_STANDIN_MODE=stale".into(),
            "BILLET_STANDIN_RUNNER_VERSION=2.331.0".into(),
        ],
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let first = loop {
        let ended: Vec<Lease> = leases(&cluster)
            .await?
            .into_iter()
            .filter(|l| l.phase.is_terminal())
            .collect();
        if let Some(first) = ended.first() {
            break first.clone();
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no lease ended: {:?}",
            leases(&cluster).await?
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(first.phase, Phase::Failed, "{first:?}");
    assert_eq!(
        first.failure_reason.as_deref(),
        Some("runner_version_rejected"),
        "{first:?}"
    );
    tokio::time::sleep(WATCH).await;
    let minted = cluster.emulator.requests_to(Endpoint::GenerateJitConfig);
    assert_eq!(
        minted.len(),
        1,
        "JIT configs minted for one job whose runner GitHub refuses: {}",
        minted.len()
    );
    let all = leases(&cluster).await?;
    assert!(
        all.len() <= 3,
        "the job was relaunched in a loop: {} leases: {all:?}",
        all.len()
    );
    for later in all.iter().filter(|l| l.id != first.id) {
        assert_eq!(
            later.failure_reason.as_deref(),
            Some("runner_outdated"),
            "a later launch was not refused before its mint: {later:?}"
        );
    }
    assert!(job_waits(&cluster, jobs[0]), "the job ran");
    let status = cluster.status_json("node-1")?;
    let refused = status["outdated_images"]
        .as_array()
        .context("outdated_images")?;
    assert!(
        refused.iter().any(|o| o["image"] == image.as_str()),
        "the node's status does not name the image: {status}"
    );
    cluster.wait_clean(Duration::from_secs(60)).await?;
    remove_image(&cluster, &image).await;
    cluster.shutdown().await
}

/// An image labelled with a runner older than the tier's minimum: every
/// launch is refused `RUNNER_OUTDATED` before anything is minted, the
/// lease ends `runner_outdated`, the plane holds the job rather than
/// relaunching it in a loop, and the node's status names both versions.
#[tokio::test]
async fn an_image_labelled_older_than_the_minimum_is_refused_before_any_mint() -> Result<()> {
    let image = image_labelled("old", "2.300.0").await?;
    let cluster = Cluster::start(ClusterOptions {
        tier_image: image.clone(),
        min_runner_version: "2.331.0".into(),
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    tokio::time::sleep(WATCH / 2).await;
    assert!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .is_empty(),
        "a JIT config was minted for a runner older than the minimum"
    );
    let all = leases(&cluster).await?;
    assert!(!all.is_empty(), "no launch was tried");
    assert!(all.len() <= 2, "relaunched in a loop: {all:?}");
    for lease in &all {
        assert_eq!(lease.phase, Phase::Failed, "{lease:?}");
        assert_eq!(
            lease.failure_reason.as_deref(),
            Some("runner_outdated"),
            "{lease:?}"
        );
    }
    assert!(job_waits(&cluster, jobs[0]), "the job ran");
    let status = cluster.status_json("node-1")?;
    let reason = status["outdated_images"][0]["reason"]
        .as_str()
        .context("an outdated image in the status")?
        .to_owned();
    assert!(
        reason.contains("2.300.0") && reason.contains("2.331.0"),
        "{reason}"
    );
    cluster.wait_clean(Duration::from_secs(60)).await?;
    remove_image(&cluster, &image).await;
    cluster.shutdown().await
}
