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

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use async_trait::async_trait;
use sqlx::Row;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
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
    /// What Release will record: "done", or "failed: <reason>" (a bare
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

/// The journal in SQLite.
#[derive(Debug)]
pub struct SqliteJournal {
    pool: SqlitePool,
}

const SCHEMA: &str = "
CREATE TABLE IF NOT EXISTS launches (
    lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, request_id INTEGER NOT NULL,
    instance TEXT NOT NULL, runner_id INTEGER NOT NULL, runner_name TEXT NOT NULL,
    created INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS custody (
    lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, instance TEXT NOT NULL,
    request_id INTEGER NOT NULL, registration_id INTEGER, registration_name TEXT,
    outcome TEXT NOT NULL, phase TEXT, discard INTEGER NOT NULL, observed INTEGER NOT NULL,
    since_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS results (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, command TEXT NOT NULL UNIQUE, encoded BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS cache_mounts (
    mount TEXT PRIMARY KEY, lease TEXT NOT NULL, key TEXT NOT NULL, parent INTEGER,
    policy TEXT NOT NULL, committable INTEGER NOT NULL, succeeded INTEGER NOT NULL,
    since_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS cache_sessions (
    lease TEXT PRIMARY KEY, token_sha256 TEXT NOT NULL, slots TEXT NOT NULL,
    since_unix_ms INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS actions_sessions (
    lease TEXT PRIMARY KEY, record TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS custody_clocks (
    lease TEXT PRIMARY KEY, since_unix_ms INTEGER NOT NULL, boot_id TEXT NOT NULL,
    since_boot_ms INTEGER NOT NULL
);
";

/// The tables added to schema 1 since it was first released (the
/// sticky-disk mounts), which a journal without them gets when a node of
/// this release opens it. Adding a table does not change the schema
/// version: a release before it checks only the tables it knows and ignores
/// another, so a rollback through `billet host-upgrade` to that release
/// still reads a journal this one wrote.
const ADDED_TABLES: &[&str] = &[
    "cache_mounts",
    "cache_sessions",
    "actions_sessions",
    "custody_clocks",
];

/// `PRAGMA application_id` of a billet node journal ("bltj"): a SQLite
/// file without it is some other program's, or no journal at all.
pub(crate) const APPLICATION_ID: i64 = 0x626c_746a;
/// `PRAGMA user_version`: the journal's schema version. It changes only
/// with a change an older release cannot read (a column changed or
/// removed), which makes that release refuse the journal; an added table
/// (`ADDED_TABLES`) is not one.
pub(crate) const SCHEMA_VERSION: i64 = 1;

/// Stamps a database as a journal of this schema. Both values are this
/// module's integer constants.
fn stamp() -> sqlx::AssertSqlSafe<String> {
    sqlx::AssertSqlSafe(format!(
        "PRAGMA application_id = {APPLICATION_ID}; PRAGMA user_version = {SCHEMA_VERSION};"
    ))
}

/// What to do about a journal that is damaged or not a journal.
const DAMAGED: &str =
    "move it aside only if this node holds no compute, or restore it from a backup";

impl SqliteJournal {
    /// Opens `journal.db` in `state_dir`, or creates it whole when there is
    /// none: built under a temporary name and renamed into place, so a
    /// `journal.db` that exists was always a complete journal. The file and
    /// SQLite's `-wal` and `-shm` beside it are kept at mode 0600.
    ///
    /// # Errors
    ///
    /// [`JournalError::Open`] naming the file, saying what is wrong and
    /// what to do: the node cannot read and write it; it fails SQLite's
    /// integrity check; it is empty, another program's database, or a
    /// journal whose tables are not this release's; it was written by a
    /// newer release.
    pub async fn open(state_dir: &Path) -> Result<Self, JournalError> {
        let path = state_dir.join(JOURNAL_FILE);
        let fail = |message: String| JournalError::Open {
            path: path.clone(),
            message,
        };
        if !probe(state_dir)? {
            create_whole(&path)
                .await
                .map_err(|e| fail(format!("cannot create: {e}")))?;
        }
        let pool = connect(&path, false).await?;
        sqlx::query("PRAGMA journal_mode = WAL")
            .execute(&pool)
            .await
            .map_err(|e| fail(format!("cannot write: {e}")))?;
        keep_private(&path);
        Ok(Self { pool })
    }

    /// The journal's connection, set to write with `durability`. Set on
    /// every write (a pragma, no I/O), so a connection the pool replaced
    /// cannot keep another write's setting.
    ///
    /// SQLite refuses the pragma inside a transaction, so it is also the
    /// check that the connection is not stuck in one: a transaction that
    /// failed for want of space is rolled back by SQLite itself, and sqlx,
    /// whose own rollback then fails, goes on counting it open, so its next
    /// transaction is a savepoint that is never committed. A connection
    /// that refuses the pragma is closed, never reused, and the write
    /// goes to a fresh one (else a node whose jobs ended while its state
    /// disk was full would journal nothing more until a restart, "Safety
    /// level may not be changed inside a transaction"). A write on a stuck
    /// connection fails here, before it writes, so none is lost in a
    /// transaction that would never commit.
    async fn connection(
        &self,
        durability: Durability,
    ) -> Result<sqlx::pool::PoolConnection<sqlx::Sqlite>, JournalError> {
        let pragma = match durability {
            Durability::Synced => "PRAGMA synchronous = FULL",
            Durability::Committed => "PRAGMA synchronous = NORMAL",
        };
        let mut conn = self.pool.acquire().await.map_err(io)?;
        if let Err(e) = sqlx::query(pragma).execute(&mut *conn).await {
            tracing::warn!(error = %e, "the journal's connection refused a write's setting; closing it and writing on a fresh one");
            drop(conn.detach());
            conn = self.pool.acquire().await.map_err(io)?;
            sqlx::query(pragma).execute(&mut *conn).await.map_err(io)?;
        }
        Ok(conn)
    }

    async fn write_launch(&self, l: &LaunchRecord) -> Result<(), JournalError> {
        let mut conn = self.connection(Durability::Synced).await?;
        sqlx::query(
            "INSERT OR REPLACE INTO launches (lease, epoch, request_id, instance, runner_id, runner_name, created)
             VALUES (?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&l.lease)
        .bind(i64::try_from(l.epoch).unwrap_or(i64::MAX))
        .bind(l.request_id)
        .bind(&l.instance)
        .bind(l.runner_id)
        .bind(&l.runner_name)
        .bind(l.created)
        .execute(&mut *conn)
        .await
        .map_err(io)?;
        Ok(())
    }

    /// Checks, as [`SqliteJournal::open`] would and without writing
    /// anything, that `journal.db` in `state_dir` can be used: absent (a
    /// node creates it), or a whole journal of this release that this user
    /// can read and write. Returns whether it exists.
    ///
    /// # Errors
    ///
    /// [`JournalError::Open`], as [`SqliteJournal::open`] reports it.
    pub async fn check(state_dir: &Path) -> Result<bool, JournalError> {
        if !probe(state_dir)? {
            return Ok(false);
        }
        connect(&state_dir.join(JOURNAL_FILE), true)
            .await?
            .close()
            .await;
        Ok(true)
    }
}

/// Whether `journal.db` exists in `state_dir` and this user may open it for
/// reading and writing.
fn probe(state_dir: &Path) -> Result<bool, JournalError> {
    let path = state_dir.join(JOURNAL_FILE);
    let fail = |message: String| JournalError::Open {
        path: path.clone(),
        message,
    };
    match std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&path)
    {
        Ok(_) => Ok(true),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let wal = sidecar(&path, "-wal");
            if wal.exists() {
                // SQLite would replay it into the new journal.
                return Err(fail(format!(
                    "is missing but its write-ahead log {} is not: the journal was moved without it; move {} and {} along with it, or remove them",
                    wal.display(),
                    wal.display(),
                    sidecar(&path, "-shm").display()
                )));
            }
            Ok(false)
        }
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(fail(format!(
            "cannot open it for reading and writing ({e}); give the user billet node runs as read and write access to it and to {}",
            state_dir.display()
        ))),
        Err(e) if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem => Err(fail(format!(
            "cannot open it for writing ({e}); the node records every launch before it starts it, so it needs a writable state directory"
        ))),
        Err(e) => Err(fail(format!("cannot open: {e}; {DAMAGED}"))),
    }
}

/// Connects to the journal at `path` (which exists) and checks that it is
/// whole and a journal of this release. Nothing is written: until the file
/// is known to be a journal it gets no journal mode (the caller sets WAL,
/// which persists).
async fn connect(path: &Path, read_only: bool) -> Result<SqlitePool, JournalError> {
    let fail = |message: String| JournalError::Open {
        path: path.to_owned(),
        message,
    };
    let options = SqliteConnectOptions::new()
        .filename(path)
        .create_if_missing(false)
        .read_only(read_only)
        .busy_timeout(std::time::Duration::from_secs(5));
    // No ping before each use: the database is a local file with no peer
    // to lose, and a ping is one more trip to sqlx's worker thread in
    // series before every write. A connection that breaks is found by
    // the write itself (see `SqliteJournal::connection`).
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .test_before_acquire(false)
        .connect_with(options)
        .await
        .map_err(|e| fail(format!("cannot open: {e}; {DAMAGED}")))?;
    let check: String = sqlx::query_scalar("PRAGMA quick_check")
        .fetch_one(&pool)
        .await
        .map_err(|e| fail(format!("cannot read: {e}; {DAMAGED}")))?;
    if check != "ok" {
        return Err(fail(format!(
            "failed its integrity check: {check}; {DAMAGED}"
        )));
    }
    identify(&pool, read_only).await.map_err(fail)?;
    Ok(pool)
}

/// Builds a fresh journal at `<path>.new` (any leftover of an earlier
/// attempt replaced) and renames it to `path`.
async fn create_whole(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let staging = path.with_extension("db.new");
    for leftover in [staging.clone(), sidecar(&staging, "-journal")] {
        match std::fs::remove_file(&leftover) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(format!("{}: {e}", leftover.display())),
        }
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&staging)
        .map_err(|e| format!("{}: {e}", staging.display()))?;
    let options = SqliteConnectOptions::new()
        .filename(&staging)
        .journal_mode(SqliteJournalMode::Delete);
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(options)
        .await
        .map_err(|e| format!("{}: {e}", staging.display()))?;
    for sql in [stamp(), sqlx::AssertSqlSafe(SCHEMA.to_owned())] {
        sqlx::raw_sql(sql)
            .execute(&pool)
            .await
            .map_err(|e| format!("{}: {e}", staging.display()))?;
    }
    pool.close().await;
    std::fs::File::open(&staging)
        .and_then(|f| f.sync_all())
        .map_err(|e| format!("{}: {e}", staging.display()))?;
    std::fs::rename(&staging, path).map_err(|e| format!("{}: {e}", staging.display()))?;
    if let Some(dir) = path.parent() {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
    Ok(())
}

/// Every table of a database (SQLite's own aside) and its columns, in
/// order.
async fn shape(pool: &SqlitePool) -> Result<BTreeMap<String, Vec<String>>, sqlx::Error> {
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
    )
    .fetch_all(pool)
    .await?;
    let mut shape = BTreeMap::new();
    for table in tables {
        let columns = sqlx::query_scalar("SELECT name FROM pragma_table_info(?) ORDER BY cid")
            .bind(&table)
            .fetch_all(pool)
            .await?;
        shape.insert(table, columns);
    }
    Ok(shape)
}

/// The tables and columns [`SCHEMA`] makes, read off an in-memory database
/// it is run in, so the check below never drifts from the schema.
async fn schema_shape() -> Result<BTreeMap<String, Vec<String>>, sqlx::Error> {
    let memory = SqlitePoolOptions::new()
        .max_connections(1)
        .connect_with(SqliteConnectOptions::new().in_memory(true))
        .await?;
    sqlx::raw_sql(SCHEMA).execute(&memory).await?;
    let shape = shape(&memory).await;
    memory.close().await;
    shape
}

/// Checks that the open database is a billet node journal of this schema.
/// A journal from before the application id was set (its tables exactly
/// this schema's) is stamped with it; one without the added tables gets
/// them (unless `read_only`, which only checks).
async fn identify(pool: &SqlitePool, read_only: bool) -> Result<(), String> {
    let read = |e: sqlx::Error| format!("cannot read: {e}; {DAMAGED}");
    let id: i64 = sqlx::query_scalar("PRAGMA application_id")
        .fetch_one(pool)
        .await
        .map_err(read)?;
    let version: i64 = sqlx::query_scalar("PRAGMA user_version")
        .fetch_one(pool)
        .await
        .map_err(read)?;
    let found = shape(pool).await.map_err(read)?;
    if id != APPLICATION_ID && id != 0 {
        return Err(format!(
            "is another program's SQLite database (application id {id:#x}), not a billet node journal; point --state-dir at billet's own directory"
        ));
    }
    if id == 0 && found.is_empty() {
        return Err(format!(
            "holds no journal (it is empty): billet creates it whole, so it was truncated or replaced; {DAMAGED}"
        ));
    }
    if id == APPLICATION_ID && version > SCHEMA_VERSION {
        return Err(format!(
            "was written by a newer billet (journal schema {version}, this release reads {SCHEMA_VERSION}); run that release again"
        ));
    }
    let expected = schema_shape()
        .await
        .map_err(|e| format!("cannot check it against the schema: {e}"))?;
    // A journal written before the added tables (or older, without an id)
    // is this schema less them: given them, in one transaction.
    let mut schema_1 = expected.clone();
    schema_1.retain(|table, _| !ADDED_TABLES.contains(&table.as_str()));
    // A journal of an earlier release has every table of schema 1 and some
    // (or none) of the added ones.
    let older = found != expected
        && schema_1.iter().all(|(t, c)| found.get(t) == Some(c))
        && found.iter().all(|(t, c)| expected.get(t) == Some(c));
    if older {
        if read_only {
            return Ok(());
        }
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "BEGIN IMMEDIATE; {SCHEMA} {} COMMIT;",
            stamp().0
        )))
        .execute(pool)
        .await
        .map_err(|e| format!("cannot upgrade it to journal schema {SCHEMA_VERSION}: {e}"))?;
        return Ok(());
    }
    // A table with other columns says more than a missing one.
    let differs = |(table, columns): &(&String, &Vec<String>)| found.get(*table) != Some(*columns);
    if let Some((table, columns)) = expected
        .iter()
        .filter(|(table, _)| found.contains_key(*table))
        .find(differs)
        .or_else(|| expected.iter().find(differs))
    {
        let what = if id == 0 {
            "is not a billet node journal"
        } else {
            "is damaged"
        };
        return Err(format!(
            "{what}: table {table} has columns {:?}, expected {columns:?}; {DAMAGED}",
            found.get(table).cloned().unwrap_or_default()
        ));
    }
    if id == 0 {
        sqlx::raw_sql(stamp())
            .execute(pool)
            .await
            .map_err(|e| format!("cannot write: {e}"))?;
    }
    Ok(())
}

/// `journal.db` plus SQLite's `suffix` file beside it.
fn sidecar(path: &Path, suffix: &str) -> PathBuf {
    let mut name = path.as_os_str().to_owned();
    name.push(suffix);
    PathBuf::from(name)
}

/// Sets the journal and SQLite's files beside it to mode 0600, whoever
/// created them (SQLite gives `-wal` and `-shm` the journal's own mode).
fn keep_private(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for file in [
        path.to_owned(),
        sidecar(path, "-wal"),
        sidecar(path, "-shm"),
    ] {
        if let Ok(meta) = std::fs::metadata(&file)
            && meta.permissions().mode() & 0o077 != 0
            && let Err(e) = std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600))
        {
            tracing::warn!(file = %file.display(), error = %e, "the node journal is readable by others and cannot be made private; chmod 600 it");
        }
    }
}

/// Ends a transaction's use of the journal's connection: back to the pool
/// when it committed; closed when it failed, since SQLite may have rolled
/// the transaction back under sqlx (see [`SqliteJournal::connection`]).
fn settle(
    conn: sqlx::pool::PoolConnection<sqlx::Sqlite>,
    written: Result<(), JournalError>,
) -> Result<(), JournalError> {
    if written.is_err() {
        drop(conn.detach());
    }
    written
}

/// One custody row, inside the caller's transaction.
async fn write_custody(
    conn: &mut sqlx::SqliteConnection,
    c: &CustodyRecord,
) -> Result<(), JournalError> {
    let (rid, rname) = c
        .registration
        .clone()
        .map_or((None, None), |(i, n)| (Some(i), Some(n)));
    sqlx::query(
        "INSERT OR REPLACE INTO custody (lease, epoch, instance, request_id, registration_id,
             registration_name, outcome, phase, discard, observed, since_unix_ms)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
    )
    .bind(&c.lease)
    .bind(i64::try_from(c.epoch).unwrap_or(i64::MAX))
    .bind(&c.instance)
    .bind(c.request_id)
    .bind(rid)
    .bind(rname)
    .bind(&c.outcome)
    .bind(&c.phase)
    .bind(c.discard)
    .bind(c.observed)
    .bind(c.since_unix_ms)
    .execute(&mut *conn)
    .await
    .map_err(io)?;
    // The boot clock beside the row; a release that does not know the
    // table leaves a stale one, which is read only while its
    // `since_unix_ms` still matches the row's.
    match &c.since_boot {
        Some(boot) => sqlx::query(
            "INSERT OR REPLACE INTO custody_clocks (lease, since_unix_ms, boot_id, since_boot_ms)
                 VALUES (?, ?, ?, ?)",
        )
        .bind(&c.lease)
        .bind(c.since_unix_ms)
        .bind(&boot.boot_id)
        .bind(boot.ms)
        .execute(&mut *conn)
        .await,
        None => {
            sqlx::query("DELETE FROM custody_clocks WHERE lease = ?")
                .bind(&c.lease)
                .execute(&mut *conn)
                .await
        }
    }
    .map_err(io)?;
    Ok(())
}

#[async_trait]
impl Journal for SqliteJournal {
    async fn put_launch(&self, l: &LaunchRecord) -> Result<(), JournalError> {
        self.write_launch(l).await
    }

    async fn amend_launch(&self, l: &LaunchRecord) -> Result<(), JournalError> {
        let mut conn = self.connection(Durability::Committed).await?;
        sqlx::query(
            "UPDATE launches SET epoch = ?, request_id = ?, instance = ?, runner_id = ?,
                 runner_name = ?, created = ?
             WHERE lease = ?",
        )
        .bind(i64::try_from(l.epoch).unwrap_or(i64::MAX))
        .bind(l.request_id)
        .bind(&l.instance)
        .bind(l.runner_id)
        .bind(&l.runner_name)
        .bind(l.created)
        .bind(&l.lease)
        .execute(&mut *conn)
        .await
        .map_err(io)?;
        Ok(())
    }

    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        let mut conn = self.connection(Durability::Synced).await?;
        sqlx::query("DELETE FROM launches WHERE lease = ?")
            .bind(lease)
            .execute(&mut *conn)
            .await
            .map_err(io)?;
        Ok(())
    }

    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        let rows = sqlx::query("SELECT * FROM launches ORDER BY lease")
            .fetch_all(&self.pool)
            .await
            .map_err(io)?;
        rows.iter()
            .map(|r| {
                Ok(LaunchRecord {
                    lease: r.try_get("lease").map_err(io)?,
                    epoch: u64::try_from(r.try_get::<i64, _>("epoch").map_err(io)?).unwrap_or(0),
                    request_id: r.try_get("request_id").map_err(io)?,
                    instance: r.try_get("instance").map_err(io)?,
                    runner_id: r.try_get("runner_id").map_err(io)?,
                    runner_name: r.try_get("runner_name").map_err(io)?,
                    created: r.try_get("created").map_err(io)?,
                })
            })
            .collect()
    }

    async fn put_custody(&self, c: &CustodyRecord) -> Result<(), JournalError> {
        self.put_custody_all(std::slice::from_ref(c)).await
    }

    async fn put_custody_all(&self, entries: &[CustodyRecord]) -> Result<(), JournalError> {
        let mut conn = self.connection(Durability::Synced).await?;
        let written = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(io)?;
            for c in entries {
                write_custody(&mut tx, c).await?;
            }
            tx.commit().await.map_err(io)
        }
        .await;
        settle(conn, written)
    }

    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        let mut conn = self.connection(Durability::Synced).await?;
        let written = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(io)?;
            for table in ["custody", "custody_clocks"] {
                sqlx::query(sqlx::AssertSqlSafe(format!(
                    "DELETE FROM {table} WHERE lease = ?"
                )))
                .bind(lease)
                .execute(&mut *tx)
                .await
                .map_err(io)?;
            }
            tx.commit().await.map_err(io)
        }
        .await;
        settle(conn, written)
    }

    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError> {
        let rows = sqlx::query(
            "SELECT c.*, k.since_unix_ms AS clock_unix_ms, k.boot_id AS clock_boot_id,
                    k.since_boot_ms AS clock_boot_ms
             FROM custody c LEFT JOIN custody_clocks k ON k.lease = c.lease
             ORDER BY c.lease",
        )
        .fetch_all(&self.pool)
        .await
        .map_err(io)?;
        rows.iter()
            .map(|r| {
                let rid: Option<i64> = r.try_get("registration_id").map_err(io)?;
                let rname: Option<String> = r.try_get("registration_name").map_err(io)?;
                let since_unix_ms: i64 = r.try_get("since_unix_ms").map_err(io)?;
                let clock_unix_ms: Option<i64> = r.try_get("clock_unix_ms").map_err(io)?;
                let boot_id: Option<String> = r.try_get("clock_boot_id").map_err(io)?;
                let boot_ms: Option<i64> = r.try_get("clock_boot_ms").map_err(io)?;
                let since_boot = boot_id
                    .zip(boot_ms)
                    .filter(|_| clock_unix_ms == Some(since_unix_ms))
                    .map(|(boot_id, ms)| BootStamp { boot_id, ms });
                Ok(CustodyRecord {
                    lease: r.try_get("lease").map_err(io)?,
                    epoch: u64::try_from(r.try_get::<i64, _>("epoch").map_err(io)?).unwrap_or(0),
                    instance: r.try_get("instance").map_err(io)?,
                    request_id: r.try_get("request_id").map_err(io)?,
                    registration: rid.zip(rname),
                    outcome: r.try_get("outcome").map_err(io)?,
                    phase: r.try_get("phase").map_err(io)?,
                    discard: r.try_get("discard").map_err(io)?,
                    observed: r.try_get("observed").map_err(io)?,
                    since_unix_ms,
                    since_boot,
                })
            })
            .collect()
    }

    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError> {
        let mut conn = self.connection(durability).await?;
        let written = async {
            let mut tx = sqlx::Connection::begin(&mut *conn).await.map_err(io)?;
            sqlx::query("INSERT OR REPLACE INTO results (command, encoded) VALUES (?, ?)")
                .bind(command)
                .bind(encoded)
                .execute(&mut *tx)
                .await
                .map_err(io)?;
            sqlx::query("DELETE FROM results WHERE seq <= (SELECT MAX(seq) FROM results) - ?")
                .bind(RESULTS_KEPT)
                .execute(&mut *tx)
                .await
                .map_err(io)?;
            tx.commit().await.map_err(io)
        }
        .await;
        settle(conn, written)
    }

    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        let rows = sqlx::query("SELECT command, encoded FROM results ORDER BY seq")
            .fetch_all(&self.pool)
            .await
            .map_err(io)?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("command").map_err(io)?,
                    r.try_get("encoded").map_err(io)?,
                ))
            })
            .collect()
    }
}

#[async_trait]
impl MountJournal for SqliteJournal {
    async fn put_mount(&self, m: &MountRecord) -> Result<(), JournalError> {
        sqlx::query(
            "INSERT OR REPLACE INTO cache_mounts (mount, lease, key, parent, policy, committable, succeeded, since_unix_ms)
             VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
        )
        .bind(&m.mount)
        .bind(&m.lease)
        .bind(&m.key)
        .bind(m.parent.map(|g| i64::try_from(g).unwrap_or(i64::MAX)))
        .bind(&m.policy)
        .bind(m.committable)
        .bind(m.succeeded)
        .bind(m.since_unix_ms)
        .execute(&mut *self.connection(Durability::Synced).await?)
        .await
        .map_err(io)?;
        Ok(())
    }

    async fn forget_mount(&self, mount: &str) -> Result<(), JournalError> {
        sqlx::query("DELETE FROM cache_mounts WHERE mount = ?")
            .bind(mount)
            .execute(&mut *self.connection(Durability::Synced).await?)
            .await
            .map_err(io)?;
        Ok(())
    }

    async fn mounts(&self) -> Result<Vec<MountRecord>, JournalError> {
        let rows = sqlx::query("SELECT * FROM cache_mounts ORDER BY mount")
            .fetch_all(&self.pool)
            .await
            .map_err(io)?;
        rows.iter()
            .map(|r| {
                let parent: Option<i64> = r.try_get("parent").map_err(io)?;
                Ok(MountRecord {
                    mount: r.try_get("mount").map_err(io)?,
                    lease: r.try_get("lease").map_err(io)?,
                    key: r.try_get("key").map_err(io)?,
                    parent: parent.and_then(|g| u64::try_from(g).ok()),
                    policy: r.try_get("policy").map_err(io)?,
                    committable: r.try_get("committable").map_err(io)?,
                    succeeded: r.try_get("succeeded").map_err(io)?,
                    since_unix_ms: r.try_get("since_unix_ms").map_err(io)?,
                })
            })
            .collect()
    }

    async fn put_session(&self, s: &SessionRecord) -> Result<(), JournalError> {
        sqlx::query(
            "INSERT OR REPLACE INTO cache_sessions (lease, token_sha256, slots, since_unix_ms)
             VALUES (?, ?, ?, ?)",
        )
        .bind(&s.lease)
        .bind(&s.token_sha256)
        .bind(&s.slots)
        .bind(s.since_unix_ms)
        .execute(&mut *self.connection(Durability::Synced).await?)
        .await
        .map_err(io)?;
        Ok(())
    }

    async fn forget_session(&self, lease: &str) -> Result<(), JournalError> {
        sqlx::query("DELETE FROM cache_sessions WHERE lease = ?")
            .bind(lease)
            .execute(&mut *self.connection(Durability::Synced).await?)
            .await
            .map_err(io)?;
        Ok(())
    }

    async fn sessions(&self) -> Result<Vec<SessionRecord>, JournalError> {
        let rows = sqlx::query("SELECT * FROM cache_sessions ORDER BY lease")
            .fetch_all(&self.pool)
            .await
            .map_err(io)?;
        rows.iter()
            .map(|r| {
                Ok(SessionRecord {
                    lease: r.try_get("lease").map_err(io)?,
                    token_sha256: r.try_get("token_sha256").map_err(io)?,
                    slots: r.try_get("slots").map_err(io)?,
                    since_unix_ms: r.try_get("since_unix_ms").map_err(io)?,
                })
            })
            .collect()
    }

    async fn put_actions_session(&self, lease: &str, record: &str) -> Result<(), JournalError> {
        sqlx::query("INSERT OR REPLACE INTO actions_sessions (lease, record) VALUES (?, ?)")
            .bind(lease)
            .bind(record)
            .execute(&mut *self.connection(Durability::Synced).await?)
            .await
            .map_err(io)?;
        Ok(())
    }

    async fn forget_actions_session(&self, lease: &str) -> Result<(), JournalError> {
        sqlx::query("DELETE FROM actions_sessions WHERE lease = ?")
            .bind(lease)
            .execute(&mut *self.connection(Durability::Synced).await?)
            .await
            .map_err(io)?;
        Ok(())
    }

    async fn actions_sessions(&self) -> Result<Vec<(String, String)>, JournalError> {
        let rows = sqlx::query("SELECT lease, record FROM actions_sessions ORDER BY lease")
            .fetch_all(&self.pool)
            .await
            .map_err(io)?;
        rows.iter()
            .map(|r| {
                Ok((
                    r.try_get("lease").map_err(io)?,
                    r.try_get("record").map_err(io)?,
                ))
            })
            .collect()
    }
}

/// A journal in memory: the seam's fake, and what a runner without a state
/// directory uses. Survives a runner being rebuilt over
/// it, which is how tests model a restart.
#[derive(Debug, Default)]
pub struct MemoryJournal {
    launches: Mutex<BTreeMap<String, LaunchRecord>>,
    custody: Mutex<BTreeMap<String, CustodyRecord>>,
    results: Mutex<Vec<(String, Vec<u8>)>>,
    result_durability: Mutex<BTreeMap<String, Durability>>,
    mounts: Mutex<BTreeMap<String, MountRecord>>,
    sessions: Mutex<BTreeMap<String, SessionRecord>>,
    actions_sessions: Mutex<BTreeMap<String, String>>,
}

impl MemoryJournal {
    /// The durability `command`'s result was last written at, if it was.
    #[cfg(test)]
    pub(crate) fn result_durability(&self, command: &str) -> Option<Durability> {
        self.result_durability
            .lock()
            .expect("journal")
            .get(command)
            .copied()
    }
}

#[async_trait]
impl MountJournal for MemoryJournal {
    async fn put_mount(&self, mount: &MountRecord) -> Result<(), JournalError> {
        self.mounts
            .lock()
            .expect("journal")
            .insert(mount.mount.clone(), mount.clone());
        Ok(())
    }
    async fn forget_mount(&self, mount: &str) -> Result<(), JournalError> {
        self.mounts.lock().expect("journal").remove(mount);
        Ok(())
    }
    async fn mounts(&self) -> Result<Vec<MountRecord>, JournalError> {
        Ok(self
            .mounts
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_session(&self, session: &SessionRecord) -> Result<(), JournalError> {
        self.sessions
            .lock()
            .expect("journal")
            .insert(session.lease.clone(), session.clone());
        Ok(())
    }
    async fn forget_session(&self, lease: &str) -> Result<(), JournalError> {
        self.sessions.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn sessions(&self) -> Result<Vec<SessionRecord>, JournalError> {
        Ok(self
            .sessions
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_actions_session(&self, lease: &str, record: &str) -> Result<(), JournalError> {
        self.actions_sessions
            .lock()
            .expect("journal")
            .insert(lease.to_owned(), record.to_owned());
        Ok(())
    }
    async fn forget_actions_session(&self, lease: &str) -> Result<(), JournalError> {
        self.actions_sessions.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn actions_sessions(&self) -> Result<Vec<(String, String)>, JournalError> {
        Ok(self
            .actions_sessions
            .lock()
            .expect("journal")
            .iter()
            .map(|(l, r)| (l.clone(), r.clone()))
            .collect())
    }
}

#[async_trait]
impl Journal for MemoryJournal {
    async fn put_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        self.launches
            .lock()
            .expect("journal")
            .insert(launch.lease.clone(), launch.clone());
        Ok(())
    }
    async fn amend_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        if let Some(l) = self
            .launches
            .lock()
            .expect("journal")
            .get_mut(&launch.lease)
        {
            *l = launch.clone();
        }
        Ok(())
    }
    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        self.launches.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        Ok(self
            .launches
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_custody(&self, entry: &CustodyRecord) -> Result<(), JournalError> {
        self.custody
            .lock()
            .expect("journal")
            .insert(entry.lease.clone(), entry.clone());
        Ok(())
    }
    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        self.custody.lock().expect("journal").remove(lease);
        Ok(())
    }
    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError> {
        Ok(self
            .custody
            .lock()
            .expect("journal")
            .values()
            .cloned()
            .collect())
    }
    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError> {
        self.result_durability
            .lock()
            .expect("journal")
            .insert(command.to_owned(), durability);
        let mut results = self.results.lock().expect("journal");
        results.retain(|(c, _)| c != command);
        results.push((command.to_owned(), encoded.to_vec()));
        let excess = results.len().saturating_sub(RESULTS_KEPT as usize);
        results.drain(..excess);
        Ok(())
    }
    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        Ok(self.results.lock().expect("journal").clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> PathBuf {
        let d =
            std::env::temp_dir().join(format!("billet-journal-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    fn launch(lease: &str) -> LaunchRecord {
        LaunchRecord {
            lease: lease.into(),
            epoch: 2,
            request_id: 7,
            instance: format!("billet-{lease}"),
            runner_id: 11,
            runner_name: format!("billet-{lease}"),
            created: true,
        }
    }

    /// The created amendment is written once the runner counts as running,
    /// so it may land after the runner ended and its record was forgotten;
    /// it must not bring the record back (recovery would then chase a
    /// registration long removed).
    #[tokio::test]
    async fn an_amendment_changes_a_recorded_launch_and_never_brings_back_a_forgotten_one() {
        let d = dir();
        let sqlite = SqliteJournal::open(&d).await.unwrap();
        let memory = MemoryJournal::default();
        for j in [&sqlite as &dyn Journal, &memory] {
            let mut a = launch("a");
            a.created = false;
            j.put_launch(&a).await.unwrap();
            a.created = true;
            j.amend_launch(&a).await.unwrap();
            assert_eq!(j.launches().await.unwrap(), [a.clone()]);
            j.forget_launch("a").await.unwrap();
            j.amend_launch(&a).await.unwrap();
            assert_eq!(j.launches().await.unwrap(), [], "{j:?}");
        }
        let _ = std::fs::remove_dir_all(&d);
    }

    #[tokio::test]
    async fn a_reopened_journal_remembers_launches_custody_and_results() {
        let d = dir();
        {
            let j = SqliteJournal::open(&d).await.unwrap();
            j.put_launch(&launch("a")).await.unwrap();
            j.put_launch(&launch("b")).await.unwrap();
            j.forget_launch("b").await.unwrap();
            j.put_custody(&CustodyRecord {
                lease: "a".into(),
                epoch: 3,
                instance: "billet-a".into(),
                request_id: 7,
                registration: Some((11, "billet-a".into())),
                outcome: "failed".into(),
                phase: Some("teardown".into()),
                discard: true,
                observed: false,
                since_unix_ms: 5,
                since_boot: Some(BootStamp {
                    boot_id: "boot-1".into(),
                    ms: 42,
                }),
            })
            .await
            .unwrap();
            j.put_result("c1", b"xyz", Durability::Synced)
                .await
                .unwrap();
        }
        let j = SqliteJournal::open(&d).await.unwrap();
        assert_eq!(j.launches().await.unwrap(), vec![launch("a")]);
        let custody = j.custody().await.unwrap();
        assert_eq!(custody.len(), 1);
        assert_eq!(custody[0].registration, Some((11, "billet-a".into())));
        assert!(custody[0].discard);
        assert_eq!(
            j.results().await.unwrap(),
            vec![("c1".to_owned(), b"xyz".to_vec())]
        );
    }

    /// The boot clock is read back with its row, and only while it matches
    /// the row: a release that rewrote the row without the clock (a
    /// rollback, then this release again) leaves a stale one, never used.
    #[tokio::test]
    async fn a_custody_rows_boot_clock_is_kept_and_a_stale_one_is_ignored() {
        let d = dir();
        let j = SqliteJournal::open(&d).await.unwrap();
        let boot = BootStamp {
            boot_id: "boot-1".into(),
            ms: 42,
        };
        let record = CustodyRecord {
            lease: "a".into(),
            epoch: 1,
            instance: "billet-a".into(),
            request_id: 7,
            registration: None,
            outcome: "done".into(),
            phase: Some("teardown".into()),
            discard: false,
            observed: true,
            since_unix_ms: 5,
            since_boot: Some(boot.clone()),
        };
        j.put_custody(&record).await.unwrap();
        assert_eq!(j.custody().await.unwrap()[0].since_boot, Some(boot));
        // What an older release writes: the row, not its clock.
        sqlx::query("UPDATE custody SET since_unix_ms = 6 WHERE lease = 'a'")
            .execute(&j.pool)
            .await
            .unwrap();
        assert_eq!(j.custody().await.unwrap()[0].since_boot, None);
        j.forget_custody("a").await.unwrap();
        let left: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM custody_clocks")
            .fetch_one(&j.pool)
            .await
            .unwrap();
        assert_eq!(left, 0, "a forgotten entry's clock outlived it");
    }

    #[test]
    fn the_boot_clock_counts_within_one_boot_only() {
        let now = BootStamp::now().expect("a Linux host has a boot id");
        let then = now.clone().before(std::time::Duration::from_secs(10));
        assert_eq!(now.since(&then), Some(std::time::Duration::from_secs(10)));
        let other = BootStamp {
            boot_id: "another boot".into(),
            ..then
        };
        assert_eq!(now.since(&other), None);
    }

    #[tokio::test]
    async fn the_journal_file_is_private() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir();
        SqliteJournal::open(&d).await.unwrap();
        let mode = std::fs::metadata(d.join(JOURNAL_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
    }

    #[tokio::test]
    async fn a_corrupt_journal_stops_start_up_naming_the_file() {
        let d = dir();
        std::fs::write(
            d.join(JOURNAL_FILE),
            b"this is not a database, just bytes ".repeat(200),
        )
        .unwrap();
        let err = SqliteJournal::open(&d).await.unwrap_err().to_string();
        assert!(err.contains(JOURNAL_FILE), "{err}");
        // Never silently recreated.
        assert!(
            std::fs::read(d.join(JOURNAL_FILE))
                .unwrap()
                .starts_with(b"this is not")
        );
    }

    #[tokio::test]
    async fn a_journal_made_readable_by_others_is_made_private_again() {
        use std::os::unix::fs::PermissionsExt;
        let d = dir();
        drop(SqliteJournal::open(&d).await.unwrap());
        let path = d.join(JOURNAL_FILE);
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).unwrap();
        let _j = SqliteJournal::open(&d).await.unwrap();
        for file in [path.clone(), sidecar(&path, "-wal"), sidecar(&path, "-shm")] {
            let mode = std::fs::metadata(&file).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o600, "{}", file.display());
        }
    }

    /// Opens a plain SQLite database at `path` and runs `sql` in it.
    async fn sqlite(path: &Path, sql: &'static str) {
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(path)
                    .create_if_missing(true),
            )
            .await
            .unwrap();
        sqlx::raw_sql(sql).execute(&pool).await.unwrap();
        pool.close().await;
    }

    async fn refused(d: &Path) -> String {
        let err = SqliteJournal::open(d).await.unwrap_err().to_string();
        assert!(
            err.contains(&d.join(JOURNAL_FILE).display().to_string()),
            "{err}"
        );
        err
    }

    #[tokio::test]
    async fn an_empty_journal_file_is_refused_not_taken_for_a_fresh_one() {
        let d = dir();
        std::fs::write(d.join(JOURNAL_FILE), b"").unwrap();
        let err = refused(&d).await;
        assert!(
            err.contains("holds no journal") && err.contains("truncated"),
            "{err}"
        );
        assert_eq!(std::fs::read(d.join(JOURNAL_FILE)).unwrap(), b"");
    }

    #[tokio::test]
    async fn another_programs_database_is_refused_and_left_as_it_was() {
        let d = dir();
        let path = d.join(JOURNAL_FILE);
        sqlite(
            &path,
            "PRAGMA application_id = 7; CREATE TABLE other (x TEXT);",
        )
        .await;
        let err = refused(&d).await;
        assert!(err.contains("another program's SQLite database"), "{err}");
        // A database without an application id and with other tables,
        // or billet's table names with other columns, is not a journal.
        let d = dir();
        let path = d.join(JOURNAL_FILE);
        sqlite(&path, "CREATE TABLE custody (x TEXT);").await;
        let err = refused(&d).await;
        assert!(
            err.contains("is not a billet node journal")
                && err.contains("table custody has columns [\"x\"]"),
            "{err}"
        );
        let pool = SqlitePoolOptions::new()
            .connect_with(SqliteConnectOptions::new().filename(&path))
            .await
            .unwrap();
        let tables: Vec<String> = sqlx::query_scalar("SELECT name FROM sqlite_schema")
            .fetch_all(&pool)
            .await
            .unwrap();
        assert_eq!(tables, ["custody"], "nothing was added to it");
    }

    #[tokio::test]
    async fn a_journal_from_a_newer_release_is_refused_naming_both_schemas() {
        let d = dir();
        drop(SqliteJournal::open(&d).await.unwrap());
        sqlite(&d.join(JOURNAL_FILE), "PRAGMA user_version = 9;").await;
        let err = refused(&d).await;
        assert!(
            err.contains("journal schema 9") && err.contains("reads 1"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn a_journal_written_before_the_application_id_is_kept_and_stamped() {
        let d = dir();
        let path = d.join(JOURNAL_FILE);
        // Exactly what earlier releases wrote: the schema, no id.
        let pool = SqlitePoolOptions::new()
            .max_connections(1)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(&path)
                    .create_if_missing(true),
            )
            .await
            .unwrap();
        sqlx::raw_sql(SCHEMA).execute(&pool).await.unwrap();
        pool.close().await;
        let j = SqliteJournal::open(&d).await.unwrap();
        j.put_launch(&launch("a")).await.unwrap();
        let id: i64 = sqlx::query_scalar("PRAGMA application_id")
            .fetch_one(&j.pool)
            .await
            .unwrap();
        assert_eq!(id, APPLICATION_ID);
    }

    #[tokio::test]
    async fn a_journal_moved_without_its_write_ahead_log_is_refused() {
        let d = dir();
        let path = d.join(JOURNAL_FILE);
        std::fs::write(sidecar(&path, "-wal"), b"frames of a journal moved away").unwrap();
        let err = refused(&d).await;
        assert!(err.contains("is missing but its write-ahead log"), "{err}");
        assert!(!path.exists(), "no journal was created beside the log");
    }

    #[tokio::test]
    async fn an_interrupted_creation_leaves_no_journal_and_the_next_start_creates_one() {
        let d = dir();
        // What a node killed while creating the journal leaves: a partial
        // file under the staging name, never `journal.db`.
        std::fs::write(d.join(JOURNAL_FILE).with_extension("db.new"), b"partial").unwrap();
        let j = SqliteJournal::open(&d).await.unwrap();
        j.put_launch(&launch("a")).await.unwrap();
        assert!(!d.join(JOURNAL_FILE).with_extension("db.new").exists());
    }

    fn mount(id: &str) -> MountRecord {
        MountRecord {
            mount: id.into(),
            lease: "l1".into(),
            key: "npm".into(),
            parent: Some(7),
            policy: "cas".into(),
            committable: true,
            succeeded: false,
            since_unix_ms: 5,
        }
    }

    #[tokio::test]
    async fn a_reopened_journal_remembers_the_cache_mounts() {
        let d = dir();
        {
            let j = SqliteJournal::open(&d).await.unwrap();
            j.put_mount(&mount("m1")).await.unwrap();
            j.put_mount(&MountRecord {
                parent: None,
                committable: false,
                ..mount("m2")
            })
            .await
            .unwrap();
            j.put_mount(&mount("m3")).await.unwrap();
            j.forget_mount("m3").await.unwrap();
            j.put_mount(&MountRecord {
                succeeded: true,
                ..mount("m1")
            })
            .await
            .unwrap();
        }
        let j = SqliteJournal::open(&d).await.unwrap();
        assert_eq!(
            j.mounts().await.unwrap(),
            vec![
                MountRecord {
                    succeeded: true,
                    ..mount("m1")
                },
                MountRecord {
                    parent: None,
                    committable: false,
                    ..mount("m2")
                },
            ]
        );
    }

    #[tokio::test]
    async fn a_journal_with_the_cache_mounts_gains_the_cache_sessions_and_stays_version_1() {
        let d = dir();
        let path = d.join(JOURNAL_FILE);
        // What the release with sticky disks and no guest API wrote.
        sqlite(
            &path,
            "PRAGMA application_id = 1651274858; PRAGMA user_version = 1;
             CREATE TABLE launches (
                lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, request_id INTEGER NOT NULL,
                instance TEXT NOT NULL, runner_id INTEGER NOT NULL, runner_name TEXT NOT NULL,
                created INTEGER NOT NULL);
             CREATE TABLE custody (
                lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, instance TEXT NOT NULL,
                request_id INTEGER NOT NULL, registration_id INTEGER, registration_name TEXT,
                outcome TEXT NOT NULL, phase TEXT, discard INTEGER NOT NULL, observed INTEGER NOT NULL,
                since_unix_ms INTEGER NOT NULL);
             CREATE TABLE results (
                seq INTEGER PRIMARY KEY AUTOINCREMENT, command TEXT NOT NULL UNIQUE, encoded BLOB NOT NULL);
             CREATE TABLE cache_mounts (
                mount TEXT PRIMARY KEY, lease TEXT NOT NULL, key TEXT NOT NULL, parent INTEGER,
                policy TEXT NOT NULL, committable INTEGER NOT NULL, succeeded INTEGER NOT NULL,
                since_unix_ms INTEGER NOT NULL);
             INSERT INTO cache_mounts VALUES ('m1', 'l1', 'npm', 7, 'cas', 1, 0, 5);",
        )
        .await;
        assert!(SqliteJournal::check(&d).await.unwrap());
        let j = SqliteJournal::open(&d).await.unwrap();
        assert_eq!(j.mounts().await.unwrap(), vec![mount("m1")]);
        let session = SessionRecord {
            lease: "l1".into(),
            token_sha256: "ab".repeat(32),
            slots: "[]".into(),
            since_unix_ms: 9,
        };
        j.put_session(&session).await.unwrap();
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&j.pool)
            .await
            .unwrap();
        assert_eq!(version, 1, "an added table changed the schema version");
        drop(j);
        let j = SqliteJournal::open(&d).await.unwrap();
        assert_eq!(j.sessions().await.unwrap(), vec![session]);
        j.forget_session("l1").await.unwrap();
        assert!(j.sessions().await.unwrap().is_empty());
    }

    #[tokio::test]
    async fn a_schema_1_journal_keeps_its_records_and_gains_the_cache_mounts() {
        let d = dir();
        let path = d.join(JOURNAL_FILE);
        // Exactly what schema 1 wrote: its three tables, stamped version 1.
        sqlite(
            &path,
            "PRAGMA application_id = 1651274858; PRAGMA user_version = 1;
             CREATE TABLE launches (
                lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, request_id INTEGER NOT NULL,
                instance TEXT NOT NULL, runner_id INTEGER NOT NULL, runner_name TEXT NOT NULL,
                created INTEGER NOT NULL);
             CREATE TABLE custody (
                lease TEXT PRIMARY KEY, epoch INTEGER NOT NULL, instance TEXT NOT NULL,
                request_id INTEGER NOT NULL, registration_id INTEGER, registration_name TEXT,
                outcome TEXT NOT NULL, phase TEXT, discard INTEGER NOT NULL, observed INTEGER NOT NULL,
                since_unix_ms INTEGER NOT NULL);
             CREATE TABLE results (
                seq INTEGER PRIMARY KEY AUTOINCREMENT, command TEXT NOT NULL UNIQUE, encoded BLOB NOT NULL);
             INSERT INTO launches VALUES ('a', 2, 7, 'billet-a', 11, 'billet-a', 1);",
        )
        .await;
        // `billet check` reads it as it is, writing nothing.
        assert!(SqliteJournal::check(&d).await.unwrap());
        let j = SqliteJournal::open(&d).await.unwrap();
        assert_eq!(j.launches().await.unwrap(), vec![launch("a")]);
        j.put_mount(&mount("m1")).await.unwrap();
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&j.pool)
            .await
            .unwrap();
        // Still version 1: the release before the cache checks only the
        // tables it knows, so a rollback to it reads this journal (it
        // refuses any version above its own).
        assert_eq!(version, 1, "an added table changed the schema version");
        drop(j);
        let j = SqliteJournal::open(&d).await.unwrap();
        assert_eq!(j.mounts().await.unwrap(), vec![mount("m1")]);
        let fresh = dir();
        let j = SqliteJournal::open(&fresh).await.unwrap();
        let version: i64 = sqlx::query_scalar("PRAGMA user_version")
            .fetch_one(&j.pool)
            .await
            .unwrap();
        assert_eq!(
            version, 1,
            "a new journal is stamped for the release before it"
        );
    }

    #[tokio::test]
    async fn only_the_most_recent_results_are_kept() {
        let j = MemoryJournal::default();
        for i in 0..(RESULTS_KEPT + 10) {
            j.put_result(&format!("c{i}"), b"r", Durability::Committed)
                .await
                .unwrap();
        }
        let results = j.results().await.unwrap();
        assert_eq!(results.len(), RESULTS_KEPT as usize);
        assert_eq!(results[0].0, "c10");
    }
}
