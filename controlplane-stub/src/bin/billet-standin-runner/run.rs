//! What the runner does in its mode ([`run`]), and how a signal ends it ([`supervise`]).

use std::future::Future;
use std::pin::pin;

use futures::{Stream, StreamExt as _};
use scaleset::JobRequestId;

use crate::allocate::{allocate, run_allocating_step};
use crate::cli::{Cli, Mode};
use crate::emulator::EmulatorLink;
use crate::jit::JitConfig;
use crate::worker::Worker;

/// Why the runner stopped without running a job.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Failure {
    /// The emulator could not be asked (not up yet, or busy): look again.
    Transient(String),
    /// Exit 1, with this sentence.
    Runtime(String),
    /// Exit with this code, silently: signals, and mode `exit` (which has said why already).
    Code(u8),
}

/// A signal that stops the runner, as [`supervise`] sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stop {
    /// SIGTERM: exit 143, except in mode `ignore-sigterm`.
    Term,
    /// SIGINT: exit 130.
    Int,
}

/// Runs `work` to its end unless a signal from `signals` stops it first: SIGTERM gives
/// `Failure::Code(143)`, except in mode `ignore-sigterm`, where it is logged and ignored; SIGINT
/// gives `Failure::Code(130)` in every mode.
pub(crate) async fn supervise<T>(
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
pub(crate) async fn run(cli: &Cli, config: &JitConfig) -> Result<JobRequestId, Failure> {
    if cli.mode == Mode::NeverConnect {
        eprintln!(
            "billet-standin-runner: runner {} (id {}) never connects (mode {}); waiting for a signal",
            config.runner_name, config.runner_id, cli.mode
        );
        return std::future::pending().await;
    }
    if cli.mode == Mode::Stale {
        // What actions/runner prints when GitHub will not let its version
        // take messages, before it polls: the node reads it from the
        // container's output.
        println!(
            "Runner version v{} is deprecated and cannot receive messages.",
            cli.runner_version
        );
        return Err(Failure::Code(1));
    }
    let emulator = EmulatorLink::new(config)?;
    let job = emulator.wait_for_job(cli).await?;
    eprintln!(
        "billet-standin-runner: runner {} took job {job}",
        config.runner_name
    );
    let _worker = Worker::start(&config.runner_name);
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
        Mode::NeverConnect | Mode::Stale => {
            unreachable!("modes never-connect and stale return before connecting")
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::stream;
    use scaleset::testing::JobState;

    use super::*;
    use crate::cli::tests::parse;

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
    async fn in_mode_stale_the_runner_exits_1_before_asking_the_emulator_anything() {
        let gh = Emulated::start("standin-stale").await;
        let cli = gh.cli(&["--mode", "stale", "--runner-version", "2.331.0"]);
        let outcome = tokio::time::timeout(BOUND, run(&cli, &gh.config)).await;
        assert_eq!(outcome.expect("the runner exits"), Err(Failure::Code(1)));
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
