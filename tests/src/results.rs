//! A fake GitHub results service for the Actions cache proxy's tests: a
//! TLS server for `results-receiver.actions.githubusercontent.com` signed
//! by a CA of its own (its PEM in a file, for the node's
//! `--actions-results-ca`), on a free port of `127.0.0.1` (the node's
//! `--actions-results-upstream`). It keeps every request it is sent (head
//! and `Content-Length` body) and answers each `299 From GitHub` with the
//! body `upstream`, keeping the connection, so a test tells what the
//! proxy spliced from what it answered itself.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio_util::sync::CancellationToken;

/// The host the node intercepts.
pub const RESULTS_HOST: &str = "results-receiver.actions.githubusercontent.com";
/// The status the fake answers everything with.
pub const UPSTREAM_STATUS: u16 = 299;

/// One request the fake was sent.
#[derive(Debug, Clone)]
pub struct Seen {
    /// The request line and headers, as sent.
    pub head: String,
    /// The body.
    pub body: Vec<u8>,
}

/// The fake; stops when dropped.
#[derive(Debug)]
pub struct FakeResults {
    addr: SocketAddr,
    ca_file: PathBuf,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: CancellationToken,
}

impl Drop for FakeResults {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl FakeResults {
    /// Serves on a free port of `127.0.0.1`, its CA written to
    /// `dir/results-ca.pem`.
    ///
    /// # Errors
    ///
    /// When the certificates cannot be made or the port bound.
    pub async fn start(dir: &Path) -> Result<Self> {
        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
        let mut ca = CertificateParams::default();
        ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let ca_key = KeyPair::generate()?;
        let ca_cert = ca.self_signed(&ca_key)?;
        let issuer = Issuer::new(ca, ca_key);
        let mut leaf = CertificateParams::default();
        leaf.subject_alt_names = vec![SanType::DnsName(RESULTS_HOST.try_into()?)];
        let leaf_key = KeyPair::generate()?;
        let leaf_cert = leaf.signed_by(&leaf_key, &issuer)?;
        let ca_file = dir.join("results-ca.pem");
        std::fs::write(&ca_file, ca_cert.pem())
            .with_context(|| format!("write {}", ca_file.display()))?;
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ServerConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf_cert.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
            )?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let seen: Arc<Mutex<Vec<Seen>>> = Arc::default();
        let stop = CancellationToken::new();
        let (kept, stopped) = (seen.clone(), stop.clone());
        tokio::spawn(async move {
            loop {
                let tcp = tokio::select! {
                    () = stopped.cancelled() => return,
                    a = listener.accept() => match a {
                        Ok((tcp, _)) => tcp,
                        Err(_) => return,
                    },
                };
                let (acceptor, kept, stopped) = (acceptor.clone(), kept.clone(), stopped.clone());
                tokio::spawn(async move {
                    let Ok(mut tls) = acceptor.accept(tcp).await else {
                        return;
                    };
                    loop {
                        let message = tokio::select! {
                            () = stopped.cancelled() => return,
                            m = read_message(&mut tls) => m,
                        };
                        let Some(seen) = message else {
                            return;
                        };
                        kept.lock().expect("seen").push(seen);
                        let answer = format!(
                            "HTTP/1.1 {UPSTREAM_STATUS} From GitHub\r\nContent-Length: 8\r\n\r\nupstream"
                        );
                        if tls.write_all(answer.as_bytes()).await.is_err() {
                            return;
                        }
                        let _ = tls.flush().await;
                    }
                });
            }
        });
        Ok(Self {
            addr,
            ca_file,
            seen,
            stop,
        })
    }

    /// Every request so far, in order.
    #[must_use]
    pub fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen").clone()
    }

    /// The node's environment that puts its proxy on loopback (where the
    /// cluster's runners, on the host's network, reach it) and points it
    /// here.
    #[must_use]
    pub fn node_env(&self) -> Vec<(String, String)> {
        vec![
            ("BILLET_CACHE_PROXY_LISTEN".into(), "127.0.0.1:0".into()),
            (
                "BILLET_ACTIONS_RESULTS_UPSTREAM".into(),
                self.addr.to_string(),
            ),
            (
                "BILLET_ACTIONS_RESULTS_CA".into(),
                self.ca_file.display().to_string(),
            ),
        ]
    }
}

/// The `Content-Length` of an HTTP/1.1 head (its text), 0 when absent.
#[must_use]
pub fn content_length(head: &str) -> usize {
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0)
}

/// Reads one HTTP/1.1 request: its head and its `Content-Length` body.
async fn read_message<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Option<Seen> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.ok()? == 0 || buf.len() > 1 << 20 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let mut body = vec![0u8; content_length(&head)];
    s.read_exact(&mut body).await.ok()?;
    Some(Seen { head, body })
}
