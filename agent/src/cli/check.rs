//! `billet check`: everything `billet node` checks before it serves (the
//! flags, the upgrade configuration, the TLS material, the state directory
//! and its journal, the Docker engine, and every address it would bind,
//! bound and released at once), with the same exit codes ([`super::exit`]),
//! holding nothing, creating nothing, settling nothing.
//!
//! A node already running on the state directory is not a fault of the
//! configuration (an operator checks a new configuration before restarting
//! onto it), so it is reported, not refused, and an address it may hold is
//! noted rather than refused.

use std::path::Path;
use std::process::ExitCode;
use std::time::SystemTime;

use tracing::error;

use super::{NodeArgs, exit};
use crate::edge::server::{self, NodeConfig, NodeError};
use crate::journal::SqliteJournal;
use crate::provider::Owner;
use crate::provider::docker::DockerProvider;

/// Runs the check and prints what was checked, one line each, to stdout.
/// Errors go to the log (stderr), as `billet node` reports them.
pub fn check(args: NodeArgs) -> ExitCode {
    let file = args.config.clone();
    let (config, listen) = match args.into_config() {
        Ok(c) => c,
        Err(e) => {
            super::report_config_error(&e, file.as_deref());
            return ExitCode::from(exit::CONFIG);
        }
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            error!("cannot start the async runtime: {e}");
            return ExitCode::from(exit::SERVE);
        }
    };
    match runtime.block_on(inspect(&config)) {
        Ok(lines) => {
            let running = runtime.block_on(node_running(&config.state_dir));
            let addresses = match bind_and_release(&addresses(&config, listen), running) {
                Ok(lines) => lines,
                Err(e) => {
                    error!("{e}");
                    return ExitCode::from(exit::BIND);
                }
            };
            for line in addresses.into_iter().chain(lines) {
                println!("{line}");
            }
            println!("ok: billet node would start with this configuration");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("{e}");
            ExitCode::from(exit::for_node_error(&e))
        }
    }
}

/// Every address `billet node` binds with this configuration, with the
/// flag that names it: the plane's, the metrics', and the Actions cache
/// proxy's when the operator named one (its default, Docker's bridge
/// gateway, is given up with a warning when taken, never refused).
fn addresses(
    config: &NodeConfig,
    listen: std::net::SocketAddr,
) -> Vec<(&'static str, std::net::SocketAddr)> {
    let mut addresses = vec![("--listen", listen)];
    if let Some(addr) = config.metrics_listen {
        addresses.push(("--metrics-listen", addr));
    }
    if let server::ProxyListen::At(addr) = config.actions_proxy.listen {
        addresses.push(("--cache-proxy-listen", addr));
    }
    addresses
}

/// Binds each address and releases it at once, a line each. An address in
/// use while a node runs on the state directory (`running`) is noted: that
/// node may hold it, and frees it when it stops.
///
/// # Errors
///
/// The sentence `billet node` would stop with (exit 4), naming the flag.
fn bind_and_release(
    addresses: &[(&'static str, std::net::SocketAddr)],
    running: bool,
) -> Result<Vec<String>, String> {
    let mut lines = Vec::new();
    for (flag, addr) in addresses {
        match std::net::TcpListener::bind(addr) {
            Ok(listener) => {
                drop(listener);
                lines.push(format!("{flag}: {addr} can be bound (bound and released)"));
            }
            Err(e) if running && e.kind() == std::io::ErrorKind::AddrInUse => lines.push(
                format!("note: {flag} {addr} is in use, perhaps by the node running on this state directory; it must be free when the new node starts"),
            ),
            Err(e) => return Err(format!("cannot listen on {addr} ({flag}): {e}")),
        }
    }
    Ok(lines)
}

/// Whether a node answers on the state directory's local socket.
async fn node_running(state_dir: &Path) -> bool {
    tokio::net::UnixStream::connect(crate::local::socket_path(state_dir))
        .await
        .is_ok()
}

/// What [`server::prepare`] checks, in its order, without its side effects:
/// the state directory is not created, the journal is opened read-only, the
/// local socket is only dialled.
///
/// # Errors
///
/// The [`NodeError`] `billet node` would stop with.
pub(crate) async fn inspect(config: &NodeConfig) -> Result<Vec<String>, NodeError> {
    let mut lines = Vec::new();
    let tls = server::load_tls(config)?;
    let expiry = if tls.expired {
        ", expired: the node starts, but must be re-enrolled (billet node enroll)".to_owned()
    } else {
        tls.not_after
            .and_then(|t| t.duration_since(SystemTime::now()).ok())
            .map_or_else(String::new, |d| {
                format!(", expires in {} days", d.as_secs() / 86_400)
            })
    };
    lines.push(format!(
        "tls: node {} (certificate {}{expiry}), plane {}",
        tls.node_name,
        config.tls.cert.display(),
        config.plane_name
    ));
    lines.push(state_dir(&config.state_dir)?);
    if config.state_dir.is_dir() {
        let exists = SqliteJournal::check(&config.state_dir).await?;
        lines.push(format!(
            "journal: {}",
            if exists {
                "readable, this release's"
            } else {
                "absent; the node creates it"
            }
        ));
        if node_running(&config.state_dir).await {
            lines.push(format!(
                "note: a node is running on this state directory ({}); a second one would be refused (exit {})",
                crate::local::socket_path(&config.state_dir).display(),
                exit::STATE
            ));
        }
    }
    lines.push(cache_dir(config)?);
    let docker = DockerProvider::connect(
        &config.docker_socket,
        Owner {
            deployment: config.deployment.clone(),
            node: tls.node_name.clone(),
        },
    )?;
    docker.ping().await?;
    lines.push(format!(
        "docker: {} answers",
        config.docker_socket.display()
    ));
    lines.push(match &config.upgrader {
        Some(u) => format!(
            "upgrades: {} with {}",
            u.binary.display(),
            u.config
                .as_deref()
                .map_or_else(String::new, |c| c.display().to_string())
        ),
        None => "upgrades: refused (no --upgrader-binary)".to_owned(),
    });
    Ok(lines)
}

/// The cache directory, its file system and what a sticky-disk mount costs
/// there, and how its generations and archives are evicted. An existing directory is
/// probed as the node probes it (two files made in it and removed); an
/// absent one is said to be created.
fn cache_dir(config: &NodeConfig) -> Result<String, NodeError> {
    let dir = &config.cache_dir;
    let rules = &config.cache_eviction;
    let eviction = format!(
        "; evicted every {} s, kept {} h after their last use, {} (Docker image stores kept {} h)",
        config.cache_evict_interval.as_secs(),
        rules.retention.as_secs() / 3600,
        rules.budget_bytes.map_or_else(
            || "no byte bound".to_owned(),
            |b| format!("at most {b} bytes")
        ),
        rules.image_store_retention.as_secs() / 3600,
    );
    crate::cache::session::check_socket_room(dir)?;
    if !dir.is_dir() {
        return Ok(format!(
            "cache: {} is absent; the node creates it (mode 0700) and finds out then whether it has reflinks{eviction}",
            dir.display()
        ));
    }
    let support = crate::cache::clone::ReflinkSupport::default();
    let filesystem = crate::cache::clone::probe(dir, &support).map_err(|e| {
        NodeError::Cache(crate::cache::CacheError::Open {
            path: dir.clone(),
            message: format!(
                "cannot write a file in it: {e}; give the node a writable --cache-dir"
            ),
        })
    })?;
    Ok(format!(
        "cache: {} on {}{eviction}",
        dir.display(),
        server::cache_cost(&filesystem)
    ))
}

/// The state directory as `billet node` would find it.
fn state_dir(path: &Path) -> Result<String, NodeError> {
    let err = |problem: &str| NodeError::StateDir {
        path: path.to_owned(),
        source: std::io::Error::other(problem.to_owned()),
    };
    // Asked of the kernel, not written: a read-only mount (a hardened unit
    // without `ReadWritePaths=`) or missing permissions answer here.
    let writable = |dir: &Path| {
        rustix::fs::access(
            dir,
            rustix::fs::Access::WRITE_OK | rustix::fs::Access::EXEC_OK,
        )
        .map_err(std::io::Error::from)
    };
    let unwritable = |dir: &Path, e: std::io::Error| {
        let problem = if e.kind() == std::io::ErrorKind::ReadOnlyFilesystem {
            format!("{} is on a read-only file system", dir.display())
        } else {
            format!("{} cannot be written by this user ({e})", dir.display())
        };
        err(&format!(
            "{problem}; the node records every launch there before it starts it: give --state-dir a writable directory (under the systemd unit, add it to ReadWritePaths=)"
        ))
    };
    if path.is_dir() {
        writable(path).map_err(|e| unwritable(path, e))?;
        return Ok(format!("state directory: {}", path.display()));
    }
    if path.exists() {
        return Err(err(
            "exists and is not a directory; give --state-dir a directory (it is created if missing)",
        ));
    }
    let ancestor = path.ancestors().skip(1).find(|a| a.exists());
    match ancestor {
        Some(a) if a.is_dir() => {
            writable(a).map_err(|e| unwritable(a, e))?;
            Ok(format!(
                "state directory: {} is absent; the node creates it (mode 0700)",
                path.display()
            ))
        }
        Some(a) => Err(err(&format!(
            "cannot be created: {} is not a directory",
            a.display()
        ))),
        None => Err(err("cannot be created: no parent directory exists")),
    }
}
