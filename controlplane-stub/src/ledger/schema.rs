//! The ledger's storage layer: the append-only schema migrations (one list
//! per backend, the same versions and names), the pools for each backend,
//! and the mapping between a `leases` row and [`Lease`] (decoding, and the
//! integer conversions either way).
//!
//! It knows the SQL schema and no lease rule: nothing here checks an epoch,
//! a phase edge or a node, and only `migrate` opens a write transaction. A
//! new column is a new migration appended to both `SQLITE_MIGRATIONS` and
//! `POSTGRES_MIGRATIONS` plus a field in `lease_from_row`; an applied
//! migration is never edited.

use std::collections::HashSet;
use std::path::Path;

use billet_proto::ending::ReasonCode;
use std::time::Duration;

use futures::future::BoxFuture;
use sqlx::AnyConnection;
use sqlx::any::{AnyPoolOptions, AnyRow};
use sqlx::pool::PoolConnectionMetadata;
use sqlx::{AnyPool, Executor, Row};

#[cfg(test)]
use super::Ledger;
use super::{Backend, Dialect, Lease, LedgerError, Phase, Result};

/// A migration: `(version, name, statements)`.
type Migration = (i64, &'static str, &'static [&'static str]);

/// SQLite's schema migrations, append-only. Every table is `STRICT`.
const SQLITE_MIGRATIONS: &[Migration] = &[
    (
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
    ),
    (
        2,
        "target nodes",
        &[
            "ALTER TABLE leases ADD COLUMN target_node TEXT",
            "CREATE INDEX leases_target_node_idx ON leases (target_node)",
            "CREATE TABLE nodes (name TEXT PRIMARY KEY NOT NULL) STRICT",
        ],
    ),
    (
        3,
        "join tokens",
        &["CREATE TABLE join_tokens (
            id TEXT PRIMARY KEY NOT NULL,
            secret_sha256 TEXT NOT NULL,
            node TEXT NOT NULL,
            expires_at_ms INTEGER NOT NULL,
            used_at_ms INTEGER,
            created_at_ms INTEGER NOT NULL
        ) STRICT"],
    ),
    (
        4,
        "cache observations",
        &["CREATE TABLE cache_observations (
            lease_id TEXT PRIMARY KEY NOT NULL,
            hits INTEGER NOT NULL,
            misses INTEGER NOT NULL,
            fallbacks INTEGER NOT NULL,
            bytes_restored INTEGER NOT NULL,
            bytes_committed INTEGER NOT NULL,
            conflicts INTEGER NOT NULL,
            recorded_at_ms INTEGER NOT NULL
        ) STRICT"],
    ),
    (
        5,
        "cache blocks",
        &["CREATE TABLE cache_blocks (
            scope TEXT NOT NULL CHECK (scope IN ('org', 'repository')),
            owner TEXT NOT NULL,
            repository TEXT NOT NULL,
            blocked_at_ms INTEGER NOT NULL,
            PRIMARY KEY (scope, owner, repository)
        ) STRICT"],
    ),
    (
        6,
        "wanted jobs",
        &["CREATE TABLE wanted_jobs (
            tier TEXT NOT NULL,
            scale_set_id INTEGER NOT NULL,
            request_id INTEGER NOT NULL,
            assigned_at_ms INTEGER NOT NULL,
            PRIMARY KEY (tier, scale_set_id, request_id)
        ) STRICT"],
    ),
    (
        7,
        "warm rooms",
        &[
            "CREATE TABLE warm_rooms (
            name TEXT PRIMARY KEY NOT NULL,
            node TEXT NOT NULL,
            tier TEXT NOT NULL,
            vcpu INTEGER NOT NULL CHECK (vcpu >= 0),
            memory_bytes INTEGER NOT NULL CHECK (memory_bytes >= 0),
            reserved_at_ms INTEGER NOT NULL
        ) STRICT",
            "CREATE INDEX warm_rooms_node_idx ON warm_rooms (node, tier)",
            "CREATE TABLE warm_wanted (
            tier TEXT PRIMARY KEY NOT NULL,
            count INTEGER NOT NULL CHECK (count >= 0),
            set_at_ms INTEGER NOT NULL
        ) STRICT",
        ],
    ),
    (
        8,
        "lease end reasons",
        &[
            "ALTER TABLE leases ADD COLUMN end_reason TEXT",
            "ALTER TABLE leases ADD COLUMN end_detail TEXT",
        ],
    ),
    (
        9,
        "job records",
        &[
            "CREATE TABLE jobs (
            request_id INTEGER PRIMARY KEY NOT NULL,
            tier TEXT NOT NULL,
            github_job_id TEXT,
            run_id INTEGER,
            repository TEXT,
            workflow TEXT,
            queued_at_ms INTEGER,
            acquired_at_ms INTEGER,
            assigned_at_ms INTEGER,
            started_at_ms INTEGER,
            runner_name TEXT,
            completed_at_ms INTEGER,
            result TEXT,
            stuck_at_ms INTEGER,
            stuck_reason TEXT,
            first_seen_at_ms INTEGER NOT NULL,
            updated_at_ms INTEGER NOT NULL
        ) STRICT",
            "CREATE INDEX jobs_updated_idx ON jobs (updated_at_ms)",
            "CREATE TABLE job_attempts (
            lease_id TEXT PRIMARY KEY NOT NULL,
            request_id INTEGER NOT NULL,
            attempt INTEGER NOT NULL CHECK (attempt >= 1),
            node TEXT NOT NULL,
            warm_runner TEXT,
            placed_at_ms INTEGER NOT NULL,
            launched_at_ms INTEGER
        ) STRICT",
            "CREATE INDEX job_attempts_request_idx ON job_attempts (request_id)",
            "CREATE TABLE job_waits (
            id INTEGER PRIMARY KEY,
            request_id INTEGER NOT NULL,
            reason TEXT NOT NULL,
            detail TEXT NOT NULL,
            since_ms INTEGER NOT NULL,
            until_ms INTEGER
        ) STRICT",
            "CREATE INDEX job_waits_request_idx ON job_waits (request_id, since_ms)",
        ],
    ),
];

/// PostgreSQL's schema migrations, append-only, with the same versions and
/// names as SQLite's: the same tables with PostgreSQL's types (`BIGINT` for
/// SQLite's 64-bit `INTEGER`).
const POSTGRES_MIGRATIONS: &[Migration] = &[
    (
        1,
        "leases and settings",
        &[
            "CREATE TABLE leases (
            id TEXT PRIMARY KEY NOT NULL,
            epoch BIGINT NOT NULL CHECK (epoch >= 1),
            phase TEXT NOT NULL CHECK (phase IN ('capacity', 'assigned', 'launching', 'online',
                'busy', 'custody', 'teardown', 'quarantine', 'done', 'failed')),
            tier TEXT NOT NULL,
            node TEXT,
            request_id BIGINT NOT NULL,
            runner_name TEXT,
            runner_id BIGINT,
            vcpu BIGINT NOT NULL CHECK (vcpu > 0),
            memory_bytes BIGINT NOT NULL CHECK (memory_bytes > 0),
            expires_at_ms BIGINT NOT NULL,
            heartbeat_at_ms BIGINT NOT NULL,
            held_at_ms BIGINT,
            failure_reason TEXT,
            force_release BIGINT NOT NULL DEFAULT 0 CHECK (force_release IN (0, 1)),
            created_at_ms BIGINT NOT NULL,
            ended_at_ms BIGINT
        )",
            "CREATE INDEX leases_open_idx ON leases (phase) WHERE phase NOT IN ('done', 'failed')",
            "CREATE INDEX leases_node_idx ON leases (node)",
            "CREATE INDEX leases_expiry_idx ON leases (expires_at_ms)
            WHERE phase NOT IN ('done', 'failed', 'quarantine')",
            "CREATE INDEX leases_runner_name_idx ON leases (runner_name)",
            "CREATE TABLE settings (
            name TEXT PRIMARY KEY NOT NULL,
            value BIGINT NOT NULL
        )",
        ],
    ),
    (
        2,
        "target nodes",
        &[
            "ALTER TABLE leases ADD COLUMN target_node TEXT",
            "CREATE INDEX leases_target_node_idx ON leases (target_node)",
            "CREATE TABLE nodes (name TEXT PRIMARY KEY NOT NULL)",
        ],
    ),
    (
        3,
        "join tokens",
        &["CREATE TABLE join_tokens (
            id TEXT PRIMARY KEY NOT NULL,
            secret_sha256 TEXT NOT NULL,
            node TEXT NOT NULL,
            expires_at_ms BIGINT NOT NULL,
            used_at_ms BIGINT,
            created_at_ms BIGINT NOT NULL
        )"],
    ),
    (
        4,
        "cache observations",
        &["CREATE TABLE cache_observations (
            lease_id TEXT PRIMARY KEY NOT NULL,
            hits BIGINT NOT NULL,
            misses BIGINT NOT NULL,
            fallbacks BIGINT NOT NULL,
            bytes_restored BIGINT NOT NULL,
            bytes_committed BIGINT NOT NULL,
            conflicts BIGINT NOT NULL,
            recorded_at_ms BIGINT NOT NULL
        )"],
    ),
    (
        5,
        "cache blocks",
        &["CREATE TABLE cache_blocks (
            scope TEXT NOT NULL CHECK (scope IN ('org', 'repository')),
            owner TEXT NOT NULL,
            repository TEXT NOT NULL,
            blocked_at_ms BIGINT NOT NULL,
            PRIMARY KEY (scope, owner, repository)
        )"],
    ),
    (
        6,
        "wanted jobs",
        &["CREATE TABLE wanted_jobs (
            tier TEXT NOT NULL,
            scale_set_id BIGINT NOT NULL,
            request_id BIGINT NOT NULL,
            assigned_at_ms BIGINT NOT NULL,
            PRIMARY KEY (tier, scale_set_id, request_id)
        )"],
    ),
    (
        7,
        "warm rooms",
        &[
            "CREATE TABLE warm_rooms (
            name TEXT PRIMARY KEY NOT NULL,
            node TEXT NOT NULL,
            tier TEXT NOT NULL,
            vcpu BIGINT NOT NULL CHECK (vcpu >= 0),
            memory_bytes BIGINT NOT NULL CHECK (memory_bytes >= 0),
            reserved_at_ms BIGINT NOT NULL
        )",
            "CREATE INDEX warm_rooms_node_idx ON warm_rooms (node, tier)",
            "CREATE TABLE warm_wanted (
            tier TEXT PRIMARY KEY NOT NULL,
            count BIGINT NOT NULL CHECK (count >= 0),
            set_at_ms BIGINT NOT NULL
        )",
        ],
    ),
    (
        8,
        "lease end reasons",
        &[
            "ALTER TABLE leases ADD COLUMN end_reason TEXT",
            "ALTER TABLE leases ADD COLUMN end_detail TEXT",
        ],
    ),
    (
        9,
        "job records",
        &[
            "CREATE TABLE jobs (
            request_id BIGINT PRIMARY KEY NOT NULL,
            tier TEXT NOT NULL,
            github_job_id TEXT,
            run_id BIGINT,
            repository TEXT,
            workflow TEXT,
            queued_at_ms BIGINT,
            acquired_at_ms BIGINT,
            assigned_at_ms BIGINT,
            started_at_ms BIGINT,
            runner_name TEXT,
            completed_at_ms BIGINT,
            result TEXT,
            stuck_at_ms BIGINT,
            stuck_reason TEXT,
            first_seen_at_ms BIGINT NOT NULL,
            updated_at_ms BIGINT NOT NULL
        )",
            "CREATE INDEX jobs_updated_idx ON jobs (updated_at_ms)",
            "CREATE TABLE job_attempts (
            lease_id TEXT PRIMARY KEY NOT NULL,
            request_id BIGINT NOT NULL,
            attempt BIGINT NOT NULL CHECK (attempt >= 1),
            node TEXT NOT NULL,
            warm_runner TEXT,
            placed_at_ms BIGINT NOT NULL,
            launched_at_ms BIGINT
        )",
            "CREATE INDEX job_attempts_request_idx ON job_attempts (request_id)",
            "CREATE TABLE job_waits (
            id BIGSERIAL PRIMARY KEY,
            request_id BIGINT NOT NULL,
            reason TEXT NOT NULL,
            detail TEXT NOT NULL,
            since_ms BIGINT NOT NULL,
            until_ms BIGINT
        )",
            "CREATE INDEX job_waits_request_idx ON job_waits (request_id, since_ms)",
        ],
    ),
];

/// The bookkeeping table, created before anything else.
const CREATE_SCHEMA_MIGRATIONS: Dialect = Dialect {
    sqlite: "CREATE TABLE IF NOT EXISTS schema_migrations (
            version INTEGER PRIMARY KEY NOT NULL,
            name TEXT NOT NULL,
            applied_at_ms INTEGER NOT NULL
        ) STRICT",
    postgres: "CREATE TABLE IF NOT EXISTS schema_migrations (
            version BIGINT PRIMARY KEY NOT NULL,
            name TEXT NOT NULL,
            applied_at_ms BIGINT NOT NULL
        )",
};

/// How long a SQLite writer waits for another process's write lock before
/// the ledger reports the write as unavailable (5 s), as a pragma.
const SQLITE_BUSY_TIMEOUT: &str = "PRAGMA busy_timeout = 5000";

/// How many connections a PostgreSQL handle writes through.
const POSTGRES_WRITERS: u32 = 8;

/// How many connections a handle reads through.
const READERS: u32 = 4;

/// How long a call waits for a free pooled connection.
const ACQUIRE_TIMEOUT: Duration = Duration::from_secs(30);

/// A pool of exactly one connection that is never recycled (an in-memory
/// database lives only as long as its connection).
fn single_connection() -> AnyPoolOptions {
    AnyPoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .acquire_timeout(ACQUIRE_TIMEOUT)
}

/// Runs `pragmas` on every new connection.
fn with_pragmas(options: AnyPoolOptions, pragmas: &'static [&'static str]) -> AnyPoolOptions {
    options.after_connect(
        move |conn: &mut AnyConnection,
              _: PoolConnectionMetadata|
              -> BoxFuture<'_, sqlx::Result<()>> {
            Box::pin(async move {
                for pragma in pragmas {
                    conn.execute(*pragma).await?;
                }
                Ok(())
            })
        },
    )
}

/// The writer (one connection: WAL, `synchronous = FULL`, the busy
/// timeout, foreign keys) and the `query_only` readers of the SQLite file at
/// `path`, created if missing.
///
/// # Errors
///
/// `Invalid` for a path that is not UTF-8 or a file that cannot be put in
/// WAL mode; `Storage` when SQLite cannot open it.
pub(super) async fn sqlite_file_pools(path: &Path) -> Result<(AnyPool, AnyPool)> {
    let absolute = std::path::absolute(path).map_err(|e| {
        LedgerError::Invalid(format!(
            "the ledger path {} is unusable: {e}",
            path.display()
        ))
    })?;
    let Some(text) = absolute.to_str() else {
        return Err(LedgerError::Invalid(format!(
            "the ledger path {} is not UTF-8; rename it",
            absolute.display()
        )));
    };
    let url = format!("sqlite://{}", percent_encode_path(text));
    let writer = with_pragmas(
        single_connection(),
        &[
            SQLITE_BUSY_TIMEOUT,
            "PRAGMA foreign_keys = ON",
            "PRAGMA journal_mode = WAL",
            "PRAGMA synchronous = FULL",
        ],
    )
    .connect(&format!("{url}?mode=rwc"))
    .await?;
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
    let reader = with_pragmas(
        AnyPoolOptions::new()
            .max_connections(READERS)
            .acquire_timeout(ACQUIRE_TIMEOUT),
        &[
            SQLITE_BUSY_TIMEOUT,
            "PRAGMA foreign_keys = ON",
            "PRAGMA query_only = ON",
        ],
    )
    .connect(&format!("{url}?mode=rw"))
    .await?;
    Ok((writer, reader))
}

/// One connection to a private in-memory SQLite database, used for reads
/// and writes alike.
///
/// # Errors
///
/// `Storage`.
pub(super) async fn sqlite_memory_pool() -> Result<AnyPool> {
    Ok(
        with_pragmas(single_connection(), &["PRAGMA foreign_keys = ON"])
            .connect("sqlite::memory:")
            .await?,
    )
}

/// The writers and the read-only readers of the PostgreSQL database at
/// `url`.
///
/// # Errors
///
/// `Storage` when the server cannot be reached or refuses the connection.
pub(super) async fn postgres_pools(url: &str) -> Result<(AnyPool, AnyPool)> {
    let writer = AnyPoolOptions::new()
        .max_connections(POSTGRES_WRITERS)
        .acquire_timeout(ACQUIRE_TIMEOUT)
        .connect(url)
        .await?;
    let reader = with_pragmas(
        AnyPoolOptions::new()
            .max_connections(READERS)
            .acquire_timeout(ACQUIRE_TIMEOUT),
        &["SET SESSION CHARACTERISTICS AS TRANSACTION READ ONLY"],
    )
    .connect(url)
    .await?;
    Ok((writer, reader))
}

/// Percent-encodes what a SQLite URL's path may not carry literally.
fn percent_encode_path(path: &str) -> String {
    let mut out = String::with_capacity(path.len());
    for byte in path.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'/' | b'-' | b'_' | b'.' | b'~') {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

fn migrations(backend: Backend) -> &'static [Migration] {
    match backend {
        Backend::Sqlite => SQLITE_MIGRATIONS,
        Backend::Postgres => POSTGRES_MIGRATIONS,
    }
}

/// Applies missing migrations and records the TTL, in one write
/// transaction (on PostgreSQL under a transaction-scoped advisory lock, so
/// two planes starting at once migrate one after the other). Returns the
/// TTL now in force.
pub(super) async fn migrate(
    writer: &AnyPool,
    backend: Backend,
    lease_ttl: Duration,
) -> Result<Duration> {
    let ttl_ms = duration_ms("lease TTL", lease_ttl)?;
    if ttl_ms == 0 {
        return Err(LedgerError::Invalid(
            "the lease TTL must be at least one millisecond".to_owned(),
        ));
    }
    let mut tx = match backend {
        Backend::Sqlite => writer.begin_with("BEGIN IMMEDIATE").await?,
        Backend::Postgres => {
            let mut tx = writer.begin().await?;
            // Any constant will do; this one spells "billet" in ASCII.
            sqlx::query("SELECT pg_advisory_xact_lock(110386118617460)")
                .execute(&mut *tx)
                .await?;
            tx
        }
    };
    sqlx::query(CREATE_SCHEMA_MIGRATIONS.pick(backend))
        .execute(&mut *tx)
        .await?;
    let applied = sqlx::query("SELECT version, name FROM schema_migrations ORDER BY version")
        .fetch_all(&mut *tx)
        .await?;
    let known = migrations(backend);
    let mut applied_versions = HashSet::new();
    for row in &applied {
        let version: i64 = row.try_get("version")?;
        let name: String = row.try_get("name")?;
        match known.iter().find(|(v, _, _)| *v == version) {
            None => {
                return Err(LedgerError::Invalid(format!(
                    "the ledger schema has migration {version} ({name}), which this build does \
                     not know; run a billet-plane at least as new as the one that wrote it"
                )));
            }
            Some((_, known, _)) if *known != name => {
                return Err(LedgerError::Invalid(format!(
                    "ledger migration {version} is recorded as {name:?} but this build calls \
                     it {known:?}; the database was written by an incompatible build"
                )));
            }
            Some(_) => {
                applied_versions.insert(version);
            }
        }
    }
    let now_ms = unix_now_ms();
    for (version, name, statements) in known {
        if applied_versions.contains(version) {
            continue;
        }
        for statement in *statements {
            sqlx::query(*statement).execute(&mut *tx).await?;
        }
        sqlx::query(
            "INSERT INTO schema_migrations (version, name, applied_at_ms) VALUES ($1, $2, $3)",
        )
        .bind(*version)
        .bind(*name)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
    }
    sqlx::query(
        "INSERT INTO settings (name, value) VALUES ('lease_ttl_ms', $1)
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

/// The lease as stored, unlocked.
pub(super) async fn load(conn: &mut AnyConnection, id: &str) -> Result<Option<Lease>> {
    sqlx::query("SELECT * FROM leases WHERE id = $1")
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
        .as_ref()
        .map(lease_from_row)
        .transpose()
}

/// The lease as stored, locked until the transaction ends (PostgreSQL's
/// `FOR UPDATE`; SQLite's `BEGIN IMMEDIATE` already holds the whole
/// database). What every write reads before it decides.
pub(super) async fn load_for_write(
    conn: &mut AnyConnection,
    backend: Backend,
    id: &str,
) -> Result<Option<Lease>> {
    const LOAD: Dialect = Dialect {
        sqlite: "SELECT * FROM leases WHERE id = $1",
        postgres: "SELECT * FROM leases WHERE id = $1 FOR UPDATE",
    };
    sqlx::query(LOAD.pick(backend))
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
        .as_ref()
        .map(lease_from_row)
        .transpose()
}

pub(super) fn lease_from_row(row: &AnyRow) -> Result<Lease> {
    let id: String = row.try_get("id")?;
    let phase: String = row.try_get("phase")?;
    let phase = Phase::parse(&phase).ok_or_else(|| {
        sqlx::Error::Decode(format!("lease {id} has unknown phase {phase:?}").into())
    })?;
    let epoch: i64 = row.try_get("epoch")?;
    let vcpu: i64 = row.try_get("vcpu")?;
    let memory_bytes: i64 = row.try_get("memory_bytes")?;
    let force_release: i64 = row.try_get("force_release")?;
    let end_reason: Option<String> = row.try_get("end_reason")?;
    // A code this build does not know (a newer plane's) reads as
    // unrecorded, whose words are still in `failure_reason`.
    let end_reason =
        end_reason.map(|code| ReasonCode::parse(&code).unwrap_or(ReasonCode::Unrecorded));
    Ok(Lease {
        epoch: from_db("epoch", epoch)?,
        phase,
        tier: row.try_get("tier")?,
        node: row.try_get("node")?,
        target_node: row.try_get("target_node")?,
        request_id: row.try_get("request_id")?,
        runner_name: row.try_get("runner_name")?,
        runner_id: row.try_get("runner_id")?,
        vcpu: from_db("vcpu", vcpu)?,
        memory_bytes: from_db("memory_bytes", memory_bytes)?,
        expires_at_ms: row.try_get("expires_at_ms")?,
        heartbeat_at_ms: row.try_get("heartbeat_at_ms")?,
        held_at_ms: row.try_get("held_at_ms")?,
        failure_reason: row.try_get("failure_reason")?,
        end_reason,
        end_detail: row.try_get("end_detail")?,
        force_release: force_release != 0,
        created_at_ms: row.try_get("created_at_ms")?,
        ended_at_ms: row.try_get("ended_at_ms")?,
        id,
    })
}

/// A stored integer that must fit the field's Rust type.
pub(super) fn from_db<T: TryFrom<i64>>(column: &str, value: i64) -> Result<T> {
    T::try_from(value).map_err(|_| {
        LedgerError::Storage(sqlx::Error::Decode(
            format!("ledger column {column} holds {value}, which is out of range").into(),
        ))
    })
}

pub(super) fn to_i64(field: &str, value: u64) -> Result<i64> {
    i64::try_from(value)
        .map_err(|_| LedgerError::Invalid(format!("{field} {value} is too large for the ledger")))
}

/// A presented epoch as stored; one beyond `i64` can match no row.
pub(super) fn db_epoch(epoch: u64) -> i64 {
    i64::try_from(epoch).unwrap_or(-1)
}

pub(super) fn duration_ms(what: &str, d: Duration) -> Result<i64> {
    i64::try_from(d.as_millis())
        .map_err(|_| LedgerError::Invalid(format!("the {what} of {d:?} is too long")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{TTL, lease_in, on_both_backends};

    on_both_backends! {
        async fn reopening_a_ledger_keeps_its_leases_and_records_the_new_ttl(db) {
            {
                let l = db.ledger().await;
                lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
                l.close().await;
            }
            let l = db.open(Duration::from_secs(30)).await;
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
            assert_eq!(versions, i64::try_from(migrations(l.backend()).len()).unwrap());
            if l.backend() == Backend::Sqlite {
                let mode: String = sqlx::query_scalar("PRAGMA journal_mode")
                    .fetch_one(&l.writer)
                    .await
                    .unwrap();
                assert_eq!(mode, "wal");
            }
            l.close().await;
        }
    }

    on_both_backends! {
        async fn a_ledger_written_by_a_newer_build_is_refused(db) {
            let l = db.ledger().await;
            sqlx::query("INSERT INTO schema_migrations VALUES (999, 'from the future', 0)")
                .execute(&l.writer)
                .await
                .unwrap();
            l.close().await;
            let err = Ledger::connect(db.location(), TTL).await.unwrap_err();
            assert_eq!(err.code(), "invalid", "{err}");
            assert!(err.to_string().contains("999"), "{err}");
        }
    }

    #[test]
    fn both_backends_know_the_same_migrations() {
        let names = |m: &[Migration]| m.iter().map(|(v, n, _)| (*v, *n)).collect::<Vec<_>>();
        assert_eq!(names(SQLITE_MIGRATIONS), names(POSTGRES_MIGRATIONS));
    }

    #[test]
    fn a_path_is_percent_encoded_for_the_url() {
        assert_eq!(
            percent_encode_path("/tmp/a b?#%.db"),
            "/tmp/a%20b%3F%23%25.db"
        );
    }
}
