//! `billet-plane`: the stand-in control plane as a process. Parses, loads
//! the TLS material, builds the GitHub client, and runs the library until
//! SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use billet_controlplane_stub::node_link::{NodeTarget, PlaneTls};
use billet_controlplane_stub::plane::{Plane, PlaneConfig, Tier};
use clap::Parser;
use tokio_util::sync::CancellationToken;
use tracing::error;

#[derive(Debug, Parser)]
#[command(
    name = "billet-plane",
    version,
    about = "A stand-in billet control plane"
)]
struct Args {
    /// The ledger's SQLite file.
    #[arg(long, default_value = "billet-ledger.db")]
    ledger: PathBuf,
    /// Deployment id.
    #[arg(long, default_value = "dev")]
    deployment: String,
    /// Lease TTL in seconds.
    #[arg(long, default_value_t = 90)]
    lease_ttl_secs: u64,
    /// Deployment CA (PEM).
    #[arg(long)]
    ca: PathBuf,
    /// The plane's certificate (PEM).
    #[arg(long)]
    cert: PathBuf,
    /// The plane's key (PEM).
    #[arg(long)]
    key: PathBuf,
    /// A node to dial, as NAME=HOST:PORT; repeatable.
    #[arg(long = "node", required = true, value_parser = parse_node)]
    nodes: Vec<NodeTarget>,
    /// GitHub config URL (an organization or repository URL).
    #[arg(long)]
    github_url: String,
    /// A personal access token.
    #[arg(long, env = "BILLET_GITHUB_PAT", hide_env_values = true)]
    github_pat: String,
    /// Permit plain HTTP to GitHub (the emulator only).
    #[arg(long)]
    allow_http: bool,
    /// Tier label, also the scale-set name.
    #[arg(long, default_value = "billet-linux")]
    tier: String,
    /// Runner image.
    #[arg(long, default_value = "billet-standin-runner:dev")]
    image: String,
    /// Runner argv element; repeatable.
    #[arg(long = "command", default_value = "/billet-standin-runner")]
    command: Vec<String>,
    /// vCPUs per runner.
    #[arg(long, default_value_t = 1)]
    vcpu: u32,
    /// Memory per runner, in bytes.
    #[arg(long, default_value_t = 512 << 20)]
    memory_bytes: u64,
    /// Container network mode.
    #[arg(long, default_value = "")]
    network: String,
    /// Plain runner environment as KEY=value; repeatable.
    #[arg(long = "env")]
    env: Vec<String>,
    /// Most runners at once.
    #[arg(long, default_value_t = 10)]
    max_runners: u32,
}

fn parse_node(s: &str) -> Result<NodeTarget, String> {
    let (name, addr) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?}: expected NAME=HOST:PORT"))?;
    let addr: SocketAddr = addr
        .parse()
        .map_err(|e| format!("{s:?}: {addr:?} is not HOST:PORT ({e})"))?;
    Ok(NodeTarget {
        name: name.to_owned(),
        addr,
    })
}

fn read(path: &PathBuf) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

#[tokio::main]
async fn main() -> ExitCode {
    let args = Args::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("BILLET_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let tls = match (read(&args.ca), read(&args.cert), read(&args.key)) {
        (Ok(ca_pem), Ok(cert_pem), Ok(key_pem)) => PlaneTls {
            ca_pem,
            cert_pem,
            key_pem,
        },
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            error!("{e}");
            return ExitCode::from(3);
        }
    };
    let credentials = match scaleset::Credentials::personal_access_token(args.github_pat) {
        Ok(c) => c,
        Err(e) => {
            error!("--github-pat: {e}");
            return ExitCode::from(2);
        }
    };
    let github = match scaleset::Client::builder(args.github_url, credentials)
        .allow_http(args.allow_http)
        .build()
    {
        Ok(c) => c,
        Err(e) => {
            error!("--github-url: {e}");
            return ExitCode::from(2);
        }
    };
    let config = PlaneConfig {
        deployment: args.deployment,
        lease_ttl: Duration::from_secs(args.lease_ttl_secs.max(1)),
        ledger_path: args.ledger,
        tls,
        nodes: args.nodes,
        tier: Tier {
            label: args.tier,
            image: args.image,
            command: args.command,
            trust: "trusted".into(),
            vcpu: args.vcpu,
            memory_bytes: args.memory_bytes,
            network: args.network,
            env: args.env,
        },
        launch_timeout: Duration::from_secs(300),
        destroy_timeout: Duration::from_secs(120),
        reap_interval: Duration::from_secs(5),
        max_runners: args.max_runners,
        maintenance_interval: Duration::from_secs(30),
        quarantine_grace: billet_controlplane_stub::calls::QUARANTINE_GRACE,
    };
    let shutdown = CancellationToken::new();
    let plane = match Plane::start(config, github, shutdown.clone()).await {
        Ok(p) => p,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };
    match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(mut term) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = tokio::signal::ctrl_c() => {}
            }
        }
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
    shutdown.cancel();
    plane.stopped().await;
    ExitCode::SUCCESS
}
