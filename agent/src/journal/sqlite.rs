//! The journal in SQLite: `journal.db` in the state directory, its schema,
//! how it is opened, identified and kept private, and both ports over it.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use async_trait::async_trait;
use sqlx::Row;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};

use super::*;

/// The journal in SQLite.
#[derive(Debug)]
pub struct SqliteJournal {
    pub(super) pool: SqlitePool,
}

pub(super) const SCHEMA: &str = "
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
pub(super) fn sidecar(path: &Path, suffix: &str) -> PathBuf {
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
