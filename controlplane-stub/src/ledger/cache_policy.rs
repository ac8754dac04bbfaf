//! The Actions cache kill switch (spec/cache.md §5.2, the reference's
//! `cache_interception_blocks`): an operator blocks an organisation or one
//! repository, and a node asks, before it serves a repository's Actions cache
//! from its local storage, whether it may.
//!
//! One row per block in `cache_blocks` (migration 5 on both backends):
//! `(scope, owner, repository)`, `repository` empty for an organisation's
//! block. Names are kept lower-cased (GitHub's names do not differ by
//! case). A repository is allowed iff neither its owner nor
//! `owner/repository` is blocked. Enabling a repository removes only its
//! own block; enabling an organisation removes only the organisation's
//! block, so a repository blocked on its own stays blocked.
//!
//! No lease rule lives here.

use sqlx::Row as _;

use super::{Ledger, LedgerError, Result};

/// The longest owner or repository name, in characters (GitHub's limit).
pub(crate) const MAX_NAME_CHARS: usize = 100;

/// What an operator blocks from the node-local Actions cache.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum CacheBlock {
    /// Every repository of an organisation (or user).
    Org(String),
    /// One repository.
    Repository {
        /// The owner.
        owner: String,
        /// The repository's name within the owner.
        repository: String,
    },
}

/// A name checked and lower-cased: 1 to [`MAX_NAME_CHARS`] characters, no
/// `/`, whitespace or NUL. `what` names the field in the error.
///
/// # Errors
///
/// [`LedgerError::Invalid`], saying what to fix.
pub(crate) fn cache_name(what: &str, name: &str) -> Result<String> {
    let chars = name.chars().count();
    if chars == 0 || chars > MAX_NAME_CHARS {
        return Err(LedgerError::Invalid(format!(
            "{what} {name:?} is {chars} characters; give 1 to {MAX_NAME_CHARS}"
        )));
    }
    if name
        .chars()
        .any(|c| c == '/' || c == '\0' || c.is_whitespace())
    {
        return Err(LedgerError::Invalid(format!(
            "{what} {name:?} has a '/', whitespace or NUL; give a bare GitHub name"
        )));
    }
    Ok(name.to_lowercase())
}

impl CacheBlock {
    /// An organisation's block; `org` is checked as [`cache_name`] says.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`].
    pub fn org(org: &str) -> Result<Self> {
        Ok(Self::Org(cache_name("the organisation", org)?))
    }

    /// A repository's block from `OWNER/NAME`, each part checked as
    /// [`cache_name`] says.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`] without exactly one `/` or with a bad part.
    pub fn repository(full: &str) -> Result<Self> {
        let Some((owner, repository)) = full.split_once('/') else {
            return Err(LedgerError::Invalid(format!(
                "the repository {full:?} is not OWNER/NAME"
            )));
        };
        Ok(Self::Repository {
            owner: cache_name("the repository's owner", owner)?,
            repository: cache_name("the repository's name", repository)?,
        })
    }

    fn columns(&self) -> (&'static str, &str, &str) {
        match self {
            Self::Org(owner) => ("org", owner, ""),
            Self::Repository { owner, repository } => ("repository", owner, repository),
        }
    }
}

impl std::fmt::Display for CacheBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Org(owner) => write!(f, "organisation {owner}"),
            Self::Repository { owner, repository } => write!(f, "repository {owner}/{repository}"),
        }
    }
}

impl Ledger {
    /// Blocks `block` from the node-local Actions cache at `now_ms`.
    /// Returns false when it was blocked already (nothing changes).
    ///
    /// # Errors
    ///
    /// [`LedgerError::Storage`] when the ledger cannot be written.
    pub async fn block_cache(&self, block: &CacheBlock, now_ms: i64) -> Result<bool> {
        let (scope, owner, repository) = block.columns();
        let mut tx = self.begin_write().await?;
        let written = sqlx::query(
            "INSERT INTO cache_blocks (scope, owner, repository, blocked_at_ms)
             VALUES ($1, $2, $3, $4)
             ON CONFLICT (scope, owner, repository) DO NOTHING",
        )
        .bind(scope)
        .bind(owner)
        .bind(repository)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(written == 1)
    }

    /// Lifts `block`, and only it: enabling an organisation leaves its
    /// repositories' own blocks. Returns false when it was not blocked.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Storage`] when the ledger cannot be written.
    pub async fn unblock_cache(&self, block: &CacheBlock) -> Result<bool> {
        let (scope, owner, repository) = block.columns();
        let mut tx = self.begin_write().await?;
        let removed = sqlx::query(
            "DELETE FROM cache_blocks WHERE scope = $1 AND owner = $2 AND repository = $3",
        )
        .bind(scope)
        .bind(owner)
        .bind(repository)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(removed == 1)
    }

    /// Whether a node may serve `owner/repository`'s Actions cache from
    /// its local storage: neither the owner nor the repository is blocked.
    /// Names are compared without case.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Invalid`] for a name [`cache_name`] refuses;
    /// [`LedgerError::Storage`] when the ledger cannot be read (the node
    /// reads that as a denial).
    pub async fn actions_cache_allowed(&self, owner: &str, repository: &str) -> Result<bool> {
        let owner = cache_name("the owner", owner)?;
        let repository = cache_name("the repository", repository)?;
        let mut conn = self.reader.acquire().await?;
        let row = sqlx::query(
            "SELECT COUNT(*) AS blocks FROM cache_blocks
             WHERE (scope = 'org' AND owner = $1)
                OR (scope = 'repository' AND owner = $1 AND repository = $2)",
        )
        .bind(&owner)
        .bind(&repository)
        .fetch_one(&mut *conn)
        .await?;
        Ok(row.try_get::<i64, _>("blocks")? == 0)
    }

    /// Every block, in order.
    ///
    /// # Errors
    ///
    /// [`LedgerError::Storage`] when the ledger cannot be read.
    pub async fn cache_blocks(&self) -> Result<Vec<CacheBlock>> {
        let mut conn = self.reader.acquire().await?;
        let rows = sqlx::query(
            "SELECT scope, owner, repository FROM cache_blocks ORDER BY scope, owner, repository",
        )
        .fetch_all(&mut *conn)
        .await?;
        rows.iter()
            .map(|row| {
                let scope: String = row.try_get("scope")?;
                let owner: String = row.try_get("owner")?;
                let repository: String = row.try_get("repository")?;
                Ok(if scope == "org" {
                    CacheBlock::Org(owner)
                } else {
                    CacheBlock::Repository { owner, repository }
                })
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ledger::test_support::{code, on_both_backends};

    #[test]
    fn a_name_is_bounded_bare_and_lower_cased() {
        assert_eq!(cache_name("x", "Octo-Org").unwrap(), "octo-org");
        assert!(cache_name("x", &"a".repeat(100)).is_ok());
        for bad in ["", "a/b", "a b", " a", "a\0", "a\tb"] {
            assert!(
                matches!(cache_name("x", bad), Err(LedgerError::Invalid(_))),
                "{bad:?}"
            );
        }
        assert!(matches!(
            cache_name("x", &"a".repeat(101)),
            Err(LedgerError::Invalid(_))
        ));
        assert!(CacheBlock::repository("octo").is_err());
        assert!(CacheBlock::repository("octo/a/b").is_err());
        assert_eq!(
            CacheBlock::repository("Octo/Hello").unwrap(),
            CacheBlock::Repository {
                owner: "octo".into(),
                repository: "hello".into()
            }
        );
    }

    on_both_backends! {
        /// spec/cache.md §5.2: a repository is allowed iff neither its
        /// owner nor it is blocked, without case; enabling an organisation
        /// leaves a repository's own block, and enabling a repository
        /// lifts only its own.
        async fn the_kill_switch_blocks_by_organisation_or_repository(db) {
            let l = db.ledger().await;
            assert!(l.actions_cache_allowed("octo", "hello").await.unwrap());
            let repo = CacheBlock::repository("Octo/Hello").unwrap();
            assert!(l.block_cache(&repo, 1).await.unwrap());
            assert!(!l.block_cache(&repo, 2).await.unwrap(), "blocked already");
            assert!(!l.actions_cache_allowed("OCTO", "hello").await.unwrap());
            assert!(l.actions_cache_allowed("octo", "other").await.unwrap());
            let org = CacheBlock::org("octo").unwrap();
            assert!(l.block_cache(&org, 3).await.unwrap());
            assert!(!l.actions_cache_allowed("octo", "other").await.unwrap());
            assert!(l.actions_cache_allowed("someone", "hello").await.unwrap());
            assert_eq!(l.cache_blocks().await.unwrap(), vec![org.clone(), repo.clone()]);
            assert!(l.unblock_cache(&org).await.unwrap());
            assert!(l.actions_cache_allowed("octo", "other").await.unwrap());
            assert!(!l.actions_cache_allowed("octo", "hello").await.unwrap(), "its own block stays");
            assert!(l.unblock_cache(&repo).await.unwrap());
            assert!(!l.unblock_cache(&repo).await.unwrap(), "not blocked");
            assert!(l.actions_cache_allowed("octo", "hello").await.unwrap());
            assert_eq!(code(l.actions_cache_allowed("octo", "a/b").await), "invalid");
            assert_eq!(code(l.actions_cache_allowed("", "hello").await), "invalid");
        }
    }

    on_both_backends! {
        /// A ledger that cannot be read is an error, never an answer.
        async fn a_closed_ledger_answers_no_policy(db) {
            let l = db.ledger().await;
            l.close().await;
            assert_eq!(code(l.actions_cache_allowed("octo", "hello").await), "unavailable");
        }
    }
}
