//! The stand-in runner's image, built from the real binary, plays a runner against the scaleset
//! emulator in a real Docker container.
//!
//! Needs Docker and a built workspace (`cargo build --workspace`); it fails, not skips, without
//! them. Containers run with `network_mode: host`, so the runner reaches the emulator on the
//! host's 127.0.0.1.
//!
//! Of the stand-in's fault modes (`BILLET_STANDIN_MODE`), the ones whose point is how a
//! container ends are run here too: `ignore-sigterm` as PID 1 outlasts `docker stop`'s SIGTERM,
//! and `allocate` is OOM-killed under a memory limit. The others are tested beside the binary.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail, ensure};
use billet_tests::image::{STANDIN_BINARY, binary_path, build_standin_image, connect_docker};
use bollard::Docker;
use bollard::models::{ContainerCreateBody, HostConfig};
use bollard::query_parameters::{
    CreateContainerOptionsBuilder, LogsOptionsBuilder, RemoveContainerOptions,
    RemoveContainerOptionsBuilder, StopContainerOptionsBuilder,
};
use futures::{FutureExt as _, StreamExt as _};
use scaleset::testing::{Emulator, JobState};
use scaleset::{
    ExposeSecret as _, JitRunnerSetting, JobRequestId, MessageSession, RunnerScaleSetSpec,
    ScaleSetId,
};

const TAG: &str = "billet-standin-runner:test";
/// Bound on a container's whole run: start, poll, 300 ms of work, complete.
const RUN_BOUND: Duration = Duration::from_secs(60);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_standin_image_runs_an_assigned_job_to_success_and_its_runner_is_gone()
-> anyhow::Result<()> {
    let runner = "billet-standin-image-run";
    let docker = connect_docker().await?;
    build_standin_image(&docker, &binary_path(STANDIN_BINARY)?, TAG).await?;
    let gh = GitHub::start("standin-image-run").await?;
    let job = gh.emu.queue_job(gh.set, Vec::<String>::new());
    let acquired = gh.session.acquire_jobs(&[job]).await?;
    ensure!(acquired == [job], "acquired {acquired:?}, expected [{job}]");

    let name = container_name("run");
    create_container(&docker, &name, gh.jit_env(runner).await?, None).await?;
    let outcome = with_cleanup(
        &docker,
        &name,
        run_to_success(&docker, &name, &gh, runner, job),
    )
    .await;
    gh.close().await;
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standin_runner_waiting_for_a_job_exits_143_as_soon_as_it_is_stopped()
-> anyhow::Result<()> {
    let runner = "billet-standin-image-stop";
    let docker = connect_docker().await?;
    build_standin_image(&docker, &binary_path(STANDIN_BINARY)?, TAG).await?;
    let gh = GitHub::start("standin-image-stop").await?;

    let name = container_name("stop");
    create_container(&docker, &name, gh.jit_env(runner).await?, None).await?;
    let outcome = with_cleanup(&docker, &name, async {
        docker.start_container(&name, None).await?;
        // It says so once its signal handlers are installed.
        wait_for_log(&docker, &name, "waiting for a job").await?;

        let stopping = Instant::now();
        // A runner ignoring SIGTERM would be killed after 10 s, exiting 137.
        let stop = StopContainerOptionsBuilder::default().t(10).build();
        docker.stop_container(&name, Some(stop)).await?;
        let took = stopping.elapsed();
        let inspected = docker.inspect_container(&name, None).await?;
        let exit = inspected.state.and_then(|s| s.exit_code);
        ensure!(
            exit == Some(143),
            "exit code {exit:?} after SIGTERM; logs:\n{}",
            logs(&docker, &name).await
        );
        ensure!(took < Duration::from_secs(5), "stopping took {took:?}");
        Ok(())
    })
    .await;
    gh.close().await;
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standin_runner_in_mode_ignore_sigterm_outlasts_sigterm_and_only_sigkill_ends_it()
-> anyhow::Result<()> {
    let runner = "billet-standin-image-ignore";
    let docker = connect_docker().await?;
    build_standin_image(&docker, &binary_path(STANDIN_BINARY)?, TAG).await?;
    let gh = GitHub::start("standin-image-ignore").await?;
    let job = gh.emu.queue_job(gh.set, Vec::<String>::new());
    ensure!(gh.session.acquire_jobs(&[job]).await? == [job]);

    let mut env = gh.jit_env(runner).await?;
    set_env(&mut env, "BILLET_STANDIN_MODE", "ignore-sigterm");
    set_env(&mut env, "BILLET_STANDIN_WORK_MS", "600000");
    let name = container_name("ignore");
    create_container(&docker, &name, env, None).await?;
    let outcome = with_cleanup(&docker, &name, async {
        docker.start_container(&name, None).await?;
        wait_for_log(&docker, &name, &format!("took job {job}")).await?;

        let grace_secs = 1;
        let stopping = Instant::now();
        let stop = StopContainerOptionsBuilder::default().t(grace_secs).build();
        docker.stop_container(&name, Some(stop)).await?;
        let took = stopping.elapsed();
        let inspected = docker.inspect_container(&name, None).await?;
        let exit = inspected.state.and_then(|s| s.exit_code);
        let logs = logs(&docker, &name).await;
        ensure!(
            exit == Some(137),
            "exit code {exit:?} after SIGTERM and, {grace_secs} s later, SIGKILL; logs:\n{logs}"
        );
        ensure!(
            took >= Duration::from_secs(1),
            "stopped after {took:?}, before the SIGKILL"
        );
        ensure!(
            logs.contains("ignores SIGTERM"),
            "the SIGTERM was not seen; logs:\n{logs}"
        );
        let state = gh.emu.state();
        ensure!(
            state
                .jobs
                .iter()
                .any(|j| j.id == job && j.state == JobState::Running),
            "job {job} is not left running: {state:#?}"
        );
        Ok(())
    })
    .await;
    gh.close().await;
    outcome
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standin_runner_in_mode_allocate_is_oom_killed_under_a_memory_limit() -> anyhow::Result<()>
{
    let runner = "billet-standin-image-allocate";
    let docker = connect_docker().await?;
    build_standin_image(&docker, &binary_path(STANDIN_BINARY)?, TAG).await?;
    let gh = GitHub::start("standin-image-allocate").await?;
    let job = gh.emu.queue_job(gh.set, Vec::<String>::new());
    ensure!(gh.session.acquire_jobs(&[job]).await? == [job]);

    let mut env = gh.jit_env(runner).await?;
    set_env(&mut env, "BILLET_STANDIN_MODE", "allocate");
    let name = container_name("allocate");
    let limit_bytes = 64 << 20;
    create_container(&docker, &name, env, Some(limit_bytes)).await?;
    let outcome = with_cleanup(&docker, &name, async {
        docker.start_container(&name, None).await?;
        let exit = wait_exit(&docker, &name).await;
        let logs = logs(&docker, &name).await;
        let inspected = docker.inspect_container(&name, None).await?;
        let oom_killed = inspected.state.and_then(|s| s.oom_killed);
        ensure!(
            exit.as_ref().ok() == Some(&137) && oom_killed == Some(true),
            "exit {exit:?}, OOM-killed {oom_killed:?} under a {limit_bytes}-byte limit; logs:\n{logs}"
        );
        ensure!(
            logs.contains(&format!("took job {job}")) && logs.contains("holds 16 MiB"),
            "the runner did not take the job and allocate; logs:\n{logs}"
        );
        Ok(())
    })
    .await;
    gh.close().await;
    outcome
}

/// The emulator with one scale set and its message session open, as the plane would have it.
struct GitHub {
    emu: Emulator,
    client: scaleset::Client,
    set: ScaleSetId,
    session: MessageSession,
}

impl GitHub {
    async fn start(scale_set: &str) -> anyhow::Result<Self> {
        let emu = Emulator::builder()
            .long_poll(Duration::from_millis(200))
            .bind("127.0.0.1:0".parse()?)
            .start()
            .await;
        let client = emu.client();
        let set = client
            .create_runner_scale_set(&RunnerScaleSetSpec::new(scale_set))
            .await?
            .id;
        let session = client
            .create_message_session(set, "standin-image-test")
            .await?;
        Ok(Self {
            emu,
            client,
            set,
            session,
        })
    }

    /// Registers `runner` and returns the container environment carrying its JIT config.
    async fn jit_env(&self, runner: &str) -> anyhow::Result<Vec<String>> {
        let jit = self
            .client
            .generate_jit_config(self.set, &JitRunnerSetting::new(runner))
            .await?;
        Ok(vec![
            format!(
                "ACTIONS_RUNNER_INPUT_JITCONFIG={}",
                jit.encoded_jit_config.expose_secret()
            ),
            "BILLET_STANDIN_WORK_MS=300".to_owned(),
            "BILLET_STANDIN_IDLE_TIMEOUT_MS=60000".to_owned(),
        ])
    }

    async fn close(self) {
        let _ = self.session.close().await;
    }
}

/// Starts the container, waits for it to exit 0 and checks the emulator saw the job through.
async fn run_to_success(
    docker: &Docker,
    name: &str,
    gh: &GitHub,
    runner: &str,
    job: JobRequestId,
) -> anyhow::Result<()> {
    docker
        .start_container(name, None)
        .await
        .context("cannot start the stand-in runner's container")?;

    let exit = wait_exit(docker, name).await;
    let logs = logs(docker, name).await;
    match exit {
        Ok(0) => {}
        Ok(code) => bail!(
            "the stand-in runner exited {code}; logs:\n{logs}\nemulator: {:#?}",
            gh.emu.state()
        ),
        Err(e) => bail!(
            "the stand-in runner's container {e}; logs:\n{logs}\nemulator: {:#?}",
            gh.emu.state()
        ),
    }
    ensure!(
        logs.contains(&format!(
            "runner {runner} ran job {job} with result succeeded"
        )),
        "the summary line is missing; logs:\n{logs}"
    );

    // The runner exits only after the emulator accepted the completion, so this holds already.
    let state = gh.emu.state();
    let done = state.jobs.iter().find(|j| j.id == job);
    ensure!(
        done.is_some_and(
            |j| j.state == JobState::Completed && j.result.as_deref() == Some("succeeded")
        ),
        "job {job} is not completed with result succeeded: {state:#?}"
    );
    ensure!(
        !state.runners.iter().any(|r| r.name == runner),
        "the ephemeral runner is still registered: {state:#?}"
    );
    Ok(())
}

/// Waits, at most [`RUN_BOUND`], for the container `name` to exit; its exit code, or why there is
/// none.
async fn wait_exit(docker: &Docker, name: &str) -> Result<i64, String> {
    let waited = tokio::time::timeout(RUN_BOUND, docker.wait_container(name, None).next()).await;
    match waited {
        Err(_) => Err(format!("did not exit within {RUN_BOUND:?}")),
        Ok(None) => Err("the wait stream ended without a status".to_owned()),
        Ok(Some(Ok(status))) => Ok(status.status_code),
        Ok(Some(Err(bollard::errors::Error::DockerContainerWaitError { code, .. }))) => Ok(code),
        Ok(Some(Err(e))) => Err(format!("waiting failed: {e}")),
    }
}

/// Waits, at most [`RUN_BOUND`], for the container's logs to contain `line`.
async fn wait_for_log(docker: &Docker, name: &str, line: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + RUN_BOUND;
    while !logs(docker, name).await.contains(line) {
        ensure!(
            Instant::now() < deadline,
            "the runner did not say {line:?} within {RUN_BOUND:?}; logs:\n{}",
            logs(docker, name).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

/// Sets `key` to `value` in a container environment, replacing an earlier value.
fn set_env(env: &mut Vec<String>, key: &str, value: &str) {
    env.retain(|entry| !entry.starts_with(&format!("{key}=")));
    env.push(format!("{key}={value}"));
}

fn container_name(what: &str) -> String {
    format!("billet-standin-image-test-{what}-{}", std::process::id())
}

fn force() -> RemoveContainerOptions {
    RemoveContainerOptionsBuilder::default().force(true).build()
}

/// Creates the container `name` of the stand-in image with `env`, limited to `memory_bytes` of
/// memory and as much memory and swap together, if given.
async fn create_container(
    docker: &Docker,
    name: &str,
    env: Vec<String>,
    memory_bytes: Option<i64>,
) -> anyhow::Result<()> {
    // A container left by an earlier, killed run of this test would make the name conflict.
    let _ = docker.remove_container(name, Some(force())).await;
    docker
        .create_container(
            Some(CreateContainerOptionsBuilder::default().name(name).build()),
            ContainerCreateBody {
                image: Some(TAG.to_owned()),
                env: Some(env),
                labels: Some(HashMap::from([(
                    "billet.test".to_owned(),
                    "standin_image".to_owned(),
                )])),
                host_config: Some(HostConfig {
                    network_mode: Some("host".to_owned()),
                    memory: memory_bytes,
                    memory_swap: memory_bytes,
                    ..Default::default()
                }),
                ..Default::default()
            },
        )
        .await
        .context("cannot create the stand-in runner's container")?;
    Ok(())
}

/// Runs `body`, then removes the container `name` whether `body` succeeded, failed or panicked.
async fn with_cleanup(
    docker: &Docker,
    name: &str,
    body: impl Future<Output = anyhow::Result<()>>,
) -> anyhow::Result<()> {
    let outcome = AssertUnwindSafe(body).catch_unwind().await;
    let removed = docker.remove_container(name, Some(force())).await;
    match outcome {
        Ok(result) => result?,
        Err(panic) => std::panic::resume_unwind(panic),
    }
    removed.with_context(|| format!("cannot remove the container {name}"))
}

/// The container's stdout and stderr, for failure messages.
async fn logs(docker: &Docker, name: &str) -> String {
    let options = LogsOptionsBuilder::default()
        .stdout(true)
        .stderr(true)
        .build();
    let mut stream = docker.logs(name, Some(options));
    let mut text = String::new();
    while let Some(item) = stream.next().await {
        match item {
            Ok(output) => text.push_str(&output.to_string()),
            Err(e) => {
                text.push_str(&format!("<cannot read the logs: {e}>"));
                break;
            }
        }
    }
    text
}

/// Rebuilding the stand-in's tag from another binary (another checkout's build) leaves alone the
/// image a running test still names by its content pin (`billet-standin-runner:c-<id>`): the
/// cluster's runners are started from that pin, and a rebuild that removed it by id would leave
/// every later launch of that test refused `IMAGE_UNAVAILABLE` (`random_e2e` seeds 3 and 8).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rebuilding_the_tag_keeps_the_image_another_tag_still_names() -> anyhow::Result<()> {
    let docker = connect_docker().await?;
    let suffix = &uuid::Uuid::new_v4().simple().to_string()[..8];
    let repository = format!("billet-rebuild-test-{suffix}");
    let tag = format!("{repository}:dev");
    let pinned = format!("{repository}:pinned");
    // Two binaries of different content, each with its shared libraries: two images.
    build_standin_image(&docker, std::path::Path::new("/bin/true"), &tag).await?;
    let first = docker.inspect_image(&tag).await?.id.context("an id")?;
    docker
        .tag_image(
            &tag,
            Some(
                bollard::query_parameters::TagImageOptionsBuilder::default()
                    .repo(&repository)
                    .tag("pinned")
                    .build(),
            ),
        )
        .await?;
    build_standin_image(&docker, std::path::Path::new("/bin/false"), &tag).await?;
    let second = docker.inspect_image(&tag).await?.id.context("an id")?;
    let kept = docker.inspect_image(&pinned).await.map(|i| i.id);
    for name in [&tag, &pinned] {
        let _ = docker
            .remove_image(
                name,
                None::<bollard::query_parameters::RemoveImageOptions>,
                None,
            )
            .await;
    }
    ensure!(first != second, "the two builds made one image");
    ensure!(
        matches!(&kept, Ok(Some(id)) if *id == first),
        "the rebuild removed the image {pinned} still names: {kept:?}"
    );
    Ok(())
}
