//! The gRPC face of the node: `Node.Attach`. A thin handler that checks the
//! plane's `Open`, answers `Hello`, and then routes: commands to the single
//! slot, acknowledgements and replies to whoever waits for them. The
//! executor ([`execute_commands`]) takes commands off the slot one at a time
//! and answers each on the session it came from.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use billet_proto::v1 as pb;
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::edge::link::{PlaneLink, SessionLink};
use crate::edge::slot::{Admission, CommandSlot, Queued};
use crate::edge::wire;
use crate::journal::{Durability, Journal};
use crate::model::NodeCommand;
use crate::model::{NodeName, RequestId};
use crate::node::health::{Health, Reason};
use crate::node::recovery::Recovery;
use crate::node::runner::{Runner, RunnerError};
use crate::upgrade::dispatch::{self, UpgradeError, Upgrader};

/// How long the plane has to send `Open` after the stream starts.
pub(crate) const OPEN_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a result waits for its acknowledgement before the node assumes
/// the plane missed it.
pub(crate) const ACK_TIMEOUT: Duration = Duration::from_secs(60);
/// How long a recycled session stays open, after the plane attached anew,
/// for the answers it still awaits.
pub(crate) const RECYCLE_DRAIN: Duration = Duration::from_secs(30);
/// Messages buffered toward the plane per session.
const OUTBOUND_BUFFER: usize = 256;

/// How long a session's Hello waits for the provider's inventory before
/// it says the inventory is unknown ([`NodeService::hello`]).
const HELLO_INVENTORY_BOUND: Duration = Duration::from_secs(5);

/// What the node says about itself in `Hello`.
#[derive(Debug, Clone)]
pub(crate) struct Identity {
    /// From the node's certificate.
    pub node_name: NodeName,
    /// The deployment this node belongs to.
    pub deployment: String,
    /// Random per process.
    pub incarnation: String,
    /// vCPUs offered.
    pub vcpu: u32,
    /// Memory offered, in bytes.
    pub memory_bytes: u64,
    /// The billet release.
    pub version: String,
}

/// The `Node` service.
#[derive(Debug, Clone)]
pub struct NodeService {
    identity: Arc<Identity>,
    runner: Arc<Runner>,
    link: Arc<PlaneLink>,
    slot: Arc<CommandSlot>,
    recovery: Arc<Recovery>,
    health: Arc<Health>,
    next_session: Arc<AtomicU64>,
}

impl NodeService {
    /// A service over a runner, the plane link it calls through, and the slot
    /// its commands queue in.
    pub(crate) fn new(
        identity: Identity,
        runner: Arc<Runner>,
        link: Arc<PlaneLink>,
        slot: Arc<CommandSlot>,
        recovery: Arc<Recovery>,
    ) -> Self {
        Self {
            identity: Arc::new(identity),
            runner,
            link,
            slot,
            recovery,
            health: Arc::default(),
            next_session: Arc::new(AtomicU64::new(1)),
        }
    }

    /// Reports and feeds `health` (the node's degraded state, its clock
    /// offset and last contact) instead of a private one.
    pub(crate) fn with_health(mut self, health: Arc<Health>) -> Self {
        self.health = health;
        self
    }

    /// The session's first message. Its inventory is asked of the
    /// provider for at most [`HELLO_INVENTORY_BOUND`], and not at all while
    /// the provider is known stuck: a hung engine must not keep the plane
    /// from attaching (its Hello deadline is 30 s, and a node that cannot
    /// attach cannot say it is degraded). An inventory not read is sent as
    /// unknown, which the plane takes as no evidence either way.
    async fn hello(&self) -> pb::Hello {
        let health = self.health.snapshot();
        let listed = if health.reasons.contains(&Reason::ProviderStuck) {
            Err("the provider is stuck".to_owned())
        } else {
            match tokio::time::timeout(HELLO_INVENTORY_BOUND, self.runner.instances()).await {
                Ok(Ok(ids)) => Ok(ids),
                Ok(Err(e)) => Err(e.to_string()),
                Err(_) => Err(format!(
                    "the provider did not answer within {}s",
                    HELLO_INVENTORY_BOUND.as_secs()
                )),
            }
        };
        let (instances, inventory_known) = match listed {
            Ok(ids) => (
                ids.into_iter().map(|l| l.as_str().to_owned()).collect(),
                true,
            ),
            Err(e) => {
                warn!(error = %e, "cannot list the provider; reporting the inventory as unknown");
                (Vec::new(), false)
            }
        };
        let id = &self.identity;
        pb::Hello {
            protocol_version: billet_proto::PROTOCOL_VERSION,
            deployment: id.deployment.clone(),
            node_name: id.node_name.as_str().to_owned(),
            incarnation: id.incarnation.clone(),
            provider: self.runner.provider_kind().to_owned(),
            capacity: Some(pb::Capacity {
                vcpu: id.vcpu,
                memory_bytes: id.memory_bytes,
            }),
            instances,
            inventory_known,
            version: id.version.clone(),
            held: Some(held(&self.runner)),
            degraded: health.degraded(),
            degraded_reasons: wire::degraded_reasons(&health),
            launches_with_registration: true,
        }
    }

    fn check_open(&self, open: &pb::Open) -> Result<std::time::Duration, Status> {
        let pb::Open {
            protocol_version,
            deployment,
            lease_ttl_ms,
            plane_clock_unix_ms,
        } = open;
        if *protocol_version != billet_proto::PROTOCOL_VERSION {
            let ours = billet_proto::PROTOCOL_VERSION;
            let which = if *protocol_version > ours {
                "this node"
            } else {
                "the plane"
            };
            return Err(Status::failed_precondition(format!(
                "the plane speaks wire protocol {protocol_version} and this node speaks {ours}; upgrade {which} so both speak the same version"
            )));
        }
        if *deployment != self.identity.deployment {
            return Err(Status::permission_denied(format!(
                "this node belongs to deployment {:?}, not {deployment:?}; dial the node from its own deployment's plane",
                self.identity.deployment
            )));
        }
        if *lease_ttl_ms == 0 {
            return Err(Status::invalid_argument(
                "open.lease_ttl_ms: must be positive; the node renews held leases every third of it",
            ));
        }
        if *plane_clock_unix_ms > 0 {
            self.health
                .clock_offset(now_unix_ms().saturating_sub(*plane_clock_unix_ms));
        }
        Ok(Duration::from_millis(*lease_ttl_ms))
    }

    /// When a command expires on this node's monotonic clock: the time it
    /// had left when the plane sent it, from now; or, from a plane that did
    /// not say, its wall-clock deadline read through the measured offset.
    /// Each command that carries both also samples the offset.
    fn deadline(
        &self,
        deadline_unix_ms: i64,
        deadline_remaining_ms: Option<u64>,
    ) -> tokio::time::Instant {
        let now = tokio::time::Instant::now();
        let past = now.checked_sub(Duration::from_millis(1)).unwrap_or(now);
        if let Some(deadline_remaining_ms) = deadline_remaining_ms {
            if deadline_remaining_ms == 0 {
                return past;
            }
            let remaining = i64::try_from(deadline_remaining_ms).unwrap_or(i64::MAX);
            if deadline_unix_ms > 0 {
                let plane_sent = deadline_unix_ms.saturating_sub(remaining);
                self.health
                    .clock_offset(now_unix_ms().saturating_sub(plane_sent));
            }
            return now + Duration::from_millis(deadline_remaining_ms);
        }
        let offset = self.health.snapshot().clock_offset_ms.unwrap_or(0);
        let plane_now = now_unix_ms().saturating_sub(offset);
        match u64::try_from(deadline_unix_ms.saturating_sub(plane_now)) {
            Ok(left) => now + Duration::from_millis(left),
            Err(_) => past,
        }
    }
}

type NodeStream = Pin<Box<dyn Stream<Item = Result<pb::NodeMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::node_server::Node for NodeService {
    type AttachStream = NodeStream;

    async fn attach(
        &self,
        request: Request<Streaming<pb::PlaneMessage>>,
    ) -> Result<Response<Self::AttachStream>, Status> {
        let connection = request
            .extensions()
            .get::<crate::tls::accept::ConnectionInfo>()
            .cloned();
        let peer = connection
            .as_ref()
            .map(|c| c.peer)
            .or_else(|| request.remote_addr());
        let mut inbound = request.into_inner();
        let first = tokio::time::timeout(OPEN_TIMEOUT, inbound.message())
            .await
            .map_err(|_| Status::deadline_exceeded("no Open within 10s of attaching"))??;
        let open = match first.and_then(|m| m.body) {
            Some(pb::plane_message::Body::Open(open)) => open,
            _ => {
                return Err(Status::invalid_argument(
                    "the first message of a session must be Open",
                ));
            }
        };
        let ttl = self.check_open(&open).inspect_err(|status| {
            warn!(?peer, reason = status.message(), "refused a session");
        })?;

        let (tx, rx) = mpsc::channel(OUTBOUND_BUFFER);
        let id = self.next_session.fetch_add(1, Ordering::Relaxed);
        let session = Arc::new(SessionLink::new(id, tx));
        session
            .send(pb::node_message::Body::Hello(self.hello().await))
            .await
            .map_err(|_| Status::unavailable("session closed during Hello"))?;
        if let Some(old) = self.link.install(Arc::clone(&session), ttl) {
            if old.recycling.is_cancelled() {
                info!(
                    old = old.id,
                    new = id,
                    "the plane attached anew; the recycled session closes once nothing on it awaits an answer"
                );
                tokio::spawn(old.hand_over(Arc::clone(&session), RECYCLE_DRAIN));
            } else {
                info!(
                    old = old.id,
                    new = id,
                    "a newer session replaces the older one"
                );
                old.close();
            }
        }
        // Before its connection's certificates expire, the plane is asked
        // to attach anew (the connection itself is cut a little later).
        if let Some(recycle_at) = connection.as_ref().and_then(|c| c.recycle_at) {
            let session = Arc::clone(&session);
            tokio::spawn(async move {
                tokio::select! {
                    () = session.closed.cancelled() => {}
                    () = tokio::time::sleep_until(recycle_at) => {
                        info!(
                            session = session.id,
                            "this session's connection nears its maximum age (its certificates expire soon); asking the plane to attach anew"
                        );
                        session.recycle();
                    }
                }
            });
        }
        info!(
            session = id,
            ?peer,
            lease_ttl_ms = ttl.as_millis() as u64,
            "plane session open"
        );
        self.recovery.start(Arc::clone(&self.runner));
        self.health.contact();
        // The node's health right after Hello, and again whenever it changes.
        {
            let (session, mut health) = (Arc::clone(&session), self.health.subscribe());
            tokio::spawn(async move {
                loop {
                    let mut status = wire::node_status(&health.borrow_and_update());
                    status.reattach = session.recycling.is_cancelled();
                    if session
                        .send(pb::node_message::Body::Status(status))
                        .await
                        .is_err()
                    {
                        return;
                    }
                    tokio::select! {
                        () = session.closed.cancelled() => return,
                        changed = health.changed() => if changed.is_err() { return },
                        () = session.recycling.cancelled(), if !session.recycling.is_cancelled() => {}
                    }
                }
            });
        }

        let session_closed = session.closed.clone();
        let this = self.clone();
        tokio::spawn(
            async move {
                loop {
                    let message = tokio::select! {
                        () = session.closed.cancelled() => break,
                        m = inbound.message() => m,
                    };
                    if matches!(message, Ok(Some(_))) {
                        this.health.contact();
                    }
                    match message {
                        Ok(Some(pb::PlaneMessage { body: Some(body) })) => {
                            this.route(&session, body).await
                        }
                        Ok(Some(pb::PlaneMessage { body: None })) => {
                            warn!("ignored an empty message from the plane");
                        }
                        Ok(None) => break,
                        Err(status) => {
                            debug!(error = %status, "session stream ended");
                            break;
                        }
                    }
                }
                session.close();
                this.link.remove(&session);
                info!(session = session.id, "plane session closed");
            }
            .instrument(info_span!("session", id)),
        );
        // The stream ends when the session closes: replaced, or the node stopping.
        let closed = session_closed.cancelled_owned();
        Ok(Response::new(Box::pin(futures::StreamExt::take_until(
            ReceiverStream::new(rx),
            closed,
        ))))
    }
}

impl NodeService {
    async fn route(&self, session: &Arc<SessionLink>, body: pb::plane_message::Body) {
        match body {
            pb::plane_message::Body::Command(command) => {
                let incoming = wire::command(command);
                match incoming.command {
                    Err(invalid) => {
                        warn!(id = %incoming.id, %invalid, "refused a malformed command");
                        let result = pb::CommandResult {
                            id: incoming.id,
                            outcome: pb::Outcome::InvalidArgument.into(),
                            custody: false,
                            error: Some(pb::Error {
                                code: pb::ErrorCode::InvalidArgument.into(),
                                message: invalid.to_string(),
                            }),
                            instances: None,
                        };
                        let _ = session.send(pb::node_message::Body::Result(result)).await;
                    }
                    Ok((id, command)) => {
                        // A degraded node refuses a launch at once, never
                        // queueing it behind what may be a stuck command.
                        let refusal = matches!(command, NodeCommand::Launch { .. })
                            .then(|| self.health.refusal())
                            .flatten();
                        let queued = Queued {
                            id: id.clone(),
                            deadline: self.deadline(
                                incoming.deadline_unix_ms,
                                incoming.deadline_remaining_ms,
                            ),
                            command,
                            session: Arc::clone(session),
                        };
                        let admission = match refusal {
                            Some(refusal) => {
                                info!(%id, %refusal, "refused a launch at once while degraded");
                                self.slot
                                    .answer_now(queued, refused_launch(id.as_str(), &refusal))
                            }
                            None => self.slot.push(queued),
                        };
                        match admission {
                            Admission::Queued | Admission::Duplicate => {}
                            Admission::Replay(result) => {
                                debug!(%id, "answering a redelivered command from its recorded result");
                                let _ = session.send(pb::node_message::Body::Result(result)).await;
                            }
                            Admission::Full => {
                                let result = failure(
                                    id.as_str(),
                                    pb::Outcome::Refused,
                                    pb::ErrorCode::Unavailable,
                                    "the node's command queue is full; retry later".into(),
                                );
                                let _ = session.send(pb::node_message::Body::Result(result)).await;
                            }
                        }
                    }
                }
            }
            pb::plane_message::Body::ResultAck(ack) => session.on_ack(ack),
            pb::plane_message::Body::Reply(reply) => session.on_reply(reply),
            pb::plane_message::Body::Open(_) => {
                warn!("ignored a second Open on an open session");
            }
        }
    }
}

fn failure(
    id: &str,
    outcome: pb::Outcome,
    code: pb::ErrorCode,
    message: String,
) -> pb::CommandResult {
    pb::CommandResult {
        id: id.to_owned(),
        outcome: outcome.into(),
        custody: false,
        error: Some(pb::Error {
            code: code.into(),
            message,
        }),
        instances: None,
    }
}

/// What the leases `runner` holds charge, as the wire's `Capacity`.
fn held(runner: &Runner) -> pb::Capacity {
    let (vcpu, memory_bytes) = runner.held_charge();
    pb::Capacity { vcpu, memory_bytes }
}

fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// What the executor needs besides the runner and the slot.
#[derive(Debug, Clone)]
pub(crate) struct Executor {
    /// Gates the first command.
    pub recovery: Arc<Recovery>,
    /// Where results are remembered across restarts.
    pub journal: Arc<dyn Journal>,
    /// How long a launch result waits for its acknowledgement.
    pub ack_timeout: Duration,
    /// What `StartUpgrade` execs; `None` refuses upgrades with a sentence
    /// saying to upgrade the node out of band.
    pub upgrader: Option<Arc<dyn Upgrader>>,
    /// What this node may run at once, as `Hello` says: every `Instances`
    /// report repeats it beside what is held.
    pub capacity: pb::Capacity,
    /// Whether a launch may start (refused while degraded).
    pub health: Arc<Health>,
}

/// Runs commands off the slot one at a time until `cancel`, once start-up
/// recovery has succeeded.
pub(crate) async fn execute_commands(
    runner: Arc<Runner>,
    slot: Arc<CommandSlot>,
    executor: Executor,
    cancel: CancellationToken,
) {
    // Ends with `cancel`, as the executor does.
    tokio::spawn(
        refuse_waiting_launches(slot.clone(), executor.health.clone(), cancel.clone())
            .instrument(info_span!("refuse_waiting_launches")),
    );
    tokio::select! {
        () = cancel.cancelled() => return,
        () = executor.recovery.wait() => {}
    }
    loop {
        let queued = tokio::select! {
            () = cancel.cancelled() => return,
            q = slot.next() => q,
        };
        let Queued {
            id,
            deadline,
            command,
            session,
        } = queued;
        let kind = command.kind();
        let durability = result_durability(&command);
        // Every line the command logs carries its lease, where it names one.
        let span = info_span!("command", %id, kind, lease = tracing::field::Empty);
        if let Some(lease) = command.lease_id() {
            span.record("lease", tracing::field::display(lease));
        }
        let (result, launched) = async {
            if tokio::time::Instant::now() > deadline {
                info!("expired before it started; doing nothing");
                return (
                    failure(
                        id.as_str(),
                        pb::Outcome::Expired,
                        pb::ErrorCode::Unspecified,
                        format!("command {id} ({kind}) expired in the queue before it started; nothing was done"),
                    ),
                    None,
                );
            }
            if matches!(command, NodeCommand::Launch { .. })
                && let Some(refusal) = executor.health.refusal()
            {
                info!(%refusal, "refused a launch while degraded");
                return (refused_launch(id.as_str(), &refusal), None);
            }
            execute(&runner, executor.upgrader.as_deref(), executor.capacity, id.as_str(), command).await
        }
        .instrument(span.clone())
        .await;
        // Expected before the command stops counting as in flight, so a
        // drain never sees a gap between the two (server.rs, DRAIN_SETTLE).
        // A session recycled and closed since hands its answers on.
        let session = session.live();
        let ack = session.expect_ack(id.as_str());
        slot.record(&id, &result);
        let encoded = durability.map(|_| prost::Message::encode_to_vec(&result));
        let journaled = async {
            if let (Some(durability), Some(encoded)) = (durability, &encoded)
                && let Err(e) = executor
                    .journal
                    .put_result(id.as_str(), encoded, durability)
                    .await
            {
                warn!(%id, error = %e, "cannot journal a result; a redelivery after a restart would run it again");
            }
        };
        let answered = deliver(
            &runner,
            session,
            ack,
            result,
            launched,
            executor.ack_timeout,
        );
        // A synced result is journaled before it is answered: nothing else
        // keeps a redelivery after a restart from running it again. A
        // launch's (committed) result is written beside the answer: its
        // synced launch record already keeps a redelivery from minting or
        // creating again. It is written before the next command starts
        // (ARCHITECTURE.md, "What each journal write survives").
        if durability == Some(Durability::Synced) {
            journaled.await;
            answered.instrument(span).await;
        } else {
            tokio::join!(journaled, answered.instrument(span));
        }
    }
}

/// While the node is degraded, answers every launch waiting in the slot
/// refused (typed as [`refused_launch`] says) instead of letting it wait
/// behind the command running, which may be the stuck one that made the
/// node degraded: a plane that waited past its timeout would take the lease
/// for held by the node although nothing started. Looks whenever the health
/// changes and every second (a launch may have been queued just as the node
/// became degraded), until `cancel`.
async fn refuse_waiting_launches(
    slot: Arc<CommandSlot>,
    health: Arc<Health>,
    cancel: CancellationToken,
) {
    let mut state = health.subscribe();
    loop {
        if let Some(refusal) = health.refusal() {
            for waiting in slot.take_waiting_launches() {
                info!(id = %waiting.id, %refusal, "refused a waiting launch: the node is degraded");
                let result = refused_launch(waiting.id.as_str(), &refusal);
                slot.record(&waiting.id, &result);
                let _ = waiting
                    .session
                    .live()
                    .send(pb::node_message::Body::Result(result))
                    .await;
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            changed = state.changed() => if changed.is_err() { return },
            () = tokio::time::sleep(Duration::from_secs(1)) => {}
        }
    }
}

/// A launch refused by a degraded node: `OUTCOME_REFUSED` with
/// `ERROR_CODE_RESOURCE_EXHAUSTED` for a full disk, else
/// `ERROR_CODE_UNAVAILABLE`; nothing was bound, minted or started.
fn refused_launch(id: &str, refusal: &crate::node::health::Refusal) -> pb::CommandResult {
    let code = if refusal.exhausted {
        pb::ErrorCode::ResourceExhausted
    } else {
        pb::ErrorCode::Unavailable
    };
    failure(id, pb::Outcome::Refused, code, refusal.to_string())
}

/// Whether a command's result is journaled, and how durably: those whose
/// loss in a restart could make a redelivered copy do something twice are
/// synced before they are answered, or committed beside the answer where
/// another synced write already keeps the copy from doing anything twice.
/// `Tend`, `Sweep`, `Instances` and `Superseded` are idempotent passes
/// over what the node holds: run again, they do what is due then, so
/// their results are remembered in memory only (the slot still answers a
/// redelivered copy within this process).
fn result_durability(command: &NodeCommand) -> Option<Durability> {
    match command {
        // The launch record, synced before the mint, is what keeps a
        // redelivered launch from minting or creating again: recovery
        // finds the launch from it, and a launch of a lease this node holds
        // is answered with what it holds (`Runner::launch`). The result is
        // committed, so it survives the process, and a power cut loses only
        // the copy of an answer the record already stands for.
        NodeCommand::Launch { .. } => Some(Durability::Committed),
        NodeCommand::Destroy { .. }
        | NodeCommand::AssumeCustody { .. }
        | NodeCommand::StartUpgrade(_) => Some(Durability::Synced),
        NodeCommand::Instances
        | NodeCommand::Sweep
        | NodeCommand::Tend
        | NodeCommand::Superseded => None,
    }
}

/// A successful launch, for custody if its result goes unacknowledged.
#[derive(Debug)]
struct Launched {
    lease: crate::model::LeaseId,
    epoch: crate::model::Epoch,
    request_id: RequestId,
}

async fn execute(
    runner: &Runner,
    upgrader: Option<&dyn Upgrader>,
    capacity: pb::Capacity,
    id: &str,
    command: NodeCommand,
) -> (pb::CommandResult, Option<Launched>) {
    let ok = || pb::CommandResult {
        id: id.to_owned(),
        outcome: pb::Outcome::Ok.into(),
        custody: false,
        error: None,
        instances: None,
    };
    let from_runner = |r: Result<(), RunnerError>| match r {
        Ok(()) => ok(),
        Err(e) => {
            let (outcome, code) = match &e {
                RunnerError::Refused(_) => (pb::Outcome::Refused, pb::ErrorCode::Refused),
                RunnerError::ImageUnavailable { .. } => {
                    (pb::Outcome::Refused, pb::ErrorCode::ImageUnavailable)
                }
                RunnerError::ProviderUnavailable(_) | RunnerError::JournalUnwritable(_) => {
                    (pb::Outcome::Refused, pb::ErrorCode::Unavailable)
                }
                RunnerError::ScaleSetNotFound(_) => {
                    (pb::Outcome::Failed, pb::ErrorCode::ScaleSetNotFound)
                }
                RunnerError::Busy { .. } => (pb::Outcome::Busy, pb::ErrorCode::Busy),
                RunnerError::Custody(_) | RunnerError::Failed(_) => {
                    (pb::Outcome::Failed, pb::ErrorCode::Unspecified)
                }
            };
            let mut result = failure(id, outcome, code, e.to_string());
            result.custody = e.is_custody();
            result
        }
    };
    match command {
        NodeCommand::Launch {
            lease,
            tier,
            job,
            registration,
        } => {
            let launched = Launched {
                lease: lease.id.clone(),
                epoch: lease.epoch,
                request_id: lease.request_id,
            };
            let r = runner.launch_with(lease, tier, job, registration).await;
            let success = r.is_ok();
            (from_runner(r), success.then_some(launched))
        }
        NodeCommand::Destroy { request_id, order } => {
            (from_runner(runner.destroy(request_id, &order).await), None)
        }
        NodeCommand::AssumeCustody { lease, request_id } => (
            from_runner(
                runner
                    .assume_custody(&lease.id, lease.epoch, request_id)
                    .await,
            ),
            None,
        ),
        // Returns once the updater has answered (bounded by its ack wait),
        // never after the upgrade itself: the slot must stay free for the
        // destroys the drain needs. OK means only that the updater took
        // responsibility; progress is read from the rollout.
        NodeCommand::StartUpgrade(spec) => {
            let result = match dispatch::start(upgrader, &spec).await {
                Ok(()) => ok(),
                Err(e) => {
                    let (outcome, code) = match &e {
                        UpgradeError::NoUpgrader { .. } | UpgradeError::Refused { .. } => {
                            (pb::Outcome::Refused, pb::ErrorCode::Refused)
                        }
                        UpgradeError::Spec { .. } => {
                            (pb::Outcome::InvalidArgument, pb::ErrorCode::InvalidArgument)
                        }
                        UpgradeError::Spawn { .. } | UpgradeError::Ack { .. } => {
                            (pb::Outcome::Failed, pb::ErrorCode::Internal)
                        }
                    };
                    failure(id, outcome, code, e.to_string())
                }
            };
            (result, None)
        }
        NodeCommand::Instances => match runner.instances().await {
            Ok(ids) => {
                let mut r = ok();
                r.instances = Some(pb::InstanceReport {
                    lease_ids: ids.into_iter().map(|l| l.as_str().to_owned()).collect(),
                    inventory_known: true,
                    capacity: Some(capacity),
                    held: Some(held(runner)),
                });
                (r, None)
            }
            Err(e) => {
                let mut r = failure(
                    id,
                    pb::Outcome::Failed,
                    pb::ErrorCode::Unavailable,
                    e.to_string(),
                );
                r.instances = Some(pb::InstanceReport {
                    lease_ids: Vec::new(),
                    inventory_known: false,
                    capacity: Some(capacity),
                    held: Some(held(runner)),
                });
                (r, None)
            }
        },
        // Reported like `Instances`, so the plane learns what the node
        // holds on every maintenance pass, not only at `Hello`.
        NodeCommand::Sweep => {
            let swept = runner.sweep_inventory().await;
            let report = pb::InstanceReport {
                inventory_known: swept.listed.is_some(),
                lease_ids: swept
                    .listed
                    .unwrap_or_default()
                    .iter()
                    .map(|l| l.as_str().to_owned())
                    .collect(),
                capacity: Some(capacity),
                held: Some(held(runner)),
            };
            let mut result = from_runner(swept.result);
            result.instances = Some(report);
            (result, None)
        }
        NodeCommand::Tend => (from_runner(runner.tend().await), None),
        NodeCommand::Superseded => {
            runner.superseded().await;
            (ok(), None)
        }
    }
}

/// Sends a result on the session its command came from and, for a
/// successful launch, takes custody unless the plane accepts it.
async fn deliver(
    runner: &Arc<Runner>,
    session: Arc<SessionLink>,
    ack: tokio::sync::oneshot::Receiver<pb::AckVerdict>,
    result: pb::CommandResult,
    launched: Option<Launched>,
    ack_timeout: Duration,
) {
    let sent = session.send(pb::node_message::Body::Result(result)).await;
    let Some(launched) = launched else {
        return;
    };
    let runner = Arc::clone(runner);
    tokio::spawn(
        async move {
            let verdict = if sent.is_err() {
                None
            } else {
                tokio::select! {
                    v = ack => v.ok(),
                    () = tokio::time::sleep(ack_timeout) => None,
                }
            };
            if verdict == Some(pb::AckVerdict::Accepted) {
                return;
            }
            info!(
                ?verdict,
                "the plane did not accept this launch's result; taking custody"
            );
            if let Err(e) = runner
                .assume_custody(&launched.lease, launched.epoch, launched.request_id)
                .await
            {
                warn!(error = %e, "custody after an unacknowledged launch");
            }
        }
        .instrument(info_span!("launch_ack")),
    );
}

/// Property tests over the command handler: whatever the plane sends, the
/// node answers without panicking, and a refused command has no effect at
/// all: nothing queued, nothing asked of the provider or the plane.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::provider::fake::FakeProvider;
    use proptest::prelude::*;

    fn service(provider: Arc<FakeProvider>) -> (NodeService, Arc<CommandSlot>, Arc<Runner>) {
        let link = Arc::new(PlaneLink::new(Duration::from_millis(50)));
        let runner = Arc::new(Runner::new(
            provider,
            link.clone(),
            link.clone(),
            crate::node::runner::RunnerOptions::default(),
        ));
        let slot = Arc::new(CommandSlot::new());
        let identity = Identity {
            node_name: NodeName::parse("node", "node-1").expect("name"),
            deployment: "dev".into(),
            incarnation: "i".into(),
            vcpu: 1,
            memory_bytes: 1,
            version: "0".into(),
        };
        let service =
            NodeService::new(identity, runner.clone(), link, slot.clone(), Arc::default());
        (service, slot, runner)
    }

    proptest! {
        #![proptest_config(crate::edge::wire::properties::config(256))]

        #[test]
        fn a_refused_command_has_no_effect_and_an_accepted_one_fails_safely_without_a_plane(
            cmd in crate::edge::wire::properties::command_strategy()
        ) {
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
            rt.block_on(async {
                let provider = Arc::new(FakeProvider::new());
                let (service, slot, runner) = service(provider.clone());
                let (tx, mut rx) = mpsc::channel(8);
                let session = Arc::new(SessionLink::new(1, tx));
                let valid = wire::command(cmd.clone()).command.is_ok();
                service.route(&session, pb::plane_message::Body::Command(cmd)).await;
                prop_assert!(provider.calls().is_empty(), "routing alone touched the provider");
                if !valid {
                    prop_assert!(slot.is_empty(), "a refused command was queued");
                    let Some(Ok(pb::NodeMessage { body: Some(pb::node_message::Body::Result(r)) })) = rx.recv().await else {
                        panic!("no answer to a refused command");
                    };
                    prop_assert_eq!(r.outcome, pb::Outcome::InvalidArgument as i32);
                    return Ok(());
                }
                prop_assert_eq!(slot.len(), 1);
                let queued = slot.next().await;
                // No plane session: every ledger call fails, so nothing may be created.
                let (result, launched) = execute(&runner, None, pb::Capacity::default(), queued.id.as_str(), queued.command).await;
                prop_assert!(launched.is_none());
                prop_assert_ne!(result.outcome, pb::Outcome::Unspecified as i32);
                prop_assert!(provider.specs().is_empty(), "an instance was created without the plane");
                Ok(())
            })?;
        }
    }
}

/// Scenarios over the executor, with a fake provider and a plane played by
/// the test: every message the node sends is read from the session's
/// channel, and each `NodeCall` is answered through `SessionLink::on_reply`.
#[cfg(test)]
mod scenarios {
    use super::*;
    use crate::journal::MemoryJournal;
    use crate::model::CommandId;
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
        }
    }

    /// A plane that answers bind, advance and remove_runner with success and
    /// a mint with a registration, except where `answer` says otherwise.
    fn default_answer(call: &pb::node_call::Call) -> Answer {
        match call {
            pb::node_call::Call::MintJit(m) => {
                Ok(Some(pb::plane_reply::Result::Jit(pb::JitConfig {
                    encoded_jit_config: "jit-config".into(),
                    runner_id: 42,
                    runner_name: m.runner_name.clone(),
                })))
            }
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
    async fn a_launch_carrying_its_registration_whose_bind_is_refused_removes_its_unstarted_instance()
     {
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
        let (result, launched) =
            execute(&runner, None, pb::Capacity::default(), "c1", command).await;
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
            ["bind_advance", "release"],
            "the bound lease is released, and nothing is minted"
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
        let (result, launched) =
            execute(&runner, None, pb::Capacity::default(), "c1", command).await;
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
}

#[cfg(test)]
mod executor_tests;
