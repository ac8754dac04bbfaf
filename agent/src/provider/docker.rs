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
    CreateContainerOptions, ListContainersOptions, RemoveContainerOptions,
    StopContainerOptionsBuilder, TopOptionsBuilder,
};
use bollard::{API_DEFAULT_VERSION, BollardRequest, ClientVersion, Docker};
use tokio::sync::OnceCell;

use super::handoff::{DELIVERY_BOUND, GUEST_DIR, Handoffs, SECRETS_ENV, SECRETS_FILE, Secrets};
use super::{
    Exit, Instance, InstanceSpec, InstanceState, Owner, Provider, ProviderError, Teardown, Work,
    is_job_process, labels,
};
use crate::model::{ByteSize, InstanceName};

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

/// What an error message carries in place of a credential.
const REDACTED: &str = "<redacted>";

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
        })
    }

    /// The same provider keeping its containers' handoff directories
    /// under `base` (a directory of the node's state; a temporary one
    /// otherwise).
    #[must_use]
    pub(crate) fn with_handoff_dir(mut self, base: PathBuf) -> Self {
        self.handoffs = Handoffs::new(base);
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

    async fn check_image_unbounded(&self, image: &str) -> Result<(), ProviderError> {
        let operation = format!("check image {image}");
        let docker = self.client(&operation).await?;
        match docker.inspect_image(image).await {
            Ok(_) => Ok(()),
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
        self.bounded(operation, self.inventory(operation, None))
            .await
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
    async fn check_image(&self, image: &str) -> Result<(), ProviderError> {
        let operation = format!("check image {image}");
        self.bounded(&operation, self.check_image_unbounded(image))
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
}

/// `vcpu` as an engine whose host has `cpus` CPUs runs it: at most `cpus`;
/// 0 (no limit) stays 0.
fn shaped_vcpu(vcpu: u32, cpus: u32) -> u32 {
    vcpu.min(cpus)
}

impl DockerProvider {
    async fn create_unbounded(
        &self,
        spec: InstanceSpec,
        exists: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let (name, body, secrets) = self.container_for(&spec)?;
        let operation = format!("create {name}");
        let secret = spec.jit_config.expose();
        let docker = self.client(&operation).await?;
        self.handoffs.prepare(&spec.name).map_err(|e| {
            ProviderError::Refused(format!(
                "{name}: cannot prepare the handoff of its credentials: {e}"
            ))
        })?;
        let created = self
            .create_and_start(&spec, &name, body, secret, docker, exists, start)
            .await;
        match &created {
            Ok(_) => {
                // The guest asks for its credentials once it runs; the
                // launch does not wait for that.
                let handoffs = self.handoffs.clone();
                let instance = spec.name.clone();
                let lease = spec.lease.clone();
                tokio::spawn(async move {
                    if let Err(e) = handoffs.deliver(&instance, &secrets, DELIVERY_BOUND).await {
                        tracing::warn!(%instance, %lease, error = %e, "the runner was not handed its JIT config; it cannot come online, and the start deadline ends it");
                    }
                });
            }
            Err(_) => self.handoffs.remove(&spec.name),
        }
        created
    }

    #[allow(clippy::too_many_arguments)]
    async fn create_and_start(
        &self,
        spec: &InstanceSpec,
        name: &str,
        body: ContainerCreateBody,
        secret: &str,
        docker: &Docker,
        exists: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        let operation = format!("create {name}");
        let name = name.to_owned();

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
            epoch = %spec.epoch,
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
        if spec.command.is_empty() {
            return Err(ProviderError::Refused(format!(
                "{}: the runner command is empty",
                spec.name
            )));
        }
        if spec.image.trim().is_empty() {
            return Err(ProviderError::Refused(format!(
                "{}: the image is empty",
                spec.name
            )));
        }
        let secret = spec.jit_config.expose();
        if secret.trim().is_empty() {
            return Err(ProviderError::Refused(format!(
                "{}: the JIT config is empty; a runner without a registration has no job to run",
                spec.name
            )));
        }
        let mut env = Vec::with_capacity(spec.env.len() + 1);
        for (key, value) in &spec.env {
            if key.is_empty() || key.contains('=') || key.contains('\0') {
                return Err(ProviderError::Refused(format!(
                    "{}: environment key {key:?} is not a valid variable name",
                    spec.name
                )));
            }
            if key == super::mirrors::MIRRORS_ENV && self.mirrors.env_value().is_some() {
                continue;
            }
            if key == JIT_CONFIG_ENV || key == SECRETS_ENV {
                return Err(ProviderError::Refused(format!(
                    "{}: the plain environment may not set {key}; the JIT config is passed \
                     separately",
                    spec.name
                )));
            }
            if key == crate::cache::session::TOKEN_ENV || key == crate::cache::actions::PROXY_ENV {
                return Err(ProviderError::Refused(format!(
                    "{}: the plain environment may not set {key}; the cache's credentials are \
                     passed separately",
                    spec.name,
                )));
            }
            env.push(format!("{key}={value}"));
        }
        if let Some(mirrors) = self.mirrors.env_value() {
            env.push(format!("{}={mirrors}", super::mirrors::MIRRORS_ENV));
        }
        // The credentials go through the handoff FIFO, never into what the
        // engine records; the environment names only where to read them.
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
        env.push(format!("{SECRETS_ENV}={GUEST_DIR}/{SECRETS_FILE}"));

        let bytes = |what: &str, size: u64| {
            i64::try_from(size).map_err(|_| {
                ProviderError::Refused(format!(
                    "{}: {what} of {size} bytes is too large",
                    spec.name
                ))
            })
        };
        let memory = bytes("memory", spec.memory.0)?;
        let shm = bytes("shm size", spec.shm.0)?;
        let host_config = HostConfig {
            nano_cpus: (spec.vcpu > 0).then(|| i64::from(spec.vcpu) * 1_000_000_000),
            memory: (memory > 0).then_some(memory),
            // The limit is the lease's memory, swap included: without this
            // the engine lets a container swap as much again.
            memory_swap: (memory > 0).then_some(memory),
            shm_size: (shm > 0).then_some(shm),
            network_mode: spec.network.clone(),
            // Structured mounts, not `binds` strings, so a path with a `:`
            // cannot be read as options.
            mounts: {
                let mut mounts: Vec<bollard::models::Mount> = spec
                    .binds
                    .iter()
                    .map(|b| bollard::models::Mount {
                        target: Some(b.guest.clone()),
                        source: Some(b.host.to_string_lossy().into_owned()),
                        typ: Some(bollard::models::MountType::BIND),
                        read_only: Some(false),
                        ..Default::default()
                    })
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
                    source: Some(self.handoffs.dir(&spec.name).to_string_lossy().into_owned()),
                    typ: Some(bollard::models::MountType::BIND),
                    read_only: Some(true),
                    ..Default::default()
                });
                Some(mounts)
            },
            ..Default::default()
        };
        let body = ContainerCreateBody {
            image: Some(spec.image.clone()),
            // The tier's command is the whole argv: it replaces the image's
            // entrypoint rather than becoming its arguments.
            entrypoint: spec.command.first().map(|c| vec![c.clone()]),
            cmd: Some(spec.command.iter().skip(1).cloned().collect()),
            env: Some(env),
            labels: Some(self.labels_for(spec)),
            host_config: Some(host_config),
            ..Default::default()
        };
        Ok((spec.name.as_str().to_owned(), body, secrets))
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
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::model::{ByteSize, Epoch, JitConfig, LeaseId, NodeName, RequestId};

    const SOCKET: &str = "/var/run/docker.sock";
    const TEST_IMAGE_REPO: &str = "billet-test-shell";
    const TEST_IMAGE_TAG: &str = "job";
    const TEST_IMAGE: &str = "billet-test-shell:job";

    fn owner(deployment: &str, node: &str) -> Owner {
        Owner {
            deployment: deployment.to_owned(),
            node: NodeName::parse("node", node).unwrap(),
        }
    }

    fn unique(prefix: &str) -> String {
        format!("{prefix}-{}", uuid::Uuid::new_v4().simple())
    }

    fn spec(lease: &str, jit: &str) -> InstanceSpec {
        let lease = LeaseId::parse("lease", lease).unwrap();
        InstanceSpec {
            name: InstanceName::for_lease(&lease),
            lease,
            epoch: Epoch(7),
            request_id: RequestId(1234),
            image: TEST_IMAGE.to_owned(),
            command: vec!["/bin/sleep".to_owned(), "300".to_owned()],
            vcpu: 1,
            memory: ByteSize(64 << 20),
            shm: ByteSize(16 << 20),
            network: Some("none".to_owned()),
            env: vec![("RUNNER_TIER".to_owned(), "small".to_owned())],
            jit_config: JitConfig::new(jit.to_owned()),
            binds: Vec::new(),
            cache_token: None,
            actions_proxy: None,
        }
    }

    fn offline() -> DockerProvider {
        DockerProvider::connect(
            Path::new("/nonexistent/docker.sock"),
            owner("dep", "node-a"),
        )
        .unwrap()
    }

    // ---- pure helpers -------------------------------------------------

    #[test]
    fn the_version_segment_is_stripped_for_the_unversioned_probe() {
        assert_eq!(
            strip_version_segment("unix://2f7661722f72756e/v1.53/version").as_deref(),
            Some("unix://2f7661722f72756e/version")
        );
        assert_eq!(
            strip_version_segment("unix://h/v1.41/containers/json?all=true").as_deref(),
            Some("unix://h/containers/json?all=true")
        );
        assert_eq!(strip_version_segment("unix://h/version"), None);
        assert_eq!(strip_version_segment("unix://h/volumes"), None);
    }

    #[test]
    fn the_api_version_is_the_lower_of_the_engines_and_bollards_and_never_below_1_41() {
        let v = |text| parse_api_version(text).unwrap();
        assert_eq!(choose_api_version(v("1.41")), Some(v("1.41")));
        assert_eq!(choose_api_version(v("1.47")), Some(v("1.47")));
        assert_eq!(choose_api_version(v("1.99")), Some(*API_DEFAULT_VERSION));
        assert_eq!(choose_api_version(v("1.40")), None);
        assert!(parse_api_version("1").is_none());
        assert!(parse_api_version("one.two").is_none());
    }

    fn summary(
        id: Option<&str>,
        names: &[&str],
        state: Option<ContainerSummaryStateEnum>,
    ) -> ContainerSummary {
        ContainerSummary {
            id: id.map(str::to_owned),
            names: Some(names.iter().map(|n| (*n).to_owned()).collect()),
            state,
            labels: Some(HashMap::from([
                (labels::LEASE.to_owned(), "a".to_owned()),
                ("com.example.other".to_owned(), "x".to_owned()),
            ])),
            ..Default::default()
        }
    }

    #[test]
    fn each_listed_state_maps_to_what_the_engine_says_and_an_unknown_one_may_run() {
        use ContainerSummaryStateEnum as S;
        for (state, expected) in [
            (None, InstanceState::Unknown),
            (Some(S::EMPTY), InstanceState::Unknown),
            (Some(S::CREATED), InstanceState::Created),
            (Some(S::RUNNING), InstanceState::Running),
            (Some(S::PAUSED), InstanceState::Running),
            (Some(S::RESTARTING), InstanceState::Running),
            // Read further by an inspect in `inventory`.
            (Some(S::EXITED), InstanceState::Unknown),
            (Some(S::REMOVING), InstanceState::Removing),
            (Some(S::DEAD), InstanceState::Removing),
            (Some(S::STOPPING), InstanceState::Running),
        ] {
            let instance =
                instance_from_summary(summary(Some("abc"), &["/billet-a"], state)).unwrap();
            assert_eq!(instance.state, expected, "{state:?}");
            assert_eq!(instance.name, "billet-a");
            assert_eq!(
                instance.labels,
                BTreeMap::from([(labels::LEASE.to_owned(), "a".to_owned())])
            );
        }
    }

    #[test]
    fn an_entry_without_an_id_or_a_name_is_malformed() {
        assert!(instance_from_summary(summary(None, &["/billet-a"], None)).is_err());
        assert!(instance_from_summary(summary(Some(""), &["/billet-a"], None)).is_err());
        assert!(instance_from_summary(summary(Some("abc"), &[], None)).is_err());
        assert!(instance_from_summary(summary(Some("abc"), &["/"], None)).is_err());
        // A legacy link alias is not the container's own name.
        let linked =
            instance_from_summary(summary(Some("abc"), &["/web/db", "/billet-a"], None)).unwrap();
        assert_eq!(linked.name, "billet-a");
    }

    /// A stand-in engine on a Unix socket: `/version` answers API 1.43 and
    /// `/containers/json` answers `containers` (raw JSON), one request per
    /// connection; anything else is a 404.
    fn engine_listing(containers: &'static str) -> std::path::PathBuf {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let path = std::env::temp_dir().join(unique("billet-listing-engine"));
        let listener = tokio::net::UnixListener::bind(&path).unwrap();
        tokio::spawn(async move {
            while let Ok((mut stream, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut head = Vec::new();
                    let mut buf = [0_u8; 1024];
                    while !head.windows(4).any(|w| w == b"\r\n\r\n") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => head.extend_from_slice(&buf[..n]),
                        }
                    }
                    let line = String::from_utf8_lossy(&head);
                    let target = line.split_whitespace().nth(1).unwrap_or_default();
                    let (status, body) = if target.ends_with("/version") {
                        ("200 OK", r#"{"ApiVersion":"1.43","Version":"24.0.0"}"#)
                    } else if target.contains("/containers/json") {
                        ("200 OK", containers)
                    } else {
                        ("404 Not Found", r#"{"message":"no such endpoint"}"#)
                    };
                    let reply = format!(
                        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                        body.len()
                    );
                    let _ = stream.write_all(reply.as_bytes()).await;
                    let _ = stream.shutdown().await;
                });
            }
        });
        path
    }

    #[tokio::test]
    async fn list_fails_on_a_malformed_entry_rather_than_answering_a_partial_inventory() {
        let labels =
            r#"{"sh.billet.deployment":"dep","sh.billet.node":"node-1","sh.billet.lease":"a"}"#;
        let good =
            format!(r#"{{"Id":"c1","Names":["/billet-a"],"State":"running","Labels":{labels}}}"#);
        let owner = owner("dep", "node-1");

        // The engine answers: a well-formed inventory lists.
        let listing: &'static str = Box::leak(format!("[{good}]").into_boxed_str());
        let provider = DockerProvider::connect(&engine_listing(listing), owner.clone())
            .unwrap()
            .with_timeout(Duration::from_secs(10));
        let listed = provider
            .list()
            .await
            .expect("a well-formed inventory lists");
        assert_eq!(listed.len(), 1, "{listed:?}");
        assert_eq!(listed[0].name, "billet-a");

        // The same inventory with an entry that has no name, or no id.
        for bad in [
            r#"{"Id":"c2","Names":[],"State":"running","Labels":{}}"#,
            r#"{"Names":["/billet-b"],"State":"running","Labels":{}}"#,
        ] {
            let listing: &'static str = Box::leak(format!("[{good},{bad}]").into_boxed_str());
            let provider = DockerProvider::connect(&engine_listing(listing), owner.clone())
                .unwrap()
                .with_timeout(Duration::from_secs(10));
            match provider.list().await {
                Err(ProviderError::Engine { operation, .. }) => {
                    assert!(operation.contains("list"), "{operation}")
                }
                other => panic!("a malformed entry {bad} gave {other:?}, not a list failure"),
            }
        }
    }

    #[test]
    fn a_jit_config_is_scrubbed_from_engine_messages() {
        assert_eq!(
            redact("bad value c2VjcmV0 here".to_owned(), "c2VjcmV0"),
            "bad value <redacted> here"
        );
        assert_eq!(
            redact(
                format!("invalid env {JIT_CONFIG_ENV}=c2Vj..., more"),
                "c2VjcmV0"
            ),
            format!("invalid env {JIT_CONFIG_ENV}=<redacted>")
        );
        assert_eq!(redact("plain".to_owned(), ""), "plain");
    }

    #[test]
    fn only_a_not_found_answer_counts_as_already_gone() {
        let answer = |status_code, message: &str| BollardError::DockerResponseServerError {
            status_code,
            message: message.to_owned(),
        };
        assert!(is_no_such_container(&answer(404, "page not found")));
        assert!(is_no_such_container(&answer(
            500,
            "Error: No such container: billet-a"
        )));
        assert!(!is_no_such_container(&answer(
            409,
            "removal of container billet-a is already in progress"
        )));
        assert!(!is_no_such_container(&BollardError::RequestTimeoutError));
    }

    #[test]
    fn registry_mirrors_reach_a_container_as_a_read_only_daemon_json_and_an_env_and_none_as_neither()
     {
        let plain = offline();
        let (_, body, _) = plain.container_for(&spec("lease-1", "c2VjcmV0")).unwrap();
        let env = body.env.unwrap();
        assert!(
            !env.iter()
                .any(|e| e.starts_with(super::super::mirrors::MIRRORS_ENV)),
            "{env:?}"
        );
        let mounts = body.host_config.unwrap().mounts.unwrap();
        assert!(
            mounts
                .iter()
                .all(|m| m.target.as_deref() == Some(GUEST_DIR)),
            "{mounts:?}"
        );

        let dir = std::env::temp_dir().join(unique("billet-mirrors-provider"));
        std::fs::create_dir_all(&dir).unwrap();
        let urls = vec![
            "https://m1.example".to_owned(),
            "http://m2.example:5000".to_owned(),
        ];
        let mirrors = super::super::mirrors::GuestMirrors::prepare(&dir, urls).unwrap();
        let daemon_json = mirrors.daemon_json().unwrap().to_owned();
        let provider = offline().with_registry_mirrors(mirrors);
        let mut with_own = spec("lease-1", "c2VjcmV0");
        with_own.env.push((
            super::super::mirrors::MIRRORS_ENV.to_owned(),
            "https://the-tier.example".to_owned(),
        ));
        let (_, body, _) = provider.container_for(&with_own).unwrap();
        let env = body.env.unwrap();
        let given: Vec<&String> = env
            .iter()
            .filter(|e| e.starts_with(super::super::mirrors::MIRRORS_ENV))
            .collect();
        assert_eq!(
            given,
            ["BILLET_REGISTRY_MIRRORS=https://m1.example,http://m2.example:5000"]
        );
        let mounts = body.host_config.unwrap().mounts.unwrap();
        assert_eq!(mounts.len(), 2, "{mounts:?}");
        assert_eq!(mounts[0].target.as_deref(), Some("/etc/docker/daemon.json"));
        assert_eq!(
            mounts[0].source.as_deref(),
            Some(daemon_json.to_str().unwrap())
        );
        assert_eq!(mounts[0].read_only, Some(true));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn the_create_request_carries_no_credential_only_where_to_read_them() {
        let provider = offline();
        let (name, body, secrets) = provider
            .container_for(&spec("lease-1", "c2VjcmV0"))
            .unwrap();
        assert_eq!(name, "billet-lease-1");
        let env = body.env.clone().unwrap();
        assert_eq!(
            env,
            [
                "RUNNER_TIER=small",
                &format!("{SECRETS_ENV}={GUEST_DIR}/{SECRETS_FILE}")
            ]
        );
        assert_eq!(
            format!("{secrets:?}"),
            format!("Secrets {{ keys: [{JIT_CONFIG_ENV:?}] }}")
        );
        let mounts = body.host_config.clone().unwrap().mounts.unwrap();
        assert_eq!(mounts.len(), 1, "{mounts:?}");
        assert_eq!(mounts[0].target.as_deref(), Some(GUEST_DIR));
        assert_eq!(mounts[0].read_only, Some(true));
        assert_eq!(body.entrypoint.clone().unwrap(), ["/bin/sleep"]);
        assert_eq!(body.cmd.clone().unwrap(), ["300"]);
        let host = body.host_config.clone().unwrap();
        assert_eq!(host.nano_cpus, Some(1_000_000_000));
        assert_eq!(host.memory, Some(64 << 20));
        assert_eq!(host.shm_size, Some(16 << 20));
        assert_eq!(host.network_mode.as_deref(), Some("none"));
        let labels = body.labels.clone().unwrap();
        assert_eq!(labels[labels::DEPLOYMENT], "dep");
        assert_eq!(labels[labels::NODE], "node-a");
        assert_eq!(labels[labels::LEASE], "lease-1");
        assert_eq!(labels[labels::EPOCH], "7");
        assert_eq!(labels[labels::REQUEST], "1234");
        // Nothing the engine records holds the secret.
        assert!(!serde_json::to_string(&body).unwrap().contains("c2VjcmV0"));

        let mut unlimited = spec("lease-1", "j");
        unlimited.vcpu = 0;
        unlimited.memory = ByteSize(0);
        unlimited.shm = ByteSize(0);
        unlimited.network = None;
        let host = provider
            .container_for(&unlimited)
            .unwrap()
            .1
            .host_config
            .unwrap();
        assert_eq!(
            (
                host.nano_cpus,
                host.memory,
                host.shm_size,
                host.network_mode
            ),
            (None, None, None, None)
        );
    }

    #[tokio::test]
    async fn create_refuses_a_bad_spec_before_reaching_the_engine() {
        let provider = offline();
        let mut cases = Vec::new();
        let mut wrong_name = spec("a", "j");
        wrong_name.name = InstanceName::for_lease(&LeaseId::parse("l", "b").unwrap());
        cases.push(wrong_name);
        let mut no_command = spec("a", "j");
        no_command.command.clear();
        cases.push(no_command);
        cases.push(spec("a", ""));
        let mut jit_in_env = spec("a", "j");
        jit_in_env
            .env
            .push((JIT_CONFIG_ENV.to_owned(), "other".to_owned()));
        cases.push(jit_in_env);
        let mut bad_key = spec("a", "j");
        bad_key.env.push(("A=B".to_owned(), "c".to_owned()));
        cases.push(bad_key);
        let mut huge = spec("a", "j");
        huge.memory = ByteSize(u64::MAX);
        cases.push(huge);
        for case in cases {
            let err = provider.create(case).await.unwrap_err();
            assert!(matches!(err, ProviderError::Refused(_)), "{err}");
        }
        // The engine was never contacted.
        assert!(provider.api_version().is_none());
    }

    /// 7.Q.6: a spec without a registration (an empty or blank JIT config)
    /// is refused before the engine is contacted, and the refusal says so.
    #[tokio::test]
    async fn create_refuses_a_spec_with_no_registration_before_reaching_the_engine() {
        let provider = offline();
        for blank in ["", " ", "\n\t "] {
            let err = provider.create(spec("a", blank)).await.unwrap_err();
            match &err {
                ProviderError::Refused(why) => {
                    assert!(why.contains("JIT config is empty"), "{blank:?}: {why}");
                }
                other => panic!("{blank:?} was not refused: {other}"),
            }
        }
        assert!(
            provider.api_version().is_none(),
            "the engine was contacted for a spec with no registration"
        );
    }

    // ---- without an engine ----------------------------------------------

    #[tokio::test]
    async fn ping_names_a_socket_that_cannot_be_reached() {
        let missing = Path::new("/nonexistent/billet-test.sock");
        let provider = DockerProvider::connect(missing, owner("dep", "node-a")).unwrap();
        let err = provider.ping().await.unwrap_err().to_string();
        assert!(err.contains("/nonexistent/billet-test.sock"), "{err}");
        assert!(err.contains("cannot be reached"), "{err}");

        // A path that exists but where nothing listens.
        let not_a_socket = std::env::temp_dir().join(unique("billet-not-a-socket"));
        std::fs::write(&not_a_socket, b"").unwrap();
        let provider = DockerProvider::connect(&not_a_socket, owner("dep", "node-a")).unwrap();
        let err = provider.ping().await.unwrap_err().to_string();
        let _ = std::fs::remove_file(&not_a_socket);
        assert!(err.contains(&not_a_socket.display().to_string()), "{err}");
        assert!(err.contains("cannot be reached"), "{err}");
    }

    /// The tests that need the Docker engine at [`SOCKET`]: the fast loop
    /// (`scripts/fast`, the `fast` profile in `.config/nextest.toml`) leaves
    /// out every test in a module named `needs_docker`, so a test that
    /// talks to the engine belongs here and nowhere else.
    mod needs_docker {
        use std::process::Command;

        use bollard::query_parameters::CreateImageOptions;
        use futures::TryStreamExt as _;

        use super::*;
        use crate::provider::contract;

        // ---- against the real engine ----------------------------------

        /// Removes the named containers, whatever their labels, when dropped,
        /// even when the test panicked.
        struct Leftovers(Vec<String>);

        impl Drop for Leftovers {
            fn drop(&mut self) {
                let names = std::mem::take(&mut self.0);
                // Drop cannot await, and a runtime cannot start inside the
                // test's own, so remove from a thread with a runtime of its own.
                let cleanup = std::thread::spawn(move || {
                    let runtime = tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                        .expect("a runtime for cleanup");
                    runtime.block_on(async {
                        let provider =
                            DockerProvider::connect(Path::new(SOCKET), owner("cleanup", "cleanup"))
                                .unwrap();
                        let Ok(docker) = provider.client("clean up").await else {
                            return;
                        };
                        for name in names {
                            let options = RemoveContainerOptions {
                                force: true,
                                v: true,
                                ..Default::default()
                            };
                            if let Err(err) = docker.remove_container(&name, Some(options)).await
                                && !is_no_such_container(&err)
                            {
                                eprintln!("could not remove test container {name}: {err}");
                            }
                        }
                    });
                });
                let _ = cleanup.join();
            }
        }

        /// A provider on the real engine, with the test image present.
        ///
        /// Panics (failing the test) when the engine cannot be reached.
        async fn provider(owner: Owner) -> DockerProvider {
            let provider = DockerProvider::connect(Path::new(SOCKET), owner).unwrap();
            if let Err(err) = provider.ping().await {
                panic!(
                    "these tests need the Docker engine at {SOCKET}, and it cannot be used: {err}"
                );
            }
            ensure_test_image(provider.client("test").await.unwrap()).await;
            provider
        }

        static TEST_IMAGE_READY: tokio::sync::OnceCell<()> = tokio::sync::OnceCell::const_new();

        /// Imports `billet-test-shell:job` (the host's `sleep` and `sh`, `sleep`
        /// again as the runner's job process, and the shared libraries they
        /// need, nothing else) unless the engine has it:
        /// no registry can be reached from here.
        async fn ensure_test_image(docker: &Docker) {
            TEST_IMAGE_READY
                .get_or_init(|| async {
                    if docker.inspect_image(TEST_IMAGE).await.is_ok() {
                        return;
                    }
                    let tar = tokio::task::spawn_blocking(test_rootfs_tar).await.unwrap();
                    let options = CreateImageOptions {
                        from_src: Some("-".to_owned()),
                        repo: Some(TEST_IMAGE_REPO.to_owned()),
                        tag: Some(TEST_IMAGE_TAG.to_owned()),
                        ..Default::default()
                    };
                    docker
                        .create_image(Some(options), Some(bollard::body_full(tar.into())), None)
                        .try_collect::<Vec<_>>()
                        .await
                        .unwrap_or_else(|err| panic!("importing {TEST_IMAGE} failed: {err}"));
                    docker
                        .inspect_image(TEST_IMAGE)
                        .await
                        .unwrap_or_else(|err| {
                            panic!("{TEST_IMAGE} is missing after import: {err}")
                        });
                })
                .await;
        }

        /// A tar of a root file system holding `/bin/sleep`, `/bin/sh` and the
        /// libraries `ldd` says they load, at their host paths.
        fn test_rootfs_tar() -> Vec<u8> {
            let root = std::env::temp_dir().join(unique("billet-test-rootfs"));
            let copy = |from: &Path, to: &Path| {
                let target = root.join(to.strip_prefix("/").unwrap());
                std::fs::create_dir_all(target.parent().unwrap()).unwrap();
                std::fs::copy(from, &target).unwrap_or_else(|err| {
                    panic!("copying {} into the test image: {err}", from.display())
                });
            };
            for tool in ["sleep", "sh"] {
                let found = [format!("/bin/{tool}"), format!("/usr/bin/{tool}")]
                    .into_iter()
                    .map(PathBuf::from)
                    .find(|path| path.exists())
                    .unwrap_or_else(|| {
                        panic!("building the test image needs {tool} at /bin or /usr/bin")
                    });
                copy(&found, &Path::new("/bin").join(tool));
                if tool == "sleep" {
                    copy(
                        &found,
                        &Path::new("/bin").join(crate::provider::JOB_PROCESS),
                    );
                }
                let ldd = Command::new("ldd")
                    .arg(&found)
                    .output()
                    .expect("building the test image needs ldd to find the tools' libraries");
                // A static binary makes ldd fail with "not a dynamic executable";
                // then there is nothing to copy.
                for line in String::from_utf8_lossy(&ldd.stdout).lines() {
                    if let Some(library) =
                        line.split_whitespace().find(|word| word.starts_with('/'))
                    {
                        copy(Path::new(library), Path::new(library));
                    }
                }
            }
            let tar = Command::new("tar")
                .arg("-C")
                .arg(&root)
                .args(["-cf", "-", "."])
                .output()
                .expect("building the test image needs tar");
            let _ = std::fs::remove_dir_all(&root);
            assert!(
                tar.status.success(),
                "tar failed: {}",
                String::from_utf8_lossy(&tar.stderr)
            );
            tar.stdout
        }

        async fn inspect(
            provider: &DockerProvider,
            name: &str,
        ) -> bollard::models::ContainerInspectResponse {
            provider
                .client("inspect")
                .await
                .unwrap()
                .inspect_container(name, None)
                .await
                .unwrap_or_else(|err| panic!("inspect {name}: {err}"))
        }

        /// A Unix socket in front of the engine's that counts the connections
        /// made to it and forwards each to the engine.
        async fn counting_proxy() -> (PathBuf, Arc<std::sync::atomic::AtomicUsize>) {
            let dir = std::env::temp_dir().join(unique("billet-engine-count"));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("docker.sock");
            let listener = tokio::net::UnixListener::bind(&path).unwrap();
            let accepted = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let counted = Arc::clone(&accepted);
            tokio::spawn(async move {
                while let Ok((mut inbound, _)) = listener.accept().await {
                    counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    tokio::spawn(async move {
                        let mut engine = tokio::net::UnixStream::connect(SOCKET)
                            .await
                            .unwrap_or_else(|e| {
                                panic!("these tests need the Docker engine at {SOCKET}: {e}")
                            });
                        let _ = tokio::io::copy_bidirectional(&mut inbound, &mut engine).await;
                    });
                }
            });
            (path, accepted)
        }

        #[tokio::test]
        async fn consecutive_calls_reuse_one_connection_to_the_engine() {
            let (socket, accepted) = counting_proxy().await;
            let provider =
                DockerProvider::connect(&socket, owner(&unique("dep"), "node-a")).unwrap();
            provider
                .ping()
                .await
                .expect("the engine answers through the proxy");
            provider.list().await.expect("list");
            let after_first = accepted.load(std::sync::atomic::Ordering::SeqCst);
            for _ in 0..10 {
                provider.list().await.expect("list");
                provider.ping().await.expect("ping");
            }
            let after = accepted.load(std::sync::atomic::Ordering::SeqCst);
            assert_eq!(
                after,
                after_first,
                "20 more calls opened {} more connections to the engine",
                after - after_first
            );
        }

        #[tokio::test]
        async fn the_engine_here_is_reached_at_a_version_it_speaks() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let version = provider.api_version().expect("negotiated by ping");
            assert!(version >= MIN_API_VERSION, "{version}");
            assert!(version <= *API_DEFAULT_VERSION, "{version}");
        }

        #[tokio::test]
        async fn a_created_container_is_labelled_and_the_engine_records_no_jit_config() {
            let deployment = unique("dep");
            let provider = provider(owner(&deployment, "node-a")).await;
            let lease = unique("t");
            let jit = unique("jit-secret");
            let spec = spec(&lease, &jit);
            let name = spec.name.clone();
            let _leftovers = Leftovers(vec![name.to_string()]);

            let created = provider.create(spec).await.unwrap();
            assert_eq!(created.name, name.as_str());
            assert_eq!(created.state, InstanceState::Running);
            assert!(!created.id.is_empty());

            let listed = provider.list().await.unwrap();
            assert_eq!(listed.len(), 1, "{listed:?}");
            let instance = &listed[0];
            assert_eq!(instance.id, created.id);
            assert_eq!(instance.name, name.as_str());
            assert_eq!(instance.state, InstanceState::Running);
            assert_eq!(instance.lease().unwrap().as_str(), lease);
            assert_eq!(
                instance.labels,
                BTreeMap::from([
                    (labels::DEPLOYMENT.to_owned(), deployment.clone()),
                    (labels::NODE.to_owned(), "node-a".to_owned()),
                    (labels::LEASE.to_owned(), lease.clone()),
                    (labels::EPOCH.to_owned(), "7".to_owned()),
                    (labels::REQUEST.to_owned(), "1234".to_owned()),
                ])
            );
            assert_eq!(instance.labels, created.labels);

            let inspected = inspect(&provider, name.as_str()).await;
            let recorded = serde_json::to_string(&inspected).unwrap();
            assert!(!recorded.contains(&jit), "{recorded}");
            let config = inspected.config.unwrap();
            let env = config.env.unwrap();
            assert!(
                !env.iter().any(|e| e.starts_with(JIT_CONFIG_ENV)),
                "{env:?}"
            );
            assert!(env.contains(&"RUNNER_TIER=small".to_owned()), "{env:?}");
            assert_eq!(config.entrypoint.unwrap(), ["/bin/sleep"]);
            assert_eq!(config.cmd.unwrap(), ["300"]);
            let host = inspected.host_config.unwrap();
            assert_eq!(host.nano_cpus, Some(1_000_000_000));
            assert_eq!(host.memory, Some(64 << 20));
            assert_eq!(host.shm_size, Some(16 << 20));
            assert_eq!(host.network_mode.as_deref(), Some("none"));
        }

        /// The guest reads its JIT config once from the file its
        /// environment names; a second look finds no file.
        #[tokio::test]
        async fn a_guest_reads_its_jit_config_once_and_then_finds_no_file() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let mut spec = spec(&unique("t"), &unique("jit-secret"));
            spec.command = vec![
                "/bin/sh".into(),
                "-c".into(),
                format!(
                    "read -r first < \"${SECRETS_ENV}\"; sleep 1; \
                     [ -e \"${SECRETS_ENV}\" ] && exit 9; \
                     case \"$first\" in {JIT_CONFIG_ENV}=jit-secret-*) exit 0;; esac; exit 8"
                ),
            ];
            let name = spec.name.clone();
            let _leftovers = Leftovers(vec![name.to_string()]);
            provider.create(spec).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            let exit = loop {
                let found = provider.find(&name).await.unwrap().expect("present");
                if let InstanceState::Exited(exit) = found.state {
                    break exit;
                }
                assert!(tokio::time::Instant::now() < deadline, "{found:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            };
            assert_eq!(exit.code, 0, "8: not the JIT config; 9: read twice");
            provider.destroy(&name).await.unwrap();
        }

        #[tokio::test]
        async fn find_matches_the_exact_name_and_not_a_prefix_of_another() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let lease = unique("t");
            let longer = format!("{lease}-long");
            let spec = spec(&longer, &unique("jit"));
            let _leftovers = Leftovers(vec![spec.name.to_string()]);
            let created = provider.create(spec.clone()).await.unwrap();

            let found = provider
                .find(&spec.name)
                .await
                .unwrap()
                .expect("found by exact name");
            assert_eq!(found.id, created.id);
            let prefix = InstanceName::for_lease(&LeaseId::parse("l", &lease).unwrap());
            assert_eq!(provider.find(&prefix).await.unwrap(), None);
            // Destroying the prefix must not remove the longer name's container.
            assert_eq!(provider.destroy(&prefix).await.unwrap(), Teardown::Stopped);
            assert!(provider.find(&spec.name).await.unwrap().is_some());
        }

        #[tokio::test]
        async fn destroying_twice_answers_stopped_both_times_and_the_container_is_gone() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let spec = spec(&unique("t"), &unique("jit"));
            let _leftovers = Leftovers(vec![spec.name.to_string()]);
            let created = provider.create(spec.clone()).await.unwrap();

            assert_eq!(
                provider.destroy(&spec.name).await.unwrap(),
                Teardown::Stopped
            );
            assert_eq!(
                provider.destroy(&spec.name).await.unwrap(),
                Teardown::Stopped
            );
            assert_eq!(provider.find(&spec.name).await.unwrap(), None);
            assert!(provider.list().await.unwrap().is_empty());
            let docker = provider.client("test").await.unwrap();
            let err = docker
                .inspect_container(&created.id, None)
                .await
                .unwrap_err();
            assert!(is_no_such_container(&err), "{err}");
        }

        #[tokio::test]
        async fn another_nodes_or_deployments_containers_are_never_seen_or_removed() {
            let deployment = unique("dep");
            let here = provider(owner(&deployment, "node-a")).await;
            let other_node = provider(owner(&deployment, "node-b")).await;
            let other_deployment = provider(owner(&unique("dep"), "node-a")).await;
            let theirs = spec(&unique("t"), &unique("jit"));
            let ours = spec(&unique("t"), &unique("jit"));
            let _leftovers = Leftovers(vec![theirs.name.to_string(), ours.name.to_string()]);
            other_node.create(theirs.clone()).await.unwrap();
            here.create(ours.clone()).await.unwrap();

            let names: Vec<_> = here
                .list()
                .await
                .unwrap()
                .into_iter()
                .map(|i| i.name)
                .collect();
            assert_eq!(names, [ours.name.to_string()]);
            assert_eq!(here.find(&theirs.name).await.unwrap(), None);
            assert!(other_deployment.list().await.unwrap().is_empty());
            assert_eq!(other_deployment.find(&ours.name).await.unwrap(), None);

            // Not ours reads as gone, and is left alone.
            assert_eq!(here.destroy(&theirs.name).await.unwrap(), Teardown::Stopped);
            assert!(other_node.find(&theirs.name).await.unwrap().is_some());
        }

        #[tokio::test]
        async fn a_container_without_billet_labels_is_never_listed_found_or_removed() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let lease = LeaseId::parse("l", &unique("t")).unwrap();
            let name = InstanceName::for_lease(&lease);
            let _leftovers = Leftovers(vec![name.to_string()]);
            let docker = provider.client("test").await.unwrap();
            docker
                .create_container(
                    Some(CreateContainerOptions {
                        name: Some(name.to_string()),
                        ..Default::default()
                    }),
                    ContainerCreateBody {
                        image: Some(TEST_IMAGE.to_owned()),
                        cmd: Some(vec!["/bin/sleep".to_owned(), "300".to_owned()]),
                        ..Default::default()
                    },
                )
                .await
                .unwrap();

            assert!(provider.list().await.unwrap().is_empty());
            assert_eq!(provider.find(&name).await.unwrap(), None);
            assert_eq!(provider.destroy(&name).await.unwrap(), Teardown::Stopped);
            docker
                .inspect_container(name.as_str(), None)
                .await
                .expect("the unlabelled container is still there");
        }

        #[tokio::test]
        async fn a_start_failure_is_an_error_and_leaves_a_stopped_container_for_destroy() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let jit = unique("jit-secret");
            let mut spec = spec(&unique("t"), &jit);
            spec.command = vec!["/no/such/binary".to_owned()];
            let _leftovers = Leftovers(vec![spec.name.to_string()]);

            let err = provider.create(spec.clone()).await.unwrap_err().to_string();
            assert!(err.contains(&format!("start {}", spec.name)), "{err}");
            assert!(!err.contains(&jit), "{err}");
            let left = provider
                .find(&spec.name)
                .await
                .unwrap()
                .expect("created before start failed");
            assert_eq!(left.state, InstanceState::Created, "{left:?}");
            assert_eq!(
                provider.destroy(&spec.name).await.unwrap(),
                Teardown::Stopped
            );
            assert_eq!(provider.find(&spec.name).await.unwrap(), None);
        }

        #[tokio::test]
        async fn a_name_in_use_or_a_missing_image_is_an_error_without_the_jit_config() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let jit = unique("jit-secret");
            let spec = spec(&unique("t"), &jit);
            let _leftovers = Leftovers(vec![spec.name.to_string()]);
            provider.create(spec.clone()).await.unwrap();
            let err = provider.create(spec.clone()).await.unwrap_err().to_string();
            assert!(err.contains("409"), "{err}");
            assert!(!err.contains(&jit), "{err}");

            let mut missing = spec_with_image(&unique("t"), &jit, "billet-test-no-such-image:none");
            missing.env.clear();
            let err = provider.create(missing).await.unwrap_err();
            assert!(
                matches!(&err, ProviderError::ImageUnavailable { image } if image == "billet-test-no-such-image:none"),
                "{err}"
            );
            assert!(!err.to_string().contains(&jit), "{err}");
        }

        fn spec_with_image(lease: &str, jit: &str, image: &str) -> InstanceSpec {
            let mut spec = spec(lease, jit);
            spec.image = image.to_owned();
            spec
        }

        #[tokio::test]
        async fn an_exited_container_is_listed_exited_with_its_code_until_destroyed() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let mut spec = spec(&unique("t"), &unique("jit"));
            spec.command = vec!["/bin/sleep".to_owned(), "0".to_owned()];
            let _leftovers = Leftovers(vec![spec.name.to_string()]);
            provider.create(spec.clone()).await.unwrap();

            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                let instance = provider
                    .find(&spec.name)
                    .await
                    .unwrap()
                    .expect("still there");
                if let Some(exit) = instance.state.exit() {
                    assert_eq!(
                        exit,
                        Exit {
                            code: 0,
                            oom_killed: false
                        }
                    );
                    assert!(!instance.may_run());
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "`sleep 0` still reads as running after 30s: {instance:?}"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        #[tokio::test]
        async fn a_bound_directory_is_what_the_container_reads_and_writes_at_its_path() {
            let provider = provider(owner(&unique("dep"), "node-a")).await;
            let host = std::env::temp_dir().join(unique("billet-bind"));
            std::fs::create_dir_all(&host).unwrap();
            std::fs::write(host.join("counter"), "41\n").unwrap();
            let mut spec = spec(&unique("t"), &unique("jit"));
            spec.command = vec![
                "/bin/sh".into(),
                "-c".into(),
                "read n < /cache/npm/counter && echo $((n + 1)) > /cache/npm/counter".into(),
            ];
            spec.binds = vec![crate::provider::Bind {
                host: host.clone(),
                guest: "/cache/npm".into(),
            }];
            let _leftovers = Leftovers(vec![spec.name.to_string()]);
            provider.create(spec.clone()).await.unwrap();
            let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
            loop {
                let instance = provider.find(&spec.name).await.unwrap().expect("present");
                if let Some(exit) = instance.state.exit() {
                    assert_eq!(exit.code, 0, "{instance:?}");
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "still running after 30s"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            assert_eq!(
                std::fs::read_to_string(host.join("counter"))
                    .unwrap()
                    .trim(),
                "42"
            );
        }

        // ---- the provider contract (`contract.rs`) against the engine ------

        /// The Docker side of the provider contract: runners are the test
        /// image's `sh` and `sleep`, the faults are played through the engine.
        struct DockerDriver {
            provider: DockerProvider,
            created: std::sync::Mutex<Vec<String>>,
        }

        impl DockerDriver {
            async fn new() -> Self {
                Self {
                    provider: provider(owner(&unique("dep"), "node-a")).await,
                    created: std::sync::Mutex::new(Vec::new()),
                }
            }

            async fn docker(&self) -> &Docker {
                self.provider.client("test").await.unwrap()
            }
        }

        impl Drop for DockerDriver {
            fn drop(&mut self) {
                drop(Leftovers(std::mem::take(
                    &mut *self.created.lock().unwrap(),
                )));
            }
        }

        #[async_trait]
        impl contract::Driver for DockerDriver {
            fn provider(&self) -> &dyn Provider {
                &self.provider
            }

            fn spec(&self, tag: &str, behaviour: contract::Behaviour) -> InstanceSpec {
                let mut spec = spec(&unique(tag), &unique("jit"));
                spec.memory = ByteSize(128 << 20);
                spec.command = match behaviour {
                    contract::Behaviour::Work => vec!["/bin/sleep".into(), "300".into()],
                    contract::Behaviour::Exit(code) => {
                        vec!["/bin/sh".into(), "-c".into(), format!("exit {code}")]
                    }
                    // The string doubles until the limit's OOM killer ends it.
                    // The host's `sleep`, under the job process's name.
                    contract::Behaviour::Job => {
                        vec![
                            format!("/bin/{}", crate::provider::JOB_PROCESS),
                            "300".into(),
                        ]
                    }
                    contract::Behaviour::Allocate => vec![
                        "/bin/sh".into(),
                        "-c".into(),
                        "a=0123456789abcdef; while :; do a=$a$a; done".into(),
                    ],
                };
                self.created.lock().unwrap().push(spec.name.to_string());
                spec
            }

            async fn enact(&self, _name: &InstanceName, _behaviour: contract::Behaviour) {}

            async fn kill(&self, name: &InstanceName) {
                self.docker()
                    .await
                    .kill_container(
                        name.as_str(),
                        None::<bollard::query_parameters::KillContainerOptions>,
                    )
                    .await
                    .unwrap_or_else(|err| panic!("docker kill {name}: {err}"));
            }

            async fn remove_out_of_band(&self, name: &InstanceName) {
                let options = RemoveContainerOptions {
                    force: true,
                    ..Default::default()
                };
                self.docker()
                    .await
                    .remove_container(name.as_str(), Some(options))
                    .await
                    .unwrap_or_else(|err| panic!("docker rm -f {name}: {err}"));
            }

            async fn unreachable(&self) -> Box<dyn Provider> {
                // A socket file nobody listens on any more: connections are
                // refused.
                let path = std::env::temp_dir().join(unique("billet-dead-engine"));
                drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
                Box::new(
                    DockerProvider::connect(&path, self.provider.owner().clone())
                        .unwrap()
                        .with_timeout(Duration::from_secs(5)),
                )
            }

            async fn hanging(&self, bound: Duration) -> Box<dyn Provider> {
                // Accepts every connection and never reads or answers.
                let path = std::env::temp_dir().join(unique("billet-hung-engine"));
                let listener = tokio::net::UnixListener::bind(&path).unwrap();
                tokio::spawn(async move {
                    let mut held = Vec::new();
                    while let Ok((stream, _)) = listener.accept().await {
                        held.push(stream);
                    }
                });
                Box::new(
                    DockerProvider::connect(&path, self.provider.owner().clone())
                        .unwrap()
                        .with_timeout(bound),
                )
            }

            fn missing_image(&self) -> String {
                "billet-test-no-such-image:none".to_owned()
            }
        }

        #[tokio::test]
        async fn docker_reads_a_runner_busy_exactly_while_its_job_process_runs() {
            contract::a_runner_is_busy_exactly_while_its_job_process_runs(
                &DockerDriver::new().await,
            )
            .await;
        }

        #[tokio::test]
        async fn docker_keeps_an_exited_container_with_its_code_until_destroyed() {
            contract::an_exited_instance_is_present_with_its_code_until_destroyed(
                &DockerDriver::new().await,
            )
            .await;
        }

        #[tokio::test]
        async fn docker_reports_a_container_oom_killed_under_128_mib() {
            contract::an_oom_killed_instance_says_so(&DockerDriver::new().await).await;
        }

        #[tokio::test]
        async fn docker_reports_a_docker_kill_as_137_without_oom() {
            contract::a_killed_instance_is_exited_137_without_the_oom_flag(
                &DockerDriver::new().await,
            )
            .await;
        }

        #[tokio::test]
        async fn docker_forgets_a_container_removed_out_of_band() {
            contract::an_instance_removed_out_of_band_is_absent(&DockerDriver::new().await).await;
        }

        #[tokio::test]
        async fn docker_leaves_a_created_container_unstarted_when_its_start_is_withheld() {
            contract::a_create_whose_start_is_withheld_leaves_the_instance_created_until_destroyed(
                &DockerDriver::new().await,
            )
            .await;
        }

        #[tokio::test]
        async fn docker_refuses_a_missing_image_before_and_at_create() {
            contract::a_missing_image_is_unavailable_and_creates_nothing(
                &DockerDriver::new().await,
            )
            .await;
        }

        #[tokio::test]
        async fn docker_with_nothing_listening_fails_every_call_typed() {
            contract::an_unreachable_engine_fails_every_call_typed(&DockerDriver::new().await)
                .await;
        }

        #[tokio::test]
        async fn docker_with_an_engine_that_never_answers_fails_every_call_typed_within_its_bound()
        {
            contract::a_hanging_engine_fails_every_call_typed_within_its_bound(
                &DockerDriver::new().await,
            )
            .await;
        }
    }
}
