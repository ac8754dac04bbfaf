//! The plane's side of the wire for one node: dial over mTLS (the node's
//! certificate must name the node we meant to dial), open the session, and
//! keep it open; send commands with a deadline fixed at queue time and wait
//! for their results; acknowledge every result; and answer the node's
//! calls (ledger writes, JIT minting) against the identity of the session.
//!
//! Lost replies move custody causally (DESIGN.md): a delivered launch that
//! times out, or whose session breaks, is answered `Custody` to the caller
//! and tombstoned, so a late success is acknowledged `custody` and the node
//! takes the lease.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::calls::CallHandler;

/// The plane's default HTTP/2 PING interval to a node ([`Keepalive`]).
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// The plane's default time for a node to answer a PING ([`Keepalive`]).
pub const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

/// How the plane's HTTP/2 connection to a node notices silence: a PING
/// every `interval` while the session's stream is open, and the connection
/// (with its session) dropped when one is not answered within `timeout`
/// (tonic's `http2_keep_alive_interval` and `keep_alive_timeout`). A node
/// that goes silent without a FIN or RST (traffic dropped, a host lost) is
/// noticed only this way: its session is lost at most `interval + timeout`
/// after the loss, and the renewal grace starts then
/// ([`crate::plane::PlaneConfig::renewal_grace`]). Short values notice a
/// partition sooner and cost a PING per node per `interval`; a slow link
/// needs `timeout` above its worst round trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keepalive {
    /// Time between PINGs.
    pub interval: Duration,
    /// How long a PING may go unanswered before the connection is dropped.
    pub timeout: Duration,
}

impl Default for Keepalive {
    /// [`KEEPALIVE_INTERVAL`] and [`KEEPALIVE_TIMEOUT`]: 20 s and 20 s.
    fn default() -> Self {
        Self {
            interval: KEEPALIVE_INTERVAL,
            timeout: KEEPALIVE_TIMEOUT,
        }
    }
}

/// The session id of commands handed over by a recycled session before
/// its successor's `Hello` was read: they belong to the next one to open.
const NEXT_SESSION: u64 = u64::MAX;

/// Most launch tombstones kept per node.
const MAX_TOMBSTONES: usize = 1024;

/// Where a node listens and what its certificate must say.
#[derive(Debug, Clone)]
pub struct NodeTarget {
    /// The node's name; its certificate must carry it as a DNS name.
    pub name: String,
    /// Its listening address.
    pub addr: SocketAddr,
}

/// The plane's mTLS material, in PEM.
#[derive(Clone)]
pub struct PlaneTls {
    /// The deployment CA.
    pub ca_pem: Vec<u8>,
    /// The plane's certificate.
    pub cert_pem: Vec<u8>,
    /// The plane's key (a credential; never logged).
    pub key_pem: Vec<u8>,
}

impl std::fmt::Debug for PlaneTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PlaneTls { key: <redacted>, .. }")
    }
}

/// How a command ended, as the caller sees it.
#[derive(Debug, Clone, PartialEq)]
pub enum CommandOutcome {
    /// The node answered; look at the result's outcome and custody flag.
    Answered(pb::CommandResult),
    /// Delivered, and then the plane stopped waiting (timeout or a broken
    /// session): for a launch the node holds the lease.
    Lost(String),
    /// Never delivered: nothing was started.
    NotDelivered(String),
}

impl CommandOutcome {
    /// Answered with `OUTCOME_OK`.
    pub fn is_ok(&self) -> bool {
        matches!(self, CommandOutcome::Answered(r) if r.outcome == pb::Outcome::Ok as i32)
    }

    /// The node may hold compute for it: answered with the custody flag, or
    /// lost after delivery.
    pub fn is_custody(&self) -> bool {
        match self {
            CommandOutcome::Answered(r) => r.custody,
            CommandOutcome::Lost(_) => true,
            CommandOutcome::NotDelivered(_) => false,
        }
    }

    /// A line for logs.
    pub fn describe(&self) -> String {
        match self {
            CommandOutcome::Answered(r) => {
                let outcome =
                    pb::Outcome::try_from(r.outcome).map_or("unknown", |o| o.as_str_name());
                match &r.error {
                    Some(e) => format!(
                        "{outcome}{}: {}",
                        if r.custody { " (custody)" } else { "" },
                        e.message
                    ),
                    None => outcome.to_owned(),
                }
            }
            CommandOutcome::Lost(why) => format!("lost after delivery: {why}"),
            CommandOutcome::NotDelivered(why) => format!("not delivered: {why}"),
        }
    }
}

/// How a session that opened ended.
#[derive(Debug)]
enum Ended {
    /// The stream ended or the plane is stopping.
    Closed,
    /// The node asked for a new session (its connection reaches its
    /// maximum age); this one, by id, goes on answering what is in flight.
    Reattach(u64),
}

/// A dial or session failure.
#[derive(Debug, Error)]
pub enum LinkError {
    /// TLS material or the address is unusable.
    #[error("{0}")]
    Config(String),
    /// The node could not be reached or refused the session.
    #[error("{0}")]
    Session(String),
}

#[derive(Debug)]
struct InFlight {
    is_launch: bool,
    is_destroy: bool,
    reply: oneshot::Sender<CommandOutcome>,
}

#[derive(Debug, Default)]
struct Shared {
    /// Sender of the current session, with its id.
    session: Option<(u64, mpsc::Sender<pb::PlaneMessage>)>,
    in_flight: HashMap<String, (u64, InFlight)>,
    tombstones: VecDeque<String>,
}

/// Fault injection for tests: drop what would otherwise flow.
#[derive(Debug)]
pub struct LinkFaults {
    /// Drop the next N launch results on receipt (the plane never sees
    /// them and never acknowledges them).
    pub drop_launch_results: AtomicU64,
    /// Break the session instead of taking the next N destroy results (the
    /// node ran the destroy; the plane never hears how it went).
    pub cut_on_destroy_results: AtomicU64,
    /// While set, do not dial the node (an open session is left alone):
    /// the node sees no plane, so it never finishes start-up recovery.
    pub hold_dial: AtomicBool,
    /// While true, the plane and the node cannot reach each other: the open
    /// session is cut and nothing is dialed ([`NodeLink::partition`]).
    partitioned: watch::Sender<bool>,
    /// While set, send launches to the node even while it says it is
    /// degraded (to see it refuse them).
    pub place_on_degraded: AtomicBool,
    /// While set, answer every certificate renewal `ERROR_CODE_UNAVAILABLE`
    /// without asking the CA (a plane that cannot sign for now).
    pub refuse_renewals: AtomicBool,
}

impl Default for LinkFaults {
    fn default() -> Self {
        Self {
            drop_launch_results: AtomicU64::new(0),
            cut_on_destroy_results: AtomicU64::new(0),
            hold_dial: AtomicBool::new(false),
            partitioned: watch::Sender::new(false),
            place_on_degraded: AtomicBool::new(false),
            refuse_renewals: AtomicBool::new(false),
        }
    }
}

/// What the node said in `Hello`, and its health as it last reported it.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeStatus {
    /// The session's `Hello`.
    pub hello: pb::Hello,
    /// The session id (per plane process).
    pub session: u64,
    /// The node's last `NodeStatus` (from `Hello` until the first one).
    pub health: pb::NodeStatus,
    /// What the node may run at once, as it last said (`Hello`, then every
    /// `Instances` or `Sweep` report).
    pub capacity: pb::Capacity,
    /// What the leases it holds charge, as it last said (same sources): its
    /// launches, custody and adopted compute.
    pub held: pb::Capacity,
}

impl NodeStatus {
    /// The node takes no launches now: place nothing on it.
    pub fn degraded(&self) -> bool {
        self.health.degraded
    }
}

/// One node, dialed and kept attached.
#[derive(Debug)]
pub struct NodeLink {
    target: NodeTarget,
    shared: Mutex<Shared>,
    status: watch::Sender<Option<NodeStatus>>,
    next_session: AtomicU64,
    /// When the last session ended (or the link was made), while none is
    /// open; `None` while attached.
    detached_since: Mutex<Option<std::time::Instant>>,
    /// How the connection notices a silent node.
    keepalive: Keepalive,
    /// Fault injection.
    pub faults: LinkFaults,
}

impl NodeLink {
    /// A link for `target`; nothing is dialed until [`NodeLink::run`].
    pub fn new(target: NodeTarget) -> Arc<Self> {
        Self::with_keepalive(target, Keepalive::default())
    }

    /// A link to `target` whose connections PING as `keepalive` says.
    pub fn with_keepalive(target: NodeTarget, keepalive: Keepalive) -> Arc<Self> {
        Arc::new(Self {
            keepalive,
            target,
            shared: Mutex::new(Shared::default()),
            status: watch::Sender::new(None),
            next_session: AtomicU64::new(1),
            detached_since: Mutex::new(Some(std::time::Instant::now())),
            faults: LinkFaults::default(),
        })
    }

    /// How long the plane has had no session with this node; `None` while
    /// one is open.
    pub fn detached_for(&self) -> Option<Duration> {
        self.detached_since
            .lock()
            .expect("link")
            .map(|since| since.elapsed())
    }

    /// Fault injection: while `on`, the plane and this node cannot reach
    /// each other. The open session is cut at once (the node sees its plane
    /// go away; commands in flight are lost) and nothing is dialed until
    /// the partition heals.
    pub fn partition(&self, on: bool) {
        self.faults.partitioned.send_replace(on);
    }

    /// The node's name.
    pub fn name(&self) -> &str {
        &self.target.name
    }

    /// Watches the node's status: `Some` while a session is open.
    pub fn status(&self) -> watch::Receiver<Option<NodeStatus>> {
        self.status.subscribe()
    }

    /// Dials and re-dials the node until `shutdown`, answering its calls with
    /// `calls`.
    pub async fn run(
        self: Arc<Self>,
        tls: PlaneTls,
        open: pb::Open,
        calls: Arc<CallHandler>,
        shutdown: CancellationToken,
    ) {
        let mut backoff = Duration::from_millis(200);
        loop {
            if self.faults.hold_dial.load(Ordering::SeqCst) || *self.faults.partitioned.borrow() {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = tokio::time::sleep(Duration::from_millis(100)) => continue,
                }
            }
            let sessions = self.next_session.load(Ordering::Relaxed);
            let attempt = self.session(&tls, &open, &calls, &shutdown).await;
            match attempt {
                Ok(Ended::Reattach(id)) => {
                    // The node asked for a fresh connection: dial again at
                    // once; what is in flight stays in flight.
                    self.retire_session(id);
                    backoff = Duration::from_millis(200);
                    continue;
                }
                Ok(Ended::Closed) => {
                    self.end_session();
                    backoff = Duration::from_millis(200);
                }
                Err(e) => {
                    self.end_session();
                    warn!(node = %self.target.name, addr = %self.target.addr, error = %e, "node session failed");
                }
            }
            // A session that was established and then ended is not a failed
            // dial: the next one starts from the shortest backoff.
            if self.next_session.load(Ordering::Relaxed) != sessions {
                backoff = Duration::from_millis(200);
            }
            tokio::select! {
                () = shutdown.cancelled() => return,
                () = tokio::time::sleep(backoff) => {}
            }
            backoff = (backoff * 2).min(Duration::from_secs(5));
        }
    }

    /// Dials once and serves the session until it ends.
    async fn session(
        self: &Arc<Self>,
        tls: &PlaneTls,
        open: &pb::Open,
        calls: &Arc<CallHandler>,
        shutdown: &CancellationToken,
    ) -> Result<Ended, LinkError> {
        let channel = dial_with(&self.target, tls, self.keepalive).await?;
        let (tx, rx) = mpsc::channel::<pb::PlaneMessage>(256);
        let mut open = open.clone();
        // The node measures its clock's offset from this.
        open.plane_clock_unix_ms = crate::now_ms();
        tx.send(pb::PlaneMessage {
            body: Some(pb::plane_message::Body::Open(open)),
        })
        .await
        .map_err(|_| LinkError::Session("session closed before Open".into()))?;
        let mut client =
            pb::node_client::NodeClient::new(channel).max_decoding_message_size(4 << 20);
        let mut inbound = client
            .attach(ReceiverStream::new(rx))
            .await
            .map_err(|s| {
                LinkError::Session(format!(
                    "node {} refused the session: {}",
                    self.target.name,
                    s.message()
                ))
            })?
            .into_inner();
        let hello = match tokio::time::timeout(Duration::from_secs(30), inbound.message()).await {
            Ok(Ok(Some(pb::NodeMessage {
                body: Some(pb::node_message::Body::Hello(h)),
            }))) => h,
            Ok(Err(s)) => {
                return Err(LinkError::Session(format!(
                    "node {} refused the session: {}",
                    self.target.name,
                    s.message()
                )));
            }
            _ => {
                return Err(LinkError::Session(format!(
                    "node {} did not say Hello",
                    self.target.name
                )));
            }
        };
        if hello.protocol_version != billet_proto::PROTOCOL_VERSION {
            return Err(LinkError::Session(format!(
                "node {} speaks wire protocol {} and this plane speaks {}; upgrade whichever is older",
                self.target.name,
                hello.protocol_version,
                billet_proto::PROTOCOL_VERSION
            )));
        }
        if hello.node_name != self.target.name {
            return Err(LinkError::Session(format!(
                "dialed node {} but it says it is {:?}; refusing the session",
                self.target.name, hello.node_name
            )));
        }
        let session = self.next_session.fetch_add(1, Ordering::Relaxed);
        info!(node = %self.target.name, session, incarnation = %hello.incarnation,
              inventory_known = hello.inventory_known, instances = hello.instances.len(), "node attached");
        {
            let mut shared = self.shared.lock().expect("link");
            shared.session = Some((session, tx.clone()));
            for (s, _) in shared.in_flight.values_mut() {
                if *s == NEXT_SESSION {
                    *s = session;
                }
            }
        }
        *self.detached_since.lock().expect("link") = None;
        let health = pb::NodeStatus {
            degraded: hello.degraded,
            reasons: hello.degraded_reasons.clone(),
            ..Default::default()
        };
        self.status.send_replace(Some(NodeStatus {
            capacity: hello.capacity.unwrap_or_default(),
            held: hello.held.unwrap_or_default(),
            hello,
            session,
            health,
        }));

        let served = self
            .serve(session, &mut inbound, &tx, calls, shutdown, false)
            .await;
        if matches!(served, Ok(Ended::Reattach(_))) {
            // The old session keeps answering what is in flight on it until
            // the node closes it; the caller dials a new one meanwhile.
            let (this, calls, shutdown) = (Arc::clone(self), Arc::clone(calls), shutdown.clone());
            tokio::spawn(
                async move {
                    let _client = client;
                    let drained = this
                        .serve(session, &mut inbound, &tx, &calls, &shutdown, true)
                        .await;
                    debug!(session, ?drained, "a recycled session ended");
                    this.end_drained(session);
                }
                .instrument(info_span!("recycled_session", session)),
            );
        }
        served
    }

    /// Serves an open session's inbound messages until it ends; unless
    /// `draining`, returns [`Ended::Reattach`] as soon as the node asks for
    /// a new session.
    async fn serve(
        self: &Arc<Self>,
        session: u64,
        inbound: &mut tonic::Streaming<pb::NodeMessage>,
        tx: &mpsc::Sender<pb::PlaneMessage>,
        calls: &Arc<CallHandler>,
        shutdown: &CancellationToken,
        draining: bool,
    ) -> Result<Ended, LinkError> {
        let mut partitioned = self.faults.partitioned.subscribe();
        loop {
            let message = tokio::select! {
                () = shutdown.cancelled() => return Ok(Ended::Closed),
                _ = partitioned.wait_for(|p| *p) => {
                    return Err(LinkError::Session("fault injection: partitioned from the node".into()));
                }
                m = inbound.message() => m,
            };
            let body = match message {
                Ok(Some(pb::NodeMessage { body: Some(body) })) => body,
                Ok(Some(_)) => continue,
                Ok(None) => return Ok(Ended::Closed),
                Err(s) => {
                    return Err(LinkError::Session(format!(
                        "session with {} broke: {}",
                        self.target.name,
                        s.message()
                    )));
                }
            };
            match body {
                pb::node_message::Body::Result(result) => {
                    if self.cut_here(&result) {
                        return Err(LinkError::Session(
                            "fault injection: session cut on a destroy result".into(),
                        ));
                    }
                    self.on_result(result, tx).await;
                }
                pb::node_message::Body::Call(call)
                    if matches!(call.call, Some(pb::node_call::Call::RenewCertificate(_)))
                        && self.faults.refuse_renewals.load(Ordering::SeqCst) =>
                {
                    warn!(node = %self.target.name, "fault injection: refusing a certificate renewal");
                    let _ = tx
                        .send(pb::PlaneMessage {
                            body: Some(pb::plane_message::Body::Reply(pb::PlaneReply {
                                call_id: call.call_id,
                                error: Some(pb::Error {
                                    code: pb::ErrorCode::Unavailable.into(),
                                    message: "fault injection: this plane signs nothing for now"
                                        .into(),
                                }),
                                result: None,
                            })),
                        })
                        .await;
                }
                pb::node_message::Body::Call(call) => {
                    let calls = Arc::clone(calls);
                    let tx = tx.clone();
                    let node = self.target.name.clone();
                    let capacity = self.status.borrow().as_ref().map(|s| s.capacity);
                    tokio::spawn(
                        async move {
                            let reply = calls.handle_from(&node, capacity, call).await;
                            let _ = tx
                                .send(pb::PlaneMessage {
                                    body: Some(pb::plane_message::Body::Reply(reply)),
                                })
                                .await;
                        }
                        .instrument(info_span!("node_call")),
                    );
                }
                pb::node_message::Body::Hello(_) => warn!("ignored a second Hello"),
                pb::node_message::Body::Status(health) if draining => {
                    debug!(session, ?health, "status on a recycled session");
                }
                pb::node_message::Body::Status(health) => {
                    let reattach = health.reattach;
                    let was = self.status.borrow().as_ref().map(NodeStatus::degraded);
                    if was != Some(health.degraded) {
                        info!(node = %self.target.name, degraded = health.degraded,
                              reasons = ?health.reasons().collect::<Vec<_>>(),
                              clock_offset_ms = health.clock_offset_ms, "node health");
                    }
                    self.status.send_modify(|s| {
                        if let Some(s) = s {
                            s.health = health;
                        }
                    });
                    if reattach {
                        info!(node = %self.target.name, session,
                              "the node recycles this session's connection; attaching anew");
                        return Ok(Ended::Reattach(session));
                    }
                }
            }
        }
    }

    fn cut_here(&self, result: &pb::CommandResult) -> bool {
        let is_destroy = self
            .shared
            .lock()
            .expect("link")
            .in_flight
            .get(&result.id)
            .is_some_and(|(_, f)| f.is_destroy);
        is_destroy
            && self
                .faults
                .cut_on_destroy_results
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
    }

    async fn on_result(&self, result: pb::CommandResult, tx: &mpsc::Sender<pb::PlaneMessage>) {
        if let Some(report) = &result.instances {
            self.status.send_if_modified(|s| {
                let Some(s) = s else { return false };
                let before = (s.capacity, s.held);
                if let Some(c) = report.capacity {
                    s.capacity = c;
                }
                if let Some(h) = report.held {
                    s.held = h;
                }
                before != (s.capacity, s.held)
            });
        }
        let is_launch = self
            .shared
            .lock()
            .expect("link")
            .in_flight
            .get(&result.id)
            .is_some_and(|(_, f)| f.is_launch);
        if is_launch
            && self
                .faults
                .drop_launch_results
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            warn!(id = %result.id, "fault injection: dropping a launch result");
            return;
        }
        let (verdict, waiter) = {
            let mut shared = self.shared.lock().expect("link");
            match shared.in_flight.remove(&result.id) {
                Some((_, flight)) => (pb::AckVerdict::Accepted, Some(flight.reply)),
                None if shared.tombstones.contains(&result.id) => (pb::AckVerdict::Custody, None),
                None => (pb::AckVerdict::Accepted, None),
            }
        };
        debug!(id = %result.id, ?verdict, "result");
        let _ = tx
            .send(pb::PlaneMessage {
                body: Some(pb::plane_message::Body::ResultAck(pb::ResultAck {
                    id: result.id.clone(),
                    verdict: verdict.into(),
                })),
            })
            .await;
        if let Some(waiter) = waiter {
            let _ = waiter.send(CommandOutcome::Answered(result));
        }
    }

    /// Stops sending on session `id` (the node asked for a new one): new
    /// commands wait for the next session, and what is in flight on it
    /// stays in flight.
    fn retire_session(&self, id: u64) {
        let mut shared = self.shared.lock().expect("link");
        if shared.session.as_ref().is_some_and(|(s, _)| *s == id) {
            shared.session = None;
            drop(shared);
            *self.detached_since.lock().expect("link") = Some(std::time::Instant::now());
            self.status.send_replace(None);
        }
    }

    /// A recycled session `ended` is over: the node answers what was in
    /// flight on it on its newer session, so those commands now belong to
    /// the current one, or to the next one to open.
    fn end_drained(&self, ended: u64) {
        let mut shared = self.shared.lock().expect("link");
        let current = shared.session.as_ref().map(|(s, _)| *s);
        let left: Vec<String> = shared
            .in_flight
            .iter()
            .filter(|(_, (s, _))| *s == ended)
            .map(|(id, _)| id.clone())
            .collect();
        // Between the two (the newer session's Hello not yet read), they
        // wait for whichever session opens next; their own deadlines still
        // bound them.
        let to = current.unwrap_or(NEXT_SESSION);
        for id in left {
            if let Some(entry) = shared.in_flight.get_mut(&id) {
                entry.0 = to;
            }
        }
    }

    fn end_session(&self) {
        let mut shared = self.shared.lock().expect("link");
        let Some((ended, _)) = shared.session.take() else {
            return;
        };
        let lost: Vec<String> = shared
            .in_flight
            .iter()
            .filter(|(_, (s, _))| *s == ended)
            .map(|(id, _)| id.clone())
            .collect();
        for id in lost {
            if let Some((_, flight)) = shared.in_flight.remove(&id) {
                if flight.is_launch {
                    tombstone(&mut shared, id);
                }
                let _ = flight.reply.send(CommandOutcome::Lost(
                    "the session broke before the node answered".into(),
                ));
            }
        }
        drop(shared);
        *self.detached_since.lock().expect("link") = Some(std::time::Instant::now());
        self.status.send_replace(None);
    }

    /// Sends a command and waits for its result until `timeout` from now
    /// (the deadline the node enforces is fixed here, at queue time). Waits
    /// for a session if none is open. A caller may stop waiting by dropping
    /// the future: nothing is left in flight, and an abandoned launch is
    /// tombstoned as if it had timed out.
    pub async fn dispatch(&self, kind: pb::command::Kind, timeout: Duration) -> CommandOutcome {
        let deadline = tokio::time::Instant::now() + timeout;
        let deadline_unix_ms =
            crate::now_ms() + i64::try_from(timeout.as_millis()).unwrap_or(i64::MAX);
        self.dispatch_until(kind, deadline, deadline_unix_ms).await
    }

    /// [`NodeLink::dispatch`] with an explicit node-side deadline, which may
    /// already be past (to test expiry).
    pub async fn dispatch_until(
        &self,
        kind: pb::command::Kind,
        deadline: tokio::time::Instant,
        deadline_unix_ms: i64,
    ) -> CommandOutcome {
        let is_launch = matches!(kind, pb::command::Kind::Launch(_));
        let id = uuid::Uuid::new_v4().simple().to_string();
        // However this call ends (a caller that stops waiting drops it), its
        // in-flight entry goes with it.
        let _waiting = Waiting {
            link: self,
            id: id.clone(),
            is_launch,
        };
        let sent = tokio::time::timeout_at(
            deadline,
            self.send_when_attached(&id, kind, deadline_unix_ms, is_launch),
        )
        .await;
        let Ok(reply) = sent else {
            return CommandOutcome::NotDelivered(format!(
                "node {} had no open session",
                self.target.name
            ));
        };
        let mut reply = reply;
        match tokio::time::timeout_at(deadline, &mut reply).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(_)) => CommandOutcome::Lost("the plane stopped waiting".into()),
            Err(_) => {
                let given_up = {
                    let mut shared = self.shared.lock().expect("link");
                    let removed = shared.in_flight.remove(&id).is_some();
                    if removed && is_launch {
                        tombstone(&mut shared, id.clone());
                    }
                    removed
                };
                if !given_up {
                    // The result arrived and was acknowledged `accepted` just
                    // as the deadline passed: it is on its way to us, and the
                    // caller must see it, or plane and node would disagree
                    // about who holds the lease.
                    if let Ok(Ok(outcome)) =
                        tokio::time::timeout(Duration::from_secs(5), reply).await
                    {
                        return outcome;
                    }
                }
                CommandOutcome::Lost(format!("no result for command {id} before its deadline"))
            }
        }
    }
}

/// A dispatch still waiting for its result. Dropped however the dispatch
/// ends; if the command is still in flight then, the caller stopped waiting
/// (its future was dropped): the entry is removed so nothing waits for it,
/// and a launch is tombstoned like one that timed out, so a late success is
/// acknowledged `custody` and the node holds the lease no caller manages.
struct Waiting<'a> {
    link: &'a NodeLink,
    id: String,
    is_launch: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut shared = self
            .link
            .shared
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if shared.in_flight.remove(&self.id).is_some() && self.is_launch {
            debug!(id = %self.id, "the caller stopped waiting for a launch; tombstoned");
            tombstone(&mut shared, self.id.clone());
        }
    }
}

impl NodeLink {
    /// Sends a command on the current session, waiting for one to open
    /// (and, for a launch, for the node to be healthy: a degraded node is
    /// given no new work); returns where its result will arrive.
    async fn send_when_attached(
        &self,
        id: &str,
        kind: pb::command::Kind,
        deadline_unix_ms: i64,
        is_launch: bool,
    ) -> oneshot::Receiver<CommandOutcome> {
        let mut status = self.status.subscribe();
        loop {
            let degraded = status
                .borrow_and_update()
                .as_ref()
                .is_some_and(NodeStatus::degraded);
            let session = self.shared.lock().expect("link").session.clone();
            let placeable =
                !is_launch || !degraded || self.faults.place_on_degraded.load(Ordering::SeqCst);
            if let Some((session, tx)) = session.filter(|_| placeable) {
                let (reply_tx, reply_rx) = oneshot::channel();
                self.shared.lock().expect("link").in_flight.insert(
                    id.to_owned(),
                    (
                        session,
                        InFlight {
                            is_launch,
                            is_destroy: matches!(kind, pb::command::Kind::Destroy(_)),
                            reply: reply_tx,
                        },
                    ),
                );
                // The node judges the time left on its own monotonic clock
                // (0: already past).
                let remaining = deadline_unix_ms.saturating_sub(crate::now_ms()).max(0);
                let command = pb::Command {
                    id: id.to_owned(),
                    deadline_unix_ms,
                    deadline_remaining_ms: Some(u64::try_from(remaining).unwrap_or(0)),
                    kind: Some(kind.clone()),
                };
                let message = pb::PlaneMessage {
                    body: Some(pb::plane_message::Body::Command(command)),
                };
                if tx.send(message).await.is_ok() {
                    return reply_rx;
                }
                self.shared.lock().expect("link").in_flight.remove(id);
            }
            let _ = status.changed().await;
        }
    }
}

fn tombstone(shared: &mut Shared, id: String) {
    shared.tombstones.push_back(id);
    while shared.tombstones.len() > MAX_TOMBSTONES {
        shared.tombstones.pop_front();
    }
}

/// Dials a node over mTLS with the default [`Keepalive`]. The node's
/// certificate must chain to the CA and name `target.name`; anything else
/// fails the handshake.
///
/// # Errors
///
/// [`LinkError`] naming the node and what went wrong.
pub async fn dial(
    target: &NodeTarget,
    tls: &PlaneTls,
) -> Result<tonic::transport::Channel, LinkError> {
    dial_with(target, tls, Keepalive::default()).await
}

/// [`dial`], with the connection PINGing as `keepalive` says.
///
/// # Errors
///
/// [`LinkError`] naming the node and what went wrong.
pub async fn dial_with(
    target: &NodeTarget,
    tls: &PlaneTls,
    keepalive: Keepalive,
) -> Result<tonic::transport::Channel, LinkError> {
    let tls_config = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&tls.ca_pem))
        .identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem))
        .domain_name(target.name.clone());
    Endpoint::from_shared(format!("https://{}", target.addr))
        .map_err(|e| {
            LinkError::Config(format!("node {} address {}: {e}", target.name, target.addr))
        })?
        .tls_config(tls_config)
        .map_err(|e| LinkError::Config(format!("plane TLS material: {e}")))?
        .connect_timeout(Duration::from_secs(10))
        .http2_keep_alive_interval(keepalive.interval)
        .keep_alive_timeout(keepalive.timeout)
        .connect()
        .await
        .map_err(|e| {
            use std::error::Error as _;
            let mut text = e.to_string();
            let mut source = e.source();
            while let Some(s) = source {
                text.push_str(": ");
                text.push_str(&s.to_string());
                source = s.source();
            }
            LinkError::Session(format!(
                "cannot attach to node {} at {}: {text}",
                target.name, target.addr
            ))
        })
}

#[cfg(test)]
impl NodeLink {
    /// Opens a session without dialing, for tests: what the plane sends on
    /// it arrives on the receiver, and results are handed in with
    /// [`NodeLink::answer_for_test`].
    pub(crate) fn attach_for_test(
        &self,
        session: u64,
        capacity: usize,
    ) -> (
        mpsc::Sender<pb::PlaneMessage>,
        mpsc::Receiver<pb::PlaneMessage>,
    ) {
        let (tx, rx) = mpsc::channel(capacity);
        self.shared.lock().expect("link").session = Some((session, tx.clone()));
        *self.detached_since.lock().expect("link") = None;
        self.status.send_replace(Some(NodeStatus {
            hello: pb::Hello {
                node_name: self.target.name.clone(),
                capacity: Some(pb::Capacity {
                    vcpu: 64,
                    memory_bytes: 64 << 30,
                }),
                ..Default::default()
            },
            session,
            health: pb::NodeStatus::default(),
            capacity: pb::Capacity {
                vcpu: 64,
                memory_bytes: 64 << 30,
            },
            held: pb::Capacity::default(),
        }));
        (tx, rx)
    }

    /// Sets what the node says it holds and whether it is degraded, for
    /// tests, as a report and a `NodeStatus` would.
    pub(crate) fn report_for_test(&self, held: pb::Capacity, degraded: bool) {
        self.status.send_modify(|s| {
            if let Some(s) = s {
                s.held = held;
                s.health.degraded = degraded;
            }
        });
    }

    /// The node's result arriving on the session whose sender is `tx`.
    pub(crate) async fn answer_for_test(
        &self,
        result: pb::CommandResult,
        tx: &mpsc::Sender<pb::PlaneMessage>,
    ) {
        self.on_result(result, tx).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn link(name: &str) -> Arc<NodeLink> {
        NodeLink::new(NodeTarget {
            name: name.into(),
            addr: "127.0.0.1:9".parse().expect("addr"),
        })
    }

    fn launch() -> pb::command::Kind {
        pb::command::Kind::Launch(pb::Launch::default())
    }

    fn destroy() -> pb::command::Kind {
        pb::command::Kind::Destroy(pb::Destroy {
            request_id: 7,
            job_result: None,
            force: false,
            reason: String::new(),
        })
    }

    fn result(id: &str, outcome: pb::Outcome, custody: bool) -> pb::CommandResult {
        pb::CommandResult {
            id: id.into(),
            outcome: outcome.into(),
            custody,
            error: (outcome != pb::Outcome::Ok).then(|| pb::Error {
                code: pb::ErrorCode::Unspecified.into(),
                message: "the node says no".into(),
            }),
            instances: None,
        }
    }

    async fn next(rx: &mut mpsc::Receiver<pb::PlaneMessage>) -> pb::plane_message::Body {
        tokio::time::timeout(Duration::from_secs(5), rx.recv())
            .await
            .expect("the plane sent something within 5s")
            .and_then(|m| m.body)
            .expect("a message with a body")
    }

    async fn command(rx: &mut mpsc::Receiver<pb::PlaneMessage>) -> pb::Command {
        match next(rx).await {
            pb::plane_message::Body::Command(c) => c,
            other => panic!("expected a command, got {other:?}"),
        }
    }

    async fn ack(rx: &mut mpsc::Receiver<pb::PlaneMessage>) -> pb::ResultAck {
        match next(rx).await {
            pb::plane_message::Body::ResultAck(a) => a,
            other => panic!("expected an acknowledgement, got {other:?}"),
        }
    }

    fn tombstones(link: &NodeLink) -> Vec<String> {
        link.shared
            .lock()
            .expect("link")
            .tombstones
            .iter()
            .cloned()
            .collect()
    }

    fn in_flight(link: &NodeLink) -> usize {
        link.shared.lock().expect("link").in_flight.len()
    }

    /// 7.M.5: what the node answered reaches the caller unchanged: OK,
    /// a clean failure (the caller may release), a failure with the custody
    /// flag (the node holds the lease), a refusal. Every answer is
    /// acknowledged `accepted`.
    #[tokio::test]
    async fn the_nodes_verdict_reaches_the_caller_as_the_node_gave_it() {
        let link = link("node-a");
        let (tx, mut rx) = link.attach_for_test(1, 16);
        let cases = [
            (pb::Outcome::Ok, false, true, false),
            (pb::Outcome::Failed, false, false, false),
            (pb::Outcome::Failed, true, false, true),
            (pb::Outcome::Refused, false, false, false),
        ];
        for (outcome, custody, ok, held) in cases {
            let dispatch = tokio::spawn({
                let link = Arc::clone(&link);
                async move { link.dispatch(launch(), Duration::from_secs(30)).await }
            });
            let sent = command(&mut rx).await;
            let answer = result(&sent.id, outcome, custody);
            link.answer_for_test(answer.clone(), &tx).await;
            let got = dispatch.await.expect("dispatch");
            assert_eq!(got, CommandOutcome::Answered(answer), "{outcome:?}");
            assert_eq!(got.is_ok(), ok, "{outcome:?} custody={custody}");
            assert_eq!(got.is_custody(), held, "{outcome:?} custody={custody}");
            let acked = ack(&mut rx).await;
            assert_eq!(acked.id, sent.id);
            assert_eq!(acked.verdict, pb::AckVerdict::Accepted as i32);
        }
        assert!(
            tombstones(&link).is_empty(),
            "an answered launch was tombstoned"
        );
        assert_eq!(in_flight(&link), 0);
    }

    /// 7.M.21: a result that arrived as the deadline passed (taken off the
    /// in-flight table and acknowledged `accepted`, its hand-over to the
    /// caller not yet done) is the answer, not a loss: otherwise the plane
    /// would call it custody while the node was told it was accepted.
    // In paused time: the deadline passes on the virtual clock, and the
    // sleep past it returns only once every other task is idle.
    #[tokio::test(start_paused = true)]
    async fn a_result_that_landed_as_the_deadline_passed_is_taken_not_lost() {
        let link = link("node-a");
        // Room for one message: the command, then (once the test fills it)
        // nothing, so the acknowledgement waits while the deadline passes.
        let (tx, mut rx) = link.attach_for_test(1, 1);
        let dispatch = tokio::spawn({
            let link = Arc::clone(&link);
            async move { link.dispatch(launch(), Duration::from_millis(300)).await }
        });
        let sent = command(&mut rx).await;
        tx.try_send(pb::PlaneMessage { body: None })
            .expect("fill the session's buffer");
        let answering = tokio::spawn({
            let (link, tx) = (Arc::clone(&link), tx.clone());
            let answer = result(&sent.id, pb::Outcome::Ok, false);
            async move { link.answer_for_test(answer, &tx).await }
        });
        // The result is in: off the in-flight table, its acknowledgement
        // blocked behind the full buffer.
        tokio::time::timeout(Duration::from_secs(5), async {
            while in_flight(&link) > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the result was taken off the in-flight table");
        // The deadline passes with the hand-over still pending.
        tokio::time::sleep(Duration::from_millis(500)).await;
        assert!(
            !dispatch.is_finished(),
            "the dispatch gave up on a result it had"
        );
        assert_eq!(rx.recv().await.map(|m| m.body), Some(None), "the filler");
        let acked = ack(&mut rx).await;
        assert_eq!(acked.verdict, pb::AckVerdict::Accepted as i32);
        answering.await.expect("answer");
        let got = dispatch.await.expect("dispatch");
        assert!(got.is_ok(), "the result was lost: {got:?}");
        assert!(!got.is_custody());
        assert!(
            tombstones(&link).is_empty(),
            "an accepted launch was tombstoned"
        );
    }

    /// 7.M.33: only a launch that is given up on is tombstoned (its late
    /// success is acknowledged `custody`); a lost destroy is sent again
    /// rather than tombstoned, and sweeps and tends never take tombstone
    /// room. Their late results are acknowledged `accepted`.
    #[tokio::test]
    async fn only_a_launch_given_up_on_is_tombstoned() {
        let link = link("node-a");
        let (tx, mut rx) = link.attach_for_test(1, 16);
        let kinds = [
            ("launch", launch()),
            ("destroy", destroy()),
            ("sweep", pb::command::Kind::Sweep(pb::Sweep {})),
            ("tend", pb::command::Kind::Tend(pb::Tend {})),
        ];
        let mut ids = Vec::new();
        for (name, kind) in kinds {
            let dispatch = tokio::spawn({
                let link = Arc::clone(&link);
                async move { link.dispatch(kind, Duration::from_millis(100)).await }
            });
            let sent = command(&mut rx).await;
            let got = dispatch.await.expect("dispatch");
            assert!(matches!(got, CommandOutcome::Lost(_)), "{name}: {got:?}");
            ids.push((name, sent.id));
        }
        assert_eq!(tombstones(&link), vec![ids[0].1.clone()]);
        assert_eq!(in_flight(&link), 0);
        for (name, id) in &ids {
            link.answer_for_test(result(id, pb::Outcome::Ok, false), &tx)
                .await;
            let acked = ack(&mut rx).await;
            assert_eq!(&acked.id, id);
            let expected = if *name == "launch" {
                pb::AckVerdict::Custody
            } else {
                pb::AckVerdict::Accepted
            };
            assert_eq!(acked.verdict, expected as i32, "late {name}");
        }
    }

    /// 7.M.38: a caller that stops waiting (its dispatch dropped) leaves
    /// nothing waiting behind it and does not wedge the link: the next
    /// command goes through, and the abandoned launch's late success is
    /// acknowledged `custody`, so the node holds the lease nobody manages.
    #[tokio::test]
    async fn a_caller_that_stops_waiting_is_not_stuck_and_its_launch_goes_to_the_node() {
        let link = link("node-a");
        let (tx, mut rx) = link.attach_for_test(1, 16);
        let abandoned = tokio::spawn({
            let link = Arc::clone(&link);
            async move { link.dispatch(launch(), Duration::from_secs(600)).await }
        });
        let sent = command(&mut rx).await;
        abandoned.abort();
        assert!(
            abandoned.await.expect_err("aborted").is_cancelled(),
            "the caller was cancelled"
        );
        assert_eq!(
            in_flight(&link),
            0,
            "the abandoned launch is still waited for"
        );
        assert_eq!(tombstones(&link), vec![sent.id.clone()]);

        let next_dispatch = tokio::spawn({
            let link = Arc::clone(&link);
            async move { link.dispatch(destroy(), Duration::from_secs(30)).await }
        });
        let next_sent = command(&mut rx).await;
        link.answer_for_test(result(&next_sent.id, pb::Outcome::Ok, false), &tx)
            .await;
        assert!(next_dispatch.await.expect("dispatch").is_ok());
        assert_eq!(ack(&mut rx).await.verdict, pb::AckVerdict::Accepted as i32);

        link.answer_for_test(result(&sent.id, pb::Outcome::Ok, false), &tx)
            .await;
        let acked = ack(&mut rx).await;
        assert_eq!(acked.id, sent.id);
        assert_eq!(acked.verdict, pb::AckVerdict::Custody as i32);
    }
}
