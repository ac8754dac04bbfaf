//! StartUpgrade end to end: real `billet` binaries installed the way an
//! operator installs them, a release source on disk, the stub plane sending
//! `StartUpgrade`, real Docker running the job the upgrade must not kill.
//! The "second build" is the same build stamped with another version by the
//! release tool (`agent/src/version.rs` says why).

use std::sync::atomic::Ordering;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use billet_agent::upgrade::release::{self, Artifact, Manifest};
use billet_agent::upgrade::updater::{JOURNAL_FILE, Record, Step};
use billet_controlplane_stub::node_link::NodeLink;
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, Installed, wait_until, write_script};
use billet_tests::systemd::SystemdHost;

const NODE: &str = "node-1";

async fn installed_cluster(work_ms: u64) -> Result<Cluster> {
    Cluster::start(ClusterOptions {
        installed: true,
        work_ms,
        ..ClusterOptions::default()
    })
    .await
}

fn installed(cluster: &Cluster) -> Result<Installed> {
    cluster
        .nodes
        .get(NODE)
        .and_then(|n| n.installed.clone())
        .context("the node is installed")
}

/// Writes release `version` (the current build, stamped) into the node's
/// release source; returns the manifest digest to pin.
fn publish(installed: &Installed, version: &str) -> Result<String> {
    installed.publish(version)
}

async fn start_upgrade(
    cluster: &Cluster,
    version: &str,
    digest: &str,
    generation: u64,
) -> Result<pb::CommandResult> {
    cluster
        .start_upgrade(NODE, version, digest, "rollout-e2e", generation)
        .await
}

fn journal(installed: &Installed) -> Result<Record> {
    let path = installed
        .state_dir
        .join(billet_agent::upgrade::updater::DIR)
        .join(JOURNAL_FILE);
    let bytes = std::fs::read(&path).with_context(|| format!("read {}", path.display()))?;
    Ok(serde_json::from_slice(&bytes)?)
}

/// Waits until the plane's current session with the node says `version` in
/// its `Hello`.
async fn wait_hello_version(cluster: &Cluster, version: &str, timeout: Duration) -> Result<()> {
    cluster.wait_hello_version(NODE, version, timeout).await
}

/// The node still runs a job after whatever the upgrade did, and the
/// cluster ends with nothing left.
async fn still_runs_jobs_and_ends_clean(cluster: Cluster) -> Result<()> {
    let jobs = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    cluster.shutdown().await
}

fn installed_version(installed: &Installed) -> Result<String> {
    billet_agent::upgrade::updater::binary_version(&installed.binary).map_err(anyhow::Error::msg)
}

fn assert_accepted(result: &pb::CommandResult) {
    assert_eq!(
        result.outcome,
        pb::Outcome::Ok as i32,
        "the updater refused: {:?}",
        result.error
    );
}

/// Publishes `<installed>-<suffix>`, queues one job, and once its
/// container runs sends StartUpgrade to that release, which the updater
/// must accept. Returns the installed node, the new version and the job.
async fn upgrade_during_a_job(
    cluster: &Cluster,
    suffix: &str,
) -> Result<(Installed, String, Vec<scaleset::JobRequestId>)> {
    let node = installed(cluster)?;
    let next = format!("{}-{suffix}", installed_version(&node)?);
    let digest = publish(&node, &next)?;
    let jobs = cluster.queue_jobs(1);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while cluster.containers().await?.is_empty() {
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the job's container never appeared"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let result = start_upgrade(cluster, &next, &digest, 1).await?;
    assert_accepted(&result);
    Ok((node, next, jobs))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_running_a_job_upgrades_to_a_new_release_without_killing_it() -> Result<()> {
    let cluster = installed_cluster(12_000).await?;
    let before = installed_version(&installed(&cluster)?)?;
    let (node, next, jobs) = upgrade_during_a_job(&cluster, "next.1").await?;

    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(180))
        .await?;
    let state = cluster.emulator.state();
    let job = state.jobs.iter().find(|j| j.id == jobs[0]).context("job")?;
    assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");

    wait_hello_version(&cluster, &next, Duration::from_secs(180)).await?;
    wait_until(Duration::from_secs(60), "the journal to say done", || {
        journal(&node).is_ok_and(|r| r.step == Step::Done)
    })
    .await?;
    assert_eq!(installed_version(&node)?, next);
    assert_eq!(
        billet_agent::upgrade::updater::binary_version(
            &billet_agent::upgrade::updater::previous_path(&node.binary)
        )
        .map_err(anyhow::Error::msg)?,
        before,
        "the previous release is kept beside the new one"
    );
    cluster.wait_clean(Duration::from_secs(60)).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_release_that_fails_its_health_check_is_rolled_back_and_the_previous_serves() -> Result<()>
{
    let cluster = installed_cluster(1_000).await?;
    let node = installed(&cluster)?;
    node.write_config(&node.start, 8)?;
    let before = installed_version(&node)?;
    // A release whose binary passes the updater's `--version` check and
    // then fails to serve.
    let broken = "9.9.9-broken";
    let dir = node.releases.join(broken);
    std::fs::create_dir_all(&dir)?;
    let script = format!(
        "#!/bin/sh\nif [ \"$1\" = --version ]; then echo 'billet {broken}'; exit 0; fi\necho 'this release cannot serve' >&2\nexit 1\n"
    );
    write_script(&dir.join("billet"), &script)?;
    let manifest = Manifest {
        version: broken.into(),
        artifacts: vec![Artifact {
            os: std::env::consts::OS.into(),
            arch: std::env::consts::ARCH.into(),
            path: "billet".into(),
            sha256: release::sha256_hex(script.as_bytes()),
        }],
    };
    let text = serde_json::to_vec(&manifest)?;
    std::fs::write(dir.join(release::MANIFEST_FILE), &text)?;

    let result = start_upgrade(&cluster, broken, &release::sha256_hex(&text), 1).await?;
    assert_accepted(&result);

    wait_until(
        Duration::from_secs(120),
        "the journal to say rolled back",
        || journal(&node).is_ok_and(|r| matches!(r.step, Step::RolledBack { .. })),
    )
    .await
    .with_context(|| cluster.nodes[NODE].log_text())?;
    let record = journal(&node)?;
    let Step::RolledBack { reason } = &record.step else {
        bail!("not rolled back: {record:?}");
    };
    assert!(
        reason.contains("did not report healthy") && reason.contains("which is serving"),
        "the updater reports why and that the previous release serves: {reason}"
    );
    assert_eq!(installed_version(&node)?, before);
    wait_hello_version(&cluster, &before, Duration::from_secs(60)).await?;
    let log = cluster.nodes[NODE].log_text();
    assert!(
        log.contains("rolling back"),
        "the updater's failure is in the node's log"
    );

    // The node still runs jobs after the rollback.
    still_runs_jobs_and_ends_clean(cluster).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_updater_killed_after_the_swap_ends_in_one_version_at_the_next_start() -> Result<()> {
    let cluster = installed_cluster(1_000).await?;
    let node = installed(&cluster)?;
    let before = installed_version(&node)?;
    let next = format!("{before}-next.2");
    let digest = publish(&node, &next)?;
    // The updater's start command hangs, so it is between the swap and the
    // health check when it is killed.
    let hang = node.start.with_file_name("start-hangs");
    write_script(&hang, "#!/bin/sh\nsleep 600\n")?;
    node.write_config(&hang, 60)?;

    let result = start_upgrade(&cluster, &next, &digest, 1).await?;
    assert_accepted(&result);
    wait_until(Duration::from_secs(120), "the swap", || {
        journal(&node).is_ok_and(|r| r.step == Step::Swapped)
    })
    .await
    .with_context(|| cluster.nodes[NODE].log_text())?;
    let pid = journal(&node)?.updater_pid;
    ensure!(pid > 1, "the journal names its updater");
    // The updater leads its own process group: kill it and its start
    // command together, as `kill -9` of a unit would.
    let killed = std::process::Command::new("kill")
        .args(["-s", "KILL", "--", &format!("-{pid}")])
        .status()?;
    ensure!(killed.success(), "kill -KILL -{pid}");
    wait_until(Duration::from_secs(10), "the updater to die", || {
        !billet_tests::cluster::alive(pid)
    })
    .await
    .with_context(|| std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default())?;
    assert_eq!(installed_version(&node)?, next, "killed after the swap");

    // The next start (a service manager's restart) settles it.
    billet_tests::cluster::run_script(&node.start).await?;
    wait_hello_version(&cluster, &before, Duration::from_secs(60)).await?;
    let record = journal(&node)?;
    assert!(
        matches!(record.step, Step::RolledBack { .. }),
        "the journal says rolled back: {record:?}"
    );
    assert_eq!(
        installed_version(&node)?,
        before,
        "one version on disk and serving"
    );
    still_runs_jobs_and_ends_clean(cluster).await
}

/// Starts an upgrade to `<installed>-<suffix>` with the plane kept from
/// dialing, and returns once the updater has started the new node: that
/// node cannot finish recovery until the plane dials again, so the updater
/// is certain to be waiting for its health. Returns the installed node, the
/// new version, and the link whose `hold_dial` lets the plane back.
async fn stalled_before_health(
    cluster: &Cluster,
    suffix: &str,
) -> Result<(Installed, String, std::sync::Arc<NodeLink>)> {
    let node = installed(cluster)?;
    let next = format!("{}-{suffix}", installed_version(&node)?);
    let digest = publish(&node, &next)?;
    let link = cluster.plane.node(NODE).context("node link")?.clone();
    link.faults.hold_dial.store(true, Ordering::SeqCst);
    let result = start_upgrade(cluster, &next, &digest, 1).await?;
    assert_accepted(&result);
    wait_until(
        Duration::from_secs(120),
        "the new node to be started",
        || journal(&node).is_ok_and(|r| r.step == Step::Started),
    )
    .await
    .with_context(|| cluster.nodes[NODE].log_text())?;
    Ok((node, next, link))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_updater_killed_while_its_new_node_comes_up_is_finished_by_settle_not_rolled_back()
-> Result<()> {
    let cluster = installed_cluster(1_000).await?;
    let (node, next, link) = stalled_before_health(&cluster, "next.3").await?;
    let updater = journal(&node)?.updater_pid;
    ensure!(updater > 1, "the journal names its updater");
    let new_node = node.pid()?;
    // Only the updater dies, as when its transient unit is killed: the
    // node it started belongs to the node's service and lives on.
    let killed = std::process::Command::new("kill")
        .args(["-s", "KILL", &updater.to_string()])
        .status()?;
    ensure!(killed.success(), "kill -KILL {updater}");
    wait_until(Duration::from_secs(10), "the updater to die", || {
        !billet_tests::cluster::alive(updater)
    })
    .await?;
    ensure!(billet_tests::cluster::alive(new_node), "the new node runs");

    // The plane comes back; the transient unit's ExecStopPost settles.
    link.faults.hold_dial.store(false, Ordering::SeqCst);
    let settle = tokio::time::timeout(
        Duration::from_secs(120),
        tokio::process::Command::new(&node.binary)
            .args(["host-upgrade", "--settle", "--config"])
            .arg(&node.upgrade_config)
            .output(),
    )
    .await
    .context("host-upgrade --settle did not return within 120 s")??;
    ensure!(
        settle.status.success(),
        "host-upgrade --settle: {}",
        String::from_utf8_lossy(&settle.stderr)
    );
    let record = journal(&node)?;
    assert_eq!(
        record.step,
        Step::Done,
        "finished, not rolled back: {record:?}"
    );
    assert_eq!(installed_version(&node)?, next);
    assert_eq!(node.pid()?, new_node, "the healthy node was not restarted");
    ensure!(billet_tests::cluster::alive(new_node), "and still runs");
    wait_hello_version(&cluster, &next, Duration::from_secs(60)).await?;
    still_runs_jobs_and_ends_clean(cluster).await
}

/// The transient unit the node starts its updater in for the tests'
/// instruction (rollout `rollout-e2e`, generation 1).
const UPDATER_UNIT: &str = "billet-host-upgrade-rollout-e2e-g1.service";

/// An installed cluster whose node runs under real systemd, and that
/// systemd's host (dropped after the cluster: declare it first).
async fn systemd_cluster(work_ms: u64) -> Result<(SystemdHost, Cluster)> {
    let options = ClusterOptions::default();
    let host = SystemdHost::start(&options.docker_socket)?;
    let cluster = Cluster::start(ClusterOptions {
        installed: true,
        systemd: Some(host.target()),
        work_ms,
        ..options
    })
    .await?;
    Ok((host, cluster))
}

/// The whole path under real systemd: the node runs as the deployed unit
/// (`Type=notify`), gets StartUpgrade while a job runs, starts its updater
/// with `systemd-run` as a transient unit (which `systemctl stop` of the
/// node's unit must not stop), and the updater drains, swaps and restarts
/// the node through `systemctl`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_systemd_the_updater_runs_as_its_own_unit_and_the_job_survives() -> Result<()> {
    let (host, cluster) = systemd_cluster(12_000).await?;
    let unit = billet_tests::cluster::NODE_UNIT;
    assert_eq!(host.property(unit, "ActiveState")?, "active");
    assert_eq!(host.property(unit, "Type")?, "notify");
    let first_pid = host.property(unit, "MainPID")?;
    let (node, next, jobs) = upgrade_during_a_job(&cluster, "next.4").await?;
    // While the node drains for the running job, the updater runs in a
    // unit of its own (a oneshot: `activating` until it ends).
    let updater = host.property(UPDATER_UNIT, "ActiveState")?;
    assert!(
        updater == "activating" || updater == "active",
        "{UPDATER_UNIT} is {updater:?}"
    );
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(180))
        .await
        .with_context(|| cluster.nodes[NODE].log_text())?;
    let state = cluster.emulator.state();
    let job = state.jobs.iter().find(|j| j.id == jobs[0]).context("job")?;
    assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");

    wait_hello_version(&cluster, &next, Duration::from_secs(180)).await?;
    wait_until(Duration::from_secs(60), "the journal to say done", || {
        journal(&node).is_ok_and(|r| r.step == Step::Done)
    })
    .await
    .with_context(|| cluster.nodes[NODE].log_text())?;
    assert_eq!(installed_version(&node)?, next);
    assert_eq!(host.property(unit, "ActiveState")?, "active");
    assert_ne!(
        host.property(unit, "MainPID")?,
        first_pid,
        "systemd started a new process"
    );
    let log = cluster.nodes[NODE].log_text();
    assert!(
        log.contains("systemd-run"),
        "the updater was not started through systemd-run:\n{log}"
    );
    still_runs_jobs_and_ends_clean(cluster).await
}

/// Under real systemd, an updater killed while its new node comes up is
/// settled by its unit's `ExecStopPost=billet host-upgrade --settle`, which
/// finds the new node healthy and finishes the upgrade.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_systemd_a_killed_updaters_unit_settles_the_upgrade_itself() -> Result<()> {
    let (host, cluster) = systemd_cluster(1_000).await?;
    let unit = billet_tests::cluster::NODE_UNIT;
    let (node, next, link) = stalled_before_health(&cluster, "next.5").await?;
    let new_node = host.property(unit, "MainPID")?;
    // Its pid as the container sees it: the updater journalled its own.
    let updater_pid = journal(&node)?.updater_pid.to_string();
    host.run(&[
        "systemctl",
        "kill",
        "--kill-whom=main",
        "--signal=SIGKILL",
        UPDATER_UNIT,
    ])?;
    // Dead before the new node can be healthy: only the unit's settle can
    // finish the upgrade now.
    wait_until(Duration::from_secs(10), "the updater to die", || {
        host.exec(&["kill", "-0", &updater_pid])
            .is_ok_and(|o| !o.status.success())
    })
    .await?;
    link.faults.hold_dial.store(false, Ordering::SeqCst);

    wait_until(
        Duration::from_secs(120),
        "the unit's settle to finish it",
        || journal(&node).is_ok_and(|r| r.step == Step::Done),
    )
    .await
    .with_context(|| format!("{:?}", journal(&node)))?;
    assert_eq!(installed_version(&node)?, next);
    assert_eq!(
        host.property(unit, "MainPID")?,
        new_node,
        "the healthy node was not restarted"
    );
    wait_hello_version(&cluster, &next, Duration::from_secs(60)).await?;
    still_runs_jobs_and_ends_clean(cluster).await
}
