//! `billet-plane`: the stand-in control plane as a process. Parses, loads
//! the TLS material, builds the GitHub client, and runs the library until
//! SIGTERM or Ctrl-C.
//!
//! With `--emulator ADDR` it needs no GitHub: it runs the `scaleset`
//! crate's emulator in process on ADDR and plays GitHub against it, so an
//! operator can attach a plane to a node on one machine in one command.
//! `billet-plane --queue-job URL` then queues a job there (one request to
//! the emulator's control API) and exits.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use billet_controlplane_stub::ledger::LedgerLocation;
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
    /// Where the ledger is: a SQLite file path (or `sqlite:PATH`), or a
    /// PostgreSQL URL (`postgres://USER@HOST/DATABASE`, which several
    /// planes may share). A password is better given in `PGPASSWORD` or the
    /// environment variable than on the command line; it is never logged.
    #[arg(
        long,
        env = "BILLET_LEDGER",
        hide_env_values = true,
        default_value = "billet-ledger.db"
    )]
    ledger: LedgerLocation,
    /// Deployment id.
    #[arg(long, default_value = "dev")]
    deployment: String,
    /// Lease TTL in seconds.
    #[arg(long, default_value_t = 90)]
    lease_ttl_secs: u64,
    /// Deployment CA (PEM).
    #[arg(long, required_unless_present = "queue_job")]
    ca: Option<PathBuf>,
    /// The plane's certificate (PEM).
    #[arg(long, required_unless_present = "queue_job")]
    cert: Option<PathBuf>,
    /// The plane's key (PEM).
    #[arg(long, required_unless_present = "queue_job")]
    key: Option<PathBuf>,
    /// A node to dial, as NAME=HOST:PORT; repeatable.
    #[arg(long = "node", required_unless_present = "queue_job", value_parser = parse_node)]
    nodes: Vec<NodeTarget>,
    /// GitHub config URL (an organization or repository URL).
    #[arg(long, required_unless_present_any = ["emulator", "queue_job"], conflicts_with = "emulator")]
    github_url: Option<String>,
    /// A personal access token.
    #[arg(long, env = "BILLET_GITHUB_PAT", hide_env_values = true)]
    github_pat: Option<String>,
    /// Play GitHub against the scale-set emulator, run in this process on
    /// this address (such as 127.0.0.1:4100), instead of --github-url; its
    /// control API is at http://ADDR/_emulator.
    #[arg(long)]
    emulator: Option<SocketAddr>,
    /// Queue one job on the emulator of a plane started with --emulator
    /// (its URL, such as http://127.0.0.1:4100) for --tier, print its id,
    /// and exit.
    #[arg(long, conflicts_with = "emulator")]
    queue_job: Option<String>,
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

/// `--queue-job`: finds the scale set named `tier` in the emulator's state
/// and queues a job on it.
async fn queue_job(url: &str, tier: &str) -> Result<String, String> {
    let http = reqwest::Client::new();
    let url = url.trim_end_matches('/');
    let state: scaleset::testing::EmulatorState = http
        .get(format!("{url}/_emulator/state"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("{url}: {e}"))?
        .json()
        .await
        .map_err(|e| format!("{url}/_emulator/state: {e}"))?;
    let scale_set = state
        .scale_sets
        .iter()
        .find(|s| s.name == tier)
        .ok_or_else(|| {
            format!("{url}: no scale set named {tier:?} yet; is a billet-plane --emulator running there?")
        })?;
    http.post(format!("{url}/_emulator/jobs"))
        .json(&serde_json::json!({ "scaleSetId": scale_set.id, "labels": [tier] }))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| format!("{url}/_emulator/jobs: {e}"))?
        .text()
        .await
        .map_err(|e| format!("{url}/_emulator/jobs: {e}"))
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
    if let Some(url) = &args.queue_job {
        return match queue_job(url, &args.tier).await {
            Ok(job) => {
                println!("{job}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("--queue-job: {e}");
                ExitCode::from(1)
            }
        };
    }
    let (Some(ca), Some(cert), Some(key)) = (&args.ca, &args.cert, &args.key) else {
        error!("--ca, --cert and --key are required");
        return ExitCode::from(2);
    };
    // Kept alive for the plane's life.
    let mut emulator = None;
    let (github_url, github_pat, allow_http) = match args.emulator {
        Some(addr) => {
            let emu = match scaleset::testing::Emulator::builder()
                .long_poll(Duration::from_secs(2))
                .bind(addr)
                .try_start()
                .await
            {
                Ok(e) => e,
                Err(e) => {
                    error!("--emulator: cannot listen on {addr}: {e}");
                    return ExitCode::from(4);
                }
            };
            println!(
                "{}",
                serde_json::json!({
                    "emulator": emu.uri(),
                    "control_url": format!("{}/_emulator", emu.uri()),
                    "queue_a_job": format!("billet-plane --queue-job {}", emu.uri()),
                })
            );
            let url = emu.config_url();
            emulator = Some(emu);
            (url, scaleset::testing::DEFAULT_PAT.to_owned(), true)
        }
        None => match (args.github_url.clone(), args.github_pat.clone()) {
            (Some(url), Some(pat)) => (url, pat, args.allow_http),
            _ => {
                error!(
                    "--github-url and --github-pat (BILLET_GITHUB_PAT) are required without --emulator"
                );
                return ExitCode::from(2);
            }
        },
    };
    let tls = match (read(ca), read(cert), read(key)) {
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
    let credentials = match scaleset::Credentials::personal_access_token(github_pat) {
        Ok(c) => c,
        Err(e) => {
            error!("--github-pat: {e}");
            return ExitCode::from(2);
        }
    };
    let github = match scaleset::Client::builder(github_url, credentials)
        .allow_http(allow_http)
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
        ledger: args.ledger,
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
        renewal_grace: billet_controlplane_stub::plane::RENEWAL_GRACE,
        scale_set_retry: billet_controlplane_stub::github::SCALE_SET_RETRY,
        registration_interval: billet_controlplane_stub::plane::REGISTRATION_INTERVAL,
        registration_grace: billet_controlplane_stub::plane::REGISTRATION_GRACE,
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
    drop(emulator);
    ExitCode::SUCCESS
}
