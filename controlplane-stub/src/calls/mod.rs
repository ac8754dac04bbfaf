//! Answers the node's calls. Every call is authorised against the identity
//! of the session it arrived on (the name the node's certificate carries,
//! which is the node the plane dialed): a node may touch only leases bound to
//! it, and may mint only for a lease it holds at `launching`; the plane's
//! CA signs a certificate request only for that name.
//!
//! `wire.rs` holds what the answers carry: leases ([`lease_to_wire`]) and
//! refusals as typed `pb::Error`s.

#[cfg(test)]
mod tests;
mod wire;

use std::sync::Arc;
use std::time::Duration;

use billet_proto::ending::ReasonCode;
use billet_proto::v1 as pb;
use tracing::warn;

use crate::github::Github;
use crate::identity::NodeCa;
use crate::ledger::{CacheObservation, Lease, Ledger, LedgerError, NodeCapacity, Phase};

use wire::{error, ledger_error};

pub use wire::lease_to_wire;
pub(crate) use wire::sign_error;

/// How long a quarantined lease must stay absent from a node's inventory
/// before the ledger frees it (§1.8, `quarantineGrace`): a listing taken
/// earlier might miss a container that is still being created.
pub const QUARANTINE_GRACE: Duration = Duration::from_secs(300);

/// The plane's answers to node calls.
#[derive(Debug)]
pub(crate) struct CallHandler {
    ledger: Arc<Ledger>,
    github: Arc<Github>,
    quarantine_grace: Duration,
    ca: Option<Arc<NodeCa>>,
}

/// Mints the runner registration `billet-<lease id>` for `lease` at GitHub and
/// records it against the lease in `ledger`: what a node's `MintJit` asks for
/// once its checks pass, and what the plane does before it dispatches a launch
/// (`Plane::mint_ahead`). A registration the ledger will not record is removed
/// at once (one this removal misses is found by its name by the plane's
/// registration pass), so no registration is ever handed out that the ledger
/// cannot name.
///
/// # Errors
///
/// `SCALE_SET_NOT_FOUND` when GitHub has no such set, `UNAVAILABLE` for any
/// other GitHub failure, and the ledger's code when it will not record it.
pub(crate) async fn mint_and_record(
    github: &Github,
    ledger: &crate::ledger::Ledger,
    lease: &crate::ledger::Lease,
) -> Result<pb::JitConfig, pb::Error> {
    let runner_name = format!("billet-{}", lease.id);
    let minted = github.mint(&lease.tier, &runner_name).await.map_err(|e| {
        let code = if e.is_scale_set_not_found() {
            pb::ErrorCode::ScaleSetNotFound
        } else if e.is_runner_name_taken() {
            pb::ErrorCode::RunnerNameTaken
        } else {
            pb::ErrorCode::Unavailable
        };
        error(code, e.to_string())
    })?;
    if let Err(e) = ledger
        .set_runner(
            &lease.id,
            lease.epoch,
            minted.runner_id,
            &minted.runner_name,
        )
        .await
    {
        if let Err(removal) = github
            .remove_runner(minted.runner_id, &minted.runner_name)
            .await
        {
            tracing::warn!(lease = %lease.id, runner = %minted.runner_name, error = %removal,
                "a registration the ledger refused to record could not be removed; the registration pass removes it by name");
        }
        return Err(ledger_error(&e));
    }
    Ok(pb::JitConfig {
        encoded_jit_config: minted.config,
        runner_id: minted.runner_id,
        runner_name: minted.runner_name,
    })
}

type Answer = Result<Option<pb::plane_reply::Result>, pb::Error>;

impl CallHandler {
    /// A handler over the ledger and GitHub.
    pub(crate) fn new(
        ledger: Arc<Ledger>,
        github: Arc<Github>,
        quarantine_grace: Duration,
    ) -> Self {
        Self {
            ledger,
            github,
            quarantine_grace,
            ca: None,
        }
    }

    /// Signs nodes' certificate requests (`RenewCertificate`) with `ca`;
    /// without it they are refused, `ERROR_CODE_UNAVAILABLE`.
    #[must_use]
    pub(crate) fn with_ca(mut self, ca: Option<Arc<NodeCa>>) -> Self {
        self.ca = ca;
        self
    }

    /// Answers one call from `node`, whose capacity the plane does not
    /// know (a `Resize` is refused `UNAVAILABLE`).
    #[cfg(test)]
    pub(crate) async fn handle(&self, node: &str, call: pb::NodeCall) -> pb::PlaneReply {
        self.handle_from(node, None, call).await
    }

    /// Answers one call from `node`, which said (`Hello`, then its
    /// reports) it may run `capacity` at once: what a `Resize` must fit in.
    pub(crate) async fn handle_from(
        &self,
        node: &str,
        capacity: Option<pb::Capacity>,
        call: pb::NodeCall,
    ) -> pb::PlaneReply {
        let pb::NodeCall { call_id, call } = call;
        let answer = match call {
            None => Err(error(
                pb::ErrorCode::InvalidArgument,
                "node call: the call is missing",
            )),
            Some(call) => self.answer(node, capacity, call).await,
        };
        match answer {
            Ok(result) => pb::PlaneReply {
                call_id,
                error: None,
                result,
            },
            Err(e) => {
                if e.code == pb::ErrorCode::WrongNode as i32 {
                    warn!(node, error = %e.message, "refused a node call on a lease that is not the node's");
                }
                if e.code == pb::ErrorCode::IdentityRefused as i32 {
                    warn!(node, error = %e.message, "refused to sign a node's certificate request");
                }
                pb::PlaneReply {
                    call_id,
                    error: Some(e),
                    result: None,
                }
            }
        }
    }

    /// The lease, if it is bound to `node`; refuses and logs otherwise.
    async fn owned(
        &self,
        node: &str,
        lease: &str,
        what: &str,
    ) -> Result<crate::ledger::Lease, pb::Error> {
        match self.ledger.get(lease).await.map_err(|e| ledger_error(&e))? {
            None => Err(error(
                pb::ErrorCode::NotFound,
                format!("lease {lease} is not in the ledger"),
            )),
            Some(l) if l.node.as_deref() == Some(node) => Ok(l),
            Some(l) => {
                warn!(node, lease, bound = ?l.node, what, "refused a node call on a lease bound elsewhere");
                Err(error(
                    pb::ErrorCode::WrongNode,
                    format!(
                        "lease {lease} is not bound to node {node}; a node may only {what} its own leases"
                    ),
                ))
            }
        }
    }

    async fn answer(
        &self,
        node: &str,
        capacity: Option<pb::Capacity>,
        call: pb::node_call::Call,
    ) -> Answer {
        use pb::node_call::Call;
        let now = crate::now_ms();
        let l = &self.ledger;
        let le = |e: LedgerError| ledger_error(&e);
        match call {
            Call::Bind(pb::Bind { lease_id, epoch }) => {
                l.bind(&lease_id, epoch, node, now).await.map_err(le)?;
                Ok(None)
            }
            Call::Advance(pb::Advance {
                lease_id,
                epoch,
                phase,
            }) => {
                let phase = Phase::parse(&phase).ok_or_else(|| {
                    error(
                        pb::ErrorCode::InvalidArgument,
                        format!("advance.phase: {phase:?} is not a lease phase"),
                    )
                })?;
                l.advance(&lease_id, epoch, node, phase, now)
                    .await
                    .map_err(le)?;
                Ok(None)
            }
            Call::BindAdvance(pb::BindAdvance {
                lease_id,
                epoch,
                phase,
            }) => {
                let phase = Phase::parse(&phase).ok_or_else(|| {
                    error(
                        pb::ErrorCode::InvalidArgument,
                        format!("bind_advance.phase: {phase:?} is not a lease phase"),
                    )
                })?;
                // One ledger transaction: bound and advanced, or neither.
                let lease = l
                    .bind_advance(&lease_id, epoch, node, phase, now)
                    .await
                    .map_err(le)?;
                Ok(Some(pb::plane_reply::Result::Lease(lease_to_wire(&lease))))
            }
            Call::Resize(pb::Resize {
                lease_id,
                epoch,
                vcpu,
                memory_bytes,
            }) => {
                let capacity = capacity.ok_or_else(|| {
                    error(
                        pb::ErrorCode::Unavailable,
                        format!(
                            "resize {lease_id}: this plane does not know node {node}'s capacity yet"
                        ),
                    )
                })?;
                let size = NodeCapacity {
                    vcpu: u64::from(vcpu),
                    memory_bytes,
                };
                let room = NodeCapacity {
                    vcpu: u64::from(capacity.vcpu),
                    memory_bytes: capacity.memory_bytes,
                };
                let lease = l
                    .resize(&lease_id, epoch, node, size, room, now)
                    .await
                    .map_err(le)?;
                tracing::info!(lease = %lease_id, node, vcpu, memory_bytes, "resized a launching lease to what its node runs");
                Ok(Some(pb::plane_reply::Result::Lease(lease_to_wire(&lease))))
            }
            Call::RecordCacheObservation(pb::RecordCacheObservation {
                lease_id,
                epoch,
                observation,
            }) => {
                let o = observation.ok_or_else(|| {
                    error(
                        pb::ErrorCode::InvalidArgument,
                        "record_cache_observation.observation: missing",
                    )
                })?;
                let kept = l
                    .record_cache_observation(
                        &lease_id,
                        epoch,
                        CacheObservation {
                            hits: o.hits,
                            misses: o.misses,
                            fallbacks: o.fallbacks,
                            bytes_restored: o.bytes_restored,
                            bytes_committed: o.bytes_committed,
                            conflicts: o.conflicts,
                        },
                        now,
                    )
                    .await
                    .map_err(le)?;
                Ok(Some(pb::plane_reply::Result::CacheObservation(
                    pb::CacheObservation {
                        hits: kept.hits,
                        misses: kept.misses,
                        fallbacks: kept.fallbacks,
                        bytes_restored: kept.bytes_restored,
                        bytes_committed: kept.bytes_committed,
                        conflicts: kept.conflicts,
                    },
                )))
            }
            Call::ActionsPolicy(pb::ActionsPolicyQuery { owner, repository }) => {
                // Not bound to a lease: any node of the deployment may ask
                // about any repository (the answer is no secret, and the
                // node asks for the static scope of its own tier).
                let allowed = l
                    .actions_cache_allowed(&owner, &repository)
                    .await
                    .map_err(le)?;
                Ok(Some(pb::plane_reply::Result::ActionsPolicy(
                    pb::ActionsPolicyAnswer { allowed },
                )))
            }
            Call::ReserveWarm(pb::ReserveWarm {
                name,
                tier,
                vcpu,
                memory_bytes,
            }) => {
                if tier.is_empty() {
                    return Err(error(
                        pb::ErrorCode::InvalidArgument,
                        "reserve_warm.tier: empty",
                    ));
                }
                let capacity = capacity.ok_or_else(|| {
                    error(
                        pb::ErrorCode::Unavailable,
                        format!(
                            "reserve warm runner {name}: this plane does not know node {node}'s capacity yet"
                        ),
                    )
                })?;
                let room = crate::ledger::WarmRoom {
                    name,
                    node: node.to_owned(),
                    tier,
                    vcpu: u64::from(vcpu),
                    memory_bytes,
                };
                let capacity = NodeCapacity {
                    vcpu: u64::from(capacity.vcpu),
                    memory_bytes: capacity.memory_bytes,
                };
                l.reserve_warm(&room, capacity, now).await.map_err(le)?;
                Ok(None)
            }
            Call::ReleaseWarm(pb::ReleaseWarm { name }) => {
                l.release_warm(node, &name).await.map_err(le)?;
                Ok(None)
            }
            Call::WarmRooms(pb::WarmRooms { names }) => {
                let charged = l.confirm_warm(node, &names).await.map_err(le)?;
                Ok(Some(pb::plane_reply::Result::WarmRooms(
                    pb::WarmRoomsCharged { charged },
                )))
            }
            Call::Heartbeat(pb::Heartbeat { leases }) => {
                let asked: Vec<(String, u64)> = leases
                    .into_iter()
                    .map(|pb::LeaseEpoch { lease_id, epoch }| (lease_id, epoch))
                    .collect();
                // One write transaction for the whole batch.
                let renewed = l.heartbeat_all(&asked, node, now).await.map_err(le)?;
                let results = asked
                    .into_iter()
                    .zip(renewed)
                    .map(|((lease_id, _), r)| pb::HeartbeatResult {
                        lease_id,
                        error: r.err().map(|e| ledger_error(&e)),
                    })
                    .collect();
                Ok(Some(pb::plane_reply::Result::Heartbeats(
                    pb::HeartbeatResults { results },
                )))
            }
            Call::Release(pb::Release {
                lease_id,
                epoch,
                outcome,
                code,
                detail,
            }) => {
                let outcome = Phase::parse(&outcome)
                    .filter(|p| p.is_terminal())
                    .ok_or_else(|| {
                        error(
                            pb::ErrorCode::InvalidArgument,
                            format!("release.outcome: {outcome:?} is neither done nor failed"),
                        )
                    })?;
                // A node that predates codes names none; the ledger reads
                // the lease's words then.
                let end = match ReasonCode::from_wire(code) {
                    ReasonCode::Unrecorded => None,
                    code => Some((code, detail.as_str())),
                };
                l.release_ending(&lease_id, epoch, Some(node), outcome, end, now)
                    .await
                    .map_err(le)?;
                Ok(None)
            }
            Call::MarkFailure(pb::MarkFailure {
                lease_id,
                epoch,
                reason,
                code,
                detail,
            }) => {
                self.owned(node, &lease_id, "mark").await?;
                let marked = match ReasonCode::from_wire(code) {
                    ReasonCode::Unrecorded => l.mark_failure(&lease_id, epoch, &reason, now).await,
                    code => {
                        l.mark_failure_as(&lease_id, epoch, &reason, (code, &detail), now)
                            .await
                    }
                };
                marked.map_err(le)?;
                Ok(None)
            }
            Call::GetLease(pb::GetLease { lease_id }) => {
                let lease = self.owned(node, &lease_id, "read").await?;
                Ok(Some(pb::plane_reply::Result::Lease(lease_to_wire(&lease))))
            }
            Call::Launched(pb::LaunchedLeases {}) => {
                // The leases themselves too, so a recovering node asks once.
                let leases = l.launched_leases(node).await.map_err(le)?;
                let (quarantined, launched): (Vec<&Lease>, Vec<&Lease>) =
                    leases.iter().partition(|l| l.phase == Phase::Quarantine);
                let ids = |v: Vec<&Lease>| v.into_iter().map(|l| l.id.clone()).collect();
                Ok(Some(pb::plane_reply::Result::Launched(pb::LaunchedSet {
                    launched: ids(launched),
                    quarantined: ids(quarantined),
                    leases: leases.iter().map(lease_to_wire).collect(),
                })))
            }
            Call::Reconcile(pb::Reconcile { lease_ids }) => {
                let freed = l
                    .reconcile(node, &lease_ids, self.quarantine_grace, now)
                    .await
                    .map_err(le)?;
                Ok(Some(pb::plane_reply::Result::Reconciled(
                    pb::ReconcileResult { freed },
                )))
            }
            Call::MintJit(pb::MintJit {
                lease_id,
                epoch,
                runner_name,
                work_folder: _,
            }) => {
                let lease = self.owned(node, &lease_id, "mint for").await?;
                if lease.epoch != epoch {
                    return Err(error(
                        pb::ErrorCode::Fenced,
                        format!("lease {lease_id} is at epoch {}, not {epoch}", lease.epoch),
                    ));
                }
                if lease.phase != Phase::Launching {
                    return Err(error(
                        pb::ErrorCode::BadTransition,
                        format!(
                            "lease {lease_id} is {}; a JIT config is minted only while launching",
                            lease.phase
                        ),
                    ));
                }
                let expected = format!("billet-{lease_id}");
                if runner_name != expected {
                    return Err(error(
                        pb::ErrorCode::InvalidArgument,
                        format!("mint_jit.runner_name: must be {expected}"),
                    ));
                }
                if lease.runner_id.is_some() {
                    return Err(error(
                        pb::ErrorCode::Refused,
                        format!(
                            "lease {lease_id} already had a JIT config minted; a registration is never minted twice"
                        ),
                    ));
                }
                mint_and_record(&self.github, l, &lease)
                    .await
                    .map(|jit| Some(pb::plane_reply::Result::Jit(jit)))
            }
            Call::RenewCertificate(pb::RenewCertificate { csr_pem }) => {
                let ca = self.ca.as_ref().ok_or_else(|| {
                    error(
                        pb::ErrorCode::Unavailable,
                        "this plane holds no CA key (billet-plane --ca-key) and signs no certificates",
                    )
                })?;
                // Only for the node the session authenticated.
                let chain = ca.sign(&csr_pem, node).map_err(|e| sign_error(&e))?;
                tracing::info!(node, "signed a renewed certificate for the session's node");
                Ok(Some(pb::plane_reply::Result::Certificate(
                    pb::IssuedCertificate {
                        certificate_chain_pem: chain,
                    },
                )))
            }
            Call::RemoveRunner(pb::RemoveRunner {
                lease_id,
                epoch: _,
                runner_id,
                runner_name,
            }) => {
                let lease = self.owned(node, &lease_id, "remove runners of").await?;
                let (id, name) = if runner_id > 0 {
                    if lease.runner_id.is_some_and(|r| r != runner_id) {
                        return Err(error(
                            pb::ErrorCode::WrongNode,
                            format!(
                                "runner {runner_id} is not the registration of lease {lease_id}"
                            ),
                        ));
                    }
                    (runner_id, runner_name)
                } else {
                    match (lease.runner_id, lease.runner_name.clone()) {
                        (Some(id), Some(name)) => (id, name),
                        (None, _) => return Ok(None),
                        (Some(id), None) => (id, format!("billet-{lease_id}")),
                    }
                };
                let removed = self.github.remove_runner(id, &name).await.map_err(|e| {
                    // A runner running a job cannot be removed: that is an
                    // answer (the node keeps it), not an outage.
                    let code = if e.is_job_still_running() {
                        pb::ErrorCode::Busy
                    } else {
                        pb::ErrorCode::Unavailable
                    };
                    error(code, e.to_string())
                })?;
                Ok(Some(pb::plane_reply::Result::RunnerRemoval(
                    pb::RunnerRemoval {
                        already_gone: !removed,
                    },
                )))
            }
        }
    }
}
