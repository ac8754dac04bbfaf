//! The Docker image store and trust classes end to end: real `billet node`
//! processes, the stub plane, the emulator as GitHub and the stand-in
//! runner in real Docker containers.
//!
//! The tier opts into the image store (`TierSpec.docker_image_store`) and
//! names one sticky disk. Each stand-in plays the guest agent
//! (`BILLET_STANDIN_DOCKER_STORE`): it asks for the store when its job
//! starts and counts the stand-in "images" on it (a counter file in
//! /var/lib/docker), and once its job is completed says the store is ready
//! with a clean-unmount proof (`ready`) or exits without a word (`never`).
//! What was published is read off the node's cache directory; what each
//! guest was told, from the reports it sent the test's sink.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until};
use billet_tests::reports::GuestReports;

const KEY: &str = "e2e-trust-counter";
const DISK: &str = "/cache/counter";
const TIMEOUT: Duration = Duration::from_secs(120);

/// The image store's key on this machine.
fn images_key() -> String {
    let arch = match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    };
    format!("docker-images/{arch}")
}

/// How a test's cluster differs from the trusted default.
struct Setup<'a> {
    trust: &'a str,
    /// `ready` or `never`.
    guest: &'a str,
    env: &'a [&'a str],
    /// Shared with clusters run before or after: the deployment and the
    /// node's cache directory.
    shared: Option<(&'a str, &'a Path)>,
    /// The tier's network; an untrusted tier may not have the host's.
    network: &'a str,
}

impl Default for Setup<'_> {
    fn default() -> Self {
        Self {
            trust: "trusted",
            guest: "ready",
            env: &[],
            shared: None,
            network: "host",
        }
    }
}

async fn start(setup: &Setup<'_>, reports: &GuestReports) -> Result<Cluster> {
    let mut node_env = Vec::new();
    if setup.trust == "untrusted" {
        node_env.push(("BILLET_ISOLATED_CONTAINERS".to_owned(), "true".to_owned()));
    }
    if let Some((_, cache)) = setup.shared {
        node_env.push(("BILLET_CACHE_DIR".to_owned(), cache.display().to_string()));
    }
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 500,
        sticky_disks: vec![pb::StickyDisk {
            key: KEY.into(),
            path: DISK.into(),
            publication: pb::StickyPublication::Cas.into(),
        }],
        docker_image_store: true,
        tier_trust: setup.trust.into(),
        tier_network: setup.network.into(),
        deployment: setup.shared.map(|(d, _)| d.to_owned()),
        node_env,
        tier_env: [
            format!("BILLET_STANDIN_STICKY={DISK}/n"),
            format!("BILLET_STANDIN_DOCKER_STORE={}", setup.guest),
            "BILLET_STANDIN_READY_WAIT_MS=4000".into(),
            reports.env(),
        ]
        .into_iter()
        .chain(setup.env.iter().map(|e| (*e).to_owned()))
        .collect(),
        ..ClusterOptions::default()
    })
    .await?;
    anyhow::ensure!(
        cluster.emulator.addr().ip() == reports.addr().ip(),
        "the sink is not where the emulator is"
    );
    Ok(cluster)
}

fn cache_dir(cluster: &Cluster, setup: &Setup<'_>) -> PathBuf {
    setup.shared.map_or_else(
        || cluster.dir.join("state-node-1").join("cache"),
        |(_, c)| c.to_owned(),
    )
}

/// A key's head, its next generation number and a file at its head.
#[derive(Debug, PartialEq, Eq)]
struct Published {
    head: Option<u64>,
    next: u64,
    file: Option<String>,
}

fn published(cache: &Path, key: &str, file: &str) -> Option<Published> {
    for entry in std::fs::read_dir(cache.join("keys")).ok()? {
        let dir = entry.ok()?.path();
        let Ok(bytes) = std::fs::read(dir.join("state.json")) else {
            continue;
        };
        let state: serde_json::Value = serde_json::from_slice(&bytes).ok()?;
        if state["key"] != key {
            continue;
        }
        let head = state["head"].as_u64();
        return Some(Published {
            head,
            next: state["next"].as_u64()?,
            file: head.and_then(|g| {
                std::fs::read_to_string(dir.join("g").join(g.to_string()).join(file))
                    .ok()
                    .map(|c| c.trim().to_owned())
            }),
        });
    }
    None
}

fn images(cache: &Path) -> Option<Published> {
    published(cache, &images_key(), "billet-standin-images")
}

fn counter(cache: &Path) -> Option<Published> {
    published(cache, KEY, "n")
}

fn generation(head: u64, file: &str) -> Option<Published> {
    Some(Published {
        head: Some(head),
        next: head + 1,
        file: Some(file.into()),
    })
}

/// Runs one job and waits until it is complete, its compute gone and its
/// mounts settled.
async fn run_job(cluster: &Cluster, cache: &Path) -> Result<()> {
    let jobs = cluster.queue_jobs(1);
    cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    cluster.wait_clean(TIMEOUT).await?;
    wait_until(TIMEOUT, "the mounts to be settled", || {
        std::fs::read_dir(cache.join("mounts")).map_or(0, Iterator::count) == 0
    })
    .await
    .with_context(|| format!("node log:\n{}", cluster.nodes["node-1"].log_text()))
}

/// The `n`th report of `kind` (from 0), once there is one.
async fn report(reports: &GuestReports, kind: &str, n: usize) -> Result<serde_json::Value> {
    Ok(reports.wait_for(kind, n + 1, TIMEOUT).await?.remove(n))
}

#[tokio::test]
async fn a_trusted_succeeded_job_whose_guest_said_ready_publishes_the_image_store() -> Result<()> {
    let reports = GuestReports::start().await?;
    let setup = Setup::default();
    let cluster = start(&setup, &reports).await?;
    let cache = cache_dir(&cluster, &setup);
    run_job(&cluster, &cache).await?;
    let log = cluster.nodes["node-1"].log_text();
    let asked = report(&reports, "docker-store", 0).await?;
    assert_eq!(
        (
            &asked["status"],
            &asked["answer"]["slot"],
            &asked["answer"]["path"],
            &asked["answer"]["cold"],
            &asked["images_found"]
        ),
        (
            &serde_json::json!(200),
            &serde_json::json!(0),
            &serde_json::json!("/var/lib/docker"),
            &serde_json::json!(true),
            &serde_json::json!(0)
        ),
        "{asked}"
    );
    let ready = report(&reports, "docker-ready", 0).await?;
    assert_eq!(ready["status"], 200, "{ready}\nnode log:\n{log}");
    assert_eq!(images(&cache), generation(1, "1"), "node log:\n{log}");
    assert_eq!(counter(&cache), generation(1, "1"));
    // The next job pulls nothing it has seen: it finds the images.
    run_job(&cluster, &cache).await?;
    let asked = report(&reports, "docker-store", 1).await?;
    assert_eq!(
        (&asked["answer"]["generation"], &asked["images_found"]),
        (&serde_json::json!(1), &serde_json::json!(1)),
        "{asked}"
    );
    assert_eq!(images(&cache), generation(2, "2"));
    cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn a_failed_job_publishes_no_image_store_though_its_guest_asks_to_be_ready() -> Result<()> {
    let reports = GuestReports::start().await?;
    let setup = Setup {
        env: &["BILLET_STANDIN_RESULT=failed"],
        ..Setup::default()
    };
    let cluster = start(&setup, &reports).await?;
    let cache = cache_dir(&cluster, &setup);
    run_job(&cluster, &cache).await?;
    let ready = report(&reports, "docker-ready", 0).await?;
    assert_eq!(ready["status"], 409, "settlement never opened: {ready}");
    let log = cluster.nodes["node-1"].log_text();
    assert!(log.contains("sticky disk mounted"), "{log}");
    assert_eq!(images(&cache), None, "node log:\n{log}");
    assert_eq!(counter(&cache), None);
    cluster.shutdown().await.context("shutdown")
}

#[tokio::test]
async fn a_guest_that_never_says_ready_publishes_no_image_store() -> Result<()> {
    let reports = GuestReports::start().await?;
    let setup = Setup {
        guest: "never",
        ..Setup::default()
    };
    let cluster = start(&setup, &reports).await?;
    let cache = cache_dir(&cluster, &setup);
    run_job(&cluster, &cache).await?;
    let log = cluster.nodes["node-1"].log_text();
    assert!(
        log.contains("Docker image store settlement opened"),
        "the succeeded job's settlement opened: {log}"
    );
    assert_eq!(images(&cache), None, "node log:\n{log}");
    // The job's sticky disk is its own: it publishes.
    assert_eq!(counter(&cache), generation(1, "1"));
    cluster.shutdown().await.context("shutdown")
}

/// An untrusted job (on a node whose operator vouches for its containers'
/// isolation) reads what trusted jobs published and publishes nothing,
/// neither its sticky disk nor its image store; the next trusted job finds
/// the old heads.
#[tokio::test]
async fn an_untrusted_job_publishes_nothing_and_the_next_trusted_job_finds_the_old_heads()
-> Result<()> {
    // Both tiers on the bridge, where the untrusted one must be, so the
    // emulator and the sink are where both reach them.
    let docker = billet_tests::image::connect_docker().await?;
    let gateway = billet_tests::cluster::bridge_gateway(&docker).await?;
    let reports = GuestReports::start_on(gateway).await?;
    let shared_dir = std::env::temp_dir().join(format!(
        "billet-e2e-trust-{}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    ));
    std::fs::create_dir_all(&shared_dir)?;
    let deployment = format!("dep{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
    let cache = shared_dir.join("cache");
    let outcome = async {
        let trusted = Setup {
            shared: Some((&deployment, &cache)),
            network: "bridge",
            ..Setup::default()
        };
        let cluster = start(&trusted, &reports).await?;
        run_job(&cluster, &cache).await?;
        cluster.shutdown().await.context("shutdown")?;
        assert_eq!(counter(&cache), generation(1, "1"));
        assert_eq!(images(&cache), generation(1, "1"));

        let untrusted = Setup {
            trust: "untrusted",
            shared: Some((&deployment, &cache)),
            network: "bridge",
            ..Setup::default()
        };
        let cluster = start(&untrusted, &reports).await?;
        run_job(&cluster, &cache).await?;
        let log = cluster.nodes["node-1"].log_text();
        cluster.shutdown().await.context("shutdown")?;
        let mounted = report(&reports, "mounted", 1).await?;
        assert_eq!(
            (
                &mounted["volumes"][0]["generation"],
                &mounted["volumes"][0]["cache_hit"]
            ),
            (&serde_json::json!(1), &serde_json::json!(true)),
            "the untrusted job read the trusted generation: {mounted}"
        );
        let told = report(&reports, "commit", 1).await?;
        assert_eq!(
            told["told"],
            serde_json::json!({"outcome": "skipped", "published": false, "reason": "untrusted"}),
            "{told}"
        );
        let asked = report(&reports, "docker-store", 1).await?;
        assert_eq!(asked["images_found"], 1, "it read the images: {asked}");
        let ready = report(&reports, "docker-ready", 1).await?;
        assert_eq!(
            ready["status"], 409,
            "no settlement for an untrusted tier: {ready}"
        );
        assert_eq!(counter(&cache), generation(1, "1"), "node log:\n{log}");
        assert_eq!(images(&cache), generation(1, "1"), "node log:\n{log}");

        let cluster = start(&trusted, &reports).await?;
        run_job(&cluster, &cache).await?;
        cluster.shutdown().await.context("shutdown")?;
        let mounted = report(&reports, "mounted", 2).await?;
        assert_eq!(
            mounted["volumes"][0]["generation"], 1,
            "the next trusted job finds the old head: {mounted}"
        );
        let asked = report(&reports, "docker-store", 2).await?;
        assert_eq!(
            (&asked["answer"]["generation"], &asked["images_found"]),
            (&serde_json::json!(1), &serde_json::json!(1)),
            "{asked}"
        );
        assert_eq!(counter(&cache), generation(2, "2"));
        anyhow::Ok(())
    }
    .await;
    let _ = std::fs::remove_dir_all(&shared_dir);
    outcome
}
