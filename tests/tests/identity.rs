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
    let (tx, rx) = tokio::sync::mpsc::channel(4);
    tx.send(pb::PlaneMessage {
        body: Some(pb::plane_message::Body::Open(pb::Open {
            protocol_version: billet_proto::PROTOCOL_VERSION,
            deployment: String::new(),
            lease_ttl_ms: 1000,
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
