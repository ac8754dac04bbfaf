//! Planes as processes on one PostgreSQL ledger: real `billet-plane`
//! processes, each with a scale set (tier) and nodes of its own, all
//! sharing one ledger database made for the test ([`ScratchPostgres`],
//! dropped afterwards) and one GitHub (the scale-set emulator, in this
//! process). Each node is a host on a fleet [`Network`] (`fleet.rs`),
//! dialed by its plane at its own address.
//!
//! A plane is a child process: [`PlaneProcess::kill`] is SIGKILL, a crash
//! with nothing written on the way out (no ledger write, no GitHub session
//! deleted), and [`PlaneProcess::start_again`] runs it again with the same
//! arguments. What a plane did is read from its log (it runs with
//! `BILLET_LOG=info`, without colour): which nodes it attached and which
//! leases its reaper reclaimed. The test's own handle on the ledger
//! ([`PlaneFleet::ledger`]) is a third client of the database, reading
//! only.

use std::collections::HashMap;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use billet_controlplane_stub::ledger::Ledger;
use billet_controlplane_stub::ledger::scratch::ScratchPostgres;
use bollard::Docker;
use scaleset::testing::Emulator;
use tokio::process::{Child, Command};

use crate::cluster::{
    ClusterOptions, HOST_PORT, NodeHost, NodeProcess, STANDIN_IMAGE, cluster_certs, node_args,
    scratch_dir, standin_image, wait_until,
};
use crate::fleet::{CapacityWatch, Network, watch_capacity};
use crate::image::{binary_path, connect_docker};

/// One plane of a [`PlaneFleet`]: its name, its tier (also its scale set's
/// name) and the nodes it dials.
#[derive(Debug, Clone)]
pub struct PlaneSpec {
    /// The plane's name in the test (its log is `<name>.log`).
    pub name: String,
    /// Its tier label and scale set.
    pub tier: String,
    /// The nodes it dials; each node belongs to one plane.
    pub nodes: Vec<String>,
}

/// One `billet-plane` process.
#[derive(Debug)]
pub struct PlaneProcess {
    /// What it was started as.
    pub spec: PlaneSpec,
    /// Its stderr and stdout, captured.
    pub log: PathBuf,
    args: Vec<String>,
    env: Vec<(String, String)>,
    child: Option<Child>,
}

impl PlaneProcess {
    async fn spawn(&mut self) -> Result<()> {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .with_context(|| format!("open {}", self.log.display()))?;
        let mut cmd = Command::new(binary_path("billet-plane")?);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .kill_on_drop(true);
        for (k, v) in &self.env {
            cmd.env(k, v);
        }
        self.child = Some(cmd.spawn().context("start billet-plane")?);
        Ok(())
    }

    /// Kills the plane with SIGKILL and waits for it to go: a crash, with
    /// nothing done on the way out.
    ///
    /// # Errors
    ///
    /// When it cannot be killed.
    pub async fn kill(&mut self) -> Result<()> {
        if let Some(mut child) = self.child.take() {
            child.kill().await.context("kill billet-plane")?;
        }
        Ok(())
    }

    /// Starts the plane again with the same arguments (after
    /// [`PlaneProcess::kill`]).
    ///
    /// # Errors
    ///
    /// When it cannot be started.
    pub async fn start_again(&mut self) -> Result<()> {
        self.kill().await?;
        self.spawn().await
    }

    /// Whether the process has exited, and how.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child
            .as_mut()
            .and_then(|c| c.try_wait().ok().flatten())
    }

    /// Everything it has logged so far, over all its runs.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// How many sessions with `node` it has opened, over all its runs (its
    /// log's `node attached` lines naming the node).
    pub fn attachments(&self, node: &str) -> usize {
        let needle = format!("node attached node={node} ");
        self.log_text().matches(&needle).count()
    }

    /// The leases its reaper quarantined, over all its runs, each as often
    /// as it was reported (its log's `reaped expired leases` lines).
    pub fn quarantined(&self) -> Vec<String> {
        reaped(&self.log_text(), "quarantined")
    }

    /// The leases its reaper reclaimed in any way (quarantined, or failed
    /// as unlaunched escrow), over all its runs, each as often as reported.
    pub fn reclaimed(&self) -> Vec<String> {
        let log = self.log_text();
        let mut all = reaped(&log, "quarantined");
        all.extend(reaped(&log, "failed"));
        all
    }
}

/// The lease ids listed under `list` (`quarantined` or `failed`) in every
/// `reaped expired leases` line of a plane's `log` (the `ReapReport` it
/// prints with `Debug`).
fn reaped(log: &str, list: &str) -> Vec<String> {
    let open = format!("{list}: [");
    log.lines()
        .filter(|l| l.contains("reaped expired leases"))
        .filter_map(|l| {
            let start = l.find(&open)? + open.len();
            let end = l[start..].find(']')? + start;
            Some(l[start..end].to_owned())
        })
        .flat_map(|ids| {
            ids.split(',')
                .map(|id| id.trim().trim_matches('"').to_owned())
                .filter(|id| !id.is_empty())
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Plane processes sharing one PostgreSQL ledger, each with its nodes on a
/// fleet network, and GitHub. Dropping it kills the planes and the nodes,
/// removes the deployment's containers and drops the database; the network
/// goes last.
#[derive(Debug)]
pub struct PlaneFleet {
    /// GitHub.
    pub emulator: Emulator,
    /// The planes, in the order they were given.
    pub planes: Vec<PlaneProcess>,
    /// The nodes, by name.
    pub nodes: HashMap<String, NodeProcess>,
    /// The test's own handle on the shared ledger.
    pub ledger: Arc<Ledger>,
    /// The Docker engine.
    pub docker: Docker,
    /// The deployment id (every plane's and node's).
    pub deployment: String,
    /// The scratch directory (certificates, logs, state).
    pub dir: PathBuf,
    database: Option<ScratchPostgres>,
    /// The nodes' network.
    pub network: Network,
}

impl PlaneFleet {
    /// Makes a ledger database, a network with a host per node of every
    /// plane in `planes`, the nodes (`options` says how: work time, vCPUs,
    /// lease TTL; its `nodes` are ignored) and the planes, and waits until
    /// every plane has attached all its nodes and made its scale set.
    ///
    /// # Errors
    ///
    /// When any part cannot start; the message says which (PostgreSQL not
    /// answering names `scripts/test`).
    pub async fn start(mut options: ClusterOptions, planes: Vec<PlaneSpec>) -> Result<PlaneFleet> {
        let docker = connect_docker().await?;
        let standin = standin_image(&docker).await?;
        let database = ScratchPostgres::create()
            .await
            .map_err(anyhow::Error::msg)?;
        let location = database.location().clone();
        let ledger = Arc::new(
            Ledger::connect(&location, options.lease_ttl)
                .await
                .context("connect to the test's ledger database")?,
        );
        options.nodes = planes.iter().flat_map(|p| p.nodes.clone()).collect();
        let network = Network::create(&options.nodes)?;
        options.hosts = network
            .hosts
            .values()
            .map(|h| {
                (
                    h.node.clone(),
                    NodeHost {
                        netns: h.netns.clone(),
                        addr: std::net::IpAddr::V4(h.addr),
                    },
                )
            })
            .collect();
        let dir = scratch_dir("billet-planes")?;
        let deployment = format!("dep{}", &uuid::Uuid::new_v4().simple().to_string()[..8]);
        let certs = cluster_certs(&dir, &options)?;
        let emulator = Emulator::builder()
            .long_poll(Duration::from_millis(300))
            .start()
            .await;
        let mut fleet = PlaneFleet {
            emulator,
            planes: Vec::new(),
            nodes: HashMap::new(),
            ledger,
            docker,
            deployment: deployment.clone(),
            dir: dir.clone(),
            database: Some(database),
            network,
        };
        for name in &options.nodes {
            let host = &options.hosts[name];
            let addr = std::net::SocketAddr::new(host.addr, HOST_PORT);
            let state_dir = dir.join(format!("state-{name}"));
            let args = node_args(&options, &certs, name, addr, &deployment, &state_dir)?;
            let mut env = vec![("BILLET_LOG".to_owned(), options.node_log.clone())];
            env.extend(options.node_env.iter().cloned());
            let process = NodeProcess::start(
                name,
                addr,
                dir.join(format!("{name}.log")),
                Some(host.netns.clone()),
                args,
                env,
            )
            .await?;
            fleet.nodes.insert(name.clone(), process);
        }
        let image = if options.tier_image == STANDIN_IMAGE {
            standin
        } else {
            options.tier_image.clone()
        };
        let url = postgres_url(&location)?;
        for spec in planes {
            let mut args = vec![
                "--ledger".to_owned(),
                url.clone(),
                "--deployment".into(),
                deployment.clone(),
                "--lease-ttl-secs".into(),
                options.lease_ttl.as_secs().max(1).to_string(),
                "--ca".into(),
                certs.ca.cert.display().to_string(),
                "--cert".into(),
                certs.plane.cert.display().to_string(),
                "--key".into(),
                certs.plane.key.display().to_string(),
                "--github-url".into(),
                fleet.emulator.config_url(),
                "--allow-http".into(),
                "--tier".into(),
                spec.tier.clone(),
                "--image".into(),
                image.clone(),
                "--command".into(),
                "/billet-standin-runner".into(),
                "--vcpu".into(),
                "1".into(),
                "--memory-bytes".into(),
                options.tier_memory_bytes.to_string(),
                "--network".into(),
                "host".into(),
                "--max-runners".into(),
                "20".into(),
                "--node-keepalive-secs".into(),
                options.node_keepalive.interval.as_secs().max(1).to_string(),
                "--node-keepalive-timeout-secs".into(),
                options.node_keepalive.timeout.as_secs().max(1).to_string(),
                "--env".into(),
                format!("BILLET_STANDIN_WORK_MS={}", options.work_ms),
                "--env".into(),
                "BILLET_STANDIN_IDLE_TIMEOUT_MS=120000".into(),
            ];
            for node in &spec.nodes {
                args.extend([
                    "--node".to_owned(),
                    format!("{node}={}", fleet.nodes[node].addr),
                ]);
            }
            let env = vec![
                ("BILLET_LOG".to_owned(), "info".to_owned()),
                (
                    "BILLET_GITHUB_PAT".to_owned(),
                    scaleset::testing::DEFAULT_PAT.to_owned(),
                ),
            ];
            let mut plane = PlaneProcess {
                log: dir.join(format!("{}.log", spec.name)),
                spec,
                args,
                env,
                child: None,
            };
            plane.spawn().await?;
            fleet.planes.push(plane);
        }
        for i in 0..fleet.planes.len() {
            fleet.wait_plane_ready(i, 0).await?;
        }
        Ok(fleet)
    }

    /// Waits until plane `i` has made its scale set and has attached each of
    /// its nodes more than `attached_before` times in all.
    ///
    /// # Errors
    ///
    /// When it does not within 60 s, or exits; its log is included.
    pub async fn wait_plane_ready(&mut self, i: usize, attached_before: usize) -> Result<()> {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        loop {
            let plane = &mut self.planes[i];
            if let Some(status) = plane.exited() {
                bail!(
                    "{} exited {status}; its log:\n{}",
                    plane.spec.name,
                    plane.log_text()
                );
            }
            let plane = &self.planes[i];
            let attached = plane
                .spec
                .nodes
                .iter()
                .all(|n| plane.attachments(n) > attached_before);
            if attached && self.scale_set(i).is_ok() {
                return Ok(());
            }
            if tokio::time::Instant::now() > deadline {
                bail!(
                    "{} did not attach {:?} within 60 s; its log:\n{}",
                    plane.spec.name,
                    plane.spec.nodes,
                    plane.log_text()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The scale set of plane `i`, as GitHub has it.
    ///
    /// # Errors
    ///
    /// When GitHub has none by its tier's name.
    pub fn scale_set(&self, i: usize) -> Result<scaleset::ScaleSetId> {
        let tier = &self.planes[i].spec.tier;
        self.emulator
            .state()
            .scale_sets
            .iter()
            .find(|s| &s.name == tier)
            .map(|s| s.id)
            .with_context(|| format!("GitHub has no scale set {tier}"))
    }

    /// Queues `n` jobs on plane `i`'s scale set.
    ///
    /// # Errors
    ///
    /// When it has no scale set.
    pub fn queue_jobs(&self, i: usize, n: usize) -> Result<Vec<scaleset::JobRequestId>> {
        let set = self.scale_set(i)?;
        let tier = self.planes[i].spec.tier.clone();
        Ok((0..n)
            .map(|_| self.emulator.queue_job(set, [tier.as_str()]))
            .collect())
    }

    /// Watches, until [`CapacityWatch::finish`], that no node of any plane
    /// is booked beyond `vcpu`, in the shared ledger or on its host.
    pub fn watch_capacity(&self, vcpu: u32) -> CapacityWatch {
        let ledger = Arc::clone(&self.ledger);
        watch_capacity(
            Arc::new(move |node: String| {
                let ledger = Arc::clone(&ledger);
                Box::pin(async move { ledger.charged_on(&node).await.ok() })
            }),
            self.docker.clone(),
            self.deployment.clone(),
            self.network.hosts.keys().cloned().collect(),
            vcpu,
        )
    }

    /// The names of this deployment's containers (any state).
    ///
    /// # Errors
    ///
    /// When Docker cannot be listed.
    pub async fn containers(&self) -> Result<Vec<String>> {
        crate::cluster::containers_of(&self.docker, &self.deployment, Vec::new()).await
    }

    /// Waits until every job in `jobs` is completed at GitHub.
    ///
    /// # Errors
    ///
    /// When `timeout` passes first.
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
                    .any(|j| j.id == *id && j.state == scaleset::testing::JobState::Completed)
            })
        })
        .await
    }

    /// Waits until no container of the deployment is left, the ledger
    /// charges nothing and GitHub holds no registration.
    ///
    /// # Errors
    ///
    /// When `timeout` passes first, with what is left.
    pub async fn wait_clean(&self, timeout: Duration) -> Result<()> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let containers = self.containers().await?;
            let charge = self.ledger.charged().await?;
            let runners = self.emulator.state().runners;
            if containers.is_empty()
                && charge == billet_controlplane_stub::ledger::Charge::default()
                && runners.is_empty()
            {
                return Ok(());
            }
            ensure!(
                tokio::time::Instant::now() < deadline,
                "not clean after {timeout:?}: containers {containers:?}, ledger charges {charge:?}, \
                 registrations {runners:?}; open leases {:?}",
                self.ledger.open_leases().await?
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// Kills the planes and the nodes, removes what is left and drops the
    /// database.
    ///
    /// # Errors
    ///
    /// When a process cannot be killed or the database dropped.
    pub async fn shutdown(mut self) -> Result<()> {
        for plane in &mut self.planes {
            plane.kill().await?;
        }
        for node in self.nodes.values_mut() {
            node.kill().await?;
        }
        self.ledger.close().await;
        if let Some(database) = self.database.take() {
            database.drop_database().await.map_err(anyhow::Error::msg)?;
        }
        Ok(())
    }
}

impl Drop for PlaneFleet {
    fn drop(&mut self) {
        // The children go with their handles (kill_on_drop); containers
        // and the database are removed here, also when a test failed.
        crate::cluster::remove_deployment_containers(&self.deployment);
        if let Some(database) = self.database.take() {
            // Drop may run inside the test's runtime: the drop runs on a
            // thread of its own with a runtime of its own.
            let _ = std::thread::spawn(move || {
                if let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    let _ = rt.block_on(database.drop_database());
                }
            })
            .join();
        }
    }
}

/// The URL a plane is given for the shared ledger.
fn postgres_url(location: &billet_controlplane_stub::ledger::LedgerLocation) -> Result<String> {
    match location {
        billet_controlplane_stub::ledger::LedgerLocation::Postgres(url) => Ok(url.clone()),
        other => bail!("the shared ledger is PostgreSQL, not {other}"),
    }
}

#[cfg(test)]
mod tests {
    use super::reaped;

    #[test]
    fn a_reap_report_in_the_log_yields_its_lease_ids() {
        let log = "2026-12-02T02:00:00Z  WARN billet_controlplane_stub::plane: reaped expired leases \
                   report=ReapReport { quarantined: [\"a1\", \"b2\"], failed: [\"c3\"] }\n\
                   2026-12-02T02:00:01Z  INFO other line quarantined: [\"zz\"]\n\
                   2026-12-02T02:00:02Z  WARN billet_controlplane_stub::plane: reaped expired leases \
                   report=ReapReport { quarantined: [], failed: [\"d4\"] }\n";
        assert_eq!(reaped(log, "quarantined"), ["a1", "b2"]);
        assert_eq!(reaped(log, "failed"), ["c3", "d4"]);
    }
}
