//! How a guest receives its credentials (the runner's JIT config, its cache
//! session token, its Actions cache proxy URL) without any of them entering
//! what the engine records about the container: not its environment, not
//! its labels, not its command line.
//!
//! Each instance gets a directory of its own on the host,
//! `<base>/<instance>/`, bound into the guest at [`GUEST_DIR`], holding one
//! FIFO, [`SECRETS_FILE`]. The guest's environment names only the path
//! ([`SECRETS_ENV`]). Once the instance has started (the create waiting a
//! little for it, `docker::HANDOFF_WAIT`), the node opens the FIFO
//! as soon as the guest opens it to read, writes one `KEY=VALUE` line per
//! credential, closes it, and removes the directory: the guest reads its
//! credentials once, and a second read finds no file. A guest's entrypoint
//! does what the stand-in runner does, or, in any image with a POSIX shell:
//!
//! ```sh
//! while IFS= read -r line; do export "$line"; done < "$BILLET_SECRETS_FILE" || exit 1
//! unset BILLET_SECRETS_FILE
//! exec ./run.sh
//! ```
//!
//! `actions/runner` then finds `ACTIONS_RUNNER_INPUT_JITCONFIG` in its own
//! environment, which the engine does not record.

use std::path::{Path, PathBuf};
use std::time::Duration;

use nix::sys::stat::Mode;
use tokio::io::AsyncWriteExt as _;

use crate::model::InstanceName;

/// The handoff directories' directory in the node's state directory.
pub(crate) const STATE_DIR: &str = "handoff";

/// The guest's directory the instance's handoff directory is bound at.
pub(crate) const GUEST_DIR: &str = "/run/billet";

/// The FIFO's name in the handoff directory.
pub(crate) const SECRETS_FILE: &str = "secrets";

/// The variable naming the FIFO in the guest ([`GUEST_DIR`]/[`SECRETS_FILE`]).
pub(crate) const SECRETS_ENV: &str = "BILLET_SECRETS_FILE";

/// How long the node waits for a guest to open its FIFO. A runner that has
/// not asked for its credentials by then never will: it cannot come online,
/// and the start deadline ends it.
pub(crate) const DELIVERY_BOUND: Duration = Duration::from_secs(600);

/// How often the node looks for the guest's reader while it waits.
const READER_POLL: Duration = Duration::from_millis(2);

/// Where the handoff directories of one node's instances live.
#[derive(Debug, Clone)]
pub(crate) struct Handoffs {
    base: PathBuf,
}

impl Handoffs {
    /// Handoff directories under `base`, which is made (mode 0700: no other
    /// user of the host reaches a FIFO) when the first is prepared.
    pub(crate) fn new(base: PathBuf) -> Self {
        Self { base }
    }

    /// The host directory of `name`'s handoff.
    pub(crate) fn dir(&self, name: &InstanceName) -> PathBuf {
        self.base.join(name.as_str())
    }

    /// Makes `name`'s directory (mode 0711, so the guest's user, whatever
    /// its uid, reaches the FIFO in it) with a fresh FIFO (mode 0666) in
    /// it, replacing any left by an earlier attempt.
    ///
    /// # Errors
    ///
    /// The filesystem's, naming the path.
    pub(crate) fn prepare(&self, name: &InstanceName) -> Result<PathBuf, String> {
        use std::os::unix::fs::{DirBuilderExt as _, PermissionsExt as _};
        let fail = |what: &str, path: &Path, e: &dyn std::fmt::Display| {
            format!("{what} {}: {e}", path.display())
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.base)
            .map_err(|e| fail("make the handoff directory", &self.base, &e))?;
        let dir = self.dir(name);
        self.remove(name);
        std::fs::DirBuilder::new()
            .mode(0o711)
            .create(&dir)
            .map_err(|e| fail("make", &dir, &e))?;
        // The mode asked for is reduced by the umask: set it exactly.
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o711))
            .map_err(|e| fail("set the mode of", &dir, &e))?;
        let fifo = dir.join(SECRETS_FILE);
        nix::unistd::mkfifo(&fifo, Mode::from_bits_truncate(0o666))
            .map_err(|e| fail("make the FIFO", &fifo, &e))?;
        std::fs::set_permissions(&fifo, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| fail("set the mode of", &fifo, &e))?;
        Ok(dir)
    }

    /// Removes every handoff directory: what an earlier process of this
    /// node left waiting was lost with it (those runners never receive
    /// their config, and the start deadline ends them).
    pub(crate) fn clear(&self) {
        if let Err(e) = std::fs::remove_dir_all(&self.base)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %self.base.display(), error = %e, "cannot remove the handoff directories");
        }
    }

    /// Moves `from`'s directory to `to`'s: a warm runner taken by a lease.
    /// The instance's bind mount follows the directory, so its guest still
    /// finds its FIFO.
    ///
    /// # Errors
    ///
    /// The filesystem's, naming both paths.
    pub(crate) fn rename(&self, from: &InstanceName, to: &InstanceName) -> Result<(), String> {
        let (from, to) = (self.dir(from), self.dir(to));
        std::fs::rename(&from, &to)
            .map_err(|e| format!("rename {} to {}: {e}", from.display(), to.display()))
    }

    /// Removes `name`'s directory, if any. Nothing to remove is success.
    pub(crate) fn remove(&self, name: &InstanceName) {
        let dir = self.dir(name);
        if let Err(e) = std::fs::remove_dir_all(&dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            tracing::warn!(dir = %dir.display(), error = %e, "cannot remove a handoff directory");
        }
    }

    /// Writes `secrets` to `name`'s FIFO once its guest opens it, within
    /// `bound`, then removes the directory whatever happened: a guest that
    /// did not read in time never finds the FIFO again. A FIFO removed
    /// meanwhile (its instance destroyed) ends the wait quietly.
    ///
    /// # Errors
    ///
    /// Why nothing was delivered (the guest never opened the FIFO, or the
    /// write failed), without the secrets.
    pub(crate) async fn deliver(
        &self,
        name: &InstanceName,
        secrets: &Secrets,
        bound: Duration,
    ) -> Result<(), String> {
        let fifo = self.dir(name).join(SECRETS_FILE);
        let delivered = tokio::time::timeout(bound, async {
            // Opening a FIFO to write without blocking fails (ENXIO) until
            // a reader has it open.
            let mut sender = loop {
                match tokio::net::unix::pipe::OpenOptions::new().open_sender(&fifo) {
                    Ok(sender) => break sender,
                    Err(e) if e.raw_os_error() == Some(nix::libc::ENXIO) => {
                        tokio::time::sleep(READER_POLL).await;
                    }
                    // Removed meanwhile: the instance was destroyed, and
                    // nobody is left to hand anything to.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
                    Err(e) => return Err(format!("open {}: {e}", fifo.display())),
                }
            };
            sender
                .write_all(secrets.text.as_bytes())
                .await
                .map_err(|e| format!("write to {}: {e}", fifo.display()))
        })
        .await
        .unwrap_or_else(|_| {
            Err(format!(
                "the guest did not open {} within {}s",
                fifo.display(),
                bound.as_secs()
            ))
        });
        self.remove(name);
        delivered
    }
}

/// The credentials one guest receives: `KEY=VALUE` lines. `Debug` shows
/// only the keys.
#[derive(Clone, Default)]
pub(crate) struct Secrets {
    text: String,
    keys: Vec<String>,
}

impl Secrets {
    /// Adds `key=value`.
    ///
    /// # Errors
    ///
    /// A key that is not a variable name, or a value with a line break or a
    /// NUL (which would end or cut the line), naming the key only.
    pub(crate) fn add(&mut self, key: &str, value: &str) -> Result<(), String> {
        if key.is_empty() || key.contains(['=', '\n', '\0']) {
            return Err(format!("{key:?} is not a variable name"));
        }
        if value.contains(['\n', '\r', '\0']) {
            return Err(format!("the value of {key} holds a line break or a NUL"));
        }
        self.text.push_str(key);
        self.text.push('=');
        self.text.push_str(value);
        self.text.push('\n');
        self.keys.push(key.to_owned());
        Ok(())
    }
}

impl std::fmt::Debug for Secrets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Secrets").field("keys", &self.keys).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::LeaseId;

    fn name(lease: &str) -> InstanceName {
        InstanceName::for_lease(&LeaseId::parse("lease", lease).unwrap())
    }

    fn scratch() -> PathBuf {
        std::env::temp_dir().join(format!("billet-handoff-{}", uuid::Uuid::new_v4().simple()))
    }

    #[tokio::test]
    async fn a_guest_reads_its_secrets_once_and_a_second_read_finds_no_file() {
        let handoffs = Handoffs::new(scratch());
        let n = name("h1");
        let dir = handoffs.prepare(&n).unwrap();
        let fifo = dir.join(SECRETS_FILE);
        let mut secrets = Secrets::default();
        secrets
            .add("ACTIONS_RUNNER_INPUT_JITCONFIG", "c2VjcmV0")
            .unwrap();
        secrets.add("BILLET_CACHE_TOKEN", "abc").unwrap();
        let guest = tokio::task::spawn_blocking({
            let fifo = fifo.clone();
            move || std::fs::read_to_string(fifo).unwrap()
        });
        handoffs
            .deliver(&n, &secrets, Duration::from_secs(10))
            .await
            .unwrap();
        assert_eq!(
            guest.await.unwrap(),
            "ACTIONS_RUNNER_INPUT_JITCONFIG=c2VjcmV0\nBILLET_CACHE_TOKEN=abc\n"
        );
        assert!(!fifo.exists(), "a second read would find the FIFO");
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn a_guest_that_never_reads_gets_nothing_and_the_fifo_goes() {
        let handoffs = Handoffs::new(scratch());
        let n = name("h2");
        let dir = handoffs.prepare(&n).unwrap();
        let mut secrets = Secrets::default();
        secrets.add("K", "v").unwrap();
        let err = handoffs
            .deliver(&n, &secrets, Duration::from_millis(50))
            .await
            .unwrap_err();
        assert!(err.contains("did not open"), "{err}");
        assert!(!err.contains("K=v"), "{err}");
        assert!(!dir.exists());
    }

    #[tokio::test]
    async fn a_handoff_withdrawn_by_a_destroy_ends_quietly() {
        let handoffs = Handoffs::new(scratch());
        let n = name("h4");
        handoffs.prepare(&n).unwrap();
        let mut secrets = Secrets::default();
        secrets.add("K", "v").unwrap();
        let waiting = tokio::spawn({
            let handoffs = handoffs.clone();
            let n = n.clone();
            async move {
                handoffs
                    .deliver(&n, &secrets, Duration::from_secs(30))
                    .await
            }
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        handoffs.remove(&n);
        let ended = tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("the wait ended")
            .unwrap();
        assert_eq!(ended, Ok(()));
        handoffs.clear();
        assert!(!handoffs.base.exists());
    }

    #[test]
    fn the_fifo_reaches_any_guest_user_and_its_directory_lists_nothing_to_others() {
        use std::os::unix::fs::{FileTypeExt as _, PermissionsExt as _};
        let base = scratch();
        let handoffs = Handoffs::new(base.clone());
        let dir = handoffs.prepare(&name("h3")).unwrap();
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&base), 0o700);
        assert_eq!(mode(&dir), 0o711);
        let fifo = dir.join(SECRETS_FILE);
        assert_eq!(mode(&fifo), 0o666);
        assert!(std::fs::metadata(&fifo).unwrap().file_type().is_fifo());
        // Prepared again (a retried create): a fresh FIFO, nothing else.
        handoffs.prepare(&name("h3")).unwrap();
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
        handoffs.remove(&name("h3"));
        assert!(!dir.exists());
        let _ = std::fs::remove_dir_all(base);
    }

    #[test]
    fn a_secret_that_would_break_its_line_is_refused_naming_only_its_key() {
        let mut secrets = Secrets::default();
        let err = secrets.add("K", "a\nb").unwrap_err();
        assert!(err.contains('K') && !err.contains("a\nb"), "{err}");
        assert!(secrets.add("A=B", "v").is_err());
        assert_eq!(format!("{secrets:?}"), r#"Secrets { keys: [] }"#);
        secrets.add("K", "v").unwrap();
        assert_eq!(format!("{secrets:?}"), r#"Secrets { keys: ["K"] }"#);
    }
}
