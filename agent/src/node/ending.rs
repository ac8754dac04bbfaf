//! How compute ends: the typed reason a lease is released `failed` with,
//! and the one policy every path that ends compute follows to remove the
//! runner registration it leaves behind.
//!
//! [`EndReason`] is what the ledger records as the lease's failure reason
//! (through `MarkFailure`, before the release), spelled `oom`,
//! `exit <code>`, `killed`, `removed`, `start_deadline`, `post_job_timeout`,
//! `registration_lost`, `max_lease_life`, and
//! `ec2 spot interruption: <action>` (the reference's spelling, spec/node.md
//! §2.11).
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
    /// The cloud is taking the host's spot capacity back
    /// ([`crate::node::interruption`]).
    SpotInterruption(SpotAction),
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
            EndReason::SpotInterruption(action) => {
                write!(f, "ec2 spot interruption: {}", action.as_str())
            }
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
    /// launch record whose lease was never bound (no mint can have
    /// happened: the plane mints only for a bound, launching lease, and a
    /// lease that ended since would have refused the bind). Drops that
    /// removal, which would otherwise take the new runner's registration;
    /// one at another epoch stays. Returns whether one was dropped.
    pub(crate) fn superseded(&mut self, lease: &LeaseId, epoch: Epoch) -> bool {
        let same = self.pending.get(lease).is_some_and(|r| r.epoch == epoch);
        if same {
            self.pending.remove(lease);
        }
        same
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
