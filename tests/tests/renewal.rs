//! Identity that never lapses while attached: a node renews its
//! certificate through the plane over the session, with jobs flowing,
//! without a restart; and a node whose certificate expired anyway keeps
//! its compute, says `identity expired`, and comes back with a one-time
//! join token through `billet node enroll`.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions};
use billet_tests::image::binary_path;

fn run_billet(args: &[&str]) -> Result<(i32, String)> {
    let out = std::process::Command::new(binary_path("billet")?)
        .args(args)
        .output()?;
    Ok((
        out.status.code().unwrap_or(-1),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    ))
}

fn status(state_dir: &Path) -> Result<serde_json::Value> {
    let dir = state_dir.display().to_string();
    let (code, text) = run_billet(&["node", "status", "--state-dir", &dir, "--json"])?;
    ensure!(code == 0, "billet node status --json exited {code}: {text}");
    serde_json::from_str(&text).with_context(|| format!("not JSON: {text}"))
}

/// Waits, bounded, until the node's status satisfies `check`.
async fn wait_status(
    state_dir: &Path,
    timeout: Duration,
    what: &str,
    check: impl Fn(&serde_json::Value) -> bool,
) -> Result<serde_json::Value> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let v = status(state_dir)?;
        if check(&v) {
            return Ok(v);
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("{what} not seen within {timeout:?}; last status: {v}");
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

fn not_after_ms(cert: &Path) -> Result<i64> {
    let at = billet_agent::node::metrics::certificate_expiry(cert)
        .with_context(|| format!("{} holds no readable certificate", cert.display()))?;
    Ok(i64::try_from(
        at.duration_since(std::time::UNIX_EPOCH)?.as_millis(),
    )?)
}

/// A certificate of 75 s, renewed through the plane at two thirds of its
/// lifetime while jobs run back to back: no launch fails or is lost, the
/// node keeps its pid and incarnation, the renewed certificate (an hour
/// long) is on disk and in force, and jobs still launch after the original
/// certificate's end, so the sessions opened after the renewal (the
/// recycled one included) run on the new one. A node that never asked
/// would have its certificate expire under it, and the plane could not
/// attach again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_short_lived_certificate_is_renewed_through_the_plane_while_jobs_run_without_a_restart()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_cert_lifetime: Some(Duration::from_secs(75)),
        plane_signs: Some(Duration::from_secs(3600)),
        work_ms: 1000,
        ..ClusterOptions::default()
    })
    .await?;
    let node = &cluster.nodes["node-1"];
    let cert = cluster.certs.node("node-1").context("files")?.cert.clone();
    let original_not_after = not_after_ms(&cert)?;
    let link = cluster.plane.node("node-1").context("node")?;
    let incarnation = link
        .status()
        .borrow()
        .clone()
        .context("attached")?
        .hello
        .incarnation;
    let pid = node.pid().context("pid")?;
    let mut events = cluster.plane.subscribe();

    // Jobs one after another until two have launched after the original
    // certificate's end (and its renewal).
    let mut jobs = Vec::new();
    let mut after_expiry = 0;
    let started = tokio::time::Instant::now();
    while after_expiry < 2 {
        ensure!(
            started.elapsed() < Duration::from_secs(180),
            "jobs did not keep launching past the original certificate's end; node log:\n{}",
            node.log_text()
        );
        jobs.extend(cluster.queue_jobs(1));
        let launched = tokio::time::timeout(Duration::from_secs(30), async {
            loop {
                match events.recv().await {
                    Ok(PlaneEvent::Launched { .. }) => return Ok(()),
                    Ok(PlaneEvent::LaunchFailed { reason, .. }) => return Err(reason),
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(e) => return Err(e.to_string()),
                }
            }
        })
        .await;
        match launched {
            Ok(Ok(())) => {}
            Ok(Err(reason)) => bail!(
                "a launch failed across the renewal: {reason}; node log:\n{}",
                node.log_text()
            ),
            Err(_) => bail!(
                "job {} did not launch within 30 s; node log:\n{}",
                jobs.len(),
                node.log_text()
            ),
        }
        if billet_controlplane_stub::now_ms() > original_not_after + 2_000 {
            after_expiry += 1;
        }
    }
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(60))
        .await?;

    let log = node.log_text();
    ensure!(
        log.contains("certificate renewed through the plane"),
        "the node never renewed:\n{log}"
    );
    ensure!(
        !log.contains("taking custody") && !log.contains("expired before it started"),
        "a command was lost or expired across the renewal:\n{log}"
    );
    ensure!(
        log.matches("billet node serving").count() == 1,
        "the node restarted:\n{log}"
    );
    assert_eq!(node.pid(), Some(pid), "the node's process changed");
    let now = link.status().borrow().clone().context("attached")?;
    assert_eq!(now.hello.incarnation, incarnation, "the node restarted");
    assert!(now.session > 1, "no session after the renewal: {now:?}");

    let renewed_not_after = not_after_ms(&cert)?;
    ensure!(
        renewed_not_after > original_not_after + 30 * 60 * 1000,
        "the certificate on disk was not renewed: {original_not_after} -> {renewed_not_after}"
    );
    let v = status(&cluster.dir.join("state-node-1"))?;
    assert_eq!(
        v["certificate_not_after_unix_ms"].as_i64(),
        Some(renewed_not_after),
        "{v}"
    );
    ensure!(
        v["certificate_remaining_ms"]
            .as_i64()
            .is_some_and(|ms| ms > 30 * 60 * 1000),
        "remaining lifetime not reported: {v}"
    );
    assert_eq!(v["identity_expired"], false, "{v}");
    let state = cluster.emulator.state();
    for id in &jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
        assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
    }
    eprintln!("{} jobs ran across the renewal", jobs.len());
    cluster.shutdown().await
}

/// A node whose renewals keep failing lets its 40 s certificate expire with
/// a job running: the plane can no longer attach, the node keeps the
/// container running, and its status says `identity expired`. The plane
/// issues a join token; `billet node enroll` hands it to the node through
/// its local socket; the node gets a fresh certificate from the enrolment
/// endpoint without a restart, the plane attaches again, the container has
/// not been touched, and the same token is refused a second time (as is a
/// token issued for another node).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_certificate_expired_keeps_its_compute_and_re_enrols_with_a_one_time_token()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_cert_lifetime: Some(Duration::from_secs(40)),
        plane_signs: Some(Duration::from_secs(3600)),
        enrollment: true,
        work_ms: 600_000,
        ..ClusterOptions::default()
    })
    .await?;
    let link = cluster.plane.node("node-1").context("node")?;
    // The plane cannot sign for now: the renewal at two thirds fails, and
    // keeps failing.
    link.faults
        .refuse_renewals
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let node = &cluster.nodes["node-1"];
    let state_dir = cluster.dir.join("state-node-1");
    let pid = node.pid().context("pid")?;
    let incarnation = link
        .status()
        .borrow()
        .clone()
        .context("attached")?
        .hello
        .incarnation;

    let mut events = cluster.plane.subscribe();
    cluster.queue_jobs(1);
    let lease = tokio::time::timeout(Duration::from_secs(30), async {
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
    .context("the job did not launch within 30 s")?
    .map_err(|r| anyhow::anyhow!("the launch failed: {r}"))?;
    let container = format!("billet-{lease}");
    let running = |docker: &bollard::Docker| {
        let docker = docker.clone();
        let name = container.clone();
        async move {
            docker
                .inspect_container(&name, None)
                .await
                .ok()
                .and_then(|c| c.state)
                .and_then(|s| s.running)
                .unwrap_or(false)
        }
    };
    ensure!(running(&cluster.docker).await, "{container} is not running");

    let expired = wait_status(
        &state_dir,
        Duration::from_secs(90),
        "identity expired",
        |v| v["identity_expired"] == true,
    )
    .await?;
    ensure!(
        expired["certificate_remaining_ms"]
            .as_i64()
            .is_some_and(|ms| ms < 0),
        "{expired}"
    );
    let dir = state_dir.display().to_string();
    let (_, table) = run_billet(&["node", "status", "--state-dir", &dir])?;
    ensure!(table.contains("identity expired"), "{table}");
    ensure!(
        running(&cluster.docker).await,
        "the node's compute did not survive its identity's expiry; log:\n{}",
        node.log_text()
    );
    ensure!(
        expired["leases"]
            .as_array()
            .is_some_and(|l| l.iter().any(|l| l["lease_id"] == lease.as_str())),
        "the node forgot the lease: {expired}"
    );
    // Every session was cut before the certificate's end, and none opens
    // on an expired one.
    let mut attached = link.status();
    tokio::time::timeout(Duration::from_secs(10), attached.wait_for(Option::is_none))
        .await
        .context("the plane is still attached to a node whose certificate expired")??;

    let plane = cluster
        .enroll_addr
        .context("enrolment endpoint")?
        .to_string();
    // A token for another node does not enrol this one.
    let other = cluster
        .plane
        .issue_join_token("node-2", Duration::from_secs(600))
        .await?;
    let (code, text) = run_billet(&[
        "node",
        "enroll",
        "--state-dir",
        &dir,
        "--plane",
        &plane,
        "--token",
        &other,
    ])?;
    assert_eq!(code, 3, "enrolled with another node's token: {text}");

    let token = cluster
        .plane
        .issue_join_token("node-1", Duration::from_secs(600))
        .await?;
    let token_file = cluster.dir.join("join-token");
    std::fs::write(&token_file, format!("{token}\n"))?;
    let file = token_file.display().to_string();
    let (code, text) = run_billet(&[
        "node",
        "enroll",
        "--state-dir",
        &dir,
        "--plane",
        &plane,
        "--token-file",
        &file,
    ])?;
    assert_eq!(
        code,
        0,
        "billet node enroll: {text}\nnode log:\n{}",
        node.log_text()
    );
    ensure!(text.contains("enrolled"), "{text}");

    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    let healed = wait_status(
        &state_dir,
        Duration::from_secs(30),
        "identity healed",
        |v| v["identity_expired"] == false,
    )
    .await?;
    ensure!(
        healed["certificate_remaining_ms"]
            .as_i64()
            .is_some_and(|ms| ms > 30 * 60 * 1000),
        "{healed}"
    );
    assert_eq!(node.pid(), Some(pid), "the node restarted");
    let now = link.status().borrow().clone().context("attached")?;
    assert_eq!(now.hello.incarnation, incarnation, "the node restarted");
    ensure!(
        running(&cluster.docker).await,
        "re-enrolment touched the compute; log:\n{}",
        node.log_text()
    );

    // The token was for one use.
    let (code, text) = run_billet(&[
        "node",
        "enroll",
        "--state-dir",
        &dir,
        "--plane",
        &plane,
        "--token-file",
        &file,
    ])?;
    assert_eq!(code, 3, "a used token enrolled again: {text}");
    ensure!(text.contains("used already"), "{text}");
    // Tokens never reach a log.
    let secret = token.rsplit('.').next().context("secret")?;
    ensure!(
        !node.log_text().contains(secret),
        "the node logged the join token"
    );
    cluster.shutdown().await
}

/// A node whose certificate expired while it was down starts on it (rather
/// than exiting 3): it leaves the container a previous incarnation left
/// running untouched, serves its local socket saying `identity expired`
/// (not serving, degraded for that reason), and stays up, although no plane
/// can attach. `billet node enroll` with a join token brings it back
/// without a restart: the plane attaches, recovery adopts the container and
/// its lease, and a new job launches and runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_started_on_an_expired_certificate_keeps_its_compute_and_re_enrols_without_a_restart()
-> Result<()> {
    let mut cluster = Cluster::start(ClusterOptions {
        node_cert_lifetime: Some(Duration::from_secs(20)),
        plane_signs: Some(Duration::from_secs(3600)),
        enrollment: true,
        work_ms: 600_000,
        ..ClusterOptions::default()
    })
    .await?;
    let link = cluster.plane.node("node-1").context("node")?;
    link.faults
        .refuse_renewals
        .store(true, std::sync::atomic::Ordering::SeqCst);
    let state_dir = cluster.dir.join("state-node-1");
    let cert = cluster.certs.node("node-1").context("files")?.cert.clone();
    let not_after = not_after_ms(&cert)?;

    let mut events = cluster.plane.subscribe();
    let first = cluster.queue_jobs(1);
    let lease = tokio::time::timeout(Duration::from_secs(30), async {
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
    .context("the job did not launch within 30 s")?
    .map_err(|r| anyhow::anyhow!("the launch failed: {r}"))?;
    let container = format!("billet-{lease}");
    let running = |docker: &bollard::Docker| {
        let docker = docker.clone();
        let name = container.clone();
        async move {
            docker
                .inspect_container(&name, None)
                .await
                .ok()
                .and_then(|c| c.state)
                .and_then(|s| s.running)
                .unwrap_or(false)
        }
    };

    // The node goes down with the job running, and its certificate
    // expires meanwhile.
    cluster
        .nodes
        .get_mut("node-1")
        .context("node")?
        .kill()
        .await?;
    billet_tests::cluster::wait_until(
        Duration::from_secs(60),
        "the node's certificate to expire",
        || billet_controlplane_stub::now_ms() > not_after + 1_000,
    )
    .await?;
    ensure!(
        running(&cluster.docker).await,
        "{container} did not outlive its node"
    );

    let node = cluster.nodes.get_mut("node-1").context("node")?;
    let restarted_at = node.log_text().len();
    node.restart().await?;
    let pid = node.pid().context("pid")?;
    let node = &cluster.nodes["node-1"];
    // Up, on its local socket, saying why no plane can attach.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let expired = loop {
        ensure!(
            billet_tests::cluster::alive(pid),
            "the node did not start on its expired certificate; its log:\n{}",
            node.log_text()
        );
        // The health service's answer follows the degraded state the node
        // publishes a moment later, so it is waited for with it.
        if let Ok(v) = status(&state_dir)
            && v["identity_expired"] == true
            && v["serving"] == false
            && v["degraded_reasons"]
                .as_array()
                .is_some_and(|r| r.iter().any(|r| r == "identity_expired"))
        {
            break v;
        }
        ensure!(
            tokio::time::Instant::now() < deadline,
            "the node never said `identity expired` and degraded; status {:?}; log:\n{}",
            status(&state_dir).ok(),
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(expired["serving"], false, "{expired}");
    // Whether what it finds is still its own is the plane's to say:
    // recovery waits for the first session, touching nothing meanwhile.
    assert_eq!(expired["recovered"], false, "{expired}");
    let dir = state_dir.display().to_string();
    let (_, table) = run_billet(&["node", "status", "--state-dir", &dir])?;
    ensure!(table.contains("identity expired"), "{table}");
    ensure!(
        node.log_text()
            .contains("the node's certificate has expired"),
        "no warning at start-up:\n{}",
        node.log_text()
    );
    ensure!(
        link.status().borrow().is_none(),
        "the plane attached to a node whose certificate expired"
    );
    // Still up once the plane has dialed and refused its certificate.
    billet_tests::cluster::wait_until(
        Duration::from_secs(30),
        "the plane to dial and refuse the expired certificate",
        || node.log_text()[restarted_at..].contains("TLS handshake failed"),
    )
    .await?;
    ensure!(
        billet_tests::cluster::alive(pid),
        "the node stopped; its log:\n{}",
        node.log_text()
    );
    ensure!(
        running(&cluster.docker).await,
        "the restarted node touched the compute; log:\n{}",
        node.log_text()
    );

    let plane = cluster
        .enroll_addr
        .context("enrolment endpoint")?
        .to_string();
    let token = cluster
        .plane
        .issue_join_token("node-1", Duration::from_secs(600))
        .await?;
    let token_file = cluster.dir.join("join-token");
    std::fs::write(&token_file, format!("{token}\n"))?;
    let file = token_file.display().to_string();
    let (code, text) = run_billet(&[
        "node",
        "enroll",
        "--state-dir",
        &dir,
        "--plane",
        &plane,
        "--token-file",
        &file,
    ])?;
    assert_eq!(
        code,
        0,
        "billet node enroll: {text}\nnode log:\n{}",
        node.log_text()
    );
    cluster
        .wait_attached("node-1", Duration::from_secs(30))
        .await?;
    let healed = wait_status(
        &state_dir,
        Duration::from_secs(30),
        "identity healed, recovered, the lease adopted and serving",
        |v| {
            v["identity_expired"] == false
                && v["recovered"] == true
                && v["serving"] == true
                && v["leases"]
                    .as_array()
                    .is_some_and(|l| l.iter().any(|l| l["lease_id"] == lease.as_str()))
        },
    )
    .await?;
    ensure!(
        healed["degraded_reasons"]
            .as_array()
            .is_some_and(Vec::is_empty),
        "{healed}"
    );
    assert_eq!(node.pid(), Some(pid), "the node restarted to re-enrol");
    ensure!(
        running(&cluster.docker).await,
        "re-enrolment touched the compute; log:\n{}",
        node.log_text()
    );

    // And it takes work again.
    let second = cluster.queue_jobs(1);
    let runs = tokio::time::timeout(Duration::from_secs(60), async {
        loop {
            let state = cluster.emulator.state();
            if state
                .jobs
                .iter()
                .any(|j| j.id == second[0] && j.state == scaleset::testing::JobState::Running)
            {
                return;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    })
    .await;
    ensure!(
        runs.is_ok(),
        "a job queued after the re-enrolment did not run; node log:\n{}",
        node.log_text()
    );
    let state = cluster.emulator.state();
    let job = state
        .jobs
        .iter()
        .find(|j| j.id == first[0])
        .context("job")?;
    assert_eq!(
        job.state,
        scaleset::testing::JobState::Running,
        "the first job did not run on: {job:?}"
    );
    cluster.shutdown().await
}

/// A node whose wall clock is stepped 120 s back just after it attached,
/// with a 90 s certificate the plane renews for an hour: "minutes off" and
/// "a certificate of a few minutes", the two things a node must survive,
/// at once. The plane backdates what it signs by 60 s, so on the node's
/// own clock every renewed certificate would be "not valid yet" and
/// refused, and the renewal itself would come 120 s late; only a session
/// opened before the original certificate's end would keep the plane
/// attached. Certificate dates are read on the plane's clock (the offset
/// the session measures): the renewal is installed, on time, and a job
/// queued 40 s after the original certificate's end runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_120_s_behind_the_plane_renews_its_short_lived_certificate_on_the_planes_clock()
-> Result<()> {
    let dir = billet_tests::cluster::scratch_dir("renewal-clock-behind")?;
    let spec = dir.join("faketime");
    std::fs::write(&spec, "+0\n")?;
    // The step comes after the node has loaded its certificate: started
    // behind, a certificate the plane dated a moment ago is not valid yet
    // at start-up, which this test is not about.
    let mut node_env = billet_tests::cluster::wall_clock_off("+0")?;
    node_env.retain(|(k, _)| k != "FAKETIME");
    node_env.push(("FAKETIME_TIMESTAMP_FILE".into(), spec.display().to_string()));
    let cluster = Cluster::start(ClusterOptions {
        node_env,
        node_cert_lifetime: Some(Duration::from_secs(90)),
        plane_signs: Some(Duration::from_secs(3600)),
        work_ms: 1000,
        ..ClusterOptions::default()
    })
    .await?;
    let node = &cluster.nodes["node-1"];
    let cert = cluster.certs.node("node-1").context("files")?.cert.clone();
    let original_not_after = not_after_ms(&cert)?;
    std::fs::write(&spec, "-120s\n")?;
    let state_dir = cluster.dir.join("state-node-1");
    // The node measures the step from the plane's next commands.
    wait_status(
        &state_dir,
        Duration::from_secs(30),
        "the offset measured",
        |v| {
            v["clock_offset_ms"]
                .as_i64()
                .is_some_and(|ms| (ms + 120_000).abs() < 5_000)
        },
    )
    .await?;

    // Renewed at two thirds of the 90 s by the plane's clock, well before
    // the original certificate's end.
    let started = tokio::time::Instant::now();
    loop {
        if not_after_ms(&cert)? > original_not_after + 30 * 60 * 1000 {
            break;
        }
        ensure!(
            started.elapsed() < Duration::from_secs(120),
            "the certificate on disk was not renewed; node log:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    ensure!(
        billet_controlplane_stub::now_ms() < original_not_after,
        "renewed only after the original certificate's end (the plane's clock): it was timed on the node's own"
    );
    let log = node.log_text();
    ensure!(
        log.contains("certificate renewed through the plane") && !log.contains("not valid yet"),
        "a renewed certificate was refused:\n{log}"
    );

    // Past the original certificate's end by the plane's clock, sessions
    // open on the renewed one and jobs still launch.
    while billet_controlplane_stub::now_ms() < original_not_after + 40_000 {
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
    let late = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&late, Duration::from_secs(60))
        .await
        .with_context(|| format!("node log:\n{}", node.log_text()))?;
    let v = status(&state_dir)?;
    assert_eq!(v["identity_expired"], false, "{v}");
    ensure!(
        v["certificate_remaining_ms"]
            .as_i64()
            .is_some_and(|ms| ms > 30 * 60 * 1000),
        "remaining lifetime not reported on the plane's clock: {v}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    cluster.shutdown().await
}
