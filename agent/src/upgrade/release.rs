//! Releases: what `billet host-upgrade` installs, and where it finds them.
//!
//! A release source is a local directory or an `https://` URL. Release `V`
//! lives under `<source>/V/`: a manifest, `manifest.json`, and the binaries
//! it names beside it. The rollout pins the manifest by its SHA-256 (over
//! the file's exact bytes); the manifest pins each binary by its SHA-256.
//!
//! ```json
//! { "version": "1.4.2",
//!   "artifacts": [ { "os": "linux", "arch": "x86_64",
//!                    "path": "billet", "sha256": "<64 hex digits>" } ] }
//! ```
//!
//! [`write()`] makes such a directory from a built binary (the
//! `billet-release` tool), stamping the version into the copy
//! (`version.rs`).

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;

/// The manifest's file name inside a release directory.
pub const MANIFEST_FILE: &str = "manifest.json";
/// The largest manifest read, in bytes.
pub(crate) const MAX_MANIFEST_BYTES: u64 = 64 << 10;
/// The largest binary fetched, in bytes.
pub(crate) const MAX_BINARY_BYTES: u64 = 1 << 30;

/// A release manifest.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Manifest {
    /// The exact release.
    pub version: String,
    /// One binary per platform.
    pub artifacts: Vec<Artifact>,
}

/// One platform's binary in a release.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Artifact {
    /// As Rust names it (`std::env::consts::OS`): `linux`.
    pub os: String,
    /// As Rust names it (`std::env::consts::ARCH`): `x86_64`, `aarch64`.
    pub arch: String,
    /// The file name beside the manifest.
    pub path: String,
    /// Lower-case hex SHA-256 of the file.
    pub sha256: String,
}

/// Why a release cannot be used. Every message names the source and what to
/// fix there.
#[derive(Debug, Error)]
pub enum ReleaseError {
    /// The configured source is not a directory path or an `https://` URL
    /// (shown without any credentials, query or fragment).
    #[error("release source {}: give an absolute directory or an https:// URL", shown(.0))]
    Source(String),
    /// The configured URL carries credentials, a query or a fragment, any
    /// of which may be a secret and would reach logs and the plane.
    #[error(
        "release source {shown}: the URL carries {what}, which would reach logs and the plane in every message naming a release; give the plain https:// base URL the releases sit under (serve them without credentials, or from a directory)",
        shown = shown(configured)
    )]
    Secretive {
        /// What it carries.
        what: &'static str,
        /// The configured source.
        configured: String,
    },
    /// The source could not be read.
    #[error("{what}: {problem}")]
    Fetch {
        /// The file or URL.
        what: String,
        /// Why.
        problem: String,
    },
    /// The manifest is not what was pinned, or not a manifest of this
    /// release.
    #[error("{what}: {problem}")]
    Manifest {
        /// The manifest's location.
        what: String,
        /// What is wrong.
        problem: String,
    },
    /// The release has no binary for this host.
    #[error("release {version} has no binary for {os}/{arch}")]
    Platform {
        /// The release.
        version: String,
        /// This host's OS.
        os: String,
        /// This host's architecture.
        arch: String,
    },
    /// A fetched binary does not match the manifest.
    #[error("{what}: sha256 is {actual}, the manifest says {expected}")]
    Digest {
        /// The binary's location.
        what: String,
        /// What the manifest says.
        expected: String,
        /// What the bytes hash to.
        actual: String,
    },
    /// A local file could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// `source` for a message: whatever precedes its last `@` (where
/// credentials would be) and whatever follows a `?` or `#` after that
/// (a query or fragment, which may hold a token) replaced by `…`. It never
/// parses the URL, so a malformed one is hidden the same way.
fn shown(source: &str) -> String {
    let (scheme, rest) = match source.split_once("://") {
        Some((scheme, rest)) => (format!("{scheme}://"), rest),
        None => (String::new(), source),
    };
    let (hidden, rest) = match rest.rsplit_once('@') {
        Some((_, after)) => ("…@", after),
        None => ("", rest),
    };
    let rest = match rest.find(['?', '#']) {
        Some(i) => format!("{}…", &rest[..i]),
        None => rest.to_owned(),
    };
    format!("{scheme}{hidden}{rest}")
}

/// Lower-case hex SHA-256 of `bytes`.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(64), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

/// Whether `digest` is 64 lower- or upper-case hex digits.
pub(crate) fn is_sha256(digest: &str) -> bool {
    digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Where releases come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// A directory holding `<version>/manifest.json` and the binaries.
    Dir(PathBuf),
    /// An `https://` base URL, read the same way.
    Https {
        /// The base URL (ends in `/`).
        base: reqwest::Url,
        /// The client, trusting the system roots and any configured CA.
        client: reqwest::Client,
    },
}

impl Source {
    /// Parses the configured source: an absolute directory or an
    /// `https://` URL. `extra_ca` is a PEM bundle to trust besides the
    /// system roots (an internal mirror's CA).
    ///
    /// # Errors
    ///
    /// [`ReleaseError::Source`] for anything else, including `http://`;
    /// [`ReleaseError::Fetch`] when `extra_ca` cannot be read.
    pub(crate) fn parse(source: &str, extra_ca: Option<&Path>) -> Result<Self, ReleaseError> {
        if source.starts_with('/') {
            return Ok(Self::Dir(PathBuf::from(source)));
        }
        let Some(rest) = source.strip_prefix("https://") else {
            return Err(ReleaseError::Source(source.to_owned()));
        };
        if rest.is_empty() {
            return Err(ReleaseError::Source(source.to_owned()));
        }
        let with_slash = if source.ends_with('/') {
            source.to_owned()
        } else {
            format!("{source}/")
        };
        let base = reqwest::Url::parse(&with_slash)
            .map_err(|_| ReleaseError::Source(source.to_owned()))?;
        if !base.username().is_empty() || base.password().is_some() {
            return Err(ReleaseError::Secretive {
                what: "credentials",
                configured: source.to_owned(),
            });
        }
        if base.query().is_some() || base.fragment().is_some() {
            return Err(ReleaseError::Secretive {
                what: "a query or fragment",
                configured: source.to_owned(),
            });
        }
        let mut builder = reqwest::Client::builder()
            .https_only(true)
            .connect_timeout(std::time::Duration::from_secs(30))
            .timeout(std::time::Duration::from_secs(900));
        if let Some(ca) = extra_ca {
            let fail = |problem: String| ReleaseError::Fetch {
                what: ca.display().to_string(),
                problem,
            };
            let pem = std::fs::read(ca).map_err(|e| fail(format!("cannot read: {e}")))?;
            let certs = reqwest::Certificate::from_pem_bundle(&pem)
                .map_err(|e| fail(format!("not a PEM certificate bundle: {e}")))?;
            for cert in certs {
                builder = builder.add_root_certificate(cert);
            }
        }
        let client = builder.build().map_err(|e| ReleaseError::Fetch {
            what: source.to_owned(),
            problem: format!("cannot build an HTTPS client: {e}"),
        })?;
        Ok(Self::Https { base, client })
    }

    fn locate(&self, version: &str, file: &str) -> String {
        match self {
            Self::Dir(dir) => dir.join(version).join(file).display().to_string(),
            Self::Https { base, .. } => format!("{base}{version}/{file}"),
        }
    }

    /// The manifest of release `version`, its exact bytes and its location.
    ///
    /// # Errors
    ///
    /// [`ReleaseError::Fetch`] when it cannot be read or is too large.
    pub(crate) async fn manifest(&self, version: &str) -> Result<(Vec<u8>, String), ReleaseError> {
        let what = self.locate(version, MANIFEST_FILE);
        let mut bytes = Vec::new();
        self.fetch(version, MANIFEST_FILE, MAX_MANIFEST_BYTES, &mut bytes)
            .await?;
        Ok((bytes, what))
    }

    /// Fetches `artifact` of release `version` into `dest` (created 0700,
    /// replacing any file there) and checks its digest.
    ///
    /// # Errors
    ///
    /// [`ReleaseError::Fetch`], [`ReleaseError::Io`], or
    /// [`ReleaseError::Digest`] when the bytes are not the manifest's.
    pub(crate) async fn artifact(
        &self,
        version: &str,
        artifact: &Artifact,
        dest: &Path,
    ) -> Result<(), ReleaseError> {
        use std::os::unix::fs::OpenOptionsExt;
        let io = |source| ReleaseError::Io {
            path: dest.to_owned(),
            source,
        };
        let _ = std::fs::remove_file(dest);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o700)
            .open(dest)
            .map_err(io)?;
        let mut sink = Hashing {
            file: std::io::BufWriter::new(file),
            hash: Sha256::new(),
        };
        self.fetch(version, &artifact.path, MAX_BINARY_BYTES, &mut sink)
            .await?;
        let Hashing { file, hash } = sink;
        file.into_inner()
            .map_err(|e| io(e.into_error()))?
            .sync_all()
            .map_err(io)?;
        let actual = hex(&hash.finalize());
        if !actual.eq_ignore_ascii_case(&artifact.sha256) {
            let _ = std::fs::remove_file(dest);
            return Err(ReleaseError::Digest {
                what: self.locate(version, &artifact.path),
                expected: artifact.sha256.clone(),
                actual,
            });
        }
        Ok(())
    }

    async fn fetch(
        &self,
        version: &str,
        file: &str,
        limit: u64,
        sink: &mut impl Write,
    ) -> Result<(), ReleaseError> {
        let what = self.locate(version, file);
        let fail = |problem: String| ReleaseError::Fetch {
            what: what.clone(),
            problem,
        };
        let too_large = || fail(format!("larger than {limit} bytes"));
        match self {
            Self::Dir(_) => {
                let path = PathBuf::from(&what);
                let mut f =
                    std::fs::File::open(&path).map_err(|e| fail(format!("cannot read: {e}")))?;
                let len = f.metadata().map(|m| m.len()).unwrap_or(0);
                if len > limit {
                    return Err(too_large());
                }
                // The size on disk is not a bound (a device, a file that
                // grows): read at most one byte past the limit.
                let read = std::io::copy(&mut std::io::Read::take(&mut f, limit + 1), sink)
                    .map_err(|e| fail(format!("cannot read: {e}")))?;
                if read > limit {
                    return Err(too_large());
                }
            }
            Self::Https { base, client } => {
                let url = base
                    .join(&format!("{version}/{file}"))
                    .map_err(|e| fail(format!("not a URL: {e}")))?;
                let mut response = client
                    .get(url)
                    .send()
                    .await
                    .and_then(reqwest::Response::error_for_status)
                    .map_err(|e| fail(format!("cannot fetch: {}", causes(e))))?;
                let mut read = 0u64;
                while let Some(chunk) = response
                    .chunk()
                    .await
                    .map_err(|e| fail(format!("cannot fetch: {}", causes(e))))?
                {
                    read += chunk.len() as u64;
                    if read > limit {
                        return Err(too_large());
                    }
                    sink.write_all(&chunk)
                        .map_err(|e| fail(format!("cannot store: {e}")))?;
                }
            }
        }
        Ok(())
    }
}

/// A reqwest error with its causes, `: `-joined and without the URL (the
/// message already names it). reqwest's own text is only "error sending
/// request"; the cause (an untrusted certificate, a refused connection) is
/// what the operator has to fix.
fn causes(e: reqwest::Error) -> String {
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        let more = c.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        cause = c.source();
    }
    text
}

struct Hashing<W> {
    file: W,
    hash: Sha256,
}

impl<W: Write> Write for Hashing<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.file.write(buf)?;
        self.hash.update(&buf[..n]);
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush()
    }
}

/// Checks manifest `bytes` fetched from `what` against the pinned digest
/// (when the rollout pinned one) and parses it as the manifest of release
/// `version`.
///
/// # Errors
///
/// [`ReleaseError::Manifest`] naming the mismatch: another digest, not
/// JSON of this shape, another version, or an artifact path that is not a
/// plain file name or a digest that is not SHA-256.
pub(crate) fn check_manifest(
    bytes: &[u8],
    what: &str,
    pinned: Option<&str>,
    version: &str,
) -> Result<Manifest, ReleaseError> {
    let fail = |problem: String| ReleaseError::Manifest {
        what: what.to_owned(),
        problem,
    };
    if let Some(pinned) = pinned {
        let actual = sha256_hex(bytes);
        if !actual.eq_ignore_ascii_case(pinned) {
            return Err(fail(format!(
                "sha256 is {actual}, the rollout pinned {pinned}: the release was changed after it was pinned, or the rollout names another one"
            )));
        }
    }
    let manifest: Manifest =
        serde_json::from_slice(bytes).map_err(|e| fail(format!("not a release manifest: {e}")))?;
    if manifest.version != version {
        return Err(fail(format!(
            "describes release {}, not {version}",
            manifest.version
        )));
    }
    for a in &manifest.artifacts {
        // Letters, digits, `.`, `_`, `-`, not starting with `.`: the same
        // name in a directory and in a URL (no `/`, `\`, `%`-escapes or
        // `..` that a URL parser would resolve out of the release).
        let plain = a
            .path
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
            && !a.path.is_empty()
            && !a.path.starts_with('.')
            && a.path != MANIFEST_FILE;
        if !plain {
            return Err(fail(format!(
                "artifact path {:?} is not a file name beside the manifest",
                a.path
            )));
        }
        if !is_sha256(&a.sha256) {
            return Err(fail(format!(
                "artifact {:?} has sha256 {:?}, which is not 64 hex digits",
                a.path, a.sha256
            )));
        }
    }
    Ok(manifest)
}

/// The manifest's binary for this host.
///
/// # Errors
///
/// [`ReleaseError::Platform`] when there is none.
pub(crate) fn for_this_host(manifest: &Manifest) -> Result<&Artifact, ReleaseError> {
    let (os, arch) = (std::env::consts::OS, std::env::consts::ARCH);
    manifest
        .artifacts
        .iter()
        .find(|a| a.os == os && a.arch == arch)
        .ok_or_else(|| ReleaseError::Platform {
            version: manifest.version.clone(),
            os: os.to_owned(),
            arch: arch.to_owned(),
        })
}

/// Writes release `version` into `<root>/<version>/`, which must not exist
/// yet: `binary` (the bytes of a built `billet`) stamped with `version` and
/// saved as `billet`, and a manifest for this host's platform. Returns the
/// manifest's SHA-256, the digest a rollout pins.
///
/// # Errors
///
/// [`ReleaseError::Manifest`] when the binary cannot be stamped with that
/// version or the release already exists; [`ReleaseError::Io`] when the
/// directory cannot be written.
pub fn write(root: &Path, version: &str, mut binary: Vec<u8>) -> Result<String, ReleaseError> {
    crate::upgrade::version::stamp(&mut binary, version).map_err(|e| ReleaseError::Manifest {
        what: root.join(version).display().to_string(),
        problem: e.to_string(),
    })?;
    let dir = root.join(version);
    let io = |path: &Path| {
        let path = path.to_owned();
        move |source| ReleaseError::Io { path, source }
    };
    std::fs::create_dir_all(root).map_err(io(root))?;
    // A release is immutable once written: a rollout may have pinned it.
    std::fs::create_dir(&dir).map_err(|e| {
        if e.kind() == std::io::ErrorKind::AlreadyExists {
            ReleaseError::Manifest {
                what: dir.display().to_string(),
                problem: "already exists; a release is never rewritten (a rollout may have pinned it): give the new build another version".into(),
            }
        } else {
            io(&dir)(e)
        }
    })?;
    let bin = dir.join("billet");
    std::fs::write(&bin, &binary).map_err(io(&bin))?;
    std::fs::set_permissions(&bin, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(io(&bin))?;
    let manifest = Manifest {
        version: version.to_owned(),
        artifacts: vec![Artifact {
            os: std::env::consts::OS.to_owned(),
            arch: std::env::consts::ARCH.to_owned(),
            path: "billet".into(),
            sha256: sha256_hex(&binary),
        }],
    };
    let mut text = serde_json::to_vec_pretty(&manifest).map_err(|e| ReleaseError::Io {
        path: dir.join(MANIFEST_FILE),
        source: e.into(),
    })?;
    text.push(b'\n');
    let path = dir.join(MANIFEST_FILE);
    std::fs::write(&path, &text).map_err(io(&path))?;
    Ok(sha256_hex(&text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_billet() -> Vec<u8> {
        let mut b = b"#!binary\n".to_vec();
        b.extend_from_slice(crate::upgrade::version::STAMP_MARKER);
        b.extend_from_slice(&[0; crate::upgrade::version::STAMP_SLOT_BYTES]);
        b
    }

    fn scratch() -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("billet-release-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        dir
    }

    #[tokio::test]
    async fn a_written_release_reads_back_through_its_pinned_digest() {
        let root = scratch();
        let pinned = write(&root, "2.0.0", fake_billet()).expect("write");
        let source = Source::parse(root.to_str().expect("utf-8"), None).expect("source");
        let (bytes, what) = source.manifest("2.0.0").await.expect("manifest");
        let manifest = check_manifest(&bytes, &what, Some(&pinned), "2.0.0").expect("pinned");
        let artifact = for_this_host(&manifest).expect("this host");
        let dest = root.join("staged");
        source
            .artifact("2.0.0", artifact, &dest)
            .await
            .expect("fetch");
        let got = std::fs::read(&dest).expect("read");
        assert_eq!(
            crate::upgrade::version::stamped(&got).as_deref(),
            Some("2.0.0")
        );
    }

    #[test]
    fn a_release_is_never_rewritten() {
        let root = scratch();
        write(&root, "2.0.0", fake_billet()).expect("write");
        let e = write(&root, "2.0.0", fake_billet()).expect_err("rewritten");
        assert!(e.to_string().contains("never rewritten"), "{e}");
    }

    #[tokio::test]
    async fn a_manifest_or_binary_changed_after_pinning_is_refused() {
        let root = scratch();
        let pinned = write(&root, "2.0.0", fake_billet()).expect("write");
        let source = Source::parse(root.to_str().expect("utf-8"), None).expect("source");
        let (bytes, what) = source.manifest("2.0.0").await.expect("manifest");
        let other = "0".repeat(64);
        let e = check_manifest(&bytes, &what, Some(&other), "2.0.0").expect_err("other pin");
        assert!(e.to_string().contains("the rollout pinned"), "{e}");
        let e = check_manifest(&bytes, &what, Some(&pinned), "2.0.1").expect_err("version");
        assert!(
            e.to_string().contains("describes release 2.0.0, not 2.0.1"),
            "{e}"
        );

        let manifest = check_manifest(&bytes, &what, Some(&pinned), "2.0.0").expect("pinned");
        std::fs::write(root.join("2.0.0/billet"), b"tampered").expect("tamper");
        let dest = root.join("staged");
        let e = source
            .artifact("2.0.0", for_this_host(&manifest).expect("host"), &dest)
            .await
            .expect_err("tampered binary");
        assert!(matches!(e, ReleaseError::Digest { .. }), "{e}");
        assert!(
            !dest.exists(),
            "a binary that failed its digest is not left staged"
        );
    }

    /// A test-only HTTPS file server over tokio-rustls: `GET /<path>`
    /// answers `200` with the file under `root`, anything else `404`; one
    /// request per connection, then it closes.
    mod https {
        use std::path::{Path, PathBuf};
        use std::sync::Arc;

        use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
        use rustls::pki_types::{CertificateDer, PrivatePkcs8KeyDer};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        use tokio::net::{TcpListener, TcpStream};
        use tokio_rustls::TlsAcceptor;

        /// A running server; stops when dropped.
        pub(super) struct Server {
            /// `https://127.0.0.1:<port>`, no trailing slash.
            pub(super) origin: String,
            /// The PEM file of the CA that issued the server's certificate.
            pub(super) ca: PathBuf,
            task: tokio::task::JoinHandle<()>,
        }

        impl Drop for Server {
            fn drop(&mut self) {
                self.task.abort();
            }
        }

        /// Serves `root` with a fresh CA (written to `ca`) and a certificate
        /// for `127.0.0.1` and `localhost`.
        pub(super) async fn serve(root: &Path, ca: PathBuf) -> Server {
            let ca_key = KeyPair::generate().expect("CA key");
            let mut params = CertificateParams::default();
            params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            let ca_cert = params.self_signed(&ca_key).expect("CA");
            std::fs::write(&ca, ca_cert.pem()).expect("write CA");
            let issuer = Issuer::new(params, ca_key);
            let key = KeyPair::generate().expect("key");
            let leaf = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .expect("params")
                .signed_by(&key, &issuer)
                .expect("leaf");
            let chain: Vec<CertificateDer<'static>> =
                vec![leaf.der().clone(), ca_cert.der().clone()];
            let config = rustls::ServerConfig::builder_with_provider(Arc::new(
                rustls::crypto::aws_lc_rs::default_provider(),
            ))
            .with_safe_default_protocol_versions()
            .expect("versions")
            .with_no_client_auth()
            .with_single_cert(chain, PrivatePkcs8KeyDer::from(key.serialize_der()).into())
            .expect("server config");
            let acceptor = TlsAcceptor::from(Arc::new(config));
            let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
            let origin = format!("https://{}", listener.local_addr().expect("addr"));
            let root = root.to_owned();
            let task = tokio::spawn(async move {
                while let Ok((tcp, _)) = listener.accept().await {
                    // A refused handshake is some tests' point: ignore it.
                    tokio::spawn(answer(acceptor.clone(), tcp, root.clone()));
                }
            });
            Server { origin, ca, task }
        }

        async fn answer(
            acceptor: TlsAcceptor,
            tcp: TcpStream,
            root: PathBuf,
        ) -> std::io::Result<()> {
            let mut tls = acceptor.accept(tcp).await?;
            let mut head = Vec::new();
            let mut buf = [0u8; 1024];
            while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                let n = tls.read(&mut buf).await?;
                if n == 0 || head.len() > 16 << 10 {
                    return Ok(());
                }
                head.extend_from_slice(&buf[..n]);
            }
            let head = String::from_utf8_lossy(&head);
            let mut line = head.lines().next().unwrap_or_default().split(' ');
            let (method, target) = (line.next(), line.next().unwrap_or_default());
            let file = match target.strip_prefix('/') {
                Some(rel)
                    if method == Some("GET")
                        && rel
                            .split('/')
                            .all(|c| !c.is_empty() && c != "." && c != "..") =>
                {
                    std::fs::read(root.join(rel)).ok()
                }
                _ => None,
            };
            let (status, body) = match file {
                Some(bytes) => ("200 OK", bytes),
                None => ("404 Not Found", b"not found\n".to_vec()),
            };
            let header = format!(
                "HTTP/1.1 {status}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
                body.len()
            );
            tls.write_all(header.as_bytes()).await?;
            tls.write_all(&body).await?;
            tls.shutdown().await
        }
    }

    /// A release written under `<root>/mirror` and served over HTTPS: the
    /// server, and the source URL (`<origin>/mirror`).
    async fn served_release(root: &Path, version: &str) -> (https::Server, String, String) {
        let pinned = write(&root.join("mirror"), version, fake_billet()).expect("write");
        let server = https::serve(root, root.join("ca.pem")).await;
        let url = format!("{}/mirror", server.origin);
        (server, url, pinned)
    }

    #[tokio::test]
    async fn a_release_served_over_https_reads_back_trusting_the_configured_ca() {
        let root = scratch();
        let (server, url, pinned) = served_release(&root, "2.0.0").await;
        let source = Source::parse(&url, Some(&server.ca)).expect("source");
        let (bytes, what) = source.manifest("2.0.0").await.expect("manifest");
        assert_eq!(what, format!("{url}/2.0.0/{MANIFEST_FILE}"));
        let manifest = check_manifest(&bytes, &what, Some(&pinned), "2.0.0").expect("pinned");
        let dest = root.join("staged");
        source
            .artifact("2.0.0", for_this_host(&manifest).expect("host"), &dest)
            .await
            .expect("fetch");
        let got = std::fs::read(&dest).expect("read");
        assert_eq!(
            crate::upgrade::version::stamped(&got).as_deref(),
            Some("2.0.0")
        );
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&dest).expect("stat").permissions(),
        );
        assert_eq!(mode & 0o777, 0o700);
    }

    #[tokio::test]
    async fn a_server_whose_ca_is_not_configured_is_refused() {
        let root = scratch();
        let (_server, url, _) = served_release(&root, "2.0.0").await;
        let source = Source::parse(&url, None).expect("source");
        let e = source.manifest("2.0.0").await.expect_err("untrusted");
        let message = e.to_string();
        assert!(matches!(e, ReleaseError::Fetch { .. }), "{message}");
        assert!(
            message.contains(&format!("{url}/2.0.0/{MANIFEST_FILE}")),
            "{message}"
        );
        // The cause, not only reqwest's "error sending request".
        assert!(message.contains("certificate"), "{message}");
        assert!(message.contains("UnknownIssuer"), "{message}");
    }

    #[tokio::test]
    async fn a_release_missing_from_the_server_names_the_url() {
        let root = scratch();
        let (server, url, _) = served_release(&root, "2.0.0").await;
        let source = Source::parse(&url, Some(&server.ca)).expect("source");
        let e = source.manifest("9.9.9").await.expect_err("missing");
        let message = e.to_string();
        assert!(matches!(e, ReleaseError::Fetch { .. }), "{message}");
        assert!(
            message.contains(&format!("{url}/9.9.9/{MANIFEST_FILE}")),
            "{message}"
        );
        assert!(message.contains("404"), "{message}");
    }

    /// `MAX_BINARY_BYTES` (1 GiB) is too large to serve in a unit test; the
    /// manifest's limit goes through the same streaming check.
    #[tokio::test]
    async fn a_manifest_larger_than_the_limit_is_refused_over_https() {
        let root = scratch();
        let (server, url, _) = served_release(&root, "2.0.0").await;
        let big = vec![b' '; usize::try_from(MAX_MANIFEST_BYTES).expect("fits") + 1];
        std::fs::create_dir_all(root.join("mirror/3.0.0")).expect("dir");
        std::fs::write(root.join("mirror/3.0.0").join(MANIFEST_FILE), big).expect("write");
        let source = Source::parse(&url, Some(&server.ca)).expect("source");
        let e = source.manifest("3.0.0").await.expect_err("too large");
        let message = e.to_string();
        assert!(matches!(e, ReleaseError::Fetch { .. }), "{message}");
        assert!(
            message.contains(&format!("{url}/3.0.0/{MANIFEST_FILE}")),
            "{message}"
        );
        assert!(
            message.contains(&format!("larger than {MAX_MANIFEST_BYTES} bytes")),
            "{message}"
        );
    }

    #[test]
    fn manifests_naming_paths_outside_the_release_are_refused() {
        for path in [
            "../billet",
            "/usr/bin/billet",
            "",
            "..",
            MANIFEST_FILE,
            "..\\..\\other\\billet",
            "%2e%2e",
            ".hidden",
            "bil let",
            "billet?x",
        ] {
            let m = Manifest {
                version: "1".into(),
                artifacts: vec![Artifact {
                    os: "linux".into(),
                    arch: "x86_64".into(),
                    path: path.into(),
                    sha256: "a".repeat(64),
                }],
            };
            let bytes = serde_json::to_vec(&m).expect("json");
            assert!(
                check_manifest(&bytes, "m", None, "1").is_err(),
                "{path:?} accepted"
            );
        }
    }

    #[test]
    fn only_directories_and_https_are_sources() {
        for bad in ["http://releases.example", "releases", "ftp://x", "https://"] {
            assert!(
                matches!(Source::parse(bad, None), Err(ReleaseError::Source(_))),
                "{bad} accepted"
            );
        }
        assert!(matches!(
            Source::parse("https://releases.example/billet", None),
            Ok(Source::Https { .. })
        ));
        // A plain `http://` URL with credentials is refused without
        // showing them.
        let e = Source::parse("http://user:pw@releases.example/r", None)
            .expect_err("http")
            .to_string();
        assert!(
            !e.contains("pw") && e.contains("…@releases.example/r"),
            "{e}"
        );
    }

    #[test]
    fn a_url_carrying_credentials_a_query_or_a_fragment_is_refused_without_showing_them() {
        for (url, what) in [
            ("https://user:s3cret@releases.example/r", "credentials"),
            ("https://tok3n@releases.example/r", "credentials"),
            (
                "https://releases.example/r?token=s3cret",
                "a query or fragment",
            ),
            ("https://releases.example/r#s3cret", "a query or fragment"),
        ] {
            let e = Source::parse(url, None).expect_err(url).to_string();
            assert!(e.contains(what), "{url}: {e}");
            assert!(!e.contains("s3cret") && !e.contains("tok3n"), "{url}: {e}");
            assert!(e.contains("releases.example/r"), "{url}: {e}");
        }
    }

    #[test]
    fn a_source_is_shown_without_what_may_be_a_secret_even_when_it_does_not_parse() {
        for (source, seen) in [
            ("https://u:s3/cret@host/r", "https://…@host/r"),
            ("https://u:s3?cret@host/r", "https://…@host/r"),
            ("https://host/r?token=s3cret", "https://host/r…"),
            ("http://u:s3cret@host", "http://…@host"),
            ("relative/s3cret?x", "relative/s3cret…"),
        ] {
            assert_eq!(shown(source), seen);
        }
        let e = Source::parse("https://u:s3/cret@host/r", None)
            .map(|_| ())
            .expect_err("credentials")
            .to_string();
        assert!(!e.contains("s3") && !e.contains("cret"), "{e}");
    }

    #[tokio::test]
    async fn a_directory_source_reads_no_more_than_the_limit_whatever_its_size_says() {
        // A manifest that is a device: its size on disk says 0.
        let dir =
            std::env::temp_dir().join(format!("billet-rel-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(dir.join("6.6.6")).expect("dir");
        std::os::unix::fs::symlink("/dev/zero", dir.join("6.6.6").join(MANIFEST_FILE))
            .expect("symlink");
        let source = Source::parse(dir.to_str().expect("utf-8"), None).expect("source");
        let e = tokio::time::timeout(std::time::Duration::from_secs(30), source.manifest("6.6.6"))
            .await
            .expect("bounded")
            .expect_err("endless manifest")
            .to_string();
        assert!(e.contains("larger than"), "{e}");
    }

    #[test]
    fn a_release_with_no_binary_for_this_host_says_which_platform() {
        let m = Manifest {
            version: "1".into(),
            artifacts: vec![Artifact {
                os: "plan9".into(),
                arch: "mips".into(),
                path: "billet".into(),
                sha256: "a".repeat(64),
            }],
        };
        let e = for_this_host(&m).expect_err("no build");
        assert!(e.to_string().contains(std::env::consts::ARCH), "{e}");
    }
}
