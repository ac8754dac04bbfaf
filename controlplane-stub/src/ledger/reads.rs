//! The ledger's reads: `get`, `lease_by_runner_name`, `leases`,
//! `open_leases`, `launched`, `charged` and `charged_on`.
//!
//! Every one issues only `SELECT`s on the reader pool: `query_only`
//! connections on a ledger file, which never wait for the writer; read-only
//! sessions on PostgreSQL; the one shared connection of an in-memory
//! ledger. Reads are unfenced: they take
//! no epoch, open no transaction and decide nothing; a caller that acts on
//! what it read presents the epoch to a holder write, which checks it again.

use sqlx::Row;

use super::schema::{from_db, lease_from_row, load};
use super::{Charge, Lease, Ledger, Result};

impl Ledger {
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
            "SELECT * FROM leases WHERE runner_name = $1 ORDER BY created_at_ms DESC, id LIMIT 1",
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

    /// Every lease not yet done or failed (quarantine included), oldest
    /// first: what the plane's coverage and placement read.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn open_leases(&self) -> Result<Vec<Lease>> {
        sqlx::query(
            "SELECT * FROM leases WHERE phase NOT IN ('done', 'failed')
             ORDER BY created_at_ms, id",
        )
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(lease_from_row)
        .collect()
    }

    /// Capacity charged on `node`: every open lease bound to it, or aimed at
    /// it ([`Ledger::reserve_on`]) and not yet bound, quarantine included.
    /// At a quiescent point this is what the node reports it holds.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn charged_on(&self, node: &str) -> Result<Charge> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS leases, CAST(COALESCE(SUM(vcpu), 0) AS BIGINT) AS vcpu,
                CAST(COALESCE(SUM(memory_bytes), 0) AS BIGINT) AS memory_bytes
             FROM leases
             WHERE (node = $1 OR (node IS NULL AND target_node = $1))
                AND phase NOT IN ('done', 'failed')",
        )
        .bind(node)
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

    /// The ids bound to `node`: `(launched, quarantined)`, where launched
    /// means launching, online, busy, custody or teardown. A node keeps
    /// instances of either set and treats any other `billet-` instance as an
    /// orphan.
    ///
    /// # Errors
    ///
    /// `Storage`.
    #[cfg(test)]
    pub(crate) async fn launched(&self, node: &str) -> Result<(Vec<String>, Vec<String>)> {
        let rows = sqlx::query(
            "SELECT id, phase FROM leases WHERE node = $1 AND phase IN
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
            if phase == super::Phase::Quarantine.as_str() {
                quarantined.push(id);
            } else {
                launched.push(id);
            }
        }
        Ok((launched, quarantined))
    }

    /// The leases bound to `node` that are launching, online, busy, in
    /// custody, tearing down or quarantined, by id: what a recovering node
    /// adopts from, read at once.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub(crate) async fn launched_leases(&self, node: &str) -> Result<Vec<Lease>> {
        sqlx::query(
            "SELECT * FROM leases WHERE node = $1 AND phase IN
                ('launching', 'online', 'busy', 'custody', 'teardown', 'quarantine')
             ORDER BY id",
        )
        .bind(node)
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(lease_from_row)
        .collect()
    }

    /// Capacity charged by every non-terminal lease, quarantine included.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn charged(&self) -> Result<Charge> {
        let row = sqlx::query(
            "SELECT COUNT(*) AS leases, CAST(COALESCE(SUM(vcpu), 0) AS BIGINT) AS vcpu,
                CAST(COALESCE(SUM(memory_bytes), 0) AS BIGINT) AS memory_bytes
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
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::ledger::Phase;
    use crate::ledger::test_support::{GIB, TTL_MS, lease_in, new_lease, on_both_backends};

    on_both_backends! {
        async fn launched_lists_running_and_held_leases_apart_from_quarantine(db) {
            let l = db.ledger().await;
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
    }

    on_both_backends! {
        async fn charged_capacity_returns_to_zero_once_every_lease_ends(db) {
            let l = db.ledger().await;
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
    }
}
