//! A fake of the EC2 instance-metadata service's spot notice, on loopback,
//! for the node's spot-interruption watcher
//! (`agent/src/node/interruption.rs`). It speaks IMDSv2 as EC2 does:
//!
//! - `PUT /latest/api/token` with `X-aws-ec2-metadata-token-ttl-seconds`
//!   between 1 and 21600 answers a fresh session token (400 without it);
//! - `GET /latest/meta-data/spot/instance-action` with a valid
//!   `X-aws-ec2-metadata-token` answers 404 while no notice stands and 200
//!   `{"action": .., "time": ..}` once one does; a missing or unknown token
//!   is 401;
//! - anything else is 404.
//!
//! A test posts and withdraws the notice, revokes tokens, and reads how
//! many requests of each kind it served.

use std::collections::HashSet;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result};
use http_body_util::Full;
use hyper::body::{Bytes, Incoming};
use hyper::{Method, Request, Response, StatusCode};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// What the fake has served, by kind.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Served {
    /// Token requests answered with a token.
    pub tokens: usize,
    /// Notice reads with a valid token (404 or 200).
    pub notices: usize,
    /// Requests refused 401 (no or unknown token).
    pub unauthorized: usize,
}

#[derive(Debug, Default)]
struct State {
    notice: Option<(String, String)>,
    tokens: HashSet<String>,
    served: Served,
}

/// The fake service; stops when dropped.
#[derive(Debug)]
pub struct FakeImds {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    stop: CancellationToken,
}

impl Drop for FakeImds {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

impl FakeImds {
    /// Serves on a free loopback port.
    ///
    /// # Errors
    ///
    /// The port cannot be bound.
    pub async fn start() -> Result<Self> {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .context("bind the fake IMDS")?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let stop = CancellationToken::new();
        let serving = Arc::clone(&state);
        crate::loopback::serve_http1(listener, stop.clone(), move |req| {
            let response = answer(&serving, &req);
            async move { response }
        });
        Ok(Self { addr, state, stop })
    }

    /// The base URL a node is given (`--spot-imds`).
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// EC2 decides: a notice with `action` (`terminate`, `stop`,
    /// `hibernate`) stands from now on.
    pub fn post(&self, action: &str) {
        self.state.lock().expect("imds").notice =
            Some((action.to_owned(), "2026-12-01T20:00:00Z".to_owned()));
    }

    /// The notice is gone.
    pub fn withdraw(&self) {
        self.state.lock().expect("imds").notice = None;
    }

    /// Every session token stops working, as when their lifetime ends.
    pub fn revoke_tokens(&self) {
        self.state.lock().expect("imds").tokens.clear();
    }

    /// What has been served so far.
    pub fn served(&self) -> Served {
        self.state.lock().expect("imds").served
    }
}

fn answer(state: &Mutex<State>, req: &Request<Incoming>) -> Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: String| {
        Response::builder()
            .status(status)
            .body(Full::new(Bytes::from(body)))
            .expect("a response")
    };
    let mut s = state.lock().expect("imds");
    match (req.method(), req.uri().path()) {
        (&Method::PUT, "/latest/api/token") => {
            let ttl = req
                .headers()
                .get("x-aws-ec2-metadata-token-ttl-seconds")
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u32>().ok());
            if !ttl.is_some_and(|t| (1..=21_600).contains(&t)) {
                return reply(StatusCode::BAD_REQUEST, String::new());
            }
            let token = uuid::Uuid::new_v4().simple().to_string();
            s.tokens.insert(token.clone());
            s.served.tokens += 1;
            reply(StatusCode::OK, token)
        }
        (&Method::GET, "/latest/meta-data/spot/instance-action") => {
            let known = req
                .headers()
                .get("x-aws-ec2-metadata-token")
                .and_then(|v| v.to_str().ok())
                .is_some_and(|t| s.tokens.contains(t));
            if !known {
                s.served.unauthorized += 1;
                return reply(StatusCode::UNAUTHORIZED, String::new());
            }
            s.served.notices += 1;
            match &s.notice {
                None => reply(StatusCode::NOT_FOUND, String::new()),
                Some((action, time)) => reply(
                    StatusCode::OK,
                    serde_json::json!({ "action": action, "time": time }).to_string(),
                ),
            }
        }
        _ => reply(StatusCode::NOT_FOUND, String::new()),
    }
}
