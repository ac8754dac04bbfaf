//! The upgrader: how `StartUpgrade` hands this node's replacement to
//! billet's own updater, and the one-line acknowledgement both ends speak.
//!
//! Behaviour follows the reference's `node.Upgrader` / `node.ExecUpgrader`
//! (seed/node-package.md; spec/node.md §6, both variants). The node starts
//! `<binary> host-upgrade --version V [--manifest-sha256 D] [--rollout R]
//! [--generation G] [--config PATH] <answer channel>` so that it outlives the
//! node, and returns as soon as the updater answers: `accepted` (it has taken
//! responsibility; the upgrade's progress is read from the rollout, never
//! from this answer) or `refused: <reason>` (it changed nothing). The node
//! never waits longer than the ack wait, so the single command slot is never
//! held by an upgrade's drain.
//!
//! How the updater is started, and so where its answer travels, is the
//! [`Dispatch`]:
//!
//! - [`Dispatch::Detached`]: exec'd directly, in its own process group; the
//!   answer comes back on a pipe whose write end is the updater's file
//!   descriptor 3 (`--ack-fd 3`).
//! - [`Dispatch::SystemdRun`], for a node that is itself a systemd service
//!   ([`Dispatch::from_environment`]): run through `systemd-run` as a
//!   transient unit of its own, so that stopping the node's service does not
//!   stop it. A pipe does not survive `systemd-run`, so the answer comes back
//!   on a unix socket `upgrade-ack-<random>` in the node's state directory
//!   (`--ack-path <socket>`), removed again however the wait ends. The
//!   updater's environment travels by name only (`--setenv=NAME`, see
//!   [`UPDATER_ENVIRONMENT`]), never as a value on a command line.
//!
//! Both channels are read by the same rules: one line of at most
//! [`MAX_ACK_BYTES`], answered at its newline, within the ack wait.
//!
//! The vocabulary ([`ACK_ACCEPTED`], [`ACK_REFUSED`], [`MAX_ACK_BYTES`],
//! [`ACK_FD`]) is defined once, here, in the module that reads it; the
//! `billet host-upgrade` command writes it through [`AckWriter`] from this
//! same module (over `--ack-fd` or `--ack-path`), so the writer cannot drift
//! from the reader.

use std::ffi::OsString;
use std::fmt;
use std::fmt::Write as _;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use command_fds::{CommandFdExt, FdMapping};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::net::UnixListener;
use tokio::time::{Instant, timeout_at};
use tracing::{Instrument, Span, debug, info, info_span, warn};

use crate::model::UpgradeSpec;

/// What an updater writes once it has taken responsibility for the upgrade.
pub(crate) const ACK_ACCEPTED: &str = "accepted";
/// What prefixes the reason when it has not.
pub const ACK_REFUSED: &str = "refused: ";
/// The most either end writes or reads, newline excluded. An answer is one
/// short line; more than this without a newline is not an answer.
pub(crate) const MAX_ACK_BYTES: usize = 4 << 10;
/// The child's descriptor the answer travels on under
/// [`Dispatch::Detached`]: the first after the standard three.
pub(crate) const ACK_FD: i32 = 3;
/// How long the node waits for the answer by default (the reference's
/// `ackWait`).
pub(crate) const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(90);
/// What `billet host-upgrade` answers when it was given no configuration
/// (`--config`), so it has no release source to install from.
pub const NO_RELEASE_SOURCE: &str = "this updater was given no --config, so it has no release source; set the node's --upgrade-config (BILLET_UPGRADE_CONFIG, see deploy/upgrade.toml.example) or upgrade this node out of band";
/// What an [`AckWriter`] dropped without answering says on the updater's
/// behalf (a panic, an early return).
pub(crate) const STOPPED_WITHOUT_ANSWER: &str =
    "this updater stopped without saying why; look at its log on that machine";

/// The `systemd-run` a node under systemd starts its updater through, found
/// on `PATH`.
pub const SYSTEMD_RUN: &str = "systemd-run";
/// The updater's transient unit is named `<this><rollout>-g<generation>`,
/// with `manual` for no rollout (the reference's naming), e.g.
/// `billet-host-upgrade-rollout-7-g4.service`.
pub(crate) const UPDATER_UNIT_PREFIX: &str = "billet-host-upgrade-";
/// How long systemd lets the updater's unit run before it stops it (its
/// `TimeoutStartSec`), and how long it lets it settle once stopped (its
/// `TimeoutStopSec`): 24.5 hours, the reference's value. The updater may
/// wait for this node's drain, which waits for running jobs.
pub(crate) const UPDATER_UNIT_TIMEOUT: Duration = Duration::from_secs(88_200);
/// The environment variables a [`Dispatch::SystemdRun`] updater is given,
/// those of them this node has. A transient unit starts with the service
/// manager's environment, not the node's, so these are passed on, and only
/// by name (`--setenv=NAME`: `systemd-run` copies the value from its own
/// environment, which it inherits from the node). No value ever appears on a
/// command line, which every user of the machine can read.
///
/// - `BILLET_LOG`: the updater logs with the node's filter.
/// - `BILLET_CONFIG`, `BILLET_STATE_DIR`: where the node's own settings and
///   state are, which a detached updater inherits with the node's
///   environment.
/// - The proxy variables, upper and lower case, for an updater that fetches
///   a release; they can carry credentials.
///
/// Nothing else: a variable is added here only when the updater needs it.
pub const UPDATER_ENVIRONMENT: &[&str] = &[
    "BILLET_LOG",
    "BILLET_CONFIG",
    "BILLET_STATE_DIR",
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "NO_PROXY",
    "no_proxy",
];
/// The longest path a unix socket can be made at: `sun_path` less its
/// terminating NUL (108 bytes on Linux, 104 elsewhere).
#[cfg(target_os = "linux")]
pub(crate) const MAX_SOCKET_PATH_BYTES: usize = 107;
/// The longest path a unix socket can be made at: `sun_path` less its
/// terminating NUL (108 bytes on Linux, 104 elsewhere).
#[cfg(not(target_os = "linux"))]
pub const MAX_SOCKET_PATH_BYTES: usize = 103;
/// What the answer socket's name in the state directory starts with; 32
/// random hex digits follow.
pub(crate) const ACK_SOCKET_PREFIX: &str = "upgrade-ack-";

/// Why an upgrade was not started.
#[derive(Debug, Error)]
pub enum UpgradeError {
    /// This node has no updater configured (the reference's `ErrNoUpgrader`).
    #[error(
        "this node has no transactional updater, so it cannot install {version}; upgrade it out of band (replace the billet binary and restart the service)"
    )]
    NoUpgrader {
        /// The release asked for.
        version: String,
    },
    /// The updater started and did not take the upgrade (the reference's
    /// `ErrUpgradeRefused`): it said no, said nothing, or said something
    /// that is not an answer. `refusal` tells which.
    #[error("{}", .refusal.describe(.version))]
    Refused {
        /// The release asked for.
        version: String,
        /// How it refused.
        refusal: Refusal,
    },
    /// A field cannot be passed to the updater safely.
    #[error("start_upgrade.{field}: {reason}")]
    Spec {
        /// The field, as on the wire.
        field: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The updater could not be started at all: it could not be exec'd, its
    /// answer socket could not be made, or `systemd-run` failed. Nothing
    /// that took the upgrade ran.
    #[error("cannot start the updater {binary}: {source}", binary = .binary.display())]
    Spawn {
        /// The updater's executable.
        binary: PathBuf,
        /// Why; names `systemd-run` or the socket when one of them failed.
        source: io::Error,
    },
    /// The answer channel failed in a way that is not an answer.
    #[error("reading the updater's answer about {version}: {source}")]
    Ack {
        /// The release asked for.
        version: String,
        /// Why.
        source: io::Error,
    },
}

/// How an updater that started did not take the upgrade. Each kind has its
/// own sentence, because each asks something different of the operator.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// It answered a line other than `accepted`: the reason, with the
    /// `refused: ` prefix removed.
    Said(String),
    /// No complete line within the ack wait (including a line begun and
    /// not finished by then). It may still be working.
    Silent(Duration),
    /// Some bytes, then end of file before the newline.
    Partway,
    /// End of file with nothing: it exited (or closed the channel) without
    /// a word.
    WithoutWord,
    /// More than [`MAX_ACK_BYTES`] without a newline.
    Oversize,
}

impl Refusal {
    fn describe(&self, version: &str) -> String {
        match self {
            Refusal::Said(reason) if reason.is_empty() => {
                format!(
                    "the updater refused to install {version} and gave no reason; look at its log on that machine"
                )
            }
            Refusal::Said(reason) => format!("the updater refused to install {version}: {reason}"),
            Refusal::Silent(wait) => format!(
                "the updater did not say within {} whether it takes the upgrade to {version}; it may still be working, so look on that machine before sending the upgrade again",
                Seconds(*wait)
            ),
            Refusal::Partway => format!(
                "the updater stopped partway through its answer about installing {version}; nothing says it took the upgrade, so look at its log on that machine"
            ),
            Refusal::WithoutWord => format!(
                "the updater stopped without saying why, so it did not take the upgrade to {version}; look at its log on that machine"
            ),
            Refusal::Oversize => format!(
                "the updater's answer about installing {version} ran past {MAX_ACK_BYTES} bytes without a newline; an answer is one short line, so this is not a billet updater speaking its protocol"
            ),
        }
    }
}

/// A duration as an operator reads it: `90s`, or `1500ms` below whole
/// seconds.
struct Seconds(Duration);

impl fmt::Display for Seconds {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.subsec_nanos() == 0 {
            write!(f, "{}s", self.0.as_secs())
        } else {
            write!(f, "{}ms", self.0.as_millis())
        }
    }
}

/// Starts the transactional updater that replaces this node's billet.
///
/// A seam rather than a direct exec, as in the reference: a node without an
/// updater must refuse rather than do nothing, and the argv is the only part
/// of the mechanism a test can see.
#[async_trait]
pub trait Upgrader: Send + Sync + fmt::Debug {
    /// Starts the updater for `spec` and returns once it has answered.
    ///
    /// Returns promptly: never later than the implementation's ack wait,
    /// whatever the updater goes on to do.
    ///
    /// # Errors
    ///
    /// [`UpgradeError::Refused`] when the updater did not take the upgrade,
    /// [`UpgradeError::Spawn`] when it could not be started,
    /// [`UpgradeError::Spec`] when a field cannot be passed safely,
    /// [`UpgradeError::Ack`] when the answer channel failed.
    async fn start_upgrade(&self, spec: &UpgradeSpec) -> Result<(), UpgradeError>;
}

/// Starts an upgrade through `upgrader`, or refuses when there is none
/// (the reference's `Runner.StartUpgrade`).
///
/// # Errors
///
/// [`UpgradeError::NoUpgrader`] without an updater; otherwise whatever the
/// updater's [`Upgrader::start_upgrade`] returns.
pub(crate) async fn start(
    upgrader: Option<&dyn Upgrader>,
    spec: &UpgradeSpec,
) -> Result<(), UpgradeError> {
    let Some(upgrader) = upgrader else {
        return Err(UpgradeError::NoUpgrader {
            version: spec.version.clone(),
        });
    };
    info!(version = %spec.version, rollout = spec.rollout_id.as_deref(), generation = spec.generation,
          "starting the updater");
    let result = upgrader.start_upgrade(spec).await;
    match &result {
        Ok(()) => info!(version = %spec.version, "the updater took the upgrade"),
        Err(e) => warn!(version = %spec.version, error = %e, "the upgrade was not started"),
    }
    result
}

/// How [`ExecUpgrader`] starts the updater so that it outlives the node,
/// and so which channel its answer comes back on (the reference's two
/// variants, spec/node.md §6).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum Dispatch {
    /// Exec'd directly as a child of the node, in its own process group,
    /// answering on a pipe as its descriptor [`ACK_FD`] (`--ack-fd 3`).
    ///
    /// For a node that is not a systemd service. Under systemd, only the
    /// node unit's `KillMode=process` would keep the updater alive when it
    /// stops the node.
    #[default]
    Detached,
    /// Started as a transient systemd service of its own through
    /// `systemd-run --no-block`, so stopping the node's service cannot stop
    /// it, answering on a unix socket in the state directory
    /// (`--ack-path <socket>`).
    ///
    /// The unit is `billet-host-upgrade-<rollout>-g<generation>` (see
    /// [`UPDATER_UNIT_PREFIX`]), a `oneshot` collected once it ends, allowed
    /// [`UPDATER_UNIT_TIMEOUT`]; a unit of that name still running makes
    /// `systemd-run` fail, so the same instruction is never run twice at
    /// once. A `systemd-run` that fails is reported at once, without waiting
    /// for an answer.
    SystemdRun {
        /// The `systemd-run` to run: [`SYSTEMD_RUN`], found on `PATH`,
        /// except in tests.
        systemd_run: PathBuf,
        /// The node's state directory, where the answer socket is made. Its
        /// absolute path, a `/` and the socket's 44-byte name must fit in
        /// [`MAX_SOCKET_PATH_BYTES`], so at most 62 bytes on Linux; a longer
        /// one is refused before anything runs.
        state_dir: PathBuf,
    },
}

impl Dispatch {
    /// How a node with the state directory `state_dir` starts its updater:
    /// [`Dispatch::SystemdRun`] through [`SYSTEMD_RUN`] when this process is
    /// a systemd service (on Linux, with `INVOCATION_ID` set, as systemd
    /// sets it for every unit it starts, the reference's test), else
    /// [`Dispatch::Detached`]. Read once, at start-up.
    pub fn from_environment(state_dir: impl Into<PathBuf>) -> Self {
        Self::for_invocation(std::env::var_os("INVOCATION_ID"), state_dir.into())
    }

    /// [`Dispatch::SystemdRun`] through [`SYSTEMD_RUN`] on `PATH`, with the
    /// answer socket in `state_dir`.
    pub(crate) fn systemd_run(state_dir: impl Into<PathBuf>) -> Self {
        Self::SystemdRun {
            systemd_run: SYSTEMD_RUN.into(),
            state_dir: state_dir.into(),
        }
    }

    fn for_invocation(invocation_id: Option<OsString>, state_dir: PathBuf) -> Self {
        let under_systemd =
            cfg!(target_os = "linux") && invocation_id.is_some_and(|id| !id.is_empty());
        if under_systemd {
            Self::systemd_run(state_dir)
        } else {
            Self::Detached
        }
    }
}

/// Runs billet's own updater (`<binary> host-upgrade ...`) so that it
/// outlives the node, and waits for its one-line answer.
///
/// Outliving the node is the point: the updater's job is to stop the very
/// service that started it. It is never tied to a cancellation token, never
/// killed when a handle drops, and nothing waits for its exit status. How
/// it is started and where it answers is its [`Dispatch`]:
///
/// - [`Dispatch::Detached`]: in its own process group (a signal to the
///   node's group does not reach it), reaped in the background with its
///   exit status ignored, stdin `/dev/null` and the node's stdout and stderr
///   (its log lands beside the node's); the answer on [`ACK_FD`].
/// - [`Dispatch::SystemdRun`]: in a unit of its own, its log in that unit's
///   journal; the answer on a unix socket in the state directory, made
///   before `systemd-run` starts and removed however the wait ends.
///   `systemd-run` itself gets stdin `/dev/null` and the node's stdout and
///   stderr, so its own complaint lands in the node's log.
///
/// Either way the whole start, `systemd-run` included, is bounded by
/// `ack_wait`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecUpgrader {
    /// The executable to run: normally the installed `billet`. Absolute
    /// under [`Dispatch::SystemdRun`], whose unit does not run in the
    /// node's working directory.
    pub binary: PathBuf,
    /// Passed to the updater as `--config`, when set.
    pub config: Option<PathBuf>,
    /// How long to wait for the answer.
    pub ack_wait: Duration,
    /// How the updater is started, and where its answer comes back.
    pub dispatch: Dispatch,
}

impl ExecUpgrader {
    /// An updater at `binary`, with no config, the default ack wait and
    /// [`Dispatch::Detached`].
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
            config: None,
            ack_wait: DEFAULT_ACK_WAIT,
            dispatch: Dispatch::Detached,
        }
    }

    /// The arguments after the binary under [`Dispatch::Detached`], ending
    /// `--ack-fd 3`; under [`Dispatch::SystemdRun`] they are the same with
    /// `--ack-path <socket>` in its place. Empty fence fields are omitted,
    /// never passed empty; a generation of zero means none. Nothing here is
    /// a secret, and nothing secret may ever be added: argv is
    /// world-readable.
    ///
    /// # Errors
    ///
    /// [`UpgradeError::Spec`] when a value is empty where required or would
    /// read as a flag.
    pub(crate) fn argv(&self, spec: &UpgradeSpec) -> Result<Vec<OsString>, UpgradeError> {
        let mut argv = self.instruction(spec)?;
        argv.extend(["--ack-fd".into(), ACK_FD.to_string().into()]);
        Ok(argv)
    }

    /// The arguments after the binary, without the answer channel's.
    fn instruction(&self, spec: &UpgradeSpec) -> Result<Vec<OsString>, UpgradeError> {
        let UpgradeSpec {
            version,
            manifest_sha256,
            rollout_id,
            generation,
        } = spec;
        let value = |field: &'static str, v: &str| -> Result<(), UpgradeError> {
            if v.starts_with('-') {
                return Err(UpgradeError::Spec {
                    field,
                    reason: "must not start with '-', or the updater would read it as a flag",
                });
            }
            Ok(())
        };
        if version.is_empty() {
            return Err(UpgradeError::Spec {
                field: "version",
                reason: "must name an exact release",
            });
        }
        value("version", version)?;
        let mut argv: Vec<OsString> =
            vec!["host-upgrade".into(), "--version".into(), version.into()];
        if let Some(d) = manifest_sha256.as_deref().filter(|d| !d.is_empty()) {
            value("manifest_sha256", d)?;
            argv.extend(["--manifest-sha256".into(), d.into()]);
        }
        if let Some(r) = rollout_id.as_deref().filter(|r| !r.is_empty()) {
            value("rollout_id", r)?;
            argv.extend(["--rollout".into(), r.into()]);
        }
        if *generation > 0 {
            argv.extend(["--generation".into(), generation.to_string().into()]);
        }
        if let Some(config) = &self.config {
            argv.extend(["--config".into(), config.clone().into_os_string()]);
        }
        Ok(argv)
    }

    /// The arguments to `systemd-run` that start the updater for `spec` in
    /// its own unit, answering on `socket`: the unit's settings, `--setenv`
    /// by name for each of [`UPDATER_ENVIRONMENT`] that `present` says this
    /// node has, then `--` and the updater's whole command line.
    fn systemd_run_args(
        &self,
        spec: &UpgradeSpec,
        socket: &Path,
        present: impl Fn(&str) -> bool,
    ) -> Result<Vec<OsString>, UpgradeError> {
        let instruction = self.instruction(spec)?;
        let unit = unit_name(spec)?;
        let mut args: Vec<OsString> = vec![
            format!("--unit={unit}").into(),
            format!(
                "--description=billet updater installing {}",
                spec.version.replace(char::is_control, " ")
            )
            .into(),
            "--service-type=oneshot".into(),
            "--collect".into(),
            "--quiet".into(),
            "--no-block".into(),
            format!(
                "--property=TimeoutStartSec={}",
                UPDATER_UNIT_TIMEOUT.as_secs()
            )
            .into(),
            // Stopping the unit SIGTERMs the updater, which settles (may
            // wait for a drain) before it exits; then `ExecStopPost` runs.
            // systemd's 90 s default would SIGKILL either mid-way.
            format!(
                "--property=TimeoutStopSec={}",
                UPDATER_UNIT_TIMEOUT.as_secs()
            )
            .into(),
        ];
        if let Some(config) = &self.config {
            // However the updater ends (killed, timed out, crashed), its
            // unit then settles what it left unfinished, so a node it
            // stopped is not left stopped.
            args.push(
                format!(
                    "--property=ExecStopPost={} host-upgrade --settle --config {}",
                    exec_word(&self.binary),
                    exec_word(config)
                )
                .into(),
            );
        }
        args.extend(
            UPDATER_ENVIRONMENT
                .iter()
                .filter(|name| present(name))
                .map(|name| OsString::from(format!("--setenv={name}"))),
        );
        args.push("--".into());
        args.push(self.binary.clone().into_os_string());
        args.extend(instruction);
        args.extend(["--ack-path".into(), socket.as_os_str().to_owned()]);
        Ok(args)
    }

    async fn start_detached(&self, spec: &UpgradeSpec) -> Result<(), UpgradeError> {
        let deadline = Instant::now() + self.ack_wait;
        let argv = self.argv(spec)?;
        let spawn_error = |source| UpgradeError::Spawn {
            binary: self.binary.clone(),
            source,
        };
        let (reader, writer) = io::pipe().map_err(spawn_error)?;
        let child = {
            let mut command = std::process::Command::new(&self.binary);
            command
                .args(&argv)
                .stdin(Stdio::null())
                .process_group(0)
                .fd_mappings(vec![FdMapping {
                    parent_fd: OwnedFd::from(writer),
                    child_fd: ACK_FD,
                }])
                .map_err(|e| spawn_error(io::Error::other(e)))?;
            let mut command = tokio::process::Command::from(command);
            // Explicit, because it is the point: the updater must outlive us.
            command.kill_on_drop(false);
            command.spawn().map_err(spawn_error)?
            // `command` drops here, closing the node's copy of the write end,
            // so the updater's exit is seen as end of file.
        };
        let pid = child.id();
        info!(pid, binary = %self.binary.display(), ?argv, "the updater is running");
        reap(child, info_span!("updater", pid, version = %spec.version));
        let ack_error = |source| UpgradeError::Ack {
            version: spec.version.clone(),
            source,
        };
        let mut reader = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(reader))
            .map_err(ack_error)?;
        let answer = read_by(deadline, &mut reader).await.map_err(ack_error)?;
        answer.into_result(&spec.version, self.ack_wait)
    }

    async fn start_under_systemd(
        &self,
        spec: &UpgradeSpec,
        systemd_run: &Path,
        state_dir: &Path,
    ) -> Result<(), UpgradeError> {
        let deadline = Instant::now() + self.ack_wait;
        let spawn_error = |source| UpgradeError::Spawn {
            binary: self.binary.clone(),
            source,
        };
        // Everything that can be refused is, before anything is made or run.
        let path = ack_socket_path(state_dir).map_err(spawn_error)?;
        let args = self.systemd_run_args(spec, &path, |name| std::env::var_os(name).is_some())?;
        // Listening before the updater can exist, so an answer at once finds
        // it; removed when `socket` drops, on every way out of here.
        let socket = AckSocket::bind(path).map_err(spawn_error)?;
        let mut child = {
            let mut command = std::process::Command::new(systemd_run);
            command.args(&args).stdin(Stdio::null()).process_group(0);
            let mut command = tokio::process::Command::from(command);
            command.kill_on_drop(false);
            command.spawn().map_err(|e| {
                spawn_error(io::Error::new(
                    e.kind(),
                    format!("cannot run {}: {e}", systemd_run.display()),
                ))
            })?
        };
        let pid = child.id();
        info!(pid, systemd_run = %systemd_run.display(), ?args, "starting the updater in its own unit");
        // `--no-block`: it returns once the unit's start is queued. Its
        // failure (no such unit manager, a unit of that name already running,
        // no permission) is reported now, not at the end of the ack wait.
        match timeout_at(deadline, child.wait()).await {
            Ok(Ok(status)) if status.success() => {}
            Ok(Ok(status)) => {
                return Err(spawn_error(io::Error::other(format!(
                    "{} failed ({status}); its own message is in this node's log",
                    systemd_run.display()
                ))));
            }
            Ok(Err(e)) => {
                return Err(spawn_error(io::Error::new(
                    e.kind(),
                    format!("cannot wait for {}: {e}", systemd_run.display()),
                )));
            }
            Err(_) => {
                // Not back within the whole ack wait. It may yet start the
                // updater, so it is left to finish, and reaped.
                reap(
                    child,
                    info_span!("systemd-run", pid, version = %spec.version),
                );
                return Answer::Timeout.into_result(&spec.version, self.ack_wait);
            }
        }
        let ack_error = |source| UpgradeError::Ack {
            version: spec.version.clone(),
            source,
        };
        let answer = match timeout_at(deadline, socket.listener.accept()).await {
            Err(_) => Answer::Timeout,
            Ok(Err(e)) => return Err(ack_error(e)),
            Ok(Ok((mut stream, _))) => {
                // The first connection is the updater's answer; nobody else
                // gets to speak for it, and the socket's file goes now.
                drop(socket);
                read_by(deadline, &mut stream).await.map_err(ack_error)?
            }
        };
        answer.into_result(&spec.version, self.ack_wait)
    }
}

#[async_trait]
impl Upgrader for ExecUpgrader {
    async fn start_upgrade(&self, spec: &UpgradeSpec) -> Result<(), UpgradeError> {
        match &self.dispatch {
            Dispatch::Detached => self.start_detached(spec).await,
            Dispatch::SystemdRun {
                systemd_run,
                state_dir,
            } => self.start_under_systemd(spec, systemd_run, state_dir).await,
        }
    }
}

/// Reaps `child` in the background so it does not linger as a zombie; its
/// handle is dropped on purpose, since nothing waits for its status.
fn reap(mut child: tokio::process::Child, span: Span) {
    tokio::spawn(
        async move {
            match child.wait().await {
                Ok(status) => debug!(%status, "exited"),
                Err(e) => debug!(error = %e, "cannot wait for it"),
            }
        }
        .instrument(span),
    );
}

/// The systemd unit the updater for `spec` runs as (without `.service`):
/// [`UPDATER_UNIT_PREFIX`], the rollout (or `manual`), `-g` and the
/// generation. A byte that may not appear in a unit name is written
/// `\xNN`, as `systemd-escape` does, so distinct rollouts name distinct
/// units. (Rollout ids from the wire never need it.)
///
/// # Errors
///
/// [`UpgradeError::Spec`] naming `rollout_id` when the name would be longer
/// than systemd allows.
fn unit_name(spec: &UpgradeSpec) -> Result<String, UpgradeError> {
    /// systemd's longest unit name, suffix included.
    const MAX_UNIT_NAME: usize = 255;
    const SUFFIX: &str = ".service";
    let rollout = spec
        .rollout_id
        .as_deref()
        .filter(|r| !r.is_empty())
        .unwrap_or("manual");
    let mut name = String::from(UPDATER_UNIT_PREFIX);
    for b in rollout.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':') {
            name.push(char::from(b));
        } else {
            let _ = write!(name, "\\x{b:02x}");
        }
    }
    let _ = write!(name, "-g{}", spec.generation);
    if name.len() + SUFFIX.len() > MAX_UNIT_NAME {
        return Err(UpgradeError::Spec {
            field: "rollout_id",
            reason: "is too long to name the updater's systemd unit",
        });
    }
    Ok(name)
}

/// Where the answer socket for one upgrade goes: an absolute path in
/// `state_dir` with a random name, checked against
/// [`MAX_SOCKET_PATH_BYTES`] before anything is made.
fn ack_socket_path(state_dir: &Path) -> io::Result<PathBuf> {
    let name = format!("{ACK_SOCKET_PREFIX}{}", uuid::Uuid::new_v4().simple());
    let path = std::path::absolute(state_dir)?.join(&name);
    let len = path.as_os_str().len();
    if len > MAX_SOCKET_PATH_BYTES {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "its answer socket {} would be a {len}-byte path, and a unix socket's path is at most {MAX_SOCKET_PATH_BYTES} bytes; give the node a state directory whose absolute path is at most {} bytes",
                path.display(),
                MAX_SOCKET_PATH_BYTES - name.len() - 1,
            ),
        ));
    }
    Ok(path)
}

/// The answer socket, listening; its file is removed when this drops,
/// however the wait ended.
#[derive(Debug)]
struct AckSocket {
    listener: UnixListener,
    path: PathBuf,
}

impl AckSocket {
    /// Listens at `path`, which must not exist, readable and writable by
    /// this node's user only (the updater's unit runs as root).
    fn bind(path: PathBuf) -> io::Result<Self> {
        let listener = UnixListener::bind(&path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot make its answer socket {}: {e}", path.display()),
            )
        })?;
        // Ours from here: the guard removes it from now on.
        let socket = Self { listener, path };
        std::fs::set_permissions(&socket.path, std::fs::Permissions::from_mode(0o600)).map_err(
            |e| {
                io::Error::new(
                    e.kind(),
                    format!(
                        "cannot restrict its answer socket {}: {e}",
                        socket.path.display()
                    ),
                )
            },
        )?;
        Ok(socket)
    }
}

impl Drop for AckSocket {
    fn drop(&mut self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => {
                warn!(path = %self.path.display(), error = %e, "cannot remove the updater's answer socket");
            }
        }
    }
}

/// What came back on the answer channel.
#[derive(Debug, PartialEq, Eq)]
enum Answer {
    /// A newline-terminated line, without its newline.
    Line(Vec<u8>),
    /// End of file after `partial` bytes and no newline.
    Eof { partial: usize },
    /// More than [`MAX_ACK_BYTES`] without a newline.
    Oversize,
    /// Nothing complete by the deadline, whatever was begun.
    Timeout,
}

impl Answer {
    fn into_result(self, version: &str, ack_wait: Duration) -> Result<(), UpgradeError> {
        let refusal = match self {
            Answer::Line(line) => {
                let line = String::from_utf8_lossy(&line);
                let line = line.trim();
                if line == ACK_ACCEPTED {
                    return Ok(());
                }
                let reason = line
                    .strip_prefix(ACK_REFUSED.trim_end())
                    .unwrap_or(line)
                    .trim();
                Refusal::Said(reason.replace(char::is_control, " "))
            }
            Answer::Eof { partial: 0 } => Refusal::WithoutWord,
            Answer::Eof { .. } => Refusal::Partway,
            Answer::Oversize => Refusal::Oversize,
            Answer::Timeout => Refusal::Silent(ack_wait),
        };
        Err(UpgradeError::Refused {
            version: version.to_owned(),
            refusal,
        })
    }
}

/// Reads the answer from either channel by `deadline`: what
/// [`read_answer`] finds, or [`Answer::Timeout`] when no line is complete
/// by then (bytes without their newline included: an answer is a line).
async fn read_by<R: AsyncRead + Unpin>(deadline: Instant, reader: &mut R) -> io::Result<Answer> {
    timeout_at(deadline, read_answer(reader))
        .await
        .unwrap_or(Ok(Answer::Timeout))
}

/// Reads at most `MAX_ACK_BYTES + 1` bytes up to the first newline, and
/// returns as soon as a line is complete without waiting for end of file.
async fn read_answer<R: AsyncRead + Unpin>(reader: &mut R) -> io::Result<Answer> {
    let mut buf = vec![0u8; MAX_ACK_BYTES + 1];
    let mut filled = 0;
    loop {
        if filled == buf.len() {
            return Ok(Answer::Oversize);
        }
        let n = match reader.read(&mut buf[filled..]).await {
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if n == 0 {
            return Ok(Answer::Eof { partial: filled });
        }
        if let Some(at) = buf[filled..filled + n].iter().position(|b| *b == b'\n') {
            buf.truncate(filled + at);
            return Ok(Answer::Line(buf));
        }
        filled += n;
    }
}

/// Where an [`AckWriter`]'s answer goes.
#[derive(Debug)]
enum Channel {
    /// The descriptor the node handed down (`--ack-fd`).
    Descriptor(File),
    /// The node's answer socket (`--ack-path`).
    Socket(UnixStream),
}

impl Channel {
    fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            Channel::Descriptor(file) => file.write_all(bytes),
            Channel::Socket(stream) => stream.write_all(bytes),
        }
    }
}

/// The updater's end of the answer channel: answers at most once, then
/// closes it.
///
/// A payload is cut to [`MAX_ACK_BYTES`] and ends with one newline; newlines
/// inside a refusal's reason become spaces. Writing is best effort and never
/// fatal. Dropped without having answered, it refuses with
/// [`STOPPED_WITHOUT_ANSWER`]. Without a channel (the command run by hand)
/// it writes nothing.
#[derive(Debug)]
pub struct AckWriter {
    out: Option<Channel>,
}

impl AckWriter {
    /// A writer with no channel: every answer is dropped.
    pub(crate) fn none() -> Self {
        Self { out: None }
    }

    /// Takes the inherited descriptor `fd` as the answer channel
    /// (`--ack-fd`, [`Dispatch::Detached`]).
    ///
    /// Call it first thing in the process, before anything else opens a
    /// file. The descriptor is reopened through `/dev/fd/<fd>` (safe code
    /// cannot adopt a raw descriptor) and the inherited one is closed at
    /// once, so the only copy is the writer's and nothing this process
    /// starts inherits it.
    ///
    /// # Errors
    ///
    /// The reopen's error when `fd` is not open for writing (in which case
    /// nothing is closed).
    pub(crate) fn take_fd(fd: i32) -> io::Result<Self> {
        if fd <= 2 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("--ack-fd {fd} is a standard stream; the answer channel is {ACK_FD}"),
            ));
        }
        let out = std::fs::OpenOptions::new()
            .write(true)
            .open(format!("/dev/fd/{fd}"))?;
        // Sound: `fd` was handed to this process for exactly this, nothing in
        // it owns that number, and we have our own copy now.
        if let Err(e) = nix::unistd::close(fd) {
            debug!(fd, error = %e, "cannot close the inherited answer descriptor");
        }
        Ok(Self {
            out: Some(Channel::Descriptor(out)),
        })
    }

    /// Connects to the node's answer socket at `path` as the answer channel
    /// (`--ack-path`, [`Dispatch::SystemdRun`]).
    ///
    /// Call it first thing, as with [`AckWriter::take_fd`]: once connected,
    /// an updater that dies before answering is seen by the node at once,
    /// as end of file, rather than at the end of its wait. The socket is the
    /// node's; this never creates or removes it.
    ///
    /// # Errors
    ///
    /// The connect's error, naming `path`, when nothing listens there: the
    /// node's wait is over (it removes the socket then), or `path` is not a
    /// node's answer socket.
    pub fn connect(path: &Path) -> io::Result<Self> {
        let stream = UnixStream::connect(path).map_err(|e| {
            io::Error::new(
                e.kind(),
                format!(
                    "cannot connect to the node's answer socket {}: {e}",
                    path.display()
                ),
            )
        })?;
        Ok(Self {
            out: Some(Channel::Socket(stream)),
        })
    }

    /// Whether an answer can still be sent.
    pub(crate) fn is_open(&self) -> bool {
        self.out.is_some()
    }

    /// Says the updater has taken responsibility for the upgrade. Only after
    /// every check that can refuse without side effects.
    pub fn accept(&mut self) {
        self.answer(ACK_ACCEPTED);
    }

    /// Says the updater refuses, and why; nothing was changed.
    pub(crate) fn refuse(&mut self, reason: &str) {
        let reason = reason.replace(['\n', '\r'], " ");
        self.answer(&format!("{ACK_REFUSED}{reason}"));
    }

    fn answer(&mut self, payload: &str) {
        let Some(mut out) = self.out.take() else {
            return;
        };
        let mut end = payload.len().min(MAX_ACK_BYTES);
        while !payload.is_char_boundary(end) {
            end -= 1;
        }
        let mut line = Vec::with_capacity(end + 1);
        line.extend_from_slice(&payload.as_bytes()[..end]);
        line.push(b'\n');
        if let Err(e) = out.write_all(&line) {
            debug!(error = %e, "the node did not hear the answer");
        }
        // `out` drops here: the channel is closed right after the answer.
    }
}

impl Drop for AckWriter {
    fn drop(&mut self) {
        if self.is_open() {
            self.refuse(STOPPED_WITHOUT_ANSWER);
        }
    }
}

/// One word of a systemd `Exec*=` line: double-quoted, with `\\` and `"`
/// escaped, and `%` and `$` doubled so systemd expands neither.
fn exec_word(path: &Path) -> String {
    let text = path.to_string_lossy();
    let mut word = String::with_capacity(text.len() + 2);
    word.push('"');
    for c in text.chars() {
        match c {
            '\\' | '"' => {
                word.push('\\');
                word.push(c);
            }
            '%' => word.push_str("%%"),
            '$' => word.push_str("$$"),
            c => word.push(c),
        }
    }
    word.push('"');
    word
}

#[cfg(test)]
mod tests;
