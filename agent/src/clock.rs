//! The plane's wall clock as this node reads it.
//!
//! A certificate's dates are the plane's: its CA signs with the plane's
//! clock, and the plane judges the node's certificate by it. A node whose
//! own clock is off must therefore judge a certificate's validity, and time
//! its renewal and its sessions' end, on the plane's clock: a node minutes
//! off behaves exactly like one in sync (a node 120 s behind judging by its
//! own clock would refuse every renewed certificate as "not valid yet",
//! since the plane backdates what it signs by only 60 s).
//!
//! The offset is the one the session measures (this node minus the plane,
//! at Open and on every command that says when it was sent); until one is
//! measured it is 0, this node's own clock.

use std::sync::atomic::{AtomicI64, Ordering};
use std::time::{Duration, SystemTime};

/// This node's clock corrected by the measured offset to the plane's.
/// Shared behind an `Arc`; reads and writes are lock-free.
#[derive(Debug, Default)]
pub(crate) struct PlaneClock {
    /// This node's clock minus the plane's, in milliseconds.
    offset_ms: AtomicI64,
}

impl PlaneClock {
    /// Records a measured offset: this node's clock minus the plane's, in
    /// milliseconds (positive: this node is ahead).
    pub(crate) fn set_offset_ms(&self, offset_ms: i64) {
        self.offset_ms.store(offset_ms, Ordering::Relaxed);
    }

    /// The offset last recorded, in milliseconds; 0 until one is.
    pub(crate) fn offset_ms(&self) -> i64 {
        self.offset_ms.load(Ordering::Relaxed)
    }

    /// What the plane's wall clock reads now.
    pub(crate) fn now(&self) -> SystemTime {
        let now = SystemTime::now();
        let offset = self.offset_ms();
        let by = Duration::from_millis(offset.unsigned_abs());
        if offset >= 0 {
            now.checked_sub(by).unwrap_or(now)
        } else {
            now.checked_add(by).unwrap_or(now)
        }
    }

    /// How long until the plane's clock reads `at`; zero once it has.
    pub(crate) fn until(&self, at: SystemTime) -> Duration {
        at.duration_since(self.now()).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_node_behind_reads_the_plane_ahead_of_its_own_clock() {
        let clock = PlaneClock::default();
        let own = SystemTime::now();
        assert!(clock.now().duration_since(own).unwrap_or_default() < Duration::from_secs(1));
        // This node 120 s behind: the plane reads 120 s later than it does.
        clock.set_offset_ms(-120_000);
        let ahead = clock.now().duration_since(own).expect("later");
        assert!(ahead >= Duration::from_secs(120) && ahead < Duration::from_secs(121));
        // 90 s ahead: the plane reads 90 s earlier.
        clock.set_offset_ms(90_000);
        let behind = own.duration_since(clock.now()).expect("earlier");
        assert!(behind >= Duration::from_secs(89) && behind <= Duration::from_secs(90));
        let until = clock.until(own);
        assert!(until > Duration::from_secs(89) && until <= Duration::from_secs(90));
        assert_eq!(clock.until(own - Duration::from_secs(200)), Duration::ZERO);
    }
}
