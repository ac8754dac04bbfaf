use std::collections::{BTreeSet, HashMap};
use std::time::Instant;

use crate::ledger::{NodeCapacity, Phase, WantedChange};

use super::registrations::Registrations;
use super::*;

/// A plane over an in-memory ledger with links to `nodes`, none dialed:
/// tests attach them with `NodeLink::attach_for_test`.
async fn plane(nodes: &[&str]) -> (Arc<Plane>, scaleset::testing::Emulator) {
    plane_configured(nodes, |_| {}).await
}

/// As [`plane`], with `configure` applied to the configuration first.
async fn plane_configured(
    nodes: &[&str],
    configure: impl FnOnce(&mut PlaneConfig),
) -> (Arc<Plane>, scaleset::testing::Emulator) {
    let emulator = scaleset::testing::Emulator::builder().start().await;
    let mut config = test_config(nodes);
    configure(&mut config);
    let lease_ttl = config.lease_ttl;
    let targets = config.nodes.clone();
    let (registry, metrics) = super::metrics::registry("linux");
    let plane = Arc::new(Plane {
        ledger: Arc::new(Ledger::open_in_memory(lease_ttl).await.expect("ledger")),
        github: Arc::new(Github::new(emulator.client())),
        nodes: targets.into_iter().map(NodeLink::new).collect(),
        events: broadcast::channel(64).0,
        managed: Mutex::new(HashSet::new()),
        cover: Mutex::new(Cover::recovering(Vec::new())),
        wake: Notify::new(),
        pass: tokio::sync::Mutex::new(()),
        scale_set: Mutex::new(scaleset::ScaleSetId(1)),
        jobs: Mutex::new(super::jobs::JobBook::default()),
        metrics: Arc::clone(&metrics),
        registry: Arc::clone(&registry),
        tasks: TaskTracker::new(),
        config,
    });
    (plane, emulator)
}

/// The tests' configuration: links to `nodes` (none dialed), an
/// in-memory ledger, the tier `linux` of 1 vCPU and 1 MiB.
fn test_config(nodes: &[&str]) -> PlaneConfig {
    let lease_ttl = Duration::from_secs(60);
    let targets: Vec<NodeTarget> = nodes
        .iter()
        .map(|name| NodeTarget {
            name: (*name).into(),
            addr: "127.0.0.1:9".parse().expect("addr"),
        })
        .collect();
    PlaneConfig {
        deployment: "dev".into(),
        lease_ttl,
        ledger: crate::ledger::LedgerLocation::SqliteMemory,
        tls: PlaneTls {
            ca_pem: Vec::new(),
            cert_pem: Vec::new(),
            key_pem: Vec::new(),
        },
        nodes: targets,
        tier: Tier {
            label: "linux".into(),
            image: "billet-standin-runner:dev".into(),
            command: vec!["/run".into()],
            trust: "trusted".into(),
            vcpu: 1,
            memory_bytes: 1 << 20,
            network: String::new(),
            env: Vec::new(),
            sticky_disks: Vec::new(),
            actions_cache: None,
            docker_image_store: false,
            min_runner_version: String::new(),
        },
        launch_timeout: Duration::from_secs(30),
        mint_before_dispatch: true,
        destroy_timeout: Duration::from_secs(30),
        reap_interval: Duration::from_secs(60),
        max_runners: 10,
        maintenance_interval: Duration::from_secs(60),
        quarantine_grace: crate::calls::QUARANTINE_GRACE,
        renewal_grace: RENEWAL_GRACE,
        scale_set_retry: crate::github::SCALE_SET_RETRY,
        registration_interval: REGISTRATION_INTERVAL,
        registration_grace: REGISTRATION_GRACE,
        node_ca: None,
        node_keepalive: crate::node_link::Keepalive::default(),
        warm: crate::plane::WarmConfig::default(),
        jobs: crate::plane::JobsConfig::default(),
    }
}

/// A lease for job `request_id`, bound to `node` and launching there.
async fn launched_on(plane: &Plane, request_id: i64, node: &str) -> crate::ledger::Lease {
    let room = NodeCapacity {
        vcpu: 64,
        memory_bytes: 1 << 40,
    };
    let (lease, _) = plane
        .reserve(request_id, node, room)
        .await
        .expect("reserve");
    let now = crate::now_ms();
    plane
        .ledger
        .bind(&lease.id, lease.epoch, node, now)
        .await
        .expect("bind");
    plane
        .ledger
        .advance(&lease.id, lease.epoch, node, Phase::Launching, now)
        .await
        .expect("advance")
}

/// 7.N.10: GitHub's completion of a job reaches only the node its lease
/// is bound to, with GitHub's result; another attached node (listed
/// first, and holding a lease of its own) hears nothing.
#[tokio::test]
async fn a_completion_is_sent_only_to_the_node_holding_the_job() {
    let (plane, _emulator) = plane(&["node-a", "node-b"]).await;
    let (_tx_a, mut rx_a) = plane.nodes[0].attach_for_test(1, 16);
    let (tx_b, mut rx_b) = plane.nodes[1].attach_for_test(1, 16);
    let _other = launched_on(&plane, 4, "node-a").await;
    let lease = launched_on(&plane, 5, "node-b").await;
    let mut events = plane.subscribe();

    let completing = tokio::spawn({
        let plane = Arc::clone(&plane);
        let runner = format!("billet-{}", lease.id);
        async move {
            plane
                .complete(runner, "succeeded".into(), CancellationToken::new())
                .await;
        }
    });
    let command = match tokio::time::timeout(Duration::from_secs(5), rx_b.recv())
        .await
        .expect("node-b was sent something")
        .and_then(|m| m.body)
    {
        Some(pb::plane_message::Body::Command(c)) => c,
        other => panic!("expected a command for node-b, got {other:?}"),
    };
    assert_eq!(
        command.kind,
        Some(pb::command::Kind::Destroy(pb::Destroy {
            request_id: 5,
            job_result: Some("succeeded".into()),
            force: false,
            reason: String::new(),
        }))
    );
    plane.nodes[1]
        .answer_for_test(
            pb::CommandResult {
                id: command.id.clone(),
                outcome: pb::Outcome::Ok.into(),
                custody: false,
                error: None,
                instances: None,
            },
            &tx_b,
        )
        .await;
    tokio::time::timeout(Duration::from_secs(5), completing)
        .await
        .expect("the completion finished")
        .expect("complete");

    assert!(
        rx_a.try_recv().is_err(),
        "node-a, which does not hold the job, was sent a command"
    );
    let released = plane
        .ledger
        .get(&lease.id)
        .await
        .expect("read")
        .expect("lease");
    assert_eq!(released.phase, Phase::Done);
    let mut saw_release = false;
    while let Ok(event) = events.try_recv() {
        saw_release |= event
            == PlaneEvent::Released {
                lease: lease.id.clone(),
                outcome: "done".into(),
            };
    }
    assert!(saw_release, "no Released event for the completed lease");
}

/// A registration whose lease ended more than the grace ago is removed at
/// GitHub; one GitHub no longer has is remembered as gone and not asked about
/// again.
#[tokio::test]
async fn a_registration_that_outlived_its_lease_is_removed_once() {
    let (plane, emulator) = plane(&["node-a"]).await;
    plane.github.ensure_scale_set("linux").await.expect("set");
    let lease = launched_on(&plane, 4, "node-a").await;
    let minted = plane
        .github
        .mint("linux", &format!("billet-{}", lease.id))
        .await
        .expect("mint");
    plane
        .ledger
        .set_runner(
            &lease.id,
            lease.epoch,
            minted.runner_id,
            &minted.runner_name,
        )
        .await
        .expect("set runner");
    plane
        .ledger
        .release(
            &lease.id,
            lease.epoch,
            Some("node-a"),
            Phase::Failed,
            crate::now_ms(),
        )
        .await
        .expect("release");
    assert_eq!(emulator.state().runners.len(), 1);
    let mut memory = Registrations::default();
    let shutdown = CancellationToken::new();
    // Within the grace nothing is touched.
    plane
        .registrations_once(&mut memory, &shutdown)
        .await
        .expect("pass");
    assert_eq!(
        emulator.state().runners.len(),
        1,
        "removed within the grace"
    );
    let mut config = plane.config.clone();
    config.registration_grace = Duration::ZERO;
    let (registry, metrics) = super::metrics::registry("linux");
    let plane = Plane {
        config,
        ledger: Arc::clone(&plane.ledger),
        github: Arc::clone(&plane.github),
        nodes: plane.nodes.clone(),
        events: broadcast::channel(4).0,
        managed: Mutex::new(HashSet::new()),
        cover: Mutex::new(Cover::recovering(Vec::new())),
        wake: Notify::new(),
        pass: tokio::sync::Mutex::new(()),
        scale_set: Mutex::new(scaleset::ScaleSetId(1)),
        jobs: Mutex::new(super::jobs::JobBook::default()),
        metrics: Arc::clone(&metrics),
        registry: Arc::clone(&registry),
        tasks: TaskTracker::new(),
    };
    plane
        .registrations_once(&mut memory, &shutdown)
        .await
        .expect("pass");
    assert!(
        emulator.state().runners.is_empty(),
        "the registration was left"
    );
    let asked = emulator.requests().len();
    plane
        .registrations_once(&mut memory, &shutdown)
        .await
        .expect("pass");
    assert_eq!(
        emulator.requests().len(),
        asked,
        "a gone registration was asked about again"
    );
}

/// A mint GitHub answered but the ledger refused to record (the lease
/// ended meanwhile), whose immediate removal failed too, leaves a
/// registration no lease names by id: the pass finds it by its name
/// once the lease has ended, removes it, and asks no more.
#[tokio::test]
async fn a_registration_the_ledger_never_recorded_is_found_by_name_and_removed() {
    let (plane, emulator) = plane_configured(&["node-a"], |c| {
        c.registration_grace = Duration::ZERO;
    })
    .await;
    plane.github.ensure_scale_set("linux").await.expect("set");
    let lease = launched_on(&plane, 5, "node-a").await;
    plane
        .github
        .mint("linux", &format!("billet-{}", lease.id))
        .await
        .expect("mint");
    plane
        .ledger
        .release(
            &lease.id,
            lease.epoch,
            Some("node-a"),
            Phase::Failed,
            crate::now_ms(),
        )
        .await
        .expect("release");
    assert_eq!(emulator.state().runners.len(), 1);
    let mut memory = Registrations::default();
    let shutdown = CancellationToken::new();
    plane
        .registrations_once(&mut memory, &shutdown)
        .await
        .expect("pass");
    assert!(
        emulator.state().runners.is_empty(),
        "the unrecorded registration was left: {:?}",
        emulator.state().runners
    );
    let asked = emulator.requests().len();
    plane
        .registrations_once(&mut memory, &shutdown)
        .await
        .expect("pass");
    assert_eq!(emulator.requests().len(), asked, "asked about it again");
}

/// Five jobs assigned at once get five leases in one pass, one per job
/// (a node refuses a second lease for a request it already runs), and
/// never more than the set's maximum.
#[tokio::test]
async fn one_pass_covers_each_assigned_job_with_its_own_lease_up_to_the_sets_maximum() {
    let (plane, _emulator) = plane(&["node-a"]).await;
    plane.github.ensure_scale_set("linux").await.expect("set");
    let (_tx, mut rx) = plane.nodes[0].attach_for_test(1, 64);
    plane
        .cover
        .lock()
        .expect("cover")
        .wanted
        .extend([11, 12, 13, 14, 15]);
    Arc::clone(&plane).cover_once().await.expect("pass");
    let mut requests = Vec::new();
    for _ in 0..5 {
        let body = tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("a launch")
            .and_then(|m| m.body);
        let Some(pb::plane_message::Body::Command(pb::Command {
            kind: Some(pb::command::Kind::Launch(launch)),
            ..
        })) = body
        else {
            panic!("expected a launch, got {body:?}");
        };
        requests.push(launch.lease.expect("lease").request_id);
    }
    requests.sort_unstable();
    assert_eq!(requests, [11, 12, 13, 14, 15]);
    // Covered: another pass launches nothing more.
    Arc::clone(&plane).cover_once().await.expect("pass");
    assert!(
        tokio::time::timeout(Duration::from_millis(300), rx.recv())
            .await
            .is_err(),
        "a covered job was launched again"
    );
    // The set's maximum (10 here) bounds coverage, however many wait.
    plane.cover.lock().expect("cover").wanted.extend(100..200);
    Arc::clone(&plane).cover_once().await.expect("pass");
    assert_eq!(plane.ledger.charged().await.expect("charged").leases, 10);
}

/// A tier larger than every node is not left waiting behind "no attached
/// node has room", which reads like a node briefly full: the plane says the
/// tier fits no node, and which is largest.
#[tokio::test]
async fn a_tier_larger_than_every_node_is_named_as_such_not_as_a_full_node() {
    let (large, _emulator) = plane_configured(&["node-a", "node-b"], |c| {
        c.tier.memory_bytes = 128 << 30;
    })
    .await;
    assert_eq!(large.too_large_for_every_node(), None, "no node attached");
    let (_tx_a, _rx_a) = large.nodes[0].attach_for_test(1, 16);
    let (_tx_b, _rx_b) = large.nodes[1].attach_for_test(1, 16);
    let why = large
        .too_large_for_every_node()
        .expect("a 128 GiB tier on 64 GiB nodes fits none");
    assert!(
        why.contains("more than any attached node has in all")
            && why.contains("131072 MiB")
            && why.contains("65536 MiB"),
        "{why}"
    );
    let (small, _emulator) = plane(&["node-a"]).await;
    let (_tx, _rx) = small.nodes[0].attach_for_test(1, 16);
    assert_eq!(small.too_large_for_every_node(), None, "the tier fits");
}

/// A degraded node is never picked, and a node is never given more than its
/// capacity less what it says it holds, even when the ledger charges it
/// nothing (compute it adopted).
#[tokio::test]
async fn pick_node_skips_a_degraded_node_and_counts_what_the_node_says_it_holds() {
    let (plane, _emulator) = plane(&["node-a", "node-b"]).await;
    let (_tx_a, _rx_a) = plane.nodes[0].attach_for_test(1, 16);
    let (_tx_b, _rx_b) = plane.nodes[1].attach_for_test(1, 16);
    let none = HashMap::new();
    let picked = |charged: &HashMap<String, (u64, u64)>| {
        plane
            .pick_node(charged, &HashMap::new(), &none)
            .map(|n| n.name().to_owned())
    };
    // Both have 64 vCPU free; b holds 60 of them: a has more room.
    plane.nodes[1].report_for_test(
        pb::Capacity {
            vcpu: 60,
            memory_bytes: 1 << 30,
        },
        false,
    );
    assert_eq!(picked(&HashMap::new()).as_deref(), Some("node-a"));
    // a degraded: only b, while it has room for one more (1 vCPU).
    plane.nodes[0].report_for_test(pb::Capacity::default(), true);
    assert_eq!(picked(&HashMap::new()).as_deref(), Some("node-b"));
    // b holds all it has: nothing fits, whatever the ledger charges.
    plane.nodes[1].report_for_test(
        pb::Capacity {
            vcpu: 64,
            memory_bytes: 1 << 30,
        },
        false,
    );
    assert_eq!(picked(&HashMap::new()), None);
    // The ledger's charge counts too when it is the larger.
    plane.nodes[0].report_for_test(pb::Capacity::default(), false);
    let full = HashMap::from([("node-a".to_owned(), (64, 0))]);
    assert_eq!(picked(&full), None);
}

/// What a node reports in `Instances` or `Sweep` replaces what it said in
/// `Hello`.
#[tokio::test]
async fn a_sweep_report_updates_what_the_plane_believes_the_node_holds() {
    let (plane, _emulator) = plane(&["node-a"]).await;
    let (tx, _rx) = plane.nodes[0].attach_for_test(1, 16);
    let held = pb::Capacity {
        vcpu: 3,
        memory_bytes: 3 << 30,
    };
    plane.nodes[0]
        .answer_for_test(
            pb::CommandResult {
                id: "sweep-1".into(),
                outcome: pb::Outcome::Ok.into(),
                instances: Some(pb::InstanceReport {
                    inventory_known: true,
                    held: Some(held),
                    capacity: Some(pb::Capacity {
                        vcpu: 4,
                        memory_bytes: 4 << 30,
                    }),
                    ..Default::default()
                }),
                ..Default::default()
            },
            &tx,
        )
        .await;
    let status = plane.nodes[0].status().borrow().clone().expect("attached");
    assert_eq!(status.held, held);
    assert_eq!(status.capacity.vcpu, 4);
    // One vCPU left, and the tier needs one: still placeable, once.
    let none = HashMap::new();
    assert!(
        plane
            .pick_node(&HashMap::new(), &HashMap::new(), &none)
            .is_some()
    );
    let one_more = HashMap::from([("node-a".to_owned(), (4, 0))]);
    assert!(plane.pick_node(&one_more, &HashMap::new(), &none).is_none());
}

/// A plane that runs with `config` on `emulator`'s GitHub, dialing no
/// node (`config.nodes` is empty), until `shutdown`.
async fn started(
    config: &PlaneConfig,
    emulator: &scaleset::testing::Emulator,
    shutdown: &CancellationToken,
) -> Arc<Plane> {
    Plane::start(config.clone(), emulator.client(), shutdown.clone())
        .await
        .expect("start the plane")
}

/// Waits up to 20 s for `plane` to want exactly `jobs`, then for
/// GitHub's queue to be drained (every message acknowledged).
async fn wait_wanted(
    plane: &Plane,
    emulator: &scaleset::testing::Emulator,
    jobs: &[scaleset::JobRequestId],
) {
    let mut want: Vec<i64> = jobs.iter().map(|j| j.get()).collect();
    want.sort_unstable();
    let deadline = Instant::now() + Duration::from_secs(20);
    while plane.uncovered_jobs() != want || !emulator.state().queues_drained() {
        assert!(
            Instant::now() < deadline,
            "the plane wants {:?}, not {want:?}; GitHub: {:?}",
            plane.uncovered_jobs(),
            emulator.state()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A fresh SQLite ledger file in the temp directory.
fn ledger_file() -> std::path::PathBuf {
    std::env::temp_dir().join(format!("billet-plane-test-{}.db", uuid::Uuid::new_v4()))
}

/// A restart, at the plane: jobs assigned and acknowledged by one plane, which
/// no runner took, are wanted by the plane started after it on the same ledger,
/// and a job GitHub then cancels is wanted no more, by either the set in memory
/// or the ledger.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plane_started_again_wants_the_jobs_its_predecessor_acknowledged() {
    let emulator = scaleset::testing::Emulator::builder()
        .long_poll(Duration::from_millis(200))
        .start()
        .await;
    let file = ledger_file();
    let mut config = test_config(&[]);
    config.ledger = crate::ledger::LedgerLocation::Sqlite(file.clone());
    let first_shutdown = CancellationToken::new();
    let first = started(&config, &emulator, &first_shutdown).await;
    let jobs: Vec<_> = (0..2)
        .map(|_| emulator.queue_job(first.scale_set(), ["linux"]))
        .collect();
    wait_wanted(&first, &emulator, &jobs).await;
    first_shutdown.cancel();
    first.stopped().await;
    first.ledger().close().await;

    let shutdown = CancellationToken::new();
    let second = started(&config, &emulator, &shutdown).await;
    wait_wanted(&second, &emulator, &jobs).await;
    emulator.complete_job(jobs[0], None);
    wait_wanted(&second, &emulator, &jobs[1..]).await;
    shutdown.cancel();
    second.stopped().await;
    second.ledger().close().await;

    let shutdown = CancellationToken::new();
    let third = started(&config, &emulator, &shutdown).await;
    wait_wanted(&third, &emulator, &jobs[1..]).await;
    shutdown.cancel();
    third.stopped().await;
    third.ledger().close().await;
    for suffix in ["", "-wal", "-shm"] {
        let mut path = file.clone().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(path);
    }
}

/// A quiet poll forgets only recovered jobs, the earliest first, and
/// only after two quiet polls in a row, with no message between, both
/// count more wanted than GitHub says wait; one that counts no excess
/// confirms what is left recovered.
#[test]
fn a_quiet_poll_forgets_only_recovered_jobs_and_only_twice_in_a_row() {
    let mut cover = Cover::recovering(vec![1, 2, 3]);
    cover.wanted.insert(4);
    assert!(
        cover.quiet_poll(2).is_empty(),
        "one quiet poll is not enough"
    );
    cover.message_seen();
    assert!(cover.quiet_poll(2).is_empty(), "a message came between");
    assert_eq!(
        cover.quiet_poll(3),
        vec![1],
        "the smaller excess of the two"
    );
    assert_eq!(cover.wanted, BTreeSet::from([2, 3, 4]));
    assert!(cover.quiet_poll(3).is_empty());
    assert!(cover.recovered.is_empty(), "confirmed");
    assert!(cover.quiet_poll(0).is_empty());
    assert!(cover.quiet_poll(0).is_empty());
    assert_eq!(
        cover.wanted,
        BTreeSet::from([2, 3, 4]),
        "never what it was told"
    );
}

/// A job recorded as wanted that ended while no plane listened, and
/// whose message never reaches the new plane, is dropped once GitHub's
/// statistics on quiet polls say fewer jobs wait; the job GitHub still
/// has stays wanted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_recovered_job_github_no_longer_counts_is_dropped_after_quiet_polls() {
    let emulator = scaleset::testing::Emulator::builder()
        .long_poll(Duration::from_millis(200))
        .start()
        .await;
    let file = ledger_file();
    let mut config = test_config(&[]);
    config.ledger = crate::ledger::LedgerLocation::Sqlite(file.clone());
    let shutdown = CancellationToken::new();
    let first = started(&config, &emulator, &shutdown).await;
    let set = first.scale_set().get();
    let job = emulator.queue_job(first.scale_set(), ["linux"]);
    wait_wanted(&first, &emulator, &[job]).await;
    shutdown.cancel();
    first.stopped().await;
    // A job recorded earlier whose completion no plane will hear of.
    first
        .ledger()
        .record_wanted("linux", set, &[WantedChange::Assigned(999_999)], 1)
        .await
        .expect("record");
    first.ledger().close().await;

    let shutdown = CancellationToken::new();
    let second = started(&config, &emulator, &shutdown).await;
    assert_eq!(second.uncovered_jobs(), vec![job.get(), 999_999]);
    wait_wanted(&second, &emulator, &[job]).await;
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        assert_eq!(second.uncovered_jobs(), vec![job.get()]);
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(
        second
            .ledger()
            .wanted_jobs("linux", set)
            .await
            .expect("read"),
        vec![job.get()]
    );
    shutdown.cancel();
    second.stopped().await;
    second.ledger().close().await;
    for suffix in ["", "-wal", "-shm"] {
        let mut path = file.clone().into_os_string();
        path.push(suffix);
        let _ = std::fs::remove_file(path);
    }
}

/// A launch the node answers `BUSY` names a lease whose runner already
/// works there (at another epoch): nothing was started, and nothing may be
/// ended. The plane reads the code: the lease stays open, charged and
/// covered by that runner, with no failure recorded; it is not a failed
/// launch to release and replace.
#[tokio::test]
async fn a_launch_answered_busy_leaves_the_lease_open_and_covered() {
    let (plane, _emulator) = plane(&["node-a"]).await;
    let (_tx, _rx) = plane.nodes[0].attach_for_test(1, 16);
    let lease = launched_on(&plane, 7, "node-a").await;
    let mut events = plane.subscribe();
    let busy = pb::CommandResult {
        id: "c1".into(),
        outcome: pb::Outcome::Busy.into(),
        custody: false,
        error: Some(pb::Error {
            retry_after_ms: 0,
            code: pb::ErrorCode::Busy.into(),
            message: format!(
                "lease {} has a runner on this node at epoch 1, and this launch is at epoch 2",
                lease.id
            ),
        }),
        instances: None,
    };
    Arc::clone(&plane)
        .launch_ended(
            lease.clone(),
            Arc::clone(&plane.nodes[0]),
            crate::node_link::CommandOutcome::Answered(busy),
            None,
        )
        .await;
    let after = plane
        .ledger
        .get(&lease.id)
        .await
        .expect("read")
        .expect("lease");
    assert_eq!(after.phase, Phase::Launching, "{after:?}");
    assert_eq!(after.failure_reason, None, "{after:?}");
    assert!(
        plane
            .cover
            .lock()
            .expect("cover")
            .launched
            .contains(&lease.id),
        "the working runner covers the lease's job"
    );
    let mut saw = Vec::new();
    while let Ok(event) = events.try_recv() {
        saw.push(event);
    }
    assert!(
        saw.iter()
            .any(|e| matches!(e, PlaneEvent::LaunchBusy { lease: l, .. } if *l == lease.id))
            && !saw
                .iter()
                .any(|e| matches!(e, PlaneEvent::LaunchFailed { .. })),
        "{saw:?}"
    );
}

/// A launch failed `RUNNER_NAME_TAKEN` (another scale set holds a runner of
/// the lease's name) is ended, naming why, and is not read as an outage:
/// no backoff before the job's fresh lease, the node not avoided. The same
/// launch failed `UNAVAILABLE` is backed off.
#[tokio::test]
async fn a_launch_whose_runner_name_another_set_holds_is_replaced_without_backoff() {
    let (plane, _emulator) = plane(&["node-a"]).await;
    let (_tx, _rx) = plane.nodes[0].attach_for_test(1, 16);
    let failed = |code: pb::ErrorCode, message: &str| pb::CommandResult {
        id: "c1".into(),
        outcome: pb::Outcome::Failed.into(),
        custody: false,
        error: Some(pb::Error {
            retry_after_ms: 0,
            code: code.into(),
            message: message.into(),
        }),
        instances: None,
    };
    let taken = launched_on(&plane, 8, "node-a").await;
    Arc::clone(&plane)
        .launch_ended(
            taken.clone(),
            Arc::clone(&plane.nodes[0]),
            crate::node_link::CommandOutcome::Answered(failed(
                pb::ErrorCode::RunnerNameTaken,
                "GitHub already has a runner named \"billet-x\" in another scale set",
            )),
            None,
        )
        .await;
    let after = plane
        .ledger
        .get(&taken.id)
        .await
        .expect("read")
        .expect("lease");
    assert_eq!(after.phase, Phase::Failed, "{after:?}");
    assert!(
        after
            .failure_reason
            .as_deref()
            .is_some_and(|r| r.contains("another scale set")),
        "{after:?}"
    );
    {
        let cover = plane.cover.lock().expect("cover");
        assert_eq!(cover.retry_at, None, "backed off as an outage");
        assert!(cover.avoid.is_empty(), "the node is avoided");
    }
    let outage = launched_on(&plane, 9, "node-a").await;
    Arc::clone(&plane)
        .launch_ended(
            outage,
            Arc::clone(&plane.nodes[0]),
            crate::node_link::CommandOutcome::Answered(failed(
                pb::ErrorCode::Unavailable,
                "plane unavailable",
            )),
            None,
        )
        .await;
    assert!(plane.cover.lock().expect("cover").retry_at.is_some());
}

/// The number of wait spans recorded for `request_id`, and the open one's
/// reason.
async fn waits_of(plane: &Plane, request_id: i64) -> (usize, Option<String>) {
    let job = plane
        .ledger
        .job_record(request_id)
        .await
        .expect("read")
        .expect("recorded");
    let open = job
        .waits
        .iter()
        .find(|w| w.until_ms.is_none())
        .map(|w| w.reason.clone());
    (job.waits.len(), open)
}

/// A job on a full node waits for capacity, recorded once however many
/// passes decide the same; a degraded node is named with its reason; past
/// the bound the job is judged stuck once, counted and shown so; room
/// places it.
#[tokio::test]
async fn a_wait_is_recorded_when_its_reason_changes_and_a_job_unplaceable_past_the_bound_is_stuck_once()
 {
    let (plane, _emulator) = plane_configured(&["node-a"], |c| {
        c.jobs.stuck_after = Duration::from_millis(200);
    })
    .await;
    plane.github.ensure_scale_set("linux").await.expect("set");
    let (_tx, mut rx) = plane.nodes[0].attach_for_test(1, 64);
    let full = pb::Capacity {
        vcpu: 64,
        memory_bytes: 1 << 40,
    };
    plane.nodes[0].report_for_test(full, false);
    plane.cover.lock().expect("cover").wanted.insert(41);
    for _ in 0..3 {
        Arc::clone(&plane).cover_once().await.expect("pass");
    }
    assert_eq!(waits_of(&plane, 41).await, (1, Some("no_capacity".into())));
    let job = plane.ledger.job_record(41).await.unwrap().unwrap();
    assert!(
        job.waits[0].detail.contains("node-a full (0 vCPU"),
        "{:?}",
        job.waits
    );
    plane.nodes[0].report_for_test(full, true);
    Arc::clone(&plane).cover_once().await.expect("pass");
    assert_eq!(
        waits_of(&plane, 41).await,
        (2, Some("node_degraded".into()))
    );
    let job = plane.ledger.job_record(41).await.unwrap().unwrap();
    assert!(
        job.waits[1].detail.contains("node-a degraded"),
        "{:?}",
        job.waits
    );
    assert!(job.stuck_at_ms.is_none());
    tokio::time::sleep(Duration::from_millis(250)).await;
    Arc::clone(&plane).cover_once().await.expect("pass");
    Arc::clone(&plane).cover_once().await.expect("pass");
    let job = plane.ledger.job_record(41).await.unwrap().unwrap();
    assert_eq!(job.stuck_reason.as_deref(), Some("node_degraded"));
    assert_eq!(crate::jobs::state(&job), "stuck: node degraded");
    let mut text = String::new();
    prometheus_client::encoding::text::encode(&mut text, &plane.registry).unwrap();
    assert!(
        text.contains("billet_jobs_stuck_total{tier=\"linux\"} 1\n"),
        "{text}"
    );
    assert!(
        text.contains("billet_plane_jobs_waiting{tier=\"linux\",reason=\"node_degraded\"} 1\n"),
        "{text}"
    );
    // Room again: a lease is placed and the job waits on its runner.
    plane.nodes[0].report_for_test(pb::Capacity::default(), false);
    Arc::clone(&plane).cover_once().await.expect("pass");
    tokio::time::timeout(Duration::from_secs(5), rx.recv())
        .await
        .expect("a launch")
        .expect("sent");
    let (spans, open) = waits_of(&plane, 41).await;
    assert_eq!((spans, open.as_deref()), (3, Some("runner_starting")));
    let job = plane.ledger.job_record(41).await.unwrap().unwrap();
    assert_eq!(job.attempts.len(), 1);
    assert_eq!(job.attempts[0].node, "node-a");
}
