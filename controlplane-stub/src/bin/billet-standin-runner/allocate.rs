//! Modes `allocate` and `oom-step`: memory allocated in chunks with every page written, in
//! the runner or in a step's child process.

use std::process::ExitCode;

use crate::run::Failure;

/// Mode `allocate`: how much memory is allocated at a time, in MiB.
const ALLOCATE_CHUNK_MIB: u64 = 16;
/// Mode `allocate`: one byte in every this many is written. The smallest page size Linux uses,
/// so every page of a chunk is touched, whatever the page size.
const TOUCH_STRIDE_BYTES: usize = 4096;
const MIB_BYTES: usize = 1 << 20;

/// Mode `allocate`: allocates memory in chunks of [`ALLOCATE_CHUNK_MIB`], writing one byte of
/// every page so the kernel must back it, until `cap_mib` MiB are held (never, without a cap:
/// under a memory limit the OOM killer ends the process). Returns what it holds; each chunk is
/// followed by a yield, so a signal still stops the runner.
pub(crate) async fn allocate(runner_name: &str, cap_mib: Option<u64>) -> Vec<Vec<u8>> {
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
pub(crate) async fn run_allocating_step(runner_name: &str) -> Result<(), Failure> {
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
pub(crate) const STEP_ENV: &str = "BILLET_STANDIN_STEP";

/// A step's process ([`STEP_ENV`]): allocates memory as mode `allocate` does, until killed.
pub(crate) fn allocating_step() -> ExitCode {
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

#[cfg(test)]
mod tests {
    use super::*;

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
}
