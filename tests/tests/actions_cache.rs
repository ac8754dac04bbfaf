//! The transparent Actions cache end to end (issue #16 item 4): a real
//! `billet node` with its proxy on loopback, the stub plane, the emulator
//! as GitHub, a fake results service behind the proxy
//! (`billet_tests::results`) and the stand-in runner in real Docker
//! containers, using the cache through the proxy as `@actions/cache` does
//! (`BILLET_STANDIN_ACTIONS_CACHE`) and reporting what it got to the
//! test's sink (`GuestReports`).

use std::time::Duration;

use anyhow::{Context, Result};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions};
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
    let dir =
        std::env::temp_dir().join(format!("billet-actions-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir)?;
    let dir = tempdir::Dir(dir);
    let results = FakeResults::start(&dir.0).await?;
    let reports = GuestReports::start().await?;
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 200,
        tier_env: vec![format!("BILLET_STANDIN_ACTIONS_CACHE={KEY}"), reports.env()],
        node_env: results.node_env(),
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
    // The guest's proxy URL carries its token: never in the node's log.
    assert!(
        !s.node_log().contains("billet:"),
        "a proxy credential in the log"
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
