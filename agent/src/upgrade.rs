//! The upgrader: how `StartUpgrade` hands this node's replacement to
//! billet's own updater, and the one-line acknowledgement both ends speak.
//!
//! Behaviour follows the reference's `node.Upgrader` / `node.ExecUpgrader`
//! (seed/node-package.md; spec/node.md §6, the fd-3 variant). The node execs
//! `<binary> host-upgrade --version V [--manifest-sha256 D] [--rollout R]
//! [--generation G] [--config PATH] --ack-fd 3` detached, and returns as soon
//! as the updater answers on file descriptor 3: `accepted` (it has taken
//! responsibility; the upgrade's progress is read from the rollout, never
//! from this answer) or `refused: <reason>` (it changed nothing). The node
//! never waits longer than the ack wait, so the single command slot is never
//! held by an upgrade's drain.
//!
//! The vocabulary ([`ACK_ACCEPTED`], [`ACK_REFUSED`], [`MAX_ACK_BYTES`],
//! [`ACK_FD`]) is defined once, here, in the module that reads it; the
//! `billet host-upgrade` command writes it through [`AckWriter`] from this
//! same module, so the writer cannot drift from the reader.

use std::ffi::OsString;
use std::fmt;
use std::fs::File;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use async_trait::async_trait;
use command_fds::{CommandFdExt, FdMapping};
use thiserror::Error;
use tokio::io::{AsyncRead, AsyncReadExt};
use tracing::{Instrument, debug, info, info_span, warn};

use crate::wire::UpgradeSpec;

/// What an updater writes once it has taken responsibility for the upgrade.
pub const ACK_ACCEPTED: &str = "accepted";
/// What prefixes the reason when it has not.
pub const ACK_REFUSED: &str = "refused: ";
/// The most either end writes or reads, newline excluded. An answer is one
/// short line; more than this without a newline is not an answer.
pub const MAX_ACK_BYTES: usize = 4 << 10;
/// The child's descriptor the answer travels on: the first after the
/// standard three.
pub const ACK_FD: i32 = 3;
/// How long the node waits for the answer by default (the reference's
/// `ackWait`).
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(90);
/// What `billet host-upgrade` answers while it has no release source to
/// install from.
pub const NO_RELEASE_SOURCE: &str =
    "this updater has no release source configured yet; upgrade this node out of band";
/// What an [`AckWriter`] dropped without answering says on the updater's
/// behalf (a panic, an early return).
pub const STOPPED_WITHOUT_ANSWER: &str =
    "this updater stopped without saying why; look at its log on that machine";

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
    /// The updater could not be started at all; nothing ran.
    #[error("cannot start the updater {binary}: {source}", binary = .binary.display())]
    Spawn {
        /// The executable.
        binary: PathBuf,
        /// Why.
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
    /// No complete line within the ack wait. It may still be working.
    Silent(Duration),
    /// Some bytes, then end of file before the newline.
    Partway,
    /// End of file with nothing: it exited (or closed the descriptor)
    /// without a word.
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
pub async fn start(
    upgrader: Option<&dyn Upgrader>,
    spec: &UpgradeSpec,
) -> Result<(), UpgradeError> {
    let Some(upgrader) = upgrader else {
        return Err(UpgradeError::NoUpgrader {
            version: spec.version.clone(),
        });
    };
    info!(version = %spec.version, rollout = ?spec.rollout_id, generation = spec.generation,
          "starting the updater");
    let result = upgrader.start_upgrade(spec).await;
    match &result {
        Ok(()) => info!(version = %spec.version, "the updater took the upgrade"),
        Err(e) => warn!(version = %spec.version, error = %e, "the upgrade was not started"),
    }
    result
}

/// Runs billet's own updater (`<binary> host-upgrade ...`) as a detached
/// process and waits for its one-line answer on [`ACK_FD`].
///
/// Detached on purpose: the updater's job is to stop the very service that
/// started it, so it must outlive it. It is not tied to any cancellation
/// token, not killed when its handle drops, runs in its own process group
/// (a signal to the node's group does not reach it), and is reaped in the
/// background with its exit status ignored. Its stdin is `/dev/null`; its
/// stdout and stderr are the node's, so its log lands beside the node's.
///
/// Not implemented yet: the reference's later variant that runs the updater
/// through `systemd-run` when the node is a systemd service (the pipe does
/// not survive `systemd-run`; that variant answers on a unix socket,
/// `--ack-path`, instead).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecUpgrader {
    /// The executable to run: normally the installed `billet`.
    pub binary: PathBuf,
    /// Passed to the updater as `--config`, when set.
    pub config: Option<PathBuf>,
    /// How long to wait for the answer.
    pub ack_wait: Duration,
}

impl ExecUpgrader {
    /// An updater at `binary`, with no config and the default ack wait.
    pub fn new(binary: impl Into<PathBuf>) -> Self {
        Self {
            binary: binary.into(),
            config: None,
            ack_wait: DEFAULT_ACK_WAIT,
        }
    }

    /// The arguments after the binary. Empty fence fields are omitted, never
    /// passed empty; a generation of zero means none. Nothing here is a
    /// secret, and nothing secret may ever be added: argv is world-readable.
    ///
    /// # Errors
    ///
    /// [`UpgradeError::Spec`] when a value is empty where required or would
    /// read as a flag.
    pub fn argv(&self, spec: &UpgradeSpec) -> Result<Vec<OsString>, UpgradeError> {
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
        argv.extend(["--ack-fd".into(), ACK_FD.to_string().into()]);
        Ok(argv)
    }
}

#[async_trait]
impl Upgrader for ExecUpgrader {
    async fn start_upgrade(&self, spec: &UpgradeSpec) -> Result<(), UpgradeError> {
        let argv = self.argv(spec)?;
        let spawn_error = |source| UpgradeError::Spawn {
            binary: self.binary.clone(),
            source,
        };
        let (reader, writer) = io::pipe().map_err(spawn_error)?;
        let mut child = {
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
        info!(?pid, binary = %self.binary.display(), ?argv, "the updater is running");
        // The handle is dropped on purpose: this task only reaps the updater
        // so it does not linger as a zombie; nothing waits for its status.
        tokio::spawn(
            async move {
                match child.wait().await {
                    Ok(status) => debug!(%status, "the updater exited"),
                    Err(e) => debug!(error = %e, "cannot wait for the updater"),
                }
            }
            .instrument(info_span!("updater", ?pid, version = %spec.version)),
        );
        let ack_error = |source| UpgradeError::Ack {
            version: spec.version.clone(),
            source,
        };
        let mut reader = tokio::net::unix::pipe::Receiver::from_owned_fd(OwnedFd::from(reader))
            .map_err(ack_error)?;
        let answer = match tokio::time::timeout(self.ack_wait, read_answer(&mut reader)).await {
            Ok(answer) => answer.map_err(ack_error)?,
            Err(_) => Answer::Timeout,
        };
        answer.into_result(&spec.version, self.ack_wait)
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
    /// Nothing complete within the ack wait.
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
    out: Option<File>,
}

impl AckWriter {
    /// A writer with no channel: every answer is dropped.
    pub fn none() -> Self {
        Self { out: None }
    }

    /// Takes the inherited descriptor `fd` as the answer channel.
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
    pub fn take_fd(fd: i32) -> io::Result<Self> {
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
        Ok(Self { out: Some(out) })
    }

    /// Whether an answer can still be sent.
    pub fn is_open(&self) -> bool {
        self.out.is_some()
    }

    /// Says the updater has taken responsibility for the upgrade. Only after
    /// every check that can refuse without side effects.
    pub fn accept(&mut self) {
        self.answer(ACK_ACCEPTED);
    }

    /// Says the updater refuses, and why; nothing was changed.
    pub fn refuse(&mut self, reason: &str) {
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;
    use std::path::Path;
    use std::sync::Arc;
    use std::time::Instant;

    use billet_proto::v1 as pb;
    use tokio::sync::mpsc;

    /// A directory removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new() -> Self {
            let dir = std::env::temp_dir()
                .join(format!("billet-upgrade-{}", uuid::Uuid::new_v4().simple()));
            std::fs::create_dir_all(&dir).expect("temp dir");
            Self(dir)
        }

        /// Writes an executable `/bin/sh` script running `body` in this
        /// directory (its working directory), and returns its path.
        fn script(&self, body: &str) -> PathBuf {
            let path = self.0.join("updater");
            let text = format!("#!/bin/sh\ncd '{}' || exit 1\n{body}\n", self.0.display());
            std::fs::write(&path, text).expect("write script");
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
                .expect("chmod script");
            path
        }

        fn path(&self, name: &str) -> PathBuf {
            self.0.join(name)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// Kills, on drop, the process group a script recorded in `pid`.
    struct Group(i32);

    impl Drop for Group {
        fn drop(&mut self) {
            let _ = std::process::Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", self.0)])
                .stderr(Stdio::null())
                .status();
        }
    }

    fn spec(version: &str) -> UpgradeSpec {
        UpgradeSpec {
            version: version.into(),
            manifest_sha256: None,
            rollout_id: None,
            generation: 0,
        }
    }

    fn upgrader(binary: PathBuf, ack_wait: Duration) -> ExecUpgrader {
        ExecUpgrader {
            binary,
            config: None,
            ack_wait,
        }
    }

    /// Starts the upgrade, retrying only the spawn failure `ETXTBSY`: a
    /// script just written can be briefly "busy" while another test thread
    /// forks with the write descriptor open (it closes at that child's exec).
    async fn start_upgrade(up: &ExecUpgrader, spec: &UpgradeSpec) -> Result<(), UpgradeError> {
        const ETXTBSY: i32 = 26;
        let mut tries = 0;
        loop {
            match up.start_upgrade(spec).await {
                Err(UpgradeError::Spawn { source, .. })
                    if source.raw_os_error() == Some(ETXTBSY) && tries < 50 =>
                {
                    tries += 1;
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                other => return other,
            }
        }
    }

    /// Waits, with a bound, until `path` holds a complete line, and returns
    /// its contents trimmed.
    async fn wait_for_file(path: &Path) -> String {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(text) = std::fs::read_to_string(path)
                && text.ends_with('\n')
            {
                return text.trim().to_owned();
            }
            assert!(
                Instant::now() < deadline,
                "{} was not written within 10s",
                path.display()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn refusal(r: Result<(), UpgradeError>) -> (Refusal, String) {
        match r {
            Err(e @ UpgradeError::Refused { .. }) => {
                let message = e.to_string();
                let UpgradeError::Refused { refusal, .. } = e else {
                    unreachable!()
                };
                (refusal, message)
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn an_updater_that_says_accepted_takes_the_upgrade() {
        let dir = TempDir::new();
        let up = upgrader(dir.script("printf 'accepted\\n' >&3"), DEFAULT_ACK_WAIT);
        start_upgrade(&up, &spec("1.2.3")).await.expect("accepted");
    }

    #[tokio::test]
    async fn accepted_with_surrounding_blanks_is_still_accepted_but_not_without_its_newline() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script("printf '  accepted \\r\\n' >&3"),
            DEFAULT_ACK_WAIT,
        );
        start_upgrade(&up, &spec("1.2.3")).await.expect("accepted");

        let up = upgrader(dir.script("printf 'accepted' >&3"), DEFAULT_ACK_WAIT);
        let (refusal, _) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
        assert_eq!(refusal, Refusal::Partway);
    }

    #[tokio::test]
    async fn an_updater_that_refuses_gives_its_reason() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script("printf 'refused: the manifest digest does not match\\n' >&3"),
            DEFAULT_ACK_WAIT,
        );
        let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
        assert_eq!(
            refusal,
            Refusal::Said("the manifest digest does not match".into())
        );
        assert_eq!(
            message,
            "the updater refused to install 1.2.3: the manifest digest does not match"
        );
    }

    #[tokio::test]
    async fn an_updater_silent_past_the_ack_wait_is_refused_as_maybe_still_working() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script("echo $$ > pid\nsleep 20"),
            Duration::from_secs(1),
        );
        let started = Instant::now();
        let r = start_upgrade(&up, &spec("1.2.3")).await;
        let elapsed = started.elapsed();
        let _group = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));
        let (refusal, message) = refusal(r);
        assert_eq!(refusal, Refusal::Silent(Duration::from_secs(1)));
        assert!(message.contains("did not say within 1s"), "{message}");
        assert!(message.contains("may still be working"), "{message}");
        assert!(
            elapsed >= Duration::from_secs(1) && elapsed < Duration::from_secs(5),
            "returned after {elapsed:?}, not at the 1s bound"
        );
    }

    #[tokio::test]
    async fn an_updater_that_stops_partway_through_its_answer_is_refused_as_such() {
        let dir = TempDir::new();
        let up = upgrader(dir.script("printf 'accep' >&3\nexit 0"), DEFAULT_ACK_WAIT);
        let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
        assert_eq!(refusal, Refusal::Partway);
        assert!(
            message.contains("stopped partway through its answer"),
            "{message}"
        );
    }

    #[tokio::test]
    async fn an_updater_that_exits_without_a_word_is_refused_as_such() {
        let dir = TempDir::new();
        let up = upgrader(dir.script("exit 3"), DEFAULT_ACK_WAIT);
        let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
        assert_eq!(refusal, Refusal::WithoutWord);
        assert!(message.contains("stopped without saying why"), "{message}");
    }

    #[tokio::test]
    async fn an_oversize_answer_is_refused_as_not_an_answer() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script("head -c 5000 /dev/zero | tr '\\0' x >&3\nsleep 1"),
            DEFAULT_ACK_WAIT,
        );
        let (refusal, message) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
        assert_eq!(refusal, Refusal::Oversize);
        assert!(message.contains("ran past 4096 bytes"), "{message}");
    }

    #[tokio::test]
    async fn an_answer_of_exactly_the_limit_is_still_a_line() {
        let dir = TempDir::new();
        // 9 bytes of prefix + 4087 of reason = 4096, then the newline.
        let up = upgrader(
            dir.script(
                "{ printf 'refused: '; head -c 4087 /dev/zero | tr '\\0' y; printf '\\n'; } >&3",
            ),
            DEFAULT_ACK_WAIT,
        );
        let (refusal, _) = refusal(start_upgrade(&up, &spec("1.2.3")).await);
        assert_eq!(refusal, Refusal::Said("y".repeat(4087)));
    }

    #[tokio::test]
    async fn the_distinct_refusals_have_distinct_messages() {
        let messages: Vec<String> = [
            Refusal::Said("no".into()),
            Refusal::Silent(DEFAULT_ACK_WAIT),
            Refusal::Partway,
            Refusal::WithoutWord,
            Refusal::Oversize,
        ]
        .iter()
        .map(|r| r.describe("1.2.3"))
        .collect();
        for (i, a) in messages.iter().enumerate() {
            for b in &messages[i + 1..] {
                assert_ne!(a, b);
            }
        }
        assert!(
            messages[1].contains("did not say within 90s"),
            "{}",
            messages[1]
        );
    }

    #[tokio::test]
    async fn the_argv_names_every_fence_that_is_set() {
        let dir = TempDir::new();
        let mut up = upgrader(
            dir.script(
                "for a in \"$@\"; do printf '%s\\n' \"$a\"; done > args\nprintf 'accepted\\n' >&3",
            ),
            DEFAULT_ACK_WAIT,
        );
        up.config = Some("/etc/billet/upgrade.toml".into());
        let digest = "ab".repeat(32);
        let spec = UpgradeSpec {
            version: "1.2.3".into(),
            manifest_sha256: Some(digest.clone()),
            rollout_id: Some("rollout-7".into()),
            generation: 4,
        };
        start_upgrade(&up, &spec).await.expect("accepted");
        let args = std::fs::read_to_string(dir.path("args")).expect("args");
        assert_eq!(
            args.lines().collect::<Vec<_>>(),
            [
                "host-upgrade",
                "--version",
                "1.2.3",
                "--manifest-sha256",
                &digest,
                "--rollout",
                "rollout-7",
                "--generation",
                "4",
                "--config",
                "/etc/billet/upgrade.toml",
                "--ack-fd",
                "3"
            ]
        );
    }

    #[tokio::test]
    async fn the_argv_omits_empty_fences_and_never_passes_them_empty() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script("for a in \"$@\"; do printf '[%s]\\n' \"$a\"; done > args\nprintf 'accepted\\n' >&3"),
            DEFAULT_ACK_WAIT,
        );
        for spec in [
            spec("1.2.3"),
            UpgradeSpec {
                version: "1.2.3".into(),
                manifest_sha256: Some(String::new()),
                rollout_id: Some(String::new()),
                generation: 0,
            },
        ] {
            start_upgrade(&up, &spec).await.expect("accepted");
            let args = std::fs::read_to_string(dir.path("args")).expect("args");
            assert_eq!(
                args.lines().collect::<Vec<_>>(),
                [
                    "[host-upgrade]",
                    "[--version]",
                    "[1.2.3]",
                    "[--ack-fd]",
                    "[3]"
                ],
                "for {spec:?}"
            );
            assert!(!args.contains("[]"), "an empty argument was passed");
        }
    }

    #[test]
    fn a_value_that_would_read_as_a_flag_is_never_passed() {
        let up = ExecUpgrader::new("/nonexistent/billet");
        let mut s = spec("--config");
        assert!(matches!(
            up.argv(&s),
            Err(UpgradeError::Spec {
                field: "version",
                ..
            })
        ));
        s.version = "1.2.3".into();
        s.rollout_id = Some("-x".into());
        assert!(matches!(
            up.argv(&s),
            Err(UpgradeError::Spec {
                field: "rollout_id",
                ..
            })
        ));
    }

    #[tokio::test]
    async fn an_updater_that_cannot_be_started_is_a_spawn_error() {
        let up = ExecUpgrader::new("/nonexistent/billet");
        let r = up.start_upgrade(&spec("1.2.3")).await;
        assert!(matches!(r, Err(UpgradeError::Spawn { .. })), "{r:?}");
    }

    #[tokio::test]
    async fn a_node_without_an_updater_says_to_upgrade_it_out_of_band() {
        let e = start(None, &spec("1.2.3")).await.expect_err("refused");
        assert!(matches!(e, UpgradeError::NoUpgrader { .. }));
        assert_eq!(
            e.to_string(),
            "this node has no transactional updater, so it cannot install 1.2.3; upgrade it out of band (replace the billet binary and restart the service)"
        );
    }

    fn pgid_of(pid: u32) -> i32 {
        let out = std::process::Command::new("ps")
            .args(["-o", "pgid=", "-p", &pid.to_string()])
            .output()
            .expect("this test needs ps(1) to read process groups");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .expect("a process group id")
    }

    fn alive(pid: i32) -> bool {
        // A zombie still has a /proc entry; it is not alive.
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| s.rsplit_once(") ").map(|(_, rest)| !rest.starts_with('Z')))
            .unwrap_or(false)
    }

    #[test]
    fn the_updater_runs_in_its_own_process_group_and_outlives_the_node_side() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script(
                "echo $$ > pid\nps -o pgid= -p $$ > pgid\nprintf 'accepted\\n' >&3\nsleep 30",
            ),
            DEFAULT_ACK_WAIT,
        );
        // The node side: a runtime of its own, dropped once the updater has
        // answered, as a node stopping would drop everything it runs.
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let started = Instant::now();
        runtime
            .block_on(start_upgrade(&up, &spec("1.2.3")))
            .expect("accepted");
        assert!(started.elapsed() < Duration::from_secs(10));
        drop(runtime);
        drop(up);

        let pid: i32 = std::fs::read_to_string(dir.path("pid"))
            .expect("pid")
            .trim()
            .parse()
            .expect("pid");
        let _group = Group(pid);
        let pgid: i32 = std::fs::read_to_string(dir.path("pgid"))
            .expect("pgid")
            .trim()
            .parse()
            .expect("pgid");
        assert_eq!(pgid, pid, "the updater leads its own process group");
        assert_ne!(
            pgid,
            pgid_of(std::process::id()),
            "the updater shares the node's process group"
        );
        assert!(
            alive(pid),
            "the updater died with the node side that started it"
        );
    }

    #[tokio::test]
    async fn an_updater_that_exits_is_reaped_and_left_no_zombie() {
        let dir = TempDir::new();
        let up = upgrader(
            dir.script("echo $$ > pid\nprintf 'accepted\\n' >&3\nexit 0"),
            DEFAULT_ACK_WAIT,
        );
        start_upgrade(&up, &spec("1.2.3")).await.expect("accepted");
        let pid = wait_for_file(&dir.path("pid")).await;
        let stat = PathBuf::from(format!("/proc/{pid}"));
        let deadline = Instant::now() + Duration::from_secs(10);
        while stat.exists() {
            assert!(
                Instant::now() < deadline,
                "the updater {pid} was not reaped within 10s (a zombie)"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    #[tokio::test]
    async fn the_node_answers_at_the_updaters_first_line_and_its_slot_is_free_right_after() {
        use crate::journal::MemoryJournal;
        use crate::model::CommandId;
        use crate::plane::{PlaneLink, SessionLink};
        use crate::provider::fake::FakeProvider;
        use crate::runner::{Runner, RunnerOptions};
        use crate::session::{Executor, Recovery, execute_commands};
        use crate::slot::{Admission, CommandSlot, Queued};
        use crate::wire::NodeCommand;
        use tokio_util::sync::CancellationToken;

        let dir = TempDir::new();
        let up = upgrader(
            dir.script("echo $$ > pid\nprintf 'accepted\\n' >&3\nsleep 30"),
            DEFAULT_ACK_WAIT,
        );
        // Spawn the script once first so a busy-text retry cannot skew the timing.
        start_upgrade(&up, &spec("1.2.2")).await.expect("accepted");
        let _first = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));
        std::fs::remove_file(dir.path("pid")).expect("rm pid");

        let link = Arc::new(PlaneLink::new(Duration::from_millis(50)));
        let runner = Arc::new(Runner::new(
            Arc::new(FakeProvider::new()),
            link.clone(),
            link,
            RunnerOptions::default(),
        ));
        let slot = Arc::new(CommandSlot::new());
        let (tx, mut rx) = mpsc::channel(8);
        let session = Arc::new(SessionLink::new(1, tx));
        let far = i64::MAX;
        for (id, command) in [
            ("a1", NodeCommand::StartUpgrade(spec("1.2.3"))),
            ("a2", NodeCommand::Instances),
        ] {
            let admission = slot.push(Queued {
                id: CommandId::parse("id", id).expect("id"),
                deadline_unix_ms: far,
                command,
                session: session.clone(),
            });
            assert!(matches!(admission, Admission::Queued));
        }
        let cancel = CancellationToken::new();
        let executor = tokio::spawn(execute_commands(
            runner,
            slot,
            Executor {
                recovery: Arc::new(Recovery::done()),
                journal: Arc::new(MemoryJournal::default()),
                ack_timeout: Duration::from_secs(60),
                upgrader: Some(Arc::new(up) as Arc<dyn Upgrader>),
            },
            cancel.clone(),
        ));

        let started = Instant::now();
        let mut results = Vec::new();
        while results.len() < 2 {
            let message = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                .await
                .expect("answered within 10s, long before the updater's 30s are up")
                .expect("session open");
            if let Ok(pb::NodeMessage {
                body: Some(pb::node_message::Body::Result(r)),
            }) = message
            {
                results.push((r, started.elapsed()));
            }
        }
        cancel.cancel();
        executor.await.expect("executor");
        let _second = Group(wait_for_file(&dir.path("pid")).await.parse().expect("pid"));

        let (upgrade, upgrade_at) = &results[0];
        assert_eq!(upgrade.id, "a1");
        assert_eq!(upgrade.outcome, pb::Outcome::Ok as i32, "{upgrade:?}");
        let (next, next_at) = &results[1];
        assert_eq!(next.id, "a2");
        assert_eq!(next.outcome, pb::Outcome::Ok as i32, "{next:?}");
        assert!(*upgrade_at < Duration::from_secs(10), "{upgrade_at:?}");
        assert!(
            next_at.saturating_sub(*upgrade_at) < Duration::from_secs(2),
            "the next command waited {:?} behind the upgrade",
            next_at.saturating_sub(*upgrade_at)
        );
    }

    #[tokio::test]
    async fn a_refusal_reaches_the_plane_as_refused_with_its_sentence() {
        use crate::journal::MemoryJournal;
        use crate::model::CommandId;
        use crate::plane::{PlaneLink, SessionLink};
        use crate::provider::fake::FakeProvider;
        use crate::runner::{Runner, RunnerOptions};
        use crate::session::{Executor, Recovery, execute_commands};
        use crate::slot::{CommandSlot, Queued};
        use crate::wire::NodeCommand;
        use tokio_util::sync::CancellationToken;

        let dir = TempDir::new();
        let up = upgrader(
            dir.script("printf 'refused: not today\\n' >&3"),
            DEFAULT_ACK_WAIT,
        );
        let link = Arc::new(PlaneLink::new(Duration::from_millis(50)));
        let runner = Arc::new(Runner::new(
            Arc::new(FakeProvider::new()),
            link.clone(),
            link,
            RunnerOptions::default(),
        ));
        let slot = Arc::new(CommandSlot::new());
        let (tx, mut rx) = mpsc::channel(8);
        let session = Arc::new(SessionLink::new(1, tx));
        for (id, upgrader) in [
            ("b1", Some(Arc::new(up) as Arc<dyn Upgrader>)),
            ("b2", None),
        ] {
            let slot = slot.clone();
            slot.push(Queued {
                id: CommandId::parse("id", id).expect("id"),
                deadline_unix_ms: i64::MAX,
                command: NodeCommand::StartUpgrade(spec("1.2.3")),
                session: session.clone(),
            });
            let cancel = CancellationToken::new();
            let executor = tokio::spawn(execute_commands(
                runner.clone(),
                slot,
                Executor {
                    recovery: Arc::new(Recovery::done()),
                    journal: Arc::new(MemoryJournal::default()),
                    ack_timeout: Duration::from_secs(60),
                    upgrader,
                },
                cancel.clone(),
            ));
            let r = loop {
                let message = tokio::time::timeout(Duration::from_secs(10), rx.recv())
                    .await
                    .expect("answered")
                    .expect("session open");
                if let Ok(pb::NodeMessage {
                    body: Some(pb::node_message::Body::Result(r)),
                }) = message
                {
                    break r;
                }
            };
            cancel.cancel();
            executor.await.expect("executor");
            assert_eq!(r.id, id);
            assert_eq!(r.outcome, pb::Outcome::Refused as i32);
            let error = r.error.expect("an error");
            assert_eq!(error.code, pb::ErrorCode::Refused as i32);
            let expected = if id == "b1" {
                "the updater refused to install 1.2.3: not today"
            } else {
                "this node has no transactional updater, so it cannot install 1.2.3; upgrade it out of band (replace the billet binary and restart the service)"
            };
            assert_eq!(error.message, expected);
        }
    }

    #[test]
    fn the_writer_answers_once_cuts_to_the_limit_and_flattens_newlines() {
        let dir = TempDir::new();
        let path = dir.path("ack");
        let open = || AckWriter {
            out: Some(File::create(&path).expect("create")),
        };

        let mut w = open();
        w.refuse("line one\nline two\r\nthree");
        w.accept();
        drop(w);
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            "refused: line one line two  three\n"
        );

        let mut w = open();
        w.refuse(&"é".repeat(4000));
        drop(w);
        let text = std::fs::read_to_string(&path).expect("read");
        assert!(
            text.ends_with('\n') && text.len() <= MAX_ACK_BYTES + 1,
            "{}",
            text.len()
        );
        assert!(text.starts_with(ACK_REFUSED));

        let w = open();
        drop(w);
        assert_eq!(
            std::fs::read_to_string(&path).expect("read"),
            format!("{ACK_REFUSED}{STOPPED_WITHOUT_ANSWER}\n")
        );

        let mut w = AckWriter::none();
        w.accept();
        assert!(!w.is_open());
    }

    #[tokio::test]
    async fn the_reader_stops_at_the_first_newline_without_waiting_for_eof() {
        let (mut tx, mut rx) = tokio::io::duplex(64);
        tokio::io::AsyncWriteExt::write_all(&mut tx, b"accepted\nmore")
            .await
            .expect("write");
        // `tx` stays open: no end of file.
        let answer = tokio::time::timeout(Duration::from_secs(5), read_answer(&mut rx))
            .await
            .expect("no wait for eof")
            .expect("read");
        assert_eq!(answer, Answer::Line(b"accepted".to_vec()));
        drop(tx);
    }
}
