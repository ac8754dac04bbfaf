//! The stand-in plane's capacity ledger: one database holding every lease,
//! its phase, its fencing epoch and what it charges. SQLite (a file, the
//! embedded default) or PostgreSQL (a server, for a plane that must survive
//! its host, and for several planes sharing one ledger), chosen by a
//! [`LedgerLocation`].
//!
//! Behaviour follows the reference ledger as described in
//! `spec/ledger-and-github.md` §1:
//!
//! - **Durability**: every write is synced before it returns but one:
//!   [`Ledger::set_runner`] commits without waiting for the disk (a
//!   registration a power cut takes is found by its name once the lease has
//!   ended; ARCHITECTURE.md, "Hot paths").
//! - **SQLite**: WAL mode with `synchronous = FULL` and a busy timeout. One
//!   writer connection per handle; every write is one transaction opened with
//!   `BEGIN IMMEDIATE`, so a read-decide-write never loses its snapshot and a
//!   second writer (another handle, an operator process) waits in line instead
//!   of failing with `SQLITE_BUSY` (§1.1). Reads go to a separate
//!   `query_only` pool and never wait for the writer.
//! - **PostgreSQL**: a pool of writer connections at `READ COMMITTED`; every
//!   write transaction locks the rows it decides on before deciding
//!   (`SELECT ... FOR UPDATE` on the lease, or on the node's row in `nodes`
//!   for a reservation or resize on that node), so two handles, in one
//!   process or in two planes, serialise on exactly the rows they share. The
//!   reaper and `reconcile` lock with `SKIP LOCKED`: a lease a holder is
//!   writing is left for the next tick, so they never wait and never
//!   deadlock; a batched heartbeat locks in id order. Reads go to a pool of
//!   read-only sessions.
//! - Every holder write (`bind`, `advance`, `heartbeat`, `release`,
//!   `mark_failure`, `set_runner`, `resize`) compares the stored epoch with
//!   the presented one inside its transaction before trusting anything else
//!   in the row, and its `UPDATE` carries both `id` and `epoch` (§1.5).
//! - Only a reclaim bumps the epoch: `reap`, `reconcile` and `force_release`
//!   of a quarantined lease. A holder keeps epoch 1 for a lease's whole life
//!   unless the plane took it away.
//! - The reaper quarantines, rather than frees, an expired lease that may
//!   still have compute behind it; quarantine stays charged and leaves only on
//!   proof (§1.7, §1.8).
//! - A reservation aimed at a node ([`Ledger::reserve_on`]) and a resize
//!   check the node's capacity inside the transaction, against every open
//!   lease bound or aimed there (`COALESCE(node, target_node)`, §1.4), so
//!   two planes cannot book the same room twice.
//!
//! Both backends run the same code through sqlx's `Any` driver; where their
//! SQL differs (the transaction's opening, row locks, the schema's types) the
//! statement is spelled out for each in a [`Dialect`]. Placeholders are
//! `$1`, `$2`, ..., which both accept.
//!
//! Times are unix milliseconds passed in by the caller (`now_ms`), so tests
//! own the clock; no SQL reads a database clock. Differences from the
//! reference: epochs start at 1, not 0; the `nodes` table holds only names
//! (capacity is presented by the caller, from what the node reported), so
//! placement policy is not checked and quarantine is attributed to the bound
//! `node` only.
//!
//! Architecture invariant: this is the only module of the stub that imports
//! sqlx.
//!
//! # Layout
//!
//! [`Ledger`] is one type; its methods are split by what they may change:
//!
//! - `mod.rs` (here): the vocabulary (the constants, [`LedgerError`],
//!   [`Lease`], [`NewLease`], [`NodeCapacity`], `ReapReport`,
//!   `ForceReleaseOutcome`, [`Charge`]), the handle's `connect`/`close`,
//!   and the discipline every write shares: `begin_write` and
//!   `expect_one_row`. Nothing here queries `leases` itself.
//! - `location.rs`: [`LedgerLocation`], which backend and where, parsed from
//!   a URL or a path, with its password redacted from every print.
//! - `phase.rs`: [`Phase`] and its transition table; pure.
//! - `schema.rs`: migrations (one list per backend, same versions), the
//!   pools, and the mapping between a `leases` row and [`Lease`].
//! - `holder.rs`: `reserve`, `reserve_on` and the epoch-fenced holder
//!   writes, with their fencing helpers.
//! - `reaper.rs`: `reap`, `reconcile` and `force_release`, the only code
//!   that bumps an epoch.
//! - `reads.rs`: the reads, on the read-only pool.
//! - `observations.rs`: [`CacheObservation`], what a node's cache did for
//!   a lease's job, recorded epoch-fenced (terminal leases too), the first
//!   one kept; changes no lease.
//! - `cache_policy.rs`: [`CacheBlock`], the Actions cache kill switch:
//!   organisations and repositories blocked from the node-local Actions
//!   cache, and the question a node asks before serving one; no lease rule.
//! - `tokens.rs`: one-time join tokens (issue, check, redeem), kept by id
//!   with only a hash of their secret; no lease rule.
//! - `wanted.rs`: [`WantedChange`], the jobs a plane keeps covered (assigned
//!   to its scale set, not taken, not ended), durable across a plane's
//!   restart; no lease rule.
//! - `jobs.rs`: [`JobRecord`], each GitHub job's timestamps, the leases
//!   placed for it and the intervals it waited with their reasons, pruned
//!   after a retention bound; no lease rule.
//! - `scratch.rs`: [`scratch::ScratchPostgres`], a throwaway PostgreSQL
//!   database for tests and the benchmark.

mod cache_policy;
mod holder;
mod jobs;
mod location;
mod observations;
mod phase;
mod reads;
mod reaper;
mod schema;
pub mod scratch;
#[cfg(test)]
mod test_support;
mod tokens;
mod wanted;
mod warm;

use std::time::Duration;

use billet_proto::ending::ReasonCode;
use sqlx::{Any, AnyPool, Transaction};
use thiserror::Error;

pub use cache_policy::CacheBlock;
pub use jobs::{JobAttempt, JobRecord, JobWait};
pub(crate) use jobs::{JobMeta, JobNote, JobStep, WaitChange};
pub use location::LedgerLocation;
pub use observations::CacheObservation;
pub use phase::Phase;
use schema::{migrate, postgres_pools, sqlite_file_pools, sqlite_memory_pool};
pub(crate) use wanted::WantedChange;
pub use warm::WarmRoom;

/// The TTL the reference ledger uses when none is configured (§1.7).
pub const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(90);

/// The failure reason `reconcile` records when it frees a quarantined lease
/// only because a node's inventory no longer lists it. Reserved: a holder
/// may not record it through [`Ledger::mark_failure`].
pub(crate) const INVENTORY_ABSENCE: &str = "billet:provisional:inventory-absence";

/// At most this many leases are reaped per [`Ledger::reap`] call, so the
/// single writer is never held for long; the next tick takes the rest.
pub(crate) const REAP_BATCH: i64 = 256;

/// Why a ledger call was refused; `crate::calls` maps it to the error code
/// the wire carries.
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
    /// The node has no room for what was asked: `asked` on top of what is
    /// already `charged` there would exceed its `capacity`. Nothing was
    /// written.
    #[error(
        "node {node} has no room for lease {lease}: it charges {charged} already and {asked} \
         more would exceed its capacity of {capacity}; place it elsewhere or wait"
    )]
    NoCapacity {
        lease: String,
        node: String,
        asked: NodeCapacity,
        charged: NodeCapacity,
        capacity: NodeCapacity,
    },
    /// An operator asked the holder to let the lease go.
    #[error(
        "an operator force-released lease {0}: stop renewing it, clean up its compute and release it"
    )]
    ForceRelease(String),
    /// A malformed argument or an unusable ledger file; the text says which.
    #[error("{0}")]
    Invalid(String),
    /// The database failed. Transient unless the text says otherwise.
    #[error("ledger storage is unavailable: {0}; retry once storage recovers")]
    Storage(#[from] sqlx::Error),
}

impl LedgerError {
    /// The machine-readable code: `fenced`, `not_found`, `bad_transition`,
    /// `wrong_node`, `conflict`, `no_capacity`, `force_release`, `invalid`
    /// or `unavailable`.
    #[cfg(test)]
    pub(crate) fn code(&self) -> &'static str {
        match self {
            LedgerError::Fenced { .. } => "fenced",
            LedgerError::NotFound(_) => "not_found",
            LedgerError::BadTransition { .. } => "bad_transition",
            LedgerError::WrongNode { .. } => "wrong_node",
            LedgerError::Conflict(_) => "conflict",
            LedgerError::NoCapacity { .. } => "no_capacity",
            LedgerError::ForceRelease(_) => "force_release",
            LedgerError::Invalid(_) => "invalid",
            LedgerError::Storage(_) => "unavailable",
        }
    }
}

/// Result of a ledger call.
pub(crate) type Result<T, E = LedgerError> = std::result::Result<T, E>;

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
    /// The node a reservation aimed it at ([`Ledger::reserve_on`]), if any:
    /// only that node may bind it, and it charges that node from the start.
    pub(crate) target_node: Option<String>,
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
    pub(crate) heartbeat_at_ms: i64,
    /// When custody, teardown or quarantine began.
    pub(crate) held_at_ms: Option<i64>,
    /// A reason the job will fail, first one recorded.
    pub failure_reason: Option<String>,
    /// Why it ended, as the holder named it (the first code recorded);
    /// `None` while open, and for a lease that ended before codes existed
    /// or whose holder named none: [`Lease::end`] reads those.
    pub(crate) end_reason: Option<ReasonCode>,
    /// The end's detail (an exit code, an operator's text, an image).
    pub(crate) end_detail: Option<String>,
    /// An operator asked the custody holder to let go.
    pub(crate) force_release: bool,
    pub(crate) created_at_ms: i64,
    /// When the lease reached done or failed.
    pub ended_at_ms: Option<i64>,
}

impl Lease {
    /// Why the lease ended, and the detail, once it has (`None` while
    /// open): the code its holder recorded; else, for a lease that ended
    /// before codes existed or whose holder named none, `completed` for
    /// `done` and what its `failure_reason` words spell for `failed`
    /// ([`ReasonCode::parse_legacy`]; no words at all is `unrecorded`).
    /// Its class is [`ReasonCode::class`].
    pub fn end(&self) -> Option<(ReasonCode, String)> {
        if !self.phase.is_terminal() {
            return None;
        }
        if let Some(code) = self.end_reason {
            return Some((code, self.end_detail.clone().unwrap_or_default()));
        }
        Some(match (self.phase, self.failure_reason.as_deref()) {
            (Phase::Done, _) => (ReasonCode::Completed, String::new()),
            (_, Some(words)) => ReasonCode::parse_legacy(words),
            (_, None) => (ReasonCode::Unrecorded, String::new()),
        })
    }
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
pub(crate) struct ReapReport {
    /// Expired leases that may still have compute: now quarantined, still
    /// charged.
    pub(crate) quarantined: Vec<String>,
    /// Expired escrow nobody launched: now failed, capacity freed.
    pub(crate) failed: Vec<String>,
}

/// What [`Ledger::force_release`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ForceReleaseOutcome {
    /// The quarantined lease is now failed and its capacity freed.
    Freed,
    /// The custody or teardown holder was flagged; it sees
    /// [`LedgerError::ForceRelease`] on its next heartbeat and releases.
    Pending,
}

/// What a node may run at once, as it reported it (`Hello`, then every
/// `Instances` and `Sweep`), or an amount of it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeCapacity {
    pub vcpu: u64,
    pub memory_bytes: u64,
}

impl std::fmt::Display for NodeCapacity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} vCPU and {} bytes", self.vcpu, self.memory_bytes)
    }
}

/// Capacity charged by every non-terminal lease, quarantine included.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Charge {
    pub leases: u32,
    pub vcpu: u64,
    pub memory_bytes: u64,
}

/// The capacity ledger. Cheap to share behind an `Arc`; every method takes
/// `&self` and is safe to call concurrently, and several handles (in one
/// process or in several planes) may share one database.
#[derive(Debug)]
pub struct Ledger {
    /// SQLite: one connection, so every write in this process is serialised
    /// here. PostgreSQL: a pool; row locks serialise what must be.
    writer: AnyPool,
    /// Read-only connections for reads; the writer itself when in memory.
    reader: AnyPool,
    backend: Backend,
    lease_ttl: Duration,
}

/// Which database a [`Ledger`] runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Backend {
    /// A SQLite file (or memory): the embedded default.
    Sqlite,
    /// A PostgreSQL server.
    Postgres,
}

impl Backend {
    /// `sqlite` or `postgres`.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Backend::Sqlite => "sqlite",
            Backend::Postgres => "postgres",
        }
    }
}

impl std::fmt::Display for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One statement spelled for each backend, where their SQL differs (row
/// locks, the opening of a transaction, schema types). Everything else is
/// written once, with `$n` placeholders.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Dialect {
    pub(crate) sqlite: &'static str,
    pub(crate) postgres: &'static str,
}

impl Dialect {
    /// The spelling for `backend`.
    pub(crate) fn pick(self, backend: Backend) -> &'static str {
        match backend {
            Backend::Sqlite => self.sqlite,
            Backend::Postgres => self.postgres,
        }
    }
}

impl Ledger {
    /// Connects to the ledger at `location` (creating a SQLite file if
    /// missing), migrates its schema and records `lease_ttl` as the
    /// deployment's lease TTL.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`] for a zero TTL, a schema newer than this
    /// build, or a SQLite file that cannot be put in WAL mode (a network
    /// filesystem); [`LedgerError::Storage`] when the database cannot be
    /// opened or reached.
    pub async fn connect(location: &LedgerLocation, lease_ttl: Duration) -> Result<Ledger> {
        sqlx::any::install_default_drivers();
        let (writer, reader, backend) = match location {
            LedgerLocation::Sqlite(path) => {
                let (writer, reader) = sqlite_file_pools(path).await?;
                (writer, reader, Backend::Sqlite)
            }
            LedgerLocation::SqliteMemory => {
                let pool = sqlite_memory_pool().await?;
                (pool.clone(), pool, Backend::Sqlite)
            }
            LedgerLocation::Postgres(url) => {
                let (writer, reader) = postgres_pools(url).await?;
                (writer, reader, Backend::Postgres)
            }
        };
        let ledger_ttl = migrate(&writer, backend, lease_ttl).await?;
        Ok(Ledger {
            writer,
            reader,
            backend,
            lease_ttl: ledger_ttl,
        })
    }

    /// A private in-memory SQLite ledger, for tests and throwaway demos.
    ///
    /// # Errors
    ///
    /// As [`Ledger::connect`].
    #[cfg(test)]
    pub(crate) async fn open_in_memory(lease_ttl: Duration) -> Result<Ledger> {
        Ledger::connect(&LedgerLocation::SqliteMemory, lease_ttl).await
    }

    /// Which database this ledger runs on.
    pub fn backend(&self) -> Backend {
        self.backend
    }

    /// The lease TTL: a lease not renewed within it is reaped. Holders renew
    /// at a third of it.
    #[cfg(test)]
    pub(crate) fn lease_ttl(&self) -> Duration {
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

    /// This backend's spelling of `d`.
    fn sql(&self, d: Dialect) -> &'static str {
        d.pick(self.backend)
    }

    /// Opens a write transaction: `BEGIN IMMEDIATE` on SQLite's single
    /// writer (the write lock is taken at once); a plain `BEGIN` at
    /// `READ COMMITTED` on PostgreSQL, where each write locks its rows.
    async fn begin_write(&self) -> Result<Transaction<'static, Any>> {
        Ok(match self.backend {
            Backend::Sqlite => self.writer.begin_with("BEGIN IMMEDIATE").await?,
            Backend::Postgres => self.writer.begin().await?,
        })
    }
}

/// Row locks (PostgreSQL) and the single writer with `BEGIN IMMEDIATE`
/// (SQLite) mean nothing can change the row between the fenced read and the
/// update; this is defence in depth.
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
    use crate::ledger::test_support::{GIB, TTL_MS, lease_in, new_lease, on_both_backends};

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
            (
                LedgerError::NoCapacity {
                    lease: lease(),
                    node: "n1".into(),
                    asked: NodeCapacity::default(),
                    charged: NodeCapacity::default(),
                    capacity: NodeCapacity::default(),
                },
                "no_capacity",
            ),
            (LedgerError::ForceRelease(lease()), "force_release"),
            (LedgerError::Invalid("x".into()), "invalid"),
            (LedgerError::Storage(sqlx::Error::PoolClosed), "unavailable"),
        ];
        for (err, want) in cases {
            assert_eq!(err.code(), want, "{err}");
        }
    }

    on_both_backends! {
        async fn the_reader_cannot_write(db) {
            let l = db.ledger().await;
            let refused = sqlx::query("DELETE FROM leases").execute(&l.reader).await;
            assert!(refused.is_err(), "{}", l.backend());
            l.close().await;
        }
    }

    on_both_backends! {
        /// Two handles on one database, as the plane and an operator process
        /// (SQLite), or two planes (PostgreSQL), would hold: writes wait for
        /// each other instead of failing busy, and none is lost.
        async fn concurrent_writers_sharing_one_database_wait_instead_of_failing(db) {
            let (a, b) = tokio::join!(db.ledger(), db.ledger());
            let (a, b) = (Arc::new(a), Arc::new(b));
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

    /// Room for four 2-vCPU, 4 GiB leases.
    const ROOM: NodeCapacity = NodeCapacity {
        vcpu: 8,
        memory_bytes: 64 * GIB,
    };

    on_both_backends! {
        /// Two ledger handles (two pools, as two plane processes would hold)
        /// race 32 reservations for room for 4 on one node: exactly 4 are
        /// booked, the rest are refused `no_capacity`, and a lease id both race
        /// for is reserved once.
        async fn two_planes_racing_for_one_nodes_room_never_book_beyond_it(db) {
            // Both connect at once: the schema is migrated once, not twice.
            let (a, b) = tokio::join!(db.ledger(), db.ledger());
            let planes = [Arc::new(a), Arc::new(b)];
            let mut tasks = tokio::task::JoinSet::new();
            for i in 0..32 {
                let l = Arc::clone(&planes[i % 2]);
                tasks.spawn(async move {
                    l.reserve_on(new_lease(&format!("race-{i}")), "n1", ROOM, 0)
                        .await
                        .map_or_else(|e| e.code(), |_| "ok")
                });
            }
            let mut codes = std::collections::BTreeMap::new();
            while let Some(code) = tasks.join_next().await {
                *codes.entry(code.expect("task panicked")).or_insert(0) += 1;
            }
            assert_eq!(
                codes,
                [("no_capacity", 28), ("ok", 4)].into_iter().collect(),
                "{}",
                db.location()
            );
            for l in &planes {
                let charged = l.charged_on("n1").await.unwrap();
                assert_eq!((charged.leases, charged.vcpu), (4, 8));
            }

            // One id, raced from both planes on a node with room: one wins.
            let [a, b] = &planes;
            let (x, y) = tokio::join!(
                a.reserve_on(new_lease("twice"), "n2", ROOM, 0),
                b.reserve_on(new_lease("twice"), "n2", ROOM, 0),
            );
            let mut outcomes = [
                x.map_or_else(|e| e.code(), |_| "ok"),
                y.map_or_else(|e| e.code(), |_| "ok"),
            ];
            outcomes.sort_unstable();
            assert_eq!(outcomes, ["conflict", "ok"]);
            assert_eq!(a.charged_on("n2").await.unwrap().leases, 1);
            for l in &planes {
                l.close().await;
            }
        }
    }

    on_both_backends! {
        /// Reservations racing two planes' reapers on one node. Expired escrow
        /// aimed at the node is failed by exactly one reaper while new
        /// reservations take the room it frees; a reader watching throughout
        /// never sees the node charged beyond its capacity, and at the end what
        /// is charged is exactly what was booked.
        async fn reservations_racing_two_reapers_never_overbook_a_node(db) {
            let (a, b) = tokio::join!(db.ledger(), db.ledger());
            let planes = [Arc::new(a), Arc::new(b)];
            // Two expired escrows hold half the room.
            for id in ["stale-0", "stale-1"] {
                planes[0].reserve_on(new_lease(id), "n1", ROOM, 0).await.unwrap();
            }
            let now = TTL_MS + 1;
            let watching = Arc::new(std::sync::atomic::AtomicBool::new(true));
            let watcher = {
                let l = Arc::clone(&planes[1]);
                let watching = Arc::clone(&watching);
                tokio::spawn(async move {
                    let mut peak = 0;
                    while watching.load(std::sync::atomic::Ordering::SeqCst) {
                        let charged = l.charged_on("n1").await.unwrap();
                        assert!(charged.vcpu <= ROOM.vcpu, "overbooked: {charged:?}");
                        peak = peak.max(charged.vcpu);
                        tokio::task::yield_now().await;
                    }
                    peak
                })
            };
            let mut reapers = tokio::task::JoinSet::new();
            for l in &planes {
                let l = Arc::clone(l);
                reapers.spawn(async move {
                    let mut failed = Vec::new();
                    for _ in 0..5 {
                        failed.extend(l.reap(now).await.unwrap().failed);
                        tokio::task::yield_now().await;
                    }
                    failed
                });
            }
            let mut reservations = tokio::task::JoinSet::new();
            for i in 0..16 {
                let l = Arc::clone(&planes[i % 2]);
                reservations.spawn(async move {
                    match l.reserve_on(new_lease(&format!("new-{i}")), "n1", ROOM, now).await {
                        Ok(_) => true,
                        Err(LedgerError::NoCapacity { .. }) => false,
                        Err(e) => panic!("reservation failed: {e}"),
                    }
                });
            }
            let mut booked = 0_u64;
            while let Some(ok) = reservations.join_next().await {
                booked += u64::from(ok.expect("task panicked"));
            }
            let mut reaped = Vec::new();
            while let Some(failed) = reapers.join_next().await {
                reaped.extend(failed.expect("task panicked"));
            }
            watching.store(false, std::sync::atomic::Ordering::SeqCst);
            let peak = watcher.await.expect("watcher panicked");
            reaped.sort();
            assert_eq!(reaped, ["stale-0", "stale-1"], "each escrow is reaped once");
            for id in ["stale-0", "stale-1"] {
                let stale = planes[0].get(id).await.unwrap().unwrap();
                assert_eq!((stale.phase, stale.epoch), (Phase::Failed, 2));
            }
            assert!((2..=4).contains(&booked), "booked {booked}");
            let charged = planes[0].charged_on("n1").await.unwrap();
            assert_eq!(charged.vcpu, 2 * booked);
            assert!(peak <= ROOM.vcpu);
            for l in &planes {
                l.close().await;
            }
        }
    }

    on_both_backends! {
        /// Two planes' reapers and the node's heartbeats race over forty
        /// expired leases. Each lease is reclaimed at most once (its epoch
        /// moves once, one reaper reports it); a heartbeat that succeeded kept
        /// its lease, and one refused `fenced` lost it.
        async fn two_reapers_and_heartbeats_racing_reclaim_each_lease_once(db) {
            let (a, b) = tokio::join!(db.ledger(), db.ledger());
            let planes = [Arc::new(a), Arc::new(b)];
            let ids: Vec<String> = (0..40).map(|i| format!("lease-{i:02}")).collect();
            for id in &ids {
                lease_in(&planes[0], id, "n1", &[Phase::Launching], 0).await;
            }
            let now = TTL_MS + 1;
            let mut reapers = tokio::task::JoinSet::new();
            for l in &planes {
                let l = Arc::clone(l);
                reapers.spawn(async move {
                    let mut quarantined = Vec::new();
                    for _ in 0..4 {
                        quarantined.extend(l.reap(now).await.unwrap().quarantined);
                    }
                    quarantined
                });
            }
            let mut beats = tokio::task::JoinSet::new();
            for (i, id) in ids.iter().enumerate().filter(|(i, _)| i % 2 == 0) {
                let l = Arc::clone(&planes[(i / 2) % 2]);
                let id = id.clone();
                beats.spawn(async move {
                    let code = l
                        .heartbeat(&id, 1, "n1", now)
                        .await
                        .map_or_else(|e| e.code(), |_| "ok");
                    (id, code)
                });
            }
            let mut beat = std::collections::HashMap::new();
            while let Some(joined) = beats.join_next().await {
                let (id, code) = joined.expect("task panicked");
                assert!(matches!(code, "ok" | "fenced"), "{id}: {code}");
                beat.insert(id, code);
            }
            let mut reported = Vec::new();
            while let Some(joined) = reapers.join_next().await {
                reported.extend(joined.expect("task panicked"));
            }
            // What both skipped while a heartbeat held it, the next tick takes.
            reported.extend(planes[0].reap(now).await.unwrap().quarantined);
            let mut once = reported.clone();
            once.sort();
            once.dedup();
            assert_eq!(once.len(), reported.len(), "a lease was reaped twice: {reported:?}");
            for id in &ids {
                let lease = planes[1].get(id).await.unwrap().unwrap();
                let quarantined = reported.contains(id);
                match beat.get(id).copied() {
                    Some("ok") => assert_eq!(
                        (lease.phase, lease.epoch, quarantined),
                        (Phase::Launching, 1, false),
                        "{id} was renewed"
                    ),
                    _ => assert_eq!(
                        (lease.phase, lease.epoch, quarantined),
                        (Phase::Quarantine, 2, true),
                        "{id} was not renewed"
                    ),
                }
            }
            for l in &planes {
                l.close().await;
            }
        }
    }
}
