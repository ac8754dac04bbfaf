//! What the wire carries back to a node: a lease ([`lease_to_wire`]), and a
//! ledger refusal or a signing refusal as a typed `pb::Error`.

use billet_proto::v1 as pb;

use crate::identity::SignError;
use crate::ledger::LedgerError;

pub(super) fn error(code: pb::ErrorCode, message: impl Into<String>) -> pb::Error {
    pb::Error {
        retry_after_ms: 0,
        code: code.into(),
        message: message.into(),
    }
}

pub(super) fn ledger_error(e: &LedgerError) -> pb::Error {
    let code = match e {
        LedgerError::Fenced { .. } => pb::ErrorCode::Fenced,
        LedgerError::NotFound(_) => pb::ErrorCode::NotFound,
        LedgerError::BadTransition { .. } => pb::ErrorCode::BadTransition,
        LedgerError::WrongNode { .. } => pb::ErrorCode::WrongNode,
        LedgerError::ForceRelease(_) => pb::ErrorCode::ForceRelease,
        LedgerError::Conflict(_) | LedgerError::NoCapacity { .. } => pb::ErrorCode::Refused,
        LedgerError::Invalid(_) => pb::ErrorCode::InvalidArgument,
        LedgerError::Storage(_) => pb::ErrorCode::Unavailable,
    };
    error(code, e.to_string())
}

/// A refusal to sign, as the wire carries it: `ERROR_CODE_IDENTITY_REFUSED`,
/// or `ERROR_CODE_INTERNAL` when the CA itself failed.
pub(crate) fn sign_error(e: &SignError) -> pb::Error {
    let code = match e {
        SignError::Malformed(_) | SignError::WrongName { .. } => pb::ErrorCode::IdentityRefused,
        SignError::Signing(_) => pb::ErrorCode::Internal,
    };
    error(code, e.to_string())
}

/// A lease as the wire carries it.
pub fn lease_to_wire(l: &crate::ledger::Lease) -> pb::Lease {
    pb::Lease {
        id: l.id.clone(),
        epoch: l.epoch,
        tier: l.tier.clone(),
        phase: l.phase.as_str().into(),
        vcpu: l.vcpu,
        memory_bytes: l.memory_bytes,
        node: l.node.clone().unwrap_or_default(),
        request_id: l.request_id,
        providers: Vec::new(),
        failure_reason: l.failure_reason.clone().unwrap_or_default(),
        end_reason: l
            .end()
            .map_or(pb::EndReason::Unspecified, |(code, _)| code.into())
            .into(),
        end_detail: l.end().map(|(_, detail)| detail).unwrap_or_default(),
    }
}
