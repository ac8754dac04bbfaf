//! One-time join tokens (`join_tokens`, migration 3 on both backends):
//! issued for one node, expiring, used at most once. A row keeps the
//! token's id, the SHA-256 of its secret in hex (never the secret), the
//! node, its expiry and when it was used. The hash a caller presents is
//! compared with the stored one in constant time; using a token up is one
//! `UPDATE ... WHERE used_at_ms IS NULL`, so two planes on one ledger cannot
//! both take it.
//!
//! No lease rule lives here.

use subtle::ConstantTimeEq as _;

use super::{Ledger, Result};
use crate::identity::JoinToken;

/// Why a join token is not accepted. The wire says only "refused"; the
/// plane's log names which.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TokenRefused {
    /// No token has this id, or its secret does not match.
    Unknown,
    /// It was used already.
    Used,
    /// It expired unused.
    Expired,
}

impl std::fmt::Display for TokenRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            TokenRefused::Unknown => "the join token is not one this plane issued",
            TokenRefused::Used => "the join token was used already; ask the plane for a new one",
            TokenRefused::Expired => "the join token expired; ask the plane for a new one",
        })
    }
}

impl Ledger {
    /// Records a join token for `node`, expiring at `expires_at_ms`.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when it cannot be written.
    pub(crate) async fn issue_join_token(
        &self,
        token: &JoinToken,
        node: &str,
        expires_at_ms: i64,
        now_ms: i64,
    ) -> Result<()> {
        let mut tx = self.begin_write().await?;
        sqlx::query(
            "INSERT INTO join_tokens (id, secret_sha256, node, expires_at_ms, created_at_ms)
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(&token.id)
        .bind(hex(&token.secret_sha256))
        .bind(node)
        .bind(expires_at_ms)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }

    /// The node `token` was issued for, if it is good now (known, its
    /// secret matching, unused, unexpired); changes nothing.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be read.
    pub(crate) async fn join_token_node(
        &self,
        token: &JoinToken,
        now_ms: i64,
    ) -> Result<Result<String, TokenRefused>> {
        let row: Option<(String, String, i64, Option<i64>)> = sqlx::query_as(
            "SELECT secret_sha256, node, expires_at_ms, used_at_ms FROM join_tokens WHERE id = $1",
        )
        .bind(&token.id)
        .fetch_optional(&self.reader)
        .await?;
        Ok(judge(token, row, now_ms))
    }

    /// Uses `token` up, if it is good now: answers the node it was issued
    /// for. Checked and marked used in one write transaction, so two
    /// callers presenting the same token cannot both succeed.
    ///
    /// # Errors
    ///
    /// [`super::LedgerError::Storage`] when the ledger cannot be written.
    pub(crate) async fn redeem_join_token(
        &self,
        token: &JoinToken,
        now_ms: i64,
    ) -> Result<Result<String, TokenRefused>> {
        let mut tx = self.begin_write().await?;
        let row: Option<(String, String, i64, Option<i64>)> = sqlx::query_as(
            "SELECT secret_sha256, node, expires_at_ms, used_at_ms FROM join_tokens WHERE id = $1",
        )
        .bind(&token.id)
        .fetch_optional(&mut *tx)
        .await?;
        let judged = judge(token, row, now_ms);
        if judged.is_ok() {
            let updated = sqlx::query(
                "UPDATE join_tokens SET used_at_ms = $1 WHERE id = $2 AND used_at_ms IS NULL",
            )
            .bind(now_ms)
            .bind(&token.id)
            .execute(&mut *tx)
            .await?;
            if updated.rows_affected() != 1 {
                return Ok(Err(TokenRefused::Used));
            }
        }
        tx.commit().await?;
        Ok(judged)
    }
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::new(), |mut s, b| {
        let _ = write!(s, "{b:02x}");
        s
    })
}

fn judge(
    token: &JoinToken,
    row: Option<(String, String, i64, Option<i64>)>,
    now_ms: i64,
) -> Result<String, TokenRefused> {
    let Some((hash, node, expires_at_ms, used_at_ms)) = row else {
        return Err(TokenRefused::Unknown);
    };
    if !bool::from(hash.as_bytes().ct_eq(hex(&token.secret_sha256).as_bytes())) {
        return Err(TokenRefused::Unknown);
    }
    if used_at_ms.is_some() {
        return Err(TokenRefused::Used);
    }
    if now_ms >= expires_at_ms {
        return Err(TokenRefused::Expired);
    }
    Ok(node)
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    async fn ledger() -> Ledger {
        Ledger::open_in_memory(Duration::from_secs(90))
            .await
            .expect("ledger")
    }

    #[tokio::test]
    async fn a_join_token_is_good_once_for_its_node_until_it_expires() {
        let l = ledger().await;
        let (text, token) = JoinToken::generate();
        l.issue_join_token(&token, "node-1", 10_000, 1_000)
            .await
            .expect("issue");
        let presented = JoinToken::parse(&text).expect("parse");
        assert_eq!(
            l.join_token_node(&presented, 2_000).await.expect("read"),
            Ok("node-1".to_owned())
        );
        // Checking does not use it up.
        assert_eq!(
            l.redeem_join_token(&presented, 2_000)
                .await
                .expect("redeem"),
            Ok("node-1".to_owned())
        );
        assert_eq!(
            l.redeem_join_token(&presented, 2_001).await.expect("again"),
            Err(TokenRefused::Used)
        );
        assert_eq!(
            l.join_token_node(&presented, 2_001).await.expect("read"),
            Err(TokenRefused::Used)
        );
    }

    #[tokio::test]
    async fn a_join_token_that_expired_or_whose_secret_differs_is_refused() {
        let l = ledger().await;
        let (text, token) = JoinToken::generate();
        l.issue_join_token(&token, "node-1", 10_000, 1_000)
            .await
            .expect("issue");
        let presented = JoinToken::parse(&text).expect("parse");
        assert_eq!(
            l.redeem_join_token(&presented, 10_000).await.expect("late"),
            Err(TokenRefused::Expired)
        );
        let wrong_secret = JoinToken::parse(&format!("{text}0")).expect("parse");
        assert_eq!(
            l.redeem_join_token(&wrong_secret, 2_000)
                .await
                .expect("wrong"),
            Err(TokenRefused::Unknown)
        );
        let (_, unknown) = JoinToken::generate();
        assert_eq!(
            l.redeem_join_token(&unknown, 2_000).await.expect("unknown"),
            Err(TokenRefused::Unknown)
        );
    }
}
