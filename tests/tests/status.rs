//! `billet node status` as an operator runs it beside a node: the release,
//! plane contact and certificate, and each lease the node holds while a job
//! runs, as a table and as JSON; nothing once the job is done.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_tests::cluster::{Cluster, ClusterOptions};
use billet_tests::image::binary_path;

fn status(state_dir: &Path, json: bool) -> Result<(i32, String)> {
    let mut command = std::process::Command::new(binary_path("billet")?);
    command
        .args(["node", "status", "--state-dir"])
        .arg(state_dir);
    if json {
        command.arg("--json");
    }
    let out = command.output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

fn json(state_dir: &Path) -> Result<serde_json::Value> {
    let (code, text) = status(state_dir, true)?;
    anyhow::ensure!(code == 0, "billet node status --json exited {code}: {text}");
    serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn node_status_lists_the_lease_of_a_running_job_and_nothing_once_it_is_done() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 8000,
        ..ClusterOptions::default()
    })
    .await?;
    let state_dir = cluster.dir.join("state-node-1");
    let jobs = cluster.queue_jobs(1);

    // Wait, bounded, for the node to report the job's lease running.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let lease = loop {
        let v = json(&state_dir)?;
        if let Some(l) = v["leases"]
            .as_array()
            .and_then(|a| a.iter().find(|l| l["state"] == "running"))
        {
            assert_eq!(v["recovered"], true, "{v}");
            assert_eq!(v["serving"], true, "{v}");
            assert!(
                v["plane_contact_age_secs"].as_i64().is_some_and(|a| a < 60),
                "{v}"
            );
            assert!(
                v["certificate_expires_in_secs"]
                    .as_i64()
                    .is_some_and(|s| s > 86_400),
                "{v}"
            );
            break l.clone();
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("the node never reported a running lease: {v}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let lease_id = lease["lease_id"].as_str().context("lease id")?.to_owned();
    let ledger = cluster.plane.ledger().leases().await?;
    let held = ledger
        .iter()
        .find(|l| l.id == lease_id)
        .context("the lease is in the ledger")?;
    assert_eq!(lease["epoch"].as_u64(), Some(held.epoch), "{lease}");
    assert_eq!(lease["instance"], format!("billet-{lease_id}"), "{lease}");
    assert_eq!(lease["custody"], false, "{lease}");
    assert!(
        lease["runner_name"].as_str().is_some_and(|r| !r.is_empty()),
        "{lease}"
    );
    // The launch's log lines carry its lease in the command's span.
    let log = cluster.nodes["node-1"].log_text();
    assert!(
        log.contains(&format!("kind=\"launch\" lease={lease_id}}}")),
        "no launch line names lease {lease_id} in its span:\n{log}"
    );
    let (code, table) = status(&state_dir, false)?;
    assert_eq!(code, 0, "{table}");
    let row = table
        .lines()
        .find(|l| l.starts_with(&lease_id))
        .with_context(|| format!("no row for {lease_id}:\n{table}"))?;
    assert!(
        row.contains("running") && row.contains(&format!("billet-{lease_id}")),
        "{table}"
    );
    assert!(table.contains("recovered    yes"), "{table}");

    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let v = json(&state_dir)?;
        if v["leases"].as_array().is_some_and(Vec::is_empty) {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("the node still reports leases after the job: {v}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    cluster.shutdown().await?;
    // No node, no answer: exit 10, naming the socket.
    let (code, text) = status(&state_dir, false)?;
    assert_eq!(code, 10, "{text}");
    assert!(text.contains("node.sock"), "{text}");
    Ok(())
}

/// A user who may not look in the state directory is told so, with its
/// owner and mode (exit 6), not that no node runs; a directory with no
/// socket is "not running" (exit 10).
#[test]
fn status_tells_a_state_directory_it_cannot_read_from_one_where_no_node_runs() -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    use std::os::unix::process::CommandExt;
    billet_tests::image::build_process_binaries()?;
    let (uid, gid) = billet_tests::cluster::other_user()?;
    let dir = billet_tests::cluster::scratch_dir("status")?;
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
    let state = dir.join("state");
    std::fs::create_dir_all(&state)?;
    std::fs::set_permissions(&state, std::fs::Permissions::from_mode(0o700))?;
    // A socket someone listens on, as a node's would be.
    let _node = std::os::unix::net::UnixListener::bind(state.join("node.sock"))?;
    let as_other = |state: &Path| -> Result<(i32, String)> {
        let out = std::process::Command::new(binary_path("billet")?)
            .args(["node", "status", "--timeout-secs", "2", "--state-dir"])
            .arg(state)
            .uid(uid)
            .gid(gid)
            .output()?;
        Ok((
            out.status.code().unwrap_or(-1),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        ))
    };
    let (code, said) = as_other(&state)?;
    assert_eq!(code, 6, "{said}");
    for part in [
        "cannot use",
        "Permission denied",
        &format!("{} is owned by root (uid 0)", state.display()),
        "mode 0700",
        "runs as billet-test-other",
    ] {
        assert!(said.contains(part), "no {part:?} in: {said}");
    }
    assert!(!said.contains("no node is running"), "{said}");

    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty)?;
    std::fs::set_permissions(&empty, std::fs::Permissions::from_mode(0o755))?;
    let (code, said) = as_other(&empty)?;
    assert_eq!(code, 10, "{said}");
    assert!(said.contains("no node is running"), "{said}");
    Ok(())
}
