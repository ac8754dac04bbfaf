//! The Actions cache's archives on the node's disk and the operations the
//! proxy answers locally (spec/cache.md §2.5 "Twirp methods served
//! locally", "Blob upload", "Finalize", "Lookup", "Blob download").
//!
//! **Layout** under `<cache dir>/actions/`:
//!
//! - `entries/<scope>/<version>/<key>/` (each part a SHA-256 in hex: the
//!   scope of `owner␀repository␀workflow_ref`, the version, the key): a
//!   published archive, `archive` and `entry.json` (key, version, size,
//!   entry id, when it was published). Write-once: it appears by one
//!   `rename` of a finalized upload's directory, which fails when the
//!   directory exists, so two jobs finalizing one key publish one archive.
//!   The mtime of `entry.json` is its last use (a restore), for eviction.
//! - `uploads/<id>/`: a reservation's archive being uploaded (`archive`,
//!   `blocks/<sha256(block id)>`, temporary files `.tmp-*`).
//! - `downloads/<id>`: a hard link to the archive a lookup matched, so an
//!   entry evicted meanwhile is still served to the job that found it.
//! - `trash/`: entries being evicted (emptied when the node starts).
//!
//! **Eviction** ([`Archives::entries`], [`Archives::evict_entry`], run by
//! the cache's eviction pass, `cache::lifecycle::evict`): an entry's last
//! use is the mtime of its `entry.json` (its publication, then each lookup
//! that matched it). An entry is **in use** while a download link of it
//! exists, that is while a live session's lookup matched it: the link is
//! journaled with its session and lives until the session closes (a
//! restarted node keeps the links its journal names and removes the
//! others), so the archive's link count is the evidence, and a restart
//! agrees. An entry in use is never evicted (removing it would free
//! nothing while the link holds its blocks). An upload being written is
//! not an entry (it is its session's, under `uploads/`) and is never
//! evicted. An entry goes by one `rename` into `trash/` (its version
//! directory synced), so a crash leaves it published whole or gone.
//!
//! **Sessions.** Each intercepting guest session ([`ActionsSession`]) is
//! journaled (`MountJournal::put_actions_session`: the token's SHA-256,
//! the scope, its uploads, downloads and receipts) before any file of it
//! is made, and forgotten when its compute is proven gone, which also
//! removes its uploads and download links. A restarted node reads the
//! sessions back: a reservation, a download and a receipt survive it.
//!
//! **Keys** are scoped as the reference's store key (spec/cache.md §2.5):
//! the scope digest, then the version digest, then the key; neither the
//! scope nor the version crosses, and the token is in no key or URL.

use std::collections::{BTreeSet, HashMap};
use std::io::SeekFrom;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::body::{Bytes, Frame, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use tokio::io::{AsyncSeekExt as _, AsyncWriteExt as _};
use tracing::{info, warn};

use super::{ActionsPolicy, CacheScope, RESULTS_HOST};
use crate::cache::session::CacheToken;
use crate::journal::MountJournal;

/// Largest archive, in bytes (spec/cache.md §1.3: 10 GiB).
pub(crate) const MAX_ARCHIVE_BYTES: u64 = 10 << 30;
/// Most uploads, downloads and receipts one session holds at once.
pub(crate) const MAX_ARCHIVES_PER_SESSION: usize = 32;
/// Longest key, version or restore key, in bytes.
pub(crate) const MAX_FIELD_BYTES: usize = 512;
/// Most restore keys of one lookup.
pub(crate) const MAX_RESTORE_KEYS: usize = 9;
/// Longest Azure block id, in bytes.
pub(crate) const MAX_BLOCK_ID_BYTES: usize = 1024;
/// Longest block list, in bytes.
pub(crate) const MAX_BLOCK_LIST_BYTES: usize = 64 * 1024;
/// Most blocks in a block list.
pub(crate) const MAX_BLOCKS: usize = 10_000;
/// The path prefix of the signed upload and download URLs.
pub(crate) const BLOB_PREFIX: &str = "/_billet/actions-cache/";
/// The header every locally answered response carries.
pub(crate) const LOCAL_HEADER: &str = "x-billet-actions-cache";

/// The body of a locally answered blob response.
pub(crate) type Body = BoxBody<Bytes, std::io::Error>;

/// Why an Actions cache operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    /// A file or directory of the cache cannot be used.
    #[error("{op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The journal refused the session's record.
    #[error("cannot journal the Actions cache session: {0}")]
    Journal(#[from] crate::journal::JournalError),
    /// A request field is not acceptable.
    #[error("{0}")]
    Invalid(String),
    /// The session holds [`MAX_ARCHIVES_PER_SESSION`] archives.
    #[error("the session holds {MAX_ARCHIVES_PER_SESSION} archives already")]
    Full,
}

fn io(op: &'static str, path: &Path) -> impl FnOnce(std::io::Error) -> ArchiveError {
    let path = path.to_owned();
    move |source| ArchiveError::Io { op, path, source }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn sha(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn random_hex() -> Result<String, ArchiveError> {
    let mut bytes = [0u8; 32];
    getrandom::getrandom(&mut bytes).map_err(|e| ArchiveError::Io {
        op: "draw random bytes for",
        path: PathBuf::from("an Actions cache archive id"),
        source: std::io::Error::other(e.to_string()),
    })?;
    Ok(hex(&bytes))
}

fn now_unix_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// A reservation: an upload to a signed URL, not yet finalized.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Upload {
    id: String,
    sig: String,
    key: String,
    version: String,
}

/// A lookup's hit: the archive it links to, served at a signed URL.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Download {
    id: String,
    sig: String,
    key: String,
}

/// A finalized upload's answer, kept so a retried finalize gets it again.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Receipt {
    key: String,
    version: String,
    size_bytes: u64,
    entry_id: i64,
    ok: bool,
}

/// What a session holds, as journaled.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
struct Held {
    uploads: Vec<Upload>,
    downloads: Vec<Download>,
    receipts: Vec<Receipt>,
}

impl Held {
    fn count(&self) -> usize {
        self.uploads.len() + self.downloads.len() + self.receipts.len()
    }
}

#[derive(Debug, Serialize, Deserialize)]
struct Record {
    token_sha256: String,
    scope: CacheScope,
    held: Held,
}

/// One guest's intercepting session: the scope of its tier and what it
/// holds. Exists only for a trusted tier that opted in.
#[derive(Debug)]
pub(crate) struct ActionsSession {
    lease: String,
    digest: [u8; 32],
    scope: CacheScope,
    scope_digest: String,
    held: tokio::sync::Mutex<Held>,
}

impl ActionsSession {}

/// A published archive's use, for eviction ([`Archives::entries`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryUse {
    /// The entry's directory.
    pub dir: PathBuf,
    /// Its cache key (as the guest named it; empty when its `entry.json`
    /// cannot be read).
    pub key: String,
    /// The bytes its directory holds on the disk (allocated blocks, as a
    /// generation's tree is counted).
    pub bytes: u64,
    /// When it was last published or matched by a lookup (the mtime of its
    /// `entry.json`).
    pub last_used: std::time::SystemTime,
    /// Whether a live session is reading it: a download link of its
    /// archive exists (its link count is above 1).
    pub in_use: bool,
}

#[derive(Debug, Serialize, Deserialize)]
struct EntryMeta {
    key: String,
    version: String,
    size_bytes: u64,
    entry_id: i64,
    created_unix_ms: i64,
}

/// A Twirp method the node answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Twirp {
    /// `CreateCacheEntry`: reserve a key+version, answer a signed upload URL.
    Create,
    /// `FinalizeCacheEntryUpload`: publish the uploaded archive.
    Finalize,
    /// `GetCacheEntryDownloadURL`: find an archive, answer a signed download URL.
    Lookup,
}

impl Twirp {
    /// The method whose exact path is `path`.
    #[must_use]
    pub(crate) fn of_path(path: &str) -> Option<Self> {
        let method = path.strip_prefix("/twirp/github.actions.results.api.v1.CacheService/")?;
        match method {
            "CreateCacheEntry" => Some(Self::Create),
            "FinalizeCacheEntryUpload" => Some(Self::Finalize),
            "GetCacheEntryDownloadURL" => Some(Self::Lookup),
            _ => None,
        }
    }
}

/// What became of a Twirp request.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Answer {
    /// Answered here: HTTP 200 with this JSON.
    Local(serde_json::Value),
    /// Not handled: splice it to GitHub (a miss at worst).
    Passthrough,
    /// Reservation-bound and failed: a local 502 with this message.
    Unavailable(&'static str),
}

/// The node's Actions cache archives and its intercepting sessions.
#[derive(Debug)]
pub struct Archives {
    root: PathBuf,
    journal: Arc<dyn MountJournal>,
    policy: Arc<dyn ActionsPolicy>,
    sessions: std::sync::Mutex<HashMap<String, Arc<ActionsSession>>>,
    /// Held shared by a lookup from its match to its download link, and
    /// exclusively by an eviction's last look and removal of an entry: an
    /// entry a lookup matched is linked before it can go.
    entries_lock: tokio::sync::RwLock<()>,
    /// The proxy's listener, where a guest fetches a download's signed URL
    /// directly, without a tunnel ([`Self::serve_downloads_at`]); unset, a
    /// download URL is on the results host and fetched in a tunnel.
    direct: std::sync::OnceLock<std::net::SocketAddr>,
    /// Every live download by id: its session's lease and its signature,
    /// so a direct download finds its session, and a forged one is
    /// refused, without waiting on any session's lock.
    download_index: std::sync::Mutex<HashMap<String, Indexed>>,
    /// What unfinished uploads hold on the disk, and their bounds
    /// ([`super::staging`]).
    staged: std::sync::Mutex<super::staging::Staged>,
}

/// A download in [`Archives`]'s index: the lease whose session holds it
/// and its signature.
#[derive(Debug)]
struct Indexed {
    lease: String,
    sig: String,
}

#[derive(Deserialize)]
struct CreateBody {
    key: String,
    version: String,
}

#[derive(Deserialize)]
struct FinalizeBody {
    key: String,
    version: String,
    size_bytes: SizeBytes,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum SizeBytes {
    Number(u64),
    Text(String),
}

#[derive(Deserialize)]
struct LookupBody {
    key: String,
    #[serde(default)]
    restore_keys: Vec<String>,
    version: String,
}

fn check_field(name: &str, value: &str) -> Result<(), ArchiveError> {
    if value.is_empty()
        || value.len() > MAX_FIELD_BYTES
        || value.trim() != value
        || value.contains(['\0', '\r', '\n'])
    {
        return Err(ArchiveError::Invalid(format!(
            "{name} must be 1 to {MAX_FIELD_BYTES} bytes without surrounding whitespace, NUL, CR or LF"
        )));
    }
    Ok(())
}

fn entry_id(store_key: &str, generation: &str) -> i64 {
    let digest = Sha256::digest(format!("{store_key}\0{generation}").as_bytes());
    let mut first = [0u8; 8];
    first.copy_from_slice(&digest[..8]);
    let id = i64::from_be_bytes(first) & i64::MAX;
    if id == 0 { 1 } else { id }
}

fn blob_url(id: &str, sig: &str) -> String {
    format!("https://{RESULTS_HOST}{BLOB_PREFIX}{id}?sig={sig}")
}

/// A signed URL's download or upload id and its query, with the `sig`.
fn signed_target(uri: &hyper::Uri) -> (String, Vec<(String, String)>, String) {
    let id = uri
        .path()
        .strip_prefix(BLOB_PREFIX)
        .unwrap_or_default()
        .to_owned();
    let query = query_pairs(uri.query().unwrap_or_default());
    let sig = query
        .iter()
        .find(|(k, _)| k == "sig")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    (id, query, sig)
}

impl Archives {
    /// The archives under `<cache_dir>/actions`, with every session
    /// `journal` names; an upload directory or a download link no session
    /// names (a crash between the two) is removed.
    ///
    /// # Errors
    ///
    /// [`ArchiveError`] when the directories cannot be made or the journal
    /// read.
    pub async fn open(
        cache_dir: &Path,
        journal: Arc<dyn MountJournal>,
        policy: Arc<dyn ActionsPolicy>,
    ) -> Result<Arc<Self>, ArchiveError> {
        let root = cache_dir.join("actions");
        for d in ["entries", "uploads", "downloads", "trash"] {
            let dir = root.join(d);
            tokio::fs::create_dir_all(&dir)
                .await
                .map_err(io("cannot create", &dir))?;
        }
        // What an eviction was removing when the node stopped.
        let trash = root.join("trash");
        let mut left = tokio::fs::read_dir(&trash)
            .await
            .map_err(io("cannot list", &trash))?;
        while let Some(e) = left.next_entry().await.map_err(io("cannot list", &trash))? {
            remove_any(&e.path()).await;
        }
        let mut sessions = HashMap::new();
        let mut named = BTreeSet::new();
        let mut staged = super::staging::Staged::default();
        let mut download_index = HashMap::new();
        for (lease, record) in journal.actions_sessions().await? {
            let Ok(record) = serde_json::from_str::<Record>(&record) else {
                warn!(%lease, "a journaled Actions cache session is unreadable; its guest's cache goes to GitHub");
                continue;
            };
            let Some(digest) = unhex32(&record.token_sha256) else {
                continue;
            };
            named.extend(record.held.uploads.iter().map(|u| u.id.clone()));
            for u in &record.held.uploads {
                let bytes = super::staging::bytes_under(&root.join("uploads").join(&u.id));
                staged.found(&lease, &u.id, bytes);
            }
            named.extend(record.held.downloads.iter().map(|d| d.id.clone()));
            for d in &record.held.downloads {
                download_index.insert(
                    d.id.clone(),
                    Indexed {
                        lease: lease.clone(),
                        sig: d.sig.clone(),
                    },
                );
            }
            sessions.insert(
                lease.clone(),
                Arc::new(ActionsSession {
                    lease,
                    digest,
                    scope_digest: scope_digest(&record.scope),
                    scope: record.scope,
                    held: tokio::sync::Mutex::new(record.held),
                }),
            );
        }
        for d in ["uploads", "downloads"] {
            let dir = root.join(d);
            let mut entries = tokio::fs::read_dir(&dir)
                .await
                .map_err(io("cannot list", &dir))?;
            while let Some(e) = entries
                .next_entry()
                .await
                .map_err(io("cannot list", &dir))?
            {
                if !named.contains(e.file_name().to_string_lossy().as_ref()) {
                    remove_any(&e.path()).await;
                }
            }
        }
        Ok(Arc::new(Self {
            root,
            journal,
            policy,
            sessions: std::sync::Mutex::new(sessions),
            entries_lock: tokio::sync::RwLock::new(()),
            direct: std::sync::OnceLock::new(),
            download_index: std::sync::Mutex::new(download_index),
            staged: std::sync::Mutex::new(staged),
        }))
    }

    /// Holds unfinished uploads to `limits` from now on
    /// ([`super::staging::StageLimits`]; the defaults until called).
    pub(crate) fn set_stage_limits(&self, limits: super::staging::StageLimits) {
        self.staged.lock().expect("staged").set_limits(limits);
    }

    fn stage<'a>(&'a self, lease: &'a str, upload: &'a str) -> Stage<'a> {
        Stage {
            archives: self,
            lease,
            upload,
        }
    }

    /// Opens `lease`'s intercepting session under `scope`, authenticated
    /// by `token` (the lease's cache session token), journaled first.
    ///
    /// # Errors
    ///
    /// [`ArchiveError::Journal`]: the guest then gets no proxy.
    pub async fn open_session(
        &self,
        lease: &str,
        token: &CacheToken,
        scope: CacheScope,
    ) -> Result<(), ArchiveError> {
        let session = Arc::new(ActionsSession {
            lease: lease.to_owned(),
            digest: Sha256::digest(token.expose().as_bytes()).into(),
            scope_digest: scope_digest(&scope),
            scope,
            held: tokio::sync::Mutex::new(Held::default()),
        });
        self.persist(&session, &Held::default()).await?;
        self.sessions
            .lock()
            .expect("sessions")
            .insert(lease.to_owned(), session);
        info!(%lease, "Actions cache session open");
        Ok(())
    }

    async fn persist(&self, session: &ActionsSession, held: &Held) -> Result<(), ArchiveError> {
        let record = Record {
            token_sha256: hex(&session.digest),
            scope: session.scope.clone(),
            held: held.clone(),
        };
        self.journal
            .put_actions_session(
                &session.lease,
                &serde_json::to_string(&record).expect("records serialise"),
            )
            .await?;
        Ok(())
    }

    /// Closes `lease`'s session once its compute is proven gone: its
    /// uploads and download links are removed and the journal forgets
    /// it; published entries stay.
    pub async fn close(&self, lease: &str) {
        let session = self.sessions.lock().expect("sessions").remove(lease);
        let Some(session) = session else {
            return;
        };
        let held = session.held.lock().await;
        for u in &held.uploads {
            remove_any(&self.root.join("uploads").join(&u.id)).await;
            self.staged.lock().expect("staged").forget(&u.id);
        }
        {
            let mut index = self.download_index.lock().expect("download index");
            for d in &held.downloads {
                index.remove(&d.id);
            }
        }
        for d in &held.downloads {
            remove_any(&self.root.join("downloads").join(&d.id)).await;
        }
        if let Err(e) = self.journal.forget_actions_session(lease).await {
            warn!(%lease, error = %e, "cannot forget the Actions cache session in the journal; a restart keeps it until it is closed");
        }
        info!(%lease, "Actions cache session closed");
    }

    /// Closes the session of every lease `listed` proves has no compute
    /// (only a successful inventory makes a [`Listed`](crate::cache::Listed): spec/cache.md
    /// §3.4).
    pub(crate) async fn reconcile(&self, listed: &crate::cache::Listed) {
        let stale: Vec<String> = self
            .sessions
            .lock()
            .expect("sessions")
            .keys()
            .filter(|l| !listed.may_run(l))
            .cloned()
            .collect();
        for lease in stale {
            self.close(&lease).await;
        }
    }

    /// Hands out download URLs on `addr` (`http://<addr>/_billet/actions-cache/<id>?sig=`),
    /// which the guest fetches directly from the proxy's listener rather
    /// than in a TLS tunnel to the results host; called once, by the proxy
    /// that listens there. Later calls change nothing.
    pub(crate) fn serve_downloads_at(&self, addr: std::net::SocketAddr) {
        let _ = self.direct.set(addr);
    }

    /// The signed URL of a download: on the proxy's listener when it
    /// serves downloads directly, else on the results host.
    fn download_url(&self, id: &str, sig: &str) -> String {
        match self.direct.get() {
            Some(addr) => format!("http://{addr}{BLOB_PREFIX}{id}?sig={sig}"),
            None => blob_url(id, sig),
        }
    }

    /// The session whose token is `token`, compared in constant time.
    #[must_use]
    pub(crate) fn authenticate(&self, token: &[u8]) -> Option<Arc<ActionsSession>> {
        let digest: [u8; 32] = Sha256::digest(token).into();
        let sessions = self.sessions.lock().expect("sessions");
        let mut found = None;
        for s in sessions.values() {
            if bool::from(s.digest.ct_eq(&digest)) {
                found = Some(s.clone());
            }
        }
        found
    }

    /// Every published archive with its size, last use and whether a
    /// live session reads it, for eviction: a walk of `entries/` that
    /// takes no lock (metadata only).
    ///
    /// # Errors
    ///
    /// [`ArchiveError::Io`] when the entries cannot be listed.
    pub fn entries(&self) -> Result<Vec<EntryUse>, ArchiveError> {
        let mut out = Vec::new();
        let base = self.root.join("entries");
        for scope in std::fs::read_dir(&base).map_err(io("cannot list", &base))? {
            let scope = scope.map_err(io("cannot list", &base))?.path();
            let Ok(versions) = std::fs::read_dir(&scope) else {
                continue;
            };
            for version in versions {
                let version = version.map_err(io("cannot list", &scope))?.path();
                let Ok(entries) = std::fs::read_dir(&version) else {
                    continue;
                };
                for entry in entries {
                    let dir = entry.map_err(io("cannot list", &version))?.path();
                    if let Some(found) = entry_use(&dir) {
                        out.push(found);
                    }
                }
            }
        }
        Ok(out)
    }

    /// Removes one published archive an eviction pass chose from its walk
    /// ([`Archives::entries`]), if it still may go: looked at again while
    /// no lookup can match it, it stays when it is gone already, when a
    /// live session is reading it (a download link of it exists), or when
    /// it was used since the walk (its last use is not `seen.last_used`).
    /// Otherwise its directory is moved to `trash/` in one `rename` and
    /// removed there. Returns whether it was removed.
    ///
    /// # Errors
    ///
    /// [`ArchiveError::Io`] when it cannot be moved or removed.
    pub(crate) async fn evict_entry(&self, seen: &EntryUse) -> Result<bool, ArchiveError> {
        let trash = self
            .root
            .join("trash")
            .join(uuid::Uuid::new_v4().simple().to_string());
        {
            let _no_lookups = self.entries_lock.write().await;
            let dir = seen.dir.clone();
            let now = tokio::task::spawn_blocking(move || entry_use(&dir))
                .await
                .ok()
                .flatten();
            match now {
                Some(now) if !now.in_use && now.last_used == seen.last_used => {}
                _ => return Ok(false),
            }
            tokio::fs::rename(&seen.dir, &trash)
                .await
                .map_err(io("cannot move to the trash", &seen.dir))?;
            if let Some(parent) = seen.dir.parent() {
                sync_dir(parent).await;
            }
        }
        tokio::fs::remove_dir_all(&trash)
            .await
            .map_err(io("cannot remove", &trash))?;
        info!(key = %seen.key, bytes = seen.bytes, "Actions cache archive evicted");
        Ok(true)
    }

    fn version_dir(&self, session: &ActionsSession, version: &str) -> PathBuf {
        self.root
            .join("entries")
            .join(&session.scope_digest)
            .join(sha(version.as_bytes()))
    }

    fn entry_dir(&self, session: &ActionsSession, version: &str, key: &str) -> PathBuf {
        self.version_dir(session, version).join(sha(key.as_bytes()))
    }

    fn store_key(session: &ActionsSession, version: &str, key: &str) -> String {
        format!(
            "actions-cache/{}/{}/{key}",
            session.scope_digest,
            sha(version.as_bytes())
        )
    }

    async fn allowed(&self, session: &ActionsSession) -> bool {
        match super::ask(self.policy.as_ref(), &session.scope).await {
            Ok(allowed) => allowed,
            Err(e) => {
                warn!(lease = %session.lease, error = %e, "the Actions cache policy gave no answer; treated as denied");
                false
            }
        }
    }

    /// Answers one of the three Twirp methods from `body` (its JSON), as
    /// spec/cache.md §2.5's fallback rules say: the policy is asked before
    /// anything is allocated; a finalize with a receipt is answered
    /// whatever the policy says.
    pub(crate) async fn twirp(
        &self,
        session: &ActionsSession,
        method: Twirp,
        body: &[u8],
    ) -> Answer {
        let result = match method {
            Twirp::Create => self.create(session, body).await,
            Twirp::Finalize => return self.finalize(session, body).await,
            Twirp::Lookup => self.lookup(session, body).await,
        };
        match result {
            Ok(answer) => answer,
            Err(e) => {
                warn!(lease = %session.lease, error = %e, "the Actions cache cannot answer; GitHub will");
                Answer::Passthrough
            }
        }
    }

    async fn create(&self, session: &ActionsSession, body: &[u8]) -> Result<Answer, ArchiveError> {
        let body: CreateBody =
            serde_json::from_slice(body).map_err(|e| ArchiveError::Invalid(e.to_string()))?;
        check_field("key", &body.key)?;
        check_field("version", &body.version)?;
        if !self.allowed(session).await {
            return Ok(Answer::Passthrough);
        }
        let mut held = session.held.lock().await;
        if held.count() >= MAX_ARCHIVES_PER_SESSION {
            return Err(ArchiveError::Full);
        }
        let mine = |k: &str, v: &str| k == body.key && v == body.version;
        if held.uploads.iter().any(|u| mine(&u.key, &u.version))
            || held.receipts.iter().any(|r| mine(&r.key, &r.version))
        {
            return Ok(Answer::Local(serde_json::json!({
                "ok": false, "message": "this job reserved that key and version already"
            })));
        }
        let entry = self.entry_dir(session, &body.version, &body.key);
        if tokio::fs::try_exists(entry.join("entry.json"))
            .await
            .unwrap_or(false)
        {
            return Ok(Answer::Local(serde_json::json!({
                "ok": false, "message": "an archive of that key and version exists; archives are written once"
            })));
        }
        let upload = Upload {
            id: random_hex()?,
            sig: random_hex()?,
            key: body.key,
            version: body.version,
        };
        let mut next = held.clone();
        next.uploads.push(upload.clone());
        // Journaled before the directory is made: a crash between the two
        // leaves a record whose directory is missing, never a directory no
        // record names.
        self.persist(session, &next).await?;
        *held = next;
        let dir = self.root.join("uploads").join(&upload.id).join("blocks");
        tokio::fs::create_dir_all(&dir)
            .await
            .map_err(io("cannot create", &dir))?;
        info!(lease = %session.lease, key = %upload.key, "Actions cache entry reserved");
        Ok(Answer::Local(serde_json::json!({
            "ok": true,
            "signed_upload_url": blob_url(&upload.id, &upload.sig),
        })))
    }

    async fn finalize(&self, session: &ActionsSession, body: &[u8]) -> Answer {
        let Ok(body) = serde_json::from_slice::<FinalizeBody>(body) else {
            return Answer::Passthrough;
        };
        let size = match &body.size_bytes {
            SizeBytes::Number(n) => Some(*n),
            SizeBytes::Text(t) => t.parse().ok(),
        };
        let Some(size) = size else {
            return Answer::Passthrough;
        };
        let mut held = session.held.lock().await;
        let mine = |k: &str, v: &str| k == body.key && v == body.version;
        if let Some(r) = held.receipts.iter().find(|r| mine(&r.key, &r.version)) {
            if r.size_bytes != size {
                return Answer::Unavailable(
                    "the archive was finalized with another size; storage is unavailable",
                );
            }
            return Answer::Local(receipt_json(r));
        }
        let Some(upload) = held
            .uploads
            .iter()
            .find(|u| mine(&u.key, &u.version))
            .cloned()
        else {
            drop(held);
            if !self.allowed(session).await {
                return Answer::Passthrough;
            }
            return Answer::Local(serde_json::json!({ "ok": false }));
        };
        if !self.allowed(session).await {
            return Answer::Unavailable("Actions cache reservation is unavailable");
        }
        let published = self.publish(session, &upload, size).await;
        if published.is_ok() {
            // Its bytes are an entry now (or gone), counted by eviction.
            self.staged.lock().expect("staged").forget(&upload.id);
        }
        match published {
            Ok(receipt) => {
                let mut next = held.clone();
                next.uploads.retain(|u| u.id != upload.id);
                next.receipts.push(receipt.clone());
                if let Err(e) = self.persist(session, &next).await {
                    warn!(lease = %session.lease, error = %e, "cannot journal the Actions cache receipt");
                    return Answer::Unavailable("storage is unavailable");
                }
                *held = next;
                info!(lease = %session.lease, key = %upload.key, ok = receipt.ok, bytes = size, "Actions cache entry finalized");
                Answer::Local(receipt_json(&receipt))
            }
            Err(e) => {
                warn!(lease = %session.lease, key = %upload.key, error = %e, "cannot finalize the Actions cache entry");
                Answer::Unavailable("storage is unavailable")
            }
        }
    }

    async fn publish(
        &self,
        session: &ActionsSession,
        upload: &Upload,
        size: u64,
    ) -> Result<Receipt, ArchiveError> {
        let store_key = Self::store_key(session, &upload.version, &upload.key);
        let id = entry_id(&store_key, &upload.id);
        let receipt = |ok| Receipt {
            key: upload.key.clone(),
            version: upload.version.clone(),
            size_bytes: size,
            entry_id: id,
            ok,
        };
        let dir = self.root.join("uploads").join(&upload.id);
        let target = self.entry_dir(session, &upload.version, &upload.key);
        if !tokio::fs::try_exists(&dir).await.unwrap_or(false) {
            // Published before a crash took the journal's receipt?
            let meta = tokio::fs::read(target.join("entry.json")).await.ok();
            let ours = meta
                .and_then(|m| serde_json::from_slice::<EntryMeta>(&m).ok())
                .is_some_and(|m| m.entry_id == id);
            return if ours {
                Ok(receipt(true))
            } else {
                Err(ArchiveError::Invalid(
                    "the upload's directory is gone".into(),
                ))
            };
        }
        let archive = dir.join("archive");
        let meta = tokio::fs::symlink_metadata(&archive)
            .await
            .map_err(io("cannot read", &archive))?;
        if !meta.is_file() || meta.len() != size {
            return Err(ArchiveError::Invalid(format!(
                "the uploaded archive has {} bytes, not the {size} finalized",
                meta.len()
            )));
        }
        // Crash leftovers and blocks go before the archive is published.
        let mut names = tokio::fs::read_dir(&dir)
            .await
            .map_err(io("cannot list", &dir))?;
        while let Some(e) = names.next_entry().await.map_err(io("cannot list", &dir))? {
            if e.file_name() != "archive" {
                remove_any(&e.path()).await;
            }
        }
        let entry = EntryMeta {
            key: upload.key.clone(),
            version: upload.version.clone(),
            size_bytes: size,
            entry_id: id,
            created_unix_ms: now_unix_ms(),
        };
        let meta_path = dir.join("entry.json");
        write_synced(
            &meta_path,
            &serde_json::to_vec(&entry).expect("entries serialise"),
        )
        .await?;
        let parent = self.version_dir(session, &upload.version);
        tokio::fs::create_dir_all(&parent)
            .await
            .map_err(io("cannot create", &parent))?;
        match tokio::fs::rename(&dir, &target).await {
            Ok(()) => {
                sync_dir(&parent).await;
                Ok(receipt(true))
            }
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::DirectoryNotEmpty | std::io::ErrorKind::AlreadyExists
                ) =>
            {
                // Another job published the key first: write-once.
                remove_any(&dir).await;
                Ok(receipt(false))
            }
            Err(e) => Err(io("cannot publish", &target)(e)),
        }
    }

    async fn lookup(&self, session: &ActionsSession, body: &[u8]) -> Result<Answer, ArchiveError> {
        let body: LookupBody =
            serde_json::from_slice(body).map_err(|e| ArchiveError::Invalid(e.to_string()))?;
        check_field("key", &body.key)?;
        check_field("version", &body.version)?;
        if body.restore_keys.len() > MAX_RESTORE_KEYS {
            return Err(ArchiveError::Invalid(format!(
                "at most {MAX_RESTORE_KEYS} restore keys"
            )));
        }
        for k in &body.restore_keys {
            check_field("restore key", k)?;
        }
        if !self.allowed(session).await {
            return Ok(Answer::Passthrough);
        }
        let mut held = session.held.lock().await;
        if held.count() >= MAX_ARCHIVES_PER_SESSION {
            return Err(ArchiveError::Full);
        }
        // No eviction between the match and its link.
        let _no_eviction = self.entries_lock.read().await;
        let Some((entry, key)) = self
            .find(session, &body.version, &body.key, &body.restore_keys)
            .await
        else {
            return Ok(Answer::Local(serde_json::json!({ "ok": false })));
        };
        let download = Download {
            id: random_hex()?,
            sig: random_hex()?,
            key: key.clone(),
        };
        let mut next = held.clone();
        next.downloads.push(download.clone());
        self.persist(session, &next).await?;
        *held = next;
        self.download_index.lock().expect("download index").insert(
            download.id.clone(),
            Indexed {
                lease: session.lease.clone(),
                sig: download.sig.clone(),
            },
        );
        let link = self.root.join("downloads").join(&download.id);
        tokio::fs::hard_link(entry.join("archive"), &link)
            .await
            .map_err(io("cannot link", &link))?;
        if let Ok(f) = std::fs::File::options()
            .write(true)
            .open(entry.join("entry.json"))
        {
            let _ = f.set_modified(std::time::SystemTime::now());
        }
        info!(lease = %session.lease, key = %key, "Actions cache entry found");
        Ok(Answer::Local(serde_json::json!({
            "ok": true,
            "signed_download_url": self.download_url(&download.id, &download.sig),
            "matched_key": key,
        })))
    }

    /// The entry of `key` exactly, else the newest whose key starts with
    /// the first restore key that matches any: its directory and key.
    async fn find(
        &self,
        session: &ActionsSession,
        version: &str,
        key: &str,
        restore_keys: &[String],
    ) -> Option<(PathBuf, String)> {
        let exact = self.entry_dir(session, version, key);
        if tokio::fs::try_exists(exact.join("entry.json"))
            .await
            .unwrap_or(false)
        {
            return Some((exact, key.to_owned()));
        }
        if restore_keys.is_empty() {
            return None;
        }
        let base = self.version_dir(session, version);
        let mut all = Vec::new();
        let mut dirs = tokio::fs::read_dir(&base).await.ok()?;
        while let Ok(Some(e)) = dirs.next_entry().await {
            let Ok(bytes) = tokio::fs::read(e.path().join("entry.json")).await else {
                continue;
            };
            if let Ok(meta) = serde_json::from_slice::<EntryMeta>(&bytes) {
                all.push((e.path(), meta));
            }
        }
        for prefix in restore_keys {
            let newest = all
                .iter()
                .filter(|(_, m)| m.key.starts_with(prefix.as_str()))
                .max_by_key(|(_, m)| m.created_unix_ms);
            if let Some((dir, meta)) = newest {
                return Some((dir.clone(), meta.key.clone()));
            }
        }
        None
    }

    /// Answers a request to a signed URL (`/_billet/actions-cache/<id>?sig=`):
    /// an upload (`HEAD`; `PUT` whole with `x-ms-blob-type: BlockBlob`,
    /// `?comp=block&blockid=`, `?comp=blocklist`) or a download (`GET`,
    /// `HEAD`, one byte range from `Range` or `x-ms-range`). Always local:
    /// a signed URL GitHub never issued cannot go to GitHub.
    pub(crate) async fn blob(
        &self,
        session: &ActionsSession,
        req: Request<Incoming>,
    ) -> Response<Body> {
        let (id, query, sig) = signed_target(req.uri());
        let signed = |s: &str| bool::from(s.as_bytes().ct_eq(sig.as_bytes()));
        let (upload, download) = {
            let held = session.held.lock().await;
            (
                held.uploads
                    .iter()
                    .find(|u| u.id == id && signed(&u.sig))
                    .cloned(),
                held.downloads
                    .iter()
                    .find(|d| d.id == id && signed(&d.sig))
                    .cloned(),
            )
        };
        if upload.is_none() && download.is_none() {
            return plain(StatusCode::FORBIDDEN, "no such signed URL for this session");
        }
        if !self.allowed(session).await {
            return plain(
                StatusCode::BAD_GATEWAY,
                "Actions cache reservation is unavailable",
            );
        }
        if let Some(upload) = upload {
            return self.upload(session, &upload, &query, req).await;
        }
        let link = self.root.join("downloads").join(&id);
        serve_download(&link, &req).await
    }

    /// Answers a download's signed URL fetched from the proxy's listener
    /// outside any tunnel (`GET` or `HEAD` of
    /// `http://<listener>/_billet/actions-cache/<id>?sig=`, as
    /// [`Self::serve_downloads_at`] hands out): the URL is the credential,
    /// as a blob store's signed URL is, so it is served to whoever holds it
    /// while the session that matched it lives and the plane allows it
    /// (else 502, as in a tunnel). An upload's URL is not served here
    /// (403): uploads stay in the tunnel.
    pub(crate) async fn direct_download(&self, req: Request<Incoming>) -> Response<Body> {
        if !matches!(*req.method(), Method::GET | Method::HEAD) {
            return plain(
                StatusCode::METHOD_NOT_ALLOWED,
                "a download URL takes GET and HEAD",
            );
        }
        let (id, _, sig) = signed_target(req.uri());
        let lease = self
            .download_index
            .lock()
            .expect("download index")
            .get(&id)
            .filter(|d| bool::from(d.sig.as_bytes().ct_eq(sig.as_bytes())))
            .map(|d| d.lease.clone());
        let session = lease.and_then(|l| self.sessions.lock().expect("sessions").get(&l).cloned());
        match session {
            // Its own session's lock only, as in a tunnel.
            Some(session) => self.blob(&session, req).await,
            None => plain(StatusCode::FORBIDDEN, "no such signed download URL"),
        }
    }

    async fn upload(
        &self,
        session: &ActionsSession,
        upload: &Upload,
        query: &[(String, String)],
        req: Request<Incoming>,
    ) -> Response<Body> {
        let dir = self.root.join("uploads").join(&upload.id);
        let stage = self.stage(&session.lease, &upload.id);
        if req.method() == Method::HEAD {
            return plain(StatusCode::OK, "");
        }
        if req.method() != Method::PUT {
            return plain(
                StatusCode::METHOD_NOT_ALLOWED,
                "an upload URL takes HEAD and PUT",
            );
        }
        let comp = query
            .iter()
            .find(|(k, _)| k == "comp")
            .map(|(_, v)| v.as_str());
        let result = match comp {
            None => {
                let block_blob = req
                    .headers()
                    .get("x-ms-blob-type")
                    .is_some_and(|v| v.as_bytes().eq_ignore_ascii_case(b"BlockBlob"));
                if !block_blob {
                    return plain(
                        StatusCode::BAD_REQUEST,
                        "a whole upload needs x-ms-blob-type: BlockBlob",
                    );
                }
                receive(&dir, "archive", req, MAX_ARCHIVE_BYTES, &stage).await
            }
            Some("block") => {
                let Some(block) = query
                    .iter()
                    .find(|(k, _)| k == "blockid")
                    .map(|(_, v)| v.as_str())
                    .filter(|b| !b.is_empty() && b.len() <= MAX_BLOCK_ID_BYTES)
                else {
                    return plain(
                        StatusCode::BAD_REQUEST,
                        "a block needs a blockid of 1 to 1024 bytes",
                    );
                };
                let name = format!("blocks/{}", sha(block.as_bytes()));
                receive(&dir, &name, req, MAX_ARCHIVE_BYTES, &stage).await
            }
            Some("blocklist") => {
                let body = match http_body_util::Limited::new(req.into_body(), MAX_BLOCK_LIST_BYTES)
                    .collect()
                    .await
                {
                    Ok(b) => b.to_bytes(),
                    Err(_) => {
                        return plain(
                            StatusCode::PAYLOAD_TOO_LARGE,
                            "a block list is at most 64 KiB",
                        );
                    }
                };
                match parse_block_list(&body) {
                    Ok(ids) => assemble(&dir, &ids, &stage).await,
                    Err(e) => return plain(StatusCode::BAD_REQUEST, &e),
                }
            }
            Some(_) => return plain(StatusCode::BAD_REQUEST, "comp is block or blocklist"),
        };
        match result {
            Ok(()) => {
                let mut r = plain(StatusCode::CREATED, "");
                let h = r.headers_mut();
                h.insert(
                    hyper::header::ETAG,
                    format!("\"billet-{}\"", upload.id)
                        .parse()
                        .expect("an etag is a header value"),
                );
                h.insert(
                    "x-ms-request-id",
                    uuid::Uuid::new_v4()
                        .to_string()
                        .parse()
                        .expect("a uuid is a header value"),
                );
                r
            }
            Err(Received::TooLarge) => plain(
                StatusCode::PAYLOAD_TOO_LARGE,
                "an archive is at most 10 GiB",
            ),
            Err(Received::Failed(e)) => {
                warn!(lease = %session.lease, key = %upload.key, error = %e, "an Actions cache upload failed");
                plain(StatusCode::BAD_GATEWAY, "storage is unavailable")
            }
            Err(Received::Refused(why)) => plain(StatusCode::BAD_REQUEST, &why),
            Err(Received::NoRoom(why)) => {
                warn!(lease = %session.lease, key = %upload.key, reason = %why, "an Actions cache upload was refused for room");
                plain(StatusCode::INSUFFICIENT_STORAGE, &why)
            }
            Err(Received::TooSlow) => plain(
                StatusCode::REQUEST_TIMEOUT,
                "the request body came too slowly",
            ),
        }
    }
}

fn receipt_json(r: &Receipt) -> serde_json::Value {
    if r.ok {
        serde_json::json!({ "ok": true, "entry_id": r.entry_id.to_string() })
    } else {
        serde_json::json!({ "ok": false })
    }
}

/// What an entry's directory says of its use, read now; `None` when it
/// has no archive or no `entry.json` (not published, or gone).
fn entry_use(dir: &Path) -> Option<EntryUse> {
    use std::os::unix::fs::MetadataExt as _;
    let meta = std::fs::metadata(dir.join("entry.json")).ok()?;
    let archive = std::fs::metadata(dir.join("archive")).ok()?;
    let key = std::fs::read(dir.join("entry.json"))
        .ok()
        .and_then(|b| serde_json::from_slice::<EntryMeta>(&b).ok())
        .map(|m| m.key)
        .unwrap_or_default();
    Some(EntryUse {
        dir: dir.to_owned(),
        key,
        bytes: crate::cache::clone::tree_bytes(dir).unwrap_or(archive.blocks() * 512),
        last_used: meta.modified().unwrap_or(std::time::UNIX_EPOCH),
        in_use: archive.nlink() > 1,
    })
}

fn scope_digest(scope: &CacheScope) -> String {
    sha(format!(
        "{}\0{}\0{}",
        scope.owner(),
        scope.repository(),
        scope.workflow_ref()
    )
    .as_bytes())
}

fn unhex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

async fn remove_any(path: &Path) {
    let removed = match tokio::fs::symlink_metadata(path).await {
        Ok(m) if m.is_dir() => tokio::fs::remove_dir_all(path).await,
        Ok(_) => tokio::fs::remove_file(path).await,
        Err(e) => Err(e),
    };
    if let Err(e) = removed
        && e.kind() != std::io::ErrorKind::NotFound
    {
        warn!(path = %path.display(), error = %e, "cannot remove an Actions cache file");
    }
}

async fn sync_dir(dir: &Path) {
    if let Ok(d) = tokio::fs::File::open(dir).await {
        let _ = d.sync_all().await;
    }
}

async fn write_synced(path: &Path, bytes: &[u8]) -> Result<(), ArchiveError> {
    let mut f = tokio::fs::File::create(path)
        .await
        .map_err(io("cannot create", path))?;
    f.write_all(bytes).await.map_err(io("cannot write", path))?;
    f.sync_all().await.map_err(io("cannot sync", path))?;
    Ok(())
}

/// `a=b&c=d`, percent-decoding `%XX` and `+` in values.
fn query_pairs(query: &str) -> Vec<(String, String)> {
    query
        .split('&')
        .filter(|p| !p.is_empty())
        .map(|p| {
            let (k, v) = p.split_once('=').unwrap_or((p, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

fn percent_decode(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' if i + 2 < bytes.len() => {
                match std::str::from_utf8(&bytes[i + 1..i + 3])
                    .ok()
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or(())
                {
                    Ok(b) => {
                        out.push(b);
                        i += 3;
                        continue;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b'+' => out.push(b' '),
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

enum Received {
    TooLarge,
    Refused(String),
    Failed(std::io::Error),
    /// A bound of [`super::staging`] would be crossed.
    NoRoom(String),
    /// The body stalled or came below the minimum rate.
    TooSlow,
}

/// One upload's reservations ([`super::staging::Staged`]).
struct Stage<'a> {
    archives: &'a Archives,
    lease: &'a str,
    upload: &'a str,
}

impl Stage<'_> {
    fn reserve(&self, bytes: u64) -> Result<(), Received> {
        self.archives
            .staged
            .lock()
            .expect("staged")
            .reserve(&self.archives.root, self.lease, self.upload, bytes)
            .map_err(|e| Received::NoRoom(e.0))
    }

    fn release(&self, bytes: u64) {
        self.archives
            .staged
            .lock()
            .expect("staged")
            .release(self.upload, bytes);
    }
}

/// Writes a request body to `<dir>/<name>` through a temporary file:
/// synced and renamed when whole; removed unsynced when the body fails.
/// Its bytes are reserved first (a declared `Content-Length` before any is
/// read, else frame by frame), less those of a file it replaces, and given
/// back when they are not kept. A body that sends nothing for
/// [`super::staging::BODY_STALL`], or averages less than
/// [`super::staging::MIN_BODY_BYTES_PER_SEC`] once
/// [`super::staging::BODY_RATE_GRACE`] has passed, is cut.
async fn receive(
    dir: &Path,
    name: &str,
    req: Request<Incoming>,
    limit: u64,
    stage: &Stage<'_>,
) -> Result<(), Received> {
    use super::staging::{BODY_RATE_GRACE, BODY_STALL, MIN_BODY_BYTES_PER_SEC};
    let declared = req
        .headers()
        .get(hyper::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|d| d > limit) {
        return Err(Received::TooLarge);
    }
    let target = dir.join(name);
    // A file put again (a retried block) is replaced: its bytes count
    // toward the new one's.
    let existing = tokio::fs::metadata(&target).await.map_or(0, |m| m.len());
    let mut reserved = declared.unwrap_or(0).saturating_sub(existing);
    stage.reserve(reserved)?;
    let mut allowance = reserved + existing;
    let mut body = req.into_body();
    let tmp = dir.join(format!(".tmp-{}", uuid::Uuid::new_v4().simple()));
    let mut file = match tokio::fs::File::create(&tmp).await {
        Ok(f) => f,
        Err(e) => {
            stage.release(reserved);
            return Err(Received::Failed(e));
        }
    };
    let mut written = 0u64;
    let began = tokio::time::Instant::now();
    let outcome = async {
        loop {
            let frame = match tokio::time::timeout(BODY_STALL, body.frame()).await {
                Err(_) => return Err(Received::TooSlow),
                Ok(None) => break,
                Ok(Some(frame)) => frame,
            };
            let frame = frame.map_err(|e| Received::Failed(std::io::Error::other(e)))?;
            if let Ok(data) = frame.into_data() {
                written += data.len() as u64;
                if written > limit {
                    return Err(Received::TooLarge);
                }
                if written > allowance {
                    stage.reserve(written - allowance)?;
                    reserved += written - allowance;
                    allowance = written;
                }
                file.write_all(&data).await.map_err(Received::Failed)?;
            }
            let elapsed = began.elapsed();
            if elapsed >= BODY_RATE_GRACE
                && u128::from(written) * 1000
                    < u128::from(MIN_BODY_BYTES_PER_SEC) * elapsed.as_millis()
            {
                return Err(Received::TooSlow);
            }
        }
        file.sync_all().await.map_err(Received::Failed)?;
        tokio::fs::rename(&tmp, &target)
            .await
            .map_err(Received::Failed)?;
        // Held now: `written` bytes in place of `existing`.
        stage.release(allowance - written);
        Ok(())
    }
    .await;
    if outcome.is_err() {
        drop(file);
        let _ = tokio::fs::remove_file(&tmp).await;
        stage.release(reserved);
    }
    outcome
}

/// Concatenates the staged blocks `ids` in declared order into `archive`.
async fn assemble(dir: &Path, ids: &[String], stage: &Stage<'_>) -> Result<(), Received> {
    let tmp = dir.join(format!(".tmp-{}", uuid::Uuid::new_v4().simple()));
    let mut reserved = 0u64;
    let outcome = async {
        let mut out = tokio::fs::File::create(&tmp)
            .await
            .map_err(Received::Failed)?;
        let mut total = 0u64;
        for id in ids {
            let path = dir.join("blocks").join(sha(id.as_bytes()));
            let mut block = tokio::fs::File::open(&path)
                .await
                .map_err(|_| Received::Refused(format!("block {id:?} was never staged")))?;
            // The archive is a second copy of its blocks until it is
            // published, so it is reserved as they are.
            let len = block.metadata().await.map_or(0, |m| m.len());
            stage.reserve(len)?;
            reserved += len;
            total += tokio::io::copy(&mut block, &mut out)
                .await
                .map_err(Received::Failed)?;
            if total > MAX_ARCHIVE_BYTES {
                return Err(Received::TooLarge);
            }
        }
        out.sync_all().await.map_err(Received::Failed)?;
        let target = dir.join("archive");
        let replaced = tokio::fs::metadata(&target).await.map_or(0, |m| m.len());
        tokio::fs::rename(&tmp, &target)
            .await
            .map_err(Received::Failed)?;
        stage.release(replaced);
        Ok(())
    }
    .await;
    if outcome.is_err() {
        let _ = tokio::fs::remove_file(&tmp).await;
        stage.release(reserved);
    }
    outcome
}

/// The block ids of an Azure `BlockList` (children `Latest`, `Committed`
/// or `Uncommitted`, no namespaces or attributes), in declared order.
fn parse_block_list(body: &[u8]) -> Result<Vec<String>, String> {
    let text = std::str::from_utf8(body).map_err(|_| "the block list is not UTF-8".to_owned())?;
    let mut rest = text.trim();
    if let Some(after) = rest.strip_prefix("<?xml") {
        rest = after
            .split_once("?>")
            .ok_or("the XML declaration is not closed")?
            .1
            .trim_start();
    }
    rest = rest
        .strip_prefix("<BlockList>")
        .ok_or("the body is not a <BlockList>")?;
    let mut ids = Vec::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</BlockList>") {
            if !after.trim().is_empty() {
                return Err("data after </BlockList>".into());
            }
            break;
        }
        let (tag, after) = ["Latest", "Committed", "Uncommitted"]
            .iter()
            .find_map(|t| rest.strip_prefix(&format!("<{t}>")).map(|a| (*t, a)))
            .ok_or("a block list's children are <Latest>, <Committed> or <Uncommitted>")?;
        let close = format!("</{tag}>");
        let (id, after) = after
            .split_once(close.as_str())
            .ok_or_else(|| format!("<{tag}> is not closed"))?;
        let id = id
            .replace("&lt;", "<")
            .replace("&gt;", ">")
            .replace("&quot;", "\"")
            .replace("&apos;", "'")
            .replace("&amp;", "&");
        if id.is_empty() || id.len() > MAX_BLOCK_ID_BYTES {
            return Err(format!(
                "block id {id:?} is empty or longer than 1024 bytes"
            ));
        }
        ids.push(id);
        if ids.len() > MAX_BLOCKS {
            return Err(format!("at most {MAX_BLOCKS} blocks"));
        }
        rest = after;
    }
    if ids.is_empty() {
        return Err("the block list names no block".into());
    }
    Ok(ids)
}

fn plain(status: StatusCode, text: &str) -> Response<Body> {
    let mut r = Response::new(
        Full::new(Bytes::from(text.to_owned()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *r.status_mut() = status;
    r.headers_mut().insert(
        LOCAL_HEADER,
        hyper::header::HeaderValue::from_static("local"),
    );
    r
}

/// A single byte range, `[start, end)` of `size`.
#[derive(Debug, PartialEq, Eq)]
enum Range {
    Whole,
    Part(u64, u64),
    Unsatisfiable,
}

/// `bytes=a-b`, `bytes=a-` or `bytes=-n` over `size` bytes.
fn parse_range(spec: Option<&str>, size: u64) -> Range {
    let Some(spec) = spec else {
        return Range::Whole;
    };
    let Some(r) = spec.trim().strip_prefix("bytes=") else {
        return Range::Unsatisfiable;
    };
    let Some((a, b)) = r.split_once('-') else {
        return Range::Unsatisfiable;
    };
    if size == 0 {
        return Range::Unsatisfiable;
    }
    let (a, b) = (a.trim(), b.trim());
    let parse = |t: &str| t.parse::<u64>().ok();
    match (a.is_empty(), b.is_empty()) {
        (true, false) => match parse(b) {
            Some(n) if n > 0 => Range::Part(size.saturating_sub(n), size),
            _ => Range::Unsatisfiable,
        },
        (false, true) => match parse(a) {
            Some(start) if start < size => Range::Part(start, size),
            _ => Range::Unsatisfiable,
        },
        (false, false) => match (parse(a), parse(b)) {
            (Some(start), Some(end)) if start <= end && start < size => {
                Range::Part(start, end.saturating_add(1).min(size))
            }
            _ => Range::Unsatisfiable,
        },
        (true, true) => Range::Unsatisfiable,
    }
}

/// Streams `link` (a download) with one byte range at most.
async fn serve_download<B>(link: &Path, req: &Request<B>) -> Response<Body> {
    if req.method() != Method::GET && req.method() != Method::HEAD {
        return plain(
            StatusCode::METHOD_NOT_ALLOWED,
            "a download URL takes GET and HEAD",
        );
    }
    let header = |name: &str| {
        req.headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    let (http, azure) = (header("range"), header("x-ms-range"));
    if let (Some(h), Some(a)) = (&http, &azure)
        && h.trim() != a.trim()
    {
        let mut r = plain(
            StatusCode::RANGE_NOT_SATISFIABLE,
            "Range and x-ms-range differ",
        );
        r.headers_mut().insert(
            hyper::header::CONTENT_RANGE,
            "bytes */*".parse().expect("a header value"),
        );
        return r;
    }
    let mut file = match tokio::fs::File::open(link).await {
        Ok(f) => f,
        Err(_) => return plain(StatusCode::NOT_FOUND, "the archive is gone"),
    };
    let Ok(meta) = file.metadata().await else {
        return plain(StatusCode::NOT_FOUND, "the archive is gone");
    };
    let size = meta.len();
    let (status, start, end) = match parse_range(http.or(azure).as_deref(), size) {
        Range::Whole => (StatusCode::OK, 0, size),
        Range::Part(a, b) => (StatusCode::PARTIAL_CONTENT, a, b),
        Range::Unsatisfiable => {
            let mut r = plain(StatusCode::RANGE_NOT_SATISFIABLE, "");
            r.headers_mut().insert(
                hyper::header::CONTENT_RANGE,
                format!("bytes */{size}").parse().expect("a header value"),
            );
            return r;
        }
    };
    let body: Body = if req.method() == Method::HEAD {
        Full::new(Bytes::new())
            .map_err(|never| match never {})
            .boxed()
    } else {
        if let Err(e) = file.seek(SeekFrom::Start(start)).await {
            warn!(error = %e, "cannot seek an Actions cache archive");
            return plain(StatusCode::BAD_GATEWAY, "storage is unavailable");
        }
        {
            let file = file.into_std().await;
            // Read front to back: the kernel may read twice as far ahead
            // (a hint; its failure changes nothing but speed).
            use std::os::fd::AsFd as _;
            let _ = rustix::fs::fadvise(file.as_fd(), 0, None, rustix::fs::Advice::Sequential);
            StreamBody::new(file_frames(file, end - start)).boxed()
        }
    };
    let mut r = Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    let mut set = |name: &'static str, value: String| {
        h.insert(name, value.parse().expect("a header value"));
    };
    set("accept-ranges", "bytes".into());
    set("content-type", "application/octet-stream".into());
    set("content-length", (end - start).to_string());
    set(LOCAL_HEADER, "local".into());
    if let Ok(modified) = meta.modified() {
        let secs = modified
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        set("etag", format!("\"billet-{size}-{secs}\""));
        set("last-modified", httpdate(secs));
    }
    if status == StatusCode::PARTIAL_CONTENT {
        set("content-range", format!("bytes {start}-{}/{size}", end - 1));
    }
    r
}

/// Bytes of one frame of a download, read off the disk in one go.
const DOWNLOAD_FRAME_BYTES: usize = 1 << 20;

/// The next `len` bytes of `file` (from its position) as frames of at most
/// [`DOWNLOAD_FRAME_BYTES`]. Each frame is read on the blocking pool
/// straight into the buffer the frame then owns (nothing is copied after
/// the kernel), and the next frame's read starts as soon as a frame is
/// handed over, so the disk reads one frame ahead while the connection
/// encrypts and sends the last; no read is made for a frame nobody polls
/// for, so a stalled or gone client pins no thread. A file shorter than
/// `len` ends the stream with [`std::io::ErrorKind::UnexpectedEof`] (the
/// response is cut short of its `Content-Length`).
fn file_frames(
    file: std::fs::File,
    len: u64,
) -> impl futures::Stream<Item = std::io::Result<Frame<Bytes>>> + Send {
    let first = (len > 0).then(|| read_frame(file, len));
    futures::stream::try_unfold(first, |pending| async move {
        let Some(pending) = pending else {
            return Ok(None);
        };
        let (file, frame, left) = pending.await.map_err(std::io::Error::other)??;
        let next = (left > 0).then(|| read_frame(file, left));
        Ok(Some((Frame::data(frame), next)))
    })
}

/// One frame of [`file_frames`], `left` bytes still to send: the file, the
/// frame and the bytes left after it.
fn read_frame(
    file: std::fs::File,
    left: u64,
) -> tokio::task::JoinHandle<std::io::Result<(std::fs::File, Bytes, u64)>> {
    // Awaited by the next poll of the stream; a dropped stream abandons at
    // most this one read.
    tokio::task::spawn_blocking(move || {
        use std::io::Read as _;
        let want =
            usize::try_from(left).map_or(DOWNLOAD_FRAME_BYTES, |l| l.min(DOWNLOAD_FRAME_BYTES));
        let mut frame = Vec::with_capacity(want);
        // `read_to_end` reads into the spare capacity without zeroing it
        // first; `take` stops it at the frame's end.
        let n = (&file).take(want as u64).read_to_end(&mut frame)?;
        if n < want {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        Ok((file, Bytes::from(frame), left - n as u64))
    })
}

/// An IMF-fixdate (`Sun, 06 Nov 1994 08:49:37 GMT`) of unix seconds.
fn httpdate(secs: u64) -> String {
    const DAYS: [&str; 7] = ["Thu", "Fri", "Sat", "Sun", "Mon", "Tue", "Wed"];
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let days = secs / 86_400;
    let rem = secs % 86_400;
    // Civil from days (Howard Hinnant's algorithm).
    let z = i64::try_from(days).unwrap_or(0) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!(
        "{}, {d:02} {} {y} {:02}:{:02}:{:02} GMT",
        DAYS[usize::try_from(days % 7).unwrap_or(0)],
        MONTHS[usize::try_from(m - 1).unwrap_or(0)],
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use futures::StreamExt as _;

    fn patterned(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    #[tokio::test]
    async fn a_download_is_read_in_whole_frames_from_the_files_position() {
        let dir = std::env::temp_dir().join(format!("baf-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("archive");
        let bytes = patterned(2 * DOWNLOAD_FRAME_BYTES + 300);
        std::fs::write(&path, &bytes).unwrap();
        let mut file = std::fs::File::open(&path).unwrap();
        std::io::Seek::seek(&mut file, SeekFrom::Start(100)).unwrap();
        let len = bytes.len() as u64 - 100 - 7;
        let frames: Vec<Bytes> = file_frames(file, len)
            .map(|f| f.unwrap().into_data().unwrap())
            .collect()
            .await;
        let sizes: Vec<usize> = frames.iter().map(Bytes::len).collect();
        assert_eq!(
            sizes,
            [DOWNLOAD_FRAME_BYTES, DOWNLOAD_FRAME_BYTES, 300 - 100 - 7]
        );
        assert_eq!(frames.concat(), &bytes[100..bytes.len() - 7]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_download_of_a_file_cut_short_ends_in_an_error_not_a_short_body() {
        let dir = std::env::temp_dir().join(format!("baf-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("archive");
        std::fs::write(&path, patterned(DOWNLOAD_FRAME_BYTES + 10)).unwrap();
        let file = std::fs::File::open(&path).unwrap();
        let items: Vec<std::io::Result<Frame<Bytes>>> =
            file_frames(file, DOWNLOAD_FRAME_BYTES as u64 + 20)
                .collect()
                .await;
        assert_eq!(items.len(), 2);
        assert_eq!(
            items[0].as_ref().unwrap().data_ref().map(Bytes::len),
            Some(DOWNLOAD_FRAME_BYTES)
        );
        assert_eq!(
            items[1].as_ref().unwrap_err().kind(),
            std::io::ErrorKind::UnexpectedEof
        );
        let empty = std::fs::File::open(&path).unwrap();
        assert_eq!(file_frames(empty, 0).count().await, 0);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
