//! The node's local socket, `<state_dir>/node.sock`: `grpc.health.v1` and
//! `billet.node.v1.Local/Status` over a unix socket, without TLS, for the
//! updater on the same host, and `billet.node.v1.Local/Enroll`, the one
//! thing it can be asked to do: re-enrol with a join token
//! ([`crate::edge::identity`]). Whoever can enter the 0700 state directory
//! can already read the node's journal; the socket tells them nothing more,
//! and enrolment needs a token only the plane issues.
//! Its client is [`crate::local`].

use std::path::{Path, PathBuf};
use std::sync::Arc;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio::net::{UnixListener, UnixStream};
use tonic::{Request, Response, Status};

use crate::edge::identity::{IdentityError, IdentityKeeper};
use crate::edge::slot::CommandSlot;
use crate::local::socket_path;
use crate::node::health::Health;
use crate::node::metrics::Metrics;
use crate::node::recovery::Recovery;
use crate::node::runner::Runner;

/// Why the local socket cannot be bound.
#[derive(Debug, Error)]
pub enum BindError {
    /// Another live node answers on this state directory's socket.
    #[error(
        "{0}: another billet node is running on this state directory; stop it, or give this one its own --state-dir"
    )]
    InUse(PathBuf),
    /// The socket cannot be created.
    #[error("{path}: cannot listen: {source}")]
    Io {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Binds the local socket in `state_dir`, replacing a stale one left by a
/// process that died, and refusing when a live node still answers on it.
///
/// # Errors
///
/// [`BindError`] naming the socket.
pub(crate) async fn bind(state_dir: &Path) -> Result<UnixListener, BindError> {
    let path = socket_path(state_dir);
    if UnixStream::connect(&path).await.is_ok() {
        return Err(BindError::InUse(path));
    }
    let io = |source| BindError::Io {
        path: path.clone(),
        source,
    };
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io(e)),
    }
    UnixListener::bind(&path).map_err(io)
}

/// The `Local` service.
#[derive(Debug, Clone)]
pub(crate) struct LocalService {
    version: String,
    incarnation: String,
    recovery: Arc<Recovery>,
    runner: Arc<Runner>,
    /// Plane contact, and the certificate file whose expiry is reported.
    observed: Option<(Arc<Metrics>, PathBuf)>,
    health: Arc<Health>,
    identity: Option<Arc<IdentityKeeper>>,
    slot: Option<Arc<CommandSlot>>,
}

impl LocalService {
    /// Reports `version` and `incarnation`, and reads recovery and drain
    /// state live.
    pub(crate) fn new(
        version: String,
        incarnation: String,
        recovery: Arc<Recovery>,
        runner: Arc<Runner>,
    ) -> Self {
        Self {
            version,
            incarnation,
            recovery,
            runner,
            observed: None,
            health: Arc::default(),
            identity: None,
            slot: None,
        }
    }

    /// Also reports the plane's last contact (from `metrics`) and the expiry
    /// of the certificate at `cert`.
    #[must_use]
    pub(crate) fn with_metrics(mut self, metrics: Arc<Metrics>, cert: PathBuf) -> Self {
        self.observed = Some((metrics, cert));
        self
    }

    /// Reports `health` (degraded reasons, clock offset, the age of the
    /// plane's last message, an expired identity) instead of a private,
    /// always healthy one.
    #[must_use]
    pub(crate) fn with_health(mut self, health: Arc<Health>) -> Self {
        self.health = health;
        self
    }

    /// Reports how long the command running in `slot` has run.
    #[must_use]
    pub(crate) fn with_slot(mut self, slot: Arc<CommandSlot>) -> Self {
        self.slot = Some(slot);
        self
    }

    /// Reports when the certificate is renewed and serves `Enroll` through
    /// `identity`; without it `Enroll` is refused.
    #[must_use]
    pub(crate) fn with_identity(mut self, identity: Arc<IdentityKeeper>) -> Self {
        self.identity = Some(identity);
        self
    }
}

fn unix_ms(t: std::time::SystemTime) -> i64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

#[tonic::async_trait]
impl pb::local_server::Local for LocalService {
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::LocalStatus>, Status> {
        let (plane_contact_unix_ms, certificate_not_after_unix_ms) = match &self.observed {
            Some((metrics, cert)) => (
                metrics.plane_contact_at().map_or(0, unix_ms),
                crate::node::metrics::certificate_expiry(cert).map_or(0, unix_ms),
            ),
            None => (0, 0),
        };
        let leases = self
            .runner
            .held()
            .into_iter()
            .map(|h| pb::LeaseStatus {
                lease_id: h.lease.as_str().to_owned(),
                epoch: h.epoch.0,
                state: h.state.as_str().to_owned(),
                instance: h.instance.as_str().to_owned(),
                runner_name: h.runner.unwrap_or_default(),
                age_ms: h
                    .age
                    .map_or(0, |a| u64::try_from(a.as_millis()).unwrap_or(u64::MAX)),
                custody: h.state.in_custody(),
            })
            .collect();
        let health = self.health.snapshot();
        let certificate_remaining_ms = health.certificate_not_after.map_or(0, |t| {
            match t.duration_since(self.health.plane_clock().now()) {
                Ok(left) => i64::try_from(left.as_millis()).unwrap_or(i64::MAX).max(1),
                Err(past) => -i64::try_from(past.duration().as_millis()).unwrap_or(i64::MAX),
            }
        });
        let certificate_renew_at_unix_ms = self
            .identity
            .as_ref()
            .and_then(|i| i.renew_at())
            .map_or(0, unix_ms);
        Ok(Response::new(pb::LocalStatus {
            certificate_remaining_ms,
            certificate_renew_at_unix_ms,
            cache_filesystem: self
                .runner
                .cache()
                .map(|c| c.filesystem().kind.clone())
                .unwrap_or_default(),
            cache_clone: self
                .runner
                .cache()
                .map(|c| c.filesystem().method().as_str().to_owned())
                .unwrap_or_default(),
            version: self.version.clone(),
            pid: std::process::id(),
            incarnation: self.incarnation.clone(),
            recovered: self.recovery.is_done(),
            draining: self.runner.is_draining(),
            leases,
            plane_contact_unix_ms,
            certificate_not_after_unix_ms,
            degraded_reasons: crate::edge::wire::degraded_reasons(&health),
            clock_offset_ms: health.clock_offset_ms.unwrap_or(0),
            plane_contact_age_ms: self
                .health
                .contact_age()
                .map_or(-1, |age| i64::try_from(age.as_millis()).unwrap_or(i64::MAX)),
            identity_expired: health
                .reasons
                .contains(&crate::node::health::Reason::IdentityExpired),
            warm: self.runner.warm().map(|pool| {
                let counts = pool.counts();
                pb::WarmStatus {
                    ready: counts.ready,
                    starting: counts.starting,
                    wanted: counts.wanted,
                }
            }),
            unhealthy_tiers: self
                .runner
                .unhealthy_tiers()
                .into_iter()
                .map(|t| pb::UnhealthyTier {
                    tier: t.tier,
                    failures: t.failures,
                    last_error: t.last_error,
                    retry_in_ms: u64::try_from(t.retry_in.as_millis()).unwrap_or(u64::MAX),
                })
                .collect(),
            outdated_images: self
                .runner
                .freshness()
                .outdated()
                .into_iter()
                .map(|o| pb::OutdatedImage {
                    reason: o.explain(),
                    image: o.image,
                    id: o.id,
                    version: o.version.unwrap_or_default(),
                    minimum: o.minimum.unwrap_or_default(),
                })
                .collect(),
            slot_busy_ms: self
                .slot
                .as_ref()
                .and_then(|s| s.busy_for())
                .map_or(0, |b| i64::try_from(b.as_millis()).unwrap_or(i64::MAX)),
        }))
    }

    async fn enroll(
        &self,
        request: Request<pb::EnrollRequest>,
    ) -> Result<Response<pb::EnrollResult>, Status> {
        let pb::EnrollRequest {
            token,
            plane_address,
        } = request.into_inner();
        let identity = self.identity.as_ref().ok_or_else(|| {
            Status::failed_precondition("this node cannot enrol: it keeps no identity files")
        })?;
        let token = crate::tls::enroll::JoinToken::parse(&token)
            .map_err(|e| Status::invalid_argument(format!("token: {e}")))?;
        if plane_address.trim().is_empty() {
            return Err(Status::invalid_argument(
                "plane_address: give the plane's enrolment endpoint as HOST:PORT",
            ));
        }
        match identity.enroll(&token, plane_address.trim()).await {
            Ok(not_after) => Ok(Response::new(pb::EnrollResult {
                certificate_not_after_unix_ms: unix_ms(not_after),
            })),
            Err(e @ IdentityError::Refused(_)) => Err(Status::permission_denied(e.to_string())),
            Err(e @ IdentityError::Unavailable(_)) => Err(Status::unavailable(e.to_string())),
            Err(e) => Err(Status::failed_precondition(e.to_string())),
        }
    }
}
