//! Why a lease ended: [`ReasonCode`], one reason from a closed set, and
//! its [`EndClass`], whose outcome the end was (the job's own, the
//! runner's, the infrastructure's, or an operator's). Both ends of the
//! wire and the ledger judge ends by these, so they live here: the node
//! names the code when it releases a lease, the ledger keeps it, and the
//! plane reads the class (to tell an infrastructure death from a failing
//! test).
//!
//! The wire carries the code as [`crate::v1::EndReason`]; its
//! `UNSPECIFIED` is [`ReasonCode::Unrecorded`], which only a lease that
//! ended before codes existed (or an older peer) has. Text recorded
//! before then reads back through [`ReasonCode::parse_legacy`].
//!
//! The table of reasons and classes, for operators: docs/lease-ends.md.

use std::fmt;

use crate::v1::EndReason as Wire;

/// Whose outcome a lease's end was.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum EndClass {
    /// The job's own outcome: it ran and ended (passed or failed), or its
    /// own workload ended its runner (out of memory, a non-zero exit).
    Job,
    /// The runner failed to become or stay a runner: it never came online,
    /// lost its registration, was refused for its version, or outstayed
    /// the post-job grace.
    Runner,
    /// The compute or the host failed under the job: killed or removed by
    /// someone else, the host taken back, the engine or the node lost, the
    /// image missing, the launch failing.
    Infra,
    /// An operator's order or bound: a forced destroy, a force release, a
    /// lifetime bound, a drain.
    Operator,
    /// Not known: a lease that ended before reasons had codes, with text
    /// that names none.
    Unknown,
}

impl EndClass {
    /// Every class, in order.
    pub const ALL: [EndClass; 5] = [
        EndClass::Job,
        EndClass::Runner,
        EndClass::Infra,
        EndClass::Operator,
        EndClass::Unknown,
    ];

    /// The class as a label and as `billet-plane` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            EndClass::Job => "job",
            EndClass::Runner => "runner",
            EndClass::Infra => "infra",
            EndClass::Operator => "operator",
            EndClass::Unknown => "unknown",
        }
    }
}

impl fmt::Display for EndClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a lease ended: exactly one of these per ended lease. A new way to
/// end is a new variant here, and every match on it (its class, its
/// spelling, the wire) must then say what it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ReasonCode {
    /// The job ended and its runner exited on its own.
    Completed,
    /// The runner was OOM-killed under the tier's memory limit.
    Oom,
    /// The runner exited non-zero (detail: the code).
    RunnerExit,
    /// The runner did not come online within the start deadline.
    StartDeadline,
    /// GitHub no longer had the runner's registration.
    RegistrationLost,
    /// The runner exited saying GitHub refused its version.
    RunnerVersionRejected,
    /// The image carries a runner older than the tier's minimum.
    RunnerOutdated,
    /// The runner kept working past the post-job grace.
    PostJobTimeout,
    /// Killed by someone other than the node.
    Killed,
    /// The instance was removed behind the node's back.
    Removed,
    /// The cloud took the host's spot capacity back (detail: the action).
    SpotInterruption,
    /// The tier's image is not on the node (detail: the image).
    ImageUnavailable,
    /// The provider's engine could not be asked.
    ProviderUnavailable,
    /// The launch failed once bound (detail: what failed, when known).
    LaunchFailed,
    /// The node stopped mid-launch.
    LaunchInterrupted,
    /// The launch's reply was lost before anything was minted.
    LaunchLost,
    /// The node's inventory no longer had the compute, or the node was
    /// lost with it.
    NodeLost,
    /// The node refused the tier after consecutive start failures.
    TierUnhealthy,
    /// A forced destroy (detail: the operator's text).
    Forced,
    /// An operator asked the holder to give the lease up.
    ForceRelease,
    /// The lease outlived the operator's bound on a lease's life.
    MaxLeaseLife,
    /// The node held it in custody past the operator's bound.
    MaxCustody,
    /// A draining node retired a runner that had taken no job.
    Drained,
    /// Ended before reasons had codes, with text that names none.
    Unrecorded,
}

impl ReasonCode {
    /// Every reason, in the order of the docs' table.
    pub const ALL: [ReasonCode; 24] = [
        ReasonCode::Completed,
        ReasonCode::Oom,
        ReasonCode::RunnerExit,
        ReasonCode::StartDeadline,
        ReasonCode::RegistrationLost,
        ReasonCode::RunnerVersionRejected,
        ReasonCode::RunnerOutdated,
        ReasonCode::PostJobTimeout,
        ReasonCode::Killed,
        ReasonCode::Removed,
        ReasonCode::SpotInterruption,
        ReasonCode::ImageUnavailable,
        ReasonCode::ProviderUnavailable,
        ReasonCode::LaunchFailed,
        ReasonCode::LaunchInterrupted,
        ReasonCode::LaunchLost,
        ReasonCode::NodeLost,
        ReasonCode::TierUnhealthy,
        ReasonCode::Forced,
        ReasonCode::ForceRelease,
        ReasonCode::MaxLeaseLife,
        ReasonCode::MaxCustody,
        ReasonCode::Drained,
        ReasonCode::Unrecorded,
    ];

    /// Whose outcome an end for this reason is. docs/lease-ends.md gives
    /// the reasoning for the ones that could go either way (`oom` and
    /// `runner_exit` are the job's: its own workload ends its runner, and
    /// running it again would end the same way).
    pub fn class(self) -> EndClass {
        match self {
            ReasonCode::Completed | ReasonCode::Oom | ReasonCode::RunnerExit => EndClass::Job,
            ReasonCode::StartDeadline
            | ReasonCode::RegistrationLost
            | ReasonCode::RunnerVersionRejected
            | ReasonCode::RunnerOutdated
            | ReasonCode::PostJobTimeout => EndClass::Runner,
            ReasonCode::Killed
            | ReasonCode::Removed
            | ReasonCode::SpotInterruption
            | ReasonCode::ImageUnavailable
            | ReasonCode::ProviderUnavailable
            | ReasonCode::LaunchFailed
            | ReasonCode::LaunchInterrupted
            | ReasonCode::LaunchLost
            | ReasonCode::NodeLost
            | ReasonCode::TierUnhealthy => EndClass::Infra,
            ReasonCode::Forced
            | ReasonCode::ForceRelease
            | ReasonCode::MaxLeaseLife
            | ReasonCode::MaxCustody
            | ReasonCode::Drained => EndClass::Operator,
            ReasonCode::Unrecorded => EndClass::Unknown,
        }
    }

    /// The reason as the ledger stores it, as a metric label, and as
    /// `billet-plane` shows it.
    pub fn as_str(self) -> &'static str {
        match self {
            ReasonCode::Completed => "completed",
            ReasonCode::Oom => "oom",
            ReasonCode::RunnerExit => "runner_exit",
            ReasonCode::StartDeadline => "start_deadline",
            ReasonCode::RegistrationLost => "registration_lost",
            ReasonCode::RunnerVersionRejected => "runner_version_rejected",
            ReasonCode::RunnerOutdated => "runner_outdated",
            ReasonCode::PostJobTimeout => "post_job_timeout",
            ReasonCode::Killed => "killed",
            ReasonCode::Removed => "removed",
            ReasonCode::SpotInterruption => "spot_interruption",
            ReasonCode::ImageUnavailable => "image_unavailable",
            ReasonCode::ProviderUnavailable => "provider_unavailable",
            ReasonCode::LaunchFailed => "launch_failed",
            ReasonCode::LaunchInterrupted => "launch_interrupted",
            ReasonCode::LaunchLost => "launch_lost",
            ReasonCode::NodeLost => "node_lost",
            ReasonCode::TierUnhealthy => "tier_unhealthy",
            ReasonCode::Forced => "forced",
            ReasonCode::ForceRelease => "force_release",
            ReasonCode::MaxLeaseLife => "max_lease_life",
            ReasonCode::MaxCustody => "max_custody",
            ReasonCode::Drained => "drained",
            ReasonCode::Unrecorded => "unrecorded",
        }
    }

    /// Reads [`ReasonCode::as_str`] back; `None` for anything else.
    pub fn parse(code: &str) -> Option<Self> {
        ReasonCode::ALL.into_iter().find(|c| c.as_str() == code)
    }

    /// The code and detail a reason recorded as text before codes existed
    /// stands for: the node's spellings (`oom`, `exit 3`, `ec2 spot
    /// interruption: terminate`, `image_unavailable <image>`, ...), the
    /// plane's (`launch: <what the node said>`, `launch_lost`, its
    /// inventory-absence marker), and anything else as
    /// [`ReasonCode::Unrecorded`] with the text as its detail (an
    /// operator's forced text could be any words, so it cannot be told
    /// from them).
    pub fn parse_legacy(text: &str) -> (Self, String) {
        let text = text.trim();
        if let Some(code) = ReasonCode::parse(text)
            && code != ReasonCode::Unrecorded
        {
            return (code, String::new());
        }
        let prefixed: [(&str, ReasonCode); 5] = [
            ("exit ", ReasonCode::RunnerExit),
            ("ec2 spot interruption: ", ReasonCode::SpotInterruption),
            ("image_unavailable ", ReasonCode::ImageUnavailable),
            ("launch: ", ReasonCode::LaunchFailed),
            ("forced: ", ReasonCode::Forced),
        ];
        for (prefix, code) in prefixed {
            if let Some(detail) = text.strip_prefix(prefix) {
                return (code, detail.trim().to_owned());
            }
        }
        match text {
            "billet:provisional:inventory-absence" => (ReasonCode::NodeLost, String::new()),
            _ => (ReasonCode::Unrecorded, text.to_owned()),
        }
    }
}

impl fmt::Display for ReasonCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl From<ReasonCode> for Wire {
    fn from(code: ReasonCode) -> Self {
        match code {
            ReasonCode::Completed => Wire::Completed,
            ReasonCode::Oom => Wire::Oom,
            ReasonCode::RunnerExit => Wire::RunnerExit,
            ReasonCode::StartDeadline => Wire::StartDeadline,
            ReasonCode::RegistrationLost => Wire::RegistrationLost,
            ReasonCode::RunnerVersionRejected => Wire::RunnerVersionRejected,
            ReasonCode::RunnerOutdated => Wire::RunnerOutdated,
            ReasonCode::PostJobTimeout => Wire::PostJobTimeout,
            ReasonCode::Killed => Wire::Killed,
            ReasonCode::Removed => Wire::Removed,
            ReasonCode::SpotInterruption => Wire::SpotInterruption,
            ReasonCode::ImageUnavailable => Wire::ImageUnavailable,
            ReasonCode::ProviderUnavailable => Wire::ProviderUnavailable,
            ReasonCode::LaunchFailed => Wire::LaunchFailed,
            ReasonCode::LaunchInterrupted => Wire::LaunchInterrupted,
            ReasonCode::LaunchLost => Wire::LaunchLost,
            ReasonCode::NodeLost => Wire::NodeLost,
            ReasonCode::TierUnhealthy => Wire::TierUnhealthy,
            ReasonCode::Forced => Wire::Forced,
            ReasonCode::ForceRelease => Wire::ForceRelease,
            ReasonCode::MaxLeaseLife => Wire::MaxLeaseLife,
            ReasonCode::MaxCustody => Wire::MaxCustody,
            ReasonCode::Drained => Wire::Drained,
            ReasonCode::Unrecorded => Wire::Unspecified,
        }
    }
}

impl From<Wire> for ReasonCode {
    fn from(wire: Wire) -> Self {
        match wire {
            Wire::Completed => ReasonCode::Completed,
            Wire::Oom => ReasonCode::Oom,
            Wire::RunnerExit => ReasonCode::RunnerExit,
            Wire::StartDeadline => ReasonCode::StartDeadline,
            Wire::RegistrationLost => ReasonCode::RegistrationLost,
            Wire::RunnerVersionRejected => ReasonCode::RunnerVersionRejected,
            Wire::RunnerOutdated => ReasonCode::RunnerOutdated,
            Wire::PostJobTimeout => ReasonCode::PostJobTimeout,
            Wire::Killed => ReasonCode::Killed,
            Wire::Removed => ReasonCode::Removed,
            Wire::SpotInterruption => ReasonCode::SpotInterruption,
            Wire::ImageUnavailable => ReasonCode::ImageUnavailable,
            Wire::ProviderUnavailable => ReasonCode::ProviderUnavailable,
            Wire::LaunchFailed => ReasonCode::LaunchFailed,
            Wire::LaunchInterrupted => ReasonCode::LaunchInterrupted,
            Wire::LaunchLost => ReasonCode::LaunchLost,
            Wire::NodeLost => ReasonCode::NodeLost,
            Wire::TierUnhealthy => ReasonCode::TierUnhealthy,
            Wire::Forced => ReasonCode::Forced,
            Wire::ForceRelease => ReasonCode::ForceRelease,
            Wire::MaxLeaseLife => ReasonCode::MaxLeaseLife,
            Wire::MaxCustody => ReasonCode::MaxCustody,
            Wire::Drained => ReasonCode::Drained,
            Wire::Unspecified => ReasonCode::Unrecorded,
        }
    }
}

impl ReasonCode {
    /// The code a wire integer carries: an unknown one (a newer peer's) is
    /// [`ReasonCode::Unrecorded`], as an older peer reads it.
    pub fn from_wire(code: i32) -> Self {
        Wire::try_from(code).map_or(ReasonCode::Unrecorded, ReasonCode::from)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_has_one_spelling_one_class_and_survives_the_wire() {
        let mut spelled = std::collections::HashSet::new();
        for code in ReasonCode::ALL {
            assert!(spelled.insert(code.as_str()), "{code:?} spelled twice");
            assert_eq!(ReasonCode::parse(code.as_str()), Some(code));
            assert_eq!(ReasonCode::from(Wire::from(code)), code);
            assert_eq!(ReasonCode::from_wire(Wire::from(code) as i32), code);
            assert!(!code.as_str().is_empty());
        }
        assert_eq!(ReasonCode::from_wire(9999), ReasonCode::Unrecorded);
        // Only a lease that ended before codes existed has no class.
        let unknown: Vec<_> = ReasonCode::ALL
            .into_iter()
            .filter(|c| c.class() == EndClass::Unknown)
            .collect();
        assert_eq!(unknown, [ReasonCode::Unrecorded]);
    }

    #[test]
    fn each_reason_is_of_the_class_the_docs_table_gives() {
        let table = include_str!("../../docs/lease-ends.md");
        for code in ReasonCode::ALL {
            let row = format!("| `{}` | {} |", code.as_str(), code.class().as_str());
            assert!(table.contains(&row), "docs/lease-ends.md lacks {row}");
        }
        use ReasonCode as R;
        let classes = [
            (R::Completed, EndClass::Job),
            (R::Oom, EndClass::Job),
            (R::RunnerExit, EndClass::Job),
            (R::StartDeadline, EndClass::Runner),
            (R::RegistrationLost, EndClass::Runner),
            (R::PostJobTimeout, EndClass::Runner),
            (R::Killed, EndClass::Infra),
            (R::Removed, EndClass::Infra),
            (R::SpotInterruption, EndClass::Infra),
            (R::NodeLost, EndClass::Infra),
            (R::Forced, EndClass::Operator),
            (R::MaxLeaseLife, EndClass::Operator),
        ];
        for (code, class) in classes {
            assert_eq!(code.class(), class, "{code}");
        }
    }

    #[test]
    fn text_recorded_before_codes_reads_as_its_reason_and_anything_else_as_unrecorded() {
        let cases = [
            ("oom", ReasonCode::Oom, ""),
            ("exit 3", ReasonCode::RunnerExit, "3"),
            ("killed", ReasonCode::Killed, ""),
            ("removed", ReasonCode::Removed, ""),
            ("start_deadline", ReasonCode::StartDeadline, ""),
            ("registration_lost", ReasonCode::RegistrationLost, ""),
            ("post_job_timeout", ReasonCode::PostJobTimeout, ""),
            ("max_lease_life", ReasonCode::MaxLeaseLife, ""),
            (
                "ec2 spot interruption: terminate",
                ReasonCode::SpotInterruption,
                "terminate",
            ),
            (
                "image_unavailable runner:1",
                ReasonCode::ImageUnavailable,
                "runner:1",
            ),
            (
                "launch: create refused",
                ReasonCode::LaunchFailed,
                "create refused",
            ),
            ("launch_lost", ReasonCode::LaunchLost, ""),
            (
                "billet:provisional:inventory-absence",
                ReasonCode::NodeLost,
                "",
            ),
            ("forced: cancelled", ReasonCode::Forced, "cancelled"),
            (
                "the operator said so",
                ReasonCode::Unrecorded,
                "the operator said so",
            ),
            ("unrecorded", ReasonCode::Unrecorded, "unrecorded"),
        ];
        for (text, code, detail) in cases {
            assert_eq!(
                ReasonCode::parse_legacy(text),
                (code, detail.to_owned()),
                "{text}"
            );
        }
    }
}
