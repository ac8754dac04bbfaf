//! Every job's story, end to end with real Docker, the real `billet node`,
//! the stub plane and the scale-set emulator: a job queued on a full node
//! has a record that says it waited for capacity, and for how long, and then
//! ran; an operator reads it with `billet-plane jobs`, from the ledger, with
//! no log.

use std::process::Command;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use billet_tests::cluster::{Cluster, ClusterOptions};
use billet_tests::image::binary_path;

/// How long the first job holds the node's only room.
const WORK_MS: u64 = 5000;

/// Runs `billet-plane --ledger <the cluster's ledger> jobs ARGS` and
/// answers its standard output.
fn plane_jobs(cluster: &Cluster, args: &[&str]) -> Result<String> {
    let output = Command::new(binary_path("billet-plane")?)
        .arg("--ledger")
        .arg(cluster.dir.join("ledger.db"))
        .arg("jobs")
        .args(args)
        .output()
        .context("run billet-plane jobs")?;
    ensure!(
        output.status.success(),
        "billet-plane jobs {args:?} exited {}: {}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    Ok(String::from_utf8(output.stdout)?)
}

/// Two jobs on a node with room for one runner: the second waits for the
/// first to finish, and its story says so, with the wait's length, where
/// before an operator read two logs and guessed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_queued_on_a_full_node_has_a_story_naming_the_capacity_wait_with_its_length()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_vcpu: 1,
        work_ms: WORK_MS,
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(2);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;

    let listed: serde_json::Value = serde_json::from_str(&plane_jobs(&cluster, &["--json"])?)?;
    let listed = listed.as_array().context("a JSON array")?;
    let mut waited_for_room = Vec::new();
    for job in &jobs {
        let record = listed
            .iter()
            .find(|j| j["request_id"] == job.get())
            .with_context(|| format!("job {job} is not listed: {listed:?}"))?;
        assert_eq!(record["state"], "completed: succeeded", "{record}");
        assert!(record["started_at_ms"].is_i64(), "{record}");
        assert_eq!(
            record["attempts"].as_array().map(Vec::len),
            Some(1),
            "{record}"
        );
        let capacity: i64 = record["waits"]
            .as_array()
            .context("waits")?
            .iter()
            .filter(|w| w["reason"] == "no_capacity")
            .map(|w| w["until_ms"].as_i64().unwrap_or(0) - w["since_ms"].as_i64().unwrap_or(0))
            .sum();
        if capacity > 0 {
            waited_for_room.push((job.get(), capacity));
        }
    }
    // One job ran at once; the other waited for the room the first held
    // for most of its work.
    let [(waiter, waited_ms)] = waited_for_room[..] else {
        panic!(
            "exactly one job should have waited for capacity: {waited_for_room:?} in {listed:#?}"
        );
    };
    assert!(
        waited_ms >= i64::try_from(WORK_MS / 2)?,
        "job {waiter} waited {waited_ms} ms for capacity"
    );
    let story = plane_jobs(&cluster, &["--job", &waiter.to_string()])?;
    let wait_line = story
        .lines()
        .find(|l| l.contains("for: no capacity"))
        .with_context(|| format!("no capacity wait in\n{story}"))?;
    // The line says the wait's length as the record holds it (7.2s).
    let said = format!(
        "{}.{}s for: no capacity",
        waited_ms / 1000,
        (waited_ms % 1000) / 100
    );
    assert!(wait_line.contains(&format!("waited {said}")), "{wait_line}");
    assert!(wait_line.contains("node-1 full"), "{wait_line}");
    for words in [
        "queued at GitHub",
        "attempt 1: lease",
        "attempt 1: launched",
        "started: runner billet-",
        "completed: succeeded",
        "compute proven gone",
    ] {
        assert!(story.contains(words), "{words:?} missing from\n{story}");
    }
    eprintln!("{story}");
    let table = plane_jobs(&cluster, &[])?;
    assert!(table.starts_with("JOB"), "{table}");
    assert!(table.lines().count() == 3, "{table}");
    cluster.shutdown().await
}
