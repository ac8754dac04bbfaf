//! The plane's enrolment endpoint, `billet.node.v1.Enrollment/Enroll`, for
//! a node whose certificate expired: served over TLS that authenticates the
//! plane only (its own certificate; no client certificate is asked for,
//! since the node's has expired). The node proves itself with a one-time
//! join token ([`crate::identity`]) issued for its name; the CA signs its
//! request only for that name, and only then is the token used up, so a
//! request for the wrong name does not burn it. Tokens never reach a log.

use std::sync::Arc;

use billet_proto::v1 as pb;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};
use tracing::{info, warn};

use crate::calls::sign_error;
use crate::identity::{JoinToken, NodeCa};
use crate::ledger::Ledger;
use crate::node_link::{LinkError, PlaneTls};

/// The `Enrollment` service.
#[derive(Debug)]
pub(crate) struct EnrollmentService {
    ledger: Arc<Ledger>,
    ca: Option<Arc<NodeCa>>,
}

impl EnrollmentService {
    /// Checks tokens in `ledger` and signs with `ca` (without it every
    /// enrolment is answered unavailable).
    pub(crate) fn new(ledger: Arc<Ledger>, ca: Option<Arc<NodeCa>>) -> Self {
        Self { ledger, ca }
    }

    async fn answer(&self, request: pb::EnrollmentRequest) -> Result<String, pb::Error> {
        let refused = |message: String| pb::Error {
            retry_after_ms: 0,
            code: pb::ErrorCode::IdentityRefused.into(),
            message,
        };
        let unavailable = |message: String| pb::Error {
            retry_after_ms: 0,
            code: pb::ErrorCode::Unavailable.into(),
            message,
        };
        let pb::EnrollmentRequest { token, csr_pem } = request;
        let Some(ca) = &self.ca else {
            return Err(unavailable(
                "this plane holds no CA key (billet-plane --ca-key) and signs no certificates"
                    .into(),
            ));
        };
        let Some(token) = JoinToken::parse(&token) else {
            warn!("refused an enrolment: not a join token");
            return Err(refused(
                "the join token is not one this plane issued".into(),
            ));
        };
        let now = crate::now_ms();
        let node = match self.ledger.join_token_node(&token, now).await {
            Ok(Ok(node)) => node,
            Ok(Err(why)) => {
                warn!(token_id = %token.id, reason = %why, "refused an enrolment");
                return Err(refused(why.to_string()));
            }
            Err(e) => return Err(unavailable(e.to_string())),
        };
        let chain = ca.sign(&csr_pem, &node).map_err(|e| {
            warn!(node, error = %e, "refused an enrolment's certificate request");
            sign_error(&e)
        })?;
        match self.ledger.redeem_join_token(&token, now).await {
            Ok(Ok(_)) => {
                info!(node, token_id = %token.id, "enrolled a node with a join token");
                Ok(chain)
            }
            Ok(Err(why)) => {
                warn!(token_id = %token.id, reason = %why, "refused an enrolment");
                Err(refused(why.to_string()))
            }
            Err(e) => Err(unavailable(e.to_string())),
        }
    }
}

#[tonic::async_trait]
impl pb::enrollment_server::Enrollment for EnrollmentService {
    async fn enroll(
        &self,
        request: Request<pb::EnrollmentRequest>,
    ) -> Result<Response<pb::EnrollmentReply>, Status> {
        let reply = match self.answer(request.into_inner()).await {
            Ok(certificate_chain_pem) => pb::EnrollmentReply {
                error: None,
                certificate: Some(pb::IssuedCertificate {
                    certificate_chain_pem,
                }),
            },
            Err(error) => pb::EnrollmentReply {
                error: Some(error),
                certificate: None,
            },
        };
        Ok(Response::new(reply))
    }
}

/// Serves `service` on `listener` over TLS with the plane's certificate
/// (no client certificate asked) until `shutdown`.
///
/// # Errors
///
/// [`LinkError::Config`] for unusable TLS material; [`LinkError::Session`]
/// when the server fails.
pub(crate) async fn serve(
    listener: TcpListener,
    tls: &PlaneTls,
    service: EnrollmentService,
    shutdown: CancellationToken,
) -> Result<(), LinkError> {
    Server::builder()
        .tls_config(
            ServerTlsConfig::new().identity(Identity::from_pem(&tls.cert_pem, &tls.key_pem)),
        )
        .map_err(|e| LinkError::Config(format!("enrolment endpoint TLS: {e}")))?
        .add_service(pb::enrollment_server::EnrollmentServer::new(service))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
        .map_err(|e| LinkError::Session(format!("enrolment endpoint: {e}")))
}
