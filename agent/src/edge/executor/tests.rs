//! Scenarios over the executor across sessions (7.B.20, 7.L.16, 7.L.20):
//! the runner over a fake provider, and a plane played by the test on each
//! session, answering every call as a plane that agrees would and
//! recording it.

use std::sync::Mutex;

use super::*;
use tokio::sync::mpsc;

use crate::edge::link::PlaneLink;
use crate::edge::session::{Identity, NodeService, now_unix_ms};
use crate::journal::{CustodyRecord, JournalError, LaunchRecord, MemoryJournal};
use crate::model::NodeName;
use crate::model::{Epoch, LeaseId};
use crate::provider::fake::{FakeProvider, Operation};

const LEASE: &str = "l1";
const INSTANCE: &str = "billet-l1";
const REQUEST: i64 = 7;

/// The plane on one session: the calls it answered, the results it got.
struct TestPlane {
    session: Arc<SessionLink>,
    calls: Arc<Mutex<Vec<pb::node_call::Call>>>,
    results: mpsc::UnboundedReceiver<pb::CommandResult>,
}

impl TestPlane {
    fn calls(&self) -> Vec<pb::node_call::Call> {
        self.calls.lock().expect("calls").clone()
    }

    async fn result(&mut self) -> pb::CommandResult {
        tokio::time::timeout(Duration::from_secs(5), self.results.recv())
            .await
            .expect("the node answered within 5s")
            .expect("the session is open")
    }

    fn heartbeats_of(&self, lease: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| {
                matches!(c, pb::node_call::Call::Heartbeat(h)
                    if h.leases.iter().any(|l| l.lease_id == lease))
            })
            .count()
    }

    fn releases(&self) -> Vec<pb::Release> {
        self.calls()
            .into_iter()
            .filter_map(|c| match c {
                pb::node_call::Call::Release(r) => Some(r),
                _ => None,
            })
            .collect()
    }
}

/// What a plane that agrees with everything answers.
fn agree(call: &pb::node_call::Call) -> Option<pb::plane_reply::Result> {
    use pb::node_call::Call;
    use pb::plane_reply::Result as R;
    match call {
        Call::MintJit(m) => Some(R::Jit(pb::JitConfig {
            encoded_jit_config: "jit-config".into(),
            runner_id: 42,
            runner_name: m.runner_name.clone(),
        })),
        Call::Heartbeat(h) => Some(R::Heartbeats(pb::HeartbeatResults {
            results: h
                .leases
                .iter()
                .map(|l| pb::HeartbeatResult {
                    lease_id: l.lease_id.clone(),
                    error: None,
                })
                .collect(),
        })),
        Call::GetLease(g) => Some(R::Lease(pb::Lease {
            id: g.lease_id.clone(),
            epoch: 1,
            tier: "linux".into(),
            phase: "online".into(),
            vcpu: 1,
            memory_bytes: 1 << 30,
            node: "node-1".into(),
            request_id: REQUEST,
            providers: Vec::new(),
            failure_reason: String::new(),
            end_reason: 0,
            end_detail: String::new(),
        })),
        Call::Launched(_) => Some(R::Launched(pb::LaunchedSet::default())),
        Call::Reconcile(_) => Some(R::Reconciled(pb::ReconcileResult { freed: 0 })),
        Call::Bind(_)
        | Call::Advance(_)
        | Call::BindAdvance(_)
        | Call::Release(_)
        | Call::RemoveRunner(_)
        | Call::MarkFailure(_)
        | Call::RenewCertificate(_)
        | Call::Resize(_)
        | Call::ReserveWarm(_)
        | Call::ReleaseWarm(_) => None,
        Call::WarmRooms(w) => Some(R::WarmRooms(pb::WarmRoomsCharged {
            charged: w.names.clone(),
        })),
        Call::RecordCacheObservation(r) => r.observation.map(R::CacheObservation),
        Call::ActionsPolicy(_) => Some(R::ActionsPolicy(pb::ActionsPolicyAnswer { allowed: true })),
    }
}

/// Opens session `id` on `link`, as `attach` does, and plays the plane on
/// it; every result is acknowledged `accepted`. Returns the plane and the
/// session it replaced, which the caller closes.
fn open(link: &PlaneLink, id: u64) -> (TestPlane, Option<Arc<SessionLink>>) {
    let (tx, mut rx) = mpsc::channel(64);
    let session = Arc::new(SessionLink::new(id, tx));
    let replaced = link.install(Arc::clone(&session), Duration::from_secs(30));
    let calls = Arc::new(Mutex::new(Vec::new()));
    let (results_tx, results) = mpsc::unbounded_channel();
    let (seen, plane_side) = (Arc::clone(&calls), Arc::clone(&session));
    tokio::spawn(async move {
        while let Some(Ok(pb::NodeMessage { body: Some(body) })) = rx.recv().await {
            match body {
                pb::node_message::Body::Call(pb::NodeCall {
                    call_id,
                    call: Some(call),
                }) => {
                    let result = agree(&call);
                    seen.lock().expect("calls").push(call);
                    plane_side.on_reply(pb::PlaneReply {
                        call_id,
                        error: None,
                        result,
                    });
                }
                pb::node_message::Body::Result(r) => {
                    plane_side.on_ack(pb::ResultAck {
                        id: r.id.clone(),
                        verdict: pb::AckVerdict::Accepted.into(),
                    });
                    let _ = results_tx.send(r);
                }
                _ => {}
            }
        }
    });
    (
        TestPlane {
            session,
            calls,
            results,
        },
        replaced,
    )
}

struct Node {
    provider: Arc<FakeProvider>,
    journal: Arc<MemoryJournal>,
    runner: Arc<Runner>,
    link: Arc<PlaneLink>,
    service: NodeService,
    cancel: CancellationToken,
}

impl Node {
    /// A node whose recovery is done, its executor running.
    fn start() -> Self {
        let journal = Arc::new(MemoryJournal::default());
        Self::start_with(journal.clone(), journal)
    }

    /// As [`Node::start`], the runner and the executor writing to
    /// `writes`, which keeps what it writes in `journal`.
    fn start_with(journal: Arc<MemoryJournal>, writes: Arc<dyn Journal>) -> Self {
        let provider = Arc::new(FakeProvider::new());
        let link = Arc::new(PlaneLink::new(Duration::from_secs(5)));
        let runner = Arc::new(
            Runner::new(
                provider.clone(),
                link.clone(),
                link.clone(),
                crate::node::runner::RunnerOptions::default(),
            )
            .with_journal(writes.clone()),
        );
        let slot = Arc::new(CommandSlot::new());
        let cancel = CancellationToken::new();
        tokio::spawn(execute_commands(
            runner.clone(),
            slot.clone(),
            Executor {
                recovery: Arc::new(Recovery::done()),
                journal: writes,
                ack_timeout: Duration::from_secs(60),
                upgrader: None,
                capacity: Default::default(),
                health: Arc::default(),
            },
            cancel.clone(),
        ));
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
            slot,
            Arc::new(Recovery::done()),
        );
        Self {
            provider,
            journal,
            runner,
            link,
            service,
            cancel,
        }
    }

    /// A command arriving on `session`, routed as the session routes it.
    async fn send(&self, session: &Arc<SessionLink>, id: &str, kind: pb::command::Kind) {
        let command = pb::Command {
            id: id.into(),
            deadline_unix_ms: now_unix_ms() + 60_000,
            deadline_remaining_ms: None,
            kind: Some(kind),
        };
        self.service
            .route(session, pb::plane_message::Body::Command(command))
            .await;
    }

    async fn send_launch(&self, session: &Arc<SessionLink>, id: &str) {
        let mut command = crate::edge::wire::tests::launch();
        command.id = id.into();
        command.deadline_unix_ms = now_unix_ms() + 60_000;
        self.service
            .route(session, pb::plane_message::Body::Command(command))
            .await;
    }

    fn custody(&self) -> Vec<String> {
        let mut leases: Vec<String> = self
            .runner
            .custody_leases()
            .iter()
            .map(|l| l.as_str().to_owned())
            .collect();
        leases.sort();
        leases
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.cancel.cancel();
    }
}

async fn eventually(what: &str, mut condition: impl FnMut() -> bool) {
    tokio::time::timeout(Duration::from_secs(5), async {
        while !condition() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await
    .unwrap_or_else(|_| panic!("{what} within 5s"));
}

/// 7.L.16: a newer session replaces the one a launch came on while the
/// launch runs. Its success cannot reach the plane that asked, so the node
/// takes custody of it (renewing it through the newer session) rather than
/// leaving a job nobody holds; nothing is launched twice.
#[tokio::test]
async fn a_launch_in_flight_when_a_newer_session_replaces_its_own_goes_into_custody() {
    let node = Node::start();
    let (mut first, _) = open(&node.link, 1);
    node.provider.block(Operation::Create);
    node.send_launch(&first.session, "c1").await;
    eventually("the create to start", || {
        node.provider.count(Operation::Create) == 1
    })
    .await;

    let (second, replaced) = open(&node.link, 2);
    replaced
        .expect("the newer session replaced the first")
        .close();
    node.provider.unblock(Operation::Create);

    eventually("the launch to go into custody", || {
        node.custody() == [LEASE]
    })
    .await;
    eventually("its renewal through the newer session", || {
        second.heartbeats_of(LEASE) > 0
    })
    .await;
    assert!(
        first.results.try_recv().is_err(),
        "a result reached the replaced session"
    );
    assert!(node.runner.holding());
    assert_eq!(node.provider.count(Operation::Create), 1);
    assert!(
        node.provider
            .instance(INSTANCE)
            .is_some_and(|i| i.may_run()),
        "the job keeps running"
    );
}

/// 7.L.20: a `Superseded` command moves running work into custody (so a
/// drain can end without completions this process will never see), and
/// tends then hold it while the job runs and release it `done` once it has
/// exited, after which the node holds nothing.
#[tokio::test]
async fn a_superseded_node_holds_its_running_work_until_tends_see_it_finish() {
    let node = Node::start();
    let (mut plane, _) = open(&node.link, 1);
    node.send_launch(&plane.session, "c1").await;
    assert_eq!(plane.result().await.outcome, pb::Outcome::Ok as i32);
    assert!(node.custody().is_empty(), "a running job is not custody");

    node.send(
        &plane.session,
        "c2",
        pb::command::Kind::Superseded(pb::Superseded {}),
    )
    .await;
    assert_eq!(plane.result().await.outcome, pb::Outcome::Ok as i32);
    assert_eq!(node.custody(), [LEASE]);

    node.send(&plane.session, "c3", pb::command::Kind::Tend(pb::Tend {}))
        .await;
    assert_eq!(plane.result().await.outcome, pb::Outcome::Ok as i32);
    assert_eq!(node.custody(), [LEASE], "a running job is left to finish");
    assert!(node.runner.holding());
    assert!(plane.releases().is_empty());

    assert!(node.provider.exit(INSTANCE, 0, false), "the job exits");
    node.send(&plane.session, "c4", pb::command::Kind::Tend(pb::Tend {}))
        .await;
    assert_eq!(plane.result().await.outcome, pb::Outcome::Ok as i32);
    assert!(node.custody().is_empty());
    assert!(!node.runner.holding(), "the drain can end");
    let releases = plane.releases();
    assert_eq!(releases.len(), 1, "{releases:?}");
    assert_eq!(
        (releases[0].lease_id.as_str(), releases[0].outcome.as_str()),
        (LEASE, "done")
    );
    // An exited container stays until it is destroyed.
    assert_eq!(node.provider.count(Operation::Destroy), 1);
    assert!(node.provider.instance(INSTANCE).is_none());
}

/// 7.B.20: a completion and a tend for the same held lease do not race:
/// the tend waits in the slot while the completion's destroy is in the
/// provider, and finds nothing left to do, so the instance is destroyed
/// and the lease released exactly once.
// In paused time: the sleep below returns only once every other task is
// idle, so the tend has had every chance to run beside the destroy.
#[tokio::test(start_paused = true)]
async fn a_completion_and_a_tend_take_turns_and_destroy_the_instance_once() {
    let node = Node::start();
    let (mut plane, _) = open(&node.link, 1);
    node.send_launch(&plane.session, "c1").await;
    assert_eq!(plane.result().await.outcome, pb::Outcome::Ok as i32);
    node.runner
        .assume_custody(
            &LeaseId::parse("lease", LEASE).expect("id"),
            Epoch(1),
            RequestId(REQUEST),
        )
        .await
        .expect("custody");
    assert_eq!(node.custody(), [LEASE]);

    // The ephemeral runner exits after its job.
    node.provider.exit(INSTANCE, 0, false);
    node.provider.block(Operation::Destroy);
    node.send(
        &plane.session,
        "c2",
        pb::command::Kind::Destroy(pb::Destroy {
            request_id: REQUEST,
            job_result: Some("succeeded".into()),
            force: false,
            reason: String::new(),
        }),
    )
    .await;
    node.send(&plane.session, "c3", pb::command::Kind::Tend(pb::Tend {}))
        .await;
    eventually("the completion's destroy to reach the provider", || {
        node.provider.count(Operation::Destroy) == 1
    })
    .await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        node.provider.count(Operation::Destroy),
        1,
        "the tend destroyed beside the completion"
    );
    assert!(
        plane.results.try_recv().is_err(),
        "answered while destroying"
    );

    node.provider.unblock(Operation::Destroy);
    let completion = plane.result().await;
    assert_eq!(completion.id, "c2");
    assert_eq!(completion.outcome, pb::Outcome::Ok as i32, "{completion:?}");
    let tend = plane.result().await;
    assert_eq!(tend.id, "c3");
    assert_eq!(tend.outcome, pb::Outcome::Ok as i32, "{tend:?}");
    assert_eq!(node.provider.count(Operation::Destroy), 1);
    assert!(node.provider.instance(INSTANCE).is_none());
    assert_eq!(plane.releases().len(), 1, "{:?}", plane.releases());
    assert!(node.custody().is_empty());
}

/// Durability by kind (ARCHITECTURE.md, "What each journal write
/// survives"): a launch's result is in the journal by the time the next
/// command runs, committed (its synced launch record is what keeps a
/// redelivery from minting again), and a destroy's is synced, so a redelivery after a
/// restart is answered rather than run again; the results of the
/// idempotent passes (Tend, Sweep, Instances) are never written, and a
/// redelivered copy within the process is still answered from memory.
#[tokio::test]
async fn only_results_whose_loss_could_repeat_work_are_journaled_before_they_are_answered() {
    use crate::journal::Journal as _;
    let node = Node::start();
    let (mut plane, _) = open(&node.link, 1);
    async fn journaled(journal: &MemoryJournal) -> Vec<String> {
        let results = journal.results().await.expect("results");
        results.into_iter().map(|(id, _)| id).collect()
    }
    node.send_launch(&plane.session, "launch-1").await;
    let launched = plane.result().await;
    assert_eq!(launched.outcome, pb::Outcome::Ok as i32, "{launched:?}");
    for (id, kind) in [
        ("tend-1", pb::command::Kind::Tend(pb::Tend {})),
        ("sweep-1", pb::command::Kind::Sweep(pb::Sweep {})),
        (
            "instances-1",
            pb::command::Kind::Instances(pb::Instances {}),
        ),
    ] {
        node.send(&plane.session, id, kind).await;
        let result = plane.result().await;
        assert_eq!(result.id, id);
    }
    assert_eq!(
        journaled(&node.journal).await,
        ["launch-1"],
        "an idempotent command's result was journaled"
    );
    assert_eq!(
        node.journal.result_durability("launch-1"),
        Some(Durability::Committed)
    );
    // Redelivered in this process: answered from memory, not run again.
    let lists = node.provider.count(Operation::List);
    node.send(
        &plane.session,
        "instances-1",
        pb::command::Kind::Instances(pb::Instances {}),
    )
    .await;
    let again = plane.result().await;
    assert_eq!(again.id, "instances-1");
    assert_eq!(node.provider.count(Operation::List), lists, "run again");
    node.send(
        &plane.session,
        "destroy-1",
        pb::command::Kind::Destroy(pb::Destroy {
            request_id: REQUEST,
            job_result: Some("succeeded".into()),
            force: false,
            reason: String::new(),
        }),
    )
    .await;
    let destroyed = plane.result().await;
    assert_eq!(destroyed.id, "destroy-1", "{destroyed:?}");
    assert_eq!(journaled(&node.journal).await, ["launch-1", "destroy-1"]);
    assert_eq!(
        node.journal.result_durability("destroy-1"),
        Some(Durability::Synced)
    );
}

/// Holds the write a launch makes beside its answer (its committed result)
/// until `open` says true; every other write, and every read, goes
/// straight to `inner`.
#[derive(Debug)]
struct GatedJournal {
    inner: Arc<MemoryJournal>,
    open: tokio::sync::watch::Receiver<bool>,
    /// Every launch record's write fails, as on a full disk.
    refuse_launches: bool,
}

impl GatedJournal {
    async fn wait(&self) {
        let mut open = self.open.clone();
        let _ = open.wait_for(|o| *o).await;
    }
}

#[async_trait::async_trait]
impl Journal for GatedJournal {
    async fn put_launch(&self, l: &LaunchRecord) -> Result<(), JournalError> {
        if self.refuse_launches {
            return Err(JournalError::Io(
                "database or disk is full (injected)".into(),
            ));
        }
        self.inner.put_launch(l).await
    }
    async fn amend_launch(&self, l: &LaunchRecord) -> Result<(), JournalError> {
        self.inner.amend_launch(l).await
    }
    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        self.inner.forget_launch(lease).await
    }
    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        self.inner.launches().await
    }
    async fn put_custody(&self, e: &CustodyRecord) -> Result<(), JournalError> {
        self.inner.put_custody(e).await
    }
    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        self.inner.forget_custody(lease).await
    }
    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError> {
        self.inner.custody().await
    }
    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError> {
        if durability == Durability::Committed {
            self.wait().await;
        }
        self.inner.put_result(command, encoded, durability).await
    }
    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        self.inner.results().await
    }
}

/// A launch is answered without waiting for its committed result (its
/// synced launch record already keeps a redelivery from minting again),
/// which is written before the next command runs; its record already
/// says created when it is answered (recovery adopts such a runner
/// without asking GitHub).
#[tokio::test]
async fn a_launch_is_answered_beside_its_committed_result_not_after_it() {
    let journal = Arc::new(MemoryJournal::default());
    let (release, gate) = tokio::sync::watch::channel(false);
    let node = Node::start_with(
        journal.clone(),
        Arc::new(GatedJournal {
            inner: journal.clone(),
            open: gate,
            refuse_launches: false,
        }),
    );
    let (mut plane, _) = open(&node.link, 1);
    node.send_launch(&plane.session, "launch-1").await;
    let launched = plane.result().await;
    assert_eq!(launched.outcome, pb::Outcome::Ok as i32, "{launched:?}");
    let records = journal.launches().await.expect("launches");
    assert_eq!(records.len(), 1, "{records:?}");
    assert!(
        records[0].created,
        "not amended before the answer: {records:?}"
    );
    assert!(
        records[0].runner_id > 0,
        "the registration is journaled before the answer"
    );
    assert!(journal.results().await.expect("results").is_empty());
    // The next command waits for it.
    node.send(
        &plane.session,
        "tend-1",
        pb::command::Kind::Tend(pb::Tend {}),
    )
    .await;
    tokio::time::sleep(Duration::from_millis(50)).await;
    assert!(
        plane.results.try_recv().is_err(),
        "the next command ran before the launch's result was written"
    );
    release.send(true).expect("gate");
    let tended = plane.result().await;
    assert_eq!(tended.id, "tend-1");
    let results: Vec<String> = journal
        .results()
        .await
        .expect("results")
        .into_iter()
        .map(|(id, _)| id)
        .collect();
    assert_eq!(results, ["launch-1"]);
}

/// A launch whose record the journal cannot write (its disk filled before
/// the health probe said so) is refused `UNAVAILABLE`, as a node degraded
/// by an unwritable journal refuses, so the plane backs off from this
/// node; nothing is started or held.
#[tokio::test]
async fn a_launch_whose_record_cannot_be_journaled_is_refused_unavailable() {
    let journal = Arc::new(MemoryJournal::default());
    let (_open, gate) = tokio::sync::watch::channel(true);
    let node = Node::start_with(
        journal.clone(),
        Arc::new(GatedJournal {
            inner: journal.clone(),
            open: gate,
            refuse_launches: true,
        }),
    );
    let (mut plane, _) = open(&node.link, 1);
    node.send_launch(&plane.session, "launch-1").await;
    let refused = plane.result().await;
    assert_eq!(refused.outcome, pb::Outcome::Refused as i32, "{refused:?}");
    assert_eq!(
        refused.error.as_ref().map(|e| e.code),
        Some(pb::ErrorCode::Unavailable as i32),
        "{refused:?}"
    );
    assert!(!refused.custody, "{refused:?}");
    assert!(node.provider.instances().is_empty());
    assert!(!node.runner.holding());
}
