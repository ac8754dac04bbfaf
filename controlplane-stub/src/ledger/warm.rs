//! Warm runners' room (`warm_rooms`, migration 7 on both backends) and the
//! warm count the operator wants per tier (`warm_wanted`).
//!
//! A warm runner is a container a node started ahead of any job, holding no
//! registration. It takes room on its node as a lease does, so its room is
//! a row here, charged beside the node's open leases wherever the ledger
//! sums a node's charge (`charged_on_in`): a node reserves the row before it
//! creates the container ([`Ledger::reserve_warm`]), hands it back once the
//! container is gone ([`Ledger::release_warm`]), and says which it holds
//! ([`Ledger::confirm_warm`]) so rows a crash or a lost reply left go. A
//! lease reserved with [`Ledger::reserve_on_warm`] takes a row over in its
//! own transaction: the room moves from the warm runner to the lease, and
//! the node hands the lease's registration to that very container.
//!
//! No lease rule lives here.

use std::collections::HashSet;

use sqlx::{AnyConnection, Row};

use super::holder::{charged_on_in, check_fits, lock_node};
use super::schema::{from_db, to_i64};
use super::{Ledger, LedgerError, NodeCapacity, Result};

/// Longest warm runner name accepted, in bytes.
const MAX_NAME_LEN: usize = 128;

/// One warm runner's room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WarmRoom {
    /// Its instance name.
    pub name: String,
    /// The node it is on.
    pub node: String,
    /// Its tier label.
    pub tier: String,
    /// What it charges.
    pub vcpu: u64,
    /// What it charges.
    pub memory_bytes: u64,
}

impl Ledger {
    /// Charges `room` on its node, whose capacity is `capacity`, unless the
    /// node's open leases and warm runners leave no room for it
    /// ([`LedgerError::NoCapacity`], nothing written). The same name again
    /// (a retried call) changes nothing and succeeds.
    ///
    /// # Errors
    ///
    /// [`LedgerError::NoCapacity`]; [`LedgerError::Invalid`] for an empty
    /// or overlong name or node; `Storage`.
    pub async fn reserve_warm(
        &self,
        room: &WarmRoom,
        capacity: NodeCapacity,
        now_ms: i64,
    ) -> Result<()> {
        if room.name.is_empty() || room.name.len() > MAX_NAME_LEN || room.node.is_empty() {
            return Err(LedgerError::Invalid(format!(
                "a warm runner's room needs a name of 1 to {MAX_NAME_LEN} bytes and a node (name {:?}, node {:?})",
                room.name, room.node
            )));
        }
        let mut tx = self.begin_write().await?;
        lock_node(&mut tx, &room.node).await?;
        let held: Option<String> = sqlx::query("SELECT node FROM warm_rooms WHERE name = $1")
            .bind(&room.name)
            .fetch_optional(&mut *tx)
            .await?
            .map(|row| row.try_get("node"))
            .transpose()?;
        if let Some(node) = held {
            if node != room.node {
                return Err(LedgerError::Invalid(format!(
                    "warm runner {} is charged to node {node}, not {}",
                    room.name, room.node
                )));
            }
            tx.commit().await?;
            return Ok(());
        }
        let charged = charged_on_in(&mut tx, &room.node).await?;
        let asked = NodeCapacity {
            vcpu: room.vcpu,
            memory_bytes: room.memory_bytes,
        };
        check_fits(&room.name, &room.node, asked, charged, capacity)?;
        sqlx::query(
            "INSERT INTO warm_rooms (name, node, tier, vcpu, memory_bytes, reserved_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6)",
        )
        .bind(&room.name)
        .bind(&room.node)
        .bind(&room.tier)
        .bind(to_i64("vcpu", room.vcpu)?)
        .bind(to_i64("memory_bytes", room.memory_bytes)?)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// Drops the room of warm runner `name` on `node`. Unknown (released
    /// already, or taken over by a lease) changes nothing.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn release_warm(&self, node: &str, name: &str) -> Result<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query("DELETE FROM warm_rooms WHERE name = $1 AND node = $2")
            .bind(name)
            .bind(node)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }

    /// `node` holds exactly the warm runners `names` (created, or reserved
    /// and being created): the room of every other warm runner charged to
    /// it is dropped. Returns those of `names` still charged; one that is
    /// not was taken over by a lease, or never reserved.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn confirm_warm(&self, node: &str, names: &[String]) -> Result<Vec<String>> {
        let mut tx = self.begin_write().await?;
        lock_node(&mut tx, node).await?;
        let rows = sqlx::query("SELECT name FROM warm_rooms WHERE node = $1")
            .bind(node)
            .fetch_all(&mut *tx)
            .await?;
        let held: HashSet<&str> = names.iter().map(String::as_str).collect();
        let mut charged = Vec::new();
        for row in rows {
            let name: String = row.try_get("name")?;
            if held.contains(name.as_str()) {
                charged.push(name);
            } else {
                sqlx::query("DELETE FROM warm_rooms WHERE name = $1")
                    .bind(&name)
                    .execute(&mut *tx)
                    .await?;
            }
        }
        tx.commit().await?;
        charged.sort();
        Ok(charged)
    }

    /// Every warm runner's room, by node then name.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn warm_rooms(&self) -> Result<Vec<WarmRoom>> {
        sqlx::query(
            "SELECT name, node, tier, vcpu, memory_bytes FROM warm_rooms ORDER BY node, name",
        )
        .fetch_all(&self.reader)
        .await?
        .iter()
        .map(|row| {
            let vcpu: i64 = row.try_get("vcpu")?;
            let memory_bytes: i64 = row.try_get("memory_bytes")?;
            Ok(WarmRoom {
                name: row.try_get("name")?,
                node: row.try_get("node")?,
                tier: row.try_get("tier")?,
                vcpu: from_db("vcpu", vcpu)?,
                memory_bytes: from_db("memory_bytes", memory_bytes)?,
            })
        })
        .collect()
    }

    /// Sets how many warm runners each node keeps for `tier`: what the
    /// plane serving it then asks of every node, in place of its
    /// `--warm` flag.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn set_warm_wanted(&self, tier: &str, count: u32, now_ms: i64) -> Result<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO warm_wanted (tier, count, set_at_ms) VALUES ($1, $2, $3)
             ON CONFLICT (tier) DO UPDATE SET count = excluded.count, set_at_ms = excluded.set_at_ms",
        )
        .bind(tier)
        .bind(i64::from(count))
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The warm count set for `tier` ([`Ledger::set_warm_wanted`]), if any.
    ///
    /// # Errors
    ///
    /// `Storage`.
    pub async fn warm_wanted(&self, tier: &str) -> Result<Option<u32>> {
        sqlx::query("SELECT count FROM warm_wanted WHERE tier = $1")
            .bind(tier)
            .fetch_optional(&self.reader)
            .await?
            .map(|row| {
                let count: i64 = row.try_get("count")?;
                from_db("count", count)
            })
            .transpose()
    }
}

/// Inside a reservation's transaction: drops the room of the oldest warm
/// runner of `tier` on `node` and returns its name, or `None` when there
/// is none.
pub(super) async fn take_warm_in(
    conn: &mut AnyConnection,
    node: &str,
    tier: &str,
) -> Result<Option<String>> {
    let name: Option<String> = sqlx::query(
        "SELECT name FROM warm_rooms WHERE node = $1 AND tier = $2
         ORDER BY reserved_at_ms, name LIMIT 1",
    )
    .bind(node)
    .bind(tier)
    .fetch_optional(&mut *conn)
    .await?
    .map(|row| row.try_get("name"))
    .transpose()?;
    if let Some(name) = &name {
        sqlx::query("DELETE FROM warm_rooms WHERE name = $1")
            .bind(name)
            .execute(&mut *conn)
            .await?;
    }
    Ok(name)
}

/// What the warm runners on `node` charge, inside a transaction.
pub(super) async fn warm_charged_in(conn: &mut AnyConnection, node: &str) -> Result<NodeCapacity> {
    let row = sqlx::query(
        "SELECT CAST(COALESCE(SUM(vcpu), 0) AS BIGINT) AS vcpu,
            CAST(COALESCE(SUM(memory_bytes), 0) AS BIGINT) AS memory_bytes
         FROM warm_rooms WHERE node = $1",
    )
    .bind(node)
    .fetch_one(&mut *conn)
    .await?;
    let vcpu: i64 = row.try_get("vcpu")?;
    let memory_bytes: i64 = row.try_get("memory_bytes")?;
    Ok(NodeCapacity {
        vcpu: from_db("vcpu", vcpu)?,
        memory_bytes: from_db("memory_bytes", memory_bytes)?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{GIB, new_lease, on_both_backends};

    fn room(name: &str, node: &str) -> WarmRoom {
        WarmRoom {
            name: name.to_owned(),
            node: node.to_owned(),
            tier: "linux-2cpu".to_owned(),
            vcpu: 2,
            memory_bytes: 4 * GIB,
        }
    }

    /// Room for two leases or warm runners of `new_lease`'s size.
    const TWO: NodeCapacity = NodeCapacity {
        vcpu: 4,
        memory_bytes: 8 * GIB,
    };

    on_both_backends! {
        async fn warm_rooms_count_against_the_node_and_a_lease_of_their_tier_takes_one_over(db) {
            let l = db.ledger().await;
            l.reserve_warm(&room("w1", "n1"), TWO, 1).await.unwrap();
            l.reserve_warm(&room("w2", "n1"), TWO, 2).await.unwrap();
            // Full of warm runners: a third is refused, and so is a lease
            // that would need room of its own.
            assert!(matches!(
                l.reserve_warm(&room("w3", "n1"), TWO, 3).await,
                Err(LedgerError::NoCapacity { .. })
            ));
            assert!(matches!(
                l.reserve_on(new_lease("cold"), "n1", TWO, 4).await,
                Err(LedgerError::NoCapacity { .. })
            ));
            // A lease of their tier takes the oldest one's room over.
            let (lease, warm) = l.reserve_on_warm(new_lease("hot"), "n1", TWO, 5).await.unwrap();
            assert_eq!(warm.as_deref(), Some("w1"));
            assert_eq!(lease.id, "hot");
            let rooms = l.warm_rooms().await.unwrap();
            assert_eq!(rooms.iter().map(|r| r.name.as_str()).collect::<Vec<_>>(), ["w2"]);
            // Still full: the lease holds what the warm runner held.
            assert!(matches!(
                l.reserve_warm(&room("w3", "n1"), TWO, 6).await,
                Err(LedgerError::NoCapacity { .. })
            ));
        }
    }

    on_both_backends! {
        async fn a_node_confirming_its_warm_runners_drops_every_other_room(db) {
            let l = db.ledger().await;
            l.reserve_warm(&room("w1", "n1"), TWO, 1).await.unwrap();
            l.reserve_warm(&room("w2", "n1"), TWO, 2).await.unwrap();
            l.reserve_warm(&room("x1", "n2"), TWO, 3).await.unwrap();
            // Retried: nothing changes.
            l.reserve_warm(&room("w1", "n1"), TWO, 4).await.unwrap();
            let charged = l
                .confirm_warm("n1", &["w2".to_owned(), "w9".to_owned()])
                .await
                .unwrap();
            assert_eq!(charged, ["w2"]);
            let names: Vec<String> = l.warm_rooms().await.unwrap().into_iter().map(|r| r.name).collect();
            assert_eq!(names, ["w2", "x1"]);
            l.release_warm("n1", "w2").await.unwrap();
            l.release_warm("n1", "w2").await.unwrap();
            assert_eq!(l.warm_rooms().await.unwrap().len(), 1);
            // Another node's name is refused, never moved.
            assert!(matches!(
                l.reserve_warm(&room("x1", "n1"), TWO, 5).await,
                Err(LedgerError::Invalid(_))
            ));
        }
    }

    on_both_backends! {
        async fn the_wanted_warm_count_is_kept_per_tier(db) {
            let l = db.ledger().await;
            assert_eq!(l.warm_wanted("t").await.unwrap(), None);
            l.set_warm_wanted("t", 3, 1).await.unwrap();
            l.set_warm_wanted("t", 0, 2).await.unwrap();
            assert_eq!(l.warm_wanted("t").await.unwrap(), Some(0));
        }
    }
}
