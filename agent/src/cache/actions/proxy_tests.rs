//! The proxy and the archives through a real client: CONNECT with Basic
//! auth, TLS trusting the node's CA, raw HTTP/1.1 inside; a fake results
//! service (TLS, its own CA) behind it. spec/cache.md §7.2 and §7.3.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use base64::Engine as _;
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

use super::archives::{Archives, BLOB_PREFIX, MAX_ARCHIVES_PER_SESSION};
use super::ca::InterceptionCa;
use super::proxy::{ActionsProxy, MAX_HEAD_BYTES, Upstream, targets_results_host};
use super::{CacheScope, FakeAnswer, FakePolicy, RESULTS_HOST};
use crate::cache::session::CacheToken;
use crate::journal::{MemoryJournal, MountJournal};

const REF: &str = "octo/app/.github/workflows/ci.yml@refs/heads/main";
const UA: &str = "@actions/cache-4.0.3";
const TWIRP: &str = "/twirp/github.actions.results.api.v1.CacheService/";

fn scratch() -> PathBuf {
    let d = std::env::temp_dir().join(format!("bap-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// What the fake results service saw: each request's head and body.
type Requests = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

#[derive(Clone, Default)]
struct Seen(Requests, Arc<Mutex<usize>>);

impl Seen {
    fn requests(&self) -> Vec<(String, Vec<u8>)> {
        self.0.lock().unwrap().clone()
    }
    fn dials(&self) -> usize {
        *self.1.lock().unwrap()
    }
}

/// How the fake upstream ends a connection.
#[derive(Clone, Copy, PartialEq)]
enum UpstreamMode {
    /// Answers each request and keeps the connection.
    KeepAlive,
    /// Answers the first request and closes.
    CloseAfterOne,
}

/// A TLS server for the results host, signed by a CA of its own.
async fn fake_upstream(mode: UpstreamMode) -> (SocketAddr, String, Seen) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, SanType};
    let mut ca = CertificateParams::default();
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca, ca_key);
    let mut leaf = CertificateParams::default();
    leaf.subject_alt_names = vec![SanType::DnsName(RESULTS_HOST.try_into().unwrap())];
    let leaf_key = KeyPair::generate().unwrap();
    let leaf_cert = leaf.signed_by(&leaf_key, &issuer).unwrap();
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(
            vec![leaf_cert.der().clone()],
            rustls::pki_types::PrivateKeyDer::Pkcs8(leaf_key.serialize_der().into()),
        )
        .unwrap();
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(config));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Seen::default();
    let s = seen.clone();
    tokio::spawn(async move {
        loop {
            let Ok((tcp, _)) = listener.accept().await else {
                return;
            };
            *s.1.lock().unwrap() += 1;
            let acceptor = acceptor.clone();
            let s = s.clone();
            tokio::spawn(async move {
                let Ok(mut tls) = acceptor.accept(tcp).await else {
                    return;
                };
                let alpn = tls.get_ref().1.alpn_protocol().map(<[u8]>::to_vec);
                loop {
                    let Some((head, body)) = read_message(&mut tls).await else {
                        return;
                    };
                    s.0.lock().unwrap().push((head.clone(), body));
                    if head.contains("Upgrade: websocket") {
                        let _ = tls
                            .write_all(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n")
                            .await;
                        let _ = tls.flush().await;
                        // Echo frames back, reversed, until the guest ends.
                        let mut buf = [0u8; 1024];
                        while let Ok(n) = tls.read(&mut buf).await {
                            if n == 0 {
                                return;
                            }
                            let mut b = buf[..n].to_vec();
                            b.reverse();
                            let _ = tls.write_all(&b).await;
                            let _ = tls.flush().await;
                        }
                        return;
                    }
                    let answer = format!(
                        "HTTP/1.1 299 From GitHub\r\nContent-Length: 8\r\nX-Alpn: {}\r\n\r\nupstream",
                        String::from_utf8_lossy(&alpn.clone().unwrap_or_default())
                    );
                    let _ = tls.write_all(answer.as_bytes()).await;
                    let _ = tls.flush().await;
                    if mode == UpstreamMode::CloseAfterOne {
                        let _ = tls.shutdown().await;
                        return;
                    }
                }
            });
        }
    });
    (addr, ca_cert.pem(), seen)
}

/// Reads one HTTP/1.1 message (request or response): its head as text and
/// its `Content-Length` body.
async fn read_message<S: tokio::io::AsyncRead + Unpin>(s: &mut S) -> Option<(String, Vec<u8>)> {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if s.read(&mut byte).await.ok()? == 0 {
            return None;
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    s.read_exact(&mut body).await.ok()?;
    Some((head, body))
}

struct Node {
    dir: PathBuf,
    journal: Arc<MemoryJournal>,
    policy: FakePolicy,
    proxy: Arc<ActionsProxy>,
    token: CacheToken,
    ca_pem: String,
    stop: tokio_util::sync::CancellationToken,
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop.cancel();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn node(upstream: (SocketAddr, &str), journal: Arc<MemoryJournal>, dir: PathBuf) -> Node {
    node_with(upstream, journal, dir, None).await
}

async fn node_with(
    upstream: (SocketAddr, &str),
    journal: Arc<MemoryJournal>,
    dir: PathBuf,
    token: Option<CacheToken>,
) -> Node {
    let policy = FakePolicy::new(FakeAnswer::Allow);
    let archives = Archives::open(&dir, journal.clone(), Arc::new(policy.clone()))
        .await
        .unwrap();
    let ca = Arc::new(InterceptionCa::load_or_create(&dir).unwrap());
    let ca_pem = ca.ca_pem().to_owned();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream =
        Upstream::new(Some(upstream.0.to_string()), Some(upstream.1.as_bytes())).unwrap();
    let proxy = ActionsProxy::new(archives, ca, upstream, listener.local_addr().unwrap()).unwrap();
    let stop = tokio_util::sync::CancellationToken::new();
    tokio::spawn(proxy.clone().serve(listener, stop.clone()));
    let token = match token {
        Some(t) => t,
        None => {
            let t = CacheToken::mint().unwrap();
            proxy
                .archives()
                .open_session("lease-1", &t, CacheScope::new("octo", "app", REF).unwrap())
                .await
                .unwrap();
            t
        }
    };
    Node {
        dir,
        journal,
        policy,
        proxy,
        token,
        ca_pem,
        stop,
    }
}

type Tunnel = tokio_rustls::client::TlsStream<tokio::net::TcpStream>;

/// Sends a CONNECT to `authority` with `token`; the proxy's status, and
/// the stream when it said 200.
async fn connect(
    node: &Node,
    authority: &str,
    token: &str,
) -> (u16, Option<tokio::net::TcpStream>) {
    let url = node.proxy.guest_url(&node.token);
    let addr = url.expose().rsplit_once('@').unwrap().1.to_owned();
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    let auth = base64::engine::general_purpose::STANDARD.encode(format!("billet:{token}"));
    tcp.write_all(
        format!(
            "CONNECT {authority} HTTP/1.1\r\nHost: {authority}\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
        )
        .as_bytes(),
    )
    .await
    .unwrap();
    let (head, _) = read_message(&mut tcp).await.unwrap();
    let status: u16 = head.split(' ').nth(1).unwrap().parse().unwrap();
    (status, (status == 200).then_some(tcp))
}

async fn tunnel(node: &Node) -> Tunnel {
    tunnel_as(node, &node.token).await
}

/// A tunnel to the results host with `token`'s session, TLS trusting the
/// node's CA.
async fn tunnel_as(node: &Node, token: &CacheToken) -> Tunnel {
    let (status, tcp) = connect(node, &format!("{RESULTS_HOST}:443"), token.expose()).await;
    assert_eq!(status, 200);
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut node.ca_pem.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    tokio_rustls::TlsConnector::from(Arc::new(config))
        .connect(
            rustls::pki_types::ServerName::try_from(RESULTS_HOST).unwrap(),
            tcp.unwrap(),
        )
        .await
        .unwrap()
}

struct Reply {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Reply {
    fn local(&self) -> bool {
        self.head
            .to_ascii_lowercase()
            .contains("x-billet-actions-cache: local")
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap()
    }
}

async fn send<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    t: &mut S,
    raw: &[u8],
) -> Reply {
    t.write_all(raw).await.unwrap();
    // TLS: what rustls still holds goes out now. Without it a large body's
    // last records could wait in the client while it reads for the answer
    // the node cannot give until they come (the 64 MiB upload of
    // `stopping_the_proxy_cuts_a_direct_download_in_progress` hung so, now
    // and then, under load).
    t.flush().await.unwrap();
    let (head, body) = read_message(t).await.expect("an answer");
    Reply {
        status: head.split(' ').nth(1).unwrap().parse().unwrap(),
        head,
        body,
    }
}

fn request(method: &str, path: &str, headers: &[(&str, &str)], body: &[u8]) -> Vec<u8> {
    request_to(RESULTS_HOST, method, path, headers, body)
}

fn request_to(
    host: &str,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Vec<u8> {
    let mut raw = format!("{method} {path} HTTP/1.1\r\nHost: {host}\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    let mut raw = raw.into_bytes();
    raw.extend_from_slice(body);
    raw
}

fn twirp_as(method: &str, ua: &str, body: &serde_json::Value) -> Vec<u8> {
    request(
        "POST",
        &format!("{TWIRP}{method}"),
        &[
            ("Content-Type", "application/json"),
            ("User-Agent", ua),
            ("Authorization", "Bearer runtime-token"),
        ],
        body.to_string().as_bytes(),
    )
}

async fn call(node: &Node, method: &str, body: serde_json::Value) -> Reply {
    let mut t = tunnel(node).await;
    send(&mut t, &twirp_as(method, UA, &body)).await
}

/// The path and query of a signed URL on the results host (fetched in a
/// tunnel); the whole URL of one on the proxy's listener (fetched
/// directly, [`blob`]).
fn signed_path(url: &str) -> String {
    url.strip_prefix(&format!("https://{RESULTS_HOST}"))
        .unwrap_or(url)
        .to_owned()
}

/// Sends a request to a signed URL: a path in a tunnel to the results
/// host, or an `http://` URL straight to the listener it names, with no
/// tunnel and no proxy credential.
async fn blob(
    node: &Node,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Reply {
    if let Some(rest) = path.strip_prefix("http://") {
        let (authority, target) = rest.split_at(rest.find('/').unwrap());
        let mut tcp = tokio::net::TcpStream::connect(authority).await.unwrap();
        return send(
            &mut tcp,
            &request_to(authority, method, target, headers, body),
        )
        .await;
    }
    let mut t = tunnel(node).await;
    send(&mut t, &request(method, path, headers, body)).await
}

/// Saves `bytes` under `key` through the three steps actions/cache takes.
async fn save(node: &Node, key: &str, bytes: &[u8]) -> serde_json::Value {
    let created = call(
        node,
        "CreateCacheEntry",
        serde_json::json!({"key": key, "version": "v1"}),
    )
    .await;
    assert!(created.local(), "{}", created.head);
    let url = created.json()["signed_upload_url"]
        .as_str()
        .unwrap()
        .to_owned();
    let put = blob(
        node,
        "PUT",
        &signed_path(&url),
        &[("x-ms-blob-type", "BlockBlob")],
        bytes,
    )
    .await;
    assert_eq!(put.status, 201, "{}", put.head);
    call(
        node,
        "FinalizeCacheEntryUpload",
        serde_json::json!({"key": key, "version": "v1", "size_bytes": bytes.len().to_string()}),
    )
    .await
    .json()
}

#[tokio::test]
async fn a_saved_archive_is_restored_locally_with_a_byte_range() {
    // spec/cache.md §7.2 1.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let finalized = save(&node, "npm-linux-abc", b"0123456789").await;
    assert_eq!(finalized["ok"], true);
    let id: i64 = finalized["entry_id"].as_str().unwrap().parse().unwrap();
    assert!(id > 0);
    let found = call(
        &node,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": "npm-linux-xyz", "restore_keys": ["npm-linux-"], "version": "v1"}),
    )
    .await;
    assert!(found.local());
    let found = found.json();
    assert_eq!(found["ok"], true);
    assert_eq!(found["matched_key"], "npm-linux-abc");
    let url = found["signed_download_url"].as_str().unwrap();
    assert!(!url.contains(node.token.expose()), "the token is in no URL");
    let part = blob(
        &node,
        "GET",
        &signed_path(url),
        &[("x-ms-range", "bytes=2-8")],
        b"",
    )
    .await;
    assert_eq!(part.status, 206);
    assert_eq!(part.body, b"2345678");
    assert!(
        part.head
            .to_ascii_lowercase()
            .contains("content-range: bytes 2-8/10"),
        "{}",
        part.head
    );
    let whole = blob(&node, "GET", &signed_path(url), &[], b"").await;
    assert_eq!(
        (whole.status, whole.body.as_slice()),
        (200, &b"0123456789"[..])
    );
    // The entry's key is scoped: no file name holds the token.
    let entries = node.proxy.archives().entries().unwrap();
    assert_eq!(entries.len(), 1);
    assert!(entries[0].bytes >= 10, "allocated blocks: {entries:?}");
    assert!(
        !entries[0]
            .dir
            .to_string_lossy()
            .contains(node.token.expose())
    );
    assert_eq!(seen.dials(), 0, "nothing went to GitHub");
    // Write-once: a second create of the key is refused.
    let again = call(
        &node,
        "CreateCacheEntry",
        serde_json::json!({"key": "npm-linux-abc", "version": "v1"}),
    )
    .await;
    assert_eq!(again.json()["ok"], false);
}

#[tokio::test]
async fn a_download_url_is_on_the_proxys_listener_and_fetched_there_without_a_tunnel() {
    // Past the reference: a restore is not decrypted by the guest (for
    // the restore figure; ARCHITECTURE.md "Downloads are fetched
    // directly").
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    assert_eq!(save(&node, "k", b"0123456789").await["ok"], true);
    let found = call(
        &node,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": "k", "version": "v1"}),
    )
    .await
    .json();
    let url = found["signed_download_url"].as_str().unwrap().to_owned();
    let listener = node.proxy.guest_url(&node.token);
    let addr = listener.expose().rsplit_once('@').unwrap().1.to_owned();
    assert!(
        url.starts_with(&format!("http://{addr}/_billet/actions-cache/")),
        "{url}"
    );
    assert!(!url.contains(node.token.expose()), "the token is in no URL");
    // Fetched directly: no CONNECT, no proxy credential.
    let whole = blob(&node, "GET", &url, &[], b"").await;
    assert_eq!(
        (whole.status, whole.body.as_slice()),
        (200, &b"0123456789"[..]),
        "{}",
        whole.head
    );
    assert!(whole.local());
    let part = blob(&node, "GET", &url, &[("Range", "bytes=2-8")], b"").await;
    assert_eq!((part.status, part.body.as_slice()), (206, &b"2345678"[..]));
    // The same URL's path still answers in a tunnel (a URL handed out by
    // a node before this one).
    let target = &url[url.find(BLOB_PREFIX).unwrap()..];
    let tunnelled = blob(&node, "GET", target, &[], b"").await;
    assert_eq!(tunnelled.body, b"0123456789");
    // The signature is the credential.
    let last = if url.ends_with('0') { '1' } else { '0' };
    let forged = format!("{}{last}", &url[..url.len() - 1]);
    assert_eq!(blob(&node, "GET", &forged, &[], b"").await.status, 403);
    let unsigned = &url[..url.find('?').unwrap()];
    assert_eq!(blob(&node, "GET", unsigned, &[], b"").await.status, 403);
    assert_eq!(blob(&node, "PUT", &url, &[], b"x").await.status, 405);
    // An upload's URL is served in the tunnel only.
    let created = call(
        &node,
        "CreateCacheEntry",
        serde_json::json!({"key": "k2", "version": "v1"}),
    )
    .await
    .json();
    let upload = signed_path(created["signed_upload_url"].as_str().unwrap());
    assert!(upload.starts_with(BLOB_PREFIX), "{upload}");
    let direct_upload = format!("http://{addr}{upload}");
    assert_eq!(
        blob(&node, "GET", &direct_upload, &[], b"").await.status,
        403
    );
    // Anything else on the listener that is not a CONNECT is refused.
    assert_eq!(
        blob(&node, "GET", &format!("http://{addr}/"), &[], b"")
            .await
            .status,
        405
    );
    // The kill switch: a local 502.
    node.policy.set(FakeAnswer::Deny);
    let denied = blob(&node, "GET", &url, &[], b"").await;
    assert_eq!((denied.status, denied.local()), (502, true));
    node.policy.set(FakeAnswer::Allow);
    assert_eq!(blob(&node, "GET", &url, &[], b"").await.status, 200);
    // Once the session is closed (the compute proven gone), the URL is dead.
    node.proxy.archives().close("lease-1").await;
    assert_eq!(blob(&node, "GET", &url, &[], b"").await.status, 403);
    assert_eq!(seen.dials(), 0, "nothing went to GitHub");
}

#[tokio::test]
async fn conflicting_azure_and_http_ranges_and_any_range_of_an_empty_archive_are_unsatisfiable() {
    // spec/cache.md §7.2 2 and 20.
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    save(&node, "full", b"0123456789").await;
    save(&node, "empty", b"").await;
    let url = |key: &'static str| {
        let node = &node;
        async move {
            let r = call(
                node,
                "GetCacheEntryDownloadURL",
                serde_json::json!({"key": key, "version": "v1"}),
            )
            .await;
            signed_path(r.json()["signed_download_url"].as_str().unwrap())
        }
    };
    let full = url("full").await;
    let r = blob(
        &node,
        "GET",
        &full,
        &[("Range", "bytes=0-1"), ("x-ms-range", "bytes=2-3")],
        b"",
    )
    .await;
    assert_eq!(r.status, 416);
    let r = blob(&node, "GET", &full, &[("Range", "bytes=-3")], b"").await;
    assert_eq!((r.status, r.body.as_slice()), (206, &b"789"[..]));
    let r = blob(&node, "GET", &full, &[("Range", "bytes=10-")], b"").await;
    assert_eq!(r.status, 416);
    assert!(
        r.head
            .to_ascii_lowercase()
            .contains("content-range: bytes */10")
    );
    let empty = url("empty").await;
    let r = blob(&node, "GET", &empty, &[("Range", "bytes=0-")], b"").await;
    assert_eq!(r.status, 416);
    let r = blob(&node, "GET", &empty, &[], b"").await;
    assert_eq!((r.status, r.body.len()), (200, 0));
}

#[tokio::test]
async fn an_archive_of_several_frames_is_restored_whole_and_by_a_range_across_frames() {
    // The download is read off the disk in 1 MiB frames: a range that
    // starts inside one and ends inside another is exact, and a HEAD reads
    // nothing.
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let bytes: Vec<u8> = (0..(3 << 20) + 5).map(|i: usize| (i % 251) as u8).collect();
    save(&node, "big", &bytes).await;
    let found = call(
        &node,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": "big", "version": "v1"}),
    )
    .await;
    let url = signed_path(found.json()["signed_download_url"].as_str().unwrap());
    let whole = blob(&node, "GET", &url, &[], b"").await;
    assert_eq!(whole.status, 200);
    assert!(whole.body == bytes, "the whole archive, byte for byte");
    let (start, end) = ((1 << 20) - 3, (2 << 20) + 4);
    let part = blob(
        &node,
        "GET",
        &url,
        &[("Range", &format!("bytes={start}-{end}"))],
        b"",
    )
    .await;
    assert_eq!(part.status, 206);
    assert!(part.body == bytes[start..=end], "the range, byte for byte");
    let authority = &url["http://".len()..url.find(BLOB_PREFIX).unwrap()];
    let target = &url[url.find(BLOB_PREFIX).unwrap()..];
    let mut t = tokio::net::TcpStream::connect(authority).await.unwrap();
    t.write_all(&request_to(
        authority,
        "HEAD",
        target,
        &[("Connection", "close")],
        b"",
    ))
    .await
    .unwrap();
    let mut answer = Vec::new();
    t.read_to_end(&mut answer).await.unwrap();
    let answer = String::from_utf8(answer).unwrap();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(
        answer
            .to_ascii_lowercase()
            .contains(&format!("content-length: {}", bytes.len())),
        "{answer}"
    );
    assert!(answer.ends_with("\r\n\r\n"), "a head and no body: {answer}");
}

#[tokio::test]
async fn staged_blocks_are_assembled_in_the_declared_order() {
    // spec/cache.md §7.2 3.
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let created = call(
        &node,
        "CreateCacheEntry",
        serde_json::json!({"key": "k", "version": "v1"}),
    )
    .await;
    let path = signed_path(created.json()["signed_upload_url"].as_str().unwrap());
    for (id, bytes) in [("b25l", &b"one"[..]), ("dHdv", &b"two"[..])] {
        let r = blob(
            &node,
            "PUT",
            &format!("{path}&comp=block&blockid={id}"),
            &[],
            bytes,
        )
        .await;
        assert_eq!(r.status, 201, "{}", r.head);
    }
    let list = b"<?xml version=\"1.0\" encoding=\"utf-8\"?><BlockList><Uncommitted>dHdv</Uncommitted><Latest>b25l</Latest></BlockList>";
    let r = blob(&node, "PUT", &format!("{path}&comp=blocklist"), &[], list).await;
    assert_eq!(r.status, 201, "{}", String::from_utf8_lossy(&r.body));
    let fin = call(
        &node,
        "FinalizeCacheEntryUpload",
        serde_json::json!({"key": "k", "version": "v1", "size_bytes": 6}),
    )
    .await;
    assert_eq!(fin.json()["ok"], true);
    let found = call(
        &node,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": "k", "version": "v1"}),
    )
    .await;
    let r = blob(
        &node,
        "GET",
        &signed_path(found.json()["signed_download_url"].as_str().unwrap()),
        &[],
        b"",
    )
    .await;
    assert_eq!(r.body, b"twoone");
}

#[tokio::test]
async fn only_the_three_exact_cache_methods_of_actions_cache_are_local_and_nothing_else_asks_the_policy()
 {
    // spec/cache.md §7.2 21, 22; §7.3 6.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let body = serde_json::json!({"key": "k", "version": "v1"});
    let cases: Vec<Vec<u8>> = vec![
        twirp_as("DeleteCacheEntry", UA, &body),
        twirp_as("CreateCacheEntryX", UA, &body),
        twirp_as("Create%43acheEntry", UA, &body),
        request(
            "POST",
            "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact",
            &[("Content-Type", "application/json"), ("User-Agent", UA)],
            body.to_string().as_bytes(),
        ),
        twirp_as("CreateCacheEntry", "buildkit/v0.20", &body),
        twirp_as("CreateCacheEntry", "go-actions-cache/1.0", &body),
        twirp_as("CreateCacheEntry", "@actions/cache-", &body),
        request(
            "POST",
            &format!("{TWIRP}CreateCacheEntry?x=1"),
            &[("Content-Type", "application/json"), ("User-Agent", UA)],
            body.to_string().as_bytes(),
        ),
        request(
            "POST",
            &format!("{TWIRP}CreateCacheEntry"),
            &[("Content-Type", "text/plain"), ("User-Agent", UA)],
            body.to_string().as_bytes(),
        ),
    ];
    for (i, raw) in cases.iter().enumerate() {
        let mut t = tunnel(&node).await;
        let r = send(&mut t, raw).await;
        assert_eq!(r.status, 299, "case {i} reached GitHub: {}", r.head);
        assert!(!r.local());
        // GitHub got exactly the bytes the guest sent.
        assert_eq!(
            seen.requests()[i].1,
            body.to_string().into_bytes(),
            "case {i}"
        );
    }
    assert!(node.policy.asked().is_empty(), "no policy question");
    assert!(node.proxy.archives().entries().unwrap().is_empty());
    let ua = &seen.requests()[4].0;
    assert!(ua.contains("User-Agent: buildkit/v0.20"), "{ua}");
}

#[tokio::test]
async fn a_denied_or_failing_policy_sends_the_cache_to_github_without_allocating_and_is_asked_with_the_sessions_scope()
 {
    // spec/cache.md §7.2 12, 23.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    for answer in [FakeAnswer::Deny, FakeAnswer::Fail] {
        node.policy.set(answer);
        let r = call(
            &node,
            "CreateCacheEntry",
            serde_json::json!({"key": "k", "version": "v1"}),
        )
        .await;
        assert_eq!(r.status, 299);
        let r = call(
            &node,
            "GetCacheEntryDownloadURL",
            serde_json::json!({"key": "k", "version": "v1"}),
        )
        .await;
        assert_eq!(r.status, 299);
    }
    assert_eq!(seen.requests().len(), 4);
    assert!(
        std::fs::read_dir(node.dir.join("actions/uploads"))
            .unwrap()
            .next()
            .is_none()
    );
    assert!(
        node.policy
            .asked()
            .iter()
            .all(|(o, r)| o == "octo" && r == "app")
    );
}

#[tokio::test]
async fn the_kill_switch_turns_an_issued_upload_url_into_a_local_502_that_writes_nothing() {
    // spec/cache.md §7.2 13.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let created = call(
        &node,
        "CreateCacheEntry",
        serde_json::json!({"key": "k", "version": "v1"}),
    )
    .await;
    let path = signed_path(created.json()["signed_upload_url"].as_str().unwrap());
    node.policy.set(FakeAnswer::Deny);
    let r = blob(
        &node,
        "PUT",
        &path,
        &[("x-ms-blob-type", "BlockBlob")],
        b"data",
    )
    .await;
    assert_eq!(r.status, 502);
    assert!(r.local());
    let fin = call(
        &node,
        "FinalizeCacheEntryUpload",
        serde_json::json!({"key": "k", "version": "v1", "size_bytes": 4}),
    )
    .await;
    assert_eq!(fin.status, 502, "a reservation never goes to GitHub");
    assert_eq!(seen.dials(), 0);
    let upload = std::fs::read_dir(node.dir.join("actions/uploads"))
        .unwrap()
        .next()
        .unwrap()
        .unwrap()
        .path();
    assert!(!upload.join("archive").exists());
}

#[tokio::test]
async fn a_session_holds_at_most_32_archives_and_the_33rd_goes_to_github() {
    // spec/cache.md §7.2 19.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    for i in 0..MAX_ARCHIVES_PER_SESSION {
        let r = call(
            &node,
            "CreateCacheEntry",
            serde_json::json!({"key": format!("k{i}"), "version": "v1"}),
        )
        .await;
        assert_eq!(r.json()["ok"], true);
    }
    let r = call(
        &node,
        "CreateCacheEntry",
        serde_json::json!({"key": "one-more", "version": "v1"}),
    )
    .await;
    assert_eq!(r.status, 299);
    assert_eq!(seen.requests().len(), 1);
    assert_eq!(
        std::fs::read_dir(node.dir.join("actions/uploads"))
            .unwrap()
            .count(),
        MAX_ARCHIVES_PER_SESSION
    );
}

#[tokio::test]
async fn keys_do_not_cross_repositories_or_workflows() {
    // spec/cache.md §7.2 11.
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    save(&node, "k", b"abc").await;
    for scope in [
        CacheScope::new("octo", "other", REF).unwrap(),
        CacheScope::new(
            "octo",
            "app",
            "octo/app/.github/workflows/release.yml@refs/heads/main",
        )
        .unwrap(),
    ] {
        let token = CacheToken::mint().unwrap();
        node.proxy
            .archives()
            .open_session("lease-2", &token, scope)
            .await
            .unwrap();
        let other = Node {
            dir: scratch(),
            journal: node.journal.clone(),
            policy: node.policy.clone(),
            proxy: node.proxy.clone(),
            token,
            ca_pem: node.ca_pem.clone(),
            stop: tokio_util::sync::CancellationToken::new(),
        };
        let r = call(
            &other,
            "GetCacheEntryDownloadURL",
            serde_json::json!({"key": "k", "version": "v1"}),
        )
        .await;
        assert_eq!(r.json()["ok"], false);
        node.proxy.archives().close("lease-2").await;
    }
}

#[tokio::test]
async fn a_finalize_receipt_and_a_pending_upload_survive_a_restart_and_a_policy_outage() {
    // spec/cache.md §7.2 9, 17(a).
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let journal = Arc::new(MemoryJournal::default());
    let dir = scratch();
    let first = node((up, &up_ca), journal.clone(), dir.clone()).await;
    save(&first, "done", b"abc").await;
    let created = call(
        &first,
        "CreateCacheEntry",
        serde_json::json!({"key": "pending", "version": "v1"}),
    )
    .await;
    let pending = signed_path(created.json()["signed_upload_url"].as_str().unwrap());
    let token = first.token.clone();
    first.stop.cancel();
    std::mem::forget(first); // keep the directory for the restart
    let second = node_with((up, &up_ca), journal.clone(), dir.clone(), Some(token)).await;
    second.policy.set(FakeAnswer::Fail);
    let fin = call(
        &second,
        "FinalizeCacheEntryUpload",
        serde_json::json!({"key": "done", "version": "v1", "size_bytes": "3"}),
    )
    .await;
    assert!(fin.local());
    assert_eq!(fin.json()["ok"], true, "answered from the receipt");
    second.policy.set(FakeAnswer::Allow);
    let r = blob(
        &second,
        "PUT",
        &pending,
        &[("x-ms-blob-type", "BlockBlob")],
        b"xyz",
    )
    .await;
    assert_eq!(r.status, 201, "the reservation outlived the restart");
    second.proxy.archives().close("lease-1").await;
    assert!(
        std::fs::read_dir(dir.join("actions/uploads"))
            .unwrap()
            .next()
            .is_none()
    );
    assert!(journal.actions_sessions().await.unwrap().is_empty());
}

#[tokio::test]
async fn the_proxy_admits_only_a_session_token_and_only_the_results_host() {
    // spec/cache.md §7.3 1.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let results = format!("{RESULTS_HOST}:443");
    assert_eq!(connect(&node, &results, &"0".repeat(64)).await.0, 407);
    assert_eq!(connect(&node, &results, "").await.0, 407);
    assert_eq!(
        connect(&node, "example.com:443", node.token.expose())
            .await
            .0,
        403
    );
    assert_eq!(
        connect(&node, &format!("{RESULTS_HOST}:8443"), node.token.expose())
            .await
            .0,
        403
    );
    assert_eq!(
        connect(&node, "not an authority", node.token.expose())
            .await
            .0,
        400
    );
    // An artifact call reaches GitHub with its Authorization unchanged.
    let mut t = tunnel(&node).await;
    let r = send(
        &mut t,
        &request(
            "POST",
            "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact",
            &[
                ("Authorization", "Bearer runtime-token"),
                ("Content-Type", "application/json"),
            ],
            b"{}",
        ),
    )
    .await;
    assert_eq!(r.status, 299);
    assert!(
        seen.requests()[0]
            .0
            .contains("Authorization: Bearer runtime-token")
    );
    assert!(
        r.head.contains("X-Alpn: http/1.1"),
        "the upstream dial pins http/1.1: {}",
        r.head
    );
    // A cache call on a fresh tunnel is answered here.
    let r = call(
        &node,
        "CreateCacheEntry",
        serde_json::json!({"key": "k", "version": "v1"}),
    )
    .await;
    assert!(r.local());
    assert_eq!(seen.requests().len(), 1);
    // A closed session's token is refused.
    node.proxy.archives().close("lease-1").await;
    assert_eq!(connect(&node, &results, node.token.expose()).await.0, 407);
}

#[test]
fn an_inner_request_must_be_origin_form_for_the_results_host() {
    // spec/cache.md §7.3 7.
    for host in [
        RESULTS_HOST,
        &format!("{RESULTS_HOST}:443"),
        &RESULTS_HOST.to_uppercase(),
    ] {
        assert!(targets_results_host("/x", Some(host)), "{host}");
    }
    for host in [
        &format!("{RESULTS_HOST}:80"),
        &format!("{RESULTS_HOST}:8443"),
        "example.com",
        "",
    ] {
        assert!(!targets_results_host("/x", Some(host)), "{host}");
    }
    assert!(!targets_results_host(
        &format!("https://{RESULTS_HOST}/x"),
        Some(RESULTS_HOST)
    ));
    assert!(!targets_results_host("mailto:x", Some(RESULTS_HOST)));
    assert!(!targets_results_host("/x", None));
}

#[tokio::test]
async fn a_request_for_another_host_gets_a_local_421_and_dials_nothing() {
    // spec/cache.md §7.3 8.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    for raw in [
        "GET / HTTP/1.1\r\nHost: example.com\r\n\r\n".to_owned(),
        format!("GET https://{RESULTS_HOST}/ HTTP/1.1\r\nHost: {RESULTS_HOST}\r\n\r\n"),
        format!("GET / HTTP/1.1\r\nHost: {RESULTS_HOST}:80\r\n\r\n"),
        "GET / HTTP/1.1\r\n\r\n".to_owned(),
    ] {
        let mut t = tunnel(&node).await;
        let r = send(&mut t, raw.as_bytes()).await;
        assert_eq!(r.status, 421, "{raw}");
        assert!(r.local());
    }
    assert_eq!(seen.dials(), 0);
}

#[tokio::test]
async fn request_headers_of_64_kib_pass_and_one_byte_more_is_refused() {
    // spec/cache.md §7.3 4.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let raw = |pad: usize| {
        let start = format!(
            "POST /other HTTP/1.1\r\nHost: {RESULTS_HOST}\r\nContent-Length: 100000\r\nX-Pad: "
        );
        let fixed = start.len() + 4; // "\r\n\r\n"
        let mut r = start.into_bytes();
        r.extend(std::iter::repeat_n(b'a', pad - fixed));
        r.extend_from_slice(b"\r\n\r\n");
        r.extend(std::iter::repeat_n(b'b', 100_000));
        r
    };
    let mut t = tunnel(&node).await;
    let r = send(&mut t, &raw(MAX_HEAD_BYTES)).await;
    assert_eq!(r.status, 299, "exactly 64 KiB of head passes");
    assert_eq!(seen.requests()[0].1.len(), 100_000);
    let mut t = tunnel(&node).await;
    let r = send(&mut t, &raw(MAX_HEAD_BYTES + 1)).await;
    assert_eq!(r.status, 431);
}

#[tokio::test]
async fn a_spliced_tunnel_carries_keep_alive_requests_and_ends_when_github_closes() {
    // spec/cache.md §7.3 9, 10.
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let mut t = tunnel(&node).await;
    for _ in 0..2 {
        let r = send(&mut t, &request("GET", "/health", &[], b"")).await;
        assert!(r.head.starts_with("HTTP/1.1 299 From GitHub"), "{}", r.head);
    }
    assert_eq!(seen.requests().len(), 2);
    assert_eq!(seen.dials(), 1);
    let (up, up_ca, _) = fake_upstream(UpstreamMode::CloseAfterOne).await;
    let closing = node_with((up, &up_ca), Arc::default(), scratch(), None).await;
    let mut t = tunnel(&closing).await;
    let r = send(&mut t, &request("GET", "/health", &[], b"")).await;
    assert_eq!(r.status, 299);
    // The guest never closes; GitHub did, so the proxy ends the tunnel.
    let mut rest = Vec::new();
    let ended =
        tokio::time::timeout(std::time::Duration::from_secs(10), t.read_to_end(&mut rest)).await;
    assert!(
        ended.is_ok(),
        "the tunnel was not closed after GitHub closed"
    );
}

#[tokio::test]
async fn a_live_log_websocket_is_spliced_both_ways() {
    // spec/cache.md §7.3 11.
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let mut t = tunnel(&node).await;
    t.write_all(
        format!("GET /ws HTTP/1.1\r\nHost: {RESULTS_HOST}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n\r\n").as_bytes(),
    )
    .await
    .unwrap();
    t.flush().await.unwrap();
    let (head, _) = read_message(&mut t).await.unwrap();
    assert!(head.starts_with("HTTP/1.1 101"), "{head}");
    t.write_all(b"frame").await.unwrap();
    t.flush().await.unwrap();
    let mut back = [0u8; 5];
    t.read_exact(&mut back).await.unwrap();
    assert_eq!(&back, b"emarf");
}

/// Sets the last use (the mtime of `entry.json`) of the published archive of
/// `key` to `hours` before now.
fn used_hours_ago(node: &Node, key: &str, hours: u64) {
    let entry = node
        .proxy
        .archives()
        .entries()
        .unwrap()
        .into_iter()
        .find(|e| e.key == key)
        .unwrap_or_else(|| panic!("no entry of {key}"));
    std::fs::File::options()
        .write(true)
        .open(entry.dir.join("entry.json"))
        .unwrap()
        .set_modified(std::time::SystemTime::now() - std::time::Duration::from_secs(hours * 3600))
        .unwrap();
}

fn keys(node: &Node) -> Vec<String> {
    let mut keys: Vec<String> = node
        .proxy
        .archives()
        .entries()
        .unwrap()
        .into_iter()
        .map(|e| e.key)
        .collect();
    keys.sort();
    keys
}

fn now_unix_ms() -> i64 {
    i64::try_from(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis(),
    )
    .unwrap()
}

/// Actions cache archives are evicted by the sticky disks' pass
/// (`cache::lifecycle::evict`): past the retention, then least recently
/// used first across archives and generations while over the byte
/// budget, and never one a live session reads (a lookup matched it: its
/// download link exists, also across a restart, which reads the link
/// back from the journal); once that session closes, it goes too. An
/// evicted archive is a miss for the next lookup.
#[tokio::test]
async fn archives_are_evicted_by_retention_and_least_recent_use_and_never_while_a_session_reads_them()
 {
    use crate::cache::{Eviction, Policy, Store, lifecycle};
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let journal = Arc::new(MemoryJournal::default());
    let dir = scratch();
    let first = node((up, &up_ca), journal.clone(), dir.clone()).await;
    for k in ["a", "b", "c"] {
        assert_eq!(save(&first, k, b"0123456789").await["ok"], true);
    }
    // A job's lookup matches a: it reads it until its session closes.
    let found = call(
        &first,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": "a", "version": "v1"}),
    )
    .await;
    // Its path, fetched in a tunnel: the restarted node below listens on
    // another port (a real one binds the same), and a journaled URL's path
    // is served in a tunnel too.
    let download = found.json()["signed_download_url"]
        .as_str()
        .unwrap()
        .to_owned();
    let download = download[download.find(BLOB_PREFIX).unwrap()..].to_owned();
    used_hours_ago(&first, "a", 3);
    used_hours_ago(&first, "b", 2);
    used_hours_ago(&first, "c", 1);
    // A restart: the session and its link come back from the journal.
    let token = first.token.clone();
    first.stop.cancel();
    std::mem::forget(first);
    let node = node_with((up, &up_ca), journal.clone(), dir.clone(), Some(token)).await;
    let store = Store::open(&dir, "dev", journal.clone()).await.unwrap();
    let archives = node.proxy.archives().clone();
    let entries = archives.entries().unwrap();
    assert!(
        entries.iter().any(|e| e.key == "a" && e.in_use),
        "{entries:?}"
    );

    // Past a 90 minute retention: b; a is older but read.
    let rules = Eviction {
        retention: std::time::Duration::from_secs(90 * 60),
        ..Eviction::default()
    };
    let report = lifecycle::evict(&store, Some(&archives), rules, now_unix_ms())
        .await
        .unwrap();
    assert_eq!(report.archives_removed.len(), 1, "{report:?}");
    assert_eq!(report.kept_in_use, 1, "{report:?}");
    assert_eq!(keys(&node), ["a", "c"]);

    // A sticky-disk generation used now, and a budget with room for a's
    // and one more: c, the least recently used that may go, goes before
    // the generation.
    let m = store
        .mount(
            &crate::model::LeaseId::parse("lease", "l1").unwrap(),
            &crate::cache::DiskKey::parse("npm").unwrap(),
            Policy::Cas,
        )
        .await
        .unwrap();
    std::fs::write(m.dir.join("n"), "1").unwrap();
    store.commit(&m.id).await.unwrap();
    let one = archives.entries().unwrap()[0].bytes;
    let rules = Eviction {
        budget_bytes: Some(2 * one + one / 2),
        ..Eviction::default()
    };
    let report = lifecycle::evict(&store, Some(&archives), rules, now_unix_ms())
        .await
        .unwrap();
    assert!(report.removed.is_empty(), "{report:?}");
    assert_eq!(report.archives_removed.len(), 1, "{report:?}");
    assert_eq!(keys(&node), ["a"]);
    let missed = call(
        &node,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": "c", "version": "v1"}),
    )
    .await;
    assert!(missed.local());
    assert_eq!(missed.json()["ok"], false, "an evicted archive is a miss");
    // What the session reads is still served.
    let got = blob(&node, "GET", &download, &[], b"").await;
    assert_eq!((got.status, got.body.as_slice()), (200, &b"0123456789"[..]));

    // Nothing may go while the session reads a, whatever the budget.
    let all = Eviction {
        budget_bytes: Some(1),
        ..Eviction::default()
    };
    let report = lifecycle::evict(&store, Some(&archives), all, now_unix_ms())
        .await
        .unwrap();
    assert!(report.archives_removed.is_empty(), "{report:?}");
    assert_eq!(keys(&node), ["a"]);
    // Its session closes (the job's compute is gone): a goes.
    archives.close("lease-1").await;
    let report = lifecycle::evict(&store, Some(&archives), all, now_unix_ms())
        .await
        .unwrap();
    assert_eq!(report.archives_removed.len(), 1, "{report:?}");
    assert!(keys(&node).is_empty());
    assert_eq!(store.evicted().archives, 3);
    assert!(
        std::fs::read_dir(dir.join("actions/trash"))
            .unwrap()
            .next()
            .is_none(),
        "nothing is left in the trash"
    );
}

/// A connection from `source` (a loopback address other than 127.0.0.1,
/// to play another guest).
async fn connect_from(source: &str, at: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(format!("{source}:0").parse().unwrap()).unwrap();
    socket.connect(at.parse().unwrap()).await.unwrap()
}

/// Whether `stream` was closed by the proxy within `wait`.
async fn closed_within(stream: &mut tokio::net::TcpStream, wait: std::time::Duration) -> bool {
    let mut buf = [0_u8; 16];
    matches!(
        tokio::time::timeout(wait, stream.read(&mut buf)).await,
        Ok(Ok(0) | Err(_))
    )
}

/// 140 idle connections from one guest, which need no token, neither keep
/// another guest's CONNECTs out nor hold more than the per-peer bound: the
/// flooder loses its own oldest, and the proxy never holds more than its
/// cap.
#[tokio::test]
async fn a_flood_of_idle_connections_from_one_guest_costs_that_guest_and_another_guests_connects_go_through()
 {
    const PER_PEER: usize = super::proxy::MAX_PROXY_CONNECTIONS_PER_PEER;
    let (addr, pem, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((addr, &pem), Arc::new(MemoryJournal::default()), scratch()).await;
    let url = node.proxy.guest_url(&node.token);
    let at = url.expose().rsplit_once('@').unwrap().1.to_owned();
    let mut flood = Vec::new();
    for _ in 0..140 {
        flood.push(connect_from("127.0.0.2", &at).await);
    }
    let mut refused = 0;
    for _ in 0..20 {
        let (status, _) = connect(&node, &format!("{RESULTS_HOST}:443"), node.token.expose()).await;
        if status != 200 {
            refused += 1;
        }
    }
    assert_eq!(refused, 0, "another guest's CONNECTs were refused");
    let wait = std::time::Duration::from_millis(500);
    let mut gone = 0;
    for stream in &mut flood[..140 - PER_PEER] {
        if closed_within(stream, wait).await {
            gone += 1;
        }
    }
    assert_eq!(
        gone,
        140 - PER_PEER,
        "the flooder's oldest were not dropped"
    );
    for stream in &mut flood[140 - PER_PEER..] {
        assert!(
            !closed_within(stream, std::time::Duration::from_millis(50)).await,
            "the flooder's newest {PER_PEER} stay"
        );
    }
}

/// At the proxy's cap, a newcomer is kept and an idle connection of the
/// peer holding the most goes; a tunnel in progress stays.
#[tokio::test]
async fn at_the_cap_a_newcomer_takes_an_idle_place_of_the_heaviest_peer_and_a_tunnel_in_progress_stays()
 {
    const CAP: usize = super::proxy::MAX_PROXY_CONNECTIONS;
    const PER_PEER: usize = super::proxy::MAX_PROXY_CONNECTIONS_PER_PEER;
    let (addr, pem, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((addr, &pem), Arc::new(MemoryJournal::default()), scratch()).await;
    let url = node.proxy.guest_url(&node.token);
    let at = url.expose().rsplit_once('@').unwrap().1.to_owned();
    // A working tunnel from 127.0.0.1, then the listener filled by four
    // other addresses, the last holding the most.
    let mut working = tunnel(&node).await;
    let mut idle = Vec::new();
    let peers = CAP.div_ceil(PER_PEER);
    for p in 0..peers {
        for _ in 0..PER_PEER {
            if idle.len() + 1 < CAP {
                idle.push(connect_from(&format!("127.0.1.{}", p + 1), &at).await);
            }
        }
    }
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let (status, _) = connect(&node, &format!("{RESULTS_HOST}:443"), node.token.expose()).await;
    assert_eq!(status, 200, "the newcomer is kept");
    let lookup = serde_json::json!({"key": "k", "version": "v1"});
    let reply = send(
        &mut working,
        &twirp_as("GetCacheEntryDownloadURL", UA, &lookup),
    )
    .await;
    assert_eq!(reply.status, 200, "the tunnel in progress stays");
    let mut gone = 0;
    for stream in &mut idle {
        if closed_within(stream, std::time::Duration::from_millis(20)).await {
            gone += 1;
        }
    }
    assert!(gone >= 1, "no idle connection made room");
}

// ---------------------------------------------------------------------------
// The direct download path, as a hostile guest would attack it.
// ---------------------------------------------------------------------------

fn t_addr(node: &Node) -> String {
    node.proxy
        .guest_url(&node.token)
        .expose()
        .rsplit_once('@')
        .unwrap()
        .1
        .to_owned()
}

async fn t_found(node: &Node, key: &str) -> String {
    let r = call(
        node,
        "GetCacheEntryDownloadURL",
        serde_json::json!({"key": key, "version": "v1"}),
    )
    .await;
    r.json()["signed_download_url"].as_str().unwrap().to_owned()
}

/// id and sig of a direct URL.
fn t_parts(url: &str) -> (String, String) {
    let rest = &url[url.find(BLOB_PREFIX).unwrap() + BLOB_PREFIX.len()..];
    let (id, q) = rest.split_once("?sig=").unwrap();
    (id.to_owned(), q.to_owned())
}

/// Writes `raw` to the listener and reads until EOF or `wait`; the bytes read and whether EOF came.
async fn t_raw(addr: &str, raw: &[u8], wait: std::time::Duration) -> (Vec<u8>, bool) {
    let mut tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
    tcp.write_all(raw).await.unwrap();
    let mut out = Vec::new();
    let mut buf = vec![0u8; 65536];
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        match tokio::time::timeout_at(deadline, tcp.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (out, true),
            Ok(Ok(n)) => out.extend_from_slice(&buf[..n]),
            Err(_) => return (out, false),
        }
    }
}

fn t_status(answer: &[u8]) -> u16 {
    String::from_utf8_lossy(answer)
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0)
}

async fn t_get(addr: &str, target: &str) -> u16 {
    let (a, _) = t_raw(
        addr,
        format!("GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        std::time::Duration::from_secs(5),
    )
    .await;
    t_status(&a)
}

#[tokio::test]
async fn a_forged_malformed_or_traversing_direct_target_is_refused() {
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    save(&node, "k", b"0123456789").await;
    let url = t_found(&node, "k").await;
    let addr = t_addr(&node);
    let (id, sig) = t_parts(&url);
    let p = BLOB_PREFIX;
    let enc: String = sig.bytes().map(|b| format!("%{b:02x}")).collect();
    let cases: Vec<(String, u16)> = vec![
        (format!("{p}{id}?sig={sig}"), 200),
        (format!("{p}{id}?sig="), 403),
        (format!("{p}{id}"), 403),
        (format!("{p}{id}?sig={}", &sig[..63]), 403),
        (format!("{p}{id}?sig={sig}0"), 403),
        (format!("{p}{id}?sig={}", sig.to_uppercase()), 403),
        (format!("{p}{}?sig={sig}", id.to_uppercase()), 403),
        (format!("{p}{id}/?sig={sig}"), 403),
        (format!("{p}{id}?SIG={sig}"), 403),
        (format!("{p}{id}?sig=x&sig={sig}"), 403),
        (format!("{p}{id}?sig={sig}&sig=x"), 200), // first sig wins
        (format!("{p}{id}?sig={enc}"), 200),       // percent-decoded
        (format!("{p}{id}?sig={sig}%00"), 403),
        (format!("{p}../{}{id}?sig={sig}", &p[1..]), 403),
        (format!("{p}%2e%2e/{}{id}?sig={sig}", &p[1..]), 403),
        (format!("/x/..{p}{id}?sig={sig}"), 405),
        (format!("/{p}{id}?sig={sig}"), 405),
        (format!("{p}?sig={sig}"), 403),
        (format!("{p}{sig}?sig={id}"), 403),
        ("/".to_owned(), 405),
    ];
    let mut bad = Vec::new();
    for (target, want) in &cases {
        let got = t_get(&addr, target).await;
        eprintln!("GET {target} -> {got}");
        if got != *want {
            bad.push(format!("{target}: {got}, expected {want}"));
        }
    }
    // Methods other than GET/HEAD on a valid URL.
    let target = format!("{p}{id}?sig={sig}");
    for m in [
        "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "PROPFIND",
    ] {
        let (a, _) = t_raw(
            &addr,
            format!("{m} {target} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n").as_bytes(),
            std::time::Duration::from_secs(5),
        )
        .await;
        eprintln!("{m} -> {}", t_status(&a));
        if t_status(&a) != 405 {
            bad.push(format!("{m}: {}", t_status(&a)));
        }
    }
    // A GET with a body it does not read: answered, and the connection not reused for the body.
    let (a, eof) = t_raw(
        &addr,
        format!("GET {target} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 5\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes(),
        std::time::Duration::from_secs(3),
    )
    .await;
    eprintln!(
        "GET with a body: {} eof={eof}: {:?}",
        t_status(&a),
        String::from_utf8_lossy(&a)
    );
    // Another session's download id with this session's sig, and vice versa.
    let t2 = CacheToken::mint().unwrap();
    node.proxy
        .archives()
        .open_session("lease-2", &t2, CacheScope::new("octo", "app", REF).unwrap())
        .await
        .unwrap();
    let mut t = tunnel_as(&node, &t2).await;
    let r = send(
        &mut t,
        &twirp_as(
            "GetCacheEntryDownloadURL",
            UA,
            &serde_json::json!({"key": "k", "version": "v1"}),
        ),
    )
    .await;
    let url2 = r.json()["signed_download_url"].as_str().unwrap().to_owned();
    let (id2, sig2) = t_parts(&url2);
    for (target, want) in [
        (format!("{p}{id}?sig={sig2}"), 403),
        (format!("{p}{id2}?sig={sig}"), 403),
        (format!("{p}{id2}?sig={sig2}"), 200),
    ] {
        let got = t_get(&addr, &target).await;
        eprintln!("cross-session {target} -> {got}");
        if got != want {
            bad.push(format!("{target}: {got}, expected {want}"));
        }
    }
    assert_eq!(seen.dials(), 0);
    assert!(bad.is_empty(), "{bad:#?}");
}

#[tokio::test]
async fn an_absolute_form_request_for_another_host_is_refused_and_host_is_ignored() {
    let (up, up_ca, seen) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    save(&node, "k", b"0123456789").await;
    let url = t_found(&node, "k").await;
    let addr = t_addr(&node);
    let target = &url[url.find(BLOB_PREFIX).unwrap()..];
    let port = addr.rsplit_once(':').unwrap().1;
    let auth =
        base64::engine::general_purpose::STANDARD.encode(format!("billet:{}", node.token.expose()));
    let cases: Vec<(String, &str, String)> = vec![
        (format!("http://{addr}{target}"), "own", String::new()),
        (
            format!("http://evil.example{target}"),
            "other host",
            String::new(),
        ),
        (
            format!("http://{RESULTS_HOST}{target}"),
            "results host",
            String::new(),
        ),
        (
            format!("https://{RESULTS_HOST}{target}"),
            "results host https",
            String::new(),
        ),
        (
            format!("https://{addr}{target}"),
            "own https",
            String::new(),
        ),
        (
            format!("http://localhost:{port}{target}"),
            "localhost",
            String::new(),
        ),
        (
            format!("http://{addr}{target}"),
            "own + proxy auth",
            format!("Proxy-Authorization: Basic {auth}\r\n"),
        ),
        (
            target.to_owned(),
            "origin + Host evil",
            "Host: evil.example\r\n".to_owned(),
        ),
    ];
    for (t, what, extra) in cases {
        let host = if extra.starts_with("Host") {
            String::new()
        } else {
            format!("Host: {addr}\r\n")
        };
        let (a, _) = t_raw(
            &addr,
            format!("GET {t} HTTP/1.1\r\n{host}{extra}Connection: close\r\n\r\n").as_bytes(),
            std::time::Duration::from_secs(5),
        )
        .await;
        eprintln!("{what}: GET {t} -> {}", t_status(&a));
    }
    assert_eq!(seen.dials(), 0, "nothing dialled GitHub");
}

#[tokio::test]
async fn pipelined_direct_requests_on_one_keep_alive_connection_are_answered_in_order() {
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    save(&node, "k", b"0123456789").await;
    let url = t_found(&node, "k").await;
    let addr = t_addr(&node);
    let target = &url[url.find(BLOB_PREFIX).unwrap()..];
    let raw = format!(
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         GET {target} HTTP/1.1\r\nHost: {addr}\r\nRange: bytes=2-3\r\n\r\n\
         HEAD {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         GET {BLOB_PREFIX}nope?sig=x HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         GET {target} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    );
    let (a, eof) = t_raw(&addr, raw.as_bytes(), std::time::Duration::from_secs(5)).await;
    let text = String::from_utf8_lossy(&a);
    eprintln!("eof={eof}\n{text}");
    let statuses: Vec<&str> = text
        .match_indices("HTTP/1.1 ")
        .map(|(i, _)| &text[i + 9..i + 12])
        .collect();
    assert_eq!(statuses, ["200", "206", "200", "403", "200"]);
    assert!(eof);
    // A download, then a CONNECT with the credential, on one connection.
    let auth =
        base64::engine::general_purpose::STANDARD.encode(format!("billet:{}", node.token.expose()));
    let raw = format!(
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         CONNECT {RESULTS_HOST}:443 HTTP/1.1\r\nHost: {RESULTS_HOST}:443\r\nProxy-Authorization: Basic {auth}\r\n\r\n"
    );
    let (a, eof) = t_raw(&addr, raw.as_bytes(), std::time::Duration::from_secs(2)).await;
    eprintln!(
        "GET then CONNECT: eof={eof}\n{}",
        String::from_utf8_lossy(&a)
    );
}

async fn t_range(
    node: &Node,
    direct: &str,
    method: &str,
    headers: &[(&str, &str)],
) -> (String, String) {
    let target = &direct[direct.find(BLOB_PREFIX).unwrap()..];
    let addr = t_addr(node);
    let mut h: Vec<(&str, &str)> = headers.to_vec();
    h.push(("Connection", "close"));
    let (d, _) = t_raw(
        &addr,
        &request_to(&addr, method, target, &h, b""),
        std::time::Duration::from_secs(5),
    )
    .await;
    let mut t = tunnel(node).await;
    t.write_all(&request(method, target, &h, b""))
        .await
        .unwrap();
    t.flush().await.unwrap();
    let mut tb = Vec::new();
    let _ = tokio::time::timeout(std::time::Duration::from_secs(5), t.read_to_end(&mut tb)).await;
    let pick = |r: &[u8]| {
        let text = String::from_utf8_lossy(r).into_owned();
        let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
        let h = head.to_ascii_lowercase();
        let keep: Vec<&str> = h
            .lines()
            .filter(|l| {
                l.starts_with("content-range")
                    || l.starts_with("content-length")
                    || l.starts_with("http/")
            })
            .collect();
        format!("{keep:?} body={body:?}")
    };
    (pick(&d), pick(&tb))
}

#[tokio::test]
async fn ranges_and_head_answer_directly_as_in_the_tunnel_and_an_overflowing_range_is_capped() {
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    save(&node, "k", b"0123456789").await;
    let url = t_found(&node, "k").await;
    let mut differ = Vec::new();
    let specs = [
        "bytes=0-0",
        "bytes=9-9",
        "bytes=9-100",
        "bytes=10-",
        "bytes=-1",
        "bytes=-100",
        "bytes=-0",
        "bytes=5-2",
        "bytes=0-1,3-4",
        "bytes= 2-3",
        "items=0-1",
        "bytes=",
        "bytes=-",
        "bytes=0-18446744073709551615",
        "bytes=18446744073709551615-",
    ];
    for spec in specs {
        for (m, hdr) in [("GET", "Range"), ("HEAD", "Range"), ("GET", "x-ms-range")] {
            let (d, t) = t_range(&node, &url, m, &[(hdr, spec)]).await;
            eprintln!("{m} {hdr}: {spec}\n  direct {d}\n  tunnel {t}");
            if d != t {
                differ.push(format!("{m} {hdr}: {spec}: direct {d} tunnel {t}"));
            }
        }
    }
    assert!(differ.is_empty(), "{differ:#?}");
}

async fn t_big(node: &Node, mib: usize) -> String {
    let bytes: Vec<u8> = (0..mib << 20).map(|i: usize| (i % 251) as u8).collect();
    assert_eq!(save(node, "big", &bytes).await["ok"], true);
    t_found(node, "big").await
}

/// Starts a GET of `url` on a fresh connection and reads `first` bytes, then stops reading.
async fn t_stalled(url: &str, first: usize) -> tokio::net::TcpStream {
    let rest = url.strip_prefix("http://").unwrap();
    let (authority, target) = rest.split_at(rest.find('/').unwrap());
    let mut tcp = tokio::net::TcpStream::connect(authority).await.unwrap();
    tcp.write_all(format!("GET {target} HTTP/1.1\r\nHost: {authority}\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut got = 0;
    let mut buf = vec![0u8; 8192];
    while got < first {
        let n = tcp.read(&mut buf).await.unwrap();
        assert!(n > 0);
        got += n;
    }
    tcp
}

#[tokio::test]
async fn stopping_the_proxy_cuts_a_direct_download_in_progress() {
    // Bounded as a whole: under load a 64 MiB upload whose last TLS records
    // the client's rustls holds unsent while it reads for the answer can
    // hang this test for over an hour (hence `send` flushes). Any step that
    // never finishes fails it, naming the test, rather than holding the
    // suite.
    tokio::time::timeout(
        std::time::Duration::from_secs(60),
        stopping_the_proxy_cuts_a_direct_download_in_progress_within_a_bound(),
    )
    .await
    .expect("a step of the stop-cuts-a-download test did not finish within 60 s");
}

async fn stopping_the_proxy_cuts_a_direct_download_in_progress_within_a_bound() {
    // ActionsProxy::serve: "each connection in a task of its own, cut when `stop` fires".
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let url = t_big(&node, 64).await;
    let direct = t_stalled(&url, 1024).await;
    // The same download in a tunnel, for comparison.
    let target = url[url.find(BLOB_PREFIX).unwrap()..].to_owned();
    let mut t = tunnel(&node).await;
    t.write_all(&request("GET", &target, &[], b""))
        .await
        .unwrap();
    t.flush().await.unwrap();
    let mut buf = vec![0u8; 8192];
    let _ = t.read(&mut buf).await.unwrap();
    node.stop.cancel();
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let drain = |mut s: tokio::net::TcpStream| async move {
        let mut total = 0usize;
        let mut buf = vec![0u8; 1 << 16];
        let r = tokio::time::timeout(std::time::Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) | Err(_) => return true,
                    Ok(n) => total += n,
                }
            }
        })
        .await;
        (total, r.is_ok())
    };
    let (direct_bytes, direct_closed) = drain(direct).await;
    let mut tunnel_total = 0usize;
    let tunnel_closed = tokio::time::timeout(std::time::Duration::from_secs(5), async {
        loop {
            match t.read(&mut buf).await {
                Ok(0) | Err(_) => return,
                Ok(n) => tunnel_total += n,
            }
        }
    })
    .await
    .is_ok();
    eprintln!(
        "after stop: direct read {direct_bytes} more bytes (of 64 MiB), closed within 5 s: {direct_closed}; \
         tunnel read {tunnel_total}, closed: {tunnel_closed}"
    );
    assert!(
        direct_bytes < 32 << 20,
        "the direct download went on after stop: {direct_bytes} bytes more"
    );
}

#[tokio::test]
async fn a_direct_download_waits_on_no_other_sessions_lock() {
    // direct_download takes no live session's `held` lock: a finalize holds its session's lock
    // across the plane's policy question (up to 2 s).
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = Arc::new(node((up, &up_ca), Arc::default(), scratch()).await);
    save(&node, "k", b"0123456789").await;
    let url = t_found(&node, "k").await;
    let (id, _) = t_parts(&url);
    let target = &url[url.find(BLOB_PREFIX).unwrap()..];
    // Another guest with a reservation it is about to finalize.
    let mut others = Vec::new();
    for n in 0..8 {
        let t = CacheToken::mint().unwrap();
        node.proxy
            .archives()
            .open_session(
                &format!("other-{n}"),
                &t,
                CacheScope::new("octo", "other", REF).unwrap(),
            )
            .await
            .unwrap();
        others.push(t);
    }
    for t in &others {
        let mut tl = tunnel_as(&node, t).await;
        let r = send(
            &mut tl,
            &twirp_as(
                "CreateCacheEntry",
                UA,
                &serde_json::json!({"key": "o", "version": "v1"}),
            ),
        )
        .await;
        let up_url = signed_path(r.json()["signed_upload_url"].as_str().unwrap());
        let mut tl = tunnel_as(&node, t).await;
        let put = send(
            &mut tl,
            &request("PUT", &up_url, &[("x-ms-blob-type", "BlockBlob")], b"abc"),
        )
        .await;
        assert_eq!(put.status, 201);
    }
    let mut victims = Vec::new();
    for n in 0..4 {
        let t = CacheToken::mint().unwrap();
        node.proxy
            .archives()
            .open_session(
                &format!("victim-{n}"),
                &t,
                CacheScope::new("octo", "app", REF).unwrap(),
            )
            .await
            .unwrap();
        let mut tl = tunnel_as(&node, &t).await;
        let r = send(
            &mut tl,
            &twirp_as(
                "GetCacheEntryDownloadURL",
                UA,
                &serde_json::json!({"key": "k", "version": "v1"}),
            ),
        )
        .await;
        victims.push(r.json()["signed_download_url"].as_str().unwrap().to_owned());
    }
    // The plane stalls on the others' finalize questions (hung for < 2 s), then recovers.
    node.policy.set(FakeAnswer::Hang);
    let asked_before = node.policy.asked().len();
    let mut finalizing = Vec::new();
    for t in others.clone() {
        let node = node.clone();
        finalizing.push(tokio::spawn(async move {
            let mut tl = tunnel_as(&node, &t).await;
            send(
                &mut tl,
                &twirp_as(
                    "FinalizeCacheEntryUpload",
                    UA,
                    &serde_json::json!({"key": "o", "version": "v1", "size_bytes": "3"}),
                ),
            )
            .await
            .status
        }));
    }
    while node.policy.asked().len() < asked_before + others.len() {
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    node.policy.set(FakeAnswer::Allow);
    let addr = t_addr(&node);
    let t0 = std::time::Instant::now();
    let in_tunnel = blob(&node, "GET", target, &[], b"").await;
    let tunnel_took = t0.elapsed();
    // Victims: lease-1's URL and those of 4 more guests that looked the key up before.
    let mut urls = vec![url.clone()];
    urls.extend(victims.iter().cloned());
    let mut fetches = Vec::new();
    for u in urls {
        let node = node.clone();
        fetches.push(tokio::spawn(async move {
            let t0 = std::time::Instant::now();
            let r = blob(&node, "GET", &u, &[], b"").await;
            (r.status, t0.elapsed())
        }));
    }
    let t0 = std::time::Instant::now();
    let forged = t_get(&addr, &format!("{BLOB_PREFIX}{id}?sig={}", "0".repeat(64))).await;
    let forged_took = t0.elapsed();
    let mut direct = Vec::new();
    for f in fetches {
        direct.push(f.await.unwrap());
    }
    for f in finalizing {
        let _ = f.await;
    }
    eprintln!(
        "while other guests' finalizes wait on the plane: tunnel download {} in {tunnel_took:?}; \
         direct downloads {direct:?}; forged direct {forged} in {forged_took:?}",
        in_tunnel.status
    );
    let slowest = direct.iter().map(|d| d.1).max().unwrap();
    assert!(
        slowest < std::time::Duration::from_millis(500),
        "a direct download waited {slowest:?} on other guests' locks (tunnel: {tunnel_took:?})"
    );
}

/// A direct download of several frames, whole and then a range across
/// frame boundaries, arrives byte for byte on one keep-alive connection,
/// which then closes as asked.
#[tokio::test]
async fn a_direct_download_arrives_byte_for_byte_whole_and_ranged_on_a_kept_connection() {
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    let archive: Vec<u8> = (0..(3 << 20) + 12_345u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    save(&node, "big", &archive).await;
    let url = t_found(&node, "big").await;
    let addr = t_addr(&node);
    let target = &url[url.find(BLOB_PREFIX).unwrap()..];
    let (from, to) = (1_000_003usize, 2_500_007usize);
    let raw = format!(
        "GET {target} HTTP/1.1\r\nHost: {addr}\r\n\r\n\
         GET {target} HTTP/1.1\r\nHost: {addr}\r\nRange: bytes={from}-{to}\r\nConnection: close\r\n\r\n"
    );
    let (answer, eof) = t_raw(&addr, raw.as_bytes(), std::time::Duration::from_secs(20)).await;
    assert!(eof, "the connection closes after the request that asked");
    let split = |a: &[u8]| {
        let end = a.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
        let head = String::from_utf8_lossy(&a[..end]).to_ascii_lowercase();
        let length: usize = head
            .lines()
            .find_map(|l| l.strip_prefix("content-length: "))
            .unwrap()
            .trim()
            .parse()
            .unwrap();
        (head, end, length)
    };
    let (head, end, length) = split(&answer);
    assert!(head.starts_with("http/1.1 200"), "{head}");
    assert_eq!(length, archive.len());
    assert!(!head.contains("connection: close"), "{head}");
    assert!(
        answer[end..end + length] == archive[..],
        "the whole archive differs"
    );
    let rest = &answer[end + length..];
    let (head, end, length) = split(rest);
    assert!(head.starts_with("http/1.1 206"), "{head}");
    assert!(head.contains("connection: close"), "{head}");
    assert!(
        head.contains(&format!(
            "content-range: bytes {from}-{to}/{}",
            archive.len()
        )),
        "{head}"
    );
    assert_eq!(rest.len(), end + length, "nothing after the range");
    assert!(rest[end..] == archive[from..=to], "the range differs");
}

// ---------------------------------------------------------------------------
// What unfinished uploads may hold, and how slowly they may come.
// ---------------------------------------------------------------------------

/// A reservation's signed upload path for `key`.
async fn reserved(node: &Node, key: &str) -> String {
    let created = call(
        node,
        "CreateCacheEntry",
        serde_json::json!({"key": key, "version": "v1"}),
    )
    .await;
    signed_path(created.json()["signed_upload_url"].as_str().unwrap())
}

/// PUTs `body` to `target` in a fresh tunnel and answers the status: a
/// refusal before the body is read may close the connection while it is
/// still being written, and is read all the same.
async fn put_refusable(node: &Node, target: &str, body: &[u8]) -> u16 {
    let mut t = tunnel(node).await;
    let raw = request("PUT", target, &[], body);
    let _ = t.write_all(&raw).await;
    let _ = t.flush().await;
    let (head, _) = read_message(&mut t).await.expect("an answer");
    head.split(' ').nth(1).unwrap().parse().unwrap()
}

fn limits(budget: Option<u64>, per_session: u64) -> super::staging::StageLimits {
    super::staging::StageLimits {
        budget_bytes: budget,
        per_session_bytes: per_session,
        free_floor_bytes: Some(0),
    }
}

/// Staged blocks count against `--cache-max-bytes` before they are
/// accepted: with a 50 MiB budget, six 8 MiB blocks are taken and the
/// seventh is refused, writing nothing; a session's end gives the room
/// back.
#[tokio::test]
async fn staged_blocks_count_against_the_cache_budget_before_they_are_accepted() {
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    node.proxy
        .archives()
        .set_stage_limits(limits(Some(50 << 20), u64::MAX));
    let path = reserved(&node, "k").await;
    let block = vec![7_u8; 8 << 20];
    let mut statuses = Vec::new();
    for n in 0..7 {
        let target = format!("{path}&comp=block&blockid=YmxvY2s{n}");
        statuses.push(put_refusable(&node, &target, &block).await);
    }
    assert_eq!(statuses, [201, 201, 201, 201, 201, 201, 507]);
    let blocks = super::staging::bytes_under(&node.dir.join("actions").join("uploads"));
    assert_eq!(blocks, 6 * (8 << 20), "the refused block left nothing");
    // Putting a block again replaces it, within the same room.
    let r = blob(
        &node,
        "PUT",
        &format!("{path}&comp=block&blockid=YmxvY2s0"),
        &[],
        &block,
    )
    .await;
    assert_eq!(r.status, 201, "a block put again reuses its own room");
    node.proxy.archives().close("lease-1").await;
    assert_eq!(
        super::staging::bytes_under(&node.dir.join("actions").join("uploads")),
        0
    );
}

/// One session's unfinished uploads are bounded whatever the budget.
#[tokio::test]
async fn one_sessions_staged_uploads_are_bounded() {
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    node.proxy
        .archives()
        .set_stage_limits(limits(None, 20 << 20));
    let first = reserved(&node, "a").await;
    let second = reserved(&node, "b").await;
    let block = vec![1_u8; 8 << 20];
    let put = |path: String| {
        let block = block.clone();
        let node = &node;
        async move { put_refusable(node, &format!("{path}&comp=block&blockid=eA"), &block).await }
    };
    assert_eq!(put(first.clone()).await, 201);
    assert_eq!(put(second.clone()).await, 201);
    let third = reserved(&node, "c").await;
    assert_eq!(put(third).await, 507, "the session's third block is over");
}

/// A body declaring more than an archive may be is refused at once; one
/// that trickles is cut once its rate is judged, not held for minutes.
#[tokio::test]
async fn a_body_declaring_20_gib_is_refused_at_once_and_a_trickling_one_is_cut() {
    let (up, up_ca, _) = fake_upstream(UpstreamMode::KeepAlive).await;
    let node = node((up, &up_ca), Arc::default(), scratch()).await;
    node.proxy
        .archives()
        .set_stage_limits(limits(None, u64::MAX));
    let path = reserved(&node, "k").await;
    let head = |declared: u64| {
        format!(
            "PUT {path}&comp=block&blockid=eA HTTP/1.1\r\nHost: {RESULTS_HOST}\r\nContent-Length: {declared}\r\n\r\n"
        )
    };
    let mut t = tunnel(&node).await;
    t.write_all(head(20 << 30).as_bytes()).await.unwrap();
    t.write_all(&vec![0_u8; 1 << 20]).await.unwrap();
    t.flush().await.unwrap();
    let answered = tokio::time::timeout(std::time::Duration::from_secs(5), read_message(&mut t))
        .await
        .expect("answered at once")
        .expect("an answer");
    assert!(answered.0.contains(" 413 "), "{}", answered.0);

    let mut t = tunnel(&node).await;
    t.write_all(head(64 << 20).as_bytes()).await.unwrap();
    t.flush().await.unwrap();
    let began = std::time::Instant::now();
    let trickle = async {
        loop {
            if t.write_all(&[0_u8; 1024]).await.is_err() || t.flush().await.is_err() {
                return None;
            }
            tokio::select! {
                answer = read_message(&mut t) => return answer,
                () = tokio::time::sleep(std::time::Duration::from_millis(200)) => {}
            }
        }
    };
    let answered = tokio::time::timeout(std::time::Duration::from_secs(30), trickle)
        .await
        .expect("a trickling body was held for more than 30 s");
    let waited = began.elapsed();
    assert!(
        waited >= super::staging::BODY_RATE_GRACE && waited < std::time::Duration::from_secs(15),
        "cut after {waited:?}"
    );
    if let Some((head, _)) = answered {
        assert!(head.contains(" 408 "), "{head}");
    }
    assert_eq!(
        super::staging::bytes_under(&node.dir.join("actions").join("uploads")),
        0,
        "the cut body left nothing"
    );
}
