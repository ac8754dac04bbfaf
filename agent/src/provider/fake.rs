//! A recording fake provider, for unit tests and the deterministic
//! simulation.
//!
//! [`FakeProvider`] keeps its instances in memory and records every call
//! (at entry, before any injected failure or block). Tests script it: fail
//! the next N calls of an [`Operation`], make a create fail after the
//! instance exists (the error that does not prove nothing started), make
//! destroy answer [`Teardown::Requested`], hold calls of an operation until
//! released, or change the inventory behind the runner's back.
//!
//! It enforces what a real provider would: the name must be
//! `billet-<lease>`, the command non-empty, the image present (see
//! [`FakeProvider::remove_image`]), and a name already in use is a conflict.
//! It models the Docker engine's view of life: an instance whose process
//! ends ([`FakeProvider::exit`]) stays present and not running, with its
//! exit code and OOM flag, until it is destroyed; an engine that is down
//! ([`Engine::Unreachable`]) fails every call at once with
//! [`ProviderError::Unreachable`], and one that hangs ([`Engine::Hanging`])
//! fails it with [`ProviderError::Timeout`] once the fake's bound passes. It
//! is deterministic: ids are `fake-1`, `fake-2`, … in creation order and
//! listings are sorted by name.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;

use super::{
    Exit, ImageFacts, Instance, InstanceSpec, InstanceState, Owner, Provider, ProviderError,
    Teardown, Work, labels,
};
use crate::model::{ByteSize, InstanceName, JitConfig, NodeName};

/// A provider operation, for injecting failures and holding calls.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Operation {
    /// [`Provider::create`].
    Create,
    /// [`Provider::destroy`].
    Destroy,
    /// [`Provider::list`].
    List,
    /// [`Provider::find`].
    Find,
    /// [`Provider::check_image`].
    CheckImage,
    /// [`Provider::stop`].
    Stop,
    /// [`Provider::work`].
    Work,
    /// The start that follows a create ([`Provider::create_then_start`]):
    /// not a call of its own (never recorded), but
    /// [`FakeProvider::block`] holds a created instance, not yet running,
    /// after `created` was sent, and [`FakeProvider::fail_next`] fails the
    /// start as Docker's can, leaving the instance created and not running.
    Start,
}

/// How the fake's engine answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Engine {
    /// It answers.
    #[default]
    Up,
    /// Nothing listens: every call fails at once with
    /// [`ProviderError::Unreachable`], touching nothing.
    Unreachable,
    /// It accepts and never answers: every call fails with
    /// [`ProviderError::Timeout`] once the fake's timeout passes, touching
    /// nothing.
    Hanging,
}

/// How long a call to a [`Engine::Hanging`] fake waits before it fails, by
/// default.
pub(crate) const DEFAULT_TIMEOUT: Duration = Duration::from_secs(5);

/// One recorded call, in the order calls arrived.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Call {
    /// `create` of this instance (the full spec is in
    /// [`FakeProvider::specs`]).
    Create(InstanceName),
    /// `destroy` of this instance.
    Destroy(InstanceName),
    /// `list`.
    List,
    /// `find` of this instance.
    Find(InstanceName),
    /// `check_image` of this image.
    CheckImage(String),
    /// `stop` of this instance, with its timeout.
    Stop(InstanceName, Duration),
    /// `work` of this instance.
    Work(InstanceName),
}

impl Call {
    /// The operation called.
    pub(crate) fn operation(&self) -> Operation {
        match self {
            Call::Create(_) => Operation::Create,
            Call::Destroy(_) => Operation::Destroy,
            Call::List => Operation::List,
            Call::Find(_) => Operation::Find,
            Call::CheckImage(_) => Operation::CheckImage,
            Call::Stop(..) => Operation::Stop,
            Call::Work(_) => Operation::Work,
        }
    }
}

/// What `destroy` does and answers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DestroyMode {
    /// Removes the instance and answers [`Teardown::Stopped`], like Docker.
    #[default]
    Stop,
    /// Removes the instance but answers [`Teardown::Requested`], like a
    /// remote backend whose removal completed by the next read. A missing
    /// instance also answers `Requested` (an eventually consistent
    /// not-found proves nothing).
    RequestAndRemove,
    /// Answers [`Teardown::Requested`] and leaves the instance running, like
    /// a remote backend that has not got round to it; remove it later with
    /// [`FakeProvider::remove_behind_back`]. A missing instance also answers
    /// `Requested`.
    RequestAndKeep,
}

#[derive(Debug, Default)]
struct State {
    instances: BTreeMap<String, Instance>,
    calls: Vec<Call>,
    specs: Vec<InstanceSpec>,
    jit_configs: Vec<JitConfig>,
    fail_next: BTreeMap<Operation, u32>,
    create_fails_after_starting: u32,
    destroy_mode: DestroyMode,
    next_id: u64,
    missing_images: BTreeSet<String>,
    /// Images rebuilt under their name: how many times, for their id.
    rebuilt: BTreeMap<String, u32>,
    /// Runner versions images carry by their label.
    image_versions: BTreeMap<String, String>,
    /// What instances' runners wrote, by instance name.
    outputs: BTreeMap<String, String>,
    engine: Engine,
    ignores_sigterm: BTreeSet<String>,
    /// Instances whose runner runs its job process ([`Provider::work`]).
    working: BTreeSet<String>,
    cpus: Option<u32>,
}

/// An in-memory [`Provider`] that records calls and can be told to fail.
///
/// `Debug` shows JIT configs redacted.
#[derive(Debug)]
pub struct FakeProvider {
    kind: &'static str,
    owner: Owner,
    state: Mutex<State>,
    /// Operations whose calls wait until released.
    blocked: watch::Sender<BTreeSet<Operation>>,
    /// How long a call to a hanging engine waits before failing.
    timeout: Duration,
}

impl Default for FakeProvider {
    fn default() -> Self {
        Self::new()
    }
}

impl FakeProvider {
    /// A fake of kind `docker` owned by deployment `fake-deployment`, node
    /// `fake-node`, with no instances.
    pub fn new() -> Self {
        let node = NodeName::parse("node", "fake-node").expect("a valid node name");
        Self {
            kind: "docker",
            owner: Owner {
                deployment: "fake-deployment".to_owned(),
                node,
            },
            state: Mutex::new(State::default()),
            blocked: watch::Sender::new(BTreeSet::new()),
            timeout: DEFAULT_TIMEOUT,
        }
    }

    /// The same fake with `timeout` as the bound a call to a hanging engine
    /// waits ([`DEFAULT_TIMEOUT`] otherwise).
    #[cfg(test)]
    pub(crate) fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Sets how the engine answers from now on.
    pub fn set_engine(&self, engine: Engine) {
        self.state().engine = engine;
    }

    /// Makes `image` absent: `check_image` answers
    /// [`ProviderError::ImageUnavailable`] and `create` refuses it the same
    /// way, creating nothing. Every image is present until removed.
    pub fn remove_image(&self, image: &str) {
        self.state().missing_images.insert(image.to_owned());
    }

    /// Makes `image` present again (built or loaded while a job waits).
    pub fn restore_image(&self, image: &str) {
        self.state().missing_images.remove(image);
    }

    /// Gives `image` a new id, as a rebuild under its name does.
    pub fn rebuild_image(&self, image: &str) {
        *self.state().rebuilt.entry(image.to_owned()).or_default() += 1;
    }

    /// Labels `image` as carrying runner `version`.
    pub fn set_image_version(&self, image: &str, version: &str) {
        self.state()
            .image_versions
            .insert(image.to_owned(), version.to_owned());
    }

    /// What the runner of instance `name` wrote, as
    /// [`Provider::output_tail`] reads it.
    pub fn set_output(&self, name: &InstanceName, output: &str) {
        self.state()
            .outputs
            .insert(name.as_str().to_owned(), output.to_owned());
    }

    /// Runs every instance at no more than `cpus` vCPUs, as the Docker
    /// provider does on a host with that many CPUs ([`Provider::shape`]).
    /// Unlimited until set.
    #[cfg(test)]
    pub(crate) fn set_cpus(&self, cpus: u32) {
        self.state().cpus = Some(cpus);
    }

    /// The same fake reporting `kind` from [`Provider::kind`].
    #[cfg(test)]
    pub(crate) fn with_kind(mut self, kind: &'static str) -> Self {
        self.kind = kind;
        self
    }

    fn state(&self) -> MutexGuard<'_, State> {
        // A test that panicked while holding the lock must not hide the
        // state from the assertions that follow.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Makes the next `times` calls of `operation` fail with
    /// [`ProviderError::Engine`] before doing anything (a failed create
    /// creates nothing). Adds to any failures already scheduled.
    pub fn fail_next(&self, operation: Operation, times: u32) {
        *self.state().fail_next.entry(operation).or_default() += times;
    }

    /// Makes the next `times` creates create and start the instance, then
    /// fail anyway (the error that does not prove nothing started).
    /// Failures scheduled with [`FakeProvider::fail_next`] take precedence.
    pub fn fail_create_after_starting(&self, times: u32) {
        self.state().create_fails_after_starting += times;
    }

    /// Sets what `destroy` does from now on.
    pub fn set_destroy_mode(&self, mode: DestroyMode) {
        self.state().destroy_mode = mode;
    }

    /// Holds every call of `operation`, present and future, after it is
    /// recorded and before it does anything, until
    /// [`FakeProvider::unblock`].
    pub fn block(&self, operation: Operation) {
        self.blocked.send_modify(|set| {
            set.insert(operation);
        });
    }

    /// Releases calls of `operation` held by [`FakeProvider::block`].
    pub fn unblock(&self, operation: Operation) {
        self.blocked.send_modify(|set| {
            set.remove(&operation);
        });
    }

    /// Removes an instance without any call, as a crash, an operator or the
    /// instance's own exit-and-remove would. Returns whether it existed.
    pub fn remove_behind_back(&self, name: &str) -> bool {
        self.state().instances.remove(name).is_some()
    }

    /// Adds (or replaces) an instance without any call, as a leftover from
    /// an earlier run would appear. Nothing about it is checked, so foreign
    /// names and labels are possible.
    pub fn insert_behind_back(&self, instance: Instance) {
        self.state()
            .instances
            .insert(instance.name.clone(), instance);
    }

    /// Changes an instance's state without any call. Returns whether it
    /// existed.
    pub fn set_state(&self, name: &str, state: InstanceState) -> bool {
        match self.state().instances.get_mut(name) {
            Some(instance) => {
                instance.state = state;
                true
            }
            None => false,
        }
    }

    /// Ends an instance's process, as the runner's own exit, a `docker
    /// kill` (code 137) or the OOM killer (137 with `oom_killed`) would: it
    /// stays present, [`InstanceState::Exited`], until destroyed. Returns
    /// whether it existed.
    pub fn exit(&self, name: &str, code: i64, oom_killed: bool) -> bool {
        self.set_state(name, InstanceState::Exited(Exit { code, oom_killed }))
    }

    /// Starts (`true`) or ends the instance's job process: while it runs,
    /// [`Provider::work`] answers [`Work::Busy`] for a running instance.
    pub fn set_working(&self, name: &str, working: bool) {
        let mut s = self.state();
        if working {
            s.working.insert(name.to_owned());
        } else {
            s.working.remove(name);
        }
    }

    /// Makes the instance's runner ignore SIGTERM: [`Provider::stop`] then
    /// takes its whole timeout and ends it with SIGKILL (137).
    pub fn ignore_sigterm(&self, name: &str) {
        self.state().ignores_sigterm.insert(name.to_owned());
    }

    /// Every instance, sorted by name.
    pub fn instances(&self) -> Vec<Instance> {
        self.state().instances.values().cloned().collect()
    }

    /// The instance named `name`, if it exists.
    pub fn instance(&self, name: &str) -> Option<Instance> {
        self.state().instances.get(name).cloned()
    }

    /// Every call so far, in order.
    pub fn calls(&self) -> Vec<Call> {
        self.state().calls.clone()
    }

    /// How many calls of `operation` arrived so far.
    pub fn count(&self, operation: Operation) -> usize {
        self.state()
            .calls
            .iter()
            .filter(|call| call.operation() == operation)
            .count()
    }

    /// Every spec passed to `create`, in call order, whether or not the
    /// create succeeded.
    pub fn specs(&self) -> Vec<InstanceSpec> {
        self.state().specs.clone()
    }

    /// Every JIT config passed to `create`, in call order, whether or not the
    /// create succeeded; a config appearing twice was used twice.
    pub fn jit_configs_used(&self) -> Vec<JitConfig> {
        self.state().jit_configs.clone()
    }

    /// Records the call, waits while its operation is blocked, then takes
    /// an injected failure if one is scheduled.
    async fn enter(&self, call: Call) -> Result<(), ProviderError> {
        let operation = call.operation();
        let description = match &call {
            Call::Create(name) => format!("create {name}"),
            Call::Destroy(name) => format!("destroy {name}"),
            Call::List => "list".to_owned(),
            Call::Find(name) => format!("find {name}"),
            Call::CheckImage(image) => format!("check image {image}"),
            Call::Stop(name, _) => format!("stop {name}"),
            Call::Work(name) => format!("read the processes of {name}"),
        };
        self.state().calls.push(call);
        let mut blocked = self.blocked.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = blocked.wait_for(|set| !set.contains(&operation)).await;
        let engine = self.state().engine;
        match engine {
            Engine::Up => {}
            Engine::Unreachable => {
                return Err(ProviderError::Unreachable {
                    operation: description,
                    message: "nothing listens at the fake engine's address".to_owned(),
                });
            }
            Engine::Hanging => {
                tokio::time::sleep(self.timeout).await;
                return Err(ProviderError::Timeout {
                    operation: description,
                    after: self.timeout,
                });
            }
        }
        let mut state = self.state();
        if let Some(left) = state.fail_next.get_mut(&operation)
            && *left > 0
        {
            *left -= 1;
            return Err(ProviderError::Engine {
                operation: description,
                message: "injected failure".to_owned(),
            });
        }
        Ok(())
    }

    fn labels_for(&self, spec: &InstanceSpec) -> BTreeMap<String, String> {
        BTreeMap::from([
            (labels::DEPLOYMENT.to_owned(), self.owner.deployment.clone()),
            (labels::NODE.to_owned(), self.owner.node.to_string()),
            (labels::LEASE.to_owned(), spec.lease.to_string()),
            (labels::EPOCH.to_owned(), spec.epoch.to_string()),
            (labels::REQUEST.to_owned(), spec.request_id.to_string()),
        ])
    }
}

#[async_trait]
impl Provider for FakeProvider {
    fn kind(&self) -> &'static str {
        self.kind
    }

    fn runs_on_host(&self) -> bool {
        true
    }

    /// Present unless [`FakeProvider::remove_image`] removed it.
    ///
    /// # Errors
    ///
    /// [`ProviderError::ImageUnavailable`] for a removed image; the
    /// engine's failures as for every call.
    async fn check_image(&self, image: &str) -> Result<ImageFacts, ProviderError> {
        self.enter(Call::CheckImage(image.to_owned())).await?;
        let state = self.state();
        if state.missing_images.contains(image) {
            return Err(ProviderError::ImageUnavailable {
                image: image.to_owned(),
            });
        }
        let built = state.rebuilt.get(image).copied().unwrap_or(0);
        Ok(ImageFacts {
            id: format!("fake:{image}#{built}"),
            runner_version: state.image_versions.get(image).cloned(),
        })
    }

    /// What [`FakeProvider::set_output`] set, else nothing.
    async fn output_tail(&self, name: &InstanceName) -> Result<String, ProviderError> {
        Ok(self
            .state()
            .outputs
            .get(name.as_str())
            .cloned()
            .unwrap_or_default())
    }

    /// At most [`FakeProvider::set_cpus`] vCPUs, memory as asked.
    async fn shape(&self, vcpu: u32, memory: ByteSize) -> Result<(u32, ByteSize), ProviderError> {
        Ok((
            self.state().cpus.map_or(vcpu, |cpus| vcpu.min(cpus)),
            memory,
        ))
    }

    /// Records the spec and its JIT config, then creates the instance
    /// `fake-<n>`, sends on `created`, and starts it (held while
    /// [`Operation::Start`] is blocked).
    ///
    /// # Errors
    ///
    /// [`ProviderError::Refused`] for a name that is not `billet-<lease>` or
    /// an empty command; [`ProviderError::Engine`] for an injected failure
    /// (of the create: nothing exists; of the start: the instance stays,
    /// created and not running) or a name already in use.
    async fn create_then_start(
        &self,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        {
            let mut state = self.state();
            state.jit_configs.push(spec.jit_config.clone());
            state.specs.push(spec.clone());
        }
        self.enter(Call::Create(spec.name.clone())).await?;
        let operation = format!("create {}", spec.name);
        if spec.name != InstanceName::for_lease(&spec.lease) {
            return Err(ProviderError::Refused(format!(
                "instance name {} is not the name of lease {}",
                spec.name, spec.lease
            )));
        }
        if spec.command.is_empty() {
            return Err(ProviderError::Refused(format!(
                "{}: the runner command is empty",
                spec.name
            )));
        }
        let labels = self.labels_for(&spec);
        let mut instance = {
            let mut state = self.state();
            if state.missing_images.contains(&spec.image) {
                return Err(ProviderError::ImageUnavailable { image: spec.image });
            }
            if state.instances.contains_key(spec.name.as_str()) {
                return Err(ProviderError::Engine {
                    operation,
                    message: format!("the name {} is already in use", spec.name),
                });
            }
            state.next_id += 1;
            let instance = Instance {
                id: format!("fake-{}", state.next_id),
                name: spec.name.as_str().to_owned(),
                state: InstanceState::Created,
                labels,
            };
            state
                .instances
                .insert(instance.name.clone(), instance.clone());
            instance
        };
        let _ = created.send(());
        super::await_start(start, &operation).await?;
        let mut blocked = self.blocked.subscribe();
        // The sender lives as long as `self`, so this cannot fail.
        let _ = blocked
            .wait_for(|set| !set.contains(&Operation::Start))
            .await;
        let mut state = self.state();
        if let Some(left) = state.fail_next.get_mut(&Operation::Start)
            && *left > 0
        {
            *left -= 1;
            return Err(ProviderError::Engine {
                operation: format!("start {}", spec.name),
                message: "injected failure".to_owned(),
            });
        }
        instance.state = InstanceState::Running;
        if let Some(present) = state.instances.get_mut(&instance.name) {
            present.state = InstanceState::Running;
        }
        if state.create_fails_after_starting > 0 {
            state.create_fails_after_starting -= 1;
            return Err(ProviderError::Engine {
                operation,
                message: "injected failure after the instance started".to_owned(),
            });
        }
        Ok(instance)
    }

    /// Removes the instance as the [`DestroyMode`] says.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] for an injected failure (the instance is
    /// untouched).
    async fn destroy(&self, name: &InstanceName) -> Result<Teardown, ProviderError> {
        self.enter(Call::Destroy(name.clone())).await?;
        let mut state = self.state();
        match state.destroy_mode {
            DestroyMode::Stop => {
                state.instances.remove(name.as_str());
                Ok(Teardown::Stopped)
            }
            DestroyMode::RequestAndRemove => {
                state.instances.remove(name.as_str());
                Ok(Teardown::Requested)
            }
            DestroyMode::RequestAndKeep => Ok(Teardown::Requested),
        }
    }

    /// Stops a running instance: it exits 143 (SIGTERM), or, marked with
    /// [`FakeProvider::ignore_sigterm`], 137 (SIGKILL) once `timeout` has
    /// passed (in tokio time). Not running, or gone, is success.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] for an injected failure.
    async fn stop(&self, name: &InstanceName, timeout: Duration) -> Result<(), ProviderError> {
        self.enter(Call::Stop(name.clone(), timeout)).await?;
        let stubborn = {
            let state = self.state();
            match state.instances.get(name.as_str()) {
                Some(i) if i.may_run() => state.ignores_sigterm.contains(name.as_str()),
                _ => return Ok(()),
            }
        };
        let code = if stubborn {
            tokio::time::sleep(timeout).await;
            137
        } else {
            143
        };
        self.exit(name.as_str(), code, false);
        Ok(())
    }

    /// Every instance, sorted by name.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] for an injected failure.
    async fn list(&self) -> Result<Vec<Instance>, ProviderError> {
        self.enter(Call::List).await?;
        Ok(self
            .instances()
            .into_iter()
            .filter(|i| InstanceName::warm(&i.name).is_none())
            .collect())
    }

    /// The instance named exactly `name`.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] for an injected failure.
    async fn find(&self, name: &InstanceName) -> Result<Option<Instance>, ProviderError> {
        self.enter(Call::Find(name.clone())).await?;
        Ok(self.instance(name.as_str()))
    }

    async fn work(&self, name: &InstanceName) -> Result<Work, ProviderError> {
        self.enter(Call::Work(name.clone())).await?;
        let runs = self
            .instance(name.as_str())
            .is_some_and(|instance| instance.may_run());
        Ok(if runs && self.state().working.contains(name.as_str()) {
            Work::Busy
        } else {
            Work::Idle
        })
    }

    /// Creates the warm runner, running, labelled with its tier.
    ///
    /// # Errors
    ///
    /// As a create: an injected [`Operation::Create`] failure, a missing
    /// image, a name in use.
    async fn create_warm(&self, spec: super::WarmSpec) -> Result<Instance, ProviderError> {
        self.enter(Call::Create(spec.name.clone())).await?;
        if InstanceName::warm(spec.name.as_str()).is_none() || spec.command.is_empty() {
            return Err(ProviderError::Refused(format!(
                "{}: not a warm runner's name, or an empty command",
                spec.name
            )));
        }
        let mut state = self.state();
        if state.missing_images.contains(&spec.image) {
            return Err(ProviderError::ImageUnavailable { image: spec.image });
        }
        if state.instances.contains_key(spec.name.as_str()) {
            return Err(ProviderError::Engine {
                operation: format!("create {}", spec.name),
                message: format!("the name {} is already in use", spec.name),
            });
        }
        state.next_id += 1;
        let instance = Instance {
            id: format!("fake-{}", state.next_id),
            name: spec.name.as_str().to_owned(),
            state: InstanceState::Running,
            labels: BTreeMap::from([
                (labels::DEPLOYMENT.to_owned(), self.owner.deployment.clone()),
                (labels::NODE.to_owned(), self.owner.node.to_string()),
                (labels::WARM.to_owned(), spec.tier.clone()),
            ]),
        };
        state
            .instances
            .insert(instance.name.clone(), instance.clone());
        Ok(instance)
    }

    async fn list_warm(&self) -> Result<Vec<Instance>, ProviderError> {
        self.enter(Call::List).await?;
        Ok(self
            .instances()
            .into_iter()
            .filter(|i| InstanceName::warm(&i.name).is_some())
            .collect())
    }

    /// Renames the warm runner to `spec`'s name, records the JIT config it
    /// is handed once `start` opens.
    ///
    /// # Errors
    ///
    /// [`ProviderError::Engine`] for an injected [`Operation::Create`]
    /// failure or a warm runner that is gone or not running (nothing
    /// renamed); [`ProviderError::StartWithheld`] when `start` closes.
    async fn claim_warm(
        &self,
        warm: &InstanceName,
        spec: InstanceSpec,
        created: tokio::sync::oneshot::Sender<()>,
        start: super::StartGate,
    ) -> Result<Instance, ProviderError> {
        self.enter(Call::Create(spec.name.clone())).await?;
        let operation = format!("claim {warm} as {}", spec.name);
        let instance = {
            let mut state = self.state();
            let runs = state
                .instances
                .get(warm.as_str())
                .is_some_and(|i| i.state == InstanceState::Running);
            if !runs || state.instances.contains_key(spec.name.as_str()) {
                return Err(ProviderError::Engine {
                    operation,
                    message: "the warm runner is not running, or the name is in use".to_owned(),
                });
            }
            let mut instance = state
                .instances
                .remove(warm.as_str())
                .expect("checked above");
            instance.name = spec.name.as_str().to_owned();
            state
                .instances
                .insert(instance.name.clone(), instance.clone());
            instance
        };
        let _ = created.send(());
        super::await_start(start, &operation).await?;
        let mut state = self.state();
        state.jit_configs.push(spec.jit_config.clone());
        state.specs.push(spec);
        Ok(instance)
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use futures::FutureExt as _;

    use super::*;
    use crate::model::{ByteSize, Epoch, LeaseId, RequestId};
    use crate::provider::contract;

    fn spec(lease: &str, jit: &str) -> InstanceSpec {
        let lease = LeaseId::parse("lease", lease).unwrap();
        InstanceSpec {
            name: InstanceName::for_lease(&lease),
            lease,
            epoch: Epoch(3),
            request_id: RequestId(42),
            image: "runner:latest".into(),
            command: vec!["/run.sh".into()],
            vcpu: 2,
            memory: ByteSize(1 << 30),
            shm: ByteSize(0),
            network: None,
            env: vec![],
            jit_config: JitConfig::new(jit.into()),
            binds: Vec::new(),
            cache_token: None,
            actions_proxy: None,
            host: Default::default(),
            pids_limit: None,
        }
    }

    fn name(lease: &str) -> InstanceName {
        InstanceName::for_lease(&LeaseId::parse("lease", lease).unwrap())
    }

    #[tokio::test]
    async fn a_created_instance_is_listed_found_and_labelled_with_its_lease() {
        let fake = FakeProvider::new();
        let created = fake.create(spec("a", "jit-a")).await.unwrap();
        assert_eq!(created.id, "fake-1");
        assert_eq!(created.name, "billet-a");
        assert_eq!(created.state, InstanceState::Running);
        assert_eq!(created.lease(), Some(LeaseId::parse("l", "a").unwrap()));
        assert_eq!(created.labels[labels::EPOCH], "3");
        assert_eq!(created.labels[labels::REQUEST], "42");
        assert_eq!(created.labels[labels::DEPLOYMENT], "fake-deployment");
        assert_eq!(created.labels[labels::NODE], "fake-node");

        assert_eq!(fake.list().await.unwrap(), vec![created.clone()]);
        assert_eq!(fake.find(&name("a")).await.unwrap(), Some(created));
        assert_eq!(fake.find(&name("b")).await.unwrap(), None);
        assert_eq!(
            fake.calls(),
            vec![
                Call::Create(name("a")),
                Call::List,
                Call::Find(name("a")),
                Call::Find(name("b")),
            ]
        );
        assert_eq!(fake.count(Operation::Find), 2);
    }

    #[tokio::test]
    async fn an_injected_create_failure_creates_nothing_and_wears_off() {
        let fake = FakeProvider::new();
        fake.fail_next(Operation::Create, 2);
        assert!(fake.create(spec("a", "j1")).await.is_err());
        assert!(fake.create(spec("a", "j2")).await.is_err());
        assert!(fake.instances().is_empty());
        fake.create(spec("a", "j3")).await.unwrap();
        assert_eq!(fake.instances().len(), 1);
        assert_eq!(fake.count(Operation::Create), 3);
    }

    #[tokio::test]
    async fn a_create_that_fails_after_starting_leaves_a_running_instance() {
        let fake = FakeProvider::new();
        fake.fail_create_after_starting(1);
        let err = fake.create(spec("a", "j")).await.unwrap_err();
        assert!(matches!(err, ProviderError::Engine { .. }), "{err}");
        let left = fake.instance("billet-a").expect("the instance exists");
        assert!(left.may_run());
        // The failure wore off; the name is now taken, as in Docker.
        let err = fake.create(spec("a", "j2")).await.unwrap_err();
        assert!(err.to_string().contains("already in use"), "{err}");
    }

    #[tokio::test]
    async fn destroy_is_idempotent_and_answers_as_its_mode_says() {
        let fake = FakeProvider::new();
        fake.create(spec("a", "j")).await.unwrap();
        assert_eq!(fake.destroy(&name("a")).await.unwrap(), Teardown::Stopped);
        assert_eq!(fake.destroy(&name("a")).await.unwrap(), Teardown::Stopped);
        assert!(fake.instances().is_empty());

        fake.set_destroy_mode(DestroyMode::RequestAndKeep);
        fake.create(spec("b", "j2")).await.unwrap();
        assert_eq!(fake.destroy(&name("b")).await.unwrap(), Teardown::Requested);
        assert!(fake.instance("billet-b").is_some());
        assert!(fake.remove_behind_back("billet-b"));
        assert_eq!(fake.destroy(&name("b")).await.unwrap(), Teardown::Requested);

        fake.set_destroy_mode(DestroyMode::RequestAndRemove);
        fake.create(spec("c", "j3")).await.unwrap();
        assert_eq!(fake.destroy(&name("c")).await.unwrap(), Teardown::Requested);
        assert!(fake.instance("billet-c").is_none());
    }

    #[tokio::test]
    async fn an_injected_destroy_failure_leaves_the_instance() {
        let fake = FakeProvider::new();
        fake.create(spec("a", "j")).await.unwrap();
        fake.fail_next(Operation::Destroy, 1);
        assert!(fake.destroy(&name("a")).await.is_err());
        assert!(fake.instance("billet-a").is_some());
        assert_eq!(fake.destroy(&name("a")).await.unwrap(), Teardown::Stopped);
    }

    #[tokio::test]
    async fn injected_read_failures_are_errors_not_empty_inventories() {
        let fake = FakeProvider::new();
        fake.create(spec("a", "j")).await.unwrap();
        fake.fail_next(Operation::List, 1);
        fake.fail_next(Operation::Find, 1);
        assert!(fake.list().await.is_err());
        assert!(fake.find(&name("a")).await.is_err());
        assert_eq!(fake.list().await.unwrap().len(), 1);
        assert!(fake.find(&name("a")).await.unwrap().is_some());
    }

    #[tokio::test]
    async fn create_refuses_a_name_that_is_not_the_leases_and_an_empty_command() {
        let fake = FakeProvider::new();
        let mut wrong_name = spec("a", "j1");
        wrong_name.name = name("b");
        assert!(matches!(
            fake.create(wrong_name).await,
            Err(ProviderError::Refused(_))
        ));
        let mut no_command = spec("a", "j2");
        no_command.command.clear();
        assert!(matches!(
            fake.create(no_command).await,
            Err(ProviderError::Refused(_))
        ));
        assert!(fake.instances().is_empty());
    }

    #[tokio::test]
    async fn the_inventory_can_change_behind_the_runners_back() {
        let fake = FakeProvider::new();
        fake.create(spec("a", "j")).await.unwrap();
        assert!(fake.exit("billet-a", 137, true));
        let a = fake.find(&name("a")).await.unwrap().unwrap();
        assert_eq!(
            a.state,
            InstanceState::Exited(Exit {
                code: 137,
                oom_killed: true
            })
        );
        assert!(!a.may_run());
        assert!(!fake.exit("billet-missing", 0, false));

        fake.insert_behind_back(Instance {
            id: "other".into(),
            name: "postgres".into(),
            state: InstanceState::Running,
            labels: BTreeMap::new(),
        });
        let names: Vec<_> = fake
            .list()
            .await
            .unwrap()
            .into_iter()
            .map(|i| i.name)
            .collect();
        assert_eq!(names, ["billet-a", "postgres"]);
        assert!(fake.remove_behind_back("billet-a"));
        assert!(!fake.remove_behind_back("billet-a"));
        assert_eq!(fake.find(&name("a")).await.unwrap(), None);
        // None of this was a call.
        assert_eq!(fake.count(Operation::Destroy), 0);
    }

    #[tokio::test]
    async fn every_jit_config_handed_to_create_is_kept_but_never_printed() {
        let fake = FakeProvider::new();
        fake.fail_next(Operation::Create, 1);
        let _ = fake.create(spec("a", "secret-one")).await;
        fake.create(spec("a", "secret-two")).await.unwrap();
        let used = fake.jit_configs_used();
        assert_eq!(
            used.iter().map(JitConfig::expose).collect::<Vec<_>>(),
            ["secret-one", "secret-two"]
        );
        assert_eq!(fake.specs().len(), 2);
        let debug = format!("{fake:?} {used:?} {:?}", fake.specs());
        assert!(!debug.contains("secret-"), "{debug}");
    }

    #[tokio::test]
    async fn a_blocked_operation_is_recorded_and_held_until_released() {
        let fake = FakeProvider::new();
        fake.block(Operation::List);
        let mut list = Box::pin(fake.list());
        assert!(
            (&mut list).now_or_never().is_none(),
            "list ran while blocked"
        );
        assert_eq!(fake.calls(), vec![Call::List]);
        // Other operations are not held.
        assert_eq!(fake.find(&name("a")).await.unwrap(), None);
        fake.unblock(Operation::List);
        let listed = tokio::time::timeout(Duration::from_secs(5), list)
            .await
            .expect("list released within 5s");
        assert_eq!(listed.unwrap(), vec![]);
    }

    /// The fake's side of the provider contract (`contract.rs`): it plays
    /// the runner's exits itself, as the engine would record them.
    struct FakeDriver {
        fake: FakeProvider,
        next: std::sync::atomic::AtomicU32,
    }

    const MISSING_IMAGE: &str = "billet-no-such-image:none";

    impl FakeDriver {
        fn new() -> Self {
            let fake = FakeProvider::new();
            fake.remove_image(MISSING_IMAGE);
            Self {
                fake,
                next: std::sync::atomic::AtomicU32::new(0),
            }
        }
    }

    #[async_trait]
    impl contract::Driver for FakeDriver {
        fn provider(&self) -> &dyn Provider {
            &self.fake
        }

        fn spec(&self, tag: &str, _behaviour: contract::Behaviour) -> InstanceSpec {
            let n = self.next.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let mut spec = spec(&format!("{tag}-{n}"), "jit");
            spec.memory = ByteSize(128 << 20);
            spec
        }

        async fn enact(&self, name: &InstanceName, behaviour: contract::Behaviour) {
            match behaviour {
                contract::Behaviour::Work => {}
                contract::Behaviour::Exit(code) => {
                    self.fake.exit(name.as_str(), code, false);
                }
                contract::Behaviour::Allocate => {
                    self.fake.exit(name.as_str(), 137, true);
                }
                contract::Behaviour::Job => self.fake.set_working(name.as_str(), true),
            }
        }

        async fn kill(&self, name: &InstanceName) {
            self.fake.exit(name.as_str(), 137, false);
        }

        async fn remove_out_of_band(&self, name: &InstanceName) {
            self.fake.remove_behind_back(name.as_str());
        }

        async fn unreachable(&self) -> Box<dyn Provider> {
            let fake = FakeProvider::new();
            fake.set_engine(Engine::Unreachable);
            Box::new(fake)
        }

        async fn hanging(&self, bound: Duration) -> Box<dyn Provider> {
            let fake = FakeProvider::new().with_timeout(bound);
            fake.set_engine(Engine::Hanging);
            Box::new(fake)
        }

        fn missing_image(&self) -> String {
            MISSING_IMAGE.to_owned()
        }
    }

    #[tokio::test]
    async fn the_fake_reads_a_runner_busy_exactly_while_its_job_process_runs() {
        contract::a_runner_is_busy_exactly_while_its_job_process_runs(&FakeDriver::new()).await;
    }

    #[tokio::test]
    async fn the_fake_keeps_an_exited_instance_with_its_code_until_destroyed() {
        contract::an_exited_instance_is_present_with_its_code_until_destroyed(&FakeDriver::new())
            .await;
    }

    #[tokio::test]
    async fn the_fake_reports_an_oom_kill() {
        contract::an_oom_killed_instance_says_so(&FakeDriver::new()).await;
    }

    #[tokio::test]
    async fn the_fake_reports_a_kill_as_137_without_oom() {
        contract::a_killed_instance_is_exited_137_without_the_oom_flag(&FakeDriver::new()).await;
    }

    #[tokio::test]
    async fn the_fake_forgets_an_instance_removed_out_of_band() {
        contract::an_instance_removed_out_of_band_is_absent(&FakeDriver::new()).await;
    }

    #[tokio::test]
    async fn the_fake_leaves_a_created_instance_unstarted_when_its_start_is_withheld() {
        contract::a_create_whose_start_is_withheld_leaves_the_instance_created_until_destroyed(
            &FakeDriver::new(),
        )
        .await;
    }

    #[tokio::test]
    async fn the_fake_refuses_a_missing_image_before_and_at_create() {
        contract::a_missing_image_is_unavailable_and_creates_nothing(&FakeDriver::new()).await;
    }

    #[tokio::test]
    async fn the_fake_with_its_engine_down_fails_every_call_typed() {
        contract::an_unreachable_engine_fails_every_call_typed(&FakeDriver::new()).await;
    }

    #[tokio::test]
    async fn the_fake_with_its_engine_hanging_fails_every_call_typed_within_its_bound() {
        contract::a_hanging_engine_fails_every_call_typed_within_its_bound(&FakeDriver::new())
            .await;
    }

    #[tokio::test]
    async fn kind_is_configurable_and_defaults_to_docker() {
        assert_eq!(FakeProvider::new().kind(), "docker");
        let fake = FakeProvider::new().with_kind("firecracker");
        assert_eq!(fake.kind(), "firecracker");
        assert!(fake.runs_on_host());
    }
}
