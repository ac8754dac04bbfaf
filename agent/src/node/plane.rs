//! The node's view of the plane: the two seams the runner calls through
//! ([`LeaseStore`] for the ledger, [`JitSource`] for runner registrations),
//! the typed refusals they answer with, and what they return. Their one real
//! implementation sends each call up the plane's session
//! (the gRPC face's link); the simulation and the scenarios drive the runner
//! through fakes of them.
//!
//! The node never dials: with no session open every call fails at once with
//! [`PlaneError::Unavailable`], and the runner treats that like any other
//! transient ledger failure.

use std::time::Duration;

use async_trait::async_trait;
use thiserror::Error;

use crate::cache::Observation;
use crate::model::{ByteSize, Epoch, InstanceName, Lease, LeaseId, Phase, Registration};

/// A refusal or failure of a plane call. The variants are the wire's typed
/// codes, because the runner branches on them.
#[derive(Debug, Error, Clone, PartialEq, Eq)]
pub enum PlaneError {
    /// The presented epoch is stale.
    #[error("fenced: {0}")]
    Fenced(String),
    /// The lease is gone or terminal.
    #[error("not found: {0}")]
    NotFound(String),
    /// Not a legal phase change.
    #[error("bad transition: {0}")]
    BadTransition(String),
    /// The lease belongs to another node.
    #[error("wrong node: {0}")]
    WrongNode(String),
    /// The plane is unreachable or busy; retry.
    #[error("plane unavailable: {0}")]
    Unavailable(String),
    /// An operator asked the holder to give the lease up.
    #[error("force release: {0}")]
    ForceRelease(String),
    /// The plane refused the request for good.
    #[error("refused: {0}")]
    Refused(String),
    /// A mint for a scale set GitHub does not have (deleted, or not yet
    /// made): nothing this node can retry; the plane decides when to launch
    /// for the set again.
    #[error("scale set not found: {0}")]
    ScaleSetNotFound(String),
    /// GitHub already has a runner of the name the mint asked for, in
    /// another scale set (409 AgentExists): the name cannot be minted, and
    /// asking again will not change that; the plane gives the job a fresh
    /// lease with a fresh name.
    #[error("runner name taken: {0}")]
    RunnerNameTaken(String),
    /// GitHub says the runner is running a job (a registration removal
    /// answered JobStillRunning): an answer, not an outage.
    #[error("busy: {0}")]
    Busy(String),
    /// The plane will not sign this certificate request (it names another
    /// node than the session's, or is malformed): asking again with the
    /// same request is pointless.
    #[error("identity refused: {0}")]
    IdentityRefused(String),
}

impl PlaneError {
    /// Fenced or not found: the lease is no longer ours at this epoch.
    pub(crate) fn is_gone(&self) -> bool {
        matches!(self, Self::Fenced(_) | Self::NotFound(_))
    }
}

/// The ledger leases that are bound to this node.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchedSet {
    /// In launching, online, busy, custody or teardown.
    pub launched: Vec<LeaseId>,
    /// In quarantine.
    pub quarantined: Vec<LeaseId>,
    /// The leases of both lists as the plane sent them with the set
    /// (`LaunchedSet.leases`), so recovery need not read each; a lease
    /// missing here is read on its own ([`LeaseStore::lease`]).
    pub leases: Vec<Lease>,
}

impl LaunchedSet {
    /// The lease `id` as sent with the set, if it was.
    pub(crate) fn lease(&self, id: &LeaseId) -> Option<&Lease> {
        self.leases.iter().find(|l| l.id == *id)
    }
}

/// The part of the capacity ledger the runner uses. Every write presents
/// the epoch the node holds; the plane fences it.
#[async_trait]
pub trait LeaseStore: Send + Sync + std::fmt::Debug {
    /// Binds the lease to this node (idempotent for the same node).
    async fn bind(&self, lease: &LeaseId, epoch: Epoch) -> Result<(), PlaneError>;
    /// Moves the lease to `phase` (idempotent for the phase it has).
    async fn advance(&self, lease: &LeaseId, epoch: Epoch, phase: Phase) -> Result<(), PlaneError>;
    /// [`LeaseStore::bind`] then [`LeaseStore::advance`] to `phase`, as the
    /// launch path asks them; a store that can do both in one round trip
    /// (the plane's `BindAdvance`) does, and the plane then writes both or
    /// neither. This default makes the two calls in turn.
    ///
    /// # Errors
    ///
    /// The bind's refusal, else the advance's, as those calls give them.
    async fn bind_advance(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        phase: Phase,
    ) -> Result<(), PlaneError> {
        self.bind(lease, epoch).await?;
        self.advance(lease, epoch, phase).await
    }
    /// Changes what a launching lease charges to `vcpu` and `memory`, what
    /// this node's provider will really run (the plane's `Resize`, the
    /// reference's `LeaseStore.Resize`). Fenced; the plane checks the
    /// node's room with the old size handed back.
    ///
    /// # Errors
    ///
    /// `Fenced`, `NotFound`, `WrongNode`; `Refused` when the lease is not
    /// launching or the new size does not fit; `Refused` from a store (or a
    /// plane) that cannot resize, which this default is.
    async fn resize(
        &self,
        lease: &LeaseId,
        _epoch: Epoch,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError> {
        Err(PlaneError::Refused(format!(
            "this lease store cannot resize lease {lease} to {vcpu} vCPU and {} MiB",
            memory.0 >> 20
        )))
    }
    /// Records what the cache did for the lease's job (the plane's
    /// `RecordCacheObservation`, the reference's
    /// `LeaseStore.RecordCacheObservation`), after its disks are settled,
    /// which is after the release: the lease may be terminal. Fenced by
    /// epoch; the ledger keeps the first observation of a lease, and this
    /// answers the one it keeps. No default: every store says what it does
    /// with it.
    ///
    /// # Errors
    ///
    /// `Fenced`, `NotFound`; `Unavailable` with no answer; `InvalidArgument`
    /// from a plane that predates the call.
    async fn record_cache_observation(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        observation: &Observation,
    ) -> Result<Observation, PlaneError>;
    /// Whether this node may serve `owner/repository`'s Actions cache from
    /// its local storage (the kill switch: the plane's
    /// `ActionsPolicyQuery`, the reference's
    /// `ActionsPolicy.ActionsCacheAllowed`, spec/cache.md §5.2). The names
    /// are the tier's static cache scope. Not about a lease: any node may
    /// ask about any repository. No default: every store says what it
    /// answers.
    ///
    /// # Errors
    ///
    /// `Unavailable` with no answer or when the plane's ledger cannot be
    /// read; `Refused` for a malformed name and from a plane that predates
    /// the call. The caller reads every error as a denial.
    async fn actions_cache_allowed(
        &self,
        owner: &str,
        repository: &str,
    ) -> Result<bool, PlaneError>;
    /// Renews every listed lease in one call; one result per lease, in order.
    async fn heartbeat(
        &self,
        leases: &[(LeaseId, Epoch)],
    ) -> Result<Vec<Result<(), PlaneError>>, PlaneError>;
    /// Ends the lease `done`, or `failed` with its reason: the reason is
    /// recorded first (the ledger keeps the first one), then the lease is
    /// released. A reason the ledger refuses because it already holds one,
    /// or because the lease is not ours at this epoch, does not stop the
    /// release, which decides.
    ///
    /// # Errors
    ///
    /// The release's refusal, or `Unavailable` when either call had no
    /// answer.
    async fn release(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        ending: &super::ending::Ending,
    ) -> Result<(), PlaneError>;
    /// Records why the lease's job will fail (`oom`, `exit 3`, ...), with
    /// its code, before it is released `failed`. The ledger keeps the
    /// first reason.
    async fn mark_failure(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        reason: &super::ending::FailureReason,
    ) -> Result<(), PlaneError>;
    /// Reads a lease.
    async fn lease(&self, lease: &LeaseId) -> Result<Lease, PlaneError>;
    /// The leases bound to this node that may have compute.
    async fn launched(&self) -> Result<LaunchedSet, PlaneError>;
    /// Reports this node's complete inventory; answers how many quarantined
    /// leases it freed.
    async fn reconcile(&self, running: &[LeaseId]) -> Result<u32, PlaneError>;
    /// The lease TTL the plane dictated; zero before any session.
    fn lease_ttl(&self) -> Duration;
}

/// Mints and removes runner registrations through the plane, which holds the
/// GitHub credential.
#[async_trait]
pub trait JitSource: Send + Sync + std::fmt::Debug {
    /// Mints a single-use registration named `runner_name` for a lease this
    /// node holds.
    async fn mint(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_name: &InstanceName,
    ) -> Result<Registration, PlaneError>;
    /// Removes the exact registration (`runner_id` 0 and an empty name: the
    /// one recorded for the lease). Already gone is success.
    async fn remove_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<(), PlaneError>;

    /// [`JitSource::remove_runner`], telling whether GitHub still had the
    /// registration: what the start deadline needs to tell a runner that
    /// took nothing (its registration removed now: torn down at once) from
    /// one GitHub had already let go (an ephemeral runner's registration
    /// goes with its completed job, or it was removed out of band: left the
    /// post-job grace to exit). The default, for a source that cannot tell,
    /// answers [`Retired::Removed`].
    async fn retire_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Retired, PlaneError> {
        self.remove_runner(lease, epoch, runner_id, runner_name)
            .await
            .map(|()| Retired::Removed)
    }
}

/// What a [`JitSource::retire_runner`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retired {
    /// The registration was there and is removed now (or the plane could
    /// not tell).
    Removed,
    /// GitHub no longer had it: this call removed nothing.
    AlreadyGone,
}
