//! GitHub through the `scaleset` crate: scale sets by tier label, JIT
//! minting and runner removal. The same code works against real GitHub with
//! an App credential; tests and the demo point it at the crate's emulator.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use scaleset::{
    Client, ExposeSecret, JitRunnerSetting, RunnerGroupId, RunnerId, RunnerReference,
    RunnerScaleSetSpec, ScaleSetId,
};
use thiserror::Error;

/// How long a scale set GitHub said it does not have is believed missing:
/// within it no call about the set reaches GitHub (mints are refused from
/// the cache and the plane launches nothing for the set); after it, one
/// lookup by name asks again.
pub const SCALE_SET_RETRY: std::time::Duration = std::time::Duration::from_secs(30);

/// A GitHub call that failed.
#[derive(Debug, Error)]
pub enum GithubError {
    /// GitHub has no scale set by this name (it was deleted, or a mint
    /// answered 404). Typed so callers branch on it rather than on text;
    /// the wire code is `SCALE_SET_NOT_FOUND`.
    #[error(
        "GitHub has no runner scale set named {set:?}; nothing is launched for it until it exists again (asked at most every {}s)",
        SCALE_SET_RETRY.as_secs()
    )]
    ScaleSetNotFound {
        /// The set's name (the tier label).
        set: String,
    },
    /// GitHub already has a runner named `name` in another scale set than
    /// the tier's (a mint answered 409 AgentExists): the name cannot be
    /// minted, and asking again will not change that. Typed so callers
    /// neither retry it as an outage nor touch that runner; the wire code
    /// is `RUNNER_NAME_TAKEN`.
    #[error(
        "GitHub already has a runner named {name:?} in another scale set ({held_by}), so none can be minted under that name; the job needs another lease"
    )]
    RunnerNameTaken {
        /// The runner name.
        name: String,
        /// Which scale set holds it, as far as GitHub said.
        held_by: String,
    },
    /// Any other failure of a call.
    #[error("GitHub {operation}: {source}")]
    Call {
        /// What was attempted.
        operation: String,
        /// The crate's error.
        #[source]
        source: scaleset::Error,
    },
}

impl GithubError {
    /// GitHub refused because the runner is running a job (an answer, not
    /// an outage).
    pub(crate) fn is_job_still_running(&self) -> bool {
        matches!(self, GithubError::Call { source, .. } if source.is_job_still_running())
    }

    /// The scale set is missing.
    pub(crate) fn is_scale_set_not_found(&self) -> bool {
        matches!(self, GithubError::ScaleSetNotFound { .. })
    }

    /// Another scale set holds a runner of the name.
    pub(crate) fn is_runner_name_taken(&self) -> bool {
        matches!(self, GithubError::RunnerNameTaken { .. })
    }
}

/// What the plane believes about one scale set.
#[derive(Debug, Clone, Copy)]
enum SetState {
    Found(ScaleSetId),
    /// GitHub said it has no such set at `since`.
    Missing {
        since: Instant,
    },
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

/// The plane's GitHub client with a cache of scale sets by tier label:
/// found (its id) or missing (since when), so a deleted set costs at most
/// one GitHub call per [`SCALE_SET_RETRY`].
#[derive(Debug)]
pub struct Github {
    client: Client,
    scale_sets: Mutex<HashMap<String, SetState>>,
    retry: Duration,
}

impl Github {
    /// Wraps a scaleset client; a missing set is asked about again after
    /// [`SCALE_SET_RETRY`].
    pub fn new(client: Client) -> Self {
        Self::with_retry(client, SCALE_SET_RETRY)
    }

    /// Wraps a scaleset client; a missing set is asked about again after
    /// `retry`.
    pub(crate) fn with_retry(client: Client, retry: Duration) -> Self {
        Self {
            client,
            scale_sets: Mutex::new(HashMap::new()),
            retry,
        }
    }

    /// Records that GitHub has no set named `label` (a mint or a listener
    /// poll answered 404). Logged once per retry interval.
    pub(crate) fn mark_missing(&self, label: &str) {
        let mut sets = self.scale_sets.lock().expect("scale sets");
        if !matches!(sets.get(label), Some(SetState::Missing { .. })) {
            tracing::warn!(
                scale_set = label,
                retry_secs = self.retry.as_secs(),
                "GitHub has no runner scale set by this name; launching nothing for it and asking again after the retry interval"
            );
        }
        sets.insert(
            label.to_owned(),
            SetState::Missing {
                since: Instant::now(),
            },
        );
    }

    /// The set's id from the cache, without calling GitHub: `Ok(None)` when
    /// unknown or when a missing set's interval has passed (ask with
    /// [`Github::scale_set`]).
    ///
    /// # Errors
    ///
    /// [`GithubError::ScaleSetNotFound`] while the set is believed missing.
    pub(crate) fn cached_scale_set(&self, label: &str) -> Result<Option<ScaleSetId>, GithubError> {
        match self.scale_sets.lock().expect("scale sets").get(label) {
            Some(SetState::Found(id)) => Ok(Some(*id)),
            Some(SetState::Missing { since }) if since.elapsed() < self.retry => {
                Err(GithubError::ScaleSetNotFound {
                    set: label.to_owned(),
                })
            }
            _ => Ok(None),
        }
    }

    /// The set's id: from the cache, or by one lookup by name when it is
    /// unknown or its missing interval has passed. Never creates it.
    ///
    /// # Errors
    ///
    /// [`GithubError::ScaleSetNotFound`] when GitHub has no such set (now
    /// cached), [`GithubError::Call`] when GitHub cannot be asked.
    pub(crate) async fn scale_set(&self, label: &str) -> Result<ScaleSetId, GithubError> {
        if let Some(id) = self.cached_scale_set(label)? {
            return Ok(id);
        }
        match self
            .client
            .get_runner_scale_set_by_name(RunnerGroupId::DEFAULT, label)
            .await
        {
            Ok(Some(set)) => {
                let was_missing = matches!(
                    self.scale_sets
                        .lock()
                        .expect("scale sets")
                        .insert(label.to_owned(), SetState::Found(set.id)),
                    Some(SetState::Missing { .. })
                );
                if was_missing {
                    tracing::info!(scale_set = label, id = %set.id, "the runner scale set is back");
                }
                Ok(set.id)
            }
            Ok(None) => {
                self.mark_missing(label);
                Err(GithubError::ScaleSetNotFound {
                    set: label.to_owned(),
                })
            }
            Err(source) => Err(GithubError::Call {
                operation: format!("look up scale set {label}"),
                source,
            }),
        }
    }

    /// The underlying client (for the listener).
    pub(crate) fn client(&self) -> &Client {
        &self.client
    }

    /// The scale set for a tier label, created in the default runner group
    /// if missing.
    ///
    /// # Errors
    ///
    /// [`GithubError`] when GitHub cannot be asked.
    pub(crate) async fn ensure_scale_set(&self, label: &str) -> Result<ScaleSetId, GithubError> {
        if let Some(SetState::Found(id)) = self.scale_sets.lock().expect("scale sets").get(label) {
            return Ok(*id);
        }
        let err = |operation: &str| {
            let operation = format!("{operation} scale set {label}");
            move |source| GithubError::Call { operation, source }
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
            .insert(label.to_owned(), SetState::Found(id));
        Ok(id)
    }

    /// Mints a JIT config for `runner_name` in the tier's scale set. Never
    /// retried here: a lost answer may still have registered the runner.
    ///
    /// # Errors
    ///
    /// [`GithubError::ScaleSetNotFound`] when the set is believed missing
    /// (no call is made) or GitHub answers 404 (the set is then believed
    /// missing for the retry interval); [`GithubError::RunnerNameTaken`]
    /// when GitHub answers 409 AgentExists and the runner of that name is
    /// not in the tier's set (or cannot be found at all); [`GithubError::Call`]
    /// otherwise, a name taken in the tier's own set included (a mint of
    /// this plane whose answer was lost: the registration pass removes it).
    pub async fn mint(&self, tier: &str, runner_name: &str) -> Result<Minted, GithubError> {
        let set = self.scale_set(tier).await?;
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
            Err(source) if source.is_not_found() => {
                self.mark_missing(tier);
                Err(GithubError::ScaleSetNotFound {
                    set: tier.to_owned(),
                })
            }
            Err(source) if source.is_runner_exists() => {
                let held_by = match self.client.get_runner_by_name(runner_name).await {
                    Ok(Some(r)) if r.runner_scale_set_id == set => {
                        return Err(GithubError::Call {
                            operation: format!(
                                "mint a JIT config for {runner_name}, which this scale set already has"
                            ),
                            source,
                        });
                    }
                    Ok(Some(r)) => format!("scale set {}", r.runner_scale_set_id),
                    Ok(None) => "one GitHub did not name".to_owned(),
                    Err(e) => format!("one GitHub did not name: {e}"),
                };
                Err(GithubError::RunnerNameTaken {
                    name: runner_name.to_owned(),
                    held_by,
                })
            }
            Err(source) => Err(GithubError::Call {
                operation: format!("mint a JIT config for {runner_name}"),
                source,
            }),
        }
    }

    /// Whether GitHub still has the registration with this id: `false` on
    /// 404.
    ///
    /// # Errors
    ///
    /// [`GithubError::Call`] when GitHub cannot answer (5xx, timeouts):
    /// unknown, which is not the same as gone.
    pub(crate) async fn runner_exists(&self, runner_id: i64) -> Result<bool, GithubError> {
        match self.client.get_runner(RunnerId(runner_id)).await {
            Ok(_) => Ok(true),
            Err(e) if e.is_not_found() || e.is_runner_not_found() => Ok(false),
            Err(source) => Err(GithubError::Call {
                operation: format!("look up runner {runner_id}"),
                source,
            }),
        }
    }

    /// The registration named `runner_name`, if GitHub has one, in
    /// whichever scale set holds it (the caller checks the set: a name is
    /// unique across sets, and another set's runner is not this plane's).
    ///
    /// # Errors
    ///
    /// [`GithubError::Call`] when GitHub cannot answer (5xx, timeouts).
    pub(crate) async fn runner_by_name(
        &self,
        runner_name: &str,
    ) -> Result<Option<RunnerReference>, GithubError> {
        match self.client.get_runner_by_name(runner_name).await {
            Ok(found) => Ok(found),
            Err(source) => Err(GithubError::Call {
                operation: format!("look up runner {runner_name}"),
                source,
            }),
        }
    }

    /// Removes a runner by id, or by name when the id is unknown. Already
    /// gone is success: `Ok(true)` when this call removed it, `Ok(false)`
    /// when GitHub no longer had it (an ephemeral runner's registration
    /// goes with its completed job).
    ///
    /// # Errors
    ///
    /// [`GithubError`] when GitHub refuses (for example, the runner is busy).
    pub async fn remove_runner(
        &self,
        runner_id: i64,
        runner_name: &str,
    ) -> Result<bool, GithubError> {
        let id = if runner_id > 0 {
            RunnerId(runner_id)
        } else {
            match self.client.get_runner_by_name(runner_name).await {
                Ok(Some(r)) => r.id,
                Ok(None) => return Ok(false),
                Err(source) => {
                    return Err(GithubError::Call {
                        operation: format!("look up runner {runner_name}"),
                        source,
                    });
                }
            }
        };
        match self.client.remove_runner(id).await {
            Ok(()) => Ok(true),
            Err(e) if e.is_not_found() || e.is_runner_not_found() => Ok(false),
            Err(source) => Err(GithubError::Call {
                operation: format!("remove runner {runner_name} ({id})"),
                source,
            }),
        }
    }
}
