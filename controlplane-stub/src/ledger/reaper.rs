//! The plane's reclaims: `reap` (expired leases to quarantine or failed),
//! `reconcile` (quarantine freed by a node's inventory) and `force_release`
//! (an operator's release), after §1.7 and §1.8.
//!
//! This is the only code that bumps an epoch, which is what fences the
//! previous holder; every update here still carries
//! `WHERE id = $n AND epoch = $m` with the epoch it read in the same
//! transaction. On PostgreSQL `reap` and `reconcile` lock what they read
//! with `FOR UPDATE SKIP LOCKED`: a lease a holder (or another plane's
//! reaper) is writing right now is left for the next tick, so each lease is
//! reclaimed once, and a reaper never waits on, nor deadlocks with, a
//! holder. A skipped row is re-read on the next tick, where a renewal it
//! was waiting on has moved its expiry. A lease that may have compute is quarantined, never freed,
//! and stays charged until proof: a node's inventory past the grace, or an
//! operator. Nothing here takes an epoch from a caller, and nothing here
//! moves a lease along its ordinary path (assigned, launching, online,
//! busy, custody, teardown): that is the holder's.

use std::collections::HashSet;
use std::time::Duration;

use billet_proto::ending::ReasonCode;
use sqlx::Row;

use super::schema::{db_epoch, duration_ms, lease_from_row, load_for_write};
use super::{
    Dialect, ForceReleaseOutcome, INVENTORY_ABSENCE, Ledger, LedgerError, Phase, REAP_BATCH,
    ReapReport, Result, expect_one_row,
};

/// The expired live leases, oldest first.
const EXPIRED: Dialect = Dialect {
    sqlite: "SELECT * FROM leases
             WHERE phase NOT IN ('done', 'failed', 'quarantine') AND expires_at_ms < $1
             ORDER BY expires_at_ms, id LIMIT $2",
    postgres: "SELECT * FROM leases
             WHERE phase NOT IN ('done', 'failed', 'quarantine') AND expires_at_ms < $1
             ORDER BY expires_at_ms, id LIMIT $2
             FOR UPDATE SKIP LOCKED",
};

/// A node's quarantined leases expired before `$2`.
const QUARANTINED_BEFORE: Dialect = Dialect {
    sqlite: "SELECT id, epoch FROM leases
             WHERE phase = 'quarantine' AND node = $1 AND expires_at_ms < $2
             ORDER BY id",
    postgres: "SELECT id, epoch FROM leases
             WHERE phase = 'quarantine' AND node = $1 AND expires_at_ms < $2
             ORDER BY id
             FOR UPDATE SKIP LOCKED",
};

impl Ledger {
    /// Reclaims up to [`REAP_BATCH`] live leases whose `expires_at_ms` is
    /// before `now_ms`, oldest first (§1.7). One that may have compute goes
    /// to quarantine (epoch + 1, `held_at_ms` set if empty, still charged);
    /// escrow nobody launched (capacity, assigned) fails (epoch + 1, freed).
    /// A quarantined lease is never reaped again.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub(crate) async fn reap(&self, now_ms: i64) -> Result<ReapReport> {
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(self.sql(EXPIRED))
            .bind(now_ms)
            .bind(REAP_BATCH)
            .fetch_all(&mut *tx)
            .await?;
        let mut report = ReapReport::default();
        for row in &rows {
            let lease = lease_from_row(row)?;
            let (sql, list) = if lease.phase.may_have_compute() {
                (
                    "UPDATE leases SET phase = 'quarantine', epoch = epoch + 1,
                        held_at_ms = COALESCE(held_at_ms, $1)
                     WHERE id = $2 AND epoch = $3",
                    &mut report.quarantined,
                )
            } else {
                (
                    "UPDATE leases SET phase = 'failed', epoch = epoch + 1, ended_at_ms = $1
                     WHERE id = $2 AND epoch = $3",
                    &mut report.failed,
                )
            };
            let done = sqlx::query(sql)
                .bind(now_ms)
                .bind(&lease.id)
                .bind(db_epoch(lease.epoch))
                .execute(&mut *tx)
                .await?;
            expect_one_row(done.rows_affected(), &lease.id)?;
            list.push(lease.id);
        }
        tx.commit().await?;
        if !report.quarantined.is_empty() {
            tracing::warn!(
                quarantined = ?report.quarantined,
                "expired leases may still have compute; quarantined and still charged"
            );
        }
        if !report.failed.is_empty() {
            tracing::info!(failed = ?report.failed, "expired unlaunched leases failed and freed");
        }
        Ok(report)
    }

    /// Frees quarantined leases bound to `node` that have been expired for
    /// longer than `grace` and that `running` (the node's complete inventory
    /// of lease ids) does not list: each becomes failed with epoch + 1 and
    /// failure reason [`INVENTORY_ABSENCE`] unless one was recorded (§1.8).
    /// Nothing else is touched. Returns how many were freed.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub(crate) async fn reconcile(
        &self,
        node: &str,
        running: &[String],
        grace: Duration,
        now_ms: i64,
    ) -> Result<u32> {
        let grace_ms = duration_ms("grace", grace)?;
        let running: HashSet<&str> = running.iter().map(String::as_str).collect();
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(self.sql(QUARANTINED_BEFORE))
            .bind(node)
            .bind(now_ms.saturating_sub(grace_ms))
            .fetch_all(&mut *tx)
            .await?;
        let mut freed = 0u32;
        for row in &rows {
            let id: String = row.try_get("id")?;
            let epoch: i64 = row.try_get("epoch")?;
            if running.contains(id.as_str()) {
                continue;
            }
            let done = sqlx::query(
                "UPDATE leases SET phase = 'failed', epoch = epoch + 1, ended_at_ms = $1,
                    failure_reason = COALESCE(failure_reason, $2),
                    end_reason = COALESCE(end_reason, $5)
                 WHERE id = $3 AND epoch = $4",
            )
            .bind(now_ms)
            .bind(INVENTORY_ABSENCE)
            .bind(&id)
            .bind(epoch)
            .bind(ReasonCode::NodeLost.as_str())
            .execute(&mut *tx)
            .await?;
            expect_one_row(done.rows_affected(), &id)?;
            freed += 1;
        }
        tx.commit().await?;
        if freed > 0 {
            tracing::info!(
                node,
                freed,
                "quarantined leases absent from the node's inventory freed"
            );
        }
        Ok(freed)
    }

    /// An operator's release. A quarantined lease fails at once (epoch + 1,
    /// freed). A lease in custody or teardown is flagged; its holder sees
    /// `ForceRelease` on its next heartbeat and releases it itself. Repeating
    /// on a flagged lease reports `Pending` again.
    ///
    /// # Errors
    ///
    /// `NotFound` for an unknown or ended lease; `Invalid` for any other
    /// phase (a running lease is released by its node).
    #[cfg_attr(
        not(test),
        expect(
            dead_code,
            reason = "no command of the stub force-releases yet; the ledger's tests do"
        )
    )]
    pub(crate) async fn force_release(&self, id: &str, now_ms: i64) -> Result<ForceReleaseOutcome> {
        let mut tx = self.begin_write().await?;
        let lease = load_for_write(&mut tx, self.backend, id)
            .await?
            .filter(|l| !l.phase.is_terminal())
            .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
        let (sql, outcome) = match lease.phase {
            Phase::Quarantine => (
                "UPDATE leases SET phase = 'failed', epoch = epoch + 1, ended_at_ms = $1
                 WHERE id = $2 AND epoch = $3",
                ForceReleaseOutcome::Freed,
            ),
            Phase::Custody | Phase::Teardown => (
                "UPDATE leases SET force_release = 1, held_at_ms = COALESCE(held_at_ms, $1)
                 WHERE id = $2 AND epoch = $3",
                ForceReleaseOutcome::Pending,
            ),
            phase => {
                return Err(LedgerError::Invalid(format!(
                    "lease {id} is {phase}: force release applies only to leases in custody, \
                     teardown or quarantine; a lease in {phase} is released by its holder"
                )));
            }
        };
        let done = sqlx::query(sql)
            .bind(now_ms)
            .bind(id)
            .bind(db_epoch(lease.epoch))
            .execute(&mut *tx)
            .await?;
        expect_one_row(done.rows_affected(), id)?;
        tx.commit().await?;
        tracing::warn!(lease = id, ?outcome, "lease force-released by an operator");
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{TTL_MS, code, lease_in, new_lease, on_both_backends};

    on_both_backends! {
        async fn a_reaped_holder_is_told_fenced_not_not_found(db) {
            let l = db.ledger().await;
            l.reserve(new_lease("escrow"), 0).await.unwrap();
            lease_in(&l, "live", "n1", &[Phase::Launching], 0).await;
            l.reap(TTL_MS + 1).await.unwrap();
            for id in ["escrow", "live"] {
                let err = l.heartbeat(id, 1, "n1", TTL_MS + 2).await.unwrap_err();
                assert!(
                    matches!(
                        err,
                        LedgerError::Fenced {
                            held: 2,
                            presented: 1,
                            ..
                        }
                    ),
                    "{id}: {err}"
                );
                assert_eq!(
                    code(l.release(id, 1, None, Phase::Failed, TTL_MS + 2).await),
                    "fenced"
                );
            }
        }
    }

    on_both_backends! {
        async fn reap_quarantines_leases_that_may_have_compute_and_fails_the_rest(db) {
            let l = db.ledger().await;
            l.reserve(new_lease("escrow"), 0).await.unwrap();
            lease_in(&l, "bound", "n1", &[], 0).await;
            lease_in(&l, "launching", "n1", &[Phase::Launching], 0).await;
            lease_in(&l, "online", "n1", &[Phase::Launching, Phase::Online], 0).await;
            use Phase::{Busy, Custody, Launching, Online, Teardown};
            lease_in(&l, "busy", "n1", &[Launching, Online, Busy], 0).await;
            lease_in(&l, "custody", "n1", &[Launching, Online, Custody], 0).await;
            lease_in(&l, "teardown", "n1", &[Launching, Teardown], 0).await;
            lease_in(&l, "fresh", "n1", &[Launching], 1_000).await;
            lease_in(&l, "ended", "n1", &[Launching], 0).await;
            l.release("ended", 1, Some("n1"), Phase::Done, 0)
                .await
                .unwrap();

            assert_eq!(
                l.reap(TTL_MS).await.unwrap(),
                ReapReport::default(),
                "not yet expired"
            );
            let now = TTL_MS + 1;
            let report = l.reap(now).await.unwrap();
            let mut quarantined = report.quarantined.clone();
            quarantined.sort();
            assert_eq!(
                quarantined,
                ["busy", "custody", "launching", "online", "teardown"]
            );
            let mut failed = report.failed.clone();
            failed.sort();
            assert_eq!(failed, ["bound", "escrow"]);

            for id in &report.quarantined {
                let lease = l.get(id).await.unwrap().unwrap();
                assert_eq!((lease.phase, lease.epoch), (Phase::Quarantine, 2), "{id}");
                let held = if id == "custody" || id == "teardown" {
                    0
                } else {
                    now
                };
                assert_eq!(lease.held_at_ms, Some(held), "{id}");
                assert_eq!(lease.ended_at_ms, None);
            }
            for id in &report.failed {
                let lease = l.get(id).await.unwrap().unwrap();
                assert_eq!(
                    (lease.phase, lease.epoch, lease.ended_at_ms),
                    (Phase::Failed, 2, Some(now))
                );
            }
            let fresh = l.get("fresh").await.unwrap().unwrap();
            assert_eq!((fresh.phase, fresh.epoch), (Phase::Launching, 1));
            let ended = l.get("ended").await.unwrap().unwrap();
            assert_eq!((ended.phase, ended.epoch), (Phase::Done, 1));

            // Quarantine stays charged: five quarantined plus "fresh".
            assert_eq!(l.charged().await.unwrap().leases, 6);
            // A quarantined lease is never reaped again, so its epoch moves once.
            let later = l.reap(now + 10 * TTL_MS).await.unwrap();
            assert_eq!(later.quarantined, ["fresh"]);
            assert_eq!(l.get("busy").await.unwrap().unwrap().epoch, 2);

            let (launched, quarantined) = l.launched("n1").await.unwrap();
            assert!(launched.is_empty(), "{launched:?}");
            assert_eq!(quarantined.len(), 6);
        }
    }

    on_both_backends! {
        async fn reconcile_frees_only_absent_quarantined_leases_after_the_grace(db) {
            let l = db.ledger().await;
            use Phase::Launching;
            for id in ["absent", "present", "reasoned"] {
                lease_in(&l, id, "n1", &[Launching], 0).await;
            }
            l.mark_failure("reasoned", 1, "spot interruption", 0)
                .await
                .unwrap();
            lease_in(&l, "other-node", "n2", &[Launching], 0).await;
            l.reap(TTL_MS + 1).await.unwrap();
            // A live lease on the same node, absent from the inventory.
            lease_in(&l, "live", "n1", &[Launching], 10 * TTL_MS).await;

            let grace = Duration::from_secs(300);
            let running = vec!["present".to_owned()];
            let within = TTL_MS + 300_000;
            assert_eq!(l.reconcile("n1", &running, grace, within).await.unwrap(), 0);

            let after = within + 1;
            assert_eq!(l.reconcile("n1", &running, grace, after).await.unwrap(), 2);
            let absent = l.get("absent").await.unwrap().unwrap();
            assert_eq!((absent.phase, absent.epoch), (Phase::Failed, 3));
            assert_eq!(absent.failure_reason.as_deref(), Some(INVENTORY_ABSENCE));
            assert_eq!(absent.ended_at_ms, Some(after));
            let reasoned = l.get("reasoned").await.unwrap().unwrap();
            assert_eq!(
                reasoned.failure_reason.as_deref(),
                Some("spot interruption")
            );
            let present = l.get("present").await.unwrap().unwrap();
            assert_eq!((present.phase, present.epoch), (Phase::Quarantine, 2));
            let other = l.get("other-node").await.unwrap().unwrap();
            assert_eq!(
                other.phase,
                Phase::Quarantine,
                "another node's inventory is not ours"
            );
            let live = l.get("live").await.unwrap().unwrap();
            assert_eq!(
                live.phase,
                Phase::Launching,
                "reconcile never touches live leases"
            );

            assert_eq!(l.reconcile("n1", &running, grace, after).await.unwrap(), 0);
            assert_eq!(l.reconcile("n2", &[], grace, after).await.unwrap(), 1);
        }
    }

    on_both_backends! {
        async fn force_release_frees_quarantine_and_asks_a_custody_holder_to_let_go(db) {
            let l = db.ledger().await;
            use Phase::{Custody, Launching, Online};
            lease_in(&l, "q", "n1", &[Launching], 0).await;
            l.reap(TTL_MS + 1).await.unwrap();
            let now = TTL_MS + 2;
            lease_in(&l, "held", "n1", &[Launching, Online, Custody], now).await;
            lease_in(&l, "online", "n1", &[Launching, Online], now).await;

            assert_eq!(
                l.force_release("q", now).await.unwrap(),
                ForceReleaseOutcome::Freed
            );
            let q = l.get("q").await.unwrap().unwrap();
            assert_eq!((q.phase, q.epoch), (Phase::Failed, 3));
            assert_eq!(code(l.force_release("q", now).await), "not_found");

            assert_eq!(
                l.force_release("held", now).await.unwrap(),
                ForceReleaseOutcome::Pending
            );
            assert_eq!(
                l.force_release("held", now).await.unwrap(),
                ForceReleaseOutcome::Pending
            );
            let held = l.get("held").await.unwrap().unwrap();
            assert!(held.force_release);
            assert_eq!((held.phase, held.epoch), (Phase::Custody, 1));
            assert_eq!(
                code(l.heartbeat("held", 1, "n1", now).await),
                "force_release"
            );
            l.release("held", 1, Some("n1"), Phase::Failed, now)
                .await
                .unwrap();

            assert_eq!(code(l.force_release("online", now).await), "invalid");
            assert_eq!(code(l.force_release("missing", now).await), "not_found");
            assert_eq!(l.get("online").await.unwrap().unwrap().phase, Phase::Online);
        }
    }
}
