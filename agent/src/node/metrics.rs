//! The node's metrics, in the Prometheus text format 0.0.4 or OpenMetrics
//! text 1.0 as the scraper asks ([`Exposition`], `prometheus-client`),
//! served on an opt-in HTTP listener (`--metrics-listen`, [`serve`]) at
//! `/metrics`.
//!
//! [`Metrics`] registers its families in a [`Registry`] it is given (no
//! globals). It is fed three ways: decorators at the seams
//! ([`MeteredProvider`], [`MeteredPlane`], [`MeteredJournal`]) time every
//! call; the command slot reports queue waits and each command's outcome
//! and duration; a [`Scrape`] closure reads the runner's state (leases held,
//! custody) when Prometheus scrapes. Hooks other subsystems set:
//! [`Metrics::set_degraded`], [`Metrics::set_clock_offset_seconds`],
//! [`Metrics::set_certificate_expiry`].
//!
//! Names carry their unit (`_seconds`, `_timestamp_seconds`); counters end
//! in `_total` (added by the encoder). No label ever holds a credential:
//! labels are command kinds, outcomes, error codes, call names, and reasons
//! from a closed vocabulary.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use async_trait::async_trait;
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::metrics::info::Info;
use prometheus_client::registry::Registry;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tracing::debug;

use crate::journal::{CustodyRecord, Durability, Journal, JournalError, LaunchRecord};
use crate::model::Registration;
use crate::model::{ByteSize, Epoch, InstanceName, Lease, LeaseId, Phase};
use crate::node::plane::{JitSource, LaunchedSet, LeaseStore, PlaneError};
use crate::node::runner::HeldLease;
use crate::provider::{
    ImageFacts, Instance, InstanceSpec, Provider, ProviderError, Teardown, Work,
};

/// The two text expositions the endpoint serves.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Exposition {
    /// The Prometheus text format 0.0.4: what `promtool check metrics` and
    /// every text scraper read. `billet_build_info` is a gauge here, and
    /// there is no `# EOF`.
    Text,
    /// OpenMetrics text 1.0, which Prometheus asks for first.
    OpenMetrics,
}

impl Exposition {
    /// Chooses by the request's `Accept` header: OpenMetrics only when the
    /// client names `application/openmetrics-text` with a quality above 0
    /// and at least that of any other type it names; otherwise (no header,
    /// `*/*`, `text/plain`, anything unparsable) the text format, which
    /// every scraper reads.
    fn negotiate(accept: Option<&str>) -> Self {
        let Some(accept) = accept else {
            return Self::Text;
        };
        let (mut openmetrics, mut other) = (0.0_f64, 0.0_f64);
        for range in accept.split(',') {
            let mut parts = range.split(';');
            let media = parts.next().unwrap_or("").trim().to_ascii_lowercase();
            let quality = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .map_or(Some(1.0), |(_, v)| v.trim().parse::<f64>().ok())
                .unwrap_or(0.0);
            if media == "application/openmetrics-text" {
                openmetrics = openmetrics.max(quality);
            } else {
                other = other.max(quality);
            }
        }
        if openmetrics > 0.0 && openmetrics >= other {
            Self::OpenMetrics
        } else {
            Self::Text
        }
    }

    fn content_type(self) -> &'static str {
        match self {
            Self::Text => prometheus_client::encoding::prometheus_text::CONTENT_TYPE,
            Self::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
        }
    }

    fn encode(self, registry: &Registry) -> Result<String, std::fmt::Error> {
        let mut body = String::new();
        match self {
            Self::Text => {
                prometheus_client::encoding::prometheus_text::encode(&mut body, registry)?
            }
            Self::OpenMetrics => prometheus_client::encoding::text::encode(&mut body, registry)?,
        }
        Ok(body)
    }
}

type FloatGauge = Gauge<f64, AtomicU64>;
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

/// Latency buckets: 1 ms to about 65 s.
fn latency() -> Histogram {
    Histogram::new(exponential_buckets(0.001, 2.0, 17))
}

/// A lease's place on this node, as a label.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabel {
    state: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CommandLabels {
    kind: &'static str,
    outcome: String,
    reason: String,
}

/// What the node-local cache did with a disk or a commit.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheEventLabel {
    event: &'static str,
}

/// The events [`Metrics::set_cache_totals`] reports, always all of them.
pub(crate) const CACHE_EVENTS: [&str; 4] = ["hit", "miss", "conflict", "fallback"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabel {
    kind: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StepLabel {
    step: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallLabel {
    call: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CallErrorLabels {
    call: &'static str,
    code: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabel {
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabel {
    reason: String,
}

/// A lease's end: its class and reason, both from
/// [`billet_proto::ending`]'s closed sets.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct EndLabels {
    class: &'static str,
    reason: &'static str,
}

/// A tier the node refuses after consecutive start failures. Tier labels
/// come from the plane's configuration, a set its operator bounds, and a
/// tier is labelled only while it is unhealthy.
#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct TierLabel {
    tier: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct BuildLabels {
    version: String,
    commit: String,
}

/// The node's metric families. Cheap to share behind an `Arc`; every method
/// takes `&self`.
#[derive(Debug)]
pub(crate) struct Metrics {
    leases_held: Family<StateLabel, Gauge>,
    warm_runners: Family<StateLabel, Gauge>,
    warm_claims: Counter,
    images_refused: Gauge,
    custody_entries: Gauge,
    custody_oldest_age: FloatGauge,
    commands: Family<CommandLabels, Counter>,
    command_duration: Histograms<KindLabel>,
    launch_steps: Histograms<StepLabel>,
    queue_depth: Gauge,
    queue_wait: Histograms<KindLabel>,
    plane_calls: Histograms<CallLabel>,
    plane_errors: Family<CallErrorLabels, Counter>,
    plane_last_contact: FloatGauge,
    provider_calls: Histograms<CallLabel>,
    provider_errors: Family<CallLabel, Counter>,
    journal_writes: Histograms<CallLabel>,
    journal_errors: Family<CallLabel, Counter>,
    degraded: Family<ReasonLabel, Gauge>,
    clock_offset: FloatGauge,
    certificate_expiry: FloatGauge,
    certificate_remaining: FloatGauge,
    certificate_renewals: Family<OutcomeLabel, Counter>,
    cache_events: Family<CacheEventLabel, Counter>,
    cache_restored_bytes: Counter,
    cache_committed_bytes: Counter,
    cache_evicted_generations: Counter,
    cache_evicted_archives: Counter,
    cache_evicted_bytes: Counter,
    lease_ends: Family<EndLabels, Counter>,
    tiers_unhealthy: Family<TierLabel, Gauge>,
}

/// Raises a counter that mirrors a sum kept elsewhere to `to`; a smaller
/// reading is ignored, so the counter never goes back.
fn raise_to(counter: &Counter, to: u64) {
    let now = counter.get();
    if to > now {
        counter.inc_by(to - now);
    }
}

/// Every call [`MeteredProvider`] names: each has its error series from the
/// start, at zero.
const PROVIDER_CALLS: [&str; 12] = [
    "check_image",
    "output_tail",
    "shape",
    "create",
    "destroy",
    "stop",
    "list",
    "find",
    "work",
    "create_warm",
    "list_warm",
    "claim_warm",
];

/// Every call [`MeteredPlane`] names.
const PLANE_CALLS: [&str; 14] = [
    "bind",
    "advance",
    "bind_advance",
    "resize",
    "record_cache_observation",
    "actions_policy",
    "heartbeat",
    "release",
    "mark_failure",
    "lease",
    "launched",
    "reconcile",
    "mint",
    "remove_runner",
];

/// Every code [`plane_code`] answers. Every call has a series per code
/// from the start, so `increase()` sees a call's first error of a kind: a
/// counter series born at 1 shows no increase.
const PLANE_CODES: [&str; 11] = [
    "fenced",
    "not_found",
    "bad_transition",
    "wrong_node",
    "unavailable",
    "force_release",
    "refused",
    "scale_set_not_found",
    "runner_name_taken",
    "busy",
    "identity_refused",
];

/// Every write [`MeteredJournal`] names.
const JOURNAL_WRITES: [&str; 7] = [
    "put_launch",
    "amend_launch",
    "forget_launch",
    "put_custody",
    "forget_custody",
    "put_result",
    "put_result_committed",
];

/// Every outcome [`Metrics::certificate_renewal`] counts.
const RENEWAL_OUTCOMES: [&str; 4] = ["renewed", "enrolled", "refused", "failed"];

/// The lease states [`Metrics::set_leases`] reports, always all of them (a
/// state with no lease reads 0, not absent).
pub(crate) const LEASE_STATES: [&str; 6] = [
    "launching",
    "running",
    "custody",
    "quarantine",
    "discard",
    "ending",
];

impl Metrics {
    /// Registers every family in `registry` (names prefixed `billet_`),
    /// with the build's version and commit as `billet_build_info`.
    pub(crate) fn new(registry: &mut Registry, version: &str, commit: &str) -> Self {
        let m = Self {
            leases_held: Family::default(),
            warm_runners: Family::default(),
            warm_claims: Counter::default(),
            images_refused: Gauge::default(),
            custody_entries: Gauge::default(),
            custody_oldest_age: FloatGauge::default(),
            commands: Family::default(),
            command_duration: Family::new_with_constructor(latency),
            launch_steps: Family::new_with_constructor(latency),
            queue_depth: Gauge::default(),
            queue_wait: Family::new_with_constructor(latency),
            plane_calls: Family::new_with_constructor(latency),
            plane_errors: Family::default(),
            plane_last_contact: FloatGauge::default(),
            provider_calls: Family::new_with_constructor(latency),
            provider_errors: Family::default(),
            journal_writes: Family::new_with_constructor(latency),
            journal_errors: Family::default(),
            degraded: Family::default(),
            clock_offset: FloatGauge::default(),
            certificate_expiry: FloatGauge::default(),
            certificate_remaining: FloatGauge::default(),
            certificate_renewals: Family::default(),
            cache_events: Family::default(),
            cache_restored_bytes: Counter::default(),
            cache_committed_bytes: Counter::default(),
            cache_evicted_generations: Counter::default(),
            cache_evicted_archives: Counter::default(),
            cache_evicted_bytes: Counter::default(),
            lease_ends: Family::default(),
            tiers_unhealthy: Family::default(),
        };
        let r = registry.sub_registry_with_prefix("billet");
        r.register(
            "build",
            "The running release: version and commit",
            Info::new(BuildLabels {
                version: version.to_owned(),
                commit: commit.to_owned(),
            }),
        );
        r.register(
            "leases_held",
            "Leases this node holds, by state (launching, running, custody, quarantine, discard)",
            m.leases_held.clone(),
        );
        r.register(
            "warm_runners",
            "Warm runners (started ahead of their jobs), by state: ready, starting, and wanted as the plane said",
            m.warm_runners.clone(),
        );
        r.register(
            "warm_claims",
            "Launches handed to a warm runner instead of creating one",
            m.warm_claims.clone(),
        );
        r.register(
            "runner_images_refused",
            "Images this node refuses to launch for their runner's version (labelled older than the minimum, or refused by GitHub)",
            m.images_refused.clone(),
        );
        r.register(
            "custody_entries",
            "Leases held in node custody",
            m.custody_entries.clone(),
        );
        r.register(
            "custody_oldest_age_seconds",
            "Age of the oldest custody entry, 0 when there is none",
            m.custody_oldest_age.clone(),
        );
        r.register(
            "commands",
            "Commands run, by kind (launch, destroy, ...), outcome and reason (the error code)",
            m.commands.clone(),
        );
        r.register(
            "command_duration_seconds",
            "How long a command ran, by kind (launch is the whole launch)",
            m.command_duration.clone(),
        );
        r.register(
            "launch_step_duration_seconds",
            "The parts of a launch: bind, advance (to launching), mint (the JIT config), create (the instance, started), created (until the instance exists, before its start)",
            m.launch_steps.clone(),
        );
        r.register(
            "command_queue_depth",
            "Commands waiting for the slot",
            m.queue_depth.clone(),
        );
        r.register(
            "command_queue_wait_seconds",
            "How long a command waited for the slot, by command kind",
            m.queue_wait.clone(),
        );
        r.register(
            "plane_call_duration_seconds",
            "Round trip of a call up the session to the plane, by call",
            m.plane_calls.clone(),
        );
        r.register(
            "plane_call_errors",
            "Calls to the plane that failed, by call and code",
            m.plane_errors.clone(),
        );
        r.register(
            "plane_last_contact_timestamp_seconds",
            "When the plane last sent a command or answered a call (unix seconds), 0 before it ever did",
            m.plane_last_contact.clone(),
        );
        r.register(
            "provider_call_duration_seconds",
            "Provider (Docker) call latency, by call",
            m.provider_calls.clone(),
        );
        r.register(
            "provider_call_errors",
            "Provider calls that failed, by call",
            m.provider_errors.clone(),
        );
        r.register(
            "journal_write_duration_seconds",
            "Node journal write latency, by write",
            m.journal_writes.clone(),
        );
        r.register(
            "journal_write_errors",
            "Node journal writes that failed, by write",
            m.journal_errors.clone(),
        );
        r.register(
            "degraded",
            "1 while the node is degraded for this reason, else 0",
            m.degraded.clone(),
        );
        r.register(
            "clock_offset_seconds",
            "This host's clock minus the plane's, as last measured",
            m.clock_offset.clone(),
        );
        r.register(
            "certificate_expiry_timestamp_seconds",
            "When the node's certificate in force expires (unix seconds)",
            m.certificate_expiry.clone(),
        );
        r.register(
            "certificate_remaining_seconds",
            "How long the node's certificate in force has left (negative once expired)",
            m.certificate_remaining.clone(),
        );
        r.register(
            "certificate_renewals",
            "Certificate renewals and enrolments, by outcome (renewed, enrolled, refused, failed)",
            m.certificate_renewals.clone(),
        );
        r.register(
            "cache_events",
            "What the node-local cache did: sticky disks mounted from a generation (hit), cold (miss) or as a fallback, and commits refused as a CAS conflict",
            m.cache_events.clone(),
        );
        r.register(
            "cache_restored_bytes",
            "Bytes cloned into jobs' sticky disks from the generations they hit (apparent size)",
            m.cache_restored_bytes.clone(),
        );
        r.register(
            "cache_committed_bytes",
            "Bytes published as new sticky-disk generations (apparent size)",
            m.cache_committed_bytes.clone(),
        );
        r.register(
            "cache_evicted_generations",
            "Sticky-disk generations removed by eviction (retention, superseded, or over --cache-max-bytes)",
            m.cache_evicted_generations.clone(),
        );
        r.register(
            "cache_evicted_archives",
            "Actions cache archives removed by eviction (retention, or over --cache-max-bytes)",
            m.cache_evicted_archives.clone(),
        );
        r.register(
            "cache_evicted_bytes",
            "Bytes freed on the cache directory's disk by eviction, generations and archives (allocated blocks)",
            m.cache_evicted_bytes.clone(),
        );
        r.register(
            "lease_ends",
            "Leases this node released, by the class and reason of their end (docs/lease-ends.md)",
            m.lease_ends.clone(),
        );
        r.register(
            "tier_unhealthy",
            "1 for each tier this node refuses after consecutive start failures, until a launch of it starts again",
            m.tiers_unhealthy.clone(),
        );
        for state in LEASE_STATES {
            m.leases_held.get_or_create(&StateLabel { state }).set(0);
        }
        for state in ["ready", "starting", "wanted"] {
            m.warm_runners.get_or_create(&StateLabel { state }).set(0);
        }
        for event in CACHE_EVENTS {
            m.cache_events
                .get_or_create(&CacheEventLabel { event })
                .inc_by(0);
        }
        // Every error family with a closed vocabulary has its series at
        // zero before the first error: a healthy node's error panels read
        // 0, not "No data", and the first error is an increase.
        for call in PROVIDER_CALLS {
            m.provider_errors
                .get_or_create(&CallLabel { call })
                .inc_by(0);
        }
        for call in PLANE_CALLS {
            for code in PLANE_CODES {
                m.plane_errors
                    .get_or_create(&CallErrorLabels { call, code })
                    .inc_by(0);
            }
        }
        for call in JOURNAL_WRITES {
            m.journal_errors
                .get_or_create(&CallLabel { call })
                .inc_by(0);
        }
        for outcome in RENEWAL_OUTCOMES {
            m.certificate_renewals
                .get_or_create(&OutcomeLabel { outcome })
                .inc_by(0);
        }
        m
    }

    /// Brings the cache counters up to `totals`, the cache store's sums
    /// since it opened ([`crate::cache::Store::totals`], read at each
    /// scrape). The store's sums only grow, so each counter gains the
    /// difference; a smaller reading is ignored.
    pub(crate) fn set_cache_totals(&self, totals: &crate::cache::Observation) {
        let raise = raise_to;
        for (event, n) in [
            ("hit", totals.hits),
            ("miss", totals.misses),
            ("conflict", totals.conflicts),
            ("fallback", totals.fallbacks),
        ] {
            raise(
                &self.cache_events.get_or_create(&CacheEventLabel { event }),
                n,
            );
        }
        raise(&self.cache_restored_bytes, totals.bytes_restored);
        raise(&self.cache_committed_bytes, totals.bytes_committed);
    }

    /// Brings the eviction counters up to `evicted`, the store's sums since
    /// it opened ([`crate::cache::Store::evicted`], read at each scrape);
    /// like [`Metrics::set_cache_totals`], a smaller reading is ignored.
    pub(crate) fn set_cache_evicted(&self, evicted: &crate::cache::Evicted) {
        raise_to(&self.cache_evicted_generations, evicted.generations);
        raise_to(&self.cache_evicted_archives, evicted.archives);
        raise_to(&self.cache_evicted_bytes, evicted.bytes);
    }

    /// Sets the warm pool's gauges and claim count, and the refused
    /// images' gauge, from one reading of each.
    pub(crate) fn observe_warm(
        &self,
        counts: Option<crate::node::warm::WarmCounts>,
        refused: usize,
    ) {
        let counts = counts.unwrap_or_default();
        for (state, n) in [
            ("ready", counts.ready),
            ("starting", counts.starting),
            ("wanted", counts.wanted),
        ] {
            self.warm_runners
                .get_or_create(&StateLabel { state })
                .set(i64::from(n));
        }
        raise_to(&self.warm_claims, counts.claimed);
        self.images_refused
            .set(i64::try_from(refused).unwrap_or(i64::MAX));
    }

    /// A lease was released with `ending`: counts its class and reason.
    pub(crate) fn lease_ended(&self, ending: &crate::node::ending::Ending) {
        let (code, _) = ending.code();
        self.lease_ends
            .get_or_create(&EndLabels {
                class: code.class().as_str(),
                reason: code.as_str(),
            })
            .inc();
    }

    /// Sets the unhealthy-tier gauge to exactly `tiers`: a tier no longer
    /// listed is dropped rather than kept at 0, so the label set stays
    /// what is unhealthy now.
    pub(crate) fn set_unhealthy_tiers(&self, tiers: &[String]) {
        self.tiers_unhealthy.clear();
        for tier in tiers {
            self.tiers_unhealthy
                .get_or_create(&TierLabel { tier: tier.clone() })
                .set(1);
        }
    }

    /// Sets the held-lease gauges from one reading of the runner's state:
    /// the count per state (states absent from `counts` read 0), and the
    /// custody entries and the oldest one's age.
    pub(crate) fn set_leases(
        &self,
        counts: &[(&'static str, i64)],
        custody: i64,
        oldest: Duration,
    ) {
        for state in LEASE_STATES {
            let n = counts
                .iter()
                .filter(|(s, _)| *s == state)
                .map(|(_, n)| n)
                .sum();
            self.leases_held.get_or_create(&StateLabel { state }).set(n);
        }
        self.custody_entries.set(custody);
        self.custody_oldest_age.set(oldest.as_secs_f64());
    }

    /// Sets the held-lease gauges from [`crate::node::runner::Runner::held`].
    pub(crate) fn observe_runner(&self, held: &[HeldLease]) {
        let mut counts: Vec<(&'static str, i64)> = Vec::new();
        let (mut custody, mut oldest) = (0, Duration::ZERO);
        for h in held {
            let state = h.state.as_str();
            match counts.iter_mut().find(|(s, _)| *s == state) {
                Some((_, n)) => *n += 1,
                None => counts.push((state, 1)),
            }
            if h.state.in_custody() {
                custody += 1;
                oldest = oldest.max(h.age.unwrap_or_default());
            }
        }
        self.set_leases(&counts, custody, oldest);
    }

    /// A command finished: `kind` as [`crate::model::NodeCommand::kind`]
    /// names it, its outcome and error code as the wire spells them (the
    /// proto enum names, lower case, without their prefix).
    pub(crate) fn command_done(
        &self,
        kind: &'static str,
        outcome: &str,
        reason: &str,
        took: Duration,
    ) {
        self.commands
            .get_or_create(&CommandLabels {
                kind,
                outcome: outcome.to_owned(),
                reason: reason.to_owned(),
            })
            .inc();
        self.command_duration
            .get_or_create(&KindLabel { kind })
            .observe(took.as_secs_f64());
    }

    /// A command of `kind` left the queue for the slot after waiting
    /// `waited`; `depth` still wait behind it.
    pub(crate) fn command_started(&self, kind: &'static str, waited: Duration, depth: usize) {
        self.queue_wait
            .get_or_create(&KindLabel { kind })
            .observe(waited.as_secs_f64());
        self.set_queue_depth(depth);
    }

    /// How many commands wait for the slot.
    pub(crate) fn set_queue_depth(&self, depth: usize) {
        self.queue_depth
            .set(i64::try_from(depth).unwrap_or(i64::MAX));
    }

    /// The plane was heard from now.
    pub(crate) fn plane_contact(&self) {
        self.plane_last_contact.set(unix_seconds(SystemTime::now()));
    }

    /// When the plane was last heard from, if ever.
    pub(crate) fn plane_contact_at(&self) -> Option<SystemTime> {
        let secs = self.plane_last_contact.get();
        (secs > 0.0).then(|| UNIX_EPOCH + Duration::from_secs_f64(secs))
    }

    /// Sets or clears one reason the node is degraded (`billet_degraded
    /// {reason}` 1 or 0). The health subsystem calls this; reasons are a
    /// closed vocabulary of its own.
    pub(crate) fn set_degraded(&self, reason: &str, degraded: bool) {
        self.degraded
            .get_or_create(&ReasonLabel {
                reason: reason.to_owned(),
            })
            .set(i64::from(degraded));
    }

    /// This host's clock minus the plane's, in seconds.
    pub(crate) fn set_clock_offset_seconds(&self, offset: f64) {
        self.clock_offset.set(offset);
    }

    /// When the certificate in force expires.
    /// Also sets the time it has left from `now`, the plane's clock as this
    /// node reads it ([`crate::clock::PlaneClock::now`]: the plane
    /// dates the certificate and judges it).
    pub(crate) fn set_certificate_expiry(&self, not_after: SystemTime, now: SystemTime) {
        self.certificate_expiry.set(unix_seconds(not_after));
        let left = match not_after.duration_since(now) {
            Ok(d) => d.as_secs_f64(),
            Err(e) => -e.duration().as_secs_f64(),
        };
        self.certificate_remaining.set(left);
    }

    /// A renewal or enrolment ended: `outcome` is one of `renewed`,
    /// `enrolled`, `refused` (the plane will not sign) or `failed` (no
    /// answer, or a certificate that did not verify).
    pub(crate) fn certificate_renewal(&self, outcome: &'static str) {
        debug_assert!(
            RENEWAL_OUTCOMES.contains(&outcome),
            "{outcome} is not in RENEWAL_OUTCOMES"
        );
        self.certificate_renewals
            .get_or_create(&OutcomeLabel { outcome })
            .inc();
    }

    fn plane_call(&self, call: &'static str, took: Duration, result: Result<(), &PlaneError>) {
        debug_assert!(PLANE_CALLS.contains(&call), "{call} is not in PLANE_CALLS");
        self.plane_calls
            .get_or_create(&CallLabel { call })
            .observe(took.as_secs_f64());
        match result {
            Ok(()) => self.plane_contact(),
            Err(e) => {
                if !matches!(e, PlaneError::Unavailable(_)) {
                    // The plane answered, with a refusal.
                    self.plane_contact();
                }
                self.plane_errors
                    .get_or_create(&CallErrorLabels {
                        call,
                        code: plane_code(e),
                    })
                    .inc();
            }
        }
    }

    fn step(&self, step: &'static str, took: Duration) {
        self.launch_steps
            .get_or_create(&StepLabel { step })
            .observe(took.as_secs_f64());
    }
}

fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn plane_code(e: &PlaneError) -> &'static str {
    match e {
        PlaneError::Fenced(_) => "fenced",
        PlaneError::NotFound(_) => "not_found",
        PlaneError::BadTransition(_) => "bad_transition",
        PlaneError::WrongNode(_) => "wrong_node",
        PlaneError::Unavailable(_) => "unavailable",
        PlaneError::ForceRelease(_) => "force_release",
        PlaneError::Refused(_) => "refused",
        PlaneError::ScaleSetNotFound(_) => "scale_set_not_found",
        PlaneError::RunnerNameTaken(_) => "runner_name_taken",
        PlaneError::Busy(_) => "busy",
        PlaneError::IdentityRefused(_) => "identity_refused",
    }
}

/// When the first certificate in the PEM file at `path` expires; `None`
/// when it cannot be read or parsed (the TLS watcher reports that).
pub fn certificate_expiry(path: &std::path::Path) -> Option<SystemTime> {
    let certs = crate::tls::load_certs(path).ok()?;
    let (_, cert) = x509_parser::parse_x509_certificate(certs.first()?.as_ref()).ok()?;
    let secs = u64::try_from(cert.validity().not_after.timestamp()).ok()?;
    Some(UNIX_EPOCH + Duration::from_secs(secs))
}

/// Reads the state the gauges show, just before each scrape is encoded.
pub(crate) type Scrape = Arc<dyn Fn(&Metrics) + Send + Sync>;

/// Most connections the metrics listener holds open at once
/// ([`crate::listen::ConnectionCap`]); past it the oldest is dropped.
/// A scraper needs one, and a scrape takes milliseconds, so one dialed into
/// a flood of idle connections is served long before it is the oldest.
pub(crate) const MAX_METRICS_CONNECTIONS: usize = 64;

/// Serves `GET /metrics` on `listener` until `shutdown`: `scrape` runs, then
/// `registry` is encoded. Any other path is 404. HTTP/1 only, one task per
/// connection, at most [`MAX_METRICS_CONNECTIONS`] open (the oldest dropped
/// for a newcomer); a failed accept backs off and is logged at a bounded
/// rate ([`crate::listen::AcceptErrors`]).
pub(crate) async fn serve(
    listener: TcpListener,
    registry: Arc<Registry>,
    metrics: Arc<Metrics>,
    scrape: Scrape,
    shutdown: CancellationToken,
) {
    use crate::listen::{AcceptErrors, AtCap, ConnectionCap};
    use http_body_util::Full;
    use hyper::body::Bytes;
    use hyper::{Request, Response, StatusCode};
    let cap = ConnectionCap::new("metrics", MAX_METRICS_CONNECTIONS, AtCap::DropOldest);
    let mut errors = AcceptErrors::new("metrics");
    loop {
        let stream = tokio::select! {
            () = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok((stream, _)) => stream,
                Err(e) => {
                    errors.back_off(&e).await;
                    continue;
                }
            },
        };
        errors.accepted();
        let Some(admitted) = cap.admit() else {
            continue;
        };
        let admitted = Arc::new(admitted);
        let (registry, metrics, scrape) = (registry.clone(), metrics.clone(), scrape.clone());
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let place = admitted.clone();
            let service = hyper::service::service_fn(move |req: Request<hyper::body::Incoming>| {
                let (registry, metrics, scrape) =
                    (registry.clone(), metrics.clone(), scrape.clone());
                // A scrape in progress is not dropped for a newcomer.
                let busy = place.busy();
                async move {
                    let _busy = busy;
                    if req.uri().path() == "/metrics" {
                        let exposition = Exposition::negotiate(
                            req.headers()
                                .get(hyper::header::ACCEPT)
                                .and_then(|v| v.to_str().ok()),
                        );
                        scrape(&metrics);
                        match exposition.encode(&registry) {
                            Ok(body) => Response::builder()
                                .header(hyper::header::CONTENT_TYPE, exposition.content_type())
                                .header(hyper::header::VARY, "accept")
                                .body(Full::new(Bytes::from(body))),
                            Err(_) => Response::builder()
                                .status(StatusCode::INTERNAL_SERVER_ERROR)
                                .body(Full::new(Bytes::from_static(b"cannot encode metrics\n"))),
                        }
                    } else {
                        Response::builder()
                            .status(StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"metrics are at /metrics\n")))
                    }
                }
            });
            let connection = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(Duration::from_secs(10))
                .serve_connection(hyper_util::rt::TokioIo::new(stream), service);
            tokio::select! {
                served = connection => if let Err(e) = served {
                    debug!(error = %e, "metrics connection ended");
                },
                () = admitted.dropped() => {}
                () = shutdown.cancelled() => {}
            }
        });
    }
}

fn timed<T, E>(start: Instant, result: &Result<T, E>) -> (Duration, bool) {
    (start.elapsed(), result.is_ok())
}

/// A [`Provider`] that times every call and counts its errors.
#[derive(Debug)]
pub(crate) struct MeteredProvider {
    inner: Arc<dyn Provider>,
    metrics: Arc<Metrics>,
}

impl MeteredProvider {
    /// Wraps `inner`.
    pub(crate) fn new(inner: Arc<dyn Provider>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    fn observe(&self, call: &'static str, took: Duration, ok: bool) {
        debug_assert!(
            PROVIDER_CALLS.contains(&call),
            "{call} is not in PROVIDER_CALLS"
        );
        self.metrics
            .provider_calls
            .get_or_create(&CallLabel { call })
            .observe(took.as_secs_f64());
        if !ok {
            self.metrics
                .provider_errors
                .get_or_create(&CallLabel { call })
                .inc();
        }
    }
}

#[async_trait]
impl Provider for MeteredProvider {
    fn kind(&self) -> &'static str {
        self.inner.kind()
    }

    fn runs_on_host(&self) -> bool {
        self.inner.runs_on_host()
    }

    async fn check_image(&self, image: &str) -> Result<ImageFacts, ProviderError> {
        let start = Instant::now();
        let r = self.inner.check_image(image).await;
        let (took, ok) = timed(start, &r);
        self.observe("check_image", took, ok);
        r
    }

    async fn output_tail(&self, name: &InstanceName) -> Result<String, ProviderError> {
        let start = Instant::now();
        let r = self.inner.output_tail(name).await;
        let (took, ok) = timed(start, &r);
        self.observe("output_tail", took, ok);
        r
    }

    async fn shape(&self, vcpu: u32, memory: ByteSize) -> Result<(u32, ByteSize), ProviderError> {
        let start = Instant::now();
        let r = self.inner.shape(vcpu, memory).await;
        let (took, ok) = timed(start, &r);
        self.observe("shape", took, ok);
        r
    }

    async fn create_then_start(
        &self,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        gate: crate::provider::StartGate,
    ) -> Result<Instance, ProviderError> {
        let start = Instant::now();
        // Passed on as soon as the instance exists, timed on the way.
        let (exists, existed) = tokio::sync::oneshot::channel();
        let forward = async {
            let at = existed.await.ok().map(|()| start.elapsed());
            if at.is_some() {
                let _ = created.send(());
            }
            at
        };
        let (r, created_after) =
            tokio::join!(self.inner.create_then_start(spec, exists, gate), forward);
        let (took, ok) = timed(start, &r);
        self.observe("create", took, ok);
        // The Docker provider's create also starts the container: `create`
        // is both, `created` until the instance exists.
        self.metrics.step("create", took);
        if let Some(at) = created_after {
            self.metrics.step("created", at);
        }
        r
    }

    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError> {
        let start = Instant::now();
        let r = self.inner.destroy(name).await;
        let (took, ok) = timed(start, &r);
        self.observe("destroy", took, ok);
        r
    }

    async fn stop(
        &self,
        name: &InstanceName,
        timeout: std::time::Duration,
    ) -> Result<(), ProviderError> {
        let start = Instant::now();
        let r = self.inner.stop(name, timeout).await;
        let (took, ok) = timed(start, &r);
        self.observe("stop", took, ok);
        r
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        let start = Instant::now();
        let r = self.inner.list().await;
        let (took, ok) = timed(start, &r);
        self.observe("list", took, ok);
        r
    }

    async fn find(&self, name: &InstanceName) -> Result<Option<Instance>, ProviderError> {
        let start = Instant::now();
        let r = self.inner.find(name).await;
        let (took, ok) = timed(start, &r);
        self.observe("find", took, ok);
        r
    }

    async fn work(&self, name: &InstanceName) -> Result<Work, ProviderError> {
        let start = Instant::now();
        let r = self.inner.work(name).await;
        let (took, ok) = timed(start, &r);
        self.observe("work", took, ok);
        r
    }

    async fn create_warm(
        &self,
        spec: crate::provider::WarmSpec,
    ) -> Result<Instance, ProviderError> {
        let start = Instant::now();
        let r = self.inner.create_warm(spec).await;
        let (took, ok) = timed(start, &r);
        self.observe("create_warm", took, ok);
        r
    }

    async fn list_warm(&self) -> Result<Vec<Instance>, ProviderError> {
        let start = Instant::now();
        let r = self.inner.list_warm().await;
        let (took, ok) = timed(start, &r);
        self.observe("list_warm", took, ok);
        r
    }

    async fn claim_warm(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        gate: crate::provider::StartGate,
    ) -> Result<Instance, ProviderError> {
        let start = Instant::now();
        let (exists, existed) = tokio::sync::oneshot::channel();
        let forward = async {
            let at = existed.await.ok().map(|()| start.elapsed());
            if at.is_some() {
                let _ = created.send(());
            }
            at
        };
        let (r, created_after) =
            tokio::join!(self.inner.claim_warm(warm, spec, exists, gate), forward);
        let (took, ok) = timed(start, &r);
        self.observe("claim_warm", took, ok);
        // A warm launch's `create` step is the claim: what stands on the
        // job's path where a cold launch creates and starts.
        self.metrics.step("create", took);
        if let Some(at) = created_after {
            self.metrics.step("created", at);
        }
        r
    }
}

/// The plane seams ([`LeaseStore`], [`JitSource`]) timed per call: each
/// call's round trip up the session, its errors by code, and the plane's
/// last contact. Bind, Advance(launching), BindAdvance(launching) and mint
/// also count as launch steps.
#[derive(Debug)]
pub(crate) struct MeteredPlane<P> {
    inner: Arc<P>,
    metrics: Arc<Metrics>,
}

impl<P> MeteredPlane<P> {
    /// Wraps `inner`.
    pub(crate) fn new(inner: Arc<P>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    fn observe<T>(
        &self,
        call: &'static str,
        start: Instant,
        r: &Result<T, PlaneError>,
    ) -> Duration {
        let took = start.elapsed();
        self.metrics.plane_call(call, took, r.as_ref().map(|_| ()));
        took
    }
}

#[async_trait]
impl<P: LeaseStore + 'static> LeaseStore for MeteredPlane<P> {
    async fn bind(&self, lease: &LeaseId, epoch: Epoch) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self.inner.bind(lease, epoch).await;
        let took = self.observe("bind", start, &r);
        self.metrics.step("bind", took);
        r
    }

    async fn advance(&self, lease: &LeaseId, epoch: Epoch, phase: Phase) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self.inner.advance(lease, epoch, phase).await;
        let took = self.observe("advance", start, &r);
        if phase == Phase::Launching {
            self.metrics.step("advance", took);
        }
        r
    }

    async fn bind_advance(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        phase: Phase,
    ) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self.inner.bind_advance(lease, epoch, phase).await;
        let took = self.observe("bind_advance", start, &r);
        if phase == Phase::Launching {
            self.metrics.step("bind_advance", took);
        }
        r
    }

    async fn resize(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        vcpu: u32,
        memory: ByteSize,
    ) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self.inner.resize(lease, epoch, vcpu, memory).await;
        let took = self.observe("resize", start, &r);
        self.metrics.step("resize", took);
        r
    }

    async fn record_cache_observation(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        observation: &crate::cache::Observation,
    ) -> Result<crate::cache::Observation, PlaneError> {
        let start = Instant::now();
        let r = self
            .inner
            .record_cache_observation(lease, epoch, observation)
            .await;
        self.observe("record_cache_observation", start, &r);
        r
    }

    async fn actions_cache_allowed(
        &self,
        owner: &str,
        repository: &str,
    ) -> Result<bool, PlaneError> {
        let start = Instant::now();
        let r = self.inner.actions_cache_allowed(owner, repository).await;
        self.observe("actions_policy", start, &r);
        r
    }

    async fn heartbeat(
        &self,
        leases: &[(LeaseId, Epoch)],
    ) -> Result<Vec<Result<(), PlaneError>>, PlaneError> {
        let start = Instant::now();
        let r = self.inner.heartbeat(leases).await;
        self.observe("heartbeat", start, &r);
        r
    }

    async fn release(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        ending: &crate::node::ending::Ending,
    ) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self.inner.release(lease, epoch, ending).await;
        self.observe("release", start, &r);
        if r.is_ok() {
            self.metrics.lease_ended(ending);
        }
        r
    }

    async fn mark_failure(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        reason: &crate::node::ending::FailureReason,
    ) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self.inner.mark_failure(lease, epoch, reason).await;
        self.observe("mark_failure", start, &r);
        r
    }

    async fn lease(&self, lease: &LeaseId) -> Result<Lease, PlaneError> {
        let start = Instant::now();
        let r = self.inner.lease(lease).await;
        self.observe("lease", start, &r);
        r
    }

    async fn launched(&self) -> Result<LaunchedSet, PlaneError> {
        let start = Instant::now();
        let r = self.inner.launched().await;
        self.observe("launched", start, &r);
        r
    }

    async fn reconcile(&self, running: &[LeaseId]) -> Result<u32, PlaneError> {
        let start = Instant::now();
        let r = self.inner.reconcile(running).await;
        self.observe("reconcile", start, &r);
        r
    }

    fn lease_ttl(&self) -> Duration {
        self.inner.lease_ttl()
    }
}

#[async_trait]
impl<P: JitSource + 'static> JitSource for MeteredPlane<P> {
    async fn mint(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_name: &InstanceName,
    ) -> Result<Registration, PlaneError> {
        let start = Instant::now();
        let r = self.inner.mint(lease, epoch, runner_name).await;
        let took = self.observe("mint", start, &r);
        self.metrics.step("mint", took);
        r
    }

    async fn remove_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<(), PlaneError> {
        let start = Instant::now();
        let r = self
            .inner
            .remove_runner(lease, epoch, runner_id, runner_name)
            .await;
        self.observe("remove_runner", start, &r);
        r
    }

    async fn retire_runner(
        &self,
        lease: &LeaseId,
        epoch: Epoch,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<crate::node::plane::Retired, PlaneError> {
        let start = Instant::now();
        let r = self
            .inner
            .retire_runner(lease, epoch, runner_id, runner_name)
            .await;
        self.observe("remove_runner", start, &r);
        r
    }
}

/// A [`Journal`] whose writes are timed (reads are not: they happen once,
/// at start-up).
#[derive(Debug)]
pub(crate) struct MeteredJournal {
    inner: Arc<dyn Journal>,
    metrics: Arc<Metrics>,
}

impl MeteredJournal {
    /// Wraps `inner`.
    pub(crate) fn new(inner: Arc<dyn Journal>, metrics: Arc<Metrics>) -> Self {
        Self { inner, metrics }
    }

    fn observe(&self, call: &'static str, start: Instant, r: &Result<(), JournalError>) {
        debug_assert!(
            JOURNAL_WRITES.contains(&call),
            "{call} is not in JOURNAL_WRITES"
        );
        self.metrics
            .journal_writes
            .get_or_create(&CallLabel { call })
            .observe(start.elapsed().as_secs_f64());
        if r.is_err() {
            self.metrics
                .journal_errors
                .get_or_create(&CallLabel { call })
                .inc();
        }
    }
}

#[async_trait]
impl Journal for MeteredJournal {
    async fn put_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        let start = Instant::now();
        let r = self.inner.put_launch(launch).await;
        self.observe("put_launch", start, &r);
        r
    }

    async fn amend_launch(&self, launch: &LaunchRecord) -> Result<(), JournalError> {
        let start = Instant::now();
        let r = self.inner.amend_launch(launch).await;
        self.observe("amend_launch", start, &r);
        r
    }

    async fn forget_launch(&self, lease: &str) -> Result<(), JournalError> {
        let start = Instant::now();
        let r = self.inner.forget_launch(lease).await;
        self.observe("forget_launch", start, &r);
        r
    }

    async fn launches(&self) -> Result<Vec<LaunchRecord>, JournalError> {
        self.inner.launches().await
    }

    async fn put_custody(&self, entry: &CustodyRecord) -> Result<(), JournalError> {
        let start = Instant::now();
        let r = self.inner.put_custody(entry).await;
        self.observe("put_custody", start, &r);
        r
    }

    async fn put_custody_all(&self, entries: &[CustodyRecord]) -> Result<(), JournalError> {
        let start = Instant::now();
        let r = self.inner.put_custody_all(entries).await;
        self.observe("put_custody", start, &r);
        r
    }

    async fn forget_custody(&self, lease: &str) -> Result<(), JournalError> {
        let start = Instant::now();
        let r = self.inner.forget_custody(lease).await;
        self.observe("forget_custody", start, &r);
        r
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
        let start = Instant::now();
        let r = self.inner.put_result(command, encoded, durability).await;
        let call = match durability {
            Durability::Synced => "put_result",
            Durability::Committed => "put_result_committed",
        };
        self.observe(call, start, &r);
        r
    }

    async fn results(&self) -> Result<Vec<(String, Vec<u8>)>, JournalError> {
        self.inner.results().await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn encoded(registry: &Registry) -> String {
        let mut s = String::new();
        prometheus_client::encoding::text::encode(&mut s, registry).unwrap();
        s
    }

    #[test]
    fn every_lease_state_is_reported_even_at_zero_and_counts_are_replaced() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry, "1.2.3", "abc");
        m.set_leases(
            &[("running", 2), ("custody", 1)],
            1,
            Duration::from_secs(90),
        );
        let text = encoded(&registry);
        assert!(
            text.contains("billet_leases_held{state=\"running\"} 2"),
            "{text}"
        );
        assert!(
            text.contains("billet_leases_held{state=\"launching\"} 0"),
            "{text}"
        );
        assert!(
            text.contains("billet_custody_oldest_age_seconds 90.0"),
            "{text}"
        );
        assert!(
            text.contains("billet_build_info{version=\"1.2.3\",commit=\"abc\"} 1"),
            "{text}"
        );
        m.set_leases(&[], 0, Duration::ZERO);
        assert!(encoded(&registry).contains("billet_leases_held{state=\"running\"} 0"));
    }

    /// Each release is counted by its class and reason, both from closed
    /// sets; an unhealthy tier is a series only while it is unhealthy.
    #[test]
    fn lease_ends_are_counted_by_class_and_reason_and_unhealthy_tiers_come_and_go() {
        use crate::node::ending::{EndReason, Ending, FailureReason, SpotAction};
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry, "1.2.3", "abc");
        m.lease_ended(&Ending::Done);
        m.lease_ended(&Ending::Done);
        m.lease_ended(&Ending::Failed(FailureReason::Compute(
            EndReason::SpotInterruption(SpotAction::Terminate),
        )));
        m.lease_ended(&Ending::Failed(FailureReason::forced(Some("cancelled"))));
        let text = encoded(&registry);
        for line in [
            "billet_lease_ends_total{class=\"job\",reason=\"completed\"} 2",
            "billet_lease_ends_total{class=\"infra\",reason=\"spot_interruption\"} 1",
            "billet_lease_ends_total{class=\"operator\",reason=\"forced\"} 1",
        ] {
            assert!(text.contains(line), "{line} in {text}");
        }
        m.set_unhealthy_tiers(&["small".to_owned()]);
        assert!(
            encoded(&registry).contains("billet_tier_unhealthy{tier=\"small\"} 1"),
            "{}",
            encoded(&registry)
        );
        m.set_unhealthy_tiers(&[]);
        assert!(!encoded(&registry).contains("tier=\"small\""));
    }

    /// An ending lease (its runner within the post-job grace) is
    /// counted too: every state a held lease can be in has its own
    /// series, so the series add up to what the node holds.
    #[test]
    fn every_held_state_is_counted_under_its_own_name() {
        use crate::model::{Epoch, InstanceName, LeaseId};
        use crate::node::runner::{HeldLease, HeldState};
        let states = [
            HeldState::Launching,
            HeldState::Running,
            HeldState::Custody,
            HeldState::Quarantine,
            HeldState::Discard,
            HeldState::Ending,
        ];
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry, "v", "c");
        let held: Vec<HeldLease> = states
            .iter()
            .enumerate()
            .map(|(i, state)| {
                let lease = LeaseId::parse("lease", &format!("lease-{i}")).unwrap();
                HeldLease {
                    instance: InstanceName::for_lease(&lease),
                    lease,
                    epoch: Epoch(1),
                    state: *state,
                    runner: None,
                    age: Some(Duration::from_secs(1)),
                }
            })
            .collect();
        m.observe_runner(&held);
        let text = encoded(&registry);
        for state in states {
            let series = format!("billet_leases_held{{state=\"{}\"}} 1", state.as_str());
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
    }

    #[test]
    fn the_text_format_is_served_unless_openmetrics_is_preferred() {
        use Exposition::{OpenMetrics, Text};
        for (accept, wanted) in [
            (None, Text),
            (Some(""), Text),
            (Some("*/*"), Text),
            (Some("text/plain"), Text),
            (Some("text/plain;version=0.0.4"), Text),
            (Some("application/openmetrics-text;q=0"), Text),
            (Some("application/openmetrics-text;q=x"), Text),
            (
                Some("text/plain;version=0.0.4;q=0.9, application/openmetrics-text;q=0.5"),
                Text,
            ),
            (
                Some("application/openmetrics-text; version=1.0.0"),
                OpenMetrics,
            ),
            (Some("Application/OpenMetrics-Text"), OpenMetrics),
            (
                Some(
                    "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
                ),
                OpenMetrics,
            ),
        ] {
            assert_eq!(Exposition::negotiate(accept), wanted, "{accept:?}");
        }
    }

    #[test]
    fn the_text_format_has_no_openmetrics_only_parts_and_openmetrics_ends_in_eof() {
        let mut registry = Registry::default();
        let _m = Metrics::new(&mut registry, "1.2.3", "abc");
        let text = Exposition::Text.encode(&registry).unwrap();
        assert!(!text.contains("# EOF"), "{text}");
        assert!(!text.contains(" info\n"), "{text}");
        assert!(!text.contains("_created"), "{text}");
        assert!(
            text.contains("# TYPE billet_build_info gauge\nbillet_build_info{version=\"1.2.3\",commit=\"abc\"} 1\n"),
            "{text}"
        );
        let open = Exposition::OpenMetrics.encode(&registry).unwrap();
        assert!(open.ends_with("# EOF\n"), "{open}");
        assert!(open.contains("# TYPE billet_build info"), "{open}");
    }

    #[test]
    fn every_error_family_has_every_known_series_at_zero_before_any_error() {
        let mut registry = Registry::default();
        let _m = Metrics::new(&mut registry, "v", "c");
        let text = Exposition::Text.encode(&registry).unwrap();
        let mut wanted: Vec<String> = Vec::new();
        for call in PROVIDER_CALLS {
            wanted.push(format!(
                "billet_provider_call_errors_total{{call=\"{call}\"}} 0"
            ));
        }
        for call in PLANE_CALLS {
            for code in PLANE_CODES {
                wanted.push(format!(
                    "billet_plane_call_errors_total{{call=\"{call}\",code=\"{code}\"}} 0"
                ));
            }
        }
        for call in JOURNAL_WRITES {
            wanted.push(format!(
                "billet_journal_write_errors_total{{call=\"{call}\"}} 0"
            ));
        }
        for outcome in RENEWAL_OUTCOMES {
            wanted.push(format!(
                "billet_certificate_renewals_total{{outcome=\"{outcome}\"}} 0"
            ));
        }
        for series in wanted {
            assert!(text.contains(&series), "no {series} in:\n{text}");
        }
    }

    #[test]
    fn every_plane_error_has_a_code_in_the_known_vocabulary() {
        let x = || String::from("x");
        for e in [
            PlaneError::Fenced(x()),
            PlaneError::NotFound(x()),
            PlaneError::BadTransition(x()),
            PlaneError::WrongNode(x()),
            PlaneError::Unavailable(x()),
            PlaneError::ForceRelease(x()),
            PlaneError::Refused(x()),
            PlaneError::ScaleSetNotFound(x()),
            PlaneError::RunnerNameTaken(x()),
            PlaneError::Busy(x()),
            PlaneError::IdentityRefused(x()),
        ] {
            assert!(PLANE_CODES.contains(&plane_code(&e)), "{e:?}");
        }
    }

    #[test]
    fn every_metric_the_grafana_dashboard_queries_is_one_the_node_serves() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry, "v", "c");
        // A family shows once it has a sample: give every one of them one.
        m.command_done("launch", "ok", "none", Duration::from_millis(1));
        m.command_started("launch", Duration::from_millis(1), 0);
        m.plane_call(
            "bind",
            Duration::from_millis(1),
            Err(&PlaneError::Fenced("x".into())),
        );
        m.step("bind", Duration::from_millis(1));
        m.set_degraded("docker", false);
        let call = CallLabel { call: "create" };
        m.provider_calls.get_or_create(&call).observe(0.1);
        m.provider_errors.get_or_create(&call).inc();
        m.journal_writes.get_or_create(&call).observe(0.1);
        m.journal_errors.get_or_create(&call).inc();
        let text = encoded(&registry);
        let dashboard = include_str!("../../../deploy/grafana-billet-node.json");
        let mut names: Vec<&str> = dashboard
            .match_indices("billet_")
            .map(|(i, _)| {
                let rest = &dashboard[i..];
                let end = rest
                    .find(|c: char| !(c.is_ascii_lowercase() || c == '_'))
                    .unwrap_or(rest.len());
                &rest[..end]
            })
            .filter(|n| *n != "billet_" && *n != "billet_node")
            .collect();
        names.sort_unstable();
        names.dedup();
        assert!(names.len() > 10, "{names:?}");
        for name in names {
            let family = ["_bucket", "_count", "_sum", "_total", "_info"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .unwrap_or(name);
            assert!(
                text.contains(&format!("# TYPE {family} ")),
                "the dashboard queries {name}, which the node does not serve:\n{text}"
            );
        }
    }

    /// The other way round: an operator who imports the dashboard sees
    /// every family the node serves, the cache's among them.
    #[test]
    fn the_grafana_dashboard_has_a_panel_for_every_family_the_node_serves() {
        let mut registry = Registry::default();
        let _m = Metrics::new(&mut registry, "v", "c");
        let text = Exposition::OpenMetrics.encode(&registry).unwrap();
        let dashboard = include_str!("../../../deploy/grafana-billet-node.json");
        let families: Vec<&str> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert!(families.len() > 20, "{families:?}");
        let missing: Vec<&str> = families
            .into_iter()
            .filter(|family| {
                !dashboard.match_indices(family).any(|(i, _)| {
                    let rest = &dashboard[i + family.len()..];
                    !rest.starts_with(|c: char| c.is_ascii_lowercase())
                })
            })
            .collect();
        assert!(missing.is_empty(), "no panel queries {missing:?}");
    }

    #[test]
    fn the_cache_counters_follow_the_stores_totals_from_zero_and_never_go_back() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry, "v", "c");
        let text = encoded(&registry);
        for event in CACHE_EVENTS {
            assert!(
                text.contains(&format!("billet_cache_events_total{{event=\"{event}\"}} 0")),
                "{text}"
            );
        }
        for zero in [
            "billet_cache_restored_bytes_total 0",
            "billet_cache_evicted_generations_total 0",
            "billet_cache_evicted_archives_total 0",
            "billet_cache_evicted_bytes_total 0",
        ] {
            assert!(text.contains(zero), "{zero} in:\n{text}");
        }
        let totals = crate::cache::Observation {
            hits: 3,
            misses: 1,
            bytes_restored: 4096,
            bytes_committed: 512,
            conflicts: 1,
            fallbacks: 2,
        };
        // Read twice (two scrapes): counted once.
        m.set_cache_totals(&totals);
        m.set_cache_totals(&totals);
        // A smaller reading (it cannot be, but) takes nothing back.
        m.set_cache_totals(&crate::cache::Observation::default());
        let evicted = crate::cache::Evicted {
            generations: 2,
            archives: 3,
            bytes: 8192,
        };
        m.set_cache_evicted(&evicted);
        m.set_cache_evicted(&evicted);
        m.set_cache_evicted(&crate::cache::Evicted::default());
        let text = encoded(&registry);
        for line in [
            "billet_cache_evicted_generations_total 2",
            "billet_cache_evicted_archives_total 3",
            "billet_cache_evicted_bytes_total 8192",
            "billet_cache_events_total{event=\"hit\"} 3",
            "billet_cache_events_total{event=\"miss\"} 1",
            "billet_cache_events_total{event=\"conflict\"} 1",
            "billet_cache_events_total{event=\"fallback\"} 2",
            "billet_cache_restored_bytes_total 4096",
            "billet_cache_committed_bytes_total 512",
        ] {
            assert!(text.contains(line), "{line} in:\n{text}");
        }
    }

    #[test]
    fn a_command_counts_by_kind_outcome_and_reason() {
        let mut registry = Registry::default();
        let m = Metrics::new(&mut registry, "v", "c");
        m.command_done("launch", "failed", "internal", Duration::from_millis(5));
        let text = encoded(&registry);
        assert!(
            text.contains(
                "billet_commands_total{kind=\"launch\",outcome=\"failed\",reason=\"internal\"} 1"
            ),
            "{text}"
        );
        assert!(
            text.contains("billet_command_duration_seconds_count{kind=\"launch\"} 1"),
            "{text}"
        );
    }

    /// A flood on the metrics port: idle connections cannot hold more
    /// than the cap, and a scrape dialed into them is still answered.
    #[tokio::test]
    async fn idle_connections_past_the_cap_drop_the_oldest_and_a_scrape_is_still_answered() {
        use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
        const CAP: usize = MAX_METRICS_CONNECTIONS;
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut registry = Registry::default();
        let metrics = Arc::new(Metrics::new(&mut registry, "v", "c"));
        let shutdown = CancellationToken::new();
        tokio::spawn(serve(
            listener,
            Arc::new(registry),
            metrics,
            Arc::new(|_: &Metrics| {}),
            shutdown.clone(),
        ));
        let mut idle = Vec::new();
        for _ in 0..CAP {
            idle.push(tokio::net::TcpStream::connect(addr).await.unwrap());
        }
        let mut scrape = tokio::net::TcpStream::connect(addr).await.unwrap();
        scrape
            .write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            .await
            .unwrap();
        let mut answer = String::new();
        tokio::time::timeout(Duration::from_secs(5), scrape.read_to_string(&mut answer))
            .await
            .expect("answered")
            .unwrap();
        assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
        assert!(answer.contains("billet_build_info"), "{answer}");
        let mut buf = [0_u8; 16];
        let closed = tokio::time::timeout(Duration::from_secs(2), idle[0].read(&mut buf)).await;
        assert!(
            matches!(closed, Ok(Ok(0) | Err(_))),
            "the oldest idle connection is closed at once, not after the header timeout: {closed:?}"
        );
        let still = tokio::time::timeout(Duration::from_millis(200), idle[1].read(&mut buf)).await;
        assert!(still.is_err(), "the others stay open: {still:?}");
        shutdown.cancel();
    }
}
