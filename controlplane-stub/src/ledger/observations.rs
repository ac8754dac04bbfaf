//! What the node-local cache did for each lease's job (the reference's
//! `LeaseStore.RecordCacheObservation`): one row per lease in
//! `cache_observations`, the first one recorded kept.
//!
//! The write is fenced by the lease's epoch like the holder writes, but the
//! lease may already be terminal: a node settles a job's sticky disks after
//! it released the lease. It changes nothing in `leases`.

use sqlx::{AnyConnection, Row};

use super::schema::{from_db, load_for_write, to_i64};
use super::{Backend, Ledger, LedgerError, Result};

/// What the cache did for one lease's job, as its node counted it: each
/// sticky disk mounted is a hit, a miss or a fallback; each commit that
/// published adds its bytes (apparent sizes of regular files); each
/// compare-and-swap commit refused is a conflict.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheObservation {
    /// Disks mounted from a published generation of their key.
    pub hits: u64,
    /// Disks mounted cold: their key had no generation yet.
    pub misses: u64,
    /// Disks the job got as an empty, uncommittable fallback.
    pub fallbacks: u64,
    /// Bytes cloned into the job's mounts from the generations they hit.
    pub bytes_restored: u64,
    /// Bytes published as new generations from the job's mounts.
    pub bytes_committed: u64,
    /// Commits refused because another job committed the key first.
    pub conflicts: u64,
}

impl Ledger {
    /// Records `observation` against lease `id`, presented at `epoch`, at
    /// `now_ms` (Unix ms), unless one is already recorded: the ledger keeps
    /// the first (`INSERT ... ON CONFLICT DO NOTHING`, then read back), so
    /// a retry or a second, different observation changes nothing. Returns
    /// the observation the ledger keeps. The lease may be terminal (a
    /// node settles its disks after the release); its row is not changed.
    ///
    /// # Errors
    ///
    /// `NotFound` for an unknown lease, `Fenced` when `epoch` is not the
    /// lease's, `Invalid` for a count beyond `i64`.
    pub(crate) async fn record_cache_observation(
        &self,
        id: &str,
        epoch: u64,
        observation: CacheObservation,
        now_ms: i64,
    ) -> Result<CacheObservation> {
        let o = observation;
        let counts = [
            to_i64("hits", o.hits)?,
            to_i64("misses", o.misses)?,
            to_i64("fallbacks", o.fallbacks)?,
            to_i64("bytes_restored", o.bytes_restored)?,
            to_i64("bytes_committed", o.bytes_committed)?,
            to_i64("conflicts", o.conflicts)?,
        ];
        let mut tx = self.begin_write().await?;
        fenced(&mut tx, self.backend, id, epoch).await?;
        let mut insert = sqlx::query(
            "INSERT INTO cache_observations (lease_id, hits, misses, fallbacks, bytes_restored,
                bytes_committed, conflicts, recorded_at_ms)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (lease_id) DO NOTHING",
        )
        .bind(id);
        for count in counts {
            insert = insert.bind(count);
        }
        insert.bind(now_ms).execute(&mut *tx).await?;
        let kept = read(&mut tx, id)
            .await?
            .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
        tx.commit().await?;
        Ok(kept)
    }

    /// The cache observation the ledger keeps for lease `id`, if any.
    ///
    /// # Errors
    ///
    /// `Storage` when the database fails.
    pub async fn cache_observation(&self, id: &str) -> Result<Option<CacheObservation>> {
        let mut conn = self.reader.acquire().await?;
        read(&mut conn, id).await
    }
}

/// Checks lease `id` exists at `epoch`, terminal or not, locking its row.
async fn fenced(conn: &mut AnyConnection, backend: Backend, id: &str, epoch: u64) -> Result<()> {
    let lease = load_for_write(conn, backend, id)
        .await?
        .ok_or_else(|| LedgerError::NotFound(id.to_owned()))?;
    if lease.epoch != epoch {
        return Err(LedgerError::Fenced {
            lease: lease.id,
            held: lease.epoch,
            presented: epoch,
        });
    }
    Ok(())
}

async fn read(conn: &mut AnyConnection, id: &str) -> Result<Option<CacheObservation>> {
    let Some(row) = sqlx::query(
        "SELECT hits, misses, fallbacks, bytes_restored, bytes_committed, conflicts
         FROM cache_observations WHERE lease_id = $1",
    )
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?
    else {
        return Ok(None);
    };
    let count = |column: &str| -> Result<u64> { from_db(column, row.try_get::<i64, _>(column)?) };
    Ok(Some(CacheObservation {
        hits: count("hits")?,
        misses: count("misses")?,
        fallbacks: count("fallbacks")?,
        bytes_restored: count("bytes_restored")?,
        bytes_committed: count("bytes_committed")?,
        conflicts: count("conflicts")?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::Phase;
    use crate::ledger::test_support::{code, lease_in, on_both_backends};

    const SEEN: CacheObservation = CacheObservation {
        hits: 1,
        misses: 2,
        fallbacks: 3,
        bytes_restored: 4,
        bytes_committed: 5,
        conflicts: 6,
    };

    on_both_backends! {
        /// An observation is recorded against the lease at its epoch, and the
        /// first one is kept: a second, different one is answered with the
        /// first.
        async fn the_first_cache_observation_of_a_lease_is_kept(db) {
            let l = db.ledger().await;
            lease_in(&l, "a", "n1", &[Phase::Launching, Phase::Online], 0).await;
            assert_eq!(l.cache_observation("a").await.unwrap(), None);
            assert_eq!(l.record_cache_observation("a", 1, SEEN, 10).await.unwrap(), SEEN);
            let other = CacheObservation { hits: 9, ..CacheObservation::default() };
            assert_eq!(l.record_cache_observation("a", 1, other, 11).await.unwrap(), SEEN);
            assert_eq!(l.cache_observation("a").await.unwrap(), Some(SEEN));
            let lease = l.get("a").await.unwrap().unwrap();
            assert_eq!(lease.phase, Phase::Online, "the lease is not changed");
        }
    }

    on_both_backends! {
        /// Fenced by epoch: a stale or future epoch writes nothing, and an
        /// unknown lease is `not_found`.
        async fn a_cache_observation_is_fenced_and_needs_a_known_lease(db) {
            let l = db.ledger().await;
            lease_in(&l, "a", "n1", &[Phase::Launching], 0).await;
            assert_eq!(code(l.record_cache_observation("a", 2, SEEN, 10).await), "fenced");
            assert_eq!(code(l.record_cache_observation("a", 0, SEEN, 10).await), "fenced");
            assert_eq!(l.cache_observation("a").await.unwrap(), None, "nothing written");
            assert_eq!(code(l.record_cache_observation("nope", 1, SEEN, 10).await), "not_found");
            assert_eq!(l.cache_observation("nope").await.unwrap(), None);
        }
    }

    on_both_backends! {
        /// A node settles a job's disks after it released the lease: an
        /// ended lease, at its epoch, still takes its observation.
        async fn a_terminal_lease_takes_its_cache_observation(db) {
            let l = db.ledger().await;
            lease_in(&l, "a", "n1", &[Phase::Launching, Phase::Online, Phase::Busy], 0).await;
            l.release("a", 1, Some("n1"), Phase::Done, 5).await.unwrap();
            assert_eq!(l.record_cache_observation("a", 1, SEEN, 10).await.unwrap(), SEEN);
            assert_eq!(l.cache_observation("a").await.unwrap(), Some(SEEN));
        }
    }
}
