//! The figures an operator graphs about jobs, on `billet-plane
//! --metrics-listen`: how long jobs wait for a runner and run, per tier;
//! how leases end, by class and reason; how many jobs wait, by reason; and
//! how many were judged stuck. Labels come from closed vocabularies only
//! (the tier is the plane's own, a reason is [`crate::jobs::WaitKind`] or
//! [`crate::jobs::end_reason_label`]).

use std::sync::Arc;
use std::time::Duration;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::jobs::WaitKind;

type Labels = Vec<(&'static str, String)>;
type Histograms = Family<Labels, Histogram, fn() -> Histogram>;

/// Queued to started, in seconds: a warm start is under a second, a cold
/// one seconds, a job waiting for room minutes or hours.
fn queue_histogram() -> Histogram {
    Histogram::new([
        0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0,
    ])
}

/// Started to completed, in seconds: CI jobs run seconds to hours.
fn run_histogram() -> Histogram {
    Histogram::new([
        1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 1800.0, 3600.0, 7200.0, 21600.0,
    ])
}

/// The plane's job metrics.
#[derive(Debug)]
pub(super) struct PlaneMetrics {
    queued_to_started: Histograms,
    started_to_completed: Histograms,
    lease_ends: Family<Labels, Counter>,
    waiting: Family<Labels, Gauge>,
    stuck: Family<Labels, Counter>,
    tier: String,
}

/// Where the plane's metrics are kept and encoded from.
pub(super) fn registry(tier: &str) -> (Arc<Registry>, Arc<PlaneMetrics>) {
    let mut registry = Registry::default();
    let metrics = PlaneMetrics {
        queued_to_started: Histograms::new_with_constructor(queue_histogram),
        started_to_completed: Histograms::new_with_constructor(run_histogram),
        lease_ends: Family::default(),
        waiting: Family::default(),
        stuck: Family::default(),
        tier: tier.to_owned(),
    };
    registry.register(
        "billet_plane_job_queued_to_started_seconds",
        "From GitHub queueing a job to a runner taking it, per tier",
        metrics.queued_to_started.clone(),
    );
    registry.register(
        "billet_plane_job_started_to_completed_seconds",
        "From a runner taking a job to GitHub reporting it completed, per tier",
        metrics.started_to_completed.clone(),
    );
    registry.register(
        "billet_plane_lease_ends",
        "Leases of the tier that ended, by the class and reason of their end",
        metrics.lease_ends.clone(),
    );
    registry.register(
        "billet_plane_jobs_waiting",
        "Jobs with no runner yet, by why (the plane's placement decision)",
        metrics.waiting.clone(),
    );
    registry.register(
        "billet_jobs_stuck",
        "Jobs that could not be placed anywhere for longer than --stuck-after-secs",
        metrics.stuck.clone(),
    );
    for kind in WaitKind::ALL {
        drop(
            metrics
                .waiting
                .get_or_create(&metrics.labels(kind.as_str())),
        );
    }
    drop(
        metrics
            .stuck
            .get_or_create(&vec![("tier", tier.to_owned())]),
    );
    (Arc::new(registry), Arc::new(metrics))
}

impl PlaneMetrics {
    fn labels(&self, reason: &str) -> Labels {
        vec![("tier", self.tier.clone()), ("reason", reason.to_owned())]
    }

    pub(super) fn job_started(&self, queued_for: Duration) {
        self.queued_to_started
            .get_or_create(&vec![("tier", self.tier.clone())])
            .observe(queued_for.as_secs_f64());
    }

    pub(super) fn job_completed(&self, ran_for: Duration) {
        self.started_to_completed
            .get_or_create(&vec![("tier", self.tier.clone())])
            .observe(ran_for.as_secs_f64());
    }

    pub(super) fn lease_ended(&self, class: &'static str, reason: &'static str) {
        self.lease_ends
            .get_or_create(&vec![
                ("tier", self.tier.clone()),
                ("class", class.to_owned()),
                ("reason", reason.to_owned()),
            ])
            .inc();
    }

    /// Sets the waiting gauges: `counts` per kind, every other kind 0.
    pub(super) fn waiting(&self, counts: &std::collections::HashMap<WaitKind, i64>) {
        for kind in WaitKind::ALL {
            self.waiting
                .get_or_create(&self.labels(kind.as_str()))
                .set(counts.get(&kind).copied().unwrap_or(0));
        }
    }

    pub(super) fn stuck(&self) {
        self.stuck
            .get_or_create(&vec![("tier", self.tier.clone())])
            .inc();
    }
}

/// The exposition format's content type.
const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `GET /metrics` on `listener` until `shutdown`; any other path is
/// 404. HTTP/1, one task per connection, each with 10 s to send its
/// request head: meant for a scraper on a trusted network, as the node's.
pub(super) async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    shutdown: CancellationToken,
) {
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Request, Response, StatusCode};
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    debug!(error = %e, "metrics accept failed");
                    // Out of descriptors, most likely: give them a moment.
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let registry = registry.clone();
        let shutdown = shutdown.clone();
        // Each connection ends with its peer, its header timeout or the
        // shutdown; nothing awaits it.
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let registry = registry.clone();
                async move {
                    if req.uri().path() == "/metrics" {
                        let mut body = String::new();
                        match prometheus_client::encoding::text::encode(&mut body, &registry) {
                            Ok(()) => Response::builder()
                                .header(hyper::header::CONTENT_TYPE, CONTENT_TYPE)
                                .body(Full::new(Bytes::from(body))),
                            Err(_) => Response::builder()
                                .status(StatusCode::INTERNAL_SERVER_ERROR)
                                .body(Full::new(Bytes::from_static(b"cannot encode metrics\n"))),
                        }
                    } else {
                        Response::builder()
                            .status(StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"metrics are at /metrics\n")))
                    }
                }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                served = connection => if let Err(e) = served {
                    debug!(error = %e, "metrics connection ended");
                },
                () = shutdown.cancelled() => {}
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_the_plane_dashboard_queries_is_one_the_plane_serves() {
        let (registry, metrics) = registry("linux");
        // A family shows once it has a sample: give every one of them one.
        metrics.job_started(Duration::from_secs(1));
        metrics.job_completed(Duration::from_secs(1));
        metrics.lease_ended("job", "done");
        metrics.stuck();
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).expect("encode");
        let dashboard = include_str!("../../../deploy/grafana-billet-plane.json");
        let mut names: Vec<&str> = dashboard
            .match_indices("billet_")
            .map(|(i, _)| {
                let rest = &dashboard[i..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                    .unwrap_or(rest.len());
                &rest[..end]
            })
            .filter(|n| *n != "billet_")
            .collect();
        names.sort_unstable();
        names.dedup();
        assert!(names.len() >= 5, "{names:?}");
        for name in names {
            let family = ["_bucket", "_count", "_sum", "_total"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(name);
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "the dashboard queries {name}, which the plane does not serve:\n{text}"
            );
        }
    }
}
