//! The jobs a plane must keep covered, durable (`wanted_jobs`, migration 6
//! on both backends): one row per job GitHub assigned to a tier's scale set
//! that no runner has taken and that is not completed or cancelled, keyed by
//! `(tier, scale_set_id, request_id)`, with when the plane first recorded it.
//!
//! The plane writes a message's changes here before it acknowledges the
//! message, so a plane started again on the same ledger wants what its
//! predecessor was told (ARCHITECTURE.md, "The plane's obligations", 1).
//! A row is keyed by its scale set's id as well as its tier: a set made
//! again under the same name is a new set, and GitHub dropped the old one's
//! jobs with it ([`Ledger::forget_other_scale_sets`]). Planes sharing a
//! PostgreSQL ledger each have a tier (a scale set) of their own and touch
//! only its rows.
//!
//! No lease rule lives here.

use super::{Ledger, Result};

/// One change to a scale set's wanted jobs, as a job message says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WantedChange {
    /// GitHub assigned the job (its runner request id) to the set: wanted
    /// until it is taken or ends. Recording it again changes nothing (a
    /// message delivered again), and keeps the first time.
    Assigned(i64),
    /// A runner took the job, or it completed or was cancelled, or the plane
    /// judged GitHub no longer has it: wanted no more. Forgetting a job that
    /// is not recorded changes nothing.
    Gone(i64),
}

impl Ledger {
    /// Applies `changes` to the wanted jobs of `tier`'s scale set
    /// `scale_set`, in order, in one write transaction, at `now_ms` (unix
    /// milliseconds, the time an assignment is recorded with).
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] or `Unavailable` when the ledger cannot
    /// be written; then nothing is changed.
    pub(crate) async fn record_wanted(
        &self,
        tier: &str,
        scale_set: i64,
        changes: &[WantedChange],
        now_ms: i64,
    ) -> Result<()> {
        if changes.is_empty() {
            return Ok(());
        }
        let mut tx = self.begin_write().await?;
        for change in changes {
            match *change {
                WantedChange::Assigned(request_id) => {
                    sqlx::query(
                        "INSERT INTO wanted_jobs (tier, scale_set_id, request_id, assigned_at_ms)
                         VALUES ($1, $2, $3, $4)
                         ON CONFLICT (tier, scale_set_id, request_id) DO NOTHING",
                    )
                    .bind(tier)
                    .bind(scale_set)
                    .bind(request_id)
                    .bind(now_ms)
                    .execute(&mut *tx)
                    .await?;
                }
                WantedChange::Gone(request_id) => {
                    sqlx::query(
                        "DELETE FROM wanted_jobs
                         WHERE tier = $1 AND scale_set_id = $2 AND request_id = $3",
                    )
                    .bind(tier)
                    .bind(scale_set)
                    .bind(request_id)
                    .execute(&mut *tx)
                    .await?;
                }
            }
        }
        tx.commit().await?;
        Ok(())
    }

    /// The wanted jobs of `tier`'s scale set `scale_set` (runner request
    /// ids), the earliest recorded first (ties by id).
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] or `Unavailable` when the ledger cannot
    /// be read.
    pub(crate) async fn wanted_jobs(&self, tier: &str, scale_set: i64) -> Result<Vec<i64>> {
        Ok(sqlx::query_scalar(
            "SELECT request_id FROM wanted_jobs WHERE tier = $1 AND scale_set_id = $2
             ORDER BY assigned_at_ms, request_id",
        )
        .bind(tier)
        .bind(scale_set)
        .fetch_all(&self.reader)
        .await?)
    }

    /// Forgets the wanted jobs recorded for `tier` under any scale set but
    /// `scale_set` (a set deleted and made again: GitHub dropped the old
    /// set's jobs with it). Returns how many were forgotten.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] or `Unavailable` when the ledger cannot
    /// be written.
    pub(crate) async fn forget_other_scale_sets(&self, tier: &str, scale_set: i64) -> Result<u64> {
        let mut tx = self.begin_write().await?;
        let gone = sqlx::query("DELETE FROM wanted_jobs WHERE tier = $1 AND scale_set_id <> $2")
            .bind(tier)
            .bind(scale_set)
            .execute(&mut *tx)
            .await?
            .rows_affected();
        tx.commit().await?;
        Ok(gone)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{code, on_both_backends};

    on_both_backends! {
        /// A job is wanted from its assignment until it is gone, once
        /// however often either is recorded, in the order first recorded;
        /// another handle (a plane started again) reads the same, and each
        /// tier and scale set keeps its own.
        async fn wanted_jobs_last_from_their_assignment_until_they_are_gone(db) {
            use WantedChange::{Assigned, Gone};
            let l = db.ledger().await;
            assert!(l.wanted_jobs("linux", 1001).await.unwrap().is_empty());
            l.record_wanted("linux", 1001, &[Assigned(7), Assigned(5)], 100).await.unwrap();
            l.record_wanted("linux", 1001, &[Assigned(9), Assigned(7)], 200).await.unwrap();
            l.record_wanted("linux", 1001, &[Assigned(11), Gone(11), Gone(12)], 300)
                .await
                .unwrap();
            l.record_wanted("mac", 1001, &[Assigned(1)], 100).await.unwrap();
            l.record_wanted("linux", 2002, &[Assigned(3)], 100).await.unwrap();
            l.close().await;
            let l = db.ledger().await;
            assert_eq!(l.wanted_jobs("linux", 1001).await.unwrap(), vec![5, 7, 9]);
            l.record_wanted("linux", 1001, &[Gone(7)], 400).await.unwrap();
            assert_eq!(l.wanted_jobs("linux", 1001).await.unwrap(), vec![5, 9]);
            assert_eq!(l.wanted_jobs("mac", 1001).await.unwrap(), vec![1]);
            assert_eq!(l.wanted_jobs("linux", 2002).await.unwrap(), vec![3]);
            l.close().await;
        }
    }

    on_both_backends! {
        /// A scale set made again under the tier's name drops the old set's
        /// jobs, and only that tier's.
        async fn a_scale_set_made_again_forgets_the_old_sets_wanted_jobs(db) {
            use WantedChange::Assigned;
            let l = db.ledger().await;
            l.record_wanted("linux", 1001, &[Assigned(5), Assigned(6)], 100).await.unwrap();
            l.record_wanted("linux", 2002, &[Assigned(7)], 100).await.unwrap();
            l.record_wanted("mac", 1001, &[Assigned(8)], 100).await.unwrap();
            assert_eq!(l.forget_other_scale_sets("linux", 2002).await.unwrap(), 2);
            assert!(l.wanted_jobs("linux", 1001).await.unwrap().is_empty());
            assert_eq!(l.wanted_jobs("linux", 2002).await.unwrap(), vec![7]);
            assert_eq!(l.wanted_jobs("mac", 1001).await.unwrap(), vec![8]);
            assert_eq!(l.forget_other_scale_sets("linux", 2002).await.unwrap(), 0);
            l.close().await;
            assert_eq!(code(l.wanted_jobs("linux", 2002).await), "unavailable");
        }
    }
}
