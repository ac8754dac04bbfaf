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
//!   A cap may also bound each peer address ([`ConnectionCap::per_peer`]):
//!   a peer at its bound loses its own oldest idle connection to its
//!   newcomer, and at the listener's cap the victim is taken from the peer
//!   holding the most, so a flood from one address costs that address,
//!   never another's connections.
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
use std::net::IpAddr;
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
    /// Where it came from, when the listener counts per peer.
    peer: Option<IpAddr>,
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
    /// The most one peer address may hold; `usize::MAX` for no bound.
    per_peer: usize,
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
            per_peer: usize::MAX,
            at_cap,
            open: Arc::default(),
        }
    }

    /// The same cap, holding at most `max` (at least 1) connections from
    /// any one peer address ([`Self::admit_from`]); past it the peer's own
    /// oldest idle connection (else its oldest) is dropped for its
    /// newcomer, whatever [`AtCap`] says, since it competes only with
    /// itself.
    #[must_use]
    pub(crate) fn per_peer(mut self, max: usize) -> Self {
        self.per_peer = max.max(1);
        self
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
        self.admit_peer(None)
    }

    /// [`Self::admit`] for a connection from `peer`, counted against the
    /// peer's bound ([`Self::per_peer`]); at the listener's cap under
    /// [`AtCap::DropOldest`] the connection dropped is one of the peer
    /// holding the most.
    #[must_use]
    pub(crate) fn admit_from(&self, peer: IpAddr) -> Option<Admitted> {
        self.admit_peer(Some(peer))
    }

    fn admit_peer(&self, peer: Option<IpAddr>) -> Option<Admitted> {
        let mut open = self.open.lock().expect("open");
        let mine = peer.map_or(0, |p| {
            open.by_age
                .values()
                .filter(|place| place.peer == Some(p))
                .count()
        });
        if peer.is_some() && mine >= self.per_peer {
            if let Some(suppressed) = open.log.admit(Instant::now()) {
                warn!(
                    listener = self.listener,
                    cap = self.per_peer,
                    suppressed,
                    "dropped a peer's oldest idle connection to make room for its new one: it holds as many as one address may"
                );
            }
            Self::drop_one_of(&mut open, peer);
        } else if open.by_age.len() >= self.max {
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
                    let heaviest = Self::heaviest(&open);
                    Self::drop_one_of(&mut open, heaviest);
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
                peer,
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

impl ConnectionCap {
    /// The peer holding the most open connections (connections of no
    /// known peer count as one peer).
    fn heaviest(open: &Open) -> Option<IpAddr> {
        let mut counts: BTreeMap<Option<IpAddr>, usize> = BTreeMap::new();
        for place in open.by_age.values() {
            *counts.entry(place.peer).or_default() += 1;
        }
        counts
            .into_iter()
            .max_by_key(|(_, n)| *n)
            .and_then(|(peer, _)| peer)
    }

    /// Drops `peer`'s oldest idle connection, else its oldest.
    fn drop_one_of(open: &mut Open, peer: Option<IpAddr>) {
        let theirs = || open.by_age.iter().filter(|(_, p)| p.peer == peer);
        let victim = theirs()
            .find(|(_, p)| p.busy.load(Ordering::Acquire) == 0)
            .or_else(|| theirs().next())
            .map(|(seq, _)| *seq);
        if let Some(place) = victim.and_then(|seq| open.by_age.remove(&seq)) {
            place.dropped.cancel();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_peer_at_its_bound_loses_its_own_oldest_idle_connection_and_a_full_listener_takes_from_the_heaviest_peer()
     {
        let flooder: IpAddr = "172.17.0.9".parse().unwrap();
        let guest: IpAddr = "172.17.0.5".parse().unwrap();
        let cap = ConnectionCap::new("test", 6, AtCap::DropOldest).per_peer(4);
        let working = cap.admit_from(guest).expect("a place");
        let _answering = working.busy();
        let idle_guest = cap.admit_from(guest).expect("a place");
        let flood: Vec<_> = (0..4)
            .map(|_| cap.admit_from(flooder).expect("a place"))
            .collect();
        // The flooder's fifth costs it its own oldest.
        let fifth = cap.admit_from(flooder).expect("a place");
        assert!(flood[0].dropped.is_cancelled());
        assert!(flood[1..].iter().all(|a| !a.dropped.is_cancelled()));
        assert!(!working.dropped.is_cancelled() && !idle_guest.dropped.is_cancelled());
        assert_eq!(cap.open(), 6);
        // Full: another guest's newcomer takes from the flooder, who holds
        // the most, never from the guest's idle connection.
        let other = cap
            .admit_from("172.17.0.6".parse().unwrap())
            .expect("a place");
        assert!(flood[1].dropped.is_cancelled());
        assert!(!idle_guest.dropped.is_cancelled() && !working.dropped.is_cancelled());
        assert!(!fifth.dropped.is_cancelled() && !other.dropped.is_cancelled());
    }

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
