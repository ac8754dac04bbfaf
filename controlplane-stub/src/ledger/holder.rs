//! The holder's writes: `reserve` opens a lease at epoch 1, and `bind`,
//! `advance`, `heartbeat`, `release`, `mark_failure` and `set_runner` change
//! it for whoever presents its epoch (the node it is bound to, or the plane
//! before a bind).
//!
//! Each of those six reads the row through `load_fenced` or `load_open`
//! inside its `BEGIN IMMEDIATE` transaction, compares the epoch before
//! trusting anything else in the row, and updates only
//! `WHERE id = ? AND epoch = ?` (§1.5). None of them bumps an epoch or
//! enters quarantine: reclaiming belongs to `reaper.rs` alone.

use sqlx::sqlite::SqliteConnection;
use sqlx::{Sqlite, Transaction};

use super::schema::{db_epoch, load, to_i64};
use super::{
    INVENTORY_ABSENCE, Lease, Ledger, LedgerError, NewLease, Phase, Result, expect_one_row,
};

/// Longest lease id accepted, in bytes.
const MAX_LEASE_ID_LEN: usize = 128;

impl Ledger {
    /// Opens a lease for a job GitHub assigned: phase `assigned`, epoch 1,
    /// unbound, expiring `now_ms + ttl`.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`] for a malformed id or a zero size;
    /// [`LedgerError::Conflict`] when the id is taken.
    pub async fn reserve(&self, new: NewLease, now_ms: i64) -> Result<Lease> {
        check_lease_id(&new.id)?;
        if new.vcpu == 0 || new.memory_bytes == 0 {
            return Err(LedgerError::Invalid(format!(
                "lease {} must charge at least one vCPU and one byte of memory",
                new.id
            )));
        }
        let memory_bytes = to_i64("memory_bytes", new.memory_bytes)?;
        let expires_at_ms = now_ms.saturating_add(self.ttl_ms());
        let mut tx = self.begin_write().await?;
        if load(&mut tx, &new.id).await?.is_some() {
            return Err(LedgerError::Conflict(format!(
                "lease {} already exists; lease ids are never reused",
                new.id
            )));
        }
        sqlx::query(
            "INSERT INTO leases (id, epoch, phase, tier, request_id, runner_name, vcpu,
                memory_bytes, expires_at_ms, heartbeat_at_ms, created_at_ms)
             VALUES (?, 1, 'assigned', ?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&new.id)
        .bind(&new.tier)
        .bind(new.request_id)
        .bind(&new.runner_name)
        .bind(i64::from(new.vcpu))
        .bind(memory_bytes)
        .bind(expires_at_ms)
        .bind(now_ms)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        finish(tx, &new.id).await
    }

    /// Binds the lease to `node`. Binding again to the same node is a no-op.
    /// Does not renew the lease (§1.7).
    ///
    /// # Errors
    ///
    /// `NotFound` (unknown or ended), `Fenced`, and `WrongNode` when the
    /// lease is bound elsewhere or is already past `assigned` without a node
    /// (it is never adopted).
    pub async fn bind(&self, id: &str, epoch: u64, node: &str, _now_ms: i64) -> Result<Lease> {
        let mut tx = self.begin_write().await?;
        let lease = load_open(&mut tx, id, epoch).await?;
        match lease.node.as_deref() {
            Some(bound) if bound == node => return Ok(lease),
            Some(_) => return Err(wrong_node(&lease, node)),
            None if !matches!(lease.phase, Phase::Capacity | Phase::Assigned) => {
                return Err(wrong_node(&lease, node));
            }
            None => {}
        }
        let done = sqlx::query("UPDATE leases SET node = ? WHERE id = ? AND epoch = ?")
            .bind(node)
            .bind(id)
            .bind(db_epoch(epoch))
            .execute(&mut *tx)
            .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }

    /// Moves the lease bound to `node` to `to`, renewing it. Staying in the
    /// same phase is a no-op. Entering custody or teardown records
    /// `held_at_ms` if empty; entering done or failed records `ended_at_ms`.
    ///
    /// # Errors
    ///
    /// `NotFound`, `Fenced`, `WrongNode` (not bound to `node`), and
    /// `BadTransition` for an illegal edge or any request to enter
    /// quarantine, which only the reaper may do.
    pub async fn advance(
        &self,
        id: &str,
        epoch: u64,
        node: &str,
        to: Phase,
        now_ms: i64,
    ) -> Result<Lease> {
        let mut tx = self.begin_write().await?;
        let lease = load_open(&mut tx, id, epoch).await?;
        if lease.node.as_deref() != Some(node) {
            return Err(wrong_node(&lease, node));
        }
        if to == Phase::Quarantine {
            return Err(bad_transition(&lease, to));
        }
        if lease.phase == to {
            return Ok(lease);
        }
        if !lease.phase.can_move_to(to) {
            return Err(bad_transition(&lease, to));
        }
        let holds = matches!(to, Phase::Custody | Phase::Teardown);
        let done = sqlx::query(
            "UPDATE leases SET phase = ?, heartbeat_at_ms = ?, expires_at_ms = ?,
                held_at_ms = CASE WHEN ? THEN COALESCE(held_at_ms, ?) ELSE held_at_ms END,
                ended_at_ms = CASE WHEN ? THEN ? ELSE ended_at_ms END
             WHERE id = ? AND epoch = ?",
        )
        .bind(to.as_str())
        .bind(now_ms)
        .bind(now_ms.saturating_add(self.ttl_ms()))
        .bind(holds)
        .bind(now_ms)
        .bind(to.is_terminal())
        .bind(now_ms)
        .bind(id)
        .bind(db_epoch(epoch))
        .execute(&mut *tx)
        .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }

    /// Renews the lease: `expires_at_ms = now_ms + ttl`. An unbound lease
    /// may be renewed by anyone holding its epoch (the plane, before a bind).
    ///
    /// # Errors
    ///
    /// `NotFound`, `Fenced`, `ForceRelease` when an operator asked the holder
    /// to let go, `WrongNode` when bound to another node.
    pub async fn heartbeat(&self, id: &str, epoch: u64, node: &str, now_ms: i64) -> Result<Lease> {
        let mut tx = self.begin_write().await?;
        renew(&mut tx, id, epoch, node, now_ms, self.ttl_ms()).await?;
        finish(tx, id).await
    }

    /// Renews every `(lease id, epoch)` of `leases` for `node` in one write
    /// transaction, each checked and renewed exactly as
    /// [`Ledger::heartbeat`] does; a lease refused gets its own error in
    /// its place and the others are renewed all the same. What a node's
    /// batched `Heartbeat` asks, answered with one commit whatever its
    /// length.
    ///
    /// # Errors
    ///
    /// The outer error when the transaction cannot be opened or committed:
    /// then nothing was renewed. Per lease, as [`Ledger::heartbeat`].
    pub async fn heartbeat_all(
        &self,
        leases: &[(String, u64)],
        node: &str,
        now_ms: i64,
    ) -> Result<Vec<Result<()>>> {
        let mut tx = self.begin_write().await?;
        let mut results = Vec::with_capacity(leases.len());
        for (id, epoch) in leases {
            results.push(renew(&mut tx, id, *epoch, node, now_ms, self.ttl_ms()).await);
        }
        tx.commit().await?;
        Ok(results)
    }

    /// Ends the lease with `outcome` (`Done` or `Failed`), freeing its
    /// capacity; the epoch is not bumped. `node` is the asking node, or
    /// `None` when the plane itself releases. Releasing an ended lease again
    /// with the same outcome is a no-op.
    ///
    /// The epoch is checked even for an ended lease, so a holder whose lease
    /// was reclaimed learns `Fenced` rather than a misleading success (§1.5).
    ///
    /// # Errors
    ///
    /// `Invalid` for a non-terminal outcome, `NotFound` for an unknown id,
    /// `Fenced`, `WrongNode` when `node` is given and the lease is not bound
    /// to it, `Conflict` when it already ended with the other outcome.
    pub async fn release(
        &self,
        id: &str,
        epoch: u64,
        node: Option<&str>,
        outcome: Phase,
        now_ms: i64,
    ) -> Result<Lease> {
        if !outcome.is_terminal() {
            return Err(LedgerError::Invalid(format!(
                "lease {id} can only be released as done or failed, not {outcome}"
            )));
        }
        let mut tx = self.begin_write().await?;
        let lease = load_fenced(&mut tx, id, epoch).await?;
        if let Some(node) = node
            && lease.node.as_deref() != Some(node)
        {
            return Err(wrong_node(&lease, node));
        }
        if lease.phase.is_terminal() {
            return if lease.phase == outcome {
                Ok(lease)
            } else {
                Err(LedgerError::Conflict(format!(
                    "lease {id} already ended as {}; it cannot also end as {outcome}",
                    lease.phase
                )))
            };
        }
        let done =
            sqlx::query("UPDATE leases SET phase = ?, ended_at_ms = ? WHERE id = ? AND epoch = ?")
                .bind(outcome.as_str())
                .bind(now_ms)
                .bind(id)
                .bind(db_epoch(epoch))
                .execute(&mut *tx)
                .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }

    /// Records why the job will fail. The first reason stays; the same
    /// reason again is a no-op. Capacity stays charged.
    ///
    /// # Errors
    ///
    /// `Invalid` for a blank reason or the reserved [`INVENTORY_ABSENCE`];
    /// `NotFound`, `Fenced`; `Conflict` when another reason is recorded.
    pub async fn mark_failure(
        &self,
        id: &str,
        epoch: u64,
        reason: &str,
        _now_ms: i64,
    ) -> Result<Lease> {
        if reason.trim().is_empty() {
            return Err(LedgerError::Invalid(format!(
                "a failure reason for lease {id} must not be blank"
            )));
        }
        if reason == INVENTORY_ABSENCE {
            return Err(LedgerError::Invalid(format!(
                "{INVENTORY_ABSENCE} is reserved for the ledger's own inventory reconciliation"
            )));
        }
        let mut tx = self.begin_write().await?;
        let lease = load_open(&mut tx, id, epoch).await?;
        match lease.failure_reason.as_deref() {
            Some(recorded) if recorded == reason => return Ok(lease),
            Some(recorded) => {
                return Err(LedgerError::Conflict(format!(
                    "lease {id} already records failure reason {recorded:?}; the first reason stays"
                )));
            }
            None => {}
        }
        let done = sqlx::query("UPDATE leases SET failure_reason = ? WHERE id = ? AND epoch = ?")
            .bind(reason)
            .bind(id)
            .bind(db_epoch(epoch))
            .execute(&mut *tx)
            .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }

    /// Records the runner registration minted for the lease. Recording the
    /// same name again replaces the id (a re-registration under the same
    /// name); a different name than the one recorded is refused.
    ///
    /// # Errors
    ///
    /// `NotFound`, `Fenced`; `Conflict` for a second, different name;
    /// `Invalid` for an empty name.
    pub async fn set_runner(
        &self,
        id: &str,
        epoch: u64,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Lease> {
        if runner_name.is_empty() {
            return Err(LedgerError::Invalid(format!(
                "the runner name recorded for lease {id} must not be empty"
            )));
        }
        let mut tx = self.begin_write().await?;
        let lease = load_open(&mut tx, id, epoch).await?;
        if let (Some(recorded), Some(_)) = (lease.runner_name.as_deref(), lease.runner_id)
            && recorded != runner_name
        {
            return Err(LedgerError::Conflict(format!(
                "lease {id} already has runner {recorded} registered; it cannot also have \
                 {runner_name}"
            )));
        }
        if lease.runner_id == Some(runner_id) && lease.runner_name.as_deref() == Some(runner_name) {
            return Ok(lease);
        }
        let done = sqlx::query(
            "UPDATE leases SET runner_id = ?, runner_name = ? WHERE id = ? AND epoch = ?",
        )
        .bind(runner_id)
        .bind(runner_name)
        .bind(id)
        .bind(db_epoch(epoch))
        .execute(&mut *tx)
        .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }
}

/// Loads the lease and checks the epoch before anything else in the row.
/// Ended leases are returned too (for `release`'s idempotency).
async fn load_fenced(conn: &mut SqliteConnection, id: &str, epoch: u64) -> Result<Lease> {
    let lease = load(conn, id)
        .await?
        .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
    if lease.epoch != epoch {
        return Err(LedgerError::Fenced {
            lease: lease.id,
            held: lease.epoch,
            presented: epoch,
        });
    }
    Ok(lease)
}

/// As [`load_fenced`], with an ended lease reported as `NotFound`.
async fn load_open(conn: &mut SqliteConnection, id: &str, epoch: u64) -> Result<Lease> {
    let lease = load_fenced(conn, id, epoch).await?;
    if lease.phase.is_terminal() {
        return Err(LedgerError::NotFound(lease.id));
    }
    Ok(lease)
}

/// Renews one lease inside a write transaction: fenced and open, not asked
/// to be given up, bound to `node` or to none.
async fn renew(
    conn: &mut SqliteConnection,
    id: &str,
    epoch: u64,
    node: &str,
    now_ms: i64,
    ttl_ms: i64,
) -> Result<()> {
    let lease = load_open(conn, id, epoch).await?;
    if lease.force_release {
        return Err(LedgerError::ForceRelease(lease.id));
    }
    if lease.node.as_deref().is_some_and(|bound| bound != node) {
        return Err(wrong_node(&lease, node));
    }
    let done = sqlx::query(
        "UPDATE leases SET heartbeat_at_ms = ?, expires_at_ms = ? WHERE id = ? AND epoch = ?",
    )
    .bind(now_ms)
    .bind(now_ms.saturating_add(ttl_ms))
    .bind(id)
    .bind(db_epoch(epoch))
    .execute(&mut *conn)
    .await?;
    expect_one_row(done.rows_affected(), id)
}

/// Reads the lease back inside the transaction and commits.
async fn finish(mut tx: Transaction<'static, Sqlite>, id: &str) -> Result<Lease> {
    let lease = load(&mut tx, id)
        .await?
        .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
    tx.commit().await?;
    Ok(lease)
}

fn wrong_node(lease: &Lease, asked: &str) -> LedgerError {
    LedgerError::WrongNode {
        lease: lease.id.clone(),
        bound: lease.node.clone(),
        asked: asked.to_owned(),
    }
}

fn bad_transition(lease: &Lease, to: Phase) -> LedgerError {
    LedgerError::BadTransition {
        lease: lease.id.clone(),
        from: lease.phase,
        to,
    }
}

fn check_lease_id(id: &str) -> Result<()> {
    let ok = !id.is_empty()
        && id.len() <= MAX_LEASE_ID_LEN
        && id
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'));
    if ok {
        Ok(())
    } else {
        Err(LedgerError::Invalid(format!(
            "lease id {id:?} must be 1 to {MAX_LEASE_ID_LEN} ASCII letters, digits, '-', '_' or '.'"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{TTL, TTL_MS, code, lease_in, ledger, new_lease};

    #[tokio::test]
    async fn a_reservation_is_assigned_at_epoch_one_and_expires_after_the_ttl() {
        let l = ledger().await;
        let lease = l.reserve(new_lease("a"), 1_000).await.unwrap();
        assert_eq!(lease.phase, Phase::Assigned);
        assert_eq!(lease.epoch, 1);
        assert_eq!(lease.node, None);
        assert_eq!(lease.expires_at_ms, 1_000 + TTL_MS);
        assert_eq!(lease.runner_name.as_deref(), Some("billet-a"));
        assert_eq!(l.lease_ttl(), TTL);
        assert_eq!(code(l.reserve(new_lease("a"), 1_000).await), "conflict");
        assert_eq!(code(l.reserve(new_lease("a b"), 1_000).await), "invalid");
        let mut empty = new_lease("z");
        empty.vcpu = 0;
        assert_eq!(code(l.reserve(empty, 1_000).await), "invalid");
    }

    /// Issue #14: one transaction renews the batch; each lease's refusal
    /// is its own, in its place, and does not stop the others.
    #[tokio::test]
    async fn a_batched_heartbeat_renews_each_lease_it_may_and_refuses_the_others_in_place() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
        lease_in(&l, "b", "n2", &[Phase::Launching], 0).await;
        lease_in(&l, "c", "n1", &[Phase::Launching], 0).await;
        let asked = [
            ("a".to_owned(), 1),
            ("b".to_owned(), 1),
            ("missing".to_owned(), 1),
            ("c".to_owned(), 2),
            ("c".to_owned(), 1),
        ];
        let results = l.heartbeat_all(&asked, "n1", 5_000).await.unwrap();
        let codes: Vec<&str> = results
            .iter()
            .map(|r| r.as_ref().map_or_else(LedgerError::code, |()| "ok"))
            .collect();
        assert_eq!(codes, ["ok", "wrong_node", "not_found", "fenced", "ok"]);
        for id in ["a", "c"] {
            let lease = l.get(id).await.unwrap().unwrap();
            assert_eq!(lease.expires_at_ms, 5_000 + TTL_MS, "{id} not renewed");
        }
        let b = l.get("b").await.unwrap().unwrap();
        assert_eq!(b.expires_at_ms, TTL_MS, "another node's lease was renewed");
        assert!(l.heartbeat_all(&[], "n1", 6_000).await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn every_holder_write_refuses_a_stale_epoch() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
        let stale = 2;
        let refusals = [
            code(l.bind("a", stale, "n1", 1).await),
            code(l.advance("a", stale, "n1", Phase::Online, 1).await),
            code(l.heartbeat("a", stale, "n1", 1).await),
            code(l.release("a", stale, Some("n1"), Phase::Done, 1).await),
            code(l.release("a", stale, None, Phase::Done, 1).await),
            code(l.mark_failure("a", stale, "spot interruption", 1).await),
            code(l.set_runner("a", stale, 5, "billet-a").await),
        ];
        assert_eq!(refusals, ["fenced"; 7]);
        let lease = l.get("a").await.unwrap().unwrap();
        assert_eq!((lease.phase, lease.epoch), (Phase::Launching, 1));
        assert_eq!(lease.runner_id, None);
        assert_eq!(lease.failure_reason, None);
    }

    #[tokio::test]
    async fn bind_advance_and_release_repeat_without_effect() {
        let l = ledger().await;
        l.reserve(new_lease("a"), 0).await.unwrap();
        let first = l.bind("a", 1, "n1", 10).await.unwrap();
        let again = l.bind("a", 1, "n1", 20).await.unwrap();
        assert_eq!(first, again);

        let launching = l.advance("a", 1, "n1", Phase::Launching, 30).await.unwrap();
        assert_eq!(launching.expires_at_ms, 30 + TTL_MS);
        let repeat = l.advance("a", 1, "n1", Phase::Launching, 40).await.unwrap();
        assert_eq!(repeat, launching, "a repeated advance changes nothing");

        let done = l
            .release("a", 1, Some("n1"), Phase::Done, 50)
            .await
            .unwrap();
        assert_eq!(
            (done.phase, done.ended_at_ms, done.epoch),
            (Phase::Done, Some(50), 1)
        );
        let again = l
            .release("a", 1, Some("n1"), Phase::Done, 60)
            .await
            .unwrap();
        assert_eq!(again, done);
        assert_eq!(
            code(l.release("a", 1, Some("n1"), Phase::Failed, 60).await),
            "conflict"
        );
        assert_eq!(
            code(l.release("a", 1, None, Phase::Busy, 60).await),
            "invalid"
        );
        assert_eq!(code(l.bind("a", 1, "n1", 70).await), "not_found");
        assert_eq!(
            code(l.advance("a", 1, "n1", Phase::Online, 70).await),
            "not_found"
        );
        assert_eq!(code(l.heartbeat("a", 1, "n1", 70).await), "not_found");
        assert_eq!(code(l.heartbeat("missing", 1, "n1", 70).await), "not_found");
    }

    #[tokio::test]
    async fn advance_follows_the_table_and_never_enters_quarantine() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[], 0).await;
        let err = l.advance("a", 1, "n1", Phase::Busy, 1).await.unwrap_err();
        assert!(matches!(
            err,
            LedgerError::BadTransition {
                from: Phase::Assigned,
                to: Phase::Busy,
                ..
            }
        ));
        l.advance("a", 1, "n1", Phase::Launching, 1).await.unwrap();
        assert_eq!(
            code(l.advance("a", 1, "n1", Phase::Quarantine, 2).await),
            "bad_transition"
        );
        l.advance("a", 1, "n1", Phase::Online, 3).await.unwrap();
        let custody = l.advance("a", 1, "n1", Phase::Custody, 4).await.unwrap();
        assert_eq!(custody.held_at_ms, Some(4));
        let teardown = l.advance("a", 1, "n1", Phase::Teardown, 5).await.unwrap();
        assert_eq!(teardown.held_at_ms, Some(4), "held_at keeps the first hold");
        assert_eq!(teardown.heartbeat_at_ms, 5);
        assert_eq!(
            code(l.advance("a", 1, "n1", Phase::Online, 6).await),
            "bad_transition"
        );
        let failed = l.advance("a", 1, "n1", Phase::Failed, 7).await.unwrap();
        assert_eq!((failed.phase, failed.ended_at_ms), (Phase::Failed, Some(7)));
    }

    #[tokio::test]
    async fn a_node_cannot_touch_a_lease_bound_to_another_node() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
        let err = l.bind("a", 1, "n2", 1).await.unwrap_err();
        assert!(
            matches!(&err, LedgerError::WrongNode { bound: Some(b), asked, .. } if b == "n1" && asked == "n2"),
            "{err}"
        );
        assert_eq!(
            code(l.advance("a", 1, "n2", Phase::Online, 1).await),
            "wrong_node"
        );
        assert_eq!(code(l.heartbeat("a", 1, "n2", 1).await), "wrong_node");
        assert_eq!(
            code(l.release("a", 1, Some("n2"), Phase::Done, 1).await),
            "wrong_node"
        );
        assert_eq!(l.get("a").await.unwrap().unwrap().phase, Phase::Launching);

        // Advancing an unbound lease is refused: a node must bind first.
        l.reserve(new_lease("b"), 0).await.unwrap();
        assert_eq!(
            code(l.advance("b", 1, "n1", Phase::Launching, 1).await),
            "wrong_node"
        );
        // The plane may renew an unbound lease.
        l.heartbeat("b", 1, "plane", 1).await.unwrap();
    }

    #[tokio::test]
    async fn an_unbound_lease_already_running_is_never_adopted_by_a_bind() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
        sqlx::query("UPDATE leases SET node = NULL WHERE id = 'a'")
            .execute(&l.writer)
            .await
            .unwrap();
        let err = l.bind("a", 1, "n2", 1).await.unwrap_err();
        assert!(
            matches!(err, LedgerError::WrongNode { bound: None, .. }),
            "{err}"
        );
        assert!(err.to_string().contains("no node"), "{err}");
    }

    #[tokio::test]
    async fn mark_failure_keeps_the_first_reason_and_refuses_the_reserved_marker() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
        l.mark_failure("a", 1, "spot interruption", 1)
            .await
            .unwrap();
        l.mark_failure("a", 1, "spot interruption", 2)
            .await
            .unwrap();
        assert_eq!(
            code(l.mark_failure("a", 1, "disk full", 3).await),
            "conflict"
        );
        assert_eq!(code(l.mark_failure("a", 1, "  ", 3).await), "invalid");
        assert_eq!(
            code(l.mark_failure("a", 1, INVENTORY_ABSENCE, 3).await),
            "invalid"
        );
        let lease = l.get("a").await.unwrap().unwrap();
        assert_eq!(lease.failure_reason.as_deref(), Some("spot interruption"));
        assert_eq!(lease.phase, Phase::Launching, "capacity stays charged");
    }

    #[tokio::test]
    async fn a_runner_registration_is_recorded_and_found_by_name() {
        let l = ledger().await;
        lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
        let lease = l.set_runner("a", 1, 42, "billet-a").await.unwrap();
        assert_eq!(lease.runner_id, Some(42));
        l.set_runner("a", 1, 42, "billet-a").await.unwrap();
        let renamed = l.set_runner("a", 1, 43, "billet-a").await.unwrap();
        assert_eq!(
            renamed.runner_id,
            Some(43),
            "a re-registration under the same name"
        );
        assert_eq!(
            code(l.set_runner("a", 1, 44, "billet-other").await),
            "conflict"
        );
        let found = l.lease_by_runner_name("billet-a").await.unwrap().unwrap();
        assert_eq!(found.id, "a");
        assert_eq!(l.lease_by_runner_name("billet-none").await.unwrap(), None);
    }
}
