//! A node that cannot do its job says so, stops taking work, and heals
//! (issue #13): clock offsets, a hung or refusing engine, a full state
//! disk, and start-up logging. End to end: real `billet node` processes,
//! real mTLS, real Docker.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_agent::node::local;
use billet_tests::cluster::{Cluster, ClusterOptions};

/// libfaketime's preload library (Debian `libfaketime`, installed with
/// `faketime` by scripts/test).
const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

fn state_dir(cluster: &Cluster, node: &str) -> PathBuf {
    cluster.dir.join(format!("state-{node}"))
}

async fn status(state_dir: &Path) -> Result<local::Observed> {
    local::check(state_dir, Duration::from_secs(5))
        .await
        .map_err(anyhow::Error::msg)
}

/// Environment that runs only the node process `offset` seconds off.
fn skewed(offset: &str) -> Result<Vec<(String, String)>> {
    if !Path::new(FAKETIME_LIB).exists() {
        bail!("{FAKETIME_LIB} is missing: install Debian's faketime package (scripts/test does)");
    }
    Ok(vec![
        ("LD_PRELOAD".into(), FAKETIME_LIB.into()),
        ("FAKETIME".into(), offset.into()),
        // Only the wall clock moves, as a badly synchronised host's would.
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
    ])
}

/// Jobs on a node whose wall clock is `offset` seconds from the plane's
/// run, complete and are cleaned up exactly as on a node in sync, and
/// nothing is answered EXPIRED; the offset is measured and reported.
async fn jobs_run_and_clean_up_with_the_node_clock_off_by(
    offset: &str,
    expect_ms: i64,
) -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_env: skewed(offset)?,
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(3);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;

    let state = cluster.emulator.state();
    for id in &jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
        assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
    }
    assert!(
        state.runners.is_empty(),
        "registrations left: {:?}",
        state.runners
    );
    let log = cluster.nodes["node-1"].log_text();
    assert!(
        !log.contains("expired before it started"),
        "a command with time left was answered EXPIRED:\n{log}"
    );
    let observed = status(&state_dir(&cluster, "node-1")).await?;
    let measured = observed.status.clock_offset_ms;
    assert!(
        (measured - expect_ms).abs() < 5_000,
        "the node reports a clock offset of {measured} ms, expected about {expect_ms}"
    );
    assert!(
        observed.serving && observed.status.degraded_reasons.is_empty(),
        "minutes off is not degraded: {observed:?}"
    );
    let link = cluster.plane.node("node-1").context("node")?;
    let reported = link.status().borrow().clone().context("attached")?;
    assert!(
        (reported.health.clock_offset_ms - expect_ms).abs() < 5_000,
        "the session reports {:?}",
        reported.health
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_clock_90_seconds_ahead_runs_and_cleans_up_jobs_like_one_in_sync() -> Result<()> {
    jobs_run_and_clean_up_with_the_node_clock_off_by("+90", 90_000).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_clock_five_minutes_behind_runs_and_cleans_up_jobs_like_one_in_sync() -> Result<()> {
    jobs_run_and_clean_up_with_the_node_clock_off_by("-300", -300_000).await
}

/// `BILLET_LOG` with a typo stops start-up with exit 2 and a message
/// naming the variable, instead of silencing the node.
#[test]
fn an_invalid_billet_log_stops_start_up_with_exit_2_naming_the_variable() -> Result<()> {
    billet_tests::image::build_process_binaries()?;
    for value in ["inf", "json", "billet=loud"] {
        let out = std::process::Command::new(billet_tests::image::binary_path("billet")?)
            .args([
                "node",
                "--listen",
                "127.0.0.1:0",
                "--cert",
                "/nonexistent/cert.pem",
                "--key",
                "/nonexistent/key.pem",
                "--ca",
                "/nonexistent/ca.pem",
            ])
            .env("BILLET_LOG", value)
            .output()?;
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "BILLET_LOG={value}: {stderr}");
        assert!(
            stderr.contains("BILLET_LOG"),
            "BILLET_LOG={value}: {stderr}"
        );
    }
    // A valid one still starts far enough to fail on the certificate (3),
    // and that error reaches stderr.
    let out = std::process::Command::new(billet_tests::image::binary_path("billet")?)
        .args([
            "node",
            "--listen",
            "127.0.0.1:0",
            "--cert",
            "/nonexistent/cert.pem",
            "--key",
            "/nonexistent/key.pem",
            "--ca",
            "/nonexistent/ca.pem",
            "--log-format",
            "json",
        ])
        .env("BILLET_LOG", "billet=debug,info")
        .output()?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("cert.pem"))
        .context("the error")?;
    let json: serde_json::Value = serde_json::from_str(line).context("a JSON line")?;
    assert_eq!(json["level"], "ERROR", "{line}");
    Ok(())
}
