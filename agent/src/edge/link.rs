//! The plane ports served over the session: [`PlaneLink`] implements
//! [`LeaseStore`] and [`JitSource`] by sending each call up the current
//! session as a `NodeCall` and waiting for the `PlaneReply`; [`SessionLink`]
//! is one open session as the node uses it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use billet_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;

use crate::cache::Observation;
use crate::model::{ByteSize, Epoch, InstanceName, JitConfig, Lease, LeaseId, Phase, Registration};
use crate::node::ending::{Ending, FailureReason};
use crate::node::plane::{JitSource, LaunchedSet, LeaseStore, PlaneError, Retired};

/// Converts a wire error into the plane port's typed refusal.
pub(crate) fn plane_error(error: pb::Error) -> PlaneError {
    let m = error.message;
    match pb::ErrorCode::try_from(error.code).unwrap_or(pb::ErrorCode::Unspecified) {
        pb::ErrorCode::Fenced => PlaneError::Fenced(m),
        pb::ErrorCode::NotFound => PlaneError::NotFound(m),
        pb::ErrorCode::BadTransition => PlaneError::BadTransition(m),
        pb::ErrorCode::WrongNode => PlaneError::WrongNode(m),
        // Out of quota or capacity for now: retried like an outage.
        pb::ErrorCode::Unavailable | pb::ErrorCode::ResourceExhausted => PlaneError::Unavailable(m),
        pb::ErrorCode::ForceRelease => PlaneError::ForceRelease(m),
        pb::ErrorCode::Busy => PlaneError::Busy(m),
        // A scale set GitHub no longer has: nothing this node can retry;
        // the plane decides when to launch again.
        pb::ErrorCode::ScaleSetNotFound => PlaneError::ScaleSetNotFound(m),
        // A name another scale set holds: an answer, not an outage.
        pb::ErrorCode::RunnerNameTaken => PlaneError::RunnerNameTaken(m),
        pb::ErrorCode::IdentityRefused => PlaneError::IdentityRefused(m),
        pb::ErrorCode::Unspecified
        | pb::ErrorCode::InvalidArgument
        | pb::ErrorCode::Refused
        | pb::ErrorCode::Internal
        | pb::ErrorCode::ImageUnavailable
        | pb::ErrorCode::RunnerOutdated
        | pb::ErrorCode::TierUnhealthy => PlaneError::Refused(m),
    }
}

/// How long a message may wait for room in a session's outbound buffer
/// before the session is closed as unresponsive.
pub(crate) const SEND_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a node call waits for its reply.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(30);

/// The plane side of one open session, as the node uses it: where to send
/// messages, and who waits for which reply or acknowledgement.
#[derive(Debug)]
pub(crate) struct SessionLink {
    /// Distinguishes sessions within this process.
    pub id: u64,
    out: mpsc::Sender<Result<pb::NodeMessage, tonic::Status>>,
    calls: Mutex<HashMap<u64, oneshot::Sender<pb::PlaneReply>>>,
    acks: Mutex<HashMap<String, oneshot::Sender<pb::AckVerdict>>>,
    /// Fires when the session ends, for any reason.
    pub closed: CancellationToken,
    /// Fires when its connection nears its maximum age and the plane is
    /// asked to attach anew ([`SessionLink::recycle`]).
    pub recycling: CancellationToken,
    /// The session that replaced this one after a recycle: results of
    /// commands that came on this one go there once it is closed.
    successor: Mutex<Option<Arc<SessionLink>>>,
}

impl SessionLink {
    /// A session that sends through `out`.
    pub(crate) fn new(id: u64, out: mpsc::Sender<Result<pb::NodeMessage, tonic::Status>>) -> Self {
        Self {
            id,
            out,
            calls: Mutex::new(HashMap::new()),
            acks: Mutex::new(HashMap::new()),
            closed: CancellationToken::new(),
            recycling: CancellationToken::new(),
            successor: Mutex::new(None),
        }
    }

    /// Marks the session as recycled: the plane is asked to attach anew,
    /// and the session that replaces it takes over its answers.
    pub(crate) fn recycle(&self) {
        self.recycling.cancel();
    }

    /// Hands a recycled session's future answers to `newer`, and closes
    /// this one once nothing it sent awaits an answer (no node call
    /// waiting for its reply, no result for its acknowledgement), or after
    /// `bound`.
    pub(crate) async fn hand_over(self: Arc<Self>, newer: Arc<SessionLink>, bound: Duration) {
        *self.successor.lock().expect("successor") = Some(newer);
        let deadline = tokio::time::Instant::now() + bound;
        let mut check = tokio::time::interval(Duration::from_millis(50));
        loop {
            let idle = self.calls.lock().expect("calls").is_empty()
                && self.acks.lock().expect("acks").is_empty();
            if idle || tokio::time::Instant::now() >= deadline {
                break;
            }
            tokio::select! {
                () = self.closed.cancelled() => break,
                _ = check.tick() => {}
            }
        }
        self.close();
    }

    /// Where an answer for a command that came on this session goes: this
    /// session while it is open, else the one a recycle handed it to.
    pub(crate) fn live(self: &Arc<Self>) -> Arc<SessionLink> {
        let mut at = Arc::clone(self);
        while at.closed.is_cancelled() {
            let next = at.successor.lock().expect("successor").clone();
            match next {
                Some(next) => at = next,
                None => break,
            }
        }
        at
    }

    /// Sends one message; fails when the session has ended.
    ///
    /// # Errors
    ///
    /// [`PlaneError::Unavailable`] when the session is closed.
    pub(crate) async fn send(&self, body: pb::node_message::Body) -> Result<(), PlaneError> {
        if self.closed.is_cancelled() {
            return Err(PlaneError::Unavailable("the session has ended".into()));
        }
        let message = Ok(pb::NodeMessage { body: Some(body) });
        tokio::select! {
            sent = self.out.send(message) => {
                sent.map_err(|_| PlaneError::Unavailable("the session has ended".into()))
            }
            () = self.closed.cancelled() => Err(PlaneError::Unavailable("the session has ended".into())),
            () = tokio::time::sleep(SEND_TIMEOUT) => {
                // A plane that stops reading must not hold the slot or the
                // renewals: it is cut off, and a new session starts clean.
                self.close();
                Err(PlaneError::Unavailable(format!(
                    "the plane read nothing for {SEND_TIMEOUT:?}; the session was closed"
                )))
            }
        }
    }

    /// Registers interest in the acknowledgement of result `id`. The
    /// receiver errs if the session ends first.
    pub(crate) fn expect_ack(&self, id: &str) -> oneshot::Receiver<pb::AckVerdict> {
        let (tx, rx) = oneshot::channel();
        self.acks.lock().expect("acks").insert(id.to_owned(), tx);
        rx
    }

    /// How many results sent on this session the plane has not yet
    /// acknowledged.
    pub(crate) fn awaiting_acks(&self) -> usize {
        self.acks.lock().expect("acks").len()
    }

    /// Delivers an acknowledgement from the plane.
    pub(crate) fn on_ack(&self, ack: pb::ResultAck) {
        let verdict = pb::AckVerdict::try_from(ack.verdict).unwrap_or(pb::AckVerdict::Unspecified);
        if let Some(tx) = self.acks.lock().expect("acks").remove(&ack.id) {
            let _ = tx.send(verdict);
        }
    }

    /// Delivers a reply from the plane.
    pub(crate) fn on_reply(&self, reply: pb::PlaneReply) {
        if let Some(tx) = self.calls.lock().expect("calls").remove(&reply.call_id) {
            let _ = tx.send(reply);
        }
    }

    /// Ends the session: every waiter sees it closed.
    pub(crate) fn close(&self) {
        self.closed.cancel();
        self.calls.lock().expect("calls").clear();
        self.acks.lock().expect("acks").clear();
    }
}

/// [`LeaseStore`] and [`JitSource`] over whichever session is current.
#[derive(Debug)]
pub(crate) struct PlaneLink {
    current: Mutex<Option<Arc<SessionLink>>>,
    ttl: watch::Sender<Duration>,
    next_call: AtomicU64,
    call_timeout: Duration,
    /// The current session's plane answered `BindAdvance` as a call it does
    /// not know (it predates it): send `Bind` and `Advance` instead until
    /// another session is installed.
    split_bind_advance: AtomicBool,
}

impl Default for PlaneLink {
    fn default() -> Self {
        Self::new(CALL_TIMEOUT)
    }
}

impl PlaneLink {
    /// A link with no session yet.
    pub(crate) fn new(call_timeout: Duration) -> Self {
        Self {
            current: Mutex::new(None),
            ttl: watch::Sender::new(Duration::ZERO),
            next_call: AtomicU64::new(1),
            call_timeout,
            split_bind_advance: AtomicBool::new(false),
        }
    }

    /// Makes `session` current and records the TTL it opened with; returns
    /// the session it replaces, which the caller closes.
    pub(crate) fn install(
        &self,
        session: Arc<SessionLink>,
        lease_ttl: Duration,
    ) -> Option<Arc<SessionLink>> {
        self.ttl.send_replace(lease_ttl);
        self.split_bind_advance.store(false, Ordering::Relaxed);
        self.current.lock().expect("current").replace(session)
    }

    /// Forgets `session` if it is still current.
    pub(crate) fn remove(&self, session: &SessionLink) {
        let mut current = self.current.lock().expect("current");
        if current.as_ref().is_some_and(|s| s.id == session.id) {
            *current = None;
        }
    }

    /// The current session, if any.
    pub(crate) fn current(&self) -> Option<Arc<SessionLink>> {
        self.current.lock().expect("current").clone()
    }

    /// Watches the lease TTL.
    #[cfg(test)]
    pub(crate) fn ttl_watch(&self) -> watch::Receiver<Duration> {
        self.ttl.subscribe()
    }

    async fn call(
        &self,
        call: pb::node_call::Call,
    ) -> Result<Option<pb::plane_reply::Result>, PlaneError> {
        let reply = self.call_raw(call).await?;
        match reply.error {
            Some(error) => Err(plane_error(error)),
            None => Ok(reply.result),
        }
    }

    /// Sends `call` and waits for its reply, error included as the wire
    /// carries it.
    async fn call_raw(&self, call: pb::node_call::Call) -> Result<pb::PlaneReply, PlaneError> {
        let session = self
            .current()
            .ok_or_else(|| PlaneError::Unavailable("no plane session is open".into()))?;
        let call_id = self.next_call.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = oneshot::channel();
        session.calls.lock().expect("calls").insert(call_id, tx);
        let sent = session
            .send(pb::node_message::Body::Call(pb::NodeCall {
                call_id,
                call: Some(call),
            }))
            .await;
        if let Err(e) = sent {
            session.calls.lock().expect("calls").remove(&call_id);
            return Err(e);
        }
        tokio::select! {
            reply = rx => reply.map_err(|_| PlaneError::Unavailable("the session ended before the plane answered".into())),
            () = tokio::time::sleep(self.call_timeout) => {
                session.calls.lock().expect("calls").remove(&call_id);
                Err(PlaneError::Unavailable(format!("the plane did not answer within {:?}", self.call_timeout)))
            }
        }
    }
}

fn lease_epoch(lease: &LeaseId, epoch: Epoch) -> (String, u64) {
    (lease.as_str().to_owned(), epoch.0)
}

fn unexpected(what: &str) -> PlaneError {
    PlaneError::Refused(format!(
        "the plane answered {what} with the wrong kind of reply"
    ))
}

#[async_trait]
impl LeaseStore for PlaneLink {
    async fn bind(&self, lease: &LeaseId, epoch: Epoch) -> Result<(), PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        self.call(pb::node_call::Call::Bind(pb::Bind { lease_id, epoch }))
            .await
            .map(drop)
    }

    async fn mark_failure(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        reason: &FailureReason,
    ) -> Result<(), PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        let (code, detail) = reason.code();
        self.call(pb::node_call::Call::MarkFailure(pb::MarkFailure {
            lease_id,
            epoch,
            reason: reason.to_string(),
            code: pb::EndReason::from(code).into(),
            detail,
        }))
        .await
        .map(drop)
    }

    async fn advance(&self, lease: &LeaseId, epoch: Epoch, phase: Phase) -> Result<(), PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        self.call(pb::node_call::Call::Advance(pb::Advance {
            lease_id,
            epoch,
            phase: phase.as_str().into(),
        }))
        .await
        .map(drop)
    }

    /// One `BindAdvance` round trip; to a plane that predates it (it
    /// answers `INVALID_ARGUMENT`, the call missing), `Bind` then `Advance`,
    /// for the rest of that session.
    async fn bind_advance(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        phase: Phase,
    ) -> Result<(), PlaneError> {
        if !self.split_bind_advance.load(Ordering::Relaxed) {
            let (lease_id, epoch_wire) = lease_epoch(lease, epoch);
            let reply = self
                .call_raw(pb::node_call::Call::BindAdvance(pb::BindAdvance {
                    lease_id,
                    epoch: epoch_wire,
                    phase: phase.as_str().into(),
                }))
                .await?;
            match reply.error {
                None => return Ok(()),
                Some(e) if e.code == pb::ErrorCode::InvalidArgument as i32 => {
                    tracing::info!(error = %e.message, "the plane does not know BindAdvance; binding and advancing in two calls");
                    self.split_bind_advance.store(true, Ordering::Relaxed);
                }
                Some(e) => return Err(plane_error(e)),
            }
        }
        self.bind(lease, epoch).await?;
        self.advance(lease, epoch, phase).await
    }

    async fn resize(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        self.call(pb::node_call::Call::Resize(pb::Resize {
            lease_id,
            epoch,
            vcpu,
            memory_bytes: memory.0,
        }))
        .await
        .map(drop)
    }

    async fn heartbeat(
        &self,
        leases: &[(LeaseId, Epoch)],
    ) -> Result<Vec<Result<(), PlaneError>>, PlaneError> {
        let call = pb::Heartbeat {
            leases: leases
                .iter()
                .map(|(l, e)| pb::LeaseEpoch {
                    lease_id: l.as_str().into(),
                    epoch: e.0,
                })
                .collect(),
        };
        match self.call(pb::node_call::Call::Heartbeat(call)).await? {
            Some(pb::plane_reply::Result::Heartbeats(h)) if h.results.len() == leases.len() => {
                Ok(h.results
                    .into_iter()
                    .map(|r| r.error.map_or(Ok(()), |e| Err(plane_error(e))))
                    .collect())
            }
            _ => Err(unexpected("a heartbeat")),
        }
    }

    async fn record_cache_observation(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        observation: &Observation,
    ) -> Result<Observation, PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        let o = observation;
        let reply = self
            .call(pb::node_call::Call::RecordCacheObservation(
                pb::RecordCacheObservation {
                    lease_id,
                    epoch,
                    observation: Some(pb::CacheObservation {
                        hits: o.hits,
                        misses: o.misses,
                        fallbacks: o.fallbacks,
                        bytes_restored: o.bytes_restored,
                        bytes_committed: o.bytes_committed,
                        conflicts: o.conflicts,
                    }),
                },
            ))
            .await?;
        match reply {
            Some(pb::plane_reply::Result::CacheObservation(kept)) => Ok(Observation {
                hits: kept.hits,
                misses: kept.misses,
                bytes_restored: kept.bytes_restored,
                bytes_committed: kept.bytes_committed,
                conflicts: kept.conflicts,
                fallbacks: kept.fallbacks,
            }),
            _ => Err(unexpected("record_cache_observation")),
        }
    }

    async fn actions_cache_allowed(
        &self,
        owner: &str,
        repository: &str,
    ) -> Result<bool, PlaneError> {
        let reply = self
            .call(pb::node_call::Call::ActionsPolicy(pb::ActionsPolicyQuery {
                owner: owner.to_owned(),
                repository: repository.to_owned(),
            }))
            .await?;
        match reply {
            Some(pb::plane_reply::Result::ActionsPolicy(pb::ActionsPolicyAnswer { allowed })) => {
                Ok(allowed)
            }
            _ => Err(unexpected("actions_policy")),
        }
    }

    async fn release(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        ending: &Ending,
    ) -> Result<(), PlaneError> {
        if let Some(reason) = ending.reason() {
            match self.mark_failure(lease, epoch, reason).await {
                Ok(()) => {}
                Err(e @ PlaneError::Unavailable(_)) => return Err(e),
                // Another reason recorded first, or the lease is not ours
                // at this epoch any more: the release decides.
                Err(e) => {
                    tracing::debug!(%lease, %reason, error = %e, "the failure reason was not recorded")
                }
            }
        }
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        let (code, detail) = ending.code();
        self.call(pb::node_call::Call::Release(pb::Release {
            lease_id,
            epoch,
            outcome: ending.phase().as_str().into(),
            code: pb::EndReason::from(code).into(),
            detail,
        }))
        .await
        .map(drop)
    }

    async fn lease(&self, lease: &LeaseId) -> Result<Lease, PlaneError> {
        let reply = self
            .call(pb::node_call::Call::GetLease(pb::GetLease {
                lease_id: lease.as_str().into(),
            }))
            .await?;
        match reply {
            Some(pb::plane_reply::Result::Lease(l)) => crate::edge::wire::lease(l, "lease")
                .map_err(|e| PlaneError::Refused(format!("the plane sent a malformed lease: {e}"))),
            _ => Err(unexpected("a lease read")),
        }
    }

    async fn launched(&self) -> Result<LaunchedSet, PlaneError> {
        match self
            .call(pb::node_call::Call::Launched(pb::LaunchedLeases {}))
            .await?
        {
            Some(pb::plane_reply::Result::Launched(set)) => {
                let ids = |v: Vec<String>| {
                    v.iter()
                        .filter_map(|s| LeaseId::parse("launched", s).ok())
                        .collect()
                };
                // A malformed lease is left out and read on its own.
                let leases = set
                    .leases
                    .into_iter()
                    .filter_map(|l| crate::edge::wire::lease(l, "launched.leases").ok())
                    .collect();
                Ok(LaunchedSet {
                    launched: ids(set.launched),
                    quarantined: ids(set.quarantined),
                    leases,
                })
            }
            _ => Err(unexpected("a launched-set read")),
        }
    }

    async fn reconcile(&self, running: &[LeaseId]) -> Result<u32, PlaneError> {
        match self
            .call(pb::node_call::Call::Reconcile(pb::Reconcile {
                lease_ids: running.iter().map(|l| l.as_str().into()).collect(),
            }))
            .await?
        {
            Some(pb::plane_reply::Result::Reconciled(r)) => Ok(r.freed),
            _ => Err(unexpected("a reconcile")),
        }
    }

    fn lease_ttl(&self) -> Duration {
        *self.ttl.borrow()
    }
}

impl PlaneLink {
    /// Asks the plane's CA to sign `csr_pem` (a PKCS#10 request, PEM, for
    /// this node's name) over the current session; answers the new
    /// certificate chain, PEM.
    ///
    /// # Errors
    ///
    /// [`PlaneError::IdentityRefused`] when the plane will not sign it;
    /// [`PlaneError::Unavailable`] with no session or no answer; any other
    /// refusal as the plane typed it.
    pub(crate) async fn renew_certificate(&self, csr_pem: &str) -> Result<String, PlaneError> {
        match self
            .call(pb::node_call::Call::RenewCertificate(
                pb::RenewCertificate {
                    csr_pem: csr_pem.to_owned(),
                },
            ))
            .await?
        {
            Some(pb::plane_reply::Result::Certificate(pb::IssuedCertificate {
                certificate_chain_pem,
            })) if !certificate_chain_pem.is_empty() => Ok(certificate_chain_pem),
            _ => Err(unexpected("a certificate renewal")),
        }
    }
}

/// The Actions cache's kill switch asked of the plane:
/// [`crate::cache::actions::ActionsPolicy`] over any [`LeaseStore`] (in a
/// node, the [`PlaneLink`] of its sessions), each question bounded to
/// [`crate::cache::actions::POLICY_TIMEOUT`] (2 s) here too, so no caller
/// can wait longer. Every refusal, an old plane's included, and no answer
/// are [`crate::cache::actions::PolicyError`]s: the proxy reads them as a
/// denial.
#[derive(Debug, Clone)]
pub(crate) struct PlanePolicy {
    ledger: Arc<dyn LeaseStore>,
}

impl PlanePolicy {
    /// The policy `ledger`'s plane answers.
    #[must_use]
    pub(crate) fn new(ledger: Arc<dyn LeaseStore>) -> Self {
        Self { ledger }
    }
}

#[async_trait]
impl crate::cache::actions::ActionsPolicy for PlanePolicy {
    async fn allowed(
        &self,
        owner: &str,
        repository: &str,
    ) -> Result<bool, crate::cache::actions::PolicyError> {
        use crate::cache::actions::{POLICY_TIMEOUT, PolicyError};
        match tokio::time::timeout(
            POLICY_TIMEOUT,
            self.ledger.actions_cache_allowed(owner, repository),
        )
        .await
        {
            Ok(Ok(allowed)) => Ok(allowed),
            Ok(Err(e)) => Err(PolicyError::Unavailable(e.to_string())),
            Err(_) => Err(PolicyError::Timeout),
        }
    }
}

#[async_trait]
impl crate::node::warm::WarmRooms for PlaneLink {
    async fn reserve(
        &self,
        name: &InstanceName,
        tier: &str,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError> {
        self.call(pb::node_call::Call::ReserveWarm(pb::ReserveWarm {
            name: name.as_str().to_owned(),
            tier: tier.to_owned(),
            vcpu,
            memory_bytes: memory.0,
        }))
        .await
        .map(drop)
    }

    async fn release(&self, name: &InstanceName) -> Result<(), PlaneError> {
        self.call(pb::node_call::Call::ReleaseWarm(pb::ReleaseWarm {
            name: name.as_str().to_owned(),
        }))
        .await
        .map(drop)
    }

    async fn confirm(&self, names: &[InstanceName]) -> Result<Vec<InstanceName>, PlaneError> {
        match self
            .call(pb::node_call::Call::WarmRooms(pb::WarmRooms {
                names: names.iter().map(|n| n.as_str().to_owned()).collect(),
            }))
            .await?
        {
            Some(pb::plane_reply::Result::WarmRooms(pb::WarmRoomsCharged { charged })) => {
                Ok(charged
                    .iter()
                    .filter_map(|n| InstanceName::warm(n))
                    .collect())
            }
            _ => Err(unexpected("a warm runners' confirmation")),
        }
    }
}

#[async_trait]
impl JitSource for PlaneLink {
    async fn mint(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_name: &InstanceName,
    ) -> Result<Registration, PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        match self
            .call(pb::node_call::Call::MintJit(pb::MintJit {
                lease_id,
                epoch,
                runner_name: runner_name.as_str().into(),
                work_folder: "_work".into(),
            }))
            .await?
        {
            Some(pb::plane_reply::Result::Jit(jit)) if !jit.encoded_jit_config.is_empty() => {
                Ok(Registration {
                    config: JitConfig::new(jit.encoded_jit_config),
                    runner_id: jit.runner_id,
                    runner_name: jit.runner_name,
                })
            }
            _ => Err(unexpected("a JIT mint")),
        }
    }

    async fn remove_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<(), PlaneError> {
        self.retire_runner(lease, epoch, runner_id, runner_name)
            .await
            .map(drop)
    }

    async fn retire_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Retired, PlaneError> {
        let (lease_id, epoch) = lease_epoch(lease, epoch);
        let reply = self
            .call(pb::node_call::Call::RemoveRunner(pb::RemoveRunner {
                lease_id,
                epoch,
                runner_id,
                runner_name: runner_name.into(),
            }))
            .await?;
        Ok(match reply {
            Some(pb::plane_reply::Result::RunnerRemoval(pb::RunnerRemoval {
                already_gone: true,
            })) => Retired::AlreadyGone,
            _ => Retired::Removed,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn wire_error(code: i32) -> pb::Error {
        pb::Error {
            retry_after_ms: 0,
            code,
            message: format!("code {code}"),
        }
    }

    /// Every wire code and the variant it must become. The match makes a new
    /// code a compile error here until it is mapped.
    fn expected(code: pb::ErrorCode, m: String) -> PlaneError {
        match code {
            pb::ErrorCode::Fenced => PlaneError::Fenced(m),
            pb::ErrorCode::NotFound => PlaneError::NotFound(m),
            pb::ErrorCode::BadTransition => PlaneError::BadTransition(m),
            pb::ErrorCode::WrongNode => PlaneError::WrongNode(m),
            pb::ErrorCode::Unavailable | pb::ErrorCode::ResourceExhausted => {
                PlaneError::Unavailable(m)
            }
            pb::ErrorCode::ForceRelease => PlaneError::ForceRelease(m),
            pb::ErrorCode::ScaleSetNotFound => PlaneError::ScaleSetNotFound(m),
            pb::ErrorCode::Busy => PlaneError::Busy(m),
            pb::ErrorCode::RunnerNameTaken => PlaneError::RunnerNameTaken(m),
            pb::ErrorCode::IdentityRefused => PlaneError::IdentityRefused(m),
            pb::ErrorCode::Unspecified
            | pb::ErrorCode::InvalidArgument
            | pb::ErrorCode::Refused
            | pb::ErrorCode::Internal
            | pb::ErrorCode::ImageUnavailable
            | pb::ErrorCode::RunnerOutdated
            | pb::ErrorCode::TierUnhealthy => PlaneError::Refused(m),
        }
    }

    const ALL: [pb::ErrorCode; 18] = [
        pb::ErrorCode::Unspecified,
        pb::ErrorCode::Fenced,
        pb::ErrorCode::NotFound,
        pb::ErrorCode::BadTransition,
        pb::ErrorCode::WrongNode,
        pb::ErrorCode::Unavailable,
        pb::ErrorCode::ForceRelease,
        pb::ErrorCode::InvalidArgument,
        pb::ErrorCode::Refused,
        pb::ErrorCode::Internal,
        pb::ErrorCode::ImageUnavailable,
        pb::ErrorCode::ScaleSetNotFound,
        pb::ErrorCode::ResourceExhausted,
        pb::ErrorCode::Busy,
        pb::ErrorCode::IdentityRefused,
        pb::ErrorCode::RunnerNameTaken,
        pb::ErrorCode::RunnerOutdated,
        pb::ErrorCode::TierUnhealthy,
    ];

    /// 7.O.6
    #[test]
    fn every_ledger_error_code_keeps_its_kind_and_message_across_the_wire() {
        // The table itself: each typed code has its own variant.
        assert!(matches!(plane_error(wire_error(1)), PlaneError::Fenced(_)));
        assert!(matches!(
            plane_error(wire_error(2)),
            PlaneError::NotFound(_)
        ));
        assert!(matches!(
            plane_error(wire_error(3)),
            PlaneError::BadTransition(_)
        ));
        assert!(matches!(
            plane_error(wire_error(4)),
            PlaneError::WrongNode(_)
        ));
        assert!(matches!(
            plane_error(wire_error(5)),
            PlaneError::Unavailable(_)
        ));
        assert!(matches!(
            plane_error(wire_error(6)),
            PlaneError::ForceRelease(_)
        ));
        for code in ALL {
            let got = plane_error(wire_error(code as i32));
            assert_eq!(
                got,
                expected(code, format!("code {}", code as i32)),
                "{code:?}"
            );
        }
    }

    /// 7.O.6
    #[test]
    fn an_error_code_this_node_does_not_know_is_a_refusal_not_a_retry() {
        let got = plane_error(wire_error(999));
        assert_eq!(got, PlaneError::Refused("code 999".into()));
        assert!(!got.is_gone());
    }

    /// 7.O.6
    #[test]
    fn only_fenced_and_not_found_mean_the_lease_is_gone() {
        for code in ALL {
            let error = plane_error(wire_error(code as i32));
            let gone = matches!(code, pb::ErrorCode::Fenced | pb::ErrorCode::NotFound);
            assert_eq!(error.is_gone(), gone, "{code:?} -> {error:?}");
        }
    }

    /// A link whose session a task answers: every call gets `reply(call_id)`.
    fn answering(reply: fn(u64) -> pb::PlaneReply) -> Arc<PlaneLink> {
        let link = Arc::new(PlaneLink::new(Duration::from_secs(5)));
        let (tx, mut rx) = mpsc::channel(4);
        let session = Arc::new(SessionLink::new(1, tx));
        link.install(Arc::clone(&session), Duration::from_secs(30));
        tokio::spawn(async move {
            while let Some(Ok(pb::NodeMessage {
                body: Some(pb::node_message::Body::Call(call)),
            })) = rx.recv().await
            {
                session.on_reply(reply(call.call_id));
            }
        });
        link
    }

    fn session(id: u64) -> Arc<SessionLink> {
        let (tx, _rx) = mpsc::channel(1);
        Arc::new(SessionLink::new(id, tx))
    }

    /// 7.O.13
    #[test]
    fn the_lease_ttl_is_the_one_the_current_session_opened_with() {
        let link = PlaneLink::default();
        assert_eq!(
            link.lease_ttl(),
            Duration::ZERO,
            "no TTL before any session"
        );
        let watch = link.ttl_watch();

        let first = session(1);
        assert!(
            link.install(Arc::clone(&first), Duration::from_secs(30))
                .is_none()
        );
        assert_eq!(link.lease_ttl(), Duration::from_secs(30));
        assert_eq!(*watch.borrow(), Duration::from_secs(30));

        let replaced = link
            .install(session(2), Duration::from_millis(4_500))
            .expect("the newer session replaces the older");
        assert_eq!(replaced.id, 1, "install hands back the session it replaced");
        assert_eq!(link.lease_ttl(), Duration::from_millis(4_500));
        assert_eq!(*watch.borrow(), Duration::from_millis(4_500));
        assert_eq!(link.current().map(|s| s.id), Some(2));

        // Removing the replaced session does not unseat the current one.
        link.remove(&first);
        assert_eq!(link.current().map(|s| s.id), Some(2));
    }

    /// The kill switch's question crosses the wire as `ActionsPolicyQuery`
    /// and its answer comes back; a refusal (an old plane, a malformed
    /// name) and no session are errors the caller reads as a denial.
    #[tokio::test]
    async fn the_actions_cache_policy_is_asked_and_answered_over_the_session() {
        let allows = answering(|call_id| pb::PlaneReply {
            call_id,
            error: None,
            result: Some(pb::plane_reply::Result::ActionsPolicy(
                pb::ActionsPolicyAnswer { allowed: true },
            )),
        });
        assert_eq!(
            allows.actions_cache_allowed("octo", "hello").await,
            Ok(true)
        );
        let denies = answering(|call_id| pb::PlaneReply {
            call_id,
            error: None,
            result: Some(pb::plane_reply::Result::ActionsPolicy(
                pb::ActionsPolicyAnswer { allowed: false },
            )),
        });
        assert_eq!(
            denies.actions_cache_allowed("octo", "hello").await,
            Ok(false)
        );
        let old = answering(|call_id| pb::PlaneReply {
            call_id,
            error: Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::InvalidArgument.into(),
                message: "node call: the call is missing".into(),
            }),
            result: None,
        });
        assert!(matches!(
            old.actions_cache_allowed("octo", "hello").await,
            Err(PlaneError::Refused(_))
        ));
        let none = PlaneLink::new(Duration::from_secs(5));
        assert!(matches!(
            none.actions_cache_allowed("octo", "hello").await,
            Err(PlaneError::Unavailable(_))
        ));
    }

    /// The proxy's policy over the plane answers what the plane answers; a
    /// refusal is an error (a denial), and a plane that does not answer is
    /// a timeout after 2 s, whatever the session's own call timeout.
    #[tokio::test(start_paused = true)]
    async fn the_plane_policy_answers_the_planes_answer_and_gives_up_after_two_seconds() {
        use crate::cache::actions::{ActionsPolicy as _, POLICY_TIMEOUT, PolicyError};
        let allows = PlanePolicy::new(answering(|call_id| pb::PlaneReply {
            call_id,
            error: None,
            result: Some(pb::plane_reply::Result::ActionsPolicy(
                pb::ActionsPolicyAnswer { allowed: true },
            )),
        }));
        assert_eq!(allows.allowed("octo", "hello").await, Ok(true));
        let denies = PlanePolicy::new(answering(|call_id| pb::PlaneReply {
            call_id,
            error: None,
            result: Some(pb::plane_reply::Result::ActionsPolicy(
                pb::ActionsPolicyAnswer { allowed: false },
            )),
        }));
        assert_eq!(denies.allowed("octo", "hello").await, Ok(false));
        let down = PlanePolicy::new(answering(|call_id| pb::PlaneReply {
            call_id,
            error: Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::Unavailable.into(),
                message: "the ledger is down".into(),
            }),
            result: None,
        }));
        assert!(matches!(
            down.allowed("octo", "hello").await,
            Err(PolicyError::Unavailable(m)) if m.contains("the ledger is down")
        ));
        // A session that never answers, with a call timeout far longer.
        let link = Arc::new(PlaneLink::new(Duration::from_secs(60)));
        let (tx, _rx) = mpsc::channel(4);
        link.install(Arc::new(SessionLink::new(1, tx)), Duration::from_secs(30));
        let silent = PlanePolicy::new(link);
        let started = tokio::time::Instant::now();
        assert_eq!(
            silent.allowed("octo", "hello").await,
            Err(PolicyError::Timeout)
        );
        assert_eq!(started.elapsed(), POLICY_TIMEOUT);
    }

    /// 7.O.13 (no session at all): calls fail at once as unavailable.
    #[tokio::test]
    async fn with_no_session_a_ledger_call_is_unavailable_at_once() {
        let link = PlaneLink::new(Duration::from_secs(60));
        let started = std::time::Instant::now();
        let error = link
            .bind(&LeaseId::parse("lease", "l1").expect("id"), Epoch(1))
            .await
            .expect_err("bind without a session");
        assert!(matches!(error, PlaneError::Unavailable(_)), "{error:?}");
        assert!(started.elapsed() < Duration::from_secs(1));
    }

    /// A reply routed back through `on_reply` answers the call that sent it.
    #[tokio::test]
    async fn a_typed_refusal_in_a_reply_reaches_the_caller_with_its_kind() {
        let link = answering(|call_id| pb::PlaneReply {
            call_id,
            error: Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::Fenced.into(),
                message: "stale".into(),
            }),
            result: None,
        });
        let error = link
            .advance(
                &LeaseId::parse("lease", "l1").expect("id"),
                Epoch(1),
                Phase::Launching,
            )
            .await
            .expect_err("fenced");
        assert_eq!(error, PlaneError::Fenced("stale".into()));
        assert!(error.is_gone());
    }

    /// 7.O.16: a call the plane receives and never answers gives up after
    /// the call timeout as `Unavailable` (retryable), and forgets its waiter.
    #[tokio::test]
    async fn a_call_the_plane_never_answers_gives_up_after_the_call_timeout() {
        let link = PlaneLink::new(Duration::from_millis(300));
        let (tx, mut rx) = mpsc::channel(4);
        let session = Arc::new(SessionLink::new(1, tx));
        link.install(Arc::clone(&session), Duration::from_secs(30));
        // The plane reads every call and answers none.
        let read = tokio::spawn(async move {
            let mut calls = 0;
            while let Some(Ok(pb::NodeMessage {
                body: Some(pb::node_message::Body::Call(_)),
            })) = rx.recv().await
            {
                calls += 1;
            }
            calls
        });
        let started = tokio::time::Instant::now();
        let error = link
            .bind(&LeaseId::parse("lease", "l1").expect("id"), Epoch(1))
            .await
            .expect_err("a silent plane answered");
        let waited = started.elapsed();
        assert!(matches!(error, PlaneError::Unavailable(_)), "{error:?}");
        assert!(error.to_string().contains("did not answer"), "{error}");
        assert!(
            waited >= Duration::from_millis(300) && waited < Duration::from_secs(5),
            "gave up after {waited:?}"
        );
        assert!(
            session.calls.lock().expect("calls").is_empty(),
            "the abandoned call is still waited for"
        );
        session.close();
        drop(link);
        drop(session);
        assert_eq!(read.await.expect("reader"), 1, "the call was sent once");
    }

    /// 7.O.21: only the plane's answer is a verdict. A typed refusal in a
    /// reply is final (not `Unavailable`); no answer (the session ended, or
    /// it timed out) is `Unavailable`, which callers retry.
    #[tokio::test]
    async fn only_an_answer_is_a_verdict_and_a_missing_answer_is_retryable() {
        let lease = LeaseId::parse("lease", "l1").expect("id");
        let refused = answering(|call_id| pb::PlaneReply {
            call_id,
            error: Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::Refused.into(),
                message: "the runner is running a job".into(),
            }),
            result: None,
        });
        let verdict = refused
            .remove_runner(&lease, Epoch(1), 0, "")
            .await
            .expect_err("refused");
        assert_eq!(
            verdict,
            PlaneError::Refused("the runner is running a job".into())
        );

        // The session ends while the call waits: no verdict.
        let link = Arc::new(PlaneLink::new(Duration::from_secs(30)));
        let (tx, mut rx) = mpsc::channel(4);
        let session = Arc::new(SessionLink::new(1, tx));
        link.install(Arc::clone(&session), Duration::from_secs(30));
        tokio::spawn(async move {
            if rx.recv().await.is_some() {
                session.close();
            }
        });
        let outage = link
            .remove_runner(&lease, Epoch(1), 0, "")
            .await
            .expect_err("the session ended");
        assert!(matches!(outage, PlaneError::Unavailable(_)), "{outage:?}");
    }

    /// 7.O.11: a lease's failure reason crosses the wire on a lease read
    /// (the runner tears such a lease down and releases it `failed`), and an
    /// empty one reads as none.
    #[tokio::test]
    async fn a_leases_failure_reason_crosses_the_wire_on_a_lease_read() {
        fn lease(call_id: u64, reason: &str) -> pb::PlaneReply {
            pb::PlaneReply {
                call_id,
                error: None,
                result: Some(pb::plane_reply::Result::Lease(pb::Lease {
                    id: "l1".into(),
                    epoch: 4,
                    tier: "linux".into(),
                    phase: "quarantine".into(),
                    vcpu: 1,
                    memory_bytes: 1 << 20,
                    node: "node-1".into(),
                    request_id: 7,
                    providers: Vec::new(),
                    failure_reason: reason.into(),
                    end_reason: 0,
                    end_detail: String::new(),
                })),
            }
        }
        let id = LeaseId::parse("lease", "l1").expect("id");
        let failed = answering(|call_id| lease(call_id, "host lost its disk"))
            .lease(&id)
            .await
            .expect("a lease");
        assert_eq!(failed.failure_reason.as_deref(), Some("host lost its disk"));
        assert_eq!(failed.phase, Phase::Quarantine);
        assert_eq!(failed.epoch, Epoch(4));
        let clean = answering(|call_id| lease(call_id, ""))
            .lease(&id)
            .await
            .expect("a lease");
        assert_eq!(clean.failure_reason, None);
    }

    /// 7.O.12: an empty launched set (no leases, no quarantine) is an
    /// answer, not an error, and stays empty.
    #[tokio::test]
    async fn an_empty_launched_set_survives_the_wire() {
        let link = answering(|call_id| pb::PlaneReply {
            call_id,
            error: None,
            result: Some(pb::plane_reply::Result::Launched(pb::LaunchedSet::default())),
        });
        assert_eq!(link.launched().await, Ok(LaunchedSet::default()));
    }
}
