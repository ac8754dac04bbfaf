//! The `billet` command line: its subcommands and flags (clap), the
//! configuration layering (command line over environment over a TOML file
//! over the built-in default, [`config_file`]), the check of a node's
//! configuration before anything binds ([`config`]), the exit-code table
//! ([`exit`]), and `billet host-upgrade`'s driver ([`host_upgrade`]).
//!
//! May not touch: lease state or the provider; it only builds what
//! [`crate::edge::server`] and [`crate::upgrade`] take as arguments.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

pub mod check;
pub(crate) mod config;
pub(crate) mod config_file;
pub mod docs;
pub mod enroll;
pub mod exit;
pub mod host_upgrade;
pub mod status;

#[derive(Debug, Parser)]
#[command(
    name = "billet",
    version,
    about = "billet: GitHub Actions jobs on hardware you control",
    long_about = None
)]
/// The `billet` command line.
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the node agent: serve the control plane over mTLS gRPC.
    #[command(
        after_help = "`billet node status [--state-dir DIR | --config FILE] [--json]` shows what the node on this host is doing.\n\n`billet node enroll --plane HOST:PORT (--token-file FILE | --token T)` re-enrols a node whose certificate expired with a join token from the plane, without a restart.\n\nLogs go to stderr, filtered by BILLET_LOG (a tracing filter such as `info`, `debug` or `billet_agent=trace`; default `info`)."
    )]
    Node(NodeArgs),
    /// `billet node status` (parsed on its own: `node`'s flags are required
    /// for serving, none of them for asking).
    #[command(skip)]
    NodeStatus(status::StatusArgs),
    /// `billet node enroll` (parsed on its own, like `status`).
    #[command(skip)]
    NodeEnroll(enroll::EnrollArgs),
    /// Check a node's configuration as `billet node` would before serving
    /// (flags, TLS material, state directory and journal, Docker engine,
    /// upgrade configuration, and every address it binds, bound and
    /// released at once), exiting with the same codes; changes nothing.
    Check(NodeArgs),
    /// Print a shell completion script for `billet` (bash, zsh, fish,
    /// elvish, powershell) to stdout.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print `billet`'s man pages (roff, section 1) to stdout, or write
    /// one file per command (`billet.1`, `billet-node.1`,
    /// `billet-node-status.1`, ...) into a directory.
    Man {
        /// Write `<command>.1` files here instead of printing them.
        #[arg(long, value_name = "DIR")]
        dir: Option<PathBuf>,
    },
    /// Replace this node's billet. Started by `billet node` on StartUpgrade,
    /// which reads the answer on --ack-fd; run by hand it answers nothing.
    HostUpgrade(HostUpgradeArgs),
}

/// `billet host-upgrade`'s flags.
#[derive(Debug, clap::Args)]
pub struct HostUpgradeArgs {
    /// The exact release to install.
    #[arg(long, required_unless_present = "settle")]
    pub version: Option<String>,
    /// Settle an upgrade whose updater is gone (roll back an unproven swap,
    /// start the node), and do nothing else. Run by the updater's transient
    /// unit when the updater ends, however it ends.
    #[arg(long, conflicts_with_all = ["version", "ack_fd", "ack_path"], requires = "config")]
    pub settle: bool,
    /// The SHA-256 of the release manifest the rollout pinned.
    #[arg(long)]
    manifest_sha256: Option<String>,
    /// The rollout this instruction belongs to.
    #[arg(long)]
    pub rollout: Option<String>,
    /// The rollout's generation; fences out stale instructions.
    #[arg(long)]
    pub generation: Option<u64>,
    /// The updater's configuration file.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// The inherited descriptor to answer on (`accepted` or `refused: ...`).
    #[arg(long, conflicts_with = "ack_path")]
    pub ack_fd: Option<i32>,
    /// A unix socket to answer on instead (the node's `systemd-run` launch).
    #[arg(long)]
    pub ack_path: Option<PathBuf>,
}

/// `billet node`'s (and `billet check`'s) flags.
#[derive(Debug, clap::Args)]
pub struct NodeArgs {
    /// A TOML file whose keys are these flags' names in snake_case; its
    /// values are defaults that the environment and the command line
    /// override.
    #[arg(long, env = "BILLET_CONFIG")]
    pub config: Option<PathBuf>,
    /// Address to listen on, such as 0.0.0.0:7443.
    #[arg(long, env = "BILLET_LISTEN")]
    pub listen: SocketAddr,
    /// The node's certificate (PEM); its DNS name is the node's name.
    #[arg(long, env = "BILLET_CERT")]
    pub cert: PathBuf,
    /// The node's private key (PEM), mode 0600 (or 0640 owned by root):
    /// a key others may read, or its group when root does not own it, is
    /// refused at start.
    #[arg(long, env = "BILLET_KEY")]
    pub key: PathBuf,
    /// Start even when the private key is readable by its group or others
    /// (a key shared through a group, on a host whose every user is
    /// trusted). Off by default.
    #[arg(long, env = "BILLET_ALLOW_READABLE_KEY", value_name = "BOOL",
          num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub allow_readable_key: bool,
    /// The deployment CA bundle (PEM) the plane's certificate must chain to.
    #[arg(long, env = "BILLET_CA")]
    pub ca: PathBuf,
    /// The DNS name the plane's client certificate must carry.
    #[arg(long, env = "BILLET_PLANE_NAME", default_value = "plane", value_parser = parse_dns_name)]
    pub plane_name: String,
    /// The deployment this node belongs to.
    #[arg(long, env = "BILLET_DEPLOYMENT", default_value = "dev")]
    pub deployment: String,
    /// Where the node keeps its state (created with mode 0700).
    #[arg(long, env = "BILLET_STATE_DIR", default_value = "/var/lib/billet")]
    pub state_dir: PathBuf,
    /// Where the node keeps its sticky disks' generations and mounts
    /// (created with mode 0700); `<state-dir>/cache` by default. Reflinks
    /// make mounts cheap where this file system has them (XFS with
    /// reflink=1, btrfs); elsewhere each mount copies its generation.
    #[arg(long, env = "BILLET_CACHE_DIR")]
    pub cache_dir: Option<PathBuf>,
    /// The most bytes the sticky disks' generations and the Actions
    /// cache's archives together may hold on the cache directory's disk:
    /// past it, each eviction pass removes the least recently used of them
    /// that no running job has mounted or is reading until they fit. No
    /// bound by default.
    #[arg(long, env = "BILLET_CACHE_MAX_BYTES")]
    pub cache_max_bytes: Option<u64>,
    /// Hours a sticky disk's generation or an Actions cache archive is kept
    /// after its last use (a job mounting or restoring it; a mounted one
    /// counts as used until its job ends); 1 to 87600. The Docker image
    /// store has its own (`--cache-image-store-retention-hours`).
    #[arg(long, env = "BILLET_CACHE_RETENTION_HOURS", default_value_t = 168,
          value_parser = within::<1, MAX_FLAG_HOURS>)]
    pub cache_retention_hours: u64,
    /// Hours a Docker image store's generation is kept after its last use,
    /// whatever `--cache-retention-hours` says; 1 to 87600.
    #[arg(
        long,
        env = "BILLET_CACHE_IMAGE_STORE_RETENTION_HOURS",
        default_value_t = 192,
        value_parser = within::<1, MAX_FLAG_HOURS>
    )]
    pub cache_image_store_retention_hours: u64,
    /// Seconds between the cache's eviction passes; 1 to 86400.
    #[arg(long, env = "BILLET_CACHE_EVICT_INTERVAL_SECS", default_value_t = crate::cache::lifecycle::DEFAULT_EVICT_INTERVAL.as_secs(),
          value_parser = within::<1, MAX_CACHE_EVICT_INTERVAL_SECS>)]
    pub cache_evict_interval_secs: u64,
    /// The Docker engine's Unix socket.
    #[arg(
        long,
        env = "BILLET_DOCKER_SOCKET",
        default_value = "/var/run/docker.sock"
    )]
    pub docker_socket: PathBuf,
    /// vCPUs to offer, 1 to 4096; defaults to the host's.
    #[arg(long, env = "BILLET_VCPU", value_parser = parse_vcpu)]
    pub vcpu: Option<u32>,
    /// Memory to offer, in bytes, 64 MiB (67108864) to 1 PiB; defaults to
    /// the host's.
    #[arg(long, env = "BILLET_MEMORY_BYTES", value_parser = within::<MIN_MEMORY_BYTES, MAX_BYTES>)]
    pub memory_bytes: Option<u64>,
    /// Destroy and release compute held in custody longer than this many
    /// seconds. Off by default (0 is off too): time alone never kills a
    /// job.
    #[arg(long, env = "BILLET_MAX_CUSTODY_SECS", value_parser = within::<0, MAX_FLAG_SECS>)]
    pub max_custody_secs: Option<u64>,
    /// Seconds an instance never seen must stay absent before its absence
    /// counts as proof it is gone.
    #[arg(long, env = "BILLET_STRAY_GRACE_SECS", default_value_t = 300,
          value_parser = within::<0, MAX_FLAG_SECS>)]
    pub stray_grace_secs: u64,
    /// Seconds a runner may take from its container's creation to coming
    /// online (GitHub sees it take a job) before it is torn down with
    /// reason start_deadline, its registration removed first and its lease
    /// released failed. 0 is off.
    #[arg(long, env = "BILLET_START_DEADLINE_SECS", default_value_t = crate::node::runner::START_DEADLINE.as_secs(),
          value_parser = within::<0, MAX_FLAG_SECS>)]
    pub start_deadline_secs: u64,
    /// Destroy and release as failed (reason max_lease_life) any lease
    /// older than this many seconds, running or in custody, busy or not.
    /// Off by default (0 is off too): time alone is not evidence a job
    /// stalled; each hour of a lease's life is warned about.
    #[arg(long, env = "BILLET_MAX_LEASE_LIFE_SECS", value_parser = within::<0, MAX_FLAG_SECS>)]
    pub max_lease_life_secs: Option<u64>,
    /// Seconds a runner still working when its job's completion arrives is
    /// left to exit on its own; then it is stopped (SIGTERM, SIGKILL 10 s
    /// later) and its lease released failed (post_job_timeout).
    #[arg(long, env = "BILLET_POST_JOB_GRACE_SECS", default_value_t = crate::node::runner::POST_JOB_GRACE.as_secs(),
          value_parser = within::<0, MAX_FLAG_SECS>)]
    pub post_job_grace_secs: u64,
    /// This node's containers are isolated from the host's kernel by other
    /// means than Docker's defaults (such as gVisor's runsc set as dockerd's
    /// default runtime, or one VM per node): untrusted tiers (a fork's pull
    /// requests) may then run here. Without it they are refused, since a
    /// plain container shares the host's kernel. The node takes the
    /// operator's word; it does not check the runtime.
    #[arg(long, env = "BILLET_ISOLATED_CONTAINERS", value_name = "BOOL",
          num_args = 0..=1, default_value_t = false, default_missing_value = "true",
          action = clap::ArgAction::Set)]
    pub isolated_containers: bool,
    /// Consecutive start failures of a tier (the engine refusing its
    /// instance, its image missing, its runner exiting before coming
    /// online) after which this node refuses the tier's launches (30 s,
    /// doubling to 10 min, then one is tried again; at once when the tier's
    /// definition changes). 0: never.
    #[arg(long, env = "BILLET_TIER_FAILURES_BEFORE_UNHEALTHY", default_value_t = crate::node::tiers::FAILURES_BEFORE_UNHEALTHY,
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    pub tier_failures_before_unhealthy: u32,
    /// The most processes (threads included) one guest may run at once; a
    /// tier may ask for fewer, never more.
    #[arg(long, env = "BILLET_GUEST_PIDS_LIMIT", default_value_t = crate::provider::docker::DEFAULT_GUEST_PIDS_LIMIT,
          value_parser = clap::value_parser!(u32).range(64..=4_194_304))]
    pub guest_pids_limit: u32,
    /// Seconds a launch result waits for the plane's acknowledgement before
    /// the node takes custody of the lease; at least 1 (0 would put every
    /// launch in custody).
    #[arg(long, env = "BILLET_ACK_TIMEOUT_SECS", default_value_t = crate::edge::session::ACK_TIMEOUT.as_secs(),
          value_parser = within::<1, MAX_FLAG_SECS>)]
    pub ack_timeout_secs: u64,
    /// Seconds a drain (SIGTERM) waits for running jobs before the node
    /// exits anyway, destroying nothing.
    #[arg(long, env = "BILLET_DRAIN_TIMEOUT_SECS", default_value_t = crate::edge::server::DEFAULT_DRAIN_TIMEOUT.as_secs(),
          value_parser = within::<0, MAX_FLAG_SECS>)]
    pub drain_timeout_secs: u64,
    /// Seconds between checks of the certificate, key and CA files for a
    /// replacement (SIGHUP checks at once); at least 1.
    #[arg(long, env = "BILLET_TLS_RELOAD_SECS", default_value_t = 10,
          value_parser = within::<1, MAX_FLAG_SECS>)]
    pub tls_reload_secs: u64,
    /// Warn daily when the node's certificate expires within this many days.
    #[arg(long, env = "BILLET_CERT_EXPIRY_WARNING_DAYS", default_value_t = 7,
          value_parser = within::<0, MAX_FLAG_DAYS>)]
    pub cert_expiry_warning_days: u64,
    /// The updater StartUpgrade execs as `<binary> host-upgrade ...`,
    /// normally this billet. Unset, the node refuses upgrades.
    #[arg(long, env = "BILLET_UPGRADER_BINARY")]
    pub upgrader_binary: Option<PathBuf>,
    /// Passed to the updater as --config.
    #[arg(long, env = "BILLET_UPGRADE_CONFIG")]
    pub upgrade_config: Option<PathBuf>,
    /// Seconds StartUpgrade waits for the updater's answer before
    /// refusing; at least 1.
    #[arg(long, env = "BILLET_UPGRADE_ACK_WAIT_SECS", default_value_t = 90,
          value_parser = within::<1, MAX_FLAG_SECS>)]
    pub upgrade_ack_wait_secs: u64,
    /// Serve Prometheus metrics over plain HTTP at /metrics on this
    /// address; a bare port means 127.0.0.1:PORT. Off by default.
    #[arg(long, env = "BILLET_METRICS_LISTEN", value_parser = parse_metrics_listen)]
    pub metrics_listen: Option<SocketAddr>,
    /// Below this many free bytes on the state directory's file system the
    /// node is degraded: it refuses launches (RESOURCE_EXHAUSTED) until
    /// space is freed. 0 (no floor) to 1 PiB.
    #[arg(long, env = "BILLET_MIN_FREE_DISK_BYTES", default_value_t = crate::node::health::DEFAULT_MIN_FREE_DISK_BYTES,
          value_parser = within::<0, MAX_BYTES>)]
    pub min_free_disk_bytes: u64,
    /// Watch the EC2 spot interruption notice at this instance-metadata
    /// base URL (IMDSv2; on EC2, http://169.254.169.254): a notice makes
    /// the node take no more work and fail every lease it holds with
    /// `ec2 spot interruption: <action>`, destroying its runners. Off by
    /// default.
    #[arg(long, env = "BILLET_SPOT_IMDS", value_parser = parse_spot_imds)]
    pub spot_imds: Option<String>,
    /// A pull-through registry mirror handed to every guest (an http:// or
    /// https:// URL); repeat the flag for several, or separate them with
    /// commas in BILLET_REGISTRY_MIRRORS. A guest that runs Docker finds
    /// them in its /etc/docker/daemon.json, every guest in
    /// BILLET_REGISTRY_MIRRORS. The node's own image pulls use the engine's
    /// configuration. None by default.
    #[arg(
        long = "registry-mirror",
        env = "BILLET_REGISTRY_MIRRORS",
        value_delimiter = ',',
        value_parser = crate::provider::mirrors::parse_mirror
    )]
    pub registry_mirror: Vec<String>,
    /// Where the Actions cache proxy listens: an ADDRESS:PORT the guests
    /// reach and hand their proxy URL, or `off`. By default the Docker
    /// bridge's gateway on port 7718 (a node without a bridge serves
    /// none). The address is no authority: every tunnel needs a session's
    /// token.
    #[arg(long, env = "BILLET_CACHE_PROXY_LISTEN")]
    pub cache_proxy_listen: Option<String>,
    /// Where the Actions cache proxy sends what it does not answer, as
    /// HOST:PORT (TLS, server name results-receiver.actions.githubusercontent.com);
    /// by default that host on 443. For tests.
    #[arg(long, env = "BILLET_ACTIONS_RESULTS_UPSTREAM")]
    pub actions_results_upstream: Option<String>,
    /// A PEM file of certificates the upstream is also trusted by, beside
    /// the system's roots. For tests.
    #[arg(long, env = "BILLET_ACTIONS_RESULTS_CA")]
    pub actions_results_ca: Option<PathBuf>,
    /// How log lines are written to stderr: `text` for people, `json` (one
    /// object per line, one field per value) for collectors.
    #[arg(long, env = "BILLET_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    pub log_format: LogFormat,
}

/// The largest value of a flag counted in seconds: ten years. No operator
/// means a longer bound, and every deadline the node computes from one (an
/// instant plus the duration) stays representable, so no flag can make the
/// node panic long after it started.
pub(crate) const MAX_FLAG_SECS: u64 = 10 * 365 * 86_400;
/// The same ten years for a flag counted in hours.
pub(crate) const MAX_FLAG_HOURS: u64 = 10 * 365 * 24;
/// The same ten years for a flag counted in days.
pub(crate) const MAX_FLAG_DAYS: u64 = 10 * 365;
/// The longest `--cache-evict-interval-secs`: a day.
pub(crate) const MAX_CACHE_EVICT_INTERVAL_SECS: u64 = 86_400;
/// The least memory a node may offer: 64 MiB, below which no runner
/// starts, so a smaller value is a slip (a unit left off).
pub(crate) const MIN_MEMORY_BYTES: u64 = 64 << 20;
/// The largest byte count a flag takes: 1 PiB, beyond any one host's
/// memory or disk.
pub(crate) const MAX_BYTES: u64 = 1 << 50;
/// The most vCPUs a node may offer.
pub(crate) const MAX_VCPU: u64 = 4096;

/// `--vcpu`: 1 to [`MAX_VCPU`].
fn parse_vcpu(value: &str) -> Result<u32, String> {
    within::<1, MAX_VCPU>(value).map(|n| u32::try_from(n).unwrap_or(u32::MAX))
}

/// `--plane-name`: a DNS name, as a certificate's subject alternative
/// name carries it; anything else can never match the plane's certificate.
fn parse_dns_name(value: &str) -> Result<String, String> {
    rustls::pki_types::DnsName::try_from(value)
        .map(|_| value.to_owned())
        .map_err(|_| {
            format!(
                "{value:?} is not a DNS name (letters, digits and hyphens in dot-separated labels, as the plane's certificate names it)"
            )
        })
}

/// A duration flag's parser: a whole number of the unit its name carries,
/// from `MIN` to `MAX`. Clap names the flag (or the configuration file's
/// key) in front of the sentence, which names the bound that was passed.
pub(crate) fn within<const MIN: u64, const MAX: u64>(value: &str) -> Result<u64, String> {
    let n = match value.parse::<u64>() {
        Ok(n) => n,
        // Digits that do not fit a u64 are a number past every bound.
        Err(_) if !value.is_empty() && value.bytes().all(|b| b.is_ascii_digit()) => u64::MAX,
        Err(_) => return Err(format!("{value:?} is not a whole number")),
    };
    if n > MAX {
        return Err(format!(
            "{value} is too large: the largest value allowed is {MAX}"
        ));
    }
    if n < MIN {
        return Err(format!(
            "{value} is too small: the smallest value allowed is {MIN}"
        ));
    }
    Ok(n)
}

/// `--metrics-listen`: an address, or a bare port on loopback.
fn parse_metrics_listen(value: &str) -> Result<SocketAddr, String> {
    if let Ok(port) = value.parse::<u16>() {
        return Ok(SocketAddr::from(([127, 0, 0, 1], port)));
    }
    value
        .parse()
        .map_err(|_| format!("{value:?} is neither an address (127.0.0.1:9464) nor a port"))
}

/// What `billet --version` prints after `billet `: the version, then the
/// commit it was built from. The updater reads the first word
/// ([`crate::upgrade::updater::parse_version_line`]).
fn version_line() -> &'static str {
    // Leaked once: clap keeps a `&'static str`.
    Box::leak(
        format!(
            "{} (commit {})",
            crate::upgrade::version::version(),
            crate::upgrade::version::COMMIT
        )
        .into_boxed_str(),
    )
}

/// How log lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Text,
    /// One JSON object per line.
    Json,
}

/// Parses the command line, layering `billet node`'s `--config` file (or
/// `BILLET_CONFIG`) under the environment and the flags.
///
/// # Errors
///
/// The exit code to stop with, after the message was printed: 2 for a bad
/// file, key, value or flag, 0 for `--help` and `--version`.
pub fn parse(args: &[OsString]) -> Result<Cli, ExitCode> {
    if args.get(1).is_some_and(|a| a == "node") && args.get(2).is_some_and(|a| a == "status") {
        return <status::StatusArgs as clap::Parser>::try_parse_from(&args[2..])
            .map(|a| Cli {
                command: Command::NodeStatus(a),
            })
            .map_err(|e| {
                let _ = e.print();
                ExitCode::from(if e.use_stderr() { exit::CONFIG } else { 0 })
            });
    }
    if args.get(1).is_some_and(|a| a == "node") && args.get(2).is_some_and(|a| a == "enroll") {
        return <enroll::EnrollArgs as clap::Parser>::try_parse_from(&args[2..])
            .map(|a| Cli {
                command: Command::NodeEnroll(a),
            })
            .map_err(|e| {
                let _ = e.print();
                ExitCode::from(if e.use_stderr() { exit::CONFIG } else { 0 })
            });
    }
    let mut command = <Cli as clap::CommandFactory>::command().version(version_line());
    // `check` takes the same flags, and the same file, as `node`.
    let sub = args
        .get(1)
        .and_then(|a| a.to_str())
        .filter(|a| ["node", "check"].contains(a));
    if let Some(sub) = sub
        && let Some(path) = config_file::named(args, std::env::var_os(config_file::ENV))
    {
        command = match config_file::apply(command, sub, &path) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("error: {e}");
                return Err(ExitCode::from(exit::CONFIG));
            }
        };
    }
    command
        .try_get_matches_from(args)
        .and_then(|m| <Cli as clap::FromArgMatches>::from_arg_matches(&m))
        .map_err(|e| {
            let _ = e.print();
            ExitCode::from(if e.use_stderr() { exit::CONFIG } else { 0 })
        })
}

/// Logs a configuration error the way `billet node` and `billet check` do:
/// naming where the value may have come from.
pub fn report_config_error(e: &str, file: Option<&std::path::Path>) {
    match file {
        Some(file) => tracing::error!(
            "configuration: {e} (the value came from the command line, the environment, or the snake_case key in {})",
            file.display()
        ),
        None => tracing::error!("configuration: {e}"),
    }
}

/// The log filter `BILLET_LOG` names (default `info` when unset or
/// empty), checked strictly: a directive that names no level is refused,
/// so a typo such as `inf` cannot silence the node.
///
/// # Errors
///
/// A sentence naming the variable and what is wrong with it.
pub(crate) fn log_filter(value: Option<&str>) -> Result<tracing_subscriber::EnvFilter, String> {
    let text = value
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .unwrap_or("info");
    // A directive is `level`, `target=level` or `target[span]=level`. A
    // bare word is read by tracing as a target at TRACE, which is how
    // `inf` or `json` would hide everything but that target: refuse it.
    for directive in text.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        let level = directive.rsplit_once('=').map_or(directive, |(_, l)| l);
        if level
            .parse::<tracing_subscriber::filter::LevelFilter>()
            .is_err()
        {
            return Err(format!(
                "BILLET_LOG={text:?}: {directive:?} names no log level; use off, error, warn, info, debug or trace, optionally as target=level, comma-separated"
            ));
        }
    }
    tracing_subscriber::EnvFilter::builder()
        .parse(text)
        .map_err(|e| format!("BILLET_LOG={text:?}: {e}"))
}

/// `billet host-upgrade`'s logger: text, `BILLET_LOG` when valid, else
/// `info` with the reason on stderr (the updater must still answer the
/// node that started it, so a bad filter does not stop it).
pub(crate) fn init_tracing_lenient() {
    let filter = log_filter(std::env::var("BILLET_LOG").ok().as_deref()).unwrap_or_else(|e| {
        eprintln!("warning: {e}; logging at info");
        tracing_subscriber::EnvFilter::new("info")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
}

/// Logs to stderr in `format`, filtered by `BILLET_LOG` (default `info`).
///
/// # Errors
///
/// An invalid `BILLET_LOG`, with the message already written to stderr
/// (there is no logger yet): the caller exits 2.
pub fn init_tracing(format: LogFormat) -> Result<(), ExitCode> {
    let filter = match log_filter(std::env::var("BILLET_LOG").ok().as_deref()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("error: {e}");
            return Err(ExitCode::from(exit::CONFIG));
        }
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
    Ok(())
}

/// Makes a panic on any thread of this process stop it with exit code
/// [`exit::PANIC`], after logging where and why at error (on stderr when the
/// log filter drops errors). Without it a panic in a spawned task ends only
/// that task: the runtime catches it, and the node serves on without its
/// executor, KeepAlive or drain. A node stopped at once is restarted by its
/// service manager and adopts what runs; one half alive holds leases it no
/// longer tends.
pub fn stop_on_panic() {
    std::panic::set_hook(Box::new(|info| {
        let thread = std::thread::current();
        let thread = thread.name().unwrap_or("<unnamed>");
        let backtrace = std::backtrace::Backtrace::capture();
        let backtrace = match backtrace.status() {
            std::backtrace::BacktraceStatus::Captured => format!("\n{backtrace}"),
            _ => String::new(),
        };
        if tracing::enabled!(tracing::Level::ERROR) {
            tracing::error!(
                thread,
                "a task of the node panicked, so the node stops (exit {}): {info}{backtrace}",
                exit::PANIC
            );
        } else {
            eprintln!(
                "billet: a task of the node panicked on thread {thread}, so the node stops (exit {}): {info}{backtrace}",
                exit::PANIC
            );
        }
        std::process::exit(i32::from(exit::PANIC));
    }));
}

/// `--spot-imds`: an instance-metadata base URL the IMDS reader accepts.
fn parse_spot_imds(value: &str) -> Result<String, String> {
    crate::node::interruption::Imds::new(value)
        .map(|_| value.to_owned())
        .map_err(|e| e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(extra: &[&str]) -> Result<NodeArgs, ExitCode> {
        let args: Vec<OsString> = [
            "billet",
            "node",
            "--listen",
            "127.0.0.1:7443",
            "--cert",
            "n.pem",
            "--key",
            "n.key",
            "--ca",
            "ca.pem",
        ]
        .iter()
        .chain(extra)
        .map(OsString::from)
        .collect();
        match parse(&args)?.command {
            Command::Node(a) => Ok(a),
            other => panic!("not a node: {other:?}"),
        }
    }

    /// Every flag counted in seconds, hours or days, of `billet node`,
    /// `billet check`, `billet node status` and `billet node enroll`,
    /// refuses a value past its bound as it is parsed, naming the flag and
    /// the largest value allowed; the largest is taken. A flag added later
    /// is held to the same by its name.
    #[test]
    fn every_duration_flag_refuses_a_value_past_its_bound_naming_the_flag_and_the_largest() {
        use clap::CommandFactory as _;
        let node_base = [
            "--listen",
            "127.0.0.1:7443",
            "--cert",
            "n.pem",
            "--key",
            "n.key",
            "--ca",
            "ca.pem",
        ];
        let commands: [(clap::Command, &[&str]); 4] = [
            (
                Cli::command().find_subcommand("node").unwrap().clone(),
                &node_base,
            ),
            (
                Cli::command().find_subcommand("check").unwrap().clone(),
                &node_base,
            ),
            (status::StatusArgs::command(), &[]),
            (
                enroll::EnrollArgs::command(),
                &["--plane", "plane:7444", "--token", "t"],
            ),
        ];
        let mut seen = 0;
        for (command, base) in commands {
            let name = command.get_name().to_owned();
            let flags: Vec<String> = command
                .get_arguments()
                .filter_map(|a| a.get_long())
                .filter(|l| ["-secs", "-hours", "-days"].iter().any(|u| l.ends_with(u)))
                .map(str::to_owned)
                .collect();
            for flag in flags {
                seen += 1;
                let largest = if flag.ends_with("-days") {
                    MAX_FLAG_DAYS
                } else if flag.ends_with("-hours") {
                    MAX_FLAG_HOURS
                } else if flag == "cache-evict-interval-secs" {
                    MAX_CACHE_EVICT_INTERVAL_SECS
                } else {
                    MAX_FLAG_SECS
                };
                let parse = |value: String| {
                    let mut args: Vec<String> = base.iter().map(|a| (*a).to_owned()).collect();
                    args.extend([format!("--{flag}"), value]);
                    command
                        .clone()
                        .no_binary_name(true)
                        .try_get_matches_from(args)
                };
                for value in [
                    u64::MAX.to_string(),
                    "18446744073709551616".to_owned(),
                    (largest + 1).to_string(),
                ] {
                    let e = parse(value.clone())
                        .expect_err(&format!("{name} --{flag} {value} was taken"))
                        .to_string();
                    assert!(
                        e.contains(&format!("--{flag}")),
                        "{name} --{flag} {value}: {e}"
                    );
                    assert!(
                        e.contains(&format!("the largest value allowed is {largest}")),
                        "{name} --{flag} {value}: {e}"
                    );
                }
                parse(largest.to_string())
                    .unwrap_or_else(|e| panic!("{name} --{flag} {largest}: {e}"));
            }
        }
        assert!(seen >= 28, "only {seen} duration flags found");
    }

    /// Set in the copy of this test binary that
    /// [`a_panic_in_a_spawned_task_stops_the_process_with_the_panic_exit_code`]
    /// runs: that copy plays the node.
    const PANIC_CHILD: &str = "BILLET_TEST_PANIC_CHILD";

    /// With the hook `billet node` installs, a panic in one spawned task
    /// stops the whole process with exit 101 and says so; the runtime
    /// alone would catch it and keep serving without the task. The test
    /// runs itself again as the child, which panics in a task.
    #[test]
    fn a_panic_in_a_spawned_task_stops_the_process_with_the_panic_exit_code() {
        if std::env::var_os(PANIC_CHILD).is_some() {
            stop_on_panic();
            let runtime = tokio::runtime::Runtime::new().unwrap();
            runtime.block_on(async {
                let task = tokio::spawn(async { panic!("a planted panic") });
                // The hook never returns, so this answers only when the
                // runtime caught the panic and the process lives on.
                let _ = task.await;
            });
            std::process::exit(3);
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "cli::tests::a_panic_in_a_spawned_task_stops_the_process_with_the_panic_exit_code",
                "--nocapture",
            ])
            .env(PANIC_CHILD, "1")
            .env_remove("RUST_BACKTRACE")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(
            out.status.code(),
            Some(i32::from(exit::PANIC)),
            "stderr:\n{stderr}"
        );
        assert!(
            stderr.contains("a task of the node panicked") && stderr.contains("a planted panic"),
            "stderr:\n{stderr}"
        );
    }

    /// Untrusted tiers run on Docker only where the operator says the
    /// containers are isolated by other means; off unless said, by flag
    /// or by the configuration file.
    #[test]
    fn the_plane_name_is_a_dns_name_and_nothing_else() {
        for good in ["plane", "plane.example.com", "plane-1.billet.internal"] {
            assert_eq!(node(&["--plane-name", good]).unwrap().plane_name, good);
        }
        for bad in ["not a dns name!", "", "plane..example", "-plane"] {
            assert!(parse_dns_name(bad).is_err(), "{bad:?} was taken");
        }
    }

    #[test]
    fn the_key_is_refused_readable_beyond_its_owner_unless_allowed() {
        assert!(!node(&[]).unwrap().allow_readable_key);
        assert!(node(&["--allow-readable-key"]).unwrap().allow_readable_key);
    }

    #[test]
    fn isolated_containers_is_off_unless_the_operator_says_so() {
        assert!(!node(&[]).unwrap().isolated_containers);
        assert!(
            node(&["--isolated-containers"])
                .unwrap()
                .isolated_containers
        );
        assert!(
            !node(&["--isolated-containers=false"])
                .unwrap()
                .isolated_containers
        );
        let dir = std::env::temp_dir().join(format!("billet-cli-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("node.toml");
        std::fs::write(&file, "isolated_containers = true\n").unwrap();
        let config = file.to_str().unwrap();
        assert!(node(&["--config", config]).unwrap().isolated_containers);
        std::fs::write(&file, "isolated_containers = \"maybe\"\n").unwrap();
        assert!(node(&["--config", config]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
