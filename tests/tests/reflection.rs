//! gRPC server reflection, as `grpcurl list` and `grpcurl describe` use it:
//! on the local socket (`grpcurl -plaintext -authority localhost -unix
//! <state_dir>/node.sock list`) and on the mTLS port with the plane's certificate, over both the
//! `v1` and the older `v1alpha` reflection service; the descriptors it serves
//! describe the node's services and their methods.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use billet_tests::cluster::{Cluster, ClusterOptions};
use prost::Message;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};
use tonic_reflection::pb::v1 as reflection;
use tonic_reflection::pb::v1alpha as reflection_alpha;

async fn local_channel(socket: &Path) -> Result<Channel> {
    let socket = socket.to_owned();
    Ok(Endpoint::from_static("http://node.local")
        .connect_with_connector(tower::service_fn(move |_: tonic::transport::Uri| {
            let socket = socket.clone();
            async move {
                tokio::net::UnixStream::connect(socket)
                    .await
                    .map(hyper_util::rt::TokioIo::new)
            }
        }))
        .await?)
}

async fn tls_channel(cluster: &Cluster, node: &str) -> Result<Channel> {
    let certs = &cluster.certs;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(std::fs::read(&certs.ca.cert)?))
        .identity(Identity::from_pem(
            std::fs::read(&certs.plane.cert)?,
            std::fs::read(&certs.plane.key)?,
        ))
        .domain_name(node);
    let addr = cluster.nodes[node].addr;
    Ok(Endpoint::from_shared(format!("https://{addr}"))?
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(10))
        .connect()
        .await?)
}

/// One reflection request and its answer (`v1`).
async fn ask(
    channel: Channel,
    request: reflection::server_reflection_request::MessageRequest,
) -> Result<reflection::server_reflection_response::MessageResponse> {
    let mut client = reflection::server_reflection_client::ServerReflectionClient::new(channel);
    let outbound = tokio_stream::iter([reflection::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(request),
    }]);
    let mut answers = client.server_reflection_info(outbound).await?.into_inner();
    let answer = answers.message().await?.context("no reflection answer")?;
    answer.message_response.context("an empty answer")
}

async fn list(channel: Channel) -> Result<Vec<String>> {
    use reflection::server_reflection_request::MessageRequest;
    use reflection::server_reflection_response::MessageResponse;
    match ask(channel, MessageRequest::ListServices(String::new())).await? {
        MessageResponse::ListServicesResponse(r) => {
            Ok(r.service.into_iter().map(|s| s.name).collect())
        }
        other => bail!("not a service list: {other:?}"),
    }
}

/// The methods of `service`, from the file that defines it.
async fn describe(channel: Channel, service: &str) -> Result<Vec<String>> {
    use reflection::server_reflection_request::MessageRequest;
    use reflection::server_reflection_response::MessageResponse;
    let MessageResponse::FileDescriptorResponse(files) = ask(
        channel,
        MessageRequest::FileContainingSymbol(service.to_owned()),
    )
    .await?
    else {
        bail!("no file for {service}");
    };
    let (package, name) = service.rsplit_once('.').context("a qualified name")?;
    for bytes in files.file_descriptor_proto {
        let file = prost_types::FileDescriptorProto::decode(bytes.as_slice())?;
        if file.package() != package {
            continue;
        }
        if let Some(s) = file.service.iter().find(|s| s.name() == name) {
            return Ok(s.method.iter().map(|m| m.name().to_owned()).collect());
        }
    }
    bail!("{service} is not described")
}

/// Service names over the older `v1alpha` reflection, which older grpcurl
/// releases ask.
async fn list_alpha(channel: Channel) -> Result<Vec<String>> {
    use reflection_alpha::server_reflection_request::MessageRequest;
    use reflection_alpha::server_reflection_response::MessageResponse;
    let mut client =
        reflection_alpha::server_reflection_client::ServerReflectionClient::new(channel);
    let outbound = tokio_stream::iter([reflection_alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    }]);
    let mut answers = client.server_reflection_info(outbound).await?.into_inner();
    match answers
        .message()
        .await?
        .and_then(|a| a.message_response)
        .context("no answer")?
    {
        MessageResponse::ListServicesResponse(r) => {
            Ok(r.service.into_iter().map(|s| s.name).collect())
        }
        other => bail!("not a service list: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_lists_and_describes_the_services_on_the_local_socket_and_the_mtls_port()
-> Result<()> {
    let cluster = Cluster::start(ClusterOptions::default()).await?;
    let socket = cluster.dir.join("state-node-1").join("node.sock");

    let local = list(local_channel(&socket).await?).await?;
    for service in [
        "billet.node.v1.Local",
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
    ] {
        assert!(
            local.iter().any(|s| s == service),
            "{service} not in {local:?}"
        );
    }
    assert_eq!(
        describe(local_channel(&socket).await?, "billet.node.v1.Local").await?,
        ["Status", "Enroll"]
    );
    let alpha = list_alpha(local_channel(&socket).await?).await?;
    assert!(
        alpha.iter().any(|s| s == "billet.node.v1.Local"),
        "{alpha:?}"
    );

    let port = list(tls_channel(&cluster, "node-1").await?).await?;
    for service in ["billet.node.v1.Node", "grpc.health.v1.Health"] {
        assert!(
            port.iter().any(|s| s == service),
            "{service} not in {port:?}"
        );
    }
    assert_eq!(
        describe(
            tls_channel(&cluster, "node-1").await?,
            "billet.node.v1.Node"
        )
        .await?,
        ["Attach"]
    );
    assert_eq!(
        describe(
            tls_channel(&cluster, "node-1").await?,
            "grpc.health.v1.Health"
        )
        .await?,
        ["Check", "Watch"]
    );
    cluster.shutdown().await
}

/// Every grpcurl line the README gives for the local socket names an
/// authority: grpcurl otherwise sends the socket's path as `:authority`,
/// which the HTTP/2 server refuses as malformed (a stream reset).
#[test]
fn the_readmes_grpcurl_lines_for_the_local_socket_name_an_authority() {
    let readme = include_str!("../../README.md");
    let lines: Vec<&str> = readme
        .lines()
        .filter(|l| l.starts_with("grpcurl") && l.contains(" -unix "))
        .collect();
    assert!(lines.len() >= 3, "{lines:?}");
    for line in lines {
        assert!(line.contains("-authority localhost"), "{line}");
    }
}
