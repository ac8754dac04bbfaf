//! `billet-plane`: the stand-in control plane as a process. Parses, loads
//! the TLS material, builds the GitHub client, and runs the library until
//! SIGTERM or Ctrl-C.
//!
//! With `--emulator ADDR` it needs no GitHub: it runs the `scaleset`
//! crate's emulator in process on ADDR and plays GitHub against it, so an
//! operator can attach a plane to a node on one machine in one command.
//! `billet-plane --queue-job URL` then queues a job there (one request to
//! the emulator's control API) and exits.
//!
//! With `--ca-key` the plane signs its nodes' certificate renewals, and
//! with `--enroll-listen ADDR` it serves the enrolment endpoint a node
//! whose certificate expired re-enrols at. `billet-plane --ledger PATH
//! [--lease-ttl-secs N] --join-token NODE` prints a one-time join token for that node (recorded
//! in the ledger the running plane reads) and exits.
//!
//! `billet-plane --ledger PATH jobs [--json] [--job ID]` lists the recent
//! jobs the plane recorded, or tells one job's story (exit 3: no such job).
//!
//! `billet-plane --ledger PATH cache disable|enable --org ORG | --repository OWNER/NAME` turns
//! the node-local Actions cache off or back on for an organisation or a repository (the kill
//! switch, spec/cache.md §5.2): it writes the ledger the running planes read and exits, and the
//! nodes' next question about that repository is answered from it (no restart). Exit codes: 0
//! done (saying whether anything changed), 1 the ledger cannot be written, 2 a bad name.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use billet_controlplane_stub::identity::{DEFAULT_JOIN_TOKEN_TTL, DEFAULT_NODE_CERT_LIFETIME};
use billet_controlplane_stub::ledger::{DEFAULT_LEASE_TTL, LedgerLocation};
use billet_controlplane_stub::node_link::{Keepalive, NodeTarget, PlaneTls};
use billet_controlplane_stub::plane::{Plane, PlaneConfig, Tier};
use clap::{Parser, Subcommand};
use tokio_util::sync::CancellationToken;
use tracing::error;

#[derive(Debug, Parser)]
#[command(
    name = "billet-plane",
    version,
    about = "A stand-in billet control plane",
    subcommand_negates_reqs = true
)]
struct Args {
    /// Writes the ledger instead of running a plane.
    #[command(subcommand)]
    action: Option<Action>,
    /// Where the ledger is: a SQLite file path (or `sqlite:PATH`), or a
    /// PostgreSQL URL (`postgres://USER@HOST/DATABASE`, which several
    /// planes may share). A password is better given in `PGPASSWORD` or the
    /// environment variable than on the command line; it is never logged.
    #[arg(
        long,
        env = "BILLET_LEDGER",
        hide_env_values = true,
        default_value = "billet-ledger.db",
        global = true
    )]
    ledger: LedgerLocation,
    /// Deployment id.
    #[arg(long, default_value = "dev")]
    deployment: String,
    /// Lease TTL in seconds.
    #[arg(long, default_value_t = DEFAULT_LEASE_TTL.as_secs())]
    lease_ttl_secs: u64,
    /// Deployment CA (PEM).
    #[arg(long, required_unless_present_any = ["queue_job", "join_token"])]
    ca: Option<PathBuf>,
    /// The deployment CA's private key (PEM): the plane then signs its
    /// nodes' certificate requests (renewals, enrolments).
    #[arg(long)]
    ca_key: Option<PathBuf>,
    /// Lifetime of the node certificates the plane signs, in seconds.
    #[arg(long, default_value_t = DEFAULT_NODE_CERT_LIFETIME.as_secs())]
    node_cert_lifetime_secs: u64,
    /// Serve the enrolment endpoint (TLS with the plane's certificate; a
    /// node presents a join token instead of a client certificate) on this
    /// address, such as 0.0.0.0:7443. Needs --ca-key.
    #[arg(long, requires = "ca_key")]
    enroll_listen: Option<SocketAddr>,
    /// Print a one-time join token for this node, recorded in --ledger,
    /// and exit.
    #[arg(long, conflicts_with_all = ["emulator", "queue_job"])]
    join_token: Option<String>,
    /// How long a join token from --join-token is good for, in seconds.
    #[arg(long, default_value_t = DEFAULT_JOIN_TOKEN_TTL.as_secs())]
    join_token_ttl_secs: u64,
    /// The plane's certificate (PEM).
    #[arg(long, required_unless_present_any = ["queue_job", "join_token"])]
    cert: Option<PathBuf>,
    /// The plane's key (PEM).
    #[arg(long, required_unless_present_any = ["queue_job", "join_token"])]
    key: Option<PathBuf>,
    /// A node to dial, as NAME=HOST:PORT; repeatable.
    #[arg(long = "node", required_unless_present_any = ["queue_job", "join_token"], value_parser = parse_node)]
    nodes: Vec<NodeTarget>,
    /// GitHub config URL (an organization or repository URL).
    #[arg(long, required_unless_present_any = ["emulator", "queue_job", "join_token"], conflicts_with = "emulator")]
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
    /// The oldest actions/runner version the tier runs: a node refuses,
    /// before anything is minted, a launch whose image's
    /// org.opencontainers.image.version label names an older one. Raise it
    /// as GitHub raises its own floor; "" for none.
    #[arg(long, env = "BILLET_MIN_RUNNER_VERSION", value_name = "VERSION",
          default_value = billet_controlplane_stub::plane::DEFAULT_MIN_RUNNER_VERSION,
          value_parser = runner_version)]
    min_runner_version: String,
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
    /// Mint each launch's runner registration before dispatching it, for a node
    /// that takes one and whose last launch ran the tier's image, so the node
    /// creates the container beside its bind (about 2 ms off each launch). Off
    /// by default: a node that refuses the launch (degraded, its image gone)
    /// then finds a registration already minted, which the plane removes at
    /// once, where without it nothing is minted for a refused launch.
    #[arg(long)]
    mint_before_dispatch: bool,
    /// Seconds between the HTTP/2 PINGs the plane sends each node, from 1
    /// to 3600. A node that goes silent (a partition, a host lost, nothing
    /// refused) is noticed only when a PING goes unanswered: its session is
    /// lost at most this plus --node-keepalive-timeout-secs after, and the
    /// renewal grace starts then.
    #[arg(long, env = "BILLET_NODE_KEEPALIVE_SECS", value_name = "SECS",
          default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=3600))]
    node_keepalive_secs: u64,
    /// Seconds a node has to answer a PING before the plane drops the
    /// connection and its session, from 1 to 3600; above the link's worst
    /// round trip.
    #[arg(long, env = "BILLET_NODE_KEEPALIVE_TIMEOUT_SECS", value_name = "SECS",
          default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..=3600))]
    node_keepalive_timeout_secs: u64,
    /// Warm runners each node keeps for --tier: containers started from its
    /// image ahead of any job, so a job's runner is already running when
    /// the job arrives. Each takes a runner's room on its node. Overridden,
    /// while this plane runs, by `billet-plane warm --count N`. 0: none.
    #[arg(long, env = "BILLET_WARM", value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=1000))]
    warm: u32,
    /// Seconds a warm runner may wait for a job before it is retired (the
    /// pool makes a fresh one); 0: never.
    #[arg(long, env = "BILLET_WARM_IDLE_SECS", value_name = "SECS", default_value_t = 3600,
          value_parser = clap::value_parser!(u64).range(0..=604_800))]
    warm_idle_secs: u64,
    /// Seconds after which a warm runner is retired and replaced whatever
    /// it does; 0: never.
    #[arg(long, env = "BILLET_WARM_MAX_AGE_SECS", value_name = "SECS", default_value_t = 86_400,
          value_parser = clap::value_parser!(u64).range(0..=2_592_000))]
    warm_max_age_secs: u64,
    /// Hours each job's record (its times, attempts and waits, read with
    /// `billet-plane jobs`) is kept after it was last written; a job still
    /// waiting is kept whatever its age.
    #[arg(long, env = "BILLET_JOB_RETENTION_HOURS", value_name = "HOURS", default_value_t = 168,
          value_parser = clap::value_parser!(u64).range(1..=87_600))]
    job_retention_hours: u64,
    /// Seconds a job may be unplaceable (no node can take its runner, for
    /// whatever reason) before it is logged at warn once, counted in
    /// billet_jobs_stuck_total and shown `stuck: <reason>` by `billet-plane jobs`.
    #[arg(long, env = "BILLET_STUCK_AFTER_SECS", value_name = "SECS", default_value_t = 300,
          value_parser = clap::value_parser!(u64).range(1..=604_800))]
    stuck_after_secs: u64,
    /// Serve the plane's metrics (job wait and run times, lease ends, jobs
    /// waiting and stuck) at http://ADDR/metrics, such as 127.0.0.1:9465.
    /// Off unless given; bind to loopback or a trusted network.
    #[arg(long, env = "BILLET_PLANE_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
}

/// What `billet-plane` does instead of running a plane.
#[derive(Debug, Subcommand)]
enum Action {
    /// The node-local Actions cache's kill switch: turn it off or on for an
    /// organisation or a repository, in the ledger every plane reads.
    Cache {
        #[command(subcommand)]
        switch: CacheSwitch,
    },
    /// Sets how many warm runners each node keeps for --tier, in the ledger
    /// every plane of the tier reads (within a second, replacing --warm).
    /// 0 retires them all.
    Warm {
        /// Warm runners per node.
        #[arg(long, value_parser = clap::value_parser!(u32).range(0..=1000))]
        count: u32,
    },
    /// Lists the recent jobs from the ledger (state, when queued, how long
    /// each waited, attempts, the last reason), or tells one job's story
    /// from first to last line with --job.
    Jobs {
        /// One job's story: its runner request id.
        #[arg(long, value_name = "ID")]
        job: Option<i64>,
        /// JSON instead of text.
        #[arg(long)]
        json: bool,
        /// How many jobs to list, the latest queued first.
        #[arg(long, default_value_t = 50, value_parser = clap::value_parser!(u32).range(1..=10_000))]
        limit: u32,
    },
}

/// `billet-plane cache disable|enable`.
#[derive(Debug, Subcommand)]
enum CacheSwitch {
    /// Nodes stop serving the Actions cache of this organisation or
    /// repository locally: its jobs' cache traffic goes to GitHub.
    Disable(CacheTarget),
    /// Lifts this block, and only it (enabling an organisation leaves its
    /// repositories' own blocks).
    Enable(CacheTarget),
}

/// Whose Actions cache: one of `--org` or `--repository`.
#[derive(Debug, clap::Args)]
#[group(required = true, multiple = false)]
struct CacheTarget {
    /// An organisation (or user): every repository it owns.
    #[arg(long)]
    org: Option<String>,
    /// One repository, as OWNER/NAME.
    #[arg(long, value_name = "OWNER/NAME")]
    repository: Option<String>,
}

/// `billet-plane cache ...`: writes the block (or lifts it) in the ledger at
/// `location` and says what changed.
async fn cache_switch(
    location: &LedgerLocation,
    lease_ttl: Duration,
    switch: &CacheSwitch,
) -> ExitCode {
    use billet_controlplane_stub::ledger::{CacheBlock, Ledger};
    let (disable, target) = match switch {
        CacheSwitch::Disable(t) => (true, t),
        CacheSwitch::Enable(t) => (false, t),
    };
    let block = match (&target.org, &target.repository) {
        (Some(org), _) => CacheBlock::org(org).map_err(|e| format!("--org: {e}")),
        (None, Some(repository)) => {
            CacheBlock::repository(repository).map_err(|e| format!("--repository: {e}"))
        }
        (None, None) => Err("give --org ORG or --repository OWNER/NAME".to_owned()),
    };
    let block = match block {
        Ok(b) => b,
        Err(e) => {
            error!("cache: {e}");
            return ExitCode::from(2);
        }
    };
    let ledger = match Ledger::connect(location, lease_ttl).await {
        Ok(l) => l,
        Err(e) => {
            error!("--ledger: {e}");
            return ExitCode::from(1);
        }
    };
    let changed = if disable {
        ledger
            .block_cache(&block, billet_controlplane_stub::now_ms())
            .await
    } else {
        ledger.unblock_cache(&block).await
    };
    ledger.close().await;
    match changed {
        Ok(changed) => {
            let state = if disable { "disabled" } else { "enabled" };
            let news = if changed { "" } else { " (it was already)" };
            println!("the node-local Actions cache is {state} for {block}{news}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("--ledger: {e}");
            ExitCode::from(1)
        }
    }
}

/// `billet-plane warm --count N`: records the wanted warm count of `tier`
/// in the ledger at `location`.
async fn warm_switch(
    location: &LedgerLocation,
    lease_ttl: Duration,
    tier: &str,
    count: u32,
) -> ExitCode {
    use billet_controlplane_stub::ledger::Ledger;
    let ledger = match Ledger::connect(location, lease_ttl).await {
        Ok(l) => l,
        Err(e) => {
            error!("--ledger: {e}");
            return ExitCode::from(1);
        }
    };
    let set = ledger
        .set_warm_wanted(tier, count, billet_controlplane_stub::now_ms())
        .await;
    ledger.close().await;
    match set {
        Ok(()) => {
            println!("each node keeps {count} warm runners of tier {tier}");
            ExitCode::SUCCESS
        }
        Err(e) => {
            error!("--ledger: {e}");
            ExitCode::from(1)
        }
    }
}

/// `billet-plane jobs`: reads the job records from the ledger at
/// `location` and prints them. Exit codes: 0 printed, 1 the ledger cannot
/// be read, 3 no such job.
async fn jobs(
    location: &LedgerLocation,
    lease_ttl: Duration,
    job: Option<i64>,
    json: bool,
    limit: u32,
) -> ExitCode {
    use billet_controlplane_stub::jobs as text;
    use billet_controlplane_stub::ledger::Ledger;
    let ledger = match Ledger::connect(location, lease_ttl).await {
        Ok(l) => l,
        Err(e) => {
            error!("--ledger: {e}");
            return ExitCode::from(1);
        }
    };
    let read = match job {
        Some(id) => ledger.job_record(id).await.map(|j| j.into_iter().collect()),
        None => ledger.recent_jobs(limit).await,
    };
    ledger.close().await;
    let records: Vec<_> = match read {
        Ok(r) => r,
        Err(e) => {
            error!("--ledger: {e}");
            return ExitCode::from(1);
        }
    };
    let now = billet_controlplane_stub::now_ms();
    match (job, records.first()) {
        (Some(id), None) => {
            error!("the ledger has no record of job {id} (never seen, or pruned)");
            return ExitCode::from(3);
        }
        (Some(_), Some(record)) if !json => print!("{}", text::story(record, now)),
        _ if json => println!("{}", text::json(&records, now)),
        _ => print!("{}", text::table(&records, now)),
    }
    ExitCode::SUCCESS
}

impl Args {
    /// The keepalive the flags give.
    fn node_keepalive(&self) -> Keepalive {
        Keepalive {
            interval: Duration::from_secs(self.node_keepalive_secs),
            timeout: Duration::from_secs(self.node_keepalive_timeout_secs),
        }
    }
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

/// `--join-token`: records a token for `node` in the ledger at `location`
/// and answers it. The ledger records `lease_ttl` as the plane does, so
/// give the running plane's `--lease-ttl-secs`.
async fn join_token(
    location: &LedgerLocation,
    lease_ttl: Duration,
    node: &str,
    ttl_secs: u64,
) -> Result<String, String> {
    let ledger = billet_controlplane_stub::ledger::Ledger::connect(location, lease_ttl)
        .await
        .map_err(|e| format!("--ledger: {e}"))?;
    let token = billet_controlplane_stub::identity::issue_join_token(
        &ledger,
        node,
        Duration::from_secs(ttl_secs.max(1)),
        billet_controlplane_stub::now_ms(),
    )
    .await
    .map_err(|e| format!("--ledger: {e}"));
    ledger.close().await;
    token
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
    if let Some(Action::Cache { switch }) = &args.action {
        let lease_ttl = Duration::from_secs(args.lease_ttl_secs.max(1));
        return cache_switch(&args.ledger, lease_ttl, switch).await;
    }
    if let Some(Action::Jobs { job, json, limit }) = &args.action {
        let lease_ttl = Duration::from_secs(args.lease_ttl_secs.max(1));
        return jobs(&args.ledger, lease_ttl, *job, *json, *limit).await;
    }
    if let Some(Action::Warm { count }) = &args.action {
        let lease_ttl = Duration::from_secs(args.lease_ttl_secs.max(1));
        return warm_switch(&args.ledger, lease_ttl, &args.tier, *count).await;
    }
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
    if let Some(node) = &args.join_token {
        let lease_ttl = Duration::from_secs(args.lease_ttl_secs.max(1));
        return match join_token(&args.ledger, lease_ttl, node, args.join_token_ttl_secs).await {
            Ok(token) => {
                // The token is printed, once, for the operator; never logged.
                println!("{token}");
                ExitCode::SUCCESS
            }
            Err(e) => {
                error!("--join-token: {e}");
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
    let node_ca = match &args.ca_key {
        None => None,
        Some(path) => {
            let loaded = std::fs::read_to_string(ca)
                .map_err(|e| format!("cannot read {}: {e}", ca.display()))
                .and_then(|cert| {
                    let key = std::fs::read_to_string(path)
                        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
                    billet_controlplane_stub::identity::NodeCa::from_pem(
                        &cert,
                        &key,
                        Duration::from_secs(args.node_cert_lifetime_secs.max(60)),
                    )
                    .map_err(|e| format!("--ca / --ca-key: {e}"))
                });
            match loaded {
                Ok(ca) => Some(std::sync::Arc::new(ca)),
                Err(e) => {
                    error!("{e}");
                    return ExitCode::from(3);
                }
            }
        }
    };
    let enroll_listener = match args.enroll_listen {
        None => None,
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                error!("--enroll-listen: cannot listen on {addr}: {e}");
                return ExitCode::from(4);
            }
        },
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
    let node_keepalive = args.node_keepalive();
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
            sticky_disks: Vec::new(),
            actions_cache: None,
            docker_image_store: false,
            min_runner_version: args.min_runner_version,
        },
        launch_timeout: Duration::from_secs(300),
        mint_before_dispatch: args.mint_before_dispatch,
        destroy_timeout: Duration::from_secs(120),
        reap_interval: Duration::from_secs(5),
        max_runners: args.max_runners,
        maintenance_interval: Duration::from_secs(30),
        quarantine_grace: billet_controlplane_stub::calls::QUARANTINE_GRACE,
        renewal_grace: billet_controlplane_stub::plane::RENEWAL_GRACE,
        scale_set_retry: billet_controlplane_stub::github::SCALE_SET_RETRY,
        registration_interval: billet_controlplane_stub::plane::REGISTRATION_INTERVAL,
        registration_grace: billet_controlplane_stub::plane::REGISTRATION_GRACE,
        node_ca,
        node_keepalive,
        warm: billet_controlplane_stub::plane::WarmConfig {
            count: args.warm,
            idle_retire: (args.warm_idle_secs > 0)
                .then(|| Duration::from_secs(args.warm_idle_secs)),
            max_age: (args.warm_max_age_secs > 0)
                .then(|| Duration::from_secs(args.warm_max_age_secs)),
        },
        jobs: billet_controlplane_stub::plane::JobsConfig {
            retention: Duration::from_secs(args.job_retention_hours * 3600),
            stuck_after: Duration::from_secs(args.stuck_after_secs),
        },
    };
    let metrics_listener = match args.metrics_listen {
        None => None,
        Some(addr) => match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => Some(l),
            Err(e) => {
                error!("--metrics-listen: cannot listen on {addr}: {e}");
                return ExitCode::from(4);
            }
        },
    };
    let shutdown = CancellationToken::new();
    let plane = match Plane::start(config, github, shutdown.clone()).await {
        Ok(p) => p,
        Err(e) => {
            error!("{e}");
            return ExitCode::from(1);
        }
    };
    if let Some(listener) = metrics_listener {
        plane.serve_metrics(listener, shutdown.clone());
    }
    if let Some(listener) = enroll_listener {
        plane.serve_enrollment(listener, shutdown.clone());
    }
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

/// Reads `--min-runner-version`: a version such as 2.331.0, or "" for none.
fn runner_version(text: &str) -> Result<String, String> {
    if text.trim().is_empty() {
        return Ok(String::new());
    }
    billet_proto::runner_version::RunnerVersion::parse(text).map(|v| v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The arguments every plane needs, and `extra`.
    fn parse(extra: &[&str]) -> Result<Args, clap::Error> {
        let base = [
            "billet-plane",
            "--ca",
            "ca.pem",
            "--cert",
            "plane.pem",
            "--key",
            "plane.key",
            "--node",
            "node-1=127.0.0.1:7443",
            "--emulator",
            "127.0.0.1:0",
        ];
        Args::try_parse_from(base.iter().chain(extra))
    }

    #[test]
    fn the_node_keepalive_is_20_s_and_20_s_unless_given() {
        let args = parse(&[]).unwrap();
        assert_eq!(args.node_keepalive(), Keepalive::default());
        assert_eq!(
            Keepalive::default(),
            Keepalive {
                interval: Duration::from_secs(20),
                timeout: Duration::from_secs(20)
            }
        );
        let args = parse(&[
            "--node-keepalive-secs",
            "2",
            "--node-keepalive-timeout-secs",
            "3",
        ])
        .unwrap();
        assert_eq!(
            args.node_keepalive(),
            Keepalive {
                interval: Duration::from_secs(2),
                timeout: Duration::from_secs(3)
            }
        );
    }

    #[test]
    fn a_node_keepalive_out_of_range_is_refused_naming_the_flag_and_the_range() {
        for (flag, value) in [
            ("--node-keepalive-secs", "0"),
            ("--node-keepalive-timeout-secs", "0"),
            ("--node-keepalive-secs", "3601"),
            ("--node-keepalive-timeout-secs", "soon"),
        ] {
            let err = parse(&[flag, value]).unwrap_err();
            assert_eq!(
                err.kind(),
                clap::error::ErrorKind::ValueValidation,
                "{flag} {value}"
            );
            let text = err.to_string();
            assert!(text.contains(flag) && text.contains(value), "{text}");
            if value != "soon" {
                assert!(text.contains("1..=3600"), "{text}");
            }
        }
    }
}
