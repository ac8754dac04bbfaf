//! Sticky disks end to end (issue #16): real `billet node` processes, the
//! stub plane, the emulator as GitHub and the stand-in runner in real
//! Docker containers. The tier asks for one sticky disk; each stand-in
//! (`BILLET_STANDIN_STICKY`) reads a counter file on it and writes it back
//! incremented, so what a job found is what the next generation holds.
//! What was published is read off the node's cache directory, as the
//! store keeps it (`agent/src/cache/store.rs`). What each guest was told by
//! the node's cache API (`agent/src/cache/session.rs`) is read off the
//! stand-in's own output, followed from each container's start.

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

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

/// Every line the cluster's runner containers write, followed from each
/// container's start, in a task of its own.
#[derive(Clone, Default)]
struct GuestLogs(Arc<Mutex<Vec<String>>>);

impl GuestLogs {
    fn watch(cluster: &Cluster) -> Self {
        let logs = Self::default();
        let docker = cluster.docker.clone();
        let deployment = cluster.deployment.clone();
        let lines = logs.0.clone();
        tokio::spawn(async move {
            let mut seen = HashSet::new();
            loop {
                let filters = std::collections::HashMap::from([(
                    "label".to_owned(),
                    vec![format!("sh.billet.deployment={deployment}")],
                )]);
                let list = docker
                    .list_containers(Some(bollard::query_parameters::ListContainersOptions {
                        all: true,
                        filters: Some(filters),
                        ..Default::default()
                    }))
                    .await
                    .unwrap_or_default();
                for id in list.into_iter().filter_map(|c| c.id) {
                    if !seen.insert(id.clone()) {
                        continue;
                    }
                    let docker = docker.clone();
                    let lines = lines.clone();
                    tokio::spawn(async move {
                        // A container not started yet has no log to
                        // follow, and a stream may end early: follow again
                        // (skipping what was taken) until the container has
                        // ended.
                        let mut taken = 0;
                        loop {
                            let mut stream = docker.logs(
                                &id,
                                Some(bollard::query_parameters::LogsOptions {
                                    follow: true,
                                    stdout: true,
                                    stderr: true,
                                    ..Default::default()
                                }),
                            );
                            let mut seen = 0;
                            while let Some(Ok(chunk)) = stream.next().await {
                                let text = chunk.to_string();
                                for line in text.lines() {
                                    seen += 1;
                                    if seen > taken {
                                        taken = seen;
                                        lines.lock().expect("logs").push(line.to_owned());
                                    }
                                }
                            }
                            let running = docker
                                .inspect_container(&id, None)
                                .await
                                .ok()
                                .and_then(|c| c.state)
                                .and_then(|s| s.status)
                                .is_some_and(|s| {
                                    s == bollard::models::ContainerStateStatusEnum::CREATED
                                        || s == bollard::models::ContainerStateStatusEnum::RUNNING
                                });
                            if !running {
                                return;
                            }
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                    });
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        });
        logs
    }

    /// The lines that contain `what`.
    fn lines(&self, what: &str) -> Vec<String> {
        self.0
            .lock()
            .expect("logs")
            .iter()
            .filter(|l| l.contains(what))
            .cloned()
            .collect()
    }

    fn text(&self) -> String {
        self.0.lock().expect("logs").join("\n")
    }

    /// What the guests were told about their commits.
    fn told(&self) -> Vec<serde_json::Value> {
        self.lines("cache commit slot")
            .iter()
            .filter_map(|l| l.split_once(" told ").map(|(_, t)| t.to_owned()))
            .filter_map(|t| serde_json::from_str(&t).ok())
            .collect()
    }

    async fn wait_told(&self, cluster: &Cluster, n: usize) -> Result<Vec<serde_json::Value>> {
        wait_until(TIMEOUT, "the guests to be told their commits", || {
            self.told().len() >= n
        })
        .await
        .with_context(|| {
            format!(
                "guest output:\n{}\nnode log:\n{}",
                self.text(),
                node_log(cluster)
            )
        })?;
        Ok(self.told())
    }
}

fn committed(generation: u64) -> serde_json::Value {
    serde_json::json!({"outcome": "committed", "published": true, "generation": generation})
}

#[tokio::test]
async fn a_second_job_finds_what_the_first_committed() -> Result<()> {
    let cluster = Cluster::start(options(pb::StickyPublication::Cas, 500, &[])).await?;
    let guests = GuestLogs::watch(&cluster);
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
    assert_eq!(guests.wait_told(&cluster, 1).await?, vec![committed(1)]);
    run_jobs(&cluster, 1).await?;
    assert_eq!(
        guests.wait_told(&cluster, 2).await?,
        vec![committed(1), committed(2)],
        "the second guest was told its commit"
    );
    let mounted = guests.lines("cache volume slot 0");
    assert!(
        mounted.len() == 2
            && mounted[0].contains("cache-hit false")
            && mounted[1].contains("generation 1 cache-hit true"),
        "the second guest found generation 1: {mounted:?}"
    );
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
    let guests = GuestLogs::watch(&cluster);
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 1).await?;
    assert_eq!(
        guests.wait_told(&cluster, 1).await?,
        vec![serde_json::json!({"outcome": "skipped", "published": false, "reason": "job_failed"})],
        "the guest is told its failed job publishes nothing"
    );
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
    let guests = GuestLogs::watch(&cluster);
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 2).await?;
    let log = node_log(&cluster);
    let mut told = guests.wait_told(&cluster, 2).await?;
    told.sort_by_key(|t| t["outcome"].as_str().map(str::to_owned));
    assert_eq!(
        told,
        vec![
            committed(1),
            serde_json::json!({"outcome": "conflict", "published": false, "reason": "conflict", "head": 1}),
        ],
        "the second guest is told of the conflict"
    );
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
    let guests = GuestLogs::watch(&cluster);
    let cache = cache_dir(&cluster);
    run_jobs(&cluster, 2).await?;
    let log = node_log(&cluster);
    let mut told = guests.wait_told(&cluster, 2).await?;
    told.sort_by_key(|t| t["generation"].as_u64());
    assert_eq!(
        told,
        vec![committed(1), committed(2)],
        "both guests published"
    );
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

/// One raw HTTP/1.1 request to a session's socket, from the host: the
/// status and the JSON body.
async fn call(
    socket: &Path,
    token: Option<&str>,
    method: &str,
    path: &str,
) -> Result<(u16, serde_json::Value)> {
    let mut stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| format!("connect {}", socket.display()))?;
    let auth = token
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    stream
        .write_all(
            format!("{method} {path} HTTP/1.1\r\nHost: x\r\n{auth}Content-Length: 0\r\nConnection: close\r\n\r\n")
                .as_bytes(),
        )
        .await?;
    let mut answer = Vec::new();
    stream.read_to_end(&mut answer).await?;
    let answer = String::from_utf8(answer)?;
    let (head, body) = answer
        .split_once("\r\n\r\n")
        .context("a truncated answer")?;
    let status = head.split(' ').nth(1).context("no status")?.parse()?;
    Ok((status, serde_json::from_str(body)?))
}

/// The one session socket under the node's cache directory, once there is
/// exactly one.
async fn one_socket(cache: &Path, not: Option<&Path>) -> Result<PathBuf> {
    let find = || -> Vec<PathBuf> {
        std::fs::read_dir(cache.join("guests"))
            .map(|d| {
                d.filter_map(|e| Some(e.ok()?.path().join("cache.sock")))
                    .filter(|p| p.exists() && Some(p.as_path()) != not)
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_until(TIMEOUT, "a guest's cache session", || find().len() == 1).await?;
    Ok(find().remove(0))
}

/// The cache token in the environment of the node's one runner container.
async fn token_of_the_runner(cluster: &Cluster) -> Result<String> {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        for name in cluster.containers().await? {
            // A container removed since the list is not the runner.
            let Ok(inspected) = cluster.docker.inspect_container(&name, None).await else {
                continue;
            };
            let env = inspected.config.and_then(|c| c.env).unwrap_or_default();
            if let Some(t) = env
                .iter()
                .find_map(|e| e.strip_prefix("BILLET_CACHE_TOKEN="))
            {
                return Ok(t.to_owned());
            }
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "no runner has a cache token"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn a_wrong_missing_or_destroyed_instances_credential_is_refused_and_changes_nothing()
-> Result<()> {
    let cluster = Cluster::start(options(pb::StickyPublication::Cas, 6000, &[])).await?;
    let guests = GuestLogs::watch(&cluster);
    let cache = cache_dir(&cluster);
    let first = cluster.queue_jobs(1);
    let socket_a = one_socket(&cache, None).await?;
    let token_a = token_of_the_runner(&cluster).await?;
    let (status, volumes) = call(&socket_a, Some(&token_a), "GET", "/v1/volumes").await?;
    assert_eq!(status, 200, "{volumes}");
    assert_eq!(volumes["volumes"][0]["key"], KEY);
    cluster.wait_jobs_completed(&first, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    wait_until(TIMEOUT, "the first session to close", || !socket_a.exists()).await?;
    assert_eq!(guests.wait_told(&cluster, 1).await?, vec![committed(1)]);
    let before = published(&cache);

    let second = cluster.queue_jobs(1);
    let socket_b = one_socket(&cache, None).await?;
    let wrong = "0".repeat(64);
    for token in [None, Some(wrong.as_str()), Some(token_a.as_str())] {
        for (method, path) in [
            ("GET", "/v1/volumes"),
            ("POST", "/v1/volumes/0/commit"),
            ("POST", "/v1/volumes/0/discard"),
        ] {
            let (status, body) = call(&socket_b, token, method, path).await?;
            assert_eq!(
                status,
                401,
                "{method} {path} with {}: {body}",
                if token == Some(token_a.as_str()) {
                    "the destroyed instance's token"
                } else {
                    "a wrong or no token"
                }
            );
        }
    }
    assert_eq!(published(&cache), before, "nothing changed");
    cluster.wait_jobs_completed(&second, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    // The refused requests withdrew nothing: the second job's own commit
    // published.
    assert_eq!(
        guests.wait_told(&cluster, 2).await?,
        vec![committed(1), committed(2)]
    );
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(2),
            next: 3,
            counter: Some("2".into())
        })
    );
    cluster.shutdown().await.context("shutdown")
}
