//! The plane's certificate authority for its nodes, and one-time join
//! tokens.
//!
//! [`NodeCa`] signs a node's certificate request with rcgen, for the node
//! the request must name: over the session, the node the session
//! authenticated (the plane dialed it and its certificate named it); at the
//! enrolment endpoint, the node a join token was issued for. A request that
//! names anything else, names more, or does not verify is refused
//! ([`SignError`], `ERROR_CODE_IDENTITY_REFUSED` on the wire). The plane
//! chooses everything in the certificate but the public key: the request's
//! own extensions are never copied.
//!
//! A join token is `billet-join.<id>.<secret>`: the ledger keeps the id, the
//! node it was issued for, when it expires, whether it was used, and only a
//! SHA-256 of the secret, compared in constant time (`JoinToken`,
//! [`issue_join_token`]); the token itself is never logged or stored.

use std::fmt;
use std::time::Duration;

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, DnType,
    ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair, KeyUsagePurpose, SanType,
};
use sha2::{Digest as _, Sha256};
use thiserror::Error;

use crate::ledger::{Ledger, LedgerError};

/// How long a certificate this CA signs lasts unless told otherwise.
pub const DEFAULT_NODE_CERT_LIFETIME: Duration = Duration::from_secs(30 * 24 * 3600);
/// How long a join token is good for unless told otherwise.
pub const DEFAULT_JOIN_TOKEN_TTL: Duration = Duration::from_secs(3600);
/// How far before now a signed certificate's validity starts, so a node
/// whose clock is a little behind the plane's accepts it at once.
pub(crate) const BACKDATE: Duration = Duration::from_secs(60);
/// What every join token starts with.
pub(crate) const TOKEN_PREFIX: &str = "billet-join";

/// Why a CA could not be loaded.
#[derive(Debug, Error)]
pub enum CaError {
    /// The certificate or key is not usable PEM.
    #[error("{what}: {reason}")]
    Unusable {
        /// Which file's content.
        what: &'static str,
        /// rcgen's reason.
        reason: String,
    },
}

/// Why a certificate request is not signed.
#[derive(Debug, Error, PartialEq, Eq)]
pub(crate) enum SignError {
    /// Not a PKCS#10 request, its signature does not verify, or it asks
    /// for an extension this CA does not read.
    #[error("the certificate request is malformed: {0}")]
    Malformed(String),
    /// It names another node (or more than one name, or no DNS name).
    #[error("the certificate request names {asked:?}; only {node} may be asked for here")]
    WrongName {
        /// The node the request must name.
        node: String,
        /// What it names.
        asked: Vec<String>,
    },
    /// rcgen could not sign it.
    #[error("cannot sign: {0}")]
    Signing(String),
}

/// The deployment CA, able to sign node certificates. Its key is a
/// credential: `Debug` does not show it.
pub struct NodeCa {
    issuer: Issuer<'static, KeyPair>,
    lifetime: Duration,
}

impl fmt::Debug for NodeCa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCa")
            .field("key", &"<redacted>")
            .field("lifetime", &self.lifetime)
            .finish()
    }
}

impl NodeCa {
    /// The CA whose certificate and key are `cert_pem` and `key_pem`, signing
    /// certificates that last `lifetime`.
    ///
    /// # Errors
    ///
    /// [`CaError`] naming which of the two is unusable.
    pub fn from_pem(cert_pem: &str, key_pem: &str, lifetime: Duration) -> Result<Self, CaError> {
        let key = KeyPair::from_pem(key_pem).map_err(|e| CaError::Unusable {
            what: "the CA key",
            reason: e.to_string(),
        })?;
        let issuer = Issuer::from_ca_cert_pem(cert_pem, key).map_err(|e| CaError::Unusable {
            what: "the CA certificate",
            reason: e.to_string(),
        })?;
        Ok(Self { issuer, lifetime })
    }

    /// Signs `csr_pem` for `node`, which must be its only name; answers the
    /// certificate, PEM: valid from [`BACKDATE`] ago for the CA's lifetime,
    /// serverAuth and clientAuth, `node` as common name and only DNS name.
    ///
    /// # Errors
    ///
    /// [`SignError`]: a malformed request, or one for another name.
    pub(crate) fn sign(&self, csr_pem: &str, node: &str) -> Result<String, SignError> {
        let mut csr = CertificateSigningRequestParams::from_pem(csr_pem)
            .map_err(|e| SignError::Malformed(e.to_string()))?;
        let asked: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .map(|san| match san {
                SanType::DnsName(name) => name.as_str().to_owned(),
                other => format!("{other:?}"),
            })
            .collect();
        if asked != [node] {
            return Err(SignError::WrongName {
                node: node.to_owned(),
                asked,
            });
        }
        let mut params = CertificateParams::new(vec![node.to_owned()])
            .map_err(|e| SignError::Signing(e.to_string()))?;
        let mut name = DistinguishedName::new();
        name.push(DnType::CommonName, node);
        params.distinguished_name = name;
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let now = std::time::SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + self.lifetime).into();
        csr.params = params;
        let cert = csr
            .signed_by(&self.issuer)
            .map_err(|e| SignError::Signing(e.to_string()))?;
        Ok(cert.pem())
    }
}

/// A join token, parsed: its id (what the ledger looks it up by) and the
/// SHA-256 of its secret. The secret itself is not kept.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct JoinToken {
    /// The ledger's key for it.
    pub(crate) id: String,
    /// SHA-256 of the secret part.
    pub(crate) secret_sha256: [u8; 32],
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("JoinToken")
            .field("id", &self.id)
            .field("secret", &"<redacted>")
            .finish()
    }
}

impl JoinToken {
    /// Makes a fresh token: answers the token to hand out, once, and what
    /// the ledger keeps of it.
    pub(crate) fn generate() -> (String, JoinToken) {
        let id = uuid::Uuid::new_v4().simple().to_string();
        let secret = format!(
            "{}{}",
            uuid::Uuid::new_v4().simple(),
            uuid::Uuid::new_v4().simple()
        );
        let token = format!("{TOKEN_PREFIX}.{id}.{secret}");
        let parsed = JoinToken {
            id,
            secret_sha256: Sha256::digest(secret.as_bytes()).into(),
        };
        (token, parsed)
    }

    /// Reads a token as [`JoinToken::generate`] printed it; `None` when it
    /// does not have that shape (refused like an unknown token).
    pub(crate) fn parse(token: &str) -> Option<JoinToken> {
        let mut parts = token.trim().split('.');
        let (prefix, id, secret) = (parts.next()?, parts.next()?, parts.next()?);
        if prefix != TOKEN_PREFIX || parts.next().is_some() || id.is_empty() || secret.is_empty() {
            return None;
        }
        Some(JoinToken {
            id: id.to_owned(),
            secret_sha256: Sha256::digest(secret.as_bytes()).into(),
        })
    }
}

/// Issues a join token for `node`, good for `ttl` from `now_ms`, recorded in
/// `ledger`; answers the token, which is shown once and never stored.
///
/// # Errors
///
/// [`LedgerError`] when the ledger cannot record it.
pub async fn issue_join_token(
    ledger: &Ledger,
    node: &str,
    ttl: Duration,
    now_ms: i64,
) -> Result<String, LedgerError> {
    let (text, token) = JoinToken::generate();
    let ttl_ms = i64::try_from(ttl.as_millis()).unwrap_or(i64::MAX);
    ledger
        .issue_join_token(&token, node, now_ms.saturating_add(ttl_ms), now_ms)
        .await?;
    Ok(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ca() -> (NodeCa, String) {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::default();
        params.is_ca = IsCa::Ca(rcgen::BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let cert = params.self_signed(&key).expect("CA");
        let ca = NodeCa::from_pem(&cert.pem(), &key.serialize_pem(), Duration::from_secs(300))
            .expect("ca");
        (ca, cert.pem())
    }

    fn csr(names: &[&str]) -> String {
        let key = KeyPair::generate().expect("key");
        CertificateParams::new(names.iter().map(|n| (*n).to_owned()).collect::<Vec<_>>())
            .expect("params")
            .serialize_request(&key)
            .expect("csr")
            .pem()
            .expect("pem")
    }

    #[test]
    fn a_request_for_the_sessions_node_is_signed_for_that_name_and_lifetime() {
        let (ca, _) = ca();
        let pem = ca.sign(&csr(&["node-1"]), "node-1").expect("signed");
        let der = rustls_pemfile_free_der(&pem);
        let (_, cert) = x509_parser::parse_x509_certificate(&der).expect("x509");
        let names: Vec<String> = cert
            .subject_alternative_name()
            .expect("san")
            .expect("present")
            .value
            .general_names
            .iter()
            .map(|n| match n {
                x509_parser::extensions::GeneralName::DNSName(d) => (*d).to_owned(),
                other => format!("{other:?}"),
            })
            .collect();
        assert_eq!(names, ["node-1"]);
        let lifetime =
            cert.validity().not_after.timestamp() - cert.validity().not_before.timestamp();
        assert_eq!(lifetime, 300 + 60, "lifetime plus the backdating");
    }

    #[test]
    fn a_request_naming_another_node_or_more_than_its_own_is_refused() {
        let (ca, _) = ca();
        assert_eq!(
            ca.sign(&csr(&["node-2"]), "node-1"),
            Err(SignError::WrongName {
                node: "node-1".into(),
                asked: vec!["node-2".into()],
            })
        );
        assert!(matches!(
            ca.sign(&csr(&["node-1", "plane"]), "node-1"),
            Err(SignError::WrongName { .. })
        ));
        assert!(matches!(
            ca.sign(&csr(&[]), "node-1"),
            Err(SignError::WrongName { .. })
        ));
    }

    #[test]
    fn a_request_that_is_not_one_or_whose_signature_fails_is_refused_as_malformed() {
        let (ca, _) = ca();
        assert!(matches!(
            ca.sign("not a request", "node-1"),
            Err(SignError::Malformed(_))
        ));
        // A request whose signed body was altered: one byte of its
        // signature flipped.
        let good = csr(&["node-1"]);
        let mut der = rustls_pemfile_free_der(&good);
        let last = der.len() - 1;
        der[last] ^= 0x01;
        let bad = pem_encode("CERTIFICATE REQUEST", &der);
        assert!(matches!(
            ca.sign(&bad, "node-1"),
            Err(SignError::Malformed(_))
        ));
    }

    #[test]
    fn a_token_parses_back_to_what_the_ledger_keeps_and_its_secret_stays_out_of_debug() {
        let (text, token) = JoinToken::generate();
        assert!(text.starts_with("billet-join."));
        assert_eq!(JoinToken::parse(&text), Some(token.clone()));
        let secret = text.rsplit('.').next().expect("secret");
        assert!(!format!("{token:?}").contains(secret));
        assert_eq!(JoinToken::parse("billet-join.abc"), None);
        assert_eq!(JoinToken::parse("other.abc.def"), None);
        assert_ne!(
            JoinToken::parse(&format!("{text}x")).map(|t| t.secret_sha256),
            Some(token.secret_sha256)
        );
    }

    fn rustls_pemfile_free_der(pem: &str) -> Vec<u8> {
        use base64::Engine as _;
        let body: String = pem.lines().filter(|l| !l.starts_with("-----")).collect();
        base64::engine::general_purpose::STANDARD
            .decode(body)
            .expect("base64")
    }

    fn pem_encode(label: &str, der: &[u8]) -> String {
        use base64::Engine as _;
        let body = base64::engine::general_purpose::STANDARD.encode(der);
        let lines: Vec<&str> = body
            .as_bytes()
            .chunks(64)
            .map(|c| std::str::from_utf8(c).expect("ascii"))
            .collect();
        format!(
            "-----BEGIN {label}-----\n{}\n-----END {label}-----\n",
            lines.join("\n")
        )
    }
}
