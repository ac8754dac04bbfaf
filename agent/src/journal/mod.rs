//! The node journal: the node's memory across its own restarts. The ledger
//! stays the authority; the journal remembers what only this node knows:
//! each launch (lease, epoch, request id, runner registration, instance),
//! each custody entry with why it is held, recent command results for
//! redelivery, and the cache's sticky-disk mounts ([`MountJournal`]), so a
//! restarted node still owns what its guests mounted.
//!
//! [`SqliteJournal`] keeps it in `journal.db` in the state directory (mode
//! 0600, through sqlx); [`MemoryJournal`] is the seam's fake. A journal that
//! cannot be read stops start-up with a message naming the file: it is never
//! silently recreated, because a node that forgot its custody would let a
//! held instance's lease lapse.

use std::path::PathBuf;

use async_trait::async_trait;
use thiserror::Error;

/// Journal file name inside the state directory.
pub(crate) const JOURNAL_FILE: &str = "journal.db";
/// How many command results are kept.
pub(crate) const RESULTS_KEPT: i64 = 4096;

/// How far a journal write has reached when it returns (ARCHITECTURE.md,
/// "What each journal write survives").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// Synced to the disk (SQLite `synchronous = FULL`): survives a power
    /// loss once the call returns.
    Synced,
    /// Committed but not synced (`synchronous = NORMAL` in WAL mode):
    /// survives the process being killed at once, and a power loss once the
    /// next synced write (which syncs every commit before it) or a
    /// checkpoint has happened.
    Committed,
}

/// A journal operation that failed.
#[derive(Debug, Error)]
pub enum JournalError {
    /// The file cannot be opened or is not a journal.
    #[error("node journal {path}: {message}")]
    Open {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        message: String,
    },
    /// A read or write failed.
    #[error("node journal: {0}")]
    Io(String),
}

fn io(e: sqlx::Error) -> JournalError {
    JournalError::Io(e.to_string())
}

/// One launch, recorded before the provider is asked to create anything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchRecord {
    /// Lease id.
    pub lease: String,
    /// Epoch at launch.
    pub epoch: u64,
    /// The request it was launched for.
    pub request_id: i64,
    /// `billet-<lease>`.
    pub instance: String,
    /// GitHub's runner id, once minted (0 before).
    pub runner_id: i64,
    /// The registered runner name, once minted (empty before).
    pub runner_name: String,
    /// Whether the instance was created (false while launching).
    pub created: bool,
}

/// A custody entry as persisted: why the node holds a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CustodyRecord {
    /// Lease id.
    pub lease: String,
    /// Epoch held.
    pub epoch: u64,
    /// `billet-<lease>`.
    pub instance: String,
    /// The request it was launched for.
    pub request_id: i64,
    /// A registration still to remove: (runner id, runner name).
    pub registration: Option<(i64, String)>,
    /// What Release will record: `done`, or `failed: <reason>` (a bare
    /// "failed" from an older build, whose reason was not kept).
    pub outcome: String,
    /// Ledger phase reported each tick, or `None` once quarantined.
    pub phase: Option<String>,
    /// Destroy on sight.
    pub discard: bool,
    /// The provider has seen the instance.
    pub observed: bool,
    /// When custody began, unix milliseconds.
    pub since_unix_ms: i64,
    /// When custody began on the host's boot clock, when it could be read:
    /// what a restarted node on the same boot counts the entry's age from,
    /// so that a wall-clock step while it was down (an NTP correction, an
    /// operator's `date -s`) neither cuts a post-job grace short nor
    /// extends it. Kept in the `custody_clocks` table beside the row.
    pub since_boot: Option<BootStamp>,
}

/// A moment on the host's boot clock (`CLOCK_BOOTTIME`, milliseconds): it
/// counts on across a process restart and is not moved by a wall-clock
/// step, but starts again at a reboot, hence the boot id beside it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BootStamp {
    /// `/proc/sys/kernel/random/boot_id` of the boot it was read in.
    pub boot_id: String,
    /// Milliseconds since that boot.
    pub ms: i64,
}

impl BootStamp {
    /// Now, or `None` where the boot id cannot be read (no `/proc`).
    pub(crate) fn now() -> Option<Self> {
        static BOOT_ID: std::sync::OnceLock<Option<String>> = std::sync::OnceLock::new();
        let boot_id = BOOT_ID
            .get_or_init(|| {
                std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
                    .ok()
                    .map(|id| id.trim().to_owned())
                    .filter(|id| !id.is_empty())
            })
            .clone()?;
        let t = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        Some(Self {
            boot_id,
            ms: t.tv_sec.saturating_mul(1000) + t.tv_nsec / 1_000_000,
        })
    }

    /// This stamp `d` earlier.
    pub(crate) fn before(self, d: std::time::Duration) -> Self {
        Self {
            ms: self.ms - i64::try_from(d.as_millis()).unwrap_or(i64::MAX),
            ..self
        }
    }

    /// How long ago `then` was, by this stamp; `None` when the two are of
    /// different boots.
    pub(crate) fn since(&self, then: &BootStamp) -> Option<std::time::Duration> {
        (self.boot_id == then.boot_id).then(|| {
            std::time::Duration::from_millis(u64::try_from(self.ms - then.ms).unwrap_or(0))
        })
    }
}

/// The node's memory. Every method is idempotent.
#[async_trait]
pub trait Journal: Send + Sync + std::fmt::Debug {
    /// Records (or replaces) a launch, synced.
    async fn put_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError>;
    /// Records a launch's progress (its registration, its created
    /// instance) committed but not synced: it survives the process, and the
    /// next synced write (which syncs every commit before it) makes it
    /// durable. A loss to a power cut before that leaves the synced record
    /// of the launch, from which recovery removes the registration by lease
    /// and asks whether the runner is busy; on a provider that runs on this
    /// host the cut also stopped the instance it describes.
    ///
    /// Only a launch still recorded is amended: one forgotten meanwhile (its
    /// runner, already counted as running, ended and was cleaned up while
    /// the created amendment was being written) stays forgotten.
    async fn amend_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        if self
            .launches()
            .await?
            .iter()
            .any(|l| l.lease == launch.lease)
        {
            self.put_launch(launch).await?;
        }
        Ok(())
    }
    /// Forgets a launch.
    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError>;
    /// Every recorded launch.
    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError>;
    /// Records (or replaces) a custody entry, synced.
    async fn put_custody(&self, entry: &CustodyRecord) -> Result<(), JournalError>;
    /// Records (or replaces) every entry of `entries` in one synced
    /// transaction: all of them or none.
    async fn put_custody_all(&self, entries: &[CustodyRecord]) -> Result<(), JournalError> {
        for entry in entries {
            self.put_custody(entry).await?;
        }
        Ok(())
    }
    /// Forgets a custody entry.
    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError>;
    /// Every custody entry.
    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError>;
    /// Records a command's encoded result at `durability`, in one
    /// transaction; old ones are dropped. Which commands' results are
    /// synced and which only committed is the session's choice
    /// (`session::result_durability`).
    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError>;
    /// Recent results, oldest first.
    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError>;
}

/// One sticky-disk mount as journaled (by the cache): recorded before
/// the clone is made, so a node killed while cloning finds it again, and
/// kept until the mount is committed or discarded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MountRecord {
    /// The mount's id, which names its directory under the cache's
    /// `mounts/`.
    pub mount: String,
    /// The lease whose instance has it bound.
    pub lease: String,
    /// The sticky-disk key (within the node's deployment).
    pub key: String,
    /// The generation it was cloned from; `None` for a cold mount.
    pub parent: Option<u64>,
    /// `"cas"` or `"last-writer-wins"`.
    pub policy: String,
    /// False for a fallback mount (an empty directory after a failed
    /// clone), which is never committed, and for one withdrawn from
    /// publication (its guest settled it: its commit began, or it was
    /// discarded).
    pub committable: bool,
    /// The job ended with GitHub's result `succeeded`: its end commits the
    /// mount instead of discarding it.
    pub succeeded: bool,
    /// When the mount was made, unix milliseconds.
    pub since_unix_ms: i64,
}

/// The cache's part of the node's memory: the sticky-disk mounts that are
/// neither committed nor discarded. A seam of its own, apart from
/// [`Journal`], so the runner's decorators (health, metrics) need not know
/// the cache.
#[async_trait]
pub trait MountJournal: Send + Sync + std::fmt::Debug {
    /// Records (or replaces) a mount, synced.
    async fn put_mount(&self, mount: &MountRecord) -> Result<(), JournalError>;
    /// Forgets a mount, synced.
    async fn forget_mount(&self, mount: &str) -> Result<(), JournalError>;
    /// Every recorded mount, by id.
    async fn mounts(&self) -> Result<Vec<MountRecord>, JournalError>;
    /// Records (or replaces) a guest's cache session, synced.
    async fn put_session(&self, session: &SessionRecord) -> Result<(), JournalError>;
    /// Forgets a session, synced.
    async fn forget_session(&self, lease: &str) -> Result<(), JournalError>;
    /// Every recorded session, by lease.
    async fn sessions(&self) -> Result<Vec<SessionRecord>, JournalError>;
    /// Records (or replaces) a lease's Actions cache session, synced: its
    /// record is the Actions cache archives' JSON (the token's
    /// SHA-256, the scope, the archives it holds), never the token.
    async fn put_actions_session(&self, lease: &str, record: &str) -> Result<(), JournalError>;
    /// Forgets a lease's Actions cache session, synced.
    async fn forget_actions_session(&self, lease: &str) -> Result<(), JournalError>;
    /// Every recorded Actions cache session: (lease, record), by lease.
    async fn actions_sessions(&self) -> Result<Vec<(String, String)>, JournalError>;
}

/// A guest's cache session as journaled (by the cache's guest sessions):
/// recorded before its compute starts, kept until its compute is proven
/// gone, so a restarted node still serves what its guest mounted. Holds
/// the SHA-256 of the session's token, never the token.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionRecord {
    /// The lease whose instance holds the session.
    pub lease: String,
    /// Lowercase hex SHA-256 of the token's text.
    pub token_sha256: String,
    /// The session's slots, JSON (the cache session's slots).
    pub slots: String,
    /// When the session was prepared, unix milliseconds.
    pub since_unix_ms: i64,
}

mod memory;
mod sqlite;

pub use memory::MemoryJournal;
pub use sqlite::SqliteJournal;

#[cfg(test)]
mod tests;
