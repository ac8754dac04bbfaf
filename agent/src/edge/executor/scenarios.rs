//! Scenarios over the executor, with a fake provider and a plane played by
//! the test: every message the node sends is read from the session's
//! channel, and each `NodeCall` is answered through `SessionLink::on_reply`.

use super::*;
use tokio::sync::mpsc;

use crate::edge::link::PlaneLink;
use crate::edge::session::{Identity, NodeService, now_unix_ms};
use crate::edge::slot::Admission;
use crate::edge::wire;
use crate::journal::MemoryJournal;
use crate::model::CommandId;
use crate::model::NodeName;
use crate::provider::fake::FakeProvider;
use std::sync::Mutex;

type Answer = Result<Option<pb::plane_reply::Result>, pb::ErrorCode>;

/// What the test plane saw: the calls by kind, and the results.
struct Plane {
    calls: Arc<Mutex<Vec<&'static str>>>,
    results: mpsc::UnboundedReceiver<pb::CommandResult>,
    session: Arc<SessionLink>,
}

impl Plane {
    fn calls(&self) -> Vec<&'static str> {
        self.calls.lock().expect("calls").clone()
    }

    async fn result(&mut self) -> pb::CommandResult {
        tokio::time::timeout(Duration::from_secs(5), self.results.recv())
            .await
            .expect("the node answered within 5s")
            .expect("the session is open")
    }
}

fn kind(call: &pb::node_call::Call) -> &'static str {
    use pb::node_call::Call;
    match call {
        Call::Bind(_) => "bind",
        Call::Advance(_) => "advance",
        Call::BindAdvance(_) => "bind_advance",
        Call::Heartbeat(_) => "heartbeat",
        Call::Release(_) => "release",
        Call::GetLease(_) => "get_lease",
        Call::Launched(_) => "launched",
        Call::Reconcile(_) => "reconcile",
        Call::MintJit(_) => "mint_jit",
        Call::RemoveRunner(_) => "remove_runner",
        Call::MarkFailure(_) => "mark_failure",
        Call::RenewCertificate(_) => "renew_certificate",
        Call::Resize(_) => "resize",
        Call::RecordCacheObservation(_) => "record_cache_observation",
        Call::ActionsPolicy(_) => "actions_policy",
        Call::ReserveWarm(_) => "reserve_warm",
        Call::ReleaseWarm(_) => "release_warm",
        Call::WarmRooms(_) => "warm_rooms",
    }
}

/// A plane that answers bind, advance and remove_runner with success and
/// a mint with a registration, except where `answer` says otherwise.
fn default_answer(call: &pb::node_call::Call) -> Answer {
    match call {
        pb::node_call::Call::MintJit(m) => Ok(Some(pb::plane_reply::Result::Jit(pb::JitConfig {
            encoded_jit_config: "jit-config".into(),
            runner_id: 42,
            runner_name: m.runner_name.clone(),
        }))),
        _ => Ok(None),
    }
}

/// Opens a session on `link` and plays the plane on it.
fn open_plane(
    link: &PlaneLink,
    answer: impl Fn(&pb::node_call::Call) -> Answer + Send + 'static,
) -> Plane {
    let (tx, mut rx) = mpsc::channel(64);
    let session = Arc::new(SessionLink::new(1, tx));
    link.install(Arc::clone(&session), Duration::from_secs(30));
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (results_tx, results) = mpsc::unbounded_channel();
    let (seen, replier) = (Arc::clone(&calls), Arc::clone(&session));
    tokio::spawn(async move {
        while let Some(Ok(pb::NodeMessage { body: Some(body) })) = rx.recv().await {
            match body {
                pb::node_message::Body::Call(pb::NodeCall {
                    call_id,
                    call: Some(call),
                }) => {
                    seen.lock().expect("calls").push(kind(&call));
                    let (result, error) = match answer(&call) {
                        Ok(result) => (result, None),
                        Err(code) => (
                            None,
                            Some(pb::Error {
                                retry_after_ms: 0,
                                code: code.into(),
                                message: format!("the test plane refuses {}", kind(&call)),
                            }),
                        ),
                    };
                    replier.on_reply(pb::PlaneReply {
                        call_id,
                        error,
                        result,
                    });
                }
                pb::node_message::Body::Result(r) => {
                    let _ = results_tx.send(r);
                }
                _ => {}
            }
        }
    });
    Plane {
        calls,
        results,
        session,
    }
}

fn node(provider: Arc<FakeProvider>) -> (Arc<Runner>, Arc<PlaneLink>) {
    let link = Arc::new(PlaneLink::new(Duration::from_secs(5)));
    let runner = Arc::new(Runner::new(
        provider,
        link.clone(),
        link.clone(),
        crate::node::runner::RunnerOptions::default(),
    ));
    (runner, link)
}

fn launch(id: &str) -> (CommandId, NodeCommand) {
    let mut command = crate::edge::wire::tests::launch();
    command.id = id.into();
    command.deadline_unix_ms = now_unix_ms() + 60_000;
    wire::command(command)
        .command
        .expect("a well-formed launch")
}

fn push_launch(slot: &CommandSlot, session: &Arc<SessionLink>, id: &str) {
    let (id, command) = launch(id);
    push(slot, session, id, command);
}

/// Queues `command` as `id` on `slot`, due in a minute.
fn push(slot: &CommandSlot, session: &Arc<SessionLink>, id: CommandId, command: NodeCommand) {
    let admission = slot.push(Queued {
        id,
        deadline: tokio::time::Instant::now() + Duration::from_secs(60),
        command,
        session: Arc::clone(session),
    });
    assert!(matches!(admission, Admission::Queued), "{admission:?}");
}

/// A launch as [`launch`] makes, of a lease asking for `vcpu`.
fn push_sized_launch(slot: &CommandSlot, session: &Arc<SessionLink>, id: &str, vcpu: u32) {
    let mut command = crate::edge::wire::tests::launch();
    command.id = id.into();
    command.deadline_unix_ms = now_unix_ms() + 60_000;
    if let Some(pb::command::Kind::Launch(pb::Launch {
        lease: Some(lease), ..
    })) = &mut command.kind
    {
        lease.vcpu = vcpu;
    }
    let (id, command) = wire::command(command)
        .command
        .expect("a well-formed launch");
    push(slot, session, id, command);
}

fn executor(recovery: Arc<Recovery>) -> Executor {
    Executor {
        recovery,
        journal: Arc::new(MemoryJournal::default()),
        ack_timeout: Duration::from_secs(60),
        upgrader: None,
        capacity: pb::Capacity::default(),
        health: Arc::default(),
    }
}

/// A hung engine: a launch queued behind a command the engine never
/// answers is refused, typed UNAVAILABLE, as soon as the node is
/// degraded, not after the stuck command (the plane would have timed it
/// out and taken the lease for held by the node); one arriving while
/// degraded is refused at once and never queued; the slot's watchdog
/// sees the stuck command. Nothing is bound or minted.
#[tokio::test(start_paused = true)]
async fn a_launch_behind_a_stuck_command_is_refused_once_degraded_and_a_new_one_at_once() {
    use crate::node::health::{Reason, SLOT_STUCK_AFTER};
    let provider = Arc::new(FakeProvider::new());
    provider.block(crate::provider::fake::Operation::List);
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let health = Arc::new(Health::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        Executor {
            health: health.clone(),
            ..executor(Arc::new(Recovery::done()))
        },
        cancel.clone(),
    ));
    let admission = slot.push(Queued {
        id: CommandId::parse("id", "i1").expect("id"),
        deadline: tokio::time::Instant::now() + Duration::from_secs(600),
        command: NodeCommand::Instances,
        session: Arc::clone(&plane.session),
    });
    assert!(matches!(admission, Admission::Queued));
    push_launch(&slot, &plane.session, "c1");
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(slot.busy_for().is_some(), "the Instances is not running");
    assert!(
        plane.results.try_recv().is_err(),
        "answered while healthy and stuck"
    );

    // The watchdog: past the bound, the slot is stuck.
    health.slot_progress(slot.busy_for());
    assert!(!health.snapshot().degraded());
    tokio::time::sleep(SLOT_STUCK_AFTER).await;
    health.slot_progress(slot.busy_for());
    assert_eq!(health.snapshot().reasons, [Reason::SlotStuck]);

    let result = plane.result().await;
    assert_eq!(result.id, "c1");
    assert_eq!(result.outcome, pb::Outcome::Refused as i32, "{result:?}");
    assert_eq!(
        result.error.as_ref().map(|e| e.code),
        Some(pb::ErrorCode::Unavailable as i32)
    );
    assert!(!result.custody, "{result:?}");
    assert!(slot.is_empty(), "the refused launch is still queued");

    // A launch arriving now is answered at once, never queued.
    let identity = Identity {
        node_name: NodeName::parse("node", "node-1").expect("name"),
        deployment: "dev".into(),
        incarnation: "i".into(),
        vcpu: 1,
        memory_bytes: 1,
        version: "0".into(),
    };
    let service = NodeService::new(
        identity,
        runner.clone(),
        link.clone(),
        slot.clone(),
        Arc::new(Recovery::done()),
    )
    .with_health(health.clone());
    let mut command = crate::edge::wire::tests::launch();
    command.id = "c2".into();
    command.deadline_remaining_ms = Some(60_000);
    service
        .route(
            &plane.session,
            pb::plane_message::Body::Command(command.clone()),
        )
        .await;
    let result = plane.result().await;
    assert_eq!(result.id, "c2");
    assert_eq!(
        result.error.as_ref().map(|e| e.code),
        Some(pb::ErrorCode::Unavailable as i32)
    );
    assert!(slot.is_empty(), "a launch was queued on a degraded node");
    // Redelivered, it gets the same answer.
    service
        .route(&plane.session, pb::plane_message::Body::Command(command))
        .await;
    assert_eq!(plane.result().await, result);
    assert!(
        plane.calls().is_empty(),
        "the plane was called: {:?}",
        plane.calls()
    );
    assert_eq!(provider.count(crate::provider::fake::Operation::Create), 0);

    provider.unblock(crate::provider::fake::Operation::List);
    let instances = plane.result().await;
    assert_eq!(instances.id, "i1");
    cancel.cancel();
    task.await.expect("executor");
}

/// 7.L.4. In paused time: the sleep below returns only once every
/// other task is idle, so "nothing happened" is a settled state, not a
/// race with a loaded machine.
#[tokio::test(start_paused = true)]
async fn a_launch_queued_before_recovery_waits_for_recovery_and_then_runs() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let recovery = Arc::new(Recovery::default());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner,
        slot.clone(),
        executor(recovery.clone()),
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");

    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        plane.calls().is_empty(),
        "the node called the plane before recovery: {:?}",
        plane.calls()
    );
    assert!(
        provider.calls().is_empty(),
        "the provider was touched before recovery"
    );
    assert!(
        plane.results.try_recv().is_err(),
        "a result was sent before recovery"
    );
    assert_eq!(slot.len(), 1, "the launch left the slot before recovery");

    recovery.mark_done();
    let result = plane.result().await;
    assert_eq!(result.id, "c1");
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    assert_eq!(plane.calls(), ["bind_advance", "mint_jit"]);
    assert_eq!(
        provider.instances().len(),
        1,
        "the launch created its instance after recovery"
    );
    cancel.cancel();
    task.await.expect("executor");
}

/// A launch binds its lease and advances it to launching in one
/// plane round trip (`BindAdvance`), so the plane is asked twice
/// before the create, where it was asked three times (`Bind`,
/// `Advance`, then the mint).
#[tokio::test]
async fn a_launch_asks_the_plane_twice_before_it_creates() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner,
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    assert_eq!(
        plane.calls(),
        ["bind_advance", "mint_jit"],
        "plane round trips on the launch path"
    );
    assert_eq!(provider.instances().len(), 1);
    cancel.cancel();
    task.await.expect("executor");
}

/// A launch as [`launch`] makes, carrying the registration the plane
/// minted before dispatching it.
fn push_registered_launch(slot: &CommandSlot, session: &Arc<SessionLink>, id: &str) {
    let mut command = crate::edge::wire::tests::launch();
    command.id = id.into();
    command.deadline_unix_ms = now_unix_ms() + 60_000;
    let Some(pb::command::Kind::Launch(launch)) = &mut command.kind else {
        unreachable!("wire::tests::launch is a launch");
    };
    let lease = launch
        .lease
        .as_ref()
        .map(|l| l.id.clone())
        .unwrap_or_default();
    launch.registration = Some(pb::JitConfig {
        encoded_jit_config: "plane-minted".into(),
        runner_id: 77,
        runner_name: format!("billet-{lease}"),
    });
    let (id, command) = wire::command(command)
        .command
        .expect("a well-formed launch");
    push(slot, session, id, command);
}

/// A launch carrying the registration the plane minted asks the plane
/// once (`BindAdvance`) and never to mint, and its instance runs with
/// that registration's config.
#[tokio::test]
async fn a_launch_carrying_its_registration_asks_the_plane_once_and_mints_nothing() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_registered_launch(&slot, &plane.session, "c1");
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    assert_eq!(
        plane.calls(),
        ["bind_advance"],
        "plane round trips on the launch path"
    );
    let used: Vec<String> = provider
        .jit_configs_used()
        .iter()
        .map(|c| c.expose().to_owned())
        .collect();
    assert_eq!(used, ["plane-minted"]);
    let instances = provider.instances();
    assert_eq!(instances.len(), 1);
    assert_eq!(instances[0].state, crate::provider::InstanceState::Running);
    let held = runner.held();
    assert_eq!(held.len(), 1, "{held:?}");
    cancel.cancel();
    task.await.expect("executor");
}

/// The instance of a launch carrying its registration is created
/// before the bind is answered, and started only once it is: a
/// refused bind leaves nothing running and nothing behind (the
/// created instance removed unstarted), asks the plane to remove
/// nothing (the registration is the plane's), and holds nothing.
#[tokio::test]
async fn a_launch_carrying_its_registration_whose_bind_is_refused_removes_its_unstarted_instance() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, |call| match call {
        pb::node_call::Call::BindAdvance(_) => Err(pb::ErrorCode::Fenced),
        other => default_answer(other),
    });
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_registered_launch(&slot, &plane.session, "c1");
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert!(!result.custody, "{result:?}");
    assert_eq!(plane.calls(), ["bind_advance"]);
    let operations: Vec<_> = provider
        .calls()
        .iter()
        .map(crate::provider::fake::Call::operation)
        .collect();
    assert!(
        operations.contains(&crate::provider::fake::Operation::Create),
        "the instance was not created beside the bind: {operations:?}"
    );
    assert!(
        operations.contains(&crate::provider::fake::Operation::Destroy),
        "the unstarted instance was not removed: {operations:?}"
    );
    assert!(
        provider.instances().is_empty(),
        "{:?}",
        provider.instances()
    );
    assert!(!runner.holding());
    cancel.cancel();
    task.await.expect("executor");
}

/// A lease asking for more vCPUs than the provider runs (the Docker
/// engine refuses a limit above its host's CPUs) is resized in the
/// ledger to what runs, after the bind and before the mint, and
/// created at that size.
#[tokio::test]
async fn a_lease_larger_than_the_provider_runs_is_resized_before_the_mint() {
    let provider = Arc::new(FakeProvider::new());
    provider.set_cpus(2);
    let (runner, link) = node(provider.clone());
    let resized = Arc::new(Mutex::new(Vec::new()));
    let seen = Arc::clone(&resized);
    let mut plane = open_plane(&link, move |call| {
        if let pb::node_call::Call::Resize(r) = call {
            seen.lock().expect("resized").push(r.clone());
        }
        default_answer(call)
    });
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_sized_launch(&slot, &plane.session, "c1", 4);
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    assert_eq!(plane.calls(), ["bind_advance", "resize", "mint_jit"]);
    assert_eq!(
        *resized.lock().expect("resized"),
        [pb::Resize {
            lease_id: "l1".into(),
            epoch: 1,
            vcpu: 2,
            memory_bytes: 1 << 30,
        }]
    );
    let specs = provider.specs();
    assert_eq!(specs.len(), 1);
    assert_eq!(specs[0].vcpu, 2, "created at the size that runs");
    assert_eq!(runner.held_charge(), (2, 1 << 30), "charged what runs");
    cancel.cancel();
    task.await.expect("executor");
}

/// A resize the plane refuses (no room, fenced, or a plane that
/// predates `Resize`) fails the launch before anything is minted or
/// created, and the lease is released.
#[tokio::test]
async fn a_refused_resize_fails_the_launch_before_anything_is_minted() {
    let provider = Arc::new(FakeProvider::new());
    provider.set_cpus(2);
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, |call| match call {
        pb::node_call::Call::Resize(_) => Err(pb::ErrorCode::InvalidArgument),
        other => default_answer(other),
    });
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_sized_launch(&slot, &plane.session, "c1", 4);
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert!(
        result
            .error
            .as_ref()
            .is_some_and(|e| e.message.contains("would not resize")),
        "{result:?}"
    );
    assert!(!plane.calls().contains(&"mint_jit"), "{:?}", plane.calls());
    assert!(provider.specs().is_empty(), "nothing created");
    assert_eq!(runner.held_charge(), (0, 0));
    cancel.cancel();
    task.await.expect("executor");
}

/// A plane that predates `BindAdvance` answers it `INVALID_ARGUMENT`
/// (the call is missing); the node then binds and advances in two
/// calls, and on that session asks `BindAdvance` no more.
#[tokio::test]
async fn a_plane_that_predates_bind_advance_is_asked_bind_then_advance() {
    use crate::node::plane::LeaseStore as _;
    let (_runner, link) = node(Arc::new(FakeProvider::new()));
    let plane = open_plane(&link, |call| match call {
        pb::node_call::Call::BindAdvance(_) => Err(pb::ErrorCode::InvalidArgument),
        other => default_answer(other),
    });
    let lease = crate::model::LeaseId::parse("lease", "l1").expect("id");
    let epoch = crate::model::Epoch(1);
    link.bind_advance(&lease, epoch, crate::model::Phase::Launching)
        .await
        .expect("bound and launching");
    assert_eq!(plane.calls(), ["bind_advance", "bind", "advance"]);
    link.bind_advance(&lease, epoch, crate::model::Phase::Launching)
        .await
        .expect("bound and launching, again");
    assert_eq!(
        plane.calls(),
        ["bind_advance", "bind", "advance", "bind", "advance"]
    );
}

/// 7.L.10. In paused time: the sleep returns only once every other
/// task is idle.
#[tokio::test(start_paused = true)]
async fn a_node_whose_recovery_never_succeeds_answers_no_command_and_touches_nothing() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let recovery = Arc::new(Recovery::default());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner,
        slot.clone(),
        executor(recovery.clone()),
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");
    push_launch(&slot, &plane.session, "c2");

    tokio::time::sleep(Duration::from_millis(500)).await;
    cancel.cancel();
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("the executor stops on cancel while waiting for recovery")
        .expect("executor");
    assert!(!recovery.is_done());
    assert!(
        plane.results.try_recv().is_err(),
        "a command was answered without recovery"
    );
    assert!(
        plane.calls().is_empty(),
        "the plane was called: {:?}",
        plane.calls()
    );
    assert!(provider.calls().is_empty(), "the provider was touched");
    assert_eq!(slot.len(), 2, "a command was taken off the slot");
}

/// 7.L.8
#[tokio::test]
async fn a_launch_that_leaves_compute_it_cannot_clean_up_is_answered_with_the_custody_flag() {
    let provider = Arc::new(FakeProvider::new());
    provider.fail_create_after_starting(1);
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, |call| match call {
        pb::node_call::Call::RemoveRunner(_) => Err(pb::ErrorCode::Unavailable),
        other => default_answer(other),
    });
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");

    let result = plane.result().await;
    assert_eq!(result.id, "c1");
    assert!(result.custody, "custody did not cross the wire: {result:?}");
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert!(result.error.is_some());
    assert!(
        provider.instance("billet-l1").is_some_and(|i| i.may_run()),
        "the started instance is still there, held"
    );
    cancel.cancel();
    task.await.expect("executor");

    // The same through `execute` directly: the flag comes from the runner's error.
    let provider = Arc::new(FakeProvider::new());
    provider.fail_create_after_starting(1);
    let (runner, link) = node(provider.clone());
    let _plane = open_plane(&link, |call| match call {
        pb::node_call::Call::RemoveRunner(_) => Err(pb::ErrorCode::Unavailable),
        other => default_answer(other),
    });
    let (id, command) = launch("c2");
    let (result, launched) =
        execute(&runner, None, pb::Capacity::default(), id.as_str(), command).await;
    assert!(result.custody, "{result:?}");
    assert!(
        launched.is_none(),
        "a failed launch is not a launch to take custody of on ack"
    );
}

/// The refusal is typed, names the image, and nothing is minted or
/// created. The image is checked beside the bind, so the lease bound
/// meanwhile is released `failed` by the node, never left bound.
#[tokio::test]
async fn a_launch_whose_image_is_missing_is_refused_image_unavailable_and_its_bound_lease_released()
{
    let provider = Arc::new(FakeProvider::new());
    let (_, command) = launch("c1");
    let NodeCommand::Launch { ref tier, .. } = command else {
        panic!("a launch")
    };
    let image = tier.image.clone();
    provider.remove_image(&image);
    let (runner, link) = node(provider.clone());
    let plane = open_plane(&link, default_answer);
    let (result, launched) = execute(&runner, None, pb::Capacity::default(), "c1", command).await;
    assert_eq!(result.outcome, pb::Outcome::Refused as i32, "{result:?}");
    assert!(!result.custody, "{result:?}");
    assert!(launched.is_none());
    let error = result.error.expect("an error");
    assert_eq!(
        error.code,
        pb::ErrorCode::ImageUnavailable as i32,
        "{error:?}"
    );
    assert!(error.message.contains(&image), "{error:?}");
    assert_eq!(
        plane.calls(),
        ["bind_advance", "mark_failure", "release"],
        "the bound lease is released failed saying why, and nothing is minted"
    );
    assert_eq!(provider.count(crate::provider::fake::Operation::Create), 0);
    assert!(!runner.holding());
}

/// The image check and the bind do not wait for each other: the plane
/// is asked to bind while the provider has not yet answered about the
/// image.
#[tokio::test]
async fn the_lease_is_bound_while_the_image_is_checked() {
    let provider = Arc::new(FakeProvider::new());
    provider.block(crate::provider::fake::Operation::CheckImage);
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner,
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");
    let bound = tokio::time::timeout(Duration::from_secs(5), async {
        while plane.calls().is_empty() {
            tokio::task::yield_now().await;
        }
    })
    .await;
    assert!(
        bound.is_ok(),
        "the plane was not asked to bind while the image check was pending"
    );
    assert_eq!(plane.calls(), ["bind_advance"]);
    assert_eq!(
        provider.calls(),
        [crate::provider::fake::Call::CheckImage(
            "billet-standin-runner:dev".into()
        )]
    );
    provider.unblock(crate::provider::fake::Operation::CheckImage);
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    assert_eq!(plane.calls(), ["bind_advance", "mint_jit"]);
    cancel.cancel();
    task.await.expect("executor");
}

/// A launch lists nothing before it binds; its image check is its
/// fresh look at the engine, so the provider is asked once before the
/// create (a whole list first would be a Docker call in series with
/// everything after it).
#[tokio::test]
async fn a_launch_asks_the_provider_once_before_it_creates() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, default_answer);
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let health = Arc::new(Health::new().with_probe(provider.clone()));
    let task = tokio::spawn(execute_commands(
        runner,
        slot.clone(),
        Executor {
            health,
            ..executor(Arc::new(Recovery::done()))
        },
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");
    let result = plane.result().await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    let operations: Vec<_> = provider
        .calls()
        .iter()
        .map(crate::provider::fake::Call::operation)
        .collect();
    assert_eq!(
        operations,
        [
            crate::provider::fake::Operation::CheckImage,
            crate::provider::fake::Operation::Create
        ]
    );
    cancel.cancel();
    task.await.expect("executor");
}

/// A start that fails after the create (the instance exists, not
/// running) fails the launch cleanly once the instance is removed:
/// nothing held.
#[tokio::test]
async fn a_failed_start_after_the_create_is_cleaned_up_like_a_failed_create() {
    let provider = Arc::new(FakeProvider::new());
    provider.fail_next(crate::provider::fake::Operation::Start, 1);
    let (runner, link) = node(provider.clone());
    let plane = open_plane(&link, default_answer);
    let (_, command) = launch("c1");
    let (result, launched) = execute(&runner, None, pb::Capacity::default(), "c1", command).await;
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert!(!result.custody, "{result:?}");
    assert!(launched.is_none());
    assert!(
        provider.instances().is_empty(),
        "the created instance stays"
    );
    assert_eq!(plane.calls(), ["bind_advance", "mint_jit", "remove_runner"]);
    assert!(!runner.holding());
}

/// 7.L.9
#[tokio::test]
async fn a_launch_refused_at_bind_is_a_clean_failure_without_the_custody_flag() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let mut plane = open_plane(&link, |call| match call {
        pb::node_call::Call::BindAdvance(_) => Err(pb::ErrorCode::Refused),
        other => default_answer(other),
    });
    let slot = Arc::new(CommandSlot::new());
    let cancel = CancellationToken::new();
    let task = tokio::spawn(execute_commands(
        runner.clone(),
        slot.clone(),
        executor(Arc::new(Recovery::done())),
        cancel.clone(),
    ));
    push_launch(&slot, &plane.session, "c1");

    let result = plane.result().await;
    assert_eq!(result.id, "c1");
    assert!(
        !result.custody,
        "a clean failure claimed custody: {result:?}"
    );
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert!(result.error.is_some_and(|e| e.message.contains("bind")));
    assert_eq!(
        plane.calls(),
        ["bind_advance"],
        "nothing past the refused bind"
    );
    assert!(
        provider
            .calls()
            .iter()
            .all(|c| matches!(c, crate::provider::fake::Call::CheckImage(_))),
        "the provider was touched past the image check: {:?}",
        provider.calls()
    );
    cancel.cancel();
    task.await.expect("executor");

    let (id, command) = launch("c2");
    let (result, launched) =
        execute(&runner, None, pb::Capacity::default(), id.as_str(), command).await;
    assert!(!result.custody, "{result:?}");
    assert!(launched.is_none());
}

/// Capacity that means something: every `Instances` report carries
/// the node's capacity and what the leases it holds charge; a
/// launched lease is held, and one whose launch failed is not.
#[tokio::test]
async fn an_instances_report_says_the_capacity_and_what_the_held_leases_charge() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let _plane = open_plane(&link, default_answer);
    let capacity = pb::Capacity {
        vcpu: 8,
        memory_bytes: 8 << 30,
    };
    let report = |r: pb::CommandResult| r.instances.expect("an instance report");
    let (before, _) = execute(&runner, None, capacity, "i0", NodeCommand::Instances).await;
    let before = report(before);
    assert_eq!(before.capacity, Some(capacity));
    assert_eq!(
        before.held,
        Some(pb::Capacity::default()),
        "nothing is held yet"
    );

    let (id, command) = launch("c1");
    let NodeCommand::Launch { lease, .. } = &command else {
        panic!("not a launch");
    };
    let size = pb::Capacity {
        vcpu: lease.vcpu,
        memory_bytes: lease.memory.0,
    };
    let (result, _) = execute(&runner, None, capacity, id.as_str(), command).await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    let (after, _) = execute(&runner, None, capacity, "i1", NodeCommand::Instances).await;
    let after = report(after);
    assert_eq!(after.held, Some(size), "the launched lease is not counted");
    assert_eq!(after.capacity, Some(capacity));
    assert_eq!(after.lease_ids.len(), 1);
}

/// A mint the plane answers `SCALE_SET_NOT_FOUND` fails the launch
/// with that code, not an untyped failure: nothing was created, the
/// lease may be released, and the plane reads the code.
#[tokio::test]
async fn a_mint_for_a_missing_scale_set_fails_the_launch_with_its_code() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let _plane = open_plane(&link, |call| match call {
        pb::node_call::Call::MintJit(_) => Err(pb::ErrorCode::ScaleSetNotFound),
        other => default_answer(other),
    });
    let (id, command) = launch("c1");
    let (result, launched) =
        execute(&runner, None, pb::Capacity::default(), id.as_str(), command).await;
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert_eq!(
        result.error.map(|e| e.code),
        Some(pb::ErrorCode::ScaleSetNotFound as i32)
    );
    assert!(!result.custody && launched.is_none());
    assert_eq!(provider.count(crate::provider::fake::Operation::Create), 0);
}

/// A mint the plane answers `RUNNER_NAME_TAKEN` (another scale set holds
/// a runner of the name) fails the launch with that code, never
/// `UNSPECIFIED`: nothing was created, the lease may be released, and the
/// plane reads the code rather than take it for an outage.
#[tokio::test]
async fn a_mint_whose_runner_name_another_set_holds_fails_the_launch_with_its_code() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let _plane = open_plane(&link, |call| match call {
        pb::node_call::Call::MintJit(_) => Err(pb::ErrorCode::RunnerNameTaken),
        other => default_answer(other),
    });
    let (id, command) = launch("c1");
    let (result, launched) =
        execute(&runner, None, pb::Capacity::default(), id.as_str(), command).await;
    assert_eq!(result.outcome, pb::Outcome::Failed as i32, "{result:?}");
    assert_eq!(
        result.error.map(|e| e.code),
        Some(pb::ErrorCode::RunnerNameTaken as i32)
    );
    assert!(!result.custody && launched.is_none());
    assert_eq!(provider.count(crate::provider::fake::Operation::Create), 0);
}

/// Every `Sweep` report carries the capacity and what the held
/// leases charge, like `Instances`, with the inventory it read.
#[tokio::test]
async fn a_sweep_report_says_the_capacity_and_what_the_held_leases_charge() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let _plane = open_plane(&link, default_answer);
    let capacity = pb::Capacity {
        vcpu: 8,
        memory_bytes: 8 << 30,
    };
    let (id, command) = launch("c1");
    let NodeCommand::Launch { lease, .. } = &command else {
        panic!("not a launch");
    };
    let size = pb::Capacity {
        vcpu: lease.vcpu,
        memory_bytes: lease.memory.0,
    };
    let lease_id = lease.id.as_str().to_owned();
    let (result, _) = execute(&runner, None, capacity, id.as_str(), command).await;
    assert_eq!(result.outcome, pb::Outcome::Ok as i32, "{result:?}");
    let (swept, _) = execute(&runner, None, capacity, "s1", NodeCommand::Sweep).await;
    let report = swept.instances.expect("a sweep report");
    assert_eq!(report.capacity, Some(capacity));
    assert_eq!(report.held, Some(size));
    assert!(report.inventory_known);
    assert_eq!(report.lease_ids, vec![lease_id]);

    // A provider that cannot be listed: no inventory, still the numbers.
    provider.fail_next(crate::provider::fake::Operation::List, 1);
    let (failed, _) = execute(&runner, None, capacity, "s2", NodeCommand::Sweep).await;
    let report = failed.instances.expect("a sweep report");
    assert!(!report.inventory_known && report.lease_ids.is_empty());
    assert_eq!(report.held, Some(size));
}

/// 7.L.12
#[test]
fn a_launch_without_a_lease_is_refused_naming_launch_lease() {
    let (_, NodeCommand::Launch { .. }) = launch("c1") else {
        panic!("not a launch");
    };
    let incoming = wire::command(pb::Command {
        id: "c1".into(),
        deadline_unix_ms: now_unix_ms() + 60_000,
        deadline_remaining_ms: None,
        kind: Some(pb::command::Kind::Launch(pb::Launch {
            registration: None,
            lease: None,
            tier: Some(pb::TierSpec {
                label: "linux".into(),
                image: "billet-standin-runner:dev".into(),
                command: vec!["/run".into()],
                trust: "trusted".into(),
                ..Default::default()
            }),
            job: Some(pb::Job {
                request_id: 7,
                ..Default::default()
            }),
            warm_instance: String::new(),
        })),
    });
    let invalid = incoming
        .command
        .expect_err("a launch with no lease was accepted");
    assert_eq!(invalid.field, "launch.lease");
    assert_eq!(incoming.id, "c1", "the refusal still names the command");
}

/// 7.L.12, at the session: the refusal is answered and nothing is queued.
#[tokio::test]
async fn a_launch_without_a_lease_is_answered_invalid_and_never_queued() {
    let provider = Arc::new(FakeProvider::new());
    let (runner, link) = node(provider.clone());
    let slot = Arc::new(CommandSlot::new());
    let identity = Identity {
        node_name: NodeName::parse("node", "node-1").expect("name"),
        deployment: "dev".into(),
        incarnation: "i".into(),
        vcpu: 1,
        memory_bytes: 1,
        version: "0".into(),
    };
    let service = NodeService::new(identity, runner, link, slot.clone(), Arc::default());
    let (tx, mut rx) = mpsc::channel(8);
    let session = Arc::new(SessionLink::new(1, tx));
    let command = pb::Command {
        id: "c1".into(),
        deadline_unix_ms: now_unix_ms() + 60_000,
        deadline_remaining_ms: None,
        kind: Some(pb::command::Kind::Launch(pb::Launch {
            registration: None,
            lease: None,
            tier: None,
            job: None,
            warm_instance: String::new(),
        })),
    };
    service
        .route(&session, pb::plane_message::Body::Command(command))
        .await;
    let Some(Ok(pb::NodeMessage {
        body: Some(pb::node_message::Body::Result(result)),
    })) = rx.recv().await
    else {
        panic!("no answer to a launch without a lease");
    };
    assert_eq!(result.id, "c1");
    assert_eq!(result.outcome, pb::Outcome::InvalidArgument as i32);
    let error = result.error.expect("an error");
    assert_eq!(error.code, pb::ErrorCode::InvalidArgument as i32);
    assert!(error.message.contains("launch.lease"), "{}", error.message);
    assert!(slot.is_empty());
    assert!(provider.calls().is_empty());
}
