//! `billet`: parse, set up tracing, load and check configuration, bind, run,
//! and map the error to an exit code (README "Exit codes"). Also
//! `billet host-upgrade`, the updater `billet node` execs on `StartUpgrade`.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use std::os::unix::process::CommandExt;

use billet_agent::config_file;
use billet_agent::hostupgrade;
use billet_agent::server::{self, NodeConfig, NodeError};
use billet_agent::tls::TlsPaths;
use billet_agent::upgrade::{self, AckWriter, ExecUpgrader};
use clap::{Parser, Subcommand};

use tokio_util::sync::CancellationToken;
use tracing::{error, info, warn};

/// Exit codes, one table (README "Exit codes").
mod exit {
    pub const CONFIG: u8 = 2;
    pub const TLS: u8 = 3;
    pub const BIND: u8 = 4;
    pub const PROVIDER: u8 = 5;
    pub const STATE: u8 = 6;
    pub const JOURNAL: u8 = 7;
    pub const UPGRADE_REFUSED: u8 = 8;
    pub const UPGRADE_FAILED: u8 = 9;
    pub const SERVE: u8 = 1;
}

#[derive(Debug, Parser)]
#[command(
    name = "billet",
    version,
    about = "billet: GitHub Actions jobs on hardware you control"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
#[expect(
    clippy::large_enum_variant,
    reason = "parsed once at start-up; boxing buys nothing"
)]
enum Command {
    /// Run the node agent: serve the control plane over mTLS gRPC.
    Node(NodeArgs),
    /// Replace this node's billet. Started by `billet node` on StartUpgrade,
    /// which reads the answer on --ack-fd; run by hand it answers nothing.
    HostUpgrade(HostUpgradeArgs),
}

#[derive(Debug, clap::Args)]
struct HostUpgradeArgs {
    /// The exact release to install.
    #[arg(long, required_unless_present = "settle")]
    version: Option<String>,
    /// Settle an upgrade whose updater is gone (roll back an unproven swap,
    /// start the node), and do nothing else. Run by the updater's transient
    /// unit when the updater ends, however it ends.
    #[arg(long, conflicts_with_all = ["version", "ack_fd", "ack_path"], requires = "config")]
    settle: bool,
    /// The SHA-256 of the release manifest the rollout pinned.
    #[arg(long)]
    manifest_sha256: Option<String>,
    /// The rollout this instruction belongs to.
    #[arg(long)]
    rollout: Option<String>,
    /// The rollout's generation; fences out stale instructions.
    #[arg(long)]
    generation: Option<u64>,
    /// The updater's configuration file.
    #[arg(long)]
    config: Option<PathBuf>,
    /// The inherited descriptor to answer on (`accepted` or `refused: ...`).
    #[arg(long, conflicts_with = "ack_path")]
    ack_fd: Option<i32>,
    /// A unix socket to answer on instead (the node's `systemd-run` launch).
    #[arg(long)]
    ack_path: Option<PathBuf>,
}

#[derive(Debug, clap::Args)]
struct NodeArgs {
    /// A TOML file whose keys are these flags' names in snake_case; its
    /// values are defaults that the environment and the command line
    /// override.
    #[arg(long, env = "BILLET_CONFIG")]
    config: Option<PathBuf>,
    /// Address to listen on, such as 0.0.0.0:7443.
    #[arg(long, env = "BILLET_LISTEN")]
    listen: SocketAddr,
    /// The node's certificate (PEM); its DNS name is the node's name.
    #[arg(long, env = "BILLET_CERT")]
    cert: PathBuf,
    /// The node's private key (PEM).
    #[arg(long, env = "BILLET_KEY")]
    key: PathBuf,
    /// The deployment CA bundle (PEM) the plane's certificate must chain to.
    #[arg(long, env = "BILLET_CA")]
    ca: PathBuf,
    /// The DNS name the plane's client certificate must carry.
    #[arg(long, env = "BILLET_PLANE_NAME", default_value = "plane")]
    plane_name: String,
    /// The deployment this node belongs to.
    #[arg(long, env = "BILLET_DEPLOYMENT", default_value = "dev")]
    deployment: String,
    /// Where the node keeps its state (created with mode 0700).
    #[arg(long, env = "BILLET_STATE_DIR", default_value = "/var/lib/billet")]
    state_dir: PathBuf,
    /// The Docker engine's Unix socket.
    #[arg(
        long,
        env = "BILLET_DOCKER_SOCKET",
        default_value = "/var/run/docker.sock"
    )]
    docker_socket: PathBuf,
    /// vCPUs to offer; defaults to the host's.
    #[arg(long, env = "BILLET_VCPU")]
    vcpu: Option<u32>,
    /// Memory to offer, in bytes; defaults to the host's.
    #[arg(long, env = "BILLET_MEMORY_BYTES")]
    memory_bytes: Option<u64>,
    /// Destroy and release compute held in custody longer than this many
    /// seconds. Off by default (0 is off too): time alone never kills a
    /// job.
    #[arg(long, env = "BILLET_MAX_CUSTODY_SECS")]
    max_custody_secs: Option<u64>,
    /// Seconds an instance never seen must stay absent before its absence
    /// counts as proof it is gone.
    #[arg(long, env = "BILLET_STRAY_GRACE_SECS", default_value_t = 300)]
    stray_grace_secs: u64,
    /// Seconds a launch result waits for the plane's acknowledgement before
    /// the node takes custody of the lease.
    #[arg(long, env = "BILLET_ACK_TIMEOUT_SECS", default_value_t = billet_agent::session::ACK_TIMEOUT.as_secs())]
    ack_timeout_secs: u64,
    /// Seconds a drain (SIGTERM) waits for running jobs before the node
    /// exits anyway, destroying nothing.
    #[arg(long, env = "BILLET_DRAIN_TIMEOUT_SECS", default_value_t = server::DEFAULT_DRAIN_TIMEOUT.as_secs())]
    drain_timeout_secs: u64,
    /// Seconds between checks of the certificate, key and CA files for a
    /// replacement (SIGHUP checks at once).
    #[arg(long, env = "BILLET_TLS_RELOAD_SECS", default_value_t = 10)]
    tls_reload_secs: u64,
    /// Warn daily when the node's certificate expires within this many days.
    #[arg(long, env = "BILLET_CERT_EXPIRY_WARNING_DAYS", default_value_t = 7)]
    cert_expiry_warning_days: u64,
    /// The updater StartUpgrade execs as `<binary> host-upgrade ...`,
    /// normally this billet. Unset, the node refuses upgrades.
    #[arg(long, env = "BILLET_UPGRADER_BINARY")]
    upgrader_binary: Option<PathBuf>,
    /// Passed to the updater as --config.
    #[arg(long, env = "BILLET_UPGRADE_CONFIG")]
    upgrade_config: Option<PathBuf>,
    /// Seconds StartUpgrade waits for the updater's answer before refusing.
    #[arg(long, env = "BILLET_UPGRADE_ACK_WAIT_SECS", default_value_t = 90)]
    upgrade_ack_wait_secs: u64,
}

fn host_memory_bytes() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map_or(0, |kib| kib * 1024)
}

fn config(args: NodeArgs) -> Result<(NodeConfig, SocketAddr), String> {
    if args.deployment.is_empty() {
        return Err("--deployment (BILLET_DEPLOYMENT) must not be empty".into());
    }
    let vcpu = args.vcpu.unwrap_or_else(|| {
        std::thread::available_parallelism().map_or(1, |n| u32::try_from(n.get()).unwrap_or(1))
    });
    if vcpu == 0 {
        return Err("--vcpu (BILLET_VCPU) must be at least 1".into());
    }
    let memory_bytes = args.memory_bytes.unwrap_or_else(host_memory_bytes);
    if memory_bytes == 0 {
        return Err("--memory-bytes (BILLET_MEMORY_BYTES) must be positive".into());
    }
    let upgrader = match args.upgrader_binary {
        None => {
            if args.upgrade_config.is_some() {
                return Err("--upgrade-config (BILLET_UPGRADE_CONFIG) is set without --upgrader-binary (BILLET_UPGRADER_BINARY); set both or neither".into());
            }
            None
        }
        Some(_) if args.upgrade_config.is_none() => {
            return Err("--upgrader-binary (BILLET_UPGRADER_BINARY) is set without --upgrade-config (BILLET_UPGRADE_CONFIG): the updater needs its configuration (deploy/upgrade.toml.example); set both or neither".into());
        }
        Some(binary) => {
            if !binary.is_absolute() {
                return Err(format!(
                    "--upgrader-binary (BILLET_UPGRADER_BINARY) {}: must be an absolute path; the node execs it long after start-up",
                    binary.display()
                ));
            }
            if !binary.is_file() {
                return Err(format!(
                    "--upgrader-binary (BILLET_UPGRADER_BINARY) {}: no such file",
                    binary.display()
                ));
            }
            if args
                .upgrade_config
                .as_ref()
                .is_some_and(|c| !c.is_absolute())
            {
                return Err(
                    "--upgrade-config (BILLET_UPGRADE_CONFIG) must be an absolute path".into(),
                );
            }
            if let Some(path) = &args.upgrade_config {
                // Checked now, not at the first rollout.
                hostupgrade::UpgradeConfig::load(path)
                    .and_then(|c| c.check_for_node(&args.state_dir))
                    .map_err(|e| format!("--upgrade-config (BILLET_UPGRADE_CONFIG): {e}"))?;
            }
            Some(ExecUpgrader {
                binary,
                config: args.upgrade_config,
                ack_wait: Duration::from_secs(args.upgrade_ack_wait_secs.max(1)),
                dispatch: upgrade::Dispatch::from_environment(args.state_dir.clone()),
            })
        }
    };
    Ok((
        NodeConfig {
            tls: TlsPaths {
                cert: args.cert,
                key: args.key,
                ca: args.ca,
            },
            plane_name: args.plane_name,
            deployment: args.deployment,
            state_dir: args.state_dir,
            docker_socket: args.docker_socket,
            vcpu,
            memory_bytes,
            max_custody: args.max_custody_secs.map(Duration::from_secs),
            stray_grace: Duration::from_secs(args.stray_grace_secs),
            ack_timeout: Duration::from_secs(args.ack_timeout_secs.max(1)),
            drain_timeout: Duration::from_secs(args.drain_timeout_secs),
            tls_reload: billet_agent::tls::ReloadPolicy {
                interval: Duration::from_secs(args.tls_reload_secs.max(1)),
                expiry_warning: Duration::from_secs(args.cert_expiry_warning_days * 86_400),
            },
            upgrader,
        },
        args.listen,
    ))
}

fn exit_code(e: &NodeError) -> u8 {
    match e {
        NodeError::Tls(_) => exit::TLS,
        NodeError::StateDir { .. } | NodeError::Local(_) => exit::STATE,
        NodeError::Provider(_) => exit::PROVIDER,
        NodeError::Journal(_) => exit::JOURNAL,
        NodeError::Serve(_) => exit::SERVE,
    }
}

fn init_tracing() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BILLET_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

fn main() -> ExitCode {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    let mut command =
        <Cli as clap::CommandFactory>::command().version(billet_agent::version::version());
    let is_node = args.get(1).is_some_and(|a| a == "node");
    if is_node && let Some(path) = config_file::named(&args, std::env::var_os(config_file::ENV)) {
        command = match config_file::apply(command, "node", &path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                return ExitCode::from(exit::CONFIG);
            }
        };
    }
    let cli = match command
        .try_get_matches_from(&args)
        .and_then(|m| <Cli as clap::FromArgMatches>::from_arg_matches(&m))
    {
        Ok(cli) => cli,
        Err(e) => {
            let _ = e.print();
            return ExitCode::from(if e.use_stderr() { exit::CONFIG } else { 0 });
        }
    };
    match cli.command {
        Command::Node(args) => {
            init_tracing();
            node(args)
        }
        Command::HostUpgrade(args) => host_upgrade(args),
    }
}

/// `billet host-upgrade`: answers on the ack channel at most once, then
/// drives the upgrade (`hostupgrade.rs`). Exit status: 0 done (or nothing
/// to do), 8 refused, 9 accepted and failed (the journal in the state
/// directory says what was restored).
fn host_upgrade(args: HostUpgradeArgs) -> ExitCode {
    // First, before anything opens a file: take the answer channel.
    let taken = match (args.ack_fd, &args.ack_path) {
        (Some(fd), _) => Some(AckWriter::take_fd(fd).map_err(|e| format!("--ack-fd {fd}: {e}"))),
        (None, Some(path)) => Some(
            AckWriter::connect(path).map_err(|e| format!("--ack-path {}: {e}", path.display())),
        ),
        (None, None) => None,
    };
    init_tracing();
    let mut ack = match taken {
        None => AckWriter::none(),
        Some(Ok(ack)) => ack,
        Some(Err(e)) => {
            warn!("cannot answer: {e}; answering nothing");
            AckWriter::none()
        }
    };
    let HostUpgradeArgs {
        version,
        settle,
        manifest_sha256,
        rollout,
        generation,
        config,
        ack_fd: _,
        ack_path: _,
    } = args;
    if settle {
        return settle_by_hand(config.as_deref());
    }
    let request = hostupgrade::Request {
        version: version.unwrap_or_default(),
        manifest_sha256,
        rollout,
        generation,
    };
    info!(?request, ?config, "asked to install a release");
    let loaded = match &config {
        None => Err(upgrade::NO_RELEASE_SOURCE.to_owned()),
        Some(path) => hostupgrade::UpgradeConfig::load(path),
    };
    let config = match loaded {
        Ok(c) => c,
        Err(reason) => {
            error!("refusing: {reason}");
            ack.refuse(&reason);
            return ExitCode::from(exit::UPGRADE_REFUSED);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            let reason = format!("cannot start the async runtime: {e}");
            ack.refuse(&reason);
            return ExitCode::from(exit::UPGRADE_REFUSED);
        }
    };
    match runtime.block_on(hostupgrade::run(&config, &request, &mut ack)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(hostupgrade::UpgradeFailure::Refused(_)) => ExitCode::from(exit::UPGRADE_REFUSED),
        Err(e @ hostupgrade::UpgradeFailure::Failed(_)) => {
            error!("upgrade {e}");
            ExitCode::from(exit::UPGRADE_FAILED)
        }
    }
}

/// `billet host-upgrade --settle --config PATH`: 0 when nothing was left
/// unfinished or the settle left one release installed and serving, 2 for
/// a configuration it cannot use, 9 when an operator must look.
fn settle_by_hand(config: Option<&std::path::Path>) -> ExitCode {
    let loaded = config
        .ok_or_else(|| "--settle needs --config".to_owned())
        .and_then(hostupgrade::UpgradeConfig::load);
    let loaded = match loaded {
        Ok(config) => config,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(exit::CONFIG);
        }
    };
    let settled = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the async runtime: {e}"))
        .and_then(|runtime| runtime.block_on(hostupgrade::settle_interrupted(&loaded)));
    match settled {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            error!("{e}");
            ExitCode::from(exit::UPGRADE_FAILED)
        }
    }
}

/// Settles an upgrade whose updater died (`hostupgrade.rs`); when that puts
/// the previous binary back, runs it in this process's place.
fn settle_upgrade(state_dir: &std::path::Path) -> Option<ExitCode> {
    match hostupgrade::settle_at_node_start(state_dir) {
        Ok(hostupgrade::Settled::RolledBack(binary)) => {
            warn!(binary = %binary.display(), "an interrupted upgrade was rolled back; starting the restored binary");
            let e = std::process::Command::new(&binary)
                .args(std::env::args_os().skip(1))
                .exec();
            error!("cannot exec {}: {e}", binary.display());
            Some(ExitCode::from(exit::STATE))
        }
        Ok(hostupgrade::Settled::Recorded) => {
            warn!("an interrupted upgrade had left the previous binary installed; recorded");
            None
        }
        Ok(hostupgrade::Settled::Nothing) => None,
        Err(e) => {
            warn!("the upgrade journal: {e}; starting anyway");
            None
        }
    }
}

fn node(args: NodeArgs) -> ExitCode {
    let file = args.config.clone();
    let (config, listen) = match config(args) {
        Ok(c) => c,
        Err(e) => {
            match file {
                Some(file) => error!(
                    "configuration: {e} (the value came from the command line, the environment, or the snake_case key in {})",
                    file.display()
                ),
                None => error!("configuration: {e}"),
            }
            return ExitCode::from(exit::CONFIG);
        }
    };
    // A state directory that is not one is refused below, naming it.
    if config.state_dir.is_dir()
        && let Some(code) = settle_upgrade(&config.state_dir)
    {
        return code;
    }
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(r) => r,
        Err(e) => {
            error!("cannot start the async runtime: {e}");
            return ExitCode::from(exit::SERVE);
        }
    };
    runtime.block_on(async move {
        let prepared = match server::prepare(&config).await {
            Ok(p) => p,
            Err(e) => {
                error!("{e}");
                return ExitCode::from(exit_code(&e));
            }
        };
        let listener = match tokio::net::TcpListener::bind(listen).await {
            Ok(l) => l,
            Err(e) => {
                error!("cannot listen on {listen}: {e}");
                return ExitCode::from(exit::BIND);
            }
        };
        let drain = CancellationToken::new();
        let shutdown = CancellationToken::new();
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(t) => t,
                Err(e) => {
                    error!("cannot handle SIGTERM: {e}");
                    return ExitCode::from(exit::SERVE);
                }
            };
        {
            let (drain, shutdown) = (drain.clone(), shutdown.clone());
            tokio::spawn(async move {
                // The first signal drains; a second one hurries.
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                info!("stopping: draining first; signal again to stop at once");
                drain.cancel();
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
                info!("stopping at once; running compute is left for the next process to adopt");
                shutdown.cancel();
            });
        }
        match server::run(config, prepared, listener, drain, shutdown).await {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                error!("{e}");
                ExitCode::from(exit_code(&e))
            }
        }
    })
}
