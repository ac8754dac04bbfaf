//! The node's log as a collector reads it: under `--log-format json`, one
//! object per line whose values carry their types (a number is a JSON
//! number, a missing value is absent or null, never `"Some(...)"`).

use std::time::Duration;

use anyhow::Result;
use billet_tests::cluster::{Cluster, ClusterOptions};

/// What is wrong with one value of a JSON log line, if anything.
fn untyped(value: &serde_json::Value) -> Option<&'static str> {
    let serde_json::Value::String(text) = value else {
        return None;
    };
    if text.starts_with("Some(") || text == "None" {
        return Some("an Option's Debug text");
    }
    let number = text.strip_prefix('-').unwrap_or(text);
    if !number.is_empty()
        && number.bytes().all(|b| b.is_ascii_digit() || b == b'.')
        && number.bytes().filter(|b| *b == b'.').count() <= 1
        && !number.starts_with('.')
        && !number.ends_with('.')
    {
        return Some("a number as a string");
    }
    None
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn json_logs_carry_numbers_as_numbers_and_never_an_options_debug_text() -> Result<()> {
    let cluster = Cluster::start(ClusterOptions {
        node_env: vec![
            ("BILLET_LOG_FORMAT".into(), "json".into()),
            ("BILLET_METRICS_LISTEN".into(), "0".into()),
        ],
        ..ClusterOptions::default()
    })
    .await?;
    let jobs = cluster.queue_jobs(1);
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(90))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;
    let log = cluster.nodes["node-1"].log_text();
    cluster.shutdown().await?;
    let mut lines = 0;
    let mut wrong = Vec::new();
    for line in log.lines().filter(|l| !l.trim().is_empty()) {
        let object: serde_json::Value =
            serde_json::from_str(line).map_err(|e| anyhow::anyhow!("not JSON ({e}): {line}"))?;
        lines += 1;
        let Some(fields) = object.as_object() else {
            anyhow::bail!("not an object: {line}");
        };
        for (key, value) in fields {
            // The message is prose; the span list is the subscriber's; an
            // identifier is a string that may happen to be all digits (a
            // lease id is random hex).
            if [
                "message",
                "spans",
                "span",
                "lease",
                "instance",
                "id",
                "incarnation",
                "mount",
                "command",
                "runner",
            ]
            .contains(&key.as_str())
            {
                continue;
            }
            if let Some(why) = untyped(value) {
                wrong.push(format!("{key}={value} ({why}) in {line}"));
            }
        }
    }
    assert!(lines > 10, "only {lines} lines:\n{log}");
    assert!(wrong.is_empty(), "untyped values:\n{}", wrong.join("\n"));
    Ok(())
}
