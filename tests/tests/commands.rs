//! The single slot's contract as the plane sees it over the wire.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Result;
use billet_controlplane_stub::calls::lease_to_wire;
use billet_controlplane_stub::ledger::Phase;
use billet_controlplane_stub::node_link::CommandOutcome;
use billet_controlplane_stub::now_ms;
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, STANDIN_IMAGE, TIER};
use scaleset::testing::{Endpoint, Fault};

fn launch(lease: &billet_controlplane_stub::ledger::Lease) -> pb::command::Kind {
    pb::command::Kind::Launch(pb::Launch {
        registration: None,
        lease: Some(lease_to_wire(lease)),
        tier: Some(pb::TierSpec {
            label: TIER.into(),
            image: STANDIN_IMAGE.into(),
            command: vec!["/billet-standin-runner".into()],
            trust: "trusted".into(),
            network: "host".into(),
            ..Default::default()
        }),
        job: Some(pb::Job {
            request_id: lease.request_id,
            ..Default::default()
        }),
        warm_instance: String::new(),
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_queued_past_its_deadline_is_answered_expired_and_starts_nothing() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let ledger = cluster.plane.ledger();
    let lease = cluster.reserve("expired1", 424242).await?;
    let node = cluster.plane.node("node-1").expect("node");
    // The plane queued it a second ago with a deadline that has passed since.
    let outcome = node
        .dispatch_until(
            launch(&lease),
            tokio::time::Instant::now() + Duration::from_secs(10),
            now_ms() - 1,
        )
        .await;
    let CommandOutcome::Answered(result) = &outcome else {
        panic!("expected an answer, got {outcome:?}");
    };
    assert_eq!(result.outcome, pb::Outcome::Expired as i32, "{result:?}");
    assert!(!result.custody);
    assert!(
        cluster.containers().await?.is_empty(),
        "an expired launch started a container"
    );
    let after = ledger.get("expired1").await?.expect("lease");
    assert_eq!(
        after.phase,
        Phase::Assigned,
        "an expired launch touched the ledger"
    );
    assert_eq!(after.node, None);
    assert!(
        cluster.emulator.state().runners.is_empty(),
        "an expired launch minted a runner"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_command_is_answered_invalid_argument_naming_the_field() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = cluster.plane.node("node-1").expect("node");
    let outcome = node
        .dispatch(
            pb::command::Kind::Destroy(pb::Destroy {
                request_id: -5,
                job_result: None,
                force: false,
                reason: String::new(),
            }),
            Duration::from_secs(10),
        )
        .await;
    let CommandOutcome::Answered(result) = &outcome else {
        panic!("expected an answer, got {outcome:?}");
    };
    assert_eq!(result.outcome, pb::Outcome::InvalidArgument as i32);
    let message = &result.error.as_ref().expect("error").message;
    assert!(message.contains("destroy.request_id"), "{message}");
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_for_a_request_nothing_was_started_for_succeeds() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = cluster.plane.node("node-1").expect("node");
    for _ in 0..2 {
        let outcome = node
            .dispatch(
                pb::command::Kind::Destroy(pb::Destroy {
                    request_id: 99,
                    job_result: Some("succeeded".into()),
                    force: false,
                    reason: String::new(),
                }),
                Duration::from_secs(10),
            )
            .await;
        assert!(outcome.is_ok(), "{outcome:?}");
    }
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn start_upgrade_without_an_updater_is_refused_with_a_sentence_an_operator_can_act_on()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = cluster.plane.node("node-1").expect("node");
    let outcome = node
        .dispatch(
            pb::command::Kind::StartUpgrade(pb::StartUpgrade {
                version: "0.2.0".into(),
                ..Default::default()
            }),
            Duration::from_secs(10),
        )
        .await;
    let CommandOutcome::Answered(result) = &outcome else {
        panic!("expected an answer, got {outcome:?}");
    };
    assert_eq!(result.outcome, pb::Outcome::Refused as i32);
    let message = &result.error.as_ref().expect("error").message;
    assert!(
        message.contains("0.2.0") && message.contains("out of band"),
        "{message}"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn instances_reports_what_docker_runs_not_what_the_ledger_believes() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 20_000,
        ..ClusterOptions::default()
    })
    .await?;
    let node = cluster.plane.node("node-1").expect("node");
    let instances = |outcome: CommandOutcome| match outcome {
        CommandOutcome::Answered(r) => {
            let report = r.instances.expect("report");
            assert!(report.inventory_known);
            report.lease_ids
        }
        other => panic!("{other:?}"),
    };
    assert!(
        instances(
            node.dispatch(
                pb::command::Kind::Instances(pb::Instances {}),
                Duration::from_secs(10)
            )
            .await
        )
        .is_empty()
    );
    let jobs = cluster.queue_jobs(1);
    billet_tests::cluster::wait_until(Duration::from_secs(30), "a launch", || {
        cluster.emulator.state().runners.len() == 1
    })
    .await?;
    let leases = cluster.plane.ledger().leases().await?;
    let reported = instances(
        node.dispatch(
            pb::command::Kind::Instances(pb::Instances {}),
            Duration::from_secs(10),
        )
        .await,
    );
    assert_eq!(reported, vec![leases[0].id.clone()]);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(60))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;
    cluster.shutdown().await
}

async fn run_idle_container(
    cluster: &Cluster,
    name: &str,
    labels: Vec<(String, String)>,
) -> Result<()> {
    use bollard::models::ContainerCreateBody;
    use bollard::query_parameters::CreateContainerOptionsBuilder;
    let body = ContainerCreateBody {
        image: Some(STANDIN_IMAGE.into()),
        // Waits for a job that never comes; the JIT config is a harmless dummy.
        env: Some(vec![
            "ACTIONS_RUNNER_INPUT_JITCONFIG=e30=".into(),
            "BILLET_STANDIN_IDLE_TIMEOUT_MS=600000".into(),
        ]),
        labels: Some(labels.into_iter().collect()),
        ..Default::default()
    };
    cluster
        .docker
        .create_container(
            Some(CreateContainerOptionsBuilder::default().name(name).build()),
            body,
        )
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sweep_destroys_an_orphan_and_never_touches_an_unlabelled_container() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let labels = |lease: &str| {
        vec![
            (
                "sh.billet.deployment".to_owned(),
                cluster.deployment.clone(),
            ),
            ("sh.billet.node".to_owned(), "node-1".to_owned()),
            ("sh.billet.lease".to_owned(), lease.to_owned()),
        ]
    };
    let orphan = format!("billet-ghost{}", &cluster.deployment[3..9]);
    let foreign = format!("billet-foreign{}", &cluster.deployment[3..9]);
    run_idle_container(&cluster, &orphan, labels("ghost")).await?;
    run_idle_container(&cluster, &foreign, Vec::new()).await?;
    let node = cluster.plane.node("node-1").expect("node");
    let outcome = node
        .dispatch(
            pb::command::Kind::Sweep(pb::Sweep {}),
            Duration::from_secs(20),
        )
        .await;
    assert!(outcome.is_ok(), "{}", outcome.describe());
    let orphan_left = cluster
        .docker
        .inspect_container(&orphan, None)
        .await
        .is_ok();
    let foreign_left = cluster
        .docker
        .inspect_container(&foreign, None)
        .await
        .is_ok();
    let _ = cluster
        .docker
        .remove_container(
            &foreign,
            Some(bollard::query_parameters::RemoveContainerOptions {
                force: true,
                ..Default::default()
            }),
        )
        .await;
    assert!(!orphan_left, "sweep left an orphan whose lease is not open");
    assert!(
        foreign_left,
        "sweep destroyed a container without billet's labels"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_destroy_that_is_not_a_completion_removes_the_runner_registration_first() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let ledger = cluster.plane.ledger();
    let lease = cluster.reserve("idle1", 5151).await?;
    let node = cluster.plane.node("node-1").expect("node");
    // No job is queued: the runner registers and waits, idle.
    let launched = node.dispatch(launch(&lease), Duration::from_secs(30)).await;
    assert!(launched.is_ok(), "{}", launched.describe());
    assert_eq!(cluster.emulator.state().runners.len(), 1);
    // GitHub answers runner calls slowly, so the registration outlives the
    // Destroy's start by seconds: wide enough to see whether the container
    // is still there while it does.
    cluster
        .emulator
        .inject(Fault::delay(Endpoint::Runners, Duration::from_secs(2)));
    let done = AtomicBool::new(false);
    let destroy = async {
        let outcome = node
            .dispatch(
                pb::command::Kind::Destroy(pb::Destroy {
                    request_id: 5151,
                    job_result: None,
                    force: false,
                    reason: String::new(),
                }),
                Duration::from_secs(30),
            )
            .await;
        done.store(true, Ordering::SeqCst);
        outcome
    };
    // Order, by observation: the container is read first, the registration
    // second; a registration still there after the container was seen gone
    // was removed after the container.
    let watch = async {
        let mut seen_registered_with_container = 0;
        while !done.load(Ordering::SeqCst) {
            let container = !cluster.containers().await?.is_empty();
            let registered = !cluster.emulator.state().runners.is_empty();
            anyhow::ensure!(
                container || !registered,
                "the container was removed while the runner was still registered"
            );
            if container && registered {
                seen_registered_with_container += 1;
            }
            // A polling interval, not a wait for something to have happened.
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        Ok(seen_registered_with_container)
    };
    let (destroyed, watched) = tokio::join!(destroy, watch);
    cluster.emulator.clear_faults();
    let seen = watched?;
    assert!(
        seen > 0,
        "the destroy never showed a moment with the registration and the container both present"
    );
    assert!(destroyed.is_ok(), "{}", destroyed.describe());
    assert!(
        cluster.emulator.state().runners.is_empty(),
        "the idle runner's registration was left behind"
    );
    assert!(cluster.containers().await?.is_empty());
    ledger
        .release("idle1", lease.epoch, None, Phase::Done, now_ms())
        .await?;
    cluster.wait_clean(Duration::from_secs(10)).await?;
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_launch_that_never_reaches_a_node_started_nothing_and_is_not_custody() -> Result<()> {
    let mut cluster = Cluster::start(ClusterOptions::default()).await?;
    let lease = cluster.reserve("undelivered1", 6161).await?;
    cluster
        .nodes
        .get_mut("node-1")
        .expect("node")
        .kill()
        .await?;
    let link = cluster.plane.node("node-1").expect("node");
    let mut status = link.status();
    tokio::time::timeout(Duration::from_secs(10), status.wait_for(Option::is_none)).await??;
    let outcome = link.dispatch(launch(&lease), Duration::from_secs(1)).await;
    assert!(
        matches!(outcome, CommandOutcome::NotDelivered(_)),
        "{outcome:?}"
    );
    assert!(
        !outcome.is_custody(),
        "an undelivered launch must not be held as custody"
    );
    assert!(cluster.containers().await?.is_empty());
    assert_eq!(
        cluster
            .plane
            .ledger()
            .get("undelivered1")
            .await?
            .expect("lease")
            .phase,
        Phase::Assigned
    );
    cluster.shutdown().await
}
