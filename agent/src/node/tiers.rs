//! Tier health: a tier whose launches keep failing to start on this node
//! is refused here at once, rather than tried again and again while its
//! job waits with nothing saying it will never run.
//!
//! [`TierHealth`] counts each tier's consecutive start failures: the
//! engine refusing its instance's create or start, its image missing, its
//! runner exiting before it came online. At `threshold` of them in a row
//! (`--tier-failures-before-unhealthy`) the tier is unhealthy: its launches
//! are refused ([`Unhealthy`], wire `ERROR_CODE_TIER_UNHEALTHY` with the
//! wait) until a backoff passes ([`RETRY_MIN`] doubling to [`RETRY_MAX`],
//! with the `backon` builder `ending.rs` backs off removals with, but no
//! jitter: one node retries one tier, so there is no crowd to spread, and
//! a seed of the simulation must replay the same), when launches are let
//! through again and the next failure refuses it for the next, longer,
//! wait. A launch of the tier under another definition (another image,
//! command, environment, size...) is let through at once and starts the
//! count over, since the operator may have fixed it. A launch that started
//! and whose lease then ended without its runner failing to start resets
//! the count. Refusals that say nothing about the tier (capacity,
//! draining, a refused bind, the plane) count neither way.
//! ([decision 117](../../../docs/decisions/0117-a-tier-that-cannot-start-is-refused-until-it-can.md))

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use backon::{BackoffBuilder as _, ExponentialBuilder};
use tokio::time::Instant;

use crate::model::{LeaseId, TierSpec};

/// The first wait before an unhealthy tier's launches are tried again.
pub(crate) const RETRY_MIN: Duration = Duration::from_secs(30);

/// The longest wait before an unhealthy tier's launches are tried again.
pub(crate) const RETRY_MAX: Duration = Duration::from_secs(600);

/// Consecutive start failures after which a tier is refused, by default.
pub const FAILURES_BEFORE_UNHEALTHY: u32 = 3;

/// How long to refuse a tier after its `trip`th time unhealthy (0 is the
/// first): [`RETRY_MIN`] doubling to [`RETRY_MAX`].
fn retry_delay(trip: u32) -> Duration {
    ExponentialBuilder::default()
        .with_min_delay(RETRY_MIN)
        .with_max_delay(RETRY_MAX)
        .with_factor(2.0)
        .without_max_times()
        .build()
        .nth(trip as usize)
        .unwrap_or(RETRY_MAX)
}

/// What a tier is, for telling a changed definition from the same one:
/// its spec and the size its launches are given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Definition {
    spec: TierSpec,
    vcpu: u32,
    memory_bytes: u64,
}

impl Definition {
    /// The definition of `spec` launched at `vcpu` and `memory_bytes`.
    pub(crate) fn new(spec: &TierSpec, vcpu: u32, memory_bytes: u64) -> Self {
        Self {
            spec: spec.clone(),
            vcpu,
            memory_bytes,
        }
    }

    fn label(&self) -> &str {
        &self.spec.label
    }
}

#[derive(Debug)]
struct Tier {
    definition: Definition,
    /// Consecutive start failures.
    failures: u32,
    last_error: String,
    /// Times it became unhealthy since it last started: the backoff's
    /// step.
    trips: u32,
    /// Refused until then; `None` while healthy, or once the wait passed.
    refused_until: Option<Instant>,
}

/// A launch refused because its tier keeps failing to start here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Unhealthy {
    /// The tier label.
    pub tier: String,
    /// Consecutive start failures.
    pub failures: u32,
    /// What the last one failed on.
    pub last_error: String,
    /// How long the tier goes on being refused.
    pub retry_after: Duration,
}

impl std::fmt::Display for Unhealthy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "tier {} failed to start {} times in a row on this node (last: {}); its launches are refused here for {}s, or until its definition changes",
            self.tier,
            self.failures,
            self.last_error,
            self.retry_after.as_secs().max(1)
        )
    }
}

/// A tier as `billet node status` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnhealthyTier {
    /// The tier label.
    pub tier: String,
    /// Consecutive start failures.
    pub failures: u32,
    /// What the last one failed on.
    pub last_error: String,
    /// Until one launch is let through again; zero once it may be.
    pub retry_in: Duration,
}

/// Each tier's consecutive start failures on this node.
#[derive(Debug, Default)]
pub(crate) struct TierHealth {
    tiers: HashMap<String, Tier>,
    /// Leases whose instance started, with their tier's definition, until
    /// their runner is known to have come up or failed to.
    started: HashMap<LeaseId, Definition>,
}

impl TierHealth {
    /// Whether a launch of `definition` may go on: `Err` while its tier is
    /// refused under this same definition. Another definition forgets the
    /// tier's failures first.
    pub(crate) fn admit(&mut self, definition: &Definition) -> Result<(), Unhealthy> {
        let label = definition.label();
        if self
            .tiers
            .get(label)
            .is_some_and(|t| t.definition != *definition)
        {
            self.tiers.remove(label);
            return Ok(());
        }
        let Some(tier) = self.tiers.get(label) else {
            return Ok(());
        };
        match tier.refused_until {
            Some(until) if until > Instant::now() => Err(Unhealthy {
                tier: label.to_owned(),
                failures: tier.failures,
                last_error: tier.last_error.clone(),
                retry_after: until - Instant::now(),
            }),
            _ => Ok(()),
        }
    }

    /// A launch of `definition` failed to start for `error`. Returns the
    /// refusal when this failure makes (or keeps) the tier unhealthy, for
    /// the caller to log. `threshold` 0: never.
    pub(crate) fn failed(
        &mut self,
        definition: &Definition,
        error: &str,
        threshold: u32,
    ) -> Option<Unhealthy> {
        let label = definition.label().to_owned();
        let tier = self
            .tiers
            .entry(label.clone())
            .and_modify(|t| {
                if t.definition != *definition {
                    t.definition = definition.clone();
                    t.failures = 0;
                    t.trips = 0;
                    t.refused_until = None;
                }
            })
            .or_insert_with(|| Tier {
                definition: definition.clone(),
                failures: 0,
                last_error: String::new(),
                trips: 0,
                refused_until: None,
            });
        tier.failures += 1;
        error.clone_into(&mut tier.last_error);
        if threshold == 0 || tier.failures < threshold {
            return None;
        }
        let wait = retry_delay(tier.trips);
        tier.trips += 1;
        tier.refused_until = Some(Instant::now() + wait);
        Some(Unhealthy {
            tier: label,
            failures: tier.failures,
            last_error: tier.last_error.clone(),
            retry_after: wait,
        })
    }

    /// A launch of `definition` for `lease` started its instance: the
    /// verdict waits for its runner ([`TierHealth::ended`],
    /// [`TierHealth::exited_before_online`]).
    pub(crate) fn started(&mut self, lease: &LeaseId, definition: &Definition) {
        self.started.insert(lease.clone(), definition.clone());
    }

    /// The runner of `lease` exited before it came online: a start failure
    /// of its tier, as [`TierHealth::failed`]. `None` for a lease not
    /// started by this process, or already judged.
    pub(crate) fn exited_before_online(
        &mut self,
        lease: &LeaseId,
        error: &str,
        threshold: u32,
    ) -> Option<Unhealthy> {
        let definition = self.started.remove(lease)?;
        self.failed(&definition, error, threshold)
    }

    /// The lease ended on this node without its runner failing to start:
    /// its tier starts here, and its count goes back to zero. Nothing for
    /// a lease not started by this process, or already judged.
    pub(crate) fn ended(&mut self, lease: &LeaseId) {
        if let Some(definition) = self.started.remove(lease)
            && self
                .tiers
                .get(definition.label())
                .is_some_and(|t| t.definition == definition)
        {
            self.tiers.remove(definition.label());
        }
    }

    /// The tiers refused now, or refused and let through again with no
    /// start since, by label.
    pub(crate) fn unhealthy(&self) -> Vec<UnhealthyTier> {
        let now = Instant::now();
        let sorted: BTreeMap<&String, &Tier> =
            self.tiers.iter().filter(|(_, t)| t.trips > 0).collect();
        sorted
            .into_iter()
            .map(|(label, t)| UnhealthyTier {
                tier: label.clone(),
                failures: t.failures,
                last_error: t.last_error.clone(),
                retry_in: t
                    .refused_until
                    .map_or(Duration::ZERO, |until| until.saturating_duration_since(now)),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{ByteSize, Trust};

    fn spec(label: &str, image: &str) -> TierSpec {
        TierSpec {
            label: label.into(),
            image: image.into(),
            command: vec!["run".into()],
            trust: Trust::Trusted,
            shm: ByteSize(0),
            network: None,
            env: Vec::new(),
            sticky_disks: Vec::new(),
            actions_cache: None,
            docker_image_store: false,
            min_runner_version: None,
            host: Default::default(),
            pids_limit: None,
        }
    }

    fn lease(id: &str) -> LeaseId {
        LeaseId::parse("lease", id).unwrap()
    }

    #[tokio::test(start_paused = true)]
    async fn a_tier_is_refused_after_k_failures_in_a_row_and_tried_again_after_a_growing_wait() {
        let mut health = TierHealth::default();
        let small = Definition::new(&spec("small", "runner:1"), 1, 1 << 20);
        for n in 1..3 {
            assert_eq!(health.failed(&small, "create refused", 3), None, "{n}");
            assert_eq!(health.admit(&small), Ok(()), "{n}");
        }
        assert!(health.unhealthy().is_empty());
        let tripped = health
            .failed(&small, "Minimum memory limit allowed is 6MB", 3)
            .expect("unhealthy at the third failure");
        assert_eq!(tripped.failures, 3);
        assert!(tripped.retry_after >= RETRY_MIN, "{tripped:?}");
        let refused = health.admit(&small).expect_err("refused");
        assert_eq!(refused.last_error, "Minimum memory limit allowed is 6MB");
        assert!(
            refused
                .to_string()
                .contains("tier small failed to start 3 times")
        );
        let shown = health.unhealthy();
        assert_eq!(shown.len(), 1);
        assert_eq!(shown[0].tier, "small");
        assert!(shown[0].retry_in > Duration::ZERO);

        // Another tier is not touched.
        let other = Definition::new(&spec("other", "runner:1"), 1, 1 << 30);
        assert_eq!(health.admit(&other), Ok(()));

        // The wait passes: launches go through; the next failure refuses
        // the tier for longer.
        tokio::time::advance(tripped.retry_after).await;
        assert_eq!(health.admit(&small), Ok(()));
        assert_eq!(health.unhealthy()[0].retry_in, Duration::ZERO);
        let again = health.failed(&small, "create refused", 3).expect("again");
        assert!(again.retry_after >= RETRY_MIN * 2, "{again:?}");
        assert!(health.admit(&small).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn a_changed_definition_is_let_through_at_once_and_counts_from_zero() {
        let mut health = TierHealth::default();
        let small = Definition::new(&spec("t", "runner:1"), 1, 1 << 20);
        for _ in 0..3 {
            health.failed(&small, "refused", 3);
        }
        assert!(health.admit(&small).is_err());
        let bigger = Definition::new(&spec("t", "runner:1"), 1, 1 << 30);
        assert_eq!(health.admit(&bigger), Ok(()));
        assert!(health.unhealthy().is_empty());
        assert_eq!(health.failed(&bigger, "refused", 3), None);
        let image = Definition::new(&spec("t", "runner:2"), 1, 1 << 30);
        assert_eq!(health.admit(&image), Ok(()));
        assert_eq!(health.failed(&image, "refused", 3), None);
        assert_eq!(health.failed(&image, "refused", 3), None, "counted anew");
    }

    #[tokio::test(start_paused = true)]
    async fn a_start_whose_runner_comes_up_resets_the_count_and_one_that_exits_first_counts() {
        let mut health = TierHealth::default();
        let t = Definition::new(&spec("t", "runner:1"), 1, 1 << 30);
        health.failed(&t, "refused", 3);
        health.failed(&t, "refused", 3);
        health.started(&lease("a"), &t);
        assert!(
            health
                .exited_before_online(&lease("a"), "exit 1", 3)
                .is_some(),
            "the third failure in a row"
        );
        assert!(health.admit(&t).is_err());
        // Judged once: the same lease's end changes nothing.
        health.ended(&lease("a"));
        assert!(health.admit(&t).is_err());

        let mut health = TierHealth::default();
        health.failed(&t, "refused", 3);
        health.failed(&t, "refused", 3);
        health.started(&lease("b"), &t);
        health.ended(&lease("b"));
        assert_eq!(health.failed(&t, "refused", 3), None, "counted from zero");
        assert_eq!(health.failed(&t, "refused", 3), None);
        assert!(health.failed(&t, "refused", 3).is_some());
    }

    #[test]
    fn a_threshold_of_zero_never_refuses() {
        let mut health = TierHealth::default();
        let t = Definition::new(&spec("t", "runner:1"), 1, 1);
        for _ in 0..10 {
            assert_eq!(health.failed(&t, "refused", 0), None);
        }
        assert_eq!(health.admit(&t), Ok(()));
    }

    #[test]
    fn waits_grow_to_the_cap() {
        let waits: Vec<u64> = (0..8).map(|t| retry_delay(t).as_secs()).collect();
        assert_eq!(waits, [30, 60, 120, 240, 480, 600, 600, 600]);
    }
}
