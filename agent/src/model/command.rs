//! The closed set of commands the node's core accepts, checked: what the
//! gRPC face hands the executor through the command slot.

use std::time::Duration;

use super::{
    ByteSize, DestroyOrder, InstanceName, Job, Lease, LeaseId, Registration, RequestId, TierSpec,
};

/// What the node was asked to do, checked.
// One command exists at a time per slot entry; boxing the launch buys nothing.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeCommand {
    /// Start compute for a lease.
    Launch {
        /// The lease, at the epoch the plane holds.
        lease: Lease,
        /// How to run it.
        tier: TierSpec,
        /// The job behind it.
        job: Job,
        /// The runner registration the plane minted before dispatching
        /// (`Launch.registration`); `None` when the node mints.
        registration: Option<Registration>,
        /// The warm runner whose room the lease took over
        /// (`Launch.warm_instance`); `None`: none named.
        warm: Option<InstanceName>,
    },
    /// Tear down whatever was started for a request.
    Destroy {
        /// The request.
        request_id: RequestId,
        /// A completion's result, force and reason.
        order: DestroyOrder,
    },
    /// Take responsibility for a launch whose result the plane missed.
    AssumeCustody {
        /// The lease.
        lease: Lease,
        /// The request it was launched for.
        request_id: RequestId,
    },
    /// Hand the node to its updater.
    StartUpgrade(UpgradeSpec),
    /// Report what the provider runs.
    Instances,
    /// Destroy what no open lease accounts for.
    Sweep,
    /// Advance everything in custody by one step.
    Tend,
    /// Another process took this node's name.
    Superseded,
    /// The warm runners wanted, per tier: the whole wanted state.
    WarmPool(Vec<WarmTarget>),
}

/// The warm runners wanted for one tier (`WarmTier`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmTarget {
    /// The tier, as its launches carry it.
    pub tier: TierSpec,
    /// How many; zero retires them all.
    pub count: u32,
    /// What each charges, as a lease of the tier asks.
    pub vcpu: u32,
    /// What each charges, as a lease of the tier asks.
    pub memory: ByteSize,
    /// Retired once idle this long; `None`: never.
    pub idle_retire: Option<Duration>,
    /// Retired once this old; `None`: never.
    pub max_age: Option<Duration>,
}

impl NodeCommand {
    /// The lease the command names, for the log lines it causes (a
    /// destroy names its request instead).
    pub(crate) fn lease_id(&self) -> Option<&LeaseId> {
        match self {
            NodeCommand::Launch { lease, .. } | NodeCommand::AssumeCustody { lease, .. } => {
                Some(&lease.id)
            }
            NodeCommand::Destroy { .. }
            | NodeCommand::StartUpgrade(_)
            | NodeCommand::Instances
            | NodeCommand::Sweep
            | NodeCommand::Tend
            | NodeCommand::Superseded
            | NodeCommand::WarmPool(_) => None,
        }
    }

    /// A short name for logs.
    pub(crate) fn kind(&self) -> &'static str {
        match self {
            NodeCommand::Launch { .. } => "launch",
            NodeCommand::Destroy { .. } => "destroy",
            NodeCommand::AssumeCustody { .. } => "assume_custody",
            NodeCommand::StartUpgrade(_) => "start_upgrade",
            NodeCommand::Instances => "instances",
            NodeCommand::Sweep => "sweep",
            NodeCommand::Tend => "tend",
            NodeCommand::Superseded => "superseded",
            NodeCommand::WarmPool(_) => "warm_pool",
        }
    }
}

/// The release an upgrade names, and its fences.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpgradeSpec {
    /// An exact release.
    pub version: String,
    /// The pinned manifest digest, if any.
    pub manifest_sha256: Option<String>,
    /// The rollout, if any.
    pub rollout_id: Option<String>,
    /// The rollout generation; zero when absent.
    pub generation: u64,
}
