//! The single command slot: one command at a time, in arrival order.
//!
//! Semantics (DESIGN.md "The wire: one session, one slot"):
//! - commands run strictly one at a time in the order they arrived, whichever
//!   session carried them;
//! - a command id seen before is never run twice: while the first copy waits
//!   or runs, the second is dropped and the first one's result answers it
//!   (a copy redelivered on a newer session moves the waiting command's
//!   answer to that session);
//!   once it has run, the recorded result is sent again;
//! - the queue is bounded: past [`MAX_QUEUED`] waiting commands a new one is
//!   refused at once rather than held;
//! - results are remembered for redelivery, newest first, up to
//!   [`RESULT_MEMORY_BYTES`] of memory (an estimate: each result's encoded
//!   size plus its id twice and the bookkeeping around them), so what the
//!   slot keeps is bounded by bytes whatever the commands, never by how many
//!   have run; at least the newest result is always kept.
//!
//! Deadlines are the executor's business: the slot only orders.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use billet_proto::v1 as pb;
use tokio::sync::Notify;

use crate::edge::link::SessionLink;
use crate::model::CommandId;
use crate::model::NodeCommand;
use crate::node::metrics::Metrics;

/// Most commands waiting at once.
pub(crate) const MAX_QUEUED: usize = 1024;
/// How much memory remembered results may take, in bytes (see
/// [`remembered_bytes`]). 1 MiB holds about 6,000 results of a no-op
/// command, several times the queue bound, so a plane redelivering what
/// was in flight when its session broke finds every answer.
pub(crate) const RESULT_MEMORY_BYTES: usize = 1 << 20;

/// What remembering `result` under `id` costs, in bytes: its encoded size
/// (a fair measure of what its strings and lists hold on the heap), the
/// result's own struct, and the id twice (the map's key and the order's
/// entry) with their `String` headers.
pub(crate) fn remembered_bytes(id: &CommandId, result: &pb::CommandResult) -> usize {
    prost::Message::encoded_len(result)
        + std::mem::size_of::<pb::CommandResult>()
        + 2 * (std::mem::size_of::<CommandId>() + id.as_str().len())
        // A hash map slot and a deque slot.
        + 2 * std::mem::size_of::<usize>()
}

/// A command waiting for the slot, with the session it came on.
#[derive(Debug)]
pub(crate) struct Queued {
    /// Its id.
    pub id: CommandId,
    /// When it expires, on this node's monotonic clock (fixed on receipt
    /// from the time the plane said it had left).
    pub deadline: tokio::time::Instant,
    /// What to do.
    pub command: NodeCommand,
    /// Where to answer.
    pub session: Arc<SessionLink>,
}

/// An outcome as the metrics label it: the proto name, lower case, without
/// its prefix.
fn outcome_name(o: pb::Outcome) -> &'static str {
    match o {
        pb::Outcome::Unspecified => "unspecified",
        pb::Outcome::Ok => "ok",
        pb::Outcome::Failed => "failed",
        pb::Outcome::Expired => "expired",
        pb::Outcome::Refused => "refused",
        pb::Outcome::InvalidArgument => "invalid_argument",
        pb::Outcome::Busy => "busy",
    }
}

/// An error code as the metrics label it.
fn error_name(c: pb::ErrorCode) -> &'static str {
    match c {
        pb::ErrorCode::Unspecified => "unspecified",
        pb::ErrorCode::Fenced => "fenced",
        pb::ErrorCode::NotFound => "not_found",
        pb::ErrorCode::BadTransition => "bad_transition",
        pb::ErrorCode::WrongNode => "wrong_node",
        pb::ErrorCode::Unavailable => "unavailable",
        pb::ErrorCode::ForceRelease => "force_release",
        pb::ErrorCode::InvalidArgument => "invalid_argument",
        pb::ErrorCode::Refused => "refused",
        pb::ErrorCode::Internal => "internal",
        pb::ErrorCode::ImageUnavailable => "image_unavailable",
        pb::ErrorCode::ScaleSetNotFound => "scale_set_not_found",
        pb::ErrorCode::ResourceExhausted => "resource_exhausted",
        pb::ErrorCode::Busy => "busy",
        pb::ErrorCode::IdentityRefused => "identity_refused",
        pb::ErrorCode::RunnerNameTaken => "runner_name_taken",
        pb::ErrorCode::RunnerOutdated => "runner_outdated",
        pb::ErrorCode::TierUnhealthy => "tier_unhealthy",
    }
}

/// What happened to a pushed command.
#[derive(Debug)]
pub(crate) enum Admission {
    /// Queued; it will be answered when it runs.
    Queued,
    /// Already queued or running; the first copy will answer.
    Duplicate,
    /// Already run: send this recorded result again.
    Replay(pb::CommandResult),
    /// The queue is full.
    Full,
}

#[derive(Debug, Default)]
struct Inner {
    queue: VecDeque<Queued>,
    /// Ids queued or running: when each was queued, and once running, its
    /// kind and start (for the metrics).
    pending: HashMap<CommandId, Pending>,
    results: HashMap<CommandId, pb::CommandResult>,
    /// Remembered ids, oldest first, with what each costs.
    order: VecDeque<(CommandId, usize)>,
    /// The sum of `order`'s costs.
    remembered_bytes: usize,
}

#[derive(Debug)]
struct Pending {
    queued: tokio::time::Instant,
    running: Option<(&'static str, tokio::time::Instant)>,
}

/// The single-item operation queue. Cheap to share behind an `Arc`.
#[derive(Debug, Default)]
pub(crate) struct CommandSlot {
    inner: Mutex<Inner>,
    ready: Notify,
    metrics: Option<Arc<Metrics>>,
}

impl CommandSlot {
    /// An empty slot.
    pub(crate) fn new() -> Self {
        Self::default()
    }

    /// Reports queue depth and waits, and each command's outcome and
    /// duration, to `metrics`.
    #[must_use]
    pub(crate) fn with_metrics(mut self, metrics: Arc<Metrics>) -> Self {
        self.metrics = Some(metrics);
        self
    }

    /// Offers a command; see [`Admission`].
    pub(crate) fn push(&self, queued: Queued) -> Admission {
        if let Some(m) = &self.metrics {
            // Every command comes from the plane.
            m.plane_contact();
        }
        let mut inner = self.inner.lock().expect("slot");
        if let Some(result) = inner.results.get(&queued.id) {
            return Admission::Replay(result.clone());
        }
        if inner.pending.contains_key(&queued.id) {
            // Still waiting: answer on the session that asked last, which is
            // the one most likely to be alive when it runs.
            if let Some(waiting) = inner.queue.iter_mut().find(|q| q.id == queued.id) {
                waiting.session = queued.session;
            }
            return Admission::Duplicate;
        }
        if inner.queue.len() >= MAX_QUEUED {
            return Admission::Full;
        }
        inner.pending.insert(
            queued.id.clone(),
            Pending {
                queued: tokio::time::Instant::now(),
                running: None,
            },
        );
        inner.queue.push_back(queued);
        if let Some(m) = &self.metrics {
            m.set_queue_depth(inner.queue.len());
        }
        drop(inner);
        self.ready.notify_one();
        Admission::Queued
    }

    /// Answers a command at once with `result` instead of queueing it (a
    /// launch a degraded node refuses): a copy already queued, running or
    /// run is treated as by [`CommandSlot::push`]; otherwise `result` is
    /// recorded for redelivery and handed back as [`Admission::Replay`], to
    /// be sent.
    pub(crate) fn answer_now(&self, queued: Queued, result: pb::CommandResult) -> Admission {
        let mut inner = self.inner.lock().expect("slot");
        if let Some(recorded) = inner.results.get(&queued.id) {
            return Admission::Replay(recorded.clone());
        }
        if inner.pending.contains_key(&queued.id) {
            if let Some(waiting) = inner.queue.iter_mut().find(|q| q.id == queued.id) {
                waiting.session = queued.session;
            }
            return Admission::Duplicate;
        }
        drop(inner);
        if let Some(m) = &self.metrics {
            m.plane_contact();
        }
        self.answered(queued.command.kind(), &result, std::time::Duration::ZERO);
        self.record(&queued.id, &result);
        Admission::Replay(result)
    }

    /// Takes every launch still waiting (not the command running) out of
    /// the queue, in arrival order, for the caller to answer: a degraded
    /// node refuses them rather than let them wait behind a stuck command.
    /// Each must be answered with [`CommandSlot::record`].
    pub(crate) fn take_waiting_launches(&self) -> Vec<Queued> {
        let mut inner = self.inner.lock().expect("slot");
        let (launches, rest): (VecDeque<_>, VecDeque<_>) = std::mem::take(&mut inner.queue)
            .into_iter()
            .partition(|q| matches!(q.command, NodeCommand::Launch { .. }));
        inner.queue = rest;
        if let Some(m) = &self.metrics {
            m.set_queue_depth(inner.queue.len());
        }
        for q in &launches {
            if let Some(p) = inner.pending.get_mut(&q.id) {
                // Counted as run (for no time) when recorded.
                p.running = Some((q.command.kind(), tokio::time::Instant::now()));
            }
        }
        launches.into()
    }

    /// How long the command running now has run; `None` while the slot is
    /// idle.
    pub(crate) fn busy_for(&self) -> Option<std::time::Duration> {
        self.inner
            .lock()
            .expect("slot")
            .pending
            .values()
            .filter_map(|p| p.running.map(|(_, started)| started.elapsed()))
            .max()
    }

    fn answered(&self, kind: &'static str, result: &pb::CommandResult, took: std::time::Duration) {
        if let Some(m) = &self.metrics {
            let outcome = pb::Outcome::try_from(result.outcome).map_or("unknown", outcome_name);
            let reason = result.error.as_ref().map_or("none", |e| {
                pb::ErrorCode::try_from(e.code).map_or("unknown", error_name)
            });
            m.command_done(kind, outcome, reason, took);
        }
    }

    /// Waits for the next command in arrival order.
    pub(crate) async fn next(&self) -> Queued {
        loop {
            let notified = self.ready.notified();
            if let Some(q) = self.take() {
                return q;
            }
            notified.await;
        }
    }

    /// The next command, marked running.
    fn take(&self) -> Option<Queued> {
        let mut inner = self.inner.lock().expect("slot");
        let q = inner.queue.pop_front()?;
        let depth = inner.queue.len();
        if let Some(p) = inner.pending.get_mut(&q.id) {
            let now = tokio::time::Instant::now();
            let kind = q.command.kind();
            p.running = Some((kind, now));
            if let Some(m) = &self.metrics {
                m.command_started(kind, now - p.queued, depth);
            }
        }
        Some(q)
    }

    /// Records the result of a command that has run, for redelivery.
    pub(crate) fn record(&self, id: &CommandId, result: &pb::CommandResult) {
        let mut inner = self.inner.lock().expect("slot");
        if let Some(Pending {
            running: Some((kind, started)),
            ..
        }) = inner.pending.remove(id)
        {
            self.answered(kind, result, started.elapsed());
        }
        let cost = remembered_bytes(id, result);
        if let Some(replaced) = inner.results.insert(id.clone(), result.clone()) {
            // Recorded again (a preload): the older copy's cost goes.
            let old = remembered_bytes(id, &replaced);
            if let Some(at) = inner.order.iter().position(|(o, _)| o == id) {
                inner.order.remove(at);
                inner.remembered_bytes -= old;
            }
        }
        inner.order.push_back((id.clone(), cost));
        inner.remembered_bytes += cost;
        while inner.remembered_bytes > RESULT_MEMORY_BYTES && inner.order.len() > 1 {
            if let Some((old, cost)) = inner.order.pop_front() {
                inner.results.remove(&old);
                inner.remembered_bytes -= cost;
            }
        }
    }

    /// How many results are remembered, and what they cost by
    /// [`remembered_bytes`].
    #[cfg(test)]
    pub(crate) fn remembered(&self) -> (usize, usize) {
        let inner = self.inner.lock().expect("slot");
        (inner.order.len(), inner.remembered_bytes)
    }

    /// Remembers results recorded by an earlier process (oldest first), so
    /// a command redelivered across a restart is answered, not run again.
    pub(crate) fn preload(
        &self,
        results: impl IntoIterator<Item = (CommandId, pb::CommandResult)>,
    ) {
        for (id, result) in results {
            self.record(&id, &result);
        }
    }

    /// How many commands are queued or running (not yet recorded).
    pub(crate) fn in_flight(&self) -> usize {
        self.inner.lock().expect("slot").pending.len()
    }

    /// How many commands wait.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.inner.lock().expect("slot").queue.len()
    }

    /// Whether nothing waits.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl crate::node::health::SlotProgress for CommandSlot {
    fn busy_for(&self) -> Option<std::time::Duration> {
        CommandSlot::busy_for(self)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn queued(id: &str) -> Queued {
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        Queued {
            id: CommandId::parse("id", id).unwrap(),
            deadline: tokio::time::Instant::now(),
            command: NodeCommand::Tend,
            session: Arc::new(SessionLink::new(1, tx)),
        }
    }

    #[tokio::test]
    async fn commands_come_out_in_arrival_order() {
        let slot = CommandSlot::new();
        for id in ["a", "b", "c"] {
            assert!(matches!(slot.push(queued(id)), Admission::Queued));
        }
        for id in ["a", "b", "c"] {
            assert_eq!(slot.next().await.id.as_str(), id);
        }
    }

    #[tokio::test]
    async fn a_redelivered_id_is_never_run_twice() {
        let slot = CommandSlot::new();
        assert!(matches!(slot.push(queued("a")), Admission::Queued));
        assert!(matches!(slot.push(queued("a")), Admission::Duplicate));
        let q = slot.next().await;
        assert!(matches!(slot.push(queued("a")), Admission::Duplicate));
        let result = pb::CommandResult {
            id: "a".into(),
            outcome: pb::Outcome::Ok.into(),
            ..Default::default()
        };
        slot.record(&q.id, &result);
        match slot.push(queued("a")) {
            Admission::Replay(r) => assert_eq!(r, result),
            other => panic!("expected a replay, got {other:?}"),
        }
        assert!(slot.is_empty());
    }

    #[tokio::test]
    async fn a_waiting_command_redelivered_on_a_newer_session_is_answered_there() {
        let slot = CommandSlot::new();
        assert!(matches!(slot.push(queued("a")), Admission::Queued));
        let (tx, _rx) = tokio::sync::mpsc::channel(1);
        let newer = Arc::new(SessionLink::new(2, tx));
        let mut again = queued("a");
        again.session = newer;
        assert!(matches!(slot.push(again), Admission::Duplicate));
        assert_eq!(slot.next().await.session.id, 2);
    }

    fn ok(id: &str) -> pb::CommandResult {
        pb::CommandResult {
            id: id.into(),
            outcome: pb::Outcome::Ok.into(),
            ..Default::default()
        }
    }

    #[test]
    fn remembered_results_are_bounded_by_bytes_not_by_count() {
        let slot = CommandSlot::new();
        let small = |i: usize| CommandId::parse("id", &format!("{i:032x}")).unwrap();
        let one = remembered_bytes(&small(0), &ok(&format!("{:032x}", 0)));
        let fits = RESULT_MEMORY_BYTES / one;
        // Far more small results than fit: memory stays within the bound,
        // the newest are kept and the oldest forgotten.
        for i in 0..fits * 3 {
            slot.record(&small(i), &ok(&format!("{i:032x}")));
        }
        let (count, bytes) = slot.remembered();
        assert!(bytes <= RESULT_MEMORY_BYTES, "{bytes} bytes remembered");
        assert!(count >= fits - 1 && count <= fits, "{count} of {fits} kept");
        let newest = small(fits * 3 - 1);
        assert!(matches!(
            slot.push(Queued {
                id: newest,
                ..queued("x")
            }),
            Admission::Replay(_)
        ));
        assert!(matches!(
            slot.push(queued(&format!("{:032x}", 0))),
            Admission::Queued
        ));
        // Large results take more room each: fewer are kept, and the bound
        // holds by bytes.
        let slot = CommandSlot::new();
        let big = |i: usize| pb::CommandResult {
            error: Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::Internal.into(),
                message: "x".repeat(16 << 10),
            }),
            ..ok(&format!("{i:032x}"))
        };
        for i in 0..200 {
            slot.record(&small(i), &big(i));
        }
        let (count, bytes) = slot.remembered();
        assert!(bytes <= RESULT_MEMORY_BYTES, "{bytes} bytes remembered");
        assert!(count < 64, "{count} large results kept");
        // One result larger than the whole bound is still kept, alone.
        let huge = pb::CommandResult {
            error: Some(pb::Error {
                retry_after_ms: 0,
                code: pb::ErrorCode::Internal.into(),
                message: "x".repeat(RESULT_MEMORY_BYTES),
            }),
            ..ok("huge")
        };
        slot.record(&CommandId::parse("id", "huge").unwrap(), &huge);
        assert_eq!(slot.remembered().0, 1);
    }

    fn launch(id: &str) -> Queued {
        let mut command = crate::edge::wire::tests::launch();
        command.id = id.into();
        command.deadline_remaining_ms = Some(60_000);
        let (_, command) = crate::edge::wire::command(command)
            .command
            .expect("a launch");
        Queued {
            command,
            ..queued(id)
        }
    }

    fn refused(id: &str) -> pb::CommandResult {
        pb::CommandResult {
            id: id.into(),
            outcome: pb::Outcome::Refused.into(),
            ..Default::default()
        }
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_launches_can_be_taken_out_and_the_running_command_timed() {
        let slot = CommandSlot::new();
        assert_eq!(slot.busy_for(), None);
        for q in [queued("t1"), launch("l1"), queued("t2"), launch("l2")] {
            assert!(matches!(slot.push(q), Admission::Queued));
        }
        let running = slot.next().await;
        assert_eq!(running.id.as_str(), "t1");
        tokio::time::advance(std::time::Duration::from_secs(7)).await;
        assert_eq!(slot.busy_for(), Some(std::time::Duration::from_secs(7)));
        let taken: Vec<String> = slot
            .take_waiting_launches()
            .iter()
            .map(|q| q.id.as_str().to_owned())
            .collect();
        assert_eq!(taken, ["l1", "l2"]);
        assert_eq!(slot.len(), 1, "the other commands stay");
        for id in ["l1", "l2"] {
            slot.record(&CommandId::parse("id", id).unwrap(), &refused(id));
        }
        slot.record(&running.id, &ok("t1"));
        assert_eq!(slot.busy_for(), None);
        assert_eq!(slot.next().await.id.as_str(), "t2");
        assert!(matches!(slot.push(launch("l1")), Admission::Replay(_)));
    }

    #[tokio::test]
    async fn a_command_answered_now_is_not_queued_and_is_remembered() {
        let slot = CommandSlot::new();
        match slot.answer_now(launch("l1"), refused("l1")) {
            Admission::Replay(r) => assert_eq!(r, refused("l1")),
            other => panic!("{other:?}"),
        }
        assert!(slot.is_empty());
        assert_eq!(slot.in_flight(), 0);
        assert!(matches!(slot.push(launch("l1")), Admission::Replay(_)));
        // A copy already queued is not answered twice.
        assert!(matches!(slot.push(launch("l2")), Admission::Queued));
        assert!(matches!(
            slot.answer_now(launch("l2"), refused("l2")),
            Admission::Duplicate
        ));
        assert_eq!(slot.len(), 1);
    }

    #[tokio::test]
    async fn a_full_queue_refuses_rather_than_grows() {
        let slot = CommandSlot::new();
        for i in 0..MAX_QUEUED {
            assert!(matches!(
                slot.push(queued(&format!("c{i}"))),
                Admission::Queued
            ));
        }
        assert!(matches!(slot.push(queued("one-more")), Admission::Full));
    }
}
