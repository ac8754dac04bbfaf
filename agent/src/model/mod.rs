//! The node's own types for what travels on the wire: ids as newtypes, the
//! lease phase with its transition table, tier specs and the JIT config as a
//! credential with a redacting `Debug`.
//!
//! Proto messages are converted into these at the edge (`wire.rs`); nothing
//! past the gRPC layer sees a generated type.

mod command;
pub(crate) mod disk;
pub(crate) mod host;
pub(crate) mod scope;

use std::fmt;

use thiserror::Error;

pub use billet_proto::runner_version::RunnerVersion;
pub use command::{NodeCommand, UpgradeSpec, WarmTarget};
pub use host::{HostAccess, HostMount};

/// Longest id accepted for a lease, a command or a runner name, in bytes.
pub(crate) const MAX_ID_LEN: usize = 128;

/// A malformed value, naming the field that carried it.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[error("{field}: {problem}")]
pub struct InvalidField {
    /// Dotted path of the offending field, such as `launch.lease.id`.
    pub field: String,
    /// What is wrong and what would be right.
    pub problem: String,
}

impl InvalidField {
    /// An error for `field`.
    pub(crate) fn new(field: impl Into<String>, problem: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            problem: problem.into(),
        }
    }
}

/// Checks an id: non-empty, at most [`MAX_ID_LEN`] bytes, only ASCII
/// letters, digits, `-`, `_` and `.`.
///
/// # Errors
///
/// [`InvalidField`] naming `field` when the id breaks a rule.
pub(crate) fn check_id(field: &str, value: &str) -> Result<(), InvalidField> {
    if value.is_empty() {
        return Err(InvalidField::new(field, "must not be empty"));
    }
    if value.len() > MAX_ID_LEN {
        return Err(InvalidField::new(
            field,
            format!("is {} bytes; at most {MAX_ID_LEN} are allowed", value.len()),
        ));
    }
    if let Some(c) = value
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.')))
    {
        return Err(InvalidField::new(
            field,
            format!("contains {c:?}; use only ASCII letters, digits, '-', '_' and '.'"),
        ));
    }
    Ok(())
}

macro_rules! string_id {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(String);

        impl $name {
            /// Checks and wraps an id (see [`check_id`]).
            ///
            /// # Errors
            ///
            /// [`InvalidField`] naming `field`.
            pub fn parse(field: &str, value: &str) -> Result<Self, InvalidField> {
                check_id(field, value)?;
                Ok(Self(value.to_owned()))
            }

            /// The id as text.
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({:?})", stringify!($name), self.0)
            }
        }
    };
}

string_id!(
    /// A lease id, unique in the ledger. The instance for it is
    /// `billet-<lease id>`.
    LeaseId
);
string_id!(
    /// A command id: random 128-bit hex chosen by the plane, never reused.
    CommandId
);
string_id!(
    /// A node name, as its certificate carries it.
    NodeName
);

/// The fencing token of a lease. Only a reclaim bumps it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Epoch(pub u64);

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// The scheduler request (GitHub job request id) a launch was made for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub i64);

impl fmt::Display for RequestId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

/// Prefix of every instance billet names.
pub(crate) const INSTANCE_PREFIX: &str = "billet-";

/// The name of a lease's instance and of its runner: `billet-<lease id>`.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct InstanceName(String);

impl InstanceName {
    /// `billet-<lease>`.
    pub fn for_lease(lease: &LeaseId) -> Self {
        Self(format!("{INSTANCE_PREFIX}{lease}"))
    }

    /// The lease a name belongs to, or `None` for a name billet did not
    /// assign (which billet never touches).
    pub fn lease(name: &str) -> Option<LeaseId> {
        let rest = name.strip_prefix('/').unwrap_or(name);
        let lease = rest.strip_prefix(INSTANCE_PREFIX)?;
        LeaseId::parse("instance name", lease).ok()
    }

    /// A fresh warm runner's name, `billet_warm-<16 hex>`: never a lease's
    /// (a lease's name has `-` after `billet`), so nothing that reads a
    /// lease from a name takes a warm runner for one.
    pub fn fresh_warm() -> Self {
        let hex = uuid::Uuid::new_v4().simple().to_string();
        Self(format!("{WARM_PREFIX}{}", &hex[..16]))
    }

    /// `name` when it is a warm runner's ([`InstanceName::fresh_warm`]).
    pub fn warm(name: &str) -> Option<Self> {
        let rest = name.strip_prefix('/').unwrap_or(name);
        let hex = rest.strip_prefix(WARM_PREFIX)?;
        (hex.len() == 16 && hex.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| Self(rest.to_owned()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// What every warm runner's name starts with.
const WARM_PREFIX: &str = "billet_warm-";

impl fmt::Display for InstanceName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A size in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord)]
pub struct ByteSize(pub u64);

/// A single-use runner registration, as encoded for `actions/runner`.
///
/// A credential until the runner consumes it: `Debug` and `Display` print
/// `<redacted>`, and the only way to the text is [`JitConfig::expose`], which
/// only the provider calls, to hand it to the instance.
#[derive(Clone, PartialEq, Eq)]
pub struct JitConfig(String);

impl JitConfig {
    /// Wraps an encoded config.
    pub fn new(encoded: String) -> Self {
        Self(encoded)
    }

    /// The encoded config, for the instance that consumes it and nothing else.
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for JitConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("JitConfig(<redacted>)")
    }
}

/// A lease phase: the one table of phases and edges, shared with the plane
/// (`billet_proto::phase`, from the reference ledger's edges,
/// spec/ledger-and-github.md §1.4). Travels on the wire as its lowercase
/// name.
pub use billet_proto::phase::Phase;

/// The phase spelled `value` in `field`.
///
/// # Errors
///
/// [`InvalidField`] naming `field` for anything but a phase's exact
/// lowercase name.
pub(crate) fn parse_phase(field: &str, value: &str) -> Result<Phase, InvalidField> {
    Phase::parse(value)
        .ok_or_else(|| InvalidField::new(field, format!("{value:?} is not a lease phase")))
}

/// A lease as a launch command carries it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Lease {
    /// Lease id.
    pub id: LeaseId,
    /// Epoch the holder presents on every write.
    pub epoch: Epoch,
    /// Tier label.
    pub tier: String,
    /// Current phase.
    pub phase: Phase,
    /// vCPUs the guest is sized with.
    pub vcpu: u32,
    /// Memory the guest is sized with.
    pub memory: ByteSize,
    /// The request that caused the launch.
    pub request_id: RequestId,
    /// Provider kinds acceptable for this lease.
    pub providers: Vec<String>,
    /// A recorded reason the job will fail, if any.
    pub failure_reason: Option<String>,
}

/// Whether a tier's jobs may run on a provider that shares the host kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trust {
    /// Code from people with write access.
    Trusted,
    /// Code from anyone (pull requests from forks).
    Untrusted,
}

/// How to run one tier's runner.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierSpec {
    /// Tier label.
    pub label: String,
    /// Image reference.
    pub image: String,
    /// Runner argv; never empty.
    pub command: Vec<String>,
    /// Trust class.
    pub trust: Trust,
    /// `/dev/shm` size; zero for the provider default.
    pub shm: ByteSize,
    /// Container network mode, if not the provider default.
    pub network: Option<String>,
    /// Plain environment (`KEY`, `value`); never a credential.
    pub env: Vec<(String, String)>,
    /// Sticky disks, checked ([`disk::check_disks`]).
    pub sticky_disks: Vec<disk::StickyDisk>,
    /// The transparent Actions cache's scope when the tier opts in
    /// (`actions_cache` and a checked `cache_scope`); `None`: the guest
    /// gets no proxy. Only a trusted tier's jobs are intercepted.
    pub actions_cache: Option<scope::CacheScope>,
    /// The Docker image store: the guest's `/var/lib/docker` is the cache
    /// disk `docker-images/<arch>` in slot 0 (the cache's Docker image store).
    pub docker_image_store: bool,
    /// The oldest runner the plane lets run: an image whose label says an
    /// older one is refused before anything is minted. `None`: unchecked.
    pub min_runner_version: Option<RunnerVersion>,
    /// What the guests are given of the host beyond the node's hardened
    /// default; nothing unless the tier is trusted ([`host`]).
    pub host: HostAccess,
    /// The tier's own pids limit per guest; the provider takes the lower
    /// of it and the node's. `None`: the node's.
    pub pids_limit: Option<u32>,
}

/// The GitHub job behind a launch; diagnostic only.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Job {
    /// Job request id.
    pub request_id: RequestId,
    /// Workflow run id.
    pub run_id: i64,
    /// Triggering event.
    pub event: String,
    /// Repository owner.
    pub owner: String,
    /// Repository name.
    pub repository: String,
    /// Workflow reference.
    pub workflow_ref: String,
}

/// What a Destroy asks of the node (`Runner::destroy`; the wire's
/// `Destroy`, proto/billet/node/v1/node.proto).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DestroyOrder {
    /// GitHub's result, when the job's completion caused this destroy.
    pub job_result: Option<String>,
    /// Destroy whatever GitHub or the runner says.
    pub force: bool,
    /// Why, for logs and for the failure reason the node records; `None`
    /// when the plane gave none.
    pub reason: Option<String>,
}

impl DestroyOrder {
    /// A scale-down: no completion, no force. A busy runner is kept.
    pub fn scale_down() -> Self {
        Self::default()
    }

    /// The job's completion, with GitHub's result word.
    pub fn completion(result: &str) -> Self {
        Self {
            job_result: Some(result.to_owned()),
            ..Self::default()
        }
    }

    /// Destroy on the plane's or an operator's authority, for `reason`.
    pub fn forced(reason: &str) -> Self {
        Self {
            force: true,
            reason: (!reason.is_empty()).then(|| reason.to_owned()),
            ..Self::default()
        }
    }
}

/// A minted runner registration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Registration {
    /// The encoded config, a credential.
    pub config: JitConfig,
    /// GitHub's runner id.
    pub runner_id: i64,
    /// The name GitHub registered (use it for removal).
    pub runner_name: String,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_round_trip_through_their_wire_spelling_and_nothing_else_parses() {
        for p in Phase::ALL {
            assert_eq!(parse_phase("phase", p.as_str()), Ok(p));
        }
        assert!(parse_phase("phase", "Launching").is_err());
        assert!(parse_phase("phase", " done").is_err());
    }

    #[test]
    fn a_jit_config_never_shows_in_debug_output() {
        let jit = JitConfig::new("c2VjcmV0".into());
        assert_eq!(format!("{jit:?}"), "JitConfig(<redacted>)");
        assert!(!format!("{:?}", Some(jit)).contains("c2VjcmV0"));
    }

    #[test]
    fn only_names_billet_assigned_map_back_to_a_lease() {
        let lease = LeaseId::parse("l", "abc-1").unwrap();
        let name = InstanceName::for_lease(&lease);
        assert_eq!(name.as_str(), "billet-abc-1");
        assert_eq!(InstanceName::lease("billet-abc-1"), Some(lease.clone()));
        assert_eq!(InstanceName::lease("/billet-abc-1"), Some(lease));
        assert_eq!(InstanceName::lease("billet-"), None);
        assert_eq!(InstanceName::lease("postgres"), None);
    }

    #[test]
    fn ids_name_the_field_that_is_wrong() {
        let err = LeaseId::parse("launch.lease.id", "a b").unwrap_err();
        assert_eq!(err.field, "launch.lease.id");
        assert!(LeaseId::parse("x", "").is_err());
        assert!(LeaseId::parse("x", &"a".repeat(MAX_ID_LEN + 1)).is_err());
    }
}
