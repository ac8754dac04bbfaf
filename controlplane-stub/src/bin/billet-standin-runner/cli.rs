//! The command line: every option a flag or an environment variable (the binary's doc has
//! the table), and the modes.

use std::fmt;

use clap::Parser;

/// Plays an ephemeral GitHub Actions runner against the scaleset emulator: takes one job
/// assigned to its scale set, works, completes it and exits. Other modes play the faults of a
/// real runner for tests.
#[derive(Debug, Parser)]
#[command(version)]
pub(crate) struct Cli {
    /// The encoded JIT config, as given to actions/runner.
    #[arg(long, env = "ACTIONS_RUNNER_INPUT_JITCONFIG", hide_env_values = true)]
    pub(crate) jitconfig: String,
    /// What the runner does: job, never-connect, hang, ignore-sigterm, allocate, exit, oom-step
    /// or stale
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
    ///   stale           play a runner GitHub refuses for its version: say so as
    ///                   actions/runner does, and exit 1 before asking for a job
    #[arg(
        long,
        verbatim_doc_comment,
        env = "BILLET_STANDIN_MODE",
        default_value = "job",
        value_parser = Mode::parse
    )]
    pub(crate) mode: Mode,
    /// The actions/runner version this runner plays (mode stale names it).
    #[arg(long, env = "BILLET_STANDIN_RUNNER_VERSION",
          default_value = billet_controlplane_stub::plane::STANDIN_RUNNER_VERSION)]
    pub(crate) runner_version: String,
    /// How long to work on the job, in milliseconds.
    #[arg(long, env = "BILLET_STANDIN_WORK_MS", default_value_t = 2000)]
    pub(crate) work_ms: u64,
    /// The job's result, such as succeeded, failed or canceled.
    #[arg(long, env = "BILLET_STANDIN_RESULT", default_value = "succeeded")]
    pub(crate) result: String,
    /// How long to wait for a job before giving up, in milliseconds.
    #[arg(
        long,
        env = "BILLET_STANDIN_IDLE_TIMEOUT_MS",
        default_value_t = 600_000
    )]
    pub(crate) idle_timeout_ms: u64,
    /// Mode exit: the code to exit with after taking the job, 0 to 255.
    #[arg(long, env = "BILLET_STANDIN_EXIT_CODE", default_value_t = 3, value_parser = exit_code)]
    pub(crate) exit_code: u8,
    /// Mode allocate: allocate this many MiB, then hold them and work and complete the job;
    /// without it, allocate until killed.
    #[arg(long, env = "BILLET_STANDIN_ALLOCATE_MIB", value_parser = allocate_mib)]
    pub(crate) allocate_mib: Option<u64>,
    /// How long to keep working after the job is completed (post-job steps), in
    /// milliseconds, before exiting.
    #[arg(long, env = "BILLET_STANDIN_POST_JOB_MS", default_value_t = 0)]
    pub(crate) post_job_ms: u64,
    /// A sticky disk's counter file, read and written incremented as the job's work.
    #[arg(long, env = "BILLET_STANDIN_STICKY")]
    pub(crate) sticky: Option<std::path::PathBuf>,
    /// A cache key to restore, or save when missing, through the node's Actions cache proxy.
    #[arg(long, env = "BILLET_STANDIN_ACTIONS_CACHE")]
    pub(crate) actions_cache: Option<String>,
    /// With `--sticky`: after the counter, fill the sticky disk (a file `fill` beside the
    /// counter) until it is full.
    #[arg(long, env = "BILLET_STANDIN_STICKY_FILL")]
    pub(crate) sticky_fill: bool,
    /// Where to report what the node's cache API told the runner (an http:// URL).
    #[arg(long, env = "BILLET_STANDIN_REPORT")]
    pub(crate) report: Option<String>,
    /// How long to wait after start before the first look at the emulator, in milliseconds:
    /// the runner stays idle (registered, taking no job) until then.
    #[arg(long, env = "BILLET_STANDIN_FIRST_LOOK_MS", default_value_t = 0)]
    pub(crate) first_look_ms: u64,
    /// Play the guest agent of the Docker image store: `ready` or `never` (the module doc).
    #[arg(long, env = "BILLET_STANDIN_DOCKER_STORE", value_parser = ["ready", "never"])]
    pub(crate) docker_store: Option<String>,
    /// How long the guest agent asks to say it is ready, in milliseconds.
    #[arg(long, env = "BILLET_STANDIN_READY_WAIT_MS", default_value_t = 60_000)]
    pub(crate) ready_wait_ms: u64,
    /// With `--actions-cache`: hold a download and an upload URL, then repeat the calls on them
    /// this many times, each round after its gate opens (the module doc).
    #[arg(long, env = "BILLET_STANDIN_ACTIONS_ROUNDS", default_value_t = 0)]
    pub(crate) actions_rounds: u32,
    /// Where the runner waits for a test's signals (an http:// URL): gate `NAME` is open once
    /// `GET <url>/NAME` answers 2xx.
    #[arg(long, env = "BILLET_STANDIN_GATES")]
    pub(crate) gates: Option<String>,
}

/// What the runner does with its JIT config (`BILLET_STANDIN_MODE`; the module doc's table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
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
    /// Say, as `actions/runner` does, that GitHub refuses this runner's
    /// version, and exit 1 before polling.
    Stale,
}

impl Mode {
    /// Every mode, in the order the documentation lists them.
    pub(crate) const ALL: [Self; 8] = [
        Self::Job,
        Self::NeverConnect,
        Self::Hang,
        Self::IgnoreSigterm,
        Self::Allocate,
        Self::Exit,
        Self::OomStep,
        Self::Stale,
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
            Self::Stale => "stale",
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

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Parses a command line of the stand-in, flags after the program name.
    pub(crate) fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
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
                "oom-step",
                "stale"
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
}
