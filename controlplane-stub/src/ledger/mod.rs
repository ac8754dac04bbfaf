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
//!
//! # Layout
//!
//! [`Ledger`] is one type; its methods are split by what they may change:
//!
//! - `mod.rs` (here): the vocabulary (the constants, [`LedgerError`],
//!   [`Lease`], [`NewLease`], [`ReapReport`], [`ForceReleaseOutcome`],
//!   [`Charge`]), the handle's `open`/`close`, and the discipline every write
//!   shares: `begin_write` (`BEGIN IMMEDIATE` on the single writer) and
//!   `expect_one_row`. Nothing here queries `leases` itself.
//! - `phase.rs`: [`Phase`] and its transition table; pure.
//! - `schema.rs`: migrations, the single-connection pool, and the mapping
//!   between a `leases` row and [`Lease`].
//! - `holder.rs`: `reserve` and the epoch-fenced holder writes, with their
//!   fencing helpers.
//! - `reaper.rs`: `reap`, `reconcile` and `force_release`, the only code
//!   that bumps an epoch.
//! - `reads.rs`: the reads, on the `query_only` pool.

mod holder;
mod phase;
mod reads;
mod reaper;
mod schema;
#[cfg(test)]
mod test_support;

use std::path::Path;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{Sqlite, SqlitePool, Transaction};
use thiserror::Error;

pub use phase::Phase;
use schema::{migrate, single_connection_pool};

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

    fn ttl_ms(&self) -> i64 {
        // `migrate` checked that the TTL fits.
        i64::try_from(self.lease_ttl.as_millis()).unwrap_or(i64::MAX)
    }

    async fn begin_write(&self) -> Result<Transaction<'static, Sqlite>> {
        Ok(self.writer.begin_with("BEGIN IMMEDIATE").await?)
    }
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

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::ledger::test_support::{TTL, TempDb, new_lease};

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
