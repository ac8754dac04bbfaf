//! The job process: while the runner holds a job, a child process named `Runner.Worker` runs
//! beside it, as `actions/runner`'s listener starts one per job. It is what a node reads, through
//! its engine's process list, to know the runner is at work whatever GitHub's busy flag says.

use std::os::unix::process::CommandExt as _;
use std::process::{Child, Command, ExitCode, Stdio};

/// The job process's name, as the node looks for it (`billet_agent::provider::JOB_PROCESS`).
pub(crate) const JOB_PROCESS: &str = "Runner.Worker";

/// Whether this process was started as the job process (its `argv[0]` is [`JOB_PROCESS`]).
pub(crate) fn is_job_process() -> bool {
    std::env::args_os()
        .next()
        .is_some_and(|arg0| arg0 == JOB_PROCESS)
}

/// The job process's life: it waits until its standard input closes, which happens when the
/// runner ends the job, or dies.
pub(crate) fn job_process() -> ExitCode {
    let mut sink = Vec::new();
    let _ = std::io::Read::read_to_end(&mut std::io::stdin(), &mut sink);
    ExitCode::SUCCESS
}

/// The job process of one job: started by [`Worker::start`], ended when dropped.
pub(crate) struct Worker(Option<Child>);

impl Worker {
    /// Starts the job process (this binary again, as [`JOB_PROCESS`]). A process that cannot be
    /// started is said on stderr and the job goes on without it.
    pub(crate) fn start(runner_name: &str) -> Self {
        let started = std::env::current_exe().and_then(|exe| {
            Command::new(exe)
                .arg0(JOB_PROCESS)
                .arg("spawnclient")
                .stdin(Stdio::piped())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
        });
        match started {
            Ok(child) => Self(Some(child)),
            Err(e) => {
                eprintln!(
                    "billet-standin-runner: runner {runner_name} cannot start its job process: {e}"
                );
                Self(None)
            }
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            // Closing its standard input ends it at once.
            drop(child.stdin.take());
            let _ = child.wait();
        }
    }
}
