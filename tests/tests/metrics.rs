//! Metrics as an operator collects them: a real Prometheus server (Debian's
//! `prometheus` package, started here on loopback with a generated
//! configuration) scrapes a node's `--metrics-listen` endpoint while a job
//! runs, and its HTTP API answers for the node's metrics afterwards; the
//! text a plain scraper gets passes `promtool check metrics`.

use std::io::{Read, Write};
use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use billet_tests::cluster::{Cluster, ClusterOptions, free_port, scratch_dir};

const PROMETHEUS: &str = "/usr/bin/prometheus";
const PROMTOOL: &str = "/usr/bin/promtool";

/// A plain HTTP/1.0 GET (no client library needed): status and body.
fn get(addr: SocketAddr, path_and_query: &str) -> Result<(u16, String)> {
    let (status, _, body) = get_accepting(addr, path_and_query, None)?;
    Ok((status, body))
}

/// A GET with an `Accept` header when one is given: status, the
/// `Content-Type` answered (empty when none) and body.
fn get_accepting(
    addr: SocketAddr,
    path_and_query: &str,
    accept: Option<&str>,
) -> Result<(u16, String, String)> {
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let accept = accept.map_or_else(String::new, |a| format!("Accept: {a}\r\n"));
    write!(
        stream,
        "GET {path_and_query} HTTP/1.0\r\nHost: {addr}\r\n{accept}Connection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    stream.read_to_string(&mut response)?;
    let (head, body) = response
        .split_once("\r\n\r\n")
        .context("an HTTP response")?;
    let status = head
        .split_whitespace()
        .nth(1)
        .context("a status")?
        .parse()?;
    let content_type = head
        .lines()
        .find_map(|l| {
            let (name, value) = l.split_once(':')?;
            name.eq_ignore_ascii_case("content-type")
                .then(|| value.trim().to_owned())
        })
        .unwrap_or_default();
    Ok((status, content_type, body.to_owned()))
}

/// What `promtool check metrics` says of `text`: its exit status and output.
fn promtool_check(text: &str) -> Result<(bool, String)> {
    ensure!(
        Path::new(PROMTOOL).exists(),
        "{PROMTOOL} is missing: install Debian's prometheus package (scripts/test does)"
    );
    let mut child = std::process::Command::new(PROMTOOL)
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("start promtool")?;
    child
        .stdin
        .take()
        .context("promtool's stdin")?
        .write_all(text.as_bytes())?;
    let out = child.wait_with_output()?;
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    Ok((out.status.success(), said))
}

/// Prometheus, killed when dropped.
struct Prometheus {
    child: std::process::Child,
    addr: SocketAddr,
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Prometheus {
    fn start(dir: &Path, target: SocketAddr) -> Result<Self> {
        ensure!(
            Path::new(PROMETHEUS).exists(),
            "{PROMETHEUS} is missing: install Debian's prometheus package (scripts/test does)"
        );
        let config = dir.join("prometheus.yml");
        std::fs::write(
            &config,
            format!(
                "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: billet-node\n    scrape_interval: 1s\n    scrape_timeout: 1s\n    static_configs:\n      - targets: ['{target}']\n"
            ),
        )?;
        let addr = free_port()?;
        let log = std::fs::File::create(dir.join("prometheus.log"))?;
        let child = std::process::Command::new(PROMETHEUS)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.join("tsdb").display()
            ))
            .arg(format!("--web.listen-address={addr}"))
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start prometheus")?;
        Ok(Self { child, addr })
    }

    /// The samples of an instant query.
    fn query(&self, query: &str) -> Result<Vec<serde_json::Value>> {
        let encoded: String = query
            .bytes()
            .map(|b| match b {
                b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'.' | b'-' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let (status, body) = get(self.addr, &format!("/api/v1/query?query={encoded}"))?;
        ensure!(status == 200, "query {query}: {status} {body}");
        let v: serde_json::Value = serde_json::from_str(&body)?;
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }

    /// The value of a query that yields one sample, once it does.
    async fn wait_value(&self, query: &str, timeout: Duration) -> Result<f64> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            if let Ok(samples) = self.query(query)
                && let Some(v) = samples
                    .first()
                    .and_then(|s| s["value"][1].as_str())
                    .and_then(|v| v.parse::<f64>().ok())
            {
                return Ok(v);
            }
            if tokio::time::Instant::now() >= deadline {
                bail!("prometheus never answered {query} within {timeout:?}");
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_a_nodes_launches_and_lease_state_while_a_job_runs() -> Result<()> {
    let metrics = free_port()?;
    let cluster = Cluster::start(ClusterOptions {
        node_env: vec![("BILLET_METRICS_LISTEN".into(), metrics.to_string())],
        work_ms: 4000,
        ..ClusterOptions::default()
    })
    .await?;
    let dir = scratch_dir("prometheus")?;
    let prometheus = Prometheus::start(&dir, metrics)?;
    // The endpoint answers in the exposition format, and only at /metrics.
    let (status, text) = get(metrics, "/metrics")?;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("billet_build_info{"), "{text}");
    assert_eq!(get(metrics, "/")?.0, 404);

    // Prometheus has the target up before the job is queued.
    let up = prometheus
        .wait_value("up{job=\"billet-node\"}", Duration::from_secs(60))
        .await?;
    assert_eq!(up, 1.0);
    let jobs = cluster.queue_jobs(1);
    // While it runs, the node holds one lease.
    prometheus
        .wait_value(
            "billet_leases_held{state=\"running\"} == 1",
            Duration::from_secs(60),
        )
        .await?;
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;

    let launches = prometheus
        .wait_value(
            "billet_commands_total{kind=\"launch\",outcome=\"ok\"}",
            Duration::from_secs(30),
        )
        .await?;
    assert_eq!(launches, 1.0);
    prometheus
        .wait_value(
            "billet_commands_total{kind=\"destroy\",outcome=\"ok\"} >= 1",
            Duration::from_secs(30),
        )
        .await?;
    for step in ["bind_advance", "mint", "create"] {
        let n = prometheus
            .wait_value(
                &format!("billet_launch_step_duration_seconds_count{{step=\"{step}\"}}"),
                Duration::from_secs(30),
            )
            .await?;
        assert_eq!(n, 1.0, "launch step {step}");
    }
    assert!(
        prometheus
            .wait_value(
                "billet_certificate_expiry_timestamp_seconds - time()",
                Duration::from_secs(10)
            )
            .await?
            > 86_400.0
    );
    prometheus
        .wait_value(
            "time() - billet_plane_last_contact_timestamp_seconds < 60",
            Duration::from_secs(10),
        )
        .await?;
    // Health: one series per degraded reason, none set on a healthy node,
    // and the clock offset the session measured (this host's own clock).
    let reasons = prometheus
        .wait_value("count(billet_degraded)", Duration::from_secs(10))
        .await?;
    #[expect(clippy::cast_precision_loss, reason = "a handful of reasons")]
    let every = billet_agent::node::health::Reason::ALL.len() as f64;
    assert_eq!(reasons, every, "one billet_degraded series per reason");
    prometheus
        .wait_value("sum(billet_degraded) == 0", Duration::from_secs(10))
        .await?;
    prometheus
        .wait_value(
            "abs(billet_clock_offset_seconds) < 5",
            Duration::from_secs(10),
        )
        .await?;
    prometheus
        .wait_value(
            "billet_journal_write_duration_seconds_count{call=\"put_launch\"} >= 1",
            Duration::from_secs(10),
        )
        .await?;
    prometheus
        .wait_value(
            "billet_leases_held{state=\"running\"} == 0",
            Duration::from_secs(30),
        )
        .await?;
    drop(prometheus);
    cluster.shutdown().await
}

/// The plane's figures about jobs, as Prometheus scrapes them: how long a
/// job waited and ran per tier, how its lease ended by class and reason,
/// jobs waiting by reason (every reason a series), none stuck.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prometheus_scrapes_the_planes_job_wait_and_run_times_and_lease_ends() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        work_ms: 2000,
        ..ClusterOptions::default()
    })
    .await?;
    let addr = free_port()?;
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let stop = tokio_util::sync::CancellationToken::new();
    cluster.plane.serve_metrics(listener, stop.clone());
    let dir = scratch_dir("prometheus-plane")?;
    let prometheus = Prometheus::start(&dir, addr)?;
    let (status, text) = get(addr, "/metrics")?;
    assert_eq!(status, 200, "{text}");
    assert!(text.contains("billet_plane_jobs_waiting{"), "{text}");
    prometheus
        .wait_value("up{job=\"billet-node\"} == 1", Duration::from_secs(60))
        .await?;
    let jobs = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;
    for (query, want) in [
        ("billet_plane_job_queued_to_started_seconds_count", 1.0),
        ("billet_plane_job_started_to_completed_seconds_count", 1.0),
        (
            "billet_plane_lease_ends_total{class=\"job\",reason=\"completed\"}",
            1.0,
        ),
        ("count(billet_plane_jobs_waiting)", 10.0),
        ("sum(billet_jobs_stuck_total)", 0.0),
    ] {
        let got = prometheus
            .wait_value(&format!("{query} == {want}"), Duration::from_secs(30))
            .await
            .with_context(|| {
                format!(
                    "{query}: {}",
                    get(addr, "/metrics").map(|r| r.1).unwrap_or_default()
                )
            })?;
        assert_eq!(got, want, "{query}");
    }
    prometheus
        .wait_value(
            "billet_plane_job_started_to_completed_seconds_sum >= 1",
            Duration::from_secs(10),
        )
        .await?;
    prometheus
        .wait_value(
            "sum(billet_plane_jobs_waiting) == 0",
            Duration::from_secs(10),
        )
        .await?;
    drop(prometheus);
    stop.cancel();
    cluster.shutdown().await
}

/// The exposition is negotiated: the Prometheus text format 0.0.4 unless
/// the scraper prefers OpenMetrics, and the text passes `promtool check
/// metrics`. Every error family has its series from the start, at zero, so
/// a healthy node's error panels read 0 and an alert on `increase()` sees
/// the first error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scraper_gets_the_format_it_asks_for_the_text_passes_promtool_and_every_error_family_reads_zero()
-> Result<()> {
    let metrics = free_port()?;
    let cluster = Cluster::start(ClusterOptions {
        node_env: vec![("BILLET_METRICS_LISTEN".into(), metrics.to_string())],
        ..ClusterOptions::default()
    })
    .await?;
    const TEXT: &str = "text/plain; version=0.0.4; charset=utf-8";
    const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
    // What Prometheus 2.x sends: OpenMetrics preferred.
    const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
    for (accept, wanted) in [
        (None, TEXT),
        (Some("*/*"), TEXT),
        (Some("text/plain;version=0.0.4"), TEXT),
        (
            Some("text/plain;version=0.0.4;q=0.9,application/openmetrics-text;q=0.1"),
            TEXT,
        ),
        (
            Some("application/openmetrics-text; version=1.0.0"),
            OPENMETRICS,
        ),
        (Some(PROMETHEUS_ACCEPT), OPENMETRICS),
    ] {
        let (status, content_type, text) = get_accepting(metrics, "/metrics", accept)?;
        assert_eq!(status, 200, "{accept:?}: {text}");
        assert_eq!(content_type, wanted, "Accept: {accept:?}");
        if wanted == TEXT {
            assert!(!text.contains("# EOF"), "{accept:?}: {text}");
            assert!(!text.contains(" info\n"), "{accept:?}: {text}");
            let (clean, said) = promtool_check(&text)?;
            assert!(clean, "promtool check metrics: {said}\n{text}");
            assert!(said.trim().is_empty(), "promtool check metrics: {said}");
            assert!(
                text.contains("billet_build_info{version=\""),
                "{accept:?}: {text}"
            );
        } else {
            assert!(text.ends_with("# EOF\n"), "{accept:?}: {text}");
        }
    }

    let (_, _, text) = get_accepting(metrics, "/metrics", None)?;
    for series in [
        "billet_plane_call_errors_total{call=\"heartbeat\",code=\"unavailable\"} 0",
        "billet_plane_call_errors_total{call=\"mint\",code=\"refused\"} 0",
        "billet_provider_call_errors_total{call=\"create\"} 0",
        "billet_provider_call_errors_total{call=\"list\"} 0",
        "billet_journal_write_errors_total{call=\"put_launch\"} 0",
        "billet_journal_write_errors_total{call=\"put_custody\"} 0",
        "billet_certificate_renewals_total{outcome=\"renewed\"} 0",
        "billet_certificate_renewals_total{outcome=\"failed\"} 0",
    ] {
        assert!(text.contains(series), "no {series} in:\n{text}");
    }
    cluster.shutdown().await
}
