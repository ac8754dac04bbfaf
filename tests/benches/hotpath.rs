//! Hot paths: what the node itself costs next to the work it manages, and how that cost grows
//! as the host fills.
//!
//! One `billet node` process (release build) on real Docker, attached over real mTLS to the stub
//! plane in this process; every figure is printed beside a baseline this run measures itself:
//!
//! 1. **Command round trip and pipelined throughput.** `Tend` with nothing held, sent through the
//!    plane's [`NodeLink::dispatch`], one at a time (median, p90) and with 64 in flight
//!    (commands per second). Baselines: a bare tonic service written here, served over the same
//!    kind of mTLS (tonic's rustls, the node's own certificate and CA): a unary call, a bidi
//!    stream answering one message at a time, and the same stream with 64 in flight.
//! 2. **RSS** of the node process: idle after start-up, after 100,000 no-op commands
//!    (`BILLET_BENCH_NOOPS`), and with N leases held (in the table of 3).
//! 3. **Recovery, Tend and KeepAlive over N** = 0, 50, 200 (`BILLET_BENCH_N`) surviving
//!    containers. For each N: N launches through the node (the stand-in runner in
//!    `never-connect` mode, so each container runs until stopped), then the node is killed
//!    (SIGKILL) and started again. Recovery is timed from the new process's `Hello` at the
//!    plane to the answer of the first command (`Instances`, which waits for recovery and lists
//!    the provider once); its baseline is one Docker list of the node's containers, one bare
//!    unary round trip, and one more Docker list (the `Instances` list), timed here in the same
//!    run. Plane calls, Docker calls and journal writes during recovery are read from the new
//!    process's `/metrics` (`--metrics-listen`). Then, with the N adopted leases in custody,
//!    one `Tend` (three times; the median time, the calls of the last) and one KeepAlive tick
//!    (waited for: KeepAlive renews every third of the lease TTL) are costed the same way, and
//!    the node's command-duration histogram gives the time the Tend held the slot. Everything
//!    is destroyed through the node, released and deregistered before the next N.
//!
//! ```text
//! cargo bench -p billet-tests --bench hotpath
//! BILLET_BENCH_N=0,50 BILLET_BENCH_NOOPS=20000 cargo bench -p billet-tests --bench hotpath
//! ```
//!
//! Run without `--bench` (as `cargo test --benches` does), it makes one small unmeasured pass
//! (N = 0 and 2, a few hundred commands) as a smoke test. It needs a running Docker engine.

use std::collections::{BTreeMap, HashMap};
use std::pin::Pin;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context as _, Result, bail, ensure};
use billet_controlplane_stub::calls::lease_to_wire;
use billet_controlplane_stub::ledger::{Lease, NewLease, Phase};
use billet_controlplane_stub::node_link::{NodeLink, NodeTarget, PlaneTls, dial};
use billet_controlplane_stub::now_ms;
use billet_proto::v1 as pb;
use billet_tests::bench::{MetricsReading, Samples, rss_bytes};
use billet_tests::cluster::{Cluster, ClusterOptions, STANDIN_IMAGE, TIER, free_port};
use billet_tests::image::{STANDIN_ENTRYPOINT, connect_docker, profile_dir};
use bollard::Docker;
use bollard::query_parameters::ListContainersOptions;
use futures::{Stream, StreamExt as _};
use tokio::sync::{Semaphore, mpsc};
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status, Streaming};

/// The one node.
const NODE: &str = "node-1";
/// Commands in flight for the pipelined figures.
const DEPTH: usize = 64;
/// The bound of every command sent to the node.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(60);
/// The plane's lease TTL: KeepAlive renews every third of it.
const LEASE_TTL: Duration = Duration::from_secs(30);
/// Memory per bench container.
const MEMORY_BYTES: u64 = 64 << 20;
/// The stand-in runs until stopped, and never talks to the emulator.
const RUNNER_ENV: [&str; 1] = ["BILLET_STANDIN_MODE=never-connect"];
/// Request ids of the bench's leases start here.
const FIRST_REQUEST_ID: i64 = 800_000;

/// How much to measure.
#[derive(Debug, Clone)]
struct Config {
    /// Sequential round trips per figure.
    round_trips: usize,
    /// Commands for the pipelined figures.
    pipelined: usize,
    /// No-op commands before the second RSS reading.
    noops: usize,
    /// The N of the recovery/tend table.
    ns: Vec<usize>,
    measuring: bool,
}

fn main() -> ExitCode {
    let measuring = std::env::args().any(|a| a == "--bench");
    let config = match config(measuring) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("hotpath bench: {e:#}");
            return ExitCode::from(2);
        }
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("error")),
        )
        .with_writer(std::io::stderr)
        .with_target(false)
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("hotpath bench: cannot start the async runtime: {e}");
            return ExitCode::from(2);
        }
    };
    match runtime.block_on(run(config)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hotpath bench: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn config(measuring: bool) -> Result<Config> {
    if !measuring {
        return Ok(Config {
            round_trips: 50,
            pipelined: 300,
            noops: 300,
            ns: vec![0, 2],
            measuring,
        });
    }
    let count = |var: &str, default: usize| -> Result<usize> {
        match std::env::var(var) {
            Ok(t) => t
                .trim()
                .parse()
                .with_context(|| format!("{var}={t:?} is not a count")),
            Err(std::env::VarError::NotPresent) => Ok(default),
            Err(e) => Err(e).with_context(|| format!("read {var}")),
        }
    };
    let ns = match std::env::var("BILLET_BENCH_N") {
        Ok(t) => t
            .split(',')
            .map(|n| {
                n.trim()
                    .parse()
                    .with_context(|| format!("BILLET_BENCH_N={t:?}: {n:?} is not a count"))
            })
            .collect::<Result<Vec<usize>>>()?,
        Err(_) => vec![0, 50, 200],
    };
    Ok(Config {
        round_trips: count("BILLET_BENCH_ROUND_TRIPS", 2000)?.max(1),
        pipelined: count("BILLET_BENCH_PIPELINED", 20_000)?.max(DEPTH),
        noops: count("BILLET_BENCH_NOOPS", 100_000)?,
        ns,
        measuring,
    })
}

/// The bare service the baselines call: `Node.Attach` answers every command at once with an OK
/// result, `Local.Status` answers an empty status. Nothing else.
#[derive(Debug, Clone, Copy)]
struct Echo;

type EchoStream = Pin<Box<dyn Stream<Item = Result<pb::NodeMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::node_server::Node for Echo {
    type AttachStream = EchoStream;

    async fn attach(
        &self,
        request: Request<Streaming<pb::PlaneMessage>>,
    ) -> Result<Response<EchoStream>, Status> {
        let answers = request.into_inner().filter_map(|m| async move {
            match m {
                Ok(pb::PlaneMessage {
                    body: Some(pb::plane_message::Body::Command(c)),
                }) => Some(Ok(pb::NodeMessage {
                    body: Some(pb::node_message::Body::Result(pb::CommandResult {
                        id: c.id,
                        outcome: pb::Outcome::Ok.into(),
                        ..Default::default()
                    })),
                })),
                Ok(_) => None,
                Err(s) => Some(Err(s)),
            }
        });
        Ok(Response::new(Box::pin(answers)))
    }
}

#[tonic::async_trait]
impl pb::local_server::Local for Echo {
    async fn status(
        &self,
        _: Request<pb::StatusRequest>,
    ) -> Result<Response<pb::LocalStatus>, Status> {
        Ok(Response::new(pb::LocalStatus::default()))
    }

    async fn enroll(
        &self,
        _: Request<pb::EnrollRequest>,
    ) -> Result<Response<pb::EnrollResult>, Status> {
        Err(Status::unimplemented("the echo service enrols nothing"))
    }
}

/// The echo service, served over mTLS with the node's own certificate, and a channel to it
/// dialed as the plane dials a node.
struct EchoServer {
    channel: tonic::transport::Channel,
    stop: CancellationToken,
}

impl EchoServer {
    async fn start(cluster: &Cluster) -> Result<Self> {
        let read =
            |p: &std::path::Path| std::fs::read(p).with_context(|| format!("read {}", p.display()));
        let node = cluster.certs.node(NODE).context("node certificate")?;
        let tls = ServerTlsConfig::new()
            .identity(Identity::from_pem(read(&node.cert)?, read(&node.key)?))
            .client_ca_root(Certificate::from_pem(read(&cluster.certs.ca.cert)?));
        let addr = free_port()?;
        let stop = CancellationToken::new();
        let server = Server::builder()
            .tls_config(tls)
            .context("the echo service's TLS")?
            .tcp_nodelay(true)
            .add_service(pb::node_server::NodeServer::new(Echo))
            .add_service(pb::local_server::LocalServer::new(Echo))
            .serve_with_shutdown(addr, stop.clone().cancelled_owned());
        tokio::spawn(server);
        let plane = PlaneTls {
            ca_pem: read(&cluster.certs.ca.cert)?,
            cert_pem: read(&cluster.certs.plane.cert)?,
            key_pem: read(&cluster.certs.plane.key)?,
        };
        let target = NodeTarget {
            name: NODE.into(),
            addr,
        };
        let since = Instant::now();
        let channel = loop {
            match dial(&target, &plane).await {
                Ok(c) => break c,
                Err(e) if since.elapsed() < Duration::from_secs(10) => {
                    tracing::debug!(error = %e, "the echo service is not up yet");
                    tokio::task::yield_now().await;
                }
                Err(e) => return Err(e).context("dial the echo service"),
            }
        };
        Ok(Self { channel, stop })
    }

    /// `n` unary calls, one at a time.
    async fn unary(&self, n: usize) -> Result<Samples> {
        let mut client = pb::local_client::LocalClient::new(self.channel.clone());
        let mut samples = Samples::default();
        for _ in 0..n {
            let started = Instant::now();
            client.status(pb::StatusRequest {}).await?;
            samples.push(started.elapsed());
        }
        Ok(samples)
    }

    /// `n` messages on one bidi stream, each sent when the last is answered.
    async fn ping_pong(&self, n: usize) -> Result<Samples> {
        let (tx, rx) = mpsc::channel(DEPTH);
        let mut client = pb::node_client::NodeClient::new(self.channel.clone());
        let mut inbound = client.attach(ReceiverStream::new(rx)).await?.into_inner();
        let mut samples = Samples::default();
        for i in 0..n {
            let started = Instant::now();
            tx.send(command(i)).await?;
            inbound.message().await?.context("the echo stream ended")?;
            samples.push(started.elapsed());
        }
        Ok(samples)
    }

    /// `n` messages on one bidi stream with [`DEPTH`] in flight; messages per second.
    async fn pipelined(&self, n: usize) -> Result<f64> {
        let (tx, rx) = mpsc::channel(DEPTH);
        let mut client = pb::node_client::NodeClient::new(self.channel.clone());
        let mut inbound = client.attach(ReceiverStream::new(rx)).await?.into_inner();
        let window = Arc::new(Semaphore::new(DEPTH));
        let started = Instant::now();
        let sender = tokio::spawn({
            let window = Arc::clone(&window);
            async move {
                for i in 0..n {
                    window.acquire().await?.forget();
                    tx.send(command(i)).await?;
                }
                anyhow::Ok(())
            }
        });
        for _ in 0..n {
            inbound.message().await?.context("the echo stream ended")?;
            window.add_permits(1);
        }
        let took = started.elapsed();
        sender.await??;
        Ok(rate(n, took))
    }
}

fn command(i: usize) -> pb::PlaneMessage {
    pb::PlaneMessage {
        body: Some(pb::plane_message::Body::Command(pb::Command {
            id: format!("{i:032x}"),
            deadline_unix_ms: now_ms() + 60_000,
            deadline_remaining_ms: Some(60_000),
            kind: Some(pb::command::Kind::Tend(pb::Tend {})),
        })),
    }
}

#[allow(clippy::cast_precision_loss)]
fn rate(n: usize, took: Duration) -> f64 {
    n as f64 / took.as_secs_f64()
}

#[allow(clippy::cast_precision_loss)]
fn mib(bytes: u64) -> f64 {
    bytes as f64 / f64::from(1 << 20)
}

/// One row of the recovery/tend table.
#[derive(Debug, Default)]
struct Row {
    n: usize,
    recovery: Duration,
    recovery_baseline: Duration,
    recovery_plane: BTreeMap<String, f64>,
    recovery_docker: BTreeMap<String, f64>,
    recovery_journal: BTreeMap<String, f64>,
    tend: Duration,
    tend_slot: Duration,
    tend_plane: BTreeMap<String, f64>,
    tend_docker: BTreeMap<String, f64>,
    tend_journal: BTreeMap<String, f64>,
    keepalive_plane: BTreeMap<String, f64>,
    keepalive_plane_ms: f64,
    keepalive_docker: BTreeMap<String, f64>,
    keepalive_journal: BTreeMap<String, f64>,
    rss_bytes: u64,
}

struct Bench {
    cluster: Cluster,
    docker: Docker,
    echo: EchoServer,
    metrics: std::net::SocketAddr,
    next_request_id: i64,
    renewing: Arc<std::sync::Mutex<Vec<Lease>>>,
}

async fn run(config: Config) -> Result<()> {
    let docker = connect_docker().await?;
    println!(
        "hotpath bench: starting the cluster; `billet` and `billet-standin-runner` are built in {} \
         first if stale",
        profile_dir().display()
    );
    let metrics = free_port()?;
    let cluster = Cluster::start(ClusterOptions {
        nodes: vec![NODE.to_owned()],
        node_log: "warn".into(),
        lease_ttl: LEASE_TTL,
        // The bench sends every command itself.
        maintenance_interval: Duration::from_secs(24 * 3600),
        registration_interval: Duration::from_secs(24 * 3600),
        node_env: vec![("BILLET_METRICS_LISTEN".into(), metrics.to_string())],
        ..ClusterOptions::default()
    })
    .await
    .context("start the cluster")?;
    let echo = EchoServer::start(&cluster).await?;
    let dir = cluster.dir.clone();
    let mut bench = Bench {
        cluster,
        docker,
        echo,
        metrics,
        next_request_id: FIRST_REQUEST_ID,
        renewing: Arc::default(),
    };
    let stop = CancellationToken::new();
    let renewer = tokio::spawn(renew(
        bench.cluster.plane.clone(),
        Arc::clone(&bench.renewing),
        stop.clone(),
    ));
    let measured = tokio::select! {
        m = bench.measure(&config) => Some(m),
        _ = tokio::signal::ctrl_c() => None,
    };
    stop.cancel();
    let _ = renewer.await;
    let leftovers = bench.clean_up().await;
    bench.echo.stop.cancel();
    bench
        .cluster
        .shutdown()
        .await
        .context("shut the cluster down")?;
    let _ = std::fs::remove_dir_all(&dir);
    let Some(measured) = measured else {
        bail!("interrupted; everything was cleaned up");
    };
    measured?;
    let leftovers = leftovers?;
    ensure!(
        leftovers.is_empty(),
        "left behind after the bench: {}",
        leftovers.join("; ")
    );
    if !config.measuring {
        println!(
            "hotpath bench: one small pass ran and was cleaned up (run with `cargo bench` to measure)"
        );
    }
    Ok(())
}

/// Renews the bench's running leases as a plane renews the leases it manages (the stub plane
/// manages only what it placed itself), until `stop`.
async fn renew(
    plane: Arc<billet_controlplane_stub::plane::Plane>,
    leases: Arc<std::sync::Mutex<Vec<Lease>>>,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            () = stop.cancelled() => return,
            () = tokio::time::sleep(LEASE_TTL / 6) => {}
        }
        let leases = leases.lock().expect("renewing").clone();
        for lease in leases {
            let _ = plane
                .ledger()
                .heartbeat(&lease.id, lease.epoch, NODE, now_ms())
                .await;
        }
    }
}

impl Bench {
    fn node(&self) -> Result<Arc<NodeLink>> {
        self.cluster
            .plane
            .node(NODE)
            .cloned()
            .context("the plane has no link to the node")
    }

    fn pid(&self) -> Result<u32> {
        self.cluster
            .nodes
            .get(NODE)
            .and_then(billet_tests::cluster::NodeProcess::pid)
            .context("the node is not running")
    }

    async fn measure(&mut self, config: &Config) -> Result<()> {
        // Warm both paths (TLS sessions, the first list, allocator pools).
        self.round_trips(config.round_trips.min(100)).await?;
        self.echo.unary(config.round_trips.min(100)).await?;
        let rss_idle = rss_bytes(self.pid()?)?;

        let unary = self.echo.unary(config.round_trips).await?;
        let ping_pong = self.echo.ping_pong(config.round_trips).await?;
        let tend = self.round_trips(config.round_trips).await?;
        let bidi_rate = self.echo.pipelined(config.pipelined).await?;
        let node_rate = self.pipelined(config.pipelined).await?;

        let noops_since = Instant::now();
        if config.noops > 0 {
            self.pipelined(config.noops).await?;
        }
        let noops_took = noops_since.elapsed();
        let rss_noops = rss_bytes(self.pid()?)?;

        let mut rows = Vec::new();
        for &n in &config.ns {
            rows.push(self.row(n).await.with_context(|| format!("N = {n}"))?);
        }
        if !config.measuring {
            return Ok(());
        }

        println!();
        println!(
            "command round trip, {} one at a time after a warm-up; node: `billet node` (release) over mTLS; baseline: a bare tonic service over the same mTLS",
            config.round_trips
        );
        println!("  {:<58} {:>9} {:>9} {:>9}", "µs", "median", "p90", "min");
        for (label, s) in [
            (
                "(a) Tend, nothing held: plane dispatch -> node result",
                &tend,
            ),
            ("(b) bare tonic unary call", &unary),
            ("(c) bare bidi stream, one message at a time", &ping_pong),
        ] {
            println!(
                "  {label:<58} {:>9.0} {:>9.0} {:>9.0}",
                s.median_ms() * 1000.0,
                s.percentile_ms(90.0) * 1000.0,
                s.min_ms() * 1000.0
            );
        }
        println!(
            "  ratio (a)/(b) of medians: {:.2}   (a)/(c): {:.2}   (goal: (a)/(b) <= 1.3)",
            tend.median_ms() / unary.median_ms(),
            tend.median_ms() / ping_pong.median_ms()
        );
        println!();
        println!(
            "pipelined, {DEPTH} in flight, {} commands each",
            config.pipelined
        );
        println!("  (a) Tend through the node:   {node_rate:>10.0} commands/s");
        println!("  (b) bare bidi stream:        {bidi_rate:>10.0} messages/s");
        println!(
            "  ratio (a)/(b): {:.3}   (goal: (a) >= 20,000/s)",
            node_rate / bidi_rate
        );
        println!();
        println!("node RSS");
        println!(
            "  idle after start-up:                     {:>8.1} MiB",
            mib(rss_idle)
        );
        println!(
            "  after {} more no-op commands ({:.1}s): {:>8.1} MiB",
            config.noops,
            noops_took.as_secs_f64(),
            mib(rss_noops)
        );
        for row in &rows {
            println!(
                "  with {:>3} leases held (after recovery): {:>8.1} MiB",
                row.n,
                mib(row.rss_bytes)
            );
        }
        print_rows(&rows);
        Ok(())
    }

    /// `n` Tends, one at a time.
    async fn round_trips(&self, n: usize) -> Result<Samples> {
        let node = self.node()?;
        let mut samples = Samples::default();
        for _ in 0..n {
            let started = Instant::now();
            let outcome = node
                .dispatch(pb::command::Kind::Tend(pb::Tend {}), COMMAND_TIMEOUT)
                .await;
            samples.push(started.elapsed());
            ensure!(outcome.is_ok(), "a Tend failed: {}", outcome.describe());
        }
        Ok(samples)
    }

    /// `n` Tends from [`DEPTH`] concurrent callers; commands per second.
    async fn pipelined(&self, n: usize) -> Result<f64> {
        let node = self.node()?;
        let left = Arc::new(AtomicUsize::new(n));
        let started = Instant::now();
        let mut callers = tokio::task::JoinSet::new();
        for _ in 0..DEPTH {
            let (node, left) = (Arc::clone(&node), Arc::clone(&left));
            callers.spawn(async move {
                while left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |l| l.checked_sub(1))
                    .is_ok()
                {
                    let outcome = node
                        .dispatch(pb::command::Kind::Tend(pb::Tend {}), COMMAND_TIMEOUT)
                        .await;
                    ensure!(outcome.is_ok(), "a Tend failed: {}", outcome.describe());
                }
                anyhow::Ok(())
            });
        }
        while let Some(done) = callers.join_next().await {
            done??;
        }
        Ok(rate(n, started.elapsed()))
    }

    async fn read_metrics(&self) -> Result<MetricsReading> {
        MetricsReading::read(self.metrics).await
    }

    /// One row of the table: N launched, the node restarted, recovery, Tend and KeepAlive
    /// costed, everything torn down.
    async fn row(&mut self, n: usize) -> Result<Row> {
        let mut leases = Vec::with_capacity(n);
        for _ in 0..n {
            leases.push(self.launch().await?);
        }
        *self.renewing.lock().expect("renewing") = leases.clone();

        // Restart: kill the node and start it again; its leases and containers survive.
        let node = self.node()?;
        let old = node
            .status()
            .borrow()
            .as_ref()
            .map(|s| s.hello.incarnation.clone());
        self.cluster
            .nodes
            .get_mut(NODE)
            .context("no node")?
            .restart()
            .await?;
        let mut status = node.status();
        let hello = tokio::time::timeout(
            Duration::from_secs(60),
            status.wait_for(|s| {
                s.as_ref()
                    .is_some_and(|s| Some(&s.hello.incarnation) != old.as_ref())
            }),
        )
        .await
        .context("the restarted node did not attach within 60s")?
        .context("the plane stopped")?
        .clone();
        let attached = Instant::now();
        let hello = hello.context("attached")?.hello;
        ensure!(
            hello.instances.len() == n,
            "the restarted node reports {} instances, not {n}",
            hello.instances.len()
        );
        let outcome = node
            .dispatch(
                pb::command::Kind::Instances(pb::Instances {}),
                COMMAND_TIMEOUT,
            )
            .await;
        let recovery = attached.elapsed();
        ensure!(
            outcome.is_ok(),
            "Instances after recovery: {}",
            outcome.describe()
        );
        let after_recovery = self.read_metrics().await?;
        let rss = rss_bytes(self.pid()?)?;

        let mut baselines = Samples::default();
        for _ in 0..5 {
            let started = Instant::now();
            self.list_node_containers().await?;
            self.echo.unary(1).await?;
            self.list_node_containers().await?;
            baselines.push(started.elapsed());
        }

        let mut tends = Samples::default();
        let mut slot = Samples::default();
        let mut tend_delta = MetricsReading::default();
        for _ in 0..3 {
            let before = self.read_metrics().await?;
            let started = Instant::now();
            let outcome = node
                .dispatch(pb::command::Kind::Tend(pb::Tend {}), COMMAND_TIMEOUT)
                .await;
            tends.push(started.elapsed());
            ensure!(
                outcome.is_ok(),
                "Tend with {n} held: {}",
                outcome.describe()
            );
            tend_delta = self.read_metrics().await?.since(&before);
            slot.push(Duration::from_secs_f64(
                tend_delta.sum("billet_command_duration_seconds_sum", &[("kind", "tend")]),
            ));
        }

        let keepalive = if n == 0 {
            MetricsReading::default()
        } else {
            let before = self.read_metrics().await?;
            let heartbeats = |m: &MetricsReading| {
                m.sum(
                    "billet_plane_call_duration_seconds_count",
                    &[("call", "heartbeat")],
                )
            };
            let since = Instant::now();
            loop {
                let now = self.read_metrics().await?;
                if heartbeats(&now) > heartbeats(&before) {
                    break now.since(&before);
                }
                ensure!(
                    since.elapsed() < LEASE_TTL,
                    "no KeepAlive renewal within {LEASE_TTL:?}"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        };

        let row = Row {
            n,
            recovery,
            recovery_baseline: Duration::from_secs_f64(baselines.median_ms() / 1000.0),
            recovery_plane: counts(&after_recovery, "billet_plane_call_duration_seconds_count"),
            recovery_docker: counts(
                &after_recovery,
                "billet_provider_call_duration_seconds_count",
            ),
            recovery_journal: counts(
                &after_recovery,
                "billet_journal_write_duration_seconds_count",
            ),
            tend: Duration::from_secs_f64(tends.median_ms() / 1000.0),
            tend_slot: Duration::from_secs_f64(slot.median_ms() / 1000.0),
            tend_plane: counts(&tend_delta, "billet_plane_call_duration_seconds_count"),
            tend_docker: counts(&tend_delta, "billet_provider_call_duration_seconds_count"),
            tend_journal: counts(&tend_delta, "billet_journal_write_duration_seconds_count"),
            keepalive_plane: counts(&keepalive, "billet_plane_call_duration_seconds_count"),
            keepalive_plane_ms: keepalive.sum("billet_plane_call_duration_seconds_sum", &[])
                * 1000.0,
            keepalive_docker: counts(&keepalive, "billet_provider_call_duration_seconds_count"),
            keepalive_journal: counts(&keepalive, "billet_journal_write_duration_seconds_count"),
            rss_bytes: rss,
        };

        self.renewing.lock().expect("renewing").clear();
        for lease in &leases {
            self.tear_down(lease).await?;
        }
        Ok(row)
    }

    /// The node's containers, as its provider lists them (one call).
    async fn list_node_containers(&self) -> Result<usize> {
        let filters = HashMap::from([(
            "label".to_owned(),
            vec![
                format!("sh.billet.deployment={}", self.cluster.deployment),
                format!("sh.billet.node={NODE}"),
            ],
        )]);
        Ok(self
            .docker
            .list_containers(Some(ListContainersOptions {
                all: true,
                filters: Some(filters),
                ..Default::default()
            }))
            .await
            .context("list containers")?
            .len())
    }

    /// Reserves a lease and launches it through the node; the container runs until stopped.
    async fn launch(&mut self) -> Result<Lease> {
        self.next_request_id += 1;
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let lease = self
            .cluster
            .plane
            .ledger()
            .reserve(
                NewLease {
                    id: id.clone(),
                    tier: TIER.into(),
                    request_id: self.next_request_id,
                    vcpu: 1,
                    memory_bytes: MEMORY_BYTES,
                    runner_name: Some(format!("billet-{id}")),
                },
                now_ms(),
            )
            .await
            .context("reserve a lease")?;
        let command = pb::command::Kind::Launch(pb::Launch {
            registration: None,
            lease: Some(lease_to_wire(&lease)),
            tier: Some(pb::TierSpec {
                label: TIER.into(),
                image: STANDIN_IMAGE.into(),
                command: vec![STANDIN_ENTRYPOINT.into()],
                trust: "trusted".into(),
                network: "host".into(),
                env: RUNNER_ENV.iter().map(|e| (*e).to_owned()).collect(),
                ..Default::default()
            }),
            job: Some(pb::Job {
                request_id: lease.request_id,
                ..Default::default()
            }),
            warm_instance: String::new(),
        });
        let outcome = self.node()?.dispatch(command, COMMAND_TIMEOUT).await;
        ensure!(
            outcome.is_ok(),
            "the launch of lease {id} did not succeed: {}",
            outcome.describe()
        );
        let lease = self
            .cluster
            .plane
            .ledger()
            .get(&id)
            .await?
            .context("the launched lease vanished")?;
        Ok(lease)
    }

    /// Destroys the lease's instance through the node, releases the lease and removes its
    /// runner registration.
    async fn tear_down(&self, lease: &Lease) -> Result<()> {
        let destroy = pb::command::Kind::Destroy(pb::Destroy {
            request_id: lease.request_id,
            job_result: None,
            force: true,
            reason: "bench teardown".into(),
        });
        let outcome = self.node()?.dispatch(destroy, COMMAND_TIMEOUT).await;
        ensure!(
            outcome.is_ok() || outcome.is_custody(),
            "the destroy of lease {} did not succeed: {}",
            lease.id,
            outcome.describe()
        );
        let ledger = self.cluster.plane.ledger();
        if let Some(current) = ledger.get(&lease.id).await?
            && !current.phase.is_terminal()
            && !outcome.is_custody()
        {
            ledger
                .release(&lease.id, current.epoch, None, Phase::Done, now_ms())
                .await
                .with_context(|| format!("release lease {}", lease.id))?;
        }
        let name = format!("billet-{}", lease.id);
        for runner in self
            .cluster
            .emulator
            .state()
            .runners
            .into_iter()
            .filter(|r| r.name == name)
        {
            self.cluster
                .emulator
                .client()
                .remove_runner(runner.id)
                .await
                .with_context(|| format!("remove the runner registration {name}"))?;
        }
        Ok(())
    }

    /// Removes whatever the bench left and says what it found.
    async fn clean_up(&self) -> Result<Vec<String>> {
        let mut found = Vec::new();
        for name in self.cluster.containers().await? {
            found.push(format!("instance {name}"));
        }
        self.cluster.remove_containers().await;
        let open: Vec<Lease> = self
            .cluster
            .plane
            .ledger()
            .leases()
            .await?
            .into_iter()
            .filter(|l| !l.phase.is_terminal())
            .collect();
        for lease in open {
            found.push(format!("open lease {} ({})", lease.id, lease.phase));
            let _ = self
                .cluster
                .plane
                .ledger()
                .release(&lease.id, lease.epoch, None, Phase::Failed, now_ms())
                .await;
        }
        for runner in self.cluster.emulator.state().runners {
            found.push(format!("runner registration {}", runner.name));
            let _ = self
                .cluster
                .emulator
                .client()
                .remove_runner(runner.id)
                .await;
        }
        Ok(found)
    }
}

/// Per-label counts of one histogram family's `_count` samples.
fn counts(m: &MetricsReading, name: &str) -> BTreeMap<String, f64> {
    m.by_label(name, "call")
        .into_iter()
        .filter(|(_, v)| *v > 0.0)
        .collect()
}

/// `heartbeat 1, get_lease 50` (total first).
fn calls(c: &BTreeMap<String, f64>) -> String {
    let total: f64 = c.values().sum();
    if c.is_empty() {
        return "0".into();
    }
    let parts: Vec<String> = c.iter().map(|(k, v)| format!("{k} {v}")).collect();
    format!("{total} ({})", parts.join(", "))
}

fn print_rows(rows: &[Row]) {
    println!();
    println!(
        "recovery with N surviving containers (real Docker, the stand-in runner): the restarted node's Hello at the plane -> its first command (Instances) answered; \
         baseline: Docker list + bare unary round trip + Docker list, timed in this run"
    );
    println!(
        "  {:>4} {:>11} {:>11} {:>7}  plane calls / Docker calls / journal writes",
        "N", "recovery ms", "baseline ms", "ratio"
    );
    for r in rows {
        println!(
            "  {:>4} {:>11.1} {:>11.1} {:>7.2}  {} / {} / {}",
            r.n,
            r.recovery.as_secs_f64() * 1000.0,
            r.recovery_baseline.as_secs_f64() * 1000.0,
            r.recovery.as_secs_f64() / r.recovery_baseline.as_secs_f64(),
            calls(&r.recovery_plane),
            calls(&r.recovery_docker),
            calls(&r.recovery_journal),
        );
    }
    println!();
    println!(
        "Tend with N leases in custody (one command; time is the median of 3, calls those of the last; slot = the node's own command duration)"
    );
    println!(
        "  {:>4} {:>9} {:>9}  plane calls / Docker calls / journal writes",
        "N", "tend ms", "slot ms"
    );
    for r in rows {
        println!(
            "  {:>4} {:>9.2} {:>9.2}  {} / {} / {}",
            r.n,
            r.tend.as_secs_f64() * 1000.0,
            r.tend_slot.as_secs_f64() * 1000.0,
            calls(&r.tend_plane),
            calls(&r.tend_docker),
            calls(&r.tend_journal),
        );
    }
    println!();
    println!(
        "KeepAlive tick with N leases in custody (every third of the {}s lease TTL, on its own task)",
        LEASE_TTL.as_secs()
    );
    println!(
        "  {:>4} {:>14}  plane calls / Docker calls / journal writes",
        "N", "plane time ms"
    );
    for r in rows {
        println!(
            "  {:>4} {:>14.2}  {} / {} / {}",
            r.n,
            r.keepalive_plane_ms,
            calls(&r.keepalive_plane),
            calls(&r.keepalive_docker),
            calls(&r.keepalive_journal),
        );
    }
}
