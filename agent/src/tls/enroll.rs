//! The node's side of re-enrolment: a certificate request made here from a
//! fresh key, and the one call to the plane's enrolment endpoint
//! (`billet.node.v1.Enrollment/Enroll`), the only connection the node ever
//! dials. The endpoint authenticates the plane (its certificate must chain
//! to the node's CA and carry the plane's name) and the node proves itself
//! with a one-time join token instead of a client certificate, since its
//! own has expired.
//!
//! The join token is a credential ([`JoinToken`]: redacted `Debug`, never
//! logged); the private key never leaves the node.

use std::fmt;
use std::time::Duration;

use billet_proto::v1 as pb;
use thiserror::Error;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

use crate::model::NodeName;

/// How long the enrolment call may take, connection included.
pub(crate) const ENROLL_TIMEOUT: Duration = Duration::from_secs(30);

/// A one-time join token the plane issued, as an operator hands it to the
/// node. A credential: `Debug` prints `<redacted>`, and only
/// [`JoinToken::expose`] reads it, to send it to the plane.
#[derive(Clone, PartialEq, Eq)]
pub(crate) struct JoinToken(String);

impl JoinToken {
    /// Wraps a token, trimmed of surrounding whitespace (a file's newline).
    ///
    /// # Errors
    ///
    /// A sentence when it is empty or holds whitespace or control characters.
    pub(crate) fn parse(text: &str) -> Result<Self, String> {
        let token = text.trim();
        if token.is_empty() {
            return Err("the join token is empty".into());
        }
        if token.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err("the join token holds whitespace or control characters; give it as the plane printed it".into());
        }
        Ok(Self(token.to_owned()))
    }

    /// The token, for the enrolment call and nothing else.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for JoinToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JoinToken(<redacted>)")
    }
}

/// A fresh private key and a certificate request for it.
pub(crate) struct Request {
    /// The certificate request, PKCS#10 PEM: what goes to the plane.
    pub csr_pem: String,
    /// The private key, PKCS#8 PEM: a credential that stays on the node.
    pub key_pem: String,
}

impl fmt::Debug for Request {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Request { key: <redacted>, .. }")
    }
}

/// Makes a fresh ECDSA P-256 key and a certificate request naming `node`
/// (common name and only DNS subject alternative name), signed by it.
///
/// # Errors
///
/// rcgen's reason, as text.
pub(crate) fn request(node: &NodeName) -> Result<Request, String> {
    let key = rcgen::KeyPair::generate().map_err(|e| format!("cannot generate a key: {e}"))?;
    let mut params = rcgen::CertificateParams::new(vec![node.as_str().to_owned()])
        .map_err(|e| format!("{node} cannot be a certificate's DNS name: {e}"))?;
    let mut name = rcgen::DistinguishedName::new();
    name.push(rcgen::DnType::CommonName, node.as_str());
    params.distinguished_name = name;
    let csr = params
        .serialize_request(&key)
        .and_then(|r| r.pem())
        .map_err(|e| format!("cannot make a certificate request: {e}"))?;
    Ok(Request {
        csr_pem: csr,
        key_pem: key.serialize_pem(),
    })
}

/// Why an enrolment call did not yield a certificate.
#[derive(Debug, Error)]
pub(crate) enum EnrollError {
    /// The address or the CA cannot be used.
    #[error("{0}")]
    Config(String),
    /// The plane could not be reached or did not answer; retry.
    #[error("the plane's enrolment endpoint at {address}: {reason}")]
    Unavailable {
        /// Where.
        address: String,
        /// Why.
        reason: String,
    },
    /// The plane refused: the token is unknown, used or expired, or the
    /// request names another node (`ERROR_CODE_IDENTITY_REFUSED`).
    #[error("the plane refused the enrolment: {0}")]
    Refused(String),
}

/// Asks the plane's enrolment endpoint at `address` (HOST:PORT) to sign
/// `csr_pem` with `token`; answers the certificate chain, PEM. The plane's
/// certificate must chain to `ca_pem` and carry `plane_name`.
///
/// # Errors
///
/// [`EnrollError`]: a refusal is final for this token; unavailability is
/// worth retrying.
pub(crate) async fn enroll(
    address: &str,
    ca_pem: &[u8],
    plane_name: &str,
    token: &JoinToken,
    csr_pem: &str,
) -> Result<String, EnrollError> {
    let unavailable = |reason: String| EnrollError::Unavailable {
        address: address.to_owned(),
        reason,
    };
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca_pem))
        .domain_name(plane_name.to_owned());
    let endpoint = Endpoint::from_shared(format!("https://{address}"))
        .map_err(|e| EnrollError::Config(format!("{address:?} is not HOST:PORT: {e}")))?
        .tls_config(tls)
        .map_err(|e| EnrollError::Config(format!("the CA bundle: {e}")))?
        .connect_timeout(ENROLL_TIMEOUT)
        .timeout(ENROLL_TIMEOUT);
    let channel = endpoint.connect().await.map_err(|e| {
        use std::error::Error as _;
        let mut text = e.to_string();
        let mut source = e.source();
        while let Some(s) = source {
            text.push_str(": ");
            text.push_str(&s.to_string());
            source = s.source();
        }
        unavailable(text)
    })?;
    let reply = pb::enrollment_client::EnrollmentClient::new(channel)
        .enroll(pb::EnrollmentRequest {
            token: token.expose().to_owned(),
            csr_pem: csr_pem.to_owned(),
        })
        .await
        .map_err(|s| unavailable(format!("{}: {}", s.code(), s.message())))?
        .into_inner();
    let pb::EnrollmentReply { error, certificate } = reply;
    if let Some(pb::Error {
        code,
        message,
        retry_after_ms: _,
    }) = error
    {
        return Err(
            match pb::ErrorCode::try_from(code).unwrap_or(pb::ErrorCode::Unspecified) {
                pb::ErrorCode::Unavailable | pb::ErrorCode::ResourceExhausted => {
                    unavailable(message)
                }
                _ => EnrollError::Refused(message),
            },
        );
    }
    match certificate {
        Some(pb::IssuedCertificate {
            certificate_chain_pem,
        }) if !certificate_chain_pem.is_empty() => Ok(certificate_chain_pem),
        _ => Err(EnrollError::Refused(
            "the plane answered without a certificate".into(),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_join_token_never_shows_in_debug_and_is_trimmed() {
        let token = JoinToken::parse("  billet-join.abc.secret\n").expect("token");
        assert_eq!(token.expose(), "billet-join.abc.secret");
        assert!(!format!("{token:?}").contains("secret"));
        assert!(JoinToken::parse(" \n").is_err());
        assert!(JoinToken::parse("a b").is_err());
    }

    #[test]
    fn a_request_names_the_node_and_its_key_stays_out_of_debug() {
        let node = NodeName::parse("test", "node-1").expect("name");
        let req = request(&node).expect("request");
        assert!(req.csr_pem.contains("BEGIN CERTIFICATE REQUEST"));
        assert!(req.key_pem.contains("PRIVATE KEY"));
        assert!(!format!("{req:?}").contains("PRIVATE"));
    }
}
