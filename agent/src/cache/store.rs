//! The sticky-disk store: per deployment and key, immutable generations on
//! the node's disk, per job a writable clone of the current one.
//!
//! The storage contract is the reference's (spec/cache.md §4.2, §4.4) in
//! a local, directory-shaped form for the Docker provider, which binds a
//! directory where a microVM would attach a block image:
//!
//! ```text
//! <cache dir>/
//!   lock                       flock'd for the store's life: one node per directory
//!   keys/<digest>/state.json   the key: its head, its next generation number, and
//!                              each generation's publication and last use
//!   keys/<digest>/g/<n>/       generation n, an immutable tree
//!   mounts/<mount id>/         a job's writable clone (or its empty fallback)
//!   trash/                     what is being removed
//! ```
//!
//! `<digest>` is the first 32 hex digits of SHA-256 over the deployment,
//! a NUL and the key, so keys of two deployments sharing a directory never
//! meet and any key is a safe file name.
//!
//! - **Mount** ([`Store::mount`]): the mount is journaled first (an intent:
//!   a node killed while cloning finds it), then the head generation is
//!   cloned ([`super::clone::clone_tree`]) and its last use refreshed. A
//!   key with no generation gives an empty, committable directory (cold).
//!   A clone that fails gives an empty directory that is never committed:
//!   the job goes on cold and nothing is published from it.
//! - **Commit** ([`Store::commit`]): under the store's lock, compare the
//!   key's head with the generation the mount was cloned from. Equal (or
//!   [`Policy::LastWriterWins`]): sync the filesystem, rename the mount's
//!   directory to the next generation (O(1): the clone's contents *are*
//!   the generation), then replace `state.json` (write, fsync, rename,
//!   fsync the directory: the head moves last). Otherwise the commit is a
//!   [`Committed::Conflict`] and the mount is discarded. A commit that
//!   fails midway leaves the old `state.json`, so the head stays at the
//!   previous generation, whose tree nothing touched; the half-made
//!   generation goes to the trash, and a crash before that leaves a
//!   generation directory no state names, collected when the store opens.
//! - **Eviction** ([`super::lifecycle::evict`], with the Actions cache's
//!   archives): a generation some open mount was cloned from is never
//!   removed, and its last use is renewed to the pass's time
//!   (`Store::renew_mounted`, the reference's `RenewActive`: a long job's
//!   generation is used for as long as it is mounted). Others go when
//!   superseded (no longer the head), when the head was last used longer
//!   ago than its key's retention ([`Eviction::retention_of`]: a Docker
//!   image store keeps its own), and, least recently used first, while the
//!   cache holds more than its byte budget. The walk that reads every
//!   generation's size (`Store::survey`) takes no lock; each victim is
//!   looked at again and removed under the lock
//!   (`Store::remove_generation`), its tree deleted after the lock is
//!   released.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use thiserror::Error;
use tracing::{info, warn};

use super::clone::{
    CloneMethod, Filesystem, ReflinkSupport, apparent_bytes, clone_tree, probe, tree_bytes,
};
use super::lifecycle::{Evicted, Listed};
use super::{DiskKey, Policy};
use crate::journal::{JournalError, MountJournal, MountRecord};
use crate::model::LeaseId;

/// The lock file in the cache directory.
pub const STORE_LOCK: &str = "lock";
/// Each key's state file.
const STATE_FILE: &str = "state.json";
/// Where `state.json` is written before it is renamed into place.
const STATE_TEMP: &str = "state.json.tmp";

/// A generation of a key: 1, 2, ... in the order they were committed,
/// never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Generation(pub u64);

impl std::fmt::Display for Generation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "g{}", self.0)
    }
}

/// A store operation that failed.
#[derive(Debug, Error)]
pub enum CacheError {
    /// The cache directory cannot be used.
    #[error("cache directory {path}: {message}")]
    Open {
        /// The directory.
        path: PathBuf,
        /// What is wrong and what to do.
        message: String,
    },
    /// A file operation failed.
    #[error("cache: {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why it failed.
        source: std::io::Error,
    },
    /// The node journal failed.
    #[error("cache: {0}")]
    Journal(#[from] JournalError),
    /// No mount has this id.
    #[error("cache: no mount {0}")]
    UnknownMount(String),
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> CacheError + 'a {
    move |source| CacheError::Io {
        op,
        path: path.to_owned(),
        source,
    }
}

/// A mount made for a job: the directory to bind at the disk's path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// Its id (the name of its directory).
    pub id: String,
    /// The directory the provider binds.
    pub dir: PathBuf,
    /// The generation it was cloned from; `None` when cold or a fallback.
    pub parent: Option<Generation>,
    /// False for a fallback: an empty directory after a failed clone,
    /// never committed.
    pub committable: bool,
    /// How it was cloned; `None` when cold or a fallback.
    pub method: Option<CloneMethod>,
}

/// What a commit did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Committed {
    /// The mount's contents are the key's new head.
    Published(Generation),
    /// The key's head moved since the mount was cloned (from `parent`; it
    /// is `head` now) and the policy is [`Policy::Cas`]: nothing was
    /// published and the mount is discarded.
    Conflict {
        /// What the mount was cloned from.
        parent: Option<Generation>,
        /// The key's head when it committed.
        head: Option<Generation>,
    },
    /// A fallback mount: discarded, never published.
    NotCommittable,
}

/// What settling a mount at the end of its job did ([`Store::settle`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// The job succeeded, so the mount was committed.
    Committed(Committed),
    /// The job did not succeed: the mount was discarded.
    Discarded,
}

/// The eviction rules.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Eviction {
    /// A sticky disk's head generation, or an Actions cache archive, not
    /// used for this long goes (spec/cache.md §4.2: 168 h).
    pub retention: Duration,
    /// A Docker image store's head generation (a key under
    /// [`super::RESERVED_PREFIX`]) not used for this long goes, whatever
    /// [`Eviction::retention`] is (spec/cache.md §1.2, §4.2: 192 h).
    pub image_store_retention: Duration,
    /// The most bytes the generations and the archives together may hold;
    /// the least recently used go first until they fit. `None`: no bound.
    pub budget_bytes: Option<u64>,
}

/// The default [`Eviction::retention`]: 168 hours.
pub(crate) const DEFAULT_RETENTION: Duration = Duration::from_secs(168 * 3600);
/// The default [`Eviction::image_store_retention`]: 192 hours (8 days).
pub(crate) const DEFAULT_IMAGE_STORE_RETENTION: Duration = Duration::from_secs(192 * 3600);

impl Default for Eviction {
    fn default() -> Self {
        Self {
            retention: DEFAULT_RETENTION,
            image_store_retention: DEFAULT_IMAGE_STORE_RETENTION,
            budget_bytes: None,
        }
    }
}

impl Eviction {
    /// How long a head generation of `key` is kept after its last use:
    /// [`Eviction::image_store_retention`] for a Docker image store,
    /// [`Eviction::retention`] for every other key.
    #[must_use]
    pub(crate) fn retention_of(&self, key: &str) -> Duration {
        if key.starts_with(super::RESERVED_PREFIX) {
            self.image_store_retention
        } else {
            self.retention
        }
    }
}

/// What an eviction pass removed and kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EvictReport {
    /// (key, generation) removed.
    pub removed: Vec<(String, Generation)>,
    /// Actions cache archives removed: each entry's directory, as it was.
    pub archives_removed: Vec<PathBuf>,
    /// Bytes the generations and archives removed held on the disk
    /// (allocated blocks).
    pub freed_bytes: u64,
    /// Generations kept because a mount was cloned from them; each had its
    /// last use renewed to the pass's time.
    pub kept_mounted: usize,
    /// Archives kept because a live session is reading them (a download
    /// link of it exists).
    pub kept_in_use: usize,
    /// Victims the walk chose that were kept when their removal looked
    /// again under the lock: mounted, read or used since the walk.
    pub kept_used_since: usize,
    /// Bytes the generations and archives kept hold on the disk after the
    /// pass (allocated blocks).
    pub kept_bytes: u64,
}

/// One generation as an eviction pass's walk found it, read without the
/// store's lock (`Store::survey`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GenerationUse {
    /// Its key.
    pub key: String,
    /// The generation.
    pub generation: Generation,
    /// Whether it was its key's head.
    pub head: bool,
    /// Its last use, in Unix milliseconds.
    pub used_unix_ms: i64,
    /// The bytes its tree holds on the disk (allocated blocks).
    pub bytes: u64,
    /// Whether an open mount was cloned from it when the pass began.
    pub mounted: bool,
}

/// Called by an eviction pass's walk before it reads each generation's
/// size, on the blocking thread that walks; a test's seam to pause a walk.
pub(crate) type WalkSeam = Arc<dyn Fn() + Send + Sync>;

/// One generation's provenance.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct GenerationMeta {
    published_unix_ms: i64,
    used_unix_ms: i64,
    /// The mount it was committed from (absent in a state written before
    /// it was kept): a commit retried after a node restart that cut off
    /// the first one's answer is told what the first one published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    mount: Option<String>,
}

/// A key's `state.json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct KeyState {
    deployment: String,
    key: String,
    head: Option<u64>,
    next: u64,
    generations: BTreeMap<u64, GenerationMeta>,
}

/// What the cache did for one lease's job, as the store counts it: each
/// disk mounted is a hit, a miss or a fallback; each commit that published
/// adds its bytes, each CAS commit refused is a conflict. Sizes are
/// apparent sizes of regular files (holes count), in bytes. Counted in
/// memory only: a node restarted mid-job counts from then on.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Observation {
    /// Disks mounted from a published generation of their key.
    pub hits: u64,
    /// Disks mounted cold: their key had no generation yet.
    pub misses: u64,
    /// Bytes cloned into the job's mounts from the generations they hit.
    pub bytes_restored: u64,
    /// Bytes published as new generations from the job's mounts.
    pub bytes_committed: u64,
    /// Commits refused because another job had committed the key since
    /// this one mounted it ([`Policy::Cas`]).
    pub conflicts: u64,
    /// Disks the job got as a fallback: an empty directory, never
    /// committed (a state, journal or clone failure at the mount).
    pub fallbacks: u64,
}

impl Observation {
    fn add(&mut self, other: &Self) {
        self.hits += other.hits;
        self.misses += other.misses;
        self.bytes_restored += other.bytes_restored;
        self.bytes_committed += other.bytes_committed;
        self.conflicts += other.conflicts;
        self.fallbacks += other.fallbacks;
    }
}

/// [`Observation`]s by lease, and their sum since the store opened.
#[derive(Debug, Default)]
struct Observed {
    leases: std::collections::HashMap<String, Observation>,
    totals: Observation,
}

/// The sticky-disk store of one deployment in one directory. One per
/// directory: [`Store::open`] holds an exclusive `flock` on its lock file.
/// Operations are serialised by one lock; their file work runs on tokio's
/// blocking pool.
#[derive(Debug)]
pub struct Store {
    dirs: Arc<Dirs>,
    journal: Arc<dyn MountJournal>,
    reflink: Arc<ReflinkSupport>,
    mounts: tokio::sync::Mutex<BTreeMap<String, MountRecord>>,
    observed: std::sync::Mutex<Observed>,
    evicted: std::sync::Mutex<Evicted>,
    filesystem: Filesystem,
    _lock: fs::File,
}

#[derive(Debug)]
struct Dirs {
    root: PathBuf,
    deployment: String,
}

impl Dirs {
    fn key_dir(&self, key: &str) -> PathBuf {
        let mut hash = Sha256::new();
        hash.update(self.deployment.as_bytes());
        hash.update([0]);
        hash.update(key.as_bytes());
        let digest = hash.finalize();
        let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
        self.root.join("keys").join(hex)
    }

    fn mount_dir(&self, id: &str) -> PathBuf {
        self.root.join("mounts").join(id)
    }

    fn generation_dir(&self, key: &str, g: u64) -> PathBuf {
        self.key_dir(key).join("g").join(g.to_string())
    }

    fn read_state(&self, key: &str) -> Result<KeyState, CacheError> {
        let path = self.key_dir(key).join(STATE_FILE);
        match fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| CacheError::Io {
                op: "parse",
                path,
                source: std::io::Error::new(std::io::ErrorKind::InvalidData, e),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(KeyState {
                deployment: self.deployment.clone(),
                key: key.to_owned(),
                head: None,
                next: 1,
                generations: BTreeMap::new(),
            }),
            Err(e) => Err(io("read", &path)(e)),
        }
    }

    /// Replaces a key's state: written aside, synced, renamed into place,
    /// the directory synced; the old state stands until the rename.
    fn write_state(&self, state: &KeyState) -> Result<(), CacheError> {
        let dir = self.key_dir(&state.key);
        fs::create_dir_all(dir.join("g")).map_err(io("create", &dir))?;
        let temp = dir.join(STATE_TEMP);
        let bytes = serde_json::to_vec_pretty(state).expect("state serialises");
        let mut file = fs::File::create(&temp).map_err(io("create", &temp))?;
        file.write_all(&bytes).map_err(io("write", &temp))?;
        file.sync_all().map_err(io("sync", &temp))?;
        let path = dir.join(STATE_FILE);
        fs::rename(&temp, &path).map_err(io("rename", &temp))?;
        fs::File::open(&dir)
            .and_then(|d| d.sync_all())
            .map_err(io("sync", &dir))
    }

    /// Moves `path` (if it exists) to the trash and removes it there.
    fn remove(&self, path: &Path) -> Result<(), CacheError> {
        match self.to_trash(path)? {
            Some(trash) => fs::remove_dir_all(&trash).map_err(io("remove", &trash)),
            None => Ok(()),
        }
    }

    /// Moves `path` to the trash (one `rename`: what a crash leaves there
    /// goes when the store opens); where it is now, `None` when there was
    /// nothing at `path`.
    fn to_trash(&self, path: &Path) -> Result<Option<PathBuf>, CacheError> {
        let trash = self
            .root
            .join("trash")
            .join(uuid::Uuid::new_v4().simple().to_string());
        match fs::rename(path, &trash) {
            Ok(()) => Ok(Some(trash)),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(io("move to the trash", path)(e)),
        }
    }

    /// Every key state in the store.
    fn states(&self) -> Result<Vec<KeyState>, CacheError> {
        let keys = self.root.join("keys");
        let mut states = Vec::new();
        for entry in fs::read_dir(&keys).map_err(io("read", &keys))? {
            let path = entry.map_err(io("read", &keys))?.path().join(STATE_FILE);
            match fs::read(&path) {
                Ok(bytes) => match serde_json::from_slice::<KeyState>(&bytes) {
                    Ok(state) if state.deployment == self.deployment => states.push(state),
                    Ok(_) => {}
                    Err(e) => {
                        warn!(file = %path.display(), error = %e, "an unreadable sticky-disk state is left alone")
                    }
                },
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io("read", &path)(e)),
            }
        }
        Ok(states)
    }
}

fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, CacheError> + Send + 'static,
) -> Result<T, CacheError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|e| std::panic::resume_unwind(e.into_panic()))
}

impl Store {
    /// Opens (creating it, mode 0700) the store of `deployment` in `root`
    /// and takes its lock; loads the journal's mounts; removes what a
    /// crash left: the trash, mount directories the journal does not name,
    /// generation directories no state names. Finds out whether its file
    /// system shares extents ([`super::clone::probe`]): see
    /// [`Store::filesystem`].
    ///
    /// # Errors
    ///
    /// [`CacheError::Open`] when the directory cannot be made, written or
    /// locked (another node uses it), [`CacheError::Journal`] when the
    /// mounts cannot be read.
    pub async fn open(
        root: &Path,
        deployment: &str,
        journal: Arc<dyn MountJournal>,
    ) -> Result<Self, CacheError> {
        let records = journal.mounts().await?;
        let dirs = Arc::new(Dirs {
            root: root.to_owned(),
            deployment: deployment.to_owned(),
        });
        let d = dirs.clone();
        let named: BTreeSet<String> = records.iter().map(|r| r.mount.clone()).collect();
        let reflink = Arc::new(ReflinkSupport::default());
        let support = reflink.clone();
        let (lock, filesystem) = blocking(move || {
            let lock = open_dirs(&d, &named)?;
            let filesystem =
                probe(&d.root.join("trash"), &support).map_err(|e| CacheError::Open {
                    path: d.root.clone(),
                    message: format!(
                        "cannot write a file in it: {e}; give the node a writable --cache-dir"
                    ),
                })?;
            Ok((lock, filesystem))
        })
        .await?;
        Ok(Self {
            dirs,
            journal,
            reflink,
            mounts: tokio::sync::Mutex::new(
                records.into_iter().map(|r| (r.mount.clone(), r)).collect(),
            ),
            observed: std::sync::Mutex::new(Observed::default()),
            evicted: std::sync::Mutex::new(Evicted::default()),
            filesystem,
            _lock: lock,
        })
    }

    /// Whether this store's filesystem shares extents: found out when it
    /// opened, and learnt again should a clone be refused later.
    #[cfg(test)]
    pub(crate) fn reflinks(&self) -> Option<bool> {
        self.reflink.known()
    }

    /// The cache directory's file system as the store found it when it
    /// opened: its kind and whether mounts are reflinks (O(files)) or
    /// copies (O(bytes)).
    #[must_use]
    pub fn filesystem(&self) -> &Filesystem {
        &self.filesystem
    }

    /// What eviction has removed since the store opened, for the node's
    /// metrics.
    #[must_use]
    pub(crate) fn evicted(&self) -> Evicted {
        *self.evicted.lock().expect("cache evictions")
    }

    /// The head generation of `key`; `None` when it has none.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] when its state cannot be read.
    pub async fn head(&self, key: &DiskKey) -> Result<Option<Generation>, CacheError> {
        let _held = self.mounts.lock().await;
        let dirs = self.dirs.clone();
        let key = key.as_str().to_owned();
        blocking(move || Ok(dirs.read_state(&key)?.head.map(Generation))).await
    }

    /// The directory of generation `g` of `key` (whether or not it exists).
    pub fn generation_dir(&self, key: &DiskKey, g: Generation) -> PathBuf {
        self.dirs.generation_dir(key.as_str(), g.0)
    }

    /// The open mounts, as journaled.
    pub async fn mounts(&self) -> Vec<MountRecord> {
        self.mounts.lock().await.values().cloned().collect()
    }

    /// Makes a mount of `key` for `lease`'s job: a clone of the key's head
    /// generation, an empty committable directory when the key has none,
    /// or an empty directory that is never committed when the clone (or
    /// its journal record) fails.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] only when not even an empty directory can be
    /// made; the job then goes on without this disk.
    pub async fn mount(
        &self,
        lease: &LeaseId,
        key: &DiskKey,
        policy: Policy,
    ) -> Result<Mount, CacheError> {
        let mut mounts = self.mounts.lock().await;
        let id = format!("{}-{}", lease.as_str(), uuid::Uuid::new_v4().simple());
        let dirs = self.dirs.clone();
        let k = key.as_str().to_owned();
        let head = blocking(move || dirs.read_state(&k)).await.map(|s| s.head);
        let mut record = MountRecord {
            mount: id.clone(),
            lease: lease.as_str().to_owned(),
            key: key.as_str().to_owned(),
            parent: head.as_ref().ok().copied().flatten(),
            policy: policy.as_str().to_owned(),
            committable: head.is_ok(),
            succeeded: false,
            since_unix_ms: now_unix_ms(),
        };
        if let Err(e) = &head {
            warn!(%lease, %key, error = %e, "the sticky disk's state cannot be read; the job gets an empty directory and nothing is published from it");
        }
        // The intent first: a node killed while cloning finds the mount in
        // its journal and discards it.
        if let Err(e) = self.journal.put_mount(&record).await {
            warn!(%lease, %key, error = %e, "cannot journal the sticky disk's mount; the job gets an empty directory and nothing is published from it");
            // A fallback, cloned from nothing.
            record.committable = false;
            record.parent = None;
        }
        let dirs = self.dirs.clone();
        let support = self.reflink.clone();
        let parent = record.parent;
        let (k, mid) = (key.as_str().to_owned(), id.clone());
        let cloned = blocking(move || {
            let dir = dirs.mount_dir(&mid);
            let Some(g) = parent else {
                fs::create_dir(&dir).map_err(io("create", &dir))?;
                return Ok(None);
            };
            let made = clone_tree(&dirs.generation_dir(&k, g), &dir, &support)
                .map_err(io("clone into", &dir));
            if made.is_err() {
                let _ = dirs.remove(&dir);
            }
            let made = made?;
            let mut state = dirs.read_state(&k)?;
            if let Some(meta) = state.generations.get_mut(&g) {
                meta.used_unix_ms = now_unix_ms();
                dirs.write_state(&state)?;
            }
            Ok(Some(made))
        })
        .await;
        let mut restored = 0;
        let method = match cloned {
            Ok(made) => {
                restored = made.as_ref().map_or(0, |m| m.bytes);
                made.map(|m| m.method)
            }
            Err(e) if record.parent.is_some() && record.committable => {
                warn!(%lease, %key, parent = record.parent, error = %e, "cannot clone the sticky disk; the job gets an empty directory and nothing is published from it");
                record.committable = false;
                // Cloned from nothing: the guest's listing says so
                // (`generation` null beside `fallback`).
                record.parent = None;
                let dirs = self.dirs.clone();
                let mid = id.clone();
                let made = blocking(move || {
                    let dir = dirs.mount_dir(&mid);
                    let _ = dirs.remove(&dir);
                    fs::create_dir(&dir).map_err(io("create", &dir))
                })
                .await;
                if let Err(e) = made {
                    let _ = self.journal.forget_mount(&id).await;
                    return Err(e);
                }
                if let Err(e) = self.journal.put_mount(&record).await {
                    warn!(%lease, %key, error = %e, "cannot journal that the sticky disk is a fallback");
                }
                None
            }
            Err(e) => {
                let _ = self.journal.forget_mount(&id).await;
                return Err(e);
            }
        };
        let mount = Mount {
            id: id.clone(),
            dir: self.dirs.mount_dir(&id),
            parent: record.parent.map(Generation),
            committable: record.committable,
            method,
        };
        info!(%lease, %key, mount = %id, parent = mount.parent.map(|g| g.0), committable = mount.committable, ?method, "sticky disk mounted");
        self.observe(
            lease.as_str(),
            &if !mount.committable {
                Observation {
                    fallbacks: 1,
                    ..Observation::default()
                }
            } else if mount.parent.is_some() {
                Observation {
                    hits: 1,
                    bytes_restored: restored,
                    ..Observation::default()
                }
            } else {
                Observation {
                    misses: 1,
                    ..Observation::default()
                }
            },
        );
        mounts.insert(id, record);
        Ok(mount)
    }

    /// Records that `lease`'s job ended with GitHub's result `succeeded`,
    /// so settling its mounts commits them. Journaled. A Docker image
    /// store's mount (key under [`super::RESERVED_PREFIX`]) is not marked:
    /// it publishes only once its guest said it is ready
    /// ([`Store::mark_mount_succeeded`], spec/cache.md §3.3).
    ///
    /// # Errors
    ///
    /// [`CacheError::Journal`]: the mark is then kept in memory only.
    pub(crate) async fn mark_succeeded(&self, lease: &LeaseId) -> Result<(), CacheError> {
        let mut mounts = self.mounts.lock().await;
        let image_store = |r: &MountRecord| r.key.starts_with(super::RESERVED_PREFIX);
        for record in mounts
            .values_mut()
            .filter(|r| r.lease == lease.as_str() && !image_store(r))
        {
            if !record.succeeded {
                record.succeeded = true;
                self.journal.put_mount(record).await?;
            }
        }
        Ok(())
    }

    /// Marks one mount to be committed when its lease's mounts are
    /// settled: the Docker image store's, once its settlement found the
    /// tier trusted, GitHub's result `succeeded` and the guest ready.
    /// Journaled.
    ///
    /// # Errors
    ///
    /// [`CacheError::UnknownMount`]; [`CacheError::Journal`]: not marked.
    pub(crate) async fn mark_mount_succeeded(&self, mount: &str) -> Result<(), CacheError> {
        let mut mounts = self.mounts.lock().await;
        let record = mounts
            .get_mut(mount)
            .ok_or_else(|| CacheError::UnknownMount(mount.to_owned()))?;
        if !record.succeeded {
            // Marked only once journaled: a mark a restart would forget
            // must not publish now either.
            let marked = MountRecord {
                succeeded: true,
                ..record.clone()
            };
            self.journal.put_mount(&marked).await?;
            *record = marked;
        }
        Ok(())
    }

    /// Settles every mount of `lease`, whose compute is proven gone:
    /// commits the mounts of a job marked succeeded
    /// ([`Store::mark_succeeded`]) and discards the others.
    pub(crate) async fn settle(
        &self,
        lease: &LeaseId,
    ) -> Vec<(String, Result<Settled, CacheError>)> {
        let ids: Vec<(String, bool)> = self
            .mounts
            .lock()
            .await
            .values()
            .filter(|r| r.lease == lease.as_str())
            .map(|r| (r.mount.clone(), r.succeeded))
            .collect();
        let mut settled = Vec::new();
        for (id, succeeded) in ids {
            let outcome = if succeeded {
                self.commit(&id).await.map(Settled::Committed)
            } else {
                self.discard(&id).await.map(|()| Settled::Discarded)
            };
            match &outcome {
                Ok(s) => info!(%lease, mount = %id, outcome = ?s, "sticky disk settled"),
                Err(e) => {
                    warn!(%lease, mount = %id, error = %e, "sticky disk not settled; discarding it")
                }
            }
            settled.push((id, outcome));
        }
        settled
    }

    /// Commits a mount: its contents become the key's next generation when
    /// the key's head is still the generation it was cloned from, or
    /// whatever the head is under [`Policy::LastWriterWins`]. A conflict
    /// and a fallback mount are discarded. The mount is gone afterwards,
    /// whatever the outcome.
    ///
    /// # Errors
    ///
    /// [`CacheError::UnknownMount`]; [`CacheError::Io`] when the commit
    /// failed midway: the key's head is still the previous generation,
    /// whole, and what the commit had made is removed.
    pub async fn commit(&self, mount: &str) -> Result<Committed, CacheError> {
        let mut mounts = self.mounts.lock().await;
        let record = mounts
            .get(mount)
            .cloned()
            .ok_or_else(|| CacheError::UnknownMount(mount.to_owned()))?;
        let policy = Policy::parse(&record.policy).unwrap_or_default();
        let dirs = self.dirs.clone();
        let r = record.clone();
        let outcome = blocking(move || {
            let dir = dirs.mount_dir(&r.mount);
            let bytes = if r.committable {
                apparent_bytes(&dir).map_err(io("measure", &dir))?
            } else {
                0
            };
            commit_blocking(&dirs, &r, policy, &dir, true).map(|c| (c, bytes))
        })
        .await;
        self.observe_commit(&record.lease, &outcome);
        let outcome = outcome.map(|(c, _)| c);
        if let Err(e) = &outcome {
            warn!(mount, error = %e, "the sticky disk's commit failed; its key keeps its head");
            let dirs = self.dirs.clone();
            let id = mount.to_owned();
            blocking(move || dirs.remove(&dirs.mount_dir(&id))).await?;
        }
        self.journal.forget_mount(mount).await?;
        mounts.remove(mount);
        match &outcome {
            Ok(Committed::Published(g)) => {
                info!(mount, key = %record.key, parent = record.parent, generation = %g, "sticky disk committed")
            }
            Ok(Committed::Conflict { parent, head }) => {
                warn!(mount, key = %record.key, parent = parent.map(|g| g.0), head = head.map(|g| g.0), "sticky disk not committed: another job committed its key since this one mounted it")
            }
            Ok(Committed::NotCommittable) | Err(_) => {}
        }
        outcome
    }

    /// Adds `seen` to `lease`'s observation and to the totals.
    fn observe(&self, lease: &str, seen: &Observation) {
        let mut observed = self.observed.lock().expect("cache observations");
        observed
            .leases
            .entry(lease.to_owned())
            .or_default()
            .add(seen);
        observed.totals.add(seen);
    }

    /// Counts a commit's outcome (with the bytes it would publish).
    fn observe_commit(&self, lease: &str, outcome: &Result<(Committed, u64), CacheError>) {
        match outcome {
            Ok((Committed::Published(_), bytes)) => self.observe(
                lease,
                &Observation {
                    bytes_committed: *bytes,
                    ..Observation::default()
                },
            ),
            Ok((Committed::Conflict { .. }, _)) => self.observe(
                lease,
                &Observation {
                    conflicts: 1,
                    ..Observation::default()
                },
            ),
            Ok((Committed::NotCommittable, _)) | Err(_) => {}
        }
    }

    /// What the cache did for `lease`'s job so far, forgotten here: called
    /// once its disks are settled ([`Store::settle`]). `None` when it
    /// mounted nothing since the store opened.
    pub(crate) fn take_observation(&self, lease: &LeaseId) -> Option<Observation> {
        self.observed
            .lock()
            .expect("cache observations")
            .leases
            .remove(lease.as_str())
    }

    /// The sum of every job's [`Observation`] since the store opened, for
    /// the node's metrics.
    #[must_use]
    pub(crate) fn totals(&self) -> Observation {
        self.observed.lock().expect("cache observations").totals
    }

    /// The cache directory.
    #[must_use]
    pub fn dir(&self) -> &Path {
        &self.dirs.root
    }

    /// The journal the store writes its mounts to.
    #[must_use]
    pub(crate) fn journal(&self) -> Arc<dyn MountJournal> {
        self.journal.clone()
    }

    /// The journaled record of an open mount.
    #[cfg(test)]
    pub(crate) async fn record(&self, mount: &str) -> Option<MountRecord> {
        self.mounts.lock().await.get(mount).cloned()
    }

    /// Commits a mount its guest still has bound, on the guest's request
    /// (the guest API, [`super::session`]): its tree is cloned aside and
    /// the clone, not the mount, becomes the key's next generation under
    /// the mount's policy, so nothing the guest writes afterwards reaches
    /// a generation. Whatever the outcome, the mount is withdrawn
    /// ([`Store::withdraw`]): its end discards it and never commits it
    /// again.
    ///
    /// # Errors
    ///
    /// [`CacheError::UnknownMount`]; [`CacheError::Io`] when the clone or
    /// the commit failed: the key keeps its head.
    pub async fn commit_now(&self, mount: &str) -> Result<Committed, CacheError> {
        // Withdrawn first, under the store's lock, so this is the mount's
        // one commit: a second request, or the job's end, finds it not
        // committable. The clone, O(bytes) without reflinks, then runs
        // without the lock (under it, a 4 GiB commit would hold every other
        // mount, so every launch, and the node's command slot behind it, for
        // 13 s); only the check of the head and the publication (a rename)
        // take it again.
        let (record, policy) = {
            let mut mounts = self.mounts.lock().await;
            let entry = mounts
                .get_mut(mount)
                .ok_or_else(|| CacheError::UnknownMount(mount.to_owned()))?;
            let record = entry.clone();
            if entry.committable {
                entry.committable = false;
                if let Err(e) = self.journal.put_mount(entry).await {
                    warn!(mount, error = %e, "cannot journal that the sticky disk was settled by its guest");
                }
            }
            let policy = Policy::parse(&record.policy).unwrap_or_default();
            (record, policy)
        };
        let dirs = self.dirs.clone();
        let support = self.reflink.clone();
        let r = record.clone();
        let staging = dirs.mount_dir(&format!("{}.commit", r.mount));
        let cloned = {
            let (dirs, staging) = (dirs.clone(), staging.clone());
            blocking(move || {
                if !r.committable {
                    // Withdrawn already: a fallback, or a commit that began
                    // before and whose answer a node restart cut off. What
                    // that one published, if anything, is its answer.
                    let state = dirs.read_state(&r.key)?;
                    let published = state.generations.iter().find_map(|(g, meta)| {
                        (meta.mount.as_deref() == Some(r.mount.as_str())).then_some(*g)
                    });
                    return Ok(published.map(|g| Err(Committed::Published(Generation(g)))));
                }
                let state = dirs.read_state(&r.key)?;
                if state.head != r.parent && policy == Policy::Cas {
                    return Ok(Some(Err(Committed::Conflict {
                        parent: r.parent.map(Generation),
                        head: state.head.map(Generation),
                    })));
                }
                let _ = dirs.remove(&staging);
                let made =
                    clone_tree(&dirs.mount_dir(&r.mount), &staging, &support).and_then(|made| {
                        // What the guest wrote reaches the disk before any
                        // state names it, and outside the lock.
                        let handle = fs::File::open(&staging)?;
                        rustix::fs::syncfs(&handle)?;
                        Ok(made)
                    });
                match made {
                    Ok(made) => Ok(Some(Ok(made.bytes))),
                    Err(e) => {
                        let _ = dirs.remove(&staging);
                        Err(io("clone into", &staging)(e))
                    }
                }
            })
            .await
        };
        let outcome = match cloned {
            Ok(None) => Ok((Committed::NotCommittable, 0)),
            // Answered without a clone: a conflict, or what an earlier
            // commit of this mount published.
            Ok(Some(Err(answer))) => Ok((answer, 0)),
            Err(e) => Err(e),
            Ok(Some(Ok(bytes))) => {
                let _mounts = self.mounts.lock().await;
                let r = record.clone();
                let staging = staging.clone();
                blocking(move || {
                    let outcome = commit_blocking(&dirs, &r, policy, &staging, false);
                    if outcome.is_err() {
                        let _ = dirs.remove(&staging);
                    }
                    outcome.map(|c| (c, bytes))
                })
                .await
            }
        };
        self.observe_commit(&record.lease, &outcome);
        let outcome = outcome.map(|(c, _)| c);
        match &outcome {
            Ok(Committed::Published(g)) => {
                info!(mount, key = %record.key, parent = record.parent, generation = %g, "sticky disk committed at its guest's request")
            }
            Ok(Committed::Conflict { parent, head }) => {
                warn!(mount, key = %record.key, parent = parent.map(|g| g.0), head = head.map(|g| g.0), "sticky disk not committed: another job committed its key since this one mounted it")
            }
            Ok(Committed::NotCommittable) => {}
            Err(e) => {
                warn!(mount, error = %e, "the sticky disk's commit failed; its key keeps its head")
            }
        }
        outcome
    }

    /// Withdraws a mount from publication: it stays bound to its guest
    /// and its end discards it. Journaled.
    ///
    /// # Errors
    ///
    /// [`CacheError::UnknownMount`]; [`CacheError::Journal`]: withdrawn in
    /// memory only.
    pub(crate) async fn withdraw(&self, mount: &str) -> Result<(), CacheError> {
        let mut mounts = self.mounts.lock().await;
        let record = mounts
            .get_mut(mount)
            .ok_or_else(|| CacheError::UnknownMount(mount.to_owned()))?;
        if record.committable {
            record.committable = false;
            self.journal.put_mount(record).await?;
        }
        Ok(())
    }

    /// Discards a mount and its contents. Idempotent for a mount whose
    /// directory is gone.
    ///
    /// # Errors
    ///
    /// [`CacheError::UnknownMount`], [`CacheError::Io`],
    /// [`CacheError::Journal`].
    pub async fn discard(&self, mount: &str) -> Result<(), CacheError> {
        let mut mounts = self.mounts.lock().await;
        if !mounts.contains_key(mount) {
            return Err(CacheError::UnknownMount(mount.to_owned()));
        }
        let dirs = self.dirs.clone();
        let id = mount.to_owned();
        blocking(move || dirs.remove(&dirs.mount_dir(&id))).await?;
        self.journal.forget_mount(mount).await?;
        mounts.remove(mount);
        Ok(())
    }

    /// Discards the mounts of every lease `listed` proves has no compute
    /// (the reference's `ReconcileInventory`, spec/cache.md §3.2): what a
    /// restarted node's journal names for compute it no longer has, and a
    /// mount whose settling failed earlier (the reference's `RetryClosed`:
    /// tried again at each inventory until it goes). Only a successful
    /// inventory makes a [`Listed`]; see [`super::lifecycle::Inventory`].
    /// Returns how many mounts were discarded.
    pub(crate) async fn reconcile(&self, listed: &Listed) -> usize {
        let stale: Vec<String> = self
            .mounts
            .lock()
            .await
            .values()
            .filter(|r| !listed.may_run(&r.lease))
            .map(|r| r.mount.clone())
            .collect();
        let mut discarded = 0;
        for id in stale {
            match self.discard(&id).await {
                Ok(()) => {
                    info!(mount = %id, "discarded the sticky disk of a lease whose compute is gone");
                    discarded += 1;
                }
                Err(e) => {
                    warn!(mount = %id, error = %e, "cannot discard the sticky disk of a lease whose compute is gone; the next inventory tries again")
                }
            }
        }
        discarded
    }

    /// One eviction pass over the sticky disks' generations alone, by
    /// `rules` at `now_unix_ms`: [`super::lifecycle::evict`] without
    /// Actions cache archives. Never removes a generation an open mount
    /// was cloned from.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] when the store cannot be read or a generation
    /// removed; what was removed before stays removed.
    pub async fn evict(
        &self,
        rules: Eviction,
        now_unix_ms: i64,
    ) -> Result<EvictReport, CacheError> {
        super::lifecycle::evict(self, None, rules, now_unix_ms).await
    }

    /// An eviction pass's first step, under the store's lock (the
    /// reference's `RenewActive`): every generation an open mount was
    /// cloned from is used now, however long ago its job mounted it, so
    /// its retention counts from `now_unix_ms`. Returns those generations
    /// as (key, number). Writes only the states of mounted keys.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] when a state cannot be read or written.
    pub(crate) async fn renew_mounted(
        &self,
        now_unix_ms: i64,
    ) -> Result<BTreeSet<(String, u64)>, CacheError> {
        let mounts = self.mounts.lock().await;
        let pinned: BTreeSet<(String, u64)> = mounts
            .values()
            .filter_map(|r| r.parent.map(|g| (r.key.clone(), g)))
            .collect();
        let dirs = self.dirs.clone();
        let renew = pinned.clone();
        blocking(move || {
            let keys: BTreeSet<&String> = renew.iter().map(|(k, _)| k).collect();
            for key in keys {
                let mut state = dirs.read_state(key)?;
                let mut renewed = false;
                for (g, meta) in &mut state.generations {
                    if renew.contains(&(key.clone(), *g)) && meta.used_unix_ms < now_unix_ms {
                        meta.used_unix_ms = now_unix_ms;
                        renewed = true;
                    }
                }
                if renewed {
                    dirs.write_state(&state)?;
                }
            }
            Ok(())
        })
        .await?;
        drop(mounts);
        Ok(pinned)
    }

    /// An eviction pass's walk, **without the store's lock**: every
    /// generation of every key, with its last use and the bytes its tree
    /// holds (O(files in the cache), metadata only), `mounted` when it is
    /// in `pinned`. Mounts and commits go on meanwhile: a state is
    /// replaced by one `rename`, so the walk reads each whole, old or new,
    /// and generation trees are never written. `seam` is called before
    /// each generation's size is read.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] when the keys cannot be listed.
    pub(crate) async fn survey(
        &self,
        pinned: &BTreeSet<(String, u64)>,
        seam: Option<WalkSeam>,
    ) -> Result<Vec<GenerationUse>, CacheError> {
        let dirs = self.dirs.clone();
        let pinned = pinned.clone();
        blocking(move || {
            let mut found = Vec::new();
            for state in dirs.states()? {
                for (g, meta) in &state.generations {
                    if let Some(seam) = &seam {
                        seam();
                    }
                    found.push(GenerationUse {
                        key: state.key.clone(),
                        generation: Generation(*g),
                        head: state.head == Some(*g),
                        used_unix_ms: meta.used_unix_ms,
                        bytes: tree_bytes(&dirs.generation_dir(&state.key, *g)).unwrap_or(0),
                        mounted: pinned.contains(&(state.key.clone(), *g)),
                    });
                }
            }
            Ok(found)
        })
        .await
    }

    /// Removes one generation an eviction pass chose from its walk, if it
    /// still may go: under the store's lock, its key's state is read again
    /// and the generation stays when it is gone already, when an open
    /// mount was cloned from it, or when it was used since the walk (its
    /// last use is not `seen.used_unix_ms`). Otherwise the state drops it
    /// first (so no state names a missing tree) and its tree is moved to
    /// the trash; the tree is removed from there after the lock is
    /// released. Returns whether it was removed.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] when the state cannot be read or written, or the
    /// tree moved or removed.
    pub(crate) async fn remove_generation(&self, seen: &GenerationUse) -> Result<bool, CacheError> {
        let mounts = self.mounts.lock().await;
        let g = seen.generation.0;
        if mounts
            .values()
            .any(|r| r.key == seen.key && r.parent == Some(g))
        {
            return Ok(false);
        }
        let dirs = self.dirs.clone();
        let (key, used) = (seen.key.clone(), seen.used_unix_ms);
        let trash = blocking(move || {
            let mut state = dirs.read_state(&key)?;
            match state.generations.get(&g) {
                Some(meta) if meta.used_unix_ms == used => {}
                _ => return Ok(None),
            }
            state.generations.remove(&g);
            if state.head == Some(g) {
                state.head = None;
            }
            dirs.write_state(&state)?;
            let trash = dirs.to_trash(&dirs.generation_dir(&key, g))?;
            Ok(Some(trash))
        })
        .await?;
        drop(mounts);
        let Some(trash) = trash else {
            return Ok(false);
        };
        if let Some(trash) = trash {
            blocking(move || fs::remove_dir_all(&trash).map_err(io("remove", &trash))).await?;
        }
        info!(key = %seen.key, generation = %seen.generation, bytes = seen.bytes, "sticky-disk generation evicted");
        self.evicted
            .lock()
            .expect("cache evictions")
            .add(1, seen.bytes);
        Ok(true)
    }

    /// Counts an Actions cache archive an eviction pass removed, for
    /// [`Store::evicted`].
    pub(crate) fn count_evicted_archive(&self, bytes: u64) {
        self.evicted
            .lock()
            .expect("cache evictions")
            .add_archive(bytes);
    }
}

/// Makes the store's directories, takes the lock, and removes what a
/// crash left behind.
fn open_dirs(dirs: &Dirs, named: &BTreeSet<String>) -> Result<fs::File, CacheError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let fail = |message: String| CacheError::Open {
        path: dirs.root.clone(),
        message,
    };
    fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dirs.root)
        .map_err(|e| {
            fail(format!(
                "cannot create it: {e}; give the node a writable --cache-dir"
            ))
        })?;
    let _ = fs::set_permissions(&dirs.root, fs::Permissions::from_mode(0o700));
    for sub in ["keys", "mounts", "trash"] {
        let path = dirs.root.join(sub);
        fs::create_dir_all(&path).map_err(|e| fail(format!("cannot create {sub}/: {e}")))?;
    }
    let lock = fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(dirs.root.join(STORE_LOCK))
        .map_err(|e| fail(format!("cannot open its lock file: {e}")))?;
    match crate::claim::take(&lock, crate::claim::PATIENCE) {
        Ok(true) => {}
        Ok(false) => {
            return Err(fail(
                "is in use by another process; give each node its own --cache-dir".to_owned(),
            ));
        }
        Err(e) => return Err(fail(format!("cannot lock it: {e}"))),
    }
    let trash = dirs.root.join("trash");
    for entry in fs::read_dir(&trash).map_err(io("read", &trash))? {
        let path = entry.map_err(io("read", &trash))?.path();
        let _ = fs::remove_dir_all(&path).or_else(|_| fs::remove_file(&path));
    }
    let mounts = dirs.root.join("mounts");
    for entry in fs::read_dir(&mounts).map_err(io("read", &mounts))? {
        let entry = entry.map_err(io("read", &mounts))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !named.contains(&name) {
            // Made and never journaled: no instance can have it bound.
            dirs.remove(&entry.path())?;
        }
    }
    for state in dirs.states()? {
        let g = dirs.key_dir(&state.key).join("g");
        let Ok(entries) = fs::read_dir(&g) else {
            continue;
        };
        for entry in entries {
            let entry = entry.map_err(io("read", &g))?;
            let known = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u64>().ok())
                .is_some_and(|n| state.generations.contains_key(&n));
            if !known {
                // A commit that did not finish.
                dirs.remove(&entry.path())?;
            }
        }
        let _ = fs::remove_file(dirs.key_dir(&state.key).join(STATE_TEMP));
    }
    Ok(lock)
}

fn commit_blocking(
    dirs: &Dirs,
    record: &MountRecord,
    policy: Policy,
    dir: &Path,
    sync: bool,
) -> Result<Committed, CacheError> {
    let dir = dir.to_owned();
    if !record.committable {
        dirs.remove(&dir)?;
        return Ok(Committed::NotCommittable);
    }
    let mut state = dirs.read_state(&record.key)?;
    if state.head != record.parent && policy == Policy::Cas {
        dirs.remove(&dir)?;
        return Ok(Committed::Conflict {
            parent: record.parent.map(Generation),
            head: state.head.map(Generation),
        });
    }
    // What the job wrote reaches the disk before any state names it (a
    // caller that synced it already says so: `sync` false).
    if sync {
        let handle = fs::File::open(&dir).map_err(io("open", &dir))?;
        rustix::fs::syncfs(&handle).map_err(|e| io("sync", &dir)(e.into()))?;
    }
    let g = state.next;
    let generation = dirs.generation_dir(&record.key, g);
    let parent = generation.parent().expect("a generation has a parent");
    fs::create_dir_all(parent).map_err(io("create", parent))?;
    fs::rename(&dir, &generation).map_err(io("rename into", &generation))?;
    let now = now_unix_ms();
    state.head = Some(g);
    state.next = g + 1;
    state.generations.insert(
        g,
        GenerationMeta {
            published_unix_ms: now,
            used_unix_ms: now,
            mount: Some(record.mount.clone()),
        },
    );
    if let Err(e) = dirs.write_state(&state) {
        // The old state stands: the head is the previous generation. The
        // half-made one goes.
        let _ = dirs.remove(&generation);
        return Err(e);
    }
    Ok(Committed::Published(Generation(g)))
}

#[cfg(test)]
mod tests;
