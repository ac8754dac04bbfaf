//! What uploads hold on the cache's disk before they are published, and
//! the bounds they are held to (decision 127).
//!
//! An upload's bytes (a whole archive, staged `comp=block` blocks, the
//! archive a block list assembles) are reserved before they are written:
//! against the session's bound ([`StageLimits::per_session_bytes`]), the
//! cache's budget (`--cache-max-bytes`: all sessions' staged bytes
//! together never exceed it), and a free-space floor the disk keeps
//! whatever the cache does, since it is by default the journal's disk
//! too. A body that declares its length is refused before a byte of it is
//! read; one that does not is reserved frame by frame. A reservation is
//! given back when its bytes are, and its upload's whole reservation when
//! the upload is published (its bytes become an entry, which eviction
//! counts) or its session closes.

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

/// The most one session may hold staged: an archive and the blocks it is
/// assembled from.
pub(crate) const MAX_STAGED_BYTES_PER_SESSION: u64 = 2 * super::archives::MAX_ARCHIVE_BYTES;

/// The free space the cache's disk keeps: this, or a tenth of the disk
/// when that is less (a small disk still takes uploads).
pub(crate) const FREE_FLOOR_BYTES: u64 = 1 << 30;

/// A request body that sends nothing for this long is cut.
pub(crate) const BODY_STALL: Duration = Duration::from_secs(10);

/// From [`BODY_RATE_GRACE`] on, a request body must have averaged at least
/// this many bytes a second since it began, or it is cut: a body that
/// declares 20 GiB and trickles cannot hold its connection and its
/// reservation for hours.
pub(crate) const MIN_BODY_BYTES_PER_SEC: u64 = 64 * 1024;

/// How long a body may take before its rate is judged.
pub(crate) const BODY_RATE_GRACE: Duration = Duration::from_secs(10);

/// The bounds uploads are held to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StageLimits {
    /// `--cache-max-bytes`: what all sessions may hold staged together.
    pub(crate) budget_bytes: Option<u64>,
    /// What one session may hold staged.
    pub(crate) per_session_bytes: u64,
    /// The free space the disk keeps; `None`: [`FREE_FLOOR_BYTES`] or a
    /// tenth of the disk, whichever is less.
    pub(crate) free_floor_bytes: Option<u64>,
}

impl Default for StageLimits {
    fn default() -> Self {
        Self {
            budget_bytes: None,
            per_session_bytes: MAX_STAGED_BYTES_PER_SESSION,
            free_floor_bytes: None,
        }
    }
}

/// Why bytes cannot be staged: a sentence for the guest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub(crate) struct NoRoom(pub(crate) String);

/// The bytes each upload holds staged, by upload id, with its session's
/// lease.
#[derive(Debug, Default)]
pub(crate) struct Staged {
    limits: StageLimits,
    by_upload: HashMap<String, (String, u64)>,
}

impl Staged {
    /// Bounded by `limits`.
    pub(crate) fn set_limits(&mut self, limits: StageLimits) {
        self.limits = limits;
    }

    /// Counts `bytes` already on disk for `upload` of `lease` (found at
    /// start-up), whatever the bounds.
    pub(crate) fn found(&mut self, lease: &str, upload: &str, bytes: u64) {
        self.by_upload
            .entry(upload.to_owned())
            .or_insert_with(|| (lease.to_owned(), 0))
            .1 += bytes;
    }

    /// Reserves `bytes` more for `upload` of `lease`, on the disk holding
    /// `root`.
    ///
    /// # Errors
    ///
    /// [`NoRoom`] saying which bound it would cross; nothing is reserved.
    pub(crate) fn reserve(
        &mut self,
        root: &Path,
        lease: &str,
        upload: &str,
        bytes: u64,
    ) -> Result<(), NoRoom> {
        let session: u64 = self
            .by_upload
            .values()
            .filter(|(l, _)| l == lease)
            .map(|(_, b)| b)
            .sum();
        if session.saturating_add(bytes) > self.limits.per_session_bytes {
            return Err(NoRoom(format!(
                "this job's unfinished uploads would hold more than {} bytes",
                self.limits.per_session_bytes
            )));
        }
        if let Some(budget) = self.limits.budget_bytes {
            let all: u64 = self.by_upload.values().map(|(_, b)| b).sum();
            if all.saturating_add(bytes) > budget {
                return Err(NoRoom(format!(
                    "unfinished uploads would hold more than the cache's {budget} bytes"
                )));
            }
        }
        let (free, size) = disk(root).map_err(|e| NoRoom(format!("the cache's disk: {e}")))?;
        let floor = self
            .limits
            .free_floor_bytes
            .unwrap_or_else(|| FREE_FLOOR_BYTES.min(size / 10));
        if free < bytes.saturating_add(floor) {
            return Err(NoRoom(format!(
                "the cache's disk keeps {floor} bytes free, and has {free}"
            )));
        }
        self.found(lease, upload, bytes);
        Ok(())
    }

    /// Gives back `bytes` of `upload`'s reservation.
    pub(crate) fn release(&mut self, upload: &str, bytes: u64) {
        if let Some((_, held)) = self.by_upload.get_mut(upload) {
            *held = held.saturating_sub(bytes);
        }
    }

    /// Gives back all of `upload`'s reservation.
    pub(crate) fn forget(&mut self, upload: &str) {
        self.by_upload.remove(upload);
    }

    /// What `lease`'s uploads hold staged.
    #[cfg(test)]
    pub(crate) fn session(&self, lease: &str) -> u64 {
        self.by_upload
            .values()
            .filter(|(l, _)| l == lease)
            .map(|(_, b)| b)
            .sum()
    }
}

/// Bytes available to this process, and the size, of the file system
/// holding `dir`.
fn disk(dir: &Path) -> std::io::Result<(u64, u64)> {
    let stat = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    #[allow(
        clippy::useless_conversion,
        reason = "the field types differ by platform"
    )]
    let (available, blocks, fragment) = (
        u64::from(stat.blocks_available()),
        u64::from(stat.blocks()),
        u64::from(stat.fragment_size()),
    );
    Ok((
        available.saturating_mul(fragment),
        blocks.saturating_mul(fragment),
    ))
}

/// The bytes of the files under `dir`, recursively (an upload's directory
/// at start-up); what cannot be read counts nothing.
pub(crate) fn bytes_under(dir: &Path) -> u64 {
    let mut total = 0;
    let mut pending = vec![dir.to_owned()];
    while let Some(d) = pending.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for entry in entries.flatten() {
            match entry.file_type() {
                Ok(t) if t.is_dir() => pending.push(entry.path()),
                Ok(t) if t.is_file() => {
                    total += entry.metadata().map_or(0, |m| m.len());
                }
                _ => {}
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn staged_bytes_are_bounded_per_session_and_by_the_budget_and_given_back() {
        let root = std::env::temp_dir();
        let mut staged = Staged::default();
        staged.set_limits(StageLimits {
            budget_bytes: Some(100),
            per_session_bytes: 60,
            free_floor_bytes: Some(0),
        });
        staged.reserve(&root, "a", "u1", 50).unwrap();
        assert!(staged.reserve(&root, "a", "u2", 20).is_err(), "per session");
        staged.reserve(&root, "b", "u3", 40).unwrap();
        let err = staged.reserve(&root, "c", "u4", 20).unwrap_err();
        assert!(err.0.contains("100 bytes"), "{err}");
        staged.release("u1", 30);
        staged.reserve(&root, "c", "u4", 20).unwrap();
        staged.forget("u3");
        assert_eq!(staged.session("b"), 0);
        staged.reserve(&root, "a", "u2", 40).unwrap();
        assert_eq!(staged.session("a"), 60);
    }

    #[test]
    fn the_disk_keeps_its_floor() {
        let root = std::env::temp_dir();
        let (free, _) = disk(&root).unwrap();
        let mut staged = Staged::default();
        staged.set_limits(StageLimits {
            free_floor_bytes: Some(free),
            per_session_bytes: u64::MAX,
            budget_bytes: None,
        });
        let err = staged.reserve(&root, "a", "u", 1 << 20).unwrap_err();
        assert!(err.0.contains("free"), "{err}");
    }
}
