//! The holder's writes: `reserve` and `reserve_on` open a lease at epoch 1,
//! and `bind`, `advance`, `bind_advance` (the two in one transaction),
//! `heartbeat`, `release`, `mark_failure`, `set_runner` and `resize` change
//! it for whoever presents its epoch (the node it is bound to, or the plane
//! before a bind).
//!
//! Each of those eight reads the row through `load_fenced` or `load_open`
//! inside its write transaction (locking it on PostgreSQL), compares the
//! epoch before trusting anything else in the row, and updates only
//! `WHERE id = $n AND epoch = $m` (§1.5). None of them bumps an epoch or
//! enters quarantine: reclaiming belongs to `reaper.rs` alone. A write that
//! adds to a node's charge (`reserve_on`, `resize`) first locks the node's
//! row in `nodes`, then sums what the node is charged and decides, so two
//! handles placing on one node take turns.

use billet_proto::ending::ReasonCode;
use sqlx::{Any, Row, Transaction};
use sqlx::{AnyConnection, Connection as _};

use super::schema::{db_epoch, from_db, load, load_for_write, to_i64};
use super::{
    Backend, INVENTORY_ABSENCE, Lease, Ledger, LedgerError, NewLease, NodeCapacity, Phase, Result,
    expect_one_row,
};

/// Longest lease id accepted, in bytes.
const MAX_LEASE_ID_LEN: usize = 128;

/// What keeps a lease open in [`Ledger::release_unless`].
#[derive(Clone, Copy)]
enum Unless {
    /// A runner registration is recorded for it.
    Minted,
    /// A node has bound it.
    Bound,
}

/// The failure reason of a lease whose launch was lost (its result never
/// came back) and that ends with no runner minted, or never bound.
pub(crate) const LAUNCH_LOST: &str = "launch_lost";

impl Ledger {
    /// Opens a lease for a job GitHub assigned: phase `assigned`, epoch 1,
    /// unbound and aimed at no node, expiring `now_ms + ttl`. Charges no
    /// node until one binds it; [`Ledger::reserve_on`] checks a node's room.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`] for a malformed id or a zero size;
    /// [`LedgerError::Conflict`] when the id is taken.
    pub async fn reserve(&self, new: NewLease, now_ms: i64) -> Result<Lease> {
        let mut tx = self.begin_write().await?;
        self.insert_lease(&mut tx, &new, None, now_ms).await?;
        finish(tx, &new.id).await
    }

    /// As [`Ledger::reserve`], aimed at `node`, whose capacity is
    /// `capacity` (what it reported): refused unless the lease fits in what
    /// the node's open leases, bound or aimed there and quarantine
    /// included, leave of it. The check and the insert are one
    /// transaction, under the node's row lock on PostgreSQL, so handles
    /// racing for the same room (two planes on one ledger) never book more
    /// than `capacity` between them. Only `node` may then bind the lease.
    ///
    /// # Errors
    ///
    /// As [`Ledger::reserve`], and [`LedgerError::NoCapacity`] when the
    /// lease does not fit (nothing is written).
    pub async fn reserve_on(
        &self,
        new: NewLease,
        node: &str,
        capacity: NodeCapacity,
        now_ms: i64,
    ) -> Result<Lease> {
        Ok(self
            .reserve_on_with(new, node, capacity, now_ms, false)
            .await?
            .0)
    }

    /// As [`Ledger::reserve_on`], taking over the room of one warm runner
    /// of the lease's tier on `node` when the ledger charges one there
    /// (the oldest): in the same transaction its room is dropped and the
    /// lease charged instead, so a node full of warm runners still takes a
    /// lease of their tier. Returns the lease and the warm runner's name,
    /// for the launch to hand its registration to; `None` when `node` has
    /// no warm runner of the tier (the lease then needs room of its own).
    ///
    /// # Errors
    ///
    /// As [`Ledger::reserve_on`].
    pub async fn reserve_on_warm(
        &self,
        new: NewLease,
        node: &str,
        capacity: NodeCapacity,
        now_ms: i64,
    ) -> Result<(Lease, Option<String>)> {
        self.reserve_on_with(new, node, capacity, now_ms, true)
            .await
    }

    async fn reserve_on_with(
        &self,
        new: NewLease,
        node: &str,
        capacity: NodeCapacity,
        now_ms: i64,
        take_warm: bool,
    ) -> Result<(Lease, Option<String>)> {
        if node.is_empty() {
            return Err(LedgerError::Invalid(format!(
                "lease {} must be aimed at a named node",
                new.id
            )));
        }
        let mut tx = self.begin_write().await?;
        lock_node(&mut tx, node).await?;
        let warm = if take_warm {
            super::warm::take_warm_in(&mut tx, node, &new.tier).await?
        } else {
            None
        };
        let charged = charged_on_in(&mut tx, node).await?;
        let asked = NodeCapacity {
            vcpu: u64::from(new.vcpu),
            memory_bytes: new.memory_bytes,
        };
        check_fits(&new.id, node, asked, charged, capacity)?;
        self.insert_lease(&mut tx, &new, Some(node), now_ms).await?;
        Ok((finish(tx, &new.id).await?, warm))
    }

    async fn insert_lease(
        &self,
        tx: &mut AnyConnection,
        new: &NewLease,
        target_node: Option<&str>,
        now_ms: i64,
    ) -> Result<()> {
        check_lease_id(&new.id)?;
        if new.vcpu == 0 || new.memory_bytes == 0 {
            return Err(LedgerError::Invalid(format!(
                "lease {} must charge at least one vCPU and one byte of memory",
                new.id
            )));
        }
        let memory_bytes = to_i64("memory_bytes", new.memory_bytes)?;
        let expires_at_ms = now_ms.saturating_add(self.ttl_ms());
        let done = sqlx::query(
            "INSERT INTO leases (id, epoch, phase, tier, request_id, runner_name, vcpu,
                memory_bytes, expires_at_ms, heartbeat_at_ms, created_at_ms, target_node)
             VALUES ($1, 1, 'assigned', $2, $3, $4, $5, $6, $7, $8, $8, $9)
             ON CONFLICT (id) DO NOTHING",
        )
        .bind(&new.id)
        .bind(&new.tier)
        .bind(new.request_id)
        .bind(&new.runner_name)
        .bind(i64::from(new.vcpu))
        .bind(memory_bytes)
        .bind(expires_at_ms)
        .bind(now_ms)
        .bind(target_node)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            return Err(LedgerError::Conflict(format!(
                "lease {} already exists; lease ids are never reused",
                new.id
            )));
        }
        Ok(())
    }

    /// Binds the lease to `node`. Binding again to the same node is a no-op.
    /// Does not renew the lease (§1.7).
    ///
    /// # Errors
    ///
    /// `NotFound` (unknown or ended), `Fenced`, and `WrongNode` when the
    /// lease is bound elsewhere, aimed at another node, or is already past
    /// `assigned` without a node (it is never adopted).
    pub async fn bind(&self, id: &str, epoch: u64, node: &str, _now_ms: i64) -> Result<Lease> {
        let mut tx = self.begin_write().await?;
        bind_in(&mut tx, self.backend, id, epoch, node).await?;
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
        advance_in(
            &mut tx,
            self.backend,
            id,
            epoch,
            node,
            to,
            now_ms,
            self.ttl_ms(),
        )
        .await?;
        finish(tx, id).await
    }

    /// [`Ledger::bind`] then [`Ledger::advance`] to `to`, in one write
    /// transaction: what a node's `BindAdvance` asks on its launch path
    /// (one round trip and one commit where there were two). Both halves
    /// happen, or neither: a refused advance leaves the lease unbound if
    /// the bind was new.
    ///
    /// # Errors
    ///
    /// As [`Ledger::bind`], then as [`Ledger::advance`], checked in that
    /// order on the same row.
    pub(crate) async fn bind_advance(
        &self,
        id: &str,
        epoch: u64,
        node: &str,
        to: Phase,
        now_ms: i64,
    ) -> Result<Lease> {
        let mut tx = self.begin_write().await?;
        bind_in(&mut tx, self.backend, id, epoch, node).await?;
        advance_in(
            &mut tx,
            self.backend,
            id,
            epoch,
            node,
            to,
            now_ms,
            self.ttl_ms(),
        )
        .await?;
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
        renew(
            &mut tx,
            self.backend,
            id,
            epoch,
            node,
            now_ms,
            self.ttl_ms(),
        )
        .await?;
        finish(tx, id).await
    }

    /// Renews every `(lease id, epoch)` of `leases` for `node` in one write
    /// transaction, each checked and renewed exactly as
    /// [`Ledger::heartbeat`] does; a lease refused gets its own error in
    /// its place and the others are renewed all the same. What a node's
    /// batched `Heartbeat` asks, answered with one commit whatever its
    /// length. The leases are locked in id order, whatever the order asked,
    /// so two batches sharing leases cannot deadlock on PostgreSQL.
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
        let mut order: Vec<usize> = (0..leases.len()).collect();
        order.sort_by(|a, b| leases[*a].0.cmp(&leases[*b].0));
        let mut tx = self.begin_write().await?;
        let mut results: Vec<Option<Result<()>>> = leases.iter().map(|_| None).collect();
        for i in order {
            let (id, epoch) = &leases[i];
            let renewed = renew(
                &mut tx,
                self.backend,
                id,
                *epoch,
                node,
                now_ms,
                self.ttl_ms(),
            )
            .await;
            results[i] = Some(renewed);
        }
        tx.commit().await?;
        Ok(results
            .into_iter()
            .map(|r| r.expect("every position is renewed once"))
            .collect())
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
        self.release_ending(id, epoch, node, outcome, None, now_ms)
            .await
    }

    /// [`Ledger::release`], recording why it ended (`end`: its code and
    /// detail) unless a code is recorded already (the first one stays, as
    /// the failure reason's does). `None`: the holder named no code (a node
    /// that predates codes); [`Lease::end`] reads the lease's words then.
    ///
    /// # Errors
    ///
    /// As [`Ledger::release`].
    pub async fn release_ending(
        &self,
        id: &str,
        epoch: u64,
        node: Option<&str>,
        outcome: Phase,
        end: Option<(ReasonCode, &str)>,
        now_ms: i64,
    ) -> Result<Lease> {
        if !outcome.is_terminal() {
            return Err(LedgerError::Invalid(format!(
                "lease {id} can only be released as done or failed, not {outcome}"
            )));
        }
        let mut tx = self.begin_write().await?;
        let lease = load_fenced(&mut tx, self.backend, id, epoch).await?;
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
        // The right-hand sides read the row as it was, so the detail is
        // written only with the code it belongs to.
        let done = sqlx::query(
            "UPDATE leases SET phase = $1, ended_at_ms = $2, \
             end_reason = COALESCE(end_reason, $5), \
             end_detail = CASE WHEN end_reason IS NULL THEN $6 ELSE end_detail END \
             WHERE id = $3 AND epoch = $4",
        )
        .bind(outcome.as_str())
        .bind(now_ms)
        .bind(id)
        .bind(db_epoch(epoch))
        .bind(end.map(|(code, _)| code.as_str()))
        .bind(end.map(|(_, detail)| detail))
        .execute(&mut *tx)
        .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }

    /// Ends the lease `failed` unless a runner registration is recorded for
    /// it, deciding and writing in one transaction under the lease's row
    /// lock. A plane whose launch result was lost uses it: the node may
    /// still be launching, and a mint recorded between a read of the lease
    /// and a separate release would leave a runner started on a lease the
    /// plane had ended (its job then killed when the node learns the lease
    /// is gone). With the decision here, either the release comes first
    /// and the mint is refused ([`Ledger::set_runner`] needs an open
    /// lease), or the mint comes first and nothing is released.
    ///
    /// Returns `Ok(Some(lease))` when the lease ended here or had already
    /// ended `failed`, `Ok(None)` when a registration is recorded (the
    /// lease is left as it is: the node may well have started a runner).
    ///
    /// # Errors
    ///
    /// `NotFound`, `Fenced`; `Conflict` when it already ended `done`.
    pub(crate) async fn release_unminted(
        &self,
        id: &str,
        epoch: u64,
        now_ms: i64,
    ) -> Result<Option<Lease>> {
        self.release_unless(id, epoch, now_ms, Unless::Minted).await
    }

    /// Ends the lease `failed` unless a node has bound it, deciding and writing
    /// in one transaction under the lease's row lock:
    /// [`Ledger::release_unminted`] for a launch whose registration the plane
    /// minted before dispatching it, so that a registration is recorded from
    /// the start and cannot tell a launch that did nothing from one that did. A
    /// node starts an instance only once its bind holds, so either the release
    /// comes first and the node's bind is refused (it removes what it created,
    /// unstarted), or the bind comes first and nothing is released.
    ///
    /// Returns `Ok(Some(lease))` when the lease ended here or had already
    /// ended `failed`, `Ok(None)` when it was bound (the lease is left as
    /// it is: the node may well have started a runner).
    ///
    /// # Errors
    ///
    /// `NotFound`, `Fenced`; `Conflict` when it already ended `done`.
    pub(crate) async fn release_unbound(
        &self,
        id: &str,
        epoch: u64,
        now_ms: i64,
    ) -> Result<Option<Lease>> {
        self.release_unless(id, epoch, now_ms, Unless::Bound).await
    }

    /// [`Ledger::release_unminted`] and [`Ledger::release_unbound`]: ends
    /// the lease `failed`, with the failure reason [`LAUNCH_LOST`] unless it
    /// has one, in one transaction unless `unless` holds.
    async fn release_unless(
        &self,
        id: &str,
        epoch: u64,
        now_ms: i64,
        unless: Unless,
    ) -> Result<Option<Lease>> {
        let mut tx = self.begin_write().await?;
        let lease = load_fenced(&mut tx, self.backend, id, epoch).await?;
        if lease.phase.is_terminal() {
            return if lease.phase == Phase::Failed {
                Ok(Some(lease))
            } else {
                Err(LedgerError::Conflict(format!(
                    "lease {id} already ended as {}; it cannot also end as failed",
                    lease.phase
                )))
            };
        }
        let (kept, update) = match unless {
            Unless::Minted => (
                lease.runner_id.is_some(),
                "UPDATE leases SET phase = $1, ended_at_ms = $2, \
                 failure_reason = COALESCE(failure_reason, $5), \
                 end_reason = COALESCE(end_reason, $6) \
                 WHERE id = $3 AND epoch = $4 AND runner_id IS NULL",
            ),
            Unless::Bound => (
                lease.node.is_some(),
                "UPDATE leases SET phase = $1, ended_at_ms = $2, \
                 failure_reason = COALESCE(failure_reason, $5), \
                 end_reason = COALESCE(end_reason, $6) \
                 WHERE id = $3 AND epoch = $4 AND node IS NULL",
            ),
        };
        if kept {
            return Ok(None);
        }
        let done = sqlx::query(update)
            .bind(Phase::Failed.as_str())
            .bind(now_ms)
            .bind(id)
            .bind(db_epoch(epoch))
            .bind(LAUNCH_LOST)
            .bind(ReasonCode::LaunchLost.as_str())
            .execute(&mut *tx)
            .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await.map(Some)
    }

    /// Records why the job will fail. The first reason stays; the same
    /// reason again is a no-op. Capacity stays charged.
    ///
    /// # Errors
    ///
    /// `Invalid` for a blank reason or the reserved [`INVENTORY_ABSENCE`];
    /// `NotFound`, `Fenced`; `Conflict` when another reason is recorded.
    pub(crate) async fn mark_failure(
        &self,
        id: &str,
        epoch: u64,
        reason: &str,
        now_ms: i64,
    ) -> Result<Lease> {
        let (code, detail) = ReasonCode::parse_legacy(reason);
        self.mark_failure_as(id, epoch, reason, (code, &detail), now_ms)
            .await
    }

    /// [`Ledger::mark_failure`] with the reason's code and detail as its
    /// holder named them (`end`), recorded with the words; the first
    /// reason stays, code and all.
    ///
    /// # Errors
    ///
    /// As [`Ledger::mark_failure`].
    pub(crate) async fn mark_failure_as(
        &self,
        id: &str,
        epoch: u64,
        reason: &str,
        end: (ReasonCode, &str),
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
        let lease = load_open(&mut tx, self.backend, id, epoch).await?;
        match lease.failure_reason.as_deref() {
            Some(recorded) if recorded == reason => return Ok(lease),
            Some(recorded) => {
                return Err(LedgerError::Conflict(format!(
                    "lease {id} already records failure reason {recorded:?}; the first reason stays"
                )));
            }
            None => {}
        }
        let done = sqlx::query(
            "UPDATE leases SET failure_reason = $1, \
             end_reason = COALESCE(end_reason, $4), \
             end_detail = CASE WHEN end_reason IS NULL THEN $5 ELSE end_detail END \
             WHERE id = $2 AND epoch = $3",
        )
        .bind(reason)
        .bind(id)
        .bind(db_epoch(epoch))
        .bind(end.0.as_str())
        .bind(end.1)
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
    pub(crate) async fn set_runner(
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
        // Committed without waiting for the disk (the one such write): the
        // mint is on every launch's critical path, and a registration whose
        // record a power cut took is found by its name by the plane's
        // registration pass once the lease has ended (`UNRECORDED_LOOKBACK_MS`
        // in plane/registrations.rs), as one the ledger refused to record is. A crash of
        // the plane process loses nothing: the commit is in the database.
        let mut conn = self.writer.acquire().await?;
        if self.backend == Backend::Sqlite {
            // SQLite cannot change its safety level inside a transaction.
            sqlx::query("PRAGMA synchronous = NORMAL")
                .execute(&mut *conn)
                .await?;
        }
        let written = self
            .set_runner_in(&mut conn, id, epoch, runner_id, runner_name)
            .await;
        if self.backend == Backend::Sqlite
            && sqlx::query("PRAGMA synchronous = FULL")
                .execute(&mut *conn)
                .await
                .is_err()
        {
            // Never hand the next write a connection that does not sync.
            conn.close_on_drop();
        }
        written
    }

    async fn set_runner_in(
        &self,
        conn: &mut AnyConnection,
        id: &str,
        epoch: u64,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<Lease> {
        let mut tx = match self.backend {
            Backend::Sqlite => conn.begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => {
                let mut tx = conn.begin().await?;
                sqlx::query("SET LOCAL synchronous_commit = off")
                    .execute(&mut *tx)
                    .await?;
                tx
            }
        };
        let lease = load_open(&mut tx, self.backend, id, epoch).await?;
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
            "UPDATE leases SET runner_id = $1, runner_name = $2 WHERE id = $3 AND epoch = $4",
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

    /// Changes what the lease bound to `node` charges to `size`, when what
    /// the node launches differs from what was reserved (the reference's
    /// `Resize`, §1.6: a provider that chose another instance shape). Only
    /// a lease in `launching`; the same size again is a no-op. Fenced, and
    /// checked like [`Ledger::reserve_on`]: the node's charge with the old
    /// size handed back and the new one added must fit in `capacity`, under
    /// the node's row lock. Does not renew the lease (§1.7).
    ///
    /// # Errors
    ///
    /// `Invalid` for a zero size; `NotFound`, `Fenced`, `WrongNode` (not
    /// bound to `node`); `Conflict` when the lease is not launching;
    /// `NoCapacity` when the new size does not fit (nothing is written).
    pub(crate) async fn resize(
        &self,
        id: &str,
        epoch: u64,
        node: &str,
        size: NodeCapacity,
        capacity: NodeCapacity,
        _now_ms: i64,
    ) -> Result<Lease> {
        if size.vcpu == 0 || size.memory_bytes == 0 {
            return Err(LedgerError::Invalid(format!(
                "lease {id} must charge at least one vCPU and one byte of memory"
            )));
        }
        let vcpu = u32::try_from(size.vcpu)
            .map_err(|_| LedgerError::Invalid(format!("{} vCPUs is too many", size.vcpu)))?;
        let memory_bytes = to_i64("memory_bytes", size.memory_bytes)?;
        let mut tx = self.begin_write().await?;
        let lease = load_open(&mut tx, self.backend, id, epoch).await?;
        if lease.node.as_deref() != Some(node) {
            return Err(wrong_node(&lease, node));
        }
        if lease.phase != Phase::Launching {
            return Err(LedgerError::Conflict(format!(
                "lease {id} is {}: only a launching lease is resized",
                lease.phase
            )));
        }
        if lease.vcpu == vcpu && lease.memory_bytes == size.memory_bytes {
            return Ok(lease);
        }
        lock_node(&mut tx, node).await?;
        let charged = charged_on_in(&mut tx, node).await?;
        let others = NodeCapacity {
            vcpu: charged.vcpu.saturating_sub(u64::from(lease.vcpu)),
            memory_bytes: charged.memory_bytes.saturating_sub(lease.memory_bytes),
        };
        check_fits(id, node, size, others, capacity)?;
        let done = sqlx::query(
            "UPDATE leases SET vcpu = $1, memory_bytes = $2 WHERE id = $3 AND epoch = $4",
        )
        .bind(i64::from(vcpu))
        .bind(memory_bytes)
        .bind(id)
        .bind(db_epoch(epoch))
        .execute(&mut *tx)
        .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
    }
}

/// Takes `node`'s row lock until the transaction ends (creating the row
/// the first time): every write that adds to a node's charge takes it
/// before summing, so on PostgreSQL they take turns. On SQLite the write
/// transaction already excludes every other writer.
pub(super) async fn lock_node(conn: &mut AnyConnection, node: &str) -> Result<()> {
    sqlx::query(
        "INSERT INTO nodes (name) VALUES ($1)
         ON CONFLICT (name) DO UPDATE SET name = excluded.name",
    )
    .bind(node)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// What `node` is charged inside the transaction: every open lease bound
/// to it, or aimed at it and not yet bound, and every warm runner's room
/// on it.
pub(super) async fn charged_on_in(conn: &mut AnyConnection, node: &str) -> Result<NodeCapacity> {
    let row = sqlx::query(
        "SELECT CAST(COALESCE(SUM(vcpu), 0) AS BIGINT) AS vcpu,
            CAST(COALESCE(SUM(memory_bytes), 0) AS BIGINT) AS memory_bytes
         FROM leases
         WHERE (node = $1 OR (node IS NULL AND target_node = $1))
            AND phase NOT IN ('done', 'failed')",
    )
    .bind(node)
    .fetch_one(&mut *conn)
    .await?;
    let vcpu: i64 = row.try_get("vcpu")?;
    let memory_bytes: i64 = row.try_get("memory_bytes")?;
    let warm = super::warm::warm_charged_in(conn, node).await?;
    Ok(NodeCapacity {
        vcpu: from_db::<u64>("vcpu", vcpu)?.saturating_add(warm.vcpu),
        memory_bytes: from_db::<u64>("memory_bytes", memory_bytes)?
            .saturating_add(warm.memory_bytes),
    })
}

/// `asked` on top of `charged` fits in `capacity`, or `NoCapacity`.
pub(super) fn check_fits(
    lease: &str,
    node: &str,
    asked: NodeCapacity,
    charged: NodeCapacity,
    capacity: NodeCapacity,
) -> Result<()> {
    let fits = charged.vcpu.saturating_add(asked.vcpu) <= capacity.vcpu
        && charged.memory_bytes.saturating_add(asked.memory_bytes) <= capacity.memory_bytes;
    if fits {
        Ok(())
    } else {
        Err(LedgerError::NoCapacity {
            lease: lease.to_owned(),
            node: node.to_owned(),
            asked,
            charged,
            capacity,
        })
    }
}

/// Loads the lease for writing and checks the epoch before anything else
/// in the row. Ended leases are returned too (for `release`'s idempotency).
async fn load_fenced(
    conn: &mut AnyConnection,
    backend: Backend,
    id: &str,
    epoch: u64,
) -> Result<Lease> {
    let lease = load_for_write(conn, backend, id)
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
async fn load_open(
    conn: &mut AnyConnection,
    backend: Backend,
    id: &str,
    epoch: u64,
) -> Result<Lease> {
    let lease = load_fenced(conn, backend, id, epoch).await?;
    if lease.phase.is_terminal() {
        return Err(LedgerError::NotFound(lease.id));
    }
    Ok(lease)
}

/// Binds the lease to `node` inside a write transaction, as
/// [`Ledger::bind`] describes; already bound to `node` writes nothing.
async fn bind_in(
    conn: &mut AnyConnection,
    backend: Backend,
    id: &str,
    epoch: u64,
    node: &str,
) -> Result<()> {
    let lease = load_open(conn, backend, id, epoch).await?;
    match lease.node.as_deref() {
        Some(bound) if bound == node => return Ok(()),
        Some(_) => return Err(wrong_node(&lease, node)),
        None if !matches!(lease.phase, Phase::Capacity | Phase::Assigned) => {
            return Err(wrong_node(&lease, node));
        }
        None => {}
    }
    if let Some(target) = lease.target_node.as_deref()
        && target != node
    {
        return Err(LedgerError::WrongNode {
            lease: lease.id.clone(),
            bound: Some(target.to_owned()),
            asked: node.to_owned(),
        });
    }
    let done = sqlx::query("UPDATE leases SET node = $1 WHERE id = $2 AND epoch = $3")
        .bind(node)
        .bind(id)
        .bind(db_epoch(epoch))
        .execute(&mut *conn)
        .await?;
    expect_one_row(done.rows_affected(), id)
}

/// Moves the lease bound to `node` to `to` inside a write transaction,
/// renewing it for `ttl_ms`, as [`Ledger::advance`] describes; the phase
/// it has already writes nothing.
#[allow(clippy::too_many_arguments)]
async fn advance_in(
    conn: &mut AnyConnection,
    backend: Backend,
    id: &str,
    epoch: u64,
    node: &str,
    to: Phase,
    now_ms: i64,
    ttl_ms: i64,
) -> Result<()> {
    let lease = load_open(conn, backend, id, epoch).await?;
    if lease.node.as_deref() != Some(node) {
        return Err(wrong_node(&lease, node));
    }
    if to == Phase::Quarantine {
        return Err(bad_transition(&lease, to));
    }
    if lease.phase == to {
        return Ok(());
    }
    if !lease.phase.can_move_to(to) {
        return Err(bad_transition(&lease, to));
    }
    let holds = matches!(to, Phase::Custody | Phase::Teardown);
    let done = sqlx::query(
        "UPDATE leases SET phase = $1, heartbeat_at_ms = $2, expires_at_ms = $3,
            held_at_ms = CASE WHEN $4 THEN COALESCE(held_at_ms, $2) ELSE held_at_ms END,
            ended_at_ms = CASE WHEN $5 THEN $2 ELSE ended_at_ms END
         WHERE id = $6 AND epoch = $7",
    )
    .bind(to.as_str())
    .bind(now_ms)
    .bind(now_ms.saturating_add(ttl_ms))
    .bind(holds)
    .bind(to.is_terminal())
    .bind(id)
    .bind(db_epoch(epoch))
    .execute(&mut *conn)
    .await?;
    expect_one_row(done.rows_affected(), id)
}

/// Renews one lease inside a write transaction: fenced and open, not asked
/// to be given up, bound to `node` or to none.
async fn renew(
    conn: &mut AnyConnection,
    backend: Backend,
    id: &str,
    epoch: u64,
    node: &str,
    now_ms: i64,
    ttl_ms: i64,
) -> Result<()> {
    let lease = load_open(conn, backend, id, epoch).await?;
    if lease.force_release {
        return Err(LedgerError::ForceRelease(lease.id));
    }
    if lease.node.as_deref().is_some_and(|bound| bound != node) {
        return Err(wrong_node(&lease, node));
    }
    let done = sqlx::query(
        "UPDATE leases SET heartbeat_at_ms = $1, expires_at_ms = $2 WHERE id = $3 AND epoch = $4",
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
async fn finish(mut tx: Transaction<'_, Any>, id: &str) -> Result<Lease> {
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
    use crate::ledger::test_support::{
        GIB, TTL, TTL_MS, code, lease_in, new_lease, on_both_backends,
    };

    /// Room for four 2-vCPU, 4 GiB leases.
    const ROOM: NodeCapacity = NodeCapacity {
        vcpu: 8,
        memory_bytes: 64 * GIB,
    };

    const ONE: NodeCapacity = NodeCapacity {
        vcpu: 1,
        memory_bytes: 1,
    };

    on_both_backends! {
        async fn a_reservation_aimed_at_a_node_charges_it_at_once_and_binds_only_there(db) {
            let l = db.ledger().await;
            let lease = l.reserve_on(new_lease("a"), "n1", ROOM, 0).await.unwrap();
            assert_eq!((lease.node, lease.target_node.as_deref()), (None, Some("n1")));
            assert_eq!((lease.phase, lease.epoch), (Phase::Assigned, 1));
            let charged = l.charged_on("n1").await.unwrap();
            assert_eq!((charged.leases, charged.vcpu), (1, 2), "charged before it is bound");
            assert_eq!(code(l.bind("a", 1, "n2", 1).await), "wrong_node");
            let bound = l.bind("a", 1, "n1", 1).await.unwrap();
            assert_eq!(bound.node.as_deref(), Some("n1"));
            assert_eq!(l.charged_on("n1").await.unwrap().leases, 1, "counted once");

            let tight = NodeCapacity { vcpu: 3, memory_bytes: 64 * GIB };
            let refused = l.reserve_on(new_lease("b"), "n1", tight, 0).await.unwrap_err();
            assert!(
                matches!(&refused, LedgerError::NoCapacity { charged, .. } if charged.vcpu == 2),
                "{refused}"
            );
            assert_eq!(l.get("b").await.unwrap(), None, "a refusal writes nothing");
            let little_memory = NodeCapacity { vcpu: 8, memory_bytes: 6 * GIB };
            assert_eq!(
                code(l.reserve_on(new_lease("b"), "n1", little_memory, 0).await),
                "no_capacity"
            );
            assert_eq!(code(l.reserve_on(new_lease("b"), "", ROOM, 0).await), "invalid");
            // An ended lease charges nothing: its room is free again.
            l.release("a", 1, Some("n1"), Phase::Done, 2).await.unwrap();
            l.reserve_on(new_lease("b"), "n1", tight, 2).await.unwrap();
            assert_eq!(code(l.reserve_on(new_lease("b"), "n1", ROOM, 2).await), "conflict");
        }
    }

    on_both_backends! {
        /// A lost launch's lease is ended only while no registration is
        /// recorded: a mint that lands first keeps it open, and one that
        /// comes after is refused.
        async fn a_lost_launch_is_released_only_while_nothing_is_minted(db) {
            let l = db.ledger().await;
            lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
            let ended = l.release_unminted("a", 1, 1).await.unwrap().expect("released");
            assert_eq!(ended.phase, Phase::Failed);
            assert_eq!(code(l.set_runner("a", 1, 7, "r-a").await), "not_found");
            assert_eq!(l.release_unminted("a", 1, 2).await.unwrap().map(|l| l.phase), Some(Phase::Failed));

            lease_in(&l, "b", "n1", &[Phase::Launching], 0).await;
            l.set_runner("b", 1, 8, "r-b").await.unwrap();
            assert_eq!(l.release_unminted("b", 1, 1).await.unwrap(), None);
            let kept = l.get("b").await.unwrap().unwrap();
            assert_eq!((kept.phase, kept.runner_id), (Phase::Launching, Some(8)));

            lease_in(&l, "c", "n1", &[Phase::Launching], 0).await;
            l.release("c", 1, Some("n1"), Phase::Done, 1).await.unwrap();
            assert_eq!(code(l.release_unminted("c", 1, 2).await), "conflict");
            assert_eq!(code(l.release_unminted("c", 2, 2).await), "fenced");
        }
    }

    on_both_backends! {
        /// The mint and the lost launch's release race: whichever commits
        /// first wins, and the lease never ends with a registration
        /// recorded after it ended.
        async fn a_mint_racing_a_lost_launch_release_never_lands_on_an_ended_lease(db) {
            let l = db.ledger().await;
            for i in 0..20 {
                let id = format!("race-{i}");
                lease_in(&l, &id, "n1", &[Phase::Launching], 0).await;
                let name = format!("r-{i}");
                let (mint, release) = tokio::join!(
                    l.set_runner(&id, 1, 100 + i, &name),
                    l.release_unminted(&id, 1, 1),
                );
                let lease = l.get(&id).await.unwrap().unwrap();
                match (mint.is_ok(), release.unwrap()) {
                    (true, None) => {
                        assert_eq!((lease.phase, lease.runner_id), (Phase::Launching, Some(100 + i)));
                    }
                    (false, Some(ended)) => {
                        assert_eq!(ended.phase, Phase::Failed);
                        assert_eq!((lease.phase, lease.runner_id), (Phase::Failed, None));
                    }
                    (minted, released) => {
                        panic!("lease {id}: mint ok {minted}, release {released:?}, now {lease:?}")
                    }
                }
            }
        }
    }

    on_both_backends! {
        /// The reference's `Resize`: a launching lease's charge follows what
        /// its node launched, fenced, bound, and within the node's room with
        /// its old size handed back.
        async fn resize_changes_what_a_launching_lease_charges_within_the_nodes_room(db) {
            let l = db.ledger().await;
            l.reserve_on(new_lease("a"), "n1", ROOM, 0).await.unwrap();
            l.bind("a", 1, "n1", 0).await.unwrap();
            l.reserve_on(new_lease("other"), "n1", ROOM, 0).await.unwrap();
            let bigger = NodeCapacity { vcpu: 6, memory_bytes: 8 * GIB };
            let assigned = l.resize("a", 1, "n1", bigger, ROOM, 1).await;
            assert_eq!(code(assigned), "conflict", "only a launching lease is resized");
            let launching = l.advance("a", 1, "n1", Phase::Launching, 10).await.unwrap();

            let resized = l.resize("a", 1, "n1", bigger, ROOM, 20).await.unwrap();
            assert_eq!((resized.vcpu, resized.memory_bytes), (6, 8 * GIB));
            assert_eq!(resized.expires_at_ms, launching.expires_at_ms, "a resize does not renew");
            assert_eq!(l.charged_on("n1").await.unwrap().vcpu, 8);
            let again = l.resize("a", 1, "n1", bigger, ROOM, 21).await.unwrap();
            assert_eq!(again, resized);

            // 6 + 2 already fill the room; 7 would not fit beside "other".
            let too_big = NodeCapacity { vcpu: 7, memory_bytes: 8 * GIB };
            assert_eq!(code(l.resize("a", 1, "n1", too_big, ROOM, 22).await), "no_capacity");
            let smaller = NodeCapacity { vcpu: 1, memory_bytes: GIB };
            assert_eq!(code(l.resize("a", 2, "n1", smaller, ROOM, 22).await), "fenced");
            assert_eq!(code(l.resize("a", 1, "n2", smaller, ROOM, 22).await), "wrong_node");
            let zero = NodeCapacity { vcpu: 0, memory_bytes: GIB };
            assert_eq!(code(l.resize("a", 1, "n1", zero, ROOM, 22).await), "invalid");
            let unchanged = l.get("a").await.unwrap().unwrap();
            assert_eq!((unchanged.vcpu, unchanged.memory_bytes), (6, 8 * GIB));

            l.resize("a", 1, "n1", smaller, ROOM, 23).await.unwrap();
            assert_eq!(l.charged_on("n1").await.unwrap().vcpu, 3);
            l.advance("a", 1, "n1", Phase::Online, 24).await.unwrap();
            assert_eq!(code(l.resize("a", 1, "n1", bigger, ROOM, 25).await), "conflict");
            l.release("a", 1, Some("n1"), Phase::Done, 26).await.unwrap();
            assert_eq!(code(l.resize("a", 1, "n1", bigger, ROOM, 27).await), "not_found");
        }
    }

    on_both_backends! {
        async fn a_reservation_is_assigned_at_epoch_one_and_expires_after_the_ttl(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        /// One transaction renews the batch; each lease's refusal is its own,
        /// in its place, and does not stop the others.
        async fn a_batched_heartbeat_renews_each_lease_it_may_and_refuses_the_others_in_place(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        async fn every_holder_write_refuses_a_stale_epoch(db) {
            let l = db.ledger().await;
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
                code(l.resize("a", stale, "n1", ONE, ROOM, 1).await),
            ];
            assert_eq!(refusals, ["fenced"; 8]);
            let lease = l.get("a").await.unwrap().unwrap();
            assert_eq!((lease.phase, lease.epoch), (Phase::Launching, 1));
            assert_eq!(lease.runner_id, None);
            assert_eq!(lease.failure_reason, None);
        }
    }

    on_both_backends! {
        /// A launch whose registration the plane minted before dispatching it,
        /// and whose result was lost, ends `failed` only while no node has
        /// bound it; a registration recorded does not keep it open, a bind
        /// does.
        async fn a_lost_launch_ends_its_lease_only_while_it_is_unbound(db) {
            let l = db.ledger().await;
            l.reserve(new_lease("a"), 0).await.unwrap();
            l.set_runner("a", 1, 7, "billet-a").await.unwrap();
            let ended = l.release_unbound("a", 1, 10).await.unwrap();
            assert_eq!(
                ended.map(|e| (e.phase, e.failure_reason)),
                Some((Phase::Failed, Some(LAUNCH_LOST.to_owned()))),
                "a lost launch's lease ends saying so"
            );
            assert_eq!(code(l.bind_advance("a", 1, "n1", Phase::Launching, 20).await), "not_found");
            let again = l.release_unbound("a", 1, 30).await.unwrap();
            assert_eq!(again.map(|e| e.phase), Some(Phase::Failed), "repeats without effect");

            l.reserve(new_lease("b"), 0).await.unwrap();
            l.set_runner("b", 1, 8, "billet-b").await.unwrap();
            l.bind_advance("b", 1, "n1", Phase::Launching, 40).await.unwrap();
            assert_eq!(l.release_unbound("b", 1, 50).await.unwrap(), None);
            let kept = l.get("b").await.unwrap().unwrap();
            assert_eq!((kept.phase, kept.node.as_deref()), (Phase::Launching, Some("n1")));
            assert_eq!(code(l.release_unbound("b", 2, 60).await), "fenced");
        }
    }

    on_both_backends! {
        async fn bind_advance_and_release_repeat_without_effect(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        /// The launch path's Bind and Advance(launching) in one transaction
        /// leave the lease as the two calls would, repeat without effect,
        /// refuse with the same codes, and on a refused advance leave the bind
        /// undone.
        async fn bind_advance_is_a_bind_then_an_advance_in_one_transaction(db) {
            let l = db.ledger().await;
            l.reserve(new_lease("two"), 0).await.unwrap();
            l.bind("two", 1, "n1", 10).await.unwrap();
            let by_two = l.advance("two", 1, "n1", Phase::Launching, 10).await.unwrap();
            l.reserve(new_lease("one"), 0).await.unwrap();
            let by_one = l.bind_advance("one", 1, "n1", Phase::Launching, 10).await.unwrap();
            assert_eq!(
                (by_one.node.as_deref(), by_one.phase, by_one.epoch, by_one.expires_at_ms),
                (Some("n1"), Phase::Launching, 1, 10 + TTL_MS)
            );
            assert_eq!(
                Lease { id: by_two.id.clone(), runner_name: by_two.runner_name.clone(), ..by_one.clone() },
                by_two,
                "one transaction left the lease as the two calls do"
            );
            assert_eq!(l.get("one").await.unwrap().as_ref(), Some(&by_one));
            let again = l.bind_advance("one", 1, "n1", Phase::Launching, 20).await.unwrap();
            assert_eq!(again, by_one, "a repeated bind_advance changes nothing");

            // Refused as each half would be, and nothing written.
            assert_eq!(code(l.bind_advance("one", 2, "n1", Phase::Launching, 30).await), "fenced");
            assert_eq!(code(l.bind_advance("one", 1, "n2", Phase::Launching, 30).await), "wrong_node");
            assert_eq!(code(l.bind_advance("missing", 1, "n1", Phase::Launching, 30).await), "not_found");
            l.reserve_on(new_lease("aimed"), "n1", ROOM, 0).await.unwrap();
            assert_eq!(code(l.bind_advance("aimed", 1, "n2", Phase::Launching, 30).await), "wrong_node");
            assert_eq!(l.get("one").await.unwrap().as_ref(), Some(&by_one));

            // A refused advance undoes the bind with it.
            l.reserve(new_lease("fresh"), 0).await.unwrap();
            for to in [Phase::Busy, Phase::Quarantine] {
                assert_eq!(code(l.bind_advance("fresh", 1, "n1", to, 30).await), "bad_transition");
            }
            let fresh = l.get("fresh").await.unwrap().unwrap();
            assert_eq!((fresh.node, fresh.phase), (None, Phase::Assigned), "half a bind_advance was written");

            l.release("one", 1, Some("n1"), Phase::Done, 40).await.unwrap();
            assert_eq!(code(l.bind_advance("one", 1, "n1", Phase::Launching, 50).await), "not_found");
        }
    }

    on_both_backends! {
        async fn advance_follows_the_table_and_never_enters_quarantine(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        async fn a_node_cannot_touch_a_lease_bound_to_another_node(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        async fn an_unbound_lease_already_running_is_never_adopted_by_a_bind(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        async fn mark_failure_keeps_the_first_reason_and_refuses_the_reserved_marker(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        async fn a_runner_registration_is_recorded_and_found_by_name(db) {
            let l = db.ledger().await;
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
    on_both_backends! {
        /// `set_runner` alone commits without waiting for the disk; the
        /// writer every other write takes afterwards syncs again, whether
        /// the registration was recorded or refused.
        async fn recording_a_registration_leaves_the_writer_syncing(db) {
            let l = db.ledger().await;
            lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
            l.set_runner("a", 1, 7, "billet-a").await.unwrap();
            assert_eq!(code(l.set_runner("a", 2, 7, "billet-a").await), "fenced");
            assert_eq!(l.get("a").await.unwrap().expect("a").runner_id, Some(7));
            let mut conn = l.writer.acquire().await.unwrap();
            match l.backend {
                Backend::Sqlite => {
                    let level: i64 = sqlx::query_scalar("PRAGMA synchronous")
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap();
                    assert_eq!(level, 2, "the writer was left at synchronous {level}, not FULL");
                }
                Backend::Postgres => {
                    let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
                        .fetch_one(&mut *conn)
                        .await
                        .unwrap();
                    assert_eq!(setting, "on");
                }
            }
        }
    }

    on_both_backends! {
        /// The first end's code stays, with its detail, as the first
        /// failure reason does; a release names a code only where none is
        /// recorded; and a lease whose holder named none is read from its
        /// words, done as `completed`.
        async fn a_lease_keeps_the_first_end_code_and_reads_older_words(db) {
            use billet_proto::ending::{EndClass, ReasonCode};
            let l = db.ledger().await;
            lease_in(&l, "a", "n1", &[Phase::Launching, Phase::Online], 0).await;
            l.mark_failure_as(
                "a",
                1,
                "ec2 spot interruption: terminate",
                (ReasonCode::SpotInterruption, "terminate"),
                1,
            )
            .await
            .unwrap();
            assert_eq!(l.get("a").await.unwrap().unwrap().end(), None, "still open");
            l.release_ending(
                "a",
                1,
                Some("n1"),
                Phase::Failed,
                Some((ReasonCode::Killed, "")),
                2,
            )
            .await
            .unwrap();
            let a = l.get("a").await.unwrap().unwrap();
            let end = a.end().unwrap();
            assert_eq!(end, (ReasonCode::SpotInterruption, "terminate".to_owned()));
            assert_eq!(end.0.class(), EndClass::Infra);

            lease_in(&l, "b", "n1", &[Phase::Launching, Phase::Online], 0).await;
            l.release_ending(
                "b",
                1,
                Some("n1"),
                Phase::Done,
                Some((ReasonCode::Completed, "")),
                2,
            )
            .await
            .unwrap();
            let b = l.get("b").await.unwrap().unwrap();
            assert_eq!(b.end(), Some((ReasonCode::Completed, String::new())));

            // Written as before codes: the words are read.
            lease_in(&l, "c", "n1", &[Phase::Launching], 0).await;
            l.mark_failure("c", 1, "exit 3", 1).await.unwrap();
            l.release("c", 1, Some("n1"), Phase::Failed, 2).await.unwrap();
            let c = l.get("c").await.unwrap().unwrap();
            assert_eq!(c.end(), Some((ReasonCode::RunnerExit, "3".to_owned())));
            lease_in(&l, "d", "n1", &[Phase::Launching], 0).await;
            l.release("d", 1, Some("n1"), Phase::Failed, 2).await.unwrap();
            let d = l.get("d").await.unwrap().unwrap();
            assert_eq!(d.end(), Some((ReasonCode::Unrecorded, String::new())));
            assert_eq!(d.end().map(|(c, _)| c.class()), Some(EndClass::Unknown));

            // A lost launch ends `launch_lost`.
            l.reserve(new_lease("e"), 0).await.unwrap();
            l.release_unminted("e", 1, 3).await.unwrap();
            let e = l.get("e").await.unwrap().unwrap();
            assert_eq!(e.end().map(|(c, _)| c), Some(ReasonCode::LaunchLost));
        }
    }
}
