//! How compute ends: the typed reason a lease is released `failed` with,
//! and the one policy every path that ends compute follows to remove the
//! runner registration it leaves behind.
//!
//! [`EndReason`] is what the ledger records as the lease's failure reason
//! (through `MarkFailure`, before the release), spelled `oom`,
//! `exit <code>`, `killed`, `removed`, `start_deadline`, `post_job_timeout`,
//! `registration_lost`, `max_lease_life`, and
//! `ec2 spot interruption: <action>` (the reference's spelling, spec/node.md
//! §2.11); a [`FailureReason`] adds the reasons that are not compute's
//! (`image_unavailable <image>`, `provider_unavailable`, `launch_failed`,
//! `launch_interrupted`, `max_custody`, `force_release`, an operator's).
//!
//! [`Ending`] is how the node releases a lease: `done`, or `failed` with a
//! [`FailureReason`] (an [`EndReason`], an operator's forced reason, a
//! refused or interrupted launch, ...). The ledger port takes an `Ending`,
//! so no path can release a lease `failed` without a reason. Each ending
//! names its [`ReasonCode`] and detail ([`Ending::code`]), which travel on
//! the wire beside the words and give its [`EndClass`]; the mapping is an
//! exhaustive match, so a new way to end names its code or does not
//! compile (docs/lease-ends.md has the table).
//!
//! [`Removals`] holds the registrations still to be removed once the compute
//! is gone: a removal GitHub answers with 404 is done; one it refuses as
//! busy (JobStillRunning: the job of a runner that died is still assigned to
//! it until GitHub gives up on it) or that fails for an outage (5xx, a
//! timeout, no plane) is tried again with exponential backoff
//! ([`REMOVAL_BACKOFF_MIN`] doubling to [`REMOVAL_BACKOFF_MAX`], jittered),
//! never once only and never on every tick. A registration whose runner
//! process is gone cannot take a job, so its lease is released without
//! waiting for the removal.

use std::collections::HashMap;
use std::fmt;
use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBuilder};
use tokio::time::Instant;

pub use billet_proto::ending::{EndClass, ReasonCode};

use crate::model::{Epoch, LeaseId};
use crate::provider::{Exit, Instance, InstanceState};

/// Why compute ended before its job did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EndReason {
    /// The OOM killer ended the runner under its memory limit.
    Oom,
    /// The runner exited with this code: not 137, and 0 only for a runner
    /// whose job GitHub still ran once it had exited (its registration's
    /// removal refused as busy), which did not finish that job.
    Exit(i64),
    /// The runner was killed with SIGKILL (exit 137) without the OOM flag:
    /// `docker kill`, an operator.
    Killed,
    /// The instance was removed behind the node's back.
    Removed,
    /// The runner did not come online within the start deadline.
    StartDeadline,
    /// The runner kept working past the post-job grace after its job was
    /// reported complete.
    PostJobTimeout,
    /// GitHub no longer has the runner's registration.
    RegistrationLost,
    /// The lease outlived the operator's bound on a lease's life.
    MaxLeaseLife,
    /// The node was draining and the runner had taken no job: it was
    /// retired (registration first, then compute), since it could only
    /// hold the drain to its timeout.
    Drained,
    /// The cloud is taking the host's spot capacity back
    /// ([`crate::node::interruption`]).
    SpotInterruption(SpotAction),
    /// The runner exited before coming online, saying GitHub refused its
    /// version ([`crate::node::freshness`]).
    RunnerVersionRejected,
}

/// What EC2 will do to a spot instance it takes back: the `action` of the
/// instance-metadata notice `/latest/meta-data/spot/instance-action`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SpotAction {
    /// The instance is terminated.
    Terminate,
    /// The instance is stopped.
    Stop,
    /// The instance is hibernated.
    Hibernate,
}

impl SpotAction {
    /// Reads the notice's `action` (`terminate`, `stop`, `hibernate`);
    /// `None` for anything else.
    pub(crate) fn parse(action: &str) -> Option<Self> {
        match action {
            "terminate" => Some(SpotAction::Terminate),
            "stop" => Some(SpotAction::Stop),
            "hibernate" => Some(SpotAction::Hibernate),
            _ => None,
        }
    }

    /// The action as EC2 spells it.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            SpotAction::Terminate => "terminate",
            SpotAction::Stop => "stop",
            SpotAction::Hibernate => "hibernate",
        }
    }
}

impl EndReason {
    /// The reason an exit is, or `None` for exit 0: an ephemeral runner
    /// exits 0 after its job, which is the job's own end, even when the
    /// container is marked OOM-killed: the engine marks it for any process
    /// of the container the OOM killer ended, and a job step ended so is
    /// the job's failure to report, not the runner's (the runner that
    /// exited 0 went on). Any other exit of an OOM-marked container is
    /// [`EndReason::Oom`].
    pub(crate) fn from_exit(exit: Exit) -> Option<Self> {
        match exit {
            Exit { code: 0, .. } => None,
            Exit {
                oom_killed: true, ..
            } => Some(EndReason::Oom),
            Exit { code: 137, .. } => Some(EndReason::Killed),
            Exit { code, .. } => Some(EndReason::Exit(code)),
        }
    }

    /// The reason an instance in `state` has ended compute, for an instance
    /// that no longer runs: its exit, or [`EndReason::Killed`] for one being
    /// removed. `None` for exit 0, and for a state that may run.
    pub(crate) fn from_state(state: InstanceState) -> Option<Self> {
        match state {
            InstanceState::Exited(exit) => Self::from_exit(exit),
            InstanceState::Removing => Some(EndReason::Killed),
            InstanceState::Created | InstanceState::Running | InstanceState::Unknown => None,
        }
    }
}

impl EndReason {
    /// Why compute `found` by the provider (`None`: not there) ended before
    /// its job did: [`EndReason::from_state`] for an instance that no longer
    /// runs, [`EndReason::Removed`] for one missing when `absent_is_proof`
    /// (this host's provider saw it exist). `None` while it may run, after
    /// an exit 0, or for an absence that proves nothing.
    pub(crate) fn of_instance(found: Option<&Instance>, absent_is_proof: bool) -> Option<Self> {
        match found {
            None => absent_is_proof.then_some(EndReason::Removed),
            Some(i) if !i.may_run() => Self::from_state(i.state),
            Some(_) => None,
        }
    }
}

impl EndReason {
    /// The reason's code and its detail (an exit code, a spot notice's
    /// action; empty when it has none).
    pub fn code(self) -> (ReasonCode, String) {
        match self {
            EndReason::Oom => (ReasonCode::Oom, String::new()),
            EndReason::Exit(code) => (ReasonCode::RunnerExit, code.to_string()),
            EndReason::Killed => (ReasonCode::Killed, String::new()),
            EndReason::Removed => (ReasonCode::Removed, String::new()),
            EndReason::StartDeadline => (ReasonCode::StartDeadline, String::new()),
            EndReason::PostJobTimeout => (ReasonCode::PostJobTimeout, String::new()),
            EndReason::RegistrationLost => (ReasonCode::RegistrationLost, String::new()),
            EndReason::MaxLeaseLife => (ReasonCode::MaxLeaseLife, String::new()),
            EndReason::Drained => (ReasonCode::Drained, String::new()),
            EndReason::SpotInterruption(action) => {
                (ReasonCode::SpotInterruption, action.as_str().to_owned())
            }
            EndReason::RunnerVersionRejected => (ReasonCode::RunnerVersionRejected, String::new()),
        }
    }
}

impl fmt::Display for EndReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EndReason::Oom => f.write_str("oom"),
            EndReason::Exit(code) => write!(f, "exit {code}"),
            EndReason::Killed => f.write_str("killed"),
            EndReason::Removed => f.write_str("removed"),
            EndReason::StartDeadline => f.write_str("start_deadline"),
            EndReason::PostJobTimeout => f.write_str("post_job_timeout"),
            EndReason::RegistrationLost => f.write_str("registration_lost"),
            EndReason::MaxLeaseLife => f.write_str("max_lease_life"),
            EndReason::Drained => f.write_str("drained"),
            EndReason::RunnerVersionRejected => f.write_str("runner_version_rejected"),
            EndReason::SpotInterruption(action) => {
                write!(f, "ec2 spot interruption: {}", action.as_str())
            }
        }
    }
}

/// Why a lease is released `failed`: what the ledger records as its
/// failure reason. Every way the node fails a lease names one of these, and
/// [`Ending::Failed`] cannot be built without one, so no lease this node
/// ends is `failed` without a reason (and none has an empty one: each
/// variant spells itself, and the texts that come from elsewhere are
/// checked where they are made).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FailureReason {
    /// The compute ended before its job did ([`EndReason`]).
    Compute(EndReason),
    /// An operator or the plane destroyed it by force, with this reason
    /// ([`FailureReason::forced`]).
    Forced(String),
    /// The launch's image is not on this node; nothing was minted or
    /// started.
    ImageUnavailable(String),
    /// The provider could not be asked about the launch's image; nothing
    /// was minted or started.
    ProviderUnavailable,
    /// The launch's image carries a runner GitHub will not run; nothing
    /// was minted or started.
    RunnerOutdated,
    /// The launch failed once its lease was bound (the mint, the mounts or
    /// the create), and what it started is gone.
    LaunchFailed,
    /// The node stopped mid-launch: the next process found the instance
    /// never created, or its runner idle with its launch unconfirmed, and
    /// retired it.
    LaunchInterrupted,
    /// The node held the lease past `--max-custody-secs`.
    MaxCustody,
    /// The plane asked the holder to give the lease up (a force release).
    ForceRelease,
    /// A reason recorded before this process (the journal's, or the
    /// ledger's own for a lease it adopted), as text
    /// ([`FailureReason::recorded`]).
    Recorded(String),
}

impl FailureReason {
    /// A forced destroy's reason: the order's, or `forced` when it gave
    /// none (or only blanks).
    pub(crate) fn forced(reason: Option<&str>) -> Self {
        match reason.map(str::trim).filter(|r| !r.is_empty()) {
            Some(r) => FailureReason::Forced(r.to_owned()),
            None => FailureReason::Forced("forced".to_owned()),
        }
    }

    /// A reason recorded earlier, as text: the reason it spells when it
    /// spells one ([`ReasonCode::parse_legacy`]), so a restarted node
    /// still names its code; other words as they are; and an empty one, a
    /// release whose reason an older build did not journal, said as such.
    pub(crate) fn recorded(text: &str) -> Self {
        let text = text.trim();
        if text.is_empty() {
            return FailureReason::Recorded("unrecorded_before_restart".to_owned());
        }
        let (code, detail) = ReasonCode::parse_legacy(text);
        let compute = |r| Some(FailureReason::Compute(r));
        let typed = match code {
            ReasonCode::Oom => compute(EndReason::Oom),
            ReasonCode::RunnerExit => detail
                .parse()
                .ok()
                .and_then(|code| compute(EndReason::Exit(code))),
            ReasonCode::Killed => compute(EndReason::Killed),
            ReasonCode::Removed => compute(EndReason::Removed),
            ReasonCode::StartDeadline => compute(EndReason::StartDeadline),
            ReasonCode::PostJobTimeout => compute(EndReason::PostJobTimeout),
            ReasonCode::RegistrationLost => compute(EndReason::RegistrationLost),
            ReasonCode::MaxLeaseLife => compute(EndReason::MaxLeaseLife),
            ReasonCode::Drained => compute(EndReason::Drained),
            ReasonCode::RunnerVersionRejected => compute(EndReason::RunnerVersionRejected),
            ReasonCode::SpotInterruption => {
                SpotAction::parse(&detail).and_then(|a| compute(EndReason::SpotInterruption(a)))
            }
            ReasonCode::ImageUnavailable => Some(FailureReason::ImageUnavailable(detail)),
            ReasonCode::ProviderUnavailable => Some(FailureReason::ProviderUnavailable),
            ReasonCode::RunnerOutdated => Some(FailureReason::RunnerOutdated),
            ReasonCode::LaunchFailed if detail.is_empty() => Some(FailureReason::LaunchFailed),
            ReasonCode::LaunchInterrupted => Some(FailureReason::LaunchInterrupted),
            ReasonCode::MaxCustody => Some(FailureReason::MaxCustody),
            ReasonCode::ForceRelease => Some(FailureReason::ForceRelease),
            ReasonCode::Forced if !detail.is_empty() => Some(FailureReason::Forced(detail)),
            // The node never fails a lease for these (the plane's own, or
            // the job's own end): kept as the words they were.
            ReasonCode::Completed
            | ReasonCode::LaunchFailed
            | ReasonCode::Forced
            | ReasonCode::LaunchLost
            | ReasonCode::NodeLost
            | ReasonCode::TierUnhealthy
            | ReasonCode::Unrecorded => None,
        };
        typed.unwrap_or_else(|| FailureReason::Recorded(text.to_owned()))
    }

    /// The reason's code and detail. A forced reason's detail is the
    /// operator's text; a [`FailureReason::Recorded`] one is read from its
    /// words ([`ReasonCode::parse_legacy`]), which is `unrecorded` only
    /// for words that name no reason.
    pub fn code(&self) -> (ReasonCode, String) {
        match self {
            FailureReason::Compute(r) => r.code(),
            FailureReason::Forced(text) => (ReasonCode::Forced, text.clone()),
            FailureReason::ImageUnavailable(image) => (ReasonCode::ImageUnavailable, image.clone()),
            FailureReason::ProviderUnavailable => (ReasonCode::ProviderUnavailable, String::new()),
            FailureReason::RunnerOutdated => (ReasonCode::RunnerOutdated, String::new()),
            FailureReason::LaunchFailed => (ReasonCode::LaunchFailed, String::new()),
            FailureReason::LaunchInterrupted => (ReasonCode::LaunchInterrupted, String::new()),
            FailureReason::MaxCustody => (ReasonCode::MaxCustody, String::new()),
            FailureReason::ForceRelease => (ReasonCode::ForceRelease, String::new()),
            FailureReason::Recorded(text) => ReasonCode::parse_legacy(text),
        }
    }
}

impl fmt::Display for FailureReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FailureReason::Compute(r) => r.fmt(f),
            FailureReason::Forced(r) | FailureReason::Recorded(r) => f.write_str(r),
            FailureReason::ImageUnavailable(image) => write!(f, "image_unavailable {image}"),
            FailureReason::ProviderUnavailable => f.write_str("provider_unavailable"),
            FailureReason::RunnerOutdated => f.write_str("runner_outdated"),
            FailureReason::LaunchFailed => f.write_str("launch_failed"),
            FailureReason::LaunchInterrupted => f.write_str("launch_interrupted"),
            FailureReason::MaxCustody => f.write_str("max_custody"),
            FailureReason::ForceRelease => f.write_str("force_release"),
        }
    }
}

/// How this node ends a lease: `done` (its job ended, as GitHub tells it),
/// or `failed` for a [`FailureReason`]. What [`LeaseStore::release`]
/// takes, so a failed release always carries its reason.
///
/// [`LeaseStore::release`]: super::plane::LeaseStore::release
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Ending {
    /// The runner's job ended, or nothing of the lease was a job's.
    Done,
    /// The lease fails, for this reason.
    Failed(FailureReason),
}

impl Ending {
    /// The terminal phase it releases the lease into.
    pub fn phase(&self) -> crate::model::Phase {
        match self {
            Ending::Done => crate::model::Phase::Done,
            Ending::Failed(_) => crate::model::Phase::Failed,
        }
    }

    /// Its failure reason, when it fails.
    pub fn reason(&self) -> Option<&FailureReason> {
        match self {
            Ending::Done => None,
            Ending::Failed(r) => Some(r),
        }
    }

    /// Whether it fails.
    pub fn is_failed(&self) -> bool {
        matches!(self, Ending::Failed(_))
    }

    /// Fails it for `why`, unless it already fails: the first reason is
    /// kept, as the ledger keeps it.
    pub(crate) fn fail(&mut self, why: FailureReason) {
        if *self == Ending::Done {
            *self = Ending::Failed(why);
        }
    }

    /// Its reason's code and detail: `completed` for `done`.
    pub fn code(&self) -> (ReasonCode, String) {
        match self {
            Ending::Done => (ReasonCode::Completed, String::new()),
            Ending::Failed(r) => r.code(),
        }
    }

    /// As the journal keeps it: `done`, or `failed: <reason>`; a forced
    /// reason as `failed: forced: <text>`, so that its words, which could
    /// be any, read back as forced.
    pub(crate) fn to_journal(&self) -> String {
        match self {
            Ending::Done => "done".to_owned(),
            Ending::Failed(FailureReason::Forced(text)) => format!("failed: forced: {text}"),
            Ending::Failed(r) => format!("failed: {r}"),
        }
    }

    /// Reads [`Ending::to_journal`] back; a bare `failed`, from a build
    /// that did not journal the reason, is [`FailureReason::recorded`] of
    /// nothing. `None` for anything else.
    pub(crate) fn from_journal(text: &str) -> Option<Self> {
        match text {
            "done" => Some(Ending::Done),
            "failed" => Some(Ending::Failed(FailureReason::recorded(""))),
            other => other
                .strip_prefix("failed:")
                .map(|r| Ending::Failed(FailureReason::recorded(r))),
        }
    }
}

impl fmt::Display for Ending {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Ending::Done => f.write_str("done"),
            Ending::Failed(r) => write!(f, "failed ({r})"),
        }
    }
}

/// The first wait before a registration removal is tried again.
pub(crate) const REMOVAL_BACKOFF_MIN: Duration = Duration::from_secs(1);

/// The longest wait between two tries of a registration removal.
pub(crate) const REMOVAL_BACKOFF_MAX: Duration = Duration::from_secs(300);

/// How long to wait before try `attempt + 1` of a removal (`attempt` 0 is
/// the wait after the first failure): exponential from
/// [`REMOVAL_BACKOFF_MIN`], doubling, capped at [`REMOVAL_BACKOFF_MAX`],
/// with jitter so removals that failed together do not retry together.
pub(crate) fn removal_delay(attempt: u32) -> Duration {
    ExponentialBuilder::default()
        .with_min_delay(REMOVAL_BACKOFF_MIN)
        .with_max_delay(REMOVAL_BACKOFF_MAX)
        .with_factor(2.0)
        .with_jitter()
        .without_max_times()
        .build()
        .nth(attempt as usize)
        .unwrap_or(REMOVAL_BACKOFF_MAX)
}

/// One registration still to be removed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Removal {
    /// The lease's epoch when its compute ended.
    pub epoch: Epoch,
    /// (GitHub runner id, name); `(0, "")` for "the one the plane recorded
    /// for the lease".
    pub registration: (i64, String),
    /// Tries that failed so far.
    pub failures: u32,
    /// Not tried again before this.
    pub next_at: Instant,
}

/// Registrations to remove, by lease, each on its own backoff.
#[derive(Debug, Default)]
pub(crate) struct Removals {
    pending: HashMap<LeaseId, Removal>,
}

impl Removals {
    /// Records a failed try for `lease`: the next waits [`removal_delay`]
    /// of the failures so far. Returns the wait.
    pub(crate) fn failed(
        &mut self,
        lease: &LeaseId,
        epoch: Epoch,
        registration: (i64, String),
    ) -> Duration {
        let failures = self.pending.get(lease).map_or(0, |r| r.failures);
        let delay = removal_delay(failures);
        self.pending.insert(
            lease.clone(),
            Removal {
                epoch,
                registration,
                failures: failures + 1,
                next_at: Instant::now() + delay,
            },
        );
        delay
    }

    /// Records a removal to try at once (found pending after a restart);
    /// a failure then backs off as usual.
    pub(crate) fn pending_now(
        &mut self,
        lease: &LeaseId,
        epoch: Epoch,
        registration: (i64, String),
    ) {
        self.pending.entry(lease.clone()).or_insert(Removal {
            epoch,
            registration,
            failures: 0,
            next_at: Instant::now(),
        });
    }

    /// The removals due now, left in place until [`Removals::done`] or
    /// [`Removals::failed`].
    pub(crate) fn due(&self) -> Vec<(LeaseId, Removal)> {
        let now = Instant::now();
        let mut due: Vec<_> = self
            .pending
            .iter()
            .filter(|(_, r)| r.next_at <= now)
            .map(|(l, r)| (l.clone(), r.clone()))
            .collect();
        due.sort_by(|a, b| a.0.as_str().cmp(b.0.as_str()));
        due
    }

    /// The removal for `lease` succeeded (or was answered "already gone").
    pub(crate) fn done(&mut self, lease: &LeaseId) {
        self.pending.remove(lease);
    }

    /// A launch of `lease` at `epoch` was just bound, so the lease is live
    /// at that epoch and a removal pending for it at the same epoch is of a
    /// launch record whose lease was never bound (the node minted nothing:
    /// it mints only for a bound, launching lease, and a lease that ended
    /// since would have refused the bind; a registration the plane minted
    /// before dispatch is the one the launch carries again). So is one at
    /// no known epoch: an orphan recovery destroyed without a launch
    /// record, removed by lease, whose lease was not launched then and is
    /// now; removed by lease, it would take whatever registration the plane
    /// holds for the lease, which is the live launch's. Drops that removal,
    /// which would otherwise take the new runner's registration; one at
    /// another known epoch stays. Returns whether one was dropped.
    pub(crate) fn superseded(&mut self, lease: &LeaseId, epoch: Epoch) -> bool {
        let stale = self
            .pending
            .get(lease)
            .is_some_and(|r| r.epoch == epoch || r.epoch == Epoch(0));
        if stale {
            self.pending.remove(lease);
        }
        stale
    }

    /// Whether a removal for `lease` is pending.
    pub(crate) fn contains(&self, lease: &LeaseId) -> bool {
        self.pending.contains_key(lease)
    }

    /// Whether none is pending.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.pending.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A failed ending always says why, in words, and keeps saying it
    /// across the journal: an empty or blank reason cannot be made, and a
    /// record of an older build without one reads as such.
    #[test]
    fn every_failure_reason_is_words_and_survives_the_journal() {
        let reasons = [
            FailureReason::Compute(EndReason::Killed),
            FailureReason::Compute(EndReason::Exit(3)),
            FailureReason::forced(None),
            FailureReason::forced(Some("  ")),
            FailureReason::forced(Some("operator_x")),
            FailureReason::ImageUnavailable("runner:1".into()),
            FailureReason::ProviderUnavailable,
            FailureReason::LaunchFailed,
            FailureReason::LaunchInterrupted,
            FailureReason::MaxCustody,
            FailureReason::ForceRelease,
            FailureReason::recorded(""),
            FailureReason::recorded("oom"),
        ];
        for reason in reasons {
            let text = reason.to_string();
            assert!(!text.trim().is_empty(), "{reason:?}");
            let ending = Ending::Failed(reason);
            let back = Ending::from_journal(&ending.to_journal()).expect("read back");
            assert_eq!(back.reason().map(ToString::to_string), Some(text));
        }
        assert_eq!(Ending::from_journal("done"), Some(Ending::Done));
        assert_eq!(
            Ending::from_journal("failed").map(|e| e.to_journal()),
            Some("failed: unrecorded_before_restart".to_owned())
        );
        assert_eq!(Ending::from_journal("lost"), None);
        let mut first = Ending::Failed(FailureReason::Compute(EndReason::Oom));
        first.fail(FailureReason::MaxCustody);
        assert_eq!(
            first.reason().map(ToString::to_string).as_deref(),
            Some("oom"),
            "the first reason stays"
        );
    }

    /// Every way the node fails a lease names a code, whose class is the
    /// docs' table's; a forced reason stays forced across the journal,
    /// whatever its words; done is the job's `completed`.
    #[test]
    fn every_ending_names_its_code_and_class_and_keeps_it_across_the_journal() {
        use billet_proto::ending::{EndClass, ReasonCode};
        let cases = [
            (Ending::Done, ReasonCode::Completed, "", EndClass::Job),
            (
                Ending::Failed(FailureReason::Compute(EndReason::Exit(3))),
                ReasonCode::RunnerExit,
                "3",
                EndClass::Job,
            ),
            (
                Ending::Failed(FailureReason::Compute(EndReason::Oom)),
                ReasonCode::Oom,
                "",
                EndClass::Job,
            ),
            (
                Ending::Failed(FailureReason::Compute(EndReason::StartDeadline)),
                ReasonCode::StartDeadline,
                "",
                EndClass::Runner,
            ),
            (
                Ending::Failed(FailureReason::Compute(EndReason::Killed)),
                ReasonCode::Killed,
                "",
                EndClass::Infra,
            ),
            (
                Ending::Failed(FailureReason::Compute(EndReason::SpotInterruption(
                    SpotAction::Stop,
                ))),
                ReasonCode::SpotInterruption,
                "stop",
                EndClass::Infra,
            ),
            (
                Ending::Failed(FailureReason::ImageUnavailable("runner:1".into())),
                ReasonCode::ImageUnavailable,
                "runner:1",
                EndClass::Infra,
            ),
            (
                Ending::Failed(FailureReason::forced(Some("oom"))),
                ReasonCode::Forced,
                "oom",
                EndClass::Operator,
            ),
            (
                Ending::Failed(FailureReason::Compute(EndReason::MaxLeaseLife)),
                ReasonCode::MaxLeaseLife,
                "",
                EndClass::Operator,
            ),
            (
                Ending::Failed(FailureReason::Compute(EndReason::Drained)),
                ReasonCode::Drained,
                "",
                EndClass::Operator,
            ),
        ];
        for (ending, code, detail, class) in cases {
            assert_eq!(ending.code(), (code, detail.to_owned()), "{ending}");
            assert_eq!(code.class(), class, "{ending}");
            let back = Ending::from_journal(&ending.to_journal()).expect("read back");
            assert_eq!(back.code(), ending.code(), "{ending} across the journal");
        }
        // A reason an older build journaled only as words.
        assert_eq!(
            Ending::from_journal("failed").map(|e| e.code().0),
            Some(ReasonCode::Unrecorded)
        );
        assert_eq!(
            FailureReason::recorded("ec2 spot interruption: terminate"),
            FailureReason::Compute(EndReason::SpotInterruption(SpotAction::Terminate))
        );
    }

    #[test]
    fn each_exit_reads_as_its_reason_and_exit_0_as_the_jobs_own_end() {
        let exit = |code, oom_killed| Exit { code, oom_killed };
        assert_eq!(EndReason::from_exit(exit(137, true)), Some(EndReason::Oom));
        assert_eq!(
            EndReason::from_exit(exit(137, false)),
            Some(EndReason::Killed)
        );
        assert_eq!(
            EndReason::from_exit(exit(3, false)),
            Some(EndReason::Exit(3))
        );
        assert_eq!(EndReason::from_exit(exit(0, false)), None);
        // A step OOM-killed inside a runner that went on and exited 0.
        assert_eq!(EndReason::from_exit(exit(0, true)), None);
        assert_eq!(EndReason::from_exit(exit(1, true)), Some(EndReason::Oom));
        assert_eq!(
            EndReason::from_state(InstanceState::Removing),
            Some(EndReason::Killed)
        );
        assert_eq!(EndReason::from_state(InstanceState::Running), None);
        assert_eq!(EndReason::from_state(InstanceState::Unknown), None);
        let spelled: Vec<String> = [
            EndReason::Oom,
            EndReason::Exit(3),
            EndReason::Killed,
            EndReason::Removed,
            EndReason::StartDeadline,
            EndReason::PostJobTimeout,
            EndReason::RegistrationLost,
            EndReason::MaxLeaseLife,
            EndReason::SpotInterruption(SpotAction::Terminate),
        ]
        .iter()
        .map(ToString::to_string)
        .collect();
        assert_eq!(
            spelled,
            [
                "oom",
                "exit 3",
                "killed",
                "removed",
                "start_deadline",
                "post_job_timeout",
                "registration_lost",
                "max_lease_life",
                "ec2 spot interruption: terminate"
            ]
        );
        for action in ["terminate", "stop", "hibernate"] {
            assert_eq!(
                SpotAction::parse(action).map(SpotAction::as_str),
                Some(action)
            );
        }
        assert_eq!(SpotAction::parse("reboot"), None);
    }

    #[test]
    fn removal_waits_grow_exponentially_to_the_cap_and_never_reach_zero() {
        let mut last = Duration::ZERO;
        for attempt in 0..20 {
            let d = removal_delay(attempt);
            assert!(d >= REMOVAL_BACKOFF_MIN, "{attempt}: {d:?}");
            // Jitter adds up to one more delay's worth.
            assert!(d <= REMOVAL_BACKOFF_MAX * 2, "{attempt}: {d:?}");
            if attempt < 5 {
                assert!(
                    d >= REMOVAL_BACKOFF_MIN * 2u32.pow(attempt),
                    "{attempt}: {d:?}"
                );
            }
            last = last.max(d);
        }
        assert!(last >= REMOVAL_BACKOFF_MAX, "{last:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_bind_supersedes_a_removal_at_its_epoch_or_at_none_known_and_keeps_one_at_another() {
        let lease = LeaseId::parse("l", "a").unwrap();
        let mut removals = Removals::default();
        removals.pending_now(&lease, Epoch(2), (0, String::new()));
        assert!(removals.superseded(&lease, Epoch(2)));
        assert!(!removals.contains(&lease));
        // An orphan destroyed without a launch record: removed by lease,
        // at no known epoch.
        removals.pending_now(&lease, Epoch(0), (0, String::new()));
        assert!(removals.superseded(&lease, Epoch(1)));
        assert!(!removals.contains(&lease));
        removals.pending_now(&lease, Epoch(1), (7, "billet-a".into()));
        assert!(!removals.superseded(&lease, Epoch(2)));
        assert!(removals.contains(&lease));
    }

    #[tokio::test(start_paused = true)]
    async fn a_failed_removal_is_not_due_again_until_its_backoff_passes() {
        let lease = LeaseId::parse("l", "a").unwrap();
        let mut removals = Removals::default();
        let first = removals.failed(&lease, Epoch(1), (7, "billet-a".into()));
        assert!(removals.due().is_empty(), "due at once");
        tokio::time::advance(first).await;
        assert_eq!(removals.due().len(), 1);
        let second = removals.failed(&lease, Epoch(1), (7, "billet-a".into()));
        assert!(second >= REMOVAL_BACKOFF_MIN * 2, "{second:?}");
        assert!(removals.due().is_empty());
        tokio::time::advance(second).await;
        assert_eq!(removals.due()[0].1.failures, 2);
        removals.done(&lease);
        assert!(removals.is_empty() && !removals.contains(&lease));
    }
}
