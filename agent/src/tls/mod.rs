//! mTLS material for the node's listener: certificate loading, the node's
//! name taken from its own certificate, and the watch that swaps the
//! material without a restart. The accept loop that runs every handshake
//! through it is [`crate::tls::accept`].

pub(crate) mod accept;
pub(crate) mod enroll;

use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::RootCertStore;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use thiserror::Error;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::clock::PlaneClock;
use crate::model::NodeName;

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
    /// When the certificate expires, if readable.
    pub not_after: Option<SystemTime>,
    /// When the certificate became valid, if readable.
    pub not_before: Option<SystemTime>,
    /// The certificate had expired when it was loaded (only
    /// [`NodeTls::load_at_start`] accepts one).
    pub expired: bool,
}

/// A certificate's validity window: `(not_before, not_after)`, each `None`
/// when unreadable.
pub(crate) type Validity = (Option<SystemTime>, Option<SystemTime>);

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
    parse_certs(&read(path)?, path)
}

/// Parses every certificate in PEM `bytes`; `path` names them in errors.
///
/// # Errors
///
/// [`TlsError::Content`] when `bytes` hold no certificate.
pub(crate) fn parse_certs(
    bytes: &[u8],
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = rustls_pemfile::certs(&mut &bytes[..])
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
    parse_key(&read(path)?, path)
}

/// Parses the first private key in PEM `bytes`; `path` names it in errors.
///
/// # Errors
///
/// [`TlsError::Content`] when `bytes` hold no key; the key's bytes never
/// appear in an error.
pub(crate) fn parse_key(bytes: &[u8], path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    rustls_pemfile::private_key(&mut &bytes[..])
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
pub(crate) fn dns_names(cert: &CertificateDer<'_>) -> Result<Vec<String>, String> {
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
        Self::from_parts(
            paths,
            load_certs(&paths.cert)?,
            load_key(&paths.key)?,
            Lapsed::Refuse,
        )
    }

    /// As [`NodeTls::load`], valid at `at` rather than now: the plane's
    /// time ([`crate::clock::PlaneClock::now`]), which the reload of
    /// replaced files judges by.
    ///
    /// # Errors
    ///
    /// As [`NodeTls::load`].
    pub(crate) fn load_at(paths: &TlsPaths, at: SystemTime) -> Result<Self, TlsError> {
        Self::from_parts_at(
            paths,
            load_certs(&paths.cert)?,
            load_key(&paths.key)?,
            Lapsed::Refuse,
            at,
        )
    }

    /// As [`NodeTls::load`], except that a certificate that has expired,
    /// but otherwise verifies (it chains to the CA and was valid for its
    /// name during its lifetime, its key matches), is accepted, with
    /// [`NodeTls::expired`] set: a node started on it keeps the compute it
    /// holds and is re-enrolled through its local socket, since no plane
    /// can attach to it. Malformed files, another CA, a name that does not
    /// verify and a key that does not match are refused as by
    /// [`NodeTls::load`]. A certificate not valid yet is served when it
    /// starts within [`START_CLOCK_SKEW`] (this node's clock is behind the
    /// plane's that dated it; the plane judges it by its own), with a
    /// warning, and refused when it starts later.
    ///
    /// # Errors
    ///
    /// As [`NodeTls::load`], expiry excepted.
    pub(crate) fn load_at_start(paths: &TlsPaths) -> Result<Self, TlsError> {
        Self::from_parts(
            paths,
            load_certs(&paths.cert)?,
            load_key(&paths.key)?,
            Lapsed::Tolerate,
        )
    }

    /// Checks a certificate chain and key that are not on disk yet (a
    /// renewal's, an enrolment's) as [`NodeTls::load`] checks files: against
    /// the CA at `paths.ca`, the key matching, but valid at `at`, the time
    /// the plane's clock reads ([`crate::clock::PlaneClock::now`]):
    /// the plane dates what it signs by its own clock and judges the
    /// certificate by it, so a node whose clock is behind must not refuse
    /// a fresh certificate as not valid yet. Errors name `paths`' files,
    /// where they are about to be written.
    ///
    /// # Errors
    ///
    /// As [`NodeTls::load`].
    pub(crate) fn from_pem_at(
        paths: &TlsPaths,
        cert_pem: &[u8],
        key_pem: &[u8],
        at: SystemTime,
    ) -> Result<Self, TlsError> {
        Self::from_parts_at(
            paths,
            parse_certs(cert_pem, &paths.cert)?,
            parse_key(key_pem, &paths.key)?,
            Lapsed::Refuse,
            at,
        )
    }

    fn from_parts(
        paths: &TlsPaths,
        certs: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        lapsed: Lapsed,
    ) -> Result<Self, TlsError> {
        Self::from_parts_at(paths, certs, key, lapsed, SystemTime::now())
    }

    fn from_parts_at(
        paths: &TlsPaths,
        certs: Vec<CertificateDer<'static>>,
        key: PrivateKeyDer<'static>,
        lapsed: Lapsed,
        at: SystemTime,
    ) -> Result<Self, TlsError> {
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
        let roots = Arc::new(roots);
        // The node's own certificate must chain to the deployment CA, carry
        // its name and be valid now: a plane would refuse it otherwise.
        let own =
            rustls::client::WebPkiServerVerifier::builder_with_provider(roots.clone(), crypto())
                .build()
                .map_err(|e| TlsError::Content {
                    path: paths.ca.clone(),
                    problem: format!("cannot verify certificates with this CA: {e}"),
                })?;
        let server_name = rustls::pki_types::ServerName::try_from(node_name.as_str().to_owned())
            .map_err(|e| TlsError::Content {
                path: paths.cert.clone(),
                problem: format!("the DNS name is not a valid server name: {e}"),
            })?;
        let (not_before, not_after) = validity(&certs[0]);
        let verify = |at: rustls::pki_types::UnixTime| {
            rustls::client::danger::ServerCertVerifier::verify_server_cert(
                own.as_ref(),
                &certs[0],
                &certs[1..],
                &server_name,
                &[],
                at,
            )
        };
        let refused = |e: rustls::Error| TlsError::Content {
            path: paths.cert.clone(),
            problem: format!(
                "does not verify against the CA bundle {} for name {node_name}: {e}",
                paths.ca.display()
            ),
        };
        let at_unix = rustls::pki_types::UnixTime::since_unix_epoch(
            at.duration_since(UNIX_EPOCH).unwrap_or_default(),
        );
        let inside_lifetime = || match (not_before, not_after) {
            (Some(b), Some(a)) => a
                .duration_since(b)
                .ok()
                .map(|life| b + life / 2)
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok()),
            _ => None,
        };
        let expired = match verify(at_unix) {
            Ok(_) => false,
            Err(e)
                if lapsed == Lapsed::Tolerate
                    && is_not_yet_valid(&e)
                    && not_before.is_some_and(|b| {
                        b.duration_since(at).unwrap_or_default() <= START_CLOCK_SKEW
                    }) =>
            {
                // Starting within the skew a healthy node may have from
                // the plane's clock (which dated it): this node is behind,
                // and the plane, which judges it, will accept it.
                let inside = inside_lifetime().ok_or_else(|| refused(e.clone()))?;
                verify(rustls::pki_types::UnixTime::since_unix_epoch(inside)).map_err(refused)?;
                warn!(
                    cert = %paths.cert.display(),
                    starts_in_secs = not_before
                        .and_then(|b| b.duration_since(at).ok())
                        .map_or(0, |d| d.as_secs()),
                    "the node's certificate is not valid yet by this node's clock; serving it, since the plane that dated it judges it by its own (this node's clock is behind; billet node status shows by how much once the plane attaches)"
                );
                false
            }
            Err(e) if lapsed == Lapsed::Tolerate && is_expiry(&e) => {
                // Everything but the date is checked again, as of a moment
                // inside the certificate's own lifetime.
                let inside = inside_lifetime().ok_or_else(|| refused(e.clone()))?;
                verify(rustls::pki_types::UnixTime::since_unix_epoch(inside)).map_err(refused)?;
                true
            }
            Err(e) => return Err(refused(e)),
        };
        let verifier = WebPkiClientVerifier::builder_with_provider(roots, crypto())
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
            not_after,
            not_before,
            expired,
        })
    }
}

/// Whether [`NodeTls`] loading accepts a certificate that has expired.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Lapsed {
    /// Refused, as every other fault (renewals, enrolments, replacements).
    Refuse,
    /// Accepted at start-up, when everything else verifies.
    Tolerate,
}

/// How far in this node's future a certificate may start and still be
/// served at start-up, before any plane has said what its clock reads: the
/// clock offset a node may have and stay healthy (`CLOCK_OFFSET_LIMIT` in
/// `node/health.rs`, 10 minutes). A certificate the plane dated a moment
/// ago starts up to that far ahead of a node that is behind.
pub(crate) const START_CLOCK_SKEW: Duration = Duration::from_secs(10 * 60);

/// Whether rustls refused a certificate only for not being valid yet.
fn is_not_yet_valid(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::InvalidCertificate(
            rustls::CertificateError::NotValidYet
                | rustls::CertificateError::NotValidYetContext { .. }
        )
    )
}

/// Whether rustls refused a certificate only for having expired.
fn is_expiry(e: &rustls::Error) -> bool {
    matches!(
        e,
        rustls::Error::InvalidCertificate(
            rustls::CertificateError::Expired | rustls::CertificateError::ExpiredContext { .. }
        )
    )
}

/// When a certificate starts and stops being valid, where readable.
pub(crate) fn validity(cert: &CertificateDer<'_>) -> Validity {
    let Ok((_, parsed)) = x509_parser::parse_x509_certificate(cert.as_ref()) else {
        return (None, None);
    };
    let at = |secs: i64| Some(UNIX_EPOCH + Duration::from_secs(u64::try_from(secs).ok()?));
    (
        at(parsed.validity().not_before.timestamp()),
        at(parsed.validity().not_after.timestamp()),
    )
}

/// How often the TLS files are checked for changes, and how early an
/// approaching expiry is warned about.
#[derive(Debug, Clone, Copy)]
pub struct ReloadPolicy {
    /// Time between checks of the files (SIGHUP checks at once).
    pub interval: Duration,
    /// Warn (daily) when the certificate expires within this.
    pub expiry_warning: Duration,
}

impl Default for ReloadPolicy {
    fn default() -> Self {
        Self {
            interval: Duration::from_secs(10),
            expiry_warning: Duration::from_secs(7 * 24 * 3600),
        }
    }
}

fn read_all(paths: &TlsPaths) -> Option<[Vec<u8>; 3]> {
    Some([
        std::fs::read(&paths.cert).ok()?,
        std::fs::read(&paths.key).ok()?,
        std::fs::read(&paths.ca).ok()?,
    ])
}

fn warn_if_expiring(
    tls: &NodeTls,
    paths: &TlsPaths,
    policy: &ReloadPolicy,
    now: SystemTime,
) -> bool {
    let Some(not_after) = tls.not_after else {
        return false;
    };
    let left = not_after.duration_since(now).unwrap_or_default();
    if left <= policy.expiry_warning {
        warn!(
            cert = %paths.cert.display(),
            days_left = left.as_secs() / 86_400,
            hours_left = left.as_secs() / 3600,
            "the node's certificate expires soon; put a renewed one in place (it is picked up without a restart)"
        );
        return true;
    }
    false
}

/// The node's identity files as the reload path owns them: a writer
/// ([`IdentityFiles::replace`], a renewal or an enrolment) and the watcher
/// take turns on them, so the watcher never reads a new key beside the old
/// certificate, and the writer wakes the watcher at once instead of waiting
/// for its next check.
#[derive(Debug, Clone)]
pub(crate) struct IdentityFiles {
    paths: TlsPaths,
    turn: Arc<tokio::sync::Mutex<()>>,
    check_now: Arc<tokio::sync::Notify>,
    validity: watch::Receiver<Validity>,
}

/// Mode of the private key file the node writes.
const KEY_FILE_MODE: u32 = 0o600;
/// Mode of the certificate file the node writes.
const CERT_FILE_MODE: u32 = 0o644;
/// How long [`IdentityFiles::replace`] waits for the watcher to serve what
/// it wrote.
const SWAP_WAIT: Duration = Duration::from_secs(10);

impl IdentityFiles {
    /// Where the files are.
    pub(crate) fn paths(&self) -> &TlsPaths {
        &self.paths
    }

    /// The validity window of the certificate in force.
    pub(crate) fn validity(&self) -> Validity {
        *self.validity.borrow()
    }

    /// Watches the validity window of the certificate in force.
    pub(crate) fn watch_validity(&self) -> watch::Receiver<Validity> {
        self.validity.clone()
    }

    /// Writes a new certificate chain and key over the identity files, each
    /// through a temporary file renamed into place (the key 0600), while the
    /// watcher waits; then has the watcher load, check and serve them through
    /// the reload path, and waits until the certificate in force is the new
    /// one (its `not_after` is `expect_not_after`). The caller has checked
    /// them (`NodeTls::from_pem`).
    ///
    /// # Errors
    ///
    /// [`TlsError::Read`] naming the file that could not be written (its
    /// directory must be writable by the node); [`TlsError::Content`] when
    /// the watcher did not put the new certificate in force within 10 s.
    pub(crate) async fn replace(
        &self,
        cert_pem: &[u8],
        key_pem: &[u8],
        expect_not_after: Option<SystemTime>,
    ) -> Result<(), TlsError> {
        {
            let _turn = self.turn.lock().await;
            let key_tmp = write_temporary(&self.paths.key, key_pem, KEY_FILE_MODE)?;
            let cert_tmp = write_temporary(&self.paths.cert, cert_pem, CERT_FILE_MODE)?;
            rename(&key_tmp, &self.paths.key)?;
            rename(&cert_tmp, &self.paths.cert)?;
        }
        self.check_now.notify_one();
        let mut validity = self.validity.clone();
        let swapped = tokio::time::timeout(
            SWAP_WAIT,
            validity.wait_for(|(_, not_after)| *not_after == expect_not_after),
        )
        .await;
        match swapped {
            Ok(Ok(_)) => Ok(()),
            _ => Err(TlsError::Content {
                path: self.paths.cert.clone(),
                problem: format!(
                    "written, but not in force after {SWAP_WAIT:?}; the reload's warning says why"
                ),
            }),
        }
    }
}

/// Writes `contents` to a fresh temporary file beside `path` with `mode`,
/// synced; answers its path.
fn write_temporary(path: &Path, contents: &[u8], mode: u32) -> Result<PathBuf, TlsError> {
    use std::io::Write as _;
    use std::os::unix::fs::{OpenOptionsExt as _, PermissionsExt as _};
    let name = path
        .file_name()
        .map_or_else(|| "identity".into(), |n| n.to_string_lossy().into_owned());
    let tmp = path.with_file_name(format!(".{name}.new"));
    let fail = |source| TlsError::Read {
        path: tmp.clone(),
        source,
    };
    match std::fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(e)),
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .map_err(fail)?;
    file.set_permissions(std::fs::Permissions::from_mode(mode))
        .and_then(|()| file.write_all(contents))
        .and_then(|()| file.sync_all())
        .map_err(fail)?;
    Ok(tmp)
}

fn rename(from: &Path, to: &Path) -> Result<(), TlsError> {
    std::fs::rename(from, to).map_err(|source| TlsError::Read {
        path: to.to_owned(),
        source,
    })
}

/// Re-reads the certificate, key and CA when they change (checked every
/// `policy.interval`, at once on SIGHUP, and at once after an
/// [`IdentityFiles::replace`]) and publishes each new configuration that
/// validates: new connections use it at once, sessions already open keep
/// theirs. A replacement that fails validation (a key that does not match,
/// a chain that does not verify, an expired or not yet valid certificate,
/// another node's name) leaves the current configuration in place, with a
/// warning naming the file. Warns daily while the certificate is within
/// `policy.expiry_warning` of expiring. Dates are read on `clock`, the
/// plane's clock as this node reads it (the plane dates what it signs and
/// judges it; a node behind would otherwise refuse a fresh renewal as not
/// valid yet). Returns the configuration in force and the handle on the
/// files, which also watches the validity window of the certificate in
/// force.
pub(crate) fn watch_files(
    paths: TlsPaths,
    initial: &NodeTls,
    policy: ReloadPolicy,
    clock: Arc<PlaneClock>,
    cancel: CancellationToken,
) -> (watch::Receiver<Arc<rustls::ServerConfig>>, IdentityFiles) {
    let (tx, rx) = watch::channel(initial.config.clone());
    let (validity_tx, validity_rx) = watch::channel((initial.not_before, initial.not_after));
    let node_name = initial.node_name.clone();
    let mut warned_at = warn_if_expiring(initial, &paths, &policy, clock.now()).then(Instant::now);
    let mut current = initial.clone();
    let files = IdentityFiles {
        paths: paths.clone(),
        turn: Arc::default(),
        check_now: Arc::default(),
        validity: validity_rx,
    };
    let (turn, check_now) = (files.turn.clone(), files.check_now.clone());
    tokio::spawn(
        async move {
            let mut seen = read_all(&paths);
            let mut hangup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
            loop {
                let hup = async {
                    match hangup.as_mut() {
                        Some(h) => {
                            h.recv().await;
                        }
                        None => std::future::pending().await,
                    }
                };
                tokio::select! {
                    () = cancel.cancelled() => return,
                    () = tokio::time::sleep(policy.interval) => {}
                    () = check_now.notified() => {}
                    () = hup => info!("SIGHUP: checking the TLS files"),
                }
                // A writer replacing the files finishes first.
                let _turn = turn.lock().await;
                let now = read_all(&paths);
                if now.is_some() && now != seen {
                    seen = now;
                    match NodeTls::load_at(&paths, clock.now()) {
                        Ok(fresh) if fresh.node_name != node_name => warn!(
                            cert = %paths.cert.display(),
                            old = %node_name,
                            new = %fresh.node_name,
                            "refused a replacement certificate for another node; still serving the old one"
                        ),
                        Ok(fresh) => {
                            info!(cert = %paths.cert.display(), "TLS material replaced; new connections use it");
                            tx.send_replace(fresh.config.clone());
                            validity_tx.send_replace((fresh.not_before, fresh.not_after));
                            current = fresh;
                            warned_at = None;
                        }
                        Err(e) => warn!(error = %e, "refused the replacement TLS material; still serving the old one"),
                    }
                }
                if warned_at.is_none_or(|t| t.elapsed() >= Duration::from_secs(86_400))
                    && warn_if_expiring(&current, &paths, &policy, clock.now())
                {
                    warned_at = Some(Instant::now());
                }
            }
        }
        .instrument(info_span!("tls_reload")),
    );
    (rx, files)
}
