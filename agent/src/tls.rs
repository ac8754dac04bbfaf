//! mTLS for the node's listener: certificate loading, the node's name taken
//! from its own certificate, and an accept loop that runs every handshake
//! through our own rustls acceptor (so the material can later be swapped
//! without a restart), with a handshake timeout, refusing plaintext and
//! refusing a client whose certificate does not name the expected plane.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use thiserror::Error;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use crate::model::NodeName;

/// How long a peer may take to finish the TLS handshake.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// Most handshakes in progress at once; more connections wait in the kernel's
/// backlog.
const MAX_PENDING_HANDSHAKES: usize = 64;

/// A certificate or key that cannot be used.
#[derive(Debug, Error)]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: io::Error,
    },
    /// A file holds no usable PEM item of the kind needed.
    #[error("{path}: {problem}")]
    Content {
        /// The file.
        path: PathBuf,
        /// What is wrong and what was expected.
        problem: String,
    },
    /// rustls refused the combination (for example a key that does not match
    /// the certificate).
    #[error("{what}: {source}")]
    Config {
        /// Which material.
        what: String,
        /// rustls's reason.
        source: rustls::Error,
    },
}

/// The node's TLS identity and trust, loaded and checked.
#[derive(Debug, Clone)]
pub struct NodeTls {
    /// The server configuration: client certificates required, checked
    /// against the deployment CA.
    pub config: Arc<rustls::ServerConfig>,
    /// The node's name, from the DNS SAN of its certificate.
    pub node_name: NodeName,
}

/// Where the node's TLS material lives.
#[derive(Debug, Clone)]
pub struct TlsPaths {
    /// The node's certificate chain (PEM), leaf first.
    pub cert: PathBuf,
    /// The node's private key (PEM).
    pub key: PathBuf,
    /// The deployment CA bundle (PEM) client certificates must chain to.
    pub ca: PathBuf,
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Reads every certificate in a PEM file.
///
/// # Errors
///
/// [`TlsError`] when the file cannot be read or holds no certificate.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read(path)?;
    let certs = rustls_pemfile::certs(&mut bytes.as_slice())
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Content {
            path: path.to_owned(),
            problem: format!("not valid PEM: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::Content {
            path: path.to_owned(),
            problem: "holds no CERTIFICATE block; expected a PEM certificate".into(),
        });
    }
    Ok(certs)
}

/// Reads the first private key in a PEM file.
///
/// # Errors
///
/// [`TlsError`] when the file cannot be read or holds no key. The key's
/// bytes never appear in an error.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let bytes = read(path)?;
    rustls_pemfile::private_key(&mut bytes.as_slice())
        .map_err(|_| TlsError::Content {
            path: path.to_owned(),
            problem: "not valid PEM".into(),
        })?
        .ok_or_else(|| TlsError::Content {
            path: path.to_owned(),
            problem: "holds no PRIVATE KEY block; expected a PEM private key".into(),
        })
}

/// The DNS names in a certificate's subject alternative names.
///
/// # Errors
///
/// A description of why the certificate cannot be parsed.
pub fn dns_names(cert: &CertificateDer<'_>) -> Result<Vec<String>, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert.as_ref())
        .map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let mut names = Vec::new();
    if let Ok(Some(san)) = parsed.subject_alternative_name() {
        for name in &san.value.general_names {
            if let x509_parser::extensions::GeneralName::DNSName(dns) = name {
                names.push((*dns).to_owned());
            }
        }
    }
    Ok(names)
}

fn crypto() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

impl NodeTls {
    /// Loads the node's certificate, key and CA, and builds a server
    /// configuration that requires a client certificate from that CA.
    ///
    /// # Errors
    ///
    /// [`TlsError`] naming the file at fault: unreadable, not PEM, a
    /// certificate without a DNS name, a key that does not match.
    pub fn load(paths: &TlsPaths) -> Result<Self, TlsError> {
        let certs = load_certs(&paths.cert)?;
        let key = load_key(&paths.key)?;
        let names = dns_names(&certs[0]).map_err(|problem| TlsError::Content {
            path: paths.cert.clone(),
            problem,
        })?;
        let first = names.first().ok_or_else(|| TlsError::Content {
            path: paths.cert.clone(),
            problem: "the certificate has no DNS subject alternative name; \
                      the node's name is taken from it"
                .into(),
        })?;
        let node_name =
            NodeName::parse("certificate DNS name", first).map_err(|e| TlsError::Content {
                path: paths.cert.clone(),
                problem: e.to_string(),
            })?;

        let mut roots = RootCertStore::empty();
        for ca in load_certs(&paths.ca)? {
            roots.add(ca).map_err(|source| TlsError::Config {
                what: format!("CA bundle {}", paths.ca.display()),
                source,
            })?;
        }
        let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), crypto())
            .build()
            .map_err(|e| TlsError::Content {
                path: paths.ca.clone(),
                problem: format!("cannot verify clients with this CA: {e}"),
            })?;
        let mut config = rustls::ServerConfig::builder_with_provider(crypto())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Config {
                what: "protocol versions".into(),
                source,
            })?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|source| TlsError::Config {
                what: format!(
                    "certificate {} with key {}",
                    paths.cert.display(),
                    paths.key.display()
                ),
                source,
            })?;
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Self {
            config: Arc::new(config),
            node_name,
        })
    }
}

/// Accepts TCP connections and completes mTLS handshakes off the accept
/// path, yielding only finished sessions whose client certificate names
/// `plane_name` (when set). Every refusal is logged with the peer address and
/// the reason; plaintext never gets past the handshake.
///
/// The returned channel closes when `cancel` fires.
pub fn accept(
    listener: TcpListener,
    config: Arc<rustls::ServerConfig>,
    plane_name: Option<String>,
    cancel: CancellationToken,
) -> mpsc::Receiver<Result<TlsStream<TcpStream>, io::Error>> {
    let (tx, rx) = mpsc::channel(MAX_PENDING_HANDSHAKES);
    let acceptor = TlsAcceptor::from(config);
    let permits = Arc::new(tokio::sync::Semaphore::new(MAX_PENDING_HANDSHAKES));
    tokio::spawn(
        async move {
            loop {
                let accepted = tokio::select! {
                    () = cancel.cancelled() => return,
                    accepted = listener.accept() => accepted,
                };
                let (tcp, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let Ok(permit) = Arc::clone(&permits).acquire_owned().await else {
                    return;
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                let plane_name = plane_name.clone();
                tokio::spawn(async move {
                    let _permit = permit;
                    if let Some(stream) =
                        handshake(acceptor, tcp, peer, plane_name.as_deref()).await
                    {
                        let _ = tx.send(Ok(stream)).await;
                    }
                });
            }
        }
        .instrument(info_span!("tls_accept")),
    );
    rx
}

async fn handshake(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    peer: SocketAddr,
    plane_name: Option<&str>,
) -> Option<TlsStream<TcpStream>> {
    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Err(_) => {
            warn!(%peer, "refused a connection: no TLS handshake within {HANDSHAKE_TIMEOUT:?}");
            return None;
        }
        Ok(Err(e)) => {
            warn!(%peer, error = %e, "refused a connection: TLS handshake failed (plaintext, no client certificate, or one this deployment's CA did not issue)");
            return None;
        }
        Ok(Ok(stream)) => stream,
    };
    if let Some(expected) = plane_name {
        let names = stream
            .get_ref()
            .1
            .peer_certificates()
            .and_then(|c| c.first())
            .map(dns_names);
        match names {
            Some(Ok(names)) if names.iter().any(|n| n == expected) => {}
            Some(Ok(names)) => {
                warn!(%peer, ?names, expected, "refused a connection: the client certificate does not name the configured plane");
                return None;
            }
            _ => {
                warn!(%peer, "refused a connection: unreadable client certificate");
                return None;
            }
        }
    }
    debug!(%peer, "mTLS session established");
    Some(stream)
}
