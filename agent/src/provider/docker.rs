//! The Docker provider: runners as containers on the local Docker engine,
//! spoken to over its Unix socket through bollard.
//!
//! Behaviour follows the reference's Docker provider (spec/node.md §5.2),
//! with the engine API in place of the CLI: containers are named
//! `billet-<lease id>`, carry the [`labels`] of their owner and lease, and
//! every read filters on the owner's deployment and node labels, so a node
//! never sees (and so never removes) a container it does not own.
//!
//! The JIT config reaches the container only as the environment variable
//! [`JIT_CONFIG_ENV`]: never in `Cmd`, never in a log line, and never in an
//! error message (engine messages are scrubbed before they leave this
//! module).
//!
//! Architecture Invariant: nothing forwards `log` records from the `bollard`
//! target at debug level or finer (no `tracing-log` bridge, no
//! `env_logger`): bollard `log::debug!`s every JSON request body, and the
//! create body holds the JIT config.
//!
//! # API version
//!
//! bollard 0.21 speaks engine API 1.53 by default, which older engines
//! (Docker 20.10 speaks 1.41) refuse outright, and newer engines refuse
//! versions below their minimum (Docker 29 refuses anything below 1.44).
//! So the first call asks the engine's unversioned `/version` endpoint which
//! API it speaks and uses the lower of that and bollard's own; engines older
//! than [`MIN_API_VERSION`] are refused.
//!
//! # Connections
//!
//! bollard's own Unix client closes its connection after every request
//! (`pool_max_idle_per_host(0)`). This provider hands bollard a transport
//! of its own (`pooled`): the same Unix connector behind a hyper client
//! that keeps idle connections for [`POOL_IDLE`], so consecutive calls
//! (a tend's list, a launch's create and start) reuse one connection
//! rather than connecting for each request.

use std::collections::{BTreeMap, HashMap};
use std::fmt::Write as _;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use bollard::errors::Error as BollardError;
use bollard::models::{
    ContainerCreateBody, ContainerSummary, ContainerSummaryStateEnum, HostConfig,
};
use bollard::query_parameters::{
    CreateContainerOptions, ListContainersOptions, LogsOptionsBuilder, RemoveContainerOptions,
    StopContainerOptionsBuilder, TopOptionsBuilder,
};
use bollard::{API_DEFAULT_VERSION, BollardRequest, ClientVersion, Docker};
use tokio::sync::OnceCell;

use super::handoff::{DELIVERY_BOUND, GUEST_DIR, Handoffs, SECRETS_ENV, SECRETS_FILE, Secrets};
use super::{
    Exit, ImageFacts, Instance, InstanceSpec, InstanceState, Owner, Provider, ProviderError,
    RUNNER_VERSION_LABEL, Teardown, Work, is_job_process, labels,
};
use crate::model::{ByteSize, InstanceName};

/// How many lines of a runner's output [`Provider::output_tail`] reads.
const OUTPUT_TAIL_LINES: u32 = 40;

/// The environment variable through which the runner receives its JIT
/// config (the only way it reaches the instance).
pub(crate) const JIT_CONFIG_ENV: &str = "ACTIONS_RUNNER_INPUT_JITCONFIG";

/// The oldest engine API this provider speaks: Docker 20.10.
pub(crate) const MIN_API_VERSION: ClientVersion = ClientVersion {
    major_version: 1,
    minor_version: 41,
};

/// The default bound on one provider call, every engine request it makes
/// included. `docker rm -f` of a running container is the slowest call made
/// and takes well under this.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(60);

/// How long an idle connection to the engine is kept for the next call.
pub(crate) const POOL_IDLE: Duration = Duration::from_secs(30);

/// How long a create waits, by default, for its guest to read its
/// credentials before it answers (`handoff.rs`).
pub(crate) const HANDOFF_WAIT: Duration = Duration::from_secs(20);

/// How long a claimed warm runner has to read its credentials: it has been
/// waiting on its FIFO since it started, so it reads at once unless it died.
const WARM_DELIVERY_BOUND: Duration = Duration::from_secs(5);

/// What an error message carries in place of a credential.
const REDACTED: &str = "<redacted>";

/// The capabilities every guest runs with (decision 126): Docker's default
/// set less `NET_RAW` (raw sockets: spoofed packets, ARP on the bridge),
/// `MKNOD` (device nodes), `AUDIT_WRITE` (the host's audit log) and
/// `SETFCAP` (file capabilities, which `no-new-privileges` makes useless
/// anyway). Every other capability is dropped, so an engine whose default
/// set grows gives guests nothing more. A trusted tier may add to it.
pub(crate) const GUEST_CAPABILITIES: [&str; 10] = [
    // Package installs and checkouts change owners and modes of files
    // they did not create.
    "CHOWN",
    "DAC_OVERRIDE",
    "FOWNER",
    "FSETID",
    // A runner signals the job processes it started under other users.
    "KILL",
    // `su`, `sudo` and apt's unprivileged download user switch identities,
    // and drop capabilities from their bounding set as they do.
    "SETGID",
    "SETUID",
    "SETPCAP",
    // Test services on ports below 1024.
    "NET_BIND_SERVICE",
    // chroot-based builds (debootstrap, some packagers).
    "SYS_CHROOT",
];

/// The most processes (threads included) one guest may run when the
/// operator says nothing (`--guest-pids-limit`): far above what a runner
/// and a parallel build use, far below what starves the host's PID space.
pub(crate) const DEFAULT_GUEST_PIDS_LIMIT: u32 = 4096;

/// A bollard client for the engine at `socket` whose connections outlive
/// their request: hyper's pool over the same Unix connector bollard uses,
/// keeping idle connections for [`POOL_IDLE`]. Addressed as bollard
/// addresses a Unix socket (`unix://<hex of the path>`), which is the form
/// the connector reads the path from.
///
/// # Errors
///
/// bollard's, when the client cannot be made.
fn pooled(socket: &str, timeout_s: u64, version: &ClientVersion) -> Result<Docker, BollardError> {
    let client = Arc::new(
        hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
            .pool_idle_timeout(POOL_IDLE)
            .build(hyperlocal::UnixConnector),
    );
    let host: String = socket.bytes().fold(String::new(), |mut hex, b| {
        let _ = write!(hex, "{b:02x}");
        hex
    });
    Docker::connect_with_custom_transport(
        move |request: BollardRequest| {
            let client = Arc::clone(&client);
            async move { client.request(request).await.map_err(BollardError::from) }
        },
        Some(format!("unix://{host}")),
        timeout_s,
        version,
    )
}

/// Runs runners as containers on the Docker engine at one Unix socket.
///
/// Owns only containers labelled with its [`Owner`]'s deployment and node;
/// [`Provider::list`], [`Provider::find`] and [`Provider::destroy`] never see
/// or touch any other container, whatever its name.
#[derive(Debug)]
pub(crate) struct DockerProvider {
    socket: PathBuf,
    owner: Owner,
    /// The client at the negotiated API version; set by the first call that
    /// reaches the engine.
    client: OnceCell<Docker>,
    /// The bound on one provider call.
    timeout: Duration,
    /// The registry mirrors every container is handed (`mirrors.rs`).
    mirrors: super::mirrors::GuestMirrors,
    /// How many CPUs the engine's host has (`docker info`'s `NCPU`), read
    /// by the first [`Provider::shape`] that reaches the engine.
    cpus: OnceCell<u32>,
    /// Where each container's credentials wait for it (`handoff.rs`).
    handoffs: Handoffs,
    /// How long a create waits for its guest to read its credentials.
    handoff_wait: Duration,
    /// The most processes one guest may run; a tier may only lower it.
    guest_pids_limit: u32,
}

impl DockerProvider {
    /// A provider for the engine listening on `socket` (such as
    /// `/var/run/docker.sock`), labelling and filtering by `owner`.
    ///
    /// Makes no call to the engine and does not require the socket to exist
    /// yet: the first operation connects and negotiates the API version.
    /// Call [`DockerProvider::ping`] to check the engine at start-up.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Refused`] when `socket` is not valid UTF-8 (the
    /// client takes the path as text).
    pub(crate) fn connect(socket: &Path, owner: Owner) -> Result<Self, ProviderError> {
        if socket.to_str().is_none() {
            return Err(ProviderError::Refused(format!(
                "the Docker socket path {} is not valid UTF-8",
                socket.display()
            )));
        }
        let handoffs = Handoffs::new(std::env::temp_dir().join(format!(
            "billet-handoff-{}-{}",
            owner.deployment, owner.node
        )));
        Ok(Self {
            socket: socket.to_owned(),
            owner,
            client: OnceCell::new(),
            timeout: DEFAULT_TIMEOUT,
            mirrors: super::mirrors::GuestMirrors::default(),
            cpus: OnceCell::new(),
            handoffs,
            handoff_wait: HANDOFF_WAIT,
            guest_pids_limit: DEFAULT_GUEST_PIDS_LIMIT,
        })
    }

    /// The same provider giving each guest at most `limit` processes
    /// ([`DEFAULT_GUEST_PIDS_LIMIT`] otherwise); a tier's own limit can
    /// only lower it.
    #[must_use]
    pub(crate) fn with_guest_pids_limit(mut self, limit: u32) -> Self {
        self.guest_pids_limit = limit;
        self
    }

    /// The same provider keeping its containers' handoff directories
    /// under `base` (a directory of the node's state; a temporary one
    /// otherwise).
    #[must_use]
    pub(crate) fn with_handoff_dir(mut self, base: PathBuf) -> Self {
        self.handoffs = Handoffs::new(base);
        self
    }

    /// The same provider answering a create without waiting for its guest
    /// to read its credentials (for guests that never do, in tests).
    #[must_use]
    #[cfg(test)]
    pub(crate) fn without_handoff_wait(mut self) -> Self {
        self.handoff_wait = Duration::ZERO;
        self
    }

    /// Removes the handoff directories an earlier process of this node
    /// left ([`Handoffs::clear`]); called once at start-up, before any
    /// launch.
    pub(crate) fn clear_handoffs(&self) {
        self.handoffs.clear();
    }

    /// The same provider handing `mirrors` to every container it creates:
    /// their daemon configuration bound read-only at
    /// [`super::mirrors::GUEST_DAEMON_JSON`], and
    /// [`super::mirrors::MIRRORS_ENV`] in the environment (replacing a
    /// tier's own). No mirrors: neither.
    #[must_use]
    pub(crate) fn with_registry_mirrors(mut self, mirrors: super::mirrors::GuestMirrors) -> Self {
        self.mirrors = mirrors;
        self
    }

    /// The same provider with `timeout` as the bound on each call
    /// ([`DEFAULT_TIMEOUT`] otherwise); a call that takes longer fails with
    /// [`ProviderError::Timeout`].
    #[must_use]
    #[cfg(test)]
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Runs one provider call within the bound.
    async fn bounded<T>(
        &self,
        operation: &str,
        call: impl Future<Output = Result<T, ProviderError>>,
    ) -> Result<T, ProviderError> {
        tokio::time::timeout(self.timeout, call)
            .await
            .unwrap_or_else(|_| {
                Err(ProviderError::Timeout {
                    operation: operation.to_owned(),
                    after: self.timeout,
                })
            })
    }

    /// bollard's own per-request bound, in whole seconds, never below one.
    fn request_timeout_s(&self) -> u64 {
        self.timeout.as_secs().max(1)
    }

    /// The owner whose containers this provider sees.
    #[cfg(test)]
    pub(crate) fn owner(&self) -> &Owner {
        &self.owner
    }

    /// Checks that the engine answers (connecting and negotiating the API
    /// version if no call has yet).
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] saying the daemon at the socket cannot be
    /// reached, why, and what to check; [`ProviderError::Refused`] when its
    /// API is older than [`MIN_API_VERSION`].
    pub(crate) async fn ping(&self) -> Result<(), ProviderError> {
        let operation = "ping Docker";
        self.bounded(operation, async {
            let docker = self.client(operation).await?;
            docker
                .ping()
                .await
                .map(drop)
                .map_err(|err| self.engine_error(operation, &err, None))
        })
        .await
    }

    /// The IPv4 gateway of the engine's default `bridge` network: the
    /// host's address as a container on that network sees it (the Actions
    /// cache proxy's default address).
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] when the engine cannot be asked;
    /// [`ProviderError::Refused`] when the network has no IPv4 gateway.
    pub(crate) async fn bridge_gateway(&self) -> Result<std::net::IpAddr, ProviderError> {
        let operation = "inspect Docker's bridge network";
        self.bounded(operation, async {
            let docker = self.client(operation).await?;
            let network = docker
                .inspect_network("bridge", None)
                .await
                .map_err(|err| self.engine_error(operation, &err, None))?;
            network
                .ipam
                .and_then(|i| i.config)
                .unwrap_or_default()
                .into_iter()
                .filter_map(|c| c.gateway)
                .filter_map(|g| g.parse::<std::net::IpAddr>().ok())
                .find(std::net::IpAddr::is_ipv4)
                .ok_or_else(|| {
                    ProviderError::Refused(
                        "Docker's bridge network has no IPv4 gateway; give --cache-proxy-listen"
                            .into(),
                    )
                })
        })
        .await
    }

    /// The engine API version in use, once a call has negotiated one.
    #[cfg(test)]
    pub(crate) fn api_version(&self) -> Option<ClientVersion> {
        self.client.get().map(Docker::client_version)
    }

    /// The client, connecting and negotiating on first use. A failed
    /// negotiation is retried by the next call.
    async fn client(&self, operation: &str) -> Result<&Docker, ProviderError> {
        self.client
            .get_or_try_init(|| self.negotiate(operation))
            .await
    }

    /// Asks the engine's unversioned `/version` which API it speaks and
    /// connects at the lower of that and bollard's.
    async fn negotiate(&self, operation: &str) -> Result<Docker, ProviderError> {
        let socket = self.socket_str();
        let probe = pooled(socket, self.request_timeout_s(), API_DEFAULT_VERSION)
            .map_err(|err| self.engine_error(operation, &err, None))?
            .with_request_modifier(unversioned);
        let version = probe
            .version()
            .await
            .map_err(|err| self.engine_error(operation, &err, None))?;
        let spoken = version
            .api_version
            .as_deref()
            .and_then(parse_api_version)
            .ok_or_else(|| ProviderError::Engine {
                operation: operation.to_owned(),
                message: format!(
                    "the Docker daemon at {} reported no usable API version ({:?})",
                    self.socket.display(),
                    version.api_version
                ),
            })?;
        let chosen = choose_api_version(spoken).ok_or_else(|| {
            ProviderError::Refused(format!(
                "the Docker daemon at {} speaks engine API {spoken}; billet needs \
                 {MIN_API_VERSION} (Docker 20.10) or newer",
                self.socket.display()
            ))
        })?;
        tracing::debug!(
            socket = %self.socket.display(),
            api = %chosen,
            "negotiated Docker API version"
        );
        pooled(socket, self.request_timeout_s(), &chosen)
            .map_err(|err| self.engine_error(operation, &err, None))
    }

    fn socket_str(&self) -> &str {
        // Checked in `connect`.
        self.socket.to_str().unwrap_or_default()
    }

    /// The [`ProviderError`] for `err`, with `secret` scrubbed from the
    /// message: [`ProviderError::Timeout`] for bollard's own timeout,
    /// [`ProviderError::Unreachable`] when the socket could not be used,
    /// [`ProviderError::Engine`] for an answer.
    fn engine_error(
        &self,
        operation: &str,
        err: &BollardError,
        secret: Option<&str>,
    ) -> ProviderError {
        let message = describe(err, &self.socket, self.timeout);
        let message = match secret {
            Some(secret) => redact(message, secret),
            None => message,
        };
        let operation = operation.to_owned();
        match err {
            BollardError::RequestTimeoutError => ProviderError::Timeout {
                operation,
                after: self.timeout,
            },
            BollardError::SocketNotFoundError(_)
            | BollardError::IOError { .. }
            | BollardError::HyperResponseError { .. }
            | BollardError::HyperLegacyError { .. } => {
                ProviderError::Unreachable { operation, message }
            }
            _ => ProviderError::Engine { operation, message },
        }
    }

    /// This owner's label filter, plus a (substring) name filter.
    fn filters(&self, name: Option<&InstanceName>) -> HashMap<String, Vec<String>> {
        let mut filters = HashMap::new();
        filters.insert(
            "label".to_owned(),
            vec![
                format!("{}={}", labels::DEPLOYMENT, self.owner.deployment),
                format!("{}={}", labels::NODE, self.owner.node),
            ],
        );
        if let Some(name) = name {
            filters.insert("name".to_owned(), vec![name.as_str().to_owned()]);
        }
        filters
    }

    /// Whether the engine-reported labels name this owner (the engine
    /// filters already; this guards against a filter it ignored).
    fn owns(&self, instance: &Instance) -> bool {
        instance.labels.get(labels::DEPLOYMENT).map(String::as_str)
            == Some(self.owner.deployment.as_str())
            && instance.labels.get(labels::NODE).map(String::as_str)
                == Some(self.owner.node.as_str())
    }

    /// Every container of this owner, optionally narrowed by a name filter.
    async fn inventory(
        &self,
        operation: &str,
        name: Option<&InstanceName>,
    ) -> Result<Vec<Instance>, ProviderError> {
        let docker = self.client(operation).await?;
        let options = ListContainersOptions {
            all: true,
            filters: Some(self.filters(name)),
            ..Default::default()
        };
        let summaries = docker
            .list_containers(Some(options))
            .await
            .map_err(|err| self.engine_error(operation, &err, None))?;
        let mut instances = Vec::with_capacity(summaries.len());
        for summary in summaries {
            let exited = summary.state == Some(ContainerSummaryStateEnum::EXITED);
            let mut instance =
                instance_from_summary(summary).map_err(|problem| ProviderError::Engine {
                    operation: operation.to_owned(),
                    message: problem,
                })?;
            if !self.owns(&instance) {
                continue;
            }
            if exited {
                // The list says only "exited"; the exit code and the OOM
                // flag are in the container's own record.
                match docker.inspect_container(&instance.id, None).await {
                    Ok(inspected) => {
                        let state = inspected.state.unwrap_or_default();
                        instance.state = InstanceState::Exited(Exit {
                            code: state.exit_code.unwrap_or(-1),
                            oom_killed: state.oom_killed.unwrap_or(false),
                        });
                    }
                    // Removed between the list and the inspect: gone.
                    Err(err) if is_no_such_container(&err) => continue,
                    Err(err) => return Err(self.engine_error(operation, &err, None)),
                }
            }
            instances.push(instance);
        }
        Ok(instances)
    }

    async fn cpus_unbounded(&self) -> Result<u32, ProviderError> {
        let operation = "read the engine's CPU count";
        let docker = self.client(operation).await?;
        let info = docker
            .info()
            .await
            .map_err(|err| self.engine_error(operation, &err, None))?;
        info.ncpu
            .and_then(|n| u32::try_from(n).ok())
            .filter(|&n| n > 0)
            .ok_or_else(|| {
                ProviderError::Refused(format!(
                    "the Docker engine reported no CPU count (NCPU {:?})",
                    info.ncpu
                ))
            })
    }

    async fn work_unbounded(
        &self,
        operation: &str,
        name: &InstanceName,
    ) -> Result<Work, ProviderError> {
        let docker = self.client(operation).await?;
        let options = TopOptionsBuilder::new().ps_args("-o pid,args").build();
        match docker.top_processes(name.as_str(), Some(options)).await {
            Ok(top) => {
                let args = top
                    .titles
                    .unwrap_or_default()
                    .iter()
                    .position(|t| t == "COMMAND" || t == "ARGS" || t == "CMD");
                let busy = args.is_some_and(|column| {
                    top.processes
                        .unwrap_or_default()
                        .iter()
                        .filter_map(|row| row.get(column))
                        .any(|line| is_job_process(line))
                });
                Ok(if busy { Work::Busy } else { Work::Idle })
            }
            // Gone (404), or present and not running (409): nothing runs.
            Err(BollardError::DockerResponseServerError {
                status_code: 404 | 409,
                ..
            }) => Ok(Work::Idle),
            Err(err) => Err(self.engine_error(operation, &err, None)),
        }
    }

    async fn output_tail_unbounded(
        &self,
        operation: &str,
        name: &InstanceName,
    ) -> Result<String, ProviderError> {
        use futures::StreamExt as _;
        let docker = self.client(operation).await?;
        let options = LogsOptionsBuilder::default()
            .stdout(true)
            .stderr(true)
            .tail(&OUTPUT_TAIL_LINES.to_string())
            .build();
        let mut logs = docker.logs(name.as_str(), Some(options));
        let mut text = String::new();
        while let Some(chunk) = logs.next().await {
            match chunk {
                Ok(out) => text.push_str(&String::from_utf8_lossy(&out.into_bytes())),
                Err(BollardError::DockerResponseServerError {
                    status_code: 404, ..
                }) => break,
                Err(err) => return Err(self.engine_error(operation, &err, None)),
            }
        }
        Ok(text)
    }

    async fn check_image_unbounded(&self, image: &str) -> Result<ImageFacts, ProviderError> {
        let operation = format!("check image {image}");
        let docker = self.client(&operation).await?;
        match docker.inspect_image(image).await {
            Ok(inspected) => Ok(ImageFacts {
                id: inspected.id.unwrap_or_default(),
                runner_version: inspected
                    .config
                    .and_then(|c| c.labels)
                    .and_then(|mut l| l.remove(RUNNER_VERSION_LABEL))
                    .map(|v| v.trim().to_owned())
                    .filter(|v| !v.is_empty()),
            }),
            Err(BollardError::DockerResponseServerError {
                status_code: 404, ..
            }) => Err(ProviderError::ImageUnavailable {
                image: image.to_owned(),
            }),
            Err(err) => Err(self.engine_error(&operation, &err, None)),
        }
    }
}

#[async_trait]
impl Provider for DockerProvider {
    fn kind(&self) -> &'static str {
        "docker"
    }

    fn runs_on_host(&self) -> bool {
        true
    }

    /// Creates the container `spec.name` from `spec.image` (never pulled:
    /// the image must already be on the host) and starts it.
    ///
    /// Sets the entrypoint and `Cmd` to `spec.command` (the whole argv), the environment to `spec.env` plus
    /// [`JIT_CONFIG_ENV`], the owner and lease [`labels`], and, where
    /// non-zero or given, `NanoCpus`, `Memory`, `ShmSize` and `NetworkMode`.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Refused`] before anything reaches the engine when the
    /// name is not `billet-<lease>`, the command or image is empty, the JIT
    /// config is empty or blank, an environment key is malformed or is
    /// [`JIT_CONFIG_ENV`], or a size does not fit the engine's signed 64-bit
    /// field.
    /// [`ProviderError::Engine`] when the engine refuses the create (a name
    /// already in use, a missing image) or the start; after a failed start
    /// the container exists, stopped, and is left for `destroy`.
    ///
    /// `created` is sent once the engine has created the container, before
    /// the start is asked.
    async fn create_then_start(
        &self,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let operation = format!("create {}", spec.name);
        self.bounded(&operation, self.create_unbounded(spec, created, start))
            .await
    }

    /// Removes the container `name` with its anonymous volumes, killing it
    /// if it runs (`docker rm --force --volumes`).
    ///
    /// Only a container carrying this owner's labels is removed: a
    /// container of that name that is not this owner's reads as gone.
    /// Removal is synchronous, so success is [`Teardown::Stopped`], as is a
    /// container that does not exist.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] when the engine refuses the removal (such
    /// as a removal already in progress); [`ProviderError::Unreachable`] or
    /// [`ProviderError::Timeout`] when it cannot be asked.
    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError> {
        let operation = format!("destroy {name}");
        self.bounded(&operation, self.destroy_unbounded(name)).await
    }

    /// `POST /containers/{id}/stop?t=<timeout>`: the engine sends SIGTERM,
    /// and SIGKILL once the timeout passes. Bounded by the timeout plus the
    /// provider's own bound. A container already stopped (304) or gone is
    /// success.
    ///
    /// # Errors
    ///
    /// As [`Provider::destroy`].
    async fn stop(&self, name: &InstanceName, timeout: Duration) -> Result<(), ProviderError> {
        let operation = format!("stop {name}");
        let bound = self.timeout + timeout;
        let call = self.stop_unbounded(name, timeout);
        tokio::time::timeout(bound, call)
            .await
            .unwrap_or(Err(ProviderError::Timeout {
                operation,
                after: bound,
            }))
    }

    /// Every container labelled with this owner's deployment and node,
    /// stopped ones included: one list request, plus one inspect for each
    /// exited container (the list does not carry the exit code or the OOM
    /// flag). `created` reads as [`InstanceState::Created`]; `running`,
    /// `paused`, `restarting` and `stopping` as [`InstanceState::Running`];
    /// `removing` and `dead` as [`InstanceState::Removing`]; a state bollard
    /// does not know as [`InstanceState::Unknown`].
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] when the engine returns an entry without an
    /// id or a name, or refuses a read; [`ProviderError::Unreachable`] or
    /// [`ProviderError::Timeout`] when it cannot be read (never a partial
    /// list).
    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        let operation = "list containers";
        let mut listed = self
            .bounded(operation, self.inventory(operation, None))
            .await?;
        listed.retain(|i| InstanceName::warm(&i.name).is_none());
        Ok(listed)
    }

    /// The container of this owner named exactly `name`.
    ///
    /// # Errors
    ///
    /// As [`Provider::list`].
    async fn find(&self, name: &InstanceName) -> Result<Option<Instance>, ProviderError> {
        let operation = format!("find {name}");
        self.bounded(&operation, self.find_exact(&operation, name))
            .await
    }

    /// The container's processes as the engine lists them (`docker top`,
    /// which runs `ps` on the engine's host): [`Work::Busy`] while one is
    /// the runner's job process. A container that is gone or not running
    /// runs nothing.
    ///
    /// # Errors
    ///
    /// As [`Provider::list`].
    async fn work(&self, name: &InstanceName) -> Result<Work, ProviderError> {
        let operation = format!("read the processes of {name}");
        self.bounded(&operation, self.work_unbounded(&operation, name))
            .await
    }

    /// Asks the engine for the image (`docker image inspect`): present
    /// locally, since this provider never pulls.
    ///
    /// # Errors
    ///
    /// [`ProviderError::ImageUnavailable`] when the engine has no such image;
    /// otherwise as [`Provider::list`].
    async fn check_image(&self, image: &str) -> Result<ImageFacts, ProviderError> {
        let operation = format!("check image {image}");
        self.bounded(&operation, self.check_image_unbounded(image))
            .await
    }

    /// The last [`OUTPUT_TAIL_LINES`] lines of the container's log (`docker
    /// logs --tail`), both streams.
    ///
    /// # Errors
    ///
    /// As [`Provider::list`]; a container already removed answers empty.
    async fn output_tail(&self, name: &InstanceName) -> Result<String, ProviderError> {
        let operation = format!("read the output of {name}");
        self.bounded(&operation, self.output_tail_unbounded(&operation, name))
            .await
    }

    /// The engine refuses a container limited to more CPUs than its host
    /// has (`Range of CPUs is from 0.01 to N`), so a lease asking for more
    /// runs at the host's count, and is charged that; memory runs as asked
    /// (the engine takes any limit). The count is read once from
    /// `docker info` and kept: it changes only with the host.
    ///
    /// # Errors
    ///
    /// As [`Provider::list`], when the engine cannot be asked the first time.
    async fn shape(&self, vcpu: u32, memory: ByteSize) -> Result<(u32, ByteSize), ProviderError> {
        let cpus = *self
            .cpus
            .get_or_try_init(|| self.bounded("read the engine's CPU count", self.cpus_unbounded()))
            .await?;
        Ok((shaped_vcpu(vcpu, cpus), memory))
    }

    /// Creates and starts `billet_warm-<hex>` from the tier's image, with
    /// its handoff directory bound and empty of credentials.
    ///
    /// # Errors
    ///
    /// As [`Provider::create`].
    async fn create_warm(&self, spec: super::WarmSpec) -> Result<Instance, ProviderError> {
        let operation = format!("create {}", spec.name);
        self.bounded(&operation, self.create_warm_unbounded(spec))
            .await
    }

    /// The warm runners: this owner's containers under a warm name.
    ///
    /// # Errors
    ///
    /// As [`Provider::list`].
    async fn list_warm(&self) -> Result<Vec<Instance>, ProviderError> {
        let operation = "list warm runners";
        let mut listed = self
            .bounded(operation, self.inventory(operation, None))
            .await?;
        listed.retain(|i| InstanceName::warm(&i.name).is_some());
        Ok(listed)
    }

    /// Renames the warm container to `spec`'s name (its handoff directory
    /// with it), then, once `start` opens, writes `spec`'s credentials to
    /// the FIFO its runner already waits on.
    ///
    /// # Errors
    ///
    /// As [`Provider::create_then_start`]; [`ProviderError::Engine`] when
    /// the runner does not read its credentials within
    /// [`WARM_DELIVERY_BOUND`] (it died while it waited).
    async fn claim_warm(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let operation = format!("claim {warm} as {}", spec.name);
        self.bounded(
            &operation,
            self.claim_warm_unbounded(warm, spec, created, start),
        )
        .await
    }
}

/// `vcpu` as an engine whose host has `cpus` CPUs runs it: at most `cpus`;
/// 0 (no limit) stays 0.
fn shaped_vcpu(vcpu: u32, cpus: u32) -> u32 {
    vcpu.min(cpus)
}

/// What a container is made of, warm or cold: everything but its labels
/// and its runner's credentials.
struct Shape<'a> {
    name: &'a InstanceName,
    image: &'a str,
    command: &'a [String],
    vcpu: u32,
    memory: ByteSize,
    shm: ByteSize,
    network: Option<&'a String>,
    env: &'a [(String, String)],
    binds: &'a [super::Bind],
    host: &'a crate::model::HostAccess,
    pids_limit: Option<u32>,
}

impl DockerProvider {
    async fn create_unbounded(
        &self,
        spec: InstanceSpec,
        exists: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let (name, body, secrets) = self.container_for(&spec)?;
        self.handoffs.prepare(&spec.name).map_err(|e| {
            ProviderError::Refused(format!(
                "{name}: cannot prepare the handoff of its credentials: {e}"
            ))
        })?;
        let created = self.create_and_start(&spec, body, exists, start).await;
        match &created {
            Ok(_) => {
                // The guest asks for its credentials once it runs. The
                // create waits for that, within `handoff_wait`, so a node
                // that dies once its launch is answered has handed the
                // runner its config; a guest slower than that is served in
                // the background.
                let handoffs = self.handoffs.clone();
                let instance = spec.name.clone();
                let lease = spec.lease.clone();
                let mut delivery = tokio::spawn(async move {
                    if let Err(e) = handoffs.deliver(&instance, &secrets, DELIVERY_BOUND).await {
                        tracing::warn!(%instance, %lease, error = %e, "the runner was not handed its JIT config; it cannot come online, and the start deadline ends it");
                    }
                });
                if tokio::time::timeout(self.handoff_wait, &mut delivery)
                    .await
                    .is_err()
                {
                    tracing::info!(instance = %spec.name, wait_s = self.handoff_wait.as_secs(),
                                   "the runner has not read its credentials yet; handing them over in the background");
                }
            }
            Err(_) => self.handoffs.remove(&spec.name),
        }
        created
    }

    async fn create_and_start(
        &self,
        spec: &InstanceSpec,
        body: ContainerCreateBody,
        exists: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let name = spec.name.as_str().to_owned();
        let operation = format!("create {name}");
        let secret = spec.jit_config.expose();
        let docker = self.client(&operation).await?;

        let created = docker
            .create_container(
                Some(CreateContainerOptions {
                    name: Some(name.clone()),
                    ..Default::default()
                }),
                body,
            )
            .await
            .map_err(|err| match err {
                // The create endpoint answers 404 only for a missing image.
                BollardError::DockerResponseServerError {
                    status_code: 404, ..
                } => ProviderError::ImageUnavailable {
                    image: spec.image.clone(),
                },
                err => self.engine_error(&operation, &err, Some(secret)),
            })?;
        for warning in &created.warnings {
            tracing::warn!(
                instance = %name,
                lease = %spec.lease,
                warning = %redact(warning.clone(), secret),
                "Docker warned on create"
            );
        }
        if created.id.is_empty() {
            return Err(ProviderError::Engine {
                operation,
                message: "the engine created the container but returned no id".to_owned(),
            });
        }
        // The container exists: the caller may record it while it starts.
        let _ = exists.send(());
        super::await_start(start, &operation).await?;

        docker
            .start_container(&created.id, None)
            .await
            .map_err(|err| self.engine_error(&format!("start {name}"), &err, Some(secret)))?;
        tracing::info!(
            instance = %name,
            lease = %spec.lease,
            epoch = spec.epoch.0,
            id = %created.id,
            "started container"
        );

        Ok(Instance {
            id: created.id,
            name,
            state: InstanceState::Running,
            labels: self.labels_for(spec).into_iter().collect(),
        })
    }

    async fn destroy_unbounded(&self, name: &InstanceName) -> Result<Teardown, ProviderError> {
        let operation = format!("destroy {name}");
        self.handoffs.remove(name);
        let Some(instance) = self.find_exact(&operation, name).await? else {
            return Ok(Teardown::Stopped);
        };
        let docker = self.client(&operation).await?;
        let options = RemoveContainerOptions {
            force: true,
            v: true,
            ..Default::default()
        };
        match docker.remove_container(&instance.id, Some(options)).await {
            Ok(()) => {
                tracing::info!(instance = %name, id = %instance.id, "removed container");
                Ok(Teardown::Stopped)
            }
            Err(err) if is_no_such_container(&err) => Ok(Teardown::Stopped),
            Err(err) => Err(self.engine_error(&operation, &err, None)),
        }
    }
}
impl DockerProvider {
    async fn create_warm_unbounded(
        &self,
        spec: super::WarmSpec,
    ) -> Result<Instance, ProviderError> {
        if InstanceName::warm(spec.name.as_str()).is_none() {
            return Err(ProviderError::Refused(format!(
                "{} is not a warm runner's name",
                spec.name
            )));
        }
        let labels = HashMap::from([
            (labels::DEPLOYMENT.to_owned(), self.owner.deployment.clone()),
            (labels::NODE.to_owned(), self.owner.node.to_string()),
            (labels::WARM.to_owned(), spec.tier.clone()),
        ]);
        let body = self.body_for(
            &Shape {
                name: &spec.name,
                image: &spec.image,
                command: &spec.command,
                vcpu: spec.vcpu,
                memory: spec.memory,
                shm: spec.shm,
                network: spec.network.as_ref(),
                env: &spec.env,
                binds: &[],
                host: &spec.host,
                pids_limit: spec.pids_limit,
            },
            labels.clone(),
        )?;
        self.handoffs.prepare(&spec.name).map_err(|e| {
            ProviderError::Refused(format!("{}: cannot prepare its handoff: {e}", spec.name))
        })?;
        let name = spec.name.as_str().to_owned();
        let operation = format!("create {name}");
        let docker = self.client(&operation).await?;
        let made = async {
            let created = docker
                .create_container(
                    Some(CreateContainerOptions {
                        name: Some(name.clone()),
                        ..Default::default()
                    }),
                    body,
                )
                .await
                .map_err(|err| match err {
                    BollardError::DockerResponseServerError {
                        status_code: 404, ..
                    } => ProviderError::ImageUnavailable {
                        image: spec.image.clone(),
                    },
                    err => self.engine_error(&operation, &err, None),
                })?;
            docker
                .start_container(&created.id, None)
                .await
                .map_err(|err| self.engine_error(&format!("start {name}"), &err, None))?;
            Ok(created.id)
        };
        match made.await {
            Ok(id) => {
                tracing::info!(instance = %name, tier = %spec.tier, %id, "started a warm runner");
                Ok(Instance {
                    id,
                    name,
                    state: InstanceState::Running,
                    labels: labels.into_iter().collect(),
                })
            }
            Err(e) => {
                self.handoffs.remove(&spec.name);
                Err(e)
            }
        }
    }

    async fn claim_warm_unbounded(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let operation = format!("claim {warm} as {}", spec.name);
        if spec.name != InstanceName::for_lease(&spec.lease)
            || InstanceName::warm(warm.as_str()).is_none()
        {
            return Err(ProviderError::Refused(format!(
                "{operation}: not a warm runner and its lease's name"
            )));
        }
        let secrets = Self::secrets_for(&spec)?;
        let docker = self.client(&operation).await?;
        docker
            .rename_container(
                warm.as_str(),
                bollard::query_parameters::RenameContainerOptions {
                    name: spec.name.as_str().to_owned(),
                },
            )
            .await
            .map_err(|err| self.engine_error(&operation, &err, None))?;
        // The bind mount follows the directory: the guest still sees it.
        self.handoffs
            .rename(warm, &spec.name)
            .map_err(|e| ProviderError::Engine {
                operation: operation.clone(),
                message: format!("cannot move its handoff: {e}"),
            })?;
        let _ = created.send(());
        super::await_start(start, &operation).await?;
        self.handoffs
            .deliver(&spec.name, &secrets, WARM_DELIVERY_BOUND)
            .await
            .map_err(|message| ProviderError::Engine {
                operation: operation.clone(),
                message: format!("the warm runner did not take its credentials: {message}"),
            })?;
        tracing::info!(instance = %spec.name, warm = %warm, lease = %spec.lease, epoch = spec.epoch.0,
                       "handed a warm runner its registration");
        Ok(Instance {
            id: String::new(),
            name: spec.name.as_str().to_owned(),
            state: InstanceState::Running,
            labels: self.labels_for(&spec).into_iter().collect(),
        })
    }
}

impl DockerProvider {
    async fn stop_unbounded(
        &self,
        name: &InstanceName,
        timeout: Duration,
    ) -> Result<(), ProviderError> {
        let operation = format!("stop {name}");
        let Some(instance) = self.find_exact(&operation, name).await? else {
            return Ok(());
        };
        if !instance.may_run() {
            return Ok(());
        }
        let docker = self.client(&operation).await?;
        let seconds = i32::try_from(timeout.as_secs()).unwrap_or(i32::MAX);
        let options = StopContainerOptionsBuilder::default().t(seconds).build();
        match docker.stop_container(&instance.id, Some(options)).await {
            Ok(()) => {
                tracing::info!(instance = %name, id = %instance.id, timeout_s = seconds, "stopped container");
                Ok(())
            }
            Err(err) if is_no_such_container(&err) || is_not_modified(&err) => Ok(()),
            Err(err) => Err(self.engine_error(&operation, &err, None)),
        }
    }

    async fn find_exact(
        &self,
        operation: &str,
        name: &InstanceName,
    ) -> Result<Option<Instance>, ProviderError> {
        // The engine's name filter matches substrings (as a regular
        // expression), so compare exactly here.
        Ok(self
            .inventory(operation, Some(name))
            .await?
            .into_iter()
            .find(|instance| instance.name == name.as_str()))
    }

    fn labels_for(&self, spec: &InstanceSpec) -> HashMap<String, String> {
        HashMap::from([
            (labels::DEPLOYMENT.to_owned(), self.owner.deployment.clone()),
            (labels::NODE.to_owned(), self.owner.node.to_string()),
            (labels::LEASE.to_owned(), spec.lease.to_string()),
            (labels::EPOCH.to_owned(), spec.epoch.to_string()),
            (labels::REQUEST.to_owned(), spec.request_id.to_string()),
        ])
    }

    /// Checks `spec` and builds the create request. Pure.
    fn container_for(
        &self,
        spec: &InstanceSpec,
    ) -> Result<(String, ContainerCreateBody, Secrets), ProviderError> {
        let expected = InstanceName::for_lease(&spec.lease);
        if spec.name != expected {
            return Err(ProviderError::Refused(format!(
                "instance name {} is not {expected}, the name of lease {}",
                spec.name, spec.lease
            )));
        }
        let secrets = Self::secrets_for(spec)?;
        let body = self.body_for(
            &Shape {
                name: &spec.name,
                image: &spec.image,
                command: &spec.command,
                vcpu: spec.vcpu,
                memory: spec.memory,
                shm: spec.shm,
                network: spec.network.as_ref(),
                env: &spec.env,
                binds: &spec.binds,
                host: &spec.host,
                pids_limit: spec.pids_limit,
            },
            self.labels_for(spec),
        )?;
        Ok((spec.name.as_str().to_owned(), body, secrets))
    }

    /// The credentials `spec`'s runner is handed through its handoff.
    fn secrets_for(spec: &InstanceSpec) -> Result<Secrets, ProviderError> {
        let secret = spec.jit_config.expose();
        if secret.trim().is_empty() {
            return Err(ProviderError::Refused(format!(
                "{}: the JIT config is empty; a runner without a registration has no job to run",
                spec.name
            )));
        }
        let refused = |e: String| ProviderError::Refused(format!("{}: {e}", spec.name));
        let mut secrets = Secrets::default();
        secrets.add(JIT_CONFIG_ENV, secret).map_err(refused)?;
        if let Some(token) = &spec.cache_token {
            secrets
                .add(crate::cache::session::TOKEN_ENV, token.expose())
                .map_err(refused)?;
        }
        if let Some(url) = &spec.actions_proxy {
            secrets
                .add(crate::cache::actions::PROXY_ENV, url.expose())
                .map_err(refused)?;
        }
        Ok(secrets)
    }

    /// Checks a container's shape and builds its create request, with
    /// `labels`. Pure.
    fn body_for(
        &self,
        shape: &Shape<'_>,
        labels: HashMap<String, String>,
    ) -> Result<ContainerCreateBody, ProviderError> {
        let name = shape.name;
        if shape.command.is_empty() {
            return Err(ProviderError::Refused(format!(
                "{name}: the runner command is empty"
            )));
        }
        if shape.image.trim().is_empty() {
            return Err(ProviderError::Refused(format!(
                "{name}: the image is empty"
            )));
        }
        let mut env = Vec::with_capacity(shape.env.len() + 2);
        for (key, value) in shape.env {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(ProviderError::Refused(format!(
                    "{name}: environment key {key:?} is not a valid variable name"
                )));
            }
            if key == super::mirrors::MIRRORS_ENV && self.mirrors.env_value().is_some() {
                continue;
            }
            if key == JIT_CONFIG_ENV || key == SECRETS_ENV {
                return Err(ProviderError::Refused(format!(
                    "{name}: the plain environment may not set {key}; the JIT config is passed \
                     separately"
                )));
            }
            if key == crate::cache::session::TOKEN_ENV || key == crate::cache::actions::PROXY_ENV {
                return Err(ProviderError::Refused(format!(
                    "{name}: the plain environment may not set {key}; the cache's credentials are \
                     passed separately",
                )));
            }
            env.push(format!("{key}={value}"));
        }
        if let Some(mirrors) = self.mirrors.env_value() {
            env.push(format!("{}={mirrors}", super::mirrors::MIRRORS_ENV));
        }
        // The credentials go through the handoff FIFO, never into what the
        // engine records; the environment names only where to read them.
        env.push(format!("{SECRETS_ENV}={GUEST_DIR}/{SECRETS_FILE}"));
        let bytes = |what: &str, size: u64| {
            i64::try_from(size).map_err(|_| {
                ProviderError::Refused(format!("{}: {what} of {size} bytes is too large", name))
            })
        };
        let memory = bytes("memory", shape.memory.0)?;
        let shm = bytes("shm size", shape.shm.0)?;
        let host_config = HostConfig {
            nano_cpus: (shape.vcpu > 0).then(|| i64::from(shape.vcpu) * 1_000_000_000),
            memory: (memory > 0).then_some(memory),
            // The limit is the lease's memory, swap included: without this
            // the engine lets a container swap as much again.
            memory_swap: (memory > 0).then_some(memory),
            shm_size: (shm > 0).then_some(shm),
            network_mode: shape.network.cloned(),
            // The hardened default (decision 126). The engine's seccomp
            // profile and masked paths are kept by never naming them.
            security_opt: (!shape.host.new_privileges)
                .then(|| vec!["no-new-privileges:true".to_owned()]),
            pids_limit: Some(i64::from(
                shape
                    .pids_limit
                    .map_or(self.guest_pids_limit, |p| p.min(self.guest_pids_limit)),
            )),
            cap_drop: (!shape.host.privileged).then(|| vec!["ALL".to_owned()]),
            cap_add: (!shape.host.privileged).then(|| {
                GUEST_CAPABILITIES
                    .iter()
                    .map(|c| (*c).to_owned())
                    .chain(shape.host.capabilities.iter().cloned())
                    .collect()
            }),
            privileged: shape.host.privileged.then_some(true),
            pid_mode: shape.host.pid.then(|| "host".to_owned()),
            ipc_mode: shape.host.ipc.then(|| "host".to_owned()),
            uts_mode: shape.host.uts.then(|| "host".to_owned()),
            devices: (!shape.host.devices.is_empty()).then(|| {
                shape
                    .host
                    .devices
                    .iter()
                    .map(|d| bollard::models::DeviceMapping {
                        path_on_host: Some(d.clone()),
                        path_in_container: Some(d.clone()),
                        cgroup_permissions: Some("rwm".to_owned()),
                    })
                    .collect()
            }),
            // Structured mounts, not `binds` strings, so a path with a `:`
            // cannot be read as options.
            mounts: {
                let mut mounts: Vec<bollard::models::Mount> = shape
                    .binds
                    .iter()
                    .map(|b| bollard::models::Mount {
                        target: Some(b.guest.clone()),
                        source: Some(b.host.to_string_lossy().into_owned()),
                        typ: Some(bollard::models::MountType::BIND),
                        read_only: Some(false),
                        ..Default::default()
                    })
                    .chain(shape.host.mounts.iter().map(|m| bollard::models::Mount {
                        target: Some(m.target.clone()),
                        source: Some(m.source.clone()),
                        typ: Some(bollard::models::MountType::BIND),
                        read_only: Some(m.read_only),
                        ..Default::default()
                    }))
                    .collect();
                if let Some(daemon_json) = self.mirrors.daemon_json() {
                    mounts.push(bollard::models::Mount {
                        target: Some(super::mirrors::GUEST_DAEMON_JSON.to_owned()),
                        source: Some(daemon_json.to_string_lossy().into_owned()),
                        typ: Some(bollard::models::MountType::BIND),
                        read_only: Some(true),
                        ..Default::default()
                    });
                }
                mounts.push(bollard::models::Mount {
                    target: Some(GUEST_DIR.to_owned()),
                    source: Some(self.handoffs.dir(name).to_string_lossy().into_owned()),
                    typ: Some(bollard::models::MountType::BIND),
                    read_only: Some(true),
                    ..Default::default()
                });
                Some(mounts)
            },
            ..Default::default()
        };
        let body = ContainerCreateBody {
            image: Some(shape.image.to_owned()),
            // The tier's command is the whole argv: it replaces the image's
            // entrypoint rather than becoming its arguments.
            entrypoint: shape.command.first().map(|c| vec![c.clone()]),
            cmd: Some(shape.command.iter().skip(1).cloned().collect()),
            env: Some(env),
            labels: Some(labels),
            host_config: Some(host_config),
            ..Default::default()
        };
        Ok(body)
    }
}

/// The lower of the engine's API version and bollard's, or `None` when that
/// is older than [`MIN_API_VERSION`].
fn choose_api_version(spoken: ClientVersion) -> Option<ClientVersion> {
    let chosen = if spoken < *API_DEFAULT_VERSION {
        spoken
    } else {
        *API_DEFAULT_VERSION
    };
    (chosen >= MIN_API_VERSION).then_some(chosen)
}

/// Parses `major.minor`.
fn parse_api_version(text: &str) -> Option<ClientVersion> {
    let (major, minor) = text.trim().split_once('.')?;
    Some(ClientVersion {
        major_version: major.parse().ok()?,
        minor_version: minor.parse().ok()?,
    })
}

/// Drops the `/v<major>.<minor>` segment bollard puts in front of every
/// path, so the request reaches the engine's unversioned endpoint, which
/// every engine serves whatever API versions it supports.
fn unversioned(mut request: BollardRequest) -> BollardRequest {
    if let Some(uri) = strip_version_segment(&request.uri().to_string())
        && let Ok(uri) = uri.parse()
    {
        *request.uri_mut() = uri;
    }
    request
}

/// `unix://host/v1.53/version` → `unix://host/version`; `None` when the
/// first path segment is not a version.
fn strip_version_segment(uri: &str) -> Option<String> {
    let after_scheme = uri.find("://")? + 3;
    let path_start = after_scheme + uri[after_scheme..].find('/')?;
    let rest = &uri[path_start + 1..];
    let segment_len = rest.find(['/', '?']).unwrap_or(rest.len());
    let segment = rest[..segment_len].strip_prefix('v')?;
    parse_api_version(segment)?;
    let mut stripped = uri[..path_start].to_owned();
    let tail = &rest[segment_len..];
    if !tail.starts_with('/') {
        stripped.push('/');
    }
    stripped.push_str(tail);
    Some(stripped)
}

/// Converts one `GET /containers/json` entry.
///
/// # Errors
///
/// A sentence when the entry has no id or no plain name.
fn instance_from_summary(summary: ContainerSummary) -> Result<Instance, String> {
    let id = summary
        .id
        .filter(|id| !id.is_empty())
        .ok_or_else(|| "the engine listed a container without an id".to_owned())?;
    // Names carry a leading '/'; a container reached through a legacy link
    // also lists `/<other>/<alias>`, which is not its own name.
    let name = summary
        .names
        .unwrap_or_default()
        .iter()
        .map(|name| name.strip_prefix('/').unwrap_or(name))
        .find(|name| !name.is_empty() && !name.contains('/'))
        .map(str::to_owned)
        .ok_or_else(|| format!("the engine listed container {id} without a name"))?;
    let state = match summary.state {
        Some(ContainerSummaryStateEnum::CREATED) => InstanceState::Created,
        Some(
            ContainerSummaryStateEnum::RUNNING
            | ContainerSummaryStateEnum::PAUSED
            | ContainerSummaryStateEnum::RESTARTING
            | ContainerSummaryStateEnum::STOPPING,
        ) => InstanceState::Running,
        // The list does not carry the exit code or the OOM flag: until the
        // container's own record is read, how it ended is unknown.
        Some(ContainerSummaryStateEnum::EXITED) => InstanceState::Unknown,
        Some(ContainerSummaryStateEnum::REMOVING | ContainerSummaryStateEnum::DEAD) => {
            InstanceState::Removing
        }
        Some(ContainerSummaryStateEnum::EMPTY) | None => InstanceState::Unknown,
    };
    let labels: BTreeMap<String, String> = summary
        .labels
        .unwrap_or_default()
        .into_iter()
        .filter(|(key, _)| key.starts_with("sh.billet."))
        .collect();
    Ok(Instance {
        id,
        name,
        state,
        labels,
    })
}

/// Whether the engine said the container does not exist.
/// The engine's 304: the container was already stopped.
fn is_not_modified(err: &BollardError) -> bool {
    matches!(
        err,
        BollardError::DockerResponseServerError {
            status_code: 304,
            ..
        }
    )
}

fn is_no_such_container(err: &BollardError) -> bool {
    match err {
        BollardError::DockerResponseServerError {
            status_code,
            message,
        } => {
            let message = message.to_ascii_lowercase();
            *status_code == 404
                || [
                    "no such container",
                    "no such object",
                    "not find container",
                    "no container with name or id",
                ]
                .iter()
                .any(|needle| message.contains(needle))
        }
        _ => false,
    }
}

/// One sentence for a bollard error, naming the socket when the engine
/// could not be reached.
fn describe(err: &BollardError, socket: &Path, timeout: Duration) -> String {
    let socket = socket.display();
    match err {
        BollardError::DockerResponseServerError {
            status_code,
            message,
        } => {
            format!(
                "the Docker daemon at {socket} answered {status_code}: {}",
                message.trim()
            )
        }
        BollardError::SocketNotFoundError(_) => format!(
            "the Docker daemon at {socket} cannot be reached: no socket exists at that path; check \
             that dockerd is running and that the configured socket path is right"
        ),
        BollardError::RequestTimeoutError => format!(
            "the Docker daemon at {socket} did not answer within {timeout:?}; check that \
             dockerd is healthy"
        ),
        BollardError::IOError { .. }
        | BollardError::HyperResponseError { .. }
        | BollardError::HyperLegacyError { .. } => format!(
            "the Docker daemon at {socket} cannot be reached: {}; check that dockerd is running \
             and that this user may open the socket (root or the docker group)",
            chain(err)
        ),
        other => chain(other),
    }
}

/// An error and its sources, joined with `: `.
fn chain(err: &dyn std::error::Error) -> String {
    let mut text = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let cause_text = cause.to_string();
        if !text.contains(&cause_text) {
            let _ = write!(text, ": {cause_text}");
        }
        source = cause.source();
    }
    text
}

/// Scrubs a credential from an engine message: every occurrence of
/// `secret`, and anything following a mention of [`JIT_CONFIG_ENV`] (in
/// case the engine echoed a truncated or escaped form of it).
fn redact(message: String, secret: &str) -> String {
    let mut message = if secret.is_empty() {
        message
    } else {
        message.replace(secret, REDACTED)
    };
    if let Some(at) = message.find(JIT_CONFIG_ENV) {
        message.truncate(at + JIT_CONFIG_ENV.len());
        message.push('=');
        message.push_str(REDACTED);
    }
    message
}

#[cfg(test)]
mod tests;
