//! The stand-in plane's capacity ledger: one SQLite file holding every lease,
//! its phase, its fencing epoch and what it charges.
//!
//! Behaviour follows the reference ledger as described in
//! `spec/ledger-and-github.md` §1:
//!
//! - SQLite in WAL mode with `synchronous = FULL` and a busy timeout. One
//!   writer connection per handle; every write is one transaction opened with
//!   `BEGIN IMMEDIATE`, so a read-decide-write never loses its snapshot and a
//!   second writer (another handle, an operator process) waits in line instead
//!   of failing with `SQLITE_BUSY` (§1.1). Reads go to a separate
//!   `query_only` pool and never wait for the writer.
//! - Every holder write (`bind`, `advance`, `heartbeat`, `release`,
//!   `mark_failure`, `set_runner`) compares the stored epoch with the
//!   presented one inside its transaction before trusting anything else in
//!   the row, and its `UPDATE` carries both `id` and `epoch` (§1.5).
//! - Only a reclaim bumps the epoch: `reap`, `reconcile` and `force_release`
//!   of a quarantined lease. A holder keeps epoch 1 for a lease's whole life
//!   unless the plane took it away.
//! - The reaper quarantines, rather than frees, an expired lease that may
//!   still have compute behind it; quarantine stays charged and leaves only on
//!   proof (§1.7, §1.8).
//!
//! Times are unix milliseconds passed in by the caller (`now_ms`), so tests
//! own the clock. Differences from the reference: epochs start at 1, not 0;
//! there is no nodes table, so placement is not checked and quarantine is
//! attributed to the bound `node` only.
//!
//! Architecture invariant: this is the only module of the stub that imports
//! sqlx.

use std::collections::HashSet;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use sqlx::sqlite::{
    SqliteConnectOptions, SqliteConnection, SqliteJournalMode, SqlitePoolOptions, SqliteRow,
    SqliteSynchronous,
};
use sqlx::{Row, Sqlite, SqlitePool, Transaction};
use thiserror::Error;

/// The TTL the reference ledger uses when none is configured (§1.7).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(90);

/// How long a quarantined lease must have been expired before a node's
/// inventory may free it (§1.8, `quarantineGrace`): a listing taken earlier
/// might miss a container that is still being created.
pub const DEFAULT_QUARANTINE_GRACE: Duration = Duration::from_secs(5 * 60);

/// The failure reason `reconcile` records when it frees a quarantined lease
/// only because a node's inventory no longer lists it. Reserved: a holder
/// may not record it through [`Ledger::mark_failure`].
pub const INVENTORY_ABSENCE: &str = "billet:provisional:inventory-absence";

/// At most this many leases are reaped per [`Ledger::reap`] call, so the
/// single writer is never held for long; the next tick takes the rest.
pub const REAP_BATCH: i64 = 256;

/// How long a writer waits for another process's write lock before the
/// ledger reports the write as unavailable.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// Longest lease id accepted, in bytes.
const MAX_LEASE_ID_LEN: usize = 128;

/// A lease phase. Travels on the wire as its lowercase name ([`Phase::as_str`]).
///
/// The edges are the reference ledger's (`spec/ledger-and-github.md` §1.4):
/// `capacity → assigned → launching → online → busy`; any phase from
/// launching on may go to custody, teardown or quarantine; custody to
/// teardown or quarantine; teardown to quarantine; every live phase to the
/// terminals `done` and `failed`, which release capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Escrowed and advertised, with no job yet.
    Capacity,
    /// GitHub gave this lease a job.
    Assigned,
    /// A node is bringing the instance up.
    Launching,
    /// The runner has registered.
    Online,
    /// The runner is executing the job.
    Busy,
    /// A node keeps compute alive that it can no longer manage as an
    /// ordinary command.
    Custody,
    /// Destruction was requested but not yet confirmed.
    Teardown,
    /// The holder stopped heartbeating while compute might still exist.
    Quarantine,
    /// Terminal: finished.
    Done,
    /// Terminal: failed or reclaimed.
    Failed,
}

impl Phase {
    /// Every phase, in lifecycle order.
    pub const ALL: [Phase; 10] = [
        Phase::Capacity,
        Phase::Assigned,
        Phase::Launching,
        Phase::Online,
        Phase::Busy,
        Phase::Custody,
        Phase::Teardown,
        Phase::Quarantine,
        Phase::Done,
        Phase::Failed,
    ];

    /// The lowercase wire and storage spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Capacity => "capacity",
            Phase::Assigned => "assigned",
            Phase::Launching => "launching",
            Phase::Online => "online",
            Phase::Busy => "busy",
            Phase::Custody => "custody",
            Phase::Teardown => "teardown",
            Phase::Quarantine => "quarantine",
            Phase::Done => "done",
            Phase::Failed => "failed",
        }
    }

    /// The phase spelled `s` exactly (lowercase), or `None`.
    pub fn parse(s: &str) -> Option<Phase> {
        Phase::ALL.into_iter().find(|p| p.as_str() == s)
    }

    /// Whether `self → to` is a legal edge. Staying in the same phase is not
    /// an edge; callers treat it as an idempotent repeat.
    pub fn can_move_to(self, to: Phase) -> bool {
        use Phase::{
            Assigned, Busy, Capacity, Custody, Done, Failed, Launching, Online, Quarantine,
            Teardown,
        };
        match self {
            Capacity => matches!(to, Assigned | Done | Failed),
            Assigned => matches!(to, Launching | Done | Failed),
            Launching => matches!(to, Online | Custody | Teardown | Quarantine | Done | Failed),
            Online => matches!(to, Busy | Custody | Teardown | Quarantine | Done | Failed),
            Busy => matches!(to, Custody | Teardown | Quarantine | Done | Failed),
            Custody => matches!(to, Teardown | Quarantine | Done | Failed),
            Teardown => matches!(to, Quarantine | Done | Failed),
            Quarantine => matches!(to, Done | Failed),
            Done | Failed => false,
        }
    }

    /// `done` or `failed`: the lease no longer charges capacity.
    pub fn is_terminal(self) -> bool {
        matches!(self, Phase::Done | Phase::Failed)
    }

    /// Whether compute may exist behind a lease in this phase, as the reaper
    /// judges it: launching, online, busy, custody, teardown.
    pub fn may_have_compute(self) -> bool {
        matches!(
            self,
            Phase::Launching | Phase::Online | Phase::Busy | Phase::Custody | Phase::Teardown
        )
    }
}

impl fmt::Display for Phase {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why a ledger call was refused. [`LedgerError::code`] gives the stable
/// machine-readable code the wire carries.
#[derive(Debug, Error)]
pub enum LedgerError {
    /// The presented epoch is not the stored one: someone reclaimed the lease.
    /// The caller must stop writing to it. This is not permission to destroy
    /// its compute.
    #[error(
        "lease {lease} is fenced: the ledger holds epoch {held} but epoch {presented} was \
         presented; stop working on this lease (this is not permission to destroy its compute)"
    )]
    Fenced {
        lease: String,
        held: u64,
        presented: u64,
    },
    /// No such lease, or it has already ended.
    #[error("lease {0} is not open in the ledger: it is unknown or has already ended")]
    NotFound(String),
    /// The phase change is not a legal edge.
    #[error("lease {lease} cannot move from {from} to {to}")]
    BadTransition {
        lease: String,
        from: Phase,
        to: Phase,
    },
    /// The lease is bound to another node (`bound`), or to none while already
    /// past assignment, so `asked` may not touch it.
    #[error(
        "lease {lease} is bound to {}, so node {asked} may not touch it",
        bound.as_deref().map_or_else(|| "no node".to_owned(), |b| format!("node {b}"))
    )]
    WrongNode {
        lease: String,
        bound: Option<String>,
        asked: String,
    },
    /// The request contradicts what the ledger already recorded first.
    #[error("ledger conflict: {0}")]
    Conflict(String),
    /// An operator asked the holder to let the lease go.
    #[error(
        "an operator force-released lease {0}: stop renewing it, clean up its compute and release it"
    )]
    ForceRelease(String),
    /// A malformed argument or an unusable ledger file; the text says which.
    #[error("{0}")]
    Invalid(String),
    /// SQLite failed. Transient unless the text says otherwise.
    #[error("ledger storage is unavailable: {0}; retry once storage recovers")]
    Storage(#[from] sqlx::Error),
}

impl LedgerError {
    /// The machine-readable code: `fenced`, `not_found`, `bad_transition`,
    /// `wrong_node`, `conflict`, `force_release`, `invalid` or `unavailable`.
    pub fn code(&self) -> &'static str {
        match self {
            LedgerError::Fenced { .. } => "fenced",
            LedgerError::NotFound(_) => "not_found",
            LedgerError::BadTransition { .. } => "bad_transition",
            LedgerError::WrongNode { .. } => "wrong_node",
            LedgerError::Conflict(_) => "conflict",
            LedgerError::ForceRelease(_) => "force_release",
            LedgerError::Invalid(_) => "invalid",
            LedgerError::Storage(_) => "unavailable",
        }
    }
}

/// Result of a ledger call.
pub type Result<T, E = LedgerError> = std::result::Result<T, E>;

/// One row of the ledger.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    /// Unique id; the instance and runner are named `billet-<id>`.
    pub id: String,
    /// Fencing token, starting at 1; only a reclaim bumps it.
    pub epoch: u64,
    pub phase: Phase,
    /// Tier label (the scale set name).
    pub tier: String,
    /// The node that bound it, if any.
    pub node: Option<String>,
    /// The GitHub job request that caused the reservation.
    pub request_id: i64,
    /// The runner registration name, once known.
    pub runner_name: Option<String>,
    /// The runner registration id, once minted.
    pub runner_id: Option<i64>,
    /// Charged vCPUs.
    pub vcpu: u32,
    /// Charged memory.
    pub memory_bytes: u64,
    /// The reaper takes the lease after this instant.
    pub expires_at_ms: i64,
    /// Last renewal (insert, phase change or heartbeat).
    pub heartbeat_at_ms: i64,
    /// When custody, teardown or quarantine began.
    pub held_at_ms: Option<i64>,
    /// A reason the job will fail, first one recorded.
    pub failure_reason: Option<String>,
    /// An operator asked the custody holder to let go.
    pub force_release: bool,
    pub created_at_ms: i64,
    /// When the lease reached done or failed.
    pub ended_at_ms: Option<i64>,
}

/// What [`Ledger::reserve`] needs to open a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLease {
    /// Unique id: ASCII letters, digits, `-`, `_`, `.`; at most 128 bytes.
    pub id: String,
    pub tier: String,
    pub request_id: i64,
    /// Must be positive.
    pub vcpu: u32,
    /// Must be positive.
    pub memory_bytes: u64,
    /// Usually `billet-<id>`.
    pub runner_name: Option<String>,
}

/// What [`Ledger::reap`] reclaimed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReapReport {
    /// Expired leases that may still have compute: now quarantined, still
    /// charged.
    pub quarantined: Vec<String>,
    /// Expired escrow nobody launched: now failed, capacity freed.
    pub failed: Vec<String>,
}

/// What [`Ledger::force_release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForceReleaseOutcome {
    /// The quarantined lease is now failed and its capacity freed.
    Freed,
    /// The custody or teardown holder was flagged; it sees
    /// [`LedgerError::ForceRelease`] on its next heartbeat and releases.
    Pending,
}

/// Capacity charged by every non-terminal lease, quarantine included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub leases: u32,
    pub vcpu: u64,
    pub memory_bytes: u64,
}

/// The capacity ledger. Cheap to share behind an `Arc`; every method takes
/// `&self` and is safe to call concurrently.
#[derive(Debug)]
pub struct Ledger {
    /// One connection: every write in this process is serialised here.
    writer: SqlitePool,
    /// `query_only` connections for reads; the writer itself when in memory.
    reader: SqlitePool,
    lease_ttl: Duration,
}

/// Schema migrations, append-only: `(version, name, statements)`.
const MIGRATIONS: &[(i64, &str, &[&str])] = &[(
    1,
    "leases and settings",
    &[
        "CREATE TABLE leases (
            id TEXT PRIMARY KEY NOT NULL,
            epoch INTEGER NOT NULL CHECK (epoch >= 1),
            phase TEXT NOT NULL CHECK (phase IN ('capacity', 'assigned', 'launching', 'online',
                'busy', 'custody', 'teardown', 'quarantine', 'done', 'failed')),
            tier TEXT NOT NULL,
            node TEXT,
            request_id INTEGER NOT NULL,
            runner_name TEXT,
            runner_id INTEGER,
            vcpu INTEGER NOT NULL CHECK (vcpu > 0),
            memory_bytes INTEGER NOT NULL CHECK (memory_bytes > 0),
            expires_at_ms INTEGER NOT NULL,
            heartbeat_at_ms INTEGER NOT NULL,
            held_at_ms INTEGER,
            failure_reason TEXT,
            force_release INTEGER NOT NULL DEFAULT 0 CHECK (force_release IN (0, 1)),
            created_at_ms INTEGER NOT NULL,
            ended_at_ms INTEGER
        ) STRICT",
        "CREATE INDEX leases_open_idx ON leases (phase) WHERE phase NOT IN ('done', 'failed')",
        "CREATE INDEX leases_node_idx ON leases (node)",
        "CREATE INDEX leases_expiry_idx ON leases (expires_at_ms)
            WHERE phase NOT IN ('done', 'failed', 'quarantine')",
        "CREATE INDEX leases_runner_name_idx ON leases (runner_name)",
        "CREATE TABLE settings (
            name TEXT PRIMARY KEY NOT NULL,
            value INTEGER NOT NULL
        ) STRICT",
    ],
)];

impl Ledger {
    /// Opens (creating if missing) the ledger file at `path`, migrates its
    /// schema and records `lease_ttl` as the deployment's lease TTL.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`] for a zero TTL, a schema newer than this
    /// build, or a file that cannot be put in WAL mode (a network
    /// filesystem); [`LedgerError::Storage`] when SQLite cannot open it.
    pub async fn open(path: &Path, lease_ttl: Duration) -> Result<Ledger> {
        let base = SqliteConnectOptions::new()
            .filename(path)
            .busy_timeout(BUSY_TIMEOUT)
            .foreign_keys(true);
        let writer_options = base
            .clone()
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Full);
        let writer = single_connection_pool(writer_options).await?;

        let journal_mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&writer)
            .await?;
        if !journal_mode.eq_ignore_ascii_case("wal") {
            return Err(LedgerError::Invalid(format!(
                "the ledger at {} runs in journal mode {journal_mode}, not WAL; put the state \
                 directory on a local filesystem",
                path.display()
            )));
        }
        let ledger_ttl = migrate(&writer, lease_ttl).await?;

        let reader = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(base.pragma("query_only", "ON"))
            .await?;
        Ok(Ledger {
            writer,
            reader,
            lease_ttl: ledger_ttl,
        })
    }

    /// A private in-memory ledger, for tests and throwaway demos.
    ///
    /// # Errors
    ///
    /// As [`Ledger::open`].
    pub async fn open_in_memory(lease_ttl: Duration) -> Result<Ledger> {
        let options = SqliteConnectOptions::new()
            .in_memory(true)
            .foreign_keys(true);
        let writer = single_connection_pool(options).await?;
        let ledger_ttl = migrate(&writer, lease_ttl).await?;
        Ok(Ledger {
            reader: writer.clone(),
            writer,
            lease_ttl: ledger_ttl,
        })
    }

    /// The lease TTL: a lease not renewed within it is reaped. Holders renew
    /// at a third of it.
    pub fn lease_ttl(&self) -> Duration {
        self.lease_ttl
    }

    /// Closes both pools, waiting for in-flight calls.
    pub async fn close(&self) {
        self.writer.close().await;
        self.reader.close().await;
    }

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
        let lease = load_open(&mut tx, id, epoch).await?;
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
        .bind(now_ms.saturating_add(self.ttl_ms()))
        .bind(id)
        .bind(db_epoch(epoch))
        .execute(&mut *tx)
        .await?;
        expect_one_row(done.rows_affected(), id)?;
        finish(tx, id).await
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

    /// The lease as stored, whatever its phase. Unfenced: recovery code that
    /// knows only an instance name reads the current epoch here.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn get(&self, id: &str) -> Result<Option<Lease>> {
        let mut conn = self.reader.acquire().await?;
        load(&mut conn, id).await
    }

    /// The most recent lease whose runner is named `name` (a completion is
    /// routed by runner name).
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn lease_by_runner_name(&self, name: &str) -> Result<Option<Lease>> {
        sqlx::query(
            "SELECT * FROM leases WHERE runner_name = ? ORDER BY created_at_ms DESC, id LIMIT 1",
        )
        .bind(name)
        .fetch_optional(&self.reader)
        .await?
        .as_ref()
        .map(lease_from_row)
        .transpose()
    }

    /// Every lease, oldest first, for reports.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn leases(&self) -> Result<Vec<Lease>> {
        sqlx::query("SELECT * FROM leases ORDER BY created_at_ms, id")
            .fetch_all(&self.reader)
            .await?
            .iter()
            .map(lease_from_row)
            .collect()
    }

    /// The ids bound to `node`: `(launched, quarantined)`, where launched
    /// means launching, online, busy, custody or teardown. A node keeps
    /// instances of either set and treats any other `billet-` instance as an
    /// orphan.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn launched(&self, node: &str) -> Result<(Vec<String>, Vec<String>)> {
        let rows = sqlx::query(
            "SELECT id, phase FROM leases WHERE node = ? AND phase IN
                ('launching', 'online', 'busy', 'custody', 'teardown', 'quarantine')
             ORDER BY id",
        )
        .bind(node)
        .fetch_all(&self.reader)
        .await?;
        let mut launched = Vec::new();
        let mut quarantined = Vec::new();
        for row in rows {
            let id: String = row.try_get("id")?;
            let phase: String = row.try_get("phase")?;
            if phase == Phase::Quarantine.as_str() {
                quarantined.push(id);
            } else {
                launched.push(id);
            }
        }
        Ok((launched, quarantined))
    }

    /// Capacity charged by every non-terminal lease, quarantine included.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn charged(&self) -> Result<Charge> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS leases, COALESCE(SUM(vcpu), 0) AS vcpu,
                COALESCE(SUM(memory_bytes), 0) AS memory_bytes
             FROM leases WHERE phase NOT IN ('done', 'failed')",
        )
        .fetch_one(&self.reader)
        .await?;
        let leases: i64 = row.try_get("leases")?;
        let vcpu: i64 = row.try_get("vcpu")?;
        let memory_bytes: i64 = row.try_get("memory_bytes")?;
        Ok(Charge {
            leases: from_db("leases", leases)?,
            vcpu: from_db("vcpu", vcpu)?,
            memory_bytes: from_db("memory_bytes", memory_bytes)?,
        })
    }

    /// Reclaims up to [`REAP_BATCH`] live leases whose `expires_at_ms` is
    /// before `now_ms`, oldest first (§1.7). One that may have compute goes
    /// to quarantine (epoch + 1, `held_at_ms` set if empty, still charged);
    /// escrow nobody launched (capacity, assigned) fails (epoch + 1, freed).
    /// A quarantined lease is never reaped again.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn reap(&self, now_ms: i64) -> Result<ReapReport> {
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(
            "SELECT * FROM leases
             WHERE phase NOT IN ('done', 'failed', 'quarantine') AND expires_at_ms < ?
             ORDER BY expires_at_ms, id LIMIT ?",
        )
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
                        held_at_ms = COALESCE(held_at_ms, ?)
                     WHERE id = ? AND epoch = ?",
                    &mut report.quarantined,
                )
            } else {
                (
                    "UPDATE leases SET phase = 'failed', epoch = epoch + 1, ended_at_ms = ?
                     WHERE id = ? AND epoch = ?",
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
    pub async fn reconcile(
        &self,
        node: &str,
        running: &[String],
        grace: Duration,
        now_ms: i64,
    ) -> Result<u32> {
        let grace_ms = duration_ms("grace", grace)?;
        let running: HashSet<&str> = running.iter().map(String::as_str).collect();
        let mut tx = self.begin_write().await?;
        let rows = sqlx::query(
            "SELECT id, epoch FROM leases
             WHERE phase = 'quarantine' AND node = ? AND expires_at_ms < ?
             ORDER BY id",
        )
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
                "UPDATE leases SET phase = 'failed', epoch = epoch + 1, ended_at_ms = ?,
                    failure_reason = COALESCE(failure_reason, ?)
                 WHERE id = ? AND epoch = ?",
            )
            .bind(now_ms)
            .bind(INVENTORY_ABSENCE)
            .bind(&id)
            .bind(epoch)
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
    pub async fn force_release(&self, id: &str, now_ms: i64) -> Result<ForceReleaseOutcome> {
        let mut tx = self.begin_write().await?;
        let lease = load(&mut tx, id)
            .await?
            .filter(|l| !l.phase.is_terminal())
            .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
        let (sql, outcome) = match lease.phase {
            Phase::Quarantine => (
                "UPDATE leases SET phase = 'failed', epoch = epoch + 1, ended_at_ms = ?
                 WHERE id = ? AND epoch = ?",
                ForceReleaseOutcome::Freed,
            ),
            Phase::Custody | Phase::Teardown => (
                "UPDATE leases SET force_release = 1, held_at_ms = COALESCE(held_at_ms, ?)
                 WHERE id = ? AND epoch = ?",
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

    fn ttl_ms(&self) -> i64 {
        // `migrate` checked that the TTL fits.
        i64::try_from(self.lease_ttl.as_millis()).unwrap_or(i64::MAX)
    }

    async fn begin_write(&self) -> Result<Transaction<'static, Sqlite>> {
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }
}

/// A pool of exactly one connection that is never recycled (an in-memory
/// database lives only as long as its connection).
async fn single_connection_pool(options: SqliteConnectOptions) -> Result<SqlitePool> {
    Ok(SqlitePoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(options)
        .await?)
}

/// Applies missing migrations and records the TTL, in one write
/// transaction. Returns the TTL now in force.
async fn migrate(writer: &SqlitePool, lease_ttl: Duration) -> Result<Duration> {
    let ttl_ms = duration_ms("lease TTL", lease_ttl)?;
    if ttl_ms == 0 {
        return Err(LedgerError::Invalid(
            "the lease TTL must be at least one millisecond".to_owned(),
        ));
    }
    let mut tx = writer.begin_with("BEGIN IMMEDIATE").await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS schema_migrations (
            version INTEGER PRIMARY KEY NOT NULL,
            name TEXT NOT NULL,
            applied_at_ms INTEGER NOT NULL
        ) STRICT",
    )
    .execute(&mut *tx)
    .await?;
    let applied = sqlx::query("SELECT version, name FROM schema_migrations ORDER BY version")
        .fetch_all(&mut *tx)
        .await?;
    let mut applied_versions = HashSet::new();
    for row in &applied {
        let version: i64 = row.try_get("version")?;
        let name: String = row.try_get("name")?;
        match MIGRATIONS.iter().find(|(v, _, _)| *v == version) {
            None => {
                return Err(LedgerError::Invalid(format!(
                    "the ledger schema has migration {version} ({name}), which this build does \
                     not know; run a billet-plane at least as new as the one that wrote it"
                )));
            }
            Some((_, known, _)) if *known != name => {
                return Err(LedgerError::Invalid(format!(
                    "ledger migration {version} is recorded as {name:?} but this build calls \
                     it {known:?}; the file was written by an incompatible build"
                )));
            }
            Some(_) => {
                applied_versions.insert(version);
            }
        }
    }
    let now_ms = unix_now_ms();
    for (version, name, statements) in MIGRATIONS {
        if applied_versions.contains(version) {
            continue;
        }
        for statement in *statements {
            sqlx::query(*statement).execute(&mut *tx).await?;
        }
        sqlx::query(
            "INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES (?, ?, ?)",
        )
        .bind(version)
        .bind(name)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query(
        "INSERT INTO settings (name, value) VALUES ('lease_ttl_ms', ?)
         ON CONFLICT (name) DO UPDATE SET value = excluded.value",
    )
    .bind(ttl_ms)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(lease_ttl)
}

/// Wall-clock unix milliseconds; only for bookkeeping columns that no rule
/// reads (migration timestamps).
fn unix_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

async fn load(conn: &mut SqliteConnection, id: &str) -> Result<Option<Lease>> {
    sqlx::query("SELECT * FROM leases WHERE id = ?")
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
        .as_ref()
        .map(lease_from_row)
        .transpose()
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

/// Reads the lease back inside the transaction and commits.
async fn finish(mut tx: Transaction<'static, Sqlite>, id: &str) -> Result<Lease> {
    let lease = load(&mut tx, id)
        .await?
        .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
    tx.commit().await?;
    Ok(lease)
}

fn lease_from_row(row: &SqliteRow) -> Result<Lease> {
    let id: String = row.try_get("id")?;
    let phase: String = row.try_get("phase")?;
    let phase = Phase::parse(&phase).ok_or_else(|| {
        sqlx::Error::Decode(format!("lease {id} has unknown phase {phase:?}").into())
    })?;
    let epoch: i64 = row.try_get("epoch")?;
    let vcpu: i64 = row.try_get("vcpu")?;
    let memory_bytes: i64 = row.try_get("memory_bytes")?;
    let force_release: i64 = row.try_get("force_release")?;
    Ok(Lease {
        epoch: from_db("epoch", epoch)?,
        phase,
        tier: row.try_get("tier")?,
        node: row.try_get("node")?,
        request_id: row.try_get("request_id")?,
        runner_name: row.try_get("runner_name")?,
        runner_id: row.try_get("runner_id")?,
        vcpu: from_db("vcpu", vcpu)?,
        memory_bytes: from_db("memory_bytes", memory_bytes)?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        heartbeat_at_ms: row.try_get("heartbeat_at_ms")?,
        held_at_ms: row.try_get("held_at_ms")?,
        failure_reason: row.try_get("failure_reason")?,
        force_release: force_release != 0,
        created_at_ms: row.try_get("created_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        id,
    })
}

/// A stored integer that must fit the field's Rust type.
fn from_db<T: TryFrom<i64>>(column: &str, value: i64) -> Result<T> {
    T::try_from(value).map_err(|_| {
        LedgerError::Storage(sqlx::Error::Decode(
            format!("ledger column {column} holds {value}, which is out of range").into(),
        ))
    })
}

fn to_i64(field: &str, value: u64) -> Result<i64> {
    i64::try_from(value)
        .map_err(|_| LedgerError::Invalid(format!("{field} {value} is too large for the ledger")))
}

/// A presented epoch as stored; one beyond `i64` can match no row.
fn db_epoch(epoch: u64) -> i64 {
    i64::try_from(epoch).unwrap_or(-1)
}

fn duration_ms(what: &str, d: Duration) -> Result<i64> {
    i64::try_from(d.as_millis())
        .map_err(|_| LedgerError::Invalid(format!("the {what} of {d:?} is too long")))
}

/// The single writer and `BEGIN IMMEDIATE` mean nothing can change the row
/// between the fenced read and the update; this is defence in depth.
fn expect_one_row(rows: u64, id: &str) -> Result<()> {
    if rows == 1 {
        Ok(())
    } else {
        Err(LedgerError::Conflict(format!(
            "lease {id} changed while its write was in progress ({rows} rows matched); read it \
             again and retry"
        )))
    }
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
    use std::path::PathBuf;
    use std::sync::Arc;

    use super::*;

    const TTL: Duration = Duration::from_secs(90);
    const TTL_MS: i64 = 90_000;
    const GIB: u64 = 1 << 30;

    fn new_lease(id: &str) -> NewLease {
        NewLease {
            id: id.to_owned(),
            tier: "linux-2cpu".to_owned(),
            request_id: 7,
            vcpu: 2,
            memory_bytes: 4 * GIB,
            runner_name: Some(format!("billet-{id}")),
        }
    }

    async fn ledger() -> Ledger {
        Ledger::open_in_memory(TTL)
            .await
            .expect("open in-memory ledger")
    }

    /// A ledger file in the temp directory, removed (with its WAL) on drop.
    struct TempDb(PathBuf);

    impl TempDb {
        fn new() -> Self {
            Self(std::env::temp_dir().join(format!(
                "billet-ledger-test-{}-{}.db",
                std::process::id(),
                uuid::Uuid::new_v4()
            )))
        }
    }

    impl Drop for TempDb {
        fn drop(&mut self) {
            for suffix in ["", "-wal", "-shm"] {
                let mut path = self.0.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
    }

    /// Reserves, binds to `node` and advances through `path`.
    async fn lease_in(l: &Ledger, id: &str, node: &str, path: &[Phase], now: i64) -> Lease {
        l.reserve(new_lease(id), now).await.expect("reserve");
        let mut lease = l.bind(id, 1, node, now).await.expect("bind");
        for &to in path {
            lease = l.advance(id, 1, node, to, now).await.expect("advance");
        }
        lease
    }

    fn code<T: fmt::Debug>(r: Result<T>) -> &'static str {
        r.expect_err("expected a refusal").code()
    }

    #[test]
    fn every_phase_pair_follows_the_transition_table() {
        use Phase::*;
        // Rows: from; columns: to, in `Phase::ALL` order
        // (capacity assigned launching online busy custody teardown quarantine done failed).
        let table: [(Phase, &str); 10] = [
            (Capacity, ".x......xx"),
            (Assigned, "..x.....xx"),
            (Launching, "...x.xxxxx"),
            (Online, "....xxxxxx"),
            (Busy, ".....xxxxx"),
            (Custody, "......xxxx"),
            (Teardown, ".......xxx"),
            (Quarantine, "........xx"),
            (Done, ".........."),
            (Failed, ".........."),
        ];
        for (from, row) in table {
            for (to, mark) in Phase::ALL.into_iter().zip(row.chars()) {
                assert_eq!(from.can_move_to(to), mark == 'x', "{from} -> {to}");
            }
        }
        assert_eq!(table.map(|(p, _)| p), Phase::ALL);
    }

    #[test]
    fn every_phase_round_trips_through_its_lowercase_wire_spelling() {
        for phase in Phase::ALL {
            assert_eq!(Phase::parse(phase.as_str()), Some(phase));
            assert_eq!(phase.to_string(), phase.as_str());
            assert_eq!(phase.as_str(), phase.as_str().to_lowercase());
        }
        assert_eq!(Phase::parse("Online"), None);
        assert_eq!(Phase::parse(""), None);
        assert_eq!(Phase::parse("running"), None);
    }

    #[test]
    fn only_launching_through_teardown_may_have_compute() {
        let with_compute: Vec<Phase> = Phase::ALL
            .into_iter()
            .filter(|p| p.may_have_compute())
            .collect();
        use Phase::*;
        assert_eq!(with_compute, [Launching, Online, Busy, Custody, Teardown]);
    }

    #[test]
    fn every_error_has_its_machine_readable_code() {
        let lease = || "L".to_owned();
        let cases = [
            (
                LedgerError::Fenced {
                    lease: lease(),
                    held: 2,
                    presented: 1,
                },
                "fenced",
            ),
            (LedgerError::NotFound(lease()), "not_found"),
            (
                LedgerError::BadTransition {
                    lease: lease(),
                    from: Phase::Busy,
                    to: Phase::Online,
                },
                "bad_transition",
            ),
            (
                LedgerError::WrongNode {
                    lease: lease(),
                    bound: None,
                    asked: "b".into(),
                },
                "wrong_node",
            ),
            (LedgerError::Conflict("x".into()), "conflict"),
            (LedgerError::ForceRelease(lease()), "force_release"),
            (LedgerError::Invalid("x".into()), "invalid"),
            (LedgerError::Storage(sqlx::Error::PoolClosed), "unavailable"),
        ];
        for (err, want) in cases {
            assert_eq!(err.code(), want, "{err}");
        }
    }

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
    async fn a_reaped_holder_is_told_fenced_not_not_found() {
        let l = ledger().await;
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
    async fn reap_quarantines_leases_that_may_have_compute_and_fails_the_rest() {
        let l = ledger().await;
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

    #[tokio::test]
    async fn launched_lists_running_and_held_leases_apart_from_quarantine() {
        let l = ledger().await;
        use Phase::{Custody, Launching, Online};
        lease_in(&l, "assigned", "n1", &[], 0).await;
        lease_in(&l, "launching", "n1", &[Launching], 0).await;
        lease_in(&l, "custody", "n1", &[Launching, Online, Custody], 0).await;
        lease_in(&l, "elsewhere", "n2", &[Launching], 0).await;
        lease_in(&l, "stale", "n1", &[Launching], 0).await;
        // Only "stale" expires.
        for id in ["launching", "custody", "elsewhere"] {
            l.heartbeat(id, 1, if id == "elsewhere" { "n2" } else { "n1" }, TTL_MS)
                .await
                .unwrap();
        }
        l.heartbeat("assigned", 1, "n1", TTL_MS).await.unwrap();
        l.reap(TTL_MS + 1).await.unwrap();
        let (launched, quarantined) = l.launched("n1").await.unwrap();
        assert_eq!(launched, ["custody", "launching"]);
        assert_eq!(quarantined, ["stale"]);
        assert_eq!(l.launched("n3").await.unwrap(), (vec![], vec![]));
    }

    #[tokio::test]
    async fn reconcile_frees_only_absent_quarantined_leases_after_the_grace() {
        let l = ledger().await;
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

    #[tokio::test]
    async fn force_release_frees_quarantine_and_asks_a_custody_holder_to_let_go() {
        let l = ledger().await;
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

    #[tokio::test]
    async fn charged_capacity_returns_to_zero_once_every_lease_ends() {
        let l = ledger().await;
        assert_eq!(l.charged().await.unwrap(), Charge::default());
        use Phase::{Busy, Launching, Online};
        lease_in(&l, "a", "n1", &[Launching, Online, Busy], 0).await;
        lease_in(&l, "b", "n1", &[Launching], 0).await;
        l.reserve(new_lease("c"), 0).await.unwrap();
        assert_eq!(
            l.charged().await.unwrap(),
            Charge {
                leases: 3,
                vcpu: 6,
                memory_bytes: 12 * GIB
            }
        );
        l.release("a", 1, Some("n1"), Phase::Done, 1).await.unwrap();
        l.release("c", 1, None, Phase::Failed, 1).await.unwrap();
        // "b" is quarantined: still charged until proof arrives.
        l.reap(TTL_MS + 1).await.unwrap();
        assert_eq!(l.charged().await.unwrap().leases, 1);
        l.reconcile("n1", &[], Duration::ZERO, TTL_MS + 2)
            .await
            .unwrap();
        assert_eq!(l.charged().await.unwrap(), Charge::default());
        assert_eq!(l.leases().await.unwrap().len(), 3);
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

    #[tokio::test]
    async fn reopening_a_ledger_file_keeps_its_leases_and_records_the_new_ttl() {
        let db = TempDb::new();
        {
            let l = Ledger::open(&db.0, TTL).await.unwrap();
            lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
            l.close().await;
        }
        let l = Ledger::open(&db.0, Duration::from_secs(30)).await.unwrap();
        assert_eq!(l.lease_ttl(), Duration::from_secs(30));
        let stored: i64 =
            sqlx::query_scalar("SELECT value FROM settings WHERE name = 'lease_ttl_ms'")
                .fetch_one(&l.reader)
                .await
                .unwrap();
        assert_eq!(stored, 30_000);
        let lease = l.heartbeat("a", 1, "n1", 5).await.unwrap();
        assert_eq!(lease.expires_at_ms, 30_005);
        let versions: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM schema_migrations")
            .fetch_one(&l.reader)
            .await
            .unwrap();
        assert_eq!(versions, i64::try_from(MIGRATIONS.len()).unwrap());
        let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
            .fetch_one(&l.writer)
            .await
            .unwrap();
        assert_eq!(mode, "wal");
        l.close().await;
    }

    #[tokio::test]
    async fn a_ledger_written_by_a_newer_build_is_refused() {
        let db = TempDb::new();
        let l = Ledger::open(&db.0, TTL).await.unwrap();
        sqlx::query("INSERT INTO schema_migrations VALUES (999, 'from the future', 0)")
            .execute(&l.writer)
            .await
            .unwrap();
        l.close().await;
        let err = Ledger::open(&db.0, TTL).await.unwrap_err();
        assert_eq!(err.code(), "invalid", "{err}");
        assert!(err.to_string().contains("999"), "{err}");
    }

    #[tokio::test]
    async fn the_reader_cannot_write() {
        let db = TempDb::new();
        let l = Ledger::open(&db.0, TTL).await.unwrap();
        let refused = sqlx::query("DELETE FROM leases").execute(&l.reader).await;
        assert!(refused.is_err());
        l.close().await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_writers_sharing_one_file_wait_instead_of_failing_busy() {
        let db = TempDb::new();
        // Two handles on one file: two writer connections contending for
        // SQLite's write lock, as the plane and an operator process would.
        let a = Arc::new(Ledger::open(&db.0, TTL).await.unwrap());
        let b = Arc::new(Ledger::open(&db.0, TTL).await.unwrap());
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..8_i64 {
            let l = if i % 2 == 0 {
                Arc::clone(&a)
            } else {
                Arc::clone(&b)
            };
            tasks.spawn(async move {
                let id = format!("lease-{i}");
                let node = format!("n{}", i % 3);
                l.reserve(new_lease(&id), 0).await?;
                l.bind(&id, 1, &node, 0).await?;
                l.advance(&id, 1, &node, Phase::Launching, 0).await?;
                for round in 0..25 {
                    l.heartbeat(&id, 1, &node, round).await?;
                    if round == 10 {
                        l.advance(&id, 1, &node, Phase::Online, round).await?;
                    }
                    if round == 20 {
                        l.advance(&id, 1, &node, Phase::Busy, round).await?;
                    }
                    l.charged().await?;
                }
                l.release(&id, 1, Some(&node), Phase::Done, 100).await?;
                Ok::<_, LedgerError>(())
            });
        }
        while let Some(joined) = tasks.join_next().await {
            joined.expect("task panicked").expect("ledger write failed");
        }
        assert_eq!(a.charged().await.unwrap(), Charge::default());
        let leases = b.leases().await.unwrap();
        assert_eq!(leases.len(), 8);
        assert!(
            leases
                .iter()
                .all(|l| l.phase == Phase::Done && l.epoch == 1)
        );
        a.close().await;
        b.close().await;
    }
}
