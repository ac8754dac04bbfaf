//! Dialing a node: where it listens ([`NodeTarget`]), the plane's mTLS
//! material ([`PlaneTls`]), how the connection notices a silent node
//! ([`Keepalive`]), and [`dial`] itself.

use std::net::SocketAddr;
use std::time::Duration;

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use super::LinkError;

/// The plane's default HTTP/2 PING interval to a node ([`Keepalive`]).
pub(crate) const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(20);
/// The plane's default time for a node to answer a PING ([`Keepalive`]).
pub(crate) const KEEPALIVE_TIMEOUT: Duration = Duration::from_secs(20);

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
    /// `KEEPALIVE_INTERVAL` and `KEEPALIVE_TIMEOUT`: 20 s and 20 s.
    fn default() -> Self {
        Self {
            interval: KEEPALIVE_INTERVAL,
            timeout: KEEPALIVE_TIMEOUT,
        }
    }
}

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
pub(crate) async fn dial_with(
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
