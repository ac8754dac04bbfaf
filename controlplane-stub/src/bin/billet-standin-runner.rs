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
//! Every option is a flag or an environment variable, so that the node's Docker provider can
//! pass it through a tier's `env`:
//!
//! | variable | flag | default | meaning |
//! |---|---|---|---|
//! | `ACTIONS_RUNNER_INPUT_JITCONFIG` | `--jitconfig` | required | the encoded JIT config |
//! | `BILLET_STANDIN_MODE` | `--mode` | `job` | what the runner does: the table below |
//! | `BILLET_STANDIN_WORK_MS` | `--work-ms` | 2000 | how long a job is worked, in milliseconds |
//! | `BILLET_STANDIN_RESULT` | `--result` | `succeeded` | the result a job is completed with |
//! | `BILLET_STANDIN_IDLE_TIMEOUT_MS` | `--idle-timeout-ms` | 600000 | how long to wait for a job, in milliseconds |
//! | `BILLET_STANDIN_EXIT_CODE` | `--exit-code` | 3 | mode `exit`: the code to exit with, 0 to 255 |
//! | `BILLET_STANDIN_ALLOCATE_MIB` | `--allocate-mib` | none: until killed | mode `allocate`: how much to allocate, in MiB (at least 1) |
//! | `BILLET_STANDIN_FIRST_LOOK_MS` | `--first-look-ms` | 0 | how long the runner waits after it starts before its first look at the emulator, in milliseconds, as a runner that is slow to connect: until then it stays idle and registered, and takes no job |
//! | `BILLET_STANDIN_STICKY` | `--sticky` | none | a sticky disk's counter file: once the job is worked and before it is completed, the runner reads the decimal number in it (a missing file is 0), writes it back incremented and says `sticky counter <path>: <old> -> <new>` on stderr; a file it cannot read or write is said and the job goes on. With `BILLET_CACHE_ENDPOINT` and `BILLET_CACHE_TOKEN` set (a node's cache session) it also speaks the node's cache API as the reference's `stickydisk` action does: what was mounted when the job starts (`cache volume slot ...`), and after the counter a commit of each disk with the job's status, saying what it was told (`cache commit slot N key K: status S told {...}`) |
//! | `BILLET_STANDIN_STICKY_FILL` | `--sticky-fill` | off | with `--sticky`: after the counter, the runner writes `fill` beside the counter file until its disk is full (`sticky fill <path>: <n> bytes, disk full` on stderr), and goes on: a job that fills its cache disk |
//! | `BILLET_STANDIN_REPORT` | `--report` | none | an `http://` URL (a test's sink, `tests/src/reports.rs`) where the runner reports what its node's cache API told it, one JSON object per POST: `{"report": "mounted", "volumes": [{"slot", "key", "path", "generation", "cache_hit", "fallback"}...]}` (or `"error"`) when the job starts, and `{"report": "commit", "slot", "key", "status", "told"}` (or `"error"`) for each commit; each with `runner` (its name) and `seq` (0, 1, ... per runner). A report is sent again until the sink answers 2xx (for at most 60 s) and the runner goes on only then, so it never exits with a report unacknowledged; one given up on is said on stderr |
//! | `BILLET_STANDIN_ACTIONS_CACHE` | `--actions-cache` | none | a cache key: when the job starts the runner uses the Actions cache through its node's proxy as `@actions/cache` does (`BILLET_ACTIONS_PROXY`, a CONNECT with Basic auth, TLS trusting `BILLET_ACTIONS_CA_FILE`, Twirp JSON with the user agent `@actions/cache-4.0.3`): a lookup of the key; on a hit a ranged download (`Range: bytes=2-8`) and a whole one of the signed URL as the node gave it (on its listener: fetched directly, no tunnel), reported as `{"report": "actions-restore", "hit": true, "matched_key", "local", "range_status", "range", "whole_matches", "direct"}` (`direct`: the URL was `http://`, fetched with no tunnel); on a miss a save (create, one `PUT` with `x-ms-blob-type: BlockBlob`, finalize) of a payload naming the key, reported as `{"report": "actions-save", "hit": false, "local", "put_status", "ok"}`. Then two calls the node must splice to GitHub, an `ArtifactService` call and a `CreateCacheEntry` with a `buildkit/` user agent: `{"report": "actions-probe", "artifact_status", "artifact_local", "buildkit_status", "buildkit_local"}`. Without a proxy: `{"report": "actions", "error": ...}`. Needs `BILLET_STANDIN_REPORT` |
//! | `BILLET_STANDIN_ACTIONS_ROUNDS` | `--actions-rounds` | 0 | with `BILLET_STANDIN_ACTIONS_CACHE`: "call, wait for a signal, call again". After the probes the runner holds a signed download URL of the key (a lookup of the exact key) and a signed upload URL of `<key>-held` (a create), reported as `{"report": "actions-held", "lookup_ok", "lookup_local", "create_ok", "create_local"}`; then for each round n from 1 it waits for the gate `actions-round-<n>` (`BILLET_STANDIN_GATES`) and calls again: a whole `GET` of the held download URL, a `PUT` of `<key>-held`'s payload to the held upload URL and a fresh lookup of the key, reported as `{"report": "actions-round", "round", "download_status", "download_local", "download_matches", "upload_status", "upload_local", "lookup_status", "lookup_local", "lookup_ok"}`; after the last round it finalizes `<key>-held`: `{"report": "actions-finalize", "status", "local", "ok"}`. A test changes something between rounds (the plane's kill switch) and reads what each call got. A gate not open within 120 s is reported as `actions` with an error, and the job goes on |
//! | `BILLET_STANDIN_GATES` | `--gates` | none | an `http://` URL where the runner waits for a test's signals (the sink of `tests/src/reports.rs`): the gate `NAME` is open once `GET <url>/NAME` answers 2xx; a closed one is asked again every 100 ms |
//! | `BILLET_STANDIN_DOCKER_STORE` | `--docker-store` | none | `ready` or `never`: the runner also plays the guest agent of the node's Docker image store (`/var/lib/docker`, its cache session's slot 0): when the job starts it asks for the store (`POST /v1/docker-store` with its architecture, reported as `docker-store` with the answer), reads the stand-in "images" counter `/var/lib/docker/billet-standin-images` (a missing file is 0) and writes it back incremented (`images <old> -> <new>` on stderr, and in the report); after completing the job, `ready` says the store is ready with a clean-unmount proof (`POST /v1/docker-store/ready`), asking again every 100 ms while the node answers 409 (settlement not open yet) for at most `BILLET_STANDIN_READY_WAIT_MS`, and reports the last answer as `docker-ready`; `never` exits without a word. Its sticky-disk commits skip the image store |
//! | `BILLET_STANDIN_READY_WAIT_MS` | `--ready-wait-ms` | 60000 | how long the guest agent asks to say ready, in milliseconds |
//! | `BILLET_STANDIN_POST_JOB_MS` | `--post-job-ms` | 0 | how long the runner keeps working after it completed its job (post-job steps, log upload), in milliseconds, before it exits 0; with `ignore-sigterm`, SIGTERM is ignored then too |
//!
//! The modes, the normal runner and the faults the end-to-end tests play:
//!
//! | `BILLET_STANDIN_MODE` | what the runner does |
//! |---|---|
//! | `job` | the default, as above: takes a job, works `WORK_MS`, completes it, exits 0 |
//! | `never-connect` | decodes its JIT config, then never asks the emulator anything and never takes a job; waits for a signal (SIGTERM: 143); the idle timeout does not apply |
//! | `hang` | takes a job and never completes it, working until a signal (SIGTERM: 143) |
//! | `ignore-sigterm` | as `job`, but every SIGTERM, from start to exit, is logged and ignored: only SIGKILL (or SIGINT) stops it early |
//! | `allocate` | takes a job, then allocates memory in 16 MiB chunks, writing every page, until killed: under a container memory limit it is OOM-killed (137). With `ALLOCATE_MIB` it stops there, holds the memory, and works and completes the job as `job` does |
//! | `exit` | takes a job and exits with `EXIT_CODE` without completing it, as a runner that crashed mid-job: the emulator keeps the job running and the runner registered |
//! | `oom-step` | takes a job and runs one step as a child process (this binary again, with `BILLET_STANDIN_STEP=allocate`) that allocates memory as `allocate` does until killed: under a container memory limit the OOM killer ends the step, not the runner, and Docker marks the container OOM-killed. The runner says how the step ended (`step ended: ...`), then works and completes the job as `job` does and exits 0, as `actions/runner` does when a step fails |
//!
//! At start, before anything else, it says on stderr what registry mirrors its node handed it
//! (`registry mirrors: env <BILLET_REGISTRY_MIRRORS or unset>; daemon.json <the registry-mirrors
//! of /etc/docker/daemon.json, or absent>`), for tests that a guest sees exactly those.
//!
//! Once it has a job, every mode says so on stderr (`runner <name> took job <id>`) before doing
//! what its mode does, so a test can wait for that line; a runner waiting for one says `waiting
//! for a job`, and `never-connect` says `never connects`. Each line comes after the signal
//! handlers are installed.
//!
//! | exit code | meaning |
//! |---|---|
//! | 0 | a job was run and completed |
//! | 1 | no job within the idle timeout, the runner was removed, or the completion failed |
//! | 2 | usage error: no or malformed JIT config, unknown mode, bad option |
//! | 3 | mode `exit`: took a job and left it uncompleted (the code is `EXIT_CODE`, 3 unless set) |
//! | 130 | SIGINT |
//! | 143 | SIGTERM (not in mode `ignore-sigterm`) |
//!
//! A SIGKILL, which includes the kernel's OOM killer, ends it with 137 as seen by Docker.

use std::fmt;
use std::future::Future;
use std::pin::pin;
use std::process::ExitCode;
use std::time::Duration;

use base64::Engine as _;
use clap::Parser;
use futures::{Stream, StreamExt as _, stream};
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
/// Mode `allocate`: how much memory is allocated at a time, in MiB.
const ALLOCATE_CHUNK_MIB: u64 = 16;
/// Mode `allocate`: one byte in every this many is written. The smallest page size Linux uses,
/// so every page of a chunk is touched, whatever the page size.
const TOUCH_STRIDE_BYTES: usize = 4096;
const MIB_BYTES: usize = 1 << 20;
/// How long one report is sent again before the runner gives up on it.
const REPORT_RETRY_FOR: Duration = Duration::from_secs(60);
/// How long the runner waits for a gate to open before it gives up on it.
const GATE_WAIT: Duration = Duration::from_secs(120);
/// How often a closed gate is asked again.
const GATE_POLL: Duration = Duration::from_millis(100);

/// Plays an ephemeral GitHub Actions runner against the scaleset emulator: takes one job
/// assigned to its scale set, works, completes it and exits. Other modes play the faults of a
/// real runner for tests.
#[derive(Debug, Parser)]
#[command(version)]
struct Cli {
    /// The encoded JIT config, as given to actions/runner.
    #[arg(long, env = "ACTIONS_RUNNER_INPUT_JITCONFIG", hide_env_values = true)]
    jitconfig: String,
    /// What the runner does: job, never-connect, hang, ignore-sigterm, allocate, exit or oom-step
    ///
    ///   job             take a job, work, complete it, exit 0
    ///   never-connect   never ask the emulator anything; wait for a signal
    ///   hang            take a job and never complete it; wait for a signal
    ///   ignore-sigterm  as job, but log and ignore every SIGTERM
    ///   allocate        take a job, then allocate and write memory in 16 MiB chunks until
    ///                   killed, or up to --allocate-mib and then work and complete the job
    ///   exit            take a job and exit with --exit-code without completing it
    ///   oom-step        take a job, run a step (a child process) that allocates memory until
    ///                   killed, then work and complete the job and exit 0
    #[arg(
        long,
        verbatim_doc_comment,
        env = "BILLET_STANDIN_MODE",
        default_value = "job",
        value_parser = Mode::parse
    )]
    mode: Mode,
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
    /// Mode exit: the code to exit with after taking the job, 0 to 255.
    #[arg(long, env = "BILLET_STANDIN_EXIT_CODE", default_value_t = 3, value_parser = exit_code)]
    exit_code: u8,
    /// Mode allocate: allocate this many MiB, then hold them and work and complete the job;
    /// without it, allocate until killed.
    #[arg(long, env = "BILLET_STANDIN_ALLOCATE_MIB", value_parser = allocate_mib)]
    allocate_mib: Option<u64>,
    /// How long to keep working after the job is completed (post-job steps), in
    /// milliseconds, before exiting.
    #[arg(long, env = "BILLET_STANDIN_POST_JOB_MS", default_value_t = 0)]
    post_job_ms: u64,
    /// A sticky disk's counter file, read and written incremented as the job's work.
    #[arg(long, env = "BILLET_STANDIN_STICKY")]
    sticky: Option<std::path::PathBuf>,
    /// A cache key to restore, or save when missing, through the node's Actions cache proxy.
    #[arg(long, env = "BILLET_STANDIN_ACTIONS_CACHE")]
    actions_cache: Option<String>,
    /// With `--sticky`: after the counter, fill the sticky disk (a file `fill` beside the
    /// counter) until it is full.
    #[arg(long, env = "BILLET_STANDIN_STICKY_FILL")]
    sticky_fill: bool,
    /// Where to report what the node's cache API told the runner (an http:// URL).
    #[arg(long, env = "BILLET_STANDIN_REPORT")]
    report: Option<String>,
    /// How long to wait after start before the first look at the emulator, in milliseconds:
    /// the runner stays idle (registered, taking no job) until then.
    #[arg(long, env = "BILLET_STANDIN_FIRST_LOOK_MS", default_value_t = 0)]
    first_look_ms: u64,
    /// Play the guest agent of the Docker image store: `ready` or `never` (the module doc).
    #[arg(long, env = "BILLET_STANDIN_DOCKER_STORE", value_parser = ["ready", "never"])]
    docker_store: Option<String>,
    /// How long the guest agent asks to say it is ready, in milliseconds.
    #[arg(long, env = "BILLET_STANDIN_READY_WAIT_MS", default_value_t = 60_000)]
    ready_wait_ms: u64,
    /// With `--actions-cache`: hold a download and an upload URL, then repeat the calls on them
    /// this many times, each round after its gate opens (the module doc).
    #[arg(long, env = "BILLET_STANDIN_ACTIONS_ROUNDS", default_value_t = 0)]
    actions_rounds: u32,
    /// Where the runner waits for a test's signals (an http:// URL): gate `NAME` is open once
    /// `GET <url>/NAME` answers 2xx.
    #[arg(long, env = "BILLET_STANDIN_GATES")]
    gates: Option<String>,
}

/// What the runner does with its JIT config (`BILLET_STANDIN_MODE`; the module doc's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Take a job, work, complete it: the runner as it should be.
    Job,
    /// Never poll nor take a job; wait for a signal.
    NeverConnect,
    /// Take a job and never complete it.
    Hang,
    /// As [`Mode::Job`], ignoring SIGTERM.
    IgnoreSigterm,
    /// Take a job, then allocate and touch memory until killed or the cap is reached.
    Allocate,
    /// Take a job and exit with the configured code without completing it.
    Exit,
    /// Take a job, run a step that is OOM-killed, then complete the job.
    OomStep,
}

impl Mode {
    /// Every mode, in the order the documentation lists them.
    const ALL: [Self; 7] = [
        Self::Job,
        Self::NeverConnect,
        Self::Hang,
        Self::IgnoreSigterm,
        Self::Allocate,
        Self::Exit,
        Self::OomStep,
    ];

    /// The mode's name in `BILLET_STANDIN_MODE`.
    fn name(self) -> &'static str {
        match self {
            Self::Job => "job",
            Self::NeverConnect => "never-connect",
            Self::Hang => "hang",
            Self::IgnoreSigterm => "ignore-sigterm",
            Self::Allocate => "allocate",
            Self::Exit => "exit",
            Self::OomStep => "oom-step",
        }
    }

    /// Reads a mode by its exact name.
    ///
    /// # Errors
    ///
    /// A sentence naming `BILLET_STANDIN_MODE` and every mode there is.
    fn parse(name: &str) -> Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|mode| mode.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Self::ALL.into_iter().map(Self::name).collect();
                format!(
                    "unknown BILLET_STANDIN_MODE {name:?}; the modes are {}",
                    names.join(", ")
                )
            })
    }
}

impl fmt::Display for Mode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// Reads `BILLET_STANDIN_EXIT_CODE`.
fn exit_code(text: &str) -> Result<u8, String> {
    text.parse().map_err(|_| {
        format!("BILLET_STANDIN_EXIT_CODE must be a whole number from 0 to 255, not {text:?}")
    })
}

/// Reads `BILLET_STANDIN_ALLOCATE_MIB`.
fn allocate_mib(text: &str) -> Result<u64, String> {
    match text.parse() {
        Ok(mib) if mib > 0 => Ok(mib),
        _ => Err(format!(
            "BILLET_STANDIN_ALLOCATE_MIB must be a whole number of MiB, at least 1, not {text:?}"
        )),
    }
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
#[derive(Debug, PartialEq, Eq)]
enum Failure {
    /// The emulator could not be asked (not up yet, or busy): look again.
    Transient(String),
    /// Exit 1, with this sentence.
    Runtime(String),
    /// Exit with this code, silently: signals, and mode `exit` (which has said why already).
    Code(u8),
}

/// A signal that stops the runner, as [`supervise`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stop {
    /// SIGTERM: exit 143, except in mode `ignore-sigterm`.
    Term,
    /// SIGINT: exit 130.
    Int,
}

/// Increments the decimal counter in `path` (a missing file counts 0), saying so on stderr; a
/// file that cannot be read, parsed or written is said, and nothing else happens: a cache never
/// fails a job.
fn count(path: &std::path::Path) {
    let old = match std::fs::read_to_string(path) {
        Ok(text) => match text.trim().parse::<u64>() {
            Ok(n) => n,
            Err(e) => {
                eprintln!(
                    "billet-standin-runner: sticky counter {}: not a number: {e}",
                    path.display()
                );
                return;
            }
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => 0,
        Err(e) => {
            eprintln!(
                "billet-standin-runner: sticky counter {}: {e}",
                path.display()
            );
            return;
        }
    };
    let new = old + 1;
    match std::fs::write(path, format!("{new}\n")) {
        Ok(()) => eprintln!(
            "billet-standin-runner: sticky counter {}: {old} -> {new}",
            path.display()
        ),
        Err(e) => eprintln!(
            "billet-standin-runner: sticky counter {}: {e}",
            path.display()
        ),
    }
}

/// Writes `fill` beside `counter` until its disk is full, saying how much on stderr; any other
/// failure is said and the job goes on.
fn fill_beside(counter: &std::path::Path) {
    use std::io::Write as _;
    let path = counter.with_file_name("fill");
    let mut written = 0u64;
    let outcome = std::fs::File::create(&path).and_then(|mut f| {
        let chunk = vec![0xa5u8; 1 << 20];
        loop {
            match f.write(&chunk) {
                Ok(0) => return Ok(()),
                Ok(n) => written += n as u64,
                Err(e) if e.kind() == std::io::ErrorKind::StorageFull => return Ok(()),
                Err(e) => return Err(e),
            }
        }
    });
    match outcome {
        Ok(()) => eprintln!(
            "billet-standin-runner: sticky fill {}: {written} bytes, disk full",
            path.display()
        ),
        Err(e) => eprintln!(
            "billet-standin-runner: sticky fill {}: {e} after {written} bytes",
            path.display()
        ),
    }
}

/// Where a guest that runs Docker finds its daemon configuration.
const DAEMON_JSON: &str = "/etc/docker/daemon.json";

/// What the runner sees of the registry mirrors its node hands it, in one line:
/// `env <value of BILLET_REGISTRY_MIRRORS, or unset>; daemon.json <its registry-mirrors as
/// JSON, or absent>`. A daemon configuration that is not JSON is said so.
fn registry_mirrors(env: Option<&str>, daemon_json: &std::path::Path) -> String {
    let env = env.map_or_else(|| "unset".to_owned(), |v| format!("{v:?}"));
    let file = match std::fs::read_to_string(daemon_json) {
        Ok(text) => match serde_json::from_str::<serde_json::Value>(&text) {
            Ok(v) => v
                .get("registry-mirrors")
                .map_or_else(|| "no registry-mirrors".to_owned(), ToString::to_string),
            Err(e) => format!("not JSON: {e}"),
        },
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => "absent".to_owned(),
        Err(e) => format!("unreadable: {e}"),
    };
    format!("env {env}; daemon.json {file}")
}

/// The guest side of the node's cache API (`agent/src/cache/session.rs`), as the reference's
/// `stickydisk` action uses it (spec/cache.md §2.6): the credentials from the environment
/// (`BILLET_CACHE_ENDPOINT`, `unix:<socket>`, and `BILLET_CACHE_TOKEN`); at the job's start what
/// was mounted (`GET /v1/volumes`, `cache-hit` = not cold); after its last write a commit of
/// each disk with the job's status (`POST /v1/volumes/{slot}/commit`). Every answer is said on
/// stderr (`cache volume ...`, `cache commit slot N key K: told {...}`), never the token; a
/// failure is said and the job goes on cold.
struct CacheGuest {
    socket: std::path::PathBuf,
    token: String,
}

impl CacheGuest {
    fn from_env() -> Option<Self> {
        let endpoint = std::env::var("BILLET_CACHE_ENDPOINT").ok()?;
        let token = std::env::var("BILLET_CACHE_TOKEN").ok()?;
        let Some(socket) = endpoint.strip_prefix("unix:") else {
            eprintln!(
                "billet-standin-runner: cache endpoint {endpoint:?} is not unix:<path>; going on cold"
            );
            return None;
        };
        Some(Self {
            socket: socket.into(),
            token,
        })
    }

    /// One request; the status and the JSON body.
    async fn call(
        &self,
        method: &str,
        path: &str,
        body: &str,
    ) -> Result<(u16, serde_json::Value), String> {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        let mut stream = tokio::net::UnixStream::connect(&self.socket)
            .await
            .map_err(|e| format!("connect {}: {e}", self.socket.display()))?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: billet-cache\r\nAuthorization: Bearer {}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            self.token,
            body.len()
        );
        stream
            .write_all(request.as_bytes())
            .await
            .map_err(|e| format!("send: {e}"))?;
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(780), stream.read_to_end(&mut answer))
            .await
            .map_err(|_| "no answer within 13 minutes".to_owned())?
            .map_err(|e| format!("read: {e}"))?;
        let answer = String::from_utf8_lossy(&answer);
        let (head, body) = answer.split_once("\r\n\r\n").ok_or("a truncated answer")?;
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or("no status line")?;
        let json = serde_json::from_str(body).map_err(|e| format!("not JSON ({e}): {body}"))?;
        Ok((status, json))
    }

    /// What was mounted (`GET /v1/volumes`): the answer's `volumes`, or why there is none.
    async fn volumes(&self) -> Result<Vec<serde_json::Value>, String> {
        match self.call("GET", "/v1/volumes", "").await? {
            (200, json) => Ok(json["volumes"].as_array().cloned().unwrap_or_default()),
            (status, json) => Err(format!("status {status}: {json}")),
        }
    }

    /// Says what was mounted, on stderr and to `reporter`: each volume with `cache-hit` (not
    /// cold and not a fallback), as the reference's action sets its output.
    async fn mounted(&self, reporter: Option<&Reporter>) {
        let report = match self.volumes().await {
            Ok(volumes) => {
                let volumes: Vec<serde_json::Value> = volumes
                    .iter()
                    .filter(|v| v["docker"] != true)
                    .map(|v| {
                        let fallback = v["fallback"].as_bool().unwrap_or(false);
                        let hit = !v["cold"].as_bool().unwrap_or(true) && !fallback;
                        eprintln!(
                            "billet-standin-runner: cache volume slot {} key {} at {}: generation {} cache-hit {hit} fallback {fallback}",
                            v["slot"], v["key"], v["path"], v["generation"],
                        );
                        serde_json::json!({
                            "slot": v["slot"],
                            "key": v["key"],
                            "path": v["path"],
                            "generation": v["generation"],
                            "cache_hit": hit,
                            "fallback": fallback,
                        })
                    })
                    .collect();
                serde_json::json!({ "volumes": volumes })
            }
            Err(e) => {
                eprintln!("billet-standin-runner: cache volumes: {e}; going on cold");
                serde_json::json!({ "error": e })
            }
        };
        if let Some(reporter) = reporter {
            reporter.report("mounted", report).await;
        }
    }

    /// The guest agent's start (`BILLET_STANDIN_DOCKER_STORE`): asks for the Docker image store
    /// with this machine's architecture, then counts the stand-in "images" on it; reports both.
    async fn docker_store(&self, reporter: Option<&Reporter>) {
        let arch = match std::env::consts::ARCH {
            "x86_64" => "amd64",
            "aarch64" => "arm64",
            other => other,
        };
        let body = serde_json::json!({ "architecture": arch }).to_string();
        let mut report = match self.call("POST", "/v1/docker-store", &body).await {
            Ok((status, answer)) => {
                eprintln!("billet-standin-runner: docker store: status {status} {answer}");
                serde_json::json!({ "status": status, "answer": answer })
            }
            Err(e) => {
                eprintln!("billet-standin-runner: docker store: {e}");
                serde_json::json!({ "error": e })
            }
        };
        let images = std::path::Path::new(DOCKER_IMAGES);
        let found = std::fs::read_to_string(images)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok())
            .unwrap_or(0);
        match std::fs::write(images, format!("{}\n", found + 1)) {
            Ok(()) => eprintln!("billet-standin-runner: images {found} -> {}", found + 1),
            Err(e) => eprintln!("billet-standin-runner: images: cannot write {DOCKER_IMAGES}: {e}"),
        }
        report["images_found"] = found.into();
        if let Some(reporter) = reporter {
            reporter.report("docker-store", report).await;
        }
    }

    /// The guest agent's end, once the job is completed: says the image store is ready with a
    /// clean-unmount proof, asking again every 100 ms while the node answers 409 (settlement not
    /// open yet), for at most `wait`; reports the last answer.
    async fn docker_ready(&self, wait: Duration, reporter: Option<&Reporter>) {
        let proof = serde_json::json!({
            "filesystem": { "type": "dir", "uuid": uuid_of_store(), "clean": true }
        })
        .to_string();
        let deadline = tokio::time::Instant::now() + wait;
        let report = loop {
            let answer = self.call("POST", "/v1/docker-store/ready", &proof).await;
            match answer {
                Ok((409, _)) if tokio::time::Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Ok((status, answer)) => {
                    eprintln!(
                        "billet-standin-runner: docker store ready: status {status} {answer}"
                    );
                    break serde_json::json!({ "status": status, "answer": answer });
                }
                Err(e) => {
                    eprintln!("billet-standin-runner: docker store ready: {e}");
                    break serde_json::json!({ "error": e });
                }
            }
        };
        if let Some(reporter) = reporter {
            reporter.report("docker-ready", report).await;
        }
    }

    /// Commits each mounted volume with the job's status, saying what it was told on stderr
    /// and to `reporter`.
    async fn commit(&self, succeeded: bool, reporter: Option<&Reporter>) {
        let job_status = if succeeded { "success" } else { "failure" };
        let volumes = match self.volumes().await {
            Ok(volumes) => volumes,
            Err(e) => {
                eprintln!("billet-standin-runner: cache volumes: {e}; committing nothing");
                if let Some(reporter) = reporter {
                    reporter
                        .report("commit", serde_json::json!({ "error": e }))
                        .await;
                }
                return;
            }
        };
        // The image store is the guest agent's, never the sticky-disk action's.
        for v in volumes.into_iter().filter(|v| v["docker"] != true) {
            let slot = &v["slot"];
            let body = serde_json::json!({ "job_status": job_status }).to_string();
            let report = match self
                .call("POST", &format!("/v1/volumes/{slot}/commit"), &body)
                .await
            {
                Ok((status, told)) => {
                    eprintln!(
                        "billet-standin-runner: cache commit slot {slot} key {}: status {status} told {told}",
                        v["key"]
                    );
                    serde_json::json!({ "slot": slot, "key": v["key"], "status": status, "told": told })
                }
                Err(e) => {
                    eprintln!("billet-standin-runner: cache commit slot {slot}: {e}");
                    serde_json::json!({ "slot": slot, "key": v["key"], "error": e })
                }
            };
            if let Some(reporter) = reporter {
                reporter.report("commit", report).await;
            }
        }
    }
}

/// The results service's host, which the node's proxy intercepts.
const RESULTS_HOST: &str = "results-receiver.actions.githubusercontent.com";
/// The user agent `@actions/cache` sends.
const ACTIONS_CACHE_UA: &str = "@actions/cache-4.0.3";
/// The Twirp service of the cache.
const CACHE_SERVICE: &str = "/twirp/github.actions.results.api.v1.CacheService/";

/// The guest side of the node's Actions cache proxy (`agent/src/cache/actions/`), as
/// `@actions/cache` speaks to the results service through an HTTPS proxy: each request on a
/// tunnel of its own (`CONNECT` with `Proxy-Authorization: Basic`, then TLS with the results host
/// as server name, trusting the node's CA).
struct ActionsGuest {
    proxy: String,
    auth: String,
    tls: tokio_rustls::TlsConnector,
}

/// One answer: status, head, body.
struct Answered {
    status: u16,
    head: String,
    body: Vec<u8>,
}

impl Answered {
    fn local(&self) -> bool {
        self.head
            .to_ascii_lowercase()
            .contains("x-billet-actions-cache: local")
    }
    fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_default()
    }
}

impl ActionsGuest {
    fn from_env() -> Result<Self, String> {
        let url = std::env::var("BILLET_ACTIONS_PROXY")
            .map_err(|_| "no Actions cache proxy: BILLET_ACTIONS_PROXY is unset".to_owned())?;
        let ca_file = std::env::var("BILLET_ACTIONS_CA_FILE")
            .map_err(|_| "BILLET_ACTIONS_CA_FILE is unset".to_owned())?;
        let rest = url
            .strip_prefix("http://")
            .ok_or("the proxy URL is not http://")?;
        let (userinfo, proxy) = rest
            .rsplit_once('@')
            .ok_or("the proxy URL has no userinfo")?;
        let pem = std::fs::read(&ca_file).map_err(|e| format!("{ca_file}: {e}"))?;
        let mut roots = rustls::RootCertStore::empty();
        for cert in rustls_pemfile_certs(&pem) {
            roots.add(cert).map_err(|e| format!("{ca_file}: {e}"))?;
        }
        let provider = std::sync::Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut config = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_root_certificates(roots)
            .with_no_client_auth();
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Self {
            proxy: proxy.trim_end_matches('/').to_owned(),
            auth: base64::engine::general_purpose::STANDARD.encode(userinfo),
            tls: tokio_rustls::TlsConnector::from(std::sync::Arc::new(config)),
        })
    }

    /// Sends `method path` with `headers` and `body` on a fresh tunnel.
    async fn send(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answered, String> {
        use tokio::io::AsyncWriteExt as _;
        let mut tcp = tokio::net::TcpStream::connect(&self.proxy)
            .await
            .map_err(|e| format!("connect {}: {e}", self.proxy))?;
        tcp.write_all(
            format!(
                "CONNECT {RESULTS_HOST}:443 HTTP/1.1\r\nHost: {RESULTS_HOST}:443\r\nProxy-Authorization: Basic {}\r\n\r\n",
                self.auth
            )
            .as_bytes(),
        )
        .await
        .map_err(|e| format!("CONNECT: {e}"))?;
        let (head, _) = read_http(&mut tcp).await?;
        if !head.starts_with("HTTP/1.1 200") {
            return Err(format!(
                "CONNECT refused: {}",
                head.lines().next().unwrap_or("")
            ));
        }
        let name =
            rustls::pki_types::ServerName::try_from(RESULTS_HOST).map_err(|e| e.to_string())?;
        let mut tls = self
            .tls
            .connect(name, tcp)
            .await
            .map_err(|e| format!("TLS: {e}"))?;
        exchange(&mut tls, RESULTS_HOST, method, path, headers, body).await
    }

    /// Sends `method` to a signed URL as `@actions/cache`'s HTTP client does: one on the results
    /// host in a tunnel ([`Self::send`]); an `http://` one (the node's listener) straight to the
    /// host it names, with no proxy (the job sets an HTTPS proxy only).
    async fn fetch(
        &self,
        method: &str,
        url: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> Result<Answered, String> {
        if let Some(path) = url.strip_prefix(&format!("https://{RESULTS_HOST}")) {
            return self.send(method, path, headers, body).await;
        }
        let rest = url
            .strip_prefix("http://")
            .ok_or_else(|| format!("a signed URL neither on the results host nor http: {url}"))?;
        let (authority, target) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
        let mut tcp = tokio::net::TcpStream::connect(authority)
            .await
            .map_err(|e| format!("connect {authority}: {e}"))?;
        exchange(&mut tcp, authority, method, target, headers, body).await
    }

    async fn twirp(
        &self,
        method: &str,
        ua: &str,
        json: &serde_json::Value,
    ) -> Result<Answered, String> {
        self.send(
            "POST",
            &format!("{CACHE_SERVICE}{method}"),
            &[
                ("Content-Type", "application/json"),
                ("User-Agent", ua),
                ("Authorization", "Bearer runtime-token"),
            ],
            json.to_string().as_bytes(),
        )
        .await
    }
}

fn rustls_pemfile_certs(pem: &[u8]) -> Vec<rustls::pki_types::CertificateDer<'static>> {
    use rustls::pki_types::pem::PemObject as _;
    rustls::pki_types::CertificateDer::pem_slice_iter(pem)
        .filter_map(Result::ok)
        .collect()
}

/// Writes one HTTP/1.1 request (`method target`, `Host: host`, `headers`, a `Content-Length`
/// body) to `s` and reads its answer.
async fn exchange<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    s: &mut S,
    host: &str,
    method: &str,
    target: &str,
    headers: &[(&str, &str)],
    body: &[u8],
) -> Result<Answered, String> {
    use tokio::io::AsyncWriteExt as _;
    let mut raw = format!("{method} {target} HTTP/1.1\r\nHost: {host}\r\n");
    for (k, v) in headers {
        raw.push_str(&format!("{k}: {v}\r\n"));
    }
    raw.push_str(&format!("Content-Length: {}\r\n\r\n", body.len()));
    s.write_all(raw.as_bytes())
        .await
        .map_err(|e| format!("send: {e}"))?;
    s.write_all(body).await.map_err(|e| format!("send: {e}"))?;
    s.flush().await.map_err(|e| format!("send: {e}"))?;
    let (head, body) = read_http(s).await?;
    let status = head
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or("no status line")?;
    Ok(Answered { status, head, body })
}

/// Reads one HTTP/1.1 message's head and `Content-Length` body.
async fn read_http<S: tokio::io::AsyncRead + Unpin>(
    s: &mut S,
) -> Result<(String, Vec<u8>), String> {
    use tokio::io::AsyncReadExt as _;
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(60), s.read(&mut byte))
            .await
            .map_err(|_| "no answer within 60 s".to_owned())?
            .map_err(|e| format!("read: {e}"))?;
        if n == 0 {
            return Err("the connection closed before an answer".into());
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).into_owned();
    let length = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-length")
                .then(|| v.trim().parse::<usize>().ok())?
        })
        .unwrap_or(0);
    let mut body = vec![0u8; length];
    s.read_exact(&mut body)
        .await
        .map_err(|e| format!("read the body: {e}"))?;
    Ok((head, body))
}

/// The payload a save of `key` uploads, so a restore can check what it got.
fn actions_payload(key: &str) -> Vec<u8> {
    format!("billet actions cache payload of {key}").into_bytes()
}

/// Restores `key` through the node's proxy, or saves it when missing; then probes two calls the
/// node must splice to GitHub. Everything is reported (`BILLET_STANDIN_ACTIONS_CACHE`).
async fn actions_cache(key: &str, rounds: u32, gates: Option<&Gates>, reporter: &Reporter) {
    let guest = match ActionsGuest::from_env() {
        Ok(g) => g,
        Err(e) => {
            eprintln!("billet-standin-runner: actions cache: {e}");
            reporter
                .report("actions", serde_json::json!({ "error": e }))
                .await;
            return;
        }
    };
    let outcome: Result<(), String> = async {
        let payload = actions_payload(key);
        let found = guest
            .twirp(
                "GetCacheEntryDownloadURL",
                ACTIONS_CACHE_UA,
                &serde_json::json!({"key": key, "restore_keys": [key], "version": "v1"}),
            )
            .await?;
        let answer = found.json();
        if answer["ok"] == true {
            let url = answer["signed_download_url"].as_str().unwrap_or_default();
            let range = guest.fetch("GET", url, &[("Range", "bytes=2-8")], b"").await?;
            let whole = guest.fetch("GET", url, &[], b"").await?;
            eprintln!("billet-standin-runner: actions cache restored {key} ({} bytes)", whole.body.len());
            reporter
                .report(
                    "actions-restore",
                    serde_json::json!({
                        "hit": true,
                        "matched_key": answer["matched_key"],
                        "local": found.local() && range.local() && whole.local(),
                        "range_status": range.status,
                        "range": String::from_utf8_lossy(&range.body),
                        "whole_matches": whole.body == payload,
                        "direct": url.starts_with("http://"),
                    }),
                )
                .await;
        } else {
            let created = guest
                .twirp(
                    "CreateCacheEntry",
                    ACTIONS_CACHE_UA,
                    &serde_json::json!({"key": key, "version": "v1"}),
                )
                .await?;
            let url = created.json()["signed_upload_url"]
                .as_str()
                .ok_or_else(|| format!("no upload URL: {}", String::from_utf8_lossy(&created.body)))?
                .to_owned();
            let put = guest
                .fetch("PUT", &url, &[("x-ms-blob-type", "BlockBlob")], &payload)
                .await?;
            let finalized = guest
                .twirp(
                    "FinalizeCacheEntryUpload",
                    ACTIONS_CACHE_UA,
                    &serde_json::json!({"key": key, "version": "v1", "size_bytes": payload.len().to_string()}),
                )
                .await?;
            eprintln!("billet-standin-runner: actions cache saved {key}");
            reporter
                .report(
                    "actions-save",
                    serde_json::json!({
                        "hit": false,
                        "local": found.local() && created.local() && put.local() && finalized.local(),
                        "put_status": put.status,
                        "ok": finalized.json()["ok"],
                    }),
                )
                .await;
        }
        let artifact = guest
            .send(
                "POST",
                "/twirp/github.actions.results.api.v1.ArtifactService/CreateArtifact",
                &[
                    ("Content-Type", "application/json"),
                    ("User-Agent", "@actions/artifact-2.1.0"),
                    ("Authorization", "Bearer runtime-token"),
                ],
                b"{\"name\":\"logs\"}",
            )
            .await?;
        let buildkit = guest
            .twirp(
                "CreateCacheEntry",
                "buildkit/v0.20",
                &serde_json::json!({"key": key, "version": "v1"}),
            )
            .await?;
        reporter
            .report(
                "actions-probe",
                serde_json::json!({
                    "artifact_status": artifact.status,
                    "artifact_local": artifact.local(),
                    "buildkit_status": buildkit.status,
                    "buildkit_local": buildkit.local(),
                }),
            )
            .await;
        if rounds > 0 {
            let gates = gates.ok_or("BILLET_STANDIN_ACTIONS_ROUNDS needs BILLET_STANDIN_GATES")?;
            actions_rounds(&guest, key, rounds, gates, reporter).await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = outcome {
        eprintln!("billet-standin-runner: actions cache: {e}");
        reporter
            .report("actions", serde_json::json!({ "error": e }))
            .await;
    }
}

/// The signed URL the node answered in `field` of `answer`, if any.
fn blob_url(answer: &Answered, field: &str) -> Option<String> {
    answer.json()[field].as_str().map(str::to_owned)
}

/// `BILLET_STANDIN_ACTIONS_ROUNDS`: holds a download URL of `key` and an upload URL of
/// `<key>-held`, then calls on them again in each of `rounds` rounds, each after its gate opens,
/// and finally finalizes `<key>-held`; everything reported (the module doc).
async fn actions_rounds(
    guest: &ActionsGuest,
    key: &str,
    rounds: u32,
    gates: &Gates,
    reporter: &Reporter,
) -> Result<(), String> {
    let payload = actions_payload(key);
    let held_key = format!("{key}-held");
    let held_payload = actions_payload(&held_key);
    let lookup = serde_json::json!({"key": key, "restore_keys": [], "version": "v1"});
    let found = guest
        .twirp("GetCacheEntryDownloadURL", ACTIONS_CACHE_UA, &lookup)
        .await?;
    let created = guest
        .twirp(
            "CreateCacheEntry",
            ACTIONS_CACHE_UA,
            &serde_json::json!({"key": held_key, "version": "v1"}),
        )
        .await?;
    reporter
        .report(
            "actions-held",
            serde_json::json!({
                "lookup_ok": found.json()["ok"] == true,
                "lookup_local": found.local(),
                "create_ok": created.json()["ok"] == true,
                "create_local": created.local(),
            }),
        )
        .await;
    let download = blob_url(&found, "signed_download_url").ok_or_else(|| {
        format!(
            "no download URL to hold: {}",
            String::from_utf8_lossy(&found.body)
        )
    })?;
    let upload = blob_url(&created, "signed_upload_url").ok_or_else(|| {
        format!(
            "no upload URL to hold: {}",
            String::from_utf8_lossy(&created.body)
        )
    })?;
    for round in 1..=rounds {
        gates.wait(&format!("actions-round-{round}")).await?;
        let got = guest.fetch("GET", &download, &[], b"").await?;
        let put = guest
            .fetch(
                "PUT",
                &upload,
                &[("x-ms-blob-type", "BlockBlob")],
                &held_payload,
            )
            .await?;
        let looked = guest
            .twirp("GetCacheEntryDownloadURL", ACTIONS_CACHE_UA, &lookup)
            .await?;
        eprintln!(
            "billet-standin-runner: actions cache round {round}: download {}, upload {}, lookup {}",
            got.status, put.status, looked.status
        );
        reporter
            .report(
                "actions-round",
                serde_json::json!({
                    "round": round,
                    "download_status": got.status,
                    "download_local": got.local(),
                    "download_matches": got.body == payload,
                    "upload_status": put.status,
                    "upload_local": put.local(),
                    "lookup_status": looked.status,
                    "lookup_local": looked.local(),
                    "lookup_ok": looked.json()["ok"] == true,
                }),
            )
            .await;
    }
    let finalized = guest
        .twirp(
            "FinalizeCacheEntryUpload",
            ACTIONS_CACHE_UA,
            &serde_json::json!({"key": held_key, "version": "v1", "size_bytes": held_payload.len().to_string()}),
        )
        .await?;
    reporter
        .report(
            "actions-finalize",
            serde_json::json!({
                "status": finalized.status,
                "local": finalized.local(),
                "ok": finalized.json()["ok"] == true,
            }),
        )
        .await;
    Ok(())
}

/// Where the runner waits for a test's signals (`BILLET_STANDIN_GATES`): the gate `NAME` is
/// open once `GET <base>/NAME` answers 2xx.
struct Gates {
    http: reqwest::Client,
    base: String,
}

impl Gates {
    fn new(http: reqwest::Client, base: &str) -> Self {
        Self {
            http,
            base: base.trim_end_matches('/').to_owned(),
        }
    }

    /// Waits until the gate `name` is open, asking every [`GATE_POLL`], for at most
    /// [`GATE_WAIT`].
    async fn wait(&self, name: &str) -> Result<(), String> {
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

/// The stand-in "images" counter on the Docker image store.
const DOCKER_IMAGES: &str = "/var/lib/docker/billet-standin-images";

/// An identifier for the image store's "filesystem" (a directory here): this process's id and
/// the time, which is all the proof's `uuid` needs to be.
fn uuid_of_store() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("standin-{}-{nanos:x}", std::process::id())
}

/// Where the runner reports what its node's cache API told it (`BILLET_STANDIN_REPORT`, a test's
/// sink: `tests/src/reports.rs`). Each report is one JSON object POSTed there, with `report` (its
/// kind), `runner` (the runner's name) and `seq` (its place among this runner's reports, from 0,
/// so a sink keeps a report sent twice once). It is sent again, with exponential backoff, until
/// the sink answers 2xx, for at most [`REPORT_RETRY_FOR`]; [`Reporter::report`] returns only
/// then, so the runner never goes on (nor exits) with a report unacknowledged. One given up on is
/// said on stderr, and the job goes on. No report carries a credential.
struct Reporter {
    http: reqwest::Client,
    url: String,
    runner: String,
    seq: std::sync::atomic::AtomicU64,
}

impl Reporter {
    fn new(http: reqwest::Client, url: &str, runner: &str) -> Self {
        Self {
            http,
            url: url.to_owned(),
            runner: runner.to_owned(),
            seq: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Reports `fields` (a JSON object) as a report of `kind`, until acknowledged or
    /// [`REPORT_RETRY_FOR`] has passed.
    async fn report(&self, kind: &str, mut fields: serde_json::Value) {
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

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    if std::env::var_os(STEP_ENV).is_some() {
        return allocating_step();
    }
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
    eprintln!(
        "billet-standin-runner: registry mirrors: {}",
        registry_mirrors(
            std::env::var("BILLET_REGISTRY_MIRRORS").ok().as_deref(),
            std::path::Path::new(DAEMON_JSON)
        )
    );
    // Installed in every mode before the first progress line, so a test that saw one may signal.
    // Mode ignore-sigterm too receives SIGTERM, to log and drop it: without a handler it would
    // kill the process outside a container, and as PID 1 inside one be dropped without a word.
    let (term, int) = match (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) {
        (Ok(term), Ok(int)) => (term, int),
        (Err(e), _) | (_, Err(e)) => {
            eprintln!("billet-standin-runner: cannot handle signals: {e}");
            return ExitCode::FAILURE;
        }
    };
    let signals = stream::select(
        stream::unfold(term, |mut term| async move {
            term.recv().await.map(|()| (Stop::Term, term))
        }),
        stream::unfold(int, |mut int| async move {
            int.recv().await.map(|()| (Stop::Int, int))
        }),
    );
    let outcome = supervise(run(&cli, &config), cli.mode, &config.runner_name, signals).await;
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

/// Runs `work` to its end unless a signal from `signals` stops it first: SIGTERM gives
/// `Failure::Code(143)`, except in mode `ignore-sigterm`, where it is logged and ignored; SIGINT
/// gives `Failure::Code(130)` in every mode.
async fn supervise<T>(
    work: impl Future<Output = Result<T, Failure>>,
    mode: Mode,
    runner_name: &str,
    signals: impl Stream<Item = Stop>,
) -> Result<T, Failure> {
    let mut work = pin!(work);
    let mut signals = pin!(signals);
    loop {
        tokio::select! {
            outcome = &mut work => return outcome,
            Some(stop) = signals.next() => match stop {
                Stop::Term if mode == Mode::IgnoreSigterm => eprintln!(
                    "billet-standin-runner: runner {runner_name} ignores SIGTERM (mode {mode})"
                ),
                Stop::Term => return Err(Failure::Code(143)),
                Stop::Int => return Err(Failure::Code(130)),
            },
        }
    }
}

/// Does what `cli.mode` says. Returns the id of the job it ran and completed; the modes that do
/// not complete a job return only by failing, or never.
async fn run(cli: &Cli, config: &JitConfig) -> Result<JobRequestId, Failure> {
    if cli.mode == Mode::NeverConnect {
        eprintln!(
            "billet-standin-runner: runner {} (id {}) never connects (mode {}); waiting for a signal",
            config.runner_name, config.runner_id, cli.mode
        );
        return std::future::pending().await;
    }
    let emulator = EmulatorLink::new(config)?;
    let job = emulator.wait_for_job(cli).await?;
    eprintln!(
        "billet-standin-runner: runner {} took job {job}",
        config.runner_name
    );
    match cli.mode {
        Mode::Job | Mode::IgnoreSigterm => emulator.work_and_complete(cli, job).await,
        Mode::Hang => {
            eprintln!(
                "billet-standin-runner: runner {} hangs on job {job} (mode {}): it never completes it",
                config.runner_name, cli.mode
            );
            std::future::pending().await
        }
        Mode::Allocate => {
            let held = allocate(&config.runner_name, cli.allocate_mib).await;
            let completed = emulator.work_and_complete(cli, job).await;
            drop(held);
            completed
        }
        Mode::OomStep => {
            run_allocating_step(&config.runner_name).await?;
            emulator.work_and_complete(cli, job).await
        }
        Mode::Exit => {
            eprintln!(
                "billet-standin-runner: runner {} exits {} without completing job {job} (mode {})",
                config.runner_name, cli.exit_code, cli.mode
            );
            Err(Failure::Code(cli.exit_code))
        }
        Mode::NeverConnect => unreachable!("mode never-connect returns before connecting"),
    }
}

/// The emulator's control API, as this runner uses it.
struct EmulatorLink<'a> {
    http: reqwest::Client,
    /// The emulator's base URL, without a trailing `/`.
    base: &'a str,
    config: &'a JitConfig,
}

impl<'a> EmulatorLink<'a> {
    fn new(config: &'a JitConfig) -> Result<Self, Failure> {
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
    async fn wait_for_job(&self, cli: &Cli) -> Result<JobRequestId, Failure> {
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
        loop {
            match take_job(&self.http, self.base, config).await {
                Ok(Some(job)) => return Ok(job),
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
        }
    }

    /// Works on `job` for `cli.work_ms`, then completes it with `cli.result`, retrying a failed
    /// completion for [`COMPLETE_RETRY_FOR`]. Returns the job's id.
    async fn work_and_complete(
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

/// Mode `allocate`: allocates memory in chunks of [`ALLOCATE_CHUNK_MIB`], writing one byte of
/// every page so the kernel must back it, until `cap_mib` MiB are held (never, without a cap:
/// under a memory limit the OOM killer ends the process). Returns what it holds; each chunk is
/// followed by a yield, so a signal still stops the runner.
async fn allocate(runner_name: &str, cap_mib: Option<u64>) -> Vec<Vec<u8>> {
    let mut held = Vec::new();
    let mut held_mib = 0;
    eprintln!(
        "billet-standin-runner: runner {runner_name} allocates memory (mode allocate) {}",
        cap_mib.map_or_else(
            || "until killed".to_owned(),
            |cap| format!("up to {cap} MiB")
        )
    );
    while let Some(chunk_mib) = next_chunk_mib(held_mib, cap_mib) {
        let chunk_bytes =
            MIB_BYTES * usize::try_from(chunk_mib).expect("a chunk is at most ALLOCATE_CHUNK_MIB");
        held.push(touched(chunk_bytes));
        held_mib += chunk_mib;
        eprintln!("billet-standin-runner: runner {runner_name} holds {held_mib} MiB");
        tokio::task::yield_now().await;
    }
    held
}

/// Mode `oom-step`: runs one job step as a child process, this binary again with
/// [`STEP_ENV`]`=allocate`, which allocates until killed, and says how it ended. The step's end
/// is the job's business, as a failed step is to `actions/runner`: only a step that could not be
/// started fails the runner.
async fn run_allocating_step(runner_name: &str) -> Result<(), Failure> {
    let exe = std::env::current_exe()
        .map_err(|e| Failure::Runtime(format!("cannot find this binary to run a step: {e}")))?;
    eprintln!(
        "billet-standin-runner: runner {runner_name} runs a step that allocates memory until killed (mode oom-step)"
    );
    let status = tokio::process::Command::new(exe)
        .env(STEP_ENV, "allocate")
        .kill_on_drop(true)
        .status()
        .await
        .map_err(|e| Failure::Runtime(format!("cannot run the step: {e}")))?;
    eprintln!("billet-standin-runner: runner {runner_name} step ended: {status}");
    Ok(())
}

/// Set on a step's process by mode `oom-step`: the process is that step, not a runner
/// (`allocate`: allocate until killed).
const STEP_ENV: &str = "BILLET_STANDIN_STEP";

/// A step's process ([`STEP_ENV`]): allocates memory as mode `allocate` does, until killed.
fn allocating_step() -> ExitCode {
    let mut held = Vec::new();
    loop {
        held.push(touched(MIB_BYTES * ALLOCATE_CHUNK_MIB as usize));
    }
}

/// `bytes` of memory with one byte of every page written, so the kernel
/// must back them.
fn touched(bytes: usize) -> Vec<u8> {
    let mut chunk = vec![0_u8; bytes];
    for byte in chunk.iter_mut().step_by(TOUCH_STRIDE_BYTES) {
        *byte = 1;
    }
    std::hint::black_box(chunk)
}

/// The size of the next chunk [`allocate`] takes, in MiB, once it holds `held_mib`; `None` when
/// it holds `cap_mib`.
fn next_chunk_mib(held_mib: u64, cap_mib: Option<u64>) -> Option<u64> {
    let left = cap_mib.map_or(ALLOCATE_CHUNK_MIB, |cap| cap.saturating_sub(held_mib));
    (left > 0).then(|| left.min(ALLOCATE_CHUNK_MIB))
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
    fn the_sticky_counter_counts_from_a_missing_file_and_leaves_a_bad_one_alone() {
        let dir = std::env::temp_dir().join(format!("standin-sticky-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let n = dir.join("n");
        let _ = std::fs::remove_file(&n);
        count(&n);
        assert_eq!(std::fs::read_to_string(&n).unwrap(), "1\n");
        count(&n);
        assert_eq!(std::fs::read_to_string(&n).unwrap(), "2\n");
        std::fs::write(&n, "two").unwrap();
        count(&n);
        assert_eq!(std::fs::read_to_string(&n).unwrap(), "two");
        // A disk that is not there: said, and nothing else.
        count(&dir.join("missing").join("n"));
    }

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

    /// Parses a command line of the stand-in, flags after the program name.
    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("billet-standin-runner").chain(args.iter().copied()))
    }

    #[test]
    fn every_mode_is_read_by_its_name_and_the_default_is_job() {
        for mode in Mode::ALL {
            assert_eq!(Mode::parse(mode.name()), Ok(mode));
            let cli = parse(&["--jitconfig", "x", "--mode", mode.name()]).unwrap();
            assert_eq!(cli.mode, mode);
        }
        let names: Vec<String> = Mode::ALL.iter().map(ToString::to_string).collect();
        assert_eq!(
            names,
            [
                "job",
                "never-connect",
                "hang",
                "ignore-sigterm",
                "allocate",
                "exit",
                "oom-step"
            ]
        );
        let cli = parse(&["--jitconfig", "x"]).unwrap();
        assert_eq!(cli.mode, Mode::Job);
        assert_eq!(cli.exit_code, 3);
        assert_eq!(cli.allocate_mib, None);
    }

    #[test]
    fn an_unknown_mode_is_a_usage_error_naming_the_variable_and_every_mode() {
        for name in ["crash", "Job", " hang", "never_connect", ""] {
            let err = parse(&["--jitconfig", "s3cr3t-token-value", "--mode", name]).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{err}");
            let text = err.to_string();
            assert!(text.contains("unknown BILLET_STANDIN_MODE"), "{text}");
            for mode in Mode::ALL {
                assert!(text.contains(mode.name()), "{text}");
            }
            assert!(!text.contains("s3cr3t"), "{text}");
        }
    }

    #[test]
    fn the_exit_code_is_a_byte_and_a_bad_one_is_a_usage_error_naming_the_variable() {
        for (given, code) in [("0", 0), ("7", 7), ("255", 255)] {
            let cli = parse(&["--jitconfig", "x", "--exit-code", given]).unwrap();
            assert_eq!(cli.exit_code, code);
        }
        for given in ["256", "-1", "three", ""] {
            let err = parse(&["--jitconfig", "x", &format!("--exit-code={given}")]).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{err}");
            assert!(
                err.to_string().contains("BILLET_STANDIN_EXIT_CODE"),
                "{err}"
            );
        }
    }

    #[test]
    fn the_allocation_cap_is_optional_and_at_least_one_mib() {
        let cli = parse(&["--jitconfig", "x", "--allocate-mib", "64"]).unwrap();
        assert_eq!(cli.allocate_mib, Some(64));
        for given in ["0", "-16", "1.5", "lots"] {
            let flag = format!("--allocate-mib={given}");
            let err = parse(&["--jitconfig", "x", &flag]).unwrap_err();
            assert_eq!(err.exit_code(), 2, "{err}");
            assert!(
                err.to_string().contains("BILLET_STANDIN_ALLOCATE_MIB"),
                "{err}"
            );
        }
    }

    #[test]
    fn memory_is_allocated_in_16_mib_chunks_up_to_the_cap_or_forever() {
        for (held_mib, cap_mib, next) in [
            (0, None, Some(16)),
            (1 << 20, None, Some(16)),
            (0, Some(20), Some(16)),
            (16, Some(20), Some(4)),
            (20, Some(20), None),
            (32, Some(20), None),
            (0, Some(1), Some(1)),
        ] {
            assert_eq!(
                next_chunk_mib(held_mib, cap_mib),
                next,
                "holding {held_mib} MiB, cap {cap_mib:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_capped_allocation_holds_exactly_the_cap_with_every_page_written() {
        let held = allocate("r", Some(20)).await;
        let sizes: Vec<usize> = held.iter().map(Vec::len).collect();
        assert_eq!(sizes, [16 * MIB_BYTES, 4 * MIB_BYTES]);
        for chunk in &held {
            assert!(chunk.iter().step_by(TOUCH_STRIDE_BYTES).all(|&b| b == 1));
        }
    }

    /// `stops`, then nothing more, as a process's signals.
    fn signals(stops: &[Stop]) -> impl Stream<Item = Stop> {
        stream::iter(stops.to_vec()).chain(stream::pending())
    }

    /// Work that ends well after the signals have been seen.
    async fn work() -> Result<JobRequestId, Failure> {
        tokio::time::sleep(Duration::from_millis(50)).await;
        Ok(JobRequestId(7))
    }

    #[tokio::test]
    async fn sigterm_ends_the_runner_with_143_and_sigint_with_130_in_every_mode_but_one() {
        for mode in Mode::ALL {
            let int = supervise(work(), mode, "r", signals(&[Stop::Int])).await;
            assert_eq!(int, Err(Failure::Code(130)), "mode {mode}");
            if mode != Mode::IgnoreSigterm {
                let term = supervise(work(), mode, "r", signals(&[Stop::Term])).await;
                assert_eq!(term, Err(Failure::Code(143)), "mode {mode}");
            }
        }
        let unsignalled = supervise(work(), Mode::Job, "r", signals(&[])).await;
        assert_eq!(unsignalled, Ok(JobRequestId(7)));
    }

    #[tokio::test]
    async fn in_mode_ignore_sigterm_sigterms_are_ignored_and_the_work_runs_to_its_end() {
        let term = [Stop::Term, Stop::Term, Stop::Term];
        let outcome = supervise(work(), Mode::IgnoreSigterm, "r", signals(&term)).await;
        assert_eq!(outcome, Ok(JobRequestId(7)));
        let interrupted = [Stop::Term, Stop::Int];
        let outcome = supervise(work(), Mode::IgnoreSigterm, "r", signals(&interrupted)).await;
        assert_eq!(outcome, Err(Failure::Code(130)));
    }

    /// Bound on what the runner does against the in-process emulator.
    const BOUND: Duration = Duration::from_secs(30);
    /// How long a runner must go on not doing something. A runner in mode `job` with no work
    /// time takes the job at its first poll and completes it at once, so this is ample.
    const QUIET: Duration = Duration::from_secs(1);

    /// The emulator with one scale set, one job assigned to it, and one runner registered.
    struct Emulated {
        emu: scaleset::testing::Emulator,
        job: JobRequestId,
        encoded: String,
        config: JitConfig,
    }

    impl Emulated {
        async fn start(runner_name: &str) -> Self {
            use scaleset::{ExposeSecret as _, JitRunnerSetting, RunnerScaleSetSpec};

            let emu = scaleset::testing::Emulator::start().await;
            let client = emu.client();
            let set = client
                .create_runner_scale_set(&RunnerScaleSetSpec::new("standin"))
                .await
                .unwrap()
                .id;
            let session = client
                .create_message_session(set, "standin-test")
                .await
                .unwrap();
            let job = emu.queue_job(set, Vec::<String>::new());
            assert_eq!(session.acquire_jobs(&[job]).await.unwrap(), [job]);
            let jit = client
                .generate_jit_config(set, &JitRunnerSetting::new(runner_name))
                .await
                .unwrap();
            let encoded = jit.encoded_jit_config.expose_secret().to_owned();
            let config = JitConfig::decode(&encoded).unwrap();
            Self {
                emu,
                job,
                encoded,
                config,
            }
        }

        /// The stand-in's options: the JIT config, no work time, then `args`.
        fn cli(&self, args: &[&str]) -> Cli {
            let mut all = vec!["--jitconfig", &self.encoded, "--work-ms", "0"];
            all.extend(args);
            parse(&all).unwrap()
        }

        fn job(&self) -> scaleset::testing::EmulatedJob {
            let state = self.emu.state();
            state
                .jobs
                .iter()
                .find(|j| j.id == self.job)
                .cloned()
                .unwrap_or_else(|| panic!("job {} is gone: {state:#?}", self.job))
        }

        fn runner_registered(&self) -> bool {
            let runner = self.config.runner_id;
            self.emu.state().runners.iter().any(|r| r.id == runner)
        }

        /// Waits until the job runs on this runner, while the runner runs `run` (which must
        /// not end first), and then checks `run` does not end within [`QUIET`].
        async fn runs_the_job_and_goes_on(
            &self,
            run: impl Future<Output = Result<JobRequestId, Failure>>,
        ) {
            let mut run = pin!(run);
            let (job, runner) = (self.job, self.config.runner_id);
            tokio::select! {
                outcome = &mut run => panic!("the runner ended first: {outcome:?}"),
                _ = self.emu.wait_until(BOUND, |s| {
                    s.jobs.iter().any(|j| j.id == job && j.state == JobState::Running
                        && j.runner_id == Some(runner))
                }) => {}
            }
            if let Ok(outcome) = tokio::time::timeout(QUIET, &mut run).await {
                panic!("the runner ended: {outcome:?}");
            }
        }
    }

    #[tokio::test]
    async fn in_mode_job_the_runner_takes_the_assigned_job_and_completes_it() {
        let gh = Emulated::start("standin-job").await;
        let cli = gh.cli(&["--result", "failed"]);
        let outcome = tokio::time::timeout(BOUND, run(&cli, &gh.config)).await;
        assert_eq!(outcome.expect("the runner finishes"), Ok(gh.job));
        let job = gh.job();
        assert_eq!(job.state, JobState::Completed);
        assert_eq!(job.result.as_deref(), Some("failed"));
        assert!(!gh.runner_registered(), "an ephemeral runner is removed");
    }

    #[tokio::test]
    async fn with_post_job_work_the_runner_completes_its_job_first_and_exits_only_after_it() {
        let gh = Emulated::start("standin-post-job").await;
        let cli = gh.cli(&["--post-job-ms", "60000"]);
        let running = run(&cli, &gh.config);
        tokio::pin!(running);
        let finished = tokio::time::timeout(BOUND, async {
            loop {
                tokio::select! {
                    outcome = &mut running => return Some(outcome),
                    () = tokio::time::sleep(Duration::from_millis(50)) => {}
                }
                if gh.job().state == JobState::Completed {
                    return None;
                }
            }
        })
        .await
        .expect("the job completes");
        assert_eq!(finished, None, "the runner exited before its post-job work");
        // Completed, and still working (a minute of post-job work left).
        let more = futures::FutureExt::now_or_never(&mut running);
        assert!(more.is_none(), "the runner did not keep working: {more:?}");
    }

    #[tokio::test]
    async fn in_mode_exit_the_runner_takes_the_job_and_exits_with_its_code_leaving_it_running() {
        let gh = Emulated::start("standin-exit").await;
        let cli = gh.cli(&["--mode", "exit", "--exit-code", "7"]);
        let outcome = tokio::time::timeout(BOUND, run(&cli, &gh.config)).await;
        assert_eq!(outcome.expect("the runner exits"), Err(Failure::Code(7)));
        let job = gh.job();
        assert_eq!(job.state, JobState::Running);
        assert_eq!(job.runner_id, Some(gh.config.runner_id));
        assert!(gh.runner_registered());
    }

    #[tokio::test]
    async fn in_mode_hang_the_runner_takes_the_job_and_never_completes_it() {
        let gh = Emulated::start("standin-hang").await;
        let cli = gh.cli(&["--mode", "hang"]);
        gh.runs_the_job_and_goes_on(run(&cli, &gh.config)).await;
        assert_eq!(gh.job().state, JobState::Running);
    }

    #[tokio::test]
    async fn in_mode_never_connect_the_runner_asks_the_emulator_nothing() {
        let gh = Emulated::start("standin-never").await;
        let cli = gh.cli(&["--mode", "never-connect", "--idle-timeout-ms", "1"]);
        let outcome = tokio::time::timeout(QUIET, run(&cli, &gh.config)).await;
        assert!(outcome.is_err(), "the runner ended: {outcome:?}");
        let asked = gh.emu.requests_to(scaleset::testing::Endpoint::Control);
        assert!(asked.is_empty(), "{asked:#?}");
        assert_eq!(gh.job().state, JobState::Assigned);
    }

    #[tokio::test]
    async fn a_runner_with_a_first_look_delay_stays_idle_until_then_and_then_runs_the_job() {
        let gh = Emulated::start("standin-first-look").await;
        let first_look = QUIET * 2;
        let cli = gh.cli(&["--first-look-ms", &first_look.as_millis().to_string()]);
        let mut running = std::pin::pin!(run(&cli, &gh.config));
        let early = tokio::time::timeout(QUIET, running.as_mut()).await;
        assert!(
            early.is_err(),
            "the runner ended before its first look: {early:?}"
        );
        let asked = gh.emu.requests_to(scaleset::testing::Endpoint::Control);
        assert!(asked.is_empty(), "asked before its first look: {asked:#?}");
        assert_eq!(gh.job().state, JobState::Assigned);
        let outcome = tokio::time::timeout(BOUND, running).await;
        assert_eq!(outcome.expect("the runner finishes"), Ok(gh.job));
        assert_eq!(gh.job().state, JobState::Completed);
    }

    #[tokio::test]
    async fn in_mode_allocate_with_a_cap_the_runner_takes_the_job_allocates_and_completes_it() {
        let gh = Emulated::start("standin-allocate").await;
        let cli = gh.cli(&["--mode", "allocate", "--allocate-mib", "20"]);
        let outcome = tokio::time::timeout(BOUND, run(&cli, &gh.config)).await;
        assert_eq!(outcome.expect("the runner finishes"), Ok(gh.job));
        assert_eq!(gh.job().state, JobState::Completed);
    }

    #[tokio::test]
    async fn in_mode_ignore_sigterm_the_runner_runs_a_job_as_in_mode_job() {
        let gh = Emulated::start("standin-ignore").await;
        let cli = gh.cli(&["--mode", "ignore-sigterm"]);
        let outcome = tokio::time::timeout(BOUND, run(&cli, &gh.config)).await;
        assert_eq!(outcome.expect("the runner finishes"), Ok(gh.job));
        assert_eq!(gh.job().state, JobState::Completed);
    }
}
