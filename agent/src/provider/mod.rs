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

pub mod docker;
pub mod fake;

use std::collections::BTreeMap;

use async_trait::async_trait;
use thiserror::Error;

use crate::edge::model::{ByteSize, Epoch, InstanceName, JitConfig, LeaseId, NodeName, RequestId};

/// Label keys every billet instance carries.
pub mod labels {
    /// The deployment the instance belongs to.
    pub const DEPLOYMENT: &str = "sh.billet.deployment";
    /// The node that created it.
    pub const NODE: &str = "sh.billet.node";
    /// Its lease id.
    pub const LEASE: &str = "sh.billet.lease";
    /// The lease epoch at creation.
    pub const EPOCH: &str = "sh.billet.epoch";
    /// The request id it was launched for.
    pub const REQUEST: &str = "sh.billet.request";
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
    /// The single-use registration. Reaches the instance only as
    /// `ACTIONS_RUNNER_INPUT_JITCONFIG`.
    pub jit_config: JitConfig,
}

/// One instance as the provider sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Instance {
    /// The provider's id (a container id for Docker).
    pub id: String,
    /// Its name.
    pub name: String,
    /// Whether it may be running. An unknown state reads as running.
    pub running: bool,
    /// The provider positively saw it reach a state it cannot leave.
    pub terminal: bool,
    /// Its billet labels.
    pub labels: BTreeMap<String, String>,
}

impl Instance {
    /// The lease this instance runs under, if billet named it.
    pub fn lease(&self) -> Option<LeaseId> {
        InstanceName::lease(&self.name)
    }
}

/// What a destroy achieved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Teardown {
    /// Asked for; may still be running.
    Requested,
    /// Confirmed gone (or never existed).
    Stopped,
}

/// A provider call that failed.
#[derive(Debug, Error)]
pub enum ProviderError {
    /// The engine could not be reached or answered with an error.
    #[error("{operation} failed: {message}")]
    Engine {
        /// What was attempted, such as `create billet-abc`.
        operation: String,
        /// The engine's message.
        message: String,
    },
    /// The spec cannot be run by this provider.
    #[error("refused: {0}")]
    Refused(String),
}

/// Something that runs runners: the Docker engine, a local process, a VM.
#[async_trait]
pub trait Provider: Send + Sync + std::fmt::Debug {
    /// The provider kind, as leases name it (`docker`).
    fn kind(&self) -> &'static str;

    /// Whether instances share this host (a vanished instance of such a
    /// provider, once seen, needs no grace period before it counts as gone).
    fn runs_on_host(&self) -> bool;

    /// Creates and starts an instance. Returns once it is created.
    ///
    /// # Errors
    ///
    /// [`ProviderError`]; an error does not prove nothing started.
    async fn create(&self, spec: InstanceSpec) -> Result<Instance, ProviderError>;

    /// Removes an instance by name. Already gone is success
    /// ([`Teardown::Stopped`]).
    ///
    /// # Errors
    ///
    /// [`ProviderError`] when the engine refused or could not be reached.
    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError>;

    /// Every billet instance this node runs for this deployment, stopped ones
    /// included.
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
}

/// Who owns an instance: used to label and to filter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Owner {
    /// The deployment id.
    pub deployment: String,
    /// This node's name.
    pub node: NodeName,
}
