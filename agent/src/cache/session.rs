//! The cache service's guest side: per-instance sessions and the
//! sticky-disk API a guest speaks over them (spec/cache.md §2.2 to §2.4,
//! §2.6).
//!
//! **The listener is a Unix socket per instance**, `cache.sock` in a
//! directory of its own under `<cache dir>/guests/`, which the Docker
//! provider binds into that container alone at [`GUEST_DIR`]: no other
//! container can reach it, nothing on the network can, and on the host only
//! root and the node's user. The session's token is a second factor on top
//! (a socket reached some other way still asks for it).
//!
//! **Credentials.** [`Sessions::prepare`] runs before the compute is
//! created: 32 bytes from the operating system's CSPRNG, hex
//! ([`CacheToken`], whose `Debug` is redacted), handed to the guest once,
//! through its handoff FIFO, as [`TOKEN_ENV`] (beside [`ENDPOINT_ENV`] in
//! its plain environment), never logged or recorded by the engine. The journal keeps its SHA-256, never the token; a request's
//! bearer is hashed and compared with it in constant time. The session is
//! journaled before the compute starts and forgotten, its socket removed,
//! when the compute is proven gone ([`Sessions::close`]); a restarted node
//! listens again for every journaled session ([`Sessions::open`]).
//!
//! **The API** (JSON, at most 8 KiB of body, which must arrive within 10 s
//! of the request's head or it gets 408; each session answers one request
//! at a time once its body is in, a second gets 429; an unauthenticated
//! request gets 401 whatever its path):
//!
//! - `GET /v1/volumes`: what was mounted, per slot (the tier's disks in
//!   order): `{"volumes": [{"slot", "key", "path", "policy", "generation"
//!   (what it was cloned from, null when cold), "cold", "fallback", "told"
//!   (the outcome, once settled)}]}`.
//! - `POST /v1/volumes/{slot}/commit`, body optional `{"job_status":
//!   "success" | "failure" | "cancelled"}` (the runner's `job.status`,
//!   `success` when absent): the guest says it is done writing the disk.
//!   Always 200 with what happened (an [`Told`]): `committed` (`published:
//!   true`, `generation`), `conflict` (`parent`, `head`: another job
//!   committed the key since this one mounted it, under `cas`), `skipped`
//!   (`reason: "job_failed"`: a job that did not succeed publishes
//!   nothing; `reason: "untrusted"`: an untrusted tier's job never
//!   publishes, spec/cache.md §5.1), `fallback` (the disk was an empty fallback after a failed
//!   clone: never published), `unavailable` (the commit failed, `reason:
//!   "cache unavailable"`, or an earlier commit of the disk was cut off by
//!   a node restart before it published, `reason: "interrupted"`; the key
//!   keeps its head; a commit cut off after it published is told
//!   `committed` when asked again). A slot settled already: 409 with what
//!   it was told.
//! - `POST /v1/volumes/{slot}/discard`: never publish this disk; 200
//!   `discarded`.
//! - `POST /v1/docker-store`, body `{"architecture": "amd64"}`: the Docker
//!   image store (slot 0, bound at `/var/lib/docker` before the compute
//!   started): 200 with its slot, path, key, generation and `cold`; 404
//!   without one; 409 for another architecture; 400 for an unusable name.
//! - `POST /v1/docker-store/ready`, body `{"filesystem": {"type", "uuid",
//!   "clean"}}`: the guest stopped its engine and unmounted cleanly. 409
//!   until the node opened settlement ([`Sessions::open_settlement`]:
//!   trusted tier, GitHub said `succeeded`); then 200 `{"ready": true}`,
//!   and the store is published once the compute is gone. A commit of
//!   slot 0 is 403 (spec/cache.md §2.4, §3.3).
//!
//! A disk the guest settles is withdrawn from the end-of-job commit
//! ([`Store::withdraw`]); one it leaves alone is settled at the end by
//! GitHub's result, as before.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use subtle::ConstantTimeEq as _;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::lifecycle::Listed;
use super::store::{CacheError, Committed, Mount, Store};
use crate::journal::{MountJournal, SessionRecord};
use crate::model::LeaseId;

/// The variable that holds the session's token in the guest.
pub const TOKEN_ENV: &str = "BILLET_CACHE_TOKEN";
/// The variable that holds the service's address in the guest:
/// `unix:<GUEST_DIR>/<SOCKET_NAME>`.
pub const ENDPOINT_ENV: &str = "BILLET_CACHE_ENDPOINT";
/// Where the guest sees its session's directory.
pub use crate::model::disk::GUEST_DIR;
/// The socket's name in that directory.
pub(crate) const SOCKET_NAME: &str = "cache.sock";

/// The longest a Unix socket's path may be on Linux (`sun_path` less its
/// terminating NUL), in bytes.
pub(crate) const SOCKET_PATH_MAX: usize = 107;

/// Checks that the guests' sockets under `cache_dir`
/// (`<cache_dir>/guests/<8 hex>/cache.sock`) fit a socket's path, so a
/// node does not start and then give every job no cache API (a
/// `--cache-dir` too long would pass `billet check` and start the node,
/// and every launch would then log that its session could not listen).
///
/// # Errors
///
/// [`CacheError::Open`] naming the directory, the length and the limit.
pub(crate) fn check_socket_room(cache_dir: &Path) -> Result<(), CacheError> {
    let socket = cache_dir.join("guests").join("00000000").join(SOCKET_NAME);
    let length = socket.as_os_str().len();
    if length > SOCKET_PATH_MAX {
        return Err(CacheError::Open {
            path: cache_dir.to_owned(),
            message: format!(
                "is too long for the guests' cache sockets: {} is {length} bytes, and a socket's path is at most {SOCKET_PATH_MAX}; give --cache-dir a path of at most {} bytes",
                socket.display(),
                SOCKET_PATH_MAX - (length - cache_dir.as_os_str().len())
            ),
        });
    }
    Ok(())
}
/// The most bytes of a request body.
pub(crate) const MAX_BODY: usize = 8 * 1024;

/// How long a request's body may take to arrive once its head has: 10 s,
/// then 408. A guest's bodies are at most [`MAX_BODY`] and sent at once.
pub(crate) const BODY_PATIENCE: std::time::Duration = std::time::Duration::from_secs(10);

/// The value of [`ENDPOINT_ENV`].
#[must_use]
pub(crate) fn guest_endpoint() -> String {
    format!("unix:{GUEST_DIR}/{SOCKET_NAME}")
}

/// A session's credential: 64 lowercase hex digits of 32 random bytes.
/// Its `Debug` is redacted; [`CacheToken::expose`] is for the provider,
/// which hands it to the guest's environment.
#[derive(Clone, PartialEq, Eq)]
pub struct CacheToken(String);

impl CacheToken {
    /// A new token from the operating system's CSPRNG.
    ///
    /// # Errors
    ///
    /// [`CacheError::Io`] when the system has no randomness to give.
    pub fn mint() -> Result<Self, CacheError> {
        let mut bytes = [0u8; 32];
        getrandom::getrandom(&mut bytes).map_err(|e| CacheError::Io {
            op: "draw random bytes for",
            path: PathBuf::from("a cache session token"),
            source: std::io::Error::other(e.to_string()),
        })?;
        Ok(Self(bytes.iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// The token's text, for the guest's environment and nothing else.
    #[must_use]
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for CacheToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("CacheToken(<redacted>)")
    }
}

fn digest(token: &[u8]) -> [u8; 32] {
    Sha256::digest(token).into()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// What a guest was told about one of its disks.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Told {
    /// `committed`, `conflict`, `skipped`, `fallback`, `unavailable` or
    /// `discarded`.
    pub outcome: String,
    /// The disk's contents are the key's head now.
    pub published: bool,
    /// The new generation, when published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub generation: Option<u64>,
    /// Why not, when not published.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// A conflict: the generation the disk was cloned from (null: cold).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parent: Option<u64>,
    /// A conflict: the key's head when the disk was committed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub head: Option<u64>,
}

impl Told {
    fn not(outcome: &str, reason: &str) -> Self {
        Self {
            outcome: outcome.to_owned(),
            published: false,
            generation: None,
            reason: Some(reason.to_owned()),
            parent: None,
            head: None,
        }
    }
}

/// One of a session's disks, as journaled (JSON in the session's row).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct Slot {
    /// The store's mount id.
    pub mount: String,
    /// The disk's key.
    pub key: String,
    /// Where the guest sees it.
    pub path: String,
    /// `cas` or `last-writer-wins`.
    pub policy: String,
    /// What it was cloned from; `None`: cold or a fallback.
    pub parent: Option<u64>,
    /// An empty directory after a failed clone, never published.
    pub fallback: bool,
    /// What the guest was told, once it settled the disk.
    pub told: Option<Told>,
    /// The session's tier is untrusted: the disk never publishes, and a
    /// commit is told `skipped`, reason `untrusted` (spec/cache.md §5.1).
    /// Absent from a record written before trust classes (every such tier
    /// was trusted).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub untrusted: bool,
    /// The Docker image store (slot 0, at [`crate::cache::DOCKER_STORE_PATH`]):
    /// published only by its settlement, never by a commit.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub docker: Option<DockerStore>,
}

/// The Docker image store's slot: its architecture and its settlement
/// (spec/cache.md §3.3), journaled with the session.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(crate) struct DockerStore {
    /// What it is keyed by (`docker-images/<architecture>`).
    pub architecture: String,
    /// The node opened settlement ([`Sessions::open_settlement`]): the tier
    /// is trusted and GitHub's result is `succeeded`.
    #[serde(default)]
    pub settling: bool,
    /// The guest's clean-unmount proof, once it said it is ready.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ready: Option<Proof>,
}

/// A guest's word that it unmounted a filesystem cleanly (the reference's
/// `{"type", "uuid", "clean"}`). On a bind-mounted directory the node
/// cannot check it: it is the guest's statement that its Docker engine
/// stopped and flushed, not an authority (the tier's trust and GitHub's
/// result are).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct Proof {
    /// The filesystem's type, e.g. `ext4`, or `dir` for a directory.
    #[serde(rename = "type")]
    pub kind: String,
    /// Its UUID, or any identifier the guest has for it.
    pub uuid: String,
    /// It was unmounted cleanly.
    pub clean: bool,
}

impl Proof {
    /// Non-blank type and uuid, and clean.
    #[must_use]
    pub(crate) fn valid(&self) -> bool {
        !self.kind.trim().is_empty() && !self.uuid.trim().is_empty() && self.clean
    }
}

impl Slot {
    /// The slot of a disk mounted at `path`.
    #[must_use]
    pub(crate) fn of(mount: &Mount, key: &str, path: &str, policy: &str) -> Self {
        Self {
            mount: mount.id.clone(),
            key: key.to_owned(),
            path: path.to_owned(),
            policy: policy.to_owned(),
            parent: mount.parent.map(|g| g.0),
            fallback: !mount.committable,
            told: None,
            untrusted: false,
            docker: None,
        }
    }
}

/// A prepared session: what the provider hands the guest.
#[derive(Debug)]
pub struct Prepared {
    /// The credential, for [`TOKEN_ENV`].
    pub token: CacheToken,
    /// The host directory to bind at [`GUEST_DIR`].
    pub dir: PathBuf,
}

#[derive(Debug)]
struct Session {
    lease: String,
    digest: [u8; 32],
    since_unix_ms: i64,
    slots: tokio::sync::Mutex<Vec<Slot>>,
    busy: AtomicBool,
    store: Arc<Store>,
    journal: Arc<dyn MountJournal>,
}

impl Session {
    fn record(&self, slots: &[Slot]) -> SessionRecord {
        SessionRecord {
            lease: self.lease.clone(),
            token_sha256: hex(&self.digest),
            slots: serde_json::to_string(slots).expect("slots serialise"),
            since_unix_ms: self.since_unix_ms,
        }
    }
}

#[derive(Debug)]
struct Live {
    stop: CancellationToken,
    dir: PathBuf,
    session: Arc<Session>,
}

/// The node's guest sessions, one per instance that has sticky disks.
#[derive(Debug)]
pub struct Sessions {
    store: Arc<Store>,
    root: PathBuf,
    journal: Arc<dyn MountJournal>,
    live: std::sync::Mutex<HashMap<String, Live>>,
}

impl Sessions {
    /// The sessions of `store`'s node, listening again for every session
    /// its journal names (a restarted node). A session that cannot listen
    /// is logged; its guest goes without the API.
    pub async fn open(store: Arc<Store>) -> Arc<Self> {
        let root = store.dir().join("guests");
        let journal = store.journal();
        let sessions = Arc::new(Self {
            store,
            root,
            journal,
            live: std::sync::Mutex::new(HashMap::new()),
        });
        let records = match sessions.journal.sessions().await {
            Ok(r) => r,
            Err(e) => {
                warn!(error = %e, "cannot read the cache sessions from the journal; their guests go without the cache API");
                Vec::new()
            }
        };
        for record in records {
            let (Some(digest), Ok(slots)) = (
                unhex(&record.token_sha256),
                serde_json::from_str::<Vec<Slot>>(&record.slots),
            ) else {
                warn!(lease = %record.lease, "a journaled cache session is unreadable; its guest goes without the cache API");
                continue;
            };
            let session = Arc::new(Session {
                lease: record.lease.clone(),
                digest,
                since_unix_ms: record.since_unix_ms,
                slots: tokio::sync::Mutex::new(slots),
                busy: AtomicBool::new(false),
                store: sessions.store.clone(),
                journal: sessions.journal.clone(),
            });
            if let Err(e) = sessions.listen(session) {
                warn!(lease = %record.lease, error = %e, "cannot listen again for a cache session; its guest goes without the cache API");
            }
        }
        sessions
    }

    fn dir_of(&self, lease: &str) -> PathBuf {
        // Short: a socket's path is at most 107 bytes.
        self.root.join(&hex(&digest(lease.as_bytes()))[..8])
    }

    /// Prepares `lease`'s session before its compute starts: a token,
    /// the journal's record, the socket listening.
    ///
    /// # Errors
    ///
    /// [`CacheError`] when the token, the directory, the socket or the
    /// journal fails: the job then goes without the API (its disks are
    /// still settled at its end).
    pub(crate) async fn prepare(
        &self,
        lease: &LeaseId,
        slots: Vec<Slot>,
    ) -> Result<Prepared, CacheError> {
        let token = CacheToken::mint()?;
        let session = Arc::new(Session {
            lease: lease.as_str().to_owned(),
            digest: digest(token.expose().as_bytes()),
            since_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX)),
            slots: tokio::sync::Mutex::new(slots),
            busy: AtomicBool::new(false),
            store: self.store.clone(),
            journal: self.journal.clone(),
        });
        let record = session.record(&session.slots.lock().await);
        self.journal.put_session(&record).await?;
        match self.listen(session) {
            Ok(dir) => Ok(Prepared { token, dir }),
            Err(e) => {
                let _ = self.journal.forget_session(lease.as_str()).await;
                Err(e)
            }
        }
    }

    fn listen(&self, session: Arc<Session>) -> Result<PathBuf, CacheError> {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = self.dir_of(&session.lease);
        let socket = dir.join(SOCKET_NAME);
        let made = (|| {
            std::fs::create_dir_all(&dir)?;
            std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755))?;
            match std::fs::remove_file(&socket) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
                _ => {}
            }
            let listener = tokio::net::UnixListener::bind(&socket)?;
            // The directory is bound into one container only; whichever
            // user the guest runs as may connect.
            std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o666))?;
            Ok(listener)
        })();
        let listener = made.map_err(|source| CacheError::Io {
            op: if socket.as_os_str().len() > SOCKET_PATH_MAX {
                "listen on (a socket's path is at most 107 bytes: use a shorter --cache-dir)"
            } else {
                "listen on"
            },
            path: socket.clone(),
            source,
        })?;
        let stop = CancellationToken::new();
        let lease = session.lease.clone();
        if let Some(old) = self.live.lock().expect("sessions").insert(
            lease.clone(),
            Live {
                stop: stop.clone(),
                dir: dir.clone(),
                session: session.clone(),
            },
        ) {
            old.stop.cancel();
        }
        tokio::spawn(serve(listener, session, stop));
        info!(%lease, "cache session listening");
        Ok(dir)
    }

    /// Closes `lease`'s session once its compute is proven gone: the
    /// socket goes, every connection is cut, the journal forgets it, and
    /// its token is never accepted again.
    pub(crate) async fn close(&self, lease: &LeaseId) {
        let live = self.live.lock().expect("sessions").remove(lease.as_str());
        let Some(live) = live else {
            return;
        };
        live.stop.cancel();
        if let Err(e) = std::fs::remove_dir_all(&live.dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            warn!(%lease, error = %e, "cannot remove the cache session's directory");
        }
        if let Err(e) = self.journal.forget_session(lease.as_str()).await {
            warn!(%lease, error = %e, "cannot forget the cache session in the journal; a restart listens for it until it is closed");
        }
        info!(%lease, "cache session closed");
    }

    /// Opens the settlement of `lease`'s Docker image store (spec/cache.md
    /// §3.3, `SettleDocker`): called by the runner when GitHub's result is
    /// `succeeded`, before the compute is removed. From then on the guest
    /// may say it is ready (`POST /v1/docker-store/ready`), which marks the
    /// store to be published once the compute is proven gone. Journaled.
    /// Returns whether settlement is open: false without a session, without
    /// an image store, for an untrusted tier, or for a store its guest
    /// discarded.
    pub(crate) async fn open_settlement(&self, lease: &LeaseId) -> bool {
        let session = self
            .live
            .lock()
            .expect("sessions")
            .get(lease.as_str())
            .map(|l| l.session.clone());
        let Some(session) = session else {
            return false;
        };
        let mut slots = session.slots.lock().await;
        let Some(slot) = slots
            .iter_mut()
            .find(|s| s.docker.is_some() && !s.untrusted && s.told.is_none())
        else {
            return false;
        };
        let docker = slot.docker.as_mut().expect("found by its store");
        if !docker.settling {
            docker.settling = true;
            if let Err(e) = session.journal.put_session(&session.record(&slots)).await {
                warn!(%lease, error = %e, "cannot journal that the Docker image store's settlement opened; a restart forgets it and the store is discarded");
            }
            info!(%lease, "Docker image store settlement opened; waiting for its guest to say it is ready");
        }
        true
    }

    /// Closes the session of every lease `listed` proves has no compute:
    /// what a restarted node's journal names for compute it no longer has
    /// (spec/cache.md §3.2 `ReconcileInventory`; only a successful
    /// inventory makes a [`Listed`]).
    pub(crate) async fn reconcile(&self, listed: &Listed) {
        let stale: Vec<String> = self
            .live
            .lock()
            .expect("sessions")
            .keys()
            .filter(|l| !listed.may_run(l))
            .cloned()
            .collect();
        for lease in stale {
            if let Ok(lease) = LeaseId::parse("cache.session.lease", &lease) {
                self.close(&lease).await;
            }
        }
    }

    /// The leases with an open session.
    #[must_use]
    #[cfg(test)]
    pub(crate) fn open_leases(&self) -> Vec<String> {
        let mut leases: Vec<String> = self
            .live
            .lock()
            .expect("sessions")
            .keys()
            .cloned()
            .collect();
        leases.sort();
        leases
    }
}

impl Drop for Sessions {
    fn drop(&mut self) {
        for live in self.live.lock().expect("sessions").values() {
            live.stop.cancel();
        }
    }
}

/// Most connections one cache session's socket holds open at once; past it
/// a new one is closed at once ([`crate::listen::ConnectionCap`]). The
/// session answers one request at a time, so a well guest needs one or two;
/// the cap keeps a guest from taking the node's file descriptors.
pub(crate) const MAX_SESSION_CONNECTIONS: usize = 8;

/// Serves the session's socket until `stop`, at most
/// [`MAX_SESSION_CONNECTIONS`] connections open; a failed accept (out of
/// descriptors) backs off and is logged at a bounded rate, and the socket
/// goes on serving (a socket that stopped would end the guest's cache API
/// for good).
async fn serve(listener: tokio::net::UnixListener, session: Arc<Session>, stop: CancellationToken) {
    use crate::listen::{AcceptErrors, AtCap, ConnectionCap};
    let cap = ConnectionCap::new("cache_session", MAX_SESSION_CONNECTIONS, AtCap::Refuse);
    let mut errors = AcceptErrors::new("cache_session");
    loop {
        let stream = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    errors.back_off(&e).await;
                    continue;
                }
            },
        };
        errors.accepted();
        let Some(admitted) = cap.admit() else {
            continue;
        };
        let session = session.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _admitted = admitted;
            let service = hyper::service::service_fn(move |req| {
                let session = session.clone();
                async move { Ok::<_, Infallible>(handle(session, req).await) }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .max_buf_size(16 * 1024)
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                () = stop.cancelled() => {}
                _ = connection => {}
            }
        });
    }
}

fn json(status: StatusCode, body: &impl Serialize) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(
        serde_json::to_vec(body).expect("answers serialise"),
    )));
    *response.status_mut() = status;
    response.headers_mut().insert(
        hyper::header::CONTENT_TYPE,
        hyper::header::HeaderValue::from_static("application/json"),
    );
    response
}

fn error(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    json(status, &serde_json::json!({ "error": message }))
}

/// The request's bearer token matches the session's, in constant time.
fn authorised(session: &Session, req: &Request<Incoming>) -> bool {
    let Some(value) = req.headers().get(hyper::header::AUTHORIZATION) else {
        return false;
    };
    let Some(token) = value.as_bytes().strip_prefix(b"Bearer ") else {
        return false;
    };
    if token.is_empty() || token.iter().any(|b| b" ,\t\r\n".contains(b)) {
        return false;
    }
    bool::from(digest(token).ct_eq(&session.digest))
}

/// The session's one request in progress; the next is admitted once this
/// is dropped (with the request's handler, or with a settlement that
/// outlives it).
struct Admitted(Arc<Session>);

impl Drop for Admitted {
    fn drop(&mut self) {
        self.0.busy.store(false, Ordering::Release);
    }
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct CommitBody {
    #[serde(default)]
    job_status: Option<String>,
}

async fn handle(owned: Arc<Session>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let session = owned.as_ref();
    if !authorised(session, &req) {
        return error(StatusCode::UNAUTHORIZED, "unauthorised cache session");
    }
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    // The body before the session is taken, bounded in size and in time:
    // a request whose body stalls (a Content-Length never sent) holds
    // its own connection, not the guest's other requests.
    let body = match tokio::time::timeout(
        BODY_PATIENCE,
        Limited::new(req.into_body(), MAX_BODY).collect(),
    )
    .await
    {
        Ok(Ok(b)) => b.to_bytes(),
        Ok(Err(_)) => {
            return error(
                StatusCode::BAD_REQUEST,
                "the body is unreadable or longer than 8 KiB",
            );
        }
        Err(_) => {
            return error(
                StatusCode::REQUEST_TIMEOUT,
                &format!(
                    "the body did not arrive within {} s; send the whole request at once",
                    BODY_PATIENCE.as_secs()
                ),
            );
        }
    };
    if session.busy.swap(true, Ordering::AcqRel) {
        return error(
            StatusCode::TOO_MANY_REQUESTS,
            "this session is answering another request; send one at a time",
        );
    }
    let admitted = Admitted(owned.clone());
    let parts: Vec<&str> = path.split('/').collect();
    match (method, parts.as_slice()) {
        (Method::GET, ["", "v1", "volumes"]) => list(session).await,
        (Method::POST, ["", "v1", "volumes", slot, action @ ("commit" | "discard")]) => {
            let Some(slot) = parse_slot(slot) else {
                return error(StatusCode::NOT_FOUND, "no such cache slot");
            };
            let body: CommitBody = if body.iter().all(u8::is_ascii_whitespace) {
                CommitBody::default()
            } else {
                match serde_json::from_slice(&body) {
                    Ok(b) => b,
                    Err(e) => {
                        return error(
                            StatusCode::BAD_REQUEST,
                            &format!(
                                "the body must be {{\"job_status\": \"success\"|\"failure\"|\"cancelled\"}}: {e}"
                            ),
                        );
                    }
                }
            };
            if *action == "discard" && body.job_status.is_some() {
                return error(StatusCode::BAD_REQUEST, "a discard takes no job_status");
            }
            // Its own task: a guest that hangs up mid-commit (a client
            // timeout shorter than the clone) does not cut the commit off
            // half done, with the mount withdrawn and its staging clone
            // left behind. The session stays busy until it is settled, and
            // a retry then learns what it was told.
            let commit = *action == "commit";
            let session = owned.clone();
            let settled = tokio::spawn(async move {
                let _admitted = admitted;
                settle(&session, slot, commit, body.job_status.as_deref()).await
            });
            settled.await.unwrap_or_else(|_| {
                error(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "the settlement failed; list the volumes to see what the disk was told",
                )
            })
        }
        (Method::POST, ["", "v1", "docker-store"]) => match serde_json::from_slice(&body) {
            Ok(body) => docker_store(session, body).await,
            Err(e) => unfit(&e),
        },
        (Method::POST, ["", "v1", "docker-store", "ready"]) => {
            match serde_json::from_slice(&body) {
                Ok(body) => docker_ready(session, body).await,
                Err(e) => unfit(&e),
            }
        }
        _ => error(StatusCode::NOT_FOUND, "no such cache API route"),
    }
}

/// 400 for a body that is not what its route takes (the structs refuse
/// unknown fields).
fn unfit(e: &serde_json::Error) -> Response<Full<Bytes>> {
    error(
        StatusCode::BAD_REQUEST,
        &format!("the body is not what this route takes: {e}"),
    )
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DockerStoreBody {
    architecture: String,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ReadyBody {
    filesystem: Proof,
}

/// `POST /v1/docker-store` (spec/cache.md §2.4): the guest asks for its
/// Docker image store. The node bound it before the compute started (a
/// bind mount cannot be added to a running container), so this tells the
/// guest what it has: 200 with the slot, the path, the generation it was
/// cloned from and whether it is cold; 404 when the tier has none; 409
/// when it is keyed by another architecture than the guest's.
async fn docker_store(session: &Session, body: DockerStoreBody) -> Response<Full<Bytes>> {
    if !crate::cache::valid_architecture(&body.architecture) {
        return error(
            StatusCode::BAD_REQUEST,
            "architecture must be 1 to 64 letters, digits, '.', '_' or '-', starting with a letter or digit, such as \"amd64\"",
        );
    }
    let slots = session.slots.lock().await;
    let Some((i, slot, docker)) = slots
        .iter()
        .enumerate()
        .find_map(|(i, s)| s.docker.as_ref().map(|d| (i, s, d)))
    else {
        return error(
            StatusCode::NOT_FOUND,
            "this job's tier has no Docker image store",
        );
    };
    if docker.architecture != body.architecture {
        return json(
            StatusCode::CONFLICT,
            &serde_json::json!({
                "error": "this node's Docker image store is for another architecture",
                "architecture": docker.architecture,
            }),
        );
    }
    json(
        StatusCode::OK,
        &serde_json::json!({
            "slot": i,
            "path": slot.path,
            "key": slot.key,
            "generation": slot.parent,
            "cold": slot.parent.is_none() && !slot.fallback,
            "fallback": slot.fallback,
        }),
    )
}

/// `POST /v1/docker-store/ready` (spec/cache.md §2.4, §3.3): the guest
/// stopped its Docker engine and proves a clean unmount. 400 for a proof
/// that is not one; 404 without an image store (or one its guest
/// discarded); 409 until the node opened settlement (so a guest cannot
/// force publication); 503 when the mark cannot be journaled; else the
/// store is marked to be published once the compute is proven gone, and
/// 200 `{"ready": true}`.
async fn docker_ready(session: &Session, body: ReadyBody) -> Response<Full<Bytes>> {
    if !body.filesystem.valid() {
        return error(
            StatusCode::BAD_REQUEST,
            "the filesystem proof needs a non-blank type and uuid and clean: true",
        );
    }
    let mut slots = session.slots.lock().await;
    let Some(i) = slots
        .iter()
        .position(|s| s.docker.is_some() && s.told.is_none())
    else {
        return error(
            StatusCode::NOT_FOUND,
            "this job has no Docker image store to settle",
        );
    };
    let settling = slots[i].docker.as_ref().is_some_and(|d| d.settling);
    if !settling {
        return error(
            StatusCode::CONFLICT,
            "the node has not opened settlement: it does once GitHub says a trusted tier's job succeeded; ask again",
        );
    }
    let lease = &session.lease;
    if let Err(e) = session.store.mark_mount_succeeded(&slots[i].mount).await {
        warn!(%lease, error = %e, "cannot mark the Docker image store for publication");
        return error(StatusCode::SERVICE_UNAVAILABLE, "cache unavailable");
    }
    if let Some(docker) = slots[i].docker.as_mut() {
        docker.ready = Some(body.filesystem);
    }
    if let Err(e) = session.journal.put_session(&session.record(&slots)).await {
        warn!(%lease, error = %e, "cannot journal the guest's readiness; the store is marked for publication all the same");
    }
    info!(%lease, "the guest said its Docker image store is ready; it is published once the compute is gone");
    json(StatusCode::OK, &serde_json::json!({ "ready": true }))
}

/// A slot number: decimal digits only (no sign, no leading zero).
fn parse_slot(text: &str) -> Option<usize> {
    if text.is_empty()
        || !text.bytes().all(|b| b.is_ascii_digit())
        || (text.len() > 1 && text.starts_with('0'))
    {
        return None;
    }
    text.parse().ok()
}

async fn list(session: &Session) -> Response<Full<Bytes>> {
    let slots = session.slots.lock().await;
    let volumes: Vec<serde_json::Value> = slots
        .iter()
        .enumerate()
        .map(|(i, s)| {
            serde_json::json!({
                "slot": i,
                "key": s.key,
                "path": s.path,
                "policy": s.policy,
                "generation": s.parent,
                "cold": s.parent.is_none() && !s.fallback,
                "fallback": s.fallback,
                "told": s.told,
                "docker": s.docker.is_some(),
            })
        })
        .collect();
    json(StatusCode::OK, &serde_json::json!({ "volumes": volumes }))
}

async fn settle(
    session: &Session,
    slot: usize,
    commit: bool,
    job_status: Option<&str>,
) -> Response<Full<Bytes>> {
    // Not held across the commit's clone: the node's own calls into the
    // session (`open_settlement` from a Destroy in the command slot) must
    // not wait for a guest's clone. One settlement at a time per session
    // (`busy`), so the slot is not settled twice meanwhile.
    let s = {
        let slots = session.slots.lock().await;
        match slots.get(slot).cloned() {
            Some(s) => s,
            None => return error(StatusCode::NOT_FOUND, "cache slot is not attached"),
        }
    };
    if commit && s.docker.is_some() {
        return error(
            StatusCode::FORBIDDEN,
            "the Docker image store is published by the node from GitHub's result and the guest's readiness, never by a commit",
        );
    }
    if let Some(told) = &s.told {
        return json(
            StatusCode::CONFLICT,
            &serde_json::json!({ "error": "this disk was settled already", "told": told }),
        );
    }
    let status = job_status.unwrap_or("success");
    if !matches!(status, "success" | "failure" | "cancelled") {
        return error(
            StatusCode::BAD_REQUEST,
            "job_status must be \"success\", \"failure\" or \"cancelled\"",
        );
    }
    let lease = &session.lease;
    let told = if !commit || s.untrusted || status != "success" || s.fallback {
        if let Err(e) = session.store.withdraw(&s.mount).await {
            warn!(%lease, slot, error = %e, "cannot withdraw the sticky disk from publication");
        }
        if !commit {
            Told::not("discarded", "discarded")
        } else if s.untrusted {
            Told::not("skipped", "untrusted")
        } else if s.fallback {
            Told::not("fallback", "fallback")
        } else {
            Told::not("skipped", "job_failed")
        }
    } else {
        match session.store.commit_now(&s.mount).await {
            Ok(Committed::Published(g)) => Told {
                outcome: "committed".into(),
                published: true,
                generation: Some(g.0),
                reason: None,
                parent: None,
                head: None,
            },
            Ok(Committed::Conflict { parent, head }) => Told {
                parent: parent.map(|g| g.0),
                head: head.map(|g| g.0),
                ..Told::not("conflict", "conflict")
            },
            // Withdrawn, yet no fallback (a fallback was answered above)
            // and nothing published from it: a commit of this disk began
            // before a node restart cut it off (the guest was never told),
            // and did not publish.
            Ok(Committed::NotCommittable) => Told::not("unavailable", "interrupted"),
            Err(_) => Told::not("unavailable", "cache unavailable"),
        }
    };
    info!(%lease, slot, key = %s.key, outcome = %told.outcome, "sticky disk settled by its guest");
    let mut slots = session.slots.lock().await;
    slots[slot].told = Some(told.clone());
    if let Err(e) = session.journal.put_session(&session.record(&slots)).await {
        warn!(%lease, error = %e, "cannot journal what the guest was told");
    }
    json(StatusCode::OK, &told)
}

#[cfg(test)]
mod tests;
