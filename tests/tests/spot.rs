//! Spot interruptions: the node watches the EC2 instance-metadata spot
//! notice through IMDSv2 tokens, served here by a fake of that endpoint on
//! loopback (`billet_tests::imds`). A notice fails the lease running on the
//! host with `ec2 spot interruption: <action>`, recorded before its runner
//! is destroyed, and the node takes no more work until the notice is
//! withdrawn. End to end: a real `billet node`, real mTLS, real Docker.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_agent::local;
use billet_agent::node::ending::SpotAction;
use billet_agent::node::interruption::{Imds, InterruptionSource, Notice};
use billet_controlplane_stub::ledger::Phase;
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until};
use billet_tests::imds::FakeImds;
use scaleset::testing::JobState;
use tokio::time::Instant;

/// The node's reader against the fake: no notice is `None`; a notice is read
/// with its action; a revoked token is replaced once, transparently; a
/// withdrawn notice is `None` again.
#[tokio::test]
async fn the_imds_reader_follows_the_notice_through_imdsv2_tokens() -> Result<()> {
    let imds = FakeImds::start().await?;
    let reader = Imds::new(&imds.url())?;
    assert_eq!(reader.notice().await?, None);
    imds.post("terminate");
    let notice = reader.notice().await?.context("the posted notice")?;
    assert_eq!(notice.action, SpotAction::Terminate);
    assert_eq!(imds.served().tokens, 1, "the token is reused while valid");
    imds.revoke_tokens();
    imds.post("stop");
    assert_eq!(
        reader.notice().await?.map(|n: Notice| n.action),
        Some(SpotAction::Stop)
    );
    assert_eq!(imds.served().tokens, 2, "one fresh token after the 401");
    assert_eq!(imds.served().unauthorized, 1);
    imds.withdraw();
    assert_eq!(reader.notice().await?, None);
    Ok(())
}

/// Nothing answers at the endpoint: an error, never "no notice" and never a
/// notice.
#[tokio::test]
async fn an_imds_that_does_not_answer_is_an_error_not_an_answer() -> Result<()> {
    let port = billet_tests::cluster::free_port()?;
    let reader = Imds::new(&format!("http://{port}"))?;
    let e = reader.notice().await.expect_err("nothing listens there");
    assert!(e.to_string().contains("did not answer"), "{e}");
    Ok(())
}

async fn status(cluster: &Cluster) -> Result<local::Observed> {
    local::check(&cluster.dir.join("state-node-1"), Duration::from_secs(5))
        .await
        .map_err(anyhow::Error::msg)
}

/// A notice while a job runs: its lease is failed with the reason, its
/// container destroyed, the node degraded with SPOT_INTERRUPTION and given
/// no launch (nothing minted for a job queued meanwhile); once the notice is
/// withdrawn the node heals by itself and the waiting job runs.
#[tokio::test]
async fn a_spot_notice_fails_the_running_lease_with_its_reason_and_the_node_takes_no_work_until_it_is_withdrawn()
-> Result<()> {
    let imds = FakeImds::start().await?;
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 30_000,
        node_env: vec![("BILLET_SPOT_IMDS".into(), imds.url())],
        ..ClusterOptions::default()
    })
    .await?;
    let first = cluster.queue_jobs(1)[0];
    wait_until(Duration::from_secs(60), "the first job to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .any(|j| j.id == first && j.state == JobState::Running)
    })
    .await?;
    let runner = cluster.emulator.state().runners[0].name.clone();
    let lease = cluster
        .plane
        .ledger()
        .lease_by_runner_name(&runner)
        .await?
        .context("the running job's lease")?;
    assert!(
        imds.served().notices > 0,
        "the node never asked for the notice"
    );

    imds.post("terminate");
    let ended = cluster
        .wait_lease_ended(
            &lease.id,
            Duration::from_secs(60),
            "the interrupted lease never ended",
        )
        .await?;
    assert_eq!(ended.phase, Phase::Failed);
    assert_eq!(
        ended.failure_reason.as_deref(),
        Some("ec2 spot interruption: terminate")
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while cluster.containers().await?.contains(&runner) {
        if Instant::now() > deadline {
            bail!("the interrupted runner's container {runner} is still there");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let observed = status(&cluster).await?;
    assert!(!observed.serving, "health serving during the notice");
    assert!(
        observed
            .status
            .degraded_reasons
            .contains(&(pb::DegradedReason::SpotInterruption as i32)),
        "{:?}",
        observed.status.degraded_reasons
    );

    // A job queued while the notice stands gets nothing on this node.
    let minted = cluster.emulator.state().runners.len();
    let second = cluster.queue_jobs(1)[0];
    let window = Instant::now() + Duration::from_secs(8);
    while Instant::now() < window {
        assert_eq!(
            cluster.emulator.state().runners.len(),
            minted,
            "a registration was minted for a node under a spot notice"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        !cluster.containers().await?.iter().any(|c| c != &runner),
        "a container was started under the notice"
    );

    // The notice is withdrawn: the node heals by itself and the job runs.
    imds.withdraw();
    cluster
        .wait_jobs_completed(&[second], Duration::from_secs(120))
        .await?;
    assert!(status(&cluster).await?.serving);
    cluster.shutdown().await
}
