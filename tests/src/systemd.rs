//! A host under real systemd, for the path operators run in production: the
//! deployed unit (`deploy/billet-node.service`, `Type=notify`), `systemctl`
//! as the updater's service manager, and `systemd-run` starting the updater
//! as its own transient unit.
//!
//! No image can be pulled, so [`SystemdHost::start`] packs one from this
//! machine: the files of the installed `systemd` package (without its
//! `tmpfiles.d` rules, which would empty directories at boot), a shell and a
//! few tools, `dpkg` and `passwd` with a dpkg database of its own (so a
//! package can be installed with `dpkg -i` and its maintainer scripts run),
//! and the libraries they and `billet` load. Its PID 1 is
//! systemd. It shares the host's network, its Docker socket and one
//! directory of its own ([`SystemdHost::shared`], mounted at the same path,
//! where the cluster keeps its binaries, certificates, state and logs), so
//! a node run there serves the harness's plane and starts runner containers
//! like any other. It needs no privileges. Of the host's cgroups only the
//! `name=systemd` hierarchy (bookkeeping, no resource control) is mounted
//! writable, because systemd needs it; systemd keeps to its own subtree
//! there (`/docker/<id>`), and every resource controller is read-only.
//! Nothing else of the host is shared.
//! Process ids inside are the container's own: the harness never signals a
//! node of this host by pid, only through `systemctl`.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use anyhow::{Context, Result, bail, ensure};

/// The image's tag. It holds nothing of this repository (`billet` is run
/// from the cluster's directory under the shared `/tmp`), only the host's
/// systemd and the libraries `billet` needs, so one build serves a run.
pub const IMAGE: &str = "billet-test-systemd:5";

/// Packs [`IMAGE`] from the host. `$BILLET` is the binary whose libraries
/// are added.
const PACK: &str = r#"
set -euo pipefail
out=$(mktemp)
trap 'rm -f "$out" "$out.files"' EXIT
canon() { local d; d=$(readlink -f "$(dirname "$1")"); echo "$d/$(basename "$1")" | sed 's|^//*|/|'; }
add() {
  local p; p=$(canon "$1")
  echo "$p" >> "$out"
  if [ -L "$p" ]; then add "$(readlink -f "$p")"; fi
}
{
  # systemd; dpkg, for installing the package (tests/tests/package.rs), with
  # what it and a maintainer script run.
  dpkg -L systemd dpkg passwd
  for b in sh dash sleep cat cp rm touch mkdir ls kill env true grep \
    tar diff ldconfig getent id install chown chmod stat gzip test; do type -P "$b"; done
  echo "$BILLET"
  printf '%s\n' /etc/passwd /etc/group /etc/nsswitch.conf /etc/login.defs \
    /usr/lib/os-release /etc/os-release
} | sort -u | while read -r f; do
  if [ -n "$f" ] && { [ -L "$f" ] || [ -f "$f" ]; }; then add "$f"; fi
done
for f in $(sort -u "$out"); do
  if [ -f "$f" ] && [ "$(head -c 4 "$f" | od -An -c | tr -d ' ')" = '177ELF' ]; then
    for l in $(ldd "$f" 2>/dev/null | grep -o '/[^ ]*' || true); do add "$l"; done
  fi
done
printf '%s\n' /bin /lib /lib64 /sbin >> "$out"
# billet itself is run from the cluster's directory, not the image.
sort -u "$out" | grep -v -e '^/dev/' -e '^/usr/lib/tmpfiles.d/' -e "^$BILLET\$" | sed 's|^/||' | sort -u > "$out.files"
# A dpkg database of its own that knows only the packages whose files are
# here and a package may depend on; no triggers, so installing runs no other
# package's scripts (man-db's, say), which are not here.
db=$(mktemp -d)
trap 'rm -rf "$out" "$out.files" "$out.db" "$out.tar" "$db"' EXIT
mkdir -p "$db/var/lib/dpkg/info" "$db/var/lib/dpkg/updates" "$db/var/lib/dpkg/triggers"
dpkg-query -s libc6 libgcc-s1 passwd dpkg systemd > "$db/var/lib/dpkg/status"
: > "$db/var/lib/dpkg/available"
( cd "$db" && find var -depth -print | sort ) > "$out.db"
tar -C / --hard-dereference --no-recursion --ignore-failed-read -cf "$out.tar" -T "$out.files" 2>/dev/null
tar -C "$db" --no-recursion -rf "$out.tar" -T "$out.db"
docker import -c 'CMD ["/usr/lib/systemd/systemd"]' - "$IMAGE" < "$out.tar" >/dev/null
"#;

/// A stand-in for the Docker engine's own unit, which the deployed unit
/// wants: the engine is the host's, reached through its socket.
const DOCKER_UNIT: &str = "[Unit]\nDescription=stand-in: the host's Docker engine\n\n[Service]\nType=oneshot\nRemainAfterExit=yes\nExecStart=/bin/true\n";

/// A running container whose PID 1 is systemd.
#[derive(Debug)]
pub struct SystemdHost {
    /// The container's name.
    pub name: String,
    /// The directory shared with the container, at the same path.
    pub shared: PathBuf,
}

/// Where a cluster runs its nodes under systemd
/// ([`crate::cluster::ClusterOptions::systemd`]).
#[derive(Debug, Clone)]
pub struct SystemdTarget {
    /// The container whose systemd runs the nodes.
    pub container: String,
    /// The directory shared with it: the cluster's directory goes there.
    pub shared: PathBuf,
}

impl SystemdHost {
    /// Builds [`IMAGE`] if this engine lacks it, starts a container from it
    /// sharing the host's network, `docker_socket` and a fresh directory,
    /// and waits until systemd has booted.
    ///
    /// # Errors
    ///
    /// When this machine has no `systemd` package, the image cannot be
    /// packed, or systemd does not come up within 60 s.
    pub fn start(docker_socket: &Path) -> Result<Self> {
        ensure_image()?;
        let name = format!("billet-systemd-{}", uuid::Uuid::new_v4().simple());
        // Short: the node's state directory goes under it, and the
        // updater's answer socket under that (a unix socket's path is at
        // most 107 bytes).
        let shared = std::env::temp_dir().join(format!(
            "bsd-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        std::fs::create_dir_all(&shared).with_context(|| format!("create {}", shared.display()))?;
        let mount = format!("{0}:{0}", shared.display());
        // From here a failure removes the directory and any container.
        let host = Self { name, shared };
        let socket = docker_socket.display().to_string();
        let out = Command::new("docker")
            .args(["run", "-d", "--name", &host.name, "--network", "host"])
            .args(["--tmpfs", "/run", "--tmpfs", "/run/lock"])
            // systemd needs its own bookkeeping hierarchy writable; every
            // resource controller stays as the engine mounts it, read-only.
            .args(["-v", "/sys/fs/cgroup/systemd:/sys/fs/cgroup/systemd"])
            // Mount namespaces, so a unit's hardening (ProtectSystem=,
            // PrivateTmp=, ...) is enforced as on a real host; without it
            // systemd skips those settings silently.
            .args(["--cap-add", "SYS_ADMIN"])
            .args(["-v", &mount])
            .args(["-v", &format!("{socket}:{socket}")])
            .args(["-e", "container=docker", IMAGE])
            .output()
            .context("docker run")?;
        ensure!(
            out.status.success(),
            "docker run {IMAGE}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        loop {
            let state = host.exec(&["systemctl", "is-system-running"])?;
            let said = String::from_utf8_lossy(&state.stdout).trim().to_owned();
            // `degraded`: a unit of the packed host failed (first boot);
            // the manager itself is up.
            if said == "running" || said == "degraded" {
                break;
            }
            if std::time::Instant::now() > deadline {
                bail!("systemd in {} did not come up: {said:?}", host.name);
            }
            std::thread::sleep(std::time::Duration::from_millis(200));
        }
        host.write_file("/etc/systemd/system/docker.service", DOCKER_UNIT)?;
        Ok(host)
    }

    /// Runs `args` in the container.
    ///
    /// # Errors
    ///
    /// When `docker exec` cannot be run.
    pub fn exec(&self, args: &[&str]) -> Result<Output> {
        exec_in(&self.name, args)
    }

    /// Runs `args` in the container and fails unless they succeed.
    ///
    /// # Errors
    ///
    /// With their output when they fail.
    pub fn run(&self, args: &[&str]) -> Result<String> {
        run_in(&self.name, args)
    }

    /// Writes `text` to `path` inside the container.
    ///
    /// # Errors
    ///
    /// When it cannot be written.
    pub fn write_file(&self, path: &str, text: &str) -> Result<()> {
        write_file_in(&self.target(), path, text)
    }

    /// Where a cluster runs its nodes on this host.
    pub fn target(&self) -> SystemdTarget {
        SystemdTarget {
            container: self.name.clone(),
            shared: self.shared.clone(),
        }
    }

    /// A unit's property, as `systemctl show -p NAME --value` prints it.
    ///
    /// # Errors
    ///
    /// When `systemctl` fails.
    pub fn property(&self, unit: &str, name: &str) -> Result<String> {
        Ok(self
            .run(&["systemctl", "show", unit, "-p", name, "--value"])?
            .trim()
            .to_owned())
    }
}

impl Drop for SystemdHost {
    fn drop(&mut self) {
        let _ = Command::new("docker")
            .args(["rm", "-f", &self.name])
            .output();
        let _ = std::fs::remove_dir_all(&self.shared);
    }
}

/// Runs `args` in `container`.
///
/// # Errors
///
/// When `docker exec` cannot be run.
pub fn exec_in(container: &str, args: &[&str]) -> Result<Output> {
    Command::new("docker")
        .args(["exec", container])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .with_context(|| format!("docker exec {container} {args:?}"))
}

/// Runs `args` in `container` and fails unless they succeed.
///
/// # Errors
///
/// With their output when they fail.
pub fn run_in(container: &str, args: &[&str]) -> Result<String> {
    let out = exec_in(container, args)?;
    ensure!(
        out.status.success(),
        "{args:?} in {container}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Writes `text` to `path` inside `host`'s container (through the shared
/// directory).
///
/// # Errors
///
/// When it cannot be written.
pub fn write_file_in(host: &SystemdTarget, path: &str, text: &str) -> Result<()> {
    let container = host.container.as_str();
    let staged = host
        .shared
        .join(format!("file-{}", uuid::Uuid::new_v4().simple()));
    std::fs::write(&staged, text)?;
    let staged = staged.display().to_string();
    let dir = Path::new(path)
        .parent()
        .context("a file's directory")?
        .display()
        .to_string();
    run_in(container, &["mkdir", "-p", &dir])?;
    run_in(container, &["cp", &staged, path])?;
    let _ = std::fs::remove_file(&staged);
    Ok(())
}

fn ensure_image() -> Result<()> {
    // Tests run on threads of one process: one packs, the others wait.
    static PACKING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _one = PACKING
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let have = Command::new("docker")
        .args(["image", "inspect", IMAGE])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .context("docker image inspect")?;
    if have.success() {
        return Ok(());
    }
    ensure!(
        Path::new("/usr/lib/systemd/systemd").is_file(),
        "this machine has no systemd to pack (/usr/lib/systemd/systemd): install Debian's `systemd` package (.ci/run does)"
    );
    let billet = crate::image::binary_path("billet")?;
    let out = Command::new("bash")
        .args(["-c", PACK])
        .env("BILLET", &billet)
        .env("IMAGE", IMAGE)
        .output()
        .context("bash")?;
    ensure!(
        out.status.success(),
        "packing {IMAGE} from this host's systemd failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    Ok(())
}
