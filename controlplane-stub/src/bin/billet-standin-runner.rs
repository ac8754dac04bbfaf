//! `billet-standin-runner`: plays one ephemeral GitHub Actions runner against the `scaleset`
//! crate's emulator, for tests and the demo.
//!
//! It receives its JIT config as `actions/runner` does (`ACTIONS_RUNNER_INPUT_JITCONFIG`, or
//! `--jitconfig <value>`). The emulator's JIT config is base64 of JSON
//! `{"runnerId", "runnerName", "scaleSetId", "emulator": <base URL>}` (scaleset 0.1
//! `testing/state.rs`, `generate_jit_config`). Through the emulator's control API it then polls
//! `GET /_emulator/state` every 200 ms for a job of its scale set in state `assigned`, takes it
//! with `POST /_emulator/jobs/{id}/start {"runnerName": <its name>}` (409: another runner took it,
//! or it is no longer assigned; look again), works for `--work-ms`, completes it with
//! `POST /_emulator/jobs/{id}/complete {"result": <result>}`, prints one line and exits. A job the
//! emulator itself started on this runner (`EmulatedRunner::job`) is worked the same way.
//!
//! The JIT config is a credential: it is never printed, not even in part.
//!
//! | exit code | meaning |
//! |---|---|
//! | 0 | a job was run and completed |
//! | 1 | no job within the idle timeout, the runner was removed, or the completion failed |
//! | 2 | usage error: no or malformed JIT config, bad option |
//! | 130 | SIGINT |
//! | 143 | SIGTERM |

use std::process::ExitCode;
use std::time::Duration;

use base64::Engine as _;
use clap::Parser;
use scaleset::testing::{EmulatorState, JobState};
use scaleset::{JobRequestId, RunnerId, ScaleSetId};
use serde::Deserialize;
use tokio::signal::unix::{SignalKind, signal};

/// How often the emulator's state is read.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// Bound of one request to the emulator.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a failing completion is retried.
const COMPLETE_RETRY_FOR: Duration = Duration::from_secs(30);

/// Plays an ephemeral GitHub Actions runner against the scaleset emulator: takes one job
/// assigned to its scale set, works, completes it and exits.
#[derive(Parser)]
#[command(version)]
struct Cli {
    /// The encoded JIT config, as given to actions/runner.
    #[arg(long, env = "ACTIONS_RUNNER_INPUT_JITCONFIG", hide_env_values = true)]
    jitconfig: String,
    /// How long to work on the job, in milliseconds.
    #[arg(long, env = "BILLET_STANDIN_WORK_MS", default_value_t = 2000)]
    work_ms: u64,
    /// The job's result, such as succeeded, failed or canceled.
    #[arg(long, env = "BILLET_STANDIN_RESULT", default_value = "succeeded")]
    result: String,
    /// How long to wait for a job before giving up, in milliseconds.
    #[arg(
        long,
        env = "BILLET_STANDIN_IDLE_TIMEOUT_MS",
        default_value_t = 600_000
    )]
    idle_timeout_ms: u64,
}

/// The emulator's decoded JIT config.
#[derive(Debug, Deserialize)]
#[serde(rename_all = "camelCase")]
struct JitConfig {
    runner_id: RunnerId,
    runner_name: String,
    scale_set_id: ScaleSetId,
    emulator: String,
}

impl JitConfig {
    /// Decodes the config without ever echoing it: errors say what is wrong, not what is there.
    fn decode(encoded: &str) -> Result<Self, String> {
        let json = base64::engine::general_purpose::STANDARD
            .decode(encoded.trim())
            .map_err(|_| "the JIT config is not base64".to_owned())?;
        let config: Self = serde_json::from_slice(&json).map_err(|e| {
            // serde's message may quote a value from the config; only a missing field is safe.
            let what = e.to_string();
            let what = match what.split_once(" at line") {
                Some((missing, _)) if missing.starts_with("missing field") => missing.to_owned(),
                _ => format!(
                    "{:?} error at line {} column {}",
                    e.classify(),
                    e.line(),
                    e.column()
                ),
            };
            format!(
                "the JIT config is not the scaleset emulator's \
                 (base64 of JSON with runnerId, runnerName, scaleSetId, emulator): {what}"
            )
        })?;
        if !config.emulator.starts_with("http://") {
            return Err("the JIT config's emulator is not an http:// URL".to_owned());
        }
        if config.runner_name.is_empty() {
            return Err("the JIT config has an empty runnerName".to_owned());
        }
        Ok(config)
    }
}

/// Why the runner stopped without running a job.
enum Failure {
    /// The emulator could not be asked (not up yet, or busy): look again.
    Transient(String),
    /// Exit 1, with this sentence.
    Runtime(String),
    /// Exit with this code, silently (signals).
    Code(u8),
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    let config = match JitConfig::decode(&cli.jitconfig) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("billet-standin-runner: {e}");
            return ExitCode::from(2);
        }
    };
    if cli.result.is_empty() {
        eprintln!("billet-standin-runner: the result must not be empty");
        return ExitCode::from(2);
    }
    let (mut term, mut int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("billet-standin-runner: cannot handle signals: {e}");
            return ExitCode::FAILURE;
        }
    };
    let outcome = tokio::select! {
        outcome = run(&cli, &config) => outcome,
        _ = term.recv() => Err(Failure::Code(143)),
        _ = int.recv() => Err(Failure::Code(130)),
    };
    match outcome {
        Ok(job) => {
            println!(
                "billet-standin-runner: runner {} ran job {job} with result {}",
                config.runner_name, cli.result
            );
            ExitCode::SUCCESS
        }
        Err(Failure::Runtime(e) | Failure::Transient(e)) => {
            eprintln!("billet-standin-runner: runner {}: {e}", config.runner_name);
            ExitCode::FAILURE
        }
        Err(Failure::Code(code)) => ExitCode::from(code),
    }
}

/// Waits for a job, runs it and completes it. Returns the job's id.
async fn run(cli: &Cli, config: &JitConfig) -> Result<JobRequestId, Failure> {
    // Plain HTTP only. reqwest has rustls here (scaleset's default feature), and its default
    // verifier needs the system's CA store, which the stand-in's `FROM scratch` image does not
    // have: an empty root store keeps the client buildable there.
    let http = reqwest::Client::builder()
        .timeout(REQUEST_TIMEOUT)
        .no_proxy()
        .tls_certs_only(std::iter::empty())
        .build()
        .map_err(|e| Failure::Runtime(format!("cannot build an HTTP client: {}", chain(&e))))?;
    let base = config.emulator.trim_end_matches('/');
    let idle_deadline = tokio::time::Instant::now() + Duration::from_millis(cli.idle_timeout_ms);
    eprintln!(
        "billet-standin-runner: runner {} (id {}) waiting for a job of scale set {} at {base}",
        config.runner_name, config.runner_id, config.scale_set_id
    );

    let mut last_error = String::new();
    let job = loop {
        match take_job(&http, base, config).await {
            Ok(Some(job)) => break job,
            Ok(None) => {}
            Err(Failure::Transient(e)) => {
                // Say so once per distinct error, not every 200 ms.
                if e != last_error {
                    eprintln!("billet-standin-runner: {e}; retrying");
                    last_error = e;
                }
            }
            Err(fatal) => return Err(fatal),
        }
        if tokio::time::Instant::now() >= idle_deadline {
            let also = if last_error.is_empty() {
                String::new()
            } else {
                format!(" (last error: {last_error})")
            };
            return Err(Failure::Runtime(format!(
                "no job of scale set {} was assigned within {} ms{also}",
                config.scale_set_id, cli.idle_timeout_ms
            )));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    };

    tokio::time::sleep(Duration::from_millis(cli.work_ms)).await;

    let complete_deadline = tokio::time::Instant::now() + COMPLETE_RETRY_FOR;
    loop {
        let sent = http
            .post(format!("{base}/_emulator/jobs/{job}/complete"))
            .json(&serde_json::json!({ "result": cli.result }))
            .send()
            .await;
        let error = match sent {
            Ok(response) if response.status().is_success() => return Ok(job),
            Ok(response) => format!("status {}", response.status()),
            Err(e) => chain(&e),
        };
        if tokio::time::Instant::now() >= complete_deadline {
            return Err(Failure::Runtime(format!(
                "cannot complete job {job}: {error}"
            )));
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// One look at the emulator: the job this runner now runs, if it got one.
///
/// A [`Failure::Transient`] is worth another look; a [`Failure::Runtime`] ends the runner.
async fn take_job(
    http: &reqwest::Client,
    base: &str,
    config: &JitConfig,
) -> Result<Option<JobRequestId>, Failure> {
    let state: EmulatorState = http
        .get(format!("{base}/_emulator/state"))
        .send()
        .await
        .and_then(reqwest::Response::error_for_status)
        .map_err(|e| {
            Failure::Transient(format!("cannot read the emulator's state: {}", chain(&e)))
        })?
        .json()
        .await
        .map_err(|e| Failure::Transient(format!("unreadable emulator state: {}", chain(&e))))?;

    let Some(me) = state.runners.iter().find(|r| r.id == config.runner_id) else {
        return Err(Failure::Runtime(format!(
            "runner id {} is not registered with the emulator (removed, or its job already ran)",
            config.runner_id
        )));
    };
    if let Some(job) = me.job {
        // Started on this runner by someone else (the emulator's auto-run, or a test).
        return Ok(Some(job));
    }
    let Some(job) = state
        .jobs_in(config.scale_set_id, JobState::Assigned)
        .map(|j| j.id)
        .next()
    else {
        return Ok(None);
    };

    let response = http
        .post(format!("{base}/_emulator/jobs/{job}/start"))
        .json(&serde_json::json!({ "runnerName": config.runner_name }))
        .send()
        .await
        .map_err(|e| Failure::Transient(format!("cannot start job {job}: {}", chain(&e))))?;
    match response.status() {
        s if s.is_success() => Ok(Some(job)),
        // Taken by another runner, or no longer assigned, between the read and the start.
        reqwest::StatusCode::CONFLICT | reqwest::StatusCode::NOT_FOUND => Ok(None),
        s => Err(Failure::Transient(format!(
            "starting job {job} answered {s}"
        ))),
    }
}

/// An error with its causes, since reqwest's own message leaves out why a request failed.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(cause) = source {
        text.push_str(": ");
        text.push_str(&cause.to_string());
        source = cause.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encode(json: &str) -> String {
        base64::engine::general_purpose::STANDARD.encode(json)
    }

    #[test]
    fn the_emulators_jit_config_decodes() {
        let config = JitConfig::decode(&encode(
            r#"{"runnerId":1002,"runnerName":"billet-7","scaleSetId":1001,"emulator":"http://127.0.0.1:4100"}"#,
        ))
        .unwrap();
        assert_eq!(config.runner_id, RunnerId(1002));
        assert_eq!(config.runner_name, "billet-7");
        assert_eq!(config.scale_set_id, ScaleSetId(1001));
    }

    #[test]
    fn a_malformed_jit_config_is_refused_without_echoing_it() {
        let secret = "s3cr3t-token-value";
        for (encoded, says) in [
            (secret.to_owned(), "not base64"),
            (encode(secret), "not the scaleset emulator's"),
            (
                encode(&format!(
                    r#"{{"runnerId":"{secret}","runnerName":"r","scaleSetId":1,"emulator":"http://e"}}"#
                )),
                "Data error",
            ),
            (
                encode(&format!(
                    r#"{{"runnerName":"{secret}","scaleSetId":1,"emulator":"http://e"}}"#
                )),
                "missing field `runnerId`",
            ),
            (
                encode(&format!(
                    r#"{{"runnerId":1,"runnerName":"r","scaleSetId":1,"emulator":"{secret}"}}"#
                )),
                "not an http:// URL",
            ),
        ] {
            let err = JitConfig::decode(&encoded).unwrap_err();
            assert!(err.contains(says), "{err}");
            assert!(!err.contains("s3cr3t"), "{err}");
        }
    }
}
