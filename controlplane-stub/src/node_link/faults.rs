//! Fault injection for tests ([`LinkFaults`]): results dropped, sessions
//! cut, dials held, partitions.

use std::sync::atomic::{AtomicBool, AtomicU64};

use tokio::sync::watch;

/// Fault injection for tests: drop what would otherwise flow.
#[derive(Debug)]
pub struct LinkFaults {
    /// Drop the next N launch results on receipt (the plane never sees
    /// them and never acknowledges them).
    pub drop_launch_results: AtomicU64,
    /// Break the session instead of taking the next N destroy results (the
    /// node ran the destroy; the plane never hears how it went).
    pub cut_on_destroy_results: AtomicU64,
    /// While set, do not dial the node (an open session is left alone):
    /// the node sees no plane, so it never finishes start-up recovery.
    pub hold_dial: AtomicBool,
    /// While true, the plane and the node cannot reach each other: the open
    /// session is cut and nothing is dialed ([`super::NodeLink::partition`]).
    pub(super) partitioned: watch::Sender<bool>,
    /// While set, send launches to the node even while it says it is
    /// degraded (to see it refuse them).
    pub place_on_degraded: AtomicBool,
    /// While set, answer every certificate renewal `ERROR_CODE_UNAVAILABLE`
    /// without asking the CA (a plane that cannot sign for now).
    pub refuse_renewals: AtomicBool,
}

impl Default for LinkFaults {
    fn default() -> Self {
        Self {
            drop_launch_results: AtomicU64::new(0),
            cut_on_destroy_results: AtomicU64::new(0),
            hold_dial: AtomicBool::new(false),
            partitioned: watch::Sender::new(false),
            place_on_degraded: AtomicBool::new(false),
            refuse_renewals: AtomicBool::new(false),
        }
    }
}
