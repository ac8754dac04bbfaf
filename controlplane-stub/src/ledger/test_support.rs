//! Helpers shared by the ledger's unit tests: an in-memory ledger, a
//! temporary ledger file, a lease walked to a phase, and the refusal code of
//! a result. Compiled only for tests; nothing outside `ledger/` uses it.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use super::{Lease, Ledger, NewLease, Phase, Result};

pub(super) const TTL: Duration = Duration::from_secs(90);
pub(super) const TTL_MS: i64 = 90_000;
pub(super) const GIB: u64 = 1 << 30;

pub(super) fn new_lease(id: &str) -> NewLease {
    NewLease {
        id: id.to_owned(),
        tier: "linux-2cpu".to_owned(),
        request_id: 7,
        vcpu: 2,
        memory_bytes: 4 * GIB,
        runner_name: Some(format!("billet-{id}")),
    }
}

pub(super) async fn ledger() -> Ledger {
    Ledger::open_in_memory(TTL)
        .await
        .expect("open in-memory ledger")
}

/// A ledger file in the temp directory, removed (with its WAL) on drop.
pub(super) struct TempDb(pub(super) PathBuf);

impl TempDb {
    pub(super) fn new() -> Self {
        Self(std::env::temp_dir().join(format!(
            "billet-ledger-test-{}-{}.db",
            std::process::id(),
            uuid::Uuid::new_v4()
        )))
    }
}

impl Drop for TempDb {
    fn drop(&mut self) {
        for suffix in ["", "-wal", "-shm"] {
            let mut path = self.0.clone().into_os_string();
            path.push(suffix);
            let _ = std::fs::remove_file(path);
        }
    }
}

/// Reserves, binds to `node` and advances through `path`.
pub(super) async fn lease_in(l: &Ledger, id: &str, node: &str, path: &[Phase], now: i64) -> Lease {
    l.reserve(new_lease(id), now).await.expect("reserve");
    let mut lease = l.bind(id, 1, node, now).await.expect("bind");
    for &to in path {
        lease = l.advance(id, 1, node, to, now).await.expect("advance");
    }
    lease
}

pub(super) fn code<T: fmt::Debug>(r: Result<T>) -> &'static str {
    r.expect_err("expected a refusal").code()
}
