//! Spot interruptions: the cloud taking the host's capacity back with two
//! minutes' notice (the reference's `WatchInterruptions`, spec/node.md
//! §2.11).
//!
//! An [`InterruptionSource`] says whether a notice stands. The one source
//! there is, [`Imds`], reads the EC2 instance-metadata spot notice,
//! `GET /latest/meta-data/spot/instance-action`, with an IMDSv2 session
//! token (`PUT /latest/api/token`): 404 while there is none; 200 with
//! `{"action": "terminate" | "stop" | "hibernate", "time": "<RFC 3339>"}`
//! once EC2 has decided. The reference reads an SQS queue per EC2 instance;
//! a Docker node's runners share its host, so here one notice ends them
//! all.
//!
//! [`watch`] asks every [`POLL_INTERVAL`]. While a notice stands the node
//! is degraded with [`Reason::SpotInterruption`] (launches refused before
//! anything is minted, capacity withdrawn, health `NOT_SERVING`), and once
//! recovery has run, [`Runner::interrupt`] fails every lease it holds with
//! `ec2 spot interruption: <action>`, recorded in the ledger before its
//! instance is destroyed. The notice has no acknowledgement to withhold:
//! it stands until the host goes, so a lease whose reason could not be
//! recorded is simply asked about again on the next poll, and a restarted
//! node sees the same notice again. A source that cannot be read changes
//! nothing: an unreadable notice is not a notice.
//!
//! May not touch: lease state except through [`Runner::interrupt`].

use std::fmt;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use serde::Deserialize;
use thiserror::Error;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use crate::node::ending::{EndReason, SpotAction};
use crate::node::health::{Health, Reason};
use crate::node::recovery::Recovery;
use crate::node::runner::Runner;

/// How often the notice is asked for. EC2 gives two minutes.
pub(crate) const POLL_INTERVAL: Duration = Duration::from_secs(5);
/// How long one instance-metadata request may take.
pub(crate) const IMDS_TIMEOUT: Duration = Duration::from_secs(2);
/// The lifetime asked for an IMDSv2 session token, in seconds (six hours,
/// the most EC2 grants).
pub(crate) const TOKEN_TTL_SECS: u64 = 21_600;
/// A token is asked for again this long before its lifetime ends.
const TOKEN_RENEW_MARGIN: Duration = Duration::from_secs(60);

/// A standing notice that the host's capacity is taken back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// What EC2 will do.
    pub action: SpotAction,
    /// When, as EC2 wrote it (RFC 3339, UTC).
    pub time: String,
}

/// Why a source could not say whether a notice stands.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum InterruptionError {
    /// The endpoint is not a usable base URL.
    #[error(
        "spot notice endpoint {endpoint:?}: {detail}; give the instance-metadata base URL, such as http://169.254.169.254"
    )]
    Endpoint {
        /// What was given.
        endpoint: String,
        /// Why it is unusable.
        detail: String,
    },
    /// The metadata service did not answer.
    #[error("the instance-metadata service at {endpoint} did not answer {what}: {detail}")]
    Unreachable {
        /// The base URL.
        endpoint: String,
        /// The request.
        what: &'static str,
        /// The transport's error.
        detail: String,
    },
    /// It answered something this node cannot read.
    #[error("the instance-metadata service at {endpoint} answered {what} with {detail}")]
    Unexpected {
        /// The base URL.
        endpoint: String,
        /// The request.
        what: &'static str,
        /// The status or body at fault.
        detail: String,
    },
}

/// Says whether a notice that the host's capacity is taken back stands.
#[async_trait]
pub trait InterruptionSource: Send + Sync + fmt::Debug {
    /// The standing notice, or `None`.
    ///
    /// # Errors
    ///
    /// [`InterruptionError`] when the source cannot be read.
    async fn notice(&self) -> Result<Option<Notice>, InterruptionError>;
}

/// The EC2 instance-metadata spot notice, read with IMDSv2 tokens.
pub struct Imds {
    http: reqwest::Client,
    endpoint: String,
    token: tokio::sync::Mutex<Option<(String, Instant)>>,
}

impl fmt::Debug for Imds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // The session token is a credential for the metadata service.
        f.debug_struct("Imds")
            .field("endpoint", &self.endpoint)
            .finish_non_exhaustive()
    }
}

#[derive(Deserialize)]
struct InstanceAction {
    action: String,
    #[serde(default)]
    time: String,
}

impl Imds {
    /// A reader of the metadata service at `endpoint` (for EC2,
    /// `http://169.254.169.254`). Never through a proxy.
    ///
    /// # Errors
    ///
    /// [`InterruptionError::Endpoint`] for anything but an `http` or
    /// `https` base URL.
    pub fn new(endpoint: &str) -> Result<Self, InterruptionError> {
        let bad = |detail: String| InterruptionError::Endpoint {
            endpoint: endpoint.to_owned(),
            detail,
        };
        let url = reqwest::Url::parse(endpoint).map_err(|e| bad(e.to_string()))?;
        if !matches!(url.scheme(), "http" | "https") || url.host_str().is_none() {
            return Err(bad("not an http:// or https:// URL with a host".into()));
        }
        let http = reqwest::Client::builder()
            .no_proxy()
            .timeout(IMDS_TIMEOUT)
            .build()
            .map_err(|e| bad(e.to_string()))?;
        Ok(Self {
            http,
            endpoint: endpoint.trim_end_matches('/').to_owned(),
            token: tokio::sync::Mutex::new(None),
        })
    }

    fn unreachable(&self, what: &'static str, e: &reqwest::Error) -> InterruptionError {
        InterruptionError::Unreachable {
            endpoint: self.endpoint.clone(),
            what,
            detail: e.to_string(),
        }
    }

    fn unexpected(&self, what: &'static str, detail: String) -> InterruptionError {
        InterruptionError::Unexpected {
            endpoint: self.endpoint.clone(),
            what,
            detail,
        }
    }

    /// A session token: the one held while it has a minute left, else a
    /// new one (`fresh` asks for a new one regardless).
    async fn token(&self, fresh: bool) -> Result<String, InterruptionError> {
        let mut held = self.token.lock().await;
        if !fresh
            && let Some((token, until)) = held.as_ref()
            && Instant::now() + TOKEN_RENEW_MARGIN < *until
        {
            return Ok(token.clone());
        }
        const WHAT: &str = "the token request (PUT /latest/api/token)";
        let response = self
            .http
            .put(format!("{}/latest/api/token", self.endpoint))
            .header(
                "X-aws-ec2-metadata-token-ttl-seconds",
                TOKEN_TTL_SECS.to_string(),
            )
            .send()
            .await
            .map_err(|e| self.unreachable(WHAT, &e))?;
        if !response.status().is_success() {
            return Err(self.unexpected(WHAT, format!("status {}", response.status())));
        }
        let token = response
            .text()
            .await
            .map_err(|e| self.unreachable(WHAT, &e))?
            .trim()
            .to_owned();
        if token.is_empty() {
            return Err(self.unexpected(WHAT, "an empty token".into()));
        }
        *held = Some((
            token.clone(),
            Instant::now() + Duration::from_secs(TOKEN_TTL_SECS),
        ));
        Ok(token)
    }
}

#[async_trait]
impl InterruptionSource for Imds {
    async fn notice(&self) -> Result<Option<Notice>, InterruptionError> {
        const WHAT: &str = "the spot notice (GET /latest/meta-data/spot/instance-action)";
        let mut fresh = false;
        loop {
            let token = self.token(fresh).await?;
            let response = self
                .http
                .get(format!(
                    "{}/latest/meta-data/spot/instance-action",
                    self.endpoint
                ))
                .header("X-aws-ec2-metadata-token", token)
                .send()
                .await
                .map_err(|e| self.unreachable(WHAT, &e))?;
            match response.status() {
                reqwest::StatusCode::NOT_FOUND => return Ok(None),
                // The token expired or was revoked: one fresh token, once.
                reqwest::StatusCode::UNAUTHORIZED if !fresh => {
                    fresh = true;
                    continue;
                }
                s if s.is_success() => {
                    let body = response
                        .text()
                        .await
                        .map_err(|e| self.unreachable(WHAT, &e))?;
                    let read: InstanceAction = serde_json::from_str(&body).map_err(|e| {
                        self.unexpected(WHAT, format!("a body that is not a spot notice ({e})"))
                    })?;
                    let action = SpotAction::parse(&read.action).ok_or_else(|| {
                        self.unexpected(WHAT, format!("an unknown action {:?}", read.action))
                    })?;
                    return Ok(Some(Notice {
                        action,
                        time: read.time,
                    }));
                }
                s => return Err(self.unexpected(WHAT, format!("status {s}"))),
            }
        }
    }
}

/// Asks `source` every `interval` until `cancel`: a standing notice makes
/// the node degraded ([`Reason::SpotInterruption`]) and, once `recovery`
/// has run, has [`Runner::interrupt`] fail what the node holds; no notice
/// clears the reason (with the health's hysteresis). An unreadable source
/// changes nothing and is logged once per distinct error.
pub(crate) async fn watch(
    source: Arc<dyn InterruptionSource>,
    runner: Arc<Runner>,
    health: Arc<Health>,
    recovery: Arc<Recovery>,
    interval: Duration,
    cancel: CancellationToken,
) {
    let mut standing: Option<Notice> = None;
    let mut last_error: Option<InterruptionError> = None;
    loop {
        match source.notice().await {
            Ok(Some(notice)) => {
                last_error = None;
                if standing.as_ref() != Some(&notice) {
                    warn!(action = notice.action.as_str(), time = %notice.time,
                          "spot interruption notice: the host's capacity is being taken back; taking no more work and failing what this node holds");
                    standing = Some(notice.clone());
                }
                health.observe(Reason::SpotInterruption, true);
                if recovery.is_done() {
                    let done = runner
                        .interrupt(EndReason::SpotInterruption(notice.action))
                        .await;
                    if done.ended > 0 || done.unrecorded > 0 {
                        info!(
                            ended = done.ended,
                            unrecorded = done.unrecorded,
                            "acted on the spot interruption notice"
                        );
                    }
                }
            }
            Ok(None) => {
                last_error = None;
                if standing.take().is_some() {
                    info!("the spot interruption notice is withdrawn");
                }
                health.observe(Reason::SpotInterruption, false);
            }
            Err(e) => {
                if last_error.as_ref() != Some(&e) {
                    warn!(error = %e, "cannot read the spot interruption notice; asking again");
                    last_error = Some(e);
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(interval) => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_that_is_not_an_http_base_url_is_refused_saying_what_to_give() {
        for bad in ["", "169.254.169.254", "ftp://169.254.169.254", "http://"] {
            let e = Imds::new(bad).expect_err(bad);
            assert!(
                e.to_string().contains("http://169.254.169.254"),
                "{bad}: {e}"
            );
        }
        Imds::new("http://169.254.169.254").expect("the EC2 endpoint");
        Imds::new("http://127.0.0.1:8080/").expect("a loopback fake");
    }

    #[test]
    fn the_debug_form_never_shows_the_session_token() {
        let imds = Imds::new("http://127.0.0.1:1").unwrap();
        *imds.token.try_lock().unwrap() = Some(("secret-token".into(), Instant::now()));
        assert!(!format!("{imds:?}").contains("secret-token"));
    }
}
