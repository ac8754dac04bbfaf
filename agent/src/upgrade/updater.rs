//! `billet host-upgrade`: the updater. It replaces this host's `billet`
//! with an exact release, transactionally: the swap either completes (the
//! new release serving, healthy, at its version) or is rolled back to the
//! previous binary, and no running job is lost (the node drains, and what
//! still runs when the drain ends is adopted by the next process).
//!
//! Reference behaviour: spec/node.md §6 (the writer side of the ack) and
//! seed/node-package.md (`Upgrader`); the release source, the fence, the
//! host claim and the journal are this project's (ARCHITECTURE.md,
//! "The updater").
//!
//! Order of work, each step journalled in `<state_dir>/upgrade/` before the
//! next begins:
//!
//! 1. Checks that refuse with nothing touched: the instruction's fields,
//!    the host claim (an exclusive lock, one upgrade at a time), an
//!    interrupted earlier upgrade (settled first), the fence (a stale
//!    generation of the same rollout), the release (manifest against the
//!    pinned digest, binary against the manifest, the binary's own
//!    `--version`). Then, and only then, `accepted`.
//! 2. Stop the node through the service manager (it drains: no new
//!    launches, running jobs finish or are left for the next process).
//! 3. Swap: the installed binary is hard-linked to `<install>.previous`,
//!    then the staged release is renamed over it (atomic).
//! 4. Start the node and wait until its local socket (`local.rs`) reports
//!    it healthy at the new version: serving, recovered (the plane has
//!    attached and read its `Hello`), not draining.
//! 5. On failure after the swap: stop, restore the previous binary (again
//!    by rename), start it, and record why.
//!
//! An updater that stops midway leaves its journal behind and its lock
//! released (the kernel drops it). It is settled by whoever comes next: the
//! updater itself on SIGTERM, its transient unit's `ExecStopPost` running
//! [`settle_interrupted`] (`host-upgrade --settle`), the next `host-upgrade`,
//! or the next `billet node` start ([`settle_at_node_start`]). The installed
//! binary decides, not the recorded step: a swap never proven healthy is
//! rolled back, so the host ends on one version, deterministically.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};
use thiserror::Error;
use tracing::{error, info, warn};

use crate::upgrade::dispatch::AckWriter;
use crate::upgrade::release::{self, Source};

/// The updater's directory inside the node's state directory.
pub const DIR: &str = "upgrade";
/// The journal of the current (or last) upgrade, inside [`DIR`].
pub const JOURNAL_FILE: &str = "journal.json";
/// The host claim, inside [`DIR`]: held (`flock`) for the updater's life.
pub const LOCK_FILE: &str = "lock";

/// One line per step of every upgrade, inside [`DIR`].
pub(crate) const HISTORY_FILE: &str = "history.log";

/// How long a started node gets to report healthy by default, in seconds.
pub(crate) const DEFAULT_HEALTH_TIMEOUT_SECS: u64 = 300;

/// The updater's configuration, read from the TOML file the node passes as
/// `--config` (`--upgrade-config` on `billet node`;
/// `deploy/upgrade.toml.example`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct UpgradeConfig {
    /// An absolute directory or an `https://` URL (`release.rs`).
    pub release_source: String,
    /// A PEM bundle to trust for an `https://` source besides the system
    /// roots.
    #[serde(default)]
    pub release_ca: Option<PathBuf>,
    /// The binary the node's service runs; replaced by rename.
    #[serde(default = "default_install_path")]
    pub install_path: PathBuf,
    /// The node's `--state-dir`: the journal, the lock and the node's local
    /// socket live there.
    #[serde(default = "default_state_dir")]
    pub state_dir: PathBuf,
    /// The node's systemd unit; stopped and started with `systemctl`.
    #[serde(default)]
    pub systemd_unit: Option<String>,
    /// Instead of a unit: a command (argv) that stops the node and returns
    /// once it has exited.
    #[serde(default)]
    pub stop_command: Option<Vec<String>>,
    /// Instead of a unit: a command (argv) that starts the node.
    #[serde(default)]
    pub start_command: Option<Vec<String>>,
    /// Seconds a started node gets to report healthy.
    #[serde(default = "default_health_timeout_secs")]
    pub health_timeout_secs: u64,
}

fn default_install_path() -> PathBuf {
    PathBuf::from("/usr/local/bin/billet")
}

fn default_state_dir() -> PathBuf {
    PathBuf::from("/var/lib/billet")
}

fn default_health_timeout_secs() -> u64 {
    DEFAULT_HEALTH_TIMEOUT_SECS
}

/// How the node's service is stopped and started.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Service {
    /// `systemctl stop|start <unit>`.
    Systemd(String),
    /// Operator-given commands.
    Commands {
        /// Stops the node; returns once it has exited.
        stop: Vec<String>,
        /// Starts the node.
        start: Vec<String>,
    },
}

impl UpgradeConfig {
    /// Reads and checks the file.
    ///
    /// # Errors
    ///
    /// A sentence naming the file and the key to fix.
    pub fn load(path: &Path) -> Result<Self, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("upgrade configuration {}: cannot read: {e}", path.display()))?;
        // The parser's message quotes the offending line, which may be the
        // release source with credentials in it: say where, not what.
        let config: Self = toml::from_str(&text).map_err(|e| {
            let at = e
                .span()
                .map(|span| {
                    let line = text
                        .get(..span.start)
                        .map_or(1, |before| before.matches('\n').count() + 1);
                    format!(" at line {line}")
                })
                .unwrap_or_default();
            format!(
                "upgrade configuration {}{at}: {}",
                path.display(),
                e.message()
            )
        })?;
        config
            .check()
            .map_err(|e| format!("upgrade configuration {}: {e}", path.display()))?;
        Ok(config)
    }

    fn check(&self) -> Result<(), String> {
        if !self.install_path.is_absolute() {
            return Err("install_path must be an absolute path".into());
        }
        if !self.state_dir.is_absolute() {
            return Err("state_dir must be an absolute path".into());
        }
        if self.health_timeout_secs == 0 {
            return Err("health_timeout_secs must be at least 1".into());
        }
        if std::fs::symlink_metadata(&self.install_path).is_ok_and(|m| m.file_type().is_symlink()) {
            return Err(format!(
                "install_path {} is a symbolic link; name the binary itself, which is replaced by rename",
                self.install_path.display()
            ));
        }
        if let Some(ca) = &self.release_ca
            && !ca.is_absolute()
        {
            return Err(format!(
                "release_ca {} must be an absolute path",
                ca.display()
            ));
        }
        Source::parse(&self.release_source, self.release_ca.as_deref())
            .map_err(|e| format!("release_source: {e}"))?;
        let service = self.service()?;
        if let Service::Commands { stop, start } = &service {
            for (key, argv) in [("stop_command", stop), ("start_command", start)] {
                if !Path::new(&argv[0]).is_absolute() {
                    return Err(format!(
                        "{key}[0] {:?} must be an absolute path to an executable",
                        argv[0]
                    ));
                }
            }
        }
        Ok(())
    }

    /// Checks this configuration against the node that names it: the same
    /// state directory (where the journal, lock and local socket live).
    ///
    /// # Errors
    ///
    /// A sentence naming both values.
    pub(crate) fn check_for_node(&self, node_state_dir: &Path) -> Result<(), String> {
        if self.state_dir != node_state_dir {
            return Err(format!(
                "state_dir is {} but the node's --state-dir is {}; they must be the same directory",
                self.state_dir.display(),
                node_state_dir.display()
            ));
        }
        Ok(())
    }

    /// The service manager to drive.
    ///
    /// # Errors
    ///
    /// When neither or both of `systemd_unit` and the command pair are set.
    pub(crate) fn service(&self) -> Result<Service, String> {
        match (&self.systemd_unit, &self.stop_command, &self.start_command) {
            (Some(unit), None, None) if !unit.is_empty() => Ok(Service::Systemd(unit.clone())),
            (None, Some(stop), Some(start)) if !stop.is_empty() && !start.is_empty() => {
                Ok(Service::Commands {
                    stop: stop.clone(),
                    start: start.clone(),
                })
            }
            _ => Err("set either systemd_unit, or both stop_command and start_command (non-empty argv arrays), to say how the node is stopped and started".into()),
        }
    }

    fn health_timeout(&self) -> Duration {
        Duration::from_secs(self.health_timeout_secs)
    }
}

/// One instruction: what `StartUpgrade` carried.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Request {
    /// The exact release.
    pub version: String,
    /// The manifest's pinned SHA-256, when the rollout pinned one.
    pub manifest_sha256: Option<String>,
    /// The rollout.
    pub rollout: Option<String>,
    /// The rollout's generation.
    pub generation: Option<u64>,
}

/// The steps of one upgrade, in order. `Done`, `RolledBack`, `Failed` and
/// `Abandoned` are final.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "step", rename_all = "snake_case")]
pub enum Step {
    /// Every check passed and the node was told `accepted`; nothing touched.
    Accepted,
    /// The node has been stopped; the binary is untouched.
    Stopped,
    /// The swap is about to happen (or has happened): from here, whoever
    /// settles this upgrade asks the installed binary which release it is.
    Swapping,
    /// The new binary is installed; the previous is kept.
    Swapped,
    /// The new node has been started; not yet proven healthy.
    Started,
    /// The new node reported healthy at the new version.
    Done,
    /// The previous binary was restored after a failure.
    RolledBack {
        /// Why.
        reason: String,
    },
    /// Failed before the swap; the binary is untouched.
    Failed {
        /// Why.
        reason: String,
    },
    /// An updater stopped before the swap; the next one or the node found
    /// it and left the binary as it was.
    Abandoned,
    /// The previous binary could not be put back after a failure; the new
    /// one stays installed and was started again. An operator must look.
    Unrecovered {
        /// Why, and what was tried.
        reason: String,
    },
}

impl Step {
    fn is_final(&self) -> bool {
        matches!(
            self,
            Self::Done
                | Self::RolledBack { .. }
                | Self::Failed { .. }
                | Self::Abandoned
                | Self::Unrecovered { .. }
        )
    }

    /// Whether the swap may have happened: the installed binary decides.
    fn maybe_swapped(&self) -> bool {
        matches!(self, Self::Swapping | Self::Swapped | Self::Started)
    }
}

/// The journal: the current or last upgrade on this host.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// The release being installed.
    pub version: String,
    /// The release that was installed before.
    pub from: String,
    /// The rollout, when the instruction carried one.
    pub rollout: Option<String>,
    /// Its generation.
    pub generation: Option<u64>,
    /// The node's binary.
    pub install_path: PathBuf,
    /// Where the previous binary is kept.
    pub previous_path: PathBuf,
    /// Where the new one waits before the swap.
    pub staged_path: PathBuf,
    /// The updater process driving it (the leader of its own process group).
    #[serde(default)]
    pub updater_pid: u32,
    /// Where this upgrade is.
    #[serde(flatten)]
    pub step: Step,
    /// Seconds since the Unix epoch when `step` was reached.
    pub at: u64,
}

/// Why `host-upgrade` did not complete.
#[derive(Debug, Error)]
pub(crate) enum UpgradeFailure {
    /// Refused before anything was touched (the node heard why).
    #[error("refused: {0}")]
    Refused(String),
    /// Accepted and then failed; the journal says what was restored.
    #[error("failed: {0}")]
    Failed(String),
}

/// The journal directory, lock and files of one state directory.
#[derive(Debug)]
struct Files {
    dir: PathBuf,
}

impl Files {
    fn new(state_dir: &Path) -> Self {
        Self {
            dir: state_dir.join(DIR),
        }
    }

    fn create(&self) -> Result<(), String> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::create_dir_all(&self.dir)
            .and_then(|()| {
                std::fs::set_permissions(&self.dir, std::fs::Permissions::from_mode(0o700))
            })
            .map_err(|e| format!("{}: {e}", self.dir.display()))
    }

    /// Takes the host claim: `Some(lock)` held until dropped, or `None`
    /// while another process holds it, tried again for `patience` first
    /// ([`crate::claim::take`]: a claim just released can still be held for
    /// a moment by a forked child).
    ///
    /// A node's start asks with no patience ([`settle_at_node_start`]): a
    /// live updater that dies while the node waits would otherwise have
    /// its swap undone under the very node it started, which the next
    /// `host-upgrade --settle` is there to judge instead
    /// (`upgrade.rs::an_updater_killed_while_its_new_node_comes_up_is_finished_by_settle_not_rolled_back`).
    fn claim(&self, patience: std::time::Duration) -> Result<Option<File>, String> {
        let path = self.dir.join(LOCK_FILE);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&path)
            .map_err(|e| format!("{}: {e}", path.display()))?;
        match crate::claim::take(&file, patience) {
            Ok(true) => Ok(Some(file)),
            Ok(false) => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    fn read(&self) -> Result<Option<Record>, String> {
        let path = self.dir.join(JOURNAL_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map(Some).map_err(|e| {
                format!(
                    "{}: unreadable upgrade journal ({e}); inspect it, restore the binary by hand if needed, and remove the file",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    /// Writes the journal atomically (temporary file, fsync, rename, fsync
    /// of the directory) and appends a line to the history.
    fn write(&self, record: &mut Record, step: Step) -> Result<(), String> {
        record.step = step;
        record.at = now();
        let path = self.dir.join(JOURNAL_FILE);
        let tmp = self.dir.join(format!("{JOURNAL_FILE}.tmp"));
        let fail = |e: std::io::Error| format!("{}: cannot journal: {e}", path.display());
        let bytes = serde_json::to_vec_pretty(record).map_err(|e| fail(e.into()))?;
        let mut f = File::create(&tmp).map_err(fail)?;
        f.write_all(&bytes)
            .and_then(|()| f.sync_all())
            .map_err(fail)?;
        std::fs::rename(&tmp, &path).map_err(fail)?;
        File::open(&self.dir)
            .and_then(|d| d.sync_all())
            .map_err(fail)?;
        let line = format!(
            "{} {} -> {} rollout={} generation={} {}\n",
            record.at,
            record.from,
            record.version,
            record.rollout.as_deref().unwrap_or("-"),
            record
                .generation
                .map_or_else(|| "-".into(), |g| g.to_string()),
            serde_json::to_string(&record.step).unwrap_or_default(),
        );
        let _ = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join(HISTORY_FILE))
            .and_then(|mut h| h.write_all(line.as_bytes()));
        info!(version = %record.version, from = %record.from, step = ?record.step, "upgrade journal");
        Ok(())
    }
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The version a `billet` binary reports (`<binary> --version` prints
/// `billet <version>`).
///
/// # Errors
///
/// When it cannot be run or says something else.
pub fn binary_version(binary: &Path) -> Result<String, String> {
    let mut child = Command::new(binary)
        .arg("--version")
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .map_err(|e| format!("{}: cannot run: {e}", binary.display()))?;
    let deadline = std::time::Instant::now() + VERSION_TIMEOUT;
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(format!(
                    "{}: `--version` did not answer within {VERSION_TIMEOUT:?}",
                    binary.display()
                ));
            }
            Err(e) => return Err(format!("{}: {e}", binary.display())),
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|e| format!("{}: {e}", binary.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    match parse_version_line(&text) {
        Some(v) if out.status.success() => Ok(v.to_owned()),
        _ => Err(format!(
            "{}: `--version` said {:?} ({}), not `billet <version>`",
            binary.display(),
            text.trim(),
            out.status
        )),
    }
}

/// The version in `billet --version`'s line, `billet <version>` with an
/// optional ` (commit <sha>)` after it: the first word after `billet `.
/// Versions have no spaces ([`crate::upgrade::version::check`]).
pub(crate) fn parse_version_line(text: &str) -> Option<&str> {
    text.trim()
        .strip_prefix("billet ")?
        .split_whitespace()
        .next()
}

/// How long a binary gets to answer `--version`.
pub(crate) const VERSION_TIMEOUT: Duration = Duration::from_secs(30);

/// Swaps `staged` in at `install`, keeping the current binary at
/// `previous`. Each change of `install` is a rename, so at every instant it
/// is one whole binary.
fn swap(install: &Path, previous: &Path, staged: &Path) -> Result<(), String> {
    let fail = |what: &str, e: std::io::Error| format!("{what}: {e}");
    match std::fs::remove_file(previous) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(fail(&previous.display().to_string(), e)),
    }
    std::fs::hard_link(install, previous).map_err(|e| {
        fail(
            &format!("keep {} as {}", install.display(), previous.display()),
            e,
        )
    })?;
    // The new binary gets the installed one's mode (the staged file is 0700).
    if let Ok(meta) = std::fs::metadata(previous) {
        std::fs::set_permissions(staged, meta.permissions())
            .map_err(|e| fail(&staged.display().to_string(), e))?;
    }
    std::fs::rename(staged, install).map_err(|e| {
        fail(
            &format!("install {} as {}", staged.display(), install.display()),
            e,
        )
    })?;
    sync_parent(install);
    Ok(())
}

/// Puts `previous` back at `install` (a copy by hard link, then a rename;
/// `previous` stays). Idempotent.
fn restore(install: &Path, previous: &Path) -> Result<(), String> {
    let mut name = install.file_name().unwrap_or_default().to_owned();
    name.push(".restoring");
    let tmp = install.with_file_name(name);
    let _ = std::fs::remove_file(&tmp);
    std::fs::hard_link(previous, &tmp)
        .and_then(|()| std::fs::rename(&tmp, install))
        .map_err(|e| {
            format!(
                "restore {} from {}: {e}; put the previous binary back by hand",
                install.display(),
                previous.display()
            )
        })?;
    sync_parent(install);
    Ok(())
}

fn sync_parent(path: &Path) {
    if let Some(parent) = path.parent()
        && let Err(e) = File::open(parent).and_then(|d| d.sync_all())
    {
        warn!(dir = %parent.display(), error = %e, "cannot sync the directory");
    }
}

/// Held while a service command runs (see [`Service::run`]).
static SERVICE_COMMAND: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// How long a settle waits for a node that is draining to exit before it
/// starts it again: as long as the updater's unit may run, since a drain
/// waits for running jobs.
const SETTLE_DRAIN_WAIT: Duration = crate::upgrade::dispatch::UPDATER_UNIT_TIMEOUT;

impl Service {
    async fn run(&self, verb: &str) -> Result<(), String> {
        let argv: Vec<String> = match self {
            Self::Systemd(unit) => vec!["systemctl".into(), verb.into(), unit.clone()],
            Self::Commands { stop, start } => {
                if verb == "stop" {
                    stop.clone()
                } else {
                    start.clone()
                }
            }
        };
        info!(?argv, "{verb}: the node");
        let mut command = tokio::process::Command::new(&argv[0]);
        command.args(&argv[1..]).stdin(std::process::Stdio::null());
        // One service command at a time, each run to its end on its own
        // task: a caller given up on (SIGTERM arriving mid-drain) leaves
        // its stop command running, and the settle's start that follows
        // waits for it rather than starting a node that is about to stop.
        let status = tokio::spawn(async move {
            let _one = SERVICE_COMMAND.lock().await;
            command.status().await
        })
        .await
        .map_err(|e| format!("{verb} the node: {e}"))?
        .map_err(|e| format!("{verb} the node: cannot run {}: {e}", argv[0]))?;
        if status.success() {
            Ok(())
        } else {
            Err(format!(
                "{verb} the node: `{}` ended {status}",
                argv.join(" ")
            ))
        }
    }

    async fn stop(&self) -> Result<(), String> {
        self.run("stop").await
    }

    async fn start(&self) -> Result<(), String> {
        self.run("start").await
    }
}

/// Waits until the node on `state_dir` reports healthy at `version`.
async fn wait_healthy(state_dir: &Path, version: &str, timeout: Duration) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let last = match crate::local::check(state_dir, Duration::from_secs(5)).await {
            Ok(seen) if seen.healthy_at(version) => return Ok(()),
            Ok(seen) => {
                format!(
                    "version {}, serving {}, recovered {}, draining {}",
                    seen.status.version, seen.serving, seen.status.recovered, seen.status.draining
                )
            }
            Err(e) => e,
        };
        if tokio::time::Instant::now() >= deadline {
            return Err(format!(
                "the node did not report healthy at {version} within {timeout:?} (last: {last})"
            ));
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
}

fn check_request(r: &Request) -> Result<(), String> {
    crate::upgrade::version::check(&r.version).map_err(|e| format!("--version: {e}"))?;
    if let Some(d) = &r.manifest_sha256
        && !release::is_sha256(d)
    {
        return Err(format!("--manifest-sha256 {d:?} is not 64 hex digits"));
    }
    if r.rollout.as_deref() == Some("") {
        return Err("--rollout was passed empty; an absent fence is omitted, never empty".into());
    }
    if r.generation == Some(0) {
        return Err("--generation 0 was passed; an absent generation is omitted".into());
    }
    if r.rollout.is_some() != r.generation.is_some() {
        return Err(
            "--rollout and --generation fence an instruction together: pass both, or neither"
                .into(),
        );
    }
    Ok(())
}

/// The highest generation accepted per rollout, kept beside the journal
/// (`fence.json`): a rollout's older generation is stale whatever other
/// rollouts happened since.
pub const FENCE_FILE: &str = "fence.json";

type Fence = std::collections::BTreeMap<String, u64>;

impl Files {
    fn fence(&self) -> Result<Fence, String> {
        let path = self.dir.join(FENCE_FILE);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| {
                format!(
                    "{}: unreadable rollout fence ({e}); remove it to reset",
                    path.display()
                )
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Fence::new()),
            Err(e) => Err(format!("{}: {e}", path.display())),
        }
    }

    fn write_fence(&self, fence: &Fence) -> Result<(), String> {
        let path = self.dir.join(FENCE_FILE);
        let tmp = self.dir.join(format!("{FENCE_FILE}.tmp"));
        let bytes = serde_json::to_vec_pretty(fence).map_err(|e| e.to_string())?;
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|e| format!("{}: cannot record the rollout fence: {e}", path.display()))
    }

    /// Journals `step`, retrying briefly: after the swap a lost step would
    /// leave the settling to guesswork, so callers that cannot journal roll
    /// back instead.
    fn write_step(&self, record: &mut Record, step: Step) -> Result<(), String> {
        let mut last = String::new();
        for _ in 0..3 {
            match self.write(record, step.clone()) {
                Ok(()) => return Ok(()),
                Err(e) => last = e,
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        error!("{last}");
        Err(last)
    }
}

/// Refuses a stale instruction: a generation lower than the highest one
/// this host accepted for the same rollout.
fn fence(fence: &Fence, r: &Request) -> Result<(), String> {
    let (Some(rollout), Some(generation)) = (&r.rollout, r.generation) else {
        return Ok(());
    };
    match fence.get(rollout) {
        Some(&seen) if generation < seen => Err(format!(
            "generation {generation} of rollout {rollout} is stale: generation {seen} was already accepted"
        )),
        _ => Ok(()),
    }
}

/// Runs one `billet host-upgrade`: answers on `ack` exactly once, then (if
/// accepted) drives the upgrade to `Done` or back to the previous binary. A
/// SIGTERM while it works settles the upgrade (rolls back a swap, starts
/// the node) before exiting.
///
/// # Errors
///
/// [`UpgradeFailure::Refused`] when it refused (nothing touched, except
/// settling an earlier interrupted upgrade); [`UpgradeFailure::Failed`] when
/// it accepted and could not finish (the journal says what was restored).
pub(crate) async fn run(
    config: &UpgradeConfig,
    request: &Request,
    ack: &mut AckWriter,
) -> Result<(), UpgradeFailure> {
    let mut refuse = |reason: String| {
        error!("refusing: {reason}");
        ack.refuse(&reason);
        UpgradeFailure::Refused(reason)
    };
    if let Err(e) = check_request(request) {
        return Err(refuse(e));
    }
    let service = match config.service() {
        Ok(s) => s,
        Err(e) => return Err(refuse(e)),
    };
    let files = Files::new(&config.state_dir);
    if let Err(e) = files.create() {
        return Err(refuse(e));
    }
    let _claim = match files.claim(crate::claim::PATIENCE) {
        Ok(Some(lock)) => lock,
        Ok(None) => {
            return Err(refuse(format!(
                "another upgrade is in progress on this host (it holds {}); wait for it to finish",
                files.dir.join(LOCK_FILE).display()
            )));
        }
        Err(e) => return Err(refuse(e)),
    };
    let last = match files.read() {
        Ok(last) => last,
        Err(e) => return Err(refuse(e)),
    };
    if let Some(mut interrupted) = last.filter(|r| !r.step.is_final()) {
        let reason = format!(
            "an earlier upgrade to {} was interrupted at {:?}; settling it first (see {}); send the instruction again afterwards",
            interrupted.version,
            interrupted.step,
            files.dir.display()
        );
        let failure = refuse(reason);
        if let Err(e) = settle(config, &service, &files, &mut interrupted).await {
            error!("{e}");
        }
        return Err(failure);
    }
    remove_stale_staging(&config.install_path);
    let mut fences = match files.fence() {
        Ok(f) => f,
        Err(e) => return Err(refuse(e)),
    };
    if let Err(e) = fence(&fences, request) {
        return Err(refuse(e));
    }
    let from = match binary_version(&config.install_path) {
        Ok(v) => v,
        Err(e) => return Err(refuse(format!("the installed binary: {e}"))),
    };
    if from == request.version {
        // Nothing to install, but the instruction is still checked and
        // fenced: a pinned manifest must describe the installed binary,
        // and a later stale generation is refused as after any other.
        if let Err(e) = check_installed(config, request).await {
            return Err(refuse(e));
        }
        if let (Some(rollout), Some(generation)) = (&request.rollout, request.generation) {
            fences.insert(rollout.clone(), generation);
            if let Err(e) = files.write_fence(&fences) {
                return Err(refuse(e));
            }
        }
        info!(version = %from, "already installed; nothing to do");
        ack.accept();
        return Ok(());
    }
    let staged = staged_path(&config.install_path, &request.version);
    if let Err(e) = stage(config, request, &staged).await {
        let _ = std::fs::remove_file(&staged);
        return Err(refuse(e));
    }
    let mut record = Record {
        version: request.version.clone(),
        from,
        rollout: request.rollout.clone(),
        generation: request.generation,
        install_path: config.install_path.clone(),
        previous_path: previous_path(&config.install_path),
        staged_path: staged,
        updater_pid: std::process::id(),
        step: Step::Accepted,
        at: 0,
    };
    if let (Some(rollout), Some(generation)) = (&request.rollout, request.generation) {
        fences.insert(rollout.clone(), generation);
    }
    if let Err(e) = files
        .write_fence(&fences)
        .and_then(|()| files.write(&mut record, Step::Accepted))
    {
        let _ = std::fs::remove_file(&record.staged_path);
        return Err(refuse(e));
    }
    ack.accept();
    info!(version = %record.version, from = %record.from, "accepted; stopping the node (it drains first)");
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let terminated = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        outcome = proceed(config, &service, &files, &mut record) => outcome,
        () = terminated => {
            warn!("SIGTERM: settling the upgrade before exiting");
            let mut current = files.read().ok().flatten().unwrap_or(record.clone());
            match settle(config, &service, &files, &mut current).await {
                Ok(()) => Err(UpgradeFailure::Failed("stopped by SIGTERM; the upgrade was settled".into())),
                Err(e) => Err(UpgradeFailure::Failed(format!("stopped by SIGTERM; settling the upgrade failed: {e}"))),
            }
        }
    }
}

/// Where a release waits before the swap:
/// `.<install file name>.<version>.staged` beside the installed binary:
/// on its file system, so the swap is a rename, and named after it, so two
/// installs sharing a directory never clear each other's.
fn staged_path(install: &Path, version: &str) -> PathBuf {
    install.with_file_name(format!("{}{version}.staged", staging_prefix(install)))
}

fn staging_prefix(install: &Path) -> String {
    format!(
        ".{}.",
        install.file_name().unwrap_or_default().to_string_lossy()
    )
}

/// Removes releases an updater staged and then died before accepting.
fn remove_stale_staging(install: &Path) {
    let Some(dir) = install.parent() else { return };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = staging_prefix(install);
    for entry in entries.flatten() {
        let name = entry.file_name();
        let name = name.to_string_lossy();
        if name.starts_with(&prefix) && name.ends_with(".staged") {
            info!(file = %entry.path().display(), "removing a release staged by an updater that stopped");
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Where the previous binary is kept: `<install>.previous`.
pub fn previous_path(install: &Path) -> PathBuf {
    let mut name = install.file_name().unwrap_or_default().to_owned();
    name.push(".previous");
    install.with_file_name(name)
}

/// The release's manifest from the configured source, checked against the
/// instruction (its version, and its pinned digest when it has one), with
/// the source and the manifest's location.
async fn checked_manifest(
    config: &UpgradeConfig,
    request: &Request,
) -> Result<(Source, release::Manifest, String), String> {
    let source = Source::parse(&config.release_source, config.release_ca.as_deref())
        .map_err(|e| e.to_string())?;
    let (bytes, what) = source
        .manifest(&request.version)
        .await
        .map_err(|e| e.to_string())?;
    if request.manifest_sha256.is_none() {
        warn!(%what, "no manifest digest was pinned; trusting the release source");
    }
    let manifest = release::check_manifest(
        &bytes,
        &what,
        request.manifest_sha256.as_deref(),
        &request.version,
    )
    .map_err(|e| e.to_string())?;
    Ok((source, manifest, what))
}

/// For an instruction naming the installed version with a pinned
/// manifest: the manifest must match the pin and this host's binary in it
/// must be the installed one, byte for byte. Without a pin the version
/// alone is the instruction, and it is already met.
async fn check_installed(config: &UpgradeConfig, request: &Request) -> Result<(), String> {
    if request.manifest_sha256.is_none() {
        return Ok(());
    }
    let (_, manifest, what) = checked_manifest(config, request).await?;
    let artifact = release::for_this_host(&manifest).map_err(|e| e.to_string())?;
    let installed = std::fs::read(&config.install_path)
        .map_err(|e| format!("{}: {e}", config.install_path.display()))?;
    let digest = release::sha256_hex(&installed);
    if digest != artifact.sha256 {
        return Err(format!(
            "{} reports {} but is not that release's binary (sha256 {digest}; {what} says {}); install the release's binary by hand, or publish the installed one as a new version",
            config.install_path.display(),
            request.version,
            artifact.sha256
        ));
    }
    Ok(())
}

/// Fetches and checks the release into `staged`.
async fn stage(config: &UpgradeConfig, request: &Request, staged: &Path) -> Result<(), String> {
    let (source, manifest, _) = checked_manifest(config, request).await?;
    let artifact = release::for_this_host(&manifest).map_err(|e| e.to_string())?;
    source
        .artifact(&request.version, artifact, staged)
        .await
        .map_err(|e| e.to_string())?;
    let says = binary_version(staged)?;
    if says != request.version {
        return Err(format!(
            "the release's binary reports version {says}, not {}",
            request.version
        ));
    }
    Ok(())
}

/// Steps 2 to 5, from `Accepted`. After the swap nothing returns early: a
/// failure of any kind, a journal write included, rolls back.
async fn proceed(
    config: &UpgradeConfig,
    service: &Service,
    files: &Files,
    record: &mut Record,
) -> Result<(), UpgradeFailure> {
    if let Err(e) = service.stop().await {
        // The node may still be running the old binary: make sure it is.
        let restart = match service.start().await {
            Ok(()) => "it was started again".to_owned(),
            Err(s) => format!("starting it again failed too: {s}"),
        };
        return Err(fail_unswapped(
            files,
            record,
            format!("{e}; the binary was not changed and {restart}"),
        ));
    }
    if let Err(e) = files
        .write_step(record, Step::Stopped)
        .and_then(|()| files.write_step(record, Step::Swapping))
    {
        let _ = service.start().await;
        return Err(fail_unswapped(
            files,
            record,
            format!("{e}; the binary was not changed"),
        ));
    }
    if let Err(e) = swap(
        &record.install_path,
        &record.previous_path,
        &record.staged_path,
    ) {
        // A failed rename leaves the old binary in place; make sure of it.
        return Err(failed(roll_back(config, service, files, record, e).await));
    }
    let outcome = async {
        files.write_step(record, Step::Swapped)?;
        service.start().await?;
        files.write_step(record, Step::Started)?;
        wait_healthy(&config.state_dir, &record.version, config.health_timeout()).await?;
        files.write_step(record, Step::Done)
    }
    .await;
    match outcome {
        Ok(()) => {
            info!(version = %record.version, "upgraded: the node is healthy on the new release");
            Ok(())
        }
        Err(reason) => Err(failed(
            roll_back(config, service, files, record, reason).await,
        )),
    }
}

/// A rollback's summary as the upgrade's failure, whether or not the
/// previous release came back serving.
fn failed(rolled_back: Result<String, String>) -> UpgradeFailure {
    match rolled_back {
        Ok(summary) | Err(summary) => UpgradeFailure::Failed(summary),
    }
}

fn fail_unswapped(files: &Files, record: &mut Record, reason: String) -> UpgradeFailure {
    let _ = files.write_step(
        record,
        Step::Failed {
            reason: reason.clone(),
        },
    );
    let _ = std::fs::remove_file(&record.staged_path);
    error!("{reason}");
    UpgradeFailure::Failed(reason)
}

/// Which release the installed binary is, against a record.
#[derive(Debug, PartialEq, Eq)]
enum Installed {
    /// The record's new release.
    New,
    /// The release it replaced.
    Old,
}

fn installed(record: &Record) -> Result<Installed, String> {
    let now = binary_version(&record.install_path)?;
    if now == record.version {
        Ok(Installed::New)
    } else if now == record.from {
        Ok(Installed::Old)
    } else {
        Err(format!(
            "{} reports {now}, neither {} nor {}; settle this upgrade by hand (see {})",
            record.install_path.display(),
            record.version,
            record.from,
            record.install_path.display()
        ))
    }
}

/// Stops the node, puts the previous binary back, starts it and watches it
/// come back. When the previous binary cannot be put back, the node is
/// started on what is installed, and the journal says `Unrecovered`.
/// Returns the summary recorded: `Ok` when the previous release is back and
/// serving, `Err` when an operator must look.
async fn roll_back(
    config: &UpgradeConfig,
    service: &Service,
    files: &Files,
    record: &mut Record,
    reason: String,
) -> Result<String, String> {
    error!(version = %record.version, %reason, "the new release failed; rolling back to {}", record.from);
    let stopped = service.stop().await;
    let restored = match installed(record) {
        Ok(Installed::Old) => Ok(()),
        _ => restore(&record.install_path, &record.previous_path),
    };
    let _ = std::fs::remove_file(&record.staged_path);
    if let Err(e) = restored {
        let started = service.start().await;
        let summary = format!(
            "{reason}; the previous release {} could not be put back ({e}), so {} stays installed and {}; an operator must look",
            record.from,
            record.version,
            match started {
                Ok(()) => "was started again".to_owned(),
                Err(s) => format!("could not be started either ({s})"),
            }
        );
        let _ = files.write_step(
            record,
            Step::Unrecovered {
                reason: summary.clone(),
            },
        );
        error!("{summary}");
        return Err(summary);
    }
    let back = match service.start().await {
        Ok(()) => wait_healthy(&config.state_dir, &record.from, config.health_timeout()).await,
        Err(e) => Err(e),
    };
    let serving = back.is_ok();
    let summary = match back {
        Ok(()) => format!("{reason}; rolled back to {}, which is serving", record.from),
        Err(e) => format!(
            "{reason}; rolled back to {}, which is installed but not healthy: {e}{}",
            record.from,
            stopped
                .err()
                .map(|s| format!(" (stopping the new release: {s})"))
                .unwrap_or_default()
        ),
    };
    let _ = files.write_step(
        record,
        Step::RolledBack {
            reason: summary.clone(),
        },
    );
    error!("{summary}");
    if serving { Ok(summary) } else { Err(summary) }
}

/// Settles an upgrade an earlier updater left unfinished. The installed
/// binary decides, not the recorded step: the new release installed means a
/// swap not yet proven healthy. An updater that died after starting the new
/// node (`Started`) may have left it coming up: given the health timeout to
/// prove itself, a healthy node at the new version finishes the upgrade
/// (`Done`) rather than being drained for a rollback; anything else is
/// rolled back. The old release installed means nothing changed on disk, so
/// the node is started in case it was stopped.
async fn settle(
    config: &UpgradeConfig,
    service: &Service,
    files: &Files,
    record: &mut Record,
) -> Result<(), String> {
    match installed(record) {
        Ok(Installed::New) if record.step.maybe_swapped() => {
            let mut reason = "the updater stopped before the new release proved healthy".to_owned();
            if record.step == Step::Started {
                match wait_healthy(&config.state_dir, &record.version, config.health_timeout())
                    .await
                {
                    Ok(()) => {
                        info!(version = %record.version, "the interrupted upgrade's node is healthy on the new release; finished");
                        let _ = std::fs::remove_file(&record.staged_path);
                        if let Err(e) = files.write_step(record, Step::Done) {
                            warn!("{e}");
                        }
                        return Ok(());
                    }
                    Err(e) => reason.push_str(&format!(", and it did not since: {e}")),
                }
            }
            roll_back(config, service, files, record, reason)
                .await
                .map(drop)
        }
        Ok(_) => {
            let running = ensure_running(config, service)
                .await
                .map_err(|e| format!("cannot start the node after an interrupted upgrade: {e}"));
            let _ = std::fs::remove_file(&record.staged_path);
            let step = if record.step.maybe_swapped() {
                Step::RolledBack {
                    reason: format!("the updater stopped; {} was still installed", record.from),
                }
            } else {
                Step::Abandoned
            };
            let _ = files.write_step(record, step);
            running
        }
        Err(e) => Err(format!("cannot settle the interrupted upgrade: {e}")),
    }
}

/// Makes sure the node runs after an upgrade that changed nothing on disk:
/// a node that answers and is not draining is left alone; one that is
/// draining (the interrupted upgrade's stop is still under way) is waited
/// for until it exits, up to [`SETTLE_DRAIN_WAIT`]; then, or when nothing
/// answers, the node is started.
async fn ensure_running(config: &UpgradeConfig, service: &Service) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + SETTLE_DRAIN_WAIT;
    loop {
        match crate::local::check(&config.state_dir, Duration::from_secs(2)).await {
            Ok(seen) if !seen.status.draining => return Ok(()),
            Ok(_) if tokio::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Ok(_) => {
                return Err(format!(
                    "the node was still draining after {SETTLE_DRAIN_WAIT:?}; start it once it has stopped"
                ));
            }
            Err(_) => return service.start().await,
        }
    }
}

/// `billet host-upgrade --settle`: settles an unfinished upgrade whose
/// updater is gone, and does nothing otherwise. The transient unit the node
/// starts the updater in runs it when the updater ends however it ends
/// (`ExecStopPost`), so an updater killed after stopping the node does not
/// leave it stopped.
///
/// # Errors
///
/// A sentence when the configuration or journal cannot be used, or when the
/// settle did not end with one release installed and serving (a rollback
/// whose node is not healthy, an `Unrecovered` one, a binary that is
/// neither release, a node that would not start): an operator must look.
pub async fn settle_interrupted(config: &UpgradeConfig) -> Result<(), String> {
    let service = config.service()?;
    let files = Files::new(&config.state_dir);
    let last = files.read()?;
    if let Some(Record {
        version,
        step: Step::Unrecovered { reason },
        ..
    }) = &last
    {
        // Nothing a settle can do; it must not read as settled.
        return Err(format!(
            "the upgrade to {version} is unrecovered and waits for an operator: {reason} (see {})",
            files.dir.display()
        ));
    }
    let Some(mut record) = last.filter(|r| !r.step.is_final()) else {
        return Ok(());
    };
    let Some(_claim) = files.claim(crate::claim::PATIENCE)? else {
        info!("an updater is still at work; nothing to settle");
        return Ok(());
    };
    // Read again under the claim: it may have finished meanwhile.
    if let Some(current) = files.read()? {
        record = current;
    }
    if record.step.is_final() {
        return Ok(());
    }
    settle(config, &service, &files, &mut record).await
}

/// What [`settle_at_node_start`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Settled {
    /// Nothing was unfinished, or a live updater is still at work.
    Nothing,
    /// An interrupted upgrade had left the previous binary installed;
    /// recorded, nothing else.
    Recorded,
    /// The previous binary was put back at this path; the caller, which may
    /// be the new binary, must exec it.
    RolledBack(PathBuf),
}

/// Run by `billet node` before anything else: settles an upgrade whose
/// updater died (its lock is free). The installed binary decides: a swap
/// never proven healthy is rolled back to the previous binary, so a host
/// ends on one version whichever process finds the journal first.
///
/// # Errors
///
/// A sentence naming the file when the journal cannot be read or written,
/// or the previous binary cannot be restored.
pub(crate) fn settle_at_node_start(state_dir: &Path) -> Result<Settled, String> {
    let files = Files::new(state_dir);
    if files.read()?.is_none_or(|r| r.step.is_final()) {
        return Ok(Settled::Nothing);
    }
    let Some(_claim) = files.claim(std::time::Duration::ZERO)? else {
        // A live updater (it started this node, or is about to).
        return Ok(Settled::Nothing);
    };
    let Some(mut record) = files.read()?.filter(|r| !r.step.is_final()) else {
        return Ok(Settled::Nothing);
    };
    if std::os::unix::net::UnixStream::connect(crate::local::socket_path(state_dir)).is_ok() {
        // A node already serves this state directory (the new release an
        // updater started before it died): this start is a second process,
        // which will refuse to bind. Undoing the swap under the running
        // node would leave one version on disk and another serving; the
        // next `host-upgrade --settle` judges that node's health instead.
        return Ok(Settled::Nothing);
    }
    let _ = std::fs::remove_file(&record.staged_path);
    match installed(&record)? {
        Installed::New if record.step.maybe_swapped() => {
            restore(&record.install_path, &record.previous_path)?;
            let reason = format!(
                "the updater stopped before {} proved healthy; billet node restored {} at start",
                record.version, record.from
            );
            // The binary is restored whether or not this is recorded; a
            // later settle finds the old release installed and agrees.
            if let Err(e) = files.write_step(&mut record, Step::RolledBack { reason }) {
                warn!("{e}");
            }
            Ok(Settled::RolledBack(record.install_path))
        }
        _ => {
            let step = if record.step.maybe_swapped() {
                Step::RolledBack {
                    reason: format!("the updater stopped; {} was still installed", record.from),
                }
            } else {
                Step::Abandoned
            };
            files.write_step(&mut record, step)?;
            Ok(Settled::Recorded)
        }
    }
}

#[cfg(test)]
mod tests;
