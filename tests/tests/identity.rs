//! mTLS both ways: only a plane with a certificate from the deployment CA can
//! attach to a node, and the plane only accepts the node it meant to dial.

use std::time::Duration;

use anyhow::Result;
use billet_controlplane_stub::node_link::{NodeTarget, PlaneTls, dial};
use billet_proto::v1 as pb;
use billet_tests::cluster::{Cluster, ClusterOptions, scratch_dir};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint};

fn plane_tls(certs: &billet_certs_dev::DevCerts) -> Result<PlaneTls> {
    Ok(PlaneTls {
        ca_pem: std::fs::read(&certs.ca.cert)?,
        cert_pem: std::fs::read(&certs.plane.cert)?,
        key_pem: std::fs::read(&certs.plane.key)?,
    })
}

/// Tries a whole session: dial, then Open, then wait for Hello.
async fn attach(channel: tonic::transport::Channel) -> Result<pb::Hello, String> {
    open_session(channel, billet_proto::PROTOCOL_VERSION, "").await
}

async fn open_session(
    channel: tonic::transport::Channel,
    protocol_version: u32,
    deployment: &str,
) -> Result<pb::Hello, String> {
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::PlaneMessage {
        body: Some(pb::plane_message::Body::Open(pb::Open {
            protocol_version,
            deployment: deployment.to_owned(),
            lease_ttl_ms: 15_000,
            plane_clock_unix_ms: 0,
        })),
    })
    .await
    .map_err(|e| e.to_string())?;
    let mut client = pb::node_client::NodeClient::new(channel);
    let mut inbound = client
        .attach(tokio_stream_wrapper(rx))
        .await
        .map_err(|s| s.to_string())?
        .into_inner();
    match inbound.message().await {
        Ok(Some(pb::NodeMessage {
            body: Some(pb::node_message::Body::Hello(h)),
        })) => Ok(h),
        other => Err(format!("{other:?}")),
    }
}

fn tokio_stream_wrapper(
    rx: tokio::sync::mpsc::Receiver<pb::PlaneMessage>,
) -> impl futures::Stream<Item = pb::PlaneMessage> {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|m| (m, rx)) })
}

async fn refused_in_log(cluster: &Cluster, before: usize) -> bool {
    let node = &cluster.nodes["node-1"];
    for _ in 0..50 {
        if node.log_text()[before..].contains("refused a connection") {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plane_certificate_from_another_ca_cannot_attach() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = &cluster.nodes["node-1"];
    let before = node.log_text().len();
    let other = billet_certs_dev::generate(&scratch_dir("other-ca")?, "plane", &["node-1"])?;
    // Trusts the node's real CA, but presents a certificate the node's CA never issued.
    let mut tls = plane_tls(&other)?;
    tls.ca_pem = std::fs::read(&cluster.certs.ca.cert)?;
    let target = NodeTarget {
        name: "node-1".into(),
        addr: node.addr,
    };
    let attempt = match dial(&target, &tls).await {
        Ok(channel) => attach(channel).await.map(|_| ()),
        Err(e) => Err(e.to_string()),
    };
    assert!(attempt.is_err(), "a foreign plane certificate attached");
    assert!(
        refused_in_log(&cluster, before).await,
        "the node logged no refusal:\n{}",
        node.log_text()
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plane_without_a_client_certificate_cannot_attach() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = &cluster.nodes["node-1"];
    let before = node.log_text().len();
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(
            &cluster.certs.ca.cert,
        )?))
        .domain_name("node-1");
    let attempt = match Endpoint::from_shared(format!("https://{}", node.addr))?
        .tls_config(tls)?
        .connect()
        .await
    {
        Ok(channel) => attach(channel).await.map(|_| ()),
        Err(e) => Err(e.to_string()),
    };
    assert!(attempt.is_err(), "a plane without a certificate attached");
    assert!(
        refused_in_log(&cluster, before).await,
        "the node logged no refusal"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plaintext_is_refused() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = &cluster.nodes["node-1"];
    let before = node.log_text().len();
    let attempt = match Endpoint::from_shared(format!("http://{}", node.addr))?
        .connect_timeout(Duration::from_secs(5))
        .timeout(Duration::from_secs(5))
        .connect()
        .await
    {
        Ok(channel) => attach(channel).await.map(|_| ()),
        Err(e) => Err(e.to_string()),
    };
    assert!(attempt.is_err(), "a plaintext session attached");
    assert!(
        refused_in_log(&cluster, before).await,
        "the node logged no refusal"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_plane_refuses_a_node_whose_certificate_names_another_node() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let node = &cluster.nodes["node-1"];
    // The plane means to dial node-2, but node-1 answers at that address.
    let target = NodeTarget {
        name: "node-2".into(),
        addr: node.addr,
    };
    let error = dial(&target, &plane_tls(&cluster.certs)?)
        .await
        .expect_err("the plane accepted a node whose certificate names another node");
    let text = error.to_string();
    assert!(text.contains("node-2"), "{text}");
    assert!(
        text.to_lowercase().contains("certificate"),
        "the error should say the certificate is wrong: {text}"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_genuine_plane_attaches_and_the_node_names_itself_from_its_certificate() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let status = cluster.plane.node("node-1").expect("node").status();
    let hello = status.borrow().clone().expect("attached").hello;
    assert_eq!(hello.node_name, "node-1");
    assert_eq!(hello.deployment, cluster.deployment);
    assert!(hello.inventory_known);
    assert_eq!(hello.provider, "docker");
    cluster.shutdown().await
}

/// Plane material signed by the cluster's CA but otherwise wrong.
fn plane_variant(
    cluster: &Cluster,
    name: &str,
    validity: billet_certs_dev::Validity,
) -> Result<PlaneTls> {
    let dir = scratch_dir("plane-variant")?;
    let made = billet_certs_dev::generate_with(
        &dir,
        name,
        &[],
        &billet_certs_dev::Options {
            validity,
            ca_dir: Some(cluster.certs.dir.clone()),
        },
    )?;
    Ok(PlaneTls {
        ca_pem: std::fs::read(&cluster.certs.ca.cert)?,
        cert_pem: std::fs::read(&made.plane.cert)?,
        key_pem: std::fs::read(&made.plane.key)?,
    })
}

async fn refused(cluster: &Cluster, tls: PlaneTls) -> Result<()> {
    let node = &cluster.nodes["node-1"];
    let before = node.log_text().len();
    let target = NodeTarget {
        name: "node-1".into(),
        addr: node.addr,
    };
    let attempt = match dial(&target, &tls).await {
        Ok(channel) => open_session(channel, billet_proto::PROTOCOL_VERSION, &cluster.deployment)
            .await
            .map(|_| ()),
        Err(e) => Err(e.to_string()),
    };
    assert!(attempt.is_err(), "the node accepted a plane it must refuse");
    assert!(
        refused_in_log(cluster, before).await,
        "the node logged no refusal:\n{}",
        node.log_text()
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_not_yet_valid_and_misnamed_plane_certificates_are_refused() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    refused(
        &cluster,
        plane_variant(&cluster, "plane", billet_certs_dev::Validity::expired())?,
    )
    .await?;
    refused(
        &cluster,
        plane_variant(
            &cluster,
            "plane",
            billet_certs_dev::Validity::not_yet_valid(),
        )?,
    )
    .await?;
    refused(
        &cluster,
        plane_variant(&cluster, "intruder", billet_certs_dev::Validity::dev())?,
    )
    .await?;
    assert!(
        cluster.nodes["node-1"]
            .log_text()
            .contains("does not name the configured plane"),
        "the refusal of a misnamed plane should say so"
    );
    // The genuine plane, made the same way, is accepted: the refusals above
    // are about the certificates, not the harness.
    let good = plane_variant(&cluster, "plane", billet_certs_dev::Validity::dev())?;
    let target = NodeTarget {
        name: "node-1".into(),
        addr: cluster.nodes["node-1"].addr,
    };
    let hello = open_session(
        dial(&target, &good).await?,
        billet_proto::PROTOCOL_VERSION,
        &cluster.deployment,
    )
    .await;
    assert!(hello.is_ok(), "{hello:?}");
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_protocol_version_mismatch_is_refused_with_a_sentence_naming_both_versions() -> Result<()>
{
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let target = NodeTarget {
        name: "node-1".into(),
        addr: cluster.nodes["node-1"].addr,
    };
    let channel = dial(&target, &plane_tls(&cluster.certs)?).await?;
    let error = open_session(channel, 999, &cluster.deployment)
        .await
        .expect_err("a plane speaking another version attached");
    let ours = billet_proto::PROTOCOL_VERSION.to_string();
    assert!(
        error.contains("999") && error.contains(&ours) && error.contains("upgrade"),
        "{error}"
    );
    cluster.shutdown().await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rotated_certificates_serve_new_sessions_while_the_open_one_keeps_working() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_env: vec![("BILLET_TLS_RELOAD_SECS".into(), "1".into())],
        ..ClusterOptions::default()
    })
    .await?;
    let files = cluster.certs.node("node-1").expect("node files").clone();
    let link = cluster.plane.node("node-1").expect("link");
    let session_before = link.status().borrow().clone().expect("attached").session;

    // A new CA; the node gets a certificate from it, and trusts both CAs.
    let next = billet_certs_dev::generate(&scratch_dir("rotated")?, "plane", &["node-1"])?;
    let next_node = next.node("node-1").expect("node files");
    let mut bundle = std::fs::read(&cluster.certs.ca.cert)?;
    bundle.extend(std::fs::read(&next.ca.cert)?);
    std::fs::write(&cluster.certs.ca.cert, &bundle)?;
    std::fs::copy(&next_node.key, &files.key)?;
    std::fs::copy(&next_node.cert, &files.cert)?;
    let node = &cluster.nodes["node-1"];
    wait_until_log(node, "TLS material replaced").await?;

    // The session opened before the rotation still carries commands.
    let outcome = link
        .dispatch(
            pb::command::Kind::Instances(pb::Instances {}),
            Duration::from_secs(10),
        )
        .await;
    assert!(outcome.is_ok(), "{}", outcome.describe());
    assert_eq!(
        link.status().borrow().clone().expect("attached").session,
        session_before
    );

    // A new session needs the new certificate: a plane trusting only the new CA attaches.
    let new_plane = plane_tls(&next)?;
    let target = NodeTarget {
        name: "node-1".into(),
        addr: node.addr,
    };
    let hello = open_session(
        dial(&target, &new_plane).await?,
        billet_proto::PROTOCOL_VERSION,
        &cluster.deployment,
    )
    .await
    .expect("a new session with the rotated material");
    assert_eq!(hello.node_name, "node-1");

    // A broken replacement (a key that does not match) is refused and the
    // current material keeps serving.
    let stray = billet_certs_dev::generate(&scratch_dir("stray")?, "plane", &["node-1"])?;
    let before = node.log_text().len();
    std::fs::copy(&stray.node("node-1").expect("node files").key, &files.key)?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !node.log_text()[before..].contains("refused the replacement TLS material") {
        assert!(
            tokio::time::Instant::now() < deadline,
            "no warning about the broken replacement"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        node.log_text()[before..].contains(&files.key.display().to_string())
            || node.log_text()[before..].contains(&files.cert.display().to_string()),
        "the warning should name the file"
    );
    let hello = open_session(
        dial(&target, &new_plane).await?,
        billet_proto::PROTOCOL_VERSION,
        &cluster.deployment,
    )
    .await;
    assert!(
        hello.is_ok(),
        "the old material stopped serving after a broken replacement: {hello:?}"
    );
    cluster.shutdown().await
}

async fn wait_until_log(node: &billet_tests::cluster::NodeProcess, text: &str) -> Result<()> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !node.log_text().contains(text) {
        anyhow::ensure!(
            tokio::time::Instant::now() < deadline,
            "the node never logged {text:?}:\n{}",
            node.log_text()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}
