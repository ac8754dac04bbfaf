//! The node-local cache: sticky disks (spec/cache.md §1.1, §2.4, §4) and
//! the Docker image store, a disk keyed `docker-images/<arch>`
//! bound at [`DOCKER_STORE_PATH`] (§1.2, §3.3). A sticky disk is a directory a job asks for by key and
//! path; the node binds a copy-on-write clone of the key's current
//! generation at that path before the job's compute starts, and at the end
//! of a successful job the clone's contents become the key's next
//! immutable generation, compare-and-swap on the generation it was cloned
//! from. A cache can make a job faster and never changes its result: every
//! failure here is a warning and a cold directory.
//!
//! - [`store`]: [`Store`], the generations, mounts, commits and eviction on
//!   the node's disk, its mounts recorded in the node journal
//!   ([`crate::journal::MountJournal`]).
//! - [`clone`]: how a mount is made: reflink per file, or a sparse copy.
//! - [`lifecycle`]: what proves a mount's compute is gone (only a
//!   successful inventory), and the periodic eviction.
//!
//! Invariant: this module never sees a lease's compute or the provider;
//! the runner asks it for mounts before compute starts and settles them
//! once compute is proven gone.

pub mod actions;
pub mod clone;
pub mod lifecycle;
pub mod session;
pub(crate) mod store;

/// A scratch directory for tests, removed when it is dropped: the cache's
/// tests write up to a gigabyte each, and left behind they filled the
/// temporary directory run after run.
#[cfg(test)]
pub(crate) struct Scratch(std::path::PathBuf);

#[cfg(test)]
impl Scratch {
    /// A new empty directory `<tmp>/<prefix>-<uuid>`.
    pub(crate) fn new(prefix: &str) -> Self {
        let d = std::env::temp_dir().join(format!("{prefix}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&d).expect("create a scratch directory");
        Self(d)
    }
}

#[cfg(test)]
impl std::ops::Deref for Scratch {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

#[cfg(test)]
impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub use lifecycle::{Evicted, Inventory, Listed};
pub use store::{
    CacheError, Committed, EvictReport, Eviction, Generation, Mount, Observation, STORE_LOCK,
    Settled, Store,
};

pub use crate::model::disk::{
    DOCKER_STORE_PATH, DiskError, DiskKey, MAX_KEY_BYTES, MAX_PATH_BYTES, MAX_STICKY_DISKS, Policy,
    RESERVED_PATHS, RESERVED_PREFIX, StickyDisk, check_beside_docker_store, check_disks,
    docker_architecture, docker_architecture_of, valid_architecture,
};
