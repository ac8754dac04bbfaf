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
//!
//! # Layout
//!
//! - `mod.rs` (here): [`NodeLink`], its session (dial loop, `Hello`, the
//!   inbound messages, results and their acknowledgements), [`NodeStatus`]
//!   and [`CommandOutcome`].
//! - `dial.rs`: [`NodeTarget`], [`PlaneTls`], [`Keepalive`] and [`dial()`].
//! - `dispatch.rs`: [`NodeLink::dispatch`], a command out and its result
//!   back.
//! - `faults.rs`: [`LinkFaults`], for tests.

mod dial;
mod dispatch;
mod faults;
#[cfg(test)]
mod tests;

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info, info_span, warn};

use crate::calls::CallHandler;

use dial::dial_with;

pub use dial::{Keepalive, NodeTarget, PlaneTls, dial};
pub use faults::LinkFaults;

/// The session id of commands handed over by a recycled session before
/// its successor's `Hello` was read: they belong to the next one to open.
const NEXT_SESSION: u64 = u64::MAX;

/// Most launch tombstones kept per node.
const MAX_TOMBSTONES: usize = 1024;

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
    pub(crate) held: pb::Capacity,
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
    #[cfg(test)]
    pub(crate) fn new(target: NodeTarget) -> Arc<Self> {
        Self::with_keepalive(target, Keepalive::default())
    }

    /// A link to `target` whose connections PING as `keepalive` says.
    pub(crate) fn with_keepalive(target: NodeTarget, keepalive: Keepalive) -> Arc<Self> {
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
    pub(crate) fn detached_for(&self) -> Option<Duration> {
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
    pub(crate) async fn run(
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
                                    retry_after_ms: 0,
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
}

fn tombstone(shared: &mut Shared, id: String) {
    shared.tombstones.push_back(id);
    while shared.tombstones.len() > MAX_TOMBSTONES {
        shared.tombstones.pop_front();
    }
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
