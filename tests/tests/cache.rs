//! Sticky disks end to end: real `billet node` processes, the stub plane,
//! the emulator as GitHub and the stand-in runner in real Docker
//! containers. The tier asks for one sticky disk; each stand-in
//! (`BILLET_STANDIN_STICKY`) reads a counter file on it and writes it back
//! incremented, so what a job found is what the next generation holds.
//! What was published is read off the node's cache directory, as the
//! store keeps it (`agent/src/cache/store.rs`). What each guest was told by
//! the node's cache API (`agent/src/cache/session.rs`) is what each
//! stand-in reported to the test's sink (`GuestReports`,
//! `BILLET_STANDIN_REPORT`): a runner goes on only once the sink has
//! acknowledged its report, so no report is lost with its container.

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use anyhow::{Context, Result};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until};
use billet_tests::reports::GuestReports;

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

/// What [`published`] says of a key whose head is `head`, the last
/// generation made, holding `counter`.
fn at(head: u64, counter: &str) -> Option<Published> {
    Some(Published {
        head: Some(head),
        next: head + 1,
        counter: Some(counter.into()),
    })
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

/// A cluster whose runners report what the node's cache API told them to
/// a sink of the test's own, with what it reported.
struct Guests {
    cluster: Cluster,
    reports: GuestReports,
}

impl Guests {
    /// Starts the sink, then the cluster with the sink named in the tier's
    /// environment (beside `env`).
    async fn start(policy: pb::StickyPublication, work_ms: u64, env: &[&str]) -> Result<Self> {
        Self::start_with(policy, work_ms, env, |_| {}).await
    }

    /// [`Guests::start`], with the cluster's options changed by `adjust`.
    async fn start_with(
        policy: pb::StickyPublication,
        work_ms: u64,
        env: &[&str],
        adjust: impl FnOnce(&mut ClusterOptions),
    ) -> Result<Self> {
        let reports = GuestReports::start().await?;
        let sink = reports.env();
        let env: Vec<&str> = env.iter().copied().chain([sink.as_str()]).collect();
        let mut options = options(policy, work_ms, &env);
        adjust(&mut options);
        let cluster = Cluster::start(options).await?;
        // The runners use the host's network: they reach the sink where
        // they reach GitHub.
        anyhow::ensure!(
            cluster.emulator.addr().ip() == reports.addr().ip(),
            "the sink ({}) is not where the emulator is ({})",
            reports.addr(),
            cluster.emulator.addr()
        );
        Ok(Self { cluster, reports })
    }

    /// What the guests were told of their commits, once `n` were, in the
    /// order they reported them.
    async fn told(&self, n: usize) -> Result<Vec<serde_json::Value>> {
        let commits = self
            .reports
            .wait_for("commit", n, TIMEOUT)
            .await
            .with_context(|| format!("node log:\n{}", node_log(&self.cluster)))?;
        Ok(commits.into_iter().map(|r| r["told"].clone()).collect())
    }

    /// What each guest found mounted at slot 0, once `n` said, in the
    /// order they reported it.
    async fn mounted(&self, n: usize) -> Result<Vec<serde_json::Value>> {
        let mounted = self
            .reports
            .wait_for("mounted", n, TIMEOUT)
            .await
            .with_context(|| format!("node log:\n{}", node_log(&self.cluster)))?;
        Ok(mounted
            .into_iter()
            .map(|r| r["volumes"][0].clone())
            .collect())
    }
}

/// What the node logged the cache did for each job once its disks were
/// settled (`hits=.. misses=.. bytes_restored=.. bytes_committed=..
/// conflicts=.. fallbacks=..`), once it has for `n` jobs, in order.
async fn observations(cluster: &Cluster, n: usize) -> Result<Vec<String>> {
    let seen = || -> Vec<String> {
        node_log(cluster)
            .lines()
            .filter(|l| l.contains("what the cache did for the job"))
            .filter_map(|l| l.find("hits=").map(|i| l[i..].trim().to_owned()))
            .collect()
    };
    wait_until(TIMEOUT, "the node to log what the cache did", || {
        seen().len() >= n
    })
    .await
    .with_context(|| format!("node log:\n{}", node_log(cluster)))?;
    Ok(seen())
}

/// The cache observation the plane's ledger keeps for each of the first
/// `n` leases, in the order their requests came, once each has one
/// (`RecordCacheObservation`, sent after the lease's disks are settled).
async fn ledger_observations(
    cluster: &Cluster,
    n: usize,
) -> Result<Vec<billet_controlplane_stub::ledger::CacheObservation>> {
    let ledger = cluster.plane.ledger();
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        let mut leases = ledger.leases().await?;
        leases.sort_by_key(|l| l.request_id);
        let mut kept = Vec::new();
        for lease in leases.iter().take(n) {
            if let Some(o) = ledger.cache_observation(&lease.id).await? {
                kept.push(o);
            }
        }
        if kept.len() == n {
            return Ok(kept);
        }
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the ledger kept {} cache observations of {n} (leases {leases:?}); node log:\n{}",
            kept.len(),
            node_log(cluster)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Publishes generation 1 of each key in `keys`, with its `n` file, in
/// order (so the first is the least recently used), in the store of
/// `deployment` at `cache`, as a node that ran jobs before would have left
/// it: a node of this test then starts on it. The generations' directories,
/// in the same order.
async fn seed(cache: &Path, deployment: &str, keys: &[(&str, &[u8])]) -> Result<Vec<PathBuf>> {
    use billet_agent::cache::{Committed, DiskKey, Generation, Policy, Store};
    let store = Store::open(
        cache,
        deployment,
        std::sync::Arc::new(billet_agent::journal::MemoryJournal::default()),
    )
    .await?;
    let lease = billet_agent::model::LeaseId::parse("seed", "seed")?;
    let mut dirs = Vec::new();
    for (key, n) in keys {
        let key = DiskKey::parse(key)?;
        let mount = store.mount(&lease, &key, Policy::Cas).await?;
        std::fs::write(mount.dir.join("n"), n)?;
        anyhow::ensure!(store.commit(&mount.id).await? == Committed::Published(Generation(1)));
        dirs.push(store.generation_dir(&key, Generation(1)));
        // The next key's use is a later millisecond.
        let now = std::time::SystemTime::now();
        while now.elapsed().unwrap_or_default() < Duration::from_millis(2) {
            std::thread::yield_now();
        }
    }
    Ok(dirs)
}

/// The generations the node's store keeps of `key`.
fn generations(cache: &Path, key: &str) -> Vec<u64> {
    let Ok(entries) = std::fs::read_dir(cache.join("keys")) else {
        return Vec::new();
    };
    for entry in entries.flatten() {
        let Ok(bytes) = std::fs::read(entry.path().join("state.json")) else {
            continue;
        };
        let Ok(state) = serde_json::from_slice::<serde_json::Value>(&bytes) else {
            continue;
        };
        if state["key"] == key {
            return state["generations"]
                .as_object()
                .map(|g| g.keys().filter_map(|k| k.parse().ok()).collect())
                .unwrap_or_default();
        }
    }
    Vec::new()
}

fn committed(generation: u64) -> serde_json::Value {
    serde_json::json!({"outcome": "committed", "published": true, "generation": generation})
}

#[tokio::test]
async fn a_second_job_finds_what_the_first_committed() -> Result<()> {
    let guests = Guests::start(pb::StickyPublication::Cas, 500, &[]).await?;
    let cluster = &guests.cluster;
    let cache = cache_dir(cluster);
    run_jobs(cluster, 1).await?;
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(1),
            next: 2,
            counter: Some("1".into())
        }),
        "the first job's commit; node log:\n{}",
        node_log(cluster)
    );
    assert_eq!(guests.told(1).await?, vec![committed(1)]);
    run_jobs(cluster, 1).await?;
    assert_eq!(
        guests.told(2).await?,
        vec![committed(1), committed(2)],
        "the second guest was told its commit"
    );
    let mounted = guests.mounted(2).await?;
    assert_eq!(
        (
            &mounted[0]["cache_hit"],
            &mounted[1]["generation"],
            &mounted[1]["cache_hit"]
        ),
        (
            &serde_json::json!(false),
            &serde_json::json!(1),
            &serde_json::json!(true)
        ),
        "the first guest found nothing and the second generation 1: {mounted:?}"
    );
    // Each wrote its counter ("1\n", then "2\n"): the first missed, the
    // second hit generation 1 and restored its 2 bytes.
    assert_eq!(
        observations(cluster, 2).await?,
        [
            "hits=0 misses=1 bytes_restored=0 bytes_committed=2 conflicts=0 fallbacks=0",
            "hits=1 misses=0 bytes_restored=2 bytes_committed=2 conflicts=0 fallbacks=0",
        ]
    );
    // The same, recorded against each lease in the plane's ledger.
    use billet_controlplane_stub::ledger::CacheObservation;
    assert_eq!(
        ledger_observations(cluster, 2).await?,
        [
            CacheObservation {
                misses: 1,
                bytes_committed: 2,
                ..CacheObservation::default()
            },
            CacheObservation {
                hits: 1,
                bytes_restored: 2,
                bytes_committed: 2,
                ..CacheObservation::default()
            },
        ]
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
        node_log(cluster)
    );
    guests.cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn a_job_that_fails_publishes_nothing() -> Result<()> {
    let guests = Guests::start(
        pb::StickyPublication::Cas,
        500,
        &["BILLET_STANDIN_RESULT=failed"],
    )
    .await?;
    let cluster = &guests.cluster;
    let cache = cache_dir(cluster);
    run_jobs(cluster, 1).await?;
    assert_eq!(
        guests.told(1).await?,
        vec![serde_json::json!({"outcome": "skipped", "published": false, "reason": "job_failed"})],
        "the guest is told its failed job publishes nothing"
    );
    let log = node_log(cluster);
    assert!(
        log.contains("sticky disk mounted"),
        "the job had its disk:\n{log}"
    );
    assert_eq!(published(&cache), None, "node log:\n{log}");
    guests.cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn of_two_jobs_on_one_key_at_once_the_second_commit_is_a_reported_conflict() -> Result<()> {
    // Long enough a job that both runners have mounted the (cold) key
    // before either commits.
    let guests = Guests::start(pb::StickyPublication::Cas, 8000, &[]).await?;
    let cluster = &guests.cluster;
    let cache = cache_dir(cluster);
    run_jobs(cluster, 2).await?;
    let log = node_log(cluster);
    let mut told = guests.told(2).await?;
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
    let mut observed = observations(cluster, 2).await?;
    observed.sort();
    assert_eq!(
        observed,
        [
            "hits=0 misses=1 bytes_restored=0 bytes_committed=0 conflicts=1 fallbacks=0",
            "hits=0 misses=1 bytes_restored=0 bytes_committed=2 conflicts=0 fallbacks=0",
        ],
        "both missed; one published, the other is counted a conflict"
    );
    guests.cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn of_two_jobs_on_one_last_writer_wins_key_both_commits_publish() -> Result<()> {
    let guests = Guests::start(pb::StickyPublication::LastWriterWins, 8000, &[]).await?;
    let cluster = &guests.cluster;
    let cache = cache_dir(cluster);
    run_jobs(cluster, 2).await?;
    let log = node_log(cluster);
    let mut told = guests.told(2).await?;
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
    guests.cluster.shutdown().await.context("shutdown")
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

/// The cache token in the environment of the node's one runner process
/// (read from `/proc/<pid>/environ` on this host: the engine does not
/// record it).
async fn token_of_the_runner(cluster: &Cluster) -> Result<String> {
    let deadline = tokio::time::Instant::now() + TIMEOUT;
    loop {
        for name in cluster.containers().await? {
            // A container removed since the list is not the runner.
            let Ok(inspected) = cluster.docker.inspect_container(&name, None).await else {
                continue;
            };
            let Some(pid) = inspected.state.and_then(|s| s.pid).filter(|p| *p > 0) else {
                continue;
            };
            let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
            if let Some(t) = environ
                .split(|b| *b == 0)
                .find_map(|e| e.strip_prefix(b"BILLET_CACHE_TOKEN="))
            {
                return Ok(String::from_utf8_lossy(t).into_owned());
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
    let guests = Guests::start(pb::StickyPublication::Cas, 6000, &[]).await?;
    let cluster = &guests.cluster;
    let cache = cache_dir(cluster);
    let first = cluster.queue_jobs(1);
    let socket_a = one_socket(&cache, None).await?;
    let token_a = token_of_the_runner(cluster).await?;
    let (status, volumes) = call(&socket_a, Some(&token_a), "GET", "/v1/volumes").await?;
    assert_eq!(status, 200, "{volumes}");
    assert_eq!(volumes["volumes"][0]["key"], KEY);
    cluster.wait_jobs_completed(&first, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    wait_until(TIMEOUT, "the first session to close", || !socket_a.exists()).await?;
    assert_eq!(guests.told(1).await?, vec![committed(1)]);
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
    assert_eq!(guests.told(2).await?, vec![committed(1), committed(2)]);
    assert_eq!(
        published(&cache),
        Some(Published {
            head: Some(2),
            next: 3,
            counter: Some("2".into())
        })
    );
    guests.cluster.shutdown().await.context("shutdown")
}

/// Eviction under pressure (`--cache-max-bytes` of 1 byte) removes an
/// older generation no job has mounted and never the one a running job
/// mounted, although it is the least recently used: the job commits what
/// it cloned from it. A node without an eviction pass never removes
/// anything ("an eviction pass" times out).
#[tokio::test]
async fn eviction_under_pressure_removes_unmounted_generations_and_never_a_mounted_one()
-> Result<()> {
    let root = billet_tests::cluster::scratch_dir("cache-evict")?;
    let deployment = format!("dep{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let cache = root.join("state-node-1").join("cache");
    const OTHER: &str = "e2e-other";
    let dirs = seed(
        &cache,
        &deployment,
        &[(KEY, b"1\n".as_slice()), (OTHER, &[7u8; 64 << 10])],
    )
    .await?;
    let guests = Guests::start_with(pb::StickyPublication::Cas, 20_000, &[], |o| {
        o.state_root = Some(root.clone());
        o.deployment = Some(deployment.clone());
        o.node_env.extend([
            ("BILLET_CACHE_MAX_BYTES".to_owned(), "1".to_owned()),
            (
                "BILLET_CACHE_EVICT_INTERVAL_SECS".to_owned(),
                "10".to_owned(),
            ),
        ]);
    })
    .await?;
    let cluster = &guests.cluster;
    let jobs = cluster.queue_jobs(1);
    wait_until(TIMEOUT, "the job's disk to be mounted", || {
        node_log(cluster).contains("sticky disk mounted")
    })
    .await?;
    wait_until(TIMEOUT, "an eviction pass", || {
        node_log(cluster).contains("cache eviction pass")
    })
    .await
    .with_context(|| format!("node log:\n{}", node_log(cluster)))?;
    let log = node_log(cluster);
    let (mounted, pass) = (
        log.find("sticky disk mounted").unwrap_or(usize::MAX),
        log.find("cache eviction pass").unwrap_or(0),
    );
    assert!(
        mounted < pass,
        "the first pass ran before the job mounted its disk: start-up was slower than the 10 s interval\n{log}"
    );
    assert_eq!(generations(&cache, OTHER), Vec::<u64>::new(), "{log}");
    assert!(!dirs[1].exists(), "the unmounted generation's tree is gone");
    assert_eq!(
        generations(&cache, KEY),
        [1],
        "the mounted one stays: {log}"
    );
    assert!(dirs[0].join("n").exists());
    assert!(
        log.contains("still holds more than --cache-max-bytes"),
        "the node says why the cache stays over its bound:\n{log}"
    );
    cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    assert_eq!(guests.mounted(1).await?[0]["generation"], 1);
    // It read 1 from its clone of generation 1 and published 2.
    assert_eq!(guests.told(1).await?, vec![committed(2)]);
    assert!(node_log(cluster).contains("sticky-disk generation evicted"));
    guests.cluster.shutdown().await.context("shutdown")?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

/// A mount that fails (the generation's tree is lost under the store, so
/// the clone fails) gives the job an empty directory that is never
/// committed, and the job runs and succeeds: its guest is told the disk
/// was a fallback, and the key keeps its head.
#[tokio::test]
async fn a_failed_mount_gives_the_job_an_empty_uncommittable_directory_and_the_job_succeeds()
-> Result<()> {
    let root = billet_tests::cluster::scratch_dir("cache-fallback")?;
    let deployment = format!("dep{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let cache = root.join("state-node-1").join("cache");
    let dirs = seed(&cache, &deployment, &[(KEY, b"41\n".as_slice())]).await?;
    std::fs::remove_dir_all(&dirs[0])?;
    let guests = Guests::start_with(pb::StickyPublication::Cas, 500, &[], |o| {
        o.state_root = Some(root.clone());
        o.deployment = Some(deployment.clone());
    })
    .await?;
    let cluster = &guests.cluster;
    run_jobs(cluster, 1).await?;
    let mounted = guests.mounted(1).await?;
    assert_eq!(
        (
            &mounted[0]["fallback"],
            &mounted[0]["cache_hit"],
            &mounted[0]["generation"]
        ),
        (
            &serde_json::json!(true),
            &serde_json::json!(false),
            &serde_json::Value::Null
        ),
        "a fallback was cloned from no generation: {mounted:?}"
    );
    assert_eq!(
        guests.told(1).await?,
        vec![serde_json::json!({"outcome": "fallback", "published": false, "reason": "fallback"})]
    );
    let log = node_log(cluster);
    assert!(
        log.contains("cannot clone the sticky disk"),
        "the node says why:\n{log}"
    );
    // The job ran on and succeeded (its runner counted from an empty disk).
    let state = cluster.emulator.state();
    assert!(
        state
            .jobs
            .iter()
            .all(|j| j.result.as_deref() == Some("succeeded")),
        "{:?}",
        state.jobs
    );
    assert_eq!(
        observations(cluster, 1).await?,
        ["hits=0 misses=0 bytes_restored=0 bytes_committed=0 conflicts=0 fallbacks=1"]
    );
    assert_eq!(
        generations(&cache, KEY),
        [1],
        "nothing was published: {log}"
    );
    guests.cluster.shutdown().await.context("shutdown")?;
    let _ = std::fs::remove_dir_all(&root);
    Ok(())
}

/// A commit on a full file system (the cache directory a 48 MiB tmpfs,
/// which the job fills through its disk) fails: the guest is told the
/// cache was unavailable, the key's head stays at the previous generation,
/// whole, and what the commit had made and the job's disk are collected,
/// so the space is free again.
#[tokio::test]
async fn a_commit_on_a_full_cache_disk_leaves_the_head_at_the_previous_generation_and_frees_the_space()
-> Result<()> {
    let small = billet_tests::scratchfs::ScratchFs::tmpfs(48)?;
    let deployment = format!("dep{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let cache = small.path.join("cache");
    seed(&cache, &deployment, &[(KEY, b"1\n".as_slice())]).await?;
    let guests = Guests::start_with(
        pb::StickyPublication::Cas,
        500,
        &["BILLET_STANDIN_STICKY_FILL=true"],
        |o| {
            o.deployment = Some(deployment.clone());
            o.node_env
                .push(("BILLET_CACHE_DIR".to_owned(), cache.display().to_string()));
        },
    )
    .await?;
    let cluster = &guests.cluster;
    let jobs = cluster.queue_jobs(1);
    cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    wait_until(TIMEOUT, "the mounts to be settled", || {
        open_mounts(&cache) == 0
    })
    .await?;
    assert_eq!(
        guests.told(1).await?,
        vec![
            serde_json::json!({"outcome": "unavailable", "published": false, "reason": "cache unavailable"})
        ]
    );
    let log = node_log(cluster);
    assert_eq!(
        published(&cache),
        at(1, "1"),
        "the head and its tree are as they were:\n{log}"
    );
    assert_eq!(generations(&cache, KEY), [1]);
    assert_eq!(
        std::fs::read_dir(cache.join("trash"))?.count(),
        0,
        "nothing half-made is left"
    );
    // The space the job and the failed commit took is free again.
    let probe = small.path.join("probe");
    std::fs::write(&probe, vec![1u8; 32 << 20]).context("32 MiB of the 48 are free again")?;
    std::fs::remove_file(&probe)?;
    guests.cluster.shutdown().await.context("shutdown")
}

/// A node killed and started again while a job has its disk mounted still
/// owns the mount: the job's guest commits through the restarted node's
/// API and the commit is published.
#[tokio::test]
async fn a_node_restarted_while_a_job_has_its_disk_mounted_still_commits_it() -> Result<()> {
    let mut guests = Guests::start(pb::StickyPublication::Cas, 12_000, &[]).await?;
    let cache = cache_dir(&guests.cluster);
    let jobs = guests.cluster.queue_jobs(1);
    wait_until(TIMEOUT, "the job's disk to be mounted", || {
        node_log(&guests.cluster).contains("sticky disk mounted")
    })
    .await?;
    guests
        .cluster
        .nodes
        .get_mut("node-1")
        .context("node-1")?
        .restart()
        .await?;
    let cluster = &guests.cluster;
    cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    wait_until(TIMEOUT, "the mounts to be settled", || {
        open_mounts(&cache) == 0
    })
    .await?;
    assert_eq!(guests.told(1).await?, vec![committed(1)]);
    assert_eq!(
        published(&cache),
        at(1, "1"),
        "node log:\n{}",
        node_log(cluster)
    );
    guests.cluster.shutdown().await.context("shutdown")
}

/// On an XFS made with `reflink=1` (loop-mounted here; this machine's
/// own disks are ext4) the store says so when it opens, a mount is a
/// reflink of every file, and what the job writes reaches its clone
/// only: the generation it was cloned from stays as it was.
#[tokio::test]
async fn on_xfs_with_reflinks_a_mount_shares_the_generations_extents_and_writes_reach_the_clone_only()
-> Result<()> {
    use billet_agent::cache::clone::CloneMethod;
    use billet_agent::cache::{DiskKey, Generation, Policy, Store};
    let xfs = billet_tests::scratchfs::ScratchFs::xfs_reflink(&std::env::temp_dir(), 1)?;
    let cache = xfs.path.join("cache");
    let dirs = seed(&cache, "dev", &[(KEY, b"1\n".as_slice())]).await?;
    // 64 MiB more in the generation, written before the store opens again.
    std::fs::write(dirs[0].join("blob"), vec![3u8; 64 << 20])?;
    let store = Store::open(
        &cache,
        "dev",
        std::sync::Arc::new(billet_agent::journal::MemoryJournal::default()),
    )
    .await?;
    assert_eq!(
        (store.filesystem().kind.as_str(), store.filesystem().reflink),
        ("xfs", true)
    );
    let lease = billet_agent::model::LeaseId::parse("lease", "l1")?;
    let key = DiskKey::parse(KEY)?;
    let mount = store.mount(&lease, &key, Policy::Cas).await?;
    assert_eq!(
        (mount.parent, mount.method),
        (Some(Generation(1)), Some(CloneMethod::Reflink))
    );
    std::fs::write(mount.dir.join("n"), "2\n")?;
    std::fs::write(mount.dir.join("blob"), b"changed")?;
    assert_eq!(std::fs::read_to_string(dirs[0].join("n"))?, "1\n");
    assert_eq!(std::fs::metadata(dirs[0].join("blob"))?.len(), 64 << 20);
    store.discard(&mount.id).await?;
    drop(store);
    Ok(())
}
