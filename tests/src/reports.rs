//! A sink for what guests report, owned by a test: a plain HTTP/1 server on
//! loopback that keeps every JSON object POSTed to it, for tests that must
//! know what a guest saw or was told without reading its container's output
//! (a container the node removes under load can take unread log lines with
//! it; a report is acknowledged before the guest goes on).
//!
//! The stand-in runner reports there when its tier's environment names the
//! sink (`BILLET_STANDIN_REPORT=<url>`, [`GuestReports::env`]; see
//! `controlplane-stub/src/bin/billet-standin-runner/`): one object per
//! report, each with its `runner` (the runner's name) and `seq` (its place
//! among that runner's reports, from 0), sent again until answered 2xx. The
//! sink answers `204 No Content` once it has kept the object, and keeps a
//! report sent again (the same runner and `seq`) once. Anything else is
//! `400` (not a JSON object with `runner` and `seq`) or `404` (neither
//! `POST /reports` nor `GET /gates/<name>`).
//!
//! The sink also holds **gates**, the signals a guest waits for between
//! two steps ("call, wait for a signal, call again"): the stand-in asks
//! `GET /gates/<name>` (`BILLET_STANDIN_GATES=<url>/gates`,
//! [`GuestReports::gates_env`]) until it answers `204 No Content`, which it
//! does once the test called [`GuestReports::open`]; before that it answers
//! `409 Conflict`.
//!
//! The sink listens on `127.0.0.1`, where the scale-set emulator listens
//! too: a cluster's runners use the host's network (`ClusterOptions`' tier),
//! so they reach it where they reach GitHub.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result};
use http_body_util::{BodyExt as _, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// The most a report may weigh, in bytes.
const MAX_REPORT_BYTES: usize = 64 * 1024;

#[derive(Debug, Default)]
struct Kept {
    /// In the order received.
    reports: Vec<serde_json::Value>,
    /// `(runner, seq)` of every report kept.
    seen: HashSet<(String, u64)>,
    /// The gates opened.
    open: HashSet<String>,
}

/// The sink; stops when dropped.
#[derive(Debug)]
pub struct GuestReports {
    addr: SocketAddr,
    kept: Arc<Mutex<Kept>>,
    stop: CancellationToken,
}

impl Drop for GuestReports {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl GuestReports {
    /// Serves on a free port of `127.0.0.1`.
    ///
    /// # Errors
    ///
    /// The port cannot be bound.
    pub async fn start() -> Result<Self> {
        Self::start_on(std::net::Ipv4Addr::LOCALHOST.into()).await
    }

    /// Serves on a free port of `ip` (Docker's bridge gateway, for runners
    /// that do not share the host's network).
    ///
    /// # Errors
    ///
    /// The port cannot be bound.
    pub async fn start_on(ip: std::net::IpAddr) -> Result<Self> {
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .await
            .context("bind the guest report sink")?;
        let addr = listener.local_addr()?;
        let kept = Arc::new(Mutex::new(Kept::default()));
        let stop = CancellationToken::new();
        let serving = Arc::clone(&kept);
        crate::loopback::serve_http1(listener, stop.clone(), move |req| {
            let kept = Arc::clone(&serving);
            async move { receive(&kept, req).await }
        });
        Ok(Self { addr, kept, stop })
    }

    /// Where the sink listens.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL reports are POSTed to.
    pub fn url(&self) -> String {
        format!("http://{}/reports", self.addr)
    }

    /// The tier environment entry that names the sink to the stand-in
    /// (`BILLET_STANDIN_REPORT=<url>`), for `ClusterOptions::tier_env`.
    pub fn env(&self) -> String {
        format!("BILLET_STANDIN_REPORT={}", self.url())
    }

    /// The tier environment entry that names the sink's gates to the
    /// stand-in (`BILLET_STANDIN_GATES=<url>`), for `ClusterOptions::tier_env`.
    pub fn gates_env(&self) -> String {
        format!("BILLET_STANDIN_GATES=http://{}/gates", self.addr)
    }

    /// Opens the gate `name`: from now on a guest waiting at it goes on.
    pub fn open(&self, name: &str) {
        self.kept
            .lock()
            .expect("reports")
            .open
            .insert(name.to_owned());
    }

    /// Every report kept so far, in the order received.
    pub fn all(&self) -> Vec<serde_json::Value> {
        self.kept.lock().expect("reports").reports.clone()
    }

    /// The reports whose `report` field is `kind`, in the order received.
    pub fn of(&self, kind: &str) -> Vec<serde_json::Value> {
        self.all()
            .into_iter()
            .filter(|r| r["report"] == kind)
            .collect()
    }

    /// Waits until at least `n` reports of `kind` are kept, and returns
    /// them in the order received.
    ///
    /// # Errors
    ///
    /// When `timeout` passes first, with every report kept.
    pub async fn wait_for(
        &self,
        kind: &str,
        n: usize,
        timeout: Duration,
    ) -> Result<Vec<serde_json::Value>> {
        crate::cluster::wait_until(timeout, &format!("{n} guest reports of {kind}"), || {
            self.of(kind).len() >= n
        })
        .await
        .with_context(|| format!("the guests reported: {:#?}", self.all()))?;
        Ok(self.of(kind))
    }
}

async fn receive(kept: &Mutex<Kept>, req: Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: &str| {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body.to_owned())))
            .expect("a response")
    };
    if req.method() == Method::GET
        && let Some(gate) = req.uri().path().strip_prefix("/gates/")
    {
        return if kept.lock().expect("reports").open.contains(gate) {
            reply(StatusCode::NO_CONTENT, "")
        } else {
            reply(StatusCode::CONFLICT, "the gate is closed")
        };
    }
    if req.method() != Method::POST || req.uri().path() != "/reports" {
        return reply(
            StatusCode::NOT_FOUND,
            "only POST /reports and GET /gates/<name>",
        );
    }
    let Ok(body) = Limited::new(req.into_body(), MAX_REPORT_BYTES)
        .collect()
        .await
        .map(|b| b.to_bytes())
    else {
        return reply(StatusCode::BAD_REQUEST, "unreadable or too large a body");
    };
    let Ok(report) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return reply(StatusCode::BAD_REQUEST, "not JSON");
    };
    let (Some(runner), Some(seq)) = (report["runner"].as_str(), report["seq"].as_u64()) else {
        return reply(StatusCode::BAD_REQUEST, "a report names its runner and seq");
    };
    let mut kept = kept.lock().expect("reports");
    if kept.seen.insert((runner.to_owned(), seq)) {
        kept.reports.push(report);
    }
    reply(StatusCode::NO_CONTENT, "")
}
