//! The ledger's storage layer: the append-only schema migrations, the
//! single-connection writer pool, and the mapping between a `leases` row and
//! [`Lease`] (decoding, and the integer conversions either way).
//!
//! It knows the SQL schema and no lease rule: nothing here checks an epoch,
//! a phase edge or a node, and only `migrate` opens a write transaction. A
//! new column is a new migration appended to `MIGRATIONS` plus a field in
//! `lease_from_row`; an applied migration is never edited.

use std::collections::HashSet;
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteConnection, SqlitePoolOptions, SqliteRow};
use sqlx::{Row, SqlitePool};

use super::{Lease, LedgerError, Phase, Result};

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

/// A pool of exactly one connection that is never recycled (an in-memory
/// database lives only as long as its connection).
pub(super) async fn single_connection_pool(options: SqliteConnectOptions) -> Result<SqlitePool> {
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
pub(super) async fn migrate(writer: &SqlitePool, lease_ttl: Duration) -> Result<Duration> {
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

pub(super) async fn load(conn: &mut SqliteConnection, id: &str) -> Result<Option<Lease>> {
    sqlx::query("SELECT * FROM leases WHERE id = ?")
        .bind(id)
        .fetch_optional(&mut *conn)
        .await?
        .as_ref()
        .map(lease_from_row)
        .transpose()
}

pub(super) fn lease_from_row(row: &SqliteRow) -> Result<Lease> {
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
    use crate::ledger::Ledger;
    use crate::ledger::test_support::{TTL, TempDb, lease_in};

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
}
