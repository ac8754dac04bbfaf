//! Credentials never reach a log or container metadata: the JIT configs
//! handed to real containers appear nowhere in the node's or the plane's
//! output, even at trace level, nor in what the engine records about the
//! containers.

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use base64::Engine;
use billet_tests::cluster::{Cluster, ClusterOptions};
use tracing_subscriber::fmt::MakeWriter;

#[derive(Clone, Default)]
struct Buffer(Arc<Mutex<Vec<u8>>>);

impl Write for Buffer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("buffer").extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl<'a> MakeWriter<'a> for Buffer {
    type Writer = Buffer;
    fn make_writer(&'a self) -> Buffer {
        self.clone()
    }
}

/// The JIT configs this cluster's runners hold, read from each runner
/// process's own environment on this host (`/proc/<pid>/environ`, as root),
/// and what the engine records about each container (`docker inspect`, as
/// JSON), read while they run.
async fn jit_configs(cluster: &Cluster, recorded: &mut Vec<String>) -> Result<Vec<String>> {
    let mut found = Vec::new();
    for name in cluster.containers().await? {
        let Ok(inspect) = cluster.docker.inspect_container(&name, None).await else {
            continue;
        };
        recorded.push(serde_json::to_string(&inspect)?);
        let Some(pid) = inspect.state.and_then(|s| s.pid).filter(|p| *p > 0) else {
            continue;
        };
        let Ok(environ) = std::fs::read(format!("/proc/{pid}/environ")) else {
            continue;
        };
        for var in environ.split(|b| *b == 0) {
            if let Some(v) = var.strip_prefix(b"ACTIONS_RUNNER_INPUT_JITCONFIG=") {
                found.push(String::from_utf8_lossy(v).into_owned());
            }
        }
    }
    Ok(found)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_jit_config_appears_in_no_log_output_even_at_trace_level_nor_in_docker_inspect()
-> Result<()> {
    let plane_log = Buffer::default();
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("trace"))
        .with_ansi(false)
        .with_writer(plane_log.clone())
        .init();
    let cluster = Cluster::start(ClusterOptions {
        node_log: "trace".into(),
        work_ms: 3000,
        ..ClusterOptions::default()
    })
    .await?;
    // The demo's loop: five jobs through the whole path.
    let jobs = cluster.queue_jobs(5);
    let mut configs = std::collections::BTreeSet::new();
    let mut recorded = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    while configs.len() < 5 && tokio::time::Instant::now() < deadline {
        configs.extend(jit_configs(&cluster, &mut recorded).await?);
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        configs.len(),
        5,
        "could not read every JIT config from the running runners"
    );
    // What the engine records about a container (its environment, labels,
    // command line, mounts) holds no JIT config: only the runner's own
    // process does.
    for inspect in &recorded {
        for config in &configs {
            assert!(
                !inspect.contains(config.as_str()),
                "docker inspect shows a JIT config"
            );
        }
        assert!(
            !inspect.contains("ACTIONS_RUNNER_INPUT_JITCONFIG"),
            "{inspect}"
        );
    }
    cluster
        .wait_jobs_completed(&jobs, Duration::from_secs(60))
        .await?;
    cluster.wait_clean(Duration::from_secs(30)).await?;

    let node_log = cluster.nodes["node-1"].log_text();
    let plane_log = String::from_utf8_lossy(&plane_log.0.lock().expect("buffer")).into_owned();
    assert!(
        node_log.contains("TRACE"),
        "the node did not log at trace level"
    );
    assert!(
        plane_log.contains("TRACE"),
        "the plane did not log at trace level"
    );
    for config in &configs {
        // The config itself, and the document it encodes.
        let decoded = base64::engine::general_purpose::STANDARD.decode(config)?;
        let decoded = String::from_utf8(decoded)?;
        for (name, log) in [("node", &node_log), ("plane", &plane_log)] {
            assert!(
                !log.contains(config.as_str()),
                "the {name} log contains a JIT config"
            );
            assert!(
                !log.contains(decoded.as_str()),
                "the {name} log contains a decoded JIT config"
            );
        }
    }
    // Nor any private key: the node's, the plane's or the CA's.
    let node_files = cluster.certs.node("node-1").expect("node files");
    for key in [
        &node_files.key,
        &cluster.certs.plane.key,
        &cluster.certs.ca.key,
    ] {
        let pem = std::fs::read_to_string(key)?;
        for line in pem
            .lines()
            .filter(|l| !l.starts_with("-----") && l.len() >= 16)
        {
            for (name, log) in [("node", &node_log), ("plane", &plane_log)] {
                assert!(
                    !log.contains(line),
                    "the {name} log contains key material from {}",
                    key.display()
                );
            }
        }
    }
    cluster.shutdown().await
}
