//! Providers: what actually runs a runner. One trait, [`Provider`], with the
//! Docker engine (through bollard) as the first real implementation and a
//! recording fake beside it for tests.
//!
//! The contract follows the reference's provider package
//! (spec/node.md §5.1): `create` returns when compute is created, not when
//! the runner is ready, and an error from it does not prove nothing started;
//! `destroy` is idempotent (already gone is success); `list` is a complete
//! inventory of this node's billet instances or an error, never a partial
//! list; `find` says explicitly whether the instance exists.
//!
//! Presence is not life: an instance reports its [`InstanceState`] as the
//! engine sees it. A Docker container whose runner died is still listed,
//! [`InstanceState::Exited`] with its exit code and OOM flag, until it is
//! destroyed; only [`InstanceState::Running`] and [`InstanceState::Unknown`]
//! may be doing work. Every call is bounded by a timeout and fails typed
//! ([`ProviderError::Unreachable`], [`ProviderError::Timeout`]), never hangs.

#[cfg(test)]
mod contract;
pub(crate) mod docker;
#[cfg(any(test, feature = "testing"))]
pub mod fake;
pub(crate) mod handoff;
pub(crate) mod mirrors;

use std::collections::BTreeMap;
use std::time::Duration;

use async_trait::async_trait;
use thiserror::Error;

use crate::model::{ByteSize, Epoch, InstanceName, JitConfig, LeaseId, NodeName, RequestId};

/// Label keys every billet instance carries.
pub(crate) mod labels {
    /// The deployment the instance belongs to.
    pub(crate) const DEPLOYMENT: &str = "sh.billet.deployment";
    /// The node that created it.
    pub(crate) const NODE: &str = "sh.billet.node";
    /// Its lease id.
    pub(crate) const LEASE: &str = "sh.billet.lease";
    /// The lease epoch at creation.
    pub(crate) const EPOCH: &str = "sh.billet.epoch";
    /// The request id it was launched for.
    pub(crate) const REQUEST: &str = "sh.billet.request";
    /// The tier a warm runner was started for (it keeps the label once a
    /// lease takes it).
    pub(crate) const WARM: &str = "sh.billet.warm";
}

/// A warm runner: an instance started from a tier's image ahead of any
/// job, holding no registration and no credential, its runner waiting on
/// its handoff until a lease takes it ([`Provider::claim_warm`]).
#[derive(Clone, Debug)]
pub struct WarmSpec {
    /// `billet_warm-<hex>` ([`InstanceName::fresh_warm`]).
    pub name: InstanceName,
    /// The tier's label.
    pub tier: String,
    /// Image reference.
    pub image: String,
    /// argv; never empty.
    pub command: Vec<String>,
    /// CPU limit in whole vCPUs; zero for none.
    pub vcpu: u32,
    /// Memory limit; zero for none.
    pub memory: ByteSize,
    /// `/dev/shm` size; zero for the default.
    pub shm: ByteSize,
    /// Network mode, if not the default.
    pub network: Option<String>,
    /// Plain environment; never a credential.
    pub env: Vec<(String, String)>,
    /// What the tier's guests are given of the host beyond the hardened
    /// default (only a trusted tier's is ever more than nothing).
    pub host: crate::model::HostAccess,
    /// The tier's pids limit; the provider runs the lower of it and its
    /// own. `None`: its own.
    pub pids_limit: Option<u32>,
}

/// Everything a provider needs to create one instance.
#[derive(Clone, Debug)]
pub struct InstanceSpec {
    /// `billet-<lease id>`.
    pub name: InstanceName,
    /// The lease it runs under.
    pub lease: LeaseId,
    /// The lease epoch at launch.
    pub epoch: Epoch,
    /// The request it was launched for.
    pub request_id: RequestId,
    /// Image reference.
    pub image: String,
    /// argv; never empty.
    pub command: Vec<String>,
    /// CPU limit in whole vCPUs; zero for none.
    pub vcpu: u32,
    /// Memory limit; zero for none.
    pub memory: ByteSize,
    /// `/dev/shm` size; zero for the default.
    pub shm: ByteSize,
    /// Network mode, if not the default.
    pub network: Option<String>,
    /// Plain environment; never a credential.
    pub env: Vec<(String, String)>,
    /// What the tier's guests are given of the host beyond the hardened
    /// default (only a trusted tier's is ever more than nothing).
    pub host: crate::model::HostAccess,
    /// The tier's pids limit; the provider runs the lower of it and its
    /// own. `None`: its own.
    pub pids_limit: Option<u32>,
    /// The single-use registration. Reaches the instance only through its
    /// handoff ([`handoff`]), as `ACTIONS_RUNNER_INPUT_JITCONFIG`.
    pub jit_config: JitConfig,
    /// Host directories bound read-write into the instance (its sticky
    /// disks' mounts and its cache session's directory).
    pub binds: Vec<Bind>,
    /// The instance's cache session credential. Reaches the instance only
    /// through its handoff, as `BILLET_CACHE_TOKEN`
    /// ([`crate::cache::session::TOKEN_ENV`]).
    pub cache_token: Option<crate::cache::session::CacheToken>,
    /// The instance's Actions cache proxy URL, with the token in it.
    /// Reaches the instance only through its handoff, as
    /// `BILLET_ACTIONS_PROXY` ([`crate::cache::actions::PROXY_ENV`]).
    pub actions_proxy: Option<crate::cache::actions::proxy::ProxyUrl>,
}

/// A host directory bound read-write into an instance.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bind {
    /// The directory on the host (a sticky disk's mount).
    pub host: std::path::PathBuf,
    /// Where the instance sees it: an absolute path.
    pub guest: String,
}

/// How an instance's process ended, as the engine recorded it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Exit {
    /// The exit code (Docker `State.ExitCode`): 128 + N for a process killed
    /// by signal N, so 137 for SIGKILL (`docker kill`, the OOM killer).
    pub code: i64,
    /// The kernel's OOM killer ended it under its memory limit (Docker
    /// `State.OOMKilled`).
    pub oom_killed: bool,
}

/// What the engine says an instance is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum InstanceState {
    /// Created and never started (Docker `created`): nothing runs in it, and
    /// billet never starts it later.
    Created,
    /// Running, paused or restarting: the runner inside may be working.
    Running,
    /// Its process ended; the instance stays present, not running, until
    /// destroyed (Docker `exited`).
    Exited(Exit),
    /// Being removed (Docker `removing`) or left half-removed (`dead`):
    /// nothing runs in it.
    Removing,
    /// A state this provider does not know. It reads as may-run: not knowing
    /// is not evidence the runner stopped.
    Unknown,
}

impl InstanceState {
    /// Whether a runner may be working in it: [`InstanceState::Running`] or
    /// [`InstanceState::Unknown`].
    pub(crate) fn may_run(self) -> bool {
        matches!(self, InstanceState::Running | InstanceState::Unknown)
    }

    /// How it ended, when it exited.
    #[cfg(test)]
    pub(crate) fn exit(self) -> Option<Exit> {
        match self {
            InstanceState::Exited(exit) => Some(exit),
            _ => None,
        }
    }
}

/// One instance as the provider sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The provider's id (a container id for Docker).
    pub id: String,
    /// Its name.
    pub name: String,
    /// What the engine says it is doing.
    pub state: InstanceState,
    /// Its billet labels.
    pub labels: BTreeMap<String, String>,
}

impl Instance {
    /// The lease this instance runs under, if billet named it.
    pub fn lease(&self) -> Option<LeaseId> {
        InstanceName::lease(&self.name)
    }

    /// Whether a runner may be working in it ([`InstanceState::may_run`]).
    pub fn may_run(&self) -> bool {
        self.state.may_run()
    }
}

/// Whether the runner in an instance is working on a job, read from the
/// instance's own processes ([`Provider::work`]): the node's evidence,
/// beside GitHub's, before it removes compute a scale-down or a drain asks
/// it to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Work {
    /// The runner's job process ([`JOB_PROCESS`]) runs in it.
    Busy,
    /// It runs no job process, or runs nothing at all.
    Idle,
    /// This provider cannot see the instance's processes: GitHub's word is
    /// the only evidence.
    Unknown,
}

/// The process the Actions runner starts for each job it takes and that
/// ends with the job (`Runner.Worker`, beside the idle `Runner.Listener`).
pub const JOB_PROCESS: &str = "Runner.Worker";

/// Whether a process's command line (`args`, as `ps` prints it) is the
/// runner's job process: its program's file name is [`JOB_PROCESS`].
pub(crate) fn is_job_process(args: &str) -> bool {
    args.split_whitespace()
        .next()
        .and_then(|program| program.rsplit('/').next())
        .is_some_and(|file| file == JOB_PROCESS)
}

/// What a destroy achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Teardown {
    /// Asked for; may still be running.
    Requested,
    /// Confirmed gone (or never existed).
    Stopped,
}

/// A provider call that failed. The variants are what a caller branches on;
/// the messages are for people.
#[derive(Debug, Error)]
pub enum ProviderError {
    /// The engine answered with an error.
    #[error("{operation} failed: {message}")]
    Engine {
        /// What was attempted, such as `create billet-abc`.
        operation: String,
        /// The engine's message.
        message: String,
    },
    /// The engine could not be reached: nothing listens at its address, or
    /// the connection broke. Nothing was done by this call, unless it was a
    /// create or a destroy whose request may have arrived.
    #[error("{operation} failed: {message}")]
    Unreachable {
        /// What was attempted.
        operation: String,
        /// Why, naming the address.
        message: String,
    },
    /// The engine did not answer within the provider's bound. Whether the
    /// call took effect is unknown.
    #[error("{operation} failed: the engine did not answer within {after:?}")]
    Timeout {
        /// What was attempted.
        operation: String,
        /// The bound that passed.
        after: Duration,
    },
    /// The image a spec names is not present where the provider runs
    /// instances (the provider never pulls).
    #[error("image {image} is not present on this host")]
    ImageUnavailable {
        /// The image reference.
        image: String,
    },
    /// The spec cannot be run by this provider.
    #[error("refused: {0}")]
    Refused(String),
    /// The caller withheld the start of an instance it had created
    /// ([`Provider::create_then_start`]'s `start` said `false` or was
    /// dropped): it stays created and never started, for the caller to
    /// remove.
    #[error("{operation}: the start was withheld")]
    StartWithheld {
        /// What was attempted, such as `create billet-abc`.
        operation: String,
    },
}

/// The image label that says which runner version an image carries (the
/// OCI annotation for a packaged software's version; decision 114).
pub const RUNNER_VERSION_LABEL: &str = "org.opencontainers.image.version";

/// What an image is, as a launch checks it ([`Provider::check_image`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ImageFacts {
    /// The provider's id of the image (a content digest for Docker): it
    /// changes whenever the image does, under the same name or not.
    pub id: String,
    /// The runner version its [`RUNNER_VERSION_LABEL`] says, as written;
    /// `None` when it has none.
    pub runner_version: Option<String>,
}

/// Whether a created instance may start: `true` starts it; `false`, or the
/// sender dropped, withholds the start ([`Provider::create_then_start`]).
pub type StartGate = tokio::sync::oneshot::Receiver<bool>;

/// A [`StartGate`] already open: the instance starts as soon as it exists.
pub(crate) fn start_now() -> StartGate {
    let (open, gate) = tokio::sync::oneshot::channel();
    let _ = open.send(true);
    gate
}

/// Waits for `gate`: `Ok` to start, [`ProviderError::StartWithheld`] for
/// `operation` when the start is withheld.
///
/// # Errors
///
/// [`ProviderError::StartWithheld`].
pub(crate) async fn await_start(gate: StartGate, operation: &str) -> Result<(), ProviderError> {
    match gate.await {
        Ok(true) => Ok(()),
        Ok(false) | Err(_) => Err(ProviderError::StartWithheld {
            operation: operation.to_owned(),
        }),
    }
}

/// Something that runs runners: the Docker engine, a local process, a VM.
#[async_trait]
pub trait Provider: Send + Sync + std::fmt::Debug {
    /// The provider kind, as leases name it (`docker`).
    fn kind(&self) -> &'static str;

    /// Whether instances share this host (a vanished instance of such a
    /// provider, once seen, needs no grace period before it counts as gone).
    fn runs_on_host(&self) -> bool;

    /// Checks, before anything is registered for a launch, that an instance
    /// of `image` could be created now: the engine answers and the image is
    /// present (providers never pull). Answers what the image is: its id,
    /// and the runner version its label says ([`RUNNER_VERSION_LABEL`]).
    ///
    /// # Errors
    ///
    /// [`ProviderError::ImageUnavailable`] when the image is missing; any
    /// other variant when the engine cannot be asked.
    async fn check_image(&self, image: &str) -> Result<ImageFacts, ProviderError>;

    /// The last lines an instance's runner wrote (its standard output and
    /// error), for telling why it exited. A provider that cannot read them
    /// answers an empty text.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the provider cannot be asked.
    async fn output_tail(&self, name: &InstanceName) -> Result<String, ProviderError>;

    /// The size an instance asked for as `vcpu` and `memory` really runs
    /// at on this provider (0 is no limit, as in [`InstanceSpec`]): what a
    /// launch charges once its lease is resized (`LeaseStore::resize`, the
    /// reference's `Resize`). Required, with no default, so that a wrapper
    /// cannot forget to ask the provider it wraps.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the provider cannot be asked.
    async fn shape(&self, vcpu: u32, memory: ByteSize) -> Result<(u32, ByteSize), ProviderError>;

    /// Creates and starts an instance. Returns once it is created.
    ///
    /// [`Provider::create_then_start`] without being told when the instance
    /// exists, starting it at once.
    ///
    /// # Errors
    ///
    /// [`ProviderError`]; an error does not prove nothing started.
    async fn create(&self, spec: InstanceSpec) -> Result<Instance, ProviderError> {
        let (created, _) = tokio::sync::oneshot::channel();
        self.create_then_start(spec, created, start_now()).await
    }

    /// Creates an instance, sends on `created` as soon as it exists, then
    /// waits for `start` and starts it only when that says `true`. The
    /// caller learns when to record the instance while it starts (the
    /// launch journals the created instance beside Docker's start) and may
    /// create before it knows the instance may run (a launch carrying its
    /// registration creates beside its bind and opens the gate once the
    /// bind holds). A provider that cannot tell create from start sends
    /// once both are done. `created` is dropped unsent when nothing was
    /// created. Required, with no default, so that a wrapper cannot forget
    /// to pass `created` and `start` to the provider it wraps.
    ///
    /// # Errors
    ///
    /// [`ProviderError::StartWithheld`] when `start` said `false` or was
    /// dropped: the instance stays, created and never started, for the
    /// caller to remove. Otherwise as [`Provider::create`]: an error does
    /// not prove nothing started, whether or not `created` was sent.
    async fn create_then_start(
        &self,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: StartGate,
    ) -> Result<Instance, ProviderError>;

    /// Removes an instance by name. Already gone is success
    /// ([`Teardown::Stopped`]).
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the engine refused or could not be reached.
    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError>;

    /// Stops an instance's process as an operator's `docker stop -t` does:
    /// SIGTERM, then SIGKILL once `timeout` has passed. Returns once it no
    /// longer runs; it stays present (exited) until destroyed. One already
    /// stopped, or gone, is success.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the engine refused or could not be reached.
    async fn stop(&self, name: &InstanceName, timeout: Duration) -> Result<(), ProviderError>;

    /// Every billet instance this node runs for this deployment, stopped ones
    /// included, each with its [`InstanceState`]. One inventory read; an
    /// instance that disappears while it is read is absent.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the inventory cannot be read in full.
    async fn list(&self) -> Result<Vec<Instance>, ProviderError>;

    /// The instance with exactly this name, or `None`.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the engine cannot be read.
    async fn find(&self, name: &InstanceName) -> Result<Option<Instance>, ProviderError>;

    /// Whether the runner in the instance named `name` is working on a job,
    /// from its processes. An instance that is gone or not running is
    /// [`Work::Idle`]. Required, with no default, so that a wrapper cannot
    /// forget to ask the provider it wraps.
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the engine cannot be read.
    async fn work(&self, name: &InstanceName) -> Result<Work, ProviderError>;

    /// Creates and starts a warm runner: what [`Provider::create`] makes of
    /// a tier, under the warm runner's name, with no lease, no registration
    /// and no credential; its runner waits on its handoff. Returns once it
    /// runs. Required, with no default, so that a wrapper cannot forget to
    /// pass it on.
    ///
    /// # Errors
    ///
    /// As [`Provider::create`]; [`ProviderError::Refused`] from a provider
    /// that keeps no warm runners.
    async fn create_warm(&self, spec: WarmSpec) -> Result<Instance, ProviderError>;

    /// Every warm runner not yet taken by a lease, in any state. Not in
    /// [`Provider::list`], which holds only leases' instances.
    ///
    /// # Errors
    ///
    /// As [`Provider::list`].
    async fn list_warm(&self) -> Result<Vec<Instance>, ProviderError>;

    /// Makes the running warm runner `warm` the instance `spec` describes
    /// (of the same tier; its binds and size are the warm runner's): it
    /// takes `spec`'s name, sends on `created`, waits for `start`, then its
    /// runner is handed `spec`'s credentials. Nothing is created, and
    /// nothing is on the job's path but a rename and a write.
    ///
    /// # Errors
    ///
    /// As [`Provider::create_then_start`]: [`ProviderError::StartWithheld`]
    /// leaves the instance, under `spec`'s name, for the caller to remove;
    /// an error once `created` was sent does not prove the runner was not
    /// handed its credentials.
    async fn claim_warm(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: StartGate,
    ) -> Result<Instance, ProviderError>;
}

/// Who owns an instance: used to label and to filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Owner {
    /// The deployment id.
    pub deployment: String,
    /// This node's name.
    pub node: NodeName,
}
