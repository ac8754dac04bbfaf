//! Job records (`jobs`, `job_attempts`, `job_waits`, one migration on both
//! backends): what the plane saw of each GitHub job, keyed by its runner
//! request id, so an operator can read why a job waited and how each of its
//! attempts ended without reading two logs.
//!
//! A job row holds the job's timestamps as the scale-set messages tell them
//! (queued, acquired, assigned, started with its runner, completed with
//! GitHub's result) and whether it was judged stuck. An attempt row is one
//! lease the plane placed for the job (node, attempt number, placed,
//! launched); how it ended is read from the lease's own row when the record
//! is read, so the ledger keeps each end once. A wait row is one interval
//! the plane could not give the job a runner, with the reason its placement
//! decision named, written when that decision changes, never on every pass.
//!
//! Every write touches `updated_at_ms`; [`Ledger::prune_jobs`] removes
//! records not touched within the retention bound, never one the plane
//! still wants covered. No lease rule lives here.

use std::collections::HashMap;

use serde::Serialize;
use sqlx::any::AnyRow;
use sqlx::{AssertSqlSafe, Row};

use super::{Ledger, Phase, Result};

/// What a scale-set message told of a job, beyond its request id.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct JobMeta {
    /// GitHub's job id (`JobInfo.job_id`); empty when the message lacks it.
    pub(crate) github_job_id: String,
    /// The workflow run (`JobInfo.workflow_run_id`); 0 when unknown.
    pub(crate) run_id: i64,
    /// `owner/name`, or empty.
    pub(crate) repository: String,
    /// The workflow reference (`JobInfo.job_workflow_ref`), or empty.
    pub(crate) workflow: String,
    /// When GitHub queued the job, unix ms, as the message says.
    pub(crate) queued_at_ms: Option<i64>,
}

/// One step of a job as a scale-set message tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum JobStep {
    /// The listener acquired the job (`JobAvailable`).
    Acquired,
    /// GitHub assigned it to the scale set (`JobAssigned`).
    Assigned,
    /// A runner took it (`JobStarted`).
    Started {
        /// The runner that took it.
        runner_name: String,
    },
    /// It finished or was cancelled (`JobCompleted`).
    Completed {
        /// GitHub's result (`succeeded`, `failed`, `canceled`, ...).
        result: String,
    },
}

/// A job's step, for [`Ledger::note_jobs`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobNote {
    pub(crate) request_id: i64,
    pub(crate) tier: String,
    pub(crate) meta: JobMeta,
    pub(crate) step: JobStep,
}

/// A change of why a job waits: the open wait (if any) ends, and `reason`
/// (kind, detail), if any, begins.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WaitChange {
    pub(crate) request_id: i64,
    pub(crate) reason: Option<(String, String)>,
}

/// A job as recorded, with its attempts and waits, the earliest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobRecord {
    /// GitHub's runner request id: the key.
    pub request_id: i64,
    /// The tier (scale set) it was assigned to.
    pub tier: String,
    /// GitHub's job id, when a message gave it.
    pub github_job_id: Option<String>,
    /// The workflow run, when a message gave it.
    pub run_id: Option<i64>,
    /// `owner/name`, when a message gave it.
    pub repository: Option<String>,
    /// The workflow reference, when a message gave it.
    pub workflow: Option<String>,
    /// When GitHub queued it (unix ms, GitHub's clock).
    pub queued_at_ms: Option<i64>,
    /// When the plane's listener acquired it.
    pub acquired_at_ms: Option<i64>,
    /// When GitHub assigned it to the scale set.
    pub assigned_at_ms: Option<i64>,
    /// When a runner took it.
    pub started_at_ms: Option<i64>,
    /// The runner that took it.
    pub runner_name: Option<String>,
    /// When GitHub reported it completed.
    pub completed_at_ms: Option<i64>,
    /// GitHub's result.
    pub result: Option<String>,
    /// When the plane judged it stuck (no placement for longer than the
    /// bound), and why.
    pub stuck_at_ms: Option<i64>,
    /// The wait reason it was stuck on.
    pub stuck_reason: Option<String>,
    /// When the plane first recorded anything of it.
    pub first_seen_at_ms: i64,
    /// When the lease of the runner that took it ended: its compute is
    /// proven gone.
    pub runner_gone_at_ms: Option<i64>,
    /// The leases placed for it.
    pub attempts: Vec<JobAttempt>,
    /// The intervals it waited, and why.
    pub waits: Vec<JobWait>,
}

/// One lease placed for a job, and how it ended (from the lease's row).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobAttempt {
    /// 1 for the job's first lease, and so on.
    pub attempt: u32,
    /// The lease.
    pub lease: String,
    /// The node it was placed on.
    pub node: String,
    /// The warm runner it took over, if any.
    pub warm_runner: Option<String>,
    /// When it was placed (reserved on the node).
    pub placed_at_ms: i64,
    /// When the node answered its launch OK.
    pub launched_at_ms: Option<i64>,
    /// The lease's phase now (`done`, `failed`, or still open).
    pub phase: Option<String>,
    /// When the lease ended: its compute proven gone.
    pub ended_at_ms: Option<i64>,
    /// Why it failed, as the lease records it.
    pub end_reason: Option<String>,
}

/// One interval a job waited without a runner, and why.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct JobWait {
    /// The reason's kind (`no_capacity`, `node_degraded`, ...).
    pub reason: String,
    /// The reason in words (which node, which failure).
    pub detail: String,
    /// When it began, unix ms.
    pub since_ms: i64,
    /// When it ended; `None` while it lasts.
    pub until_ms: Option<i64>,
}

/// Upserts the job row of `request_id`, filling what is still unknown and
/// marking it written at `now_ms`.
async fn touch_job(
    tx: &mut sqlx::AnyConnection,
    request_id: i64,
    tier: &str,
    meta: &JobMeta,
    now_ms: i64,
) -> Result<()> {
    let text = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    sqlx::query(
        "INSERT INTO jobs (request_id, tier, github_job_id, run_id, repository, workflow,
             queued_at_ms, first_seen_at_ms, updated_at_ms)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $8)
         ON CONFLICT (request_id) DO UPDATE SET
             github_job_id = COALESCE(jobs.github_job_id, excluded.github_job_id),
             run_id = COALESCE(jobs.run_id, excluded.run_id),
             repository = COALESCE(jobs.repository, excluded.repository),
             workflow = COALESCE(jobs.workflow, excluded.workflow),
             queued_at_ms = COALESCE(jobs.queued_at_ms, excluded.queued_at_ms),
             updated_at_ms = excluded.updated_at_ms",
    )
    .bind(request_id)
    .bind(tier)
    .bind(text(&meta.github_job_id))
    .bind((meta.run_id != 0).then_some(meta.run_id))
    .bind(text(&meta.repository))
    .bind(text(&meta.workflow))
    .bind(meta.queued_at_ms)
    .bind(now_ms)
    .execute(&mut *tx)
    .await?;
    Ok(())
}

/// Ends the open wait of `request_id` at `now_ms`, if one is open.
async fn close_wait(tx: &mut sqlx::AnyConnection, request_id: i64, now_ms: i64) -> Result<()> {
    sqlx::query("UPDATE job_waits SET until_ms = $2 WHERE request_id = $1 AND until_ms IS NULL")
        .bind(request_id)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

impl Ledger {
    /// Records what messages told of jobs, in order, in one write
    /// transaction at `now_ms`. A step recorded again (a message delivered
    /// again) keeps its first time. A started or completed job waits no
    /// more: its open wait ends.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written;
    /// then nothing is changed.
    pub(crate) async fn note_jobs(&self, notes: &[JobNote], now_ms: i64) -> Result<()> {
        if notes.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for note in notes {
            touch_job(&mut tx, note.request_id, &note.tier, &note.meta, now_ms).await?;
            let (set, text) = match &note.step {
                JobStep::Acquired => ("acquired_at_ms = COALESCE(acquired_at_ms, $2)", None),
                JobStep::Assigned => ("assigned_at_ms = COALESCE(assigned_at_ms, $2)", None),
                JobStep::Started { runner_name } => (
                    "started_at_ms = COALESCE(started_at_ms, $2),
                     runner_name = COALESCE(runner_name, $3)",
                    Some(runner_name.clone()),
                ),
                JobStep::Completed { result } => (
                    "completed_at_ms = COALESCE(completed_at_ms, $2),
                     result = COALESCE(result, $3)",
                    Some(result.clone()),
                ),
            };
            let sql = format!("UPDATE jobs SET {set} WHERE request_id = $1");
            let query = sqlx::query(AssertSqlSafe(sql))
                .bind(note.request_id)
                .bind(now_ms);
            let query = match text {
                Some(t) => query.bind(t),
                None => query,
            };
            query.execute(&mut *tx).await?;
            if matches!(
                note.step,
                JobStep::Started { .. } | JobStep::Completed { .. }
            ) {
                close_wait(&mut tx, note.request_id, now_ms).await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records lease `lease` placed on `node` for job `request_id` of
    /// `tier` at `now_ms`, numbered after the job's earlier attempts;
    /// `warm_runner` is the warm runner whose room it took over.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written.
    pub(crate) async fn record_attempt(
        &self,
        lease: &str,
        request_id: i64,
        tier: &str,
        node: &str,
        warm_runner: Option<&str>,
        now_ms: i64,
    ) -> Result<()> {
        let mut tx = self.begin_write().await?;
        touch_job(&mut tx, request_id, tier, &JobMeta::default(), now_ms).await?;
        sqlx::query(
            "INSERT INTO job_attempts (lease_id, request_id, attempt, node, warm_runner, placed_at_ms)
             VALUES ($1, $2, (SELECT COUNT(*) + 1 FROM job_attempts WHERE request_id = $2),
                     $3, $4, $5)
             ON CONFLICT (lease_id) DO NOTHING",
        )
        .bind(lease)
        .bind(request_id)
        .bind(node)
        .bind(warm_runner.map(str::to_owned))
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Records that the node answered the launch of `lease` OK, at `now_ms`
    /// (the first answer is kept).
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written.
    pub(crate) async fn attempt_launched(&self, lease: &str, now_ms: i64) -> Result<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "UPDATE job_attempts SET launched_at_ms = COALESCE(launched_at_ms, $2)
             WHERE lease_id = $1",
        )
        .bind(lease)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        sqlx::query(
            "UPDATE jobs SET updated_at_ms = $2
             WHERE request_id = (SELECT request_id FROM job_attempts WHERE lease_id = $1)",
        )
        .bind(lease)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Applies wait changes of jobs of `tier` at `now_ms`, in one write
    /// transaction: each ends the job's open wait and opens its new one.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written;
    /// then nothing is changed.
    pub(crate) async fn record_waits(
        &self,
        tier: &str,
        changes: &[WaitChange],
        now_ms: i64,
    ) -> Result<()> {
        if changes.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for change in changes {
            touch_job(
                &mut tx,
                change.request_id,
                tier,
                &JobMeta::default(),
                now_ms,
            )
            .await?;
            close_wait(&mut tx, change.request_id, now_ms).await?;
            if let Some((reason, detail)) = &change.reason {
                sqlx::query(
                    "INSERT INTO job_waits (request_id, reason, detail, since_ms)
                     VALUES ($1, $2, $3, $4)",
                )
                .bind(change.request_id)
                .bind(reason.as_str())
                .bind(detail.as_str())
                .bind(now_ms)
                .execute(&mut *tx)
                .await?;
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records that job `request_id` has been judged stuck at `now_ms`,
    /// waiting for `reason`.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written.
    pub(crate) async fn mark_job_stuck(
        &self,
        request_id: i64,
        tier: &str,
        reason: &str,
        now_ms: i64,
    ) -> Result<()> {
        let mut tx = self.begin_write().await?;
        touch_job(&mut tx, request_id, tier, &JobMeta::default(), now_ms).await?;
        sqlx::query("UPDATE jobs SET stuck_at_ms = $2, stuck_reason = $3 WHERE request_id = $1")
            .bind(request_id)
            .bind(now_ms)
            .bind(reason)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Removes the records of jobs last written before `before_ms` that no
    /// plane still wants covered, with their attempts and waits. Returns
    /// how many jobs went.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written.
    pub(crate) async fn prune_jobs(&self, before_ms: i64) -> Result<u64> {
        let mut tx = self.begin_write().await?;
        let gone = sqlx::query(
            "DELETE FROM jobs WHERE updated_at_ms < $1
             AND request_id NOT IN (SELECT request_id FROM wanted_jobs)",
        )
        .bind(before_ms)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        sqlx::query(
            "DELETE FROM job_attempts WHERE request_id NOT IN (SELECT request_id FROM jobs)",
        )
        .execute(&mut *tx)
        .await?;
        sqlx::query("DELETE FROM job_waits WHERE request_id NOT IN (SELECT request_id FROM jobs)")
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(gone)
    }

    /// The job `request_id` as recorded, or `None`.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be read.
    pub async fn job_record(&self, request_id: i64) -> Result<Option<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "{JOB_SELECT} WHERE j.request_id = $1"
        )))
        .bind(request_id)
        .fetch_all(&self.reader)
        .await?;
        Ok(self.with_details(rows).await?.pop())
    }

    /// The `limit` jobs queued (or first seen) last, the latest first.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be read.
    pub async fn recent_jobs(&self, limit: u32) -> Result<Vec<JobRecord>> {
        let rows = sqlx::query(AssertSqlSafe(format!(
            "{JOB_SELECT} ORDER BY COALESCE(j.queued_at_ms, j.first_seen_at_ms) DESC,
             j.request_id DESC LIMIT $1"
        )))
        .bind(i64::from(limit))
        .fetch_all(&self.reader)
        .await?;
        self.with_details(rows).await
    }

    /// Job rows with their attempts and waits.
    async fn with_details(&self, rows: Vec<AnyRow>) -> Result<Vec<JobRecord>> {
        let mut jobs = rows.iter().map(job_from_row).collect::<Result<Vec<_>>>()?;
        if jobs.is_empty() {
            return Ok(jobs);
        }
        // Request ids are integers the ledger stored: safe to spell out.
        let ids = jobs
            .iter()
            .map(|j| j.request_id.to_string())
            .collect::<Vec<_>>()
            .join(",");
        let mut attempts: HashMap<i64, Vec<JobAttempt>> = HashMap::new();
        for row in sqlx::query(AssertSqlSafe(format!(
            "SELECT a.*, l.phase, l.ended_at_ms, l.failure_reason
             FROM job_attempts a LEFT JOIN leases l ON l.id = a.lease_id
             WHERE a.request_id IN ({ids}) ORDER BY a.attempt"
        )))
        .fetch_all(&self.reader)
        .await?
        {
            let attempt: i64 = row.try_get("attempt")?;
            let phase: Option<String> = row.try_get("phase")?;
            attempts
                .entry(row.try_get("request_id")?)
                .or_default()
                .push(JobAttempt {
                    attempt: super::schema::from_db("attempt", attempt)?,
                    lease: row.try_get("lease_id")?,
                    node: row.try_get("node")?,
                    warm_runner: row.try_get("warm_runner")?,
                    placed_at_ms: row.try_get("placed_at_ms")?,
                    launched_at_ms: row.try_get("launched_at_ms")?,
                    phase: phase.and_then(|p| Phase::parse(&p)).map(|p| p.to_string()),
                    ended_at_ms: row.try_get("ended_at_ms")?,
                    end_reason: row.try_get("failure_reason")?,
                });
        }
        let mut waits: HashMap<i64, Vec<JobWait>> = HashMap::new();
        for row in sqlx::query(AssertSqlSafe(format!(
            "SELECT * FROM job_waits WHERE request_id IN ({ids}) ORDER BY since_ms, id"
        )))
        .fetch_all(&self.reader)
        .await?
        {
            waits
                .entry(row.try_get("request_id")?)
                .or_default()
                .push(JobWait {
                    reason: row.try_get("reason")?,
                    detail: row.try_get("detail")?,
                    since_ms: row.try_get("since_ms")?,
                    until_ms: row.try_get("until_ms")?,
                });
        }
        for job in &mut jobs {
            job.attempts = attempts.remove(&job.request_id).unwrap_or_default();
            job.waits = waits.remove(&job.request_id).unwrap_or_default();
        }
        Ok(jobs)
    }
}

/// A job row, with the end of the lease whose runner took it.
const JOB_SELECT: &str = "SELECT j.*, (SELECT MAX(l.ended_at_ms) FROM leases l
     WHERE j.runner_name IS NOT NULL AND l.runner_name = j.runner_name) AS runner_gone_at_ms
     FROM jobs j";

fn job_from_row(row: &AnyRow) -> Result<JobRecord> {
    Ok(JobRecord {
        request_id: row.try_get("request_id")?,
        tier: row.try_get("tier")?,
        github_job_id: row.try_get("github_job_id")?,
        run_id: row.try_get("run_id")?,
        repository: row.try_get("repository")?,
        workflow: row.try_get("workflow")?,
        queued_at_ms: row.try_get("queued_at_ms")?,
        acquired_at_ms: row.try_get("acquired_at_ms")?,
        assigned_at_ms: row.try_get("assigned_at_ms")?,
        started_at_ms: row.try_get("started_at_ms")?,
        runner_name: row.try_get("runner_name")?,
        completed_at_ms: row.try_get("completed_at_ms")?,
        result: row.try_get("result")?,
        stuck_at_ms: row.try_get("stuck_at_ms")?,
        stuck_reason: row.try_get("stuck_reason")?,
        first_seen_at_ms: row.try_get("first_seen_at_ms")?,
        runner_gone_at_ms: row.try_get("runner_gone_at_ms")?,
        attempts: Vec::new(),
        waits: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{lease_in, on_both_backends};

    fn note(request_id: i64, step: JobStep) -> JobNote {
        JobNote {
            request_id,
            tier: "linux-2cpu".to_owned(),
            meta: JobMeta {
                github_job_id: "9f3c".to_owned(),
                run_id: 1003,
                repository: "org/repo".to_owned(),
                workflow: "org/repo/.github/workflows/ci.yml@refs/heads/main".to_owned(),
                queued_at_ms: Some(1_000),
            },
            step,
        }
    }

    fn wait(request_id: i64, reason: Option<(&str, &str)>) -> WaitChange {
        WaitChange {
            request_id,
            reason: reason.map(|(r, d)| (r.to_owned(), d.to_owned())),
        }
    }

    on_both_backends! {
        /// A job queued on a full node: `billet-plane jobs` lists it with
        /// how long it waited, and its story names the capacity wait with
        /// its length, each attempt and how it ended, from queued to the
        /// compute proven gone.
        async fn a_jobs_story_names_each_wait_with_its_length_and_each_attempt_with_its_end(db) {
            let l = db.ledger().await;
            l.note_jobs(&[note(7, JobStep::Acquired), note(7, JobStep::Assigned)], 1_200)
                .await
                .unwrap();
            l.record_waits("linux-2cpu", &[wait(7, Some(("no_capacity", "node n1 full")))], 1_300)
                .await
                .unwrap();
            // A second job, still waiting and judged stuck.
            l.note_jobs(&[note(8, JobStep::Assigned)], 1_250).await.unwrap();
            l.record_waits("linux-2cpu", &[wait(8, Some(("node_degraded", "n1 degraded (disk_low)")))], 1_300)
                .await
                .unwrap();
            l.mark_job_stuck(8, "linux-2cpu", "node_degraded", 301_300).await.unwrap();
            // The first attempt fails at launch; the second runs the job.
            lease_in(&l, "a", "n1", &[], 8_300).await;
            l.record_attempt("a", 7, "linux-2cpu", "n1", None, 8_300).await.unwrap();
            l.record_waits("linux-2cpu", &[wait(7, Some(("runner_starting", "lease a on node n1")))], 8_300)
                .await
                .unwrap();
            l.mark_failure("a", 1, "launch: the engine refused the container", 8_400).await.unwrap();
            l.release("a", 1, None, Phase::Failed, 8_500).await.unwrap();
            l.record_waits("linux-2cpu", &[wait(7, Some(("backing_off", "after failure 1")))], 8_500)
                .await
                .unwrap();
            lease_in(&l, "b", "n1", &[Phase::Launching], 9_000).await;
            l.record_attempt("b", 7, "linux-2cpu", "n1", None, 9_000).await.unwrap();
            l.attempt_launched("b", 9_500).await.unwrap();
            l.note_jobs(
                &[note(7, JobStep::Started { runner_name: "billet-b".to_owned() })],
                10_000,
            )
            .await
            .unwrap();
            // Delivered again: the first time stays.
            l.note_jobs(
                &[note(7, JobStep::Started { runner_name: "billet-b".to_owned() })],
                10_500,
            )
            .await
            .unwrap();
            l.note_jobs(
                &[note(7, JobStep::Completed { result: "succeeded".to_owned() })],
                14_000,
            )
            .await
            .unwrap();
            l.release("b", 1, Some("n1"), Phase::Done, 14_500).await.unwrap();

            let job = l.job_record(7).await.unwrap().expect("recorded");
            assert_eq!(job.repository.as_deref(), Some("org/repo"));
            assert_eq!(job.run_id, Some(1003));
            assert_eq!(job.started_at_ms, Some(10_000));
            assert_eq!(job.runner_gone_at_ms, Some(14_500));
            assert_eq!(job.attempts.len(), 2);
            assert_eq!(job.attempts[0].end_reason.as_deref(), Some("launch: the engine refused the container"));
            assert_eq!(job.attempts[1].launched_at_ms, Some(9_500));
            let waits: Vec<(&str, i64, Option<i64>)> = job
                .waits
                .iter()
                .map(|w| (w.reason.as_str(), w.since_ms, w.until_ms))
                .collect();
            assert_eq!(
                waits,
                vec![
                    ("no_capacity", 1_300, Some(8_300)),
                    ("runner_starting", 8_300, Some(8_500)),
                    ("backing_off", 8_500, Some(10_000)),
                ],
                "the start ends the last wait"
            );

            let story = crate::jobs::story(&job, 20_000);
            for line in [
                "job 7 (org/repo, run 1003, workflow org/repo/.github/workflows/ci.yml@refs/heads/main, GitHub job 9f3c): completed: succeeded",
                "1970-01-01 00:00:01.000  +    0ms  queued at GitHub",
                "1970-01-01 00:00:01.300  +  300ms  waited 7.0s for: no capacity (node n1 full)",
                "1970-01-01 00:00:08.300  +   7.3s  attempt 1: lease a placed on node n1",
                "1970-01-01 00:00:08.500  +   7.5s  attempt 1: lease a ended failed (infra): launch: the engine refused the container",
                "1970-01-01 00:00:08.500  +   7.5s  waited 1.5s for: backing off (after failure 1)",
                "1970-01-01 00:00:09.000  +   8.0s  attempt 2: lease b placed on node n1",
                "1970-01-01 00:00:09.500  +   8.5s  attempt 2: launched (the node answered OK)",
                "1970-01-01 00:00:10.000  +   9.0s  started: runner billet-b took the job (online)",
                "1970-01-01 00:00:14.000  +  13.0s  completed: succeeded",
                "1970-01-01 00:00:14.500  +  13.5s  attempt 2: lease b ended done (job)",
                "1970-01-01 00:00:14.500  +  13.5s  compute proven gone (the runner's lease ended)",
            ] {
                assert!(story.contains(line), "{line:?} missing from\n{story}");
            }
            // From first to last line, in time order.
            let times: Vec<&str> = story.lines().skip(1).map(|l| &l[2..25]).collect();
            let mut sorted = times.clone();
            sorted.sort_unstable();
            assert_eq!(times, sorted, "{story}");

            let jobs = l.recent_jobs(10).await.unwrap();
            assert_eq!(jobs.iter().map(|j| j.request_id).collect::<Vec<_>>(), vec![8, 7]);
            let table = crate::jobs::table(&jobs, 400_000);
            let lines: Vec<&str> = table.lines().collect();
            assert_eq!(lines.len(), 3, "{table}");
            assert!(lines[0].starts_with("JOB  REPOSITORY  STATE"), "{table}");
            assert!(lines[1].starts_with("8    org/repo    stuck: node degraded"), "{table}");
            assert!(lines[1].contains("6m39s"), "{table}");
            assert!(lines[1].ends_with("node degraded: n1 degraded (disk_low)"), "{table}");
            assert!(lines[2].starts_with("7    org/repo    completed: succeeded"), "{table}");
            assert!(lines[2].contains("  9.0s  "), "{table}");
            let json: serde_json::Value =
                serde_json::from_str(&crate::jobs::json(&jobs, 400_000)).unwrap();
            assert_eq!(json[0]["state"], "stuck: node degraded");
            assert_eq!(json[1]["waited_ms"], 9_000);
            assert_eq!(json[1]["attempt_classes"], serde_json::json!(["infra", "job"]));
            l.close().await;
        }
    }

    on_both_backends! {
        /// Records not written within the retention bound go with their
        /// attempts and waits; a job still wanted stays whatever its age.
        async fn old_job_records_are_pruned_but_not_a_wanted_job(db) {
            let l = db.ledger().await;
            l.note_jobs(&[note(1, JobStep::Assigned), note(2, JobStep::Assigned)], 100)
                .await
                .unwrap();
            l.record_wanted("linux-2cpu", 1001, &[crate::ledger::WantedChange::Assigned(2)], 100)
                .await
                .unwrap();
            l.record_waits("linux-2cpu", &[wait(1, Some(("no_capacity", ""))), wait(2, Some(("no_capacity", "")))], 200)
                .await
                .unwrap();
            l.note_jobs(&[note(3, JobStep::Assigned)], 5_000).await.unwrap();
            assert_eq!(l.prune_jobs(1_000).await.unwrap(), 1);
            assert!(l.job_record(1).await.unwrap().is_none());
            assert_eq!(l.job_record(2).await.unwrap().unwrap().waits.len(), 1);
            assert!(l.job_record(3).await.unwrap().is_some());
            let waits: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM job_waits WHERE request_id = 1")
                .fetch_one(&l.reader)
                .await
                .unwrap();
            assert_eq!(waits, 0);
            l.close().await;
        }
    }
}
