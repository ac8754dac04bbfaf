//! A whole billet on this machine, for end-to-end tests and the demo: the
//! scale-set emulator as GitHub, the stub plane in process, and real
//! `billet node` processes over real mTLS, running the stand-in runner in
//! real Docker containers.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::ledger::Charge;
use billet_controlplane_stub::node_link::{NodeTarget, PlaneTls};
use billet_controlplane_stub::plane::{Plane, PlaneConfig, Tier};
use bollard::Docker;
use scaleset::testing::{Emulator, JobState};
use tokio::process::{Child, Command};
use tokio_util::sync::CancellationToken;

use crate::image::{binary_path, build_process_binaries, build_standin_image, connect_docker};

/// The stand-in runner image every cluster uses.
pub const STANDIN_IMAGE: &str = "billet-standin-runner:dev";
/// The tier (and scale-set) label.
pub const TIER: &str = "billet-linux";

/// How to start a cluster.
#[derive(Debug, Clone)]
pub struct ClusterOptions {
    /// Node names; one `billet node` each.
    pub nodes: Vec<String>,
    /// How long each stand-in runner works, in milliseconds.
    pub work_ms: u64,
    /// The node's log filter (`BILLET_LOG`).
    pub node_log: String,
    /// Lease TTL.
    pub lease_ttl: Duration,
    /// Launch timeout at the plane.
    pub launch_timeout: Duration,
    /// The plane mints each launch's registration before dispatching it
    /// ([`PlaneConfig::mint_before_dispatch`]). Off by default, as in
    /// `billet-plane`: the node mints through `MintJit`.
    pub mint_before_dispatch: bool,
    /// Extra environment for node processes.
    pub node_env: Vec<(String, String)>,
    /// The Docker socket the nodes use.
    pub docker_socket: PathBuf,
    /// How often the plane sends Tend and Sweep.
    pub maintenance_interval: Duration,
    /// How long a quarantined lease must be absent before it is freed.
    pub quarantine_grace: Duration,
    /// How long the plane renews a node's leases after losing its session.
    pub renewal_grace: Duration,
    /// How long the plane believes a scale set GitHub said is missing.
    pub scale_set_retry: Duration,
    /// How often the plane reconciles registrations with open leases.
    pub registration_interval: Duration,
    /// How long a registration may outlive its lease or be missing under
    /// an idle runner.
    pub registration_grace: Duration,
    /// Install each node the way an operator would, for upgrades: its own
    /// copy of `billet`, started and stopped by scripts a service manager
    /// would run, with `billet host-upgrade` as its updater. See
    /// [`Installed`].
    pub installed: bool,
    /// With `installed`: run each node under the real systemd of a
    /// [`crate::systemd::SystemdHost`], as the deployed unit, with
    /// `systemctl` as the updater's service manager. The cluster's
    /// directory is then made in the host's shared directory.
    pub systemd: Option<crate::systemd::SystemdTarget>,
    /// More plain environment for each runner (`KEY=value`), such as the
    /// stand-in's `BILLET_STANDIN_MODE`.
    pub tier_env: Vec<String>,
    /// Memory per runner, in bytes (the container's limit).
    pub tier_memory_bytes: u64,
    /// vCPUs per runner, as the tier asks them (the plane reserves this
    /// many; the node may resize the lease to what its provider runs).
    pub tier_vcpu: u32,
    /// The runner image; the stand-in by default.
    pub tier_image: String,
    /// Sticky disks each runner of the tier gets.
    pub sticky_disks: Vec<billet_proto::v1::StickyDisk>,
    /// The tier's Actions cache scope when it opts in.
    pub actions_cache: Option<billet_proto::v1::CacheScope>,
    /// The tier's trust class, `trusted` or `untrusted` (an untrusted tier
    /// needs the node's `--isolated-containers`, e.g. in `node_env`).
    pub tier_trust: String,
    /// The tier's network: `host` by default. Any other (an untrusted
    /// tier may not have the host's) puts the emulator on Docker's bridge
    /// gateway ([`bridge_gateway`]), where the runners reach it.
    pub tier_network: String,
    /// Whether the tier's runners get the Docker image store.
    pub docker_image_store: bool,
    /// The oldest runner version the tier runs ("" for none).
    pub min_runner_version: String,
    /// The node certificates' lifetime from now, when short-lived ones are
    /// wanted (the CA's and the plane's stay as usual).
    pub node_cert_lifetime: Option<Duration>,
    /// The plane holds the CA key and signs node certificates lasting this
    /// long (renewals over the session, enrolments); `None`: it signs none.
    pub plane_signs: Option<Duration>,
    /// Serve the plane's enrolment endpoint ([`Cluster::enroll_addr`]).
    pub enrollment: bool,
    /// Where the nodes' state directories (`state-<name>`) are made;
    /// `None`: in the cluster's scratch directory. A test puts them on a
    /// file system of its own (a small one that it fills).
    pub state_root: Option<PathBuf>,
    /// The deployment's id; `None`: a fresh one (`dep` and 8 hex digits).
    /// A test that prepares a node's state before it starts (a cache
    /// store, which is per deployment) names it.
    pub deployment: Option<String>,
    /// Nodes that run on a network host of their own (by node name): each
    /// such node listens on its host's address and runs inside its network
    /// namespace (`ip netns exec`), with a certificate naming the address
    /// as well as the name. Others run on 127.0.0.1. See `fleet.rs`.
    pub hosts: HashMap<String, NodeHost>,
    /// The vCPUs each node reports (`--vcpu`); every runner takes one.
    pub node_vcpu: u32,
    /// How the plane's connections notice a silent node.
    pub node_keepalive: billet_controlplane_stub::node_link::Keepalive,
    /// The warm runners each node keeps (none by default).
    pub warm: billet_controlplane_stub::plane::WarmConfig,
    /// How long the plane keeps job records, and when a job is stuck.
    pub jobs: billet_controlplane_stub::plane::JobsConfig,
}

/// The IPv4 gateway of Docker's default bridge: an address of this host
/// that runners on the bridge reach.
///
/// # Errors
///
/// The engine cannot be asked, or the bridge has no IPv4 gateway.
pub async fn bridge_gateway(docker: &Docker) -> Result<std::net::IpAddr> {
    let network = docker
        .inspect_network(
            "bridge",
            None::<bollard::query_parameters::InspectNetworkOptions>,
        )
        .await
        .context("inspect Docker's bridge network")?;
    // An engine that chose the gateway itself may not say it: it is then
    // the subnet's first address.
    network
        .ipam
        .and_then(|i| i.config)
        .unwrap_or_default()
        .into_iter()
        .find_map(|c| {
            c.gateway
                .and_then(|g| g.parse::<std::net::Ipv4Addr>().ok())
                .or_else(|| {
                    let subnet = c.subnet?;
                    let base: std::net::Ipv4Addr = subnet.split_once('/')?.0.parse().ok()?;
                    Some(std::net::Ipv4Addr::from(u32::from(base) + 1))
                })
        })
        .map(std::net::IpAddr::V4)
        .context("Docker's bridge network has no IPv4 gateway or subnet")
}

/// Where a node runs when it has a network of its own: its namespace and
/// its address there.
#[derive(Debug, Clone)]
pub struct NodeHost {
    /// The network namespace (`ip netns` name) the node runs in.
    pub netns: String,
    /// The node's address in it, which it listens on and its certificate
    /// names.
    pub addr: std::net::IpAddr,
}

/// The port a node on a host of its own listens on (every host has its
/// own address, so all share it).
pub const HOST_PORT: u16 = 7443;

impl Default for ClusterOptions {
    fn default() -> Self {
        Self {
            nodes: vec!["node-1".into()],
            work_ms: 1500,
            node_log: "info".into(),
            lease_ttl: Duration::from_secs(15),
            launch_timeout: Duration::from_secs(120),
            mint_before_dispatch: false,
            node_env: Vec::new(),
            docker_socket: PathBuf::from("/var/run/docker.sock"),
            maintenance_interval: Duration::from_secs(2),
            quarantine_grace: Duration::from_secs(300),
            renewal_grace: billet_controlplane_stub::plane::RENEWAL_GRACE,
            scale_set_retry: billet_controlplane_stub::github::SCALE_SET_RETRY,
            registration_interval: Duration::from_secs(2),
            registration_grace: Duration::from_secs(10),
            installed: false,
            systemd: None,
            tier_env: Vec::new(),
            tier_memory_bytes: 256 << 20,
            tier_vcpu: 1,
            tier_image: STANDIN_IMAGE.into(),
            sticky_disks: Vec::new(),
            actions_cache: None,
            tier_trust: "trusted".into(),
            tier_network: "host".into(),
            docker_image_store: false,
            min_runner_version: billet_controlplane_stub::plane::DEFAULT_MIN_RUNNER_VERSION.into(),
            node_cert_lifetime: None,
            plane_signs: None,
            enrollment: false,
            state_root: None,
            deployment: None,
            hosts: HashMap::new(),
            node_vcpu: 8,
            node_keepalive: billet_controlplane_stub::node_link::Keepalive::default(),
            warm: billet_controlplane_stub::plane::WarmConfig::default(),
            jobs: billet_controlplane_stub::plane::JobsConfig::default(),
        }
    }
}

/// A node installed the way an operator installs one, so that
/// `billet host-upgrade` can replace it: its own copy of `billet` at
/// `binary`, a start script that runs it in the background and records its
/// pid, a stop script that sends SIGTERM and returns once it has exited (a
/// service manager's two verbs), and the updater's configuration.
#[derive(Debug, Clone)]
pub struct Installed {
    /// The node's binary (the updater's `install_path`).
    pub binary: PathBuf,
    /// Starts the node in the background.
    pub start: PathBuf,
    /// Stops the node: SIGTERM, then waits for it to exit.
    pub stop: PathBuf,
    /// Where `start` records the node's pid.
    pub pidfile: PathBuf,
    /// The updater's configuration (`--upgrade-config`).
    pub upgrade_config: PathBuf,
    /// The release source directory the configuration names.
    pub releases: PathBuf,
    /// The node's state directory.
    pub state_dir: PathBuf,
    /// The systemd host that runs the node, if one does.
    pub systemd: Option<crate::systemd::SystemdTarget>,
}

/// The unit the node runs as under systemd.
pub const NODE_UNIT: &str = "billet-node.service";

/// `word` quoted for a systemd unit's command line (`command`: `$` is
/// expanded there) or an `Environment=` assignment.
fn unit_word(word: &str, command: bool) -> String {
    let mut escaped = word
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('%', "%%");
    if command {
        escaped = escaped.replace('$', "$$");
    }
    format!("\"{escaped}\"")
}

impl Installed {
    /// Writes the binary, the scripts and the configuration for a node run
    /// with `args` and `env`, logging to `log`.
    #[expect(
        clippy::too_many_arguments,
        reason = "each is one file of the installation, named at the call"
    )]
    fn write(
        dir: &Path,
        name: &str,
        args: &mut Vec<String>,
        env: &[(String, String)],
        log: &Path,
        state_dir: &Path,
        systemd: Option<&crate::systemd::SystemdTarget>,
        netns: Option<&str>,
    ) -> Result<Self> {
        let root = dir.join(format!("install-{name}"));
        std::fs::create_dir_all(&root).with_context(|| format!("create {}", root.display()))?;
        let binary = root.join("billet");
        std::fs::copy(binary_path("billet")?, &binary).context("install billet")?;
        let releases = dir.join("releases");
        std::fs::create_dir_all(&releases)?;
        let upgrade_config = root.join("upgrade.toml");
        let installed = Self {
            start: root.join("start"),
            stop: root.join("stop"),
            pidfile: root.join("node.pid"),
            upgrade_config,
            releases,
            state_dir: state_dir.to_owned(),
            binary,
            systemd: systemd.cloned(),
        };
        args.extend([
            "--upgrader-binary".into(),
            installed.binary.display().to_string(),
            "--upgrade-config".into(),
            installed.upgrade_config.display().to_string(),
        ]);
        let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
        let exports: String = env
            .iter()
            .map(|(k, v)| format!("export {k}={}\n", quote(v)))
            .collect();
        if let Some(host) = systemd {
            installed.install_unit(host, args, env, log)?;
            return Ok(installed);
        }
        let argv: Vec<String> = args.iter().map(|a| quote(a)).collect();
        write_script(
            &installed.start,
            &format!(
                "#!/bin/sh\n# Starts billet node {name} in the background, as a service manager would.\n{exports}{}{} {} >>{} 2>&1 </dev/null &\necho $! >{}\n",
                // `ip netns exec` execs the node in place: the pid is its.
                netns.map_or(String::new(), |ns| format!("ip netns exec {} ", quote(ns))),
                quote(&installed.binary.display().to_string()),
                argv.join(" "),
                quote(&log.display().to_string()),
                quote(&installed.pidfile.display().to_string()),
            ),
        )?;
        write_script(
            &installed.stop,
            &format!(
                "#!/bin/sh\n# Stops billet node {name}: SIGTERM (it drains), then waits for it to exit.\npid=$(cat {}) || exit 0\nkill -TERM \"$pid\" 2>/dev/null || exit 0\nwhile [ -e /proc/$pid ] && ! grep -q '^State:[[:space:]]*Z' /proc/$pid/status 2>/dev/null; do sleep 0.1; done\n",
                quote(&installed.pidfile.display().to_string()),
            ),
        )?;
        installed.write_config(&installed.start, 60)?;
        Ok(installed)
    }

    /// Installs the node in `container` as [`NODE_UNIT`]: the deployed
    /// unit file itself, with a drop-in giving this node's command line,
    /// environment and log (the deployed unit reads them from
    /// `/etc/billet/node.env`); start and stop scripts that run
    /// `systemctl`; and an updater configuration naming the unit.
    fn install_unit(
        &self,
        host: &crate::systemd::SystemdTarget,
        args: &[String],
        env: &[(String, String)],
        log: &Path,
    ) -> Result<()> {
        use crate::systemd::{run_in, write_file_in};
        let container = host.container.as_str();
        write_file_in(
            host,
            &format!("/etc/systemd/system/{NODE_UNIT}"),
            include_str!("../../deploy/billet-node.service"),
        )?;
        let exec: Vec<String> = std::iter::once(self.binary.display().to_string())
            .chain(args.iter().cloned())
            .map(|w| unit_word(&w, true))
            .collect();
        let environment: String = env
            .iter()
            .map(|(k, v)| format!("Environment={}\n", unit_word(&format!("{k}={v}"), false)))
            .collect();
        let log = log.display().to_string();
        // Everything of this test's node (binary, certificates, state) is
        // in the shared directory under /tmp: the one place the deployed
        // unit's hardening is relaxed, as an operator's drop-in would for a
        // --state-dir outside /var/lib/billet.
        let shared = host.shared.display().to_string();
        write_file_in(
            host,
            &format!("/etc/systemd/system/{NODE_UNIT}.d/test.conf"),
            &format!(
                "[Service]\nEnvironmentFile=\nExecStart=\nExecStart={}\n{environment}StandardOutput=append:{log}\nStandardError=append:{log}\nPrivateTmp=no\nReadWritePaths={shared}\n",
                exec.join(" ")
            ),
        )?;
        run_in(container, &["systemctl", "daemon-reload"])?;
        write_script(
            &self.start,
            &format!("#!/bin/sh\nexec docker exec {container} systemctl start {NODE_UNIT}\n"),
        )?;
        write_script(
            &self.stop,
            &format!("#!/bin/sh\nexec docker exec {container} systemctl stop {NODE_UNIT}\n"),
        )?;
        self.write_upgrade_config(&format!("systemd_unit = {NODE_UNIT:?}\n"), 60)
    }

    /// Writes the updater's configuration: this install's release source,
    /// binary and state directory, `service` (the TOML lines saying how
    /// the node is stopped and started) and `health_timeout_secs`.
    fn write_upgrade_config(&self, service: &str, health_timeout_secs: u64) -> Result<()> {
        let text = format!(
            "release_source = {:?}\ninstall_path = {:?}\nstate_dir = {:?}\n{service}health_timeout_secs = {health_timeout_secs}\n",
            self.releases.display().to_string(),
            self.binary.display().to_string(),
            self.state_dir.display().to_string(),
        );
        std::fs::write(&self.upgrade_config, text)
            .with_context(|| format!("write {}", self.upgrade_config.display()))
    }

    /// Rewrites the updater's configuration: `start` as its start command
    /// and `health_timeout_secs`.
    ///
    /// # Errors
    ///
    /// When the file cannot be written.
    pub fn write_config(&self, start: &Path, health_timeout_secs: u64) -> Result<()> {
        self.write_upgrade_config(
            &format!(
                "stop_command = [{:?}]\nstart_command = [{:?}]\n",
                self.stop.display().to_string(),
                start.display().to_string(),
            ),
            health_timeout_secs,
        )
    }

    /// Writes release `version` (the current build of `billet`, stamped
    /// with it by the release tool) into the release source; returns the
    /// manifest digest to pin.
    ///
    /// # Errors
    ///
    /// When the build cannot be read or the release written.
    pub fn publish(&self, version: &str) -> Result<String> {
        let binary = std::fs::read(binary_path("billet")?)?;
        Ok(billet_agent::upgrade::release::write(
            &self.releases,
            version,
            binary,
        )?)
    }

    /// The pid the start script recorded last.
    ///
    /// # Errors
    ///
    /// When there is none.
    pub fn pid(&self) -> Result<u32> {
        let text = std::fs::read_to_string(&self.pidfile)
            .with_context(|| format!("read {}", self.pidfile.display()))?;
        text.trim()
            .parse()
            .with_context(|| format!("{} holds {text:?}", self.pidfile.display()))
    }
}

/// Writes an executable script.
///
/// # Errors
///
/// When it cannot be written.
/// libfaketime's preload library (Debian `libfaketime`, installed with
/// `faketime` by scripts/test).
pub const FAKETIME_LIB: &str = "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1";

/// Environment that runs only the node process with its wall clock
/// `offset` off (libfaketime's spelling: `+300s`, `-90s`), as a badly
/// synchronised host's or one stepped by NTP: the monotonic and boot
/// clocks are left alone, as a real step leaves them.
///
/// # Errors
///
/// When libfaketime is not installed (scripts/test installs it).
pub fn wall_clock_off(offset: &str) -> Result<Vec<(String, String)>> {
    if !Path::new(FAKETIME_LIB).exists() {
        bail!("{FAKETIME_LIB} is missing: install Debian's faketime package (scripts/test does)");
    }
    Ok(vec![
        ("LD_PRELOAD".into(), FAKETIME_LIB.into()),
        ("FAKETIME".into(), offset.into()),
        ("FAKETIME_DONT_FAKE_MONOTONIC".into(), "1".into()),
        ("FAKETIME_NO_CACHE".into(), "1".into()),
    ])
}

pub fn write_script(path: &Path, text: &str) -> Result<()> {
    std::fs::write(path, text).with_context(|| format!("write {}", path.display()))?;
    std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .with_context(|| format!("chmod {}", path.display()))
}

/// Whether process `pid` is alive (not gone, not a zombie).
pub fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status")).is_ok_and(|s| {
        !s.lines()
            .any(|l| l.starts_with("State:") && l.contains('Z'))
    })
}

/// Runs a script to completion, retrying while the kernel still reports it
/// busy (a script just written, while another thread forks).
///
/// # Errors
///
/// When it cannot run or fails.
pub async fn run_script(path: &Path) -> Result<()> {
    for _ in 0..50 {
        match Command::new(path).status().await {
            Ok(status) if status.success() => return Ok(()),
            Ok(status) => bail!("{} ended {status}", path.display()),
            Err(e) if e.raw_os_error() == Some(26) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => return Err(e).with_context(|| format!("run {}", path.display())),
        }
    }
    bail!("{} stayed busy", path.display())
}

/// One `billet node` process.
#[derive(Debug)]
pub struct NodeProcess {
    /// The node's name (in its certificate).
    pub name: String,
    /// Where it listens.
    pub addr: SocketAddr,
    /// Its stderr, captured.
    pub log: PathBuf,
    /// Set when the node is installed for upgrades: then its process is
    /// started and stopped by the scripts, not held as a child.
    pub installed: Option<Installed>,
    /// The network namespace it runs in, when it has a host of its own.
    pub netns: Option<String>,
    /// The argv it was started with, to restart it.
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl NodeProcess {
    /// Starts `billet node` (not installed: a child of this process) named
    /// `name`, listening on `addr`, with `args` and `env`, logging to
    /// `log`, inside network namespace `netns` if one is given.
    ///
    /// # Errors
    ///
    /// When the log cannot be opened or the process started.
    pub async fn start(
        name: &str,
        addr: SocketAddr,
        log: PathBuf,
        netns: Option<String>,
        args: Vec<String>,
        env: Vec<(String, String)>,
    ) -> Result<NodeProcess> {
        let mut process = NodeProcess {
            name: name.to_owned(),
            addr,
            log,
            installed: None,
            netns,
            args,
            env,
            child: None,
        };
        process.spawn().await?;
        Ok(process)
    }

    async fn spawn(&mut self) -> Result<()> {
        if let Some(installed) = &self.installed {
            return run_script(&installed.start).await;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        // `BILLET_TEST_NODE_BINARY` runs another build of `billet` as the
        // node (an older release against this plane, or a build without a
        // fix to see a test fail).
        let binary = match std::env::var_os("BILLET_TEST_NODE_BINARY") {
            Some(path) => PathBuf::from(path),
            None => binary_path("billet")?,
        };
        let mut cmd = match &self.netns {
            // `ip netns exec` execs the node in place: the child is the node.
            Some(ns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", ns]).arg(binary);
                cmd
            }
            None => Command::new(binary),
        };
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().context("start billet node")?);
        Ok(())
    }

    /// Sends SIGKILL and waits for the process to go.
    pub async fn kill(&mut self) -> Result<()> {
        if let Some(installed) = &self.installed
            && installed.systemd.is_some()
        {
            // Pids in the container are not this host's: systemd stops it.
            return run_script(&installed.stop).await;
        }
        if let Some(installed) = &self.installed {
            if let Ok(pid) = installed.pid() {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
                wait_until(Duration::from_secs(10), "the node to die", || !alive(pid)).await?;
            }
            return Ok(());
        }
        if let Some(mut child) = self.child.take() {
            child.kill().await?;
        }
        Ok(())
    }

    /// Sends SIGTERM.
    pub fn terminate(&self) -> Result<()> {
        let pid = match &self.installed {
            Some(installed) => installed.pid()?,
            None => self
                .child
                .as_ref()
                .and_then(Child::id)
                .context("node is not running")?,
        };
        let status = std::process::Command::new("kill")
            .args(["-TERM", &pid.to_string()])
            .status()?;
        if !status.success() {
            bail!("kill -TERM {pid} failed");
        }
        Ok(())
    }

    /// Waits for the process to exit, up to `timeout`.
    pub async fn wait(&mut self, timeout: Duration) -> Result<std::process::ExitStatus> {
        let child = self
            .child
            .as_mut()
            .context("node is not running as this process's child")?;
        let status = tokio::time::timeout(timeout, child.wait())
            .await
            .context("node did not exit in time")??;
        self.child = None;
        Ok(status)
    }

    /// Sets the environment variable `key` to `value` for the node's next
    /// start ([`NodeProcess::restart`]).
    pub fn set_env(&mut self, key: &str, value: &str) {
        self.env.retain(|(k, _)| k != key);
        self.env.push((key.to_owned(), value.to_owned()));
    }

    /// Starts the process again with the same arguments.
    pub async fn restart(&mut self) -> Result<()> {
        self.kill().await?;
        self.spawn().await
    }

    /// The process id of the node, while it runs as this process's child
    /// or as an installed node with a recorded pid.
    pub fn pid(&self) -> Option<u32> {
        match &self.installed {
            Some(installed) => installed.pid().ok(),
            None => self.child.as_ref().and_then(Child::id),
        }
    }

    /// Everything it has logged so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

/// A running cluster. Dropping it stops the plane and kills the nodes;
/// [`Cluster::shutdown`] does so cleanly.
#[derive(Debug)]
pub struct Cluster {
    /// GitHub.
    pub emulator: Emulator,
    /// The plane.
    pub plane: Arc<Plane>,
    /// The nodes, by name.
    pub nodes: HashMap<String, NodeProcess>,
    /// The scratch directory (certificates, ledger, logs, state).
    pub dir: PathBuf,
    /// The Docker engine.
    pub docker: Docker,
    /// The deployment id.
    pub deployment: String,
    /// The development certificates.
    pub certs: billet_certs_dev::DevCerts,
    /// Where the plane's enrolment endpoint listens, with
    /// [`ClusterOptions::enrollment`].
    pub enroll_addr: Option<SocketAddr>,
    shutdown: CancellationToken,
    /// What the plane was started with, to start it again.
    plane_config: PlaneConfig,
}

/// A fresh scratch directory under the system temp dir.
pub fn scratch_dir(prefix: &str) -> Result<PathBuf> {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}-{}", std::process::id(), uuid_like()));
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    Ok(dir)
}

fn uuid_like() -> String {
    uuid::Uuid::new_v4().simple().to_string()
}

/// The ports [`free_port`] hands out: below Linux's default ephemeral range
/// (32768-60999), so neither an outgoing connection nor another process's
/// bind to port 0 takes one between its release and its reuse by a node or
/// a plane.
const TEST_PORTS: std::ops::Range<u16> = 20_000..32_000;

/// How long a port [`free_port`] handed out stays claimed.
const PORT_CLAIM: Duration = Duration::from_secs(30 * 60);

/// A port on 127.0.0.1 for a node or a plane to bind later: free now, and
/// claimed for `PORT_CLAIM` so that no other test process on this machine
/// is handed it meanwhile (a claim is a file created exclusively in
/// `<temp>/billet-test-ports/`; an older one is taken back). Tests run side
/// by side in processes of their own, so the kernel's "bind port 0, then
/// release" is not enough: another test, or one of its outgoing
/// connections, takes the port before it is bound again.
pub fn free_port() -> Result<SocketAddr> {
    let claims = std::env::temp_dir().join("billet-test-ports");
    std::fs::create_dir_all(&claims).with_context(|| format!("create {}", claims.display()))?;
    let span = u128::from(TEST_PORTS.end - TEST_PORTS.start);
    for _ in 0..1000 {
        let offset = u16::try_from(uuid::Uuid::new_v4().as_u128() % span).unwrap_or(0);
        let port = TEST_PORTS.start + offset;
        let claim = claims.join(port.to_string());
        let stale = std::fs::metadata(&claim)
            .and_then(|m| m.modified())
            .is_ok_and(|at| at.elapsed().is_ok_and(|age| age > PORT_CLAIM));
        if stale {
            let _ = std::fs::remove_file(&claim);
        }
        if std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&claim)
            .is_err()
        {
            continue;
        }
        if let Ok(l) = std::net::TcpListener::bind(("127.0.0.1", port)) {
            return Ok(l.local_addr()?);
        }
    }
    bail!(
        "no free port in {}..{} after 1000 tries",
        TEST_PORTS.start,
        TEST_PORTS.end
    )
}

/// Removes every container of deployment `deployment`, in any state,
/// through the `docker` command (usable from `Drop`, outside any runtime).
/// Best effort: a failure to list or remove is ignored, since it runs when
/// a test ends, failed or not.
pub fn remove_deployment_containers(deployment: &str) {
    let names: Vec<String> = std::process::Command::new("docker")
        .args([
            "ps",
            "-aq",
            "--filter",
            &format!("label=sh.billet.deployment={deployment}"),
        ])
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .map(str::to_owned)
                .collect()
        })
        .unwrap_or_default();
    if !names.is_empty() {
        let _ = std::process::Command::new("docker")
            .arg("rm")
            .arg("-f")
            .args(&names)
            .output();
    }
}

/// The names of deployment `deployment`'s containers on `docker`, in any
/// state, that also carry every label in `labels` (`key=value`).
///
/// # Errors
///
/// When Docker cannot be listed.
pub async fn containers_of(
    docker: &Docker,
    deployment: &str,
    labels: Vec<String>,
) -> Result<Vec<String>> {
    let mut all = vec![format!("sh.billet.deployment={deployment}")];
    all.extend(labels);
    let filters: HashMap<String, Vec<String>> = HashMap::from([("label".to_owned(), all)]);
    let list = docker
        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
            all: true,
            filters: Some(filters),
            ..Default::default()
        }))
        .await?;
    Ok(list
        .into_iter()
        .flat_map(|c| c.names.unwrap_or_default())
        .map(|n| n.trim_start_matches('/').to_owned())
        .collect())
}

/// The stand-in runner image's tag pinned by its content (built once per
/// process: parallel tests share the binaries and the tag). The tier names
/// the image by a tag that carries its content's id, so another checkout
/// rebuilding [`STANDIN_IMAGE`] from its own binary while this one runs
/// cannot change the runner a test starts. The process binaries
/// ([`PROCESS_BINARIES`](crate::image::PROCESS_BINARIES)) are built first.
///
/// # Errors
///
/// When the binaries or the image cannot be built.
pub async fn standin_image(docker: &Docker) -> Result<String> {
    static IMAGE: tokio::sync::OnceCell<String> = tokio::sync::OnceCell::const_new();
    Ok(IMAGE
        .get_or_try_init(|| async {
            tokio::task::spawn_blocking(build_process_binaries).await??;
            build_standin_image(
                docker,
                &binary_path("billet-standin-runner")?,
                STANDIN_IMAGE,
            )
            .await
            .context("build the stand-in runner image")?;
            pin_by_content(docker, STANDIN_IMAGE).await
        })
        .await?
        .clone())
}

/// The arguments of `billet node` for node `name` of a cluster started with
/// `options`: listening on `addr`, with its certificate from `certs`, in
/// `deployment`, keeping its state in `state_dir`.
///
/// # Errors
///
/// When `certs` has no certificate for `name`.
pub fn node_args(
    options: &ClusterOptions,
    certs: &billet_certs_dev::DevCerts,
    name: &str,
    addr: SocketAddr,
    deployment: &str,
    state_dir: &Path,
) -> Result<Vec<String>> {
    let files = certs.node(name).context("node certificate")?;
    Ok(vec![
        "node".to_owned(),
        "--listen".into(),
        addr.to_string(),
        "--cert".into(),
        files.cert.display().to_string(),
        "--key".into(),
        files.key.display().to_string(),
        "--ca".into(),
        certs.ca.cert.display().to_string(),
        "--plane-name".into(),
        "plane".into(),
        "--deployment".into(),
        deployment.to_owned(),
        "--state-dir".into(),
        state_dir.display().to_string(),
        "--docker-socket".into(),
        options.docker_socket.display().to_string(),
        "--vcpu".into(),
        options.node_vcpu.to_string(),
        "--memory-bytes".into(),
        (8u64 << 30).to_string(),
    ])
}

/// The development certificates of a cluster started with `options`, in
/// `dir/certs`: the CA, the plane's (named `plane`) and one per node, naming
/// its address too when it runs on a host of its own.
///
/// # Errors
///
/// When they cannot be made or written.
pub fn cluster_certs(dir: &Path, options: &ClusterOptions) -> Result<billet_certs_dev::DevCerts> {
    let names: Vec<&str> = options.nodes.iter().map(String::as_str).collect();
    billet_certs_dev::generate_with_nodes(
        &dir.join("certs"),
        "plane",
        &names,
        &billet_certs_dev::Options::default(),
        &billet_certs_dev::NodeOptions {
            validity: options
                .node_cert_lifetime
                .map(billet_certs_dev::Validity::lasting)
                .transpose()?,
            addresses: options
                .hosts
                .iter()
                .map(|(name, host)| (name.clone(), host.addr))
                .collect(),
            ..Default::default()
        },
    )
}

impl Cluster {
    /// Builds the stand-in image, makes certificates, starts the emulator,
    /// the nodes and the plane, and waits until every node is attached.
    ///
    /// # Errors
    ///
    /// When any part cannot start; the message says which.
    pub async fn start(options: ClusterOptions) -> Result<Cluster> {
        let docker = connect_docker().await?;
        let standin = standin_image(&docker).await?;
        let dir = match &options.systemd {
            // Where the systemd host sees it, at the same path.
            Some(host) => {
                let dir = host.shared.join("c");
                std::fs::create_dir_all(&dir)
                    .with_context(|| format!("create {}", dir.display()))?;
                dir
            }
            None => scratch_dir("billet-cluster")?,
        };
        let deployment = options
            .deployment
            .clone()
            .unwrap_or_else(|| format!("dep{}", &uuid_like()[..8]));
        let certs = cluster_certs(&dir, &options)?;

        let mut emulator = Emulator::builder().long_poll(Duration::from_millis(300));
        if options.tier_network != "host" {
            emulator = emulator.bind(SocketAddr::new(bridge_gateway(&docker).await?, 0));
        }
        let emulator = emulator
            .try_start()
            .await
            .context("start the scale-set emulator")?;

        let mut nodes = HashMap::new();
        let mut targets = Vec::new();
        for name in &options.nodes {
            let host = options.hosts.get(name);
            let addr = match host {
                Some(host) => SocketAddr::new(host.addr, HOST_PORT),
                None => free_port()?,
            };
            let state_dir = options
                .state_root
                .as_deref()
                .unwrap_or(&dir)
                .join(format!("state-{name}"));
            let args = node_args(&options, &certs, name, addr, &deployment, &state_dir)?;
            let mut env = vec![("BILLET_LOG".to_owned(), options.node_log.clone())];
            env.extend(options.node_env.iter().cloned());
            let log = dir.join(format!("{name}.log"));
            let mut args = args;
            let installed = if options.installed {
                Some(Installed::write(
                    &dir,
                    name,
                    &mut args,
                    &env,
                    &log,
                    &state_dir,
                    options.systemd.as_ref(),
                    host.map(|h| h.netns.as_str()),
                )?)
            } else {
                None
            };
            let mut process = NodeProcess {
                name: name.clone(),
                addr,
                log,
                installed,
                netns: host.map(|h| h.netns.clone()),
                args,
                env,
                child: None,
            };
            process.spawn().await?;
            targets.push(NodeTarget {
                name: name.clone(),
                addr,
            });
            nodes.insert(name.clone(), process);
        }

        let read = |p: &Path| std::fs::read(p).with_context(|| format!("read {}", p.display()));
        let tls = PlaneTls {
            ca_pem: read(&certs.ca.cert)?,
            cert_pem: read(&certs.plane.cert)?,
            key_pem: read(&certs.plane.key)?,
        };
        let shutdown = CancellationToken::new();
        let config = PlaneConfig {
            deployment: deployment.clone(),
            lease_ttl: options.lease_ttl,
            ledger: dir.join("ledger.db").into(),
            tls,
            nodes: targets,
            tier: Tier {
                label: TIER.into(),
                image: if options.tier_image == STANDIN_IMAGE {
                    standin.clone()
                } else {
                    options.tier_image.clone()
                },
                command: vec!["/billet-standin-runner".into()],
                trust: options.tier_trust.clone(),
                vcpu: options.tier_vcpu,
                memory_bytes: options.tier_memory_bytes,
                network: options.tier_network.clone(),
                env: [
                    format!("BILLET_STANDIN_WORK_MS={}", options.work_ms),
                    "BILLET_STANDIN_IDLE_TIMEOUT_MS=120000".into(),
                ]
                .into_iter()
                .chain(options.tier_env.iter().cloned())
                .collect(),
                sticky_disks: options.sticky_disks.clone(),
                actions_cache: options.actions_cache.clone(),
                docker_image_store: options.docker_image_store,
                min_runner_version: options.min_runner_version.clone(),
            },
            launch_timeout: options.launch_timeout,
            mint_before_dispatch: options.mint_before_dispatch,
            destroy_timeout: Duration::from_secs(60),
            reap_interval: Duration::from_secs(1),
            max_runners: 20,
            maintenance_interval: options.maintenance_interval,
            quarantine_grace: options.quarantine_grace,
            renewal_grace: options.renewal_grace,
            scale_set_retry: options.scale_set_retry,
            registration_interval: options.registration_interval,
            registration_grace: options.registration_grace,
            node_ca: match options.plane_signs {
                None => None,
                Some(lifetime) => Some(Arc::new(
                    billet_controlplane_stub::identity::NodeCa::from_pem(
                        &std::fs::read_to_string(&certs.ca.cert)?,
                        &std::fs::read_to_string(&certs.ca.key)?,
                        lifetime,
                    )?,
                )),
            },
            node_keepalive: options.node_keepalive,
            warm: options.warm,
            jobs: options.jobs,
        };
        let plane = Plane::start(config.clone(), emulator.client(), shutdown.clone())
            .await
            .context("start the plane")?;
        let enroll_addr = if options.enrollment {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            plane.serve_enrollment(listener, shutdown.clone());
            Some(addr)
        } else {
            None
        };
        let cluster = Cluster {
            emulator,
            plane,
            nodes,
            dir,
            docker,
            deployment,
            certs,
            enroll_addr,
            shutdown,
            plane_config: config,
        };
        for name in &options.nodes {
            cluster.wait_attached(name, Duration::from_secs(30)).await?;
        }
        Ok(cluster)
    }

    /// Stops the plane (every task, its sessions with the nodes and its
    /// listener) and starts a new one on the same ledger, GitHub and nodes,
    /// as a plane's host restarting it would; returns once every node is
    /// attached to the new plane. The enrolment endpoint is not served
    /// again. Subscriptions to the old plane's events end.
    ///
    /// # Errors
    ///
    /// When the new plane cannot start or a node does not attach in time.
    pub async fn restart_plane(&mut self) -> Result<()> {
        self.restart_plane_with(|_| {}).await
    }

    /// [`Cluster::restart_plane`], with its configuration changed by
    /// `change` first (an operator redefining the tier, say); later
    /// restarts keep the change.
    ///
    /// # Errors
    ///
    /// As [`Cluster::restart_plane`].
    pub async fn restart_plane_with(
        &mut self,
        change: impl FnOnce(&mut PlaneConfig),
    ) -> Result<()> {
        change(&mut self.plane_config);
        self.shutdown.cancel();
        self.plane.stopped().await;
        self.shutdown = CancellationToken::new();
        self.plane = Plane::start(
            self.plane_config.clone(),
            self.emulator.client(),
            self.shutdown.clone(),
        )
        .await
        .context("start the plane again")?;
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        for name in names {
            self.wait_attached(&name, Duration::from_secs(60)).await?;
        }
        Ok(())
    }

    /// Sends `StartUpgrade` to `node` for release `version` (its manifest
    /// pinned by `digest`, as [`Installed::publish`] returns it) in
    /// rollout `rollout_id`, and returns the node's answer.
    ///
    /// # Errors
    ///
    /// When there is no such node or the command was not answered.
    pub async fn start_upgrade(
        &self,
        node: &str,
        version: &str,
        digest: &str,
        rollout_id: &str,
        generation: u64,
    ) -> Result<billet_proto::v1::CommandResult> {
        use billet_controlplane_stub::node_link::CommandOutcome;
        use billet_proto::v1 as pb;
        let link = self.plane.node(node).context("node link")?;
        let outcome = link
            .dispatch(
                pb::command::Kind::StartUpgrade(pb::StartUpgrade {
                    version: version.into(),
                    manifest_sha256: digest.into(),
                    rollout_id: rollout_id.into(),
                    generation,
                }),
                Duration::from_secs(120),
            )
            .await;
        match outcome {
            CommandOutcome::Answered(result) => Ok(result),
            other => bail!("StartUpgrade to {node} was not answered: {other:?}"),
        }
    }

    /// Waits until the plane's current session with `node` says `version`
    /// in its `Hello`.
    ///
    /// # Errors
    ///
    /// When it does not within `timeout`; the node's log is included.
    pub async fn wait_hello_version(
        &self,
        node: &str,
        version: &str,
        timeout: Duration,
    ) -> Result<()> {
        let link = self.plane.node(node).context("node link")?;
        let mut status = link.status();
        let seen = tokio::time::timeout(
            timeout,
            status.wait_for(|s| s.as_ref().is_some_and(|s| s.hello.version == version)),
        )
        .await;
        if !matches!(seen, Ok(Ok(_))) {
            bail!(
                "the plane never saw version {version} in {node}'s Hello; its log:\n{}",
                self.nodes
                    .get(node)
                    .map(NodeProcess::log_text)
                    .unwrap_or_default()
            );
        }
        Ok(())
    }

    /// Waits until the plane has a session with `node`.
    ///
    /// # Errors
    ///
    /// When it does not attach in time; the node's log is included.
    pub async fn wait_attached(&self, node: &str, timeout: Duration) -> Result<()> {
        let link = self.plane.node(node).context("no such node")?;
        let mut status = link.status();
        let attached = tokio::time::timeout(timeout, status.wait_for(Option::is_some)).await;
        if !matches!(attached, Ok(Ok(_))) {
            let log = self
                .nodes
                .get(node)
                .map(NodeProcess::log_text)
                .unwrap_or_default();
            bail!("node {node} did not attach within {timeout:?}; its log:\n{log}");
        }
        Ok(())
    }

    /// Reserves lease `id` in the ledger for job `request_id` on the tier,
    /// at 1 vCPU and 256 MiB, its runner named `billet-<id>`, as the plane
    /// does before it sends the Launch a test then sends by hand.
    ///
    /// # Errors
    ///
    /// The ledger's.
    pub async fn reserve(
        &self,
        id: &str,
        request_id: i64,
    ) -> Result<billet_controlplane_stub::ledger::Lease> {
        Ok(self
            .plane
            .ledger()
            .reserve(
                billet_controlplane_stub::ledger::NewLease {
                    id: id.into(),
                    tier: TIER.into(),
                    request_id,
                    vcpu: 1,
                    memory_bytes: 256 << 20,
                    runner_name: Some(format!("billet-{id}")),
                },
                billet_controlplane_stub::now_ms(),
            )
            .await?)
    }

    /// Queues `n` jobs on the tier's scale set.
    pub fn queue_jobs(&self, n: usize) -> Vec<scaleset::JobRequestId> {
        (0..n)
            .map(|_| self.emulator.queue_job(self.plane.scale_set(), [TIER]))
            .collect()
    }

    /// Waits until every job in `jobs` is completed in the emulator.
    ///
    /// # Errors
    ///
    /// When `timeout` passes first, with the emulator's state.
    pub async fn wait_jobs_completed(
        &self,
        jobs: &[scaleset::JobRequestId],
        timeout: Duration,
    ) -> Result<()> {
        wait_until(timeout, "jobs to complete", || {
            let state = self.emulator.state();
            jobs.iter().all(|id| {
                state
                    .jobs
                    .iter()
                    .any(|j| j.id == *id && j.state == JobState::Completed)
            })
        })
        .await
    }

    /// Every billet container of this cluster's deployment (any state).
    ///
    /// # Errors
    ///
    /// When Docker cannot be listed.
    pub async fn containers(&self) -> Result<Vec<String>> {
        self.containers_labelled(Vec::new()).await
    }

    /// The names of this deployment's containers (any state) that also carry
    /// every label in `labels` (`key=value`).
    ///
    /// # Errors
    ///
    /// When Docker cannot be listed.
    pub async fn containers_labelled(&self, labels: Vec<String>) -> Result<Vec<String>> {
        containers_of(&self.docker, &self.deployment, labels).await
    }

    /// Waits until the ledger's lease `id` has ended (done or failed) and
    /// returns it.
    ///
    /// # Errors
    ///
    /// When the lease is unknown or the ledger cannot be read, or when
    /// `timeout` passes first, naming `what` and the lease as it stands.
    pub async fn wait_lease_ended(
        &self,
        id: &str,
        timeout: Duration,
        what: &str,
    ) -> Result<billet_controlplane_stub::ledger::Lease> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let lease = self
                .plane
                .ledger()
                .get(id)
                .await?
                .with_context(|| format!("lease {id}"))?;
            if lease.phase.is_terminal() {
                return Ok(lease);
            }
            if tokio::time::Instant::now() > deadline {
                bail!("{what} after {timeout:?}: {lease:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// `billet node status --json` of node `name`.
    ///
    /// # Errors
    ///
    /// When `billet` cannot be run or exits non-zero, or prints no JSON.
    pub fn status_json(&self, name: &str) -> Result<serde_json::Value> {
        let out = std::process::Command::new(crate::image::binary_path("billet")?)
            .args(["node", "status", "--json", "--state-dir"])
            .arg(self.dir.join(format!("state-{name}")))
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "billet node status exited {:?}: {}",
            out.status.code(),
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(serde_json::from_slice(&out.stdout)?)
    }

    /// What the ledger still charges.
    ///
    /// # Errors
    ///
    /// When the ledger cannot be read.
    pub async fn charged(&self) -> Result<Charge> {
        Ok(self.plane.ledger().charged().await?)
    }

    /// Waits until no container of this deployment is left and the ledger
    /// charges nothing.
    ///
    /// # Errors
    ///
    /// When `timeout` passes first.
    pub async fn wait_clean(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let containers = self.containers().await?;
            let charge = self.charged().await?;
            if containers.is_empty() && charge == Charge::default() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "not clean after {timeout:?}: containers {containers:?}, ledger charges {charge:?}; leases {:?}",
                    self.plane.ledger().leases().await?
                );
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Stops the plane and the nodes and removes any container left.
    pub async fn shutdown(mut self) -> Result<()> {
        self.shutdown.cancel();
        self.plane.stopped().await;
        for node in self.nodes.values_mut() {
            node.kill().await?;
        }
        self.remove_containers().await;
        Ok(())
    }

    /// Force-removes every container of this deployment (cleanup after a
    /// failed test).
    pub async fn remove_containers(&self) {
        if let Ok(names) = self.containers().await {
            for name in names {
                let _ = self
                    .docker
                    .remove_container(
                        &name,
                        Some(bollard::query_parameters::RemoveContainerOptions {
                            force: true,
                            v: true,
                            ..Default::default()
                        }),
                    )
                    .await;
            }
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shutdown.cancel();
        // Installed nodes are not our children: stop them by pid.
        for node in self.nodes.values() {
            if let Some(pid) = node.installed.as_ref().and_then(|i| i.pid().ok()) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", &pid.to_string()])
                    .status();
            }
        }
        // Best effort: a test that failed midway leaves no container behind.
        remove_deployment_containers(&self.deployment);
    }
}

/// Polls `condition` every 100 ms until it holds or `timeout` passes.
///
/// # Errors
///
/// Naming `what` when the time runs out.
pub async fn wait_until(
    timeout: Duration,
    what: &str,
    mut condition: impl FnMut() -> bool,
) -> Result<()> {
    let deadline = tokio::time::Instant::now() + timeout;
    while !condition() {
        if tokio::time::Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// Tags the image `tag` names as `<repository>:c-<first 12 hex digits of
/// its id>` (the id is the digest of the image's content) and returns that
/// tag.
///
/// # Errors
///
/// The image cannot be inspected or tagged.
async fn pin_by_content(docker: &bollard::Docker, tag: &str) -> Result<String> {
    let id = docker
        .inspect_image(tag)
        .await
        .with_context(|| format!("inspect {tag}"))?
        .id
        .with_context(|| format!("{tag} has no id"))?;
    let digest = id.trim_start_matches("sha256:");
    let short = digest.get(..12).unwrap_or(digest);
    let repository = tag.split_once(':').map_or(tag, |(r, _)| r);
    let pinned = format!("c-{short}");
    docker
        .tag_image(
            tag,
            Some(
                bollard::query_parameters::TagImageOptionsBuilder::default()
                    .repo(repository)
                    .tag(&pinned)
                    .build(),
            ),
        )
        .await
        .with_context(|| format!("tag {tag} as {repository}:{pinned}"))?;
    Ok(format!("{repository}:{pinned}"))
}

/// How many times each job was started by a runner, from the plane's
/// events: the runners that started each job, by its request id, so a test
/// can check every job ran exactly once.
#[derive(Clone, Debug, Default)]
pub struct Starts(Arc<Mutex<HashMap<i64, Vec<String>>>>);

impl Starts {
    /// Counts every start the plane reports from now on, in a task of
    /// its own.
    pub fn watch(cluster: &Cluster) -> Self {
        let starts = Self::default();
        let mut events = cluster.plane.subscribe();
        let counts = Arc::clone(&starts.0);
        tokio::spawn(async move {
            while let Ok(event) = events.recv().await {
                if let billet_controlplane_stub::plane::PlaneEvent::Started {
                    request_id,
                    runner_name,
                } = event
                {
                    counts
                        .lock()
                        .expect("starts")
                        .entry(request_id)
                        .or_default()
                        .push(runner_name);
                }
            }
        });
        starts
    }

    /// The runners that started `job`.
    pub fn of(&self, job: scaleset::JobRequestId) -> Vec<String> {
        self.0
            .lock()
            .expect("starts")
            .get(&job.get())
            .cloned()
            .unwrap_or_default()
    }

    /// Asserts that each of `jobs` ended `succeeded` in the emulator and was
    /// started by exactly one runner.
    ///
    /// # Errors
    ///
    /// A job the emulator does not have.
    ///
    /// # Panics
    ///
    /// A job that did not succeed or was not started exactly once.
    pub fn assert_each_succeeded_once(
        &self,
        cluster: &Cluster,
        jobs: &[scaleset::JobRequestId],
    ) -> anyhow::Result<()> {
        let state = cluster.emulator.state();
        for id in jobs {
            let job = state
                .jobs
                .iter()
                .find(|j| j.id == *id)
                .with_context(|| format!("job {id} is not in the emulator"))?;
            assert_eq!(job.result.as_deref(), Some("succeeded"), "{job:?}");
            assert_eq!(
                self.of(*id).len(),
                1,
                "job {id} was not started exactly once: {:?}",
                self.of(*id)
            );
        }
        Ok(())
    }
}

/// A system user the tests run a command as, to see what another user
/// sees (the machine runs the tests as root, which every permission
/// admits): created once if absent, with no home and no shell. Answers its
/// uid and gid.
///
/// # Errors
///
/// When the user neither exists nor can be created (`useradd`, from
/// Debian's passwd, as root).
pub fn other_user() -> Result<(u32, u32)> {
    const NAME: &str = "billet-test-other";
    let id = |flag: &str| -> Result<Option<u32>> {
        let out = std::process::Command::new("id")
            .args([flag, NAME])
            .output()?;
        Ok(if out.status.success() {
            Some(String::from_utf8_lossy(&out.stdout).trim().parse()?)
        } else {
            None
        })
    };
    if id("-u")?.is_none() {
        let out = std::process::Command::new("useradd")
            .args([
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                NAME,
            ])
            .output()
            .context("run useradd (Debian's passwd) to make a second user")?;
        // 9: made meanwhile by a test beside this one.
        anyhow::ensure!(
            out.status.success() || out.status.code() == Some(9),
            "useradd {NAME}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok((
        id("-u")?.context("the other user's uid")?,
        id("-g")?.context("the other user's gid")?,
    ))
}
