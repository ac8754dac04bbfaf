//! The node's own judgement of whether it can do its job: [`Health`], the
//! degraded state with its reasons, fed by the watchdog around every
//! provider call ([`WatchedProvider`]), the journal's writes
//! ([`WatchedJournal`]), the state directory's free space, the node's
//! certificate and the clock offset measured against the plane.
//!
//! A degraded node refuses launches before anything is minted (typed
//! `UNAVAILABLE`, or `RESOURCE_EXHAUSTED` for a full disk), says so on both
//! health endpoints (`NOT_SERVING`) and in the session (`NodeStatus`), and
//! keeps renewing the leases it holds and running destroys, tends and
//! sweeps. It heals by itself: a reason is raised at the first bad
//! observation and cleared only once its cause has been absent for
//! [`HEAL_AFTER`] (hysteresis; measured levels also have a lower clear
//! threshold than raise threshold).
//!
//! May not touch: lease state or the wire; the session reads
//! [`Health::snapshot`] and converts it at the edge.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, info, info_span, warn};

use crate::clock::PlaneClock;
use crate::journal::{CustodyRecord, Durability, Journal, JournalError, LaunchRecord};
use crate::model::{ByteSize, InstanceName};
use crate::provider::{
    ImageFacts, Instance, InstanceSpec, Provider, ProviderError, Teardown, Work,
};

/// How long a reason's cause must have been absent before the reason clears.
pub(crate) const HEAL_AFTER: Duration = Duration::from_secs(10);
/// How often the provider is probed and the disk and certificate looked at.
pub(crate) const PROBE_INTERVAL: Duration = Duration::from_secs(5);
/// How long the provider probe (a list) may take before the provider counts
/// as stuck.
pub(crate) const PROBE_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a launch's own provider calls before the mint (its image
/// check, which is also its fresh probe of the engine, and its shape) may
/// take.
pub(crate) const LAUNCH_PROBE_TIMEOUT: Duration = Duration::from_secs(5);
/// Watchdog bound on a provider `list`, `find` or `destroy`.
pub(crate) const CALL_TIMEOUT: Duration = Duration::from_secs(60);
/// Watchdog bound on a provider `create` (it may unpack an image).
pub(crate) const CREATE_TIMEOUT: Duration = Duration::from_secs(180);
/// A clock further than this from the plane's makes the node degraded; it
/// clears below half of it. Deadlines do not depend on it (they are judged
/// on the monotonic clock); certificate validity and operators' logs do.
pub(crate) const CLOCK_OFFSET_LIMIT: Duration = Duration::from_secs(10 * 60);
/// What health needs of the command slot: how long the command in it has
/// run. The slot itself lives in the gRPC face (`edge::slot`).
pub(crate) trait SlotProgress: Send + Sync + std::fmt::Debug {
    /// How long the command now in the slot has run; `None` when idle.
    fn busy_for(&self) -> Option<Duration>;
}

/// A command that has held the command slot longer than this makes the node
/// degraded ([`Reason::SlotStuck`]) until the slot moves again: everything
/// queued behind it waits, so a launch placed here would too. Longer than
/// any command takes when the node is well (a launch's plane calls and
/// create take seconds), shorter than the provider watchdog's
/// [`CALL_TIMEOUT`], so a call that hangs shows here before it is cut, and
/// a wait the provider watchdog does not bound (a plane call, a journal
/// write) shows at all.
pub(crate) const SLOT_STUCK_AFTER: Duration = Duration::from_secs(30);
/// How often at most a repeated failure (a journal write, the journal
/// probe) is logged on its own line; the lines in between are counted and
/// the next line says how many were suppressed.
pub(crate) const REPEATED_FAILURE_LOG_EVERY: Duration = Duration::from_secs(60);
/// The file the journal probe writes, syncs and removes in the state
/// directory on every health tick.
pub(crate) const JOURNAL_PROBE_FILE: &str = ".journal-probe";
/// Default free-space watermark of the state directory's file system.
pub(crate) const DEFAULT_MIN_FREE_DISK_BYTES: u64 = 64 << 20;

/// Why a node says it cannot take work.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Reason {
    /// A provider call failed for an outage.
    ProviderUnreachable,
    /// A provider call did not answer within its watchdog bound.
    ProviderStuck,
    /// The state directory's file system is below its watermark.
    DiskLow,
    /// A journal write failed.
    JournalUnwritable,
    /// The certificate expires soon (within a sixth of its lifetime, at
    /// most a day).
    IdentityExpiring,
    /// The certificate has expired.
    IdentityExpired,
    /// The clock is more than [`CLOCK_OFFSET_LIMIT`] from the plane's.
    ClockOffset,
    /// The cloud gave notice that it takes the host's spot capacity back
    /// ([`crate::node::interruption`]).
    SpotInterruption,
    /// One command has held the command slot longer than
    /// [`SLOT_STUCK_AFTER`].
    SlotStuck,
}

impl Reason {
    /// Every reason, in order.
    pub const ALL: [Reason; 9] = [
        Reason::ProviderUnreachable,
        Reason::ProviderStuck,
        Reason::DiskLow,
        Reason::JournalUnwritable,
        Reason::IdentityExpiring,
        Reason::IdentityExpired,
        Reason::ClockOffset,
        Reason::SpotInterruption,
        Reason::SlotStuck,
    ];

    /// A snake_case label (the `reason` of `billet_degraded`).
    pub(crate) fn label(self) -> &'static str {
        match self {
            Reason::ProviderUnreachable => "provider_unreachable",
            Reason::ProviderStuck => "provider_stuck",
            Reason::DiskLow => "disk_low",
            Reason::JournalUnwritable => "journal_unwritable",
            Reason::IdentityExpiring => "identity_expiring",
            Reason::IdentityExpired => "identity_expired",
            Reason::ClockOffset => "clock_offset",
            Reason::SpotInterruption => "spot_interruption",
            Reason::SlotStuck => "slot_stuck",
        }
    }

    /// Lowercase words for logs.
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Reason::ProviderUnreachable => "provider unreachable",
            Reason::ProviderStuck => "provider stuck",
            Reason::DiskLow => "state disk below its watermark",
            Reason::JournalUnwritable => "journal not writable",
            Reason::IdentityExpiring => "identity expiring",
            Reason::IdentityExpired => "identity expired",
            Reason::ClockOffset => "clock offset",
            Reason::SpotInterruption => "spot interruption notice",
            Reason::SlotStuck => "command slot stuck",
        }
    }
}

/// What the node says about its health at one moment.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Snapshot {
    /// Active reasons, in order; empty when healthy.
    pub reasons: Vec<Reason>,
    /// This node's wall clock minus the plane's, in milliseconds, as last
    /// measured.
    pub clock_offset_ms: Option<i64>,
    /// When the node's certificate stops being valid.
    pub certificate_not_after: Option<SystemTime>,
}

impl Snapshot {
    /// Whether the node takes no launches.
    pub(crate) fn degraded(&self) -> bool {
        !self.reasons.is_empty()
    }

    /// The certificate's end as unix milliseconds; 0 when unknown.
    pub(crate) fn certificate_not_after_unix_ms(&self) -> i64 {
        self.certificate_not_after
            .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
            .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
    }
}

/// Why a launch is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Refusal {
    /// A resource is exhausted (disk): `RESOURCE_EXHAUSTED`; else
    /// `UNAVAILABLE`.
    pub exhausted: bool,
    /// The reasons, for the message.
    pub reasons: Vec<Reason>,
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let words: Vec<&str> = self.reasons.iter().map(|r| r.as_str()).collect();
        write!(
            f,
            "this node is degraded ({}); nothing was started or minted: place the launch elsewhere or retry once it is healthy",
            words.join(", ")
        )
    }
}

#[derive(Debug, Default, Clone, Copy)]
struct Cause {
    active: bool,
    good_since: Option<Instant>,
}

#[derive(Debug, Default)]
struct Inner {
    causes: BTreeMap<Reason, Cause>,
    clock_offset_ms: Option<i64>,
    certificate_not_after: Option<SystemTime>,
    last_contact: Option<Instant>,
}

/// The degraded state. Cheap to share behind an `Arc`; every observation
/// republishes the [`Snapshot`] when it changed.
#[derive(Debug)]
pub(crate) struct Health {
    inner: Mutex<Inner>,
    published: watch::Sender<Snapshot>,
    probe: Mutex<Option<Arc<dyn Provider>>>,
    slot: Mutex<Option<Arc<dyn SlotProgress>>>,
    journal_probe_log: LogLimit,
    journal_probing: std::sync::atomic::AtomicBool,
    /// The plane's clock through the offset last recorded: certificate
    /// dates are judged on it.
    plane_clock: Arc<PlaneClock>,
}

impl Default for Health {
    fn default() -> Self {
        Self {
            inner: Mutex::default(),
            published: watch::Sender::new(Snapshot::default()),
            probe: Mutex::new(None),
            slot: Mutex::new(None),
            journal_probe_log: LogLimit::default(),
            journal_probing: std::sync::atomic::AtomicBool::new(false),
            plane_clock: Arc::default(),
        }
    }
}

impl Health {
    /// A healthy node with nothing measured yet.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// The provider [`Health::watch`] probes.
    pub(crate) fn with_probe(self, provider: Arc<dyn Provider>) -> Self {
        *self.probe.lock().expect("health probe") = Some(provider);
        self
    }

    /// Sets the command slot whose progress [`Health::watch`] watches.
    pub(crate) fn watch_slot(&self, slot: Arc<dyn SlotProgress>) {
        *self.slot.lock().expect("health slot") = Some(slot);
    }

    /// Records how long the command running in the slot has run (`None`:
    /// idle): past [`SLOT_STUCK_AFTER`] raises [`Reason::SlotStuck`].
    pub(crate) fn slot_progress(&self, busy: Option<Duration>) {
        let stuck = busy.is_some_and(|b| b > SLOT_STUCK_AFTER);
        if stuck && !self.snapshot().reasons.contains(&Reason::SlotStuck) {
            warn!(
                busy_s = busy.unwrap_or_default().as_secs(),
                "one command has held the command slot past its bound; what is queued behind it waits"
            );
        }
        self.observe(Reason::SlotStuck, stuck);
    }

    /// Probes whether the journal's directory `dir` can be written
    /// ([`probe_writable`], off the async threads, bounded by
    /// [`PROBE_TIMEOUT`]) and feeds [`Reason::JournalUnwritable`] with the
    /// answer, so the reason is raised and cleared by observation, not only
    /// by a failed journal write. A probe still running from an earlier
    /// tick counts as a failure and starts no other. Failures are logged
    /// with their error, at most once per [`REPEATED_FAILURE_LOG_EVERY`].
    pub(crate) async fn probe_journal(&self, dir: &std::path::Path) {
        use std::sync::atomic::Ordering;
        let outcome = if self.journal_probing.swap(true, Ordering::SeqCst) {
            Err("the previous probe has not returned".to_owned())
        } else {
            let dir = dir.to_owned();
            let probe = tokio::task::spawn_blocking(move || probe_writable(&dir));
            let outcome = match tokio::time::timeout(PROBE_TIMEOUT, probe).await {
                Err(_) => Err(format!("no answer within {PROBE_TIMEOUT:?}")),
                Ok(Err(e)) => Err(format!("the probe task failed: {e}")),
                Ok(Ok(r)) => r.map_err(|e| e.to_string()),
            };
            // A probe that timed out still runs: the flag stays set until
            // it returns (it holds no handle to clear it), so at most one
            // hangs. Cleared here when it did return.
            if !matches!(&outcome, Err(e) if e.starts_with("no answer")) {
                self.journal_probing.store(false, Ordering::SeqCst);
            }
            outcome
        };
        if let Err(e) = &outcome
            && let Some(suppressed) = self.journal_probe_log.admit()
        {
            warn!(dir = %dir.display(), error = %e, suppressed,
                  "the journal probe cannot write the state directory");
        }
        self.observe(Reason::JournalUnwritable, outcome.is_err());
    }

    /// Records one observation of `reason`'s cause: `bad` raises it at once;
    /// a good one clears it once the cause has been absent [`HEAL_AFTER`].
    pub(crate) fn observe(&self, reason: Reason, bad: bool) {
        let mut inner = self.inner.lock().expect("health");
        let cause = inner.causes.entry(reason).or_default();
        if bad {
            if !cause.active {
                warn!(reason = reason.as_str(), "degraded: taking no launches");
            }
            cause.active = true;
            cause.good_since = None;
        } else if cause.active && cause.good_since.is_none() {
            cause.good_since = Some(Instant::now());
        }
        self.publish(&mut inner);
    }

    /// Clears reasons whose cause has been absent long enough.
    pub(crate) fn tick(&self) {
        let mut inner = self.inner.lock().expect("health");
        self.publish(&mut inner);
    }

    fn publish(&self, inner: &mut Inner) {
        for (reason, cause) in &mut inner.causes {
            if cause.active && cause.good_since.is_some_and(|t| t.elapsed() >= HEAL_AFTER) {
                info!(reason = reason.as_str(), "healed");
                *cause = Cause::default();
            }
        }
        let snapshot = Snapshot {
            reasons: inner
                .causes
                .iter()
                .filter(|(_, c)| c.active)
                .map(|(r, _)| *r)
                .collect(),
            clock_offset_ms: inner.clock_offset_ms,
            certificate_not_after: inner.certificate_not_after,
        };
        self.published.send_if_modified(|current| {
            if *current == snapshot {
                return false;
            }
            *current = snapshot;
            true
        });
    }

    /// The plane's clock as this node reads it, corrected by every offset
    /// [`Health::clock_offset`] records: what certificate dates are judged
    /// on (the identity's renewal, the sessions' end, this health).
    pub(crate) fn plane_clock(&self) -> Arc<PlaneClock> {
        Arc::clone(&self.plane_clock)
    }

    /// Records a measured clock offset (this node minus the plane), in ms.
    pub(crate) fn clock_offset(&self, offset_ms: i64) {
        self.plane_clock.set_offset_ms(offset_ms);
        let limit = i64::try_from(CLOCK_OFFSET_LIMIT.as_millis()).unwrap_or(i64::MAX);
        {
            let mut inner = self.inner.lock().expect("health");
            if inner.clock_offset_ms != Some(offset_ms) {
                inner.clock_offset_ms = Some(offset_ms);
                self.publish(&mut inner);
            }
        }
        if offset_ms.abs() > limit {
            self.observe(Reason::ClockOffset, true);
        } else if offset_ms.abs() < limit / 2 {
            self.observe(Reason::ClockOffset, false);
        }
    }

    /// Records the certificate the node serves now (`not_before`,
    /// `not_after`), judged against the plane's clock ([`Health::plane_clock`]:
    /// the plane is who refuses an expired one).
    pub(crate) fn certificate(
        &self,
        not_before: Option<SystemTime>,
        not_after: Option<SystemTime>,
    ) {
        {
            let mut inner = self.inner.lock().expect("health");
            inner.certificate_not_after = not_after;
            self.publish(&mut inner);
        }
        let Some(not_after) = not_after else {
            return;
        };
        let now = self.plane_clock.now();
        let expired = now >= not_after;
        let left = not_after.duration_since(now).unwrap_or_default();
        let lifetime = not_before
            .and_then(|b| not_after.duration_since(b).ok())
            .unwrap_or(Duration::from_secs(86_400 * 6));
        let soon = (lifetime / 6).min(Duration::from_secs(86_400));
        self.observe(Reason::IdentityExpired, expired);
        self.observe(Reason::IdentityExpiring, !expired && left <= soon);
    }

    /// Records that a message from the plane arrived now.
    pub(crate) fn contact(&self) {
        self.inner.lock().expect("health").last_contact = Some(Instant::now());
    }

    /// How long ago the plane last spoke; `None` if it never has.
    pub(crate) fn contact_age(&self) -> Option<Duration> {
        self.inner
            .lock()
            .expect("health")
            .last_contact
            .map(|t| t.elapsed())
    }

    /// The current state.
    pub(crate) fn snapshot(&self) -> Snapshot {
        self.published.borrow().clone()
    }

    /// Watches the state.
    pub(crate) fn subscribe(&self) -> watch::Receiver<Snapshot> {
        self.published.subscribe()
    }

    /// Why a launch would be refused now, judged on what is known without
    /// probing anything; `None` while healthy. A launch that passes asks
    /// the provider about its image before anything is minted (that check,
    /// which feeds this state through [`WatchedProvider`], is the launch's
    /// fresh probe of the engine, so a launch arriving in the first moments
    /// of an outage mints nothing without a list of its own).
    pub(crate) fn refusal(&self) -> Option<Refusal> {
        let snapshot = self.snapshot();
        snapshot.degraded().then(|| Refusal {
            exhausted: snapshot.reasons.contains(&Reason::DiskLow),
            reasons: snapshot.reasons,
        })
    }

    async fn probe_provider(&self, provider: &dyn Provider, timeout: Duration) {
        let outcome = match tokio::time::timeout(timeout, provider.list()).await {
            Err(_) => Err(ProviderError::Timeout {
                operation: "list (health probe)".into(),
                after: timeout,
            }),
            Ok(r) => r.map(|_| ()),
        };
        if let Err(e) = &outcome
            && answered(&outcome).is_none()
        {
            warn!(error = %e, "the provider probe failed");
        }
        self.provider_outcome(&outcome);
    }

    /// Feeds one provider call's outcome: a timeout raises
    /// [`Reason::ProviderStuck`], an unreachable engine
    /// [`Reason::ProviderUnreachable`]; any answer (an error the engine
    /// gave included) is evidence against both.
    pub(crate) fn provider_outcome<T>(&self, outcome: &Result<T, ProviderError>) {
        match (answered(outcome), outcome) {
            (Some(()), _) => {
                self.observe(Reason::ProviderStuck, false);
                self.observe(Reason::ProviderUnreachable, false);
            }
            (None, Err(ProviderError::Timeout { .. })) => {
                self.observe(Reason::ProviderStuck, true);
            }
            (None, _) => self.observe(Reason::ProviderUnreachable, true),
        }
    }

    /// Runs the checks until `cancel`: the provider probe, the state
    /// directory's free space against `min_free_disk_bytes`, the
    /// certificate in force (`certificate`, its validity window) and, every
    /// second, the command slot's progress and whether the journal's
    /// directory can be written ([`Health::probe_journal`]).
    pub(crate) fn watch(
        self: &Arc<Self>,
        state_dir: PathBuf,
        min_free_disk_bytes: u64,
        mut certificate: watch::Receiver<(Option<SystemTime>, Option<SystemTime>)>,
        cancel: CancellationToken,
    ) {
        let probe = self.probe.lock().expect("health probe").clone();
        if let Some(provider) = probe {
            let (this, cancel) = (Arc::clone(self), cancel.clone());
            tokio::spawn(
                async move {
                    loop {
                        this.probe_provider(provider.as_ref(), PROBE_TIMEOUT).await;
                        tokio::select! {
                            () = cancel.cancelled() => return,
                            () = tokio::time::sleep(PROBE_INTERVAL) => {}
                        }
                    }
                }
                .instrument(info_span!("provider_probe")),
            );
        }
        let this = Arc::clone(self);
        let slot = self.slot.lock().expect("health slot").clone();
        tokio::spawn(
            async move {
                loop {
                    if let Some(slot) = &slot {
                        this.slot_progress(slot.busy_for());
                    }
                    this.probe_journal(&state_dir).await;
                    match free_bytes(&state_dir) {
                        Ok(free) => this.observe(Reason::DiskLow, free < min_free_disk_bytes),
                        Err(e) => warn!(dir = %state_dir.display(), error = %e, "cannot read the state directory's free space"),
                    }
                    let (not_before, not_after) = *certificate.borrow_and_update();
                    this.certificate(not_before, not_after);
                    this.tick();
                    tokio::select! {
                        () = cancel.cancelled() => return,
                        () = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = certificate.changed() => {}
                    }
                }
            }
            .instrument(info_span!("health")),
        );
    }
}

/// `Some` when the engine answered (successfully or with its own error),
/// `None` when it could not be reached or did not answer in time.
fn answered<T>(outcome: &Result<T, ProviderError>) -> Option<()> {
    match outcome {
        Err(ProviderError::Timeout { .. } | ProviderError::Unreachable { .. }) => None,
        _ => Some(()),
    }
}

/// Bytes available to this process on the file system holding `dir`.
///
/// # Errors
///
/// The `statvfs` failure.
pub(crate) fn free_bytes(dir: &std::path::Path) -> std::io::Result<u64> {
    let stat = nix::sys::statvfs::statvfs(dir).map_err(std::io::Error::from)?;
    #[allow(
        clippy::useless_conversion,
        reason = "the field types differ by platform"
    )]
    Ok(u64::from(stat.blocks_available()).saturating_mul(u64::from(stat.fragment_size())))
}

/// A log line's rate limit, for a failure that repeats on every tick (a
/// journal that cannot be written): the first occurrence is logged, then at
/// most one per `every`; those in between are counted, and the next line
/// logged carries how many were suppressed.
#[derive(Debug)]
pub(crate) struct LogLimit {
    every: Duration,
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogLimit {
    /// At most one line per `every`.
    pub(crate) fn new(every: Duration) -> Self {
        Self {
            every,
            state: Mutex::new((None, 0)),
        }
    }

    /// `Some(suppressed)` when this occurrence is to be logged (with the
    /// count suppressed since the last line logged), `None` when it is
    /// counted instead.
    pub(crate) fn admit(&self) -> Option<u64> {
        let mut state = self.state.lock().expect("log limit");
        let (last, suppressed) = &mut *state;
        if last.is_some_and(|t| t.elapsed() < self.every) {
            *suppressed += 1;
            return None;
        }
        *last = Some(Instant::now());
        Some(std::mem::take(suppressed))
    }
}

impl Default for LogLimit {
    fn default() -> Self {
        Self::new(REPEATED_FAILURE_LOG_EVERY)
    }
}

/// Writes, syncs and removes a small file ([`JOURNAL_PROBE_FILE`]) in
/// `dir`: whether the journal's directory takes a write that needs a fresh
/// block now (a full file system, a read-only remount, an I/O error fail
/// it), without touching the journal itself.
///
/// # Errors
///
/// The failed step's I/O error.
pub(crate) fn probe_writable(dir: &std::path::Path) -> std::io::Result<()> {
    use std::io::Write as _;
    let path = dir.join(JOURNAL_PROBE_FILE);
    let written = (|| {
        let mut file = std::fs::File::create(&path)?;
        // One page: a file system with no free block refuses it.
        file.write_all(&[0u8; 4096])?;
        file.sync_all()
    })();
    let removed = std::fs::remove_file(&path);
    written?;
    removed
}

/// A provider whose every call is bounded by a watchdog timeout and whose
/// outcomes feed [`Health`]: a call that times out raises
/// [`Reason::ProviderStuck`] and fails as an engine error (for `create`,
/// which proves nothing about what started, the runner's failed-launch path
/// then looks for a stray instance); a successful call is evidence the
/// engine answers.
#[derive(Debug)]
pub(crate) struct WatchedProvider {
    inner: Arc<dyn Provider>,
    health: Arc<Health>,
    call_timeout: Duration,
    create_timeout: Duration,
}

impl WatchedProvider {
    /// Wraps `inner` with the default bounds.
    pub(crate) fn new(inner: Arc<dyn Provider>, health: Arc<Health>) -> Self {
        Self {
            inner,
            health,
            call_timeout: CALL_TIMEOUT,
            create_timeout: CREATE_TIMEOUT,
        }
    }

    /// Other bounds, for tests.
    #[cfg(test)]
    pub(crate) fn with_timeouts(mut self, call: Duration, create: Duration) -> Self {
        self.call_timeout = call;
        self.create_timeout = create;
        self
    }

    async fn bounded<T>(
        &self,
        operation: String,
        timeout: Duration,
        call: impl std::future::Future<Output = Result<T, ProviderError>>,
    ) -> Result<T, ProviderError> {
        let outcome = match tokio::time::timeout(timeout, call).await {
            Err(_) => Err(ProviderError::Timeout {
                operation,
                after: timeout,
            }),
            Ok(outcome) => outcome,
        };
        self.health.provider_outcome(&outcome);
        outcome
    }
}

#[async_trait]
impl Provider for WatchedProvider {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn runs_on_host(&self) -> bool {
        self.inner.runs_on_host()
    }

    async fn check_image(&self, image: &str) -> Result<ImageFacts, ProviderError> {
        self.bounded(
            format!("check image {image}"),
            LAUNCH_PROBE_TIMEOUT,
            self.inner.check_image(image),
        )
        .await
    }

    async fn output_tail(&self, name: &InstanceName) -> Result<String, ProviderError> {
        self.bounded(
            format!("read the output of {name}"),
            LAUNCH_PROBE_TIMEOUT,
            self.inner.output_tail(name),
        )
        .await
    }

    async fn shape(&self, vcpu: u32, memory: ByteSize) -> Result<(u32, ByteSize), ProviderError> {
        self.bounded(
            "read the engine's CPU count".to_owned(),
            LAUNCH_PROBE_TIMEOUT,
            self.inner.shape(vcpu, memory),
        )
        .await
    }

    async fn create_then_start(
        &self,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: crate::provider::StartGate,
    ) -> Result<Instance, ProviderError> {
        // The bound includes the wait for `start`: a launch opens it once
        // its bind (a plane call bounded by `plane::CALL_TIMEOUT`, 30 s)
        // and its launch record have passed, well inside the create's 180 s,
        // so a slow plane is not read as a stuck engine.
        let operation = format!("create {}", spec.name);
        self.bounded(
            operation,
            self.create_timeout,
            self.inner.create_then_start(spec, created, start),
        )
        .await
    }

    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError> {
        self.bounded(
            format!("destroy {name}"),
            self.call_timeout,
            self.inner.destroy(name),
        )
        .await
    }

    async fn stop(&self, name: &InstanceName, timeout: Duration) -> Result<(), ProviderError> {
        self.bounded(
            format!("stop {name}"),
            self.call_timeout + timeout,
            self.inner.stop(name, timeout),
        )
        .await
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        self.bounded("list".into(), self.call_timeout, self.inner.list())
            .await
    }

    async fn find(&self, name: &InstanceName) -> Result<Option<Instance>, ProviderError> {
        self.bounded(
            format!("find {name}"),
            self.call_timeout,
            self.inner.find(name),
        )
        .await
    }

    async fn work(&self, name: &InstanceName) -> Result<Work, ProviderError> {
        self.bounded(
            format!("read the processes of {name}"),
            self.call_timeout,
            self.inner.work(name),
        )
        .await
    }

    async fn create_warm(
        &self,
        spec: crate::provider::WarmSpec,
    ) -> Result<Instance, ProviderError> {
        self.bounded(
            format!("create {}", spec.name),
            self.create_timeout,
            self.inner.create_warm(spec),
        )
        .await
    }

    async fn list_warm(&self) -> Result<Vec<Instance>, ProviderError> {
        self.bounded(
            "list warm runners".into(),
            self.call_timeout,
            self.inner.list_warm(),
        )
        .await
    }

    async fn claim_warm(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: crate::provider::StartGate,
    ) -> Result<Instance, ProviderError> {
        // Bounded as a create: the wait for `start` is the bind's.
        self.bounded(
            format!("claim {warm} as {}", spec.name),
            self.create_timeout,
            self.inner.claim_warm(warm, spec, created, start),
        )
        .await
    }
}

/// A journal whose write failures raise [`Reason::JournalUnwritable`] and
/// whose successful writes are evidence it heals.
#[derive(Debug)]
pub(crate) struct WatchedJournal {
    inner: Arc<dyn Journal>,
    health: Arc<Health>,
}

impl WatchedJournal {
    /// Wraps `inner`.
    pub(crate) fn new(inner: Arc<dyn Journal>, health: Arc<Health>) -> Self {
        Self { inner, health }
    }

    fn wrote(&self, r: Result<(), JournalError>) -> Result<(), JournalError> {
        self.health.observe(Reason::JournalUnwritable, r.is_err());
        r
    }
}

#[async_trait]
impl Journal for WatchedJournal {
    async fn put_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        self.wrote(self.inner.put_launch(launch).await)
    }
    async fn amend_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        self.wrote(self.inner.amend_launch(launch).await)
    }
    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        self.wrote(self.inner.forget_launch(lease).await)
    }
    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        self.inner.launches().await
    }
    async fn put_custody(&self, entry: &CustodyRecord) -> Result<(), JournalError> {
        self.wrote(self.inner.put_custody(entry).await)
    }
    async fn put_custody_all(&self, entries: &[CustodyRecord]) -> Result<(), JournalError> {
        self.wrote(self.inner.put_custody_all(entries).await)
    }
    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        self.wrote(self.inner.forget_custody(lease).await)
    }
    async fn custody(&self) -> Result<Vec<CustodyRecord>, JournalError> {
        self.inner.custody().await
    }
    async fn put_result(
        &self,
        command: &str,
        encoded: &[u8],
        durability: Durability,
    ) -> Result<(), JournalError> {
        self.wrote(self.inner.put_result(command, encoded, durability).await)
    }
    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        self.inner.results().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fake::{FakeProvider, Operation};

    #[tokio::test(start_paused = true)]
    async fn a_reason_is_raised_at_once_and_clears_only_after_its_cause_stayed_away() {
        let health = Health::new();
        health.observe(Reason::DiskLow, true);
        assert_eq!(health.snapshot().reasons, [Reason::DiskLow]);
        health.observe(Reason::DiskLow, false);
        tokio::time::advance(HEAL_AFTER / 2).await;
        health.tick();
        assert!(health.snapshot().degraded(), "healed before the hysteresis");
        // A relapse restarts the wait.
        health.observe(Reason::DiskLow, true);
        health.observe(Reason::DiskLow, false);
        tokio::time::advance(HEAL_AFTER / 2 + Duration::from_millis(1)).await;
        health.tick();
        assert!(
            health.snapshot().degraded(),
            "a relapse did not restart the wait"
        );
        tokio::time::advance(HEAL_AFTER).await;
        health.tick();
        assert!(!health.snapshot().degraded(), "never healed");
    }

    #[tokio::test(start_paused = true)]
    async fn a_clock_offset_degrades_past_the_limit_and_clears_only_well_below_it() {
        let health = Health::new();
        let limit = i64::try_from(CLOCK_OFFSET_LIMIT.as_millis()).expect("ms");
        health.clock_offset(300_000);
        assert!(
            !health.snapshot().degraded(),
            "five minutes off is not degraded"
        );
        health.clock_offset(-limit - 1);
        assert_eq!(health.snapshot().reasons, [Reason::ClockOffset]);
        assert_eq!(health.snapshot().clock_offset_ms, Some(-limit - 1));
        health.clock_offset(limit * 3 / 4);
        tokio::time::advance(HEAL_AFTER * 2).await;
        health.tick();
        assert!(
            health.snapshot().degraded(),
            "cleared between the thresholds"
        );
        health.clock_offset(1_000);
        tokio::time::advance(HEAL_AFTER).await;
        health.tick();
        assert!(!health.snapshot().degraded());
    }

    #[tokio::test]
    async fn an_expired_or_nearly_expired_certificate_is_a_reason() {
        let health = Health::new();
        let now = SystemTime::now();
        let hour = Duration::from_secs(3600);
        health.certificate(Some(now - 10 * hour), Some(now + 10 * hour));
        assert!(!health.snapshot().degraded());
        health.certificate(Some(now - 10 * hour), Some(now + hour));
        assert_eq!(health.snapshot().reasons, [Reason::IdentityExpiring]);
        health.certificate(Some(now - 10 * hour), Some(now - hour));
        assert!(health.snapshot().reasons.contains(&Reason::IdentityExpired));
    }

    #[tokio::test]
    async fn a_launch_is_refused_typed_while_degraded_and_a_full_disk_is_exhaustion() {
        let health = Health::new().with_probe(Arc::new(FakeProvider::new()));
        assert_eq!(health.refusal(), None);
        health.observe(Reason::JournalUnwritable, true);
        let refusal = health.refusal().expect("refused");
        assert!(!refusal.exhausted);
        health.observe(Reason::DiskLow, true);
        let refusal = health.refusal().expect("refused");
        assert!(refusal.exhausted, "{refusal}");
    }

    #[tokio::test(start_paused = true)]
    async fn a_command_holding_the_slot_past_its_bound_degrades_until_the_slot_moves() {
        let health = Health::new();
        health.slot_progress(None);
        health.slot_progress(Some(SLOT_STUCK_AFTER));
        assert!(!health.snapshot().degraded(), "stuck at the bound itself");
        health.slot_progress(Some(SLOT_STUCK_AFTER + Duration::from_secs(1)));
        assert_eq!(health.snapshot().reasons, [Reason::SlotStuck]);
        let refusal = health.refusal().expect("refused");
        assert!(!refusal.exhausted, "a stuck slot is not exhaustion");
        // The command ends; the slot moves again: healed after the wait.
        health.slot_progress(None);
        health.slot_progress(Some(Duration::from_secs(1)));
        tokio::time::advance(HEAL_AFTER).await;
        health.tick();
        assert!(!health.snapshot().degraded());
    }

    #[tokio::test]
    async fn the_journal_probe_raises_and_clears_journal_unwritable_by_observation() {
        let health = Health::new();
        let dir = std::env::temp_dir().join(format!("billet-probe-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        // A directory that cannot be written (here: gone) fails the probe.
        health.probe_journal(&dir).await;
        assert_eq!(health.snapshot().reasons, [Reason::JournalUnwritable]);
        std::fs::create_dir_all(&dir).expect("dir");
        health.probe_journal(&dir).await;
        assert!(
            health.snapshot().degraded(),
            "cleared before the hysteresis"
        );
        assert!(
            !dir.join(JOURNAL_PROBE_FILE).exists(),
            "the probe left its file"
        );
        // Clears HEAL_AFTER after the first good probe.
        {
            let mut inner = health.inner.lock().expect("health");
            let cause = inner
                .causes
                .get_mut(&Reason::JournalUnwritable)
                .expect("cause");
            cause.good_since = cause.good_since.map(|t| t - HEAL_AFTER);
        }
        health.probe_journal(&dir).await;
        assert!(!health.snapshot().degraded());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(start_paused = true)]
    async fn a_repeated_failure_is_logged_once_per_window_with_the_count_suppressed() {
        let limit = LogLimit::new(Duration::from_secs(60));
        assert_eq!(limit.admit(), Some(0), "the first is logged");
        for _ in 0..59 {
            tokio::time::advance(Duration::from_secs(1)).await;
            assert_eq!(limit.admit(), None);
        }
        tokio::time::advance(Duration::from_secs(1)).await;
        assert_eq!(limit.admit(), Some(59), "the next line says what it hid");
        assert_eq!(limit.admit(), None);
    }

    #[tokio::test(start_paused = true)]
    async fn a_provider_call_that_never_answers_is_cut_by_the_watchdog_and_degrades_the_node() {
        let fake = Arc::new(FakeProvider::new());
        let health = Arc::new(Health::new());
        let watched = WatchedProvider::new(fake.clone(), health.clone())
            .with_timeouts(Duration::from_secs(1), Duration::from_secs(1));
        fake.block(Operation::List);
        let listed = watched.list().await;
        assert!(listed.is_err(), "the watchdog let a stuck call through");
        assert_eq!(health.snapshot().reasons, [Reason::ProviderStuck]);
        fake.unblock(Operation::List);
        watched.list().await.expect("answers again");
        tokio::time::advance(HEAL_AFTER).await;
        health.tick();
        assert!(!health.snapshot().degraded());
    }
}
