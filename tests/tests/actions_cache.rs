//! The transparent Actions cache end to end: a real `billet node` with
//! its proxy on loopback, the stub plane, the emulator as GitHub, a fake
//! results service behind the proxy (`billet_tests::results`) and the
//! stand-in runner in real Docker containers, using the cache through the
//! proxy as `@actions/cache` does (`BILLET_STANDIN_ACTIONS_CACHE`) and
//! reporting what it got to the test's sink (`GuestReports`).

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, wait_until};
use billet_tests::reports::GuestReports;
use billet_tests::results::{FakeResults, UPSTREAM_STATUS};

const KEY: &str = "npm-linux-e2e";
const TIMEOUT: Duration = Duration::from_secs(120);

fn scope() -> pb::CacheScope {
    pb::CacheScope {
        owner: "octo".into(),
        repository: "app".into(),
        workflow_ref: "octo/app/.github/workflows/ci.yml@refs/heads/main".into(),
    }
}

struct Setup {
    cluster: Cluster,
    reports: GuestReports,
    results: FakeResults,
    _dir: tempdir::Dir,
}

mod tempdir {
    /// A scratch directory removed on drop.
    pub struct Dir(pub std::path::PathBuf);
    impl Drop for Dir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
}

async fn start(actions_cache: Option<pb::CacheScope>) -> Result<Setup> {
    start_with(actions_cache, |_| Vec::new(), Vec::new()).await
}

/// As [`start`], with more tier environment, made knowing the sink, and
/// more node environment.
async fn start_with(
    actions_cache: Option<pb::CacheScope>,
    more_env: impl FnOnce(&GuestReports) -> Vec<String>,
    more_node_env: Vec<(String, String)>,
) -> Result<Setup> {
    let dir =
        std::env::temp_dir().join(format!("billet-actions-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    let dir = tempdir::Dir(dir);
    let results = FakeResults::start(&dir.0).await?;
    let reports = GuestReports::start().await?;
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 200,
        tier_env: [format!("BILLET_STANDIN_ACTIONS_CACHE={KEY}"), reports.env()]
            .into_iter()
            .chain(more_env(&reports))
            .collect(),
        node_env: results
            .node_env()
            .into_iter()
            .chain(more_node_env)
            .collect(),
        actions_cache,
        ..ClusterOptions::default()
    })
    .await?;
    Ok(Setup {
        cluster,
        reports,
        results,
        _dir: dir,
    })
}

impl Setup {
    /// The operator's kill switch: `billet-plane cache disable|enable
    /// --repository octo/app`, the real binary on the ledger the cluster's
    /// plane reads.
    fn switch(&self, state: &str) -> Result<()> {
        let out = std::process::Command::new(billet_tests::image::binary_path("billet-plane")?)
            .arg("--ledger")
            .arg(self.cluster.dir.join("ledger.db"))
            .args(["cache", state, "--repository", "octo/app"])
            .env_remove("BILLET_LEDGER")
            .output()
            .context("run billet-plane cache")?;
        ensure!(
            out.status.success(),
            "billet-plane cache {state}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(())
    }

    /// The node's Actions cache uploads directory.
    fn uploads(&self) -> PathBuf {
        self.cluster
            .dir
            .join("state-node-1")
            .join("cache")
            .join("actions")
            .join("uploads")
    }

    async fn run_one(&self) -> Result<()> {
        let jobs = self.cluster.queue_jobs(1);
        self.cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
        self.cluster.wait_clean(TIMEOUT).await
    }

    fn node_log(&self) -> String {
        self.cluster.nodes["node-1"].log_text()
    }

    async fn report(&self, kind: &str, n: usize) -> Result<serde_json::Value> {
        let all = self
            .reports
            .wait_for(kind, n, TIMEOUT)
            .await
            .with_context(|| format!("node log:\n{}", self.node_log()))?;
        Ok(all[n - 1].clone())
    }
}

#[tokio::test]
async fn a_job_saves_an_actions_cache_entry_the_next_restores_locally_and_everything_else_reaches_github()
-> Result<()> {
    let s = start(Some(scope())).await?;
    s.run_one().await?;
    let saved = s.report("actions-save", 1).await?;
    assert_eq!(saved["local"], true, "{saved}");
    assert_eq!(saved["put_status"], 201, "{saved}");
    assert_eq!(saved["ok"], true, "{saved}");
    s.run_one().await?;
    let restored = s.report("actions-restore", 1).await?;
    assert_eq!(restored["hit"], true, "{restored}");
    assert_eq!(restored["matched_key"], KEY);
    assert_eq!(
        restored["local"], true,
        "X-Billet-Actions-Cache: local on each answer"
    );
    assert_eq!(restored["range_status"], 206);
    // "billet actions cache payload of ..."[2..=8]
    assert_eq!(restored["range"], "llet ac");
    assert_eq!(restored["whole_matches"], true);
    assert_eq!(
        restored["direct"], true,
        "the download URL is on the node's listener, fetched from the container without a tunnel: {restored}"
    );
    // Each job's artifact call and BuildKit cache call went to GitHub.
    for n in [1, 2] {
        let probe = s.report("actions-probe", n).await?;
        assert_eq!(probe["artifact_status"], UPSTREAM_STATUS, "{probe}");
        assert_eq!(probe["artifact_local"], false);
        assert_eq!(probe["buildkit_status"], UPSTREAM_STATUS, "{probe}");
        assert_eq!(probe["buildkit_local"], false);
    }
    let seen = s.results.seen();
    assert_eq!(seen.len(), 4, "only the probes reached GitHub: {seen:#?}");
    let artifact = seen
        .iter()
        .find(|r| r.head.contains("ArtifactService/CreateArtifact"))
        .context("the artifact call reached GitHub")?;
    assert!(
        artifact
            .head
            .contains("Authorization: Bearer runtime-token")
    );
    assert_eq!(artifact.body, br#"{"name":"logs"}"#);
    let buildkit = seen
        .iter()
        .find(|r| r.head.contains("User-Agent: buildkit/v0.20"))
        .context("the BuildKit call reached GitHub")?;
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&buildkit.body)?,
        serde_json::json!({"key": KEY, "version": "v1"})
    );
    // The guest's proxy URL carries its token (`billet:<token>@`): never
    // in the node's log. (`billet: ` with a space is the binary's own log
    // target.)
    let log = s.node_log();
    let credentials: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.match_indices("billet:").any(|(i, m)| {
                l[i + m.len()..]
                    .chars()
                    .next()
                    .is_some_and(|c| !c.is_whitespace())
            })
        })
        .collect();
    assert!(
        credentials.is_empty(),
        "a proxy credential in the log: {credentials:?}"
    );
    Ok(())
}

#[tokio::test]
async fn a_tier_that_does_not_opt_in_gets_no_proxy() -> Result<()> {
    let s = start(None).await?;
    s.run_one().await?;
    let told = s.report("actions", 1).await?;
    assert!(
        told["error"]
            .as_str()
            .is_some_and(|e| e.contains("BILLET_ACTIONS_PROXY is unset")),
        "{told}"
    );
    assert!(s.results.seen().is_empty());
    Ok(())
}

/// The kill switch turned off mid-run (spec/cache.md §5.2; §7.2 13 end to
/// end). A job saves through the proxy (answered locally) and holds a signed
/// download URL and a signed upload URL; the operator then disables the
/// cache for its repository with the real `billet-plane cache disable`, and
/// from then on that job's calls are not answered locally: the held URLs get
/// a local 502 (GitHub never issued them) and write nothing, a fresh lookup
/// reaches GitHub unchanged. Enabled again, the same URLs and lookups are
/// served locally, and the job succeeds.
#[tokio::test]
async fn the_kill_switch_turned_off_mid_run_sends_the_jobs_cache_calls_to_github_and_on_again_serves_them_locally()
-> Result<()> {
    let s = start_with(
        Some(scope()),
        |reports| {
            vec![
                "BILLET_STANDIN_ACTIONS_ROUNDS=2".into(),
                reports.gates_env(),
            ]
        },
        Vec::new(),
    )
    .await?;
    let jobs = s.cluster.queue_jobs(1);
    let saved = s.report("actions-save", 1).await?;
    assert_eq!(saved["local"], true, "{saved}");
    assert_eq!(saved["ok"], true, "{saved}");
    let held = s.report("actions-held", 1).await?;
    assert_eq!(held["lookup_ok"], true, "{held}");
    assert_eq!(held["lookup_local"], true, "{held}");
    assert_eq!(held["create_ok"], true, "{held}");
    assert_eq!(held["create_local"], true, "{held}");
    let before = s.results.seen().len();

    // The job is running, holding both URLs: the operator turns the cache
    // off for its repository.
    s.switch("disable")?;
    s.reports.open("actions-round-1");
    let off = s.report("actions-round", 1).await?;
    assert_eq!(
        off["download_status"], 502,
        "the issued download URL: {off}"
    );
    assert_eq!(off["download_local"], true, "{off}");
    assert_eq!(off["upload_status"], 502, "the issued upload URL: {off}");
    assert_eq!(off["upload_local"], true, "{off}");
    assert_eq!(
        off["lookup_status"], UPSTREAM_STATUS,
        "a fresh lookup goes to GitHub: {off}"
    );
    assert_eq!(off["lookup_local"], false, "{off}");
    // The refused upload wrote no archive.
    let written: Vec<PathBuf> = std::fs::read_dir(s.uploads())?
        .filter_map(|e| e.ok().map(|e| e.path().join("archive")))
        .filter(|a| a.exists())
        .collect();
    assert!(
        written.is_empty(),
        "an upload refused by the kill switch wrote {written:?}"
    );
    // Only the lookup reached GitHub, unchanged; no signed URL ever did.
    let seen = s.results.seen();
    assert_eq!(seen.len(), before + 1, "{seen:#?}");
    let lookup = &seen[before];
    assert!(
        lookup.head.starts_with(
            "POST /twirp/github.actions.results.api.v1.CacheService/GetCacheEntryDownloadURL "
        ),
        "{lookup:?}"
    );
    assert!(lookup.head.contains("Authorization: Bearer runtime-token"));
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&lookup.body)?,
        serde_json::json!({"key": KEY, "restore_keys": [], "version": "v1"})
    );

    // On again: the same URLs and a fresh lookup are served locally.
    s.switch("enable")?;
    s.reports.open("actions-round-2");
    let on = s.report("actions-round", 2).await?;
    assert_eq!(on["download_status"], 200, "{on}");
    assert_eq!(on["download_local"], true, "{on}");
    assert_eq!(on["download_matches"], true, "{on}");
    assert_eq!(on["upload_status"], 201, "{on}");
    assert_eq!(on["upload_local"], true, "{on}");
    assert_eq!(on["lookup_status"], 200, "{on}");
    assert_eq!(on["lookup_local"], true, "{on}");
    assert_eq!(on["lookup_ok"], true, "{on}");
    let finalized = s.report("actions-finalize", 1).await?;
    assert_eq!(finalized["local"], true, "{finalized}");
    assert_eq!(finalized["ok"], true, "{finalized}");
    assert_eq!(
        s.results.seen().len(),
        before + 1,
        "nothing more reached GitHub"
    );
    assert!(
        s.reports.of("actions").is_empty(),
        "{:#?}",
        s.reports.of("actions")
    );

    // The job succeeded whatever the cache did.
    s.cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    let state = s.cluster.emulator.state();
    let job = state
        .jobs
        .iter()
        .find(|j| j.id == jobs[0])
        .context("the job")?;
    assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
    s.cluster.wait_clean(TIMEOUT).await
}

/// The published archives under the node's cache directory (each entry's
/// `archive`).
fn published(s: &Setup) -> Vec<PathBuf> {
    let entries = s.cluster.dir.join("state-node-1/cache/actions/entries");
    let mut found = Vec::new();
    for scope in std::fs::read_dir(entries).into_iter().flatten().flatten() {
        for version in std::fs::read_dir(scope.path())
            .into_iter()
            .flatten()
            .flatten()
        {
            for entry in std::fs::read_dir(version.path())
                .into_iter()
                .flatten()
                .flatten()
            {
                let archive = entry.path().join("archive");
                if archive.exists() {
                    found.push(archive);
                }
            }
        }
    }
    found
}

/// Actions cache archives are evicted by the cache's pass under pressure
/// (`--cache-max-bytes` of 1 byte, a pass every second), never one a
/// running job reads: a job saves an archive and holds a download of it;
/// the node is restarted with the pressure on (its proxy on a fixed port,
/// so the job's proxy URL stays good) and passes keep the archive, because
/// the session's download link came back from the journal; the job's held
/// download is still served locally. Once the job has ended (its session
/// closed) the archive goes, and the next job's lookup misses; its save,
/// over the budget, is refused before it is written.
#[tokio::test]
async fn under_pressure_an_archive_a_running_job_reads_stays_across_a_restart_and_goes_once_the_job_ends()
-> Result<()> {
    let proxy = billet_tests::cluster::free_port()?;
    let mut s = start_with(
        Some(scope()),
        |reports| {
            vec![
                "BILLET_STANDIN_ACTIONS_ROUNDS=1".into(),
                reports.gates_env(),
            ]
        },
        vec![("BILLET_CACHE_PROXY_LISTEN".into(), proxy.to_string())],
    )
    .await?;
    let jobs = s.cluster.queue_jobs(1);
    let saved = s.report("actions-save", 1).await?;
    assert_eq!(saved["local"], true, "{saved}");
    assert_eq!(saved["ok"], true, "{saved}");
    let held = s.report("actions-held", 1).await?;
    assert_eq!(held["lookup_ok"], true, "{held}");
    assert_eq!(published(&s).len(), 1);

    // The job reads its archive; the node restarts with the pressure on.
    let node = s.cluster.nodes.get_mut("node-1").context("node-1")?;
    node.set_env("BILLET_CACHE_MAX_BYTES", "1");
    node.set_env("BILLET_CACHE_EVICT_INTERVAL_SECS", "1");
    let before = s.node_log().len();
    s.cluster
        .nodes
        .get_mut("node-1")
        .context("node-1")?
        .restart()
        .await?;
    wait_until(TIMEOUT, "two eviction passes after the restart", || {
        s.node_log()[before..]
            .matches("cache eviction pass")
            .count()
            >= 2
    })
    .await
    .with_context(|| s.node_log())?;
    let log = s.node_log()[before..].to_owned();
    assert!(log.contains("kept_in_use=1"), "{log}");
    assert!(!log.contains("Actions cache archive evicted"), "{log}");
    assert_eq!(published(&s).len(), 1, "the archive the job reads stays");
    s.reports.open("actions-round-1");
    let round = s.report("actions-round", 1).await?;
    assert_eq!(round["download_status"], 200, "{round}");
    assert_eq!(round["download_local"], true, "{round}");
    assert_eq!(round["download_matches"], true, "{round}");

    // The job ends and its session closes: the archive goes.
    s.cluster.wait_jobs_completed(&jobs, TIMEOUT).await?;
    s.cluster.wait_clean(TIMEOUT).await?;
    wait_until(TIMEOUT, "the archives to be evicted", || {
        published(&s).is_empty()
    })
    .await
    .with_context(|| s.node_log())?;
    assert!(
        s.node_log()[before..].contains(&format!("Actions cache archive evicted key={KEY} ")),
        "{}",
        s.node_log()
    );

    // The next job misses, and its save does not fit the budget: it is
    // refused before a byte is written, and nothing is published.
    let next = s.cluster.queue_jobs(1);
    let saved = s.report("actions-save", 2).await?;
    assert_eq!(saved["hit"], false, "{saved}");
    assert_eq!(saved["local"], true, "{saved}");
    assert_eq!(saved["put_status"], 507, "{saved}");
    assert!(published(&s).is_empty());
    s.reports.open("actions-round-1");
    s.cluster.wait_jobs_completed(&next, TIMEOUT).await?;
    s.cluster.wait_clean(TIMEOUT).await
}
