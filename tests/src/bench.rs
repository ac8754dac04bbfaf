//! What the benchmarks in `tests/benches/` share: latency samples and their
//! order statistics, and readings of a node's `/metrics`.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context as _, Result, bail};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};

/// Latencies of one kind, in the order measured.
#[derive(Debug, Default, Clone)]
pub struct Samples(pub Vec<Duration>);

impl Samples {
    /// Adds one sample.
    pub fn push(&mut self, d: Duration) {
        self.0.push(d);
    }

    /// The samples in milliseconds, ascending.
    pub fn sorted_ms(&self) -> Vec<f64> {
        let mut ms: Vec<f64> = self.0.iter().map(|d| d.as_secs_f64() * 1000.0).collect();
        ms.sort_by(f64::total_cmp);
        ms
    }

    /// The median in milliseconds (the mean of the middle two for an even
    /// count); 0 without samples.
    pub fn median_ms(&self) -> f64 {
        median(&self.sorted_ms())
    }

    /// The nearest-rank percentile `p` (0 < p <= 100) in milliseconds; `p`
    /// of 0 is the minimum. 0 without samples.
    pub fn percentile_ms(&self, p: f64) -> f64 {
        let ms = self.sorted_ms();
        if ms.is_empty() {
            return 0.0;
        }
        #[allow(
            clippy::cast_possible_truncation,
            clippy::cast_sign_loss,
            clippy::cast_precision_loss
        )]
        let rank = ((p / 100.0) * ms.len() as f64).ceil().max(1.0) as usize;
        ms[rank.min(ms.len()) - 1]
    }

    /// The smallest sample in milliseconds.
    pub fn min_ms(&self) -> f64 {
        self.percentile_ms(0.0)
    }

    /// The largest sample in milliseconds.
    pub fn max_ms(&self) -> f64 {
        self.percentile_ms(100.0)
    }
}

/// The median of ascending `values`; 0 when empty.
pub fn median(values: &[f64]) -> f64 {
    let n = values.len();
    match n {
        0 => 0.0,
        _ if n % 2 == 1 => values[n / 2],
        _ => (values[n / 2 - 1] + values[n / 2]) / 2.0,
    }
}

/// The distribution-free 95% confidence interval of the median of `sorted`
/// (ascending): the values at ranks `n/2 - 0.98 sqrt(n)` and `n/2 + 0.98 sqrt(n)`
/// (the normal approximation to the binomial order statistics), clamped to
/// the samples. With one sample, that sample twice.
///
/// # Panics
///
/// When `sorted` is empty.
pub fn median_interval(sorted: &[f64]) -> (f64, f64) {
    let n = sorted.len();
    #[allow(clippy::cast_precision_loss)]
    let half_width = 0.98 * (n as f64).sqrt();
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let (low, high) = (
        ((n as f64 / 2.0 - half_width).floor().max(0.0) as usize).min(n - 1),
        ((n as f64 / 2.0 + half_width).ceil() as usize).min(n - 1),
    );
    (sorted[low], sorted[high])
}

/// One reading of a node's metrics: every sample line, keyed by its name
/// with labels exactly as exposed (`billet_commands_total{kind="tend",...}`).
#[derive(Debug, Clone, Default)]
pub struct MetricsReading(pub BTreeMap<String, f64>);

impl MetricsReading {
    /// Reads `GET /metrics` from a node's `--metrics-listen` address.
    ///
    /// # Errors
    ///
    /// When the node does not answer 200 with a text body.
    pub async fn read(addr: SocketAddr) -> Result<Self> {
        let mut stream = tokio::net::TcpStream::connect(addr)
            .await
            .with_context(|| format!("connect to the metrics listener {addr}"))?;
        stream
            .write_all(
                format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n")
                    .as_bytes(),
            )
            .await?;
        let mut text = String::new();
        stream.read_to_string(&mut text).await?;
        let Some((head, body)) = text.split_once("\r\n\r\n") else {
            bail!("the metrics listener answered no HTTP response");
        };
        if !head.starts_with("HTTP/1.1 200") {
            bail!("the metrics listener answered {head:?}");
        }
        let mut samples = BTreeMap::new();
        for line in body.lines() {
            if line.starts_with('#') || line.trim().is_empty() {
                continue;
            }
            // A chunked body has size lines; they hold no space.
            let Some((key, value)) = line.rsplit_once(' ') else {
                continue;
            };
            if let Ok(v) = value.parse::<f64>() {
                samples.insert(key.to_owned(), v);
            }
        }
        Ok(Self(samples))
    }

    /// The sum over every sample named `name` whose labels include all of
    /// `labels` (`("call", "heartbeat")`).
    pub fn sum(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.0
            .iter()
            .filter(|(key, _)| {
                let (n, rest) = key.split_once('{').unwrap_or((key.as_str(), ""));
                n == name
                    && labels
                        .iter()
                        .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")))
            })
            .map(|(_, v)| v)
            .sum()
    }

    /// The values of label `label` over samples named `name`, with each
    /// value's sum, ascending by label value.
    pub fn by_label(&self, name: &str, label: &str) -> BTreeMap<String, f64> {
        let mut out = BTreeMap::new();
        let needle = format!("{label}=\"");
        for (key, v) in &self.0 {
            let (n, rest) = key.split_once('{').unwrap_or((key.as_str(), ""));
            if n != name {
                continue;
            }
            if let Some(start) = rest.find(&needle) {
                let value = &rest[start + needle.len()..];
                let value = value.split('"').next().unwrap_or_default();
                *out.entry(value.to_owned()).or_insert(0.0) += v;
            }
        }
        out
    }

    /// `self - earlier`, sample by sample (a sample absent earlier counts
    /// from 0).
    pub fn since(&self, earlier: &Self) -> Self {
        Self(
            self.0
                .iter()
                .map(|(k, v)| (k.clone(), v - earlier.0.get(k).copied().unwrap_or(0.0)))
                .collect(),
        )
    }
}

/// A process's resident set size in bytes, from `/proc/<pid>/status`.
///
/// # Errors
///
/// When the process is gone or the file has no `VmRSS` line.
pub fn rss_bytes(pid: u32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("read /proc/{pid}/status"))?;
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .context("no VmRSS line")?;
    let kib: u64 = line
        .split_whitespace()
        .nth(1)
        .context("VmRSS without a value")?
        .parse()
        .context("VmRSS is not a number")?;
    Ok(kib * 1024)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reading_sums_by_name_and_labels_and_subtracts() {
        let a = MetricsReading(BTreeMap::from([
            ("billet_x_count{call=\"heartbeat\"}".to_owned(), 3.0),
            ("billet_x_count{call=\"advance\"}".to_owned(), 2.0),
            ("billet_y_count{call=\"advance\"}".to_owned(), 9.0),
        ]));
        let mut b = a.clone();
        b.0.insert("billet_x_count{call=\"heartbeat\"}".to_owned(), 5.0);
        assert_eq!(a.sum("billet_x_count", &[]), 5.0);
        assert_eq!(a.sum("billet_x_count", &[("call", "advance")]), 2.0);
        let d = b.since(&a);
        assert_eq!(d.sum("billet_x_count", &[]), 2.0);
        assert_eq!(
            b.by_label("billet_x_count", "call").get("heartbeat"),
            Some(&5.0)
        );
    }

    #[test]
    fn order_statistics_of_samples() {
        let s = Samples(
            [3, 1, 2, 4]
                .into_iter()
                .map(Duration::from_millis)
                .collect(),
        );
        assert_eq!(s.median_ms(), 2.5);
        assert_eq!(s.min_ms(), 1.0);
        assert_eq!(s.max_ms(), 4.0);
    }
}
