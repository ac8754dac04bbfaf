//! The node's accept loop: TCP connections in, finished mTLS sessions out,
//! and no way for unauthenticated peers to crowd the plane out.
//!
//! - Every connection is accepted at once (the loop never waits for a
//!   handshake slot, so the kernel's backlog fills only when connections
//!   come faster than the loop can take them) and gets `TCP_NODELAY`: the
//!   wire is small request/response messages.
//! - A handshake has [`HANDSHAKE_TIMEOUT`] to finish.
//! - A connection that has sent no byte yet is *silent*; one that has is a
//!   handshake. At most [`MAX_SILENT_PER_PEER`] silent connections are held
//!   per peer address and [`MAX_SILENT`] in all; at most
//!   [`MAX_PENDING_PER_PEER`] handshakes run per peer address and
//!   [`MAX_PENDING_HANDSHAKES`] in all. At a peer's limit its connection of
//!   the class that has read the fewest bytes (the oldest of those) is
//!   dropped to make room; at a total limit, the same from the peer holding
//!   the most of the class; never the newcomer. Fewest bytes first, so that
//!   connections sending a byte or a ClientHello fragment and then stalling
//!   or closing, even from the plane's own address, go before a plane's
//!   handshake several round trips along. The classes are apart so that an
//!   idle flood, however fast it redials, never drops a handshake: a plane's
//!   ClientHello follows its connect at once, and once it has arrived only
//!   other handshakes compete with it (with one limit for both, 12,000 idle
//!   dials a second from the plane's own address lock a plane out). The
//!   heaviest peer pays at a total limit so that a flood from many
//!   addresses drops its own connections before a plane's one, however far
//!   away the plane is (by age alone, a plane 10 ms away is always the
//!   oldest of all in a storm of stalled handshakes from 9 addresses).
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
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, debug, info_span, warn};

use crate::clock::PlaneClock;
use crate::listen::AcceptErrors;
use crate::tls::{Validity, dns_names};

/// How long a peer may take to finish the TLS handshake. Short: an mTLS
/// handshake takes a few round trips, and a slot held longer is one a
/// plane cannot use.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// Most unfinished handshakes at once (connections that have sent a byte);
/// past it the oldest is dropped.
pub(crate) const MAX_PENDING_HANDSHAKES: usize = 64;

/// Most unfinished handshakes from one peer address; past it that peer's
/// oldest is dropped, so one address cannot take every slot.
pub(crate) const MAX_PENDING_PER_PEER: usize = 8;

/// Most connections from one peer address that have sent no byte yet; past
/// it that peer's oldest such is dropped. Apart from the handshakes and
/// larger, because such a connection costs a descriptor and a parked task
/// and nothing else, and because the more of them are held the slower an
/// idle flood that redials at once churns: a plane whose ClientHello is a
/// moment behind its connect is not dropped before it speaks.
pub(crate) const MAX_SILENT_PER_PEER: usize = 128;

/// Most connections that have sent no byte yet, from anyone; past it the
/// oldest such is dropped.
pub(crate) const MAX_SILENT: usize = 256;

/// The window of the refusal log's rate limit.
pub(crate) const REFUSAL_LOG_WINDOW: Duration = Duration::from_secs(10);

/// Refusal lines logged per [`REFUSAL_LOG_WINDOW`]; the rest are counted.
pub(crate) const REFUSAL_LOG_BURST: u32 = 10;

/// A finished mTLS session from the plane.
#[derive(Debug)]
pub(crate) struct Accepted {
    /// The session.
    pub stream: TlsStream<Counted>,
    /// Who dialed.
    pub peer: SocketAddr,
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
pub(crate) struct ConnectionInfo {
    /// Who dialed.
    pub peer: SocketAddr,
    /// When the sessions on it are asked to attach anew on a new connection
    /// (three quarters of the certificates' remaining lifetime at the
    /// handshake); `None` when no expiry could be read.
    pub recycle_at: Option<Instant>,
}

impl Accepted {
    /// The connection as the server serves it, aged from now.
    pub(crate) fn into_connection(self) -> Connection {
        let (recycle_at, cut_at) = ages(Instant::now(), self.certificates_expire);
        Connection {
            stream: self.stream,
            info: ConnectionInfo {
                peer: self.peer,
                recycle_at,
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
/// cut passes (nine tenths of its certificates' remaining lifetime at the
/// handshake): a connection never outlives the certificates it was opened
/// with.
#[derive(Debug)]
pub(crate) struct Connection {
    stream: TlsStream<Counted>,
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
    /// Dropped at a limit to make room for a newer connection, mid-handshake.
    Evicted,
    /// Dropped at a limit to make room for a newer connection, having sent
    /// nothing.
    EvictedIdle,
    /// The client certificate does not name the plane.
    NotThePlane,
    /// The client certificate could not be read.
    Unreadable,
    /// Closed having sent nothing (a scan, a health check): not logged.
    Closed,
}

impl Refusal {
    fn label(self) -> &'static str {
        match self {
            Refusal::Timeout => "timeout",
            Refusal::Handshake => "handshake_failed",
            Refusal::Evicted => "evicted",
            Refusal::EvictedIdle => "evicted_idle",
            Refusal::NotThePlane => "not_the_plane",
            Refusal::Unreadable => "unreadable_certificate",
            Refusal::Closed => "closed",
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

/// An unfinished connection: its peer, the token that drops it, whether
/// the peer has sent a byte yet (its class), and how many bytes its
/// handshake has read.
#[derive(Debug)]
struct Unfinished {
    ip: IpAddr,
    dropped: CancellationToken,
    spoke: bool,
    received: Arc<AtomicU64>,
}

/// One peer address's unfinished connections, oldest first, and how many
/// of each class (`[silent, spoke]`).
#[derive(Debug, Default)]
struct Peer {
    seqs: VecDeque<u64>,
    held: [usize; 2],
}

/// The unfinished connections, oldest first, with counts kept per class so
/// that admitting one costs no walk of them all, even in a flood.
#[derive(Debug, Default)]
struct Pending {
    next: u64,
    by_age: BTreeMap<u64, Unfinished>,
    by_peer: HashMap<IpAddr, Peer>,
    /// How many of each class in all (`[silent, spoke]`).
    totals: [usize; 2],
}

impl Pending {
    /// The limits of a class: per peer and in all.
    fn caps(spoke: bool) -> (usize, usize) {
        if spoke {
            (MAX_PENDING_PER_PEER, MAX_PENDING_HANDSHAKES)
        } else {
            (MAX_SILENT_PER_PEER, MAX_SILENT)
        }
    }

    /// `peer`'s connection of class `spoke` whose handshake has read the
    /// fewest bytes, the oldest of those: one that sent a byte or a
    /// fragment and stalled, or whose task has not read it yet, goes before
    /// a plane's handshake several round trips along.
    fn least_along(&self, peer: &Peer, spoke: bool) -> Option<u64> {
        peer.seqs
            .iter()
            .filter_map(|s| {
                let u = self.by_age.get(s).filter(|u| u.spoke == spoke)?;
                Some((u.received.load(Ordering::Relaxed), *s))
            })
            .min()
            .map(|(_, s)| s)
    }

    /// The byte count of connection `seq`'s handshake, which its task's
    /// stream adds to ([`Counted`]).
    fn received(&self, seq: u64) -> Arc<AtomicU64> {
        self.by_age
            .get(&seq)
            .map_or_else(Arc::default, |u| Arc::clone(&u.received))
    }

    /// The connection to drop so that one more of class `spoke` from `ip`
    /// fits: that peer's least along of the class at its per-peer limit
    /// ([`Self::least_along`]); at the class's total, the least along of
    /// the class from the peer holding the most of it (at a tie, the peer
    /// whose oldest connection is oldest),
    /// so that a plane's one connection is never dropped while another
    /// address holds more, however fast their connections turn over;
    /// `None` when it fits.
    fn victim(&self, ip: IpAddr, spoke: bool) -> Option<u64> {
        let (per_peer, total) = Self::caps(spoke);
        let class = usize::from(spoke);
        if let Some(own) = self.by_peer.get(&ip)
            && own.held[class] >= per_peer
        {
            return self.least_along(own, spoke);
        }
        if self.totals[class] < total {
            return None;
        }
        let heaviest = self
            .by_peer
            .values()
            .filter(|p| p.held[class] > 0)
            // `Reverse`: at a tie `max` prefers the older front.
            .max_by_key(|p| (p.held[class], std::cmp::Reverse(p.seqs.front().copied())))?;
        self.least_along(heaviest, spoke)
    }

    fn drop_one(&mut self, victim: Option<u64>) {
        if let Some(victim) = victim {
            if let Some(u) = self.by_age.get(&victim) {
                u.dropped.cancel();
            }
            self.finish(victim);
        }
    }

    /// Admits a connection from `ip` (`spoke`: its first bytes have
    /// arrived), dropping one of its class at a limit (see
    /// [`Self::victim`]). Returns its number and the token that drops it.
    fn admit(&mut self, ip: IpAddr, spoke: bool) -> (u64, CancellationToken) {
        self.drop_one(self.victim(ip, spoke));
        let seq = self.next;
        self.next += 1;
        let dropped = CancellationToken::new();
        self.by_age.insert(
            seq,
            Unfinished {
                ip,
                dropped: dropped.clone(),
                spoke,
                received: Arc::default(),
            },
        );
        let peer = self.by_peer.entry(ip).or_default();
        peer.seqs.push_back(seq);
        peer.held[usize::from(spoke)] += 1;
        self.totals[usize::from(spoke)] += 1;
        (seq, dropped)
    }

    /// Notes that connection `seq`'s peer has sent its first bytes: it
    /// moves to the handshakes, dropping one of those at a limit.
    fn spoke(&mut self, seq: u64) {
        let Some(ip) = self.by_age.get(&seq).filter(|u| !u.spoke).map(|u| u.ip) else {
            return;
        };
        self.drop_one(self.victim(ip, true));
        if let Some(u) = self.by_age.get_mut(&seq) {
            u.spoke = true;
            if let Some(peer) = self.by_peer.get_mut(&ip) {
                peer.held[0] -= 1;
                peer.held[1] += 1;
            }
            self.totals[0] -= 1;
            self.totals[1] += 1;
        }
    }

    /// Forgets connection `seq` (finished, failed or dropped).
    fn finish(&mut self, seq: u64) {
        let Some(Unfinished { ip, spoke, .. }) = self.by_age.remove(&seq) else {
            return;
        };
        let class = usize::from(spoke);
        self.totals[class] -= 1;
        if let Some(peer) = self.by_peer.get_mut(&ip) {
            peer.seqs.retain(|s| *s != seq);
            peer.held[class] -= 1;
            if peer.seqs.is_empty() {
                self.by_peer.remove(&ip);
            }
        }
    }

    /// How many are held; panics when the counts kept disagree with them.
    #[cfg(test)]
    fn len(&self) -> usize {
        let mut totals = [0; 2];
        for u in self.by_age.values() {
            totals[usize::from(u.spoke)] += 1;
        }
        assert_eq!(totals, self.totals, "the class totals");
        for (ip, peer) in &self.by_peer {
            let mut held = [0; 2];
            for s in &peer.seqs {
                let u = &self.by_age[s];
                assert_eq!(u.ip, *ip);
                held[usize::from(u.spoke)] += 1;
            }
            assert_eq!(held, peer.held, "{ip}'s counts");
        }
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
pub(crate) fn accept(
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
                // Bytes already waiting (the accept queue is long in a
                // flood, so a plane's ClientHello is usually here by now),
                // or a peer gone already (a scan, a health check): that
                // one takes no place at all.
                let spoke = match first_look(&tcp) {
                    Look::Spoke(n) => Some(n),
                    Look::Silent => None,
                    Look::Gone => {
                        log_refusal(peer, Refusal::Closed, "");
                        continue;
                    }
                };
                let (seq, dropped, received) = {
                    let mut pending = pending.lock().expect("pending");
                    let (seq, dropped) = pending.admit(peer.ip(), spoke.is_some());
                    let received = pending.received(seq);
                    // What is waiting counts towards how far along it is,
                    // before its task has read a byte.
                    if let Some(waiting) = spoke {
                        received.store(waiting, Ordering::Relaxed);
                    }
                    (seq, dropped, received)
                };
                let spoke = spoke.is_some();
                // More than none once it has spoken (what was waiting at
                // either look counts): whether an eviction dropped a
                // handshake or an idle connection.
                let progress = Arc::clone(&received);
                // The configuration in force now: a rotation applies to the
                // next connection, never to one already open.
                let acceptor = TlsAcceptor::from(config.borrow().clone());
                let node_expires = validity.borrow().1;
                let (tx, plane_name, clock) = (tx.clone(), plane_name.clone(), clock.clone());
                let (pending, log) = (Arc::clone(&pending), Arc::clone(&log));
                tokio::spawn(async move {
                    let deadline = Instant::now() + HANDSHAKE_TIMEOUT;
                    let spoken = async {
                        if !spoke {
                            match tokio::time::timeout_at(deadline, first_bytes(&tcp)).await {
                                Err(_) => return Err((Refusal::Timeout, String::new())),
                                Ok(Look::Spoke(n)) => {
                                    received.fetch_add(n, Ordering::Relaxed);
                                }
                                // Closed having said nothing: it leaves its
                                // place and never counts as a handshake.
                                Ok(Look::Silent | Look::Gone) => {
                                    return Err((Refusal::Closed, String::new()));
                                }
                            }
                            pending.lock().expect("pending").spoke(seq);
                        }
                        let tcp = Counted {
                            inner: tcp,
                            received,
                        };
                        handshake(acceptor, tcp, plane_name.as_deref(), deadline).await
                    };
                    let outcome = tokio::select! {
                        () = dropped.cancelled() => {
                            let refusal = if progress.load(Ordering::Relaxed) > 0 {
                                Refusal::Evicted
                            } else {
                                Refusal::EvictedIdle
                            };
                            Err((refusal, String::new()))
                        }
                        done = spoken => done,
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
                                    certificates_expire,
                                }))
                                .await;
                        }
                        // Not counted by the refusal log: a scan or a
                        // health check is no refusal worth a line.
                        Err((Refusal::Closed, detail)) => {
                            log_refusal(peer, Refusal::Closed, &detail)
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
            warn!(%peer, reason, "dropped an unfinished TLS handshake to make room for a newer one (too many at once from this address or in all)")
        }
        Refusal::EvictedIdle => {
            warn!(%peer, reason, "dropped a connection that had sent nothing to make room for a newer one (too many idle at once from this address or in all)")
        }
        Refusal::NotThePlane => {
            warn!(%peer, reason, names = detail, "refused a connection: the client certificate does not name the configured plane")
        }
        Refusal::Unreadable => {
            warn!(%peer, reason, "refused a connection: unreadable client certificate")
        }
        Refusal::Closed => {
            debug!(%peer, reason, "a connection closed before sending anything");
        }
    }
}

/// Whether `tcp` has bytes waiting (or an end) to be read, asked of the
/// kernel without waiting and without taking them.
/// What a connection's first look finds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Look {
    /// This many bytes are waiting (counted up to [`PEEK_BYTES`]).
    Spoke(u64),
    /// Nothing yet.
    Silent,
    /// The peer closed (or the socket failed) having sent nothing.
    Gone,
}

/// Whether `tcp` has bytes waiting, nothing yet, or an end with nothing
/// before it; asked of the kernel without waiting and without taking
/// them.
fn first_look(tcp: &TcpStream) -> Look {
    match peek(tcp) {
        Ok(0) => Look::Gone,
        Ok(n) => Look::Spoke(n as u64),
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => Look::Silent,
        Err(_) => Look::Gone,
    }
}

/// How many waiting bytes a first look counts: more than a ClientHello
/// fragment, less than a full one with its extensions.
const PEEK_BYTES: usize = 2048;

fn peek(tcp: &TcpStream) -> io::Result<usize> {
    let mut bytes = [0u8; PEEK_BYTES];
    rustix::net::recv(
        tcp,
        &mut bytes[..],
        rustix::net::RecvFlags::PEEK | rustix::net::RecvFlags::DONTWAIT,
    )
    .map(|(n, _)| n)
    .map_err(io::Error::from)
}

/// Waits until `tcp` has bytes to read ([`Look::Spoke`]) or has ended with
/// none ([`Look::Gone`]), without taking them: a readiness the kernel does
/// not confirm is cleared and waited for again.
async fn first_bytes(tcp: &TcpStream) -> Look {
    loop {
        if tcp.readable().await.is_err() {
            return Look::Gone;
        }
        match tcp.try_io(tokio::io::Interest::READABLE, || peek(tcp)) {
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Ok(0) | Err(_) => return Look::Gone,
            Ok(n) => return Look::Spoke(n as u64),
        }
    }
}

/// A TCP stream that counts the bytes read from it, so that the limits on
/// unfinished handshakes can tell one several round trips along (a plane's)
/// from one that sent a byte or a fragment and stalled or ended.
#[derive(Debug)]
pub(crate) struct Counted {
    inner: TcpStream,
    received: Arc<AtomicU64>,
}

impl tokio::io::AsyncRead for Counted {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = std::pin::Pin::new(&mut self.inner).poll_read(cx, buf);
        let read = buf.filled().len().saturating_sub(before);
        self.received.fetch_add(read as u64, Ordering::Relaxed);
        polled
    }
}

impl tokio::io::AsyncWrite for Counted {
    fn poll_write(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> std::task::Poll<io::Result<usize>> {
        std::pin::Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        std::pin::Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

type Handshake = (TlsStream<Counted>, Option<SystemTime>);

async fn handshake(
    acceptor: TlsAcceptor,
    tcp: Counted,
    plane_name: Option<&str>,
    deadline: Instant,
) -> Result<Handshake, (Refusal, String)> {
    let stream = match tokio::time::timeout_at(deadline, acceptor.accept(tcp)).await {
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
    let plane_expires = leaf.as_ref().and_then(|cert| crate::tls::validity(cert).1);
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
        let (_, other) = pending.admit(ip(2), true);
        let mut own = Vec::new();
        for _ in 0..MAX_PENDING_PER_PEER {
            own.push(pending.admit(ip(1), true).1);
        }
        assert!(own.iter().all(|t| !t.is_cancelled()));
        let (_, newest) = pending.admit(ip(1), true);
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
            tokens.push(pending.admit(ip(last), true).1);
        }
        let (_, newest) = pending.admit(ip(200), true);
        assert!(tokens[0].is_cancelled());
        assert!(tokens[1..].iter().all(|t| !t.is_cancelled()));
        assert!(!newest.is_cancelled());
        assert_eq!(pending.len(), MAX_PENDING_HANDSHAKES);
    }

    #[test]
    fn an_idle_flood_from_a_peers_own_address_never_drops_its_handshake() {
        // A flood of idle dials from the plane's own address must not
        // evict the plane's handshake, as it would if one limit held
        // both.
        let mut pending = Pending::default();
        let (plane_seq, plane) = pending.admit(ip(1), false);
        let mut idle = Vec::new();
        for _ in 1..MAX_SILENT_PER_PEER {
            idle.push(pending.admit(ip(1), false).1);
        }
        pending.spoke(plane_seq);
        let (_, spoken_at_accept) = pending.admit(ip(1), true);
        for round in 0..10_000 {
            idle.push(pending.admit(ip(1), false).1);
            assert!(
                !plane.is_cancelled(),
                "round {round}: the plane was dropped"
            );
            assert!(!spoken_at_accept.is_cancelled());
        }
        let kept: Vec<bool> = idle.iter().map(|t| !t.is_cancelled()).collect();
        assert_eq!(
            kept.iter().filter(|k| **k).count(),
            MAX_SILENT_PER_PEER,
            "the peer's silent connections are held to their limit"
        );
        assert!(
            kept.iter().rev().take(MAX_SILENT_PER_PEER).all(|k| *k),
            "the oldest silent ones go first"
        );
        assert_eq!(pending.len(), MAX_SILENT_PER_PEER + 2);
    }

    #[test]
    fn the_silent_are_held_to_their_total_and_one_that_speaks_joins_the_handshakes_limit() {
        let mut pending = Pending::default();
        let mut silent = Vec::new();
        for n in 0..MAX_SILENT {
            let last = u8::try_from(n / MAX_SILENT_PER_PEER).expect("few peers");
            silent.push(pending.admit(ip(last), false));
        }
        let handshake = pending.admit(ip(100), true).1;
        pending.admit(ip(200), false);
        assert!(
            silent[0].1.is_cancelled(),
            "the oldest silent of anyone goes"
        );
        assert!(silent[1..].iter().all(|(_, t)| !t.is_cancelled()));
        assert!(!handshake.is_cancelled(), "a handshake is not silent");
        // Handshakes of peer 1 at their limit; one of its silent speaks.
        let mut handshakes = Vec::new();
        for _ in 0..MAX_PENDING_PER_PEER {
            handshakes.push(pending.admit(ip(1), true).1);
        }
        let (speaker, speaker_token) = silent[MAX_SILENT_PER_PEER + 1].clone();
        pending.spoke(speaker);
        assert!(
            handshakes[0].is_cancelled(),
            "the oldest handshake of that peer goes"
        );
        assert!(handshakes[1..].iter().all(|t| !t.is_cancelled()));
        assert!(!speaker_token.is_cancelled());
        pending.spoke(speaker);
        assert!(
            handshakes[1..].iter().all(|t| !t.is_cancelled()),
            "speaking twice moves nothing"
        );
        assert_eq!(pending.len(), MAX_SILENT + 1 + MAX_PENDING_PER_PEER - 1);
    }

    #[test]
    fn at_a_total_limit_the_peer_holding_most_loses_its_oldest_not_a_lone_older_one() {
        // Nine addresses of stalled handshakes, each within its 8, must
        // not drop a plane 10 ms away as the oldest of all.
        for spoke in [true, false] {
            let (per_peer, total) = Pending::caps(spoke);
            let mut pending = Pending::default();
            let (_, plane) = pending.admit(ip(1), spoke);
            let mut peer = 10u8;
            while pending.len() < total {
                for _ in 0..per_peer - 1 {
                    if pending.len() < total {
                        pending.admit(ip(peer), spoke);
                    }
                }
                peer += 1;
            }
            for round in 0..10_000 {
                let from = 10 + u8::try_from(round % 9).expect("small");
                pending.admit(ip(from), spoke);
                assert!(
                    !plane.is_cancelled(),
                    "spoke {spoke}, round {round}: the plane's lone connection was dropped"
                );
            }
            assert_eq!(pending.len(), total);
        }
    }

    #[test]
    fn at_a_peers_limit_the_handshake_that_has_read_least_goes_first() {
        // One byte and a close, from the plane's own address, must not
        // drop the plane's handshake as the oldest.
        let mut pending = Pending::default();
        let (plane_seq, plane) = pending.admit(ip(1), true);
        pending.received(plane_seq).store(517, Ordering::Relaxed);
        let mut fragments = Vec::new();
        for _ in 1..MAX_PENDING_PER_PEER {
            let (seq, token) = pending.admit(ip(1), true);
            pending.received(seq).store(1, Ordering::Relaxed);
            fragments.push(token);
        }
        for _ in 0..100 {
            fragments.push(pending.admit(ip(1), true).1);
            assert!(!plane.is_cancelled(), "the plane's handshake went");
        }
        assert_eq!(pending.len(), MAX_PENDING_PER_PEER);
        // Among equals, the oldest still goes first.
        let mut equals = Pending::default();
        let first = equals.admit(ip(2), true).1;
        for _ in 0..MAX_PENDING_PER_PEER {
            equals.admit(ip(2), true);
        }
        assert!(first.is_cancelled());
    }

    #[test]
    fn a_finished_handshake_frees_its_place() {
        let mut pending = Pending::default();
        let mut seqs = Vec::new();
        for _ in 0..MAX_PENDING_PER_PEER {
            seqs.push(pending.admit(ip(1), true));
        }
        pending.finish(seqs[3].0);
        let (_, newest) = pending.admit(ip(1), true);
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
