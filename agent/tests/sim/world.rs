//! One simulated world per seed: the runner under test, the plane around it
//! (modelled on `controlplane-stub`'s dispatch: it renews the leases it
//! manages, stops when the node holds one, releases `failed` after a failed
//! launch and `done` after a completion-triggered destroy succeeds), GitHub
//! (jobs complete, ephemeral registrations go away with their job), and the
//! faults and restarts the seed chooses. Invariants are checked after every
//! step and again after a quiescence phase.
//!
//! The node keeps a warm pool, the crate's own [`WarmPool`], run on its
//! own task as the node runs it: the plane states the warm runners it
//! wants (sometimes none, sometimes of a changed tier or size), reserves
//! leases onto warm runners' room and names them in launches, and the
//! seed kills warm runners while they wait and fails their creates,
//! listings, destroys and the pool's calls to the ledger.

use std::collections::{BTreeMap, VecDeque};
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use billet_agent::model::{
    ByteSize, DestroyOrder, Epoch, InstanceName, Job as GithubJob, Lease, LeaseId, Phase,
    RequestId, TierSpec, Trust, WarmTarget,
};
use billet_agent::node::freshness::Freshness;
use billet_agent::node::runner::{Runner, RunnerError, RunnerOptions};
use billet_agent::node::warm::WarmPool;
use billet_agent::provider::Exit;
use billet_agent::provider::fake::FakeProvider;
use futures::FutureExt as _;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::fakes::{
    Core, Crash, FakeLedger, Fault, Job, LEASE_MEMORY, LEASE_VCPU, LOp, PFault, POST_JOB_GRACE,
    POp, STRAY_GRACE, Sabotage, Shared, is_warm, may_run, secs,
};
use crate::journal::SimJournal;
use crate::provider::SimProvider;
use crate::rng::Rng;

/// Counters of what a run exercised, summed over seeds for the report.
pub type Stats = BTreeMap<&'static str, u64>;

/// The step-by-step log of a verbose run (and, through `sim.rs`, the
/// runner's own tracing output), kept until the run is over so that only
/// the attempt that failed is printed.
pub static LOG: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

fn log_line(line: &str) {
    let mut log = LOG.lock().unwrap_or_else(|p| p.into_inner());
    log.push_str(line);
    log.push('\n');
}

/// Runner bugs the simulation found, each reached by one kind of
/// injection. While a bug is listed as known in `sim.rs`, the default run
/// leaves its injection out; the invariants are never relaxed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Bug {
    /// A launch redelivered to a restarted node for a lease whose instance
    /// exists is answered `Failed`, so the plane frees a lease that runs.
    RelaunchAfterRestart,
    /// A mint whose reply is lost leaves a registration nobody removes.
    MintReplyLost,
    /// A custody entry whose lease the plane ended with the other outcome
    /// can never finish.
    ReleaseConflictWedgesCustody,
    /// Recover adopts the stray of a failed create as a live job: its idle
    /// runner is kept forever, or, if it exits, the lease is released and
    /// its registration left behind.
    RecoverAdoptsStray,
    /// A destroy without a completion (a scale-down of a runner GitHub's
    /// lagging listing shows idle) on a runner that has just taken its job:
    /// the removal is refused (JobStillRunning) and the node destroys the
    /// instance anyway, killing the job.
    ScaleDownKillsBusyRunner,
    /// A completion GitHub sends while the runner still works (an early
    /// completion): the node destroys the instance at once instead of
    /// letting the runner exit within a post-job grace.
    EarlyCompletionKillsRunner,
    /// A runner that exits before it takes a job (its container stays,
    /// exited): nothing reports it and GitHub never completes a job for it,
    /// so the node holds the lease, the exited container and the
    /// registration forever.
    ExitedRunnerUnnoticed,
    /// A held runner whose container is removed out of band before it takes
    /// a job: custody ends (the instance is gone) without removing its
    /// registration, which GitHub keeps, offline, for ever.
    VanishedIdleRunnerKeepsRegistration,
    /// A destroy without a completion whose registration removal fails
    /// (the plane or GitHub unreachable): the node destroys the instance
    /// anyway and answers OK, and the registration is left for ever.
    DestroyLeaksUnremovedRegistration,
    /// A Destroy answered custody marks the held entry for teardown in
    /// memory only: a restart before its next journal write holds the
    /// runner again as a job, and an idle one is kept for ever.
    DestroyForgottenAfterRestart,
    /// The warm pool hands a warm runner's room back after its destroy
    /// failed: the container still runs, and the ledger lends its room out
    /// again until a later look removes it.
    WarmRoomReleasedWhileRunning,
    /// A launch onto a warm runner whose bind is refused withholds the
    /// start, but the claimed runner already runs (waiting on its
    /// handoff); the node treats it as an instance never started, so when
    /// its destroy does not confirm the node answers without holding the
    /// lease, and the plane frees a lease whose container still runs.
    WithheldClaimLeftRunning,
}

/// Which known bugs' injections a run includes.
#[derive(Debug, Clone, Default)]
pub struct Gates {
    pub open: std::collections::BTreeSet<Bug>,
    /// What a reproduction line must set besides the seed.
    pub repro_env: String,
    /// A planted violation (tests of the checks only).
    pub sabotage: Option<Sabotage>,
}

impl Gates {
    fn allows(&self, bug: Bug) -> bool {
        self.open.contains(&bug)
    }
}

/// What one seed did.
#[derive(Debug)]
pub struct Outcome {
    pub steps: usize,
    /// A hash of every step's outcome, to compare two runs of one seed.
    pub trace: u64,
    pub stats: Stats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Step {
    NewJob,
    Complete,
    DeliverCompletion,
    DuplicateDestroy,
    AssumeCustody,
    Tend,
    Sweep,
    AdvanceSmall,
    AdvanceMedium,
    AdvanceLarge,
    ProviderFault,
    LedgerFault,
    LedgerDown,
    Slow,
    PlaneStall,
    RemoveBehindBack,
    InstanceExits,
    StraysExit,
    BackendCatchesUp,
    ForceRelease,
    Restart,
    Crash,
    LaunchForRunningRequest,
    LateLaunch,
    CancelJob,
    JournalFault,
    JobStarts,
    ScaleDown,
    EarlyCompletion,
    GithubNotices,
    RemovalAcceptedAtWork,
    RelaunchAtHigherEpoch,
    WarmTargets,
    WarmDies,
    WarmFault,
}

const STEPS: &[(Step, u64)] = &[
    (Step::NewJob, 14),
    (Step::Complete, 10),
    (Step::DeliverCompletion, 5),
    (Step::DuplicateDestroy, 2),
    (Step::AssumeCustody, 3),
    (Step::Tend, 10),
    (Step::Sweep, 6),
    (Step::AdvanceSmall, 10),
    (Step::AdvanceMedium, 4),
    (Step::AdvanceLarge, 1),
    (Step::ProviderFault, 8),
    (Step::LedgerFault, 7),
    (Step::LedgerDown, 2),
    (Step::Slow, 2),
    (Step::PlaneStall, 1),
    (Step::RemoveBehindBack, 2),
    (Step::InstanceExits, 1),
    (Step::StraysExit, 3),
    (Step::BackendCatchesUp, 3),
    (Step::ForceRelease, 2),
    (Step::Restart, 3),
    (Step::Crash, 3),
    (Step::LaunchForRunningRequest, 2),
    (Step::LateLaunch, 1),
    (Step::CancelJob, 1),
    (Step::JournalFault, 2),
    (Step::JobStarts, 8),
    (Step::ScaleDown, 2),
    (Step::EarlyCompletion, 2),
    (Step::GithubNotices, 2),
    (Step::RemovalAcceptedAtWork, 2),
    (Step::RelaunchAtHigherEpoch, 2),
    (Step::WarmTargets, 2),
    (Step::WarmDies, 2),
    (Step::WarmFault, 3),
];

/// How long the warm pool takes to come to rest once faults are off: past
/// its confirmation period (`warm::CONFIRM_EVERY`, 10 s), then the grace a
/// taken warm runner waits for its launch (`warm::TAKEN_GRACE`, 60 s), then
/// a turn. Real seconds of the pool's own clock, not `secs`.
const WARM_SETTLE: Duration = Duration::from_secs(75);

/// A quiescence round while a claimed runner waits on its handoff: forty
/// of them outlast the runner's start deadline (`RunnerOptions`' default,
/// 300 s, which the world does not scale) and the post-job grace after it.
const START_DEADLINE_ROUND: Duration = Duration::from_secs(30);

/// A few of the warm pool's turns (one a second, or at once when woken).
const WARM_TURNS: Duration = Duration::from_secs(3);

/// One process of the node: its warm pool and its runner, sharing what
/// the node knows of its images' freshness, as the server wires them. The
/// pool names its runners from a counter the world keeps across restarts,
/// so a seed replays with the same names in the same order.
fn new_node(
    provider: &Arc<SimProvider>,
    ledger: &Arc<FakeLedger>,
    journal: &Arc<SimJournal>,
    shared: &Arc<Shared>,
) -> (Arc<WarmPool>, Arc<Runner>) {
    let freshness = Arc::new(Freshness::default());
    let names = Arc::clone(shared);
    let pool = Arc::new(
        WarmPool::new(provider.clone(), ledger.clone(), freshness.clone()).with_names(move || {
            let mut c = names.lock();
            c.warm.named += 1;
            warm_name(c.warm.named)
        }),
    );
    let runner = Arc::new(
        Runner::new(
            provider.clone(),
            ledger.clone(),
            ledger.clone(),
            RunnerOptions {
                stray_grace: STRAY_GRACE,
                post_job_grace: POST_JOB_GRACE,
                stop_timeout: secs(10),
                ..RunnerOptions::default()
            },
        )
        .with_journal(journal.clone())
        .with_freshness(freshness)
        .with_warm(pool.clone()),
    );
    (pool, runner)
}

/// The `n`-th warm runner's name.
fn warm_name(n: u64) -> InstanceName {
    InstanceName::warm(&format!("billet_warm-{n:016x}")).expect("a warm runner's name")
}

fn tier() -> TierSpec {
    TierSpec {
        label: "sim".into(),
        image: "runner:sim".into(),
        command: vec!["/run.sh".into()],
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

fn kind(r: &Result<(), RunnerError>) -> &'static str {
    match r {
        Ok(()) => "ok",
        Err(RunnerError::Custody(_)) => "custody",
        Err(
            RunnerError::Failed(_)
            | RunnerError::ScaleSetNotFound(_)
            | RunnerError::RunnerNameTaken(_),
        ) => "failed",
        Err(
            RunnerError::Refused(_)
            | RunnerError::ImageUnavailable { .. }
            | RunnerError::RunnerOutdated(_)
            | RunnerError::ProviderUnavailable(_)
            | RunnerError::JournalUnwritable(_)
            | RunnerError::TierUnhealthy(_),
        ) => "refused",
        Err(RunnerError::Busy { held: true, .. }) => "busy (held)",
        Err(RunnerError::Busy { held: false, .. }) => "busy",
    }
}

fn name_of(lease: &LeaseId) -> String {
    InstanceName::for_lease(lease).as_str().to_owned()
}

/// The message of a task's panic.
fn panic_text(e: tokio::task::JoinError) -> String {
    let payload = e.into_panic();
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| (*s).to_owned()))
        .unwrap_or_else(|| "a panic without a message".to_owned())
}

/// Runs `f` unless the armed crash strikes first, in which case `f` (and
/// with it whatever the node was doing) is dropped mid-call.
async fn guarded<F: Future>(shared: &Shared, f: F) -> Option<F::Output> {
    let crashed = shared.crash.notified();
    tokio::pin!(crashed);
    tokio::pin!(f);
    tokio::select! {
        biased;
        () = &mut crashed => None,
        out = &mut f => Some(out),
    }
}

/// The simulated world of one seed.
pub struct World {
    seed: u64,
    rng: Rng,
    verbose: bool,
    step: usize,
    shared: Arc<Shared>,
    fake: Arc<FakeProvider>,
    provider: Arc<SimProvider>,
    ledger: Arc<FakeLedger>,
    journal: Arc<SimJournal>,
    runner: Arc<Runner>,
    keep_alive: Option<JoinHandle<()>>,
    next_request: i64,
    delivered: Vec<(LeaseId, &'static str)>,
    recent: VecDeque<String>,
    trace: u64,
    heal_down_at: Option<usize>,
    heal_slow_at: Option<usize>,
    heal_stall_at: Option<usize>,
    /// When GitHub stops accepting the removal of a runner at work.
    heal_removal_at: Option<usize>,
    stats: Stats,
    gates: Gates,
    /// Scale-downs the node refused or failed, which the plane sends again.
    scale_down_retry: Vec<(LeaseId, RequestId)>,
    /// Leases the plane sent a scale-down for.
    scaled_down: std::collections::BTreeSet<LeaseId>,
    /// Leases whose scale-down the node answered custody (it holds them
    /// for teardown).
    held_for_teardown: std::collections::BTreeSet<LeaseId>,
    /// The plane's background task.
    plane_task: Option<JoinHandle<()>>,
    /// The node's warm pool, its task and what stops that gracefully.
    pool: Arc<WarmPool>,
    pool_task: Option<JoinHandle<()>>,
    pool_shutdown: CancellationToken,
    /// The warm runners the plane last stated, stated again to a restarted
    /// node (the plane does on every new session).
    warm_targets: Vec<WarmTarget>,
}

impl World {
    fn new(seed: u64, verbose: bool, gates: Gates) -> Self {
        let fake = Arc::new(FakeProvider::new());
        let shared = Shared::new(Core::new(Arc::clone(&fake), verbose));
        let provider = Arc::new(SimProvider {
            fake: Arc::clone(&fake),
            shared: Arc::clone(&shared),
        });
        let ledger = Arc::new(FakeLedger(Arc::clone(&shared)));
        let journal = Arc::new(SimJournal::default());
        let (pool, runner) = new_node(&provider, &ledger, &journal, &shared);
        shared.lock().withheld_claim_faults = gates.allows(Bug::WithheldClaimLeftRunning);
        let mut world = Self {
            seed,
            rng: Rng::new(seed),
            verbose,
            step: 0,
            shared,
            fake,
            provider,
            ledger,
            journal,
            runner,
            keep_alive: None,
            next_request: 100,
            delivered: Vec::new(),
            recent: VecDeque::new(),
            trace: 0xcbf2_9ce4_8422_2325,
            heal_down_at: None,
            heal_slow_at: None,
            heal_stall_at: None,
            heal_removal_at: None,
            stats: Stats::new(),
            gates,
            scale_down_retry: Vec::new(),
            scaled_down: std::collections::BTreeSet::new(),
            held_for_teardown: std::collections::BTreeSet::new(),
            plane_task: None,
            pool,
            pool_task: None,
            pool_shutdown: CancellationToken::new(),
            warm_targets: Vec::new(),
        };
        world.spawn_keep_alive();
        world.spawn_pool();
        let plane = Arc::clone(&world.shared);
        let panics = world.gates.sabotage == Some(Sabotage::PanicInPlaneTask);
        world.plane_task = Some(tokio::spawn(async move {
            loop {
                let next = plane.lock().plane_next();
                tokio::time::sleep_until(next).await;
                assert!(!panics, "sabotage: the plane's task panics");
                plane.lock().plane_tick();
            }
        }));
        if world.gates.sabotage == Some(Sabotage::PanicInDetachedTask) {
            // Detached on purpose: only the panic hook's record can see it.
            drop(tokio::spawn(async {
                tokio::time::sleep(secs(10)).await;
                panic!("sabotage: a detached task panics");
            }));
        }
        world
    }

    fn spawn_keep_alive(&mut self) {
        let runner = Arc::clone(&self.runner);
        let cancel = tokio_util::sync::CancellationToken::new();
        self.keep_alive = Some(tokio::spawn(async move { runner.keep_alive(cancel).await }));
    }

    fn spawn_pool(&mut self) {
        self.pool_shutdown = CancellationToken::new();
        let pool = Arc::clone(&self.pool);
        self.pool_task = Some(tokio::spawn(pool.run(self.pool_shutdown.clone())));
    }

    /// Ends the warm pool's task: `graceful`, as a node that shuts down
    /// (it retires what it holds), else as a process killed mid-call.
    async fn stop_pool(&mut self, graceful: bool) {
        let Some(mut handle) = self.pool_task.take() else {
            return;
        };
        let ended = if graceful {
            self.pool_shutdown.cancel();
            match tokio::time::timeout(secs(600), &mut handle).await {
                Ok(ended) => ended,
                Err(_) => {
                    handle.abort();
                    handle.await
                }
            }
        } else {
            handle.abort();
            handle.await
        };
        if let Err(e) = ended
            && e.is_panic()
        {
            self.fail(&format!(
                "a task panicked: the warm pool: {}",
                panic_text(e)
            ));
        }
    }

    fn count(&mut self, what: &'static str) {
        *self.stats.entry(what).or_default() += 1;
    }

    /// Records a step's outcome: `hashed` goes into the trace, `detail`
    /// (which may carry error text in an order the runner chose) only into
    /// the log.
    fn note(&mut self, hashed: String, detail: Option<String>) {
        for b in hashed.bytes() {
            self.trace = (self.trace ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
        let line = match detail {
            Some(d) if self.verbose => format!("{hashed}: {d}"),
            _ => hashed,
        };
        if self.verbose {
            let events = std::mem::take(&mut self.shared.lock().events);
            log_line(&format!("[seed {} step {}] {line}", self.seed, self.step));
            for e in &events {
                log_line(&format!("      {e}"));
            }
        }
        if self.recent.len() == 12 {
            self.recent.pop_front();
        }
        self.recent.push_back(line);
    }

    fn fail(&self, what: &str) -> ! {
        let recent: Vec<&str> = self.recent.iter().map(String::as_str).collect();
        panic!(
            "seed {} step {}: {what}\n  last steps: {}\n  reproduce: {}BILLET_SIM_SEED={} cargo test -p billet-agent --test sim",
            self.seed,
            self.step,
            recent.join(" | "),
            self.gates.repro_env,
            self.seed
        );
    }

    fn next_request(&mut self) -> RequestId {
        self.next_request += 1;
        RequestId(self.next_request)
    }

    async fn restart(&mut self, why: &str) {
        if let Some(handle) = self.keep_alive.take() {
            handle.abort();
            if let Err(e) = handle.await
                && e.is_panic()
            {
                self.fail(&format!("a task panicked: KeepAlive: {}", panic_text(e)));
            }
        }
        let graceful = why == "restart" && self.rng.chance(50);
        self.stop_pool(graceful).await;
        {
            let mut c = self.shared.lock();
            c.crashed = false;
            c.crash = None;
            // The next process's pool retires every warm runner it finds,
            // whatever room the last one handed back.
            c.warm.released_running.clear();
        }
        // Forget a crash signal nobody consumed.
        let _ = self.shared.crash.notified().now_or_never();
        let downtime = if self.rng.chance(30) {
            secs(self.rng.range(5, 240))
        } else {
            Duration::ZERO
        };
        if !downtime.is_zero() {
            tokio::time::sleep(downtime).await;
        }
        (self.pool, self.runner) =
            new_node(&self.provider, &self.ledger, &self.journal, &self.shared);
        self.spawn_keep_alive();
        self.spawn_pool();
        // The plane states its warm runners on the node's new session.
        self.pool.set_targets(self.warm_targets.clone());
        self.count("restarts");
        self.note(
            format!("restart ({why}), down {}ms", downtime.as_millis()),
            None,
        );
        self.recover().await;
    }

    /// Start-up recovery, before any command reaches the runner; retried
    /// (as the session does) until it succeeds. Each failed attempt counts
    /// as a step, so timed faults heal.
    async fn recover(&mut self) {
        for _ in 0..200 {
            let runner = Arc::clone(&self.runner);
            match guarded(&self.shared, runner.recover()).await {
                Some(Ok(())) => {
                    self.note("recover -> ok".into(), None);
                    return;
                }
                Some(Err(e)) => {
                    self.count("recover failed (retried)");
                    self.note("recover -> failed".into(), Some(e.to_string()));
                }
                None => {
                    let mut c = self.shared.lock();
                    c.crashed = false;
                    c.crash = None;
                }
            }
            self.check();
            self.step += 1;
            self.heal();
            tokio::time::sleep(secs(5)).await;
        }
        self.fail("liveness: start-up recovery never succeeded in 200 attempts; the node would take no work");
    }

    // ----- the plane -----

    fn on_launch_result(&mut self, lease: &LeaseId, r: &Result<(), RunnerError>, minted: bool) {
        let mut c = self.shared.lock();
        match r {
            Ok(()) => {}
            Err(e) if e.is_custody() => c.unmanage(lease),
            Err(_) => {
                let epoch = c.plane.get(lease).map(|p| p.epoch);
                c.plane_release(lease, epoch, Phase::Failed, "plane after a failed launch");
                if minted {
                    c.plane_remove_registration(lease);
                }
            }
        }
    }

    /// The plane stops waiting for a launch's result. One whose
    /// registration it minted before dispatch is the plane's to end
    /// while no node has bound it (the stub's `release_unbound`): the
    /// node starts nothing before its bind holds. Any other is the
    /// node's from now on.
    fn give_up_on_launch(&mut self, lease: &LeaseId, minted: bool) {
        let mut c = self.shared.lock();
        if minted && !c.bound(lease) {
            let epoch = c.plane.get(lease).map(|p| p.epoch);
            c.plane_release(
                lease,
                epoch,
                Phase::Failed,
                "plane after a lost, unbound launch",
            );
            c.plane_remove_registration(lease);
        } else {
            c.unmanage(lease);
        }
    }

    async fn launch(&mut self, lease: LeaseId, what: &'static str) {
        // Half the launches carry the registration the plane minted before
        // dispatching them, as the stub plane sends to a node that takes
        // one; the rest are minted by the node, as for an older plane.
        let registration = if self.rng.chance(50) {
            let minted = {
                let mut c = self.shared.lock();
                let epoch = c.plane[&lease].epoch;
                c.mint_ahead(&lease, epoch)
            };
            match minted {
                Ok(r) => Some(r),
                Err(e) => {
                    self.note(
                        format!("{what} {lease}: the plane cannot mint"),
                        Some(e.to_string()),
                    );
                    let mut c = self.shared.lock();
                    let epoch = c.plane.get(&lease).map(|p| p.epoch);
                    c.plane_release(&lease, epoch, Phase::Failed, "plane after a failed mint");
                    return;
                }
            }
        } else {
            None
        };
        self.send_launch(lease, what, registration).await;
    }

    /// The plane reserves a lease for `request` on the node, mostly onto a
    /// warm runner's room when one is charged (as the stub does), and
    /// launches it; a node without room gets nothing.
    async fn reserve_and_launch(&mut self, request: RequestId, what: &'static str) {
        let take_warm = self.rng.chance(80);
        let reserved = self.shared.lock().reserve(request, take_warm);
        match reserved {
            Some(lease) => self.launch(lease, what).await,
            None => {
                self.count("no room for a lease");
                self.note(
                    format!("plane: no room on the node for request {request}"),
                    None,
                );
            }
        }
    }

    async fn send_launch(
        &mut self,
        lease: LeaseId,
        what: &'static str,
        registration: Option<billet_agent::model::Registration>,
    ) {
        let minted = registration.is_some();
        let (request, epoch, mut warm, named) = {
            let c = self.shared.lock();
            let p = &c.plane[&lease];
            (p.request, p.epoch, p.warm.clone(), c.warm.named)
        };
        if warm.is_none() && named > 0 && self.rng.chance(5) {
            // A plane whose view of the node's warm runners is stale names
            // one that is gone.
            let stale = warm_name(self.rng.range(1, named));
            if self.fake.instance(stale.as_str()).is_none() {
                self.count("launches naming a warm runner that is gone");
                warm = Some(stale);
            }
        }
        let (command, job) = assigned(&lease, epoch, request);
        let runner = Arc::clone(&self.runner);
        let Some(r) = guarded(
            &self.shared,
            runner.launch_onto(command, tier(), job, registration.clone(), warm.clone()),
        )
        .await
        else {
            self.count("crash mid-launch");
            self.note(
                format!("{what} {lease} (request {request}): node crashed mid-launch"),
                None,
            );
            self.restart("crash").await;
            if self.rng.chance(50) && self.gates.allows(Bug::RelaunchAfterRestart) {
                // The plane was still waiting: it redelivers the command to
                // the new process, which has no record of it.
                self.count("launch redelivered after a restart");
                Box::pin(self.send_launch(lease, "redelivered launch", registration)).await;
            } else {
                self.give_up_on_launch(&lease, minted);
                self.note(format!("plane gives up on {lease}"), None);
            }
            return;
        };
        let name = name_of(&lease);
        // Only a runner GitHub still has a registration for can take a job.
        let idle = {
            let c = self.shared.lock();
            c.jobs.get(&name) == Some(&Job::Idle) && c.regs.contains_key(&name)
        };
        if idle && self.fake.instance(&name).is_some() && self.rng.chance(70) {
            // Most runners take their job at once; the rest wait for
            // `Step::JobStarts`.
            self.shared.lock().job_starts(&name);
        }
        *self
            .stats
            .entry(match kind(&r) {
                "ok" => "launch ok",
                "custody" => "launch custody",
                "failed" => "launch failed",
                _ => "launch refused",
            })
            .or_default() += 1;
        let onto = warm.map(|w| format!(" naming {w}")).unwrap_or_default();
        self.note(
            format!("{what} {lease} (request {request}){onto} -> {}", kind(&r)),
            r.as_ref().err().map(ToString::to_string),
        );
        if self.rng.chance(8) {
            // The session broke before the result was acknowledged.
            self.count("launch reply lost");
            if self.rng.chance(50) {
                // Redelivered on the next session, answered from the slot's
                // record: the plane learns the real result.
                self.on_launch_result(&lease, &r, minted);
                self.note(format!("{lease}: result replayed to the plane"), None);
            } else {
                self.give_up_on_launch(&lease, minted);
                self.note(
                    format!("{lease}: result lost; the plane gives up on it"),
                    None,
                );
            }
            if r.is_ok() && self.rng.chance(80) {
                // The node's session puts an unacknowledged success into custody.
                let out =
                    guarded(&self.shared, runner.assume_custody(&lease, epoch, request)).await;
                match out {
                    Some(r) => self.note(
                        format!("node assumes custody of {lease} -> {}", kind(&r)),
                        r.err().map(|e| e.to_string()),
                    ),
                    None => self.restart("crash").await,
                }
            }
        } else {
            self.on_launch_result(&lease, &r, minted);
        }
    }

    async fn deliver(&mut self, lease: LeaseId, result: &'static str, duplicate: bool) {
        let (request, ended) = {
            let c = self.shared.lock();
            let row = &c.leases[&lease];
            (row.request, row.phase.is_terminal())
        };
        let pending = |c: &mut Core| {
            c.completions.remove(&(lease.clone(), result));
        };
        if ended && !duplicate {
            // The plane skips completions of leases that have ended.
            pending(&mut self.shared.lock());
            self.note(format!("completion of {lease}: lease ended, skipped"), None);
            return;
        }
        let runner = Arc::clone(&self.runner);
        let what = if duplicate {
            "duplicate destroy"
        } else {
            "destroy"
        };
        // The plane drops a scale-down of a runner whose job completed.
        self.scale_down_retry.retain(|(l, _)| *l != lease);
        let order = DestroyOrder::completion(result);
        let Some(r) = guarded(&self.shared, runner.destroy(request, &order)).await else {
            self.count("crash mid-destroy");
            self.note(
                format!("{what} request {request} ({lease}): node crashed"),
                None,
            );
            self.restart("crash").await;
            return;
        };
        self.count(match kind(&r) {
            "ok" => "destroy ok",
            "custody" => "destroy custody",
            "busy (held)" => "destroy busy, held (runner still works)",
            _ => "destroy failed",
        });
        self.note(
            format!(
                "{what} request {request} ({lease}, {result}) -> {}",
                kind(&r)
            ),
            r.as_ref().err().map(ToString::to_string),
        );
        if !duplicate && self.rng.chance(6) {
            self.count("destroy reply lost");
            self.note(
                format!("{lease}: destroy result lost; plane will redeliver"),
                None,
            );
            return;
        }
        let mut c = self.shared.lock();
        match r {
            Ok(()) => {
                pending(&mut c);
                if !duplicate {
                    self.delivered.push((lease.clone(), result));
                }
                c.plane_release(
                    &lease,
                    None,
                    Phase::Done,
                    "plane after a completion's destroy",
                );
            }
            Err(e) if e.is_custody() => {
                pending(&mut c);
                c.unmanage(&lease);
            }
            Err(_) => {}
        }
    }

    /// The plane scales down a runner its listing shows idle: a destroy
    /// without a completion and without authority. GitHub's busy flag lags
    /// behind job start, so the runner may have just taken its job; the
    /// removal is then refused, and the node must keep the runner.
    async fn scale_down(&mut self) {
        let lagging = self.gates.allows(Bug::ScaleDownKillsBusyRunner);
        let candidates: Vec<(LeaseId, RequestId)> = {
            let c = self.shared.lock();
            c.regs
                .iter()
                .filter(|(_, r)| !r.busy && (lagging || !r.job))
                .filter(|(n, _)| self.fake.instance(n).is_some_and(|i| may_run(&i)))
                .filter_map(|(_, r)| {
                    c.leases
                        .get(&r.lease)
                        .filter(|row| !row.phase.is_terminal())
                        .map(|row| (row.id.clone(), row.request))
                })
                .collect()
        };
        let Some((lease, request)) = self.rng.pick(&candidates) else {
            return;
        };
        if !self.gates.allows(Bug::DestroyLeaksUnremovedRegistration) {
            let c = self.shared.lock();
            if c.faults.ledger_down
                || c.faults
                    .lease
                    .get(&(lease.clone(), LOp::RemoveRunner))
                    .is_some_and(|q| !q.is_empty())
            {
                return;
            }
        }
        self.count("scale-downs");
        self.scale_down_one(lease, request).await;
    }

    /// The plane scales down a runner that has just taken its job, its
    /// listing still showing it idle: the removal GitHub may then accept
    /// (`Faults::removal_ignores_job`) is the node's only word from GitHub,
    /// and the runner's job process must keep it.
    async fn scale_down_at_work(&mut self) {
        let candidates: Vec<(LeaseId, RequestId)> = {
            let c = self.shared.lock();
            c.regs
                .iter()
                .filter(|(n, r)| r.job && !r.busy && c.jobs.get(*n) == Some(&Job::Live))
                .filter(|(n, _)| self.fake.instance(n).is_some_and(|i| may_run(&i)))
                .filter_map(|(_, r)| {
                    c.leases
                        .get(&r.lease)
                        .filter(|row| !row.phase.is_terminal())
                        .map(|row| (row.id.clone(), row.request))
                })
                .collect()
        };
        if let Some((lease, request)) = self.rng.pick(&candidates) {
            self.count("scale-downs of a runner at work");
            self.scale_down_one(lease, request).await;
        }
    }

    /// The plane dispatches a Launch for a lease whose runner works on the
    /// node, at the epoch after the one the node holds it at (the plane
    /// believes something false about the lease). The node answers BUSY
    /// and starts nothing; the plane, as the stub's `launch_ended` does,
    /// leaves the lease open and covered by the working runner, records no
    /// failure and removes no registration. Any other answer is handled as
    /// the stub handles it (a failure ends the lease), so a runner left
    /// running under it breaks invariant (3), and a second mint or create
    /// invariant (5).
    async fn relaunch_at_higher_epoch(&mut self) {
        let candidates: Vec<(LeaseId, Epoch, RequestId)> = {
            let c = self.shared.lock();
            self.runner
                .held()
                .into_iter()
                .filter(|h| c.jobs.get(h.instance.as_str()) == Some(&Job::Live))
                .filter_map(|h| {
                    c.plane
                        .get(&h.lease)
                        .map(|p| (h.lease.clone(), h.epoch, p.request))
                })
                .collect()
        };
        let Some((lease, held, request)) = self.rng.pick(&candidates) else {
            return;
        };
        let epoch = Epoch(held.0 + 1);
        let (command, job) = assigned(&lease, epoch, request);
        let runner = Arc::clone(&self.runner);
        let Some(r) = guarded(&self.shared, runner.launch_with(command, tier(), job, None)).await
        else {
            self.note(
                format!("plane: launch {lease} at epoch {epoch}: node crashed"),
                None,
            );
            self.restart("crash").await;
            return;
        };
        self.count(match kind(&r) {
            "busy" => "relaunch at a higher epoch answered busy",
            "custody" => "relaunch at a higher epoch answered custody",
            "ok" => "relaunch at a higher epoch answered ok",
            _ => "relaunch at a higher epoch failed or refused",
        });
        self.note(
            format!(
                "plane: launch {lease} (request {request}) at epoch {epoch}, its runner working at {held} -> {}",
                kind(&r)
            ),
            r.as_ref().err().map(ToString::to_string),
        );
        let mut c = self.shared.lock();
        match r {
            // Launched, or BUSY: the working runner covers the lease.
            Ok(()) | Err(RunnerError::Busy { held: false, .. }) => {}
            Err(e) if e.is_custody() => c.unmanage(&lease),
            Err(_) => c.plane_release(&lease, None, Phase::Failed, "plane after a failed launch"),
        }
    }

    async fn scale_down_one(&mut self, lease: LeaseId, request: RequestId) {
        self.scaled_down.insert(lease.clone());
        let runner = Arc::clone(&self.runner);
        let order = DestroyOrder::scale_down();
        let Some(r) = guarded(&self.shared, runner.destroy(request, &order)).await else {
            self.note(
                format!("plane: scale down request {request} ({lease}): node crashed"),
                None,
            );
            self.restart("crash").await;
            return;
        };
        self.note(
            format!(
                "plane: scale down request {request} ({lease}) -> {}",
                kind(&r)
            ),
            r.as_ref().err().map(ToString::to_string),
        );
        let mut c = self.shared.lock();
        match r {
            Ok(()) => c.plane_release(&lease, None, Phase::Done, "plane after a scale-down"),
            Err(e) if e.is_custody() => {
                c.unmanage(&lease);
                drop(c);
                self.held_for_teardown.insert(lease);
            }
            // Refused or failed: the plane asks again later.
            Err(_) => {
                drop(c);
                if !self.scale_down_retry.contains(&(lease.clone(), request)) {
                    self.scale_down_retry.push((lease, request));
                }
            }
        }
    }

    /// Whether a restart now could lose a teardown the node promised (a
    /// known bug, left out of the default run while listed).
    fn teardown_would_be_forgotten(&mut self) -> bool {
        if self.gates.allows(Bug::DestroyForgottenAfterRestart) {
            return false;
        }
        let fake = Arc::clone(&self.fake);
        self.held_for_teardown
            .retain(|lease| fake.instance(&name_of(lease)).is_some());
        !self.held_for_teardown.is_empty()
    }

    // ----- GitHub and the instances -----

    /// A runner's container exits and stays, as Docker keeps it: present,
    /// not running, with its exit code and OOM flag.
    fn exit(&self, name: &str, exit: Exit) {
        if exit.code == 0 {
            self.shared.lock().clean_exits.insert(name.to_owned());
        }
        self.fake.exit(name, exit.code, exit.oom_killed);
    }

    fn complete_job(&mut self, name: &str) {
        // An ephemeral runner exits after its job; its container stays
        // (exited 0) unless something removes it.
        let remove = self.rng.chance(20);
        if remove {
            self.fake.remove_behind_back(name);
        } else {
            // Sometimes a step of the job was OOM-killed inside the
            // container and the runner went on: Docker marks the container
            // OOM-killed all the same, exit 0.
            let oom_killed = self.rng.chance(10);
            self.exit(
                name,
                Exit {
                    code: 0,
                    oom_killed,
                },
            );
        }
        self.shared
            .lock()
            .job_ends(name, Job::Completed, "succeeded");
        self.count("jobs completed");
        self.note(
            format!(
                "github: job on {name} completes; the runner exits ({})",
                if remove { "removed" } else { "exited 0" }
            ),
            None,
        );
    }

    /// Instances whose runner may run and is in `job`.
    fn runners_in(&self, job: Job) -> Vec<String> {
        let c = self.shared.lock();
        c.jobs
            .iter()
            .filter(|(n, j)| **j == job && self.fake.instance(n).is_some_and(|i| may_run(&i)))
            .map(|(n, _)| n.clone())
            .collect()
    }

    fn live_jobs(&self) -> Vec<String> {
        self.runners_in(Job::Live)
    }

    /// Idle runners take their jobs (all of them, or each by chance).
    fn jobs_start(&mut self, all: bool) {
        // A runner the plane scaled down whose registration is not yet
        // removed can still take a job; the node then destroys it once
        // GitHub refuses the removal, a known bug.
        let after_scale_down = self.gates.allows(Bug::ScaleDownKillsBusyRunner);
        for name in self.runners_in(Job::Idle) {
            if !self.shared.lock().regs.contains_key(&name) {
                continue;
            }
            let lease = InstanceName::lease(&name).expect("billet name");
            if !after_scale_down && self.scaled_down.contains(&lease) {
                continue;
            }
            if all || self.rng.chance(50) {
                self.shared.lock().job_starts(&name);
                self.count("jobs started");
                self.note(format!("github: {name} takes its job"), None);
            }
        }
    }

    /// Runners still working after an early completion finish and exit.
    fn finishing_exit(&mut self, all: bool) {
        for name in self.runners_in(Job::Finishing) {
            if all || self.rng.chance(50) {
                self.exit(
                    &name,
                    Exit {
                        code: 0,
                        oom_killed: false,
                    },
                );
                let mut c = self.shared.lock();
                c.jobs.insert(name.clone(), Job::Completed);
                c.finishing.remove(&name);
                drop(c);
                self.note(
                    format!("{name}: finishes its post-job work and exits 0"),
                    None,
                );
            }
        }
    }

    /// GitHub notices runners that died mid-job (their connection is gone):
    /// it fails the job, retires the registration and reports the
    /// completion.
    fn github_notices(&mut self) {
        let lost: Vec<String> = {
            let c = self.shared.lock();
            c.regs
                .iter()
                .filter(|(n, r)| {
                    r.job
                        && c.jobs.get(*n) == Some(&Job::Dead)
                        && self.fake.instance(n).is_none_or(|i| !may_run(&i))
                })
                .map(|(n, _)| n.clone())
                .collect()
        };
        for name in lost {
            self.shared.lock().job_ends(&name, Job::Dead, "failed");
            self.count("lost runners noticed by GitHub");
            self.note(
                format!("github: notices {name} is lost; fails its job"),
                None,
            );
        }
    }

    fn strays_exit(&mut self, all: bool) {
        let strays: Vec<String> = {
            let c = self.shared.lock();
            self.fake
                .instances()
                .into_iter()
                .filter(|i| {
                    // A warm runner, or one claimed and never handed its
                    // config, waits on its handoff and never exits for
                    // want of a registration.
                    may_run(i)
                        && !is_warm(&i.name)
                        && !c.warm.waiting.contains(&i.name)
                        && !matches!(c.jobs.get(&i.name), Some(Job::Live | Job::Finishing))
                        && !c.regs.contains_key(&i.name)
                })
                .map(|i| i.name)
                .collect()
        };
        for name in strays {
            if all || self.rng.chance(50) {
                // A runner whose registration is gone cannot connect: it exits.
                self.exit(
                    &name,
                    Exit {
                        code: 1,
                        oom_killed: false,
                    },
                );
                self.note(
                    format!("{name}: a runner without a registration exits 1"),
                    None,
                );
            }
        }
    }

    fn backend_catches_up(&mut self) {
        let pending: Vec<String> = self.shared.lock().pending_removal.iter().cloned().collect();
        for name in pending {
            self.fake.remove_behind_back(&name);
            self.shared.lock().gone(&name);
            self.note(
                format!("backend: the requested removal of {name} completes"),
                None,
            );
        }
        self.shared.lock().busy_catches_up();
    }

    // ----- steps -----

    fn heal(&mut self) {
        let step = self.step;
        let mut c = self.shared.lock();
        if self.heal_down_at.is_some_and(|s| s <= step) {
            self.heal_down_at = None;
            c.faults.ledger_down = false;
        }
        if self.heal_slow_at.is_some_and(|s| s <= step) {
            self.heal_slow_at = None;
            c.faults.slow_ledger = None;
            c.faults.slow_provider = None;
        }
        if self.heal_stall_at.is_some_and(|s| s <= step) {
            self.heal_stall_at = None;
            c.faults.plane_stalled = false;
        }
        if self.heal_removal_at.is_some_and(|s| s <= step) {
            self.heal_removal_at = None;
            c.faults.removal_ignores_job = false;
        }
    }

    async fn run_step(&mut self, step: Step) {
        let runner = Arc::clone(&self.runner);
        match step {
            Step::NewJob => {
                let request = self.next_request();
                self.reserve_and_launch(request, "launch").await;
            }
            Step::Complete => {
                self.finishing_exit(false);
                let live = self.live_jobs();
                if let Some(name) = self.rng.pick(&live) {
                    self.complete_job(&name);
                    if self.rng.chance(70) {
                        let lease = InstanceName::lease(&name).expect("billet name");
                        self.deliver(lease, "succeeded", false).await;
                    }
                }
            }
            Step::DeliverCompletion => {
                let pending: Vec<_> = self.shared.lock().completions.iter().cloned().collect();
                if let Some((lease, result)) = self.rng.pick(&pending) {
                    self.deliver(lease, result, false).await;
                }
            }
            Step::DuplicateDestroy => {
                if let Some((lease, result)) = self.rng.pick(&self.delivered.clone()) {
                    self.count("duplicate destroys");
                    self.deliver(lease, result, true).await;
                }
            }
            Step::AssumeCustody => {
                let candidates: Vec<(LeaseId, Epoch, RequestId)> = {
                    let c = self.shared.lock();
                    c.plane
                        .iter()
                        .filter(|(id, _)| {
                            let row = &c.leases[*id];
                            row.bound && !row.phase.is_terminal()
                        })
                        .map(|(id, p)| (id.clone(), p.epoch, p.request))
                        .collect()
                };
                if let Some((lease, epoch, request)) = self.rng.pick(&candidates) {
                    self.shared.lock().unmanage(&lease);
                    self.count("assume custody");
                    match guarded(&self.shared, runner.assume_custody(&lease, epoch, request)).await
                    {
                        Some(r) => self.note(
                            format!("plane: assume custody of {lease} -> {}", kind(&r)),
                            r.err().map(|e| e.to_string()),
                        ),
                        None => self.restart("crash").await,
                    }
                }
            }
            Step::Tend => {
                // Time may pass inside a tend only while it tends at most one
                // entry: it visits entries in the runner's `HashMap` order, so
                // with two, what the clock (or a crash) reaches first would
                // differ from run to run.
                let one = self.runner.custody_leases().len() <= 1;
                if one && self.rng.chance(30) {
                    let d = secs(self.rng.range(1, 60));
                    self.shared.lock().faults.inside_tend = Some(d);
                    self.count("slow tends");
                    self.note(
                        format!(
                            "fault: every call of the next tend takes {}ms",
                            d.as_millis()
                        ),
                        None,
                    );
                }
                let out = guarded(&self.shared, runner.tend()).await;
                self.shared.lock().faults.inside_tend = None;
                match out {
                    Some(r) => {
                        self.count("tends");
                        self.note(
                            format!("tend -> {}", kind(&r)),
                            r.err().map(|e| e.to_string()),
                        );
                    }
                    None => {
                        self.count("crash mid-tend");
                        self.note("tend: node crashed".into(), None);
                        self.restart("crash").await;
                    }
                }
            }
            Step::Sweep => match guarded(&self.shared, runner.sweep()).await {
                Some(r) => {
                    self.count("sweeps");
                    self.note(
                        format!("sweep -> {}", kind(&r)),
                        r.err().map(|e| e.to_string()),
                    );
                }
                None => {
                    self.note("sweep: node crashed".into(), None);
                    self.restart("crash").await;
                }
            },
            Step::AdvanceSmall | Step::AdvanceMedium | Step::AdvanceLarge => {
                let n = match step {
                    Step::AdvanceSmall => self.rng.range(1, 30),
                    Step::AdvanceMedium => self.rng.range(30, 180),
                    _ => self.rng.range(180, 720),
                };
                tokio::time::sleep(secs(n)).await;
                self.note(format!("time passes: {n}s"), None);
            }
            Step::ProviderFault => self.arm_provider_fault(),
            Step::LedgerFault => self.arm_ledger_fault(),
            Step::LedgerDown => {
                let steps = self.rng.range(1, 6) as usize;
                self.heal_down_at = Some(self.step + steps);
                self.shared.lock().faults.ledger_down = true;
                self.count("plane unreachable");
                self.note(
                    format!("fault: the plane is unreachable for {steps} steps"),
                    None,
                );
            }
            Step::Slow => {
                let steps = self.rng.range(1, 8) as usize;
                self.heal_slow_at = Some(self.step + steps);
                let ledger = secs(self.rng.range(1, 20));
                let provider = secs(self.rng.range(1, 60));
                let (l, p) = match self.rng.below(3) {
                    0 => (Some(ledger), None),
                    1 => (None, Some(provider)),
                    _ => (Some(ledger), Some(provider)),
                };
                {
                    let mut c = self.shared.lock();
                    c.faults.slow_ledger = l;
                    c.faults.slow_provider = p;
                }
                self.count("slow periods");
                self.note(
                    format!("fault: slow ledger {l:?}, provider {p:?} for {steps} steps"),
                    None,
                );
            }
            Step::PlaneStall => {
                let steps = self.rng.range(1, 10) as usize;
                self.heal_stall_at = Some(self.step + steps);
                self.shared.lock().faults.plane_stalled = true;
                self.count("plane renewal stalls");
                self.note(
                    format!("fault: the plane stops renewing for {steps} steps"),
                    None,
                );
            }
            Step::RemoveBehindBack => {
                let idle_too = self.gates.allows(Bug::VanishedIdleRunnerKeepsRegistration);
                let names: Vec<String> = {
                    let c = self.shared.lock();
                    self.fake
                        .instances()
                        .into_iter()
                        .filter(|i| !is_warm(&i.name))
                        .filter(|i| {
                            idle_too
                                || c.jobs.get(&i.name) != Some(&Job::Idle)
                                || !c.regs.contains_key(&i.name)
                        })
                        .map(|i| i.name)
                        .collect()
                };
                if let Some(name) = self.rng.pick(&names) {
                    self.fake.remove_behind_back(&name);
                    self.shared.lock().gone(&name);
                    self.count("removed behind the back");
                    self.note(
                        format!("fault: {name} removed behind the node's back"),
                        None,
                    );
                }
            }
            Step::InstanceExits => {
                // The runner dies and its container stays, exited. GitHub
                // learns of a lost job only later (`Step::GithubNotices`);
                // a runner that had no job yet is never reported at all.
                let idle_too = self.gates.allows(Bug::ExitedRunnerUnnoticed);
                let names: Vec<String> = {
                    let c = self.shared.lock();
                    self.fake
                        .instances()
                        .into_iter()
                        .filter(may_run)
                        .filter(|i| !is_warm(&i.name))
                        .filter(|i| {
                            idle_too
                                || c.jobs.get(&i.name) != Some(&Job::Idle)
                                || !c.regs.contains_key(&i.name)
                        })
                        .map(|i| i.name)
                        .collect()
                };
                if let Some(name) = self.rng.pick(&names) {
                    let exit = if self.rng.chance(30) {
                        Exit {
                            code: 137,
                            oom_killed: true,
                        }
                    } else {
                        Exit {
                            code: 1,
                            oom_killed: false,
                        }
                    };
                    self.exit(&name, exit);
                    let mut c = self.shared.lock();
                    match c.jobs.get(&name) {
                        Some(Job::Live) => {
                            c.jobs.insert(name.clone(), Job::Dead);
                        }
                        Some(Job::Finishing) => {
                            c.jobs.insert(name.clone(), Job::Completed);
                            c.finishing.remove(&name);
                        }
                        _ => {}
                    }
                    drop(c);
                    self.count("runners died, container kept");
                    self.note(
                        format!("fault: the runner in {name} dies; its container stays ({exit:?})"),
                        None,
                    );
                }
            }
            Step::JobStarts => self.jobs_start(false),
            Step::GithubNotices => self.github_notices(),
            Step::ScaleDown => self.scale_down().await,
            Step::RemovalAcceptedAtWork => {
                let steps = self.rng.range(1, 8) as usize;
                self.heal_removal_at = Some(self.step + steps);
                self.shared.lock().faults.removal_ignores_job = true;
                self.count("github accepts removals of runners at work");
                self.note(
                    format!(
                        "fault: GitHub accepts the removal of a runner at work for {steps} steps"
                    ),
                    None,
                );
                if self.rng.chance(50) {
                    self.scale_down_at_work().await;
                }
            }
            Step::RelaunchAtHigherEpoch => self.relaunch_at_higher_epoch().await,
            Step::WarmTargets => self.set_warm_targets(false),
            Step::WarmDies => self.warm_dies(),
            Step::WarmFault => self.arm_warm_fault(),
            Step::EarlyCompletion => {
                if self.gates.allows(Bug::EarlyCompletionKillsRunner) {
                    let live = self.live_jobs();
                    if let Some(name) = self.rng.pick(&live) {
                        self.shared.lock().completes_early(&name);
                        self.count("early completions");
                        self.note(
                            format!(
                                "github: completes the job on {name} early; the runner still works"
                            ),
                            None,
                        );
                        if self.rng.chance(70) {
                            let lease = InstanceName::lease(&name).expect("billet name");
                            self.deliver(lease, "succeeded", false).await;
                        }
                    }
                }
            }
            Step::StraysExit => self.strays_exit(false),
            Step::BackendCatchesUp => self.backend_catches_up(),
            Step::ForceRelease => self.force_release(),
            Step::Restart | Step::Crash if self.teardown_would_be_forgotten() => {}
            Step::Restart => self.restart("restart").await,
            Step::Crash => {
                let countdown = self.rng.range(1, 6) as u32;
                let after_effect = self.rng.chance(50);
                self.shared.lock().crash = Some(Crash {
                    countdown,
                    after_effect,
                });
                self.count("crashes armed");
                self.note(
                    format!("crash armed at node call {countdown} (after effect: {after_effect})"),
                    None,
                );
                // During a tend only while it tends at most one entry: it
                // visits custody entries in the runner's HashMap order, so
                // with more "the k-th call" would name a different entry
                // from run to run.
                let mut op = match self.rng.below(5) {
                    0 | 1 => Step::NewJob,
                    2 => Step::Sweep,
                    3 => Step::DeliverCompletion,
                    _ => Step::Tend,
                };
                if op == Step::Tend && self.runner.custody_leases().len() > 1 {
                    op = Step::Sweep;
                }
                if op == Step::NewJob && !self.gates.allows(Bug::RecoverAdoptsStray) {
                    let c = self.shared.lock();
                    let next = (name_of(&c.peek_lease()), POp::Create);
                    if c.faults
                        .instance
                        .get(&next)
                        .is_some_and(|q| q.contains(&PFault::FailAfterStart))
                    {
                        op = Step::Sweep;
                    }
                }
                Box::pin(self.run_step(op)).await;
                self.shared.lock().crash = None;
            }
            Step::JournalFault => {
                // A failed write leaves a stale custody record that a restart
                // resurrects with an outcome the ledger may have overtaken.
                if self.rng.chance(20) || !self.gates.allows(Bug::ReleaseConflictWedgesCustody) {
                    self.journal.fail_reads(1);
                    self.note("fault: the next journal read fails".into(), None);
                } else {
                    let open: Vec<LeaseId> = {
                        let c = self.shared.lock();
                        c.leases
                            .values()
                            .filter(|r| !r.phase.is_terminal())
                            .map(|r| r.id.clone())
                            .collect()
                    };
                    let lease = match self.rng.pick(&open) {
                        Some(l) if self.rng.chance(60) => l,
                        _ => self.shared.lock().peek_lease(),
                    };
                    let times = self.rng.range(1, 3) as u32;
                    self.journal.fail_writes(lease.as_str(), times);
                    self.note(
                        format!("fault: the next {times} journal writes for {lease} fail"),
                        None,
                    );
                }
                self.count("journal faults");
            }
            Step::CancelJob => {
                // The plane cancels a running job (not a completion): a
                // destroy without a job result, on the plane's authority.
                let live = self.live_jobs();
                if let Some(name) = self.rng.pick(&live) {
                    let lease = InstanceName::lease(&name).expect("billet name");
                    let request = {
                        let mut c = self.shared.lock();
                        c.authority.insert(lease.clone());
                        c.leases[&lease].request
                    };
                    self.count("jobs cancelled");
                    let runner = Arc::clone(&self.runner);
                    let order = DestroyOrder::forced("cancelled");
                    match guarded(&self.shared, runner.destroy(request, &order)).await {
                        Some(r) => {
                            self.note(
                                format!(
                                    "plane: cancel request {request} ({lease}) -> {}",
                                    kind(&r)
                                ),
                                r.as_ref().err().map(ToString::to_string),
                            );
                            // A cancelled job ends failed; while the wedge on
                            // an outcome conflict is open the plane records
                            // done, as the stub does after every destroy.
                            let outcome = if self.gates.allows(Bug::ReleaseConflictWedgesCustody) {
                                Phase::Failed
                            } else {
                                Phase::Done
                            };
                            let mut c = self.shared.lock();
                            match r {
                                Ok(()) => c.plane_release(
                                    &lease,
                                    None,
                                    outcome,
                                    "plane after a cancelling destroy",
                                ),
                                Err(e) if e.is_custody() => c.unmanage(&lease),
                                Err(_) => {}
                            }
                        }
                        None => self.restart("crash").await,
                    }
                }
            }
            Step::LateLaunch => {
                // A launch delivered after the plane gave up on its lease.
                let ended: Vec<LeaseId> = {
                    let c = self.shared.lock();
                    c.plane
                        .keys()
                        .filter(|id| c.leases[*id].phase.is_terminal())
                        .cloned()
                        .collect()
                };
                if let Some(lease) = self.rng.pick(&ended) {
                    self.count("late launches");
                    self.launch(lease, "late launch").await;
                }
            }
            Step::LaunchForRunningRequest => {
                let live = self.live_jobs();
                let candidates: Vec<RequestId> = {
                    let c = self.shared.lock();
                    live.iter()
                        .filter_map(|n| InstanceName::lease(n))
                        .filter_map(|l| c.plane.get(&l).map(|p| p.request))
                        .collect()
                };
                if let Some(request) = self.rng.pick(&candidates) {
                    self.count("launch for a running request");
                    self.reserve_and_launch(request, "second launch for a running request")
                        .await;
                }
            }
        }
    }

    /// The plane states the warm runners it wants: `some` wants at least
    /// one. Now and then of a tier or a size no launch of the world's
    /// matches (a tier changed under the pool), or retired when idle or
    /// old.
    fn set_warm_targets(&mut self, some: bool) {
        let count = self.rng.range(u64::from(some), 3) as u32;
        let mut tier = tier();
        if self.rng.chance(15) {
            tier.image = "runner:sim-next".into();
        }
        let (vcpu, memory) = if self.rng.chance(15) {
            (1, ByteSize(512 << 20))
        } else {
            (LEASE_VCPU, LEASE_MEMORY)
        };
        let idle_retire = self
            .rng
            .chance(20)
            .then(|| Duration::from_secs(self.rng.range(5, 60)));
        let max_age = self
            .rng
            .chance(15)
            .then(|| Duration::from_secs(self.rng.range(20, 120)));
        self.warm_targets = if count == 0 && self.rng.chance(50) {
            Vec::new()
        } else {
            vec![WarmTarget {
                tier,
                count,
                vcpu,
                memory,
                idle_retire,
                max_age,
            }]
        };
        let stated = self
            .warm_targets
            .iter()
            .map(|t| {
                format!(
                    "{} x{} ({}, {} vCPU, {} B, idle {:?}, age {:?})",
                    t.tier.label,
                    t.count,
                    t.tier.image,
                    t.vcpu,
                    t.memory.0,
                    t.idle_retire,
                    t.max_age
                )
            })
            .collect::<Vec<_>>()
            .join(", ");
        self.pool.set_targets(self.warm_targets.clone());
        self.count("warm targets stated");
        self.note(format!("plane: wants warm runners [{stated}]"), None);
    }

    /// The warm runners waiting for a launch, by name.
    fn waiting_warm(&self) -> Vec<String> {
        self.fake
            .instances()
            .into_iter()
            .filter(|i| is_warm(&i.name) && may_run(i))
            .map(|i| i.name)
            .collect()
    }

    /// A warm runner dies while it waits: its runner exits (the container
    /// stays, exited) or its container is removed out of band.
    fn warm_dies(&mut self) {
        let Some(name) = self.rng.pick(&self.waiting_warm()) else {
            return;
        };
        let how = if self.rng.chance(50) {
            let (code, oom_killed) = if self.rng.chance(30) {
                (137, true)
            } else {
                (1, false)
            };
            self.fake.exit(&name, code, oom_killed);
            format!("exits {code}")
        } else {
            self.fake.remove_behind_back(&name);
            self.shared.lock().gone(&name);
            "is removed behind the node's back".to_owned()
        };
        self.count("warm runners died while waiting");
        self.note(format!("fault: warm runner {name} {how}"), None);
    }

    /// Arms a fault of the warm pool's: its creates or its listing fail, a
    /// waiting warm runner's destroy fails, or one of its calls to the
    /// ledger is refused or loses its reply.
    fn arm_warm_fault(&mut self) {
        let waiting = self.waiting_warm();
        let mut c = self.shared.lock();
        let what = match self.rng.below(5) {
            0 | 1 => {
                let n = self.rng.range(1, 2) as u32;
                c.faults.warm_create += n;
                format!("the next {n} warm runners' creates fail")
            }
            2 => {
                c.faults.warm_list += 1;
                "the next listing of the warm runners fails".to_owned()
            }
            3 => {
                let op = self
                    .rng
                    .pick(&[LOp::ReserveWarm, LOp::ReleaseWarm, LOp::ConfirmWarm])
                    .expect("ops");
                let fault = if self.rng.chance(50) {
                    Fault::Refuse
                } else {
                    Fault::LoseReply
                };
                c.faults.global.entry(op).or_default().push_back(fault);
                format!("the next {op:?} will {fault:?}")
            }
            _ => {
                let Some(name) = self.rng.pick(&waiting) else {
                    return;
                };
                if !self.gates.allows(Bug::WarmRoomReleasedWhileRunning) {
                    return;
                }
                c.faults
                    .instance
                    .entry((name.clone(), POp::Destroy))
                    .or_default()
                    .push_back(PFault::Fail);
                format!("the destroy of warm runner {name} will fail")
            }
        };
        drop(c);
        self.count("warm faults");
        self.note(format!("fault: {what}"), None);
    }

    fn arm_provider_fault(&mut self) {
        let next = name_of(&self.shared.lock().peek_lease());
        let existing: Vec<String> = self
            .fake
            .instances()
            .into_iter()
            .map(|i| i.name)
            .filter(|n| !is_warm(n))
            .collect();
        let mut c = self.shared.lock();
        let (name, op, fault) = match self.rng.below(8) {
            0 | 1 => (next, POp::Create, PFault::Fail),
            2 | 3 => (next, POp::Create, PFault::FailAfterStart),
            4 => match self.rng.pick(&existing) {
                Some(n) => (n, POp::Destroy, PFault::Fail),
                None => return,
            },
            5 => match self.rng.pick(&existing) {
                Some(n) => (
                    n,
                    POp::Destroy,
                    if self.rng.chance(50) {
                        PFault::Requested
                    } else {
                        PFault::RequestedGone
                    },
                ),
                None => (next, POp::Destroy, PFault::Requested),
            },
            6 => match self.rng.pick(&existing) {
                Some(n) => (n, POp::Find, PFault::Fail),
                None => (next, POp::Find, PFault::Fail),
            },
            _ => {
                c.faults.list += 1;
                drop(c);
                self.count("provider faults");
                self.note("fault: the next provider list fails".into(), None);
                return;
            }
        };
        let times = if op == POp::Find {
            self.rng.range(1, 3)
        } else {
            1
        };
        for _ in 0..times {
            c.faults
                .instance
                .entry((name.clone(), op))
                .or_default()
                .push_back(fault);
        }
        drop(c);
        self.count("provider faults");
        self.note(
            format!("fault: {op:?} of {name} will {fault:?} (x{times})"),
            None,
        );
    }

    fn arm_ledger_fault(&mut self) {
        let mut c = self.shared.lock();
        let fault = if self.rng.chance(50) {
            Fault::Refuse
        } else {
            Fault::LoseReply
        };
        if self.rng.chance(15) {
            let op = if self.rng.chance(50) {
                LOp::Launched
            } else {
                LOp::Reconcile
            };
            c.faults.global.entry(op).or_default().push_back(fault);
            drop(c);
            self.count("ledger faults");
            self.note(format!("fault: the next {op:?} will {fault:?}"), None);
            return;
        }
        let open: Vec<LeaseId> = c
            .leases
            .values()
            .filter(|r| !r.phase.is_terminal())
            .map(|r| r.id.clone())
            .collect();
        let lease = if open.is_empty() || self.rng.chance(50) {
            c.peek_lease()
        } else {
            self.rng.pick(&open).expect("not empty")
        };
        let ops = [
            LOp::Bind,
            LOp::Advance,
            LOp::Mint,
            LOp::Heartbeat,
            LOp::Release,
            LOp::Lease,
            LOp::RemoveRunner,
        ];
        let op = self.rng.pick(&ops).expect("ops");
        let fault = if op == LOp::Mint
            && fault == Fault::LoseReply
            && !self.gates.allows(Bug::MintReplyLost)
        {
            Fault::Refuse
        } else {
            fault
        };
        if op == LOp::Release && !self.gates.allows(Bug::ReleaseConflictWedgesCustody) {
            return;
        }
        c.faults
            .lease
            .entry((lease.clone(), op))
            .or_default()
            .push_back(fault);
        drop(c);
        self.count("ledger faults");
        self.note(format!("fault: {op:?} of {lease} will {fault:?}"), None);
    }

    fn force_release(&mut self) {
        let mut c = self.shared.lock();
        let candidates: Vec<(LeaseId, Phase)> = c
            .leases
            .values()
            .filter(|r| match r.phase {
                Phase::Custody | Phase::Teardown => {
                    !r.force_release && self.gates.allows(Bug::ReleaseConflictWedgesCustody)
                }
                // An operator releases quarantine only once the compute is gone.
                Phase::Quarantine => self
                    .fake
                    .instance(&name_of(&r.id))
                    .is_none_or(|i| !may_run(&i)),
                _ => false,
            })
            .map(|r| (r.id.clone(), r.phase))
            .collect();
        let Some((lease, phase)) = self.rng.pick(&candidates) else {
            return;
        };
        c.authority.insert(lease.clone());
        if phase == Phase::Quarantine {
            c.unmanage(&lease);
            c.end(&lease, Phase::Failed, true, "operator force release");
        } else {
            c.leases.get_mut(&lease).expect("known").force_release = true;
        }
        drop(c);
        self.count("operator force releases");
        self.note(format!("operator: force release {lease} ({phase})"), None);
    }

    // ----- invariants -----

    /// Every invariant, after every step: the world's recorded violations
    /// (invariants 3, 4 and 5, caught as they happen), the background
    /// tasks, every instance (1, 3) and every registration (2).
    fn check(&mut self) {
        self.check_tasks();
        let mut c = self.shared.lock();
        let mut found = std::mem::take(&mut c.violations);
        c.created_since_check = false;
        for instance in self.fake.instances() {
            if is_warm(&instance.name) {
                if c.warm.handed.contains_key(&instance.id) {
                    found.push(format!(
                        "invariant (7) no registration before a claim: warm runner {} holds a JIT config while it waits",
                        instance.name
                    ));
                }
                if may_run(&instance) && c.warm.released_running.contains(&instance.name) {
                    found.push(format!(
                        "invariant (8) capacity conserved: the room of warm runner {} was handed back while it still runs, and no launch claimed it",
                        instance.name
                    ));
                }
                continue;
            }
            let Some(lease) = instance.lease() else {
                found.push(format!("{} is not a billet instance", instance.name));
                continue;
            };
            match c.leases.get(&lease) {
                None => found.push(format!(
                    "invariant (1) no leaked instance: {} has no lease in the ledger",
                    instance.name
                )),
                Some(row) if row.phase.is_terminal() && may_run(&instance) => found.push(format!(
                    "invariant (3) no capacity freed while an instance may exist: {} still runs and lease {lease} is {} ({})",
                    instance.name,
                    row.phase,
                    row.ended_by.unwrap_or("?")
                )),
                // An exited instance of an ended lease is garbage the next
                // sweep removes; an open lease accounts for the rest.
                Some(_) => {}
            }
        }
        let (vcpu, memory) = c.charged();
        if vcpu > c.capacity.0 || memory > c.capacity.1 {
            found.push(format!(
                "invariant (8) capacity conserved: the ledger charges {vcpu} vCPUs and {memory} B on a node of {} and {} B",
                c.capacity.0, c.capacity.1
            ));
        }
        // A registration outlives its lease only while something will still
        // remove it: GitHub itself, once the job it records ends (an
        // ephemeral runner is retired with its job); the runner holding the
        // lease; the journal remembering it for the next process; or its
        // instance being there for a sweep or a recovery to find. Otherwise
        // nothing ever removes it.
        let held: std::collections::BTreeSet<LeaseId> =
            self.runner.custody_leases().into_iter().collect();
        let remembered = self.journal.leases();
        for (name, reg) in &c.regs {
            let ended = c
                .leases
                .get(&reg.lease)
                .is_none_or(|r| r.phase.is_terminal());
            // A registration the plane minted before dispatch is also
            // the plane's: its registration pass removes that of an ended
            // lease (the stub's `registrations_once`), whatever the node
            // forgot (a launch whose journal failed before it recorded it).
            if ended
                && !reg.job
                && !c.minted_ahead.contains(&reg.lease)
                && !held.contains(&reg.lease)
                && !remembered.contains(reg.lease.as_str())
                && self.fake.instance(name).is_none()
            {
                found.push(format!(
                    "invariant (2) no leaked registration: {name} is still registered at GitHub, its lease {} ended, and nothing on the node will remove it",
                    reg.lease
                ));
            }
        }
        let configs = std::mem::take(&mut c.create_called);
        drop(c);
        if let Some(first) = found.first() {
            self.fail(first);
        }
        if configs {
            self.jit_configs_unique();
        }
    }

    /// A background task that ended on its own panicked or gave up; either
    /// breaks the node (KeepAlive) or the world (the plane).
    fn check_tasks(&mut self) {
        for (what, slot) in [
            ("KeepAlive", &mut self.keep_alive),
            ("the plane", &mut self.plane_task),
            ("the warm pool", &mut self.pool_task),
        ] {
            if slot.as_ref().is_some_and(JoinHandle::is_finished) {
                let handle = slot.take().expect("finished");
                let why = match handle.now_or_never() {
                    Some(Err(e)) if e.is_panic() => panic_text(e),
                    _ => "it returned".to_owned(),
                };
                let recent: Vec<&str> = self.recent.iter().map(String::as_str).collect();
                panic!(
                    "seed {} step {}: a task panicked or stopped: {what}: {why}\n  last steps: {}\n  reproduce: {}BILLET_SIM_SEED={} cargo test -p billet-agent --test sim",
                    self.seed,
                    self.step,
                    recent.join(" | "),
                    self.gates.repro_env,
                    self.seed
                );
            }
        }
    }

    fn jit_configs_unique(&self) {
        let used = self.shared.lock().configs_run.clone();
        let mut seen = std::collections::BTreeSet::new();
        for config in &used {
            if !seen.insert(config.as_str()) {
                let lease = self
                    .shared
                    .lock()
                    .regs
                    .values()
                    .find(|r| r.config == *config)
                    .map(|r| r.lease.to_string())
                    .unwrap_or_default();
                self.fail(&format!(
                    "invariant (5) no JIT config used twice: a config (lease {lease}) was handed to two creates"
                ));
            }
        }
    }

    fn settled(&self) -> bool {
        let c = self.shared.lock();
        self.fake.instances().iter().all(|i| is_warm(&i.name))
            && c.regs.is_empty()
            && c.completions.is_empty()
            && c.leases.values().all(|r| r.phase.is_terminal())
            && !self.runner.holding()
    }

    async fn quiesce(&mut self) {
        {
            let mut c = self.shared.lock();
            c.faults = Default::default();
            c.crash = None;
        }
        self.journal.clear_faults();
        self.heal_down_at = None;
        self.heal_slow_at = None;
        self.heal_stall_at = None;
        self.heal_removal_at = None;
        self.note("quiescence: faults off".into(), None);
        for round in 0..40 {
            self.step += 1;
            self.jobs_start(true);
            for name in self.live_jobs() {
                self.complete_job(&name);
            }
            self.finishing_exit(true);
            self.strays_exit(true);
            self.github_notices();
            self.backend_catches_up();
            self.shared.lock().plane_registration_pass();
            let pending: Vec<_> = self.shared.lock().completions.iter().cloned().collect();
            for (lease, result) in pending {
                self.deliver(lease, result, false).await;
            }
            for (lease, request) in std::mem::take(&mut self.scale_down_retry) {
                let open = !self.shared.lock().leases[&lease].phase.is_terminal();
                if open {
                    self.scale_down_one(lease, request).await;
                }
            }
            let runner = Arc::clone(&self.runner);
            let r = runner.tend().await;
            self.note(
                format!("tend -> {}", kind(&r)),
                r.err().map(|e| e.to_string()),
            );
            let r = runner.sweep().await;
            self.note(
                format!("sweep -> {}", kind(&r)),
                r.err().map(|e| e.to_string()),
            );
            self.check();
            self.count("quiescence rounds");
            if round >= 2 && self.settled() {
                return;
            }
            // A claimed runner never handed its config waits on its
            // handoff for ever; a node that adopted it as a job ends it only
            // at its start deadline.
            let waiting = !self.shared.lock().warm.waiting.is_empty();
            tokio::time::sleep(if waiting {
                START_DEADLINE_ROUND
            } else {
                secs(30)
            })
            .await;
        }
    }

    /// The warm pool at rest, then emptied. Once it has confirmed its
    /// runners with the ledger since the faults went off and every taken
    /// runner's grace has passed, the ledger charges the room of exactly
    /// the warm runners that run (invariant 8). Then the plane wants none,
    /// or the node drains, or it shuts down, and the pool retires them all
    /// ([`World::final_check`] sees nothing left).
    async fn quiesce_warm(&mut self) {
        tokio::time::sleep(WARM_SETTLE).await;
        self.step += 1;
        self.note("quiescence: the warm pool at rest".into(), None);
        self.check();
        let mut found = Vec::new();
        {
            let c = self.shared.lock();
            let running: std::collections::BTreeSet<String> =
                self.waiting_warm().into_iter().collect();
            for name in c.warm.rooms.keys() {
                if !running.contains(name) {
                    found.push(format!(
                        "invariant (8) capacity conserved: at rest, the pool confirmed, the ledger still charges the room of warm runner {name}, which does not run"
                    ));
                }
            }
            for name in &running {
                if !c.warm.rooms.contains_key(name) {
                    found.push(format!(
                        "invariant (8) capacity conserved: at rest, the pool confirmed, warm runner {name} runs with no room charged"
                    ));
                }
            }
        }
        if let Some(first) = found.first() {
            self.fail(first);
        }
        let how = match self.rng.below(3) {
            0 => {
                self.warm_targets.clear();
                self.pool.set_targets(Vec::new());
                "the plane wants no warm runners"
            }
            1 => {
                self.runner.start_draining();
                "the node drains"
            }
            _ => {
                self.stop_pool(true).await;
                "the node shuts down"
            }
        };
        tokio::time::sleep(WARM_TURNS).await;
        self.step += 1;
        self.note(format!("quiescence: {how}"), None);
        self.check();
    }

    fn final_check(&mut self) {
        self.jit_configs_unique();
        let c = self.shared.lock();
        let instances: Vec<String> = self
            .fake
            .instances()
            .into_iter()
            .map(|i| {
                let phase = i
                    .lease()
                    .and_then(|l| c.leases.get(&l).map(|r| r.phase.to_string()))
                    .unwrap_or_default();
                format!("{} ({:?}, lease {phase})", i.name, i.state)
            })
            .collect();
        let regs: Vec<String> = c
            .regs
            .iter()
            .map(|(name, r)| {
                let phase = c
                    .leases
                    .get(&r.lease)
                    .map(|l| l.phase.to_string())
                    .unwrap_or_default();
                format!("{name} (connected {}, lease {phase})", r.connected)
            })
            .collect();
        let charged: Vec<String> = c
            .leases
            .values()
            .filter(|r| !r.phase.is_terminal())
            .map(|r| format!("{} {} epoch {}", r.id, r.phase, r.epoch))
            .collect();
        let warm_rooms: Vec<String> = c.warm.rooms.keys().cloned().collect();
        drop(c);
        if !instances.is_empty() {
            self.fail(&format!(
                "invariant (1) no leaked instance: at quiescence the provider still has {}",
                instances.join(", ")
            ));
        }
        if !regs.is_empty() {
            self.fail(&format!(
                "invariant (2) no leaked registration: at quiescence GitHub still has {}",
                regs.join(", ")
            ));
        }
        if !charged.is_empty() {
            self.fail(&format!(
                "invariant (1) no leaked capacity: at quiescence the ledger still charges {}",
                charged.join(", ")
            ));
        }
        if !warm_rooms.is_empty() {
            self.fail(&format!(
                "invariant (8) capacity conserved: at quiescence, no warm runner wanted, the ledger still charges the room of {}",
                warm_rooms.join(", ")
            ));
        }
        if self.runner.holding() {
            self.fail(&format!(
                "invariant (1) the runner holds nothing at quiescence: it still holds custody of {:?}, so a draining node would never stop",
                self.runner.custody_leases()
            ));
        }
    }
}

/// Runs one seed to the end, panicking on the first broken invariant.
pub async fn run(seed: u64, verbose: bool, gates: Gates) -> Outcome {
    let began = tokio::time::Instant::now();
    let sabotage = gates.sabotage;
    let mut world = World::new(seed, verbose, gates);
    world.shared.lock().sabotage = sabotage;
    world.recover().await;
    if world.rng.chance(60) {
        world.set_warm_targets(true);
    }
    let steps = 30 + world.rng.below(200) as usize;
    while world.step < steps {
        world.step += 1;
        world.heal();
        let roll = world
            .rng
            .weighted(&STEPS.iter().map(|(_, w)| *w).collect::<Vec<_>>());
        let step = STEPS[roll].0;
        if verbose {
            log_line(&format!("[seed {seed} step {}] -- {step:?}", world.step));
        }
        world.run_step(step).await;
        if world.gates.sabotage == Some(Sabotage::FailCleanExit) {
            let mut c = world.shared.lock();
            let exited_clean = c
                .open
                .iter()
                .find(|id| c.clean_exits.contains(&name_of(id)));
            if let Some(id) = exited_clean.cloned() {
                let epoch = Epoch(c.leases[&id].epoch);
                let _ = c.mark_failure(&id, epoch, "oom");
            }
        }
        if world.gates.sabotage == Some(Sabotage::KillBusyRunner) {
            let live = world.live_jobs();
            let busy: Vec<String> = {
                let c = world.shared.lock();
                live.into_iter().filter(|n| c.busy_at_github(n)).collect()
            };
            if let Some(name) = busy.first() {
                let lease = InstanceName::lease(name).expect("billet name");
                let _ = billet_agent::provider::Provider::destroy(
                    &*world.provider,
                    &InstanceName::for_lease(&lease),
                )
                .await;
            }
        }
        world.check();
    }
    world.jit_configs_unique();
    world.quiesce().await;
    world.quiesce_warm().await;
    world.final_check();
    let mut stats = std::mem::take(&mut world.stats);
    stats.insert("seeds", 1);
    stats.insert("simulated seconds", began.elapsed().as_secs());
    stats.insert("steps", world.step as u64);
    {
        let c = world.shared.lock();
        for (k, v) in &c.tally {
            *stats.entry(k).or_default() += v;
        }
    }
    world.check_tasks();
    for handle in [
        world.keep_alive.take(),
        world.plane_task.take(),
        world.pool_task.take(),
    ]
    .into_iter()
    .flatten()
    {
        handle.abort();
    }
    Outcome {
        steps: world.step,
        trace: world.trace,
        stats,
    }
}

/// The plane's Launch of `lease` at `epoch` for the job `request`: the
/// lease as the plane sends it, and the job.
fn assigned(lease: &LeaseId, epoch: Epoch, request: RequestId) -> (Lease, GithubJob) {
    let command = Lease {
        id: lease.clone(),
        epoch,
        tier: "sim".into(),
        phase: Phase::Assigned,
        vcpu: LEASE_VCPU,
        memory: LEASE_MEMORY,
        request_id: request,
        providers: vec!["docker".into()],
        failure_reason: None,
    };
    let job = GithubJob {
        request_id: request,
        ..GithubJob::default()
    };
    (command, job)
}
