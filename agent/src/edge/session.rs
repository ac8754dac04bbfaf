//! The gRPC face of the node: `Node.Attach`. A thin handler that checks the
//! plane's `Open`, answers `Hello`, and then routes: commands to the single
//! slot, acknowledgements and replies to whoever waits for them. The
//! executor ([`super::executor::execute_commands`]) takes commands off the slot one at a time
//! and answers each on the session it came from.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use billet_proto::v1 as pb;
use futures::Stream;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::{Request, Response, Status, Streaming};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::edge::executor::refused_launch;
use crate::edge::link::{PlaneLink, SessionLink};
use crate::edge::slot::{Admission, CommandSlot, Queued};
use crate::edge::wire;
use crate::model::NodeCommand;
use crate::model::NodeName;
use crate::node::health::{Health, Reason};
use crate::node::recovery::Recovery;
use crate::node::runner::Runner;

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
            keeps_warm_pool: self.runner.warm().is_some(),
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
            warn!(
                peer = peer.map(tracing::field::display),
                reason = status.message(),
                "refused a session"
            );
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
            peer = peer.map(tracing::field::display),
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
        // Set when the plane's stream could not be read: the session ends
        // with it, so the plane sees what it sent wrong, not OK.
        let ended_with: Arc<std::sync::Mutex<Option<Status>>> = Arc::default();
        let end = Arc::clone(&ended_with);
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
                            match unreadable(&status) {
                                Some(answer) => {
                                    warn!(
                                        peer = peer.map(tracing::field::display),
                                        error = %status,
                                        "closed the session: a message from the plane could not be read"
                                    );
                                    *end.lock().unwrap_or_else(std::sync::PoisonError::into_inner) =
                                        Some(answer);
                                }
                                None => debug!(error = %status, "session stream ended"),
                            }
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
        // The stream ends when the session closes: replaced, or the node
        // stopping; then with the status that says why, when it was the
        // plane's message.
        let closed = session_closed.cancelled_owned();
        let last = futures::stream::once(async move {
            ended_with
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .take()
                .map(Err)
        });
        let last = futures::StreamExt::filter_map(last, std::future::ready);
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            futures::StreamExt::take_until(ReceiverStream::new(rx), closed),
            last,
        ))))
    }
}

/// The status to end a session with when reading the plane's stream
/// failed on the plane's message itself (too large, or not a message this
/// node can decode); `None` for the transport failing (a reset, a closed
/// connection), which carries its cause as a source and has no one to
/// answer.
fn unreadable(status: &Status) -> Option<Status> {
    if std::error::Error::source(status).is_some() {
        return None;
    }
    match status.code() {
        tonic::Code::OutOfRange | tonic::Code::ResourceExhausted => {
            Some(Status::resource_exhausted(format!(
                "a message from the plane is larger than the node reads ({}); the session is closed",
                status.message()
            )))
        }
        tonic::Code::Internal => Some(Status::invalid_argument(format!(
            "a message from the plane could not be decoded ({}); the session is closed",
            status.message()
        ))),
        _ => None,
    }
}

impl NodeService {
    pub(super) async fn route(&self, session: &Arc<SessionLink>, body: pb::plane_message::Body) {
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
                                retry_after_ms: 0,
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

pub(super) fn failure(
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
            retry_after_ms: 0,
            code: code.into(),
            message,
        }),
        instances: None,
    }
}

/// What the leases `runner` holds charge, as the wire's `Capacity`.
pub(super) fn held(runner: &Runner) -> pb::Capacity {
    let (vcpu, memory_bytes) = runner.held_charge();
    pb::Capacity { vcpu, memory_bytes }
}

pub(super) fn now_unix_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// Property tests over the command handler: whatever the plane sends, the
/// node answers without panicking, and a refused command has no effect at
/// all: nothing queued, nothing asked of the provider or the plane.
#[cfg(test)]
mod properties {
    use super::*;
    use crate::edge::executor::execute;
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
