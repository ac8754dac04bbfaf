//! Each job's record, as the plane keeps it: what the scale-set messages
//! told ([`Plane::note_messages`]), the leases placed for it (`reserve`,
//! `launch_ended`), and why it waits ([`Plane::note_waits`], written only
//! when the coverage pass's decision for the job changes); ends of the
//! tier's leases counted by class and reason ([`Plane::observe_ends`]); a
//! job that cannot be placed anywhere for longer than
//! [`JobsConfig::stuck_after`] logged once, counted and recorded stuck; and
//! records past [`JobsConfig::retention`] pruned.
//!
//! A record is an observation: a write that fails is logged and never
//! holds coverage back.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use scaleset::JobMessage;
use tokio_util::sync::CancellationToken;
use tracing::warn;

use crate::jobs::{WaitKind, attempt_class, end_reason_label};
use crate::ledger::{JobMeta, JobNote, JobStep, WaitChange};

use super::Plane;

/// How long job records are kept unless configured otherwise.
pub const DEFAULT_JOB_RETENTION: Duration = Duration::from_secs(7 * 24 * 3600);

/// How long a job may be unplaceable before it is judged stuck, unless
/// configured otherwise.
pub const DEFAULT_STUCK_AFTER: Duration = Duration::from_secs(300);

/// How often old records are pruned.
const PRUNE_EVERY: Duration = Duration::from_secs(3600);

/// How often the tier's open leases are compared with the last look, to
/// count the ends.
const ENDS_TICK: Duration = Duration::from_secs(1);

/// The plane's job records' bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct JobsConfig {
    /// Records not written for this long are pruned (a job still wanted is
    /// kept).
    pub retention: Duration,
    /// A job that could not be placed anywhere for this long is logged at
    /// warn once, counted (`billet_jobs_stuck_total`) and shown stuck.
    pub stuck_after: Duration,
}

impl Default for JobsConfig {
    fn default() -> Self {
        Self {
            retention: DEFAULT_JOB_RETENTION,
            stuck_after: DEFAULT_STUCK_AFTER,
        }
    }
}

/// What the coverage pass decided for one wanted job.
pub(super) type Decision = (i64, WaitKind, String);

/// The plane's memory of its jobs between passes.
#[derive(Debug, Default)]
pub(super) struct JobBook {
    /// Each waiting job's current reason, as last written.
    waits: HashMap<i64, (WaitKind, String)>,
    /// Since when each job has had no launch answered OK (while it is
    /// wanted), and whether it was judged stuck since.
    unplaced: HashMap<i64, (Instant, bool)>,
    /// Leases that took over a warm runner's room.
    pub(super) warm_leases: HashSet<String>,
    /// When each job started (unix ms), until it completes.
    started_ms: HashMap<i64, i64>,
    /// The tier's open leases at the last look, with their job.
    open: Option<HashSet<String>>,
    /// When records were last pruned.
    pruned: Option<Instant>,
}

/// What a message said of a job, beyond its id.
fn meta(job: &scaleset::JobInfo) -> JobMeta {
    let repository = match (job.owner_name.as_str(), job.repository_name.as_str()) {
        ("", "") => String::new(),
        ("", name) => name.to_owned(),
        (owner, name) => format!("{owner}/{name}"),
    };
    JobMeta {
        github_job_id: job.job_id.clone(),
        run_id: job.workflow_run_id,
        repository,
        workflow: job.job_workflow_ref.clone(),
        queued_at_ms: job.queue_time.map(|t| t.as_millisecond()),
    }
}

impl Plane {
    /// Records what `jobs` (one message) told, and times the starts and
    /// completions.
    pub(super) async fn note_messages(&self, jobs: &[JobMessage]) {
        let now = crate::now_ms();
        let tier = &self.config.tier.label;
        let mut notes = Vec::new();
        for job in jobs {
            let (info, step) = match job {
                JobMessage::Available(j) => (&j.job, JobStep::Acquired),
                JobMessage::Assigned(j) => (&j.job, JobStep::Assigned),
                JobMessage::Started(j) => (
                    &j.job,
                    JobStep::Started {
                        runner_name: j.runner_name.clone(),
                    },
                ),
                JobMessage::Completed(j) => (
                    &j.job,
                    JobStep::Completed {
                        result: j.result.clone(),
                    },
                ),
                _ => continue,
            };
            let request_id = info.runner_request_id.get();
            let queued = info.queue_time.map(|t| t.as_millisecond());
            match &step {
                JobStep::Started { .. } => {
                    let first = self
                        .jobs
                        .lock()
                        .expect("jobs")
                        .started_ms
                        .insert(request_id, now)
                        .is_none();
                    if first && let Some(queued) = queued {
                        self.metrics.job_started(ms(now - queued));
                    }
                }
                JobStep::Completed { .. } => {
                    let mut book = self.jobs.lock().expect("jobs");
                    book.unplaced.remove(&request_id);
                    let started = book
                        .started_ms
                        .remove(&request_id)
                        .or_else(|| info.runner_assign_time.map(|t| t.as_millisecond()));
                    if let Some(started) = started {
                        self.metrics.job_completed(ms(now - started));
                    }
                }
                _ => {}
            }
            notes.push(JobNote {
                request_id,
                tier: tier.clone(),
                meta: meta(info),
                step,
            });
        }
        if let Err(e) = self.ledger.note_jobs(&notes, now).await {
            warn!(error = %e, "recording what a message told of its jobs");
        }
    }

    /// Records a lease placed for a job.
    pub(super) async fn note_placed(
        &self,
        lease: &crate::ledger::Lease,
        node: &str,
        warm: Option<&str>,
    ) {
        if warm.is_some() {
            self.jobs
                .lock()
                .expect("jobs")
                .warm_leases
                .insert(lease.id.clone());
        }
        if let Err(e) = self
            .ledger
            .record_attempt(
                &lease.id,
                lease.request_id,
                &lease.tier,
                node,
                warm,
                crate::now_ms(),
            )
            .await
        {
            warn!(lease = %lease.id, error = %e, "recording a job's attempt");
        }
    }

    /// Records that a node answered a job's launch OK: the job has been
    /// placed, so its clock towards stuck starts again.
    pub(super) async fn note_launched(&self, lease: &crate::ledger::Lease) {
        self.jobs
            .lock()
            .expect("jobs")
            .unplaced
            .remove(&lease.request_id);
        if let Err(e) = self
            .ledger
            .attempt_launched(&lease.id, crate::now_ms())
            .await
        {
            warn!(lease = %lease.id, error = %e, "recording a job's launch");
        }
    }

    /// Writes the wait reasons that changed since the last pass (a job no
    /// longer decided on waits no more), sets the waiting gauges, and judges
    /// jobs stuck that could not be placed for longer than the bound.
    pub(super) async fn note_waits(&self, decisions: Vec<Decision>) {
        let mut changes = Vec::new();
        let mut stuck = Vec::new();
        {
            let mut book = self.jobs.lock().expect("jobs");
            let decided: HashSet<i64> = decisions.iter().map(|(r, _, _)| *r).collect();
            let gone: Vec<i64> = book
                .waits
                .keys()
                .filter(|r| !decided.contains(r))
                .copied()
                .collect();
            for request_id in gone {
                book.waits.remove(&request_id);
                changes.push(WaitChange {
                    request_id,
                    reason: None,
                });
            }
            book.unplaced.retain(|r, _| decided.contains(r));
            let mut counts: HashMap<WaitKind, i64> = HashMap::new();
            for (request_id, kind, detail) in decisions {
                *counts.entry(kind).or_default() += 1;
                if !kind.placed() {
                    let (since, judged) = book
                        .unplaced
                        .entry(request_id)
                        .or_insert((Instant::now(), false));
                    if !*judged && since.elapsed() >= self.config.jobs.stuck_after {
                        *judged = true;
                        stuck.push((request_id, kind, detail.clone(), since.elapsed()));
                    }
                }
                let now = (kind, detail);
                if book.waits.get(&request_id) != Some(&now) {
                    changes.push(WaitChange {
                        request_id,
                        reason: Some((now.0.as_str().to_owned(), now.1.clone())),
                    });
                    book.waits.insert(request_id, now);
                }
            }
            self.metrics.waiting(&counts);
        }
        let now = crate::now_ms();
        let tier = &self.config.tier.label;
        for (request_id, kind, detail, unplaced_for) in stuck {
            warn!(request_id, tier = %tier, reason = kind.as_str(), %detail,
                  unplaced_s = unplaced_for.as_secs(),
                  "a job could not be placed anywhere for longer than the bound; it is stuck until that changes");
            self.metrics.stuck();
            if let Err(e) = self
                .ledger
                .mark_job_stuck(request_id, tier, kind.as_str(), now)
                .await
            {
                warn!(request_id, error = %e, "recording a stuck job");
            }
        }
        if let Err(e) = self.ledger.record_waits(tier, &changes, now).await {
            warn!(error = %e, "recording why jobs wait");
            // Written again on the next pass.
            let mut book = self.jobs.lock().expect("jobs");
            for change in &changes {
                book.waits.remove(&change.request_id);
            }
        }
    }

    /// Counts the tier's leases that ended since the last look, by class
    /// and reason, every [`ENDS_TICK`]; prunes old job records every
    /// [`PRUNE_EVERY`].
    pub(super) async fn observe_ends(self: Arc<Self>, shutdown: CancellationToken) {
        let mut tick = tokio::time::interval(ENDS_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            if let Err(e) = self.count_ends().await {
                warn!(error = %e, "counting ended leases");
            }
        }
    }

    async fn count_ends(&self) -> Result<(), crate::ledger::LedgerError> {
        let tier = &self.config.tier.label;
        let open: HashSet<String> = self
            .ledger
            .open_leases()
            .await?
            .into_iter()
            .filter(|l| &l.tier == tier)
            .map(|l| l.id)
            .collect();
        let before = self.jobs.lock().expect("jobs").open.replace(open.clone());
        for id in before.unwrap_or_default().difference(&open) {
            let Some(lease) = self.ledger.get(id).await? else {
                continue;
            };
            if !lease.phase.is_terminal() {
                // Quarantined or otherwise left the open set still charged.
                continue;
            }
            let phase = lease.phase.to_string();
            let reason = lease.failure_reason.as_deref();
            self.metrics.lease_ended(
                attempt_class(Some(&phase), reason),
                end_reason_label(Some(&phase), reason),
            );
            self.jobs.lock().expect("jobs").warm_leases.remove(id);
        }
        Ok(())
    }

    /// Prunes job records past the retention bound, at most every
    /// [`PRUNE_EVERY`]; from the maintenance loop.
    pub(super) async fn prune_job_records(&self) {
        {
            let mut book = self.jobs.lock().expect("jobs");
            if book.pruned.is_some_and(|t| t.elapsed() < PRUNE_EVERY) {
                return;
            }
            book.pruned = Some(Instant::now());
        }
        let retention = i64::try_from(self.config.jobs.retention.as_millis()).unwrap_or(i64::MAX);
        match self
            .ledger
            .prune_jobs(crate::now_ms().saturating_sub(retention))
            .await
        {
            Ok(0) => {}
            Ok(n) => tracing::info!(
                jobs = n,
                "pruned job records older than the retention bound"
            ),
            Err(e) => warn!(error = %e, "pruning job records"),
        }
    }
}

fn ms(ms: i64) -> Duration {
    Duration::from_millis(u64::try_from(ms).unwrap_or(0))
}
