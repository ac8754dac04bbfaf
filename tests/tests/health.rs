//! A node that cannot do its job says so, stops taking work, and heals:
//! clock offsets, a hung or refusing engine, a full state disk, and
//! start-up logging. End to end: real `billet node` processes, real
//! mTLS, real Docker.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use billet_agent::edge::session::NodeService;
use billet_agent::local;
use billet_controlplane_stub::node_link::{NodeTarget, PlaneTls, dial};
use billet_controlplane_stub::plane::PlaneEvent;
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, Starts, wait_until, wall_clock_off};
use billet_tests::engine_proxy::EngineProxy;
use scaleset::testing::{Endpoint, JobState};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

fn state_dir(cluster: &Cluster, node: &str) -> PathBuf {
    cluster.dir.join(format!("state-{node}"))
}

async fn status(state_dir: &Path) -> Result<local::Observed> {
    local::check(state_dir, Duration::from_secs(5))
        .await
        .map_err(anyhow::Error::msg)
}

/// Jobs on a node whose wall clock is `offset` seconds from the plane's
/// run, complete and are cleaned up exactly as on a node in sync, and
/// nothing is answered EXPIRED; the offset is measured and reported.
async fn jobs_run_and_clean_up_with_the_node_clock_off_by(
    offset: &str,
    expect_ms: i64,
) -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_env: wall_clock_off(offset)?,
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(3);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(120))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;

    let state = cluster.emulator.state();
    for id in &jobs {
        let job = state.jobs.iter().find(|j| j.id == *id).context("job")?;
        assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
    }
    assert!(
        state.runners.is_empty(),
        "registrations left: {:?}",
        state.runners
    );
    let log = cluster.nodes["node-1"].log_text();
    assert!(
        !log.contains("expired before it started"),
        "a command with time left was answered EXPIRED:\n{log}"
    );
    let observed = status(&state_dir(&cluster, "node-1")).await?;
    let measured = observed.status.clock_offset_ms;
    assert!(
        (measured - expect_ms).abs() < 5_000,
        "the node reports a clock offset of {measured} ms, expected about {expect_ms}"
    );
    assert!(
        observed.serving && observed.status.degraded_reasons.is_empty(),
        "minutes off is not degraded: {observed:?}"
    );
    let link = cluster.plane.node("node-1").context("node")?;
    let reported = link.status().borrow().clone().context("attached")?;
    assert!(
        (reported.health.clock_offset_ms - expect_ms).abs() < 5_000,
        "the session reports {:?}",
        reported.health
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_clock_90_seconds_ahead_runs_and_cleans_up_jobs_like_one_in_sync() -> Result<()> {
    jobs_run_and_clean_up_with_the_node_clock_off_by("+90", 90_000).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_clock_five_minutes_behind_runs_and_cleans_up_jobs_like_one_in_sync() -> Result<()> {
    jobs_run_and_clean_up_with_the_node_clock_off_by("-300", -300_000).await
}

/// `billet node` started with `BILLET_LOG=log` and `extra` arguments on
/// certificates that do not exist: its exit code and its stderr.
fn start_without_certificates(log: &str, extra: &[&str]) -> Result<(Option<i32>, String)> {
    let out = std::process::Command::new(billet_tests::image::binary_path("billet")?)
        .args([
            "node",
            "--listen",
            "127.0.0.1:0",
            "--cert",
            "/nonexistent/cert.pem",
            "--key",
            "/nonexistent/key.pem",
            "--ca",
            "/nonexistent/ca.pem",
        ])
        .args(extra)
        .env("BILLET_LOG", log)
        .output()?;
    Ok((
        out.status.code(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    ))
}

/// `BILLET_LOG` with a typo stops start-up with exit 2 and a message
/// naming the variable, instead of silencing the node.
#[test]
fn an_invalid_billet_log_stops_start_up_with_exit_2_naming_the_variable() -> Result<()> {
    billet_tests::image::build_process_binaries()?;
    for value in ["inf", "json", "billet=loud"] {
        let (code, stderr) = start_without_certificates(value, &[])?;
        assert_eq!(code, Some(2), "BILLET_LOG={value}: {stderr}");
        assert!(
            stderr.contains("BILLET_LOG"),
            "BILLET_LOG={value}: {stderr}"
        );
    }
    // A valid one still starts far enough to fail on the certificate (3),
    // and that error reaches stderr.
    let (code, stderr) =
        start_without_certificates("billet=debug,info", &["--log-format", "json"])?;
    assert_eq!(code, Some(3), "{stderr}");
    let line = stderr
        .lines()
        .find(|l| l.contains("cert.pem"))
        .context("the error")?;
    let json: serde_json::Value = serde_json::from_str(line).context("a JSON line")?;
    assert_eq!(json["level"], "ERROR", "{line}");
    // Logging turned off does not silence why the node stops (exit 3
    // and not a word would leave the operator guessing).
    let (code, stderr) = start_without_certificates("off", &[])?;
    assert_eq!(code, Some(3), "{stderr}");
    assert!(
        stderr.contains("/nonexistent/cert.pem"),
        "BILLET_LOG=off: {stderr:?}"
    );
    Ok(())
}

/// Every plane event from now on, with when it was seen.
#[derive(Clone, Default)]
struct Events(Arc<Mutex<Vec<(Instant, PlaneEvent)>>>);

impl Events {
    fn watch(cluster: &Cluster) -> Self {
        let events = Self::default();
        let (mut rx, seen) = (cluster.plane.subscribe(), Arc::clone(&events.0));
        tokio::spawn(async move {
            while let Ok(event) = rx.recv().await {
                seen.lock().expect("events").push((Instant::now(), event));
            }
        });
        events
    }

    /// The launch failures seen since `since`: (lease, custody, code).
    fn launch_failures(&self, since: Instant) -> Vec<(String, bool, Option<pb::ErrorCode>)> {
        self.0
            .lock()
            .expect("events")
            .iter()
            .filter(|(at, _)| *at >= since)
            .filter_map(|(_, e)| match e {
                PlaneEvent::LaunchFailed {
                    lease,
                    custody,
                    code,
                    ..
                } => Some((lease.clone(), *custody, *code)),
                _ => None,
            })
            .collect()
    }
}

/// Polls an async `condition` every 200 ms until it yields a value or
/// `timeout` passes; the last error or the last unmet state is named.
async fn eventually<T, F, Fut>(timeout: Duration, what: &str, mut condition: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        let last = match condition().await {
            Ok(Some(t)) => return Ok(t),
            Ok(None) => String::from("not yet"),
            Err(e) => format!("{e:#}"),
        };
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} ({last})");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// What the node's port says over the plane's own mTLS: whether
/// `grpc.health.v1` calls the `Node` service serving.
async fn port_serving(cluster: &Cluster, node: &str) -> Result<bool> {
    let read = |p: &Path| std::fs::read(p).with_context(|| format!("read {}", p.display()));
    let tls = PlaneTls {
        ca_pem: read(&cluster.certs.ca.cert)?,
        cert_pem: read(&cluster.certs.plane.cert)?,
        key_pem: read(&cluster.certs.plane.key)?,
    };
    let target = NodeTarget {
        name: node.into(),
        addr: cluster.nodes[node].addr,
    };
    let channel = dial(&target, &tls).await?;
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service:
                <pb::node_server::NodeServer<NodeService> as tonic::server::NamedService>::NAME
                    .to_owned(),
        })
        .await?
        .into_inner();
    Ok(answer.status == ServingStatus::Serving as i32)
}

fn has(reasons: &[i32], reason: pb::DegradedReason) -> bool {
    reasons.contains(&(reason as i32))
}

/// The Docker socket accepts connections and never answers while jobs run.
/// Within 30 s the node says it is degraded (provider stuck) on the port,
/// the local socket and the session, and the plane stops placing work there;
/// a launch that was already queued behind the stuck call, and one placed
/// anyway, are refused at once, typed UNAVAILABLE, with nothing minted and
/// nothing handed to custody; a command busy past the slot's bound adds
/// `slot stuck`. The running jobs are left alone. When the socket answers
/// again the node heals by itself and every job runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hung_engine_degrades_the_node_refuses_launches_at_once_and_heals_when_it_answers()
-> Result<()> {
    let proxy = EngineProxy::start().await?;
    let cluster = Cluster::start(ClusterOptions {
        docker_socket: proxy.path.clone(),
        work_ms: 40_000,
        launch_timeout: Duration::from_secs(30),
        ..ClusterOptions::default()
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let events = Events::watch(&cluster);
    let state = state_dir(&cluster, "node-1");
    let link = Arc::clone(cluster.plane.node("node-1").context("node")?);
    let running = cluster.queue_jobs(2);
    wait_until(Duration::from_secs(60), "two jobs to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .filter(|j| j.state == JobState::Running)
            .count()
            == 2
    })
    .await?;
    let containers = cluster.containers().await?;
    assert_eq!(containers.len(), 2, "{containers:?}");

    // The engine hangs. A command that reads it takes the slot and does not
    // come back; a launch placed now, before anyone knows, queues behind it.
    proxy.set_hung(true);
    let hung_at = Instant::now();
    let minted = cluster
        .emulator
        .requests_to(Endpoint::GenerateJitConfig)
        .len();
    let stuck = {
        let link = Arc::clone(&link);
        tokio::spawn(async move {
            link.dispatch(
                pb::command::Kind::Instances(pb::Instances {}),
                Duration::from_secs(150),
            )
            .await
        })
    };
    link.faults.place_on_degraded.store(true, Ordering::SeqCst);
    let queued = cluster.queue_jobs(1);

    // Degraded within 30 s, everywhere it is said.
    eventually(
        Duration::from_secs(30),
        "the node to say it is degraded",
        || async {
            let observed = status(&state).await?;
            let plane = link.status().borrow().clone().context("attached")?;
            let port = port_serving(&cluster, "node-1").await?;
            Ok((!observed.serving
                && has(
                    &observed.status.degraded_reasons,
                    pb::DegradedReason::ProviderStuck,
                )
                && !port
                && plane.degraded()
                && plane
                    .health
                    .reasons()
                    .any(|r| r == pb::DegradedReason::ProviderStuck))
            .then_some(()))
        },
    )
    .await?;
    eprintln!("degraded after {:?}", hung_at.elapsed());

    // The queued launch, and the one placed anyway, are refused at once
    // (not after the stuck call, not by the plane's own timeout), typed.
    wait_until(
        Duration::from_secs(30).saturating_sub(hung_at.elapsed()),
        "a launch on the degraded node to be refused",
        || !events.launch_failures(hung_at).is_empty(),
    )
    .await?;
    link.faults.place_on_degraded.store(false, Ordering::SeqCst);
    let placing_stopped = Instant::now();
    let refused = events.launch_failures(hung_at);
    for (lease, custody, code) in &refused {
        assert_eq!(
            *code,
            Some(pb::ErrorCode::Unavailable),
            "lease {lease}: {refused:?}"
        );
        assert!(!custody, "lease {lease} was handed to custody: {refused:?}");
    }

    // One command has held the slot past its bound: `slot stuck`, and the
    // status says for how long.
    let busy_ms = eventually(Duration::from_secs(45), "slot stuck", || async {
        let observed = status(&state).await?;
        Ok(has(
            &observed.status.degraded_reasons,
            pb::DegradedReason::SlotStuck,
        )
        .then_some(observed.status.slot_busy_ms))
    })
    .await?;
    assert!(busy_ms >= 20_000, "slot busy for {busy_ms} ms");

    // Nothing minted, nothing in custody, the running jobs untouched.
    assert_eq!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len(),
        minted,
        "a registration was minted while the engine hung"
    );
    let observed = status(&state).await?;
    assert!(
        observed.status.leases.iter().all(|l| !l.custody),
        "{:?}",
        observed.status.leases
    );
    assert_eq!(
        observed.status.leases.len(),
        2,
        "{:?}",
        observed.status.leases
    );
    assert_eq!(cluster.containers().await?, containers);

    // The socket answers again: healthy by itself, everywhere.
    proxy.set_hung(false);
    eventually(Duration::from_secs(60), "the node to heal", || async {
        let observed = status(&state).await?;
        let plane = link.status().borrow().clone().context("attached")?;
        let port = port_serving(&cluster, "node-1").await?;
        Ok((observed.serving
            && observed.status.degraded_reasons.is_empty()
            && port
            && !plane.degraded())
        .then_some(()))
    })
    .await?;
    // While it said it was degraded, the plane placed nothing on it.
    let healed_at = Instant::now();
    let placed: Vec<_> = events
        .0
        .lock()
        .expect("events")
        .iter()
        .filter(|(at, e)| {
            *at > placing_stopped + Duration::from_secs(2)
                && *at < healed_at
                && matches!(
                    e,
                    PlaneEvent::Launched { .. } | PlaneEvent::LaunchFailed { .. }
                )
        })
        .map(|(_, e)| format!("{e:?}"))
        .collect();
    assert!(placed.is_empty(), "placed on a degraded node: {placed:?}");

    let jobs: Vec<_> = running.iter().chain(&queued).copied().collect();
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(180))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    for id in &jobs {
        assert_eq!(starts.of(*id).len(), 1, "job {id}: {:?}", starts.of(*id));
    }
    assert!(cluster.emulator.state().runners.is_empty());
    let _ = stuck.await;
    cluster.shutdown().await
}

/// A node restarted (a crash, systemd's restart) while the Docker socket
/// accepts connections and never answers, with a job running, comes up
/// rather than saying nothing and serving nothing for 60 s, its start-up
/// ping waiting, then exiting 5, again at every restart: within 45 s of the
/// restart its local socket, its port and the plane's session all say it is
/// degraded (provider stuck), nothing is minted for a job queued meanwhile,
/// and once the engine answers it recovers the running job, which completes
/// once, runs the queued one, and leaves nothing behind.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_restarted_while_the_engine_hangs_comes_up_degraded_and_recovers_when_it_answers()
-> Result<()> {
    let proxy = EngineProxy::start().await?;
    let mut cluster = Cluster::start(ClusterOptions {
        docker_socket: proxy.path.clone(),
        work_ms: 30_000,
        launch_timeout: Duration::from_secs(30),
        ..ClusterOptions::default()
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let state = state_dir(&cluster, "node-1");
    let link = Arc::clone(cluster.plane.node("node-1").context("node")?);
    let running = cluster.queue_jobs(1);
    wait_until(Duration::from_secs(60), "the job to run", || {
        cluster
            .emulator
            .state()
            .jobs
            .iter()
            .any(|j| j.state == JobState::Running)
    })
    .await?;
    let containers = cluster.containers().await?;
    let before = status(&state).await?.status.incarnation;

    proxy.set_hung(true);
    let restarted_at = Instant::now();
    cluster
        .nodes
        .get_mut("node-1")
        .context("node")?
        .restart()
        .await?;
    let minted = cluster
        .emulator
        .requests_to(Endpoint::GenerateJitConfig)
        .len();
    let queued = cluster.queue_jobs(1);
    eventually(
        Duration::from_secs(45),
        "the restarted node to come up and say it is degraded",
        || async {
            let observed = status(&state).await?;
            let plane = link.status().borrow().clone().context("attached")?;
            let port = port_serving(&cluster, "node-1").await?;
            Ok((observed.status.incarnation != before
                && !observed.serving
                && has(
                    &observed.status.degraded_reasons,
                    pb::DegradedReason::ProviderStuck,
                )
                && !port
                && plane.degraded()
                && plane
                    .health
                    .reasons()
                    .any(|r| r == pb::DegradedReason::ProviderStuck))
            .then_some(()))
        },
    )
    .await
    .with_context(|| cluster.nodes["node-1"].log_text())?;
    eprintln!(
        "up and degraded {:?} after the restart",
        restarted_at.elapsed()
    );
    assert!(
        cluster
            .nodes
            .get_mut("node-1")
            .context("node")?
            .wait(Duration::from_secs(5))
            .await
            .is_err(),
        "the node exited while the engine hung"
    );
    assert_eq!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len(),
        minted,
        "a registration was minted while the engine hung"
    );
    assert_eq!(cluster.containers().await?, containers);

    proxy.set_hung(false);
    eventually(
        Duration::from_secs(60),
        "the node to heal and recover",
        || async {
            let observed = status(&state).await?;
            Ok((observed.serving
                && observed.status.degraded_reasons.is_empty()
                && observed.status.recovered)
                .then_some(()))
        },
    )
    .await?;
    let jobs: Vec<_> = running.iter().chain(&queued).copied().collect();
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(180))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    for id in &jobs {
        assert_eq!(starts.of(*id).len(), 1, "job {id}: {:?}", starts.of(*id));
    }
    assert!(cluster.emulator.state().runners.is_empty());
    cluster.shutdown().await
}

/// The node's state directory on a small file system that fills up. The
/// node says it is degraded (state disk low, journal not writable, the
/// latter found by its own probe, not by a failed custody write), the
/// plane withdraws its capacity, and a launch placed anyway is refused
/// typed RESOURCE_EXHAUSTED before anything is minted; once the filler is
/// deleted the node heals by itself, is placed on again, and a job runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_state_disk_degrades_the_node_refuses_launches_typed_and_heals_when_space_is_freed()
-> Result<()> {
    // Declared first, dropped last: unmounted after the node is gone.
    let small = billet_tests::scratchfs::ScratchFs::tmpfs(128)?;
    let cluster = Cluster::start(ClusterOptions {
        state_root: Some(small.path.clone()),
        ..ClusterOptions::default()
    })
    .await?;
    let starts = Starts::watch(&cluster);
    let events = Events::watch(&cluster);
    let state = small.path.join("state-node-1");
    let link = Arc::clone(cluster.plane.node("node-1").context("node")?);
    let first = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&first, Duration::from_secs(90))
        .await?;
    // Idle: no journal write is due, so only a probe can find the journal
    // unwritable.
    cluster.wait_clean(Duration::from_secs(60)).await?;
    assert!(
        status(&state).await?.serving,
        "healthy before the disk fills"
    );

    let log_before = cluster.nodes["node-1"].log_text().len();
    let filler = small.fill("filler")?;
    let full_at = Instant::now();
    eventually(
        Duration::from_secs(30),
        "the node to say its disk is full",
        || async {
            let observed = status(&state).await?;
            let plane = link.status().borrow().clone().context("attached")?;
            let port = port_serving(&cluster, "node-1").await?;
            let reasons = &observed.status.degraded_reasons;
            Ok((!observed.serving
                && has(reasons, pb::DegradedReason::DiskLow)
                && has(reasons, pb::DegradedReason::JournalUnwritable)
                && !port
                && plane.degraded())
            .then_some(()))
        },
    )
    .await?;
    eprintln!("degraded after {:?}", full_at.elapsed());
    let log = cluster.nodes["node-1"].log_text();
    assert!(
        log.contains("the journal probe cannot write the state directory"),
        "the probe's error is not in the log:\n{log}"
    );

    // Placed anyway: refused, typed, before anything is minted.
    let minted = cluster
        .emulator
        .requests_to(Endpoint::GenerateJitConfig)
        .len();
    link.faults.place_on_degraded.store(true, Ordering::SeqCst);
    let placed_at = Instant::now();
    let second = cluster.queue_jobs(1);
    wait_until(
        Duration::from_secs(30),
        "a launch on the full node to be refused",
        || !events.launch_failures(placed_at).is_empty(),
    )
    .await?;
    link.faults.place_on_degraded.store(false, Ordering::SeqCst);
    let refused = events.launch_failures(placed_at);
    for (lease, custody, code) in &refused {
        assert_eq!(
            *code,
            Some(pb::ErrorCode::ResourceExhausted),
            "lease {lease}: {refused:?}"
        );
        assert!(!custody, "lease {lease} was handed to custody: {refused:?}");
    }
    assert_eq!(
        cluster
            .emulator
            .requests_to(Endpoint::GenerateJitConfig)
            .len(),
        minted,
        "a registration was minted for a launch on a full node"
    );

    // Full for at least 20 health ticks (one a second, each probing the
    // journal and failing): the failure is logged at a bounded rate, once
    // a minute, not once a tick.
    wait_until(Duration::from_secs(60), "20 s of a full state disk", || {
        full_at.elapsed() >= Duration::from_secs(20)
    })
    .await?;
    let window = full_at.elapsed();
    let log = cluster.nodes["node-1"].log_text();
    let full_log = &log[log_before..];
    let probe_lines = full_log
        .lines()
        .filter(|l| l.contains("the journal probe cannot write the state directory"))
        .count();
    let journal_lines = full_log
        .lines()
        .filter(|l| l.contains("cannot journal"))
        .count();
    eprintln!(
        "over {window:?} of a full disk: {probe_lines} journal probe lines, {journal_lines} journal write lines"
    );
    let bound = usize::try_from(window.as_secs() / 60).unwrap_or(0) + 1;
    assert!(
        probe_lines >= 1 && probe_lines <= bound,
        "{probe_lines} journal probe lines over {window:?} (bound {bound}):\n{full_log}"
    );
    assert!(
        journal_lines <= 2 * bound,
        "{journal_lines} journal write failure lines over {window:?}:\n{full_log}"
    );

    // Space freed: healthy by itself, placed on again, the job runs.
    std::fs::remove_file(&filler)?;
    eventually(Duration::from_secs(60), "the node to heal", || async {
        let observed = status(&state).await?;
        let plane = link.status().borrow().clone().context("attached")?;
        let port = port_serving(&cluster, "node-1").await?;
        Ok((observed.serving
            && observed.status.degraded_reasons.is_empty()
            && port
            && !plane.degraded()
            && plane.capacity.vcpu > 0)
            .then_some(()))
    })
    .await?;
    cluster
        .wait_jobs_completed(&second, Duration::from_secs(120))
        .await?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    for id in first.iter().chain(&second) {
        assert_eq!(starts.of(*id).len(), 1, "job {id}: {:?}", starts.of(*id));
    }
    assert!(cluster.emulator.state().runners.is_empty());
    cluster.shutdown().await
}

/// Jobs completing while the node's state disk is full must not leave its
/// journal refusing every write once space is freed (`Safety level may not
/// be changed inside a transaction`): a transaction that failed for want
/// of space can leave the journal's one connection inside a transaction
/// SQLite had already rolled back, and then every later launch answers
/// "cannot journal the launch" while the node looks healthy until a
/// restart. No node or engine is needed: the journal alone, on a small
/// tmpfs filled to the last byte.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_journal_whose_writes_failed_on_a_full_disk_takes_writes_again_once_space_is_freed()
-> Result<()> {
    use billet_agent::journal::{CustodyRecord, Durability, Journal, LaunchRecord, SqliteJournal};
    let small = billet_tests::scratchfs::ScratchFs::tmpfs(16)?;
    let dir = small.path.join("state");
    std::fs::create_dir(&dir)?;
    let journal = SqliteJournal::open(&dir).await?;
    let launch = |n: u32| LaunchRecord {
        lease: format!("lease-{n}"),
        epoch: 1,
        request_id: i64::from(n),
        instance: format!("billet-lease-{n}"),
        runner_id: 0,
        runner_name: String::new(),
        created: false,
    };
    let custody = |n: u32| CustodyRecord {
        lease: format!("lease-{n}"),
        epoch: 1,
        instance: format!("billet-lease-{n}"),
        request_id: i64::from(n),
        registration: None,
        outcome: "done".into(),
        phase: Some("custody".into()),
        discard: false,
        observed: true,
        since_unix_ms: 0,
        since_boot: None,
    };
    journal.put_launch(&launch(0)).await?;
    journal
        .put_result("command-0", b"answered", Durability::Synced)
        .await?;

    let filler = small.fill("filler")?;
    // Writes inside a transaction (a result with its trim, custody in one
    // transaction) and alone, until each kind has failed for want of space.
    let big = vec![7u8; 256 << 10];
    let mut failed = (0, 0, 0);
    for n in 1..200u32 {
        if journal
            .put_result(&format!("command-{n}"), &big, Durability::Synced)
            .await
            .is_err()
        {
            failed.0 += 1;
        }
        if journal
            .put_custody_all(&[custody(n), custody(n + 1000)])
            .await
            .is_err()
        {
            failed.1 += 1;
        }
        if journal.put_launch(&launch(n)).await.is_err() {
            failed.2 += 1;
        }
        if failed.0 > 2 && failed.1 > 2 && failed.2 > 2 {
            break;
        }
    }
    assert!(
        failed.0 > 0 && failed.1 > 0,
        "no transaction failed on a full disk: {failed:?}"
    );

    std::fs::remove_file(&filler)?;
    journal
        .put_launch(&launch(5000))
        .await
        .context("a launch record once space was freed")?;
    journal
        .put_result("command-5000", b"answered", Durability::Synced)
        .await
        .context("a result once space was freed")?;
    journal
        .put_custody_all(&[custody(5000)])
        .await
        .context("custody once space was freed")?;
    journal.forget_launch("lease-5000").await?;
    assert!(
        journal
            .custody()
            .await?
            .iter()
            .any(|c| c.lease == "lease-5000"),
        "the custody entry written after the disk was freed is not in the journal"
    );
    Ok(())
}
