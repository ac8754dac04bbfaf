//! `billet-standin-runner`: plays one ephemeral GitHub Actions runner against the `scaleset`
//! crate's emulator, for tests and the demo.
//!
//! It receives its JIT config as `actions/runner` does (`ACTIONS_RUNNER_INPUT_JITCONFIG`, or
//! `--jitconfig <value>`). The emulator's JIT config is base64 of JSON
//! `{"runnerId", "runnerName", "scaleSetId", "emulator": <base URL>}` (scaleset 0.1
//! `testing/state.rs`, `generate_jit_config`). Through the emulator's control API it then polls
//! `GET /_emulator/state` every 200 ms for a job of its scale set in state `assigned`, takes the first
//! with `POST /_emulator/jobs/{id}/start {"runnerName": <its name>}` (409: another runner
//! took it, or it is no longer assigned; look again at once), works for `--work-ms`, completes it with
//! `POST /_emulator/jobs/{id}/complete {"result": <result>}`, prints one line and exits. A job the
//! emulator itself started on this runner (`EmulatedRunner::job`) is worked the same way.
//!
//! The JIT config is a credential: it is never printed, not even in part. A node hands it over
//! once, with the other credentials, through the file `BILLET_SECRETS_FILE` names (a FIFO the
//! node writes `KEY=VALUE` lines into): the runner reads it before anything else and runs itself
//! again with those variables in its environment, so none of them is in the container's
//! recorded configuration.
//!
//! Every option is a flag or an environment variable, so that the node's Docker provider can
//! pass it through a tier's `env`:
//!
//! | variable | flag | default | meaning |
//! |---|---|---|---|
//! | `ACTIONS_RUNNER_INPUT_JITCONFIG` | `--jitconfig` | required | the encoded JIT config |
//! | `BILLET_SECRETS_FILE` | none | none | a file of `KEY=VALUE` lines read once at start, before anything else, into the runner's own environment: how a node hands over the JIT config and the cache's credentials |
//! | `BILLET_STANDIN_MODE` | `--mode` | `job` | what the runner does: the table below |
//! | `BILLET_STANDIN_RUNNER_VERSION` | `--runner-version` | the stand-in's (its image's `org.opencontainers.image.version`) | the actions/runner version it plays, named by mode `stale` |
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
//! | `stale` | plays a runner GitHub refuses for its version: prints `Runner version v<RUNNER_VERSION> is deprecated and cannot receive messages.` on stdout, as `actions/runner` does, and exits 1 before asking for a job |
//!
//! At start it says on stderr what it may do to its host (`confinement: raw socket <opened or
//! refused: ...>; no_new_privs <0 or 1>; pids.max <limit>`), for tests that a guest is confined.
//!
//! At start, before anything else, it says on stderr what registry mirrors its node handed it
//! (`registry mirrors: env <BILLET_REGISTRY_MIRRORS or unset>; daemon.json <the registry-mirrors
//! of /etc/docker/daemon.json, or absent>`), for tests that a guest sees exactly those.
//!
//! While it holds a job, in every mode, a child process of this binary named `Runner.Worker` runs
//! beside it, as `actions/runner` starts one per job: a node reads it from its engine's process
//! list as its own evidence that the runner is at work. It ends when the job does.
//!
//! Once it has a job, every mode says so on stderr (`runner <name> took job <id>`) before doing
//! what its mode does, so a test can wait for that line; a runner waiting for one says `waiting
//! for a job`, and `never-connect` says `never connects`. Each line comes after the signal
//! handlers are installed.
//!
//! | exit code | meaning |
//! |---|---|
//! | 0 | a job was run and completed |
//! | 1 | no job within the idle timeout, the runner was removed, the completion failed, or mode `stale` |
//! | 2 | usage error: no or malformed JIT config, unknown mode, bad option |
//! | 3 | mode `exit`: took a job and left it uncompleted (the code is `EXIT_CODE`, 3 unless set) |
//! | 130 | SIGINT |
//! | 143 | SIGTERM (not in mode `ignore-sigterm`) |
//!
//! A SIGKILL, which includes the kernel's OOM killer, ends it with 137 as seen by Docker.

mod actions_cache;
mod allocate;
mod cache_api;
mod cli;
mod confinement;
mod emulator;
mod jit;
mod mirrors;
mod reports;
mod run;
mod secrets;
mod sticky;
mod worker;

use std::process::ExitCode;

use clap::Parser;
use futures::stream;
use tokio::signal::unix::{SignalKind, signal};

use allocate::{STEP_ENV, allocating_step};
use cli::Cli;
use jit::JitConfig;
use mirrors::{DAEMON_JSON, registry_mirrors};
use run::{Failure, Stop, run, supervise};

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    if worker::is_job_process() {
        return worker::job_process();
    }
    if let Some(e) = secrets::exec_with_secrets() {
        eprintln!("billet-standin-runner: {e}");
        return ExitCode::from(2);
    }
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
        "billet-standin-runner: confinement: {}",
        confinement::confinement()
    );
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
