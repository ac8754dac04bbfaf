//! The node's identity kept alive: [`IdentityKeeper`] asks the plane to
//! renew the certificate over the session at two thirds of its lifetime
//! ([`renew_at`]), and re-enrols a node whose certificate expired anyway
//! with a one-time join token ([`IdentityKeeper::enroll`]).
//!
//! Either way the node makes a fresh key and a certificate request naming
//! itself ([`crate::tls::enroll::request`]); the key never leaves the node
//! and the node never holds the CA key. What the plane sends back is checked
//! as the files would be (chains to the CA, valid now by the plane's clock
//! ([`crate::clock::PlaneClock`]), names this node, matches the key),
//! written over the identity files and put in force through the reload
//! path ([`IdentityFiles::replace`]): no restart, no session dropped,
//! nothing the node runs touched. Sessions opened after it (the recycled
//! one included) are opened on the new certificate.
//!
//! The renewal's time, like every certificate date, is read on the plane's
//! clock: a node minutes behind renews when the plane's two thirds have
//! passed, not minutes late.
//!
//! A renewal that fails is retried with backoff (1 s doubling to 60 s,
//! jittered, without end); meanwhile the health subsystem raises
//! `identity expiring` at five sixths of the lifetime and `identity
//! expired` at its end, as for any certificate.
//!
//! May not touch: lease state, the provider or the journal.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use backon::{BackoffBuilder as _, ExponentialBuilder};
use thiserror::Error;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::clock::PlaneClock;
use crate::edge::link::PlaneLink;
use crate::model::NodeName;
use crate::node::metrics::Metrics;
use crate::node::plane::PlaneError;
use crate::tls::enroll::{EnrollError, JoinToken};
use crate::tls::{IdentityFiles, NodeTls, TlsError};

/// The first wait after a failed renewal.
pub(crate) const RENEWAL_BACKOFF_MIN: Duration = Duration::from_secs(1);
/// The longest wait between two tries of a renewal.
pub(crate) const RENEWAL_BACKOFF_MAX: Duration = Duration::from_secs(60);
/// How often a renewal not yet due is looked at again: its time is read on
/// the plane's clock, whose offset may be measured or move meanwhile.
const RENEWAL_RECHECK: Duration = Duration::from_secs(15);

/// When a certificate valid from `not_before` to `not_after` is renewed:
/// two thirds into its lifetime. `None` when either end is unknown or the
/// window is empty.
pub(crate) fn renew_at(
    not_before: Option<SystemTime>,
    not_after: Option<SystemTime>,
) -> Option<SystemTime> {
    let (not_before, not_after) = (not_before?, not_after?);
    let lifetime = not_after.duration_since(not_before).ok()?;
    Some(not_before + lifetime * 2 / 3)
}

/// Why a renewal or an enrolment did not put a new certificate in force.
#[derive(Debug, Error)]
pub(crate) enum IdentityError {
    /// No key or request could be made.
    #[error("{0}")]
    Request(String),
    /// The plane will not sign: the request names another node, or the
    /// join token is unknown, used or expired.
    #[error("the plane refused to sign: {0}")]
    Refused(String),
    /// The plane could not be asked, or did not answer; retry.
    #[error("the plane could not be asked: {0}")]
    Unavailable(String),
    /// What the plane sent does not verify as this node's certificate.
    #[error("the certificate the plane sent was refused: {0}")]
    Issued(TlsError),
    /// Another node's name in a certificate the plane sent.
    #[error("the plane sent a certificate for {got}, not for this node ({expected})")]
    OtherNode {
        /// This node.
        expected: NodeName,
        /// What the certificate names.
        got: NodeName,
    },
    /// The files could not be written or the new certificate was not put
    /// in force.
    #[error("cannot install the new certificate: {0}")]
    Install(TlsError),
}

/// Keeps the node's certificate valid while attached, and re-enrols it when
/// it expired anyway. One renewal or enrolment at a time.
#[derive(Debug)]
pub(crate) struct IdentityKeeper {
    files: IdentityFiles,
    node_name: NodeName,
    plane_name: String,
    link: Arc<PlaneLink>,
    metrics: Option<Arc<Metrics>>,
    /// Certificate dates are read on it; this node's own clock until
    /// [`IdentityKeeper::with_plane_clock`].
    plane_clock: Arc<PlaneClock>,
    one_at_a_time: tokio::sync::Mutex<()>,
}

impl IdentityKeeper {
    /// A keeper of `node_name`'s identity `files`, renewing over `link`'s
    /// current session; an enrolment verifies the plane by `plane_name`.
    pub(crate) fn new(
        files: IdentityFiles,
        node_name: NodeName,
        plane_name: String,
        link: Arc<PlaneLink>,
    ) -> Self {
        Self {
            files,
            node_name,
            plane_name,
            link,
            metrics: None,
            plane_clock: Arc::default(),
            one_at_a_time: tokio::sync::Mutex::new(()),
        }
    }

    /// Counts renewals and enrolments in `metrics`.
    #[must_use]
    pub(crate) fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Reads certificate dates on `clock` (the health subsystem's, corrected
    /// by the offset each session measures).
    #[must_use]
    pub(crate) fn with_plane_clock(mut self, clock: Arc<PlaneClock>) -> Self {
        self.plane_clock = clock;
        self
    }

    /// When the certificate in force is renewed ([`renew_at`]), as the
    /// plane's clock reads it.
    pub(crate) fn renew_at(&self) -> Option<SystemTime> {
        let (not_before, not_after) = self.files.validity();
        renew_at(not_before, not_after)
    }

    fn count(&self, outcome: &'static str) {
        if let Some(m) = &self.metrics {
            m.certificate_renewal(outcome);
        }
    }

    /// Checks what the plane sent against the node's CA and name, valid at
    /// the plane's time, and installs it with `key_pem`; answers the new
    /// certificate's end.
    async fn install(&self, chain_pem: &str, key_pem: &str) -> Result<SystemTime, IdentityError> {
        let fresh = NodeTls::from_pem_at(
            self.files.paths(),
            chain_pem.as_bytes(),
            key_pem.as_bytes(),
            self.plane_clock.now(),
        )
        .map_err(IdentityError::Issued)?;
        if fresh.node_name != self.node_name {
            return Err(IdentityError::OtherNode {
                expected: self.node_name.clone(),
                got: fresh.node_name,
            });
        }
        self.files
            .replace(chain_pem.as_bytes(), key_pem.as_bytes(), fresh.not_after)
            .await
            .map_err(IdentityError::Install)?;
        Ok(fresh.not_after.unwrap_or(SystemTime::UNIX_EPOCH))
    }

    /// One renewal over the current session: a fresh key and request, the
    /// plane's signature, the new certificate in force. Answers its end.
    ///
    /// # Errors
    ///
    /// [`IdentityError`]; [`IdentityError::Unavailable`] with no session.
    pub(crate) async fn renew_once(&self) -> Result<SystemTime, IdentityError> {
        let _one = self.one_at_a_time.lock().await;
        let request =
            crate::tls::enroll::request(&self.node_name).map_err(IdentityError::Request)?;
        let chain = match self.link.renew_certificate(&request.csr_pem).await {
            Ok(chain) => chain,
            Err(PlaneError::Unavailable(e)) => {
                self.count("failed");
                return Err(IdentityError::Unavailable(e));
            }
            Err(e) => {
                self.count("refused");
                return Err(IdentityError::Refused(e.to_string()));
            }
        };
        let installed = self.install(&chain, &request.key_pem).await;
        self.count(if installed.is_ok() {
            "renewed"
        } else {
            "failed"
        });
        installed
    }

    /// Re-enrols with a join token: a fresh key and request, signed by the
    /// plane's enrolment endpoint at `plane_address`, put in force. Answers
    /// the new certificate's end. Nothing the node runs is touched.
    ///
    /// # Errors
    ///
    /// [`IdentityError::Refused`] for a token the plane will not take
    /// (unknown, used, expired, another node's); [`IdentityError::Unavailable`]
    /// when the endpoint cannot be reached.
    pub(crate) async fn enroll(
        &self,
        token: &JoinToken,
        plane_address: &str,
    ) -> Result<SystemTime, IdentityError> {
        let _one = self.one_at_a_time.lock().await;
        let request =
            crate::tls::enroll::request(&self.node_name).map_err(IdentityError::Request)?;
        let ca = std::fs::read(&self.files.paths().ca).map_err(|source| {
            IdentityError::Install(TlsError::Read {
                path: self.files.paths().ca.clone(),
                source,
            })
        })?;
        let chain = match crate::tls::enroll::enroll(
            plane_address,
            &ca,
            &self.plane_name,
            token,
            &request.csr_pem,
        )
        .await
        {
            Ok(chain) => chain,
            Err(EnrollError::Refused(e)) => {
                self.count("refused");
                return Err(IdentityError::Refused(e));
            }
            Err(e) => {
                self.count("failed");
                return Err(IdentityError::Unavailable(e.to_string()));
            }
        };
        let installed = self.install(&chain, &request.key_pem).await;
        if let Ok(not_after) = &installed {
            info!(node = %self.node_name, not_after_unix_s = unix_s(*not_after), "re-enrolled: a new certificate is in force");
        }
        self.count(if installed.is_ok() {
            "enrolled"
        } else {
            "failed"
        });
        installed
    }

    /// Renews the certificate in force at [`renew_at`] until `cancel`,
    /// retrying a failed renewal with backoff until one succeeds or the
    /// certificate in force changes (files replaced by hand, an enrolment).
    pub(crate) async fn keep(self: Arc<Self>, cancel: CancellationToken) {
        let mut validity = self.files.watch_validity();
        loop {
            let due = self.renew_at();
            let wait = due.map(|at| self.plane_clock.until(at));
            // Looked at again every RENEWAL_RECHECK while not due: the
            // offset to the plane's clock, which the wait is read on, may
            // be measured (or move) meanwhile.
            let due_now = wait.is_some_and(|w| w.is_zero());
            tokio::select! {
                () = cancel.cancelled() => return,
                changed = validity.changed() => {
                    if changed.is_err() {
                        return;
                    }
                    continue;
                }
                () = async {
                    match wait {
                        Some(w) => tokio::time::sleep(w.min(RENEWAL_RECHECK)).await,
                        None => std::future::pending().await,
                    }
                } => {
                    if !due_now {
                        continue;
                    }
                }
            }
            let in_force = *validity.borrow_and_update();
            let mut delays = ExponentialBuilder::default()
                .with_min_delay(RENEWAL_BACKOFF_MIN)
                .with_max_delay(RENEWAL_BACKOFF_MAX)
                .with_factor(2.0)
                .with_jitter()
                .without_max_times()
                .build();
            loop {
                if *validity.borrow() != in_force {
                    break;
                }
                info!(node = %self.node_name, "asking the plane to renew the node's certificate");
                match self.renew_once().await {
                    Ok(not_after) => {
                        info!(node = %self.node_name, not_after_unix_s = unix_s(not_after),
                              "certificate renewed through the plane; new connections use it");
                        break;
                    }
                    Err(e) => {
                        let delay = delays.next().unwrap_or(RENEWAL_BACKOFF_MAX);
                        warn!(node = %self.node_name, error = %e, retry_in_ms = delay.as_millis(),
                              "the certificate renewal failed; retrying");
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(delay) => {}
                        }
                    }
                }
            }
            // The next round waits for the new certificate's own time.
            validity.borrow_and_update();
        }
    }
}

/// A time as whole seconds since the Unix epoch, for a log field a
/// collector reads as a number; 0 before the epoch.
fn unix_s(t: SystemTime) -> u64 {
    t.duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_certificate_is_renewed_two_thirds_into_its_lifetime() {
        let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
        assert_eq!(
            renew_at(Some(start), Some(start + Duration::from_secs(300))),
            Some(start + Duration::from_secs(200))
        );
        assert_eq!(renew_at(None, Some(start)), None);
        assert_eq!(renew_at(Some(start), None), None);
        assert_eq!(
            renew_at(Some(start), Some(start - Duration::from_secs(1))),
            None
        );
    }
}
