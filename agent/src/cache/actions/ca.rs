//! The node's interception CA (spec/cache.md §2.2, §2.5): a self-signed
//! CA the node makes once and keeps in its state directory
//! (`<state dir>/actions-interception/ca.pem`, `ca.key` at mode 0600), so
//! a restarted node's guests still trust it; and a leaf for
//! [`RESULTS_HOST`] it signs at each start, served with TLS 1.3 only.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, SanType,
};

use super::RESULTS_HOST;

/// The directory under the state directory that holds the CA.
pub(crate) const CA_DIR: &str = "actions-interception";

/// Why the CA cannot be made or read.
#[derive(Debug, thiserror::Error)]
pub enum CaError {
    /// A file of the CA cannot be read or written.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The CA's certificate or key is not one (or cannot be made).
    #[error(
        "the Actions cache interception CA in {dir} is unusable ({message}); move the directory aside so the node makes a new one (guests of jobs running now lose the proxy)"
    )]
    Unusable {
        /// The CA's directory.
        dir: PathBuf,
        /// What is wrong.
        message: String,
    },
}

/// The interception CA and the TLS configuration it serves the results
/// host with.
pub struct InterceptionCa {
    ca_pem: String,
    server: Arc<rustls::ServerConfig>,
}

impl std::fmt::Debug for InterceptionCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InterceptionCa").finish_non_exhaustive()
    }
}

fn write_private(path: &Path, bytes: &[u8], mode: u32) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("tmp");
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(mode)
        .open(&tmp)?;
    f.write_all(bytes)?;
    f.sync_all()?;
    std::fs::rename(&tmp, path)
}

impl InterceptionCa {
    /// Reads the CA from `<state_dir>/actions-interception/`, or makes one
    /// there when there is none; then signs a fresh leaf for
    /// [`RESULTS_HOST`].
    ///
    /// # Errors
    ///
    /// [`CaError`] naming the file or saying what to do.
    pub fn load_or_create(state_dir: &Path) -> Result<Self, CaError> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = state_dir.join(CA_DIR);
        let cert_path = dir.join("ca.pem");
        let key_path = dir.join("ca.key");
        let unusable = |message: String| CaError::Unusable {
            dir: dir.clone(),
            message,
        };
        let io = |op, path: &Path| {
            let path = path.to_owned();
            move |source| CaError::Io { op, path, source }
        };
        let (ca_pem, issuer) = if key_path.exists() {
            let ca_pem =
                std::fs::read_to_string(&cert_path).map_err(io("cannot read", &cert_path))?;
            let key_pem =
                std::fs::read_to_string(&key_path).map_err(io("cannot read", &key_path))?;
            let key = KeyPair::from_pem(&key_pem).map_err(|e| unusable(e.to_string()))?;
            let issuer =
                Issuer::from_ca_cert_pem(&ca_pem, key).map_err(|e| unusable(e.to_string()))?;
            (ca_pem, issuer)
        } else {
            std::fs::create_dir_all(&dir).map_err(io("cannot create", &dir))?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700))
                .map_err(io("cannot restrict", &dir))?;
            let mut params = CertificateParams::default();
            params.distinguished_name = name("billet node Actions cache interception CA");
            params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
            params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
            params.not_after = rcgen::date_time_ymd(2125, 1, 1);
            let key = KeyPair::generate().map_err(|e| unusable(e.to_string()))?;
            let cert = params
                .self_signed(&key)
                .map_err(|e| unusable(e.to_string()))?;
            // The certificate first: a key without its certificate is
            // never found, so a crash between the two makes a new CA.
            write_private(&cert_path, cert.pem().as_bytes(), 0o644)
                .map_err(io("cannot write", &cert_path))?;
            write_private(&key_path, key.serialize_pem().as_bytes(), 0o600)
                .map_err(io("cannot write", &key_path))?;
            (cert.pem(), Issuer::new(params, key))
        };
        let mut params = CertificateParams::default();
        params.distinguished_name = name(RESULTS_HOST);
        params.subject_alt_names = vec![SanType::DnsName(
            RESULTS_HOST
                .try_into()
                .expect("the results host is a DNS name"),
        )];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        params.use_authority_key_identifier_extension = true;
        let now = std::time::SystemTime::now();
        params.not_before = (now - std::time::Duration::from_secs(3600)).into();
        params.not_after = (now + std::time::Duration::from_secs(400 * 86_400)).into();
        let leaf_key = KeyPair::generate().map_err(|e| unusable(e.to_string()))?;
        let leaf = params
            .signed_by(&leaf_key, &issuer)
            .map_err(|e| unusable(e.to_string()))?;
        // AES-128-GCM first, whatever the guest lists first: the archives
        // a restore streams cost one AES pass per byte on each side, and
        // 128-bit keys take 10 rounds where 256-bit ones take 14.
        let mut provider = rustls::crypto::aws_lc_rs::default_provider();
        provider
            .cipher_suites
            .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        let mut server = rustls::ServerConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(|e| unusable(e.to_string()))?
            .with_no_client_auth()
            .with_single_cert(
                vec![leaf.der().clone()],
                rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
            )
            .map_err(|e| unusable(e.to_string()))?;
        server.ignore_client_order = true;
        Ok(Self {
            ca_pem,
            server: Arc::new(server),
        })
    }

    /// The CA's certificate, PEM: what a guest trusts.
    #[must_use]
    pub fn ca_pem(&self) -> &str {
        &self.ca_pem
    }

    /// The results host's TLS configuration (TLS 1.3 only, the node's leaf).
    #[must_use]
    pub(crate) fn server_config(&self) -> Arc<rustls::ServerConfig> {
        self.server.clone()
    }
}

fn name(common: &str) -> DistinguishedName {
    let mut dn = DistinguishedName::new();
    dn.push(DnType::CommonName, common);
    dn
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ca_is_made_once_with_a_private_key_and_read_back_after_a_restart() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = std::env::temp_dir().join(format!("bca-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let first = InterceptionCa::load_or_create(&dir).unwrap();
        let mode = |f: &str| {
            std::fs::metadata(dir.join(CA_DIR).join(f))
                .unwrap()
                .permissions()
                .mode()
                & 0o777
        };
        assert_eq!(mode("ca.key"), 0o600);
        let again = InterceptionCa::load_or_create(&dir).unwrap();
        assert_eq!(first.ca_pem(), again.ca_pem());
        assert!(first.ca_pem().starts_with("-----BEGIN CERTIFICATE-----"));
        std::fs::write(dir.join(CA_DIR).join("ca.key"), "not a key").unwrap();
        assert!(matches!(
            InterceptionCa::load_or_create(&dir),
            Err(CaError::Unusable { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A restore's bytes are encrypted once on each side: the leg to the
    /// guest uses AES-128-GCM even when the guest lists AES-256 first (as
    /// rustls' and OpenSSL's defaults do), the cheaper of TLS 1.3's AES
    /// suites.
    #[tokio::test]
    async fn the_guest_leg_uses_aes_128_whatever_the_guest_prefers() {
        let dir = std::env::temp_dir().join(format!("bca-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let ca = InterceptionCa::load_or_create(&dir).unwrap();
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile::certs(&mut ca.ca_pem().as_bytes()) {
            roots.add(cert.unwrap()).unwrap();
        }
        let mut provider = rustls::crypto::aws_lc_rs::default_provider();
        provider
            .cipher_suites
            .sort_by_key(|s| s.suite() != rustls::CipherSuite::TLS13_AES_256_GCM_SHA384);
        let client = rustls::ClientConfig::builder_with_provider(Arc::new(provider))
            .with_protocol_versions(&[&rustls::version::TLS13])
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let (c, s) = tokio::io::duplex(1 << 16);
        let acceptor = tokio_rustls::TlsAcceptor::from(ca.server_config());
        let server = tokio::spawn(async move { acceptor.accept(s).await.map(|_| ()) });
        let tls = tokio_rustls::TlsConnector::from(Arc::new(client))
            .connect(
                rustls::pki_types::ServerName::try_from(super::super::RESULTS_HOST).unwrap(),
                c,
            )
            .await
            .unwrap();
        server.await.unwrap().unwrap();
        assert_eq!(
            tls.get_ref().1.negotiated_cipher_suite().map(|s| s.suite()),
            Some(rustls::CipherSuite::TLS13_AES_128_GCM_SHA256)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
