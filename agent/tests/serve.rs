//! `server::run` in process: the real node (TLS acceptor, session handler,
//! slot, executor, KeepAlive, drain) over a fake provider, with a plane
//! played by the test over real mTLS. What only the wiring in `server::run`
//! decides: the custody janitor (KeepAlive) starts with the node, renews for
//! the whole drain, and stops with the node; a command that reaches the slot
//! after the drain began gets drain semantics (spec/node.md 7.L.13, 7.L.14,
//! 7.L.26, 7.L.28).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use billet_agent::edge::server::{self, NodeConfig, Prepared};
use billet_agent::journal::MemoryJournal;
use billet_agent::provider::fake::{FakeProvider, Operation};
use billet_agent::provider::{Instance, InstanceState};
use billet_agent::tls::{NodeTls, ReloadPolicy, TlsPaths};
use billet_proto::v1 as pb;
use rcgen::{
    BasicConstraints, CertificateParams, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    KeyUsagePurpose,
};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

const NODE: &str = "node-1";
const PLANE: &str = "plane";
/// The lease whose instance an earlier process left running.
const HELD: &str = "l1";
const HELD_INSTANCE: &str = "billet-l1";
const HELD_REQUEST: i64 = 11;
/// The TTL the plane opens with: KeepAlive renews every third of it, at
/// its 500 ms wake.
const TTL: Duration = Duration::from_millis(900);

/// A fresh directory under the system temp dir, removed when dropped.
struct Scratch(PathBuf);

impl Scratch {
    fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("billet-serve-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        Self(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The PEM material the plane dials with.
struct PlaneCerts {
    ca: String,
    cert: String,
    key: String,
}

/// A CA, the node's certificate (written into `dir`) and the plane's.
fn certificates(dir: &Path) -> (TlsPaths, PlaneCerts) {
    let ca_key = KeyPair::generate().expect("CA key");
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![
        KeyUsagePurpose::KeyCertSign,
        KeyUsagePurpose::CrlSign,
        KeyUsagePurpose::DigitalSignature,
    ];
    let ca_pem = ca.self_signed(&ca_key).expect("CA").pem();
    let issuer = Issuer::new(ca, ca_key);
    let leaf = |name: &str| {
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::new(vec![name.to_owned()]).expect("params");
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let cert = params.signed_by(&key, &issuer).expect("leaf");
        (cert.pem(), key.serialize_pem())
    };
    let (node_cert, node_key) = leaf(NODE);
    let (plane_cert, plane_key) = leaf(PLANE);
    let paths = TlsPaths {
        cert: dir.join("node.pem"),
        key: dir.join("node.key"),
        ca: dir.join("ca.pem"),
    };
    std::fs::write(&paths.cert, node_cert).expect("write");
    std::fs::write(&paths.key, node_key).expect("write");
    std::fs::write(&paths.ca, &ca_pem).expect("write");
    (
        paths,
        PlaneCerts {
            ca: ca_pem,
            cert: plane_cert,
            key: plane_key,
        },
    )
}

/// The ledger as the test plane keeps it: open leases by id.
type Leases = Arc<Mutex<HashMap<String, pb::Lease>>>;

fn lease(id: &str, epoch: u64, phase: &str, request_id: i64) -> pb::Lease {
    pb::Lease {
        id: id.into(),
        epoch,
        tier: "linux".into(),
        phase: phase.into(),
        vcpu: 1,
        memory_bytes: 1 << 30,
        node: NODE.into(),
        request_id,
        providers: Vec::new(),
        failure_reason: String::new(),
        end_reason: 0,
        end_detail: String::new(),
    }
}

/// How the test plane answers: a ledger that agrees with the node.
fn answer(leases: &Leases, call: &pb::node_call::Call) -> pb::PlaneReply {
    use pb::node_call::Call;
    use pb::plane_reply::Result as R;
    let mut leases = leases.lock().expect("leases");
    let (result, error) = match call {
        Call::Launched(_) => (
            Some(R::Launched(pb::LaunchedSet {
                launched: leases.keys().cloned().collect(),
                quarantined: Vec::new(),
                leases: leases.values().cloned().collect(),
            })),
            None,
        ),
        Call::GetLease(g) => match leases.get(&g.lease_id) {
            Some(l) => (Some(R::Lease(l.clone())), None),
            None => (
                None,
                Some(pb::Error {
                    retry_after_ms: 0,
                    code: pb::ErrorCode::NotFound.into(),
                    message: format!("no lease {}", g.lease_id),
                }),
            ),
        },
        Call::Heartbeat(h) => (
            Some(R::Heartbeats(pb::HeartbeatResults {
                results: h
                    .leases
                    .iter()
                    .map(|l| pb::HeartbeatResult {
                        lease_id: l.lease_id.clone(),
                        error: None,
                    })
                    .collect(),
            })),
            None,
        ),
        Call::Release(r) => {
            leases.remove(&r.lease_id);
            (None, None)
        }
        Call::Reconcile(_) => (Some(R::Reconciled(pb::ReconcileResult { freed: 0 })), None),
        Call::MintJit(m) => (
            Some(R::Jit(pb::JitConfig {
                encoded_jit_config: "jit-config".into(),
                runner_id: 42,
                runner_name: m.runner_name.clone(),
            })),
            None,
        ),
        Call::Bind(_)
        | Call::Advance(_)
        | Call::BindAdvance(_)
        | Call::RemoveRunner(_)
        | Call::MarkFailure(_)
        | Call::Resize(_)
        | Call::RecordCacheObservation(_)
        | Call::ReserveWarm(_)
        | Call::ReleaseWarm(_) => (None, None),
        Call::WarmRooms(w) => (
            Some(R::WarmRooms(pb::WarmRoomsCharged {
                charged: w.names.clone(),
            })),
            None,
        ),
        Call::ActionsPolicy(_) => (
            Some(R::ActionsPolicy(pb::ActionsPolicyAnswer { allowed: true })),
            None,
        ),
        // This plane holds no CA.
        Call::RenewCertificate(_) => (
            None,
            Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::Unavailable.into(),
                message: "this test plane signs nothing".into(),
            }),
        ),
    };
    pb::PlaneReply {
        call_id: 0,
        error,
        result,
    }
}

/// The plane's side of one session: what it was asked, what it was told.
struct Plane {
    commands: mpsc::Sender<pb::PlaneMessage>,
    calls: Arc<Mutex<Vec<pb::node_call::Call>>>,
    results: mpsc::UnboundedReceiver<pb::CommandResult>,
    leases: Leases,
    /// Reads the node's stream; it ends when the node ends the session.
    reader: JoinHandle<()>,
}

impl Plane {
    /// Dials the node over mTLS, opens a session with [`TTL`] and answers
    /// its calls; every result is acknowledged `accepted`.
    async fn attach(addr: std::net::SocketAddr, certs: &PlaneCerts, leases: Leases) -> Self {
        let tls = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(&certs.ca))
            .identity(Identity::from_pem(&certs.cert, &certs.key))
            .domain_name(NODE);
        let channel = Endpoint::from_shared(format!("https://{addr}"))
            .expect("endpoint")
            .tls_config(tls)
            .expect("tls")
            .connect()
            .await
            .expect("the node accepts the plane");
        let (tx, rx) = mpsc::channel(64);
        tx.send(pb::PlaneMessage {
            body: Some(pb::plane_message::Body::Open(pb::Open {
                protocol_version: billet_proto::PROTOCOL_VERSION,
                deployment: "dev".into(),
                lease_ttl_ms: u64::try_from(TTL.as_millis()).expect("ttl"),
                plane_clock_unix_ms: 0,
            })),
        })
        .await
        .expect("open");
        let mut inbound = pb::node_client::NodeClient::new(channel)
            .attach(ReceiverStream::new(rx))
            .await
            .expect("attach")
            .into_inner();
        match inbound.message().await {
            Ok(Some(pb::NodeMessage {
                body: Some(pb::node_message::Body::Hello(hello)),
            })) => assert_eq!(hello.node_name, NODE),
            other => panic!("no Hello: {other:?}"),
        }
        let calls = Arc::new(Mutex::new(Vec::new()));
        let (results_tx, results) = mpsc::unbounded_channel();
        let (seen, replies, ledger) = (Arc::clone(&calls), tx.clone(), Arc::clone(&leases));
        let reader = tokio::spawn(async move {
            while let Ok(Some(pb::NodeMessage { body: Some(body) })) = inbound.message().await {
                let reply = match body {
                    pb::node_message::Body::Call(pb::NodeCall {
                        call_id,
                        call: Some(call),
                    }) => {
                        let mut reply = answer(&ledger, &call);
                        reply.call_id = call_id;
                        seen.lock().expect("calls").push(call);
                        pb::plane_message::Body::Reply(reply)
                    }
                    pb::node_message::Body::Result(result) => {
                        let ack = pb::ResultAck {
                            id: result.id.clone(),
                            verdict: pb::AckVerdict::Accepted.into(),
                        };
                        let _ = results_tx.send(result);
                        pb::plane_message::Body::ResultAck(ack)
                    }
                    _ => continue,
                };
                if replies
                    .send(pb::PlaneMessage { body: Some(reply) })
                    .await
                    .is_err()
                {
                    break;
                }
            }
        });
        Self {
            commands: tx,
            calls,
            results,
            leases,
            reader,
        }
    }

    /// Waits until the node has ended the session (its stream closed).
    async fn closed(&mut self) {
        // Our side stays open (`commands` lives on): only the node can end
        // the stream.
        tokio::time::timeout(Duration::from_secs(10), &mut self.reader)
            .await
            .expect("the node ended the session within 10s")
            .expect("the session reader");
    }

    async fn send(&self, id: &str, kind: pb::command::Kind) {
        let deadline_unix_ms = i64::try_from(
            (std::time::SystemTime::now() + Duration::from_secs(60))
                .duration_since(std::time::UNIX_EPOCH)
                .expect("clock")
                .as_millis(),
        )
        .expect("ms");
        self.commands
            .send(pb::PlaneMessage {
                body: Some(pb::plane_message::Body::Command(pb::Command {
                    id: id.into(),
                    deadline_unix_ms,
                    deadline_remaining_ms: Some(60_000),
                    kind: Some(kind),
                })),
            })
            .await
            .expect("the session is open");
    }

    async fn result(&mut self) -> pb::CommandResult {
        tokio::time::timeout(Duration::from_secs(10), self.results.recv())
            .await
            .expect("the node answered within 10s")
            .expect("the session is open")
    }

    fn calls(&self) -> Vec<pb::node_call::Call> {
        self.calls.lock().expect("calls").clone()
    }

    /// Renewals of `lease` so far.
    fn renewals(&self, lease: &str) -> usize {
        self.calls()
            .iter()
            .filter(|c| {
                matches!(c, pb::node_call::Call::Heartbeat(h)
                    if h.leases.iter().any(|l| l.lease_id == lease))
            })
            .count()
    }

    /// Waits until `lease` has been renewed `n` times in all.
    async fn renewed(&self, lease: &str, n: usize) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while self.renewals(lease) < n {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{lease} was renewed {} times, not {n}, within 10s",
                self.renewals(lease)
            )
        });
    }
}

/// A node serving in this process.
struct Node {
    provider: Arc<FakeProvider>,
    state_dir: PathBuf,
    addr: std::net::SocketAddr,
    plane: PlaneCerts,
    drain: CancellationToken,
    shutdown: CancellationToken,
    run: JoinHandle<Result<(), server::NodeError>>,
    _scratch: Scratch,
}

impl Node {
    /// Starts a node whose host still runs [`HELD_INSTANCE`], left by an
    /// earlier process: recovery adopts it into custody once a plane
    /// attaches, and the node holds it until it is gone.
    async fn start() -> Self {
        let scratch = Scratch::new();
        let (tls, plane) = certificates(&scratch.0);
        let state_dir = scratch.0.join("state");
        std::fs::create_dir_all(&state_dir).expect("state dir");
        let provider = Arc::new(FakeProvider::new());
        provider.insert_behind_back(Instance {
            id: "fake-0".into(),
            name: HELD_INSTANCE.into(),
            state: InstanceState::Running,
            labels: Default::default(),
        });
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let prepared = Prepared {
            tls: NodeTls::load(&tls).expect("node TLS"),
            provider: provider.clone(),
            journal: Arc::new(MemoryJournal::default()),
            cache: None,
            local: tokio::net::UnixListener::bind(state_dir.join("node.sock")).expect("local"),
            metrics: None,
            actions: None,
        };
        let config = NodeConfig {
            tls,
            plane_name: PLANE.into(),
            allow_readable_key: false,
            deployment: "dev".into(),
            cache_dir: state_dir.join("cache"),
            cache_eviction: billet_agent::cache::Eviction::default(),
            cache_evict_interval: billet_agent::cache::lifecycle::DEFAULT_EVICT_INTERVAL,
            state_dir,
            docker_socket: PathBuf::from("/nonexistent/docker.sock"),
            vcpu: 2,
            memory_bytes: 4 << 30,
            max_custody: None,
            stray_grace: Duration::from_secs(300),
            start_deadline: None,
            max_lease_life: None,
            post_job_grace: Duration::from_secs(120),
            isolated_containers: false,
            tier_failures_before_unhealthy: 3,
            guest_pids_limit: 4096,
            ack_timeout: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(60),
            tls_reload: ReloadPolicy::default(),
            upgrader: None,
            metrics_listen: None,
            min_free_disk_bytes: 0,
            spot_imds: None,
            registry_mirrors: Vec::new(),
            actions_proxy: billet_agent::edge::server::ActionsProxyConfig::default(),
        };
        let (drain, shutdown) = (CancellationToken::new(), CancellationToken::new());
        let run = tokio::spawn(server::run(
            config,
            prepared,
            listener,
            drain.clone(),
            shutdown.clone(),
        ));
        Self {
            provider,
            state_dir: scratch.0.join("state"),
            addr,
            plane,
            drain,
            shutdown,
            run,
            _scratch: scratch,
        }
    }

    /// A plane attaches; the ledger holds [`HELD`] open on this node.
    async fn attach(&self) -> Plane {
        let leases = Arc::new(Mutex::new(HashMap::from([(
            HELD.to_owned(),
            lease(HELD, 3, "online", HELD_REQUEST),
        )])));
        Plane::attach(self.addr, &self.plane, leases).await
    }

    /// Waits until the node says, on its local socket, that it is draining.
    async fn draining(&self) {
        tokio::time::timeout(Duration::from_secs(10), async {
            loop {
                if let Ok(seen) =
                    billet_agent::local::check(&self.state_dir, Duration::from_secs(2)).await
                    && seen.status.draining
                {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .expect("the node reported draining within 10s");
    }

    async fn stopped(self) -> Arc<FakeProvider> {
        let run = tokio::time::timeout(Duration::from_secs(10), self.run)
            .await
            .expect("the node stopped within 10s")
            .expect("the node's task");
        if let Err(e) = run {
            panic!("the node stopped with an error: {e}");
        }
        self.provider
    }
}

/// 7.L.13: the custody janitor starts with the node. Once a plane has
/// attached and recovery adopted the compute an earlier process left, the
/// lease is renewed on KeepAlive's own clock, with no command asking.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_custody_janitor_starts_with_the_node_and_renews_what_it_holds_unasked() {
    let node = Node::start().await;
    let plane = node.attach().await;
    // Recovery's own renewal of what it adopted...
    plane.renewed(HELD, 1).await;
    // ...and then the janitor's, every third of the TTL at its wake.
    plane.renewed(HELD, 4).await;
    assert!(
        plane.results.is_empty(),
        "a command was answered; none was sent"
    );
    assert_eq!(node.provider.count(Operation::Destroy), 0);
    assert!(plane.leases.lock().expect("leases").contains_key(HELD));
    node.shutdown.cancel();
    node.stopped().await;
}

/// 7.L.26: a drain does not stop the janitor. While the drain waits for
/// held compute to finish, the held lease keeps being renewed (the plane
/// would otherwise reap it under a running job); once the job has exited
/// and a tend released it, the drain ends and the node stops by itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_janitor_keeps_renewing_for_the_whole_drain() {
    let node = Node::start().await;
    let mut plane = node.attach().await;
    plane.renewed(HELD, 2).await;
    node.drain.cancel();
    node.draining().await;
    let at_drain = plane.renewals(HELD);
    // Three renewals after the drain began (several TTLs of draining, each
    // renewal due every third of one): the node renews throughout, and is
    // still running when the third arrives.
    plane.renewed(HELD, at_drain + 3).await;
    assert!(!node.run.is_finished(), "the drain ended while holding");
    assert!(!node.shutdown.is_cancelled());

    assert!(node.provider.exit(HELD_INSTANCE, 0, false), "the job exits");
    plane.send("t1", pb::command::Kind::Tend(pb::Tend {})).await;
    let tended = plane.result().await;
    assert_eq!(tended.outcome, pb::Outcome::Ok as i32, "{tended:?}");
    assert!(
        !plane.leases.lock().expect("leases").contains_key(HELD),
        "the lease was released"
    );
    node.stopped().await;
}

/// Health reads NOT_SERVING from the moment a drain begins, while the
/// node still holds compute and still answers: a probe or load balancer
/// sends it nothing new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_turns_not_serving_as_soon_as_a_drain_begins() {
    let node = Node::start().await;
    let plane = node.attach().await;
    plane.renewed(HELD, 1).await;
    let state_dir = node._scratch.0.join("state");
    let before = billet_agent::local::check(&state_dir, Duration::from_secs(5))
        .await
        .expect("the node answers");
    assert!(before.serving, "{before:?}");
    node.drain.cancel();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = billet_agent::local::check(&state_dir, Duration::from_secs(5))
            .await
            .expect("a draining node still answers");
        if !now.serving {
            assert!(now.status.draining, "{now:?}");
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "still SERVING 10 s into the drain"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(!node.run.is_finished(), "the drain ended while holding");
    drop(plane);
    node.shutdown.cancel();
    node.stopped().await;
}

/// 7.L.14: the janitor does not outlive the node. When the node stops,
/// every task it started has ended: nothing holds the runner (and so the
/// provider) any more.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_janitor_does_not_outlive_the_node() {
    let node = Node::start().await;
    let plane = node.attach().await;
    let mut plane = plane;
    plane.renewed(HELD, 3).await;
    assert!(
        Arc::strong_count(&node.provider) > 1,
        "the node holds its provider"
    );
    node.shutdown.cancel();
    let provider = node.stopped().await;
    tokio::time::timeout(Duration::from_secs(5), async {
        while Arc::strong_count(&provider) > 1 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("a task of the stopped node still holds the runner");
    let after = plane.renewals(HELD);
    // The session's end is the signal: once the node has closed its stream,
    // nothing it runs can reach this plane again.
    plane.closed().await;
    assert_eq!(
        plane.renewals(HELD),
        after,
        "renewed after the node stopped"
    );
}

/// 7.L.28: a command delivered before the drain began but reaching the
/// slot after it gets drain semantics: the launch is refused before it
/// binds anything, and the destroy behind it still runs and is reported.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_command_that_reaches_the_slot_after_the_drain_began_gets_drain_semantics() {
    let node = Node::start().await;
    let mut plane = node.attach().await;
    plane.renewed(HELD, 1).await;
    // A tend holds the slot (its read of the provider waits), so what is
    // delivered next waits in the queue while the drain begins.
    let lists = node.provider.count(Operation::List);
    node.provider.block(Operation::List);
    plane.send("t1", pb::command::Kind::Tend(pb::Tend {})).await;
    let mut launch = lease("l2", 1, "assigned", 12);
    launch.providers = vec!["docker".into()];
    plane
        .send(
            "c1",
            pb::command::Kind::Launch(pb::Launch {
                registration: None,
                lease: Some(launch),
                tier: Some(pb::TierSpec {
                    label: "linux".into(),
                    image: "billet-standin-runner:dev".into(),
                    command: vec!["/run".into()],
                    trust: "trusted".into(),
                    ..Default::default()
                }),
                job: Some(pb::Job {
                    request_id: 12,
                    ..Default::default()
                }),
                warm_instance: String::new(),
            }),
        )
        .await;
    plane
        .send(
            "c2",
            pb::command::Kind::Destroy(pb::Destroy {
                request_id: HELD_REQUEST,
                job_result: Some("succeeded".into()),
                // The held runner still runs in the fake: without force a
                // completion waits for it to exit (answered BUSY). What
                // this test asks is only that a destroy still runs during
                // the drain.
                force: true,
                reason: "drain test".into(),
            }),
        )
        .await;
    tokio::time::timeout(Duration::from_secs(10), async {
        while node.provider.count(Operation::List) == lists {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the tend reached the provider");
    node.drain.cancel();
    // The runner has started draining (the local socket says so) before
    // the tend lets the queued commands reach the slot.
    node.draining().await;
    node.provider.unblock(Operation::List);

    let tend = plane.result().await;
    assert_eq!(
        (tend.id.as_str(), tend.outcome),
        ("t1", pb::Outcome::Ok as i32)
    );
    let launched = plane.result().await;
    assert_eq!(launched.id, "c1");
    assert_eq!(
        launched.outcome,
        pb::Outcome::Refused as i32,
        "{launched:?}"
    );
    assert!(!launched.custody);
    let why = launched.error.expect("a reason");
    assert!(why.message.contains("draining"), "{}", why.message);
    let destroyed = plane.result().await;
    assert_eq!(destroyed.id, "c2");
    assert_eq!(destroyed.outcome, pb::Outcome::Ok as i32, "{destroyed:?}");

    let touched_l2 = plane.calls().iter().any(|c| match c {
        pb::node_call::Call::Bind(b) => b.lease_id == "l2",
        pb::node_call::Call::BindAdvance(b) => b.lease_id == "l2",
        pb::node_call::Call::MintJit(m) => m.lease_id == "l2",
        _ => false,
    });
    assert!(!touched_l2, "the refused launch reached the ledger");
    assert!(
        node.provider.specs().is_empty(),
        "the refused launch created"
    );
    assert!(node.provider.instance(HELD_INSTANCE).is_none());
    assert!(!plane.leases.lock().expect("leases").contains_key(HELD));
    // Nothing held any more: the drain ends and the node stops.
    node.stopped().await;
}

/// A plane that sends each message's bytes as it is given them, unchecked,
/// and reads the node's messages: it can send what no plane should.
#[derive(Debug, Clone, Copy, Default)]
struct RawCodec;

#[derive(Debug)]
struct RawEncoder;

#[derive(Debug)]
struct NodeDecoder;

impl tonic::codec::Encoder for RawEncoder {
    type Item = Vec<u8>;
    type Error = tonic::Status;

    fn encode(
        &mut self,
        item: Vec<u8>,
        dst: &mut tonic::codec::EncodeBuf<'_>,
    ) -> Result<(), tonic::Status> {
        prost::bytes::BufMut::put_slice(dst, &item);
        Ok(())
    }
}

impl tonic::codec::Decoder for NodeDecoder {
    type Item = pb::NodeMessage;
    type Error = tonic::Status;

    fn decode(
        &mut self,
        src: &mut tonic::codec::DecodeBuf<'_>,
    ) -> Result<Option<pb::NodeMessage>, tonic::Status> {
        prost::Message::decode(src)
            .map(Some)
            .map_err(|e| tonic::Status::internal(e.to_string()))
    }
}

impl tonic::codec::Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = pb::NodeMessage;
    type Encoder = RawEncoder;
    type Decoder = NodeDecoder;

    fn encoder(&mut self) -> RawEncoder {
        RawEncoder
    }

    fn decoder(&mut self) -> NodeDecoder {
        NodeDecoder
    }
}

/// What this process logs, for a test that reads it.
static LOGGED: Mutex<Vec<u8>> = Mutex::new(Vec::new());

struct LogWriter;

impl std::io::Write for LogWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        LOGGED.lock().expect("log").extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Opens a session as a plane, then sends `malformed` as one message's
/// bytes; answers the status the node ended the session with.
async fn attach_and_send(node: &Node, malformed: Vec<u8>) -> tonic::Status {
    let certs = &node.plane;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(&certs.ca))
        .identity(Identity::from_pem(&certs.cert, &certs.key))
        .domain_name(NODE);
    let channel = Endpoint::from_shared(format!("https://{}", node.addr))
        .expect("endpoint")
        .tls_config(tls)
        .expect("tls")
        .connect()
        .await
        .expect("the node accepts the plane");
    let open = prost::Message::encode_to_vec(&pb::PlaneMessage {
        body: Some(pb::plane_message::Body::Open(pb::Open {
            protocol_version: billet_proto::PROTOCOL_VERSION,
            deployment: "dev".into(),
            lease_ttl_ms: u64::try_from(TTL.as_millis()).expect("ttl"),
            plane_clock_unix_ms: 0,
        })),
    });
    let (tx, rx) = mpsc::channel::<Vec<u8>>(4);
    tx.send(open).await.expect("open");
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.expect("ready");
    let mut inbound = grpc
        .streaming(
            tonic::Request::new(ReceiverStream::new(rx)),
            tonic::codegen::http::uri::PathAndQuery::from_static("/billet.node.v1.Node/Attach"),
            RawCodec,
        )
        .await
        .expect("attach")
        .into_inner();
    match inbound.message().await {
        Ok(Some(pb::NodeMessage {
            body: Some(pb::node_message::Body::Hello(_)),
        })) => {}
        other => panic!("no Hello: {other:?}"),
    }
    tx.send(malformed).await.expect("send");
    tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match inbound.message().await {
                Ok(Some(_)) => {}
                Ok(None) => panic!("the session ended with OK"),
                Err(status) => return status,
            }
        }
    })
    .await
    .expect("the session ended within 10s")
}

/// A message the node cannot read (past the size limit, or nested past
/// what the decoder follows) ends the session with a status that says
/// what was wrong, never OK, and is logged once at warn with the peer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_the_node_cannot_read_ends_the_session_with_a_status_saying_what_was_wrong() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("warn"))
        .with_writer(|| LogWriter)
        .with_ansi(false)
        .try_init();
    let node = Node::start().await;
    // A field the message does not have (1000), as a group (wire type 3)
    // opened 100,000 times: each level is a recursion for the decoder.
    let nested: Vec<u8> = [0xC3u8, 0x3E].repeat(100_000);
    for (malformed, code, said) in [
        (
            vec![0u8; 5 << 20],
            tonic::Code::ResourceExhausted,
            "larger than the node reads",
        ),
        (nested, tonic::Code::InvalidArgument, "could not be decoded"),
    ] {
        let status = attach_and_send(&node, malformed).await;
        assert_eq!(status.code(), code, "{status:?}");
        assert!(status.message().contains(said), "{status:?}");
    }
    let logged = String::from_utf8_lossy(&LOGGED.lock().expect("log")).into_owned();
    let warned: Vec<&str> = logged
        .lines()
        .filter(|l| l.contains("a message from the plane could not be read"))
        .collect();
    assert_eq!(warned.len(), 2, "{logged}");
    for line in warned {
        assert!(line.contains("WARN"), "{line}");
        assert!(line.contains("peer=127.0.0.1:"), "{line}");
    }
    node.shutdown.cancel();
}
