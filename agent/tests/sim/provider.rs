//! The provider the runner sees in the simulation: the crate's
//! [`FakeProvider`] (which holds the instances and records every call and
//! every JIT config handed to it), with faults armed per instance name and
//! enacted through the fake's own knobs (`fail_next`,
//! `fail_create_after_starting`, destroy modes) just before the call they
//! target. Arming per name rather than "the next call" keeps a seed's faults
//! landing on the same instance whatever order the runner visits its
//! entries in.
//!
//! It reports exits as the Docker provider does: an exited container stays
//! present and exited, with its exit code and OOM flag (the crate's
//! `InstanceState::Exited`), until it is destroyed; only an out-of-band
//! removal makes it vanish.
//!
//! It also keeps the ground truth GitHub would have: a started instance's
//! runner connects with its JIT config and waits for its job, and every
//! destroy of an instance that may still run is checked against GitHub's
//! state and the authority the simulation tracks (invariant 4): GitHub
//! records a job running on it, or its runner is still finishing within the
//! post-job grace after an early completion, and no operator released or
//! plane cancelled it.
//!
//! Warm runners are the fake's too: created running with no registration,
//! listed apart, and claimed by a rename and the handoff of the lease's
//! config. The ground truth the world checks is kept here, by the engine's
//! container id (which a claim keeps): every config a container was handed
//! (invariants 7 and 9), every claim of a warm runner (9), and whether the
//! ledger charged a warm runner's room when it was created (8).

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use billet_agent::model::{ByteSize, InstanceName};
use billet_agent::provider::fake::{DestroyMode, FakeProvider, Operation};
use billet_agent::provider::{
    ImageFacts, Instance, InstanceSpec, InstanceState, Provider, ProviderError, StartGate,
    Teardown, WarmSpec, Work,
};

use crate::fakes::{Job, PFault, POST_JOB_GRACE, POp, Sabotage, Shared, is_warm, may_run};

/// [`FakeProvider`] with per-instance faults, slowness and crash points.
#[derive(Debug)]
pub struct SimProvider {
    pub fake: Arc<FakeProvider>,
    pub shared: Arc<Shared>,
}

impl SimProvider {
    /// Slowness applies to create and list only (see `FakeLedger::call`:
    /// find and destroy also run inside a tend).
    async fn enter(&self, slow: bool) -> crate::fakes::Gate {
        let slow = {
            let c = self.shared.lock();
            if slow { c.faults.slow_provider } else { None }.or(c.faults.inside_tend)
        };
        self.shared.enter(slow).await
    }
}

impl SimProvider {
    /// Invariant (4), wherever a runner is ended: no running instance
    /// GitHub records as running a job, or whose runner still works within
    /// the post-job grace after an early completion, without an operator
    /// release or a cancellation.
    fn check_kill(&self, c: &mut crate::fakes::Core, n: &str, how: &str) {
        // A warm runner waiting for its launch runs no job.
        if is_warm(n) {
            return;
        }
        let lease = InstanceName::lease(n).expect("billet names only");
        if let Some(instance) = self.fake.instance(n)
            && may_run(&instance)
            && !c.authority.contains(&lease)
        {
            if c.busy_at_github(n) || c.jobs.get(n) == Some(&Job::Live) {
                c.violate(format!(
                    "invariant (4) no live job killed without authority: {how} of {n} while GitHub records its job running, with no operator release or cancellation"
                ));
            } else if c.jobs.get(n) == Some(&Job::Finishing)
                && c.finishing
                    .get(n)
                    .is_some_and(|t| t.elapsed() < POST_JOB_GRACE)
            {
                c.violate(format!(
                    "invariant (4) no live job killed without authority: {how} of {n} while its runner still works after an early completion, within the post-job grace"
                ));
            }
        }
    }
}

#[async_trait]
impl Provider for SimProvider {
    fn kind(&self) -> &'static str {
        self.fake.kind()
    }

    fn runs_on_host(&self) -> bool {
        self.fake.runs_on_host()
    }

    async fn create_then_start(
        &self,
        mut spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: StartGate,
    ) -> Result<Instance, ProviderError> {
        let gate = self.enter(true).await;
        if self.shared.lock().sabotage == Some(Sabotage::ReuseJitConfig)
            && let Some(first) = self.fake.jit_configs_used().into_iter().next()
        {
            spec.jit_config = first;
        }
        let name = spec.name.as_str().to_owned();
        let config = spec.jit_config.expose().to_owned();
        let existed = self.fake.instance(&name).is_some();
        self.shared.lock().create_called = true;
        match self.shared.lock().take_pfault(&name, POp::Create) {
            Some(PFault::Fail) => self.fake.fail_next(Operation::Create, 1),
            Some(PFault::FailAfterStart) => self.fake.fail_create_after_starting(1),
            _ => {}
        }
        // Completes in one poll: nothing in the fake waits unless blocked.
        let result = self.fake.create_then_start(spec, created, start).await;
        // A create whose start was withheld (its launch's bind was
        // refused, or its record not written) never ran its runner: the
        // instance stays `created`, and its config is not consumed. A
        // config counts as used once an instance created with it has
        // run: a create that made nothing, or whose instance never left
        // `created`, consumed nothing, and a launch redelivered after a
        // crash may hand the plane-minted config to a create again.
        let withheld = matches!(result, Err(ProviderError::StartWithheld { .. }));
        let ran = !existed
            && self
                .fake
                .instance(&name)
                .is_some_and(|i| i.state != InstanceState::Created);
        if ran {
            self.shared.lock().configs_run.push(config.clone());
        }
        if !existed && !withheld && self.fake.instance(&name).is_some() {
            let mut c = self.shared.lock();
            c.created_since_check = true;
            // Its runner connects with the config it was given and waits
            // for its job (`Core::job_starts`); the runner of a create that
            // failed runs no job, and its registration is removed.
            let registered = c.connect(&config);
            let job = if result.is_ok() && registered {
                Job::Idle
            } else {
                Job::Stray
            };
            c.jobs.insert(name.clone(), job);
            if c.verbose {
                c.events.push(format!("provider: {name} started ({job:?})"));
            }
        }
        self.shared.leave(gate).await;
        result
    }

    async fn stop(&self, name: &InstanceName, timeout: Duration) -> Result<(), ProviderError> {
        let gate = self.enter(false).await;
        let n = name.as_str().to_owned();
        {
            let mut c = self.shared.lock();
            self.check_kill(&mut c, &n, "stop");
            c.tally("provider: runner stopped (post-job grace passed)");
        }
        let result = self.fake.stop(name, timeout).await;
        {
            let mut c = self.shared.lock();
            if self.fake.instance(&n).is_some_and(|i| !may_run(&i)) {
                // The runner is gone, its container stays: as a runner dying.
                match c.jobs.get(&n) {
                    Some(Job::Live) => {
                        c.jobs.insert(n.clone(), Job::Dead);
                    }
                    Some(Job::Finishing) => {
                        c.jobs.insert(n.clone(), Job::Completed);
                        c.finishing.remove(&n);
                    }
                    _ => {}
                }
            }
        }
        self.shared.leave(gate).await;
        result
    }

    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError> {
        let gate = self.enter(false).await;
        let n = name.as_str().to_owned();
        {
            let mut c = self.shared.lock();
            self.check_kill(&mut c, &n, "destroy");
            if c.verbose {
                let present = self.fake.instance(&n).map(|i| i.state);
                c.events
                    .push(format!("provider: destroy {n} ({present:?})"));
            }
            // A destroy that does not confirm, of a claimed runner never
            // handed its config, reaches a known bug: left out unless its
            // gate is open.
            let fault = c.take_pfault(&n, POp::Destroy);
            let fault = fault.filter(|_| c.withheld_claim_faults || !c.warm.waiting.contains(&n));
            match fault {
                Some(PFault::Fail) => self.fake.fail_next(Operation::Destroy, 1),
                Some(PFault::Requested) if self.fake.instance(&n).is_some() => {
                    c.pending_removal.insert(n.clone());
                }
                Some(PFault::RequestedGone) => {
                    self.fake.set_destroy_mode(DestroyMode::RequestAndRemove)
                }
                _ => {}
            }
            if c.pending_removal.contains(&n) {
                self.fake.set_destroy_mode(DestroyMode::RequestAndKeep);
            }
        }
        let lie = match (self.shared.lock().sabotage, self.fake.instance(&n)) {
            (Some(Sabotage::DestroyKeepsExited), Some(i)) => !may_run(&i),
            (Some(Sabotage::DestroyKeepsRunning), Some(i)) => may_run(&i),
            _ => false,
        };
        if lie {
            self.shared.leave(gate).await;
            return Ok(Teardown::Stopped);
        }
        let result = self.fake.destroy(name).await;
        self.fake.set_destroy_mode(DestroyMode::Stop);
        {
            let mut c = self.shared.lock();
            if self.fake.instance(&n).is_none() {
                c.gone(&n);
            }
        }
        self.shared.leave(gate).await;
        result
    }

    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        let gate = self.enter(true).await;
        {
            let mut c = self.shared.lock();
            if c.faults.list > 0 {
                c.faults.list -= 1;
                self.fake.fail_next(Operation::List, 1);
            }
        }
        let result = self.fake.list().await;
        self.shared.leave(gate).await;
        result
    }

    async fn check_image(&self, image: &str) -> Result<ImageFacts, ProviderError> {
        self.fake.check_image(image).await
    }

    async fn output_tail(&self, name: &InstanceName) -> Result<String, ProviderError> {
        self.fake.output_tail(name).await
    }

    async fn shape(&self, vcpu: u32, memory: ByteSize) -> Result<(u32, ByteSize), ProviderError> {
        self.fake.shape(vcpu, memory).await
    }

    async fn find(&self, name: &InstanceName) -> Result<Option<Instance>, ProviderError> {
        let gate = self.enter(false).await;
        if self.shared.lock().take_pfault(name.as_str(), POp::Find) == Some(PFault::Fail) {
            self.fake.fail_next(Operation::Find, 1);
        }
        let result = self.fake.find(name).await;
        self.shared.leave(gate).await;
        result
    }

    /// The runner's job process runs while its job does, and while it
    /// finishes after an early completion.
    async fn work(&self, name: &InstanceName) -> Result<Work, ProviderError> {
        let gate = self.enter(false).await;
        let working = matches!(
            self.shared.lock().jobs.get(name.as_str()),
            Some(Job::Live | Job::Finishing)
        );
        self.fake.set_working(name.as_str(), working);
        let result = self.fake.work(name).await;
        self.shared.leave(gate).await;
        result
    }

    /// Creates the warm runner; the ledger must have charged its room
    /// first (invariant 8).
    async fn create_warm(&self, spec: WarmSpec) -> Result<Instance, ProviderError> {
        let gate = self.enter(true).await;
        let name = spec.name.as_str().to_owned();
        {
            let mut c = self.shared.lock();
            // Invariant (8): the room is charged before the container
            // takes it.
            if !c.warm_reserved(&name) {
                c.violate(format!(
                    "invariant (8) capacity conserved: warm runner {name} is created though the ledger never charged its room"
                ));
            }
            if c.faults.warm_create > 0 {
                c.faults.warm_create -= 1;
                self.fake.fail_next(Operation::Create, 1);
            }
        }
        let result = self.fake.create_warm(spec).await;
        {
            let mut c = self.shared.lock();
            match &result {
                Ok(instance) => {
                    c.tally("provider: warm runner started");
                    if c.sabotage == Some(Sabotage::WarmStartsRegistered) {
                        c.warm
                            .handed
                            .entry(instance.id.clone())
                            .or_default()
                            .push(format!("jit-baked-into-{}", instance.id));
                    }
                    if c.verbose {
                        c.events
                            .push(format!("provider: warm runner {name} started"));
                    }
                }
                Err(_) => c.tally("provider: warm runner's create failed"),
            }
        }
        self.shared.leave(gate).await;
        result
    }

    async fn list_warm(&self) -> Result<Vec<Instance>, ProviderError> {
        let gate = self.enter(true).await;
        {
            let mut c = self.shared.lock();
            if c.faults.warm_list > 0 {
                c.faults.warm_list -= 1;
                self.fake.fail_next(Operation::List, 1);
            }
        }
        let result = self.fake.list_warm().await;
        self.shared.leave(gate).await;
        result
    }

    /// Claims the warm runner through the fake, then reads from the fake's
    /// own record which configs that handed over, and to which container.
    async fn claim_warm(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: StartGate,
    ) -> Result<Instance, ProviderError> {
        let gate = self.enter(true).await;
        let w = warm.as_str().to_owned();
        let name = spec.name.as_str().to_owned();
        let container = self.fake.instance(&w).map(|i| i.id);
        let existed = self.fake.instance(&name).is_some();
        let before = self.fake.jit_configs_used().len();
        let fault = {
            let mut c = self.shared.lock();
            c.create_called = true;
            // Named by a launch: a room handed back just before is the
            // claim's (the lease charges its own).
            c.warm.released_running.remove(&w);
            let claims = c.warm.claims.entry(w.clone()).or_default();
            *claims += 1;
            if *claims > 1 {
                let n = *claims;
                c.violate(format!(
                    "invariant (9) no config handed twice: warm runner {w} was claimed {n} times (now for {name})"
                ));
            }
            match c.take_pfault(&name, POp::Create) {
                Some(PFault::Fail) => {
                    self.fake.fail_next(Operation::Create, 1);
                    None
                }
                other => other,
            }
        };
        let mut result = self.fake.claim_warm(warm, spec, created, start).await;
        let handed: Vec<String> = self.fake.jit_configs_used()[before..]
            .iter()
            .map(|j| j.expose().to_owned())
            .collect();
        if fault == Some(PFault::FailAfterStart) && result.is_ok() {
            // As a create that fails after starting: the runner has its
            // config, and the node reads an error.
            result = Err(ProviderError::Engine {
                operation: format!("claim {w} as {name}"),
                message: "injected failure after the handoff".to_owned(),
            });
        }
        self.record_claim(&w, &name, container, existed, handed, result.is_ok());
        self.shared.leave(gate).await;
        result
    }
}

impl SimProvider {
    /// What a claim did, as GitHub and the world's checks see it: the
    /// configs `handed` over went to `container` (the warm runner's, by the
    /// engine's id), whose runner connects with the first, and a claimed
    /// runner handed none waits on its handoff.
    fn record_claim(
        &self,
        w: &str,
        name: &str,
        container: Option<String>,
        existed: bool,
        mut handed: Vec<String>,
        ok: bool,
    ) {
        let mut c = self.shared.lock();
        if c.sabotage == Some(Sabotage::ClaimHandsConfigTwice) {
            handed.extend(handed.clone());
        }
        for config in &handed {
            // Invariant (9): a config reaches one runner, once.
            if c.warm.handed.values().flatten().any(|h| h == config) {
                c.violate(format!(
                    "invariant (9) no config handed twice: the config of {name} was handed over again when {w} was claimed"
                ));
            }
            if let Some(id) = &container {
                c.warm
                    .handed
                    .entry(id.clone())
                    .or_default()
                    .push(config.clone());
            }
            c.configs_run.push(config.clone());
        }
        let now = self.fake.instance(name);
        if !existed && let Some(instance) = now.filter(may_run) {
            c.created_since_check = true;
            let job = match handed.first() {
                // Its runner connects with the config it was handed; that
                // of a claim that failed runs no job, and its registration
                // is removed.
                Some(config) => {
                    let registered = c.connect(config);
                    c.tally("provider: launch onto a warm runner");
                    if ok && registered {
                        Job::Idle
                    } else {
                        Job::Stray
                    }
                }
                // Never handed its config: it waits on its handoff.
                None => {
                    c.warm.waiting.insert(name.to_owned());
                    Job::Stray
                }
            };
            c.jobs.insert(name.to_owned(), job);
            if c.verbose {
                c.events.push(format!(
                    "provider: warm runner {w} claimed as {} ({job:?})",
                    instance.name
                ));
            }
        }
    }
}
