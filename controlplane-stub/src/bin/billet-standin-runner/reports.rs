//! A test's sink (`tests/src/reports.rs`): reports of what the node told the runner
//! ([`Reporter`], `BILLET_STANDIN_REPORT`), and gates the runner waits at ([`Gates`],
//! `BILLET_STANDIN_GATES`).

use std::time::Duration;

use crate::chain;

/// How long one report is sent again before the runner gives up on it.
const REPORT_RETRY_FOR: Duration = Duration::from_secs(60);
/// How long the runner waits for a gate to open before it gives up on it.
const GATE_WAIT: Duration = Duration::from_secs(120);
/// How often a closed gate is asked again.
const GATE_POLL: Duration = Duration::from_millis(100);

/// Where the runner waits for a test's signals (`BILLET_STANDIN_GATES`): the gate `NAME` is
/// open once `GET <base>/NAME` answers 2xx.
pub(crate) struct Gates {
    http: reqwest::Client,
    base: String,
}

impl Gates {
    pub(crate) fn new(http: reqwest::Client, base: &str) -> Self {
        Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    /// Waits until the gate `name` is open, asking every [`GATE_POLL`], for at most
    /// [`GATE_WAIT`].
    pub(crate) async fn wait(&self, name: &str) -> Result<(), String> {
        let deadline = tokio::time::Instant::now() + GATE_WAIT;
        eprintln!("billet-standin-runner: waiting at gate {name}");
        loop {
            let asked = self.http.get(format!("{}/{name}", self.base)).send().await;
            if asked.is_ok_and(|r| r.status().is_success()) {
                return Ok(());
            }
            if tokio::time::Instant::now() >= deadline {
                return Err(format!(
                    "the gate {name} did not open within {} s",
                    GATE_WAIT.as_secs()
                ));
            }
            tokio::time::sleep(GATE_POLL).await;
        }
    }
}

/// Where the runner reports what its node's cache API told it (`BILLET_STANDIN_REPORT`, a test's
/// sink: `tests/src/reports.rs`). Each report is one JSON object POSTed there, with `report` (its
/// kind), `runner` (the runner's name) and `seq` (its place among this runner's reports, from 0,
/// so a sink keeps a report sent twice once). It is sent again, with exponential backoff, until
/// the sink answers 2xx, for at most [`REPORT_RETRY_FOR`]; [`Reporter::report`] returns only
/// then, so the runner never goes on (nor exits) with a report unacknowledged. One given up on is
/// said on stderr, and the job goes on. No report carries a credential.
pub(crate) struct Reporter {
    http: reqwest::Client,
    url: String,
    runner: String,
    seq: std::sync::atomic::AtomicU64,
}

impl Reporter {
    pub(crate) fn new(http: reqwest::Client, url: &str, runner: &str) -> Self {
        Self {
            http,
            url: url.to_owned(),
            runner: runner.to_owned(),
            seq: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Reports `fields` (a JSON object) as a report of `kind`, until acknowledged or
    /// [`REPORT_RETRY_FOR`] has passed.
    pub(crate) async fn report(&self, kind: &str, mut fields: serde_json::Value) {
        use backon::BackoffBuilder as _;
        let seq = self.seq.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        fields["report"] = kind.into();
        fields["runner"] = self.runner.clone().into();
        fields["seq"] = seq.into();
        let mut delays = backon::ExponentialBuilder::default()
            .with_min_delay(Duration::from_millis(50))
            .with_max_delay(Duration::from_secs(2))
            .with_factor(2.0)
            .with_jitter()
            .without_max_times()
            .with_total_delay(Some(REPORT_RETRY_FOR))
            .build();
        loop {
            let error = match self.http.post(&self.url).json(&fields).send().await {
                Ok(response) if response.status().is_success() => return,
                Ok(response) => format!("status {}", response.status()),
                Err(e) => chain(&e),
            };
            let Some(delay) = delays.next() else {
                eprintln!(
                    "billet-standin-runner: report {kind} {seq} to {}: {error}; given up after {} s",
                    self.url,
                    REPORT_RETRY_FOR.as_secs()
                );
                return;
            };
            tokio::time::sleep(delay).await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink on loopback that answers the first `refusals` requests 503 and the rest 204,
    /// keeping every body it received.
    async fn sink(refusals: usize) -> (String, std::sync::Arc<std::sync::Mutex<Vec<String>>>) {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}/reports", listener.local_addr().unwrap());
        let bodies = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = bodies.clone();
        tokio::spawn(async move {
            let mut served = 0;
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                let mut request = Vec::new();
                let mut buf = [0_u8; 4096];
                // One request per connection: read the head, then its body.
                let body = loop {
                    let n = stream.read(&mut buf).await.unwrap();
                    assert!(n > 0, "the request ended early");
                    request.extend_from_slice(&buf[..n]);
                    let text = String::from_utf8_lossy(&request).to_string();
                    if let Some((head, body)) = text.split_once("\r\n\r\n") {
                        let length: usize = head
                            .lines()
                            .find_map(|l| {
                                l.to_ascii_lowercase()
                                    .strip_prefix("content-length: ")
                                    .map(str::to_owned)
                            })
                            .and_then(|l| l.trim().parse().ok())
                            .unwrap_or(0);
                        if body.len() >= length {
                            break body.to_owned();
                        }
                    }
                };
                kept.lock().unwrap().push(body);
                let status = if served < refusals {
                    "503 Service Unavailable"
                } else {
                    "204 No Content"
                };
                served += 1;
                stream
                    .write_all(
                        format!(
                            "HTTP/1.1 {status}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
                        )
                        .as_bytes(),
                    )
                    .await
                    .unwrap();
            }
        });
        (url, bodies)
    }

    #[tokio::test]
    async fn a_report_is_sent_again_until_the_sink_acknowledges_it_and_only_then_returns() {
        let (url, bodies) = sink(2).await;
        let reporter = Reporter::new(reqwest::Client::new(), &url, "billet-7");
        reporter
            .report(
                "commit",
                serde_json::json!({ "slot": 0, "told": { "outcome": "committed" } }),
            )
            .await;
        // Refused twice, then acknowledged: three sends of the same report, and no more.
        let sent: Vec<serde_json::Value> = bodies
            .lock()
            .unwrap()
            .iter()
            .map(|b| serde_json::from_str(b).unwrap())
            .collect();
        let expected = serde_json::json!({
            "report": "commit", "runner": "billet-7", "seq": 0,
            "slot": 0, "told": { "outcome": "committed" }
        });
        assert_eq!(sent, vec![expected.clone(), expected.clone(), expected]);
        reporter
            .report("mounted", serde_json::json!({ "volumes": [] }))
            .await;
        let last: serde_json::Value =
            serde_json::from_str(bodies.lock().unwrap().last().unwrap()).unwrap();
        assert_eq!(
            last["seq"], 1,
            "the next report is the runner's second: {last}"
        );
        assert_eq!(bodies.lock().unwrap().len(), 4);
    }
}
