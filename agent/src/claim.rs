//! Exclusive claims on host files: the updater's host claim and the cache
//! store's lock, each an `flock` held for as long as its owner lives.
//!
//! An `flock` belongs to the open file, so a child forked by any thread of
//! the holder, between its fork and its `exec`, holds it too for that
//! instant (the descriptor is close-on-exec, not close-on-fork). A claim
//! its holder has just released can therefore still be busy for a moment.
//! [`take`] tries a busy claim again for a patience (usually [`PATIENCE`])
//! before it reports it held; a real holder (an updater, a node) keeps its
//! claim for minutes or for ever. A caller whose answer must not change if
//! the holder dies during the wait (a node start deciding whether to undo
//! an updater's swap) passes no patience.

use std::fs::{File, TryLockError};
use std::time::{Duration, Instant};

/// How long a busy claim is tried again before it is reported held: long
/// enough for a forked child that inherited the lock to reach its `exec`.
pub(crate) const PATIENCE: Duration = Duration::from_millis(250);

/// How long [`take`] waits between two tries.
const RETRY: Duration = Duration::from_millis(10);

/// Takes an exclusive, non-blocking lock on `file`, tried again for
/// `patience` while it is busy. Blocks the calling thread for at most
/// `patience`.
///
/// # Errors
///
/// `Ok(false)` while another open file holds the lock after `patience`;
/// `Err` when the lock cannot be asked for at all (an unsupported
/// filesystem, a bad descriptor).
pub(crate) fn take(file: &File, patience: Duration) -> std::io::Result<bool> {
    let deadline = Instant::now() + patience;
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(true),
            Err(TryLockError::WouldBlock) if Instant::now() < deadline => {
                std::thread::sleep(RETRY);
            }
            Err(TryLockError::WouldBlock) => return Ok(false),
            Err(TryLockError::Error(e)) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A lock file in a directory of its own, removed when the guard drops.
    struct Scratch(std::path::PathBuf);

    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn lock_file() -> (Scratch, std::path::PathBuf) {
        let dir =
            std::env::temp_dir().join(format!("billet-claim-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("lock");
        (Scratch(dir), path)
    }

    fn open(path: &std::path::Path) -> File {
        std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)
            .expect("open")
    }

    #[test]
    fn a_claim_held_by_another_open_file_is_reported_held_after_the_patience() {
        let (_dir, path) = lock_file();
        let holder = open(&path);
        assert!(take(&holder, Duration::ZERO).expect("take"));
        let other = open(&path);
        let started = Instant::now();
        assert!(!take(&other, Duration::from_millis(50)).expect("take"));
        assert!(started.elapsed() >= Duration::from_millis(50));
        drop(holder);
        assert!(take(&other, Duration::ZERO).expect("take"));
    }

    #[test]
    fn a_claim_a_child_still_holds_for_a_moment_is_taken_once_the_child_lets_go() {
        // What a fork between open and exec does: the child holds the same
        // open file, so the lock outlives the parent's close by that long.
        let (_dir, path) = lock_file();
        let holder = open(&path);
        assert!(take(&holder, Duration::ZERO).expect("take"));
        let mut child = std::process::Command::new("sleep")
            .arg("0.1")
            .stdin(holder.try_clone().expect("dup"))
            .spawn()
            .expect("sleep");
        drop(holder);
        let other = open(&path);
        assert!(!take(&other, Duration::ZERO).expect("take"));
        assert!(take(&other, PATIENCE).expect("take"));
        assert!(child.wait().expect("child").success());
    }
}
