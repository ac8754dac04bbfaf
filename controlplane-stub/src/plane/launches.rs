//! Launches: reserving a lease for a job, minting its registration ahead
//! when the node takes one, dispatching `Launch`, and what the plane does
//! with the outcome; a launch whose result was lost is handed to its node
//! with `AssumeCustody` ([`LostLaunch`]).

use std::sync::Arc;
use std::time::Instant;

use billet_proto::ending::ReasonCode;
use billet_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, warn};

use crate::calls::lease_to_wire;
use crate::ledger::{NewLease, NodeCapacity, Phase};
use crate::node_link::{CommandOutcome, NodeLink};

use super::{Plane, PlaneEvent};

/// A launch whose result the plane never saw: the node may hold compute
/// for it, so the plane hands it over with `AssumeCustody` on the node's
/// next session (DESIGN.md, custody moves causally).
#[derive(Debug, Clone)]
pub(super) struct LostLaunch {
    lease: String,
    request_id: i64,
}

impl Plane {
    pub(super) async fn launch(
        self: Arc<Self>,
        lease: crate::ledger::Lease,
        node: Arc<NodeLink>,
        warm: Option<String>,
    ) {
        let mut wire = lease_to_wire(&lease);
        wire.providers = vec!["docker".into()];
        let ahead = self.config.mint_before_dispatch
            && node
                .status()
                .borrow()
                .as_ref()
                .is_some_and(|s| s.hello.launches_with_registration && !s.degraded())
            && self
                .cover
                .lock()
                .expect("cover")
                .image_ran
                .contains(node.name());
        let registration = if ahead {
            match self.mint_ahead(&lease).await {
                Ok(minted) => Some(minted),
                Err(refused) => {
                    // Nothing was dispatched: a failure like a node's
                    // failed mint, with nothing started.
                    self.launch_ended(lease, node, CommandOutcome::Answered(refused), None)
                        .await;
                    return;
                }
            }
        } else {
            None
        };
        let command = pb::command::Kind::Launch(pb::Launch {
            registration: registration.clone(),
            lease: Some(wire),
            tier: Some(self.tier_spec()),
            job: Some(pb::Job {
                request_id: lease.request_id,
                ..Default::default()
            }),
            warm_instance: warm.unwrap_or_default(),
        });
        let outcome = node.dispatch(command, self.config.launch_timeout).await;
        self.launch_ended(lease, node, outcome, registration).await;
    }

    /// Mints the registration of `lease` for its launch with the code a node's
    /// `MintJit` runs ([`crate::calls::mint_and_record`]): the runner named
    /// `billet-<lease>`, recorded against the lease before it is sent. Returns
    /// the failed command result the launch ends with when it cannot be minted
    /// (`SCALE_SET_NOT_FOUND`, `UNAVAILABLE`, or the ledger's code). Public so
    /// the launch bench times the plane's own mint.
    ///
    /// # Errors
    ///
    /// The failed [`pb::CommandResult`] above.
    pub async fn mint_ahead(
        &self,
        lease: &crate::ledger::Lease,
    ) -> Result<pb::JitConfig, pb::CommandResult> {
        crate::calls::mint_and_record(&self.github, &self.ledger, lease)
            .await
            .map_err(|error| pb::CommandResult {
                outcome: pb::Outcome::Failed as i32,
                error: Some(error),
                ..Default::default()
            })
    }

    /// Removes the registration this plane minted for a launch that ended with
    /// nothing started (the plane's obligation once it mints before dispatch).
    /// GitHub no longer having it is success; a removal that fails is left to
    /// the registration pass, which removes the registrations of ended leases.
    async fn remove_minted(&self, lease: &str, registration: &pb::JitConfig) {
        match self
            .github
            .remove_runner(registration.runner_id, &registration.runner_name)
            .await
        {
            Ok(_) => {
                info!(%lease, runner = %registration.runner_name, "removed the registration of a launch that started nothing");
            }
            Err(e) => {
                warn!(%lease, runner = %registration.runner_name, error = %e,
                      "cannot remove the registration of a launch that started nothing; the registration pass removes it");
            }
        }
    }

    /// What the plane does with a launch's outcome: a launched lease is
    /// covered; a lost one is the node's if it may have started a runner;
    /// one answered `BUSY` (a runner of the lease already works on the node)
    /// is left open and covered; any other is failed, released and backed
    /// off. `registration` is the
    /// one this plane minted before dispatching, removed here whenever the
    /// lease ends with nothing started.
    pub(super) async fn launch_ended(
        self: Arc<Self>,
        lease: crate::ledger::Lease,
        node: Arc<NodeLink>,
        outcome: CommandOutcome,
        registration: Option<pb::JitConfig>,
    ) {
        let tier = &self.config.tier;
        self.cover
            .lock()
            .expect("cover")
            .in_flight
            .remove(&lease.id);
        if outcome.is_ok() {
            info!("launched");
            self.note_launched(&lease).await;
            {
                let mut cover = self.cover.lock().expect("cover");
                cover.launched.insert(lease.id.clone());
                cover.image_ran.insert(node.name().to_owned());
            }
            self.emit(PlaneEvent::Launched {
                lease: lease.id.clone(),
                node: node.name().to_owned(),
                minted_ahead: registration.is_some(),
            });
            self.wake.notify_one();
            return;
        }
        let custody = outcome.is_custody();
        let reason = outcome.describe();
        let code = match &outcome {
            CommandOutcome::Answered(r) => r
                .error
                .as_ref()
                .and_then(|e| pb::ErrorCode::try_from(e.code).ok()),
            _ => None,
        };
        // How long the node said it goes on refusing the tier (with
        // `TIER_UNHEALTHY`): the node is avoided at least that long.
        let tier_refused_for = match &outcome {
            CommandOutcome::Answered(r) if code == Some(pb::ErrorCode::TierUnhealthy) => r
                .error
                .as_ref()
                .map(|e| std::time::Duration::from_millis(e.retry_after_ms)),
            _ => None,
        };
        if code == Some(pb::ErrorCode::Busy) {
            // The node already holds a runner of this lease, at another
            // epoch: the launch started nothing, and ending the lease now
            // would free capacity a working runner uses and cover its job
            // twice. The lease stays open, renewed and covered by that
            // runner; its completion ends it as any other. A registration
            // minted ahead for this launch carries the runner's own name
            // (`billet-<lease>`), so it is not removed here, where the
            // removal could take the working runner's: the registration
            // pass removes what the lease's end leaves behind.
            warn!(%reason, node = node.name(), "the node answered the launch BUSY: a runner of this lease already works there; the lease is left open");
            self.cover
                .lock()
                .expect("cover")
                .launched
                .insert(lease.id.clone());
            self.emit(PlaneEvent::LaunchBusy {
                lease: lease.id.clone(),
                node: node.name().to_owned(),
                reason,
            });
            self.wake.notify_one();
            return;
        }
        self.emit(PlaneEvent::LaunchFailed {
            lease: lease.id.clone(),
            reason: reason.clone(),
            custody,
            code,
        });
        self.managed.lock().expect("managed").remove(&lease.id);
        // A lost launch whose lease never had a registration minted has no
        // runner and cannot get one (the ledger refuses a mint, and records
        // none, once the lease has ended): it is a failure like any other.
        // The node may still be launching, so the check and the release are
        // one ledger transaction: a mint recorded in between would leave a
        // runner started on a lease already ended. A ledger error counts as
        // minted, the careful side (the lease stays open and covered).
        //
        // A registration this plane minted before dispatching is recorded
        // from the start, so there the question is the bind instead: the
        // node starts nothing before its bind holds.
        let minted = match &outcome {
            CommandOutcome::Lost(_) => {
                let judged = if registration.is_some() {
                    self.ledger
                        .release_unbound(&lease.id, lease.epoch, crate::now_ms())
                        .await
                } else {
                    self.ledger
                        .release_unminted(&lease.id, lease.epoch, crate::now_ms())
                        .await
                };
                match judged {
                    Ok(released) => released.is_none(),
                    Err(e) => {
                        warn!(error = %e, "the lost launch's lease could not be judged; it is treated as minted");
                        true
                    }
                }
            }
            _ => false,
        };
        if minted {
            // The node may well have started the runner: the lease covers
            // its job for as long as the node keeps it open, and is
            // replaced once the ledger closes or quarantines it (a node
            // that restarted and found nothing, or one that went silent).
            // The node is told it holds the lease now if a session is
            // open, else on the next one.
            warn!(%reason, "the launch's result was lost; the node holds the lease");
            self.cover
                .lock()
                .expect("cover")
                .lost
                .entry(node.name().to_owned())
                .or_default()
                .push(LostLaunch {
                    lease: lease.id.clone(),
                    request_id: lease.request_id,
                });
            if node.status().borrow().is_some() {
                let plane = Arc::clone(&self);
                self.tasks
                    .spawn(async move { plane.hand_over_lost(&node).await }.in_current_span());
            }
            self.wake.notify_one();
            return;
        }
        let custody = custody && !matches!(outcome, CommandOutcome::Lost(_));
        // A node that refused (draining, degraded, without the tier's image)
        // or is out of room says so in the outcome and the code: it is
        // avoided for the backoff. A missing image minted nothing and
        // charged nothing; the job waits, covered, and the launch is tried
        // again after the backoff, so an image built or loaded meanwhile
        // lets it run.
        let refused = matches!(&outcome, CommandOutcome::Answered(r)
            if r.outcome == pb::Outcome::Refused as i32)
            || matches!(
                code,
                Some(pb::ErrorCode::ResourceExhausted | pb::ErrorCode::ImageUnavailable)
            );
        // Whatever the node said, its next launch is checked by the node
        // before anything is minted.
        self.cover
            .lock()
            .expect("cover")
            .image_ran
            .remove(node.name());
        if code == Some(pb::ErrorCode::ImageUnavailable) {
            warn!(image = %tier.image, node = node.name(), "the node does not have the tier's image; the job waits until it does");
        }
        if let Some(wait) = tier_refused_for {
            warn!(node = node.name(), %reason, retry_after_s = wait.as_secs(),
                "the node refuses the tier after consecutive start failures; not placing it there until it tries again");
        }
        if code == Some(pb::ErrorCode::RunnerOutdated) {
            let hold = self.cover.lock().expect("cover").hold_outdated();
            tracing::error!(image = %tier.image, node = node.name(), %reason, hold_s = hold.as_secs(),
                "the tier's image carries a runner GitHub will not run; nothing was minted, and the tier's jobs wait until the image is rebuilt on a newer actions/runner (asked again after the hold)");
        }
        // Another scale set holds a runner of the lease's name: neither the
        // node nor GitHub is failing, so the launch is not backed off as an
        // outage, and the node is not avoided. The name is the lease's, so
        // the job's fresh lease mints a fresh one at once. An operator
        // should know that another set names its runners as this plane
        // does.
        let name_taken = code == Some(pb::ErrorCode::RunnerNameTaken);
        if name_taken {
            tracing::error!(%reason, "another scale set holds a runner of this lease's name; the job gets a fresh lease (and name) now, without backoff");
        }
        let delay = {
            let mut cover = self.cover.lock().expect("cover");
            cover.not_covering.insert(lease.id.clone());
            cover.last_failure = Some(if code == Some(pb::ErrorCode::ImageUnavailable) {
                (
                    crate::jobs::WaitKind::ImageMissing,
                    format!("node {} does not have image {}", node.name(), tier.image),
                )
            } else {
                (
                    crate::jobs::WaitKind::BackingOff,
                    format!(
                        "lease {} on node {}: {}",
                        lease.id,
                        node.name(),
                        launch_failure_reason(&reason)
                    ),
                )
            });
            if name_taken {
                std::time::Duration::ZERO
            } else {
                let delay = cover.failed();
                if refused {
                    // A tier the node refuses is not placed there until the
                    // node's own wait passes: sooner would only be refused
                    // again.
                    let avoid = delay.max(tier_refused_for.unwrap_or_default());
                    cover
                        .avoid
                        .insert(node.name().to_owned(), Instant::now() + avoid);
                }
                delay
            }
        };
        warn!(%reason, custody, retry_in = ?delay, "the launch did not end with a runner; the job gets a fresh lease");
        if !matches!(outcome, CommandOutcome::Lost(_)) {
            // The lease says why its launch failed, so an operator reading
            // the ledger sees what a launch that keeps failing (a tier the
            // engine refuses) fails on: one the plane ends now, and one the
            // node holds until what it started is proven gone (it ends it
            // `failed` then; the job has a fresh lease meanwhile).
            let words = launch_failure_reason(&reason);
            let code = if tier_refused_for.is_some() {
                ReasonCode::TierUnhealthy
            } else {
                ReasonCode::LaunchFailed
            };
            let detail = words.strip_prefix("launch: ").unwrap_or(&words);
            if let Err(e) = self
                .ledger
                .mark_failure_as(
                    &lease.id,
                    lease.epoch,
                    &words,
                    (code, detail),
                    crate::now_ms(),
                )
                .await
            {
                warn!(error = %e, "recording why a launch failed");
            }
        }
        if !custody && !matches!(outcome, CommandOutcome::Lost(_)) {
            // Nothing was started: the plane ends the lease itself (a lost
            // launch's lease was ended above, with the mint check).
            if let Err(e) = self
                .ledger
                .release(&lease.id, lease.epoch, None, Phase::Failed, crate::now_ms())
                .await
            {
                warn!(error = %e, "release after a failed launch");
            }
        }
        // Nothing started (the node said so, or never bound the lost
        // launch's lease): the registration minted for it goes now. A node
        // holding the lease removes it itself with what it started.
        if !custody && let Some(registration) = &registration {
            self.remove_minted(&lease.id, registration).await;
        }
        self.wake.notify_one();
    }

    /// Hands every lost launch of `node` to it with `AssumeCustody` on each
    /// new session: the plane stopped waiting for the result, so the node
    /// holds whatever it started until it is proven gone or its job ends.
    pub(super) async fn hand_over(
        self: Arc<Self>,
        node: Arc<NodeLink>,
        shutdown: CancellationToken,
    ) {
        let mut status = node.status();
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                changed = status.changed() => if changed.is_err() { return },
            }
            if status.borrow_and_update().is_none() {
                continue;
            }
            self.hand_over_lost(&node).await;
        }
    }

    /// Sends `AssumeCustody` for each lost launch of `node` still open; one
    /// the node did not answer waits for the next session.
    async fn hand_over_lost(&self, node: &Arc<NodeLink>) {
        let lost = self
            .cover
            .lock()
            .expect("cover")
            .lost
            .remove(node.name())
            .unwrap_or_default();
        for launch in lost {
            let Ok(Some(lease)) = self.ledger.get(&launch.lease).await else {
                continue;
            };
            if lease.phase.is_terminal() {
                continue;
            }
            let outcome = node
                .dispatch(
                    pb::command::Kind::AssumeCustody(pb::AssumeCustody {
                        lease: Some(lease_to_wire(&lease)),
                        request_id: launch.request_id,
                    }),
                    self.config.destroy_timeout,
                )
                .await;
            match outcome {
                CommandOutcome::Answered(_) => {
                    info!(lease = %launch.lease, outcome = %outcome.describe(), "handed a lost launch to its node")
                }
                // Not heard: send it again on the next session.
                _ => self
                    .cover
                    .lock()
                    .expect("cover")
                    .lost
                    .entry(node.name().to_owned())
                    .or_default()
                    .push(launch),
            }
        }
    }

    /// The tier's spec as a `Launch` or a `WarmPool` carries it.
    pub(super) fn tier_spec(&self) -> pb::TierSpec {
        let tier = &self.config.tier;
        pb::TierSpec {
            label: tier.label.clone(),
            image: tier.image.clone(),
            command: tier.command.clone(),
            trust: tier.trust.clone(),
            shm_bytes: 0,
            network: tier.network.clone(),
            env: tier.env.clone(),
            sticky_disks: tier.sticky_disks.clone(),
            actions_cache: tier.actions_cache.is_some(),
            cache_scope: tier.actions_cache.clone(),
            docker_image_store: tier.docker_image_store,
            min_runner_version: tier.min_runner_version.clone(),
            host: None,
            pids_limit: 0,
        }
    }

    /// Reserves a lease for `request_id` aimed at `node`, whose capacity is
    /// `capacity`, and starts renewing it: the ledger refuses it (`NoCapacity`)
    /// when the node's open leases and warm runners leave no room, whoever
    /// booked them. The lease takes over the room of one of the node's warm
    /// runners of the tier when the ledger charges one there; its name comes
    /// back with the lease, for the launch to name.
    pub(super) async fn reserve(
        &self,
        request_id: i64,
        node: &str,
        capacity: NodeCapacity,
    ) -> Result<(crate::ledger::Lease, Option<String>), crate::ledger::LedgerError> {
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let tier = &self.config.tier;
        let (lease, warm) = self
            .ledger
            .reserve_on_warm(
                NewLease {
                    id: id.clone(),
                    tier: tier.label.clone(),
                    request_id,
                    vcpu: tier.vcpu,
                    memory_bytes: tier.memory_bytes,
                    runner_name: Some(format!("billet-{id}")),
                },
                node,
                capacity,
                crate::now_ms(),
            )
            .await?;
        info!(lease = %id, request_id, node, warm = ?warm, "reserved a lease for an assigned job");
        self.note_placed(&lease, node, warm.as_deref()).await;
        self.managed.lock().expect("managed").insert(id.clone());
        self.emit(PlaneEvent::Reserved {
            request_id,
            lease: id,
        });
        Ok((lease, warm))
    }
}

/// The failure reason a lease whose launch failed is ended with: `launch: `
/// and what the node (or the session) said, at most
/// [`LAUNCH_FAILURE_REASON_CHARS`] characters of it.
fn launch_failure_reason(described: &str) -> String {
    let mut reason = format!("launch: {described}");
    if let Some((cut, _)) = reason.char_indices().nth(LAUNCH_FAILURE_REASON_CHARS) {
        reason.truncate(cut);
    }
    reason
}

/// The longest failure reason [`launch_failure_reason`] records, in
/// characters.
const LAUNCH_FAILURE_REASON_CHARS: usize = 500;
