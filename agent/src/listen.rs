//! What the node's listeners share besides the plane's own accept loop
//! (in `tls::accept`): a cap on the connections a secondary listener holds
//! open, and accept errors that back off and are logged at a bounded rate.
//!
//! - [`ConnectionCap`]: at most `max` connections open on one listener.
//!   Every connection is accepted at once (the kernel's backlog never
//!   fills); at the cap either the newcomer is closed at once
//!   ([`AtCap::Refuse`]) or the oldest open connection is dropped to make
//!   room for it ([`AtCap::DropOldest`], for a listener whose connections
//!   finish their work in milliseconds, so that one dialed into a flood is
//!   served long before it is the oldest; one answering a request, marked
//!   by [`Admitted::busy`], is passed over while an idle one remains).
//!   Nothing is ever queued. Why:
//!   every open connection is a file descriptor, and the node's plane
//!   session, journal and Docker connections need theirs; a secondary port
//!   must not be able to take them all (a flood on the metrics port, say).
//! - [`AcceptErrors`]: a failed accept (out of descriptors, `EMFILE` or
//!   `ENFILE`, most likely) waits before the next, from
//!   [`ACCEPT_BACKOFF_MIN`] doubling to [`ACCEPT_BACKOFF_MAX`] and back to
//!   the minimum after an accept succeeds (as Go's `net/http` server does),
//!   and is logged at most once per [`ACCEPT_ERROR_LOG_EVERY`], the line
//!   carrying how many failures it stands for.

use std::collections::BTreeMap;
use std::io;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::net::{UnixListener, UnixStream};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::warn;

/// The first wait after a failed accept.
pub(crate) const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(5);

/// The longest wait after failed accepts in a row.
pub(crate) const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// At most one line per this about a listener's failed accepts, and one
/// about the connections its cap closed.
pub(crate) const ACCEPT_ERROR_LOG_EVERY: Duration = Duration::from_secs(10);

/// A line's rate limit: the first occurrence is logged, then at most one
/// per [`ACCEPT_ERROR_LOG_EVERY`]; the ones in between are counted and the
/// next line carries the count.
#[derive(Debug, Default)]
struct Limited {
    last: Option<Instant>,
    suppressed: u64,
}

impl Limited {
    /// `Some(suppressed since the last line)` when this occurrence is
    /// logged, `None` when it is counted.
    fn admit(&mut self, now: Instant) -> Option<u64> {
        if self
            .last
            .is_some_and(|t| now.duration_since(t) < ACCEPT_ERROR_LOG_EVERY)
        {
            self.suppressed += 1;
            return None;
        }
        self.last = Some(now);
        Some(std::mem::take(&mut self.suppressed))
    }
}

/// One listener's failed accepts: the backoff before the next accept and
/// the rate limit of the line about them. See the module doc.
#[derive(Debug)]
pub(crate) struct AcceptErrors {
    listener: &'static str,
    backoff: Duration,
    log: Limited,
}

impl AcceptErrors {
    /// For the listener named `listener` in the log (`metrics`, ...).
    #[must_use]
    pub(crate) fn new(listener: &'static str) -> Self {
        Self {
            listener,
            backoff: ACCEPT_BACKOFF_MIN,
            log: Limited::default(),
        }
    }

    /// An accept succeeded: the next failure waits the minimum again.
    pub(crate) fn accepted(&mut self) {
        self.backoff = ACCEPT_BACKOFF_MIN;
    }

    /// Records a failed accept, logs it unless a line was logged within
    /// [`ACCEPT_ERROR_LOG_EVERY`], and returns how long to wait before
    /// accepting again.
    pub(crate) fn failed(&mut self, error: &io::Error) -> Duration {
        let wait = self.backoff;
        self.backoff = (self.backoff * 2).min(ACCEPT_BACKOFF_MAX);
        if let Some(suppressed) = self.log.admit(Instant::now()) {
            warn!(
                listener = self.listener,
                %error,
                suppressed,
                "accept failed (out of file descriptors?); backing off, repeats counted for {ACCEPT_ERROR_LOG_EVERY:?}"
            );
        }
        wait
    }

    /// [`Self::failed`], then waits.
    pub(crate) async fn back_off(&mut self, error: &io::Error) {
        let wait = self.failed(error);
        tokio::time::sleep(wait).await;
    }
}

/// The connections accepted on `listener`, for a server that takes a
/// stream of them (tonic's `serve_with_incoming`): a failed accept is
/// handled by [`AcceptErrors`] (backed off, logged at a bounded rate) and
/// never yielded, since tonic would retry it at once and spin while the
/// node is out of descriptors. `listener` names it in the log. Uncapped:
/// for the local socket, which only the node's own operators can reach.
pub(crate) fn unix_incoming(
    listener: UnixListener,
    name: &'static str,
) -> impl futures::Stream<Item = io::Result<UnixStream>> {
    futures::stream::unfold(
        (listener, AcceptErrors::new(name)),
        |(listener, mut errors)| async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => {
                        errors.accepted();
                        return Some((Ok(stream), (listener, errors)));
                    }
                    Err(e) => errors.back_off(&e).await,
                }
            }
        },
    )
}

/// What a [`ConnectionCap`] does with a connection past its cap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum AtCap {
    /// Close the newcomer at once; the open ones go on.
    Refuse,
    /// Drop the oldest open connection and keep the newcomer.
    DropOldest,
}

/// One open connection: the token that drops it and whether it is
/// answering a request.
#[derive(Debug)]
struct Place {
    dropped: CancellationToken,
    busy: Arc<AtomicUsize>,
}

#[derive(Debug, Default)]
struct Open {
    next: u64,
    by_age: BTreeMap<u64, Place>,
    log: Limited,
}

/// At most `max` connections open at once on one listener; see the module
/// doc. Cheap to clone (shared).
#[derive(Debug, Clone)]
pub(crate) struct ConnectionCap {
    listener: &'static str,
    max: usize,
    at_cap: AtCap,
    open: Arc<Mutex<Open>>,
}

/// One admitted connection's place under its [`ConnectionCap`]: held for as
/// long as the connection is open, freed on drop. Serve the connection only
/// until [`Self::dropped`] fires.
#[derive(Debug)]
pub(crate) struct Admitted {
    seq: u64,
    dropped: CancellationToken,
    busy: Arc<AtomicUsize>,
    open: Arc<Mutex<Open>>,
}

impl Admitted {
    /// Fires when the cap drops this connection for a newer one.
    pub(crate) async fn dropped(&self) {
        self.dropped.cancelled().await;
    }

    /// Marks the connection as answering a request until the guard drops:
    /// [`AtCap::DropOldest`] passes it over while an idle one is open.
    #[must_use]
    pub(crate) fn busy(&self) -> Busy {
        self.busy.fetch_add(1, Ordering::AcqRel);
        Busy(Arc::clone(&self.busy))
    }
}

/// A request in progress on an [`Admitted`] connection; see
/// [`Admitted::busy`].
#[derive(Debug)]
pub(crate) struct Busy(Arc<AtomicUsize>);

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.open.lock().expect("open").by_age.remove(&self.seq);
    }
}

impl ConnectionCap {
    /// A cap of `max` (at least 1) open connections on the listener named
    /// `listener` in the log.
    #[must_use]
    pub(crate) fn new(listener: &'static str, max: usize, at_cap: AtCap) -> Self {
        Self {
            listener,
            max: max.max(1),
            at_cap,
            open: Arc::default(),
        }
    }

    /// How many connections are open under it.
    #[must_use]
    #[cfg(test)]
    pub(crate) fn open(&self) -> usize {
        self.open.lock().expect("open").by_age.len()
    }

    /// A place for a connection just accepted; `None` when it is to be
    /// closed at once ([`AtCap::Refuse`] at the cap). Under
    /// [`AtCap::DropOldest`] at the cap, the oldest idle connection's (else
    /// the oldest one's) [`Admitted::dropped`] fires and the newcomer
    /// always gets a place.
    /// Either is logged at most once per [`ACCEPT_ERROR_LOG_EVERY`], with
    /// the count since the last line.
    #[must_use]
    pub(crate) fn admit(&self) -> Option<Admitted> {
        let mut open = self.open.lock().expect("open");
        if open.by_age.len() >= self.max {
            let logged = open.log.admit(Instant::now());
            match self.at_cap {
                AtCap::Refuse => {
                    if let Some(suppressed) = logged {
                        warn!(
                            listener = self.listener,
                            cap = self.max,
                            suppressed,
                            "closed a new connection at once: this listener holds as many open connections as it may"
                        );
                    }
                    return None;
                }
                AtCap::DropOldest => {
                    if let Some(suppressed) = logged {
                        warn!(
                            listener = self.listener,
                            cap = self.max,
                            suppressed,
                            "dropped the oldest open connection to make room for a new one: this listener holds as many as it may"
                        );
                    }
                    let victim = open
                        .by_age
                        .iter()
                        .find(|(_, p)| p.busy.load(Ordering::Acquire) == 0)
                        .or_else(|| open.by_age.first_key_value())
                        .map(|(seq, _)| *seq);
                    if let Some(place) = victim.and_then(|seq| open.by_age.remove(&seq)) {
                        place.dropped.cancel();
                    }
                }
            }
        }
        let seq = open.next;
        open.next += 1;
        let (dropped, busy) = (CancellationToken::new(), Arc::<AtomicUsize>::default());
        open.by_age.insert(
            seq,
            Place {
                dropped: dropped.clone(),
                busy: Arc::clone(&busy),
            },
        );
        Some(Admitted {
            seq,
            dropped,
            busy,
            open: Arc::clone(&self.open),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_the_cap_a_refusing_listener_closes_the_newcomer_and_a_freed_place_is_used_again() {
        let cap = ConnectionCap::new("test", 3, AtCap::Refuse);
        let held: Vec<_> = (0..3).map(|_| cap.admit().expect("a place")).collect();
        assert!(cap.admit().is_none(), "the fourth is closed at once");
        assert!(held.iter().all(|a| !a.dropped.is_cancelled()));
        drop(held);
        assert_eq!(cap.open(), 0);
        assert!(cap.admit().is_some());
    }

    #[test]
    fn at_the_cap_the_oldest_connection_is_dropped_for_the_newcomer() {
        let cap = ConnectionCap::new("test", 3, AtCap::DropOldest);
        let held: Vec<_> = (0..3).map(|_| cap.admit().expect("a place")).collect();
        let newest = cap.admit().expect("the newcomer always gets a place");
        assert!(held[0].dropped.is_cancelled(), "the oldest is dropped");
        assert!(held[1..].iter().all(|a| !a.dropped.is_cancelled()));
        assert!(!newest.dropped.is_cancelled());
        assert_eq!(cap.open(), 3);
        let answering = held[1].busy();
        let newer = cap.admit().expect("a place");
        assert!(
            !held[1].dropped.is_cancelled(),
            "one answering a request is passed over"
        );
        assert!(held[2].dropped.is_cancelled(), "the oldest idle one goes");
        drop(answering);
        drop(held);
        assert_eq!(cap.open(), 2, "only the newest two are left");
        drop(newer);
        drop(newest);
        assert_eq!(cap.open(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn failed_accepts_back_off_to_a_second_and_are_logged_once_per_window_with_a_count() {
        let mut errors = AcceptErrors::new("test");
        let emfile = io::Error::from_raw_os_error(24);
        let waits: Vec<_> = (0..10).map(|_| errors.failed(&emfile)).collect();
        assert_eq!(waits[0], ACCEPT_BACKOFF_MIN);
        assert_eq!(waits[1], ACCEPT_BACKOFF_MIN * 2);
        assert_eq!(waits[9], ACCEPT_BACKOFF_MAX, "bounded");
        errors.accepted();
        assert_eq!(errors.failed(&emfile), ACCEPT_BACKOFF_MIN, "reset");

        let mut log = Limited::default();
        assert_eq!(log.admit(Instant::now()), Some(0), "the first is logged");
        let counted = (0..1000)
            .filter(|_| log.admit(Instant::now()).is_none())
            .count();
        assert_eq!(counted, 1000);
        tokio::time::advance(ACCEPT_ERROR_LOG_EVERY).await;
        assert_eq!(
            log.admit(Instant::now()),
            Some(1000),
            "the next window's line carries the count"
        );
    }
}
