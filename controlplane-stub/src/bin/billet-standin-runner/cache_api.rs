//! The guest side of the node's cache API (`BILLET_CACHE_ENDPOINT`, `BILLET_CACHE_TOKEN`):
//! the sticky disks mounted and committed, and the Docker image store's guest agent.

use std::time::Duration;

use crate::reports::Reporter;

/// The guest side of the node's cache API (`agent/src/cache/session.rs`), as the reference's
/// `stickydisk` action uses it (spec/cache.md §2.6): the credentials from the environment
/// (`BILLET_CACHE_ENDPOINT`, `unix:<socket>`, and `BILLET_CACHE_TOKEN`); at the job's start what
/// was mounted (`GET /v1/volumes`, `cache-hit` = not cold); after its last write a commit of
/// each disk with the job's status (`POST /v1/volumes/{slot}/commit`). Every answer is said on
/// stderr (`cache volume ...`, `cache commit slot N key K: told {...}`), never the token; a
/// failure is said and the job goes on cold.
pub(crate) struct CacheGuest {
    socket: std::path::PathBuf,
    token: String,
}

impl CacheGuest {
    pub(crate) fn from_env() -> Option<Self> {
        let endpoint = std::env::var("BILLET_CACHE_ENDPOINT").ok()?;
        let token = std::env::var("BILLET_CACHE_TOKEN").ok()?;
        let Some(socket) = endpoint.strip_prefix("unix:") else {
            eprintln!(
                "billet-standin-runner: cache endpoint {endpoint:?} is not unix:<path>; going on cold"
            );
            return None;
        };
        Some(Self {
            socket: socket.into(),
            token,
        })
    }

    /// One request; the status and the JSON body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: &str,
    ) -> Result<(u16, serde_json::Value), String> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|e| format!("connect {}: {e}", self.socket.display()))?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: billet-cache\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.token,
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(780), stream.read_to_end(&mut answer))
            .await
            .map_err(|_| "no answer within 13 minutes".to_owned())?
            .map_err(|e| format!("read: {e}"))?;
        let answer = String::from_utf8_lossy(&answer);
        let (head, body) = answer.split_once("\r\n\r\n").ok_or("a truncated answer")?;
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or("no status line")?;
        let json = serde_json::from_str(body).map_err(|e| format!("not JSON ({e}): {body}"))?;
        Ok((status, json))
    }

    /// What was mounted (`GET /v1/volumes`): the answer's `volumes`, or why there is none.
    async fn volumes(&self) -> Result<Vec<serde_json::Value>, String> {
        match self.call("GET", "/v1/volumes", "").await? {
            (200, json) => Ok(json["volumes"].as_array().cloned().unwrap_or_default()),
            (status, json) => Err(format!("status {status}: {json}")),
        }
    }

    /// Says what was mounted, on stderr and to `reporter`: each volume with `cache-hit` (not
    /// cold and not a fallback), as the reference's action sets its output.
    pub(crate) async fn mounted(&self, reporter: Option<&Reporter>) {
        let report = match self.volumes().await {
            Ok(volumes) => {
                let volumes: Vec<serde_json::Value> = volumes
                    .iter()
                    .filter(|v| v["docker"] != true)
                    .map(|v| {
                        let fallback = v["fallback"].as_bool().unwrap_or(false);
                        let hit = !v["cold"].as_bool().unwrap_or(true) && !fallback;
                        eprintln!(
                            "billet-standin-runner: cache volume slot {} key {} at {}: generation {} cache-hit {hit} fallback {fallback}",
                            v["slot"], v["key"], v["path"], v["generation"],
                        );
                        serde_json::json!({
                            "slot": v["slot"],
                            "key": v["key"],
                            "path": v["path"],
                            "generation": v["generation"],
                            "cache_hit": hit,
                            "fallback": fallback,
                        })
                    })
                    .collect();
                serde_json::json!({ "volumes": volumes })
            }
            Err(e) => {
                eprintln!("billet-standin-runner: cache volumes: {e}; going on cold");
                serde_json::json!({ "error": e })
            }
        };
        if let Some(reporter) = reporter {
            reporter.report("mounted", report).await;
        }
    }

    /// The guest agent's start (`BILLET_STANDIN_DOCKER_STORE`): asks for the Docker image store
    /// with this machine's architecture, then counts the stand-in "images" on it; reports both.
    pub(crate) async fn docker_store(&self, reporter: Option<&Reporter>) {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        let body = serde_json::json!({ "architecture": arch }).to_string();
        let mut report = match self.call("POST", "/v1/docker-store", &body).await {
            Ok((status, answer)) => {
                eprintln!("billet-standin-runner: docker store: status {status} {answer}");
                serde_json::json!({ "status": status, "answer": answer })
            }
            Err(e) => {
                eprintln!("billet-standin-runner: docker store: {e}");
                serde_json::json!({ "error": e })
            }
        };
        let images = std::path::Path::new(DOCKER_IMAGES);
        let found = std::fs::read_to_string(images)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        match std::fs::write(images, format!("{}\n", found + 1)) {
            Ok(()) => eprintln!("billet-standin-runner: images {found} -> {}", found + 1),
            Err(e) => eprintln!("billet-standin-runner: images: cannot write {DOCKER_IMAGES}: {e}"),
        }
        report["images_found"] = found.into();
        if let Some(reporter) = reporter {
            reporter.report("docker-store", report).await;
        }
    }

    /// The guest agent's end, once the job is completed: says the image store is ready with a
    /// clean-unmount proof, asking again every 100 ms while the node answers 409 (settlement not
    /// open yet), for at most `wait`; reports the last answer.
    pub(crate) async fn docker_ready(&self, wait: Duration, reporter: Option<&Reporter>) {
        let proof = serde_json::json!({
            "filesystem": { "type": "dir", "uuid": uuid_of_store(), "clean": true }
        })
        .to_string();
        let deadline = tokio::time::Instant::now() + wait;
        let report = loop {
            let answer = self.call("POST", "/v1/docker-store/ready", &proof).await;
            match answer {
                Ok((409, _)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok((status, answer)) => {
                    eprintln!(
                        "billet-standin-runner: docker store ready: status {status} {answer}"
                    );
                    break serde_json::json!({ "status": status, "answer": answer });
                }
                Err(e) => {
                    eprintln!("billet-standin-runner: docker store ready: {e}");
                    break serde_json::json!({ "error": e });
                }
            }
        };
        if let Some(reporter) = reporter {
            reporter.report("docker-ready", report).await;
        }
    }

    /// Commits each mounted volume with the job's status, saying what it was told on stderr
    /// and to `reporter`.
    pub(crate) async fn commit(&self, succeeded: bool, reporter: Option<&Reporter>) {
        let job_status = if succeeded { "success" } else { "failure" };
        let volumes = match self.volumes().await {
            Ok(volumes) => volumes,
            Err(e) => {
                eprintln!("billet-standin-runner: cache volumes: {e}; committing nothing");
                if let Some(reporter) = reporter {
                    reporter
                        .report("commit", serde_json::json!({ "error": e }))
                        .await;
                }
                return;
            }
        };
        // The image store is the guest agent's, never the sticky-disk action's.
        for v in volumes.into_iter().filter(|v| v["docker"] != true) {
            let slot = &v["slot"];
            let body = serde_json::json!({ "job_status": job_status }).to_string();
            let report = match self
                .call("POST", &format!("/v1/volumes/{slot}/commit"), &body)
                .await
            {
                Ok((status, told)) => {
                    eprintln!(
                        "billet-standin-runner: cache commit slot {slot} key {}: status {status} told {told}",
                        v["key"]
                    );
                    serde_json::json!({ "slot": slot, "key": v["key"], "status": status, "told": told })
                }
                Err(e) => {
                    eprintln!("billet-standin-runner: cache commit slot {slot}: {e}");
                    serde_json::json!({ "slot": slot, "key": v["key"], "error": e })
                }
            };
            if let Some(reporter) = reporter {
                reporter.report("commit", report).await;
            }
        }
    }
}

/// The stand-in "images" counter on the Docker image store.
const DOCKER_IMAGES: &str = "/var/lib/docker/billet-standin-images";

/// An identifier for the image store's "filesystem" (a directory here): this process's id and
/// the time, which is all the proof's `uuid` needs to be.
fn uuid_of_store() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("standin-{}-{nanos:x}", std::process::id())
}
