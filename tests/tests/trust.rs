//! Trust boxes end to end: what a tier's guests may ask of the host, and
//! what every guest is denied, with the real `billet node`, the stub plane
//! and real Docker.
//!
//! The node runs with `--isolated-containers` (as the operator of a node
//! whose containers are isolated by other means says), so an untrusted tier
//! is launched at all; what it may ask for is then the node's to refuse.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_controlplane_stub::calls::lease_to_wire;
use billet_controlplane_stub::ledger::Phase;
use billet_controlplane_stub::node_link::CommandOutcome;
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, STANDIN_IMAGE, TIER};
use bollard::Docker;
use bollard::query_parameters::LogsOptionsBuilder;
use futures::StreamExt as _;

fn untrusted_node() -> ClusterOptions {
    ClusterOptions {
        node_env: vec![("BILLET_ISOLATED_CONTAINERS".into(), "true".into())],
        ..ClusterOptions::default()
    }
}

fn launch(
    lease: &billet_controlplane_stub::ledger::Lease,
    tier: pb::TierSpec,
) -> pb::command::Kind {
    pb::command::Kind::Launch(pb::Launch {
        registration: None,
        lease: Some(lease_to_wire(lease)),
        tier: Some(tier),
        job: Some(pb::Job {
            request_id: lease.request_id,
            ..Default::default()
        }),
        warm_instance: String::new(),
    })
}

fn untrusted_tier() -> pb::TierSpec {
    pb::TierSpec {
        label: TIER.into(),
        image: STANDIN_IMAGE.into(),
        command: vec!["/billet-standin-runner".into()],
        trust: "untrusted".into(),
        env: vec!["BILLET_STANDIN_MODE=never-connect".into()],
        ..Default::default()
    }
}

/// Sends a launch of `tier` on a fresh lease and checks it was refused
/// `INVALID_ARGUMENT` naming `field`, with nothing minted, started or bound.
async fn refused_naming(
    cluster: &Cluster,
    lease_id: &str,
    request_id: i64,
    tier: pb::TierSpec,
    field: &str,
) -> Result<()> {
    let lease = cluster.reserve(lease_id, request_id).await?;
    let node = cluster.plane.node("node-1").expect("node");
    let outcome = node
        .dispatch(launch(&lease, tier), Duration::from_secs(30))
        .await;
    let CommandOutcome::Answered(result) = &outcome else {
        panic!("{field}: expected an answer, got {outcome:?}");
    };
    let containers = cluster.containers().await?;
    assert_eq!(
        result.outcome,
        pb::Outcome::InvalidArgument as i32,
        "{field}: an untrusted tier asking for it was not refused: {result:?}; containers {containers:?}"
    );
    let message = &result.error.as_ref().expect("error").message;
    assert!(message.contains(field), "{field}: {message}");
    assert!(containers.is_empty(), "{field}: started {containers:?}");
    assert!(
        cluster.emulator.state().runners.is_empty(),
        "{field}: a runner was minted"
    );
    let after = cluster.plane.ledger().get(lease_id).await?.expect("lease");
    assert_eq!(
        after.phase,
        Phase::Assigned,
        "{field}: the lease was touched"
    );
    Ok(())
}

/// An untrusted tier on the host's network would share loopback with the
/// node's metrics, cache proxy and gRPC listeners.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_tier_asking_for_the_host_network_is_refused_naming_the_field_before_anything_is_minted()
-> Result<()> {
    let cluster = Cluster::start(untrusted_node()).await?;
    let outcome = refused_naming(
        &cluster,
        "hostnet1",
        515_151,
        pb::TierSpec {
            network: "host".into(),
            ..untrusted_tier()
        },
        "launch.tier.network",
    )
    .await;
    cluster.remove_containers().await;
    outcome.context("network host")?;
    cluster.shutdown().await
}

/// Every other part of the host, one launch each.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_untrusted_tier_asking_for_any_part_of_the_host_is_refused_naming_it() -> Result<()> {
    let cluster = Cluster::start(untrusted_node()).await?;
    let asks: Vec<(&str, pb::HostAccess)> = vec![
        (
            "launch.tier.host.pid",
            pb::HostAccess {
                pid: true,
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.ipc",
            pb::HostAccess {
                ipc: true,
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.uts",
            pb::HostAccess {
                uts: true,
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.privileged",
            pb::HostAccess {
                privileged: true,
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.devices",
            pb::HostAccess {
                devices: vec!["/dev/fuse".into()],
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.capabilities",
            pb::HostAccess {
                capabilities: vec!["CAP_SYS_ADMIN".into()],
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.new_privileges",
            pb::HostAccess {
                new_privileges: true,
                ..Default::default()
            },
        ),
        (
            "launch.tier.host.mounts",
            pb::HostAccess {
                mounts: vec![pb::HostMount {
                    source: "/var/run/docker.sock".into(),
                    target: "/var/run/docker.sock".into(),
                    read_only: false,
                }],
                ..Default::default()
            },
        ),
    ];
    let outcome = async {
        for (n, (field, host)) in asks.into_iter().enumerate() {
            let tier = pb::TierSpec {
                host: Some(host),
                ..untrusted_tier()
            };
            let request = 616_000 + i64::try_from(n)?;
            refused_naming(&cluster, &format!("hostask{n}"), request, tier, field)
                .await
                .with_context(|| field.to_owned())?;
        }
        anyhow::Ok(())
    }
    .await;
    cluster.remove_containers().await;
    outcome?;
    cluster.shutdown().await
}

/// The container's stdout and stderr so far.
async fn logs(docker: &Docker, name: &str) -> String {
    let options = LogsOptionsBuilder::default()
        .stdout(true)
        .stderr(true)
        .build();
    let mut stream = docker.logs(name, Some(options));
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(output) => text.push_str(&output.to_string()),
            Err(e) => {
                text.push_str(&format!("<cannot read the logs: {e}>"));
                break;
            }
        }
    }
    text
}

/// Launches a trusted runner of `tier` that never takes a job, and answers
/// its container's inspection and what it says it may do.
async fn launched(
    cluster: &Cluster,
    lease_id: &str,
    request_id: i64,
    tier: pb::TierSpec,
) -> Result<(bollard::models::HostConfig, String)> {
    let lease = cluster.reserve(lease_id, request_id).await?;
    let node = cluster.plane.node("node-1").expect("node");
    let outcome = node
        .dispatch(launch(&lease, tier), Duration::from_secs(60))
        .await;
    let CommandOutcome::Answered(result) = &outcome else {
        bail!("expected an answer, got {outcome:?}");
    };
    anyhow::ensure!(
        result.outcome == pb::Outcome::Ok as i32,
        "the launch failed: {result:?}"
    );
    let container = format!("billet-{lease_id}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let line = loop {
        let text = logs(&cluster.docker, &container).await;
        if let Some(line) = text
            .lines()
            .find_map(|l| l.split_once("confinement: ").map(|(_, r)| r.to_owned()))
        {
            break line;
        }
        if tokio::time::Instant::now() >= deadline {
            bail!("{container} never said what it may do; its log:\n{text}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let inspect = cluster
        .docker
        .inspect_container(&container, None)
        .await
        .with_context(|| format!("inspect {container}"))?;
    Ok((inspect.host_config.context("no host config")?, line))
}

fn trusted_tier() -> pb::TierSpec {
    pb::TierSpec {
        trust: "trusted".into(),
        network: "host".into(),
        ..untrusted_tier()
    }
}

/// Every guest runs without `NET_RAW` (so no raw socket, no spoofed
/// packets), with `no-new-privileges` and a pids limit, under the engine's
/// seccomp profile and masked paths; a tier's pids limit only tightens
/// the node's, and a trusted tier may add a capability back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_guest_runs_without_net_raw_with_no_new_privileges_and_a_pids_limit_under_the_engines_seccomp_profile()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let outcome = async {
        let (host, said) = launched(&cluster, "hard1", 717_001, trusted_tier()).await?;
        assert!(said.starts_with("raw socket refused"), "{said}");
        assert!(said.contains("no_new_privs 1"), "{said}");
        assert!(said.contains("pids.max 4096"), "{said}");
        assert_eq!(host.cap_drop, Some(vec!["ALL".to_owned()]));
        let added = host.cap_add.clone().unwrap_or_default();
        for dropped in ["NET_RAW", "MKNOD", "AUDIT_WRITE", "SETFCAP", "SYS_ADMIN"] {
            assert!(
                !added
                    .iter()
                    .any(|c| c.trim_start_matches("CAP_") == dropped),
                "{dropped} in {added:?}"
            );
        }
        assert_eq!(host.pids_limit, Some(4096));
        let security = host.security_opt.clone().unwrap_or_default();
        assert!(
            security.iter().any(|o| o.starts_with("no-new-privileges")),
            "{security:?}"
        );
        assert!(
            !security.iter().any(|o| o.contains("unconfined")),
            "{security:?}"
        );
        assert!(
            host.masked_paths
                .as_ref()
                .is_some_and(|m| m.iter().any(|p| p == "/proc/kcore")),
            "the engine's masked paths are gone: {:?}",
            host.masked_paths
        );
        assert_ne!(host.privileged, Some(true));

        // A tier asks for fewer processes, and for more than the node allows.
        let (host, said) = launched(
            &cluster,
            "hard2",
            717_002,
            pb::TierSpec {
                pids_limit: 256,
                ..trusted_tier()
            },
        )
        .await?;
        assert_eq!(host.pids_limit, Some(256));
        assert!(said.contains("pids.max 256"), "{said}");
        let (host, _) = launched(
            &cluster,
            "hard3",
            717_003,
            pb::TierSpec {
                pids_limit: 1_000_000,
                ..trusted_tier()
            },
        )
        .await?;
        assert_eq!(host.pids_limit, Some(4096));

        // A trusted tier may widen it: NET_RAW back.
        let (_, said) = launched(
            &cluster,
            "hard4",
            717_004,
            pb::TierSpec {
                host: Some(pb::HostAccess {
                    capabilities: vec!["NET_RAW".into()],
                    ..Default::default()
                }),
                ..trusted_tier()
            },
        )
        .await?;
        assert!(said.starts_with("raw socket opened"), "{said}");
        anyhow::Ok(())
    }
    .await;
    cluster.remove_containers().await;
    outcome?;
    cluster.shutdown().await
}
