//! GitHub through the `scaleset` crate: scale sets by tier label, JIT
//! minting and runner removal. The same code works against real GitHub with
//! an App credential; tests and the demo point it at the crate's emulator.

use std::collections::HashMap;
use std::sync::Mutex;

use scaleset::{
    Client, ExposeSecret, JitRunnerSetting, RunnerGroupId, RunnerId, RunnerScaleSetSpec, ScaleSetId,
};
use thiserror::Error;

/// A GitHub call that failed.
#[derive(Debug, Error)]
#[error("GitHub {operation}: {source}")]
pub struct GithubError {
    /// What was attempted.
    pub operation: String,
    /// The crate's error.
    #[source]
    pub source: scaleset::Error,
}

/// A minted registration. `config` is a credential.
pub struct Minted {
    /// The encoded JIT config.
    pub config: String,
    /// GitHub's runner id.
    pub runner_id: i64,
    /// The name GitHub registered.
    pub runner_name: String,
}

impl std::fmt::Debug for Minted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Minted")
            .field("config", &"<redacted>")
            .field("runner_id", &self.runner_id)
            .field("runner_name", &self.runner_name)
            .finish()
    }
}

/// The plane's GitHub client with a cache of scale-set ids by tier label.
#[derive(Debug)]
pub struct Github {
    client: Client,
    scale_sets: Mutex<HashMap<String, ScaleSetId>>,
}

impl Github {
    /// Wraps a scaleset client.
    pub fn new(client: Client) -> Self {
        Self {
            client,
            scale_sets: Mutex::new(HashMap::new()),
        }
    }

    /// The underlying client (for the listener).
    pub fn client(&self) -> &Client {
        &self.client
    }

    /// The scale set for a tier label, created in the default runner group
    /// if missing.
    ///
    /// # Errors
    ///
    /// [`GithubError`] when GitHub cannot be asked.
    pub async fn ensure_scale_set(&self, label: &str) -> Result<ScaleSetId, GithubError> {
        if let Some(id) = self.scale_sets.lock().expect("scale sets").get(label) {
            return Ok(*id);
        }
        let err = |operation: &str| {
            let operation = format!("{operation} scale set {label}");
            move |source| GithubError { operation, source }
        };
        let id = match self
            .client
            .get_runner_scale_set_by_name(RunnerGroupId::DEFAULT, label)
            .await
            .map_err(err("look up"))?
        {
            Some(set) => set.id,
            None => {
                self.client
                    .create_runner_scale_set(&RunnerScaleSetSpec::new(label))
                    .await
                    .map_err(err("create"))?
                    .id
            }
        };
        self.scale_sets
            .lock()
            .expect("scale sets")
            .insert(label.to_owned(), id);
        Ok(id)
    }

    /// Mints a JIT config for `runner_name` in the tier's scale set. Never
    /// retried here: a lost answer may still have registered the runner.
    ///
    /// # Errors
    ///
    /// [`GithubError`]; the scale-set cache entry is dropped so the next
    /// mint re-resolves it.
    pub async fn mint(&self, tier: &str, runner_name: &str) -> Result<Minted, GithubError> {
        let set = self.ensure_scale_set(tier).await?;
        let mut setting = JitRunnerSetting::new(runner_name);
        setting.work_folder = "_work".into();
        match self.client.generate_jit_config(set, &setting).await {
            Ok(jit) => {
                let (runner_id, name) = jit
                    .runner
                    .map_or((0, runner_name.to_owned()), |r| (r.id.get(), r.name));
                Ok(Minted {
                    config: jit.encoded_jit_config.expose_secret().to_owned(),
                    runner_id,
                    runner_name: name,
                })
            }
            Err(source) => {
                self.scale_sets.lock().expect("scale sets").remove(tier);
                Err(GithubError {
                    operation: format!("mint a JIT config for {runner_name}"),
                    source,
                })
            }
        }
    }

    /// Removes a runner by id, or by name when the id is unknown. Already
    /// gone is success.
    ///
    /// # Errors
    ///
    /// [`GithubError`] when GitHub refuses (for example, the runner is busy).
    pub async fn remove_runner(
        &self,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<(), GithubError> {
        let id = if runner_id > 0 {
            RunnerId(runner_id)
        } else {
            match self.client.get_runner_by_name(runner_name).await {
                Ok(Some(r)) => r.id,
                Ok(None) => return Ok(()),
                Err(source) => {
                    return Err(GithubError {
                        operation: format!("look up runner {runner_name}"),
                        source,
                    });
                }
            }
        };
        match self.client.remove_runner(id).await {
            Ok(()) => Ok(()),
            Err(e) if e.is_not_found() || e.is_runner_not_found() => Ok(()),
            Err(source) => Err(GithubError {
                operation: format!("remove runner {runner_name} ({id})"),
                source,
            }),
        }
    }
}
