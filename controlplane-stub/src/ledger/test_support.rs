//! Helpers shared by the ledger's unit tests: a fresh ledger database on
//! either backend ([`TestDb`]), the macro that runs one test body on both
//! ([`on_both_backends!`]), a lease walked to a phase, and the refusal code
//! of a result. Compiled only for tests; nothing outside `ledger/` uses it.
//!
//! The PostgreSQL half of every test needs a server (`scripts/test` starts
//! one) and fails, naming `scripts/test`, when none answers; each test gets
//! a database of its own, dropped after it whether it passed or not.

use std::fmt;
use std::future::Future;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use super::scratch::ScratchPostgres;
use super::{Backend, Lease, Ledger, LedgerLocation, NewLease, Phase, Result};

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

/// One test's ledger database: a SQLite file in the temp directory, or a
/// scratch PostgreSQL database. Any number of [`Ledger`] handles may be
/// opened on it, as any number of planes would.
#[derive(Debug)]
pub(super) struct TestDb {
    location: LedgerLocation,
    file: Option<PathBuf>,
    scratch: Option<ScratchPostgres>,
}

impl TestDb {
    /// A fresh, empty database on `backend`.
    ///
    /// # Panics
    ///
    /// When PostgreSQL is asked for and no server answers (the message
    /// names `scripts/test`).
    pub(super) async fn new(backend: Backend) -> TestDb {
        match backend {
            Backend::Sqlite => {
                let file = std::env::temp_dir().join(format!(
                    "billet-ledger-test-{}-{}.db",
                    std::process::id(),
                    uuid::Uuid::new_v4()
                ));
                TestDb {
                    location: LedgerLocation::Sqlite(file.clone()),
                    file: Some(file),
                    scratch: None,
                }
            }
            Backend::Postgres => {
                let scratch = ScratchPostgres::create()
                    .await
                    .unwrap_or_else(|e| panic!("{e}"));
                TestDb {
                    location: scratch.location().clone(),
                    file: None,
                    scratch: Some(scratch),
                }
            }
        }
    }

    pub(super) fn location(&self) -> &LedgerLocation {
        &self.location
    }

    /// A new handle on the database with lease TTL `ttl`.
    pub(super) async fn open(&self, ttl: Duration) -> Ledger {
        Ledger::connect(&self.location, ttl)
            .await
            .unwrap_or_else(|e| panic!("open the ledger at {}: {e}", self.location))
    }

    /// A new handle with the tests' [`TTL`].
    pub(super) async fn ledger(&self) -> Ledger {
        self.open(TTL).await
    }

    async fn remove(&self) {
        if let Some(file) = &self.file {
            for suffix in ["", "-wal", "-shm"] {
                let mut path = file.clone().into_os_string();
                path.push(suffix);
                let _ = std::fs::remove_file(path);
            }
        }
        if let Some(scratch) = &self.scratch
            && let Err(e) = scratch.drop_database().await
        {
            eprintln!("leaving a test database behind: {e}");
        }
    }
}

/// Runs `test` against a fresh database on `backend`, then removes the
/// database, and fails as the test failed.
pub(super) async fn run_on<F, Fut>(backend: Backend, test: F)
where
    F: FnOnce(Arc<TestDb>) -> Fut,
    Fut: Future<Output = ()> + Send + 'static,
{
    let db = Arc::new(TestDb::new(backend).await);
    let outcome = tokio::spawn(test(Arc::clone(&db))).await;
    db.remove().await;
    if let Err(e) = outcome {
        match e.try_into_panic() {
            Ok(panic) => std::panic::resume_unwind(panic),
            Err(e) => panic!("the test task ended without finishing: {e}"),
        }
    }
}

/// Writes one async test body, `async fn name(db) { ... }` with `db` an
/// `Arc<TestDb>`, as a module `name` holding two tests, `name::sqlite` and
/// `name::postgres`, each on a fresh database of that backend.
macro_rules! on_both_backends {
    ($(#[doc = $doc:literal])* async fn $name:ident($db:ident) $body:block) => {
        $(#[doc = $doc])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            async fn body($db: std::sync::Arc<$crate::ledger::test_support::TestDb>) $body

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn sqlite() {
                $crate::ledger::test_support::run_on($crate::ledger::Backend::Sqlite, body).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn postgres() {
                $crate::ledger::test_support::run_on($crate::ledger::Backend::Postgres, body)
                    .await;
            }
        }
    };
}
pub(super) use on_both_backends;

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
