//! Sticky disks end to end (issue #16): real `billet node` processes, the
//! stub plane, the emulator as GitHub and the stand-in runner in real
//! Docker containers. The tier asks for one sticky disk; each stand-in
//! (`BILLET_STANDIN_STICKY`) reads a counter file on it and writes it back
//! incremented, so what a job found is what the next generation holds.
//! What was published is read off the node's cache directory, as the
//! store keeps it (`agent/src/cache/store.rs`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until};

const KEY: &str = "e2e-counter";
/// Where the job sees its disk.
const DISK: &str = "/cache/counter";
const TIMEOUT: Duration = Duration::from_secs(120);

fn options(policy: pb::StickyPublication, work_ms: u64, env: &[&str]) -> ClusterOptions {
    ClusterOptions {
        work_ms,
        sticky_disks: vec![pb::StickyDisk {
            key: KEY.into(),
            path: DISK.into(),
            publication: policy.into(),
        }],
        tier_env: [format!("BILLET_STANDIN_STICKY={DISK}/n")]
            .into_iter()
            .chain(env.iter().map(|e| (*e).to_owned()))
            .collect(),
        ..ClusterOptions::default()
    }
}

fn cache_dir(cluster: &Cluster) -> PathBuf {
    cluster.dir.join("state-node-1").join("cache")
}

/// What the node's store has published for [`KEY`]: its head, the next
/// generation number (so how many were ever published) and the counter at
/// the head.
#[derive(Debug, PartialEq, Eq)]
struct Published {
    head: Option<u64>,
    next: u64,
    counter: Option<String>,
}

fn published(cache: &Path) -> Option<Published> {
    for entry in std::fs::read_dir(cache.join("keys")).ok()? {
        let dir = entry.ok()?.path();
        let Ok(bytes) = std::fs::read(dir.join("state.json")) else {
            continue;
        };
        let state: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        if state["key"] != KEY {
            continue;
        }
        let head = state["head"].as_u64();
        let counter = head.and_then(|g| {
            std::fs::read_to_string(dir.join("g").join(g.to_string()).join("n"))
                .ok()
                .map(|c| c.trim().to_owned())
        });
        return Some(Published {
            head,
            next: state["next"].as_u64()?,
            counter,
        });
    }
    None
}

/// The mounts the node has not settled.
fn open_mounts(cache: &Path) -> usize {
    std::fs::read_dir(cache.join("mounts")).map_or(0, Iterator::count)
}

/// Runs `n` jobs at once and waits until they are complete, their compute
/// gone and their mounts settled.
async fn run_jobs(cluster: &Cluster, n: usize) -> Result<()> {
    let jobs = cluster.queue_jobs(n);
    cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    let cache = cache_dir(cluster);
    wait_until(TIMEOUT, "the mounts to be settled", || {
        open_mounts(&cache) == 0
    })
    .await
}

fn node_log(cluster: &Cluster) -> String {
    cluster.nodes["node-1"].log_text()
}

#[tokio::test]
async fn a_second_job_finds_what_the_first_committed() -> Result<()> {
    let cluster = Cluster::start(options(pb::StickyPublication::Cas, 500, &[])).await?;
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 1).await?;
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(1),
            next: 2,
            counter: Some("1".into())
        }),
        "the first job's commit; node log:\n{}",
        node_log(&cluster)
    );
    run_jobs(&cluster, 1).await?;
    // The second job read 1 from its clone of generation 1 and wrote 2.
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(2),
            next: 3,
            counter: Some("2".into())
        }),
        "node log:\n{}",
        node_log(&cluster)
    );
    cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn a_job_that_fails_publishes_nothing() -> Result<()> {
    let cluster = Cluster::start(options(
        pb::StickyPublication::Cas,
        500,
        &["BILLET_STANDIN_RESULT=failed"],
    ))
    .await?;
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 1).await?;
    let log = node_log(&cluster);
    assert!(
        log.contains("sticky disk mounted"),
        "the job had its disk:\n{log}"
    );
    assert_eq!(published(&cache), None, "node log:\n{log}");
    cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn of_two_jobs_on_one_key_at_once_the_second_commit_is_a_reported_conflict() -> Result<()> {
    // Long enough a job that both runners have mounted the (cold) key
    // before either commits.
    let cluster = Cluster::start(options(pb::StickyPublication::Cas, 8000, &[])).await?;
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 2).await?;
    let log = node_log(&cluster);
    assert_eq!(
        log.matches("sticky disk mounted").count(),
        2,
        "both jobs mounted:\n{log}"
    );
    // Both read nothing and wrote 1; one generation was ever published.
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(1),
            next: 2,
            counter: Some("1".into())
        }),
        "node log:\n{log}"
    );
    assert!(
        log.contains("another job committed its key since this one mounted it"),
        "the conflict is reported:\n{log}"
    );
    cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn of_two_jobs_on_one_last_writer_wins_key_both_commits_publish() -> Result<()> {
    let cluster = Cluster::start(options(pb::StickyPublication::LastWriterWins, 8000, &[])).await?;
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 2).await?;
    let log = node_log(&cluster);
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(2),
            next: 3,
            counter: Some("1".into())
        }),
        "node log:\n{log}"
    );
    assert!(!log.contains("another job committed its key"), "{log}");
    cluster.shutdown().await.context("shutdown")
}
