//! Registry mirrors for guests: the mirrors a node is configured with
//! (`--registry-mirror`, `BILLET_REGISTRY_MIRRORS`) reach every runner it
//! starts, exactly, as its Docker daemon configuration
//! (`/etc/docker/daemon.json`, bound read-only) and in
//! `BILLET_REGISTRY_MIRRORS`; a node configured with none hands none. The
//! stand-in runner says at start what it sees.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions};
use bollard::Docker;
use bollard::query_parameters::LogsOptionsBuilder;
use futures::StreamExt as _;

/// The container's stdout and stderr so far.
async fn logs(docker: &Docker, name: &str) -> String {
    let options = LogsOptionsBuilder::default()
        .stdout(true)
        .stderr(true)
        .build();
    let mut stream = docker.logs(name, Some(options));
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(output) => text.push_str(&output.to_string()),
            Err(e) => {
                text.push_str(&format!("<cannot read the logs: {e}>"));
                break;
            }
        }
    }
    text
}

/// Starts a cluster whose node has `node_env`, launches one job, and
/// answers the stand-in's `registry mirrors:` line from its container.
async fn what_a_guest_sees(node_env: Vec<(String, String)>) -> Result<String> {
    let cluster = Cluster::start(ClusterOptions {
        node_env,
        work_ms: 600_000,
        ..ClusterOptions::default()
    })
    .await?;
    let mut events = cluster.plane.subscribe();
    cluster.queue_jobs(1);
    let lease = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            match events.recv().await {
                Ok(PlaneEvent::Launched { lease, .. }) => return Ok(lease),
                Ok(PlaneEvent::LaunchFailed { reason, .. }) => return Err(reason),
                Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                Err(e) => return Err(e.to_string()),
            }
        }
    })
    .await
    .context("the job did not launch within 60 s")?
    .map_err(|r| anyhow::anyhow!("the launch failed: {r}"))?;
    let container = format!("billet-{lease}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let line = loop {
        let text = logs(&cluster.docker, &container).await;
        if let Some(line) = text.lines().find_map(|l| {
            l.split_once("registry mirrors: ")
                .map(|(_, r)| r.to_owned())
        }) {
            break line;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("{container} never said what mirrors it sees; its log:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    cluster.shutdown().await?;
    Ok(line)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_sees_exactly_the_configured_registry_mirrors_in_daemon_json_and_its_env()
-> Result<()> {
    let seen = what_a_guest_sees(vec![(
        "BILLET_REGISTRY_MIRRORS".into(),
        "https://mirror-one.example,http://10.1.2.3:5000".into(),
    )])
    .await?;
    assert_eq!(
        seen,
        "env \"https://mirror-one.example,http://10.1.2.3:5000\"; \
         daemon.json [\"https://mirror-one.example\",\"http://10.1.2.3:5000\"]"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_of_a_node_without_mirrors_sees_none() -> Result<()> {
    let seen = what_a_guest_sees(Vec::new()).await?;
    assert_eq!(seen, "env unset; daemon.json absent");
    Ok(())
}
