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
//!   ([`crate::node::journal::MountJournal`]).
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
pub mod store;

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

use thiserror::Error;

/// Most sticky disks one job may mount (the reference's
/// `provider.MaxVolumes`, spec/cache.md §1.1).
pub const MAX_STICKY_DISKS: usize = 5;

/// Longest sticky-disk key, in bytes (spec/cache.md §2.4).
pub const MAX_KEY_BYTES: usize = 512;

/// The key prefix the Docker image store reserves (spec/cache.md §2.4):
/// no sticky disk may claim it.
pub const RESERVED_PREFIX: &str = "docker-images/";

/// A sticky disk's key, within the node's deployment: non-empty, at most
/// [`MAX_KEY_BYTES`], no surrounding whitespace, no control character, not
/// under [`RESERVED_PREFIX`]. Used verbatim, so two repositories of one
/// deployment that use the same key share it (spec/cache.md §1.1: prefix
/// it with the repository).
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DiskKey(String);

/// Why a sticky disk a tier asks for is refused.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum DiskError {
    /// The key is empty.
    #[error("the key is empty; name the cache, e.g. \"<repository>-npm\"")]
    EmptyKey,
    /// The key is longer than [`MAX_KEY_BYTES`].
    #[error("the key is {0} bytes; at most {MAX_KEY_BYTES} are allowed")]
    LongKey(usize),
    /// The key has surrounding whitespace or a control character.
    #[error("the key {0:?} has surrounding whitespace or a control character; remove it")]
    KeyCharacters(String),
    /// The key claims the Docker image store's namespace.
    #[error("the key {0:?} starts with {RESERVED_PREFIX:?}, which the Docker image store reserves")]
    ReservedKey(String),
    /// The path is not absolute.
    #[error("the path {0:?} is not absolute; give the path inside the job, e.g. \"/cache/npm\"")]
    RelativePath(String),
    /// The path is `/`, or has `.`/`..` parts or a control character.
    #[error(
        "the path {0:?} is not a plain absolute directory; no \".\", \"..\" or control characters, and not \"/\""
    )]
    BadPath(String),
    /// The path is where the container runtime or billet mounts something
    /// itself: at or under `/proc`, `/dev`, `/sys` or the cache session's
    /// directory.
    #[error(
        "the path {0:?} is at or under {1}, which the container runtime or billet mounts itself; give the disk another path, e.g. \"/cache/npm\""
    )]
    ReservedPath(String, &'static str),
    /// Two disks of one job at one path.
    #[error("two sticky disks are mounted at {0:?}; give each its own path")]
    SamePath(String),
    /// More than [`MAX_STICKY_DISKS`].
    #[error("{0} sticky disks were asked for; a job may mount at most {MAX_STICKY_DISKS}")]
    TooMany(usize),
    /// Beside the Docker image store, which takes slot 0, more than
    /// [`MAX_STICKY_DISKS`] − 1.
    #[error(
        "{0} sticky disks were asked for beside the Docker image store, which takes one of the {MAX_STICKY_DISKS} slots; name at most {beside}",
        beside = MAX_STICKY_DISKS - 1
    )]
    TooManyBesideDockerStore(usize),
    /// A sticky disk where the Docker image store is bound.
    #[error(
        "a sticky disk at {0:?} would hide the Docker image store at {DOCKER_STORE_PATH}; give it another path"
    )]
    AtDockerStore(String),
}

impl DiskKey {
    /// Checks a key.
    ///
    /// # Errors
    ///
    /// [`DiskError::EmptyKey`], [`DiskError::LongKey`],
    /// [`DiskError::KeyCharacters`], [`DiskError::ReservedKey`].
    pub fn parse(key: &str) -> Result<Self, DiskError> {
        if key.is_empty() {
            return Err(DiskError::EmptyKey);
        }
        if key.len() > MAX_KEY_BYTES {
            return Err(DiskError::LongKey(key.len()));
        }
        if key.trim() != key || key.chars().any(char::is_control) {
            return Err(DiskError::KeyCharacters(key.to_owned()));
        }
        if key.starts_with(RESERVED_PREFIX) {
            return Err(DiskError::ReservedKey(key.to_owned()));
        }
        Ok(Self(key.to_owned()))
    }

    /// The Docker image store's key for `arch` (`docker-images/<arch>`),
    /// the one key under [`RESERVED_PREFIX`]; `None` for an architecture
    /// [`valid_architecture`] refuses.
    #[must_use]
    pub fn docker_images(arch: &str) -> Option<Self> {
        valid_architecture(arch).then(|| Self(format!("{RESERVED_PREFIX}{arch}")))
    }

    /// Whether this is a Docker image store's key.
    #[must_use]
    pub fn is_docker_images(&self) -> bool {
        self.0.starts_with(RESERVED_PREFIX)
    }

    /// The key.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Display for DiskKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

/// Longest sticky-disk path, in bytes.
pub const MAX_PATH_BYTES: usize = 4096;

/// Where no sticky disk may be bound, nor under: kernel file systems the
/// runtime mounts (runc refuses a bind over them at start) and the cache
/// session's own directory ([`session::GUEST_DIR`], bound beside the
/// disks; the engine refuses a second mount at one destination).
pub const RESERVED_PATHS: [&str; 4] = ["/proc", "/dev", "/sys", session::GUEST_DIR];

/// One sticky disk a tier asks for: the key's clone bound at `path`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StickyDisk {
    /// The cache's name.
    pub key: DiskKey,
    /// Where the job sees it: absolute, plain, not `/`, in its one
    /// spelling (no repeated or trailing `/`), outside [`RESERVED_PATHS`].
    pub path: String,
    /// What its commit does when the key moved.
    pub policy: Policy,
}

impl StickyDisk {
    /// Checks one disk.
    ///
    /// # Errors
    ///
    /// [`DiskKey::parse`]'s errors, [`DiskError::RelativePath`],
    /// [`DiskError::BadPath`], [`DiskError::ReservedPath`].
    pub fn new(key: &str, path: &str, policy: Policy) -> Result<Self, DiskError> {
        let key = DiskKey::parse(key)?;
        if !path.starts_with('/') {
            return Err(DiskError::RelativePath(path.to_owned()));
        }
        let plain = std::path::Path::new(path)
            .components()
            .skip(1)
            .all(|c| matches!(c, std::path::Component::Normal(_)));
        if path == "/"
            || !plain
            || path.len() > MAX_PATH_BYTES
            || path.contains("/./")
            || path.ends_with("/.")
            || path.chars().any(char::is_control)
        {
            return Err(DiskError::BadPath(path.to_owned()));
        }
        // One spelling per directory: the engine compares destinations
        // as given, and refuses `/c/npm` beside `/c//npm` at the create.
        let normal = std::path::Path::new(path)
            .components()
            .skip(1)
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .fold(String::new(), |acc, c| acc + "/" + &c);
        if let Some(reserved) = RESERVED_PATHS
            .iter()
            .find(|r| normal == **r || normal.starts_with(&format!("{r}/")))
        {
            return Err(DiskError::ReservedPath(path.to_owned(), reserved));
        }
        Ok(Self {
            key,
            path: normal,
            policy,
        })
    }
}

/// Checks a job's list of disks: at most [`MAX_STICKY_DISKS`], each at its
/// own path.
///
/// # Errors
///
/// [`DiskError::TooMany`], [`DiskError::SamePath`].
pub fn check_disks(disks: &[StickyDisk]) -> Result<(), DiskError> {
    if disks.len() > MAX_STICKY_DISKS {
        return Err(DiskError::TooMany(disks.len()));
    }
    for (i, disk) in disks.iter().enumerate() {
        let path = disk.path.trim_end_matches('/');
        if disks[..i]
            .iter()
            .any(|d| d.path.trim_end_matches('/') == path)
        {
            return Err(DiskError::SamePath(disk.path.clone()));
        }
    }
    Ok(())
}

/// Where the guest sees the Docker image store (spec/cache.md §1.2).
pub const DOCKER_STORE_PATH: &str = "/var/lib/docker";

/// Checks a tier's sticky disks beside its Docker image store, which takes
/// slot 0 of the [`MAX_STICKY_DISKS`] (the reference's `MaxVolumes`): at
/// most 4 disks, none at or under [`DOCKER_STORE_PATH`].
///
/// # Errors
///
/// [`DiskError::TooManyBesideDockerStore`], [`DiskError::AtDockerStore`].
pub fn check_beside_docker_store<'a>(
    count: usize,
    paths: impl IntoIterator<Item = &'a str>,
) -> Result<(), DiskError> {
    if count > MAX_STICKY_DISKS - 1 {
        return Err(DiskError::TooManyBesideDockerStore(count));
    }
    for path in paths {
        let p = path.trim_end_matches('/');
        if p == DOCKER_STORE_PATH || p.starts_with(&format!("{DOCKER_STORE_PATH}/")) {
            return Err(DiskError::AtDockerStore(path.to_owned()));
        }
    }
    Ok(())
}

/// The architecture the node's Docker image store is keyed by
/// (`docker-images/<arch>`, spec/cache.md §1.2), in Docker's names: the
/// node's own build target (the engine it drives runs on the same
/// machine), `x86_64` as `amd64` and `aarch64` as `arm64`
/// ([`docker_architecture_of`]).
#[must_use]
pub fn docker_architecture() -> &'static str {
    docker_architecture_of(std::env::consts::ARCH)
}

/// A machine name (`uname -m`, Rust's `ARCH`) in Docker's words: `x86_64`
/// and `amd64` are `amd64`, `aarch64` and `arm64` are `arm64`; any other is
/// kept as it is.
#[must_use]
pub fn docker_architecture_of(machine: &str) -> &str {
    match machine {
        "x86_64" | "amd64" => "amd64",
        "aarch64" | "arm64" => "arm64",
        other => other,
    }
}

/// Whether `arch` is an architecture a guest may name (spec/cache.md §2.4
/// `/v1/docker-store`): 1 to 64 characters, the first an ASCII letter or
/// digit, the rest letters, digits, `.`, `_` or `-`.
#[must_use]
pub fn valid_architecture(arch: &str) -> bool {
    let mut chars = arch.chars();
    arch.len() <= 64
        && chars.next().is_some_and(|c| c.is_ascii_alphanumeric())
        && chars.all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

/// How a commit treats a key whose head moved since the mount was cloned
/// (spec/cache.md §2.4, §4.2 "Publication policies").
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Policy {
    /// Compare-and-swap on the parent generation: the first commit after a
    /// generation wins, and a later one cloned from the same generation is
    /// rejected as a conflict and discarded (the default).
    #[default]
    Cas,
    /// The commit becomes the head whatever the head is now (the
    /// reference's `last-write-wins`, which its BuildKit state uses): the
    /// tier opts into losing the other job's commit.
    LastWriterWins,
}

impl Policy {
    /// Its name in the journal and in logs: `cas`, `last-writer-wins`.
    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Cas => "cas",
            Policy::LastWriterWins => "last-writer-wins",
        }
    }

    /// The policy named `name` ([`Policy::as_str`]).
    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "cas" => Some(Policy::Cas),
            "last-writer-wins" => Some(Policy::LastWriterWins),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_must_be_plain_bounded_and_outside_the_image_store() {
        assert_eq!(DiskKey::parse("repo-npm").unwrap().as_str(), "repo-npm");
        assert_eq!(DiskKey::parse(""), Err(DiskError::EmptyKey));
        assert_eq!(
            DiskKey::parse(&"k".repeat(513)),
            Err(DiskError::LongKey(513))
        );
        assert!(DiskKey::parse(&"k".repeat(512)).is_ok());
        for bad in [" npm", "npm ", "np\nm", "n\0pm"] {
            assert!(
                matches!(DiskKey::parse(bad), Err(DiskError::KeyCharacters(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            DiskKey::parse("docker-images/amd64"),
            Err(DiskError::ReservedKey(_))
        ));
    }

    /// spec/cache.md §7.1 scenario 9: an unusable architecture names no
    /// image store.
    #[test]
    fn the_image_store_is_keyed_by_a_plain_architecture_in_dockers_words() {
        assert_eq!(docker_architecture_of("x86_64"), "amd64");
        assert_eq!(docker_architecture_of("aarch64"), "arm64");
        assert_eq!(docker_architecture_of("riscv64"), "riscv64");
        let k = DiskKey::docker_images("amd64").unwrap();
        assert_eq!(k.as_str(), "docker-images/amd64");
        assert!(k.is_docker_images());
        assert!(!DiskKey::parse("npm").unwrap().is_docker_images());
        for bad in ["", "a/b", "amd64\n", "am d64", "-amd64", &"a".repeat(65)] {
            assert!(!valid_architecture(bad), "{bad:?}");
            assert_eq!(DiskKey::docker_images(bad), None, "{bad:?}");
        }
        assert!(valid_architecture("arm64.v8_x-1"));
    }

    #[test]
    fn beside_the_image_store_four_disks_fit_and_none_hides_it() {
        assert!(check_beside_docker_store(4, ["/a", "/var/lib/dockerx"]).is_ok());
        assert_eq!(
            check_beside_docker_store(5, ["/a"]),
            Err(DiskError::TooManyBesideDockerStore(5))
        );
        for at in [
            "/var/lib/docker",
            "/var/lib/docker/",
            "/var/lib/docker/volumes",
        ] {
            assert!(
                matches!(
                    check_beside_docker_store(1, [at]),
                    Err(DiskError::AtDockerStore(_))
                ),
                "{at}"
            );
        }
    }

    #[test]
    fn a_policy_is_named_in_both_directions() {
        for p in [Policy::Cas, Policy::LastWriterWins] {
            assert_eq!(Policy::parse(p.as_str()), Some(p));
        }
        assert_eq!(Policy::parse("last-write-wins"), None);
    }
}
