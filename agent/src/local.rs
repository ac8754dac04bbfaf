//! The client of the node's local socket, `<state_dir>/node.sock`, for
//! whoever runs on the same host: `billet node status`, `billet check`,
//! `billet node enroll` and the updater. The service itself is
//! the gRPC face's (`edge::local`).
//!
//! The updater's health check ([`check`]) is: health `SERVING` for the
//! `Node` service, the expected version, and start-up recovery done (which
//! needs the plane to have attached and received this process's `Hello`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio::net::UnixStream;

/// The socket's file name inside the state directory.
pub(crate) const SOCKET_FILE: &str = "node.sock";

/// The socket's path for a state directory.
pub fn socket_path(state_dir: &Path) -> PathBuf {
    state_dir.join(SOCKET_FILE)
}

/// What a node answered on its local socket.
#[derive(Debug, Clone, PartialEq)]
pub struct Observed {
    /// Whether `grpc.health.v1` says the `Node` service is serving.
    pub serving: bool,
    /// Its status.
    pub status: pb::LocalStatus,
}

impl Observed {
    /// Healthy at `version`: serving, recovered, not draining, that version.
    pub(crate) fn healthy_at(&self, version: &str) -> bool {
        self.serving
            && self.status.recovered
            && !self.status.draining
            && self.status.version == version
    }
}

/// Asks the node whose state directory is `state_dir` for its health and
/// status, giving up after `timeout`.
///
/// # Errors
///
/// A message saying what failed (no socket, no answer, an RPC error).
pub async fn check(state_dir: &Path, timeout: Duration) -> Result<Observed, String> {
    tokio::time::timeout(timeout, ask(socket_path(state_dir)))
        .await
        .map_err(|_| {
            format!(
                "no answer on {} within {timeout:?}",
                socket_path(state_dir).display()
            )
        })?
}

/// Why [`enroll`] did not put a new certificate in force.
#[derive(Debug, Error)]
pub(crate) enum EnrollFailure {
    /// No node answers on the socket.
    #[error("{0}")]
    NotRunning(String),
    /// The plane refused the token or the request (unknown, used, expired,
    /// another node's).
    #[error("{0}")]
    Refused(String),
    /// Anything else: the plane unreachable, the certificate not
    /// installable; the message says which.
    #[error("{0}")]
    Failed(String),
}

/// Asks the node whose state directory is `state_dir` to re-enrol with
/// `token` at the plane's enrolment endpoint `plane_address`, giving up
/// after `timeout`; answers when the new certificate expires (unix ms).
///
/// # Errors
///
/// [`EnrollFailure`].
pub(crate) async fn enroll(
    state_dir: &Path,
    token: &crate::tls::enroll::JoinToken,
    plane_address: &str,
    timeout: Duration,
) -> Result<i64, EnrollFailure> {
    let path = socket_path(state_dir);
    let shown = path.display().to_string();
    let asked = async {
        let channel = connect(path).await.map_err(EnrollFailure::NotRunning)?;
        pb::local_client::LocalClient::new(channel)
            .enroll(pb::EnrollRequest {
                token: token.expose().to_owned(),
                plane_address: plane_address.to_owned(),
            })
            .await
            .map(|r| r.into_inner().certificate_not_after_unix_ms)
            .map_err(|s| match s.code() {
                tonic::Code::PermissionDenied => EnrollFailure::Refused(s.message().to_owned()),
                _ => EnrollFailure::Failed(s.message().to_owned()),
            })
    };
    tokio::time::timeout(timeout, asked)
        .await
        .map_err(|_| EnrollFailure::Failed(format!("no answer on {shown} within {timeout:?}")))?
}

/// Why this user may not use the node's socket, when the kernel refuses
/// it (the state directory or the socket is another user's); `None` when
/// it may, or when the socket is absent or dead.
pub(crate) fn refusal(state_dir: &Path) -> Option<String> {
    refusal_at(&socket_path(state_dir))
}

fn refusal_at(path: &Path) -> Option<String> {
    let refused = match std::fs::symlink_metadata(path) {
        Err(e) if crate::access::is_refusal(&e) => e,
        Err(_) => return None,
        Ok(_) => match std::os::unix::net::UnixStream::connect(path) {
            Err(e) if crate::access::is_refusal(&e) => e,
            _ => return None,
        },
    };
    Some(crate::access::refused(
        path,
        "use",
        &refused,
        "whether a node runs there cannot be told by this user; run the command as that owner or as root (sudo -u OWNER, or sudo)",
    ))
}

async fn connect(path: PathBuf) -> Result<tonic::transport::Channel, String> {
    let shown = path.display().to_string();
    // Asked first: a socket this user may not look at is not an absent one.
    if let Some(why) = refusal_at(&path) {
        return Err(why);
    }
    if !path.exists() {
        return Err(format!(
            "{shown} does not exist: no node is running on this state directory"
        ));
    }
    // The URI is required by the API and unused: the connector dials the
    // socket.
    tonic::transport::Endpoint::from_static("http://node.local")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let path = path.clone();
            async move {
                UnixStream::connect(path)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await
        .map_err(|e| format!("{shown}: cannot connect: {e}"))
}

async fn ask(path: PathBuf) -> Result<Observed, String> {
    let shown = path.display().to_string();
    let channel = connect(path).await?;
    let health = tonic_health::pb::health_client::HealthClient::new(channel.clone())
        .check(tonic_health::pb::HealthCheckRequest {
            service: pb::node_server::SERVICE_NAME.to_owned(),
        })
        .await
        .map_err(|e| format!("{shown}: health check: {}", e.message()))?
        .into_inner();
    let status = pb::local_client::LocalClient::new(channel)
        .status(pb::StatusRequest {})
        .await
        .map_err(|e| format!("{shown}: status: {}", e.message()))?
        .into_inner();
    Ok(Observed {
        serving: health.status
            == tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
        status,
    })
}
