//! Warm runners: the plane states, to every attached node that keeps a warm
//! pool, how many warm runners of its tier it wants there (`WarmPool`), and
//! says it again whenever the wanted count changes or the node attaches on
//! a new session. The count is `billet-plane warm` (in the ledger, so every
//! plane of the tier and a restarted plane read it) or else `--warm`.
//!
//! The node reserves each warm runner's room in the ledger before it
//! creates it (`ReserveWarm`, `calls/`), so the plane never places a lease
//! on room a warm runner takes; a lease of the tier takes a warm runner's
//! room over when it is reserved ([`crate::ledger::Ledger::reserve_on_warm`]).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use billet_proto::v1 as pb;
use tokio_util::sync::CancellationToken;
use tracing::{info, warn};

use super::Plane;

/// How often the plane compares what each node was told with what is
/// wanted: a count set with `billet-plane warm` reaches the nodes within it.
const WARM_TICK: Duration = Duration::from_secs(1);

/// How long a `WarmPool` may wait in a node's queue.
const WARM_TIMEOUT: Duration = Duration::from_secs(30);

/// The warm runners each node keeps for the plane's tier.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WarmConfig {
    /// How many per node, unless the ledger holds a count set since
    /// (`billet-plane warm`). Zero: none.
    pub count: u32,
    /// A warm runner idle this long is retired and replaced; `None`: never.
    pub idle_retire: Option<Duration>,
    /// A warm runner this old is retired and replaced; `None`: never.
    pub max_age: Option<Duration>,
}

impl Plane {
    /// States the wanted warm runners to every attached node that keeps a
    /// pool, on each tick, when the count or the node's session changed
    /// since the node last took it in.
    pub(super) async fn keep_warm(self: Arc<Self>, shutdown: CancellationToken) {
        let mut told: HashMap<String, (u64, u32)> = HashMap::new();
        let mut tick = tokio::time::interval(WARM_TICK);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = shutdown.cancelled() => return,
                _ = tick.tick() => {}
            }
            let count = match self.ledger.warm_wanted(&self.config.tier.label).await {
                Ok(set) => set.unwrap_or(self.config.warm.count),
                Err(e) => {
                    warn!(error = %e, "cannot read the wanted warm count; asking again");
                    continue;
                }
            };
            for node in &self.nodes {
                let session = match node.status().borrow().as_ref() {
                    Some(s) if s.hello.keeps_warm_pool => s.session,
                    _ => continue,
                };
                if told.get(node.name()) == Some(&(session, count)) {
                    continue;
                }
                let outcome = node
                    .dispatch(
                        pb::command::Kind::WarmPool(self.warm_pool(count)),
                        WARM_TIMEOUT,
                    )
                    .await;
                if outcome.is_ok() {
                    info!(
                        node = node.name(),
                        count, "told the node how many warm runners to keep"
                    );
                    told.insert(node.name().to_owned(), (session, count));
                } else {
                    warn!(node = node.name(), outcome = %outcome.describe(), "the node did not take its warm pool in; telling it again");
                }
            }
        }
    }

    fn warm_pool(&self, count: u32) -> pb::WarmPool {
        let warm = self.config.warm;
        let secs = |d: Option<Duration>| d.map_or(0, |d| d.as_secs().max(1));
        pb::WarmPool {
            tiers: vec![pb::WarmTier {
                tier: Some(self.tier_spec()),
                count,
                vcpu: self.config.tier.vcpu,
                memory_bytes: self.config.tier.memory_bytes,
                idle_retire_secs: secs(warm.idle_retire),
                max_age_secs: secs(warm.max_age),
            }],
        }
    }
}
