//! Development certificates for billet's mTLS: a CA, the plane's certificate and one per node.
//!
//! [`generate`] writes, into one directory:
//!
//! | file | what |
//! |---|---|
//! | `ca.pem`, `ca.key` | the development CA (path length 0: it signs leaves only) |
//! | `plane.pem`, `plane.key` | the plane: SAN DNS = plane name, EKU serverAuth + clientAuth |
//! | `node-<name>.pem`, `node-<name>.key` | a node: SAN DNS = node name, EKU serverAuth + clientAuth |
//! | `other-ca.pem`, `other-ca.key` | only with [`NodeOptions::other_ca`]: a second CA, which signed the node certificates |
//!
//! Certificates are PEM; keys are ECDSA P-256 in PKCS#8 PEM, written mode 0600. A directory created
//! here is mode 0700; an existing one keeps its mode. Every file is written to a temporary name and
//! renamed into place, so a process reloading certificates from disk never reads half a file.
//!
//! Both leaf kinds carry serverAuth and clientAuth: the plane dials nodes (TLS client) and the node
//! listens (TLS server), but each also presents its certificate to the other side, and keeping one
//! shape for both lets a test swap roles without a second generator.
//!
//! [`generate_with`] lets tests make the certificates that must be refused: signed by another CA
//! (a fresh [`generate`] into another directory), expired or not yet valid ([`Validity`]) while
//! signed by the deployment's own CA ([`Options::ca_dir`]). [`generate_with_nodes`] makes only
//! the node certificates so, beside a good CA and plane certificate: expired, not yet valid,
//! short-lived ([`Validity::lasting`]) or signed by a second CA ([`NodeOptions`]). The
//! `billet-certs-dev` command's `--expired`, `--not-yet-valid`, `--lifetime-secs` and
//! `--other-ca` are these.
//!
//! These are development credentials; nothing here is meant for a production deployment.

use std::fs;
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt as _, OpenOptionsExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use anyhow::{Context as _, bail, ensure};
use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use time::OffsetDateTime;

/// File name of the CA certificate.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the CA private key.
pub const CA_KEY_FILE: &str = "ca.key";
/// Common name of a CA made by [`generate`].
pub const CA_COMMON_NAME: &str = "billet development CA";
/// File name of the second CA's certificate ([`NodeOptions::other_ca`]).
pub const OTHER_CA_CERT_FILE: &str = "other-ca.pem";
/// File name of the second CA's private key ([`NodeOptions::other_ca`]).
pub const OTHER_CA_KEY_FILE: &str = "other-ca.key";
/// Longest lifetime [`Validity::lasting`] accepts: 100 years of 365 days.
pub const MAX_LIFETIME: Duration = Duration::from_secs(100 * 365 * 24 * 60 * 60);

/// Mode of private key files.
const KEY_FILE_MODE: u32 = 0o600;
/// Mode of certificate files.
const CERT_FILE_MODE: u32 = 0o644;
/// Mode of a directory this crate creates.
const DIR_MODE: u32 = 0o700;

const DAY: Duration = Duration::from_secs(24 * 60 * 60);

/// One certificate and its private key, as written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertFiles {
    /// The DNS name in the certificate's SAN (for the CA: its common name).
    pub name: String,
    /// The PEM certificate.
    pub cert: PathBuf,
    /// The PEM (PKCS#8) private key, mode 0600.
    pub key: PathBuf,
}

/// What [`generate`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DevCerts {
    /// The output directory.
    pub dir: PathBuf,
    /// The CA that signed the plane certificate, and the node certificates unless
    /// [`Self::other_ca`] did. With [`Options::ca_dir`] these are the files in that directory,
    /// which were read, not written.
    pub ca: CertFiles,
    /// Whether the CA was made (and written) by this call.
    pub ca_generated: bool,
    /// The second CA that signed the node certificates, made and written by this call
    /// ([`NodeOptions::other_ca`]); `None` when [`Self::ca`] signed them.
    pub other_ca: Option<CertFiles>,
    /// The plane's certificate.
    pub plane: CertFiles,
    /// One certificate per node, in the order the names were given.
    pub nodes: Vec<CertFiles>,
}

impl DevCerts {
    /// The certificate of the node called `name`.
    pub fn node(&self, name: &str) -> Option<&CertFiles> {
        self.nodes.iter().find(|n| n.name == name)
    }

    /// Every file written, in the order written (the CA's only if it was made here).
    pub fn written_files(&self) -> Vec<&Path> {
        let mut files = Vec::new();
        if self.ca_generated {
            files.extend([self.ca.cert.as_path(), self.ca.key.as_path()]);
        }
        if let Some(other) = &self.other_ca {
            files.extend([other.cert.as_path(), other.key.as_path()]);
        }
        for c in std::iter::once(&self.plane).chain(&self.nodes) {
            files.extend([c.cert.as_path(), c.key.as_path()]);
        }
        files
    }
}

/// The validity window of the plane and node certificates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Validity {
    /// First instant the certificate is valid.
    pub not_before: SystemTime,
    /// Last instant the certificate is valid.
    pub not_after: SystemTime,
}

impl Validity {
    /// From one day ago to 365 days from now: the default.
    pub fn dev() -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now - DAY,
            not_after: now + 365 * DAY,
        }
    }

    /// Valid from 30 days ago until one day ago: refused as expired.
    pub fn expired() -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now - 30 * DAY,
            not_after: now - DAY,
        }
    }

    /// Valid from one day from now for 30 days: refused as not yet valid.
    pub fn not_yet_valid() -> Self {
        let now = SystemTime::now();
        Self {
            not_before: now + DAY,
            not_after: now + 31 * DAY,
        }
    }

    /// Valid from now for `lifetime`: a short-lived certificate, to watch one expire. A
    /// certificate holds whole seconds and both ends are rounded down, so the written window
    /// starts at most a second before now.
    ///
    /// # Errors
    ///
    /// A lifetime shorter than one second or longer than [`MAX_LIFETIME`].
    pub fn lasting(lifetime: Duration) -> anyhow::Result<Self> {
        ensure!(
            (Duration::from_secs(1)..=MAX_LIFETIME).contains(&lifetime),
            "a certificate's lifetime must be from 1 second to {} seconds (100 years), not {} s",
            MAX_LIFETIME.as_secs(),
            lifetime.as_secs_f64()
        );
        let now = SystemTime::now();
        Ok(Self {
            not_before: now,
            not_after: now + lifetime,
        })
    }
}

impl Default for Validity {
    fn default() -> Self {
        Self::dev()
    }
}

/// How [`generate_with`] makes the certificates.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Options {
    /// Validity of the plane and node certificates. A CA made here covers at least this window
    /// and [`Validity::dev`], so a leaf's own window is what decides whether it is accepted.
    pub validity: Validity,
    /// Sign with the CA already in this directory (`ca.pem`, `ca.key`) instead of making a new
    /// one in the output directory. It may be the output directory itself.
    pub ca_dir: Option<PathBuf>,
}

/// How the node certificates [`generate_with_nodes`] makes differ from the plane's: the negative
/// cases, made beside a good CA and plane certificate.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeOptions {
    /// Validity of the node certificates; `None`: [`Options::validity`], as the plane's.
    pub validity: Option<Validity>,
    /// Sign the node certificates with a second CA made by this call and written beside the
    /// others as `other-ca.pem` and `other-ca.key` ([`DevCerts::other_ca`]), instead of with the
    /// deployment's CA. It has the same common name as the deployment's CA and its own key, as
    /// another deployment's development CA would: a verifier must check the signature, not only
    /// the issuer's name, to refuse its certificates.
    pub other_ca: bool,
    /// IP addresses a node's certificate names besides its DNS name, by node name: a node on a
    /// network address of its own (the fleet harness's network namespaces) has a certificate
    /// naming both. A name not among the nodes is refused.
    pub addresses: std::collections::BTreeMap<String, std::net::IpAddr>,
}

/// Writes a new development CA, a plane certificate for `plane_name` and one certificate per
/// entry of `node_names` into `out_dir`, replacing files of the same names.
///
/// Same as [`generate_with`] with default [`Options`]: a fresh CA, valid from one day ago for
/// 365 days.
///
/// # Errors
///
/// A name that is not a lowercase DNS name, a repeated node name, or a failure to create the
/// directory or write a file (the message names the path).
pub fn generate(out_dir: &Path, plane_name: &str, node_names: &[&str]) -> anyhow::Result<DevCerts> {
    generate_with(out_dir, plane_name, node_names, &Options::default())
}

/// Like [`generate`], with a chosen validity window and optionally an existing CA.
///
/// # Errors
///
/// As [`generate`]; also a `not_after` that is not after `not_before`, and a CA directory whose
/// `ca.pem` or `ca.key` cannot be read or parsed.
pub fn generate_with(
    out_dir: &Path,
    plane_name: &str,
    node_names: &[&str],
    options: &Options,
) -> anyhow::Result<DevCerts> {
    generate_with_nodes(
        out_dir,
        plane_name,
        node_names,
        options,
        &NodeOptions::default(),
    )
}

/// Like [`generate_with`], with node certificates that differ from the plane's as `nodes` says:
/// another validity window, or signed by a second CA. The CA (made or read) and the plane
/// certificate are as [`generate_with`] makes them; a CA made here covers the node
/// certificates' window too.
///
/// # Errors
///
/// As [`generate_with`]; an empty window is named as the plane's or the nodes'.
pub fn generate_with_nodes(
    out_dir: &Path,
    plane_name: &str,
    node_names: &[&str],
    options: &Options,
    nodes: &NodeOptions,
) -> anyhow::Result<DevCerts> {
    check_dns_name(plane_name).context("invalid plane name")?;
    for (i, name) in node_names.iter().enumerate() {
        check_dns_name(name).context("invalid node name")?;
        ensure!(
            !node_names[..i].contains(name),
            "node name {name:?} is given twice"
        );
    }
    let validity = options.validity;
    ensure!(
        validity.not_after > validity.not_before,
        "the validity window is empty: not_after must be later than not_before"
    );
    let node_validity = nodes.validity.unwrap_or(validity);
    ensure!(
        node_validity.not_after > node_validity.not_before,
        "the node certificates' validity window is empty: not_after must be later than not_before"
    );

    if let Some(name) = nodes
        .addresses
        .keys()
        .find(|name| !node_names.contains(&name.as_str()))
    {
        anyhow::bail!("an address is given for {name:?}, which is not among the nodes");
    }

    create_private_dir(out_dir)?;

    let (issuer, ca) = match &options.ca_dir {
        Some(ca_dir) => load_ca(ca_dir)?,
        None => make_ca(
            out_dir,
            [CA_CERT_FILE, CA_KEY_FILE],
            &[validity, node_validity],
        )?,
    };
    let other_ca = if nodes.other_ca {
        Some(make_ca(
            out_dir,
            [OTHER_CA_CERT_FILE, OTHER_CA_KEY_FILE],
            &[node_validity],
        )?)
    } else {
        None
    };
    let node_issuer = other_ca.as_ref().map_or(&issuer, |(other, _)| other);

    let plane = make_leaf(out_dir, "plane", plane_name, None, validity, &issuer)?;
    let node_certs = node_names
        .iter()
        .map(|name| {
            let stem = format!("node-{name}");
            let address = nodes.addresses.get(*name).copied();
            make_leaf(out_dir, &stem, name, address, node_validity, node_issuer)
        })
        .collect::<anyhow::Result<Vec<_>>>()?;

    Ok(DevCerts {
        dir: out_dir.to_path_buf(),
        ca,
        ca_generated: options.ca_dir.is_none(),
        other_ca: other_ca.map(|(_, files)| files),
        plane,
        nodes: node_certs,
    })
}

/// Checks that `name` can be a certificate's DNS name and a file name: dot-separated labels of
/// 1 to 63 lowercase ASCII letters, digits and `-`, not starting or ending with `-`, at most 253
/// characters in all, and not an IP address.
///
/// Lowercase only, because the name is also the node's identity and `Node-A` and `node-a` would
/// be the same DNS name but different strings.
///
/// # Errors
///
/// A sentence saying which rule the name breaks.
pub fn check_dns_name(name: &str) -> anyhow::Result<()> {
    ensure!(!name.is_empty(), "the name is empty");
    ensure!(
        name.len() <= 253,
        "{name:?} is {} characters long; a DNS name has at most 253",
        name.len()
    );
    ensure!(
        name.parse::<IpAddr>().is_err(),
        "{name:?} is an IP address; give a DNS name"
    );
    for label in name.split('.') {
        ensure!(
            !label.is_empty(),
            "{name:?} has an empty label (a leading, trailing or doubled '.')"
        );
        ensure!(
            label.len() <= 63,
            "{name:?} has a label longer than 63 characters"
        );
        if let Some(c) = label
            .chars()
            .find(|c| !(c.is_ascii_lowercase() || c.is_ascii_digit() || *c == '-'))
        {
            bail!(
                "{name:?} contains {c:?}; use lowercase letters a-z, digits and '-', with '.' between labels"
            );
        }
        ensure!(
            !label.starts_with('-') && !label.ends_with('-'),
            "{name:?} has a label that starts or ends with '-'"
        );
    }
    Ok(())
}

/// Makes a CA whose window covers the default one and every one of `leaves`, and writes it as
/// `files` (certificate, key) in `out_dir`.
fn make_ca(
    out_dir: &Path,
    [cert_file, key_file]: [&str; 2],
    leaves: &[Validity],
) -> anyhow::Result<(Issuer<'static, KeyPair>, CertFiles)> {
    let dev = Validity::dev();
    let not_before = leaves
        .iter()
        .map(|v| v.not_before)
        .fold(dev.not_before, SystemTime::min);
    let not_after = leaves
        .iter()
        .map(|v| v.not_after)
        .fold(dev.not_after, SystemTime::max);
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name(CA_COMMON_NAME);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    params.not_before = OffsetDateTime::from(not_before);
    params.not_after = OffsetDateTime::from(not_after);
    let key = KeyPair::generate().context("cannot generate the CA key")?;
    let cert = params
        .self_signed(&key)
        .context("cannot sign the CA certificate")?;
    let files = CertFiles {
        name: CA_COMMON_NAME.to_owned(),
        cert: out_dir.join(cert_file),
        key: out_dir.join(key_file),
    };
    write_file(&files.cert, cert.pem().as_bytes(), CERT_FILE_MODE)?;
    write_file(&files.key, key.serialize_pem().as_bytes(), KEY_FILE_MODE)?;
    Ok((Issuer::new(params, key), files))
}

/// Reads an existing CA back from `ca_dir`.
fn load_ca(ca_dir: &Path) -> anyhow::Result<(Issuer<'static, KeyPair>, CertFiles)> {
    let cert_path = ca_dir.join(CA_CERT_FILE);
    let key_path = ca_dir.join(CA_KEY_FILE);
    let cert_pem = fs::read_to_string(&cert_path)
        .with_context(|| format!("cannot read the CA certificate {}", cert_path.display()))?;
    let key_pem = fs::read_to_string(&key_path)
        .with_context(|| format!("cannot read the CA key {}", key_path.display()))?;
    let key = KeyPair::from_pem(&key_pem)
        .with_context(|| format!("cannot parse the CA key {}", key_path.display()))?;
    let issuer = Issuer::from_ca_cert_pem(&cert_pem, key)
        .with_context(|| format!("cannot parse the CA certificate {}", cert_path.display()))?;
    let files = CertFiles {
        name: CA_COMMON_NAME.to_owned(),
        cert: cert_path,
        key: key_path,
    };
    Ok((issuer, files))
}

/// Makes a leaf for `dns_name` (and `address`, when given), usable for TLS server and client
/// authentication, and writes it as `<stem>.pem` and `<stem>.key`.
fn make_leaf(
    out_dir: &Path,
    stem: &str,
    dns_name: &str,
    address: Option<std::net::IpAddr>,
    validity: Validity,
    issuer: &Issuer<'_, KeyPair>,
) -> anyhow::Result<CertFiles> {
    let mut params = CertificateParams::default();
    params.distinguished_name = common_name(dns_name);
    params.subject_alt_names =
        vec![SanType::DnsName(dns_name.try_into().with_context(
            || format!("{dns_name:?} is not a valid DNS name"),
        )?)];
    params
        .subject_alt_names
        .extend(address.map(SanType::IpAddress));
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.use_authority_key_identifier_extension = true;
    params.not_before = OffsetDateTime::from(validity.not_before);
    params.not_after = OffsetDateTime::from(validity.not_after);
    let key = KeyPair::generate().with_context(|| format!("cannot generate a key for {stem}"))?;
    let cert = params
        .signed_by(&key, issuer)
        .with_context(|| format!("cannot sign the certificate for {stem}"))?;
    let files = CertFiles {
        name: dns_name.to_owned(),
        cert: out_dir.join(format!("{stem}.pem")),
        key: out_dir.join(format!("{stem}.key")),
    };
    write_file(&files.cert, cert.pem().as_bytes(), CERT_FILE_MODE)?;
    write_file(&files.key, key.serialize_pem().as_bytes(), KEY_FILE_MODE)?;
    Ok(files)
}

fn common_name(name: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, name);
    dn
}

/// Creates `dir` (and missing parents) with mode 0700; an existing directory is left as it is.
fn create_private_dir(dir: &Path) -> anyhow::Result<()> {
    if dir.is_dir() {
        return Ok(());
    }
    fs::DirBuilder::new()
        .recursive(true)
        .mode(DIR_MODE)
        .create(dir)
        .with_context(|| format!("cannot create the directory {}", dir.display()))?;
    // The umask may have narrowed the mode further; make it exactly 0700.
    fs::set_permissions(dir, fs::Permissions::from_mode(DIR_MODE))
        .with_context(|| format!("cannot set the mode of {}", dir.display()))
}

/// Writes `contents` to `path` with `mode`, through a temporary file renamed into place, so the
/// key never exists with a wider mode and readers see the old file or the new one, never half.
fn write_file(path: &Path, contents: &[u8], mode: u32) -> anyhow::Result<()> {
    let file_name = path
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("{} has no file name", path.display()))?;
    let tmp = path.with_file_name(format!(".{file_name}.tmp"));
    // A temporary file left by an interrupted run: its mode is unknown, so it is not reused.
    match fs::remove_file(&tmp) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("cannot remove {}", tmp.display())),
    }
    let mut file = fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))?;
    // The umask only narrows `mode`, but a certificate should be readable as asked.
    file.set_permissions(fs::Permissions::from_mode(mode))
        .with_context(|| format!("cannot set the mode of {}", tmp.display()))?;
    file.write_all(contents)
        .and_then(|()| file.sync_all())
        .with_context(|| format!("cannot write {}", tmp.display()))?;
    fs::rename(&tmp, path).with_context(|| format!("cannot write {}", path.display()))
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use rustls::pki_types::pem::PemObject as _;
    use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
    use webpki::{EndEntityCert, KeyUsage};

    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            static NEXT: AtomicU32 = AtomicU32::new(0);
            let path = std::env::temp_dir().join(format!(
                "billet-certs-dev-test-{}-{}",
                std::process::id(),
                NEXT.fetch_add(1, Ordering::Relaxed)
            ));
            let _ = fs::remove_dir_all(&path);
            Self(path)
        }

        fn path(&self) -> &Path {
            &self.0
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    fn read_cert(path: &Path) -> CertificateDer<'static> {
        CertificateDer::from_pem_file(path)
            .unwrap_or_else(|e| panic!("{} is not a PEM certificate: {e:?}", path.display()))
    }

    fn read_key(path: &Path) -> PrivateKeyDer<'static> {
        PrivateKeyDer::from_pem_file(path)
            .unwrap_or_else(|e| panic!("{} is not a PEM private key: {e:?}", path.display()))
    }

    /// Verifies `leaf` against the CA in `ca` for `usage` and the DNS name `name`, now.
    fn verify(ca: &Path, leaf: &Path, usage: KeyUsage, name: &str) -> Result<(), webpki::Error> {
        verify_at(ca, leaf, usage, name, UnixTime::now())
    }

    /// As [`verify`], at `time`.
    fn verify_at(
        ca: &Path,
        leaf: &Path,
        usage: KeyUsage,
        name: &str,
        time: UnixTime,
    ) -> Result<(), webpki::Error> {
        let ca = read_cert(ca);
        let anchors = [webpki::anchor_from_trusted_cert(&ca)?.to_owned()];
        let leaf = read_cert(leaf);
        let cert = EndEntityCert::try_from(&leaf)?;
        cert.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &[],
            time,
            usage,
            None,
            None,
        )?;
        cert.verify_is_valid_for_subject_name(&ServerName::try_from(name).expect("a DNS name"))
    }

    #[test]
    fn every_certificate_chains_to_the_ca_for_server_and_client_use_under_its_own_name() {
        let dir = TempDir::new();
        let certs = generate(dir.path(), "plane", &["node-a", "node-b"]).unwrap();
        assert_eq!(certs.ca.cert, dir.path().join("ca.pem"));
        assert_eq!(certs.plane.cert, dir.path().join("plane.pem"));
        assert_eq!(
            certs.node("node-b").unwrap().key,
            dir.path().join("node-node-b.key")
        );
        assert_eq!(certs.written_files().len(), 8);

        for leaf in std::iter::once(&certs.plane).chain(&certs.nodes) {
            for usage in [KeyUsage::server_auth(), KeyUsage::client_auth()] {
                verify(&certs.ca.cert, &leaf.cert, usage, &leaf.name)
                    .unwrap_or_else(|e| panic!("{} does not verify: {e:?}", leaf.name));
            }
            read_key(&leaf.key);
        }
        assert!(matches!(
            verify(
                &certs.ca.cert,
                &certs.nodes[0].cert,
                KeyUsage::server_auth(),
                "node-b"
            ),
            Err(webpki::Error::CertNotValidForName(_))
        ));
    }

    #[test]
    fn keys_are_written_0600_and_a_new_directory_0700() {
        let dir = TempDir::new();
        let out = dir.path().join("nested/out");
        let certs = generate(&out, "plane", &["node-1"]).unwrap();
        let mode = |p: &Path| fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&out), 0o700);
        for key in [&certs.ca.key, &certs.plane.key, &certs.nodes[0].key] {
            assert_eq!(mode(key), 0o600, "{}", key.display());
        }
        assert_eq!(mode(&certs.plane.cert), 0o644);
        let leftovers: Vec<_> = fs::read_dir(&out)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .filter(|n| n.to_string_lossy().ends_with(".tmp"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn regenerating_over_a_world_readable_key_leaves_it_0600() {
        let dir = TempDir::new();
        let certs = generate(dir.path(), "plane", &[]).unwrap();
        fs::set_permissions(&certs.plane.key, fs::Permissions::from_mode(0o644)).unwrap();
        let again = generate(dir.path(), "plane", &[]).unwrap();
        let mode = fs::metadata(&again.plane.key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
    }

    #[test]
    fn a_certificate_from_another_ca_is_refused() {
        let ours = TempDir::new();
        let theirs = TempDir::new();
        let ours = generate(ours.path(), "plane", &["node-a"]).unwrap();
        let theirs = generate(theirs.path(), "plane", &["node-a"]).unwrap();
        let err = verify(
            &ours.ca.cert,
            &theirs.nodes[0].cert,
            KeyUsage::server_auth(),
            "node-a",
        );
        // Both CAs have the same common name, so webpki takes ours as the candidate issuer by name
        // and then refuses the signature.
        assert!(
            matches!(
                err,
                Err(webpki::Error::InvalidSignatureForPublicKey | webpki::Error::UnknownIssuer)
            ),
            "{err:?}"
        );
    }

    #[test]
    fn expired_and_not_yet_valid_certificates_from_the_same_ca_are_refused_for_their_dates() {
        let good = TempDir::new();
        let expired = TempDir::new();
        let early = TempDir::new();
        let good = generate(good.path(), "plane", &["node-a"]).unwrap();
        let with = |validity| Options {
            validity,
            ca_dir: Some(good.dir.clone()),
        };
        let expired = generate_with(
            expired.path(),
            "plane",
            &["node-a"],
            &with(Validity::expired()),
        )
        .unwrap();
        let early = generate_with(
            early.path(),
            "plane",
            &["node-a"],
            &with(Validity::not_yet_valid()),
        )
        .unwrap();
        assert_eq!(
            expired.ca, good.ca,
            "signed by the existing CA, not a new one"
        );
        assert!(!expired.dir.join(CA_CERT_FILE).exists());

        let node = |c: &DevCerts| c.nodes[0].cert.clone();
        assert!(matches!(
            verify(
                &good.ca.cert,
                &node(&expired),
                KeyUsage::client_auth(),
                "node-a"
            ),
            Err(webpki::Error::CertExpired { .. })
        ));
        assert!(matches!(
            verify(
                &good.ca.cert,
                &node(&early),
                KeyUsage::client_auth(),
                "node-a"
            ),
            Err(webpki::Error::CertNotValidYet { .. })
        ));
    }

    #[test]
    fn a_node_given_an_address_gets_a_certificate_naming_it_beside_its_name() {
        let dir = TempDir::new();
        let address: std::net::IpAddr = "10.77.3.11".parse().unwrap();
        let nodes = NodeOptions {
            addresses: [("node-a".to_owned(), address)].into_iter().collect(),
            ..NodeOptions::default()
        };
        let certs = generate_with_nodes(
            dir.path(),
            "plane",
            &["node-a", "node-b"],
            &Options::default(),
            &nodes,
        )
        .unwrap();
        let sans = |name: &str| {
            let pem = fs::read(&certs.node(name).unwrap().cert).unwrap();
            let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
            let cert = pem.parse_x509().unwrap();
            let san = cert.subject_alternative_name().unwrap().unwrap();
            san.value
                .general_names
                .iter()
                .map(|n| format!("{n:?}"))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            sans("node-a"),
            ["DNSName(\"node-a\")", "IPAddress([10, 77, 3, 11])"]
        );
        assert_eq!(sans("node-b"), ["DNSName(\"node-b\")"]);
        let err = generate_with_nodes(
            dir.path(),
            "plane",
            &["node-b"],
            &Options::default(),
            &nodes,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("\"node-a\", which is not among the nodes"),
            "{err}"
        );
    }

    /// The validity window written in the PEM certificate at `path`, in Unix seconds.
    fn window(path: &Path) -> (i64, i64) {
        let pem = fs::read(path).unwrap();
        let (_, pem) = x509_parser::pem::parse_x509_pem(&pem).unwrap();
        let cert = pem.parse_x509().unwrap();
        let validity = cert.validity();
        (
            validity.not_before.timestamp(),
            validity.not_after.timestamp(),
        )
    }

    /// `validity` as a certificate holds it: whole Unix seconds, rounded down.
    fn whole_seconds(validity: Validity) -> (i64, i64) {
        let secs = |t: SystemTime| match t.duration_since(SystemTime::UNIX_EPOCH) {
            Ok(after) => i64::try_from(after.as_secs()).unwrap(),
            Err(before) => panic!("{:?} before the epoch", before.duration()),
        };
        (secs(validity.not_before), secs(validity.not_after))
    }

    #[test]
    fn node_certificates_get_the_window_asked_for_while_the_ca_and_the_plane_stay_good() {
        let existing = TempDir::new();
        let existing = generate(existing.path(), "plane", &[]).unwrap();
        let lasting = Validity::lasting(Duration::from_secs(90)).unwrap();
        for (what, asked) in [
            ("expired", Validity::expired()),
            ("not yet valid", Validity::not_yet_valid()),
            ("lasting 90 s", lasting),
        ] {
            for ca_dir in [None, Some(existing.dir.clone())] {
                let dir = TempDir::new();
                let options = Options {
                    ca_dir: ca_dir.clone(),
                    ..Options::default()
                };
                let nodes = NodeOptions {
                    validity: Some(asked),
                    other_ca: false,
                    ..NodeOptions::default()
                };
                let certs = generate_with_nodes(dir.path(), "plane", &["node-a"], &options, &nodes)
                    .unwrap();
                let context = format!("{what}, CA {ca_dir:?}");
                assert_eq!(
                    window(&certs.nodes[0].cert),
                    whole_seconds(asked),
                    "{context}"
                );
                assert_eq!(
                    window(&certs.plane.cert),
                    whole_seconds(options.validity),
                    "{context}"
                );
                verify(
                    &certs.ca.cert,
                    &certs.plane.cert,
                    KeyUsage::server_auth(),
                    "plane",
                )
                .unwrap_or_else(|e| panic!("{context}: the plane does not verify: {e:?}"));
                if ca_dir.is_none() {
                    let (ca_from, ca_until) = window(&certs.ca.cert);
                    let (from, until) = whole_seconds(asked);
                    assert!(
                        ca_from <= from && until <= ca_until,
                        "{context}: the CA does not cover the node's window"
                    );
                }
            }
        }
    }

    #[test]
    fn a_short_lived_certificate_verifies_now_and_is_refused_once_its_lifetime_is_over() {
        let dir = TempDir::new();
        let lifetime = Duration::from_secs(60);
        let nodes = NodeOptions {
            validity: Some(Validity::lasting(lifetime).unwrap()),
            other_ca: false,
            ..NodeOptions::default()
        };
        let certs = generate_with_nodes(
            dir.path(),
            "plane",
            &["node-a"],
            &Options::default(),
            &nodes,
        )
        .unwrap();
        let (ca, node) = (&certs.ca.cert, &certs.nodes[0].cert);
        verify(ca, node, KeyUsage::client_auth(), "node-a").unwrap();
        let later = UnixTime::since_unix_epoch(
            SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .unwrap()
                + lifetime
                + Duration::from_secs(1),
        );
        assert!(matches!(
            verify_at(ca, node, KeyUsage::client_auth(), "node-a", later),
            Err(webpki::Error::CertExpired { .. })
        ));
    }

    #[test]
    fn a_lifetime_is_from_one_second_to_a_hundred_years() {
        for refused in [
            Duration::ZERO,
            Duration::from_millis(999),
            MAX_LIFETIME + Duration::from_secs(1),
        ] {
            let err = Validity::lasting(refused).unwrap_err().to_string();
            assert!(err.contains("from 1 second to"), "{refused:?}: {err}");
        }
        for accepted in [Duration::from_secs(1), MAX_LIFETIME] {
            let validity = Validity::lasting(accepted).unwrap();
            assert_eq!(validity.not_after - accepted, validity.not_before);
        }
    }

    #[test]
    fn node_certificates_from_the_other_ca_are_refused_by_the_deployments_ca_and_chain_to_theirs() {
        let dir = TempDir::new();
        let nodes = NodeOptions {
            validity: None,
            other_ca: true,
            ..NodeOptions::default()
        };
        let certs = generate_with_nodes(
            dir.path(),
            "plane",
            &["node-a", "node-b"],
            &Options::default(),
            &nodes,
        )
        .unwrap();
        let other = certs.other_ca.as_ref().expect("an other CA");
        assert_eq!(other.cert, dir.path().join(OTHER_CA_CERT_FILE));
        assert_eq!(other.key, dir.path().join(OTHER_CA_KEY_FILE));
        let mode = fs::metadata(&other.key).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let written = certs.written_files();
        assert_eq!(written.len(), 10, "{written:?}");
        assert!(written.contains(&other.cert.as_path()) && written.contains(&other.key.as_path()));

        verify(
            &certs.ca.cert,
            &certs.plane.cert,
            KeyUsage::server_auth(),
            "plane",
        )
        .unwrap();
        for node in &certs.nodes {
            let refused = verify(
                &certs.ca.cert,
                &node.cert,
                KeyUsage::client_auth(),
                &node.name,
            );
            // Same common name as the deployment's CA: refused for the signature, not the name.
            assert!(
                matches!(refused, Err(webpki::Error::InvalidSignatureForPublicKey)),
                "{}: {refused:?}",
                node.name
            );
            verify(&other.cert, &node.cert, KeyUsage::client_auth(), &node.name)
                .unwrap_or_else(|e| panic!("{} does not chain to the other CA: {e:?}", node.name));
        }
    }

    #[test]
    fn an_empty_node_window_is_refused_naming_the_nodes() {
        let dir = TempDir::new();
        let now = SystemTime::now();
        let nodes = NodeOptions {
            validity: Some(Validity {
                not_before: now,
                not_after: now,
            }),
            other_ca: false,
            ..NodeOptions::default()
        };
        let err = generate_with_nodes(dir.path(), "plane", &["n"], &Options::default(), &nodes)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("node certificates' validity window is empty"),
            "{err}"
        );
        assert!(!dir.path().exists(), "nothing is written");
    }

    #[test]
    fn a_node_added_later_with_the_existing_ca_verifies_and_the_ca_is_kept() {
        let dir = TempDir::new();
        let first = generate(dir.path(), "plane", &["node-a"]).unwrap();
        let ca_before = fs::read(&first.ca.cert).unwrap();
        let options = Options {
            ca_dir: Some(dir.path().to_path_buf()),
            ..Options::default()
        };
        let second = generate_with(dir.path(), "plane", &["node-b"], &options).unwrap();
        assert_eq!(fs::read(&second.ca.cert).unwrap(), ca_before);
        assert_eq!(
            second.written_files().len(),
            4,
            "{:?}",
            second.written_files()
        );
        for leaf in [&first.nodes[0], &second.nodes[0]] {
            verify(
                &second.ca.cert,
                &leaf.cert,
                KeyUsage::server_auth(),
                &leaf.name,
            )
            .unwrap();
        }
    }

    #[test]
    fn names_that_are_not_lowercase_dns_names_are_refused_with_the_reason() {
        for (name, says) in [
            ("", "empty"),
            ("Node-A", "contains 'N'"),
            ("node_a", "contains '_'"),
            ("-node", "starts or ends with '-'"),
            ("node-", "starts or ends with '-'"),
            ("a..b", "empty label"),
            ("plane.", "empty label"),
            ("10.0.0.1", "IP address"),
            ("node/../../etc", "contains '/'"),
        ] {
            let err = check_dns_name(name).unwrap_err().to_string();
            assert!(err.contains(says), "{name:?}: {err}");
        }
        for name in ["plane", "node-1", "n1.example.com", "0node"] {
            check_dns_name(name).unwrap();
        }

        let dir = TempDir::new();
        let err = generate(dir.path(), "plane", &["node_a"]).unwrap_err();
        assert!(
            format!("{err:#}").starts_with("invalid node name: "),
            "{err:#}"
        );
        let err = generate(dir.path(), "plane", &["a", "a"]).unwrap_err();
        assert!(err.to_string().contains("given twice"), "{err:#}");
        assert!(
            !dir.path().exists(),
            "nothing is written for an invalid name"
        );
    }

    #[test]
    fn plane_and_node_complete_an_mtls_handshake_in_both_roles() {
        let dir = TempDir::new();
        let certs = generate(dir.path(), "plane", &["node-a"]).unwrap();
        let node = &certs.nodes[0];
        handshake(&certs.ca.cert, &certs.plane, node);
        handshake(&certs.ca.cert, node, &certs.plane);
    }

    /// Runs a TLS 1.3 handshake in memory between `client` and `server`, each requiring the
    /// other's certificate to chain to `ca`; the client checks the server's name.
    fn handshake(ca: &Path, client: &CertFiles, server: &CertFiles) {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = rustls::RootCertStore::empty();
        roots.add(read_cert(ca)).unwrap();
        let roots = Arc::new(roots);

        let client_verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .unwrap();
        let server_config = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(vec![read_cert(&server.cert)], read_key(&server.key))
            .unwrap();
        let client_config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_client_auth_cert(vec![read_cert(&client.cert)], read_key(&client.key))
            .unwrap();

        let name = ServerName::try_from(server.name.clone()).unwrap();
        let mut c = rustls::ClientConnection::new(Arc::new(client_config), name).unwrap();
        let mut s = rustls::ServerConnection::new(Arc::new(server_config)).unwrap();
        for _ in 0..10 {
            if !c.is_handshaking() && !s.is_handshaking() {
                break;
            }
            let mut buf = Vec::new();
            c.write_tls(&mut buf).unwrap();
            s.read_tls(&mut buf.as_slice()).unwrap();
            s.process_new_packets()
                .expect("the server accepts the client");
            buf.clear();
            s.write_tls(&mut buf).unwrap();
            c.read_tls(&mut buf.as_slice()).unwrap();
            c.process_new_packets()
                .expect("the client accepts the server");
        }
        assert!(
            !c.is_handshaking() && !s.is_handshaking(),
            "handshake did not finish"
        );
        let presented = s.peer_certificates().expect("a client certificate");
        assert_eq!(presented[0], read_cert(&client.cert));
    }
}
