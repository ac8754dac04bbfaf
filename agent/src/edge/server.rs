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
use tracing::{Instrument, debug, info, info_span, warn};

use crate::edge::executor::{Executor, execute_commands};
use crate::edge::link::PlaneLink;
use crate::edge::session::{Identity, NodeService};
use crate::edge::slot::CommandSlot;
use crate::journal::{Journal, SqliteJournal};
use crate::node::health::{Health, WatchedJournal, WatchedProvider};
use crate::node::metrics::{MeteredJournal, MeteredPlane, MeteredProvider, Metrics};
use crate::node::recovery::Recovery;
use crate::node::runner::{Runner, RunnerOptions};
use crate::provider::docker::DockerProvider;
use crate::provider::{Owner, Provider};
use crate::tls::{NodeTls, TlsError, TlsPaths};
use crate::upgrade::dispatch::{ExecUpgrader, Upgrader};

/// Most concurrent gRPC streams one connection may open.
pub(crate) const MAX_STREAMS_PER_CONNECTION: u32 = 8;
/// Largest message the node accepts or sends, in bytes.
pub(crate) const MAX_MESSAGE_BYTES: usize = 4 << 20;
/// How long a drain waits for running jobs by default before the node exits
/// anyway, destroying nothing: six hours, GitHub's longest job. The systemd
/// unit's stop timeout is longer (`deploy/billet-node.service`).
pub(crate) const DEFAULT_DRAIN_TIMEOUT: Duration = Duration::from_secs(6 * 3600);
/// How long a stopping node waits for connected clients to hang up before
/// closing their connections itself.
pub(crate) const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);
/// How long a drain that holds nothing more still waits for commands in
/// flight to finish and their results to be acknowledged before exiting.
pub(crate) const DRAIN_SETTLE: Duration = Duration::from_secs(10);

/// How often a drain asks again whether each running runner has taken a
/// job, retiring those that have not ([`Runner::retire_idle_runners`]): a
/// runner GitHub could not be asked about is asked again this much later.
pub(crate) const DRAIN_RETIRE_EVERY: Duration = Duration::from_secs(5);

/// Everything `billet node` needs, checked.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Certificate, key and CA.
    pub tls: TlsPaths,
    /// The name the plane's client certificate must carry.
    pub plane_name: String,
    /// Whether a private key its group or others may read is taken
    /// (`--allow-readable-key`); refused at start otherwise.
    pub allow_readable_key: bool,
    /// The deployment this node belongs to.
    pub deployment: String,
    /// Where the node keeps its state (mode 0700).
    pub state_dir: PathBuf,
    /// Where the sticky-disk store lives (mode 0700).
    pub cache_dir: PathBuf,
    /// How the sticky disks' generations and the Actions cache's archives
    /// are evicted (`--cache-retention-hours`,
    /// `--cache-image-store-retention-hours`, `--cache-max-bytes`).
    pub cache_eviction: crate::cache::Eviction,
    /// How often they are (`--cache-evict-interval-secs`).
    pub cache_evict_interval: Duration,
    /// The Docker engine's socket.
    pub docker_socket: PathBuf,
    /// vCPUs offered.
    pub vcpu: u32,
    /// Memory offered, in bytes.
    pub memory_bytes: u64,
    /// See [`RunnerOptions::max_custody`].
    pub max_custody: Option<Duration>,
    /// See [`RunnerOptions::stray_grace`].
    pub stray_grace: Duration,
    /// See [`RunnerOptions::start_deadline`].
    pub start_deadline: Option<Duration>,
    /// See [`RunnerOptions::max_lease_life`].
    pub max_lease_life: Option<Duration>,
    /// See [`RunnerOptions::post_job_grace`].
    pub post_job_grace: Duration,
    /// See [`RunnerOptions::isolated_containers`].
    pub isolated_containers: bool,
    /// See [`RunnerOptions::tier_failures_before_unhealthy`].
    pub tier_failures_before_unhealthy: u32,
    /// The most processes one guest may run (`--guest-pids-limit`).
    pub guest_pids_limit: u32,
    /// How long a successful launch's result waits for the plane's
    /// acknowledgement before the node takes custody.
    pub ack_timeout: Duration,
    /// How long a drain (first SIGTERM) waits for held compute to finish
    /// before the node exits anyway, destroying nothing.
    pub drain_timeout: Duration,
    /// How the TLS files are watched for rotation.
    pub tls_reload: crate::tls::ReloadPolicy,
    /// The updater `StartUpgrade` execs. `None` (the default) refuses
    /// upgrades with a sentence saying to upgrade the node out of band.
    pub upgrader: Option<ExecUpgrader>,
    /// Where to serve metrics (`--metrics-listen`); `None` serves none.
    /// `main` binds it into [`Prepared::metrics`].
    pub metrics_listen: Option<std::net::SocketAddr>,
    /// Below this many free bytes on the state directory's file system the
    /// node is degraded (`node/health.rs`).
    pub min_free_disk_bytes: u64,
    /// The instance-metadata base URL whose spot interruption notice the
    /// node watches (`node/interruption.rs`); `None` watches none.
    pub spot_imds: Option<String>,
    /// Pull-through registry mirrors handed to every guest
    /// (`provider/mirrors.rs`), each checked by
    /// [`crate::provider::mirrors::parse_mirror`]; empty hands none.
    pub registry_mirrors: Vec<String>,
    /// The Actions cache proxy (`cache/actions/`).
    pub actions_proxy: ActionsProxyConfig,
}

/// Where the Actions cache proxy listens (`--cache-proxy-listen`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum ProxyListen {
    /// Serves none: no guest gets a proxy.
    #[default]
    Off,
    /// The Docker bridge's gateway on
    /// [`crate::cache::actions::proxy::DEFAULT_PORT`]; none when the
    /// engine has no bridge (a warning).
    BridgeGateway,
    /// This address, which guests must reach.
    At(std::net::SocketAddr),
}

/// The Actions cache proxy's configuration.
#[derive(Debug, Clone, Default)]
pub struct ActionsProxyConfig {
    /// Where it listens.
    pub listen: ProxyListen,
    /// Where it splices to, `HOST:PORT`; `None`: the results host on 443.
    pub upstream: Option<String>,
    /// Extra trust roots for the upstream (PEM).
    pub extra_ca: Option<PathBuf>,
}

/// The Actions cache proxy's parts, made and bound by [`prepare`].
#[derive(Debug)]
pub struct ActionsParts {
    /// The bound listener.
    pub listener: TcpListener,
    /// The interception CA.
    pub ca: Arc<crate::cache::actions::ca::InterceptionCa>,
    /// Where spliced requests go.
    pub upstream: crate::cache::actions::proxy::Upstream,
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
    /// The node journal cannot be used.
    #[error(transparent)]
    Journal(#[from] crate::journal::JournalError),
    /// The Actions cache proxy cannot be set up (its CA, its upstream's
    /// roots, its address).
    #[error("the Actions cache proxy: {0}")]
    ActionsProxy(String),
    /// The cache directory cannot be used (or another node holds it).
    #[error(transparent)]
    Cache(#[from] crate::cache::CacheError),
    /// The local socket cannot be bound.
    #[error(transparent)]
    Local(#[from] crate::edge::local::BindError),
    /// The spot interruption notice cannot be watched as configured.
    #[error("spot interruptions: {0}")]
    Interruptions(String),
    /// The compiled-in descriptors could not be served for reflection.
    #[error("gRPC reflection: {0}")]
    Reflection(String),
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
    if path.exists() && !path.is_dir() {
        return Err(err(std::io::Error::other(
            "exists and is not a directory; give --state-dir a directory (it is created if missing)",
        )));
    }
    // A refusal names the owner and mode in the way and the user asking:
    // the bare error ("Operation not permitted") names neither.
    fn explained(path: &std::path::Path, what: &str, e: std::io::Error, change: &str) -> NodeError {
        let source = if crate::access::is_refusal(&e) {
            std::io::Error::new(e.kind(), crate::access::refused(path, what, &e, change))
        } else {
            e
        };
        NodeError::StateDir {
            path: path.to_owned(),
            source,
        }
    }
    std::fs::create_dir_all(path).map_err(|e| explained(
        path,
        "create",
        e,
        "create the directory and give it to the node's user (install -d -m 0700 -o USER DIR), or give --state-dir one it may write",
    ))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700)).map_err(|e| explained(
        path,
        "chmod 0700",
        e,
        "the node must own its state directory: chown it to the node's user, or run the node as its owner",
    ))
}

/// Refuses a private key others may read or write, or its group when root
/// does not own it, as ssh, Nomad and PostgreSQL do: a key another user may
/// have read is no proof of this node's identity. A root-owned key its
/// group may read (0640 root:billet) is root sharing it with the node's
/// group, as PostgreSQL allows. `allow` (`--allow-readable-key`) takes any
/// key, with a warning.
fn check_key_is_private(key: &std::path::Path, allow: bool) -> Result<(), NodeError> {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let Ok(meta) = std::fs::metadata(key) else {
        return Ok(());
    };
    let mode = meta.permissions().mode() & 0o7777;
    let shared = if meta.uid() == 0 { 0o037 } else { 0o077 };
    if mode & shared == 0 {
        return Ok(());
    }
    if allow {
        warn!(
            key = %key.display(),
            mode = format!("{mode:04o}"),
            "the node's private key is readable beyond its owner; taken because --allow-readable-key is set"
        );
        return Ok(());
    }
    Err(NodeError::Tls(TlsError::Content {
        path: key.to_owned(),
        problem: format!(
            "the private key is readable beyond its owner ({}); chmod 600 it (or 640 with root as its owner and the node's group), or pass --allow-readable-key (BILLET_ALLOW_READABLE_KEY=true) to start anyway",
            crate::access::ownership(key)
        ),
    }))
}

/// Loads and checks the node's TLS material as [`prepare`] does: a
/// certificate that verifies against the CA, with a key that matches it,
/// naming a node that is not the plane. A certificate that has expired but
/// verifies otherwise is accepted with a warning ([`NodeTls::load_at_start`]):
/// the node starts, keeps what it holds, and waits to be re-enrolled
/// (`billet node enroll`). Refuses a key readable beyond its owner unless
/// the configuration allows it.
///
/// # Errors
///
/// [`NodeError::Tls`] naming the file.
pub(crate) fn load_tls(config: &NodeConfig) -> Result<NodeTls, NodeError> {
    let tls = NodeTls::load_at_start(&config.tls)?;
    if tls.node_name.as_str() == config.plane_name {
        return Err(NodeError::Tls(TlsError::Content {
            path: config.tls.cert.clone(),
            problem: format!(
                "names {}, which is the plane's name: give the node a certificate for its own name",
                tls.node_name
            ),
        }));
    }
    check_key_is_private(&config.tls.key, config.allow_readable_key)?;
    if tls.expired {
        warn!(
            cert = %config.tls.cert.display(),
            not_after_unix_s = tls.not_after.and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok()).map(|d| d.as_secs()),
            "the node's certificate has expired: starting anyway to keep the compute it holds, \
             but no plane can attach until it is re-enrolled \
             (billet node enroll --plane HOST:PORT --token-file FILE, with a join token from the plane)"
        );
    }
    Ok(tls)
}

/// How long the start waits for the Docker engine's first answer before it
/// starts without it (a hung engine; [`prepare`]).
const START_PING_BOUND: Duration = Duration::from_secs(10);

/// Loads everything that can fail before binding: TLS material, the state
/// directory and the provider (reachable; an engine that accepts
/// connections and does not answer within `START_PING_BOUND` is left to
/// the health probe, which reports it).
///
/// # Errors
///
/// [`NodeError`] naming what is wrong.
pub async fn prepare(config: &NodeConfig) -> Result<Prepared, NodeError> {
    let tls = load_tls(config)?;
    prepare_state_dir(&config.state_dir)?;
    // First in the state directory: a second node on it is refused before
    // it opens the first one's journal.
    let local = crate::edge::local::bind(&config.state_dir).await?;
    let journal = Arc::new(SqliteJournal::open(&config.state_dir).await?);
    crate::cache::session::check_socket_room(&config.cache_dir)?;
    let cache = Arc::new(
        crate::cache::Store::open(&config.cache_dir, &config.deployment, journal.clone()).await?,
    );
    say_cache_filesystem(&config.cache_dir, cache.filesystem());
    let mirrors = crate::provider::mirrors::GuestMirrors::prepare(
        &config.state_dir,
        config.registry_mirrors.clone(),
    )
    .map_err(|source| NodeError::StateDir {
        path: config
            .state_dir
            .join(crate::provider::mirrors::DAEMON_JSON_FILE),
        source,
    })?;
    let docker = DockerProvider::connect(
        &config.docker_socket,
        Owner {
            deployment: config.deployment.clone(),
            node: tls.node_name.clone(),
        },
    )?
    .with_registry_mirrors(mirrors)
    .with_guest_pids_limit(config.guest_pids_limit)
    .with_handoff_dir(config.state_dir.join(crate::provider::handoff::STATE_DIR));
    docker.clear_handoffs();
    let engine_answered = match tokio::time::timeout(START_PING_BOUND, docker.ping()).await {
        Ok(Ok(())) => true,
        // Connected, and no answer: a hung engine. The node starts without
        // it: it attaches, says it is degraded (its health probe finds the
        // engine stuck), takes no launch, and recovers and heals once the
        // engine answers. An engine that cannot be reached at all is still
        // exit 5: a wrong socket is fixed by the operator.
        Ok(Err(crate::provider::ProviderError::Timeout { .. })) | Err(_) => {
            warn!(socket = %config.docker_socket.display(), bound_s = START_PING_BOUND.as_secs(),
                  "the Docker engine accepts connections but does not answer; starting without it: \
                   the node reports itself degraded and takes no launch, and recovers what it holds \
                   once the engine answers");
            false
        }
        Ok(Err(e)) => return Err(e.into()),
    };
    let actions = prepare_actions(config, &docker, engine_answered).await?;
    Ok(Prepared {
        tls,
        provider: Arc::new(docker),
        journal,
        cache: Some(cache),
        local,
        metrics: None,
        actions,
    })
}

/// Makes the Actions cache proxy's CA, reads its upstream's roots and
/// binds its listener; `None` when it is off, or its address is Docker's
/// bridge gateway (the default) and the engine has no bridge or did not
/// answer at start (`engine_answered`), the address is taken, or the
/// system has no trust roots to reach GitHub with. An address the operator
/// gave (`--cache-proxy-listen`) must work: each of those is then an
/// error.
async fn prepare_actions(
    config: &NodeConfig,
    docker: &DockerProvider,
    engine_answered: bool,
) -> Result<Option<ActionsParts>, NodeError> {
    let fail = |e: String| NodeError::ActionsProxy(e);
    let addr = match config.actions_proxy.listen {
        ProxyListen::Off => return Ok(None),
        ProxyListen::At(addr) => addr,
        ProxyListen::BridgeGateway if !engine_answered => {
            warn!(
                "no Actions cache proxy until the node restarts: Docker's bridge gateway is unknown while the engine does not answer (give --cache-proxy-listen to have one whatever the engine)"
            );
            return Ok(None);
        }
        ProxyListen::BridgeGateway => match docker.bridge_gateway().await {
            Ok(ip) => std::net::SocketAddr::new(ip, crate::cache::actions::proxy::DEFAULT_PORT),
            Err(e) => {
                warn!(error = %e, "no Actions cache proxy: Docker's bridge gateway is unknown (give --cache-proxy-listen)");
                return Ok(None);
            }
        },
    };
    if addr.ip().is_unspecified() {
        return Err(fail(
            crate::cache::actions::proxy::ProxyError::Unspecified(addr).to_string(),
        ));
    }
    let extra = match &config.actions_proxy.extra_ca {
        Some(path) => Some(
            std::fs::read(path)
                .map_err(|e| fail(format!("--actions-results-ca {}: {e}", path.display())))?,
        ),
        None => None,
    };
    let upstream = match crate::cache::actions::proxy::Upstream::new(
        config.actions_proxy.upstream.clone(),
        extra.as_deref(),
    ) {
        Ok(upstream) => upstream,
        // No trust roots (a host without ca-certificates): the proxy
        // cannot reach GitHub, so none, as without a bridge; a proxy the
        // operator asked for must work.
        Err(e) if config.actions_proxy.listen == ProxyListen::BridgeGateway => {
            warn!(error = %e, "no Actions cache proxy: there are no CA certificates to reach GitHub's results service with; install Debian's ca-certificates and restart the node to have one");
            return Ok(None);
        }
        Err(e) => return Err(fail(e.to_string())),
    };
    let ca = crate::cache::actions::ca::InterceptionCa::load_or_create(&config.state_dir)
        .map_err(|e| fail(e.to_string()))?;
    let listener = match TcpListener::bind(addr).await {
        Ok(l) => l,
        // The default address taken (another node on this host): no proxy,
        // as without a bridge; an address the operator named must work.
        Err(e) if config.actions_proxy.listen == ProxyListen::BridgeGateway => {
            warn!(%addr, error = %e, "no Actions cache proxy: its default address is taken (give --cache-proxy-listen)");
            return Ok(None);
        }
        Err(e) => {
            return Err(fail(format!(
                "cannot listen on {addr} (--cache-proxy-listen): {e}"
            )));
        }
    };
    Ok(Some(ActionsParts {
        listener,
        ca: Arc::new(ca),
        upstream,
    }))
}

/// What a sticky-disk mount costs on `filesystem`, in one sentence for the
/// log and `billet check`.
#[must_use]
pub(crate) fn cache_cost(filesystem: &crate::cache::clone::Filesystem) -> String {
    if filesystem.reflink {
        format!(
            "{}, reflinks: a mount clones each file's extents, O(files) whatever their size",
            filesystem.kind
        )
    } else {
        format!(
            "{}, no reflinks: a mount copies its generation's data, O(bytes); put --cache-dir on XFS (mkfs.xfs -m reflink=1) or btrfs for mounts that cost the same whatever the cache's size",
            filesystem.kind
        )
    }
}

/// Logs the cache directory's file system at start: a warning where a
/// mount costs O(bytes).
fn say_cache_filesystem(dir: &std::path::Path, filesystem: &crate::cache::clone::Filesystem) {
    let method = filesystem.method().as_str();
    if filesystem.reflink {
        info!(dir = %dir.display(), filesystem = %filesystem.kind, clone = method, "sticky disks: {}", cache_cost(filesystem));
    } else {
        warn!(dir = %dir.display(), filesystem = %filesystem.kind, clone = method, "sticky disks: {}", cache_cost(filesystem));
    }
}

/// What [`prepare`] loaded and checked.
#[derive(Debug)]
pub struct Prepared {
    /// TLS material.
    pub tls: NodeTls,
    /// The provider, reachable (answering, or hung: [`prepare`]).
    pub provider: Arc<dyn Provider>,
    /// The node journal, readable.
    pub journal: Arc<dyn Journal>,
    /// The sticky-disk store, open and locked; `None`: sticky disks are
    /// not mounted.
    pub cache: Option<Arc<crate::cache::Store>>,
    /// The local socket (`local.rs`), bound.
    pub local: tokio::net::UnixListener,
    /// The metrics listener (`metrics.rs`), bound by the caller when
    /// configured; [`prepare`] leaves it `None`.
    pub metrics: Option<TcpListener>,
    /// The Actions cache proxy's parts; `None`: it is off.
    pub actions: Option<ActionsParts>,
}

/// What a start finds absent and may create: the state directory (the
/// topmost of its missing ancestors), its journal, the cache directory.
/// Taken before [`prepare`]; [`Footprint::undo`] removes, after a start
/// that failed, what that start made, so a failed start leaves the host as
/// it found it (a half-made state directory would be taken for a node's).
#[derive(Debug)]
pub struct Footprint {
    state_dir: PathBuf,
    made_state: Option<PathBuf>,
    made_journal: bool,
    made_cache: Option<PathBuf>,
}

/// The topmost ancestor of `path` (itself included) that does not exist.
fn topmost_absent(path: &std::path::Path) -> Option<PathBuf> {
    path.ancestors()
        .take_while(|a| !a.as_os_str().is_empty() && std::fs::symlink_metadata(a).is_err())
        .last()
        .map(std::path::Path::to_path_buf)
}

impl Footprint {
    /// What is absent now, before a start.
    #[must_use]
    pub fn before(config: &NodeConfig) -> Self {
        Self {
            state_dir: config.state_dir.clone(),
            made_state: topmost_absent(&config.state_dir),
            made_journal: std::fs::symlink_metadata(
                config.state_dir.join(crate::journal::JOURNAL_FILE),
            )
            .is_err(),
            made_cache: topmost_absent(&config.cache_dir),
        }
    }

    /// Removes what the failed start made. The local socket goes unless a
    /// node answers on it (another node's, which refused this start); the
    /// caller drops what the start bound first. Nothing is in the journal
    /// yet: it is removed only if this start created it.
    pub fn undo(self) {
        let socket = crate::local::socket_path(&self.state_dir);
        if std::os::unix::net::UnixStream::connect(&socket).is_err() {
            remove(&socket, false);
        }
        if self.made_journal {
            let journal = self.state_dir.join(crate::journal::JOURNAL_FILE);
            for suffix in ["", "-wal", "-shm", "-journal", ".new"] {
                let mut name = journal.clone().into_os_string();
                name.push(suffix);
                remove(std::path::Path::new(&name), false);
            }
        }
        for dir in [self.made_cache, self.made_state].into_iter().flatten() {
            remove(&dir, true);
        }
    }
}

/// Removes the file `path`, or the directory and everything in it;
/// already gone is fine, anything else a warning.
fn remove(path: &std::path::Path, directory: bool) {
    let removed = if directory {
        std::fs::remove_dir_all(path)
    } else {
        std::fs::remove_file(path)
    };
    match removed {
        Ok(()) => debug!(path = %path.display(), "removed what the failed start made"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => {
            warn!(path = %path.display(), error = %e, "cannot remove what the failed start made")
        }
    }
}

/// Below this many open files the node warns at start: room for the
/// plane's session, the journal, the Docker engine's connections and the
/// secondary listeners' caps with every tier's jobs running, with margin.
pub const OPEN_FILES_WANTED: u64 = 8192;

/// The node's open-files limit (`RLIMIT_NOFILE`) once
/// [`raise_open_files_limit`] has run; `None` is unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OpenFiles {
    /// The soft limit before.
    pub was: Option<u64>,
    /// The soft limit now: what the node runs with.
    pub soft: Option<u64>,
    /// The hard limit, which only root (or the unit's `LimitNOFILE=`) moves.
    pub hard: Option<u64>,
}

/// Raises the soft open-files limit to the hard one, as Go's runtime does
/// at start since Go 1.19: the soft limit of 1,024 that systemd and most
/// shells hand out exists for programs that use `select(2)`, which the
/// node does not (tokio polls with epoll), and a node at 1,024 can be run
/// out of descriptors by connections to its ports. Children
/// (`billet host-upgrade`, `docker` helpers) inherit the raised limit.
///
/// # Errors
///
/// `setrlimit` refused (it does not, for a soft limit at or under the
/// hard one); the limit is then unchanged.
pub fn raise_open_files_limit() -> std::io::Result<OpenFiles> {
    use rustix::process::{Resource, Rlimit, getrlimit, setrlimit};
    let before = getrlimit(Resource::Nofile);
    if before.current != before.maximum {
        setrlimit(
            Resource::Nofile,
            Rlimit {
                current: before.maximum,
                maximum: before.maximum,
            },
        )?;
    }
    let after = getrlimit(Resource::Nofile);
    Ok(OpenFiles {
        was: before.current,
        soft: after.current,
        hard: after.maximum,
    })
}

/// Turns SIGTERM and Ctrl-C into the node's stop: the first cancels
/// `drain` (no new launches; running jobs finish), a second cancels
/// `shutdown` (stop at once; running compute is left for the next process
/// to adopt).
///
/// # Errors
///
/// The signal handler cannot be installed.
pub fn stop_on_signals(
    drain: CancellationToken,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    use tokio::signal::unix::{SignalKind, signal};
    let mut term = signal(SignalKind::terminate())?;
    tokio::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        info!("stopping: draining first; signal again to stop at once");
        drain.cancel();
        tokio::select! {
            _ = term.recv() => {}
            _ = tokio::signal::ctrl_c() => {}
        }
        info!("stopping at once; running compute is left for the next process to adopt");
        shutdown.cancel();
    });
    Ok(())
}

/// Serves the node on `listener` until `shutdown` fires. When `drain`
/// fires first, the node stops taking launches, keeps serving destroys,
/// sweeps and tends, and stops once it holds nothing or the drain timeout
/// passes; a drain that times out destroys nothing (the next process adopts).
///
/// # Errors
///
/// [`NodeError::Serve`] when the gRPC server fails; [`NodeError::Journal`]
/// when the journal's recorded results cannot be read.
pub async fn run(
    config: NodeConfig,
    prepared: Prepared,
    listener: TcpListener,
    drain: CancellationToken,
    shutdown: CancellationToken,
) -> Result<(), NodeError> {
    let Prepared {
        tls,
        provider,
        journal,
        cache,
        local,
        metrics: metrics_listener,
        actions,
    } = prepared;
    let mut registry = prometheus_client::registry::Registry::default();
    let metrics = Arc::new(Metrics::new(
        &mut registry,
        crate::upgrade::version::version(),
        crate::upgrade::version::COMMIT,
    ));
    if let Some(not_after) = tls.not_after {
        metrics.set_certificate_expiry(not_after, std::time::SystemTime::now());
    }
    let provider: Arc<dyn Provider> = Arc::new(MeteredProvider::new(provider, metrics.clone()));
    let journal: Arc<dyn Journal> = Arc::new(MeteredJournal::new(journal, metrics.clone()));
    // Every provider call runs under the watchdog, every journal write is
    // watched, and both feed the degraded state (`health.rs`).
    let health = Arc::new(Health::new().with_probe(provider.clone()));
    let provider: Arc<dyn Provider> = Arc::new(WatchedProvider::new(provider, health.clone()));
    let journal: Arc<dyn Journal> = Arc::new(WatchedJournal::new(journal, health.clone()));
    let link = Arc::new(PlaneLink::default());
    let plane = Arc::new(MeteredPlane::new(link.clone(), metrics.clone()));
    let freshness = Arc::new(crate::node::freshness::Freshness::default());
    let warm = Arc::new(crate::node::warm::WarmPool::new(
        provider.clone(),
        link.clone(),
        freshness.clone(),
    ));
    let runner = Arc::new(
        Runner::new(
            provider,
            plane.clone(),
            plane.clone(),
            RunnerOptions {
                max_custody: config.max_custody,
                stray_grace: config.stray_grace,
                start_deadline: config.start_deadline,
                max_lease_life: config.max_lease_life,
                post_job_grace: config.post_job_grace,
                isolated_containers: config.isolated_containers,
                tier_failures_before_unhealthy: config.tier_failures_before_unhealthy,
                ..RunnerOptions::default()
            },
        )
        .with_journal(journal.clone())
        .with_freshness(freshness)
        .with_warm(warm.clone()),
    );
    let cache_store = cache.clone();
    let mut cache_archives = None;
    let runner = match cache {
        Some(cache) => {
            let sessions = crate::cache::session::Sessions::open(cache.clone()).await;
            let mut inner = Arc::into_inner(runner)
                .expect("the runner is not shared yet")
                .with_cache(cache.clone(), sessions);
            if let Some(parts) = actions {
                // The plane answers the kill switch (NodeCall 26).
                let policy = Arc::new(crate::edge::link::PlanePolicy::new(plane.clone()));
                let archives = crate::cache::actions::archives::Archives::open(
                    cache.dir(),
                    cache.journal(),
                    policy,
                )
                .await
                .map_err(|e| NodeError::ActionsProxy(e.to_string()))?;
                archives.set_stage_limits(crate::cache::actions::staging::StageLimits {
                    budget_bytes: config.cache_eviction.budget_bytes,
                    ..Default::default()
                });
                cache_archives = Some(archives.clone());
                let addr = parts
                    .listener
                    .local_addr()
                    .map_err(|e| NodeError::ActionsProxy(e.to_string()))?;
                let proxy = crate::cache::actions::proxy::ActionsProxy::new(
                    archives,
                    parts.ca,
                    parts.upstream,
                    addr,
                )
                .map_err(|e| NodeError::ActionsProxy(e.to_string()))?;
                tokio::spawn(
                    proxy
                        .clone()
                        .serve(parts.listener, shutdown.clone())
                        .instrument(info_span!("actions_proxy")),
                );
                info!(%addr, "Actions cache proxy listening");
                inner = inner.with_actions(proxy);
            }
            Arc::new(inner)
        }
        None => runner,
    };
    let slot = Arc::new(CommandSlot::new().with_metrics(metrics.clone()));
    health.watch_slot(slot.clone());
    slot.preload(
        journal
            .results()
            .await?
            .into_iter()
            .filter_map(|(id, bytes)| {
                let id = crate::model::CommandId::parse("journal.result", &id).ok()?;
                let result =
                    <pb::CommandResult as prost::Message>::decode(bytes.as_slice()).ok()?;
                Some((id, result))
            }),
    );
    let identity = Identity {
        node_name: tls.node_name.clone(),
        deployment: config.deployment.clone(),
        incarnation: uuid::Uuid::new_v4().simple().to_string(),
        vcpu: config.vcpu,
        memory_bytes: config.memory_bytes,
        version: crate::upgrade::version::version().to_owned(),
    };
    info!(node = %identity.node_name, incarnation = %identity.incarnation,
          addr = listener.local_addr().ok().map(tracing::field::display), "billet node serving");
    let recovery = Arc::new(Recovery::default());
    let (tls_config, identity_files) = crate::tls::watch_files(
        config.tls.clone(),
        &tls,
        config.tls_reload,
        health.plane_clock(),
        shutdown.clone(),
    );
    let validity = identity_files.watch_validity();
    // Renewed over the session at two thirds of its lifetime; re-enrolled
    // through the local socket once expired (`identity.rs`).
    let keeper = Arc::new(
        crate::edge::identity::IdentityKeeper::new(
            identity_files,
            identity.node_name.clone(),
            config.plane_name.clone(),
            link.clone(),
        )
        .with_metrics(metrics.clone())
        .with_plane_clock(health.plane_clock()),
    );
    tokio::spawn(
        keeper
            .clone()
            .keep(shutdown.clone())
            .instrument(info_span!("identity")),
    );
    let local_service = crate::edge::local::LocalService::new(
        identity.version.clone(),
        identity.incarnation.clone(),
        recovery.clone(),
        runner.clone(),
    )
    .with_metrics(metrics.clone(), config.tls.cert.clone())
    .with_health(health.clone())
    .with_slot(slot.clone())
    .with_identity(keeper);
    let service = NodeService::new(
        identity,
        runner.clone(),
        link.clone(),
        slot.clone(),
        recovery.clone(),
    )
    .with_health(health.clone());

    if let Some(endpoint) = &config.spot_imds {
        let source = crate::node::interruption::Imds::new(endpoint)
            .map_err(|e| NodeError::Interruptions(e.to_string()))?;
        info!(%endpoint, "watching the spot interruption notice");
        tokio::spawn(
            crate::node::interruption::watch(
                Arc::new(source),
                runner.clone(),
                health.clone(),
                recovery.clone(),
                crate::node::interruption::POLL_INTERVAL,
                shutdown.clone(),
            )
            .instrument(info_span!("interruptions")),
        );
    }

    let tasks = TaskTracker::new();
    let background = CancellationToken::new();
    let drain_begun = drain.clone();
    tasks.spawn(
        execute_commands(
            runner.clone(),
            slot.clone(),
            Executor {
                recovery,
                journal,
                ack_timeout: config.ack_timeout,
                upgrader: config
                    .upgrader
                    .clone()
                    .map(|u| Arc::new(u) as Arc<dyn Upgrader>),
                capacity: billet_proto::v1::Capacity {
                    vcpu: config.vcpu,
                    memory_bytes: config.memory_bytes,
                },
                health: health.clone(),
            },
            background.clone(),
        )
        .instrument(info_span!("executor")),
    );
    {
        let runner = runner.clone();
        let cancel = background.clone();
        tasks.spawn(
            async move { runner.keep_alive(cancel).await }.instrument(info_span!("keep_alive")),
        );
    }
    tasks.spawn(
        warm.run(shutdown.clone())
            .instrument(info_span!("warm_pool")),
    );
    {
        let runner = runner.clone();
        let shutdown = shutdown.clone();
        let timeout = config.drain_timeout;
        let (slot, link) = (slot.clone(), link.clone());
        tasks.spawn(
            async move {
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    () = drain.cancelled() => {}
                }
                runner.start_draining();
                notify(&[sd_notify::NotifyState::Stopping]);
                info!(timeout_s = timeout.as_secs(), "draining: no new launches; waiting for held compute to finish");
                let deadline = tokio::time::Instant::now() + timeout;
                // Runners that have taken no job would hold the drain to its
                // timeout: they are retired (registration first, then
                // compute) at once and again every DRAIN_RETIRE_EVERY, so the
                // drain ends when the working jobs do.
                let mut retire_at = tokio::time::Instant::now();
                while runner.holding() {
                    if tokio::time::Instant::now() >= deadline {
                        warn!("drain timed out; exiting without destroying anything (the next process adopts what runs)");
                        break;
                    }
                    if tokio::time::Instant::now() >= retire_at {
                        retire_at = tokio::time::Instant::now() + DRAIN_RETIRE_EVERY;
                        let retired = runner.retire_idle_runners().await;
                        if retired > 0 {
                            info!(retired, "draining: retired runners that had taken no job");
                        }
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(200)) => {}
                    }
                }
                // The last answers (an updater's `accepted`, a destroy's
                // result) reach the plane before the session is cut.
                let settle = tokio::time::Instant::now() + DRAIN_SETTLE;
                while slot.in_flight() > 0
                    || link.current().is_some_and(|s| s.awaiting_acks() > 0)
                {
                    if tokio::time::Instant::now() >= settle {
                        warn!("results still unacknowledged at exit; the plane will find them in the journal on redelivery");
                        break;
                    }
                    tokio::select! {
                        () = shutdown.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_millis(50)) => {}
                    }
                }
                info!("drained");
                shutdown.cancel();
            }
            .instrument(info_span!("drain")),
        );
    }
    {
        // Stopping ends the open session, so the server's graceful shutdown
        // is not held by a stream that never ends.
        let (link, shutdown) = (link.clone(), shutdown.clone());
        tasks.spawn(async move {
            shutdown.cancelled().await;
            if let Some(session) = link.current() {
                session.close();
            }
        });
    }
    if let Some(store) = &cache_store {
        tasks.spawn(
            crate::cache::lifecycle::keep_evicting(
                store.clone(),
                cache_archives,
                config.cache_eviction,
                config.cache_evict_interval,
                shutdown.clone(),
            )
            .instrument(info_span!("cache_eviction")),
        );
    }
    if let Some(listener) = metrics_listener {
        info!(
            addr = listener.local_addr().ok().map(tracing::field::display),
            "serving metrics at /metrics"
        );
        let (runner, cert) = (runner.clone(), config.tls.cert.clone());
        let plane_clock = health.plane_clock();
        let scrape: crate::node::metrics::Scrape = Arc::new(move |m: &Metrics| {
            m.observe_runner(&runner.held());
            let unhealthy: Vec<String> = runner
                .unhealthy_tiers()
                .into_iter()
                .map(|t| t.tier)
                .collect();
            m.set_unhealthy_tiers(&unhealthy);
            m.observe_warm(
                runner.warm().map(|pool| pool.counts()),
                runner.freshness().outdated().len(),
            );
            if let Some(cache) = &cache_store {
                m.set_cache_totals(&cache.totals());
                m.set_cache_evicted(&cache.evicted());
            }
            if let Some(not_after) = crate::node::metrics::certificate_expiry(&cert) {
                m.set_certificate_expiry(not_after, plane_clock.now());
            }
        });
        tasks.spawn(
            crate::node::metrics::serve(
                listener,
                Arc::new(registry),
                metrics.clone(),
                scrape,
                shutdown.clone(),
            )
            .instrument(info_span!("metrics")),
        );
    }
    tasks.close();

    // Reflection, so grpcurl can list and describe what is served, on the
    // port and on the local socket; v1alpha too, which older clients ask.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
    };
    let reflect = || -> Result<_, NodeError> {
        let v1 = reflection()
            .build_v1()
            .map_err(|e| NodeError::Reflection(e.to_string()))?;
        let v1alpha = reflection()
            .build_v1alpha()
            .map_err(|e| NodeError::Reflection(e.to_string()))?;
        Ok((v1, v1alpha))
    };
    let (port_reflection, port_reflection_alpha) = reflect()?;
    let (local_reflection, local_reflection_alpha) = reflect()?;
    health.watch(
        config.state_dir.clone(),
        config.min_free_disk_bytes,
        validity.clone(),
        shutdown.clone(),
    );
    let (reporter, health_service) = tonic_health::server::health_reporter();
    reporter
        .set_serving::<pb::node_server::NodeServer<NodeService>>()
        .await;
    {
        // NOT_SERVING on both the port and the local socket while degraded,
        // and from the moment a drain begins: a draining node takes no
        // launches, whatever else it still answers (load balancers and
        // probes read this).
        let (mut state, runner, shutdown) = (health.subscribe(), runner.clone(), shutdown.clone());
        let drain_begun = drain_begun.clone();
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut serving = true;
            loop {
                let snapshot = state.borrow_and_update().clone();
                for reason in crate::node::health::Reason::ALL {
                    metrics.set_degraded(reason.label(), snapshot.reasons.contains(&reason));
                }
                if let Some(ms) = snapshot.clock_offset_ms {
                    #[expect(clippy::cast_precision_loss, reason = "a gauge in seconds")]
                    metrics.set_clock_offset_seconds(ms as f64 / 1000.0);
                }
                let now =
                    !snapshot.degraded() && !runner.is_draining() && !drain_begun.is_cancelled();
                if now != serving {
                    serving = now;
                    if serving {
                        reporter
                            .set_serving::<pb::node_server::NodeServer<NodeService>>()
                            .await;
                    } else {
                        reporter
                            .set_not_serving::<pb::node_server::NodeServer<NodeService>>()
                            .await;
                    }
                }
                tokio::select! {
                    () = shutdown.cancelled() => return,
                    _ = state.changed() => {}
                    () = drain_begun.cancelled(), if !drain_begun.is_cancelled() => {}
                    () = tokio::time::sleep(Duration::from_millis(500)) => {}
                }
            }
        });
    }
    let incoming = crate::tls::accept::accept(
        listener,
        tls_config,
        validity.clone(),
        Some(config.plane_name.clone()),
        health.plane_clock(),
        shutdown.clone(),
    );
    // Limits: a silent peer is found by HTTP/2 pings, a flooding one meets
    // bounded streams and message sizes (the slot and the outbound buffer
    // are bounded too).
    let mut local_served = {
        let shutdown = shutdown.clone();
        let health = health_service.clone();
        tokio::spawn(
            tonic::transport::Server::builder()
                .add_service(health)
                .add_service(local_reflection)
                .add_service(local_reflection_alpha)
                .add_service(pb::local_server::LocalServer::new(local_service))
                .serve_with_incoming_shutdown(
                    // tonic retries a failed accept at once, which spins
                    // while the node is out of descriptors.
                    crate::listen::unix_incoming(local, "local"),
                    shutdown.cancelled_owned(),
                ),
        )
    };
    // Journal read, provider reached (answering, or hung and reported
    // degraded by the health probe), both listeners bound: what systemd
    // may call ready. Recovery itself needs the plane and runs on its first
    // session; the local socket reports it (`recovered`).
    notify(&[sd_notify::NotifyState::Ready]);
    let served = tonic::transport::Server::builder()
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(20)))
        .tcp_keepalive(Some(Duration::from_secs(60)))
        .max_concurrent_streams(Some(MAX_STREAMS_PER_CONNECTION))
        .concurrency_limit_per_connection(MAX_STREAMS_PER_CONNECTION as usize)
        .add_service(health_service)
        .add_service(port_reflection)
        .add_service(port_reflection_alpha)
        .add_service(
            pb::node_server::NodeServer::new(service)
                .max_decoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES)
                .max_encoding_message_size(MAX_MESSAGE_BYTES),
        )
        .serve_with_incoming_shutdown(
            tokio_stream::StreamExt::map(ReceiverStream::new(incoming), |a| {
                a.map(crate::tls::accept::Accepted::into_connection)
            }),
            shutdown.cancelled(),
        );
    // A graceful stop waits for clients to hang up; one that never does
    // must not keep the node from exiting.
    let served = tokio::select! {
        served = served => served,
        () = async {
            shutdown.cancelled().await;
            tokio::time::sleep(SHUTDOWN_GRACE).await;
        } => {
            warn!(grace_s = SHUTDOWN_GRACE.as_secs(), "a client kept its connection open past the stop; closing it");
            Ok(())
        }
    };
    background.cancel();
    tasks.wait().await;
    match tokio::time::timeout(SHUTDOWN_GRACE, &mut local_served).await {
        Ok(Ok(Err(e))) => warn!(error = %e, "the local socket stopped with an error"),
        Ok(_) => {}
        Err(_) => {
            warn!("a local client kept its connection open past the stop; closing it");
            local_served.abort();
        }
    }
    let _ = std::fs::remove_file(crate::local::socket_path(&config.state_dir));
    info!("billet node stopped");
    served.map_err(NodeError::from)
}

/// Tells systemd (when it started us with `Type=notify`) about a state
/// change; does nothing elsewhere.
fn notify(state: &[sd_notify::NotifyState<'_>]) {
    if let Err(e) = sd_notify::notify(false, state) {
        warn!(error = %e, "cannot notify systemd");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_systemd_unit_waits_longer_than_the_default_drain_and_is_type_notify() {
        let unit = include_str!("../../../deploy/billet-node.service");
        let value = |key: &str| {
            unit.lines()
                .find_map(|l| l.strip_prefix(key)?.strip_prefix('='))
                .unwrap_or_else(|| panic!("the unit sets {key}"))
                .trim()
        };
        let stop: u64 = value("TimeoutStopSec").parse().expect("seconds");
        assert!(
            stop > DEFAULT_DRAIN_TIMEOUT.as_secs(),
            "TimeoutStopSec={stop} would kill the node mid-drain"
        );
        assert_eq!(value("Type"), "notify");
        assert_eq!(value("KillMode"), "process");
    }
}
