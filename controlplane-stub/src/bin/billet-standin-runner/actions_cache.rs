//! The guest side of the node's Actions cache proxy (`BILLET_STANDIN_ACTIONS_CACHE`,
//! `BILLET_STANDIN_ACTIONS_ROUNDS`): restore or save a key as `@actions/cache` does, probe
//! the calls the node must splice to GitHub, and report what each call got.

use std::time::Duration;

use base64::Engine as _;

use crate::reports::{Gates, Reporter};

/// The results service's host, which the node's proxy intercepts.
const RESULTS_HOST: &str = "results-receiver.actions.githubusercontent.com";
/// The user agent `@actions/cache` sends.
const ACTIONS_CACHE_UA: &str = "@actions/cache-4.0.3";
/// The Twirp service of the cache.
const CACHE_SERVICE: &str = "/twirp/github.actions.results.api.v1.CacheService/";

/// The guest side of the node's Actions cache proxy (`agent/src/cache/actions/`), as
/// `@actions/cache` speaks to the results service through an HTTPS proxy: each request on a
/// tunnel of its own (`CONNECT` with `Proxy-Authorization: Basic`, then TLS with the results host
/// as server name, trusting the node's CA).
struct ActionsGuest {
    proxy: String,
    auth: String,
    tls: tokio_rustls::TlsConnector,
}

/// One answer: status, head, body.
struct Answered {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answered {
    fn local(&self) -> bool {
        self.head
            .to_ascii_lowercase()
            .contains("x-billet-actions-cache: local")
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }
}

impl ActionsGuest {
    fn from_env() -> Result<Self, String> {
        let url = std::env::var("BILLET_ACTIONS_PROXY")
            .map_err(|_| "no Actions cache proxy: BILLET_ACTIONS_PROXY is unset".to_owned())?;
        let ca_file = std::env::var("BILLET_ACTIONS_CA_FILE")
            .map_err(|_| "BILLET_ACTIONS_CA_FILE is unset".to_owned())?;
        let rest = url
            .strip_prefix("http://")
            .ok_or("the proxy URL is not http://")?;
        let (userinfo, proxy) = rest
            .rsplit_once('@')
            .ok_or("the proxy URL has no userinfo")?;
        let pem = std::fs::read(&ca_file).map_err(|e| format!("{ca_file}: {e}"))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile_certs(&pem) {
            roots.add(cert).map_err(|e| format!("{ca_file}: {e}"))?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            proxy: proxy.trim_end_matches('/').to_owned(),
            auth: base64::engine::general_purpose::STANDARD.encode(userinfo),
            tls: tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)),
        })
    }

    /// Sends `method path` with `headers` and `body` on a fresh tunnel.
    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answered, String> {
        use tokio::io::AsyncWriteExt as _;
        let mut tcp = tokio::net::TcpStream::connect(&self.proxy)
            .await
            .map_err(|e| format!("connect {}: {e}", self.proxy))?;
        tcp.write_all(
            format!(
                "CONNECT {RESULTS_HOST}:443 HTTP/1.1\r\nHost: {RESULTS_HOST}:443\r\nProxy-Authorization: Basic {}\r\n\r\n",
                self.auth
            )
            .as_bytes(),
        )
        .await
        .map_err(|e| format!("CONNECT: {e}"))?;
        let (head, _) = read_http(&mut tcp).await?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!(
                "CONNECT refused: {}",
                head.lines().next().unwrap_or("")
            ));
        }
        let name =
            rustls::pki_types::ServerName::try_from(RESULTS_HOST).map_err(|e| e.to_string())?;
        let mut tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        exchange(&mut tls, RESULTS_HOST, method, path, headers, body).await
    }

    /// Sends `method` to a signed URL as `@actions/cache`'s HTTP client does: one on the results
    /// host in a tunnel ([`Self::send`]); an `http://` one (the node's listener) straight to the
    /// host it names, with no proxy (the job sets an HTTPS proxy only).
    async fn fetch(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answered, String> {
        if let Some(path) = url.strip_prefix(&format!("https://{RESULTS_HOST}")) {
            return self.send(method, path, headers, body).await;
        }
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("a signed URL neither on the results host nor http: {url}"))?;
        let (authority, target) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let mut tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("connect {authority}: {e}"))?;
        exchange(&mut tcp, authority, method, target, headers, body).await
    }

    async fn twirp(
        &self,
        method: &str,
        ua: &str,
        json: &serde_json::Value,
    ) -> Result<Answered, String> {
        self.send(
            "POST",
            &format!("{CACHE_SERVICE}{method}"),
            &[
                ("Content-Type", "application/json"),
                ("User-Agent", ua),
                ("Authorization", "Bearer runtime-token"),
            ],
            json.to_string().as_bytes(),
        )
        .await
    }
}

fn rustls_pemfile_certs(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect()
}

/// Writes one HTTP/1.1 request (`method target`, `Host: host`, `headers`, a `Content-Length`
/// body) to `s` and reads its answer.
async fn exchange<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    host: &str,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Answered, String> {
    use tokio::io::AsyncWriteExt as _;
    let mut raw = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(raw.as_bytes())
        .await
        .map_err(|e| format!("send: {e}"))?;
    s.write_all(body).await.map_err(|e| format!("send: {e}"))?;
    s.flush().await.map_err(|e| format!("send: {e}"))?;
    let (head, body) = read_http(s).await?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status line")?;
    Ok(Answered { status, head, body })
}

/// Reads one HTTP/1.1 message's head and `Content-Length` body.
async fn read_http<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
) -> Result<(String, Vec<u8>), String> {
    use tokio::io::AsyncReadExt as _;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut byte))
            .await
            .map_err(|_| "no answer within 60 s".to_owned())?
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("the connection closed before an answer".into());
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
    s.read_exact(&mut body)
        .await
        .map_err(|e| format!("read the body: {e}"))?;
    Ok((head, body))
}

/// The payload a save of `key` uploads, so a restore can check what it got.
fn actions_payload(key: &str) -> Vec<u8> {
    format!("billet actions cache payload of {key}").into_bytes()
}

/// Restores `key` through the node's proxy, or saves it when missing; then probes two calls the
/// node must splice to GitHub. Everything is reported (`BILLET_STANDIN_ACTIONS_CACHE`).
pub(crate) async fn actions_cache(
    key: &str,
    rounds: u32,
    gates: Option<&Gates>,
    reporter: &Reporter,
) {
    let guest = match ActionsGuest::from_env() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("billet-standin-runner: actions cache: {e}");
            reporter
                .report("actions", serde_json::json!({ "error": e }))
                .await;
            return;
        }
    };
    let outcome: Result<(), String> = async {
        let payload = actions_payload(key);
        let found = guest
            .twirp(
                "GetCacheEntryDownloadURL",
                ACTIONS_CACHE_UA,
                &serde_json::json!({"key": key, "restore_keys": [key], "version": "v1"}),
            )
            .await?;
        let answer = found.json();
        if answer["ok"] == true {
            let url = answer["signed_download_url"].as_str().unwrap_or_default();
            let range = guest.fetch("GET", url, &[("Range", "bytes=2-8")], b"").await?;
            let whole = guest.fetch("GET", url, &[], b"").await?;
            eprintln!("billet-standin-runner: actions cache restored {key} ({} bytes)", whole.body.len());
            reporter
                .report(
                    "actions-restore",
                    serde_json::json!({
                        "hit": true,
                        "matched_key": answer["matched_key"],
                        "local": found.local() && range.local() && whole.local(),
                        "range_status": range.status,
                        "range": String::from_utf8_lossy(&range.body),
                        "whole_matches": whole.body == payload,
                        "direct": url.starts_with("http://"),
                    }),
                )
                .await;
        } else {
            let created = guest
                .twirp(
                    "CreateCacheEntry",
                    ACTIONS_CACHE_UA,
                    &serde_json::json!({"key": key, "version": "v1"}),
                )
                .await?;
            let url = created.json()["signed_upload_url"]
                .as_str()
                .ok_or_else(|| format!("no upload URL: {}", String::from_utf8_lossy(&created.body)))?
                .to_owned();
            let put = guest
                .fetch("PUT", &url, &[("x-ms-blob-type", "BlockBlob")], &payload)
                .await?;
            let finalized = guest
                .twirp(
                    "FinalizeCacheEntryUpload",
                    ACTIONS_CACHE_UA,
                    &serde_json::json!({"key": key, "version": "v1", "size_bytes": payload.len().to_string()}),
                )
                .await?;
            eprintln!("billet-standin-runner: actions cache saved {key}");
            reporter
                .report(
                    "actions-save",
                    serde_json::json!({
                        "hit": false,
                        "local": found.local() && created.local() && put.local() && finalized.local(),
                        "put_status": put.status,
                        "ok": finalized.json()["ok"],
                    }),
                )
                .await;
        }
        let artifact = guest
            .send(
                "POST",
                "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact",
                &[
                    ("Content-Type", "application/json"),
                    ("User-Agent", "@actions/artifact-2.1.0"),
                    ("Authorization", "Bearer runtime-token"),
                ],
                b"{\"name\":\"logs\"}",
            )
            .await?;
        let buildkit = guest
            .twirp(
                "CreateCacheEntry",
                "buildkit/v0.20",
                &serde_json::json!({"key": key, "version": "v1"}),
            )
            .await?;
        reporter
            .report(
                "actions-probe",
                serde_json::json!({
                    "artifact_status": artifact.status,
                    "artifact_local": artifact.local(),
                    "buildkit_status": buildkit.status,
                    "buildkit_local": buildkit.local(),
                }),
            )
            .await;
        if rounds > 0 {
            let gates = gates.ok_or("BILLET_STANDIN_ACTIONS_ROUNDS needs BILLET_STANDIN_GATES")?;
            actions_rounds(&guest, key, rounds, gates, reporter).await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = outcome {
        eprintln!("billet-standin-runner: actions cache: {e}");
        reporter
            .report("actions", serde_json::json!({ "error": e }))
            .await;
    }
}

/// The signed URL the node answered in `field` of `answer`, if any.
fn blob_url(answer: &Answered, field: &str) -> Option<String> {
    answer.json()[field].as_str().map(str::to_owned)
}

/// `BILLET_STANDIN_ACTIONS_ROUNDS`: holds a download URL of `key` and an upload URL of
/// `<key>-held`, then calls on them again in each of `rounds` rounds, each after its gate opens,
/// and finally finalizes `<key>-held`; everything reported (the module doc).
async fn actions_rounds(
    guest: &ActionsGuest,
    key: &str,
    rounds: u32,
    gates: &Gates,
    reporter: &Reporter,
) -> Result<(), String> {
    let payload = actions_payload(key);
    let held_key = format!("{key}-held");
    let held_payload = actions_payload(&held_key);
    let lookup = serde_json::json!({"key": key, "restore_keys": [], "version": "v1"});
    let found = guest
        .twirp("GetCacheEntryDownloadURL", ACTIONS_CACHE_UA, &lookup)
        .await?;
    let created = guest
        .twirp(
            "CreateCacheEntry",
            ACTIONS_CACHE_UA,
            &serde_json::json!({"key": held_key, "version": "v1"}),
        )
        .await?;
    reporter
        .report(
            "actions-held",
            serde_json::json!({
                "lookup_ok": found.json()["ok"] == true,
                "lookup_local": found.local(),
                "create_ok": created.json()["ok"] == true,
                "create_local": created.local(),
            }),
        )
        .await;
    let download = blob_url(&found, "signed_download_url").ok_or_else(|| {
        format!(
            "no download URL to hold: {}",
            String::from_utf8_lossy(&found.body)
        )
    })?;
    let upload = blob_url(&created, "signed_upload_url").ok_or_else(|| {
        format!(
            "no upload URL to hold: {}",
            String::from_utf8_lossy(&created.body)
        )
    })?;
    for round in 1..=rounds {
        gates.wait(&format!("actions-round-{round}")).await?;
        let got = guest.fetch("GET", &download, &[], b"").await?;
        let put = guest
            .fetch(
                "PUT",
                &upload,
                &[("x-ms-blob-type", "BlockBlob")],
                &held_payload,
            )
            .await?;
        let looked = guest
            .twirp("GetCacheEntryDownloadURL", ACTIONS_CACHE_UA, &lookup)
            .await?;
        eprintln!(
            "billet-standin-runner: actions cache round {round}: download {}, upload {}, lookup {}",
            got.status, put.status, looked.status
        );
        reporter
            .report(
                "actions-round",
                serde_json::json!({
                    "round": round,
                    "download_status": got.status,
                    "download_local": got.local(),
                    "download_matches": got.body == payload,
                    "upload_status": put.status,
                    "upload_local": put.local(),
                    "lookup_status": looked.status,
                    "lookup_local": looked.local(),
                    "lookup_ok": looked.json()["ok"] == true,
                }),
            )
            .await;
    }
    let finalized = guest
        .twirp(
            "FinalizeCacheEntryUpload",
            ACTIONS_CACHE_UA,
            &serde_json::json!({"key": held_key, "version": "v1", "size_bytes": held_payload.len().to_string()}),
        )
        .await?;
    reporter
        .report(
            "actions-finalize",
            serde_json::json!({
                "status": finalized.status,
                "local": finalized.local(),
                "ok": finalized.json()["ok"] == true,
            }),
        )
        .await;
    Ok(())
}
