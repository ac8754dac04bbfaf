//! The node's accept loop: TCP connections in, finished mTLS sessions out,
//! and no way for unauthenticated peers to crowd the plane out.
//!
//! - Every connection is accepted at once (the loop never waits for a
//!   handshake slot, so the kernel's backlog never fills) and gets
//!   `TCP_NODELAY`: the wire is small request/response messages.
//! - A handshake has [`HANDSHAKE_TIMEOUT`] to finish.
//! - At most [`MAX_PENDING_PER_PEER`] handshakes run per peer address and
//!   [`MAX_PENDING_HANDSHAKES`] in all. At a limit the *oldest* unfinished
//!   handshake (that peer's, or anyone's) is dropped to make room, never the
//!   newcomer: a plane that dials into a flood finishes its handshake in
//!   milliseconds, long before idle connections would have aged out.
//! - Refusals are logged at a bounded rate ([`REFUSAL_LOG_BURST`] lines per
//!   [`REFUSAL_LOG_WINDOW`], and the first of each reason in the window);
//!   past that they are counted, and the count is logged once per window
//!   with the reasons.
//! - A failed accept (out of descriptors) backs off and is logged at a
//!   bounded rate ([`AcceptErrors`]).
//!
//! What comes out is an [`Accepted`]: the TLS stream, the peer, and when the
//! first of the two certificates it was authenticated with expires, so the
//! server can recycle the connection before then.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::future::Future as _;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use crate::edge::clock::PlaneClock;
use crate::edge::listen::AcceptErrors;
use crate::edge::tls::{Validity, dns_names};

/// How long a peer may take to finish the TLS handshake. Short: an mTLS
/// handshake takes a few round trips, and a slot held longer is one a
/// plane cannot use.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most unfinished handshakes at once; past it the oldest is dropped.
pub const MAX_PENDING_HANDSHAKES: usize = 64;

/// Most unfinished handshakes from one peer address; past it that peer's
/// oldest is dropped, so one address cannot take every slot.
pub const MAX_PENDING_PER_PEER: usize = 8;

/// The window of the refusal log's rate limit.
pub const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// Refusal lines logged per [`REFUSAL_LOG_WINDOW`]; the rest are counted.
pub const REFUSAL_LOG_BURST: u32 = 10;

/// A finished mTLS session from the plane.
#[derive(Debug)]
pub struct Accepted {
    /// The session.
    pub stream: TlsStream<TcpStream>,
    /// Who dialed.
    pub peer: SocketAddr,
    /// The address it reached.
    pub local: Option<SocketAddr>,
    /// When the first of the node's certificate in force at the handshake
    /// and the plane's certificate expires, on this node's monotonic clock;
    /// `None` when neither could be read.
    pub certificates_expire: Option<Instant>,
}

/// What share of the certificates' remaining lifetime a connection may
/// live before its sessions are asked to move to a new connection.
const RECYCLE_SHARE: (u32, u32) = (3, 4);

/// What share of it passes before the connection is cut regardless.
const CUT_SHARE: (u32, u32) = (9, 10);

/// What the node knows of a connection; in the extensions of every request
/// that arrives on it.
#[derive(Debug, Clone)]
pub struct ConnectionInfo {
    /// Who dialed.
    pub peer: SocketAddr,
    /// When the sessions on it are asked to attach anew on a new connection
    /// (three quarters of the certificates' remaining lifetime at the
    /// handshake); `None` when no expiry could be read.
    pub recycle_at: Option<Instant>,
    /// When it is cut regardless (nine tenths of that lifetime): a
    /// connection never outlives the certificates it was opened with.
    pub cut_at: Option<Instant>,
}

impl Accepted {
    /// The connection as the server serves it, aged from now.
    pub fn into_connection(self) -> Connection {
        let (recycle_at, cut_at) = ages(Instant::now(), self.certificates_expire);
        Connection {
            stream: self.stream,
            info: ConnectionInfo {
                peer: self.peer,
                recycle_at,
                cut_at,
            },
            cut: cut_at.map(|at| Box::pin(tokio::time::sleep_until(at))),
        }
    }
}

/// When a connection opened at `now` whose certificates expire at
/// `expires` is recycled and when it is cut.
fn ages(now: Instant, expires: Option<Instant>) -> (Option<Instant>, Option<Instant>) {
    let share =
        |(n, d): (u32, u32)| expires.map(|at| now + at.saturating_duration_since(now) * n / d);
    (share(RECYCLE_SHARE), share(CUT_SHARE))
}

/// An accepted mTLS connection that fails every read and write once its
/// [`ConnectionInfo::cut_at`] passes.
#[derive(Debug)]
pub struct Connection {
    stream: TlsStream<TcpStream>,
    info: ConnectionInfo,
    cut: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
}

impl Connection {
    /// Whether the cut is due; registers for a wake-up when it is not.
    fn cut_due(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        self.cut
            .as_mut()
            .is_some_and(|cut| cut.as_mut().poll(cx).is_ready())
    }
}

fn aged_out() -> io::Error {
    io::Error::new(
        io::ErrorKind::TimedOut,
        "the connection reached its maximum age (the certificates it was opened with expire soon)",
    )
}

impl tokio::io::AsyncRead for Connection {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        if self.cut_due(cx) {
            return std::task::Poll::Ready(Err(aged_out()));
        }
        std::pin::Pin::new(&mut self.stream).poll_read(cx, buf)
    }
}

impl tokio::io::AsyncWrite for Connection {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        if self.cut_due(cx) {
            return std::task::Poll::Ready(Err(aged_out()));
        }
        std::pin::Pin::new(&mut self.stream).poll_write(cx, buf)
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.stream).poll_shutdown(cx)
    }
}

impl tonic::transport::server::Connected for Connection {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        self.info.clone()
    }
}

/// Why a connection was refused, as the log counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Refusal {
    /// No handshake within [`HANDSHAKE_TIMEOUT`].
    Timeout,
    /// The handshake failed (plaintext, no or a foreign client certificate).
    Handshake,
    /// Dropped at a limit to make room for a newer connection.
    Evicted,
    /// The client certificate does not name the plane.
    NotThePlane,
    /// The client certificate could not be read.
    Unreadable,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::Timeout => "timeout",
            Refusal::Handshake => "handshake_failed",
            Refusal::Evicted => "evicted",
            Refusal::NotThePlane => "not_the_plane",
            Refusal::Unreadable => "unreadable_certificate",
        }
    }
}

/// A refusal log line's rate limit: [`REFUSAL_LOG_BURST`] lines per
/// [`REFUSAL_LOG_WINDOW`] plus the first of each reason, the rest counted
/// and summed up once per window.
#[derive(Debug)]
struct RefusalLog {
    window_start: Instant,
    logged: u32,
    seen: BTreeSet<Refusal>,
    suppressed: BTreeMap<Refusal, u64>,
}

impl RefusalLog {
    fn new(now: Instant) -> Self {
        Self {
            window_start: now,
            logged: 0,
            seen: BTreeSet::new(),
            suppressed: BTreeMap::new(),
        }
    }

    /// Starts a new window when this one is over, logging what the old one
    /// suppressed. Returns the suppressed counts it logged.
    fn roll(&mut self, now: Instant) -> Option<BTreeMap<Refusal, u64>> {
        if now.duration_since(self.window_start) < REFUSAL_LOG_WINDOW {
            return None;
        }
        self.window_start = now;
        self.logged = 0;
        self.seen.clear();
        if self.suppressed.is_empty() {
            return None;
        }
        let suppressed = std::mem::take(&mut self.suppressed);
        let total: u64 = suppressed.values().sum();
        let by_reason: Vec<String> = suppressed
            .iter()
            .map(|(r, n)| format!("{}={n}", r.label()))
            .collect();
        warn!(
            suppressed = total,
            reasons = %by_reason.join(","),
            "refused more connections than are logged one by one"
        );
        Some(suppressed)
    }

    /// Whether this refusal may be logged on its own line; if not, it is
    /// counted. The first of each reason in a window is always logged, so a
    /// flood of one kind never hides another.
    fn admit(&mut self, now: Instant, refusal: Refusal) -> bool {
        self.roll(now);
        if self.logged < REFUSAL_LOG_BURST || self.seen.insert(refusal) {
            self.seen.insert(refusal);
            self.logged += 1;
            true
        } else {
            *self.suppressed.entry(refusal).or_default() += 1;
            false
        }
    }
}

/// The unfinished handshakes, oldest first, each with its peer and the
/// token that drops it.
#[derive(Debug, Default)]
struct Pending {
    next: u64,
    by_age: BTreeMap<u64, (IpAddr, CancellationToken)>,
    by_peer: HashMap<IpAddr, VecDeque<u64>>,
}

impl Pending {
    /// Admits a handshake from `ip`, dropping the oldest one at a limit
    /// (that peer's at the per-peer limit, else anyone's at the total).
    /// Returns its number and the token that drops it.
    fn admit(&mut self, ip: IpAddr) -> (u64, CancellationToken) {
        let victim = match self.by_peer.get(&ip) {
            Some(own) if own.len() >= MAX_PENDING_PER_PEER => own.front().copied(),
            _ if self.by_age.len() >= MAX_PENDING_HANDSHAKES => self.by_age.keys().next().copied(),
            _ => None,
        };
        if let Some(victim) = victim {
            if let Some((_, token)) = self.by_age.get(&victim) {
                token.cancel();
            }
            self.finish(victim);
        }
        let seq = self.next;
        self.next += 1;
        let token = CancellationToken::new();
        self.by_age.insert(seq, (ip, token.clone()));
        self.by_peer.entry(ip).or_default().push_back(seq);
        (seq, token)
    }

    /// Forgets handshake `seq` (finished, failed or dropped).
    fn finish(&mut self, seq: u64) {
        let Some((ip, _)) = self.by_age.remove(&seq) else {
            return;
        };
        if let Some(own) = self.by_peer.get_mut(&ip) {
            own.retain(|s| *s != seq);
            if own.is_empty() {
                self.by_peer.remove(&ip);
            }
        }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_age.len()
    }
}

/// Accepts TCP connections and completes mTLS handshakes off the accept
/// path (each with the configuration in force at that moment), yielding
/// only finished sessions whose client certificate names `plane_name` (when
/// set). See the module doc for the limits and the refusal log. Each
/// session's `certificates_expire` is the earlier end of the two
/// certificates, read on `clock` (the plane dates both).
///
/// The returned channel closes when `cancel` fires.
pub fn accept(
    listener: TcpListener,
    config: watch::Receiver<Arc<rustls::ServerConfig>>,
    validity: watch::Receiver<Validity>,
    plane_name: Option<String>,
    clock: Arc<PlaneClock>,
    cancel: CancellationToken,
) -> mpsc::Receiver<Result<Accepted, io::Error>> {
    let (tx, rx) = mpsc::channel(MAX_PENDING_HANDSHAKES);
    let pending = Arc::new(Mutex::new(Pending::default()));
    let log = Arc::new(Mutex::new(RefusalLog::new(Instant::now())));
    let mut errors = AcceptErrors::new("plane");
    tokio::spawn(
        async move {
            let mut roll = tokio::time::interval(REFUSAL_LOG_WINDOW);
            loop {
                let accepted = tokio::select! {
                    () = cancel.cancelled() => return,
                    _ = roll.tick() => {
                        log.lock().expect("refusal log").roll(Instant::now());
                        continue;
                    }
                    accepted = listener.accept() => accepted,
                };
                let (tcp, peer) = match accepted {
                    Ok(pair) => pair,
                    Err(e) => {
                        // Out of descriptors, most likely: give the
                        // handshakes in flight a moment to finish, longer
                        // each time, and say so at a bounded rate.
                        errors.back_off(&e).await;
                        continue;
                    }
                };
                errors.accepted();
                if let Err(e) = tcp.set_nodelay(true) {
                    debug!(%peer, error = %e, "cannot set TCP_NODELAY");
                }
                let (seq, dropped) = pending.lock().expect("pending").admit(peer.ip());
                // The configuration in force now: a rotation applies to the
                // next connection, never to one already open.
                let acceptor = TlsAcceptor::from(config.borrow().clone());
                let node_expires = validity.borrow().1;
                let (tx, plane_name, clock) = (tx.clone(), plane_name.clone(), clock.clone());
                let (pending, log) = (Arc::clone(&pending), Arc::clone(&log));
                tokio::spawn(async move {
                    let local = tcp.local_addr().ok();
                    let outcome = tokio::select! {
                        () = dropped.cancelled() => Err((Refusal::Evicted, String::new())),
                        done = handshake(acceptor, tcp, plane_name.as_deref()) => done,
                    };
                    pending.lock().expect("pending").finish(seq);
                    match outcome {
                        Ok((stream, plane_expires)) => {
                            debug!(%peer, "mTLS session established");
                            let certificates_expire = [node_expires, plane_expires]
                                .into_iter()
                                .flatten()
                                .min()
                                .map(|at| Instant::now() + clock.until(at));
                            let _ = tx
                                .send(Ok(Accepted {
                                    stream,
                                    peer,
                                    local,
                                    certificates_expire,
                                }))
                                .await;
                        }
                        Err((refusal, detail)) => {
                            if log
                                .lock()
                                .expect("refusal log")
                                .admit(Instant::now(), refusal)
                            {
                                log_refusal(peer, refusal, &detail);
                            }
                        }
                    }
                });
            }
        }
        .instrument(info_span!("tls_accept")),
    );
    rx
}

fn log_refusal(peer: SocketAddr, refusal: Refusal, detail: &str) {
    let reason = refusal.label();
    match refusal {
        Refusal::Timeout => {
            warn!(%peer, reason, "refused a connection: no TLS handshake within {HANDSHAKE_TIMEOUT:?}")
        }
        Refusal::Handshake => {
            warn!(%peer, reason, error = detail, "refused a connection: TLS handshake failed (plaintext, no client certificate, or one this deployment's CA did not issue)")
        }
        Refusal::Evicted => {
            warn!(%peer, reason, "dropped an unfinished TLS handshake to make room for a newer connection (too many at once from this address or in all)")
        }
        Refusal::NotThePlane => {
            warn!(%peer, reason, names = detail, "refused a connection: the client certificate does not name the configured plane")
        }
        Refusal::Unreadable => {
            warn!(%peer, reason, "refused a connection: unreadable client certificate")
        }
    }
}

type Handshake = (TlsStream<TcpStream>, Option<SystemTime>);

async fn handshake(
    acceptor: TlsAcceptor,
    tcp: TcpStream,
    plane_name: Option<&str>,
) -> Result<Handshake, (Refusal, String)> {
    let stream = match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
        Err(_) => return Err((Refusal::Timeout, String::new())),
        Ok(Err(e)) => return Err((Refusal::Handshake, e.to_string())),
        Ok(Ok(stream)) => stream,
    };
    let leaf = stream
        .get_ref()
        .1
        .peer_certificates()
        .and_then(|c| c.first())
        .cloned();
    let plane_expires = leaf
        .as_ref()
        .and_then(|cert| crate::edge::tls::validity(cert).1);
    if let Some(expected) = plane_name {
        match leaf.as_ref().map(dns_names) {
            Some(Ok(names)) if names.iter().any(|n| n == expected) => {}
            Some(Ok(names)) => {
                return Err((
                    Refusal::NotThePlane,
                    format!("{names:?} (expected {expected})"),
                ));
            }
            _ => return Err((Refusal::Unreadable, String::new())),
        }
    }
    Ok((stream, plane_expires))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    #[test]
    fn a_connection_is_recycled_at_three_quarters_of_its_certificates_lifetime_and_cut_at_nine_tenths()
     {
        let now = Instant::now();
        let (recycle, cut) = ages(now, Some(now + Duration::from_secs(100)));
        assert_eq!(recycle, Some(now + Duration::from_secs(75)));
        assert_eq!(cut, Some(now + Duration::from_secs(90)));
        assert_eq!(ages(now, None), (None, None), "no expiry read, no age");
        let (recycle, cut) = ages(now, now.checked_sub(Duration::from_secs(1)));
        assert_eq!(
            (recycle, cut),
            (Some(now), Some(now)),
            "already expired: at once"
        );
    }

    #[test]
    fn a_peer_at_its_limit_loses_its_oldest_handshake_and_no_one_elses() {
        let mut pending = Pending::default();
        let (_, other) = pending.admit(ip(2));
        let mut own = Vec::new();
        for _ in 0..MAX_PENDING_PER_PEER {
            own.push(pending.admit(ip(1)).1);
        }
        assert!(own.iter().all(|t| !t.is_cancelled()));
        let (_, newest) = pending.admit(ip(1));
        assert!(own[0].is_cancelled(), "the oldest of that peer is dropped");
        assert!(own[1..].iter().all(|t| !t.is_cancelled()));
        assert!(
            !newest.is_cancelled(),
            "the newcomer is never the one dropped"
        );
        assert!(
            !other.is_cancelled(),
            "another peer's handshake is untouched"
        );
        assert_eq!(pending.len(), MAX_PENDING_PER_PEER + 1);
    }

    #[test]
    fn at_the_total_limit_the_oldest_handshake_of_anyone_is_dropped() {
        let mut pending = Pending::default();
        let mut tokens = Vec::new();
        for n in 0..MAX_PENDING_HANDSHAKES {
            let last = u8::try_from(n / MAX_PENDING_PER_PEER).expect("few peers");
            tokens.push(pending.admit(ip(last)).1);
        }
        let (_, newest) = pending.admit(ip(200));
        assert!(tokens[0].is_cancelled());
        assert!(tokens[1..].iter().all(|t| !t.is_cancelled()));
        assert!(!newest.is_cancelled());
        assert_eq!(pending.len(), MAX_PENDING_HANDSHAKES);
    }

    #[test]
    fn a_finished_handshake_frees_its_place() {
        let mut pending = Pending::default();
        let mut seqs = Vec::new();
        for _ in 0..MAX_PENDING_PER_PEER {
            seqs.push(pending.admit(ip(1)));
        }
        pending.finish(seqs[3].0);
        let (_, newest) = pending.admit(ip(1));
        assert!(
            seqs.iter().all(|(_, t)| !t.is_cancelled()),
            "a free place is used before anything is dropped"
        );
        assert!(!newest.is_cancelled());
        pending.finish(seqs[3].0);
        assert_eq!(pending.len(), MAX_PENDING_PER_PEER);
    }

    #[tokio::test(start_paused = true)]
    async fn refusals_past_the_burst_are_counted_and_summed_up_once_a_window() {
        let mut log = RefusalLog::new(Instant::now());
        let admitted = (0..1000)
            .filter(|_| log.admit(Instant::now(), Refusal::Timeout))
            .count();
        assert_eq!(admitted, REFUSAL_LOG_BURST as usize);
        assert!(
            log.admit(Instant::now(), Refusal::NotThePlane),
            "the first of another reason is logged"
        );
        assert!(!log.admit(Instant::now(), Refusal::NotThePlane));
        log.admit(Instant::now(), Refusal::Evicted);
        assert_eq!(log.roll(Instant::now()), None, "not before the window ends");
        tokio::time::advance(REFUSAL_LOG_WINDOW).await;
        let summed = log.roll(Instant::now()).expect("a summary");
        assert_eq!(
            summed.get(&Refusal::Timeout),
            Some(&(1000 - u64::from(REFUSAL_LOG_BURST)))
        );
        assert_eq!(summed.get(&Refusal::Evicted), None, "its first was logged");
        assert_eq!(summed.get(&Refusal::NotThePlane), Some(&1));
        assert!(
            log.admit(Instant::now(), Refusal::Timeout),
            "a new window logs again"
        );
        tokio::time::advance(REFUSAL_LOG_WINDOW).await;
        assert_eq!(
            log.roll(Instant::now()),
            None,
            "nothing suppressed, nothing summed"
        );
    }
}
