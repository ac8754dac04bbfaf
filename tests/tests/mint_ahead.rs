//! Launches carrying a registration the plane minted before dispatch
//! (`mint_before_dispatch: true`), with the node killed between its create
//! and its start. Real Docker, real `billet node`, the stub plane.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use billet_controlplane_stub::plane::PlaneEvent;
use billet_tests::cluster::{Cluster, ClusterOptions, Starts, wait_until};
use scaleset::JobRequestId;
use tokio::time::Instant;

fn options(work_ms: u64) -> ClusterOptions {
    ClusterOptions {
        work_ms,
        mint_before_dispatch: true,
        maintenance_interval: Duration::from_secs(2),
        // The registration pass (the backstop) must not hide a leak.
        registration_grace: Duration::from_secs(300),
        node_env: vec![
            ("BILLET_ACK_TIMEOUT_SECS".into(), "2".into()),
            ("BILLET_STRAY_GRACE_SECS".into(), "2".into()),
        ],
        ..ClusterOptions::default()
    }
}

/// Counts `Launched` events, by whether they were minted ahead.
#[derive(Clone, Default)]
struct Launches {
    ahead: Arc<AtomicUsize>,
    checked: Arc<AtomicUsize>,
    failed: Arc<std::sync::Mutex<Vec<String>>>,
}

impl Launches {
    fn watch(cluster: &Cluster) -> Self {
        let me = Self::default();
        let mut events = cluster.plane.subscribe();
        let m = me.clone();
        tokio::spawn(async move {
            while let Ok(event) = events.recv().await {
                match event {
                    PlaneEvent::Launched { minted_ahead, .. } => {
                        if minted_ahead {
                            m.ahead.fetch_add(1, Ordering::SeqCst);
                        } else {
                            m.checked.fetch_add(1, Ordering::SeqCst);
                        }
                    }
                    PlaneEvent::LaunchFailed {
                        lease,
                        reason,
                        custody,
                        ..
                    } => m
                        .failed
                        .lock()
                        .unwrap()
                        .push(format!("{lease} custody={custody}: {reason}")),
                    _ => {}
                }
            }
        });
        me
    }
    fn report(&self) -> String {
        format!(
            "launched minted-ahead {}, checked {}, failed {:?}",
            self.ahead.load(Ordering::SeqCst),
            self.checked.load(Ordering::SeqCst),
            self.failed.lock().unwrap()
        )
    }
}

/// Runs one job so the plane has seen node-1 run the tier's image.
async fn warm_up(cluster: &Cluster) -> Result<()> {
    let jobs = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await
        .context("the warm-up job")
}

/// All three views agree, and every job ran exactly once.
async fn ends_clean_once(
    cluster: &Cluster,
    jobs: &[JobRequestId],
    starts: &Starts,
    timeout: Duration,
    launches: &Launches,
) -> Result<()> {
    cluster
        .wait_jobs_completed(jobs, timeout)
        .await
        .with_context(|| {
            format!(
                "{}; jobs {:?}; leases pending",
                launches.report(),
                cluster.emulator.state().jobs
            )
        })?;
    cluster.wait_clean(Duration::from_secs(60)).await?;
    wait_until(Duration::from_secs(60), "no registration left", || {
        cluster.emulator.state().runners.is_empty()
    })
    .await
    .with_context(|| {
        format!(
            "registrations left: {:?}; {}",
            cluster.emulator.state().runners,
            launches.report()
        )
    })?;
    starts.assert_each_succeeded_once(cluster, jobs)?;
    let leases = cluster.plane.ledger().leases().await?;
    let open: Vec<_> = leases.iter().filter(|l| !l.phase.is_terminal()).collect();
    assert!(open.is_empty(), "leases still open: {open:?}");
    Ok(())
}

/// The containers of this cluster's deployment in Docker state `created`.
async fn created_containers(cluster: &Cluster) -> Result<Vec<String>> {
    let filters: HashMap<String, Vec<String>> = HashMap::from([
        (
            "label".to_owned(),
            vec![format!("sh.billet.deployment={}", cluster.deployment)],
        ),
        ("status".to_owned(), vec!["created".to_owned()]),
    ]);
    Ok(cluster
        .docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        }))
        .await?
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .collect())
}

/// SIGKILL the node the moment a container of a pre-minted
/// launch is seen in Docker state `created` (inside the start gate), then
/// restart it. Recovery must tear the created container down; the
/// registration, the lease and the job must all come right.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_inside_the_start_gate_leaks_nothing() -> Result<()> {
    let mut cluster = Cluster::start(options(1000)).await?;
    let starts = Starts::watch(&cluster);
    let launches = Launches::watch(&cluster);
    warm_up(&cluster).await?;
    let mut all = Vec::new();
    let mut hits = 0;
    for round in 0..6 {
        let good = cluster.queue_jobs(1);
        cluster
            .wait_jobs_completed(&good, Duration::from_secs(90))
            .await?;
        all.extend(good);
        cluster.wait_clean(Duration::from_secs(30)).await?;
        let ahead = launches.ahead.load(Ordering::SeqCst);
        all.extend(cluster.queue_jobs(1));
        let deadline = Instant::now() + Duration::from_secs(20);
        let seen = loop {
            let created = created_containers(&cluster).await?;
            if !created.is_empty() {
                break Some(created);
            }
            if Instant::now() > deadline {
                break None;
            }
            tokio::time::sleep(Duration::from_millis(3)).await;
        };
        cluster
            .nodes
            .get_mut("node-1")
            .context("node")?
            .kill()
            .await?;
        let after_kill = created_containers(&cluster).await?;
        let node = cluster.nodes.get_mut("node-1").context("node")?;
        eprintln!(
            "round {round}: seen created {seen:?}, still created after the kill {after_kill:?}, minted-ahead launches before {ahead}"
        );
        if seen.is_some() {
            hits += 1;
        }
        node.restart().await?;
        cluster
            .wait_attached("node-1", Duration::from_secs(30))
            .await?;
    }
    eprintln!("hits {hits}; {}", launches.report());
    assert!(
        hits > 0,
        "no kill landed while a container was created and not started"
    );
    assert!(
        launches.ahead.load(Ordering::SeqCst) > 0,
        "no launch was minted ahead: {}",
        launches.report()
    );
    let r = ends_clean_once(&cluster, &all, &starts, Duration::from_secs(180), &launches).await;
    if r.is_err() {
        eprintln!("node log:\n{}", cluster.nodes["node-1"].log_text());
    }
    r?;
    cluster.shutdown().await
}
