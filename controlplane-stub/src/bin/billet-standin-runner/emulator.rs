//! The emulator's control API as the runner uses it: wait for a job of its scale set, take
//! it, work, and complete it.

use std::time::Duration;

use scaleset::JobRequestId;
use scaleset::testing::{EmulatorState, JobState};

use crate::actions_cache::actions_cache;
use crate::cache_api::CacheGuest;
use crate::chain;
use crate::cli::{Cli, Mode};
use crate::jit::JitConfig;
use crate::reports::{Gates, Reporter};
use crate::run::Failure;
use crate::sticky::{count, fill_beside};

/// How often the emulator's state is read.
const POLL_INTERVAL: Duration = Duration::from_millis(200);
/// How many jobs lost to other runners in a row are followed by another
/// look at once, before the next waits for the poll.
const LOST_AGAIN_AT_ONCE: u32 = 8;
/// Bound of one request to the emulator.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a failing completion is retried.
const COMPLETE_RETRY_FOR: Duration = Duration::from_secs(30);

/// The emulator's control API, as this runner uses it.
pub(crate) struct EmulatorLink<'a> {
    http: reqwest::Client,
    /// The emulator's base URL, without a trailing `/`.
    base: &'a str,
    config: &'a JitConfig,
}

impl<'a> EmulatorLink<'a> {
    pub(crate) fn new(config: &'a JitConfig) -> Result<Self, Failure> {
        // Plain HTTP only. reqwest has rustls here (scaleset's default feature), and its default
        // verifier needs the system's CA store, which the stand-in's `FROM scratch` image does
        // not have: an empty root store keeps the client buildable there.
        let http = reqwest::Client::builder()
            .timeout(REQUEST_TIMEOUT)
            .no_proxy()
            .tls_certs_only(std::iter::empty())
            .build()
            .map_err(|e| Failure::Runtime(format!("cannot build an HTTP client: {}", chain(&e))))?;
        Ok(Self {
            http,
            base: config.emulator.trim_end_matches('/'),
            config,
        })
    }

    /// Polls until this runner has a job, for at most the idle timeout. Returns the job's id.
    pub(crate) async fn wait_for_job(&self, cli: &Cli) -> Result<JobRequestId, Failure> {
        let config = self.config;
        let idle_deadline =
            tokio::time::Instant::now() + Duration::from_millis(cli.idle_timeout_ms);
        let also_mode = if cli.mode == Mode::Job {
            String::new()
        } else {
            format!(" (mode {})", cli.mode)
        };
        eprintln!(
            "billet-standin-runner: runner {} (id {}) waiting for a job of scale set {} at {}{also_mode}",
            config.runner_name, config.runner_id, config.scale_set_id, self.base
        );
        if cli.first_look_ms > 0 {
            tokio::time::sleep(Duration::from_millis(cli.first_look_ms)).await;
        }

        let mut last_error = String::new();
        let mut lost = 0_u32;
        loop {
            match take_job(&self.http, self.base, config).await {
                Ok(Taken::Job(job)) => return Ok(job),
                // Another runner took the job this one chose: the others
                // still assigned are looked at again at once, as a runner
                // GitHub hands its own job would not wait for a poll (a
                // few times in a row, then at the poll's pace).
                Ok(Taken::Lost) if lost < LOST_AGAIN_AT_ONCE => {
                    lost += 1;
                    continue;
                }
                Ok(Taken::Lost | Taken::Nothing) => {}
                Err(Failure::Transient(e)) => {
                    // Say so once per distinct error, not every 200 ms.
                    if e != last_error {
                        eprintln!("billet-standin-runner: {e}; retrying");
                        last_error = e;
                    }
                }
                Err(fatal) => return Err(fatal),
            }
            lost = 0;
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
        }
    }

    /// Works on `job` for `cli.work_ms`, then completes it with `cli.result`, retrying a failed
    /// completion for [`COMPLETE_RETRY_FOR`]. Returns the job's id.
    pub(crate) async fn work_and_complete(
        &self,
        cli: &Cli,
        job: JobRequestId,
    ) -> Result<JobRequestId, Failure> {
        let reporter = cli
            .report
            .as_deref()
            .map(|url| Reporter::new(self.http.clone(), url, &self.config.runner_name));
        let guest = (cli.sticky.is_some() || cli.docker_store.is_some())
            .then(CacheGuest::from_env)
            .flatten();
        if let (Some(guest), Some(_)) = (&guest, &cli.docker_store) {
            guest.docker_store(reporter.as_ref()).await;
        }
        match (&guest, &reporter) {
            (Some(guest), reporter) if cli.sticky.is_some() => {
                guest.mounted(reporter.as_ref()).await;
            }
            (None, Some(reporter)) if cli.sticky.is_some() => {
                reporter
                    .report(
                        "mounted",
                        serde_json::json!({
                            "error": "no cache session: BILLET_CACHE_ENDPOINT or BILLET_CACHE_TOKEN is unset"
                        }),
                    )
                    .await;
            }
            _ => {}
        }
        if let (Some(key), Some(reporter)) = (&cli.actions_cache, &reporter) {
            let gates = cli
                .gates
                .as_deref()
                .map(|url| Gates::new(self.http.clone(), url));
            actions_cache(key, cli.actions_rounds, gates.as_ref(), reporter).await;
        }
        tokio::time::sleep(Duration::from_millis(cli.work_ms)).await;
        if let Some(path) = &cli.sticky {
            count(path);
            if cli.sticky_fill {
                fill_beside(path);
            }
        }
        if let (Some(guest), Some(_)) = (&guest, &cli.sticky) {
            guest
                .commit(cli.result == "succeeded", reporter.as_ref())
                .await;
        }

        let complete_deadline = tokio::time::Instant::now() + COMPLETE_RETRY_FOR;
        loop {
            let sent = self
                .http
                .post(format!("{}/_emulator/jobs/{job}/complete", self.base))
                .json(&serde_json::json!({ "result": cli.result }))
                .send()
                .await;
            let error = match sent {
                Ok(response) if response.status().is_success() => {
                    if let (Some(guest), Some("ready")) = (&guest, cli.docker_store.as_deref()) {
                        guest
                            .docker_ready(
                                Duration::from_millis(cli.ready_wait_ms),
                                reporter.as_ref(),
                            )
                            .await;
                    }
                    if cli.post_job_ms > 0 {
                        eprintln!(
                            "billet-standin-runner: runner {} completed job {job}; post-job work for {} ms",
                            self.config.runner_name, cli.post_job_ms
                        );
                        tokio::time::sleep(Duration::from_millis(cli.post_job_ms)).await;
                    }
                    return Ok(job);
                }
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
}

/// One look at the emulator: the job this runner now runs, if it got one.
///
/// A [`Failure::Transient`] is worth another look; a [`Failure::Runtime`] ends the runner.
/// What one look at the emulator's jobs found.
enum Taken {
    /// This runner has this job.
    Job(JobRequestId),
    /// No job of its scale set is assigned.
    Nothing,
    /// Another runner took the job this one chose first.
    Lost,
}

async fn take_job(
    http: &reqwest::Client,
    base: &str,
    config: &JitConfig,
) -> Result<Taken, Failure> {
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
        return Ok(Taken::Job(job));
    }
    // The first assigned job, as the emulator orders them: the test
    // harnesses read a job's runner from the order its launches were made.
    let Some(job) = state
        .jobs_in(config.scale_set_id, JobState::Assigned)
        .map(|j| j.id)
        .next()
    else {
        return Ok(Taken::Nothing);
    };

    let response = http
        .post(format!("{base}/_emulator/jobs/{job}/start"))
        .json(&serde_json::json!({ "runnerName": config.runner_name }))
        .send()
        .await
        .map_err(|e| Failure::Transient(format!("cannot start job {job}: {}", chain(&e))))?;
    match response.status() {
        s if s.is_success() => Ok(Taken::Job(job)),
        // Taken by another runner, or no longer assigned, between the read and the start.
        reqwest::StatusCode::CONFLICT | reqwest::StatusCode::NOT_FOUND => Ok(Taken::Lost),
        s => Err(Failure::Transient(format!(
            "starting job {job} answered {s}"
        ))),
    }
}
