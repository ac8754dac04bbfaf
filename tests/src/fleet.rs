//! The fleet harness: nodes as hosts. A [`Cluster`] whose nodes each run in
//! a Linux network namespace of their own, joined to the root namespace by
//! a veth pair into a bridge there, on a private /24 (`10.77.<n>.0/24`, one
//! per fleet so fleets can run side by side): each node has its own
//! address (`10.77.<n>.<10+i>`), a certificate naming that address and its
//! name, its own state directory, and Docker through the host's socket
//! (the namespace isolates the network only, so runners still reach the
//! emulator on the host's loopback). The plane runs in this process, in
//! the root namespace, and dials each node at its address over mTLS.
//!
//! A partition drops a node's traffic in its namespace (`iptables -j DROP`
//! on its interface, both ways): packets vanish, nothing is refused. A
//! [`Network`] removes its namespaces and bridge when dropped, also when a
//! test fails; a fleet that cannot be built (no bridge or veth support, no
//! `ip`/`iptables`, not root) fails saying what is missing: it never falls
//! back to loopback.

use std::collections::{BTreeMap, HashMap};
use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use tokio_util::sync::CancellationToken;

use crate::cluster::{Cluster, ClusterOptions, NodeHost};

/// Where the per-subnet locks live: a fleet holds the lock of its /24 for
/// its lifetime, so two fleets (in this process or another) never share one.
const LOCK_DIR: &str = "/run/billet-fleet";

/// One node's host: its namespace, its interface and its address.
#[derive(Debug, Clone)]
pub struct Host {
    /// The node's name.
    pub node: String,
    /// The network namespace.
    pub netns: String,
    /// The veth end inside the namespace.
    pub interface: String,
    /// The node's address.
    pub addr: Ipv4Addr,
}

/// A private network of hosts: a bridge in the root namespace holding
/// `10.77.<subnet>.1/24` and one namespace per node. Dropping it deletes
/// them.
#[derive(Debug)]
pub struct Network {
    /// The third octet of the /24.
    pub subnet: u8,
    /// The bridge in the root namespace.
    pub bridge: String,
    /// The hosts, by node name.
    pub hosts: BTreeMap<String, Host>,
    /// Held for the network's lifetime (the /24 is this fleet's).
    _lock: std::fs::File,
}

/// Runs `program args`, failing with its stderr and `hint` (what is
/// missing when this fails).
fn run(program: &str, args: &[&str], hint: &str) -> Result<String> {
    let out = Command::new(program)
        .args(args)
        .output()
        .with_context(|| format!("cannot run {program} (is it installed? {hint})"))?;
    if !out.status.success() {
        bail!(
            "`{program} {}` failed ({}): {}; {hint}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `args` inside namespace `netns`.
fn run_in(netns: &str, args: &[&str], hint: &str) -> Result<String> {
    let mut all = vec!["netns", "exec", netns];
    all.extend_from_slice(args);
    run("ip", &all, hint)
}

impl Network {
    /// Makes the bridge and one namespace per name in `nodes`.
    ///
    /// # Errors
    ///
    /// When the kernel or the tools refuse any step; the message says
    /// which and what to provide.
    pub fn create(nodes: &[String]) -> Result<Network> {
        std::fs::create_dir_all(LOCK_DIR).with_context(|| format!("create {LOCK_DIR}"))?;
        let (subnet, lock) = Self::claim_subnet()?;
        let id = &uuid::Uuid::new_v4().simple().to_string()[..6];
        let mut network = Network {
            subnet,
            // Interface names are at most 15 bytes.
            bridge: format!("bfl{id}"),
            hosts: BTreeMap::new(),
            _lock: lock,
        };
        let bridge = network.bridge.clone();
        run(
            "ip",
            &["link", "add", "name", &bridge, "type", "bridge"],
            "the fleet harness needs the kernel's bridge support (modprobe bridge) and root",
        )?;
        let gateway = format!("10.77.{subnet}.1/24");
        run(
            "ip",
            &["addr", "add", &gateway, "dev", &bridge],
            "cannot address the bridge",
        )?;
        run(
            "ip",
            &["link", "set", &bridge, "up"],
            "cannot bring the bridge up",
        )?;
        for (i, node) in nodes.iter().enumerate() {
            let netns = format!("billet-{id}-{i}");
            let outside = format!("bfv{id}{i}");
            let inside = format!("bfn{id}{i}");
            let addr = Ipv4Addr::new(10, 77, subnet, 10 + u8::try_from(i)?);
            run(
                "ip",
                &["netns", "add", &netns],
                "the fleet harness needs network namespaces (`ip netns`) and root",
            )?;
            // Recorded before anything else can fail, so Drop removes it.
            network.hosts.insert(
                node.clone(),
                Host {
                    node: node.clone(),
                    netns: netns.clone(),
                    interface: inside.clone(),
                    addr,
                },
            );
            run(
                "ip",
                &[
                    "link", "add", &outside, "type", "veth", "peer", "name", &inside,
                ],
                "the fleet harness needs the kernel's veth support (modprobe veth)",
            )?;
            run(
                "ip",
                &["link", "set", &inside, "netns", &netns],
                "cannot move the veth into the namespace",
            )?;
            run(
                "ip",
                &["link", "set", &outside, "master", &bridge, "up"],
                "cannot attach the veth to the bridge",
            )?;
            let cidr = format!("{addr}/24");
            let hint = "cannot configure the namespace's interface";
            run_in(&netns, &["ip", "addr", "add", &cidr, "dev", &inside], hint)?;
            run_in(&netns, &["ip", "link", "set", &inside, "up"], hint)?;
            run_in(&netns, &["ip", "link", "set", "lo", "up"], hint)?;
            let via = format!("10.77.{subnet}.1");
            run_in(
                &netns,
                &["ip", "route", "add", "default", "via", &via],
                hint,
            )?;
        }
        // The plane must reach every node before a test starts: a TCP
        // probe answered (refused: nothing listens yet) proves the path.
        for host in network.hosts.values() {
            match std::net::TcpStream::connect_timeout(
                &std::net::SocketAddr::new(IpAddr::V4(host.addr), 9),
                Duration::from_secs(2),
            ) {
                Err(e) if e.kind() != std::io::ErrorKind::ConnectionRefused => {
                    bail!(
                        "the root namespace cannot reach {} in {} over the bridge ({e}): a firewall on bridged traffic?",
                        host.addr,
                        host.netns
                    )
                }
                _ => {}
            }
        }
        Ok(network)
    }

    /// Claims a free /24 under 10.77/16: the first whose lock this process
    /// gets, starting at a random one. Leftovers of a run that died holding
    /// it (a bridge addressed in it, its namespaces) are removed first.
    fn claim_subnet() -> Result<(u8, std::fs::File)> {
        let start = uuid::Uuid::new_v4().as_bytes()[0];
        for step in 0..=255u8 {
            let subnet = start.wrapping_add(step);
            if subnet == 0 || subnet == 255 {
                continue;
            }
            let path = format!("{LOCK_DIR}/10.77.{subnet}.lock");
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&path)
                .with_context(|| format!("open {path}"))?;
            if file.try_lock().is_err() {
                continue;
            }
            Self::remove_leftovers(subnet);
            return Ok((subnet, file));
        }
        bail!("every 10.77.x.0/24 is held by another fleet")
    }

    /// Deletes a bridge left addressed in `10.77.<subnet>.0/24` by a run
    /// that died, and the namespaces named after it.
    fn remove_leftovers(subnet: u8) {
        let Ok(text) = run("ip", &["-o", "-4", "addr", "show"], "") else {
            return;
        };
        let needle = format!("inet 10.77.{subnet}.1/24");
        for line in text.lines().filter(|l| l.contains(&needle)) {
            let Some(name) = line.split_whitespace().nth(1) else {
                continue;
            };
            let _ = run("ip", &["link", "del", name], "");
            if let Some(id) = name.strip_prefix("bfl") {
                let prefix = format!("billet-{id}-");
                if let Ok(list) = run("ip", &["netns", "list"], "") {
                    for ns in list.lines().filter_map(|l| l.split_whitespace().next()) {
                        if ns.starts_with(&prefix) {
                            let _ = run("ip", &["netns", "del", ns], "");
                        }
                    }
                }
            }
        }
    }

    /// The host of `node`.
    ///
    /// # Errors
    ///
    /// When it has none.
    pub fn host(&self, node: &str) -> Result<&Host> {
        self.hosts
            .get(node)
            .with_context(|| format!("no host for node {node}"))
    }

    /// Cuts `node` off: every packet in or out of its interface is dropped
    /// in its namespace (not refused: the other side sees silence).
    ///
    /// # Errors
    ///
    /// When iptables refuses.
    pub fn partition(&self, node: &str) -> Result<()> {
        let host = self.host(node)?;
        let hint = "the fleet harness drops traffic with iptables in the namespace";
        run_in(
            &host.netns,
            &[
                "iptables",
                "-w",
                "-I",
                "INPUT",
                "-i",
                &host.interface,
                "-j",
                "DROP",
            ],
            hint,
        )?;
        run_in(
            &host.netns,
            &[
                "iptables",
                "-w",
                "-I",
                "OUTPUT",
                "-o",
                &host.interface,
                "-j",
                "DROP",
            ],
            hint,
        )?;
        Ok(())
    }

    /// Heals a [`Network::partition`].
    ///
    /// # Errors
    ///
    /// When iptables refuses (no partition to heal included).
    pub fn heal(&self, node: &str) -> Result<()> {
        let host = self.host(node)?;
        let hint = "healing a partition the harness made";
        run_in(
            &host.netns,
            &[
                "iptables",
                "-w",
                "-D",
                "INPUT",
                "-i",
                &host.interface,
                "-j",
                "DROP",
            ],
            hint,
        )?;
        run_in(
            &host.netns,
            &[
                "iptables",
                "-w",
                "-D",
                "OUTPUT",
                "-o",
                &host.interface,
                "-j",
                "DROP",
            ],
            hint,
        )?;
        Ok(())
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting a namespace deletes the veth end in it, and with it the
        // pair; the bridge goes last.
        for host in self.hosts.values() {
            let _ = run("ip", &["netns", "del", &host.netns], "");
        }
        let _ = run("ip", &["link", "del", &self.bridge], "");
    }
}

/// A cluster whose nodes are hosts on a [`Network`]. The cluster is
/// declared first, so it (its node processes) goes before the network.
#[derive(Debug)]
pub struct Fleet {
    /// The plane, the nodes and GitHub.
    pub cluster: Cluster,
    /// The nodes' network.
    pub network: Network,
}

impl Fleet {
    /// Makes the network for `options.nodes` and starts the cluster with
    /// each node on its host.
    ///
    /// # Errors
    ///
    /// When the network or the cluster cannot be made.
    pub async fn start(mut options: ClusterOptions) -> Result<Fleet> {
        let network = Network::create(&options.nodes)?;
        options.hosts = network
            .hosts
            .values()
            .map(|h| {
                (
                    h.node.clone(),
                    NodeHost {
                        netns: h.netns.clone(),
                        addr: IpAddr::V4(h.addr),
                    },
                )
            })
            .collect();
        let cluster = Cluster::start(options).await?;
        Ok(Fleet { cluster, network })
    }

    /// Loses `node`'s host for good: the node is killed, its network cut
    /// and its runners' containers removed (the host is gone, and its
    /// compute with it); GitHub fails the jobs those runners were running,
    /// as it does for lost runners. Returns those jobs.
    ///
    /// # Errors
    ///
    /// When the node cannot be killed or cut off.
    pub async fn lose_host(&mut self, node: &str) -> Result<Vec<scaleset::JobRequestId>> {
        self.network.partition(node)?;
        self.cluster
            .nodes
            .get_mut(node)
            .with_context(|| format!("no node {node}"))?
            .kill()
            .await?;
        let names = self.containers_of(node).await?;
        for name in &names {
            let _ = self
                .cluster
                .docker
                .remove_container(
                    name,
                    Some(bollard::query_parameters::RemoveContainerOptions {
                        force: true,
                        v: true,
                        ..Default::default()
                    }),
                )
                .await;
        }
        let state = self.cluster.emulator.state();
        let failed: Vec<_> = state
            .runners
            .iter()
            .filter(|r| names.contains(&r.name))
            .filter_map(|r| r.job)
            .collect();
        for job in &failed {
            self.cluster.emulator.complete_job(*job, Some("failed"));
        }
        Ok(failed)
    }

    /// The names of `node`'s containers of this deployment (any state).
    ///
    /// # Errors
    ///
    /// When Docker cannot be listed.
    pub async fn containers_of(&self, node: &str) -> Result<Vec<String>> {
        self.cluster
            .containers_labelled(vec![format!("sh.billet.node={node}")])
            .await
    }

    /// Watches, every 200 ms until [`CapacityWatch::finish`], that no
    /// node is booked beyond `vcpu`: neither in the ledger (what it
    /// charges on the node) nor on the host (its running containers).
    pub fn watch_capacity(&self, vcpu: u32) -> CapacityWatch {
        let plane = Arc::clone(&self.cluster.plane);
        watch_capacity(
            Arc::new(move |node: String| {
                let plane = Arc::clone(&plane);
                Box::pin(async move { plane.ledger().charged_on(&node).await.ok() })
            }),
            self.cluster.docker.clone(),
            self.cluster.deployment.clone(),
            self.network.hosts.keys().cloned().collect(),
            vcpu,
        )
    }
}

/// What the ledger charges on a node (by name), `None` when it cannot say:
/// how [`watch_capacity`] reads whichever ledger the test has.
pub type ChargedOn = Arc<
    dyn Fn(
            String,
        )
            -> futures::future::BoxFuture<'static, Option<billet_controlplane_stub::ledger::Charge>>
        + Send
        + Sync,
>;

/// Watches, every 200 ms until [`CapacityWatch::finish`], that none of
/// `nodes` is booked beyond `vcpu`: neither in the ledger (`charged_on`)
/// nor on its host (its running containers of `deployment`).
pub fn watch_capacity(
    charged_on: ChargedOn,
    docker: bollard::Docker,
    deployment: String,
    nodes: Vec<String>,
    vcpu: u32,
) -> CapacityWatch {
    let stop = CancellationToken::new();
    let seen = Arc::new(Mutex::new(CapacitySeen::default()));
    let task = {
        let stop = stop.clone();
        let seen = Arc::clone(&seen);
        tokio::spawn(async move {
            while !stop.is_cancelled() {
                for node in &nodes {
                    let charged = charged_on(node.clone()).await;
                    let filters: HashMap<String, Vec<String>> = HashMap::from([
                        (
                            "label".to_owned(),
                            vec![
                                format!("sh.billet.deployment={deployment}"),
                                format!("sh.billet.node={node}"),
                            ],
                        ),
                        ("status".to_owned(), vec!["running".to_owned()]),
                    ]);
                    let running = docker
                        .list_containers(Some(bollard::query_parameters::ListContainersOptions {
                            filters: Some(filters),
                            ..Default::default()
                        }))
                        .await
                        .map(|l| l.len())
                        .ok();
                    let mut guard = seen.lock().expect("capacity");
                    let seen = &mut *guard;
                    let entry = seen.max.entry(node.clone()).or_default();
                    if let Some(c) = charged {
                        entry.0 = entry.0.max(c.vcpu);
                        if c.vcpu > u64::from(vcpu) {
                            seen.over.push(format!(
                                "the ledger charged {} vCPUs on {node} (capacity {vcpu})",
                                c.vcpu
                            ));
                        }
                    }
                    if let Some(n) = running {
                        entry.1 = entry.1.max(n);
                        if n > vcpu as usize {
                            seen.over.push(format!(
                                "{n} runners ran on {node} at once (capacity {vcpu})"
                            ));
                        }
                    }
                }
                tokio::select! {
                    () = stop.cancelled() => {}
                    () = tokio::time::sleep(Duration::from_millis(200)) => {}
                }
            }
        })
    };
    CapacityWatch { stop, seen, task }
}

/// What a [`CapacityWatch`] saw.
#[derive(Debug, Default, Clone)]
pub struct CapacitySeen {
    /// Per node, the most vCPUs the ledger charged and the most runners
    /// running at once.
    pub max: BTreeMap<String, (u64, usize)>,
    /// Every sample over capacity, described.
    pub over: Vec<String>,
}

/// The task [`Fleet::watch_capacity`] runs.
#[derive(Debug)]
pub struct CapacityWatch {
    stop: CancellationToken,
    seen: Arc<Mutex<CapacitySeen>>,
    task: tokio::task::JoinHandle<()>,
}

impl CapacityWatch {
    /// Stops watching and says what was seen.
    ///
    /// # Errors
    ///
    /// When the watch task panicked.
    pub async fn finish(self) -> Result<CapacitySeen> {
        self.stop.cancel();
        self.task.await.context("the capacity watch")?;
        Ok(self.seen.lock().expect("capacity").clone())
    }
}
