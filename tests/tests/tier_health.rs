//! No silent queue, end to end with real Docker, the real `billet node`,
//! the stub plane and the scale-set emulator: a tier whose every launch the
//! engine refuses at create (a memory limit below Docker's 6 MB minimum) is
//! refused by the node after three failures in a row, shown unhealthy in
//! `billet node status`, no longer placed on the node nor minted for, never
//! refused for "compute under another lease" while a failed launch is torn
//! down, and its job runs once the tier is fixed.

use std::time::Duration;

use anyhow::{Context, Result};
use billet_controlplane_stub::ledger::Lease;
use billet_proto::ending::{EndClass, ReasonCode};
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until};
use scaleset::testing::Endpoint;

/// Below Docker's minimum memory limit (6 MB): every create is refused.
const TOO_SMALL_BYTES: u64 = 4 << 20;

/// Consecutive start failures before the node refuses the tier.
const K: usize = 3;

/// How long the tier is watched once the node refuses it: within this,
/// before, the job's launches went on failing every few seconds.
const WATCH: Duration = Duration::from_secs(25);

async fn leases(cluster: &Cluster) -> Result<Vec<Lease>> {
    Ok(cluster.plane.ledger().leases().await?)
}

fn unhealthy_tiers(status: &serde_json::Value) -> Vec<serde_json::Value> {
    status["unhealthy_tiers"]
        .as_array()
        .cloned()
        .unwrap_or_default()
}

#[tokio::test]
async fn a_tier_the_engine_refuses_is_withdrawn_after_k_failures_and_its_job_runs_once_it_is_fixed()
-> Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        tier_memory_bytes: TOO_SMALL_BYTES,
        node_env: vec![
            (
                "BILLET_TIER_FAILURES_BEFORE_UNHEALTHY".into(),
                K.to_string(),
            ),
            // A create the engine refused left nothing, but the node proves
            // that by absence over the stray grace before it ends the
            // lease: shortened, so the test can see the node clean.
            ("BILLET_STRAY_GRACE_SECS".into(), "20".into()),
        ],
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(1);

    // The first K launches mint, are refused at create, and the node then
    // refuses the tier.
    let minted = || {
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len()
    };
    let withdrawn = wait_until(
        Duration::from_secs(90),
        "the node to refuse the tier",
        || {
            cluster
                .status_json("node-1")
                .is_ok_and(|s| !unhealthy_tiers(&s).is_empty())
        },
    )
    .await;
    let all = leases(&cluster).await?;
    let refused_under_another_lease: Vec<(&str, &str)> = all
        .iter()
        .filter_map(|l| Some((l.id.as_str(), l.failure_reason.as_deref()?)))
        .filter(|(_, reason)| reason.contains("under another lease"))
        .collect();
    assert!(
        refused_under_another_lease.is_empty(),
        "a launch was refused while a failed one was torn down: {refused_under_another_lease:?}"
    );
    withdrawn.with_context(|| {
        let reasons: Vec<_> = all.iter().map(|l| &l.failure_reason).collect();
        format!("after {} mints; the leases' ends: {reasons:?}", minted())
    })?;
    let at_withdrawal = minted();
    assert!(
        at_withdrawal <= K,
        "{at_withdrawal} JIT configs minted before the tier was withdrawn"
    );

    // Withdrawn: nothing more is minted or started for it, and the status
    // says why.
    tokio::time::sleep(WATCH).await;
    assert_eq!(
        minted(),
        at_withdrawal,
        "JIT configs were minted for a tier the node refuses"
    );
    let status = cluster.status_json("node-1")?;
    let tiers = unhealthy_tiers(&status);
    assert_eq!(tiers.len(), 1, "{status}");
    assert_eq!(tiers[0]["failures"], K, "{status}");
    let last = tiers[0]["last_error"].as_str().unwrap_or_default();
    assert!(
        last.to_ascii_lowercase().contains("memory"),
        "the last error does not say what the engine refused: {last}"
    );
    // Each ended attempt says why, as an infrastructure end: the K that
    // the engine refused, then those the node refused for the tier (the
    // failed ones still being torn down end once their absence is proven).
    let all = leases(&cluster).await?;
    let mut ends = Vec::new();
    for lease in all.iter().filter(|l| l.phase.is_terminal()) {
        let (code, _) = lease.end().context("ended")?;
        assert!(
            matches!(code, ReasonCode::LaunchFailed | ReasonCode::TierUnhealthy),
            "{lease:?}"
        );
        assert_eq!(code.class(), EndClass::Infra, "{lease:?}");
        ends.push(code);
    }
    assert!(
        ends.contains(&ReasonCode::TierUnhealthy),
        "no launch was refused for the tier: {ends:?}"
    );
    let waiting = cluster
        .emulator
        .state()
        .jobs
        .iter()
        .any(|j| j.id == jobs[0] && j.state != scaleset::testing::JobState::Completed);
    assert!(waiting, "the job ran on a tier the engine refuses");

    // The operator fixes the tier: a new definition is tried at once, and
    // the job runs.
    cluster
        .restart_plane_with(|config| config.tier.memory_bytes = 256 << 20)
        .await?;
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    let status = cluster.status_json("node-1")?;
    assert!(unhealthy_tiers(&status).is_empty(), "{status}");
    cluster.wait_clean(Duration::from_secs(60)).await?;
    cluster.shutdown().await
}
