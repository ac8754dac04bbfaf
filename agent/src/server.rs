//! Wires the node together and serves it: TLS material, the provider, the
//! plane link, the runner, the command slot and its executor, KeepAlive, and
//! the gRPC server (`Node` plus `grpc.health.v1`) behind our own mTLS
//! acceptor. Takes the bound listener and a stop signal, so tests start the
//! real thing on port 0.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use billet_proto::v1 as pb;
use thiserror::Error;
use tokio::net::TcpListener;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::{Instrument, info, info_span};

use crate::plane::PlaneLink;
use crate::provider::docker::DockerProvider;
use crate::provider::{Owner, Provider};
use crate::runner::{Runner, RunnerOptions};
use crate::session::{Identity, NodeService, execute_commands};
use crate::slot::CommandSlot;
use crate::tls::{NodeTls, TlsError, TlsPaths};

/// Everything `billet node` needs, checked.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Certificate, key and CA.
    pub tls: TlsPaths,
    /// The name the plane's client certificate must carry.
    pub plane_name: String,
    /// The deployment this node belongs to.
    pub deployment: String,
    /// Where the node keeps its state (mode 0700).
    pub state_dir: PathBuf,
    /// The Docker engine's socket.
    pub docker_socket: PathBuf,
    /// vCPUs offered.
    pub vcpu: u32,
    /// Memory offered, in bytes.
    pub memory_bytes: u64,
    /// See [`RunnerOptions::max_custody`].
    pub max_custody: Option<Duration>,
}

/// Why the node could not start or stopped with an error.
#[derive(Debug, Error)]
pub enum NodeError {
    /// The TLS material is unusable.
    #[error(transparent)]
    Tls(#[from] TlsError),
    /// The state directory cannot be used.
    #[error("state directory {path}: {source}")]
    StateDir {
        /// The directory.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The provider cannot be reached.
    #[error(transparent)]
    Provider(#[from] crate::provider::ProviderError),
    /// The gRPC server failed.
    #[error("serving: {0}")]
    Serve(#[from] tonic::transport::Error),
}

fn prepare_state_dir(path: &std::path::Path) -> Result<(), NodeError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| NodeError::StateDir {
        path: path.to_owned(),
        source,
    };
    std::fs::create_dir_all(path).map_err(err)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(err)
}

/// Loads everything that can fail before binding: TLS material, the state
/// directory and the provider.
///
/// # Errors
///
/// [`NodeError`] naming what is wrong.
pub async fn prepare(config: &NodeConfig) -> Result<(NodeTls, Arc<dyn Provider>), NodeError> {
    let tls = NodeTls::load(&config.tls)?;
    prepare_state_dir(&config.state_dir)?;
    let docker = DockerProvider::connect(
        &config.docker_socket,
        Owner {
            deployment: config.deployment.clone(),
            node: tls.node_name.clone(),
        },
    )?;
    docker.ping().await?;
    Ok((tls, Arc::new(docker)))
}

/// Serves the node on `listener` until `shutdown` fires.
///
/// # Errors
///
/// [`NodeError::Serve`] when the gRPC server fails.
pub async fn run(
    config: NodeConfig,
    tls: NodeTls,
    provider: Arc<dyn Provider>,
    listener: TcpListener,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let link = Arc::new(PlaneLink::default());
    let runner = Arc::new(Runner::new(
        provider,
        link.clone(),
        link.clone(),
        RunnerOptions {
            max_custody: config.max_custody,
        },
    ));
    let slot = Arc::new(CommandSlot::new());
    let identity = Identity {
        node_name: tls.node_name.clone(),
        deployment: config.deployment.clone(),
        incarnation: uuid::Uuid::new_v4().simple().to_string(),
        vcpu: config.vcpu,
        memory_bytes: config.memory_bytes,
        version: env!("CARGO_PKG_VERSION").to_owned(),
    };
    info!(node = %identity.node_name, incarnation = %identity.incarnation,
          addr = ?listener.local_addr().ok(), "billet node serving");
    let service = NodeService::new(identity, runner.clone(), link, slot.clone());

    let tasks = TaskTracker::new();
    let background = CancellationToken::new();
    tasks.spawn(
        execute_commands(runner.clone(), slot, background.clone())
            .instrument(info_span!("executor")),
    );
    {
        let runner = runner.clone();
        let cancel = background.clone();
        tasks.spawn(
            async move { runner.keep_alive(cancel).await }.instrument(info_span!("keep_alive")),
        );
    }
    tasks.close();

    let (health, health_service) = tonic_health::server::health_reporter();
    health
        .set_serving::<pb::node_server::NodeServer<NodeService>>()
        .await;
    let incoming = crate::tls::accept(
        listener,
        tls.config.clone(),
        Some(config.plane_name.clone()),
        shutdown.clone(),
    );
    let served = tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(pb::node_server::NodeServer::new(service).max_decoding_message_size(4 << 20))
        .serve_with_incoming_shutdown(ReceiverStream::new(incoming), shutdown.cancelled())
        .await;
    background.cancel();
    tasks.wait().await;
    info!("billet node stopped");
    served.map_err(NodeError::from)
}
